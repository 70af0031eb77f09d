"""The share prices of `fgd-lp`: the knapsack against brute force, the LP's prices against the LP
over every pattern, the averaged table's properties, and the choice the prices make."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize

from sharegpu.core import errors, frag, policies, prices
from sharegpu.core import placer as core_placer
from tests.builders import MakeAllocation
from tests.conftest import ledger, node, pod

WHOLE = 1000


def _fillings(sizes: list[int], room: int) -> list[tuple[int, ...]]:
    """Every count of each size (any number of each) whose sum fits in `room`."""
    ranges = [range(room // size + 1) for size in sizes]
    return [c for c in itertools.product(*ranges) if sum(k * s for k, s in zip(c, sizes, strict=True)) <= room]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(90, 999), min_size=1, max_size=3, unique=True),
    values=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    rooms=st.lists(st.integers(0, WHOLE), min_size=1, max_size=5),
)
def test_knapsack_is_the_best_filling_of_every_room(sizes: list[int], values: list[float], rooms: list[int]) -> None:
    values = values[: len(sizes)]
    best, pattern = prices.knapsack(sizes, values)
    for room in [*rooms, WHOLE]:
        brute = max(sum(k * v for k, v in zip(c, values, strict=True)) for c in _fillings(sizes, room))
        assert best[room] == pytest.approx(brute, abs=1e-9)
    assert sum(int(k) * s for k, s in zip(pattern, sizes, strict=True)) <= WHOLE, "the pattern fits one GPU"
    assert sum(int(k) * v for k, v in zip(pattern, values, strict=True)) == pytest.approx(best[WHOLE], abs=1e-9)


def test_knapsack_refuses_a_size_of_nothing_or_over_a_gpu() -> None:
    with pytest.raises(errors.InvalidInputError, match=r"1\.\.1000"):
        prices.knapsack([0, 300], [0.1, 0.2])
    with pytest.raises(errors.InvalidInputError, match=r"1\.\.1000"):
        prices.knapsack([1200], [1.0])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(150, 900), min_size=1, max_size=4, unique=True),
    parts=st.lists(st.floats(0.01, 1), min_size=4, max_size=4),
)
def test_the_prices_are_the_dual_of_the_packing_lp_over_every_pattern(sizes: list[int], parts: list[float]) -> None:
    sizes = sorted(sizes)
    parts = parts[: len(sizes)]
    found = prices.prices(sizes, parts, [])
    # The LP over every pattern (every filling of one GPU), solved directly.
    every = np.array([c for c in _fillings(sizes, WHOLE) if any(c)], dtype=np.float64).T
    direct = optimize.linprog(np.ones(every.shape[1]), A_ub=-every, b_ub=-np.array(parts), method="highs")
    assert np.all(found >= 0)
    assert prices.knapsack(sizes, found.tolist())[0][WHOLE] <= 1 + 1e-9, "no pattern is worth more than a GPU"
    assert float(found @ np.array(parts)) == pytest.approx(direct.fun, rel=1e-7), "worth the LP's optimum"


def test_small_shares_that_fit_beside_the_large_ones_are_free() -> None:
    # 810s leave 190 that only a 160 fills, and there are fewer 160s than 810s: the 160s cost no GPU.
    found = prices.prices([160, 470, 810], [0.1, 0.4, 0.5], [])
    assert found.tolist() == pytest.approx([0.0, 0.5, 1.0])


@settings(max_examples=20, deadline=None)
@given(mix=st.dictionaries(st.integers(50, 950), st.floats(0.001, 1), min_size=1, max_size=6))
def test_what_a_gpu_can_still_hold_grows_with_its_room_from_nothing_to_at_most_one_gpu(
    mix: dict[int, float],
) -> None:
    held = prices.held_value(tuple(mix.items()), draws=4)
    assert held[0] == 0
    assert np.all(np.diff(held) >= -1e-12)
    assert held.max() <= 1 + 1e-9
    assert not held.flags.writeable, "the cached table is shared: read-only"


def test_held_value_is_computed_once_per_mix_and_refuses_what_is_no_share() -> None:
    mix = ((230, 0.3), (470, 0.5), (810, 0.2))
    assert prices.held_value(mix) is prices.held_value(tuple(reversed(mix)))
    nearly = ((230, 0.3), (470, 0.5001), (810, 0.2))  # less than a share in CONCENTRATION apart
    assert prices.held_value(nearly) is prices.held_value(mix)
    moved = ((230, 0.3), (470, 0.6), (810, 0.2))
    assert prices.held_value(moved) is not prices.held_value(mix)
    assert not prices.held_value(()).any(), "no one-GPU share: nothing to price"
    with pytest.raises(errors.InvalidInputError, match=r"sizes 1\.\.999"):
        prices.held_value(((1000, 0.5),))
    with pytest.raises(errors.InvalidInputError, match="parts > 0"):
        prices.held_value(((300, 0.0),))


DEFAULT_MIX: prices.Mix = ((810, 0.14), (650, 0.03), (590, 0.01), (550, 0.01), (470, 0.1), (460, 0.015))
DEFAULT_MIX += ((370, 0.006), (320, 0.04), (230, 0.016), (220, 0.006), (160, 0.007))
"""The one-GPU shares of openb's default trace, weights rounded."""
LP_SHAPES = tuple(frag.WeightedShape(frag.Shape(0, milli, 1), weight) for milli, weight in DEFAULT_MIX)


def test_fgd_lp_keeps_a_lone_650_for_the_320_the_tightest_packings_pair_it_with() -> None:
    b = ledger(node("n", 2))
    assert b.add(MakeAllocation("ns/big", "n").grant(1, 650, container="m").obj()).ok
    share = pod("ns/p", count=1, milli=230)

    def decide(name: str) -> core_placer.Decision:
        return core_placer.Placer(b.state, policies.make(name, LP_SHAPES)).decide(share.demand)

    # Beside the 650 the 230 leaves 120, which only the rare 160 could have filled, where the LP packs
    # 650 + 320. `fgd-fill` prices a 120 gap about as it prices the 770 a free GPU would keep (which
    # the common sizes do not all fill either), so FGD's own term, which favours the GPU in use, decides.
    # The LP's prices: the 650's GPU loses what its 350 could hold (a 320, about a third), a free GPU
    # only the 230's own quarter (its 770 can still hold 470 + 230 or three 230s).
    held = prices.held_value(frag.share_mix(LP_SHAPES))
    assert held[1000] - held[770] < held[350] - held[120]
    assert decide("fgd-fill").gpus == (1,)
    assert decide("fgd-lp").gpus == (0,)
    assert policies.DEFAULT == "fgd-lp"
