"""Preemption by the extender: a GPU pod that fits nowhere is nominated where the fewest
lower-priority pods must go, their GPUs are kept from everyone else while they leave, the victims are
marked and deleted (again if a deletion is lost), and the pod gets the GPUs they freed; nothing is
over-committed on the way. Pods that may not preempt (policy Never, equal priority) do not. A gang
goes whole or not at all, and a gang that fits nowhere preempts for all its members at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sharegpu.api import extender as api_extender
from sharegpu.api import names, paths, pods
from sharegpu.core import gangs as core_gangs
from sharegpu.core import status, units
from sharegpu.extender import runtime
from sharegpu.extender.preemption import Preemptor
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


async def preempting_with_a_status_refused(h: Harness, refused: str) -> Preemptor:
    """`high` (600, priority 100) preempts one of the low pair, the first write to `refused`'s status
    answered 503; after one pass."""
    await low_pair(h)
    high = await h.create(pod("high", 600, priority=100))
    preemptor = h.extender.preemptor
    assert preemptor is not None
    h.server.fail(503, method="PATCH", path=paths.pod_status("ns", refused))
    h.extender.scheduling.filter(h.args(high))
    await preemptor.reconcile()
    await settle(h.server)
    return preemptor


async def test_a_victim_that_could_not_be_marked_is_not_deleted_until_it_is(harness: Callable[..., Any]) -> None:
    """As kube-scheduler: no DisruptionTarget condition, no deletion (a Job's pod failure policy
    reads the condition to tell a preemption from a failure)."""
    h: Harness = await harness(nodes=1, gpus=1)
    preemptor = await preempting_with_a_status_refused(h, "low2")
    victim = stored(h, "low2")
    assert not victim["metadata"].get("deletionTimestamp") and reasons(h, "low2") == [], "not marked: not deleted"
    assert h.extender.metrics.preempted_deletions.labels("untold")._value.get() == 1
    h.clock.advance(preemptor.retry)
    await preemptor.reconcile()
    await settle(h.server)
    victim = stored(h, "low2")
    assert [c["reason"] for c in victim["status"]["conditions"] if c["type"] == pods.DISRUPTION_TARGET] == [
        pods.PREEMPTED
    ]
    assert victim["metadata"].get("deletionTimestamp") and reasons(h, "low2") == ["Preempted"]


async def test_a_nominated_node_that_could_not_be_written_is_written_again(harness: Callable[..., Any]) -> None:
    """The event written but not the nominated node: kube-scheduler would not see the node taken,
    and the later nudge (clearing a field never set) would change nothing."""
    h: Harness = await harness(nodes=1, gpus=1)
    preemptor = await preempting_with_a_status_refused(h, "high")
    assert not h.server.faults, "the nominated node was refused once"
    await preemptor.reconcile()
    await settle(h.server)
    assert stored(h, "high")["status"]["nominatedNodeName"] == "n0" and reasons(h, "high") == ["Preempting"]


async def test_a_nudge_that_could_not_be_written_is_written_again(harness: Callable[..., Any]) -> None:
    """Found by bench/chaos.py: the victims have gone and the pod's nominated node cannot be cleared
    (the API server restarting); nothing else would make kube-scheduler try it again soon."""
    h: Harness = await harness(nodes=1, gpus=1)
    await low_pair(h)
    high = await h.create(pod("high", 900, priority=100))
    preemptor = h.extender.preemptor
    assert preemptor is not None
    h.extender.scheduling.filter(h.args(high))
    await preemptor.reconcile()
    await settle(h.server)
    assert stored(h, "high")["status"]["nominatedNodeName"] == "n0"
    h.server.fail(503, method="PATCH", path=paths.pod_status("ns", "high"), times=2)
    h.server.finish_deletions()
    await settle(h.server)
    await preemptor.reconcile()  # placed: assumed for it; clearing refused
    assert "ns/high" in h.extender.cache.assumed
    assert stored(h, "high")["status"]["nominatedNodeName"] == "n0"
    h.clock.advance(preemptor.retry)
    await preemptor.reconcile()  # refused again
    await preemptor.reconcile()  # not before `retry`
    assert stored(h, "high")["status"]["nominatedNodeName"] == "n0"
    h.clock.advance(preemptor.retry)
    await preemptor.reconcile()
    await settle(h.server)
    assert not stored(h, "high")["status"].get("nominatedNodeName"), "cleared at the third try"
    assert await h.schedule(high) == "n0"
    assert not overcommitted(h)


async def test_a_nudge_is_written_again_when_the_room_could_not_be_assumed(harness: Callable[..., Any]) -> None:
    """The victims have gone but so has the node: nothing is assumed, the pod must still be tried
    again (elsewhere), so a refused nudge is sent again all the same."""
    h: Harness = await harness(nodes=2, gpus=1)
    for name in ("low1", "low2"):
        await h.schedule(await h.create(pod(name, 400)), nodes=["n0"])
    await h.schedule(await h.create(pod("other", 1000)), nodes=["n1"])
    high = await h.create(pod("high", 900, priority=100))
    preemptor = h.extender.preemptor
    assert preemptor is not None
    h.extender.scheduling.filter(h.args(high, nodes=["n0"]))
    await preemptor.reconcile()
    await settle(h.server)
    assert stored(h, "high")["status"]["nominatedNodeName"] == "n0"
    h.server.fail(503, method="PATCH", path=paths.pod_status("ns", "high"), times=2)
    h.server.remove_object(paths.node("n0"))
    h.server.finish_deletions()
    await settle(h.server)
    await preemptor.reconcile()  # freed, not assumed (no node); clearing refused
    assert "ns/high" not in h.extender.cache.assumed and preemptor.nominations == {}
    assert stored(h, "high")["status"]["nominatedNodeName"] == "n0"
    h.clock.advance(preemptor.retry)
    await preemptor.reconcile()  # refused again
    assert stored(h, "high")["status"]["nominatedNodeName"] == "n0"
    h.clock.advance(preemptor.retry)
    await preemptor.reconcile()
    await settle(h.server)
    assert not stored(h, "high")["status"].get("nominatedNodeName"), "cleared at the third try"
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


def gang_member(name: str, milli: int, priority: int) -> Json:
    annotations = {names.GANG: "job", names.GANG_MIN: "2"}
    return gpu_pod(name, milli=milli, annotations=annotations, spec={"priority": priority})


async def test_a_gang_that_fits_nowhere_preempts_across_nodes_at_once_and_is_placed_whole(
    harness: Callable[..., Any],
) -> None:
    """Two one-GPU nodes, each with a low pod (600, priority 0) and a mid pod (300, priority 50): a
    gang of two 400-milli members of priority 100 fits nowhere; both low pods go (the mid pods stay,
    reprieved), the members' room is kept from everyone meanwhile, and once the victims have gone the
    gang is planned into it whole."""
    h: Harness = await harness(nodes=2, gpus=1, assume_ttl=300.0)
    for name, milli, priority in (("low-a", 600, 0), ("low-b", 600, 0), ("mid-a", 300, 50), ("mid-b", 300, 50)):
        await h.schedule(await h.create(pod(name, milli, priority=priority)))
    g0 = await h.create(gang_member("g0", 400, 100))
    g1 = await h.create(gang_member("g1", 400, 100))
    verdict = h.extender.scheduling.filter(h.args(g0))
    said = " ".join(verdict.failed_nodes.values())
    assert verdict.node_names == [] and "preempting 2 lower-priority pod(s) on n0, n1" in said, said
    preemptor = h.extender.preemptor
    assert preemptor is not None and list(preemptor.gangs) == ["ns/job"]
    sneak = await h.create(pod("sneak", 100))
    assert h.extender.scheduling.filter(h.args(sneak)).node_names == [], "the gang's room is kept for it"

    await preemptor.reconcile()
    await settle(h.server)
    assert all(stored(h, n)["metadata"].get("deletionTimestamp") for n in ("low-a", "low-b"))
    assert not any(stored(h, n)["metadata"].get("deletionTimestamp") for n in ("mid-a", "mid-b")), "reprieved"
    assert reasons(h, "low-a") == ["Preempted"] and reasons(h, "g0") == ["Preempting"] == reasons(h, "g1")
    assert {stored(h, n)["status"]["nominatedNodeName"] for n in ("g0", "g1")} == {"n0", "n1"}
    (condition,) = [c for c in stored(h, "low-b")["status"]["conditions"] if c["type"] == pods.DISRUPTION_TARGET]
    assert "preempted by gang ns/job (priority 100)" in condition["message"]
    waiting = h.extender.scheduling.filter(h.args(g1))
    assert "its gang ns/job waits for 2 preempted pods to leave n0, n1" in " ".join(waiting.failed_nodes.values())
    assert not overcommitted(h)

    h.server.fail(503, method="PATCH", path=paths.pod_status("ns", "g1"))
    h.server.finish_deletions()
    await settle(h.server)
    await preemptor.reconcile()
    await settle(h.server)
    assert not stored(h, "g0")["status"].get("nominatedNodeName"), "nudged"
    assert stored(h, "g1")["status"]["nominatedNodeName"], "its nudge refused"
    first = h.extender.scheduling.filter(h.args(g0))  # the gang is planned into the room: its nomination ends
    assert preemptor.gangs == {} and len(first.node_names) == 1, first.failed_nodes
    await preemptor.reconcile()
    assert stored(h, "g1")["status"]["nominatedNodeName"], "not before `retry`"
    h.clock.advance(preemptor.retry)
    await preemptor.reconcile()
    await settle(h.server)
    assert not stored(h, "g1")["status"].get("nominatedNodeName"), "nudged again, past its gang's nomination"
    bigger = await h.create(pod("bigger", 400))  # would fit in the room the victims freed
    assert h.extender.scheduling.filter(h.args(bigger)).node_names == [], "planned at once: the room is the gang's"
    second = h.extender.scheduling.filter(h.args(g1))
    assert {first.node_names[0], second.node_names[0]} == {"n0", "n1"}
    results = await asyncio.gather(
        *(
            h.extender.scheduling.bind(
                api_extender.BindingArgs(
                    pod_name=n, pod_namespace="ns", pod_uid=stored(h, n)["metadata"]["uid"], node=v.node_names[0]
                )
            )
            for n, v in (("g0", first), ("g1", second))
        )
    )
    assert all(r.error == "" for r in results), [r.error for r in results]
    await settle(h.server)
    assert {stored(h, n)["spec"]["nodeName"] for n in ("g0", "g1")} == {"n0", "n1"}
    assert not overcommitted(h)


async def test_a_gang_preempts_nothing_it_does_not_outrank_and_tries_at_most_once_per_retry(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=2, gpus=1, assume_ttl=300.0)
    for name in ("a", "b"):
        await h.schedule(await h.create(pod(name, 700, priority=100)))
    g0 = await h.create(gang_member("g0", 400, 100))
    await h.create(gang_member("g1", 400, 100))
    verdict = h.extender.scheduling.filter(h.args(g0))
    assert "preempting" not in " ".join(verdict.failed_nodes.values())
    preemptor = h.extender.preemptor
    assert preemptor is not None and preemptor.gangs == {}
    assert not any(stored(h, n)["metadata"].get("deletionTimestamp") for n in "ab"), "equal priority stays"
    tries: list[int] = []

    def plan() -> core_gangs.Plan:
        tries.append(1)
        return core_gangs.Plan(status.unschedulable("no"))

    low = await h.create(pod("low", 200, priority=0))
    await h.schedule(low)
    members = [h.extender.cache.record(units.PodKey(f"ns/{n}")) for n in ("g0", "g1")]
    assert all(m is not None for m in members)
    found = [m for m in members if m is not None]
    h.clock.advance(preemptor.retry)
    assert preemptor.consider_gang("ns/job", found, plan) is None and tries, "tried: low is below the gang"
    tried = len(tries)
    assert preemptor.consider_gang("ns/job", found, plan) is None and len(tries) == tried, "not again so soon"
    h.clock.advance(preemptor.retry)
    preemptor.consider_gang("ns/job", found, plan)
    assert len(tries) > tried


async def protect_db(h: Harness) -> Preemptor:
    """A PodDisruptionBudget `db` over the pods labelled app=db that allows no disruption now, as the
    extender's preemptor sees it."""
    budget: Json = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "db", "namespace": "ns"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "db"}}},
        "status": {"disruptionsAllowed": 0},
    }  # fmt: skip
    await h.api.create(paths.pod_disruption_budgets("ns"), budget)
    await settle(h.server)
    preemptor = h.extender.preemptor
    assert preemptor is not None and preemptor.budgets.allowed() == {"ns/db": 0}
    return preemptor


