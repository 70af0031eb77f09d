"""The reservation reconciler: exactly one live reservation pod per shared GPU, and none elsewhere.

A physical GPU that pods share is held by one reservation pod (namespace of the system,
`nvidia.com/gpu: 1`, created with nodeName) so that the NVIDIA device plugin gives it to nobody
else; the pod reports the GPU's UUID, which the hand-off reconciler passes on to the sharers. This
reconciler is the only writer of reservation pods and runs on the leader only, so no two replicas
ever decide about the same GPU. Each pass compares what the ledger says is shared (assumed pods
included: the reservation is on its way while the bind is written) with the reservation pods the
watch shows, and:

- creates a reservation for a shared GPU that has none (with exponential backoff per GPU, 0.5 s
  doubling to 60 s, reset once a reservation reports its UUID: a device plugin that cannot admit it
  must not cause churn);
- deletes reservations that ended (failed, or evicted) so they can be replaced;
- deletes duplicates (keeping the one that reported a UUID, then the oldest);
- deletes a reservation whose GPU has had no sharer for `idle` seconds (`retiring` from the moment
  of the decision: the hand-off reconciler no longer gives it to anyone), conditionally on its UID,
  the GPU's sharers looked at again at that moment (a pod may have been bound to it while the pass
  awaited another write); a node the fleet does not count now (cordoned, not Ready, its Device gone
  or unreadable) keeps its reservations, since its sharers may still run there.

Reservations this process created but the watch has not shown yet are remembered (`pending`), so a
pass never creates a second one for the same GPU.

Writes whose answer was lost (`kube.errors.outcome` UNKNOWN) count as done until read back: a
creation is pending like one that succeeded (the watch shows the pod, or a read `settle` seconds
later finds it missing and the GPU gets a new one, its backoff applying); a deletion leaves the
pod retiring, never handed out, and is sent again (conditionally on the UID, so it cannot touch a
pod made since) if the pod is still there and not being deleted `settle` seconds later.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

from sharegpu.api import names, paths, pods
from sharegpu.core import errors, units
from sharegpu.extender import handle as extender_handle
from sharegpu.extender import metrics as extender_metrics
from sharegpu.kube import errors as kube_errors
from sharegpu.kube import reconcile as kube_reconcile

log = logging.getLogger(__name__)
Slot = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Backoff:
    attempts: int
    not_before: float


class ReservationReconciler(extender_handle.Reconciler):
    def __init__(
        self,
        handle: extender_handle.Handle,
        *,
        image: str = "sharegpu:latest",
        idle: float = 3.0,
        pending_timeout: float = 30.0,
        settle: float = 3.0,
    ) -> None:
        super().__init__(handle)
        self.image = image
        self.idle = idle
        self.pending_timeout = pending_timeout
        self.settle = settle
        self.retiring: set[units.PodKey] = set()
        self.pending: dict[Slot, tuple[str, float]] = {}
        """Created by us, not yet seen: GPU -> (pod name, when)."""
        self.unsure: set[Slot] = set()
        """Pending creations whose answer was lost (read back after `settle`)."""
        self.deleting: dict[units.PodKey, tuple[extender_metrics.ReservationAction, float]] = {}
        """Deletions whose answer was lost: pod -> (why, when sent)."""
        self.backoff: dict[Slot, Backoff] = {}
        self.idle_since: dict[Slot, float] = {}
        self.loop = kube_reconcile.Loop("reservations", self.reconcile)

    # ----------------------------------------------------------------- what the hand-off reads

    def holder(self, node: str, slot: int) -> pods.Record | None:
        """The reservation pod holding (node, slot) that may be handed to sharers, if any."""
        found = [
            r for r in self.cache.live_reservations()
            if r.reservation is not None and (r.reservation.node, r.reservation.index) == (node, slot)
            and r.key not in self.retiring
        ]  # fmt: skip
        return _keeper(found) if found else None

    # ----------------------------------------------------------------- the loop

    def wake(self) -> None:
        self.loop.wake()

    async def run(self, tick: float = 0.5, pace: float = 0.25) -> None:
        """Reconcile on every change (at most once per `pace` seconds) and at least every `tick`."""
        await self.loop.run(tick, pace)

    async def reconcile(self) -> None:
        now = self.clock()
        by_slot: dict[Slot, list[pods.Record]] = {}
        self.retiring &= set(self.cache.reservations)
        for key in self.deleting.keys() - self.retiring:
            del self.deleting[key]
        for record in list(self.cache.reservations.values()):
            slot = record.reservation
            unsure = self.deleting.get(record.key)
            if unsure is not None and not record.deleting and now - unsure[1] >= self.settle:
                await self._delete(record, unsure[0], now)  # the lost deletion did not happen: again
            if slot is None or record.deleting or record.key in self.retiring:
                continue
            if record.terminal:
                await self._delete(record, extender_metrics.ReservationAction.DELETED_ENDED, now)
                continue
            by_slot.setdefault((slot.node, slot.index), []).append(record)
        seen = {key.split("/", 1)[1] for key in self.cache.reservations}
        for where in list(self.pending):
            name, since = self.pending[where]
            if name in seen:
                del self.pending[where]  # seen in whatever state: from now on the watch tells
                self.unsure.discard(where)
            elif (where in self.unsure and now - since >= self.settle) or now - since > self.pending_timeout:
                await self._read_back(where, name)  # not shown yet (a silent watch?): there, it stays pending
        shared = self.cache.shared_slots()
        for where, found in by_slot.items():
            keep = _keeper(found)
            for extra in found:
                if extra is not keep:
                    await self._delete(extra, extender_metrics.ReservationAction.DELETED_DUPLICATE, now)
            if keep.reservation is not None and keep.reservation.uuid:
                self.backoff.pop(where, None)
            if where in shared or self.cache.state.row(where[0]) is None:
                self.idle_since.pop(where, None)
                continue
            since = self.idle_since.setdefault(where, now)
            if now - since >= self.idle:
                if where in self.cache.shared_slots():  # bound to while this pass awaited a write
                    self.idle_since.pop(where, None)
                    continue
                await self._delete(keep, extender_metrics.ReservationAction.DELETED_IDLE, now)  # retiring at once
                self.idle_since.pop(where, None)
        for where in self.idle_since.keys() - by_slot.keys():
            del self.idle_since[where]
        for where in sorted(shared - by_slot.keys() - self.pending.keys()):
            await self._create(where, now)

    async def _create(self, where: Slot, now: float) -> None:
        backoff = self.backoff.get(where, Backoff(0, 0.0))
        if now < backoff.not_before:
            return
        self.backoff[where] = Backoff(backoff.attempts + 1, now + min(60.0, 0.5 * 2**backoff.attempts))
        node, slot = where
        name = names.reservation_name(node, slot, secrets.token_hex(3))
        try:
            await self.api.create(paths.pods(names.HOLDING_NAMESPACE), reservation_pod(name, node, slot, self.image))
        except errors.SharegpuError as exc:
            if kube_errors.outcome(exc) is kube_errors.Outcome.REFUSED:
                log.warning("creating the reservation of %s/gpu%d failed: %s", node, slot, exc)
                return
            log.warning("creating the reservation %s of %s/gpu%d: outcome unknown (%s); pending until read back",
                        name, node, slot, exc)  # fmt: skip
            self.unsure.add(where)
        self.pending[where] = (name, now)
        self.metrics.reservations.labels(extender_metrics.ReservationAction.CREATED).inc()
        if backoff.attempts:
            log.warning("GPU %d of %s lost its reservation pod; created %s", slot, node, name)

    async def _read_back(self, where: Slot, name: str) -> None:
        """A creation whose answer was lost, or that the watch has not shown for `pending_timeout`
        seconds: read it; gone, the GPU gets a new reservation (its backoff applying); there, it
        stays pending (read again `pending_timeout` seconds later) and no second one is made."""
        try:
            await self.api.get(paths.pod(names.HOLDING_NAMESPACE, name))
        except kube_errors.NotFoundError:
            del self.pending[where]
            self.unsure.discard(where)
            log.warning("the reservation %s of %s/gpu%d was not created after all", name, *where)
        except errors.SharegpuError as exc:
            log.warning("reading back the reservation %s: %s", name, exc)
        else:
            self.unsure.discard(where)  # it exists: the watch will show it
            self.pending[where] = (name, self.clock())

    async def _delete(self, record: pods.Record, why: extender_metrics.ReservationAction, now: float) -> None:
        namespace, name = record.key.split("/", 1)
        self.retiring.add(record.key)
        self.deleting.pop(record.key, None)
        try:
            await self.api.delete(paths.pod(namespace, name), preconditions={"uid": record.uid})
        except errors.SharegpuError as exc:
            if kube_errors.outcome(exc) is kube_errors.Outcome.UNKNOWN:
                self.deleting[record.key] = (why, now)  # still retiring: handed to nobody
                log.warning("deleting reservation %s (%s): outcome unknown (%s)", record.key, why, exc)
                return
            self.retiring.discard(record.key)
            log.warning("deleting reservation %s (%s) failed: %s", record.key, why, exc)
            return
        self.metrics.reservations.labels(why).inc()


def _keeper(found: list[pods.Record]) -> pods.Record:
    """Of several reservations for one GPU, the one to keep: reported a UUID first, then the oldest."""
    return min(found, key=lambda r: (r.reservation is None or not r.reservation.uuid, r.created, r.key))


def reservation_pod(name: str, node: str, slot: int, image: str) -> dict[str, Any]:
    """The reservation pod that holds GPU `slot` of `node` and reports its UUID (`sharegpu reserve`).

    It requests the GPU only, no CPU or memory (its small limits stay): it is created after its
    sharers were placed, and nothing placed them with room for it. A request would make
    kube-scheduler see less room on the node than the extender and the simulator do (it counts
    every bound pod; the ledger leaves reservations out), and could get it refused by the kubelet
    on a node whose CPU or memory its sharers filled."""
    container = pods.reserve_container(image, 1)
    container["resources"]["requests"] = {names.NVIDIA_GPU: "1", "cpu": "0", "memory": "0"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": names.HOLDING_NAMESPACE,
            "labels": {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: node, names.LABEL_SLOT: str(slot)},
        },
        "spec": {
            "nodeName": node,
            "serviceAccountName": names.RESERVE_ACCOUNT,
            "priorityClassName": "system-node-critical",
            "tolerations": [{"operator": "Exists"}],
            "terminationGracePeriodSeconds": 5,
            "containers": [container],
        },
    }
