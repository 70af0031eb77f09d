"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

Candidates read the Lease every `retry_period`. The holder renews it (updates renewTime); a
candidate takes it over only when the record has not changed for `lease_duration` as measured on
the candidate's own clock since it last saw a change (never by comparing timestamps written by
another machine, so clock skew cannot make two leaders). Every write is a PUT with the
resourceVersion read, so of two candidates racing for an expired Lease exactly one wins (the other
gets a 409). A leader that cannot renew for `renew_deadline` (< `lease_duration`) steps down before
anyone else may take over; one that stops cleanly releases the Lease so the next takes over at once.

`leading` is set while this process leads; `run_while_leading` runs work only then and cancels it
the moment leadership is lost. `Follower` leads while another process of its pod holds the Lease
(the chart's extender follows the kube-scheduler in its pod), never writing it.

A candidate's identity (`identity`) begins with its pod's name and `SEPARATOR`, which no pod name
holds: the ValidatingAdmissionPolicy `sharegpu-leader` lets the extender's writes of claims through
only from the pod whose name begins the Lease's holder, so a write an old leader sent is refused if
it arrives after another took the Lease, however late.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

from sharegpu.api import paths, wire
from sharegpu.kube import client, errors, informer
from sharegpu.kube import terms as election_terms
from sharegpu.kube.terms import Terms

log = logging.getLogger(__name__)
Json = dict[str, Any]


SEPARATOR: Final = "_"
"""Between the pod's name and the rest of an identity (a pod's name is a DNS subdomain: never "_")."""


def identity(pod: str | None = None) -> str:
    """This process's identity as a candidate: `<pod>_<pid>-<4 hex>`, the pod's name being the host's
    (a pod's hostname is its name) unless given, so two processes of one pod differ too."""
    return f"{pod or socket.gethostname()}{SEPARATOR}{os.getpid()}-{secrets.token_hex(2)}"


def _micro_time() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _OnLease:
    """What an elector and a follower share: the Lease they read, its terms, the clock they measure
    them on, and `leading`, set while this process leads."""

    def __init__(
        self,
        api: client.KubeApi,
        namespace: str,
        name: str,
        terms: Terms = election_terms.TIMINGS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.terms = terms
        self.clock = clock
        self.leading = asyncio.Event()
        self.transitions = 0
        """Times this process became leader."""
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0

    @property
    def path(self) -> str:
        return paths.lease(self.namespace, self.name)

    @property
    def is_leader(self) -> bool:
        return self.leading.is_set()


class LeaderElector(_OnLease):
    """A candidate for the Lease, under `identity` (see `identity()`)."""

    def __init__(
        self,
        api: client.KubeApi,
        namespace: str,
        name: str,
        identity: str,
        terms: Terms = election_terms.TIMINGS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(api, namespace, name, terms, clock)
        self.identity = identity
        self._renewed_at = 0.0

    async def run(self) -> None:
        """Campaign and renew until cancelled; releases the Lease on the way out if it holds it."""
        try:
            while True:
                try:
                    await self._try()
                except asyncio.CancelledError:
                    raise
                except errors.KubeError as exc:
                    log.warning("leader election %s: %s", self.name, exc)
                except Exception:
                    log.exception("leader election %s: unexpected failure", self.name)
                if self.is_leader and self.clock() - self._renewed_at > self.terms.renew_deadline:
                    log.error(
                        "leader election %s: could not renew for %.0f s; stepping down",
                        self.name,
                        self.terms.renew_deadline,
                    )
                    self.leading.clear()
                await asyncio.sleep(self.terms.retry_period)
        finally:
            if self.is_leader:
                self.leading.clear()
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._release())

    async def _try(self) -> None:
        now = self.clock()
        try:
            current = await self.api.get(self.path)
        except errors.NotFoundError:
            body = self._lease(None, transitions=0, acquired=True)
            await self.api.create(paths.leases(self.namespace), body)
            self._won(now)
            return
        lease = wire.convert(current, wire.Lease)
        spec = lease.spec
        record = (spec.holder_identity, spec.renew_time, spec.acquire_time, spec.lease_duration_seconds)
        if record != self._observed:
            self._observed, self._observed_at = record, now
        holder = spec.holder_identity or ""
        duration = float(spec.lease_duration_seconds or self.terms.lease_duration)
        mine = holder == self.identity
        if not mine and holder and now - self._observed_at < duration:
            if self.is_leader:
                log.error("leader election %s: %s holds the lease; stepping down", self.name, holder)
                self.leading.clear()
            return
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        body = self._lease(current, transitions=transitions, acquired=not mine, previous=spec)
        updated = await self.api.replace(self.path, body)
        fresh = wire.convert(updated, wire.Lease).spec
        self._observed = (fresh.holder_identity, fresh.renew_time, fresh.acquire_time, fresh.lease_duration_seconds)
        self._observed_at = now
        self._won(now)

    def _won(self, now: float) -> None:
        self._renewed_at = now
        if not self.is_leader:
            self.transitions += 1
            log.info("leader election %s: %s is the leader", self.name, self.identity)
            self.leading.set()

    def _lease(
        self, current: Json | None, *, transitions: int, acquired: bool, previous: wire.LeaseSpec | None = None
    ) -> Json:
        stamp = _micro_time()
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": round(self.terms.lease_duration),
            "acquireTime": stamp if acquired or previous is None else previous.acquire_time,
            "renewTime": stamp,
            "leaseTransitions": transitions,
        }
        metadata: Json = {"name": self.name, "namespace": self.namespace}
        if current is not None:
            metadata["resourceVersion"] = current["metadata"]["resourceVersion"]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}

    async def _release(self) -> None:
        """Hand the Lease back: no holder, one-second duration, so a follower takes over at once."""
        current = await self.api.get(self.path)
        if (current.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        current["spec"].update({"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _micro_time()})
        await self.api.replace(self.path, current)
        log.info("leader election %s: %s released the lease", self.name, self.identity)


class Follower(_OnLease):
    """Leads while another process of this pod holds the Lease, never writing it: the chart's
    extender follows the kube-scheduler beside it in its pod, which elects on the same Lease (the
    `sharegpu-leader` policy reads its holder: both containers' claim writes then pass from the
    leading pod only, and the extender's reconcilers run where the scheduler that calls it leads).

    Every `retry_period` it reads the Lease. It leads while the holder's identity begins with
    `pod` and SEPARATOR (kube-scheduler's identity is `<hostname>_<uuid>`, a pod's hostname its
    name), the record has changed within its `leaseDurationSeconds` as measured on this clock (a
    holder that stopped renewing is about to be replaced), and a read succeeded within
    `renew_deadline` (one that cannot read steps down before another could take over)."""

    def __init__(
        self,
        api: client.KubeApi,
        namespace: str,
        name: str,
        pod: str,
        terms: Terms = election_terms.TIMINGS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(api, namespace, name, terms, clock)
        self.pod = pod
        self._read_at = -float("inf")

    async def run(self) -> None:
        """Follow the Lease until cancelled."""
        try:
            while True:
                try:
                    await self.observe()
                except asyncio.CancelledError:
                    raise
                except errors.KubeError as exc:
                    log.warning("following the lease %s: %s", self.name, exc)
                if self.is_leader and self.clock() - self._read_at > self.terms.renew_deadline:
                    log.error("lease %s: not read for %.0f s; stepping down", self.name, self.terms.renew_deadline)
                    self.leading.clear()
                await asyncio.sleep(self.terms.retry_period)
        finally:
            self.leading.clear()

    async def observe(self) -> None:
        """One read of the Lease, and what it says about leading."""
        now = self.clock()
        try:
            current = await self.api.get(self.path)
        except errors.NotFoundError:
            self._read_at = now
            self._set(False, "nobody holds it")
            return
        self._read_at = now
        spec = wire.convert(current, wire.Lease).spec
        record = (spec.holder_identity, spec.renew_time, spec.acquire_time, spec.lease_duration_seconds)
        if record != self._observed:
            self._observed, self._observed_at = record, now
        holder = spec.holder_identity or ""
        duration = float(spec.lease_duration_seconds or self.terms.lease_duration)
        if not holder.startswith(self.pod + SEPARATOR):
            self._set(False, f"{holder or 'nobody'} holds it")
        elif now - self._observed_at >= duration:
            self._set(False, f"{holder} stopped renewing it")
        else:
            self._set(True, f"{holder}, beside this process, holds it")

    def _set(self, leading: bool, why: str) -> None:
        if leading and not self.is_leader:
            self.transitions += 1
            log.info("lease %s: leading (%s)", self.name, why)
            self.leading.set()
        elif not leading and self.is_leader:
            log.error("lease %s: stepping down (%s)", self.name, why)
            self.leading.clear()


class Leadership(Protocol):
    """What `run_while_leading` needs: `LeaderElector`, or a stand-in that always leads."""

    leading: asyncio.Event

    @property
    def is_leader(self) -> bool: ...


class Solo:
    """Leadership without election: one replica always leads."""

    def __init__(self) -> None:
        self.leading = asyncio.Event()
        self.leading.set()

    @property
    def is_leader(self) -> bool:
        return True

    async def run(self) -> None:
        await asyncio.Event().wait()


async def run_while_leading(elector: Leadership, work: Callable[[], list[Awaitable[None]]]) -> None:
    """Run `work()`'s coroutines while `elector` leads; cancel them as soon as it stops leading."""
    while True:
        await elector.leading.wait()
        tasks = [asyncio.ensure_future(coroutine) for coroutine in work()]
        lost = asyncio.create_task(_until_lost(elector))
        try:
            await asyncio.wait([lost, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            await informer.cancel([lost, *tasks])


async def _until_lost(elector: Leadership) -> None:
    while elector.is_leader:
        await asyncio.sleep(0.05)
