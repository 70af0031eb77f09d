"""The peers' placement policies, each pinned to the choices its system's documentation and sources
describe, on small hand-made clusters (two T4 nodes of two GPUs unless said otherwise)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from sharegpu.core import devices, fleet, policies, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from sharegpu.sim import catalog, peers
from tests.builders import MakeAllocation
from tests.conftest import node, pod

_serial = itertools.count()


def cluster(*nodes: devices.NodeInventory) -> core_ledger.Ledger:
    return core_ledger.Ledger(fleet.FleetState(list(nodes) or [node("n0"), node("n1")]))


def holding(ledger: core_ledger.Ledger, where: str, index: int, milli: int, memory: int = 0, cpu: int = 0) -> None:
    """A pod already there: `milli` (and `memory` MiB) of GPU `index` of node `where`."""
    made = MakeAllocation(f"ns/held{next(_serial)}", where).grant(index, milli, memory).host(cpu, 0)
    assert ledger.add(made.obj()).ok


def place(ledger: core_ledger.Ledger, policy: str, **request: int) -> tuple[str, tuple[int, ...]]:
    """Where `policy` puts a one-container pod asking `request` (count 1 unless said)."""
    request.setdefault("count", 1)
    chooser = core_placer.Placer(ledger.state, catalog.make(policy))
    decision = chooser.decide(pod(f"ns/new{next(_serial)}", **request).demand)
    assert decision.status.ok and decision.node is not None, decision.status
    return str(decision.node), tuple(decision.gpus)


def test_every_peer_is_registered_with_its_system_version_and_sources() -> None:
    for cls in peers.PEERS:
        assert catalog.REGISTRY[cls.name] is cls
        assert cls.name not in policies.REGISTRY, "the components take sharegpu's policies only"
        assert cls.system.split()[0] in {"HAMi", "Koordinator", "Volcano", "Aliyun", "KAI"} and " v" in cls.system
        assert cls.source and cls.summary
    assert set(peers.DEFAULTS) <= set(catalog.REGISTRY)


# ----------------------------------------------------------------------------------------------- HAMi


def test_hami_default_packs_nodes_and_spreads_over_the_node_s_gpus() -> None:
    ledger = cluster()
    holding(ledger, "n0", 0, 500, 8192)
    # binpack node: n0 is fuller; spread GPU: gpu1 (emptier) inside it.
    assert place(ledger, "hami-binpack-spread", milli=200) == ("n0", (1,))
    assert place(ledger, "hami-binpack-binpack", milli=200) == ("n0", (0,)), "the fullest GPU that fits"
    assert place(ledger, "hami-spread-spread", milli=200) == ("n1", (1,)), "emptiest node; full tie: later GPU"
    assert place(ledger, "hami-spread-binpack", milli=200) == ("n1", (1,)), "full tie on an empty node: later GPU"


def test_hami_counts_pods_per_gpu_as_well_as_compute_and_memory() -> None:
    ledger = cluster(node("n0", 2))
    for _ in range(3):
        holding(ledger, "n0", 0, 100, 2730)
    holding(ledger, "n0", 1, 400, 8190)
    # With the pod (100 milli; memory, unnamed, read as 1638 MiB): gpu0 has 4 of 10 slots, 400 of 1000
    # milli, 9828 of 16384 MiB: 10*(0.4+0.4+0.6) = 14; gpu1 2 slots, 500 milli, the same memory: 13.
    assert place(ledger, "hami-binpack-binpack", milli=100) == ("n0", (0,))
    assert place(ledger, "hami-binpack-spread", milli=100) == ("n0", (1,))


def test_hami_multi_gpu_requests_take_the_first_in_its_order() -> None:
    ledger = cluster(node("n0", 4))
    holding(ledger, "n0", 1, 600)
    # spread: the emptiest first, full ties from the later index: 3, 2, then 0.
    assert place(ledger, "hami-binpack-spread", count=2, milli=300) == ("n0", (2, 3))
    assert place(ledger, "hami-binpack-binpack", count=2, milli=300) == ("n0", (1, 3))


def test_hami_numa_takes_the_highest_numa_node_s_gpus_first_however_used() -> None:
    plain = node("n0", 4)
    swapped = tuple(dataclasses.replace(gpu, numa_node=1 - gpu.index // 2) for gpu in plain.gpus)
    ledger = cluster(dataclasses.replace(plain, gpus=swapped))  # GPUs 0 and 1 on NUMA node 1
    holding(ledger, "n0", 1, 600)
    assert place(ledger, "hami-binpack-numa", milli=100) == ("n0", (1,)), "NUMA 1, the higher index, though used"
    assert place(ledger, "hami-binpack-spread", milli=100) == ("n0", (3,)), "the default: an empty GPU"
    assert place(ledger, "hami-binpack-numa", count=2, milli=300) == ("n0", (0, 1))
    holding(ledger, "n0", 1, 400)
    assert place(ledger, "hami-binpack-numa", milli=100) == ("n0", (0,)), "GPU 1 is full: NUMA 1's other GPU"


@pytest.mark.parametrize("policy", ["hami-binpack-binpack", "volcano-binpack"])
def test_hami_and_volcano_put_at_most_ten_pods_on_a_gpu(policy: str) -> None:
    ledger = cluster(node("n0", 1), node("n1", 1))
    for _ in range(9):
        holding(ledger, "n0", 0, 50)
    assert place(ledger, policy, milli=50) == ("n0", (0,)), "the fuller GPU, its tenth slot"
    holding(ledger, "n0", 0, 50)
    # Half of n0's GPU is free, but its ten slots are taken: n1, where sharegpu's own fit would not look.
    assert place(ledger, policy, milli=50) == ("n1", (0,))
    assert place(ledger, "bestfit", milli=50)[0] == "n0", "sharegpu counts no slots"


# ---------------------------------------------------------------------------------------- Koordinator


def test_koordinator_default_spreads_by_gpu_memory_and_takes_the_lowest_minor_on_ties() -> None:
    ledger = cluster()
    holding(ledger, "n0", 1, 200, 4096)
    assert place(ledger, "koordinator-spread", milli=300, memory_mib=2048) == ("n1", (0,))
    ledger = cluster(node("n0"))
    holding(ledger, "n0", 0, 200, 4096)
    assert place(ledger, "koordinator-spread", milli=300, memory_mib=2048) == ("n0", (1,)), "most free memory"
    assert place(ledger, "koordinator-binpack", milli=300, memory_mib=2048) == ("n0", (0,)), "MostAllocated packs"


def test_koordinator_scores_memory_not_compute() -> None:
    ledger = cluster(node("n0"))
    holding(ledger, "n0", 0, 300, 1024)  # more compute, less memory (its 300 milli read as 4915 MiB)
    holding(ledger, "n0", 1, 200, 8192)  # less compute, more memory
    assert place(ledger, "koordinator-binpack", milli=100, memory_mib=1024) == ("n0", (1,))


# -------------------------------------------------------------------------------------------- Volcano


def test_volcano_default_takes_gpus_from_the_highest_index() -> None:
    ledger = cluster(node("n0", 4))
    assert place(ledger, "volcano", milli=300) == ("n0", (3,))
    assert place(ledger, "volcano", count=2, milli=300) == ("n0", (2, 3))


def test_volcano_binpack_takes_the_gpu_with_most_memory_in_use_and_spread_the_one_with_fewest_pods() -> None:
    ledger = cluster(node("n0", 3))
    holding(ledger, "n0", 0, 100, 1024)
    holding(ledger, "n0", 0, 100, 1024)
    holding(ledger, "n0", 1, 200, 6144)
    assert place(ledger, "volcano-binpack", milli=100, memory_mib=1024) == ("n0", (1,))
    assert place(ledger, "volcano-spread", milli=100, memory_mib=1024) == ("n0", (2,))


def test_volcano_binpack_prefers_the_node_whose_chosen_gpu_is_fullest() -> None:
    ledger = cluster()
    holding(ledger, "n1", 0, 500, 8192)
    assert place(ledger, "volcano-binpack", milli=100, memory_mib=1024) == ("n1", (0,))


# --------------------------------------------------------------------------------------------- Aliyun


def test_aliyun_takes_the_gpu_with_least_free_memory_and_leaves_the_node_to_kube_scheduler() -> None:
    ledger = cluster(node("n0", 3))
    holding(ledger, "n0", 0, 100, 2048)
    holding(ledger, "n0", 2, 100, 12288)
    assert place(ledger, "aliyun-gpushare", milli=100, memory_mib=2048) == ("n0", (2,)), "best fit on memory"
    assert place(ledger, "aliyun-gpushare", milli=100, memory_mib=8192) == ("n0", (0,)), "gpu2 has too little"
    ledger = cluster()
    holding(ledger, "n0", 0, 100, 1024, cpu=16000)
    # LeastAllocated on CPU and memory: n1 has the more CPU free, whatever the GPUs.
    assert place(ledger, "aliyun-gpushare", milli=100, memory_mib=1024, cpu_milli=1000) == ("n1", (0,))


# ------------------------------------------------------------------------------------------------ KAI


def test_kai_binpack_puts_fractions_on_shared_gpus_first_the_fullest_of_them() -> None:
    ledger = cluster(node("n0", 3), node("n1", 3))
    holding(ledger, "n1", 0, 300, 4096)
    holding(ledger, "n1", 2, 600, 8192)
    holding(ledger, "n0", 0, 1000, 16384)  # n0: a whole GPU taken, none shared
    assert place(ledger, "kai-binpack", milli=200) == ("n1", (2,)), "a node with a shared GPU; the fullest"
    assert place(ledger, "kai-binpack", milli=500) == ("n1", (0,)), "the fullest shared GPU it fits"


def test_kai_binpack_without_shared_gpus_packs_nodes_with_fewest_idle_gpus_and_spread_the_opposite() -> None:
    ledger = cluster(node("n0", 3), node("n1", 3))
    holding(ledger, "n1", 0, units.MILLI_PER_GPU, 16384)
    assert place(ledger, "kai-binpack", milli=units.MILLI_PER_GPU) == ("n1", (1,))
    assert place(ledger, "kai-spread", milli=units.MILLI_PER_GPU) == ("n0", (0,))


def test_kai_spread_puts_a_fraction_on_an_idle_gpu_before_a_shared_one() -> None:
    ledger = cluster(node("n0", 2))
    holding(ledger, "n0", 0, 200, 2048)
    assert place(ledger, "kai-spread", milli=200) == ("n0", (1,))
    assert place(ledger, "kai-binpack", milli=200) == ("n0", (0,))


@pytest.mark.parametrize("name", [cls.name for cls in peers.PEERS if cls is not peers.HamiBinpackMutex])
def test_every_peer_places_only_where_sharegpu_s_fit_allows(name: str) -> None:
    """(HAMi's mutex offers neither GPU here, both being in use: its own test says so.)"""
    ledger = cluster(node("n0", 2))
    holding(ledger, "n0", 0, 900, 1024)  # memory to spare, no compute
    holding(ledger, "n0", 1, 100, 8192)
    assert place(ledger, name, milli=200, memory_mib=2048) == ("n0", (1,)), "the one GPU both fit"


def test_hami_topology_aware_keeps_the_best_linked_gpus_for_sets_and_gives_them_to_sets() -> None:
    linked = dataclasses.replace(node("n0", 4), nvlinks=frozenset({(0, 1)}))  # only GPUs 0 and 1 NVLinked
    ledger = cluster(linked)
    assert place(ledger, "hami-binpack-topology", milli=300) == ("n0", (2,)), "a lone GPU off the link (lowest index)"
    ledger = cluster(linked)
    assert place(ledger, "hami-binpack-topology", count=2, milli=1000) == ("n0", (0, 1)), "the NVLinked pair"


def test_hami_mutex_offers_only_gpus_nobody_uses_and_a_node_without_one_does_not_fit() -> None:
    ledger = cluster()
    holding(ledger, "n0", 0, 100)
    assert place(ledger, "hami-binpack-mutex", milli=100) == ("n0", (1,)), "the fuller node, its unused GPU"
    holding(ledger, "n0", 1, 100)
    assert place(ledger, "hami-binpack-mutex", milli=100) == ("n1", (1,)), "n0 has none left: n1"
    assert place(ledger, "hami-binpack-spread", milli=100) == ("n0", (1,)), "the default shares n0's GPUs"
