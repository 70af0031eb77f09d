"""bench/share_packing.py's packing figures: the LP bound and best-fit decreasing against brute force."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import bench_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with bench_script("share_packing") as module:
        yield module


def fewest_gpus(items: list[int]) -> int:
    """Brute force: the fewest GPUs of 1000 milli that hold every item (each item to one GPU)."""
    for gpus in range(1, len(items) + 1):
        for assignment in itertools.product(range(gpus), repeat=len(items)):
            load = [0] * gpus
            for item, gpu in zip(items, assignment, strict=True):
                load[gpu] += item
            if max(load) <= 1000:
                return gpus
    return 0


@pytest.mark.parametrize(
    ("items", "lp", "bfd"),
    [
        ([500, 500, 500], 1.5, 2),
        ([600, 600], 2.0, 2),
        ([810, 190], 1.0, 1),
        ([470, 470, 530, 530], 2.0, 2),
        ([600, 400, 600, 400], 2.0, 2),
        ([810, 810, 160], 2.0, 2),
        ([], 0.0, 0),
    ],
)
def test_known_packings(bench: ModuleType, items: list[int], lp: float, bfd: int) -> None:
    assert bench.lp_gpus(items) == pytest.approx(lp, abs=1e-6)
    assert bench.bfd_gpus(items) == bfd


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([110, 160, 230, 320, 370, 460, 470, 550, 650, 810]), min_size=1, max_size=6))
def test_the_lp_bounds_every_packing_and_bfd_is_one(bench: ModuleType, items: list[int]) -> None:
    lp = bench.lp_gpus(items)
    best = fewest_gpus(items)
    assert sum(items) / 1000 - 1e-6 <= lp
    assert math.ceil(lp - 1e-6) <= best <= bench.bfd_gpus(items)
