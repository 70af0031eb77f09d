"""Preemption by the extender: a GPU pod that fits nowhere is nominated where the fewest
lower-priority pods must go, their GPUs are kept from everyone else while they leave, the victims are
marked and deleted (again if a deletion is lost), and the pod gets the GPUs they freed; nothing is
over-committed on the way. Pods that may not preempt (policy Never, equal priority) do not. A gang
goes whole or not at all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sharegpu.api import names, paths, pods
from sharegpu.core import units
from sharegpu.extender import runtime
from sharegpu.kube import client
from tests.extender.conftest import Harness, gpu_pod, settle

Json = dict[str, Any]


def pod(name: str, milli: int, priority: int = 0, **spec: Any) -> Json:
    return gpu_pod(name, milli=milli, spec={"priority": priority, **spec})


def stored(h: Harness, name: str) -> Json:
    found = h.server.get_object(paths.pod("ns", name))
    assert found is not None, name
    return found


def reasons(h: Harness, name: str) -> list[str]:
    return sorted(e["reason"] for e in h.server.list_objects(paths.events("ns")) if e["involvedObject"]["name"] == name)


def overcommitted(h: Harness) -> bool:
    state = h.extender.cache.state
    return bool((state.milli_free < 0).any() or h.extender.cache.ledger.overcommitted())


async def low_pair(h: Harness) -> None:
    for name in ("low1", "low2"):
        await h.schedule(await h.create(pod(name, 400)))


async def test_a_high_priority_pod_preempts_the_fewest_and_gets_their_gpu(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await low_pair(h)
    high = await h.create(pod("high", 600, priority=100))
    verdict = h.extender.scheduling.filter(h.args(high))
    assert verdict.node_names == []
    assert "preempting 1 lower-priority pod here" in verdict.failed_nodes["n0"]
    preemptor = h.extender.preemptor
    assert preemptor is not None
    await preemptor.reconcile()
    await settle(h.server)
    victim, kept = stored(h, "low2"), stored(h, "low1")
    assert victim["metadata"].get("deletionTimestamp"), "the newer of two equals goes"
    assert not kept["metadata"].get("deletionTimestamp"), "one is enough"
    (condition,) = [c for c in victim["status"]["conditions"] if c["type"] == pods.DISRUPTION_TARGET]
    assert condition["reason"] == pods.PREEMPTED and "ns/high" in condition["message"]
    assert reasons(h, "low2") == ["Preempted"] and reasons(h, "high") == ["Preempting"]
    assert stored(h, "high")["status"]["nominatedNodeName"] == "n0"

    sneak = await h.create(pod("sneak", 100))
    refused = h.extender.scheduling.filter(h.args(sneak))
    assert refused.node_names == [] and "preemption" in refused.failed_nodes["n0"], "the GPU is kept for high"
    waiting = h.extender.scheduling.filter(h.args(high))
    assert "waiting for 1 preempted pod to leave n0" in waiting.failed_nodes["n0"]
    assert not overcommitted(h)
    (shown,) = preemptor.describe()
    assert shown["pod"] == "ns/high" and shown["gpus"] == [0] and shown["waiting_for"] == ["ns/low2"]

    h.server.finish_deletions()  # the kubelet stops the victim
    await settle(h.server)
    await preemptor.reconcile()
    await settle(h.server)
    assert preemptor.nominations == {} and not h.extender.cache.state.held.any()
    assert not stored(h, "high")["status"].get("nominatedNodeName"), "cleared: kube-scheduler tries it again"
    assert h.extender.scheduling.filter(h.args(sneak)).node_names == [], "assumed for high at once"
    assert await h.schedule(high) == "n0"
    assert not overcommitted(h)
    assert int(h.extender.cache.state.milli_free[0, 0]) == 0
    assert h.extender.scheduling.filter(h.args(sneak)).node_names == []
    assert h.extender.metrics.preemptions.labels("nominated")._value.get() == 1


async def test_pods_that_may_not_preempt_do_not(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await low_pair(h)
    never = await h.create(pod("never", 600, priority=100, preemptionPolicy="Never"))
    equal = await h.create(pod("equal", 600, priority=0))
    for body in (never, equal):
        verdict = h.extender.scheduling.filter(h.args(body))
        assert verdict.node_names == [] and "preempting" not in verdict.failed_nodes["n0"]
    assert h.extender.preemptor is not None and h.extender.preemptor.nominations == {}
    assert all(not stored(h, n)["metadata"].get("deletionTimestamp") for n in ("low1", "low2"))


async def test_a_lost_deletion_is_sent_again(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await low_pair(h)
    high = await h.create(pod("high", 900, priority=100))
    preemptor = h.extender.preemptor
    assert preemptor is not None
    h.server.fail(503, method="DELETE", path=paths.pod("ns", "low1"))
    h.server.lose(method="DELETE", path=paths.pod("ns", "low2"), after_commit=False)
    h.server.fail(409, method="POST", path=paths.events("ns"), times=3)  # no event written, no deletion sent
    assert "preempting 2 lower-priority pods here" in h.extender.scheduling.filter(h.args(high)).failed_nodes["n0"]
    await preemptor.reconcile()
    await settle(h.server)
    assert not any(stored(h, n)["metadata"].get("deletionTimestamp") for n in ("low1", "low2"))
    assert reasons(h, "low1") == [] and reasons(h, "low2") == [], "the events were refused"
    h.clock.advance(preemptor.retry)
    await preemptor.reconcile()
    await settle(h.server)
    assert reasons(h, "low1") == ["Preempted"] and reasons(h, "low2") == ["Preempted"]
    assert not any(stored(h, n)["metadata"].get("deletionTimestamp") for n in ("low1", "low2")), "lost and 503"
    await preemptor.reconcile()
    assert not any(stored(h, n)["metadata"].get("deletionTimestamp") for n in ("low1", "low2")), "not before retry"
    h.clock.advance(preemptor.retry)
    await preemptor.reconcile()
    await settle(h.server)
    assert all(stored(h, n)["metadata"].get("deletionTimestamp") for n in ("low1", "low2"))
    assert reasons(h, "low1") == ["Preempted"], "told once"
    h.server.finish_deletions()
    await settle(h.server)
    assert await h.schedule(high) == "n0"
    assert not overcommitted(h)


async def test_a_nomination_ends_with_its_pod(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await low_pair(h)
    high = await h.create(pod("high", 600, priority=100))
    h.extender.scheduling.filter(h.args(high))
    preemptor = h.extender.preemptor
    assert preemptor is not None and units.PodKey("ns/high") in preemptor.nominations
    await client.KubeClient(h.server).delete(paths.pod("ns", "high"), grace_period=0)
    await settle(h.server)
    await preemptor.reconcile()
    assert preemptor.nominations == {} and not h.extender.cache.state.held.any()
    assert await h.schedule(await h.create(pod("other", 200))) == "n0", "the room is anyone's again"


async def test_a_restarted_extender_waits_for_the_victims_instead_of_preempting_more(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await low_pair(h)
    high = await h.create(pod("high", 600, priority=100))
    h.extender.scheduling.filter(h.args(high))
    assert h.extender.preemptor is not None
    await h.extender.preemptor.reconcile()
    await settle(h.server)
    assert stored(h, "low2")["metadata"].get("deletionTimestamp")
    await h.extender.stop()

    fresh = runtime.Extender(
        client.KubeClient(h.server), runtime.Options(leader_elect=False, reservation_idle=0.0, pace=0.01), clock=h.clock
    )
    await fresh.start()
    try:
        again = Harness(h.server, fresh, h.clock)
        verdict = fresh.scheduling.filter(again.args(high))
        assert "waiting for 1 pod leaving" in verdict.failed_nodes["n0"]
        assert fresh.preemptor is not None
        await fresh.preemptor.reconcile()
        await settle(h.server)
        assert not stored(h, "low1")["metadata"].get("deletionTimestamp"), "nothing more is preempted"
        h.server.finish_deletions()
        await settle(h.server)
        assert await again.schedule(high) == "n0"
        assert not overcommitted(again)
    finally:
        await fresh.stop()


async def test_a_gang_is_preempted_whole_wherever_its_members_run(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2, gpus=1)
    gang = {names.GANG: "job", names.GANG_MIN: "1"}
    for name in ("a", "b"):  # one whole GPU each: one on each node
        await h.schedule(await h.create(gpu_pod(name, milli=None, count=1, annotations=gang, spec={"priority": 0})))
    assert {stored(h, n)["spec"]["nodeName"] for n in "ab"} == {"n0", "n1"}
    high = await h.create(pod("high", 600, priority=100))
    verdict = h.extender.scheduling.filter(h.args(high))
    assert "preempting 2 lower-priority pods" in " ".join(verdict.failed_nodes.values()), verdict.failed_nodes
    preemptor = h.extender.preemptor
    assert preemptor is not None
    await preemptor.reconcile()
    await settle(h.server)
    assert all(stored(h, n)["metadata"].get("deletionTimestamp") for n in "ab"), "the member and its gang go"
    (nomination,) = preemptor.nominations.values()
    elsewhere = next(n for n in "ab" if stored(h, n)["spec"]["nodeName"] != nomination.plan.node)
    (condition,) = [c for c in stored(h, elsewhere)["status"]["conditions"] if c["type"] == pods.DISRUPTION_TARGET]
    assert "preempted with its gang ns/job by ns/high" in condition["message"]
    h.server.finish_deletions()
    await settle(h.server)
    await preemptor.reconcile()
    assert await h.schedule(high) == nomination.plan.node and not overcommitted(h)


async def test_a_gang_with_a_member_that_outranks_the_pod_is_not_preempted(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2, gpus=1)
    gang = {names.GANG: "job", names.GANG_MIN: "1"}
    for name, priority in (("a", 0), ("b", 200)):
        body = gpu_pod(name, milli=None, count=1, annotations=gang, spec={"priority": priority})
        await h.schedule(await h.create(body))
    high = await h.create(pod("high", 600, priority=100))
    verdict = h.extender.scheduling.filter(h.args(high))
    assert verdict.node_names == [] and "preempting" not in " ".join(verdict.failed_nodes.values())
    assert not any(stored(h, n)["metadata"].get("deletionTimestamp") for n in "ab"), "a alone would leave b partial"
