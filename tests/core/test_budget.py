"""GPU time: weights, periods and usage (core.budget)."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharegpu.api import budgets
from sharegpu.core import allocation, budget, errors, units
from tests.builders import MakeAllocation

DAY = budget.SECONDS_PER_DAY
POD = units.PodKey("ns/p")


def alloc(*grants: tuple[int, int, int]) -> allocation.Allocation:
    """An allocation of (GPU index, milli, memory MiB) grants in one container."""
    return MakeAllocation(POD, "n").grants(*grants).obj()


def test_a_pods_weight_is_the_larger_share_of_each_gpu_summed() -> None:
    sixteen = {0: 16384, 1: 16384, 2: 16384}
    assert budget.weight(alloc((0, 500, 0), (1, 500, 0), (2, 500, 0)), sixteen) == 1500
    assert budget.weight(alloc((0, 200, 8192)), sixteen) == 500, "half the memory keeps half the GPU"
    assert budget.weight(alloc((0, 1, 1)), sixteen) == 1, "a sliver of memory rounds up to 1 milli"
    assert budget.weight(alloc((0, 1000, 0), (1, 1000, 0)), sixteen) == 2000


def test_usage_counts_only_the_period_and_up_to_now() -> None:
    period = budget.window(anchor=0, days=30, now=31 * DAY)
    assert (period.start, period.end) == (30 * DAY, 60 * DAY)
    holdings = [
        budget.Holding(units.PodKey("ns/old"), 1000, start=29 * DAY, end=30 * DAY + 3600),  # 1 h inside
        budget.Holding(units.PodKey("ns/half"), 500, start=30 * DAY + 7200),  # still running
        budget.Holding(units.PodKey("ns/before"), 1000, start=0, end=DAY),  # an earlier period
    ]
    used = budget.used(holdings, period, now=31 * DAY)
    assert used == {units.PodKey("ns/old"): 1000 * 3600, units.PodKey("ns/half"): 500 * (DAY - 7200)}
    assert budget.gpu_seconds(sum(used.values())) == 3600 + (DAY - 7200) // 2


@given(
    st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 10 * DAY), st.integers(0, 10 * DAY)), max_size=20),
    st.integers(0, 12 * DAY),
)
def test_usage_is_additive_over_consecutive_periods(spans: list[tuple[int, int, int]], now: int) -> None:
    """Two periods of one day add up to what one two-day period counts, for any holdings."""
    holdings = [budget.Holding(POD, w, min(a, b), max(a, b)) for w, a, b in spans]
    two = budget.Window(0, 2 * DAY)
    first, second = budget.Window(0, DAY), budget.Window(DAY, 2 * DAY)
    total = sum(budget.used(holdings, two, now).values())
    assert total == sum(budget.used(holdings, first, now).values()) + sum(budget.used(holdings, second, now).values())


def test_states_and_bad_input() -> None:
    assert budget.state(79, 100, 80) == budget.WITHIN
    assert budget.state(80, 100, 80) == budget.WARNING
    assert budget.state(100, 100, 80) == budget.EXHAUSTED
    assert set(typing.get_args(budgets.State)) == {budget.WITHIN, budget.WARNING, budget.EXHAUSTED}
    with pytest.raises(errors.InvalidInputError, match=r"ends .* before it starts"):
        budget.Holding(POD, 10, start=10, end=5)
    with pytest.raises(errors.InvalidInputError, match="at least one day"):
        budget.window(0, 0, 5)
