"""Preemption GPU by GPU: the fewest lower-priority tenants whose leaving makes a pod fit, the least
important of them, never a pod of equal or higher priority, and the plan that hurts least across nodes;
for a gang, across nodes at once, the lowest priorities that make it fit, the fleet left as it was."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from sharegpu.core import fit, fleet, policies, requests, units, victims
from sharegpu.core import gangs as core_gangs
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from tests.builders import MakeAllocation
from tests.conftest import node, pod


def tenant(
    name: str, milli: int, priority: int, *, where: str = "a", index: int = 0, leaving: bool = False, created: str = ""
) -> victims.Tenant:
    whole = milli == 1000
    alloc = MakeAllocation(f"ns/{name}", where).grant(index, milli).host(100, 64).exclusive(whole).obj()
    return victims.Tenant(alloc, priority, created=created, leaving=leaving)


def share(milli: int, count: int = 1) -> requests.GpuDemand:
    return requests.GpuDemand(count=count, milli=milli, cpu_milli=100, host_memory_mib=64)


def state_of(*names: str, gpus: int = 1) -> fleet.FleetState:
    return fleet.FleetState([node(n, gpus) for n in names])


def names(keys: tuple[units.PodKey, ...]) -> list[str]:
    return [k.split("/")[1] for k in keys]


def test_only_lower_priority_pods_go_and_only_as_many_as_needed() -> None:
    state = state_of("a")
    tenants = [tenant("low1", 300, 0), tenant("low2", 300, 0), tenant("high", 300, 10)]
    plan = victims.on_node(state, 0, tenants, share(600), priority=5)
    assert plan is not None
    assert sorted(names(plan.victims)) == ["low1", "low2"], "high outranks the pod: it stays"
    assert plan.gpus == (0,) and plan.cost == (0, 0, 0, 2)


def test_the_most_important_are_reprieved_first() -> None:
    state = state_of("a")
    tenants = [tenant("p1", 300, 1), tenant("p3", 300, 3), tenant("p2", 300, 2)]
    plan = victims.on_node(state, 0, tenants, share(400), priority=100)
    assert plan is not None and names(plan.victims) == ["p1"], "one pod frees enough: the least important"


def test_of_equals_the_newer_goes() -> None:
    state = state_of("a")
    tenants = [
        tenant("old", 500, 1, created="2026-01-01T00:00:00Z"),
        tenant("new", 500, 1, created="2026-01-02T00:00:00Z"),
    ]
    plan = victims.on_node(state, 0, tenants, share(500), priority=2)
    assert plan is not None and names(plan.victims) == ["new"]


def test_a_victim_that_breaks_a_disruption_budget_is_reprieved_first() -> None:
    """kube-scheduler's order: the candidates whose going would take a budget below zero are put back
    before the others, so one pod of the same priority goes instead of the protected one."""
    state = state_of("a")
    guarded = dataclasses.replace(tenant("guarded", 500, 1, created="2026-01-02T00:00:00Z"), budgets=("ns/guard",))
    free = tenant("free", 500, 1, created="2026-01-01T00:00:00Z")
    plan = victims.on_node(state, 0, [guarded, free], share(500), priority=5, allowed={"ns/guard": 0})
    assert plan is not None and names(plan.victims) == ["free"] and plan.violations == 0
    # Without the budget the newer of two equals goes: the guarded one.
    unguarded = dataclasses.replace(guarded, budgets=())
    plain = victims.on_node(state, 0, [unguarded, free], share(500), priority=5)
    assert plain is not None and names(plain.victims) == ["guarded"] and plain.violations == 0
    # A budget that still allows a disruption is not broken by it.
    allows = victims.on_node(state, 0, [guarded, free], share(500), priority=5, allowed={"ns/guard": 1})
    assert allows is not None and names(allows.victims) == ["guarded"] and allows.violations == 0


def test_budgets_slow_preemption_down_but_do_not_stop_it() -> None:
    """Only protected pods can make room: they go, and the plan counts what it breaks; across nodes the
    plan that breaks fewer budgets wins before priorities are weighed."""
    state = state_of("a", "b")
    guarded = dataclasses.replace(tenant("guarded", 800, 0), budgets=("ns/guard",))
    plan_a = victims.on_node(state, 0, [guarded], share(500), priority=5, allowed={"ns/guard": 0})
    assert plan_a is not None and names(plan_a.victims) == ["guarded"] and plan_a.violations == 1
    higher = tenant("higher", 800, 3, where="b")
    plan_b = victims.on_node(state, 1, [higher], share(500), priority=5, allowed={"ns/guard": 0})
    assert plan_b is not None and plan_b.violations == 0
    assert victims.best([plan_a, plan_b], np.arange(2)) is plan_b, "a higher victim rather than a broken budget"
    # Two pods under one budget that allows one disruption: the first (the most important) uses it up.
    both = [
        dataclasses.replace(tenant("p1", 400, 2), budgets=("ns/guard",)),
        dataclasses.replace(tenant("p2", 400, 1), budgets=("ns/guard",)),
    ]
    assert victims.violating(both, {"ns/guard": 1}) == {"ns/p2"}
    assert victims.violating(both, {}) == {"ns/p1", "ns/p2"}, "a budget not known allows none"


def test_a_gang_member_whose_companion_a_budget_protects_is_reprieved_first() -> None:
    """A member leaves with its gang, so its companions' budgets are its own: a lone pod of the same
    priority goes instead, and where only the gang makes room the companion's broken budget is counted."""
    state = state_of("a")
    protected = victims.Companion(units.PodKey("ns/mate"), 1, budgets=("ns/guard",))
    member = dataclasses.replace(tenant("member", 500, 1, created="2026-01-02T00:00:00Z"), companions=(protected,))
    lone = tenant("lone", 500, 1, created="2026-01-01T00:00:00Z")
    plan = victims.on_node(state, 0, [member, lone], share(500), priority=5, allowed={"ns/guard": 0})
    assert plan is not None and names(plan.victims) == ["lone"] and plan.violations == 0
    # A budget that still allows one: the newer of two equals goes, and its companion with it.
    free = victims.on_node(state, 0, [member, lone], share(500), priority=5, allowed={"ns/guard": 1})
    assert free is not None and sorted(names(free.victims)) == ["mate", "member"] and free.violations == 0
    # Only the gang makes room: it goes, and the plan counts the companion's broken budget.
    only = victims.on_node(state, 0, [member], share(600), priority=5, allowed={"ns/guard": 0})
    assert only is not None and sorted(names(only.victims)) == ["mate", "member"] and only.violations == 1
    # A pod counts once in the walk, however many of the candidates take it along.
    twice = [member, dataclasses.replace(lone, companions=(protected,))]
    assert victims.violating(twice, {"ns/guard": 1}) == set()


