"""The ledger never over-commits a GPU, whatever the order of calls (Hypothesis stateful test)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from sharegpu.core import allocation, fleet, ledger, requests, status, units
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


class LedgerMachine(RuleBasedStateMachine):
    pods = Bundle("pods")

    def __init__(self) -> None:
        super().__init__()
        self.state = fleet.FleetState(NODES)
        self.book = ledger.Ledger(self.state)

    @rule(target=pods, alloc=allocations())
    def assume(self, alloc: allocation.Allocation) -> units.PodKey:
        known = alloc.pod in self.book
        result = self.book.assume(alloc)
        if known:
            assert result.code is status.Code.CONFLICT
        return alloc.pod

    @rule(target=pods, alloc=allocations())
    def add(self, alloc: allocation.Allocation) -> units.PodKey:
        before = self.book.get(alloc.pod)
        result = self.book.add(alloc)
        if not result.ok:
            assert self.book.get(alloc.pod) == before, "a refused add must change nothing"
        return alloc.pod

    @rule(pod=pods)
    def forget(self, pod: units.PodKey) -> None:
        entry = self.book.get(pod)
        result = self.book.forget(pod)
        assert result.ok == (entry is not None and entry.phase is ledger.Phase.ASSUMED)
        if result.ok:
            assert pod not in self.book
            assert not self.book.forget(pod).ok, "forget works exactly once"

    @rule(pod=pods)
    def remove(self, pod: units.PodKey) -> None:
        known = pod in self.book
        assert self.book.remove(pod).ok == known
        assert pod not in self.book

    @invariant()
    def never_over_committed(self) -> None:
        s = self.state
        assert (s.milli_free >= 0).all() and (s.gmem_free >= 0).all()
        assert (s.cpu_free >= 0).all() and (s.mem_free >= 0).all()
        assert (s.milli_free <= s.milli_capacity).all()

    @invariant()
    def free_is_derived_from_the_allocations(self) -> None:
        assert self.state.same_usage(self.state.recount(self.book.allocations()))

    @invariant()
    def cotenancy_rules_hold(self) -> None:
        per_gpu: dict[tuple[str, int], list[allocation.Allocation]] = {}
        for alloc in self.book.allocations():
            for index in alloc.gpu_usage():
                per_gpu.setdefault((alloc.node, index), []).append(alloc)
        for tenants in per_gpu.values():
            if len(tenants) < 2:
                continue
            assert not any(t.exclusive for t in tenants)
            assert len({t.cotenancy.affinity for t in tenants}) == 1
            assert len({t.cotenancy.group for t in tenants}) == 1
            assert len({t.cotenancy.exclusion for t in tenants} - {None}) <= 1
            anti = [t.cotenancy.anti_affinity for t in tenants if t.cotenancy.anti_affinity]
            assert len(anti) == len(set(anti))


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestLedger = LedgerMachine.TestCase


def test_assumed_pods_expire_on_the_injected_clock() -> None:
    now = [100.0]
    state = fleet.FleetState(NODES)
    book = ledger.Ledger(state, clock=lambda: now[0])
    grant = allocation.DeviceGrant(0, 500, 0, 500)
    alloc = allocation.Allocation(
        units.PodKey("ns/x"), units.NodeName("a"), (allocation.ContainerAllocation("m", (grant,)),)
    )
    assert book.assume(alloc).ok
    now[0] = 129.0
    assert book.assumed_before(30) == []
    now[0] = 130.0
    assert book.assumed_before(30) == ["ns/x"]
    assert int(state.milli_free[0, 0]) == 500, "a query: nothing is forgotten until the owner says so"
    assert book.forget(units.PodKey("ns/x")).ok
    assert book.assumed_before(30) == []


def test_add_confirms_an_assumed_pod_and_replaces_a_different_one() -> None:
    state = fleet.FleetState(NODES)
    book = ledger.Ledger(state)
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
    assert book.assume(first).ok
    assert book.add(first).ok and book.get(units.PodKey("ns/x")).phase is ledger.Phase.ADDED  # type: ignore[union-attr]
    assert not book.forget(units.PodKey("ns/x")).ok, "a confirmed pod cannot be forgotten"
    assert book.add(moved).ok
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
    loaded, added = ledger.Ledger(fleet.FleetState(NODES)), ledger.Ledger(fleet.FleetState(NODES))
    for book in (loaded, added):
        for alloc in existing:
            book.add(alloc)
    outcome = loaded.load(batch)
    expected = [added.add(a) for a in batch]
    assert [s.ok for s in outcome] == [s.ok for s in expected]
    assert dict(loaded.entries()).keys() == dict(added.entries()).keys()
    assert loaded.state.same_usage(added.state)
    assert np.array_equal(loaded.state.version > 0, added.state.version > 0)
    assert loaded.state.node_shapes == added.state.node_shapes


def test_load_of_many_fitting_pods_takes_the_vectorised_path() -> None:
    book = ledger.Ledger(fleet.FleetState(NODES))
    grants = [allocation.DeviceGrant(i % 4, 200, 100, 200) for i in range(12)]
    batch = [
        allocation.Allocation(
            units.PodKey(f"ns/p{i}"), units.NodeName("b"), (allocation.ContainerAllocation("m", (g,)),)
        )
        for i, g in enumerate(grants)
    ]
    assert all(s.ok for s in book.load(batch))
    assert book.state.milli_free[1].tolist() == [400, 400, 400, 400]
    assert book.state.recount(book.allocations()).same_usage(book.state)