async def test_preemption_breaks_a_disruption_budget_only_where_nothing_else_makes_room(
    harness: Callable[..., Any],
) -> None:
    """As kube-scheduler weighs them: the node whose victim a PodDisruptionBudget protects (it allows
    no disruption now) loses to one whose victim is of a higher priority but unprotected; with only
    protected victims left, the budget is broken all the same."""
    h: Harness = await harness(nodes=2, gpus=1)
    guarded = pod("guarded", 800, priority=0)
    guarded["metadata"]["labels"] = {"app": "db"}
    assert await h.schedule(await h.create(guarded), ["n0"]) == "n0"
    assert await h.schedule(await h.create(pod("free", 800, priority=1)), ["n1"]) == "n1"
    preemptor = await protect_db(h)
    high = await h.create(pod("high", 600, priority=100))
    verdict = h.extender.scheduling.filter(h.args(high))
    assert verdict.node_names == [] and "preempting" in verdict.failed_nodes["n1"], verdict.failed_nodes
    assert preemptor.nominations[units.PodKey("ns/high")].plan.node == "n1", (
        "the unprotected victim, though of a higher priority"
    )
    assert preemptor.nominations[units.PodKey("ns/high")].plan.violations == 0

    # n1's GPU is held for it now: a second such pod can only make room on n0, and does, breaking the
    # budget (kube-scheduler's rule: budgets slow preemption down, they never stop it).
    other = await h.create(pod("other", 600, priority=100))
    h.extender.scheduling.filter(h.args(other))
    assert preemptor.nominations[units.PodKey("ns/other")].plan.node == "n0"
    assert preemptor.nominations[units.PodKey("ns/other")].plan.violations == 1
    shown = {str(n["pod"]): n["budgets_broken"] for n in preemptor.describe()}
    assert shown == {"ns/high": 0, "ns/other": 1}, "/debug says which nomination breaks a budget"

    # Deleted, the budget weighs nothing any more.
    await h.api.delete(paths.pod_disruption_budgets("ns") + "/db")
    await settle(h.server)
    assert preemptor.budgets.allowed() == {} and preemptor.budgets.by_namespace == {}


