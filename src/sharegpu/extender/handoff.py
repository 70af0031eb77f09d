"""The hand-off reconciler: each sharing pod's ConfigMap holds what its containers must see.

For every bound pod that names a hand-off ConfigMap (the webhook set the name at admission) and
whose shared GPUs are all held by reservation pods that reported their UUIDs, the ConfigMap must
hold `api.handoff.data` for the pod's allocation (with the limits its node enforces: the isolation
modes of its Device), and be owned by the pod (so it goes when the pod
goes). This reconciler writes it, on the leader only, and only when what the API shows differs from
what it should be: it watches the hand-off ConfigMaps themselves, so a new leader after a failover,
or a restarted one, rewrites nothing that is already right.

Before a sharing pod is bound (`prepare`, on every replica, from the bind), its ConfigMap is made to
hold what its allocation gives it, or nothing yet while its reservations have not reported (its
containers wait for the required variable): no container can start on what someone else wrote
there first. The ConfigMaps live in the tenant's namespace; the chart's admission policy
(files/policies/handoff.yaml) lets only sharegpu write them, and this module does not rely on it:
a ConfigMap it finds that it did not write (a create answered AlreadyExists, read back: no
sharegpu label, or not owned by the pod) is replaced whole, and so is one changed after it was
right; either way an alarm is raised (a Warning event `HandoffForged` on the pod, the metric
`sharegpu_extender_handoff_writes{action="repaired"}`, an error in the log).

Who gets a ConfigMap that several pods name (a copied manifest, or a forged annotation): the pod
that owns it already keeps it (its ownerReference says so, also across restarts); otherwise the
oldest claimant. Any other claimant gets nothing: a pod cannot read another pod's GPU, and is not
bound while another live pod owns its ConfigMap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sharegpu.api import events, handoff, names, paths, pods, wire
from sharegpu.core import allocation, errors, units
from sharegpu.extender import handle as extender_handle
from sharegpu.extender import metrics as extender_metrics
from sharegpu.kube import errors as kube_errors
from sharegpu.kube import reconcile as kube_reconcile
from sharegpu.kube import takeover

log = logging.getLogger(__name__)
Claim = tuple[str, str]
"""(namespace, ConfigMap name)."""


@dataclass(frozen=True, slots=True)
class ConfigMapRecord:
    namespace: str
    name: str
    uid: str
    resource_version: str
    owners: tuple[str, ...]
    """UIDs of the Pods in its ownerReferences."""
    data: dict[str, str]


def configmap_record(obj: wire.ConfigMap, previous: ConfigMapRecord | None = None) -> ConfigMapRecord:
    meta = obj.metadata
    owners = tuple(ref.uid for ref in meta.owner_references if ref.kind == "Pod")
    return ConfigMapRecord(meta.namespace, meta.name, meta.uid, meta.resource_version, owners, dict(obj.data))


def _foreign(found: dict[str, Any], uid: str) -> bool:
    """Whether a ConfigMap read back is not one sharegpu wrote for the pod `uid`."""
    meta = found.get("metadata") or {}
    owners = [r.get("uid") for r in meta.get("ownerReferences") or [] if r.get("kind") == "Pod"]
    return (meta.get("labels") or {}).get(names.LABEL_ROLE) != names.ROLE_HANDOFF or owners != [uid]


class HandoffReconciler(extender_handle.Reconciler):
    def __init__(self, handle: extender_handle.Handle, holder: Callable[[str, int], pods.Record | None]) -> None:
        super().__init__(handle)
        self.holder = holder
        """(node, GPU index) -> the reservation pod that may be handed out (the reservation reconciler's view)."""
        self.configmaps: dict[Claim, ConfigMapRecord] = {}
        self.confirmed: dict[Claim, dict[str, str]] = {}
        """What this process last saw right (wrote, or found equal to what it should be): a change from
        it while the pod should still see the same is tampering, not a late write of ours."""
        self.loop = kube_reconcile.Loop("hand-off", self.reconcile)
        self._warned: set[tuple[Claim, units.PodKey]] = set()

    def on_configmap(self, kind: wire.EventType, record: ConfigMapRecord) -> None:
        claim = (record.namespace, record.name)
        if kind == wire.EventType.DELETED:
            self.configmaps.pop(claim, None)
        else:
            self.configmaps[claim] = record

    def wake(self) -> None:
        self.loop.wake()

    async def run(self, tick: float = 0.5, pace: float = 0.25) -> None:
        """Reconcile on every change (at most once per `pace` seconds) and at least every `tick`."""
        await self.loop.run(tick, pace)

    # ----------------------------------------------------------------- deciding

    def owners(self) -> dict[Claim, pods.Record]:
        """(namespace, ConfigMap) -> the one pod it belongs to."""
        claimants: dict[Claim, list[pods.Record]] = {}
        for key in self.cache.handoff_pods:
            record = self.cache.pods.get(key)
            if record is None or record.handoff is None or record.terminal:
                continue
            claimants.setdefault((key.split("/", 1)[0], record.handoff), []).append(record)
        chosen: dict[Claim, pods.Record] = {}
        for claim, found in claimants.items():
            existing = self.configmaps.get(claim)
            owner = next((r for r in found if existing is not None and r.uid in existing.owners), None)
            chosen[claim] = owner or min(found, key=lambda r: (r.created, r.key))
            for other in found:
                if other is not chosen[claim] and (claim, other.key) not in self._warned:
                    self._warned.add((claim, other.key))
                    log.warning("hand-off ConfigMap %s/%s is named by several pods; only %s gets it, not %s",
                                *claim, chosen[claim].key, other.key)  # fmt: skip
        return chosen

    def desired(self, record: pods.Record) -> dict[str, str] | None:
        """The ConfigMap data `record` should see now, or None while something is not known yet."""
        alloc = record.allocation
        if not record.live or alloc is None or alloc.node != record.node:
            return None
        return self.data_for(record, alloc)

    def data_for(self, record: pods.Record, alloc: allocation.Allocation) -> dict[str, str] | None:
        """The data a pod's containers see with `alloc`: None while a GPU's reservation has not
        reported its UUID (or the allocation hands nothing off: whole GPUs)."""
        if alloc.exclusive:
            return None
        uuid_of: dict[int, str] = {}
        for slot in alloc.gpu_indices:
            held = self.holder(alloc.node, slot)
            if held is None or held.reservation is None or not held.reservation.uuid:
                return None
            uuid_of[slot] = held.reservation.uuid
        device = self.cache.devices.get(alloc.node)
        demanded = record.request.demand.isolation if record.request is not None else None
        enforce = handoff.Enforcement.of(device.isolation if device is not None else frozenset(), demanded)
        return handoff.data(alloc, uuid_of, enforce)

    async def reconcile(self) -> None:
        await self.recorder.retell()
        for claim, record in self.owners().items():
            data = self.desired(record)
            if data is None:
                continue
            existing = self.configmaps.get(claim)
            if existing is not None and existing.data == data and existing.owners == (record.uid,):
                self.confirmed[claim] = data
                continue
            if existing is not None and self.confirmed.get(claim) == data:
                await self._alarm(claim, record, "was changed after sharegpu wrote it")
            await self._write(claim, record, data, existing)
        live = set(self.configmaps) | {(r.key.split("/", 1)[0], r.handoff) for r in self.owners().values()}
        for claim in self.confirmed.keys() - live:
            del self.confirmed[claim]

    # ----------------------------------------------------------------- before binding

    async def prepare(self, record: pods.Record, alloc: allocation.Allocation) -> str | None:
        """Make a sharing pod's hand-off hold what `alloc` gives it (or nothing yet), before it is
        bound; None when done, else why it must not be bound now."""
        if record.handoff is None or alloc.exclusive:
            return None
        namespace, pod_name = record.key.split("/", 1)
        claim = (namespace, record.handoff)
        existing = self.configmaps.get(claim)
        if existing is not None and record.uid not in existing.owners:
            others = [r for r in self.owners().values() if r.uid in existing.owners and r.key != record.key]
            if others:
                return (f"hand-off ConfigMap {namespace}/{record.handoff} belongs to pod {others[0].key}: "
                        "this pod would see its GPU")  # fmt: skip
        data = self.data_for(record, alloc) or {}
        if existing is not None and existing.data == data and existing.owners == (record.uid,):
            return None
        if not await self._write(claim, record, data, existing):
            return f"hand-off ConfigMap {namespace}/{record.handoff} of pod {pod_name} could not be written yet"
        return None

    # ----------------------------------------------------------------- writes

    async def _write(
        self, claim: Claim, record: pods.Record, data: dict[str, str], existing: ConfigMapRecord | None
    ) -> bool:
        """Write `data` into the pod's ConfigMap; whether it holds it now."""
        namespace, name = claim
        pod_name = record.key.split("/", 1)[1]
        try:
            if existing is not None and existing.owners != (record.uid,):
                return await self._take_back(claim, record, data)  # labelled, but not this pod's
            if existing is None:
                try:
                    await self.api.create(
                        paths.configmaps(namespace), handoff.configmap(name, namespace, pod_name, record.uid, data)
                    )
                    self.metrics.handoffs.labels(extender_metrics.HandoffAction.CREATED).inc()
                except kube_errors.ConflictError as exc:
                    if not exc.already_exists:
                        raise
                    return await self._take_back(claim, record, data)
            else:
                body: dict[str, Any] = {
                    "metadata": {
                        "resourceVersion": existing.resource_version,
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": record.uid}],
                    },
                    "data": {**dict.fromkeys(existing.data), **data},
                }
                await self.api.patch(paths.configmap(namespace, name), body)
                self.metrics.handoffs.labels(extender_metrics.HandoffAction.UPDATED).inc()
        except kube_errors.ConflictError:
            return False  # changed meanwhile: the watch shows it, the next pass decides again
        except errors.SharegpuError as exc:
            log.warning("hand-off ConfigMap %s/%s: %s", namespace, name, exc)
            return False
        self.confirmed[claim] = data
        return True

    async def _take_back(self, claim: Claim, record: pods.Record, data: dict[str, str]) -> bool:
        """A create answered AlreadyExists, or the watch shows the ConfigMap owned by another: read it
        back; one sharegpu did not write for this pod is replaced whole (labels, owner, data; an
        immutable one deleted and made again), with an alarm. Errors go to the caller."""
        namespace, name = claim
        path = paths.configmap(namespace, name)
        found = await self.api.get(path)
        owner = await self._live_owner(namespace, found, record.uid)
        if owner is not None:  # sharegpu's hand-off of a live pod the watch had not shown yet: not ours to take
            log.warning("pod %s: hand-off ConfigMap %s/%s belongs to pod %s; not taken", record.key, namespace,
                        name, owner)  # fmt: skip
            return False
        if not _foreign(found, record.uid) and not found.get("immutable"):
            current = configmap_record(wire.convert(found, wire.ConfigMap))
            self.on_configmap(wire.EventType.MODIFIED, current)  # the watch had not shown it yet
            if current.data == data:
                return True
            return await self._write(claim, record, data, current)
        await self._alarm(claim, record, "was written by someone other than sharegpu")
        body = handoff.configmap(name, namespace, record.key.split("/", 1)[1], record.uid, data)
        await takeover.overwrite(self.api, paths.configmaps(namespace), path, body, found)
        self.metrics.handoffs.labels(extender_metrics.HandoffAction.REPAIRED).inc()
        self.confirmed[claim] = data
        return True

    async def _live_owner(self, namespace: str, found: dict[str, Any], uid: str) -> str | None:
        """The pod (its name) other than `uid` that a hand-off sharegpu wrote belongs to, while that
        pod exists with that UID and has not ended: a ConfigMap it still reads is never handed to
        another pod that names it (a tenant's pod copying another's hand-off annotation)."""
        meta = found.get("metadata") or {}
        if (meta.get("labels") or {}).get(names.LABEL_ROLE) != names.ROLE_HANDOFF:
            return None
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") != "Pod" or ref.get("uid") in (None, uid):
                continue
            try:
                pod = wire.convert(await self.api.get(paths.pod(namespace, str(ref.get("name")))), wire.Pod)
            except kube_errors.NotFoundError:
                continue
            if pod.metadata.uid == ref.get("uid") and not pods.is_terminal(pod):
                return f"{namespace}/{pod.metadata.name}"
        return None

    async def _alarm(self, claim: Claim, record: pods.Record, what: str) -> None:
        namespace, name = claim
        message = (f"hand-off ConfigMap {name} {what}; sharegpu replaces it with what the pod's allocation "
                   "gives it (check who can write ConfigMaps here, and that the admission policy "
                   "sharegpu-handoff is installed)")  # fmt: skip
        log.error("pod %s: %s", record.key, message)
        subject = events.pod(namespace, record.key.split("/", 1)[1], record.uid)
        await self.recorder.tell(subject, handoff.FORGED_REASON, message, decision=f"{name}:{what}", kind="Warning")
