"""What each one-GPU share size is worth when GPUs are packed as tightly as the workload allows, and
what a GPU's free compute can still hold at those prices (`fgd-lp`'s gap cost).

Packing the workload's one-GPU shares, in the proportions it asks for them, into as few GPUs as
possible is the cutting-stock LP of Gilmore and Gomory; its columns are the ways one GPU can be
filled (patterns). Its dual gives each size s a price p(s) >= 0 such that no pattern is worth more
than one GPU, and the patterns of an optimal packing exactly one. By duality the GPUs a packing of
the mix uses are the LP's optimum plus, GPU by GPU, one less the prices of the shares it holds: the
GPU's *slack*, which only the shares still to come can lower. A GPU with x milli free can gain at
most `held(x)`, the most price a set of sizes that fits in x is worth (an unbounded knapsack). A
share s placed on it raises the slack that GPU is sure to keep by `held(x) - held(x - s) - p(s)`;
p(s) is the same wherever the share goes, so a placer compares `held(x) - held(x - s)` across GPUs:
it puts the share where it takes the least of what the GPU could still hold. On openb's default
trace (prices 810: 1, 650, 590 and 550: 2/3, 470 and 460: 1/2, 320 and 370: 1/3, 230: 1/4, 220:
1/12, 160: 0) a 230 beside a lone 590 raises that GPU's slack by 1/12 (the 410 it leaves could hold
a 320 or 370, worth 1/3; the 180 after it nothing; less the 230's own 1/4), on a free GPU by
nothing (1 less the 3/4 that 770 can still hold, less the same 1/4).

The LP's prices are a vertex of a degenerate dual, and a small change in the mix can move them a
long way (on openb's default mix, when the small shares are a little rarer, all of them fit into
the gaps of the large ones and become free). `held_value` therefore averages `held` over the mixes a
sample of `CONCENTRATION` shares could show (Dirichlet draws around the mix), which both smooths
the jumps and, on openb, packs better than the exact mix's prices (docs/simulation.md). The mix is
first counted as such a sample would count it, so mixes that differ by less than one share in
`CONCENTRATION` share one table.

Pure: numpy and scipy's HiGHS (`scipy.optimize.linprog`, loaded at the first LP). A mix's table is
computed once (about 0.1 to 0.2 s: the draws share the patterns found, so each after the first
needs one or two LP solves) and kept (`held_value` caches the last mixes asked).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from sharegpu.core import errors, fleet, frag, units

WHOLE = units.MILLI_PER_GPU
DRAWS = 32
"""Mixes drawn around the workload's to average the prices' table over."""
CONCENTRATION = 2000.0
"""The draws' spread: the mixes a sample of this many shares could show (Dirichlet parameters: the
mix counted as such a sample, at least one of each size). Chosen on openb's tuning screen from
1000, 2000, 4000 and 8000 (docs/simulation.md)."""
_TOLERANCE = 1e-9

Mix = tuple[tuple[int, float], ...]
"""One-GPU share sizes (milli, 1..999) with their parts of the workload (> 0)."""


def knapsack(sizes: Sequence[int], values: Sequence[float]) -> tuple[frag.FloatArray, fleet.IntArray]:
    """The most value sizes (each any number of times) are worth within each room 0..1000 milli, and
    how many of each size a best filling of a whole GPU takes.

    One pass per size over all rooms at once (numpy), taking 0, 1, 2... of it; a size of 0 or more
    than a GPU is refused."""
    if any(not 0 < size <= WHOLE for size in sizes) or len(sizes) != len(values):
        raise errors.InvalidInputError(f"knapsack: sizes must be 1..{WHOLE} milli, one value each: {sizes}")
    best = np.zeros(WHOLE + 1, dtype=np.float64)
    taken: list[fleet.IntArray] = []
    for size, value in zip(sizes, values, strict=True):
        after = best.copy()
        count = np.zeros(WHOLE + 1, dtype=np.int64)
        for k in range(1, WHOLE // size + 1):
            candidate = best[: WHOLE + 1 - k * size] + k * value
            better = candidate > after[k * size :] + _TOLERANCE
            after[k * size :] = np.where(better, candidate, after[k * size :])
            count[k * size :] = np.where(better, k, count[k * size :])
        taken.append(count)
        best = after
    pattern = np.zeros(len(sizes), dtype=np.int64)
    room = WHOLE
    for i in range(len(sizes) - 1, -1, -1):
        pattern[i] = taken[i][room]
        room -= int(pattern[i]) * sizes[i]
    return best, pattern


def prices(sizes: Sequence[int], parts: Sequence[float], patterns: list[fleet.IntArray]) -> frag.FloatArray:
    """The cutting-stock LP's prices of `sizes` (the dual of: cover `parts` of each with the fewest
    GPUs), by column generation: solve over `patterns`, price the best filling of a GPU at the duals
    (`knapsack`), add it while it is worth more than one GPU. `patterns` (per size, how many one GPU
    takes) is read and extended in place, so calls for nearby mixes start from what earlier ones found;
    an empty list starts from one size per GPU."""
    from scipy import optimize

    if not patterns:
        patterns.extend(np.eye(len(sizes), dtype=np.int64)[i] * (WHOLE // size) for i, size in enumerate(sizes))
    need = np.asarray(parts, dtype=np.float64)
    while True:
        columns = np.array(patterns, dtype=np.float64).T
        solved = optimize.linprog(np.ones(len(patterns)), A_ub=-columns, b_ub=-need, bounds=(0, None), method="highs")
        if solved.status != 0:
            raise errors.InvalidInputError(f"the share packing LP did not solve: {solved.message}")
        duals = np.maximum(-np.asarray(solved.ineqlin.marginals, dtype=np.float64), 0.0)
        best, pattern = knapsack(sizes, duals.tolist())
        if best[WHOLE] <= 1 + _TOLERANCE:
            return duals
        patterns.append(pattern)


def held_value(mix: Mix, draws: int = DRAWS, concentration: float = CONCENTRATION) -> frag.FloatArray:
    """Per free compute x of a GPU (0..1000 milli): the most LP price the mix's shares that fit in x
    are worth, averaged over `draws` mixes drawn around `mix` (the module docstring says why). 0
    everywhere for a workload with no one-GPU shares; 1 at most, 0 at 0, never lower for more room.
    Read-only: the table is shared by every caller asking for the same mix."""
    if not mix:
        empty = np.zeros(WHOLE + 1, dtype=np.float64)
        empty.setflags(write=False)
        return empty
    if any(not 0 < size < WHOLE or not part > 0 for size, part in mix) or draws < 1 or concentration < 1:
        raise errors.InvalidInputError(f"held_value: sizes 1..{WHOLE - 1} milli with parts > 0, draws >= 1: {mix}")
    total = sum(part for _, part in mix)
    # The mix as a sample of `concentration` shares would count it (at least one of each size): mixes
    # nearer than that are one, so a mix learned from live pods is priced again only when it moved.
    counted = tuple(sorted((size, max(1, round(part / total * concentration))) for size, part in mix))
    return _held(counted, draws)


@functools.lru_cache(maxsize=8)
def _held(counted: tuple[tuple[int, int], ...], draws: int) -> frag.FloatArray:
    sizes = [size for size, _ in counted]
    rng = np.random.default_rng(0)
    patterns: list[fleet.IntArray] = []
    total = np.zeros(WHOLE + 1, dtype=np.float64)
    for _ in range(draws):
        drawn = rng.dirichlet([float(count) for _, count in counted])
        total += knapsack(sizes, prices(sizes, drawn.tolist(), patterns).tolist())[0]
    table = total / draws
    table.setflags(write=False)
    return table