async def test_a_gang_member_counts_its_companions_disruption_budgets(harness: Callable[..., Any]) -> None:
    """A member leaves with its gang, so the budget that protects a companion on another node weighs on
    the member's node too: the lone pod of a higher priority goes instead of the unprotected member."""
    h: Harness = await harness(nodes=3, gpus=1)
    gang = {names.GANG: "job", names.GANG_MIN: "1"}
    used = set()
    for name in ("a", "b"):  # one whole GPU each: on two of the nodes
        body = gpu_pod(name, milli=None, count=1, annotations=gang, spec={"priority": 0})
        body["metadata"]["labels"] = {"app": "db"} if name == "b" else {}
        used.add(await h.schedule(await h.create(body)))
    (left,) = {"n0", "n1", "n2"} - used
    assert await h.schedule(await h.create(pod("lone", 800, priority=1)), [left]) == left
    preemptor = await protect_db(h)
    high = await h.create(pod("high", 600, priority=100))
    h.extender.scheduling.filter(h.args(high))
    plan = preemptor.nominations[units.PodKey("ns/high")].plan
    assert plan.node == left and plan.victims == ("ns/lone",) and plan.violations == 0, plan

    # Only the gang left to take: it goes whole, and the plan counts the companion's broken budget.
    other = await h.create(pod("other", 600, priority=100))
    h.extender.scheduling.filter(h.args(other))
    taken = preemptor.nominations[units.PodKey("ns/other")].plan
    assert sorted(taken.victims) == ["ns/a", "ns/b"] and taken.violations == 1, taken


