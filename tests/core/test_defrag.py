"""The defragmenter's planner: fewest safe evictions, and never an unsafe one (table tests over
small clusters, and a Hypothesis property: any plan is safe and leaves the ledger as it was)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.core import defrag, devices, fleet, policies, requests, status, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from tests.conftest import node, pod


class Cluster:
    """A fluent builder: nodes, running pods placed exactly where told, pending pods."""

    def __init__(self, *nodes: devices.NodeInventory) -> None:
        self.state = fleet.FleetState(list(nodes))
        self.ledger = core_ledger.Ledger(self.state)
        self.placer = core_placer.Placer(self.state, policies.make("bestfit"))
        self.tenants: dict[units.PodKey, defrag.Tenant] = {}

    def run(
        self,
        key: str,
        node_name: str,
        gpus: tuple[int, ...],
        milli: int = 1000,
        *,
        movable: bool = True,
        priority: int = 0,
        groups: tuple[str, ...] = (),
        cpu: int = 0,
    ) -> Cluster:
        request = pod(key, count=len(gpus), milli=milli, cpu_milli=cpu)
        row = self.state.row_of[node_name]
        decision = core_placer.Decision(status.SUCCESS, row=row, node=units.NodeName(node_name), gpus=gpus)
        result = self.ledger.add(self.placer.allocation_for(request, decision))
        assert result.ok, result
        self.tenants[request.key] = defrag.Tenant(request, movable, priority, groups, owner=f"ReplicaSet/{key}")
        return self

    def plan(
        self, *pending: requests.PodRequest | defrag.Pending, evictions: int = 10, groups: dict[str, int] | None = None
    ) -> defrag.Plan:
        items = [p if isinstance(p, defrag.Pending) else defrag.Pending(p) for p in pending]
        before = snapshot(self.ledger)
        result = defrag.plan(self.ledger, self.placer, self.tenants, items, defrag.Limits(evictions, groups or {}))
        assert snapshot(self.ledger) == before, "the plan changed the ledger"
        assert self.state.same_usage(self.state.recount(self.ledger.allocations()))
        return result


def snapshot(ledger: core_ledger.Ledger) -> dict[units.PodKey, tuple[object, core_ledger.Phase]]:
    return {key: (entry.alloc, entry.phase) for key, entry in ledger.entries()}


def victims(plan: defrag.Plan) -> list[str]:
    return [v.pod for m in plan.moves for v in m.victims]


def test_one_small_tenant_moves_so_that_a_whole_gpu_fits() -> None:
    # Two GPUs, each 300 used: 1400 free in total, no whole GPU. Moving one 300 pod frees a GPU.
    cluster = Cluster(node("n", gpus=2)).run("ns/a", "n", (0,), 300).run("ns/b", "n", (1,), 300)
    plan = cluster.plan(pod("ns/p", count=1))
    assert plan.evictions == 1 and plan.gain_milli == 1000
    (move,) = plan.moves
    victim = move.victims[0]
    assert move.placed.gpu_indices == victim.before.gpu_indices  # the pod takes the GPU its victim left
    assert victim.after.gpu_indices != victim.before.gpu_indices  # and the victim joins the other GPU
    assert victim.owner.startswith("ReplicaSet/")


def test_the_fewest_evictions_win_then_the_least_compute_moved() -> None:
    cluster = (
        Cluster(node("x", gpus=1), node("y", gpus=1), node("z", gpus=2))
        .run("ns/x1", "x", (0,), 200).run("ns/x2", "x", (0,), 200)  # two pods to move on x
        .run("ns/y1", "y", (0,), 500)  # one, but 500 to move
        .run("ns/z1", "z", (0,), 300).run("ns/z2", "z", (1,), 100)  # one of 100 on z
    )  # fmt: skip
    plan = cluster.plan(pod("ns/p", count=1))
    assert victims(plan) == ["ns/z2"]
    assert plan.moves[0].placed.node == "z"


def test_a_share_needs_only_enough_room_on_one_gpu() -> None:
    # GPU 0: 400 + 300 + 200 (100 free). A 500 share: moving the 400 suffices (one pod), not 300 + 200.
    cluster = (
        Cluster(node("n", gpus=1), node("m", gpus=1))
        .run("ns/a", "n", (0,), 400).run("ns/b", "n", (0,), 300).run("ns/c", "n", (0,), 200)
        .run("ns/d", "m", (0,), 600)
    )  # fmt: skip
    plan = cluster.plan(pod("ns/p", count=1, milli=500))
    assert victims(plan) == ["ns/a"]


def test_a_pod_without_owner_is_never_evicted() -> None:
    cluster = Cluster(node("n", gpus=2)).run("ns/a", "n", (0,), 300, movable=False).run("ns/b", "n", (1,), 300)
    assert victims(cluster.plan(pod("ns/p", count=1))) == ["ns/b"]
    alone = (
        Cluster(node("n", gpus=2)).run("ns/a", "n", (0,), 300, movable=False).run("ns/b", "n", (1,), 300, movable=False)
    )
    plan = alone.plan(pod("ns/p", count=1))
    assert plan.moves == () and plan.skipped[0].why is defrag.Why.NO_SAFE_MOVE


def test_a_pod_of_higher_priority_is_never_evicted() -> None:
    cluster = (
        Cluster(node("n", gpus=2)).run("ns/a", "n", (0,), 300, priority=100).run("ns/b", "n", (1,), 300, priority=5)
    )
    assert victims(cluster.plan(defrag.Pending(pod("ns/p", count=1), priority=10))) == ["ns/b"]
    assert cluster.plan(defrag.Pending(pod("ns/p", count=1), priority=1)).moves == ()


def test_a_disruption_budget_that_allows_none_is_honoured() -> None:
    cluster = (
        Cluster(node("n", gpus=1), node("m", gpus=1))
        .run("ns/a", "n", (0,), 300, groups=("ns/pdb-a",))
        .run("ns/b", "m", (0,), 300, groups=("ns/pdb-b",))
    )
    assert victims(cluster.plan(pod("ns/p", count=1), groups={"ns/pdb-a": 0, "ns/pdb-b": 1})) == ["ns/b"]
    assert victims(cluster.plan(pod("ns/p", count=1), groups={"ns/pdb-a": 1, "ns/pdb-b": 0})) == ["ns/a"]
    # A group the caller knows nothing of allows nothing.
    assert cluster.plan(pod("ns/p", count=1), groups={}).moves == ()


def test_a_group_allowance_is_shared_by_the_whole_plan() -> None:
    cluster = (
        Cluster(node("n", gpus=2), node("m", gpus=2))
        .run("ns/a", "n", (0,), 300, groups=("g",)).run("ns/b", "n", (1,), 300, groups=("g",))
        .run("ns/c", "m", (0,), 300, groups=("g",)).run("ns/d", "m", (1,), 300, groups=("g",))
    )  # fmt: skip
    plan = cluster.plan(pod("ns/p", count=1), pod("ns/q", count=1), groups={"g": 1})
    assert plan.evictions == 1
    assert [s.why for s in plan.skipped] == [defrag.Why.NO_SAFE_MOVE]
    both = cluster.plan(pod("ns/p", count=1), pod("ns/q", count=1), groups={"g": 2})
    assert both.evictions == 2 and both.gain_milli == 2000


def test_the_eviction_budget_is_never_exceeded() -> None:
    cluster = (
        Cluster(node("n", gpus=2), node("m", gpus=2))
        .run("ns/a", "n", (0,), 300).run("ns/b", "n", (1,), 300)
        .run("ns/c", "m", (0,), 300).run("ns/d", "m", (1,), 300)
    )  # fmt: skip
    plan = cluster.plan(pod("ns/p", count=1), pod("ns/q", count=1), evictions=1)
    assert plan.evictions == 1
    assert [s.why for s in plan.skipped] == [defrag.Why.BUDGET]
    assert cluster.plan(pod("ns/p", count=1), evictions=0).skipped[0].why is defrag.Why.BUDGET


def test_every_victim_must_fit_elsewhere() -> None:
    # Each GPU holds 600: 800 free in total, but a moved 600 fits nowhere, so nothing is planned.
    cluster = Cluster(node("n", gpus=1), node("m", gpus=1)).run("ns/a", "n", (0,), 600).run("ns/b", "m", (0,), 600)
    plan = cluster.plan(pod("ns/p", count=1, milli=700))
    assert plan.moves == () and plan.skipped[0].why is defrag.Why.NO_SAFE_MOVE


def test_no_plan_when_capacity_is_short_or_the_pod_fits() -> None:
    cluster = Cluster(node("n", gpus=2)).run("ns/a", "n", (0,), 600).run("ns/b", "n", (1,), 600)
    short = cluster.plan(pod("ns/p", count=1))
    assert short.moves == () and short.skipped[0].why is defrag.Why.SHORTAGE
    assert "800 milli-GPU free" in short.skipped[0].detail
    fits = cluster.plan(pod("ns/p", count=1, milli=300))
    assert fits.skipped[0].why is defrag.Why.FITS


def test_models_the_pod_may_not_use_do_not_count_as_free() -> None:
    cluster = Cluster(node("t", gpus=2, model="T4"), node("v", gpus=1, model="V100")).run("ns/a", "t", (0,), 300)
    cluster.run("ns/b", "t", (1,), 300).run("ns/c", "v", (0,), 900)
    plan = cluster.plan(pod("ns/p", count=2, models=frozenset({"V100"})))
    assert plan.skipped[0].why is defrag.Why.SHORTAGE


def test_higher_priority_pending_pods_are_planned_first_and_later_ones_see_the_moves() -> None:
    cluster = Cluster(node("n", gpus=2)).run("ns/a", "n", (0,), 300).run("ns/b", "n", (1,), 300)
    low = defrag.Pending(pod("ns/low", count=1), priority=0)
    high = defrag.Pending(pod("ns/high", count=1), priority=10)
    plan = cluster.plan(low, high)
    assert [m.pod for m in plan.moves] == ["ns/high"]
    assert plan.skipped[0].pod == "ns/low" and plan.skipped[0].why is defrag.Why.SHORTAGE


def test_a_victim_is_moved_at_most_once_and_a_whole_gpu_pod_clears_all_tenants() -> None:
    cluster = (
        Cluster(node("n", gpus=2), node("m", gpus=2))
        .run("ns/a", "n", (0,), 200).run("ns/b", "n", (0,), 200).run("ns/c", "n", (1,), 500)
        .run("ns/d", "m", (0,), 500).run("ns/e", "m", (1,), 500)
    )  # fmt: skip
    plan = cluster.plan(pod("ns/p", count=1))
    assert plan.evictions == 1 and victims(plan)[0] in ("ns/c", "ns/d", "ns/e")
    seen = victims(cluster.plan(pod("ns/p", count=1), pod("ns/q", count=1)))
    assert len(seen) == len(set(seen))


# ----------------------------------------------------------------- property: any plan is safe

SHARES = st.sampled_from([100, 200, 250, 300, 400, 500, 600, 700])


@settings(max_examples=60, deadline=None)
@given(
    layout=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1), SHARES, st.booleans(), st.integers(0, 2)),
                    max_size=10),
    wanted=st.lists(st.sampled_from([(1, 1000), (2, 1000), (1, 800), (1, 500)]), min_size=1, max_size=3),
    evictions=st.integers(0, 4),
    allowance=st.integers(0, 2),
)  # fmt: skip
def test_any_plan_is_safe(
    layout: list[tuple[int, int, int, bool, int]],
    wanted: list[tuple[int, int]],
    evictions: int,
    allowance: int,
) -> None:
    cluster = Cluster(node("n0", gpus=2), node("n1", gpus=2), node("n2", gpus=2))
    for i, (where, index, milli, movable, priority) in enumerate(layout):
        row = cluster.state.row_of[f"n{where}"]
        if cluster.state.milli_free[row, index] < milli:
            continue
        cluster.run(f"ns/r{i}", f"n{where}", (index,), milli, movable=movable, priority=priority, groups=("g",))
    pending = [defrag.Pending(pod(f"ns/p{i}", count=c, milli=m), priority=1) for i, (c, m) in enumerate(wanted)]
    plan = cluster.plan(*pending, evictions=evictions, groups={"g": allowance})
    assert plan.evictions <= min(evictions, allowance)
    # Replay the plan on a copy: every victim leaves, every pending pod and victim lands, nothing over-commits.
    ledger = core_ledger.Ledger(fleet.FleetState(list(cluster.state.inventories)))
    assert all(r.ok for r in ledger.load(cluster.ledger.allocations()))
    for move in plan.moves:
        for victim in move.victims:
            tenant = cluster.tenants[victim.pod]
            assert tenant.movable and tenant.priority <= 1
            assert ledger.remove(victim.pod).ok
        assert ledger.add(move.placed).ok
        for victim in move.victims:
            assert ledger.add(victim.after).ok
    assert ledger.state.same_usage(ledger.state.recount(ledger.allocations()))
    assert np.all(ledger.state.milli_free >= 0)
    assert len(set(victims(plan))) == plan.evictions


def test_the_pending_pods_and_the_victims_own_node_constraints_are_kept() -> None:
    # Both nodes fragmented alike; the pending pod may only go to "b" (its nodeSelector), and the
    # victim on "b" only to "b" or "c" (its affinity), where "c" is full: so it must stay on "b".
    def build() -> Cluster:
        return (
            Cluster(node("a", gpus=2), node("b", gpus=2), node("c", gpus=1))
            .run("ns/a0", "a", (0,), 300).run("ns/a1", "a", (1,), 300)
            .run("ns/b0", "b", (0,), 300).run("ns/b1", "b", (1,), 300)
            .run("ns/c0", "c", (0,), 1000)
        )  # fmt: skip

    p = pod("ns/p", count=1)
    plan = build().plan(defrag.Pending(p, nodes=frozenset({"b"})))
    (move,) = plan.moves
    assert move.placed.node == "b" and move.victims[0].after.node == "b"
    # On "c" its one GPU would have to be cleared, and that whole-GPU pod fits nowhere else.
    assert build().plan(defrag.Pending(p, nodes=frozenset({"c"}))).skipped[0].why is defrag.Why.NO_SAFE_MOVE
    none = build().plan(defrag.Pending(p, nodes=frozenset()))
    assert none.skipped[0].why is defrag.Why.SHORTAGE and "nodeSelector" in none.skipped[0].detail
    cluster = build()
    for key in ("ns/b0", "ns/b1"):
        cluster.tenants[units.PodKey(key)] = defrag.Tenant(
            cluster.tenants[units.PodKey(key)].request, True, nodes=frozenset({"c"})
        )
    assert not cluster.plan(defrag.Pending(p, nodes=frozenset({"b"}))).moves, "its victims have nowhere to go"


@settings(max_examples=80, deadline=None)
@given(
    layout=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([(0,), (1,), (2,), (0, 1), (1, 2), (0, 1, 2)]),
                              SHARES, st.booleans()), max_size=24),
    wanted=st.sampled_from([(1, 1000), (2, 1000), (3, 1000), (1, 800), (1, 500), (2, 600), (1, 200)]),
    limit=st.integers(1, 4),
)  # fmt: skip
def test_the_bounded_search_finds_the_same_cheapest_candidates_as_searching_every_node(
    layout: list[tuple[int, tuple[int, ...], int, bool]], wanted: tuple[int, int], limit: int
) -> None:
    """Nodes are visited from the lowest bound on their cost and the search stops early: what it
    returns must be what a search of every node would put first (multi-GPU tenants included, one of
    which frees several GPUs at once)."""
    cluster = Cluster(*(node(f"n{i}", gpus=3) for i in range(6)))
    for i, (where, gpus, milli, movable) in enumerate(layout):
        row = cluster.state.row_of[f"n{where}"]
        share = 1000 if len(gpus) > 1 else milli
        if (cluster.state.milli_free[row, list(gpus)] < share).any():
            continue
        cluster.run(f"ns/r{i}", f"n{where}", gpus, share, movable=movable)
    demand = pod("ns/p", count=wanted[0], milli=wanted[1]).demand

    def usable(key: units.PodKey, entry: core_ledger.Entry) -> bool:
        return cluster.tenants[key].movable

    every = np.arange(6, dtype=np.int64)
    trial = defrag._Trial(cluster.ledger)
    bounded = defrag._candidates(trial, cluster.placer, demand, usable, every, limit, {}, 0)
    exhaustive = defrag._candidates(trial, cluster.placer, demand, usable, every, 10**6, {}, 0)
    assert bounded == exhaustive[:limit]
    assert [c.cost for c in exhaustive] == sorted(c.cost for c in exhaustive)


def test_a_node_lacking_more_is_still_searched_when_it_may_be_cheaper() -> None:
    """n1 lacks only 50 milli but its smallest tenant is 150; n0 lacks 100 and has a tenant of exactly
    100. The search visits n1 first (its bound is lower) and must still look at n0."""
    cluster = Cluster(node("n0", gpus=3), node("n1", gpus=3))
    for name in ("n0", "n1"):
        for index in (1, 2):
            cluster.run(f"ns/full-{name}-{index}", name, (index,), 1000, movable=False)
    cluster.run("ns/small", "n0", (0,), 100).run("ns/a", "n0", (0,), 300).run("ns/b", "n0", (0,), 200)
    cluster.run("ns/c", "n1", (0,), 150).run("ns/d", "n1", (0,), 400)
    demand = pod("ns/p", count=1, milli=500).demand
    every = np.arange(2, dtype=np.int64)
    (first,) = defrag._candidates(
        defrag._Trial(cluster.ledger), cluster.placer, demand, lambda k, e: True, every, 1, {}, 0
    )
    assert (first.row, first.victims, first.cost[:2]) == (0, ("ns/small",), (1, 100))
    plan = cluster.plan(pod("ns/p", count=1, milli=500), evictions=1)
    assert victims(plan) == ["ns/small"] and plan.moves[0].placed.node == "n0"


def test_a_gpu_over_committed_already_neither_breaks_the_plan_nor_changes_the_ledger() -> None:
    """n's GPU holds `a` and `b` at 600 each (the API showed both: the second counted with a Conflict).
    Trying moves from n takes them out and puts them back: the ledger ends as it began."""
    c = Cluster(node("n", gpus=1), node("m", gpus=2))
    for key in ("ns/a", "ns/b"):
        request = pod(key, count=1, milli=600)
        decision = core_placer.Decision(status.SUCCESS, row=c.state.row_of["n"], node=units.NodeName("n"), gpus=(0,))
        c.ledger.add(c.placer.allocation_for(request, decision))
        c.tenants[request.key] = defrag.Tenant(request, True, 0, (), owner=f"ReplicaSet/{key}")
    c.run("ns/c", "m", (0,), 300, movable=False).run("ns/d", "m", (1,), 300, movable=False)
    found = c.plan(pod("ns/p", count=1))  # Cluster.plan checks the ledger is as it was
    assert victims(found) == ["ns/a", "ns/b"], "both moved to m, 600 beside 300 on each GPU: p takes n"
