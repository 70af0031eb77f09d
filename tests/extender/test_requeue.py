"""The requeuer: a pod turned away for want of room, when room appears on a node it was offered and
kube-scheduler has not tried it again, gets a status condition that makes kube-scheduler try it
again; not before the grace, not twice for one refusal, and not when it still does not fit (room on
a node that serves DRA claims only does not count)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sharegpu.api import paths
from sharegpu.extender import requeue
from sharegpu.kube import client
from tests.extender.conftest import Harness, gpu_pod, settle

Json = dict[str, Any]


def conditions(h: Harness, name: str) -> list[Json]:
    pod = h.server.get_object(paths.pod("ns", name))
    assert pod is not None
    return [c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == requeue.CONDITION]


def nudges(h: Harness) -> float:
    value: float = h.extender.metrics.requeues.labels("nudged")._value.get()
    return value


async def turned_away(h: Harness, holder_milli: int, waiting_milli: int) -> None:
    await h.schedule(await h.create(gpu_pod("holder", milli=holder_milli)))
    waiting = await h.create(gpu_pod("waiting", milli=waiting_milli))
    assert h.extender.scheduling.filter(h.args(waiting)).node_names == []


async def free_holder(h: Harness) -> None:
    await client.KubeClient(h.server).delete(paths.pod("ns", "holder"), grace_period=0)
    await settle(h.server)


async def test_room_after_a_refusal_asks_kube_scheduler_to_try_again_once(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await turned_away(h, 800, 500)
    requeuer = h.extender.requeuer
    await requeuer.reconcile()
    assert conditions(h, "waiting") == [], "no room yet"
    h.clock.advance(1)
    await free_holder(h)
    await requeuer.reconcile()
    assert conditions(h, "waiting") == [], "kube-scheduler gets the grace to try it by itself"
    h.clock.advance(requeue.GRACE)
    await requeuer.reconcile()
    await settle(h.server)
    (condition,) = conditions(h, "waiting")
    assert condition["status"] == "True" and "n0" in condition["message"]
    h.clock.advance(requeue.GRACE)
    await requeuer.reconcile()
    assert nudges(h) == 1, "once per refusal"


async def test_no_nudge_when_the_room_is_too_small(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await h.schedule(await h.create(gpu_pod("big", milli=700)))
    await turned_away(h, 200, 900)  # the holder's 200 freed still leaves 300
    h.clock.advance(1)
    await free_holder(h)
    h.clock.advance(requeue.GRACE)
    await h.extender.requeuer.reconcile()
    assert conditions(h, "waiting") == [] and nudges(h) == 0


async def test_room_on_a_node_that_serves_dra_claims_only_is_no_reason_to_nudge(harness: Callable[..., Any]) -> None:
    """A chaos run showed the requeuer nudging pods every 30 s toward a DRA node whose GPUs were free:
    kube-scheduler tried them again and the filter turned them away again, the node being the
    allocator's only."""
    h: Harness = await harness(nodes=1, gpus=1, dra=1)
    await h.schedule(await h.create(gpu_pod("big", milli=600)), ["n0"])
    await turned_away(h, 200, 500)  # offered n0 and d0; d0's GPU is free but takes no pod
    h.clock.advance(1)
    await free_holder(h)  # room appears on n0: 400, too little
    h.clock.advance(requeue.GRACE)
    await h.extender.requeuer.reconcile()
    assert conditions(h, "waiting") == [] and nudges(h) == 0


async def test_a_nudge_that_could_not_be_written_is_sent_again(harness: Callable[..., Any]) -> None:
    """The API server refusing the condition's write (restarting) must not cost the pod its nudge:
    nothing else would wake it before kube-scheduler's five-minute flush."""
    h: Harness = await harness(nodes=1, gpus=1)
    await turned_away(h, 800, 500)
    requeuer = h.extender.requeuer
    h.clock.advance(1)
    await free_holder(h)
    h.clock.advance(requeue.GRACE)
    h.server.fail(503, method="PATCH", path=paths.pod_status("ns", "waiting"), times=2)
    await requeuer.reconcile()
    assert conditions(h, "waiting") == [] and nudges(h) == 0
    await requeuer.reconcile()
    assert h.extender.metrics.requeues.labels("failed")._value.get() == 1, "not again before the grace"
    h.clock.advance(requeue.GRACE)
    await requeuer.reconcile()  # refused again
    h.clock.advance(requeue.GRACE)
    await requeuer.reconcile()
    await settle(h.server)
    (condition,) = conditions(h, "waiting")
    assert condition["status"] == "True" and nudges(h) == 1
    h.clock.advance(requeue.EVERY)
    await requeuer.reconcile()
    assert nudges(h) == 1, "once written, once per refusal"