# ----------------------------------------------------------------- found by a review (stop 64)


async def test_no_more_victims_than_needed_with_a_gang_on_the_node(harness: Callable[..., Any]) -> None:
    """Over the API: the lone pod b is not deleted when the gang {a, c}, which goes anyway, frees the room."""
    h: Harness = await harness(nodes=1, gpus=1)
    gang = {names.GANG: "job", names.GANG_MIN: "1"}
    await h.schedule(await h.create(gpu_pod("a", milli=400, annotations=gang, spec={"priority": 0})))
    await h.schedule(await h.create(gpu_pod("b", milli=300, spec={"priority": 0})))
    await h.schedule(await h.create(gpu_pod("c", milli=300, annotations=gang, spec={"priority": 0})))
    high = await h.create(gpu_pod("high", milli=600, spec={"priority": 100}))
    assert h.extender.scheduling.filter(h.args(high)).node_names == []
    preemptor = h.extender.preemptor
    assert preemptor is not None
    (nomination,) = preemptor.nominations.values()
    assert sorted(nomination.plan.victims) == ["ns/a", "ns/c"]
    await preemptor.reconcile()
    await settle(h.server)
    b = h.server.get_object(paths.pod("ns", "b"))
    assert b is not None and not b["metadata"].get("deletionTimestamp")