def test_no_plan_where_preempting_cannot_help() -> None:
    state = state_of("a")
    assert victims.on_node(state, 0, [tenant("same", 800, 5)], share(500), priority=5) is None, "equal priority stays"
    assert victims.on_node(state, 0, [tenant("low", 100, 0), tenant("high", 800, 9)], share(500), priority=5) is None
    assert victims.on_node(state, 0, [], share(500), priority=5) is None


def test_pods_already_leaving_count_as_gone_and_cost_nothing() -> None:
    state = state_of("a")
    tenants = [tenant("going", 800, 0, leaving=True), tenant("low", 200, 0)]
    plan = victims.on_node(state, 0, tenants, share(800), priority=5)
    assert plan is not None and plan.victims == () and names(plan.leaving) == ["going"]
    assert victims.on_node(state, 0, tenants, share(800), priority=0) is None, "only for a pod that could preempt it"
    assert plan.cost < victims.on_node(state, 0, [tenant("low", 900, 0)], share(800), priority=5).cost  # type: ignore[union-attr]


def test_a_whole_gpu_is_freed_where_that_takes_the_fewest_pods() -> None:
    state = state_of("a", gpus=2)
    tenants = [tenant("x", 300, 0, index=0), tenant("y", 300, 0, index=0), tenant("z", 300, 0, index=1)]
    plan = victims.on_node(state, 0, tenants, share(1000), priority=5)
    assert plan is not None and names(plan.victims) == ["z"] and plan.gpus == (1,)


def test_held_and_blocked_gpus_stay_out_of_the_plan() -> None:
    state = state_of("a", gpus=2)
    state.hold(0, [1], +1)
    tenants = [tenant("x", 300, 0, index=0), tenant("y", 300, 0, index=0), tenant("z", 300, 0, index=1)]
    plan = victims.on_node(state, 0, tenants, share(1000), priority=5)
    assert plan is not None and sorted(names(plan.victims)) == ["x", "y"] and plan.gpus == (0,)
    state.blocked[0, 0] = True
    assert victims.on_node(state, 0, tenants, share(1000), priority=5) is None


def test_the_plan_that_hurts_least_wins_across_nodes() -> None:
    state = state_of("a", "b", "c")
    plans = [
        victims.on_node(state, 0, [tenant("a1", 900, 5, where="a")], share(500), priority=9),
        victims.on_node(state, 1, [tenant(f"b{i}", 300, 1, where="b") for i in range(3)], share(600), priority=9),
        victims.on_node(state, 2, [tenant("c1", 900, 1, where="c")], share(500), priority=9),
    ]
    found = [p for p in plans if p is not None]
    assert len(found) == 3
    best = victims.best(found, np.arange(3))
    assert best is not None and best.node == "c", "lowest priority, then fewest pods"
    assert victims.best(found[:2], np.arange(3)).node == "b"  # type: ignore[union-attr]
    assert victims.best([], np.arange(3)) is None


