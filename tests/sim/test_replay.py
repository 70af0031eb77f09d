from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.core import ledger as core_ledger
from sharegpu.core import policies, requests
from sharegpu.sim import replay, runner, synthetic, trace


@pytest.fixture(scope="module")
def world() -> tuple[list, trace.Trace]:  # type: ignore[type-arg]
    return synthetic.cluster(), synthetic.workload(pods=800)


def test_workload_puts_the_shuffled_trace_first_and_stops_at_tune(world: tuple[list, trace.Trace]) -> None:  # type: ignore[type-arg]
    nodes, pods = world
    small = pods.pods[:100]
    capacity = 10 * sum(p.gpu_milli_total for p in small)
    workload = replay.build_workload(small, capacity, len(nodes), 1.3, seed=7)
    assert sorted(p.name for p in workload.pods[:100]) == sorted(p.name for p in small)
    total = sum(p.gpu_milli_total for p in workload.pods)
    assert total <= 1.3 * capacity
    assert total > 1.3 * capacity - 8000, "stops only when the next pod would overshoot"
    assert sorted(workload.node_priority.tolist()) == list(range(len(nodes)))
    again = replay.build_workload(small, capacity, len(nodes), 1.3, seed=7)
    assert [p.name for p in again.pods] == [p.name for p in workload.pods]


def test_a_workload_of_pods_that_ask_for_no_gpu_is_refused(world: tuple[list, trace.Trace]) -> None:  # type: ignore[type-arg]
    nodes, pods = world
    idle = tuple(dataclasses.replace(p, num_gpu=0, gpu_milli=0) for p in pods.pods[:3])
    assert all(p.gpu_milli_total == 0 for p in idle)
    with pytest.raises(ValueError, match="no pod asks for a GPU"):
        replay.build_workload(idle, 10_000, len(nodes), 1.3, seed=7)


def test_static_replay_never_allocates_more_than_arrived(world: tuple[list, trace.Trace]) -> None:  # type: ignore[type-arg]
    nodes, pods = world
    capacity = sum(n.gpu_count for n in nodes) * 1000
    workload = replay.build_workload(pods.pods, capacity, len(nodes), 1.3, seed=1)
    shapes = pods.typical_shapes()
    result = replay.replay_static(nodes, workload, policies.make("fgd", shapes), shapes, seed=1)
    assert (result.allocated_pct <= result.arrived_pct + 1e-9).all()
    assert (np.diff(result.allocated_pct) >= 0).all()
    assert result.allocated_pct[-1] <= 100
    assert result.placed + result.failed == len(workload.pods)
    assert 0 <= result.unallocated_pct_at_100 < 30
    assert 0 <= result.frag_pct_at_100 <= 100


def test_the_hook_at_100_sees_the_ledger_once(world: tuple[list, trace.Trace]) -> None:  # type: ignore[type-arg]
    nodes, pods = world
    capacity = sum(n.gpu_count for n in nodes) * 1000
    workload = replay.build_workload(pods.pods, capacity, len(nodes), 1.3, seed=1)
    shapes = pods.typical_shapes()
    seen: list[int] = []

    def look(ledger: core_ledger.Ledger) -> None:
        seen.append(sum(milli for alloc in ledger.allocations() for milli, _ in alloc.gpu_usage().values()))

    result = replay.replay_static(nodes, workload, policies.make("fgd", shapes), shapes, seed=1, at_100=look)
    first = int(np.flatnonzero(np.round(result.arrived_pct) >= 100)[0])
    assert len(seen) == 1
    assert seen[0] == round(result.allocated_pct[first] * capacity / 100)


def test_dynamic_replay_places_or_drops_every_pod(world: tuple[list, trace.Trace]) -> None:  # type: ignore[type-arg]
    nodes, pods = world
    result = replay.replay_dynamic(nodes, pods.pods, policies.make("bestfit"), seed=3)
    assert result.pods == len(pods.pods)
    assert len(result.waits) + result.never_placed == result.pods
    assert (result.waits >= 0).all()
    assert (np.diff(result.times) >= 0).all()
    assert (result.allocated_pct >= 0).all()
    assert (result.allocated_pct <= 100).all()
    assert 0 < result.mean_allocated_pct <= 100