async def test_a_group_holder_is_never_a_victim(harness: Callable[..., Any]) -> None:
    """sharegpu's own pods are never victims: a SharedDeviceGroup's holder (system-cluster-critical)
    stays when a system-node-critical GPU pod fits nowhere else."""
    h: Harness = await harness(nodes=1, gpus=1)
    holder = gpu_pod("holder", milli=None, count=1, namespace=names.HOLDING_NAMESPACE,
                     spec={"priority": 2000000000, "priorityClassName": "system-cluster-critical"})  # fmt: skip
    holder["metadata"]["labels"] = {names.LABEL_ROLE: names.ROLE_GROUP_HOLDER}
    await h.schedule(await h.create(holder))
    node_critical = {"priority": 2000001000, "priorityClassName": "system-node-critical"}
    critical = await h.create(gpu_pod("critical", milli=None, count=1, spec=node_critical))
    h.extender.scheduling.filter(h.args(critical))
    preemptor = h.extender.preemptor
    assert preemptor is not None and not preemptor.nominations
    await preemptor.reconcile()
    await settle(h.server)
    stored = h.server.get_object(paths.pod(names.HOLDING_NAMESPACE, "holder"))
    assert stored is not None and not stored["metadata"].get("deletionTimestamp")


async def test_a_group_holder_preempts_no_one(harness: Callable[..., Any]) -> None:
    """A tenant's group holder runs at system-cluster-critical (nothing preempts it from under its
    members), a priority no tenant may take other tenants' GPUs at: it waits for room."""
    h: Harness = await harness(nodes=1, gpus=1)
    await h.schedule(await h.create(gpu_pod("tenant", milli=None, count=1, namespace="other", spec={"priority": 0})))
    holder = gpu_pod("holder", milli=None, count=1, namespace=names.HOLDING_NAMESPACE,
                     spec={"priority": 2000000000, "priorityClassName": "system-cluster-critical"})  # fmt: skip
    holder["metadata"]["labels"] = {names.LABEL_ROLE: names.ROLE_GROUP_HOLDER}
    verdict = h.extender.scheduling.filter(h.args(await h.create(holder)))
    assert not verdict.node_names
    preemptor = h.extender.preemptor
    assert preemptor is not None and not preemptor.nominations
    await preemptor.reconcile()
    await settle(h.server)
    stored = h.server.get_object(paths.pod("other", "tenant"))
    assert stored is not None and not stored["metadata"].get("deletionTimestamp")


