"""The ledger's decisions never over-commit a GPU, whatever the order of calls; the facts it is given
are always counted, and exactly the GPUs they over-commit are blocked (Hypothesis stateful test)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from sharegpu.core import allocation, fleet, requests, status, units
from sharegpu.core import ledger as core_ledger
from tests.conftest import node

NODES = [node("a", 2, memory=1000, cpu=4000, host_memory=4000), node("b", 4, memory=2000, cpu=8000, host_memory=8000)]
GPU_MEMORY = {"a": [1000, 1000], "b": [2000] * 4}
LABELS = st.sampled_from([None, "x", "y"])


@st.composite
def allocations(draw: st.DrawFn) -> allocation.Allocation:
    name = draw(st.sampled_from(["a", "b"]))
    width = len(GPU_MEMORY[name])
    key = units.PodKey(f"ns/p{draw(st.integers(0, 7))}")
    whole = draw(st.booleans())
    rules = requests.CoTenancy(
        affinity=draw(LABELS),
        anti_affinity=draw(LABELS),
        exclusion=draw(LABELS),
        group=draw(st.sampled_from([None, "g"])),
    )
    if whole:
        indices = draw(st.lists(st.integers(0, width - 1), min_size=1, max_size=width, unique=True))
        grants = tuple(allocation.DeviceGrant(i, 1000, GPU_MEMORY[name][i], 1000) for i in indices)
    else:
        index = draw(st.integers(0, width - 1))
        milli = draw(st.integers(1, 1000))
        grants = (allocation.DeviceGrant(index, milli, draw(st.integers(0, 1200)), milli),)
    return allocation.Allocation(
        pod=key,
        node=units.NodeName(name),
        containers=(allocation.ContainerAllocation("main", grants),),
        cpu_milli=draw(st.integers(0, 5000)),
        memory_mib=draw(st.integers(0, 5000)),
        cotenancy=rules,
        exclusive=whole,
    )


def violations(ledger: core_ledger.Ledger) -> set[tuple[str, int]]:
    """GPUs whose tenants break a rule, judged from the whole set of tenants (in no order): compute or
    memory over capacity, a whole GPU shared, mixed affinity or group labels, two exclusion labels,
    an anti-affinity label twice."""
    per_gpu: dict[tuple[str, int], list[allocation.Allocation]] = {}
    for alloc in ledger.allocations():
        for index in alloc.gpu_usage():
            per_gpu.setdefault((alloc.node, index), []).append(alloc)
    broken = set()
    for (node_name, index), tenants in per_gpu.items():
        milli = sum(t.gpu_usage()[index][0] for t in tenants)
        memory = sum(t.gpu_usage()[index][1] for t in tenants)
        anti = [t.cotenancy.anti_affinity for t in tenants if t.cotenancy.anti_affinity]
        if (
            milli > 1000
            or memory > GPU_MEMORY[node_name][index]
            or (len(tenants) > 1 and any(t.exclusive for t in tenants))
            or len({t.cotenancy.affinity for t in tenants}) > 1
            or len({t.cotenancy.group for t in tenants}) > 1
            or len({t.cotenancy.exclusion for t in tenants} - {None}) > 1
            or len(anti) != len(set(anti))
        ):
            broken.add((node_name, index))
    return broken


def blocked(ledger: core_ledger.Ledger) -> set[tuple[str, int]]:
    state = ledger.state
    return {(state.names[r], int(i)) for r, i in np.argwhere(state.blocked).tolist()}


class LedgerMachine(RuleBasedStateMachine):
    pods = Bundle("pods")

    def __init__(self) -> None:
        super().__init__()
        self.state = fleet.FleetState(NODES)
        self.ledger = core_ledger.Ledger(self.state)

    @rule(target=pods, alloc=allocations())
    def assume(self, alloc: allocation.Allocation) -> units.PodKey:
        known = alloc.pod in self.ledger
        before, closed = violations(self.ledger), blocked(self.ledger)
        result = self.ledger.assume(alloc)
        if known:
            assert result.code is status.Code.CONFLICT
        if result.ok:
            assert violations(self.ledger) <= before, "a decision never over-commits a GPU"
            assert not {(alloc.node, i) for i in alloc.gpu_usage()} & closed, "nothing new on a blocked GPU"
        else:
            assert self.ledger.get(alloc.pod) is None or known, "a refused assumption changes nothing"
        return alloc.pod

    @rule(target=pods, alloc=allocations())
    def add(self, alloc: allocation.Allocation) -> units.PodKey:
        result = self.ledger.add(alloc)
        entry = self.ledger.get(alloc.pod)
        assert entry is not None and entry.alloc == alloc, "a fact from the API server is always counted"
        assert entry.phase is core_ledger.Phase.ADDED
        landed = {(alloc.node, i) for i in alloc.gpu_usage()}
        if not result.ok and landed & violations(self.ledger):
            assert landed & blocked(self.ledger), "a pod that over-commits blocks the GPU it landed on"
        return alloc.pod

    @rule(pod=pods)
    def forget(self, pod: units.PodKey) -> None:
        entry = self.ledger.get(pod)
        result = self.ledger.forget(pod)
        assert result.ok == (entry is not None and entry.phase is core_ledger.Phase.ASSUMED)
        if result.ok:
            assert pod not in self.ledger
            assert not self.ledger.forget(pod).ok, "forget works exactly once"

    @rule(pod=pods)
    def remove(self, pod: units.PodKey) -> None:
        known = pod in self.ledger
        assert self.ledger.remove(pod).ok == known
        assert pod not in self.ledger

    @invariant()
    def every_over_committed_gpu_is_blocked(self) -> None:
        broken = violations(self.ledger)
        assert broken <= blocked(self.ledger)
        assert broken <= {(o.node, o.index) for o in self.ledger.overcommitted()}

    @invariant()
    def a_node_whose_tenants_fit_blocks_nothing(self) -> None:
        broken_nodes = {n for n, _ in violations(self.ledger)}
        for name in ("a", "b"):
            groups = [
                (a.cotenancy.group, i)
                for a in self.ledger.allocations()
                if a.node == name and a.cotenancy.group
                for i in a.gpu_usage()
            ]
            spread = any(len({i for g, i in groups if g == label}) > 1 for label, _ in groups)  # also blocked
            if name not in broken_nodes and not spread:
                assert not {i for n, i in blocked(self.ledger) if n == name}, f"node {name} fits but is blocked"

    @invariant()
    def free_is_derived_from_the_allocations(self) -> None:
        assert self.state.same_usage(self.state.recount(self.ledger.allocations()))
        assert (self.state.milli_free <= self.state.milli_capacity).all()


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLedger = LedgerMachine.TestCase


def test_assumed_pods_expire_on_the_injected_clock() -> None:
    now = [100.0]
    state = fleet.FleetState(NODES)
    ledger = core_ledger.Ledger(state, clock=lambda: now[0])
    grant = allocation.DeviceGrant(0, 500, 0, 500)
    alloc = allocation.Allocation(
        units.PodKey("ns/x"), units.NodeName("a"), (allocation.ContainerAllocation("m", (grant,)),)
    )
    assert ledger.assume(alloc).ok
    now[0] = 129.0
    assert ledger.assumed_before(30) == []
    now[0] = 130.0
    assert ledger.assumed_before(30) == ["ns/x"]
    assert int(state.milli_free[0, 0]) == 500, "a query: nothing is forgotten until the owner says so"
    assert ledger.forget(units.PodKey("ns/x")).ok
    assert ledger.assumed_before(30) == []


def test_add_confirms_an_assumed_pod_and_replaces_a_different_one() -> None:
    state = fleet.FleetState(NODES)
    ledger = core_ledger.Ledger(state)
    first = allocation.Allocation(
        units.PodKey("ns/x"),
        units.NodeName("a"),
        (allocation.ContainerAllocation("m", (allocation.DeviceGrant(0, 500, 0, 500),)),),
    )
    moved = allocation.Allocation(
        units.PodKey("ns/x"),
        units.NodeName("b"),
        (allocation.ContainerAllocation("m", (allocation.DeviceGrant(3, 700, 0, 700),)),),
    )
    assert ledger.assume(first).ok
    assert ledger.add(first).ok and ledger.get(units.PodKey("ns/x")).phase is core_ledger.Phase.ADDED  # type: ignore[union-attr]
    assert not ledger.forget(units.PodKey("ns/x")).ok, "a confirmed pod cannot be forgotten"
    assert ledger.add(moved).ok
    assert int(state.milli_free[0, 0]) == 1000 and int(state.milli_free[1, 3]) == 300
    np.testing.assert_array_equal(state.tenants.sum(), 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(allocations(), max_size=12, unique_by=lambda a: a.pod),
    st.lists(allocations(), max_size=3, unique_by=lambda a: a.pod),
    st.booleans(),
)
def test_load_is_sequential_add_however_it_ends(
    batch: list[allocation.Allocation], existing: list[allocation.Allocation], plain: bool
) -> None:
    if plain:  # mostly rule-less pods, as in a real cluster: the vectorised path is taken
        batch = [dataclasses.replace(a, cotenancy=requests.NO_RULES) for a in batch]
    loaded, added = core_ledger.Ledger(fleet.FleetState(NODES)), core_ledger.Ledger(fleet.FleetState(NODES))
    for ledger in (loaded, added):
        for alloc in existing:
            ledger.add(alloc)
    outcome = loaded.load(batch)
    expected = [added.add(a) for a in batch]
    assert [s.ok for s in outcome] == [s.ok for s in expected]
    assert dict(loaded.entries()).keys() == dict(added.entries()).keys()
    assert loaded.state.same_usage(added.state)
    assert np.array_equal(loaded.state.version > 0, added.state.version > 0)
    assert loaded.state.node_shapes == added.state.node_shapes


def test_load_of_many_fitting_pods_takes_the_vectorised_path() -> None:
    ledger = core_ledger.Ledger(fleet.FleetState(NODES))
    grants = [allocation.DeviceGrant(i % 4, 200, 100, 200) for i in range(12)]
    batch = [
        allocation.Allocation(
            units.PodKey(f"ns/p{i}"), units.NodeName("b"), (allocation.ContainerAllocation("m", (g,)),)
        )
        for i, g in enumerate(grants)
    ]
    assert all(s.ok for s in ledger.load(batch))
    assert ledger.state.milli_free[1].tolist() == [400, 400, 400, 400]
    assert ledger.state.recount(ledger.allocations()).same_usage(ledger.state)


def test_a_claim_loaded_in_a_batch_is_counted_as_added_one_by_one() -> None:
    """`load` promises what `add` in order does: a claim's `claimed` count was skipped by its
    vectorised step, and the claim's removal drove it below zero."""
    state = fleet.FleetState([node("n", 1)])
    ledger = core_ledger.Ledger(state)
    grants = (allocation.ContainerAllocation("c", (allocation.DeviceGrant(0, 300, 100, 300),)),)
    claim = allocation.Allocation(pod=units.PodKey("ns/claim"), node=units.NodeName("n"), containers=grants,
                                  device_claim=True)  # fmt: skip
    assert all(result.ok for result in ledger.load([claim]))
    assert np.array_equal(state.claimed, state.recount(ledger.allocations()).claimed)
    ledger.remove(claim.pod)
    assert (state.claimed == 0).all()
