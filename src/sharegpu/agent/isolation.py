"""What isolation a node offers, and what each mode enforces there: HAMi-core's library installed
(`agent.hamicore`) and proven by a probe (`agent.proof`), an MPS daemon per healthy GPU
(`agent.mps`), each proven by a probe client, and MIG as NVML reports it. `Isolation.apply` gives
the Device spec its `isolation` (the modes offered), `mps` (each daemon) and `enforcement` (per mode:
offered, memory proven, compute enforced, what was proven, why not); a failed proof is also a
Warning event on the Node, once per mode, subject and reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from sharegpu.agent import hamicore, host, mps, notices, nvml, proof, watchdog
from sharegpu.api import cdi, events, handoff, names, paths, wire
from sharegpu.api import pods as api_pods
from sharegpu.core import devices
from sharegpu.core import errors as core_errors
from sharegpu.kube import client, errors

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HamiCore:
    """Where HAMi-core's library comes from and goes, and what the operator says it enforces."""

    library: Path | None
    """The node offers hami-core while this file exists, is installed and proven; None: never."""
    directory: Path = host.HAMI_CORE_DIR
    """Where the library is installed for containers (the webhook mounts this host folder)."""
    compute: bool = False
    """The operator measured (scripts/gpu-check) that this node's HAMi-core enforces compute shares."""


def ceilings(live: Mapping[str, wire.Pod], spec: wire.DeviceSpec) -> dict[str, mps.Ceiling]:
    """GPU UUID -> what its MPS daemon lets any one client take: the largest grant of a container of
    the node's live pods that demand mps on it (its compute ceiling in percent, its memory; a grant of
    no memory limit, the GPU's), or, while no such pod is on it, the whole GPU. A tenant that drops
    its hand-off's variables gets that, not more; an honest one gets its own (the hand-off lowers it)."""
    gpus = {g.uuid: g.memory_mib for g in spec.gpus}
    largest: dict[str, tuple[int, int]] = {}
    slot_gpus = watchdog.slots(live, spec)
    for pod in live.values():
        if pod.metadata.annotations.get(names.ISOLATION) != devices.Isolation.MPS.value:
            continue
        try:
            alloc = api_pods.allocation_of(pod)
        except core_errors.InvalidInputError:
            continue
        if alloc is None or alloc.exclusive:
            continue
        for container in alloc.containers:
            for grant in container.devices:
                for uuid in slot_gpus.get(grant.index, frozenset()) & gpus.keys():
                    memory = grant.memory_mib or gpus[uuid]
                    percent, mib = largest.get(uuid, (0, 0))
                    largest[uuid] = (max(percent, handoff.percent_of([grant])), max(mib, memory))
    out = {}
    for uuid, total in gpus.items():
        percent, mib = largest.get(uuid, (100, total))
        out[uuid] = mps.Ceiling(percent=percent, memory_mib=max(1, min(mib, total)))
    return out


