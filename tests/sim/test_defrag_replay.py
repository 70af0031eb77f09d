"""The simulator's defragmentation option (dynamic mode) on the embedded synthetic workload: it moves
pods, never more per hour of virtual time than its budget, and allocates no less than without it."""

from __future__ import annotations

import bisect
from typing import Any

import pytest

from sharegpu.core import devices, policies
from sharegpu.sim import replay, runner, synthetic, trace

BUDGET = 10


@pytest.fixture(scope="module")
def world() -> tuple[list[devices.NodeInventory], trace.Trace]:
    return synthetic.cluster(), synthetic.workload()


def test_defragmenting_moves_pods_within_its_budget_and_allocates_no_less(
    world: tuple[list[devices.NodeInventory], trace.Trace],
) -> None:
    nodes, pods = world
    off = replay.replay_dynamic(nodes, pods.pods, policies.make("bestfit"), seed=42)
    on = replay.replay_dynamic(nodes, pods.pods, policies.make("bestfit"), seed=42, defrag_budget_per_hour=BUDGET)
    assert off.evictions == 0 and off.eviction_times == ()
    assert on.evictions > 0 and len(on.eviction_times) == on.evictions
    times = list(on.eviction_times)
    assert times == sorted(times)
    for i, start in enumerate(times):  # no hour holds more evictions than the budget
        assert bisect.bisect_left(times, start + 3600.0) - i <= BUDGET
    assert on.mean_allocated_pct >= off.mean_allocated_pct
    assert on.wait_p99 <= off.wait_p99
    assert on.never_placed == off.never_placed == 0
    assert len(on.waits) == len(off.waits) == on.pods


def test_a_negative_budget_is_refused(world: tuple[list[devices.NodeInventory], trace.Trace]) -> None:
    nodes, pods = world
    with pytest.raises(ValueError, match="defrag_budget_per_hour"):
        replay.replay_dynamic(nodes, pods.pods[:10], policies.make("bestfit"), seed=1, defrag_budget_per_hour=-1)


def test_the_runner_passes_the_budget_and_reports_evictions(
    world: tuple[list[devices.NodeInventory], trace.Trace], monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes, pods = world
    seen: list[int] = []
    real = replay.replay_dynamic

    def small(*args: Any, defrag_budget_per_hour: int = 0) -> replay.DynamicResult:
        seen.append(defrag_budget_per_hour)
        return real(nodes, pods.pods[:400], *args[2:], defrag_budget_per_hour=defrag_budget_per_hour)

    monkeypatch.setattr(replay, "replay_dynamic", small)
    source = runner.Source(runner.SYNTHETIC)
    result = runner.execute(runner.RunSpec(source, "bestfit", 42, mode="dynamic", time_scale=4.0, defrag_budget=3))
    assert seen == [3]
    assert result.evictions is not None and result.evictions >= 0
    assert runner.execute(runner.RunSpec(source, "bestfit", 42)).evictions is None
