"""Gang plans: all or nothing, at least the minimum, the ledger left as it was, packed onto few nodes,
kept within one domain of the gang's topology label, the tightest that holds it, and within a node
on one NVLink island."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from sharegpu.core import devices, fleet, gangs, policies
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from tests.conftest import node, pod


def setup(*nodes: object, policy: str = "binpack") -> tuple[core_ledger.Ledger, core_placer.Placer]:
    state = fleet.FleetState(list(nodes))  # type: ignore[arg-type]
    return core_ledger.Ledger(state), core_placer.Placer(state, policies.make(policy))


def test_a_gang_that_fits_is_planned_whole_and_the_ledger_is_left_as_it_was() -> None:
    ledger, placer = setup(node("a", gpus=4), node("b", gpus=4))
    before = ledger.state.milli_free.copy()
    members = [pod(f"ns/w{i}", count=1, milli=500) for i in range(6)]
    found = gangs.plan(ledger, placer, members, need=6)
    assert found.status.ok, found.status.message
    assert sorted(a.pod for a in found.allocations) == sorted(m.key for m in members)
    assert not found.left
    assert np.array_equal(ledger.state.milli_free, before) and len(ledger) == 0
    for alloc in found.allocations:  # the plan is assumable as it stands, member after member
        assert ledger.assume(alloc).ok


def test_a_gang_is_packed_onto_as_few_nodes_as_hold_it_even_under_spread() -> None:
    ledger, placer = setup(node("a", gpus=4), node("b", gpus=4), node("c", gpus=4), policy="spread")
    members = [pod(f"ns/w{i}", count=1, milli=1000) for i in range(4)]
    found = gangs.plan(ledger, placer, members, need=4)
    assert found.status.ok and found.nodes == 1


def test_members_that_keep_apart_get_a_topology_value_each_and_avoid_those_already_taken() -> None:
    ledger, placer = setup(node("a", gpus=4), node("b", gpus=4), node("c", gpus=4), node("d", gpus=4))
    members = [pod(f"ns/w{i}", count=1, milli=1000) for i in range(3)]
    hosts = np.arange(4, dtype=np.int64)  # one value per node
    racks = np.array([0, 0, 1, 1], dtype=np.int64)
    one_per_node = gangs.Apart({m.key: ("host",) for m in members}, {"host": hosts})
    found = gangs.plan(ledger, placer, members, need=3, apart=one_per_node)
    assert found.status.ok and found.nodes == 3, "packed, all three would share one node"
    # One per rack: two racks hold two of the three; with a member running in rack 0, one.
    per_rack = gangs.Apart({m.key: ("rack",) for m in members}, {"rack": racks})
    assert not gangs.plan(ledger, placer, members, need=3, apart=per_rack).status.ok
    assert len(gangs.plan(ledger, placer, members, need=2, apart=per_rack).allocations) == 2
    running = gangs.Apart(per_rack.keys, per_rack.values, {"rack": frozenset({0})})
    found = gangs.plan(ledger, placer, members, need=1, apart=running)
    assert len(found.allocations) == 1 and found.allocations[0].node in ("c", "d") and len(found.left) == 2
    # A member that does not keep apart packs beside the one that does.
    mixed = gangs.Apart({members[0].key: ("host",)}, {"host": hosts})
    assert gangs.plan(ledger, placer, members, need=3, apart=mixed).nodes == 1


def test_nothing_is_planned_when_fewer_than_the_minimum_fit() -> None:
    ledger, placer = setup(node("a", gpus=2), node("b", gpus=2))
    members = [pod(f"ns/w{i}", count=1, milli=1000) for i in range(5)]
    found = gangs.plan(ledger, placer, members, need=5)
    assert not found.status.ok and found.allocations == ()
    assert "fewer than 5 of 5" in found.status.message
    assert len(ledger) == 0


def test_a_minimum_below_the_size_plans_every_member_that_fits_and_names_the_rest() -> None:
    ledger, placer = setup(node("a", gpus=2), node("b", gpus=2))
    members = [pod(f"ns/w{i}", count=1, milli=1000) for i in range(5)]
    found = gangs.plan(ledger, placer, members, need=3)
    assert found.status.ok and len(found.allocations) == 4 and len(found.left) == 1


def test_too_few_members_waiting_is_refused_before_any_placement() -> None:
    ledger, placer = setup(node("a", gpus=8))
    found = gangs.plan(ledger, placer, [pod("ns/w0", count=1, milli=100)], need=2)
    assert not found.status.ok and "1 member(s) wait, the gang needs 2" in found.status.message


def test_the_gang_stays_in_one_domain_the_tightest_that_holds_it() -> None:
    nodes = [node("r1a", gpus=4), node("r1b", gpus=4), node("r2a", gpus=4), node("r2b", gpus=4)]
    ledger, placer = setup(*nodes)
    # rack 2 is half full: the gang of 4 whole GPUs fits in either rack, rack 2 is the tighter one
    ledger.assume(placer.allocation_on(pod("ns/other", count=4, milli=1000), 2, (0, 1, 2, 3)))
    racks = [gangs.Domain("r1", np.array([0, 1])), gangs.Domain("r2", np.array([2, 3]))]
    found = gangs.plan(ledger, placer, [pod(f"ns/w{i}", count=1, milli=1000) for i in range(4)], 4, racks)
    assert found.status.ok and found.domain == "r2"
    assert {a.node for a in found.allocations} == {"r2b"}
    # six members fit in no single rack's free room of 4 (rack 2) or... rack 1 holds 8: rack 1
    found = gangs.plan(ledger, placer, [pod(f"ns/v{i}", count=1, milli=1000) for i in range(6)], 6, racks)
    assert found.status.ok and found.domain == "r1"
    assert {a.node for a in found.allocations} == {"r1a", "r1b"}


def test_a_gang_split_across_domains_is_refused_though_the_cluster_has_room() -> None:
    ledger, placer = setup(node("r1a", gpus=2), node("r2a", gpus=2))
    racks = [gangs.Domain("r1", np.array([0])), gangs.Domain("r2", np.array([1]))]
    members = [pod(f"ns/w{i}", count=1, milli=1000) for i in range(3)]
    assert gangs.plan(ledger, placer, members, 3).status.ok, "without a topology the cluster holds it"
    found = gangs.plan(ledger, placer, members, 3, racks)
    assert not found.status.ok and "any of 0 domain(s)" in found.status.message


def test_the_largest_members_are_placed_first() -> None:
    ledger, placer = setup(node("a", gpus=2))
    # in arrival order the two halves would split both GPUs and the whole GPU would not fit
    members = [pod("ns/h1", count=1, milli=500), pod("ns/h2", count=1, milli=500), pod("ns/w", count=1, milli=1000)]
    found = gangs.plan(ledger, placer, members, need=3)
    assert found.status.ok and len(found.allocations) == 3


def test_a_new_node_is_opened_where_the_most_remaining_members_fit() -> None:
    ledger, placer = setup(node("a", gpus=2), node("b", gpus=2), node("c", gpus=2))
    ledger.assume(placer.allocation_on(pod("ns/other", count=1, milli=600), 0, (0,)))
    members = [pod(f"ns/w{i}", count=1, milli=600) for i in range(4)]
    found = gangs.plan(ledger, placer, members, need=4)
    assert found.status.ok and found.nodes == 2 and {a.node for a in found.allocations} == {"b", "c"}


def islands(name: str) -> devices.NodeInventory:
    """Eight GPUs in two NVLink islands of four (0-3 and 4-7), as an HGX board split in halves is."""
    base = node(name, gpus=8)
    links = frozenset(p for half in (range(4), range(4, 8)) for p in itertools.combinations(half, 2))
    return dataclasses.replace(base, nvlinks=links)


def test_a_gangs_members_on_one_node_share_an_nvlink_island() -> None:
    ledger, placer = setup(islands("a"))
    for i, gpu in enumerate((1, 2, 3)):  # others hold three GPUs of the first island: 0 and 4-7 are free
        assert ledger.assume(placer.allocation_on(pod(f"ns/o{i}", count=1, milli=1000), 0, (gpu,))).ok
    alone = placer.decide(pod("ns/x", count=1, milli=1000).demand)
    members = [pod(f"ns/w{i}", count=1, milli=1000) for i in range(3)]
    found = gangs.plan(ledger, placer, members, need=3)
    assert found.status.ok
    gpus = sorted(g for a in found.allocations for g in a.gpu_indices)
    assert alone.gpus == (0,), "the policy alone would start on GPU 0, cut off from the others"
    assert gpus in ([4, 5, 6], [4, 5, 7], [4, 6, 7], [5, 6, 7]), f"one island for the whole gang: {gpus}"


def test_a_gang_of_multi_gpu_members_takes_the_island_with_room_for_all() -> None:
    ledger, placer = setup(islands("a"))
    for i, gpu in enumerate((0, 1)):
        assert ledger.assume(placer.allocation_on(pod(f"ns/o{i}", count=1, milli=1000), 0, (gpu,))).ok
    alone = placer.decide(pod("ns/x", count=2, milli=1000).demand)
    members = [pod("ns/big", count=2, milli=1000), pod("ns/small", count=2, milli=1000)]
    found = gangs.plan(ledger, placer, members, need=2)
    gpus = {g for a in found.allocations for g in a.gpu_indices}
    assert alone.gpus == (2, 3), "alone, a pair would take what is left of the first island"
    assert gpus == {4, 5, 6, 7}, f"the gang's four GPUs on one island: {gpus}"


def test_island_choice_leaves_shared_members_to_the_policy() -> None:
    ledger, placer = setup(islands("a"))
    members = [pod(f"ns/w{i}", count=1, milli=300) for i in range(3)]
    found = gangs.plan(ledger, placer, members, need=3)
    assert {g for a in found.allocations for g in a.gpu_indices} == {0}, "binpack: one GPU shared by all three"
