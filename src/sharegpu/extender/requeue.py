"""The requeuer: asks kube-scheduler to try a pod again when room appeared after it was turned away.

kube-scheduler keeps a pod the extender turned away among its unschedulable pods until a cluster
event it watches (a pod deleted, a node changed), then tries it again. Its watches and the
extender's are separate: when the event reaches kube-scheduler first, its new try meets the
extender's cache from before the event, is turned away again, and nothing else wakes the pod for up
to five minutes. Under faults the extender's view can lag by seconds (a broken watch resumes after
a backoff), which the chaos benchmark showed: the last pods of a churn left pending with room for
them.

So when room appeared in the cache (`ClusterCache.freed_at`) after a pod's last refusal for want of
GPU room, and kube-scheduler has not tried it again within `grace` seconds, and the pod fits now on
one of the nodes kube-scheduler offered it last time (one that takes pods: a node that serves DRA
claims only does not), the pod's status gets the condition
`sharegpu.io/RoomFreed`: a change to the pod, which kube-scheduler answers by trying it again. Once
per refusal (a later refusal may be nudged again), and at most every `every` seconds per pod. A
write that failed (the API server restarting) does not count: the pod is looked at again `grace`
seconds later, and nudged if it still waits and fits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final

from sharegpu.api import names, paths, pods, wire
from sharegpu.core import errors, requests, units
from sharegpu.extender import handle as extender_handle
from sharegpu.extender import metrics as extender_metrics
from sharegpu.extender import scheduling
from sharegpu.kube import client

log = logging.getLogger(__name__)

CONDITION: Final = f"{names.DOMAIN}/RoomFreed"
"""The pod condition whose change makes kube-scheduler try the pod again."""
GRACE = 2.0
"""Seconds kube-scheduler gets to try the pod again by itself once room has appeared."""
EVERY = 30.0
"""Seconds at least between two nudges of one pod."""


def room_freed(node: str, now: str) -> dict[str, Any]:
    """The status patch saying room for the pod appeared on `node` (`CONDITION`)."""
    message = (
        f"room for this pod appeared on {node} after sharegpu turned it away; kube-scheduler is asked to try it again"
    )
    return pods.condition(CONDITION, "RoomFreed", message, now)


class Requeuer(extender_handle.Reconciler):
    def __init__(
        self,
        handle: extender_handle.Handle,
        service: scheduling.SchedulingService,
        *,
        grace: float = GRACE,
        every: float = EVERY,
        wall: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(handle)
        self.service = service
        self.grace = grace
        self.every = every
        self.wall = wall
        self.nudged: dict[units.PodKey, float] = {}
        """Pods nudged -> when (by `clock`)."""
        self.checked: dict[units.PodKey, float] = {}
        """Pods -> the `freed_at` they were last looked at for."""
        self._offered: dict[units.PodKey, tuple[float, frozenset[str]]] = {}
        """Pods -> (the refusal's time, the nodes offered then)."""
        self._failed: dict[units.PodKey, float] = {}
        """Pods whose nudge could not be written -> when (looked at again `grace` seconds later)."""

    async def run(self, tick: float = 1.0) -> None:
        while True:
            await asyncio.sleep(tick)
            try:
                await self.reconcile()
            except Exception:  # the task must not end: pods turned away would wait for the flush
                log.exception("requeue pass failed; the next pass tries again")

    def due(self) -> list[tuple[units.PodKey, str]]:
        """Pods to nudge now, each with a node it fits on. A pod is looked at once per appearance of
        room (nothing else makes room), over the fleet's cached per-shape fit, so a pass stays cheap
        with hundreds of pods waiting and thousands of nodes offered."""
        now = self.clock()
        freed = self.cache.freed_at
        if now - freed < self.grace:
            return []
        found = []
        for key, outcome in list(self.service.outcomes.items()):
            if not outcome.short or outcome.at >= freed or self.checked.get(key) == freed:
                continue  # not turned away for room, tried again since room appeared, or looked at already
            failed = self._failed.get(key)
            if failed is not None and now - failed < self.grace:
                continue  # its nudge failed just now
            last = self.nudged.get(key)
            if last is not None and (last >= outcome.at or now - last < self.every):
                continue
            self.checked[key] = freed
            record = self.cache.record(key)
            if record is None or record.node or record.deleting or record.terminal or record.request is None:
                continue
            node = self._fits(key, record.request.demand, outcome)
            if node is not None:
                found.append((key, node))
        return found

    def _fits(self, key: units.PodKey, demand: requests.GpuDemand, outcome: scheduling.Outcome) -> str | None:
        """A node kube-scheduler offered the pod that the demand fits on now (fitting is the same
        under every policy), among the nodes that take pods (not those that serve DRA claims only)."""
        offered = self._offered.get(key)
        if offered is None or offered[0] != outcome.at:
            offered = (outcome.at, frozenset(outcome.candidates))
            self._offered[key] = offered
        state = self.cache.state
        evaluation = self.cache.placer.evaluate(demand)
        usable = evaluation.feasible & self.cache.pod_rows  # every row; nodes that serve DRA claims only are out
        fitting: list[int] = evaluation.rows[usable].tolist()
        for row in fitting:
            name: str = state.names[row]
            if name in offered[1]:
                return name
        return None

    async def reconcile(self) -> None:
        for key, node in self.due():
            self.nudged[key] = self.clock()
            namespace, _, name = key.partition("/")
            try:
                await self.api.patch(
                    paths.pod_status(namespace, name),
                    room_freed(node, wire.timestamp(self.wall())),
                    content_type=client.STRATEGIC_PATCH,
                )
            except errors.SharegpuError as exc:
                self.metrics.requeues.labels(extender_metrics.RequeueOutcome.FAILED).inc()
                log.warning(
                    "pod %s: cannot ask kube-scheduler to try it again (again in %g s): %s", key, self.grace, exc
                )
                self.nudged.pop(key, None)  # not nudged: looked at again
                self.checked.pop(key, None)
                self._failed[key] = self.clock()
                continue
            self._failed.pop(key, None)
            self.metrics.requeues.labels(extender_metrics.RequeueOutcome.NUDGED).inc()
            log.info("pod %s: room appeared on %s after it was turned away; kube-scheduler asked to retry", key, node)
        live = self.service.outcomes
        for kept in (self.nudged, self.checked, self._offered, self._failed):
            for key in [k for k in kept if k not in live]:
                del kept[key]
