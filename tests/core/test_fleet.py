"""The fleet's arrays: built from inventories (names unique, nodes of different sizes side by side,
isolation and compute-enforcing modes as bits), changed only by applying allocations and holds (each
a new version of its node), and read back as the ledger and placement need them (memory by ratio,
recounts equal to the running totals)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sharegpu.core import devices, errors, fleet, requests
from tests.builders import MakeAllocation
from tests.conftest import node


def test_nodes_of_different_sizes_share_one_width_and_names_are_unique() -> None:
    state = fleet.FleetState([node("a", gpus=1), node("b", gpus=4, model="A100", memory=81920)])
    assert state.width == 4 and state.names == ("a", "b") and state.row("b") == 1 and state.row("x") is None
    assert state.present.tolist() == [[True, False, False, False], [True, True, True, True]]
    assert state.milli_capacity.sum(axis=1).tolist() == [1000, 4000] and state.total_milli == 5000
    assert state.gmem_capacity[1].tolist() == [81920] * 4
    assert state.model_mask({"A100"}, slice(None)).tolist() == [[False] * 4, [True] * 4]
    with pytest.raises(errors.InvalidInventoryError, match="unique"):
        fleet.FleetState([node("a"), node("a")])


def test_isolation_modes_are_bits_and_compute_counts_only_where_offered() -> None:
    mps, hami = devices.Isolation.MPS, devices.Isolation.HAMI_CORE
    offers = dataclasses.replace(node("a"), isolation=frozenset({mps, hami}), compute_isolation=frozenset({mps}))
    claims = dataclasses.replace(node("b"), compute_isolation=frozenset({hami}))  # enforces what it does not offer
    state = fleet.FleetState([offers, claims])
    assert state.isolation.tolist() == [mps.bit | hami.bit, 0]
    assert state.compute_isolation.tolist() == [mps.bit, 0]


def test_applying_an_allocation_and_taking_it_back_restores_every_array() -> None:
    state = fleet.FleetState([node("a", gpus=2, cpu=8000)])
    before = state.recount([])
    placed = MakeAllocation("ns/p", "a").grant(1, milli=300, memory=2048).host(cpu_milli=500, memory_mib=0).obj()
    version = int(state.version[0])
    state.apply(placed, +1)
    assert (int(state.milli_free[0, 1]), int(state.gmem_free[0, 1]), int(state.tenants[0, 1])) == (700, 14336, 1)
    assert int(state.cpu_free[0]) == 7500 and state.allocated_milli == 300
    assert int(state.version[0]) == version + 1, "a change is a new version of its node (caches key on it)"
    assert state.same_usage(state.recount([placed])), "the running totals equal a recount"
    state.apply(placed, -1)
    assert state.same_usage(before)


def test_holding_gpus_bumps_the_version_and_letting_go_needs_a_hold() -> None:
    state = fleet.FleetState([node("a", gpus=2)])
    state.hold(0, [0], +1)
    assert state.held[0].tolist() == [1, 0] and int(state.version[0]) == 1
    state.hold(0, [0], -1)
    assert state.held[0].tolist() == [0, 0]
    with pytest.raises(AssertionError, match="were not held"):
        state.hold(0, [1], -1)


def test_memory_by_ratio_resolves_per_gpu_and_never_below_the_mib_asked() -> None:
    state = fleet.FleetState([node("a", gpus=1, memory=16384), node("b", gpus=1, memory=81920)])
    by_ratio = requests.GpuDemand(count=1, milli=300, memory_permille=250)
    assert state.memory_need(by_ratio, slice(None))[:, 0].tolist() == [4096, 20480]
    both = requests.GpuDemand(count=1, milli=300, memory_permille=250, memory_mib=8192)
    assert state.memory_need(both, np.array([0, 1]))[:, 0].tolist() == [8192, 20480]


def test_a_device_claims_share_is_counted_apart_from_the_pods() -> None:
    state = fleet.FleetState([node("n", 2)])
    pod = MakeAllocation("ns/p", "n").grant(0, 300, container="m").obj()
    claim = dataclasses.replace(
        MakeAllocation("ns/c#claim", "n").grant(0, 200, container="gpu").obj(), device_claim=True
    )
    whole = dataclasses.replace(
        MakeAllocation("ns/w#claim", "n").grant(1, 1000, container="gpu").obj(), device_claim=True, exclusive=True
    )
    before = fleet.FleetState([node("n", 2)])
    for alloc in (pod, claim, whole):
        state.apply(alloc, +1)
    assert state.tenants[0, :2].tolist() == [2, 1] and state.claimed[0, :2].tolist() == [1, 0]
    assert state.exclusive[0, :2].tolist() == [0, 1], "a whole claim counts as exclusive, not as a share"
    assert not state.same_usage(before)
    for alloc in (pod, claim, whole):
        state.apply(alloc, -1)
    assert state.same_usage(before) and not state.claimed.any()