def test_holding_a_gpu_keeps_placement_off_it() -> None:
    state = state_of("a", gpus=2)
    rows = np.array([0])
    assert fit.eligible_gpus(state, share(500), rows)[0].tolist() == [True, True]
    state.hold(0, [0], +1)
    assert fit.eligible_gpus(state, share(500), rows)[0].tolist() == [False, True]
    assert fit.diagnose(state, share(500, count=2), rows).shortfall[0] == fit.Shortfall.HELD
    state.hold(0, [0], -1)
    assert fit.eligible_gpus(state, share(500), rows)[0].tolist() == [True, True]


def test_a_node_narrower_than_the_fleet_is_planned_on_its_own_gpus() -> None:
    state = fleet.FleetState([node("a", 2), node("b", 4)])
    state.hold(0, [1], +1)
    plan = victims.on_node(state, 0, [tenant("x", 600, 0, index=0)], share(500), priority=5)
    assert plan is not None and names(plan.victims) == ["x"] and plan.gpus == (0,)


def test_a_gang_member_takes_its_companions_along_and_costs_them_all() -> None:
    state = state_of("a", "b")
    member = victims.Tenant(tenant("m", 1000, 0).alloc, 0, companions=(victims.Companion(units.PodKey("ns/m2"), 0),))
    on_a = victims.on_node(state, 0, [member], share(600), priority=5)
    on_b = victims.on_node(state, 1, [tenant("lone", 1000, 0, where="b")], share(600), priority=5)
    assert on_a is not None and on_b is not None
    assert sorted(names(on_a.victims)) == ["m", "m2"] and on_a.cost == (0, 0, 0, 2), "its gang leaves with it"
    assert victims.best([on_a, on_b], np.zeros(2, dtype=np.int64)) is on_b, "a lone pod hurts less than a gang"


def test_a_companion_on_the_same_node_put_back_first_still_leaves_with_its_gang() -> None:
    state = state_of("a")
    older = victims.Tenant(tenant("g1", 400, 3).alloc, 3, companions=(victims.Companion(units.PodKey("ns/g2"), 0),))
    newer = victims.Tenant(tenant("g2", 400, 0).alloc, 0, companions=(victims.Companion(units.PodKey("ns/g1"), 3),))
    plan = victims.on_node(state, 0, [older, newer], share(300), priority=5)
    assert plan is not None and sorted(names(plan.victims)) == ["g1", "g2"], "g2 must go, and g1 with it"
    assert plan.priorities == (0, 3)


def test_a_gang_member_whose_companion_outranks_the_pod_stays() -> None:
    state = state_of("a")
    member = victims.Tenant(tenant("m", 1000, 0).alloc, 0, companions=(victims.Companion(units.PodKey("ns/boss"), 10),))
    assert victims.on_node(state, 0, [member], share(600), priority=5) is None


def gang_setup(*names_: str, gpus: int = 1) -> tuple[fleet.FleetState, core_ledger.Ledger, core_placer.Placer]:
    state = state_of(*names_, gpus=gpus)
    return state, core_ledger.Ledger(state), core_placer.Placer(state, policies.make("binpack"))


def placed(ledger: core_ledger.Ledger, tenants: list[victims.Tenant]) -> None:
    for t in tenants:
        assert ledger.assume(t.alloc).ok


def snapshot(state: fleet.FleetState) -> list[np.ndarray]:
    return [a.copy() for a in (state.milli_free, state.gmem_free, state.tenants, state.affinity_tag, state.version)]


def test_a_gang_preempts_across_nodes_the_lowest_priorities_it_can_and_no_more() -> None:
    """Two one-GPU nodes, each with a tenant of priority 1 (400 milli) and one of priority 5 (500): a
    gang of two 600-milli members needs both priority-1 tenants gone and nothing more; the
    priority-5 tenants stay (reprieved), and the fleet is left exactly as it was."""
    state, ledger, placer = gang_setup("a", "b")
    tenants = [
        tenant("low-a", 400, 1, where="a"), tenant("mid-a", 500, 5, where="a"),
        tenant("low-b", 400, 1, where="b"), tenant("mid-b", 500, 5, where="b"),
    ]  # fmt: skip
    placed(ledger, tenants)
    members = [pod(f"ns/w{i}", count=1, milli=500) for i in range(2)]
    plan = functools.partial(core_gangs.plan, ledger, placer, members, 2)
    assert not plan().status.ok
    before = snapshot(state)[:4]
    found = victims.for_gang(state, tenants, plan, priority=10)
    assert found is not None
    assert sorted(names(found.victims)) == ["low-a", "low-b"] and found.priorities == (1, 1)
    assert found.nodes == ("a", "b") and len(found.allocations) == 2
    assert all(np.array_equal(x, y) for x, y in zip(before, snapshot(state)[:4], strict=True))
    assert not plan().status.ok, "the live fleet is as it was: the gang still does not fit"


