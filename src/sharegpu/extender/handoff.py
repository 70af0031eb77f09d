"""The hand-off reconciler: each sharing pod's ConfigMap holds what its containers must see.

For every bound pod that names a hand-off ConfigMap (the webhook set the name at admission) and
whose shared GPUs are all held by reservation pods that reported their UUIDs, the ConfigMap must
hold `api.handoff.data` for the pod's allocation (with the limits its node enforces: the isolation
modes of its Device), and be owned by the pod (so it goes when the pod
goes). This reconciler writes it, on the leader only, and only when what the API shows differs from
what it should be: it watches the hand-off ConfigMaps themselves, so a new leader after a failover,
or a restarted one, rewrites nothing that is already right.

Who gets a ConfigMap that several pods name (a copied manifest, or a forged annotation): the pod
that owns it already keeps it (its ownerReference says so, also across restarts); otherwise the
oldest claimant. Any other claimant gets nothing: a pod cannot read another pod's GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sharegpu.api import handoff, paths, pods, wire
from sharegpu.core import errors, units
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import metrics as extender_metrics
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from sharegpu.kube import reconcile as kube_reconcile

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


class HandoffReconciler:
    def __init__(
        self,
        cache: extender_cache.ClusterCache,
        holder: Callable[[str, int], pods.Record | None],
        api: client.KubeApi,
        metrics: extender_metrics.Metrics,
    ) -> None:
        self.cache = cache
        self.holder = holder
        """(node, GPU index) -> the reservation pod that may be handed out (the reservation reconciler's view)."""
        self.api = api
        self.metrics = metrics
        self.configmaps: dict[Claim, ConfigMapRecord] = {}
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
        if not record.live or alloc is None or alloc.exclusive or alloc.node != record.node:
            return None
        uuid_of: dict[int, str] = {}
        for slot in alloc.gpu_indices:
            held = self.holder(record.node, slot)
            if held is None or held.reservation is None or not held.reservation.uuid:
                return None
            uuid_of[slot] = held.reservation.uuid
        device = self.cache.devices.get(record.node)
        demanded = record.request.demand.isolation if record.request is not None else None
        enforce = handoff.Enforcement.of(device.isolation if device is not None else frozenset(), demanded)
        return handoff.data(alloc, uuid_of, enforce)

    async def reconcile(self) -> None:
        for claim, record in self.owners().items():
            data = self.desired(record)
            if data is None:
                continue
            existing = self.configmaps.get(claim)
            if existing is not None and existing.data == data and existing.owners == (record.uid,):
                continue
            await self._write(claim, record, data, existing)

    async def _write(
        self, claim: Claim, record: pods.Record, data: dict[str, str], existing: ConfigMapRecord | None
    ) -> None:
        namespace, name = claim
        pod_name = record.key.split("/", 1)[1]
        try:
            if existing is None:
                await self.api.create(
                    paths.configmaps(namespace), handoff.configmap(name, namespace, pod_name, record.uid, data)
                )
                self.metrics.handoffs.labels("created").inc()
            else:
                body: dict[str, Any] = {
                    "metadata": {
                        "resourceVersion": existing.resource_version,
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": record.uid}],
                    },
                    "data": {**dict.fromkeys(existing.data), **data},
                }
                await self.api.patch(paths.configmap(namespace, name), body)
                self.metrics.handoffs.labels("updated").inc()
        except kube_errors.ConflictError:
            return  # changed or created meanwhile: the watch shows it, the next pass decides again
        except errors.SharegpuError as exc:
            log.warning("hand-off ConfigMap %s/%s: %s", namespace, name, exc)