class Isolation:
    """The node's isolation modes, pass after pass (it remembers which failed proofs it told)."""

    def __init__(
        self,
        api: client.KubeApi,
        node: str,
        settings: HamiCore,
        warnings: notices.Notices,
        *,
        supervisor: mps.Supervisor | None = None,
        prover: proof.Prover | None = None,
    ) -> None:
        self.api = api
        self.node = node
        self.settings = settings
        self.warnings = warnings
        self.supervisor = supervisor
        """Runs one MPS control daemon per healthy GPU (MPS mode); None: no MPS on this node."""
        self.prover = prover
        """Proves each isolation mode before it is offered; None: modes are offered unproven."""
        self.announced: set[tuple[str, str, str]] = set()
        """(mode, subject, reason) of the failed proofs told in a Warning event."""
        self.node_uid = ""

    async def apply(
        self,
        spec: wire.DeviceSpec,
        gpus: list[nvml.Gpu],
        live: dict[str, wire.Pod],
        claims: Mapping[tuple[str, str], cdi.PreparedClaim] | None = None,
        *,
        assigned: Mapping[str, Collection[str]] | None = None,
    ) -> wire.DeviceSpec:
        """`spec` with the isolation modes the node offers now, what each enforces, and its MPS daemons
        (`live`: the node's pods by UID, and `claims`: the ResourceClaims prepared here, whose grants no
        probe may take memory from; `assigned`: the device plugin's GPUs of each pod, by the kubelet)."""
        promised = watchdog.promised(live, spec, claims, assigned=assigned)
        room = {g.uuid: g.memory_mib - promised.get(g.uuid, 0) for g in spec.gpus if g.healthy}
        hami = await self._hami_core(room)
        if self.supervisor is not None:
            self.supervisor.limit(ceilings(live, spec))
        mps_entry, daemons = await self._mps(room)
        mig = any(g.mig for g in gpus)
        no_mig = "" if mig else "no GPU in MIG mode"
        entries = sorted([hami, mps_entry, _entry(devices.Isolation.MIG, mig, reason=no_mig)], key=lambda e: e.mode)
        for entry in entries:
            if not entry.offered and self._failed(entry):
                await self._not_proven(entry)
        modes = [e.mode for e in entries if e.offered]
        return msgspec.structs.replace(spec, isolation=modes, mps=daemons, enforcement=entries)

    async def _hami_core(self, room: dict[str, int]) -> wire.ModeEnforcement:
        mode = devices.Isolation.HAMI_CORE
        compute = self.settings.compute
        library = self.settings.library
        if library is None:
            return _entry(mode, False, compute=compute, reason="no library configured (--hami-core-library '')")
        try:
            if not await asyncio.to_thread(hamicore.install, library, self.settings.directory):
                return _entry(mode, False, compute=compute, reason=f"no library at {library}")
        except OSError as exc:
            log.error("HAMi-core's library %s cannot be installed in %s (hami-core not offered): %s",
                      library, self.settings.directory, exc)  # fmt: skip
            return _entry(mode, False, compute=compute, reason=f"{library} cannot be installed: {exc}")
        unenforced = "" if compute else "compute shares are not enforced (docs/isolation.md)"
        if self.prover is None:
            return _entry(mode, True, compute=compute, reason=_join("not proven: probing is off", unenforced))
        found = await self.prover.hami(self.settings.directory / hamicore.LIBRARY_NAME, room)
        return _entry(
            mode, found.proven, memory=found.proven, compute=compute, subject=found.subject,
            at=found.at, reason=_join(found.reason, unenforced),
        )  # fmt: skip

    async def _mps(self, room: dict[str, int]) -> tuple[wire.ModeEnforcement, list[wire.MpsDaemon]]:
        mode = devices.Isolation.MPS
        if self.supervisor is None:
            return _entry(mode, False, compute=True, reason="no MPS daemons (the agent runs without --mps)"), []
        await self.supervisor.ensure(set(room))
        states = self.supervisor.status()
        layout = self.supervisor.layout
        prover = self.prover

        async def proven(state: mps.Status) -> proof.Proof | None:
            if prover is None or not state.linked or state.pid is None:
                return None
            return await prover.mps(state.uuid, state.pid, layout.tenant_pipe(state.uuid), room.get(state.uuid, 0))

        found = dict(zip(states, await asyncio.gather(*(proven(s) for s in states.values())), strict=True))
        if prover is not None:
            prover.forget(set(room))
        daemons = []
        problems = []
        for uuid, state in states.items():
            made = found[uuid]
            unlinked = "its control socket is not linked for tenants yet" if state.running and not state.linked else ""
            problem = state.problem or unlinked or (made.reason if made is not None and not made.proven else "")
            daemons.append(wire.MpsDaemon(uuid=uuid, running=state.running, restarts=state.restarts,
                                          problem=problem, proven=made is not None and made.proven))  # fmt: skip
            if problem:
                problems.append(f"{uuid}: {problem}")
        missing = sorted(set(room) - set(states))
        problems += [f"{uuid}: no daemon" for uuid in missing]
        running = bool(room) and not missing and all(states[u].linked for u in room)
        proofs = [found[u] for u in sorted(room) if u in found]
        every = running and prover is not None and all(p is not None and p.proven for p in proofs)
        offered = every or (running and prover is None)
        reason = "; ".join(problems) if problems else ("" if room else "no healthy GPU")
        if prover is None and offered:
            reason = "not proven: probing is off"
        subject = ", ".join(f"{uuid} {p.subject}" for uuid, p in zip(sorted(room), proofs, strict=False) if p)
        times = [p.at for p in proofs if p is not None and p.at is not None]
        return (
            _entry(mode, offered, memory=every, compute=True, subject=subject,
                   at=max(times) if every and times else None, reason=reason),
            daemons,
        )  # fmt: skip

    def _failed(self, entry: wire.ModeEnforcement) -> bool:
        """Whether a probe failed for what the entry is about (not: waiting for one, or not configured)."""
        if self.prover is None:
            return False
        if entry.mode == devices.Isolation.HAMI_CORE.value:
            known = self.prover.hami_core
            return known is not None and known.subject == entry.subject and known.state is proof.State.FAILED
        if entry.mode == devices.Isolation.MPS.value:
            return any(p.state is proof.State.FAILED for p in self.prover.daemons.values())
        return False

    async def _not_proven(self, entry: wire.ModeEnforcement) -> None:
        """A Warning event on the Node, once per (mode, subject, reason)."""
        told = (entry.mode, entry.subject, entry.reason)
        if told in self.announced:
            return
        log.warning("isolation %s not offered: %s", entry.mode, entry.reason)
        try:
            if not self.node_uid:
                self.node_uid = (await self.api.get(paths.node(self.node)))["metadata"]["uid"]
        except errors.KubeError as exc:
            log.warning("event IsolationNotProven not recorded: %s", exc)
            return
        subject = events.node(self.node, self.node_uid)
        decision = f"{entry.mode}/{entry.subject}"
        message = f"isolation {entry.mode} not offered: {entry.reason}"
        await self.warnings.warn(subject, "IsolationNotProven", message, decision)
        self.announced.add(told)


def _entry(
    mode: devices.Isolation,
    offered: bool,
    *,
    memory: bool | None = None,
    compute: bool | None = None,
    subject: str = "",
    at: float | None = None,
    reason: str = "",
) -> wire.ModeEnforcement:
    """One mode's line in the Device's `enforcement` (`memory`: proven, by default as `offered`;
    `compute`: by default what `proof.COMPUTE` says of the mode)."""
    return wire.ModeEnforcement(
        mode=mode.value,
        offered=offered,
        memory=offered if memory is None else memory,
        compute=proof.COMPUTE[mode] if compute is None else compute,
        subject=subject,
        proven_at=wire.timestamp(at) if at is not None else "",
        reason=reason,
    )


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)