def test_a_time_scale_raises_the_load_and_the_waits(world: tuple[list, trace.Trace]) -> None:  # type: ignore[type-arg]
    nodes, pods = world
    calm = replay.replay_dynamic(nodes, pods.pods, policies.make("bestfit"), seed=3)
    busy = replay.replay_dynamic(nodes, pods.pods, policies.make("bestfit"), seed=3, time_scale=4.0)
    assert busy.mean_allocated_pct > calm.mean_allocated_pct
    assert busy.wait_p99 >= calm.wait_p99
    assert busy.times[-1] < calm.times[-1]
    with pytest.raises(ValueError, match="time_scale must be > 0"):
        replay.replay_dynamic(nodes, pods.pods, policies.make("bestfit"), seed=3, time_scale=0)


def test_dynamic_replay_is_deterministic(world: tuple[list, trace.Trace]) -> None:  # type: ignore[type-arg]
    nodes, pods = world
    a = replay.replay_dynamic(nodes, pods.pods[:300], policies.make("fgd", pods.typical_shapes()), seed=5)
    b = replay.replay_dynamic(nodes, pods.pods[:300], policies.make("fgd", pods.typical_shapes()), seed=5)
    np.testing.assert_array_equal(a.allocated_pct, b.allocated_pct)
    np.testing.assert_array_equal(a.waits, b.waits)


def test_runner_runs_in_processes_and_keeps_order() -> None:
    specs = [runner.RunSpec(runner.Source(runner.SYNTHETIC), p, s) for p in ("bestfit", "random") for s in (1, 2)]
    results = runner.run_all(specs, jobs=2)
    assert [(r.policy, r.seed) for r in results] == [("bestfit", 1), ("bestfit", 2), ("random", 1), ("random", 2)]
    serial = runner.run_all(specs[:1], jobs=1)
    assert serial[0].unallocated_gpu_pct_at_arrived_100 == results[0].unallocated_gpu_pct_at_arrived_100


SIZES = st.tuples(st.integers(1, 2), st.sampled_from([250, 500, 700, 1000]), st.integers(0, 4))


@settings(max_examples=200, deadline=None)
@given(st.lists(SIZES, max_size=40), st.lists(st.integers(0, 1000), min_size=2, max_size=4), st.integers(0, 6),
       st.sets(st.integers(0, 39)))  # fmt: skip
def test_a_retry_places_exactly_what_trying_every_pod_in_order_would(
    sizes: list[tuple[int, int, int]], free: list[int], cpu: int, done: set[int]
) -> None:
    """The waiting queue passes over pods that cannot fit (they need at least as much as one that
    did not) and stops trying a demand once it failed: the outcome is that of offering every pod."""
    demand = [requests.GpuDemand(count=c, milli=m, cpu_milli=k) for c, m, k in sizes]

    def room() -> Callable[[int], bool]:
        milli, cores, tried = list(free), [cpu], []

        def place(index: int) -> bool:
            d = demand[index]
            tried.append(index)
            gpus = [g for g, f in enumerate(milli) if (f == 1000 if d.whole else f >= d.milli)][: d.count]
            if len(gpus) < d.count or d.cpu_milli > cores[0]:
                return False
            for g in gpus:
                milli[g] -= d.milli
            cores[0] -= d.cpu_milli
            return True

        return place

    waiting = replay.Waiting(lambda index: demand[index])
    for index in range(len(sizes)):
        waiting.append(index)
    waiting.discard({i for i in done if i < len(sizes)})
    left = [i for i in range(len(sizes)) if i not in done]
    assert list(waiting) == left and len(waiting) == len(left)
    every = room()
    expected = [i for i in left if not every(i)]
    waiting.retry(room())
    assert list(waiting) == expected and len(waiting) == len(expected)