async def test_a_pod_made_again_under_a_victims_name_during_a_pass_is_not_deleted(harness: Callable[..., Any]) -> None:
    """While a pass deletes the first victim, the second ends and its owner makes a pod of the same
    name: that pod (another UID, unbound) is not the victim and is not deleted."""
    h: Harness = await harness(nodes=1, gpus=1)
    for name in ("low1", "low2"):
        await h.schedule(await h.create(gpu_pod(name, milli=400, spec={"priority": 0})))
    high = await h.create(gpu_pod("high", milli=900, spec={"priority": 100}))
    h.extender.scheduling.filter(h.args(high))
    preemptor = h.extender.preemptor
    assert preemptor is not None
    (nomination,) = preemptor.nominations.values()
    _, second = nomination.plan.victims
    planned = nomination.victims[second]
    delete = preemptor._delete
    calls = 0

    async def first_then_replace(made: Any, victim: pods.Record) -> None:
        nonlocal calls
        calls += 1
        await delete(made, victim)
        if calls == 1:
            name = second.split("/")[1]
            h.server.remove_object(paths.pod("ns", name))
            h.server.put_object(paths.pods("ns"), gpu_pod(name, milli=400, spec={"priority": 0}))
            await settle(h.server)

    preemptor._delete = first_then_replace  # type: ignore[method-assign,assignment]
    await preemptor.reconcile()
    await settle(h.server)
    now = h.server.get_object(paths.pod("ns", second.split("/")[1]))
    assert now is not None and now["metadata"]["uid"] != planned and not now["metadata"].get("deletionTimestamp")


async def test_a_pod_of_a_gpu_group_preempts_no_one_on_a_node_its_group_is_not_on(
    harness: Callable[..., Any],
) -> None:
    """A co-tenancy group (`sharegpu.io/group`) holds one GPU: its next member fits only there. The
    node with a low pod on it looked fine to preemption (its one-node view did not know the group was
    bound elsewhere): the low pod was deleted, and the member still landed nowhere."""
    h: Harness = await harness(nodes=2, gpus=1)
    grouped = {names.GROUP: "g"}
    first = await h.schedule(await h.create(gpu_pod("g1", milli=400, annotations=grouped, spec={"priority": 1000})))
    await h.schedule(await h.create(gpu_pod("g2", milli=400, annotations=grouped, spec={"priority": 1000})))
    other = "n1" if first == "n0" else "n0"
    assert await h.schedule(await h.create(pod("low", 600)), nodes=[other]) == other
    member = await h.create(gpu_pod("g3", milli=400, annotations=grouped, spec={"priority": 1000}))
    assert h.extender.scheduling.filter(h.args(member)).node_names == []
    preemptor = h.extender.preemptor
    assert preemptor is not None
    await preemptor.reconcile()
    await settle(h.server)
    assert not stored(h, "low")["metadata"].get("deletionTimestamp"), "deleted for a pod that cannot use its node"