def test_a_gangs_victims_spare_the_pods_a_disruption_budget_protects_where_others_make_room() -> None:
    state, ledger, placer = gang_setup("a")
    tenants = [tenant("p", 500, 1), tenant("q", 500, 1)]
    placed(ledger, tenants)
    members = [pod("ns/w0", count=1, milli=500)]
    plan = functools.partial(core_gangs.plan, ledger, placer, members, 1)
    found = victims.for_gang(state, tenants, plan, priority=10)
    assert found is not None and names(found.victims) == ["q"] and found.violations == 0, "of equals, by name"
    guarded = [tenants[0], dataclasses.replace(tenants[1], budgets=("ns/keep",))]
    spared = victims.for_gang(state, guarded, plan, priority=10, allowed={"ns/keep": 0})
    assert spared is not None and names(spared.victims) == ["p"] and spared.violations == 0
    both = [dataclasses.replace(t, budgets=("ns/keep",)) for t in tenants]
    broken = victims.for_gang(state, both, plan, priority=10, allowed={"ns/keep": 0})
    assert broken is not None and len(broken.victims) == 1 and broken.violations == 1, "broken, not stopped"


def test_a_gang_takes_a_higher_level_only_when_the_lower_one_is_not_enough() -> None:
    state, ledger, placer = gang_setup("a", "b")
    tenants = [tenant("p1", 300, 1, where="a"), tenant("p3", 1000, 3, where="b")]
    placed(ledger, tenants)
    members = [pod(f"ns/w{i}", count=1, milli=1000) for i in range(2)]
    plan = functools.partial(core_gangs.plan, ledger, placer, members, 2)
    found = victims.for_gang(state, tenants, plan, priority=4)
    assert found is not None and sorted(names(found.victims)) == ["p1", "p3"]
    assert victims.for_gang(state, tenants, plan, priority=3) is None, "p3 is not below 3: no plan"


def test_a_gang_that_fits_once_leaving_pods_go_preempts_nothing_and_waits_only_for_those_in_its_way() -> None:
    state, ledger, placer = gang_setup("a", "b", "c")
    tenants = [
        tenant("going", 1000, 0, where="a", leaving=True), tenant("low", 1000, 0, where="b"),
        tenant("stuck", 300, 0, where="c", leaving=True), tenant("busy", 700, 9, where="c"),
    ]  # fmt: skip
    placed(ledger, tenants)
    members = [pod("ns/w0", count=1, milli=1000)]
    found = victims.for_gang(state, tenants, functools.partial(core_gangs.plan, ledger, placer, members, 1), 5)
    assert found is not None and found.victims == () and names(found.leaving) == ["going"], found


def test_a_gangs_victim_takes_its_own_gang_along() -> None:
    state, ledger, placer = gang_setup("a", "b", "c")
    mate = units.PodKey("ns/mate")
    tenants = [
        victims.Tenant(tenant("m", 1000, 0, where="a").alloc, 0, companions=(victims.Companion(mate, 0),)),
        victims.Tenant(
            tenant("mate", 1000, 0, where="c").alloc, 0, companions=(victims.Companion(units.PodKey("ns/m"), 0),)
        ),
        tenant("other", 1000, 2, where="b"),
    ]
    placed(ledger, tenants)
    members = [pod(f"ns/w{i}", count=1, milli=1000) for i in range(2)]
    found = victims.for_gang(state, tenants, functools.partial(core_gangs.plan, ledger, placer, members, 2), 5)
    assert found is not None
    assert sorted(names(found.victims)) == ["m", "mate"], "the low gang goes whole; priority 2 stays"


def test_a_lone_victim_a_gang_taken_later_makes_needless_is_put_back() -> None:
    """One GPU: gang {z 400 (oldest), y 300 (newest)} and a lone x 300, all of priority 1; a pod of
    priority 5 asks 600. z is put back, x is taken, then y with z: z and y free 700, so x is put back
    (a review found x deleted as well: one victim more than needed)."""
    state = state_of("a")
    z = tenant("z", 400, 1, created="2026-01-01T00:00:00Z")
    x = tenant("x", 300, 1, created="2026-01-02T00:00:00Z")
    y = tenant("y", 300, 1, created="2026-01-03T00:00:00Z")
    z = dataclasses.replace(z, companions=(victims.Companion(units.PodKey("ns/y"), 1),))
    y = dataclasses.replace(y, companions=(victims.Companion(units.PodKey("ns/z"), 1),))
    plan = victims.on_node(state, 0, [z, x, y], share(600), priority=5)
    assert plan is not None and sorted(names(plan.victims)) == ["y", "z"]
