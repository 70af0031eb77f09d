"""The placer on small fleets: it evaluates per node (and caches by shape and node version, never
serving a stale answer), chooses by score, then tiebreak, then its fixed node priority, builds the
allocation a decision stands for, and places (decides and assumes) without ever over-committing."""

from __future__ import annotations

import numpy as np
import pytest

from sharegpu.core import fleet, policies, requests, status, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from tests.conftest import node, pod


def placer_over(*nodes: object, policy: str = "binpack", priority: list[int] | None = None) -> core_placer.Placer:
    state = fleet.FleetState(list(nodes))  # type: ignore[arg-type]
    ranks = np.array(priority, dtype=np.int64) if priority is not None else None
    return core_placer.Placer(state, policies.make(policy), priority=ranks)


def test_a_cached_evaluation_is_recomputed_for_the_nodes_that_changed() -> None:
    placer = placer_over(node("a"), node("b"))
    ledger = core_ledger.Ledger(placer.state)
    demand = pod("ns/p", count=1, milli=600).demand
    first = placer.evaluate(demand)
    assert first.feasible.tolist() == [True, True]
    ledger.assume(placer.allocation_on(pod("ns/big", count=2, milli=700), 0, (0, 1)))
    again = placer.evaluate(demand)
    assert again.feasible.tolist() == [False, True], "node a changed: its cached answer is not served"
    fresh = placer_over(node("a"), node("b"))
    core_ledger.Ledger(fresh.state).assume(fresh.allocation_on(pod("ns/big", count=2, milli=700), 0, (0, 1)))
    assert fresh.evaluate(demand).score.tolist() == again.score.tolist()


def test_the_highest_score_wins_then_the_tiebreak_then_the_node_priority() -> None:
    placer = placer_over(node("a"), node("b"), node("c"), priority=[2, 0, 1])
    rows = np.arange(3, dtype=np.int64)
    feasible = np.array([True, True, True])
    demand = pod("ns/p", count=1, milli=100).demand

    def chosen(score: list[int], tiebreak: list[int]) -> str | None:
        evaluation = core_placer.Evaluation(
            rows,
            feasible,
            np.array(score, dtype=np.int64),
            np.ones(3, dtype=np.int64),
            np.array(tiebreak, dtype=np.int64),
        )
        return placer.choose(demand, evaluation).node

    assert chosen([10, 50, 20], [0, 0, 0]) == "b"
    assert chosen([50, 50, 20], [1, 0, 0]) == "a", "equal scores: the larger tiebreak"
    assert chosen([50, 50, 50], [0, 0, 0]) == "b", "all equal: the lowest priority rank (b is 0)"
    nothing = core_placer.Evaluation(rows, np.zeros(3, dtype=np.bool_), rows, rows, rows)
    refused = placer.choose(demand, nothing)
    assert refused.node is None and refused.status.code is status.Code.UNSCHEDULABLE
    assert refused.status.message == "no node fits among 3 candidate(s)"


def test_a_decision_becomes_the_allocation_on_its_gpus_with_their_uuids() -> None:
    placer = placer_over(node("a", gpus=2, memory=16384))
    request = pod("ns/p", count=1, milli=300, memory_mib=2048)
    decision = placer.decide(request.demand)
    assert decision.status.ok and decision.node == "a" and len(decision.gpus) == 1
    made = placer.allocation_for(request, decision)
    [grant] = made.containers[0].devices
    assert (made.node, grant.index, grant.milli, grant.memory_mib) == ("a", decision.gpus[0], 300, 2048)
    assert grant.uuid == placer.state.inventories[0].gpus[decision.gpus[0]].uuid


def test_placing_until_full_never_over_commits_a_gpu() -> None:
    placer = placer_over(node("a", gpus=2), node("b", gpus=1))
    ledger = core_ledger.Ledger(placer.state)
    placed = [placer.place(ledger, pod(f"ns/p{i}", count=1, milli=400)) for i in range(10)]
    assert sum(d.status.ok for d in placed) == 6, "two 400-milli shares fit on each of the three GPUs"
    assert int(placer.state.milli_free.min()) >= 0
    assert placed[-1].status.code is status.Code.UNSCHEDULABLE


def test_a_priority_of_the_wrong_shape_is_refused() -> None:
    state = fleet.FleetState([node("a"), node("b")])
    with pytest.raises(ValueError, match="one rank per node"):
        core_placer.Placer(state, policies.make("binpack"), priority=np.zeros(3, dtype=np.int64))


def test_pods_with_no_gpu_still_need_host_room() -> None:
    placer = placer_over(node("a", cpu=1000))
    assert placer.decide(requests.simple_pod(units.PodKey("ns/c"), cpu_milli=500).demand).node == "a"
    assert not placer.decide(requests.simple_pod(units.PodKey("ns/c"), cpu_milli=5000).demand).status.ok


def test_a_selection_named_again_is_decided_over_its_new_gpus() -> None:
    """The extender names its DRA selections afresh on every call: a decision over a selection's old
    GPUs was served from the placer's cache, and a claim got a GPU its selectors no longer pick."""
    state = fleet.FleetState([node("n0", 1), node("n1", 1)])
    placer = core_placer.Placer(state, policies.make("bestfit"))
    demand = requests.simple_pod("ns/p", count=1, milli=100, selection="s").demand
    state.select("s", [("n0", 0)])
    assert placer.decide(demand).node == "n0"
    state.select("s", [("n1", 0)])
    assert placer.decide(demand).node == "n1"