async def test_a_gang_preempts_only_for_as_many_members_as_its_quota_admits(harness: Callable[..., Any]) -> None:
    """Three low pods fill three GPUs; a gang (minimum two) has three members waiting under a quota of
    two GPUs. Preemption frees two GPUs, not three, and the gang then lands: it had deleted all three
    victims for a plan of three members the quota refused, and the gang never landed."""
    h: Harness = await harness(nodes=1, gpus=3, assume_ttl=300.0)
    for i in range(3):
        await h.schedule(await h.create(gpu_pod(f"low{i}", milli=1000, namespace="other", spec={"priority": 0})))
    hard = {"requests.sharegpu.io/gpu-milli-total": "2000"}
    quota = {"metadata": {"name": "gpus", "namespace": "ns"}, "spec": {"hard": hard}}
    h.server.put_object(paths.RESOURCE_QUOTAS, quota)
    await settle(h.server)
    made = [await h.create(gang_member(f"w{i}", 1000, 100)) for i in range(3)]
    assert h.extender.scheduling.filter(h.args(made[0])).node_names == []
    preemptor = h.extender.preemptor
    assert preemptor is not None
    await preemptor.reconcile()
    await settle(h.server)
    deleted = [
        name for name in ("low0", "low1", "low2")
        if (h.server.get_object(paths.pod("other", name)) or {}).get("metadata", {}).get("deletionTimestamp")
    ]  # fmt: skip
    assert len(deleted) == 2, deleted
    h.server.finish_deletions()
    await settle(h.server)
    await preemptor.reconcile()
    await settle(h.server)
    assert h.extender.scheduling.filter(h.args(made[0])).node_names == ["n0"]


async def test_a_victim_and_its_preemptor_of_other_namespaces_are_not_told_each_others_names(
    harness: Callable[..., Any],
) -> None:
    """The victim's condition and event name its preemptor by UID, the preemptor's event counts its
    victims: each is in the other tenant's namespace (kube-scheduler stopped naming them for this)."""
    h: Harness = await harness(nodes=1, gpus=1)
    await h.schedule(await h.create(gpu_pod("secret-training", milli=800, namespace="team-b", spec={"priority": 0})))
    high = await h.create(gpu_pod("launch-plan", milli=600, namespace="team-a", spec={"priority": 100}))
    assert h.extender.scheduling.filter(h.args(high)).node_names == []
    preemptor = h.extender.preemptor
    assert preemptor is not None
    await preemptor.reconcile()
    await settle(h.server)
    victim = h.server.get_object(paths.pod("team-b", "secret-training"))
    assert victim is not None and victim["metadata"].get("deletionTimestamp")
    (condition,) = [c for c in victim["status"]["conditions"] if c["type"] == pods.DISRUPTION_TARGET]
    told = {ns: " ".join(e["message"] for e in h.server.list_objects(paths.events(ns))) for ns in ("team-a", "team-b")}
    assert (
        "launch-plan" not in condition["message"] + told["team-b"] and high["metadata"]["uid"] in condition["message"]
    )
    assert "secret-training" not in told["team-a"] and "1 pod(s) of other namespaces" in told["team-a"]


async def test_a_replica_that_stops_leading_deletes_no_victim_and_lets_go_of_its_nominations(
    harness: Callable[..., Any],
) -> None:
    """Its kube-scheduler lost the Lease after the filter nominated: the new leader's scheduler places
    the pod afresh and its extender preempts on its own plan; victims deleted here too would be a
    second preemption."""
    h: Harness = await harness(nodes=1, gpus=1)
    await low_pair(h)
    high = await h.create(pod("high", 600, priority=100))
    preemptor = h.extender.preemptor
    assert preemptor is not None
    preemptor.is_leader = lambda: False  # before the filter: the preemptor's own loop runs meanwhile
    assert h.extender.scheduling.filter(h.args(high)).node_names == []
    await preemptor.reconcile()
    await settle(h.server)
    assert not any(stored(h, name)["metadata"].get("deletionTimestamp") for name in ("low1", "low2"))
    assert not preemptor.nominations and not h.extender.cache.holds, "the room it held is let go"
