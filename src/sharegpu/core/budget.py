"""GPU time: what a pod's holding costs, summed over a budget's period. Pure arithmetic, no I/O.

A pod holds, on each of its GPUs, a compute share (milli-GPU) and memory; its *weight* on a GPU is
the larger of the two as a fraction of that GPU (a pod with 20% of the compute and half the memory
keeps half the GPU from others), and its weight is the sum over its GPUs, in milli-GPU: 3 GPUs at
500 milli weigh 1500. Usage is weight x time held, kept in milli-GPU-seconds (integers) and shown
in GPU-seconds (a whole GPU for a second is one).

Periods are fixed windows of `days` days counted from an anchor: usage within the current window is
what counts against the budget; a holding that started before the window counts from its start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sharegpu.core import allocation, errors, units

SECONDS_PER_DAY = 86_400
WITHIN = "Within"
WARNING = "Warning"
EXHAUSTED = "Exhausted"


@dataclass(frozen=True, slots=True)
class Holding:
    """A pod's GPU holding: its weight (milli-GPU over every GPU) from `start` to `end` (whole
    seconds, as the API's timestamps; None: still held)."""

    pod: units.PodKey
    weight: int
    start: int
    end: int | None = None

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise errors.InvalidInputError(f"{self.pod}: a holding's weight is not negative, got {self.weight}")
        if self.end is not None and self.end < self.start:
            raise errors.InvalidInputError(f"{self.pod}: a holding ends ({self.end}) before it starts ({self.start})")


def weight(alloc: allocation.Allocation, memory_of: Mapping[int, int]) -> int:
    """The pod's weight in milli-GPU: per GPU the larger of its compute share and its share of the
    GPU's memory (`memory_of`: GPU index -> the GPU's memory in MiB), summed over its GPUs."""
    total = 0
    for index, (milli, memory) in alloc.gpu_usage().items():
        capacity = memory_of.get(index, 0)
        memory_milli = -(-memory * units.MILLI_PER_GPU // capacity) if capacity and memory else 0
        total += min(units.MILLI_PER_GPU, max(milli, memory_milli))
    return total


@dataclass(frozen=True, slots=True)
class Window:
    """One period of a budget: [start, end) in seconds."""

    start: int
    end: int


def window(anchor: int, days: int, now: int) -> Window:
    """The period that holds `now`, periods of `days` days counted from `anchor`."""
    if days < 1:
        raise errors.InvalidInputError(f"a budget period is at least one day, got {days}")
    length = days * SECONDS_PER_DAY
    start = anchor + ((now - anchor) // length) * length
    return Window(start, start + length)


def held_in(held: Holding, period: Window, now: int) -> int:
    """The holding's milli-GPU-seconds within the period, up to `now`."""
    begin = max(held.start, period.start)
    finish = min(held.end if held.end is not None else now, period.end, now)
    return held.weight * (finish - begin) if finish > begin else 0


def used(holdings: Iterable[Holding], period: Window, now: int) -> dict[units.PodKey, int]:
    """Per pod, its milli-GPU-seconds within the period up to `now` (pods with none are left out)."""
    out: dict[units.PodKey, int] = {}
    for held in holdings:
        spent = held_in(held, period, now)
        if spent:
            out[held.pod] = out.get(held.pod, 0) + spent
    return out


def gpu_seconds(milli_seconds: int) -> int:
    """milli-GPU-seconds as whole GPU-seconds (rounded down)."""
    return milli_seconds // units.MILLI_PER_GPU


def state(used_gpu_seconds: int, budget_gpu_seconds: int, warn_at_percent: int) -> str:
    """Within, Warning (at or past the warning share) or Exhausted (at or past the budget)."""
    if used_gpu_seconds >= budget_gpu_seconds:
        return EXHAUSTED
    if used_gpu_seconds * 100 >= budget_gpu_seconds * warn_at_percent:
        return WARNING
    return WITHIN
