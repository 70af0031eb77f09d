"""The gang simulation: the generated workload's shape, all-or-nothing policies never hold GPUs for a
gang that is not running while per-pod placement does, and sharegpu packs gangs onto fewer nodes."""

from __future__ import annotations

import itertools

import pytest

from sharegpu.core import devices, requests
from sharegpu.sim import gangs


def test_the_workload_has_gangs_of_the_stated_sizes_and_single_pods() -> None:
    jobs = gangs.workload(seed=3, jobs=400, gang_share=0.25)
    sizes = [len(j.members) for j in jobs if j.gang]
    assert set(sizes) <= set(gangs.SIZES) and 70 <= len(sizes) <= 130
    assert all(len({(m.demand.count, m.demand.milli) for m in j.members}) == 1 for j in jobs if j.gang)
    assert all(a.arrival <= b.arrival for a, b in itertools.pairwise(jobs))
    assert gangs.workload(seed=3, jobs=400, gang_share=0.25) == jobs, "a seed gives one workload"


def node(name: str, gpus: int) -> devices.NodeInventory:
    return devices.uniform_node(
        name, gpu_count=gpus, model="T4", gpu_memory_mib=16384, cpu_milli=64000, memory_mib=1 << 20
    )


def deadlock() -> list[gangs.Job]:
    """Two gangs of three on two nodes of two GPUs: one at a time fits; taken member by member, each
    holds part of the room and neither ever runs."""

    def gang(tag: str, arrival: float) -> gangs.Job:
        members = tuple(requests.simple_pod(f"{tag}-{i}", count=1) for i in range(3))
        return gangs.Job(arrival, 100.0, members)

    # arrival order interleaved the way a queue of members meets them: a0 a1 | b0 b1 | ...
    return [gang("a", 0.0), gang("b", 0.0)]


@pytest.mark.parametrize("policy", ["sharegpu", "volcano", "kai"])
def test_all_or_nothing_runs_both_gangs_one_after_the_other_and_holds_nothing_idle(policy: str) -> None:
    result = gangs.GangReplay([node("a", 2), node("b", 2)], deadlock(), policy, seed=0).run()
    assert result.gangs_run == 2 and result.stuck == 0
    assert result.partial_gpu_hours == 0.0
    assert result.gang_wait_p50_s == pytest.approx(50.0), "waits 0 and 100 s: the second waits for the first"


def test_without_gang_scheduling_members_hold_gpus_and_gangs_can_deadlock() -> None:
    result = gangs.GangReplay([node("a", 2), node("b", 2)], deadlock(), "none", seed=0).run()
    assert result.gangs_run < 2 or result.partial_gpu_hours > 0
    assert result.partial_gpu_hours > 0, "members placed before their gang runs hold GPUs"


def test_sharegpu_packs_a_gang_onto_fewer_nodes_than_per_pod_placement() -> None:
    members = tuple(requests.simple_pod(f"g-{i}", count=1) for i in range(4))
    cluster = [node("small-1", 2), node("small-2", 2), node("big", 4)]
    packed = gangs.GangReplay(cluster, [gangs.Job(0.0, 10.0, members)], "sharegpu", seed=0).run()
    assert packed.nodes_per_gang == 1.0


def test_an_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown gang policy 'slurm'"):
        gangs.GangReplay([node("a", 1)], [], "slurm", seed=0)


def test_a_small_run_reports_every_figure() -> None:
    result = gangs.run("sharegpu", seed=1, jobs=150)
    assert result.gangs > 0 and result.gangs_run == result.gangs and result.partial_gpu_hours == 0.0
    assert 0 < result.mean_allocated_gpu_pct < 100 and result.nodes_per_gang >= 1
