"""GPU fragmentation as the FGD paper measures it, vectorised over nodes and GPUs.

A node's fragmentation is the GPU compute it has free but that the workload is unlikely to use:
for each typical pod shape (weighted by how often it occurs), if the shape fits the node, the free
compute on GPUs too small for the shape counts; if it does not fit at all (too little CPU, too few
GPUs, wrong model, or a shape with no GPU), all the node's free GPU compute counts. Memory plays no
part. The typical shapes are the most popular ones covering 95% of a reference workload's pods.

`FragModel.frag` evaluates many nodes at once; `frag_after` evaluates hypothetical placements (a
fractional pod on each eligible GPU of each node, or whole GPUs taken) as deltas of cached per-node,
per-shape aggregates, without materialising every hypothetical node. `unfillable` says, per free
compute of a GPU, what no sum of the workload's common share sizes fills (`fgd-fill`'s gap cost);
`share_mix` the one-GPU share sizes it and `prices` (`fgd-lp`'s) start from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sharegpu.core import fleet, units

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True, order=True)
class Shape:
    """A pod shape: host CPU, per-GPU compute, GPU count and allowed models (empty: any)."""

    cpu_milli: int
    milli: int
    count: int
    models: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WeightedShape:
    shape: Shape
    weight: float


def typical_shapes(shapes: Iterable[Shape], coverage: float = 0.95) -> tuple[WeightedShape, ...]:
    """The most popular shapes whose pods make up at least `coverage` of all pods, weights summing to 1.

    Shapes are taken in order of decreasing popularity (ties by shape, for determinism) until the
    running count reaches `coverage` of the total; the weights are then renormalised.
    """
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    counts = Counter(shapes)
    total = sum(counts.values())
    if total == 0:
        return ()
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    chosen: list[tuple[Shape, int]] = []
    running = 0
    for shape, count in ranked:
        if running >= coverage * total:
            break
        chosen.append((shape, count))
        running += count
    return tuple(WeightedShape(shape, count / running) for shape, count in chosen)


def cpu_per_gpu_milli(shapes: tuple[WeightedShape, ...]) -> float:
    """The workload's host CPU (milli-cores) per milli-GPU, popularity-weighted over its GPU shapes."""
    cpu = sum(s.weight * s.shape.cpu_milli for s in shapes if s.shape.count)
    gpu = sum(s.weight * s.shape.milli * s.shape.count for s in shapes if s.shape.count)
    return cpu / gpu if gpu > 0 else 0.0


def share_mix(shapes: tuple[WeightedShape, ...]) -> tuple[tuple[int, float], ...]:
    """The workload's one-GPU share sizes (milli, ascending), each with the weight of its shapes
    together (any CPU, any models); whole GPUs and multi-GPU shapes are left out."""
    weights: dict[int, float] = {}
    for item in shapes:
        if item.shape.count == 1 and 0 < item.shape.milli < units.MILLI_PER_GPU and item.weight > 0:
            weights[item.shape.milli] = weights.get(item.shape.milli, 0.0) + item.weight
    return tuple(sorted(weights.items()))


def unfillable(shapes: tuple[WeightedShape, ...], min_weight: float) -> FloatArray:
    """Per free compute x of a GPU (0..1000 milli): what of it no sum of the workload's common
    one-GPU share sizes fills, `x - max(sum of common sizes <= x)`; 0 for a whole free GPU.

    A size is common when its shapes (any CPU, any models) weigh at least `min_weight` together.
    FGD judges a gap against one pod at a time; this says which gaps a mix of pods can close: on
    openb, 470 and 810 close a gap of 470 or 810 exactly; 190 beside an 810 share closes never."""
    # The sums of common sizes (any number of each) up to a whole GPU, then the largest one <= x.
    reachable = np.zeros(units.MILLI_PER_GPU + 1, dtype=bool)
    reachable[0] = True
    for size in (size for size, weight in share_mix(shapes) if weight >= min_weight):
        for _ in range(units.MILLI_PER_GPU // size):
            reachable[size:] |= reachable[:-size]
    span = np.arange(units.MILLI_PER_GPU + 1)
    filled = np.maximum.accumulate(np.where(reachable, span, 0))
    gaps = (span - filled).astype(np.float64)
    gaps[units.MILLI_PER_GPU] = 0.0
    return gaps


class FragModel:
    """Fragmentation of the nodes of one fleet with respect to a set of typical shapes.

    Per-node aggregates (GPUs able to host each shape, compute stranded below each shape) depend
    only on the node's own state, so `current` caches them per node version; hypothetical states
    ("after this pod lands there") are evaluated as deltas of those aggregates (`frag_after`).

    With `cpu_per_milli` (rho > 0) a node's fragmentation also counts the GPU compute its free CPU
    cannot feed: `max(0, free milli - free CPU / rho)`, what pods of the workload's average CPU
    intensity could not use because the node's CPU runs out first. The paper's FGD leaves it out.
    """

    def __init__(self, state: fleet.FleetState, shapes: tuple[WeightedShape, ...], cpu_per_milli: float = 0.0) -> None:
        self.state = state
        self.shapes = shapes
        self.cpu_per_milli = cpu_per_milli
        self.cpu: fleet.IntArray = np.array([s.shape.cpu_milli for s in shapes], dtype=np.int64)
        self.milli: fleet.IntArray = np.array([s.shape.milli for s in shapes], dtype=np.int64)
        self.count: fleet.IntArray = np.array([s.shape.count for s in shapes], dtype=np.int64)
        self.weight: FloatArray = np.array([s.weight for s in shapes], dtype=np.float64)
        self.wants_gpu: fleet.BoolArray = self.milli > 0
        n, _ = state.present.shape
        k = len(shapes)
        model_ok = np.repeat(state.present[:, :, None], k, axis=2)
        for j, item in enumerate(shapes):
            if item.shape.models:
                model_ok[:, :, j] &= state.model_mask(item.shape.models, slice(None))
        self.model_ok: fleet.BoolArray = model_ok
        self._count_ok: fleet.IntArray = np.zeros((n, k), dtype=np.int64)
        self._below: fleet.IntArray = np.zeros((n, k), dtype=np.int64)
        self._total: fleet.IntArray = np.zeros(n, dtype=np.int64)
        self._frag: FloatArray = np.zeros(n, dtype=np.float64)
        self._version: fleet.IntArray = np.full(n, -1, dtype=np.int64)

    def aggregates(
        self, rows: fleet.IntArray, milli_free: fleet.IntArray
    ) -> tuple[fleet.IntArray, fleet.IntArray, fleet.IntArray]:
        """Per node and shape: GPUs that can host one unit, and free compute on the others."""
        free = milli_free[:, :, None]
        fits_gpu = (free >= self.milli) & self.model_ok[rows]
        count_ok = fits_gpu.sum(axis=1)
        below = np.where(fits_gpu, 0, free).sum(axis=1)
        return count_ok, below, milli_free.sum(axis=1)

    def frag_from(
        self, count_ok: fleet.IntArray, below: fleet.IntArray, total: fleet.IntArray, cpu_free: fleet.IntArray
    ) -> FloatArray:
        fits = (count_ok >= self.count) & (cpu_free[:, None] >= self.cpu) & self.wants_gpu
        amount = np.where(fits, below, total[:, None])
        expected = np.asarray(amount @ self.weight, dtype=np.float64)
        if self.cpu_per_milli > 0:
            expected += np.maximum(0.0, total - cpu_free / self.cpu_per_milli)
        return expected

    def frag(self, rows: fleet.IntArray, cpu_free: fleet.IntArray, milli_free: fleet.IntArray) -> FloatArray:
        """(n,) expected fragmentation of nodes `rows` in the given (possibly hypothetical) state."""
        if not self.shapes:
            return np.zeros(len(rows), dtype=np.float64)
        count_ok, below, total = self.aggregates(rows, milli_free)
        return self.frag_from(count_ok, below, total, cpu_free)

    def current(self, rows: fleet.IntArray) -> FloatArray:
        """(n,) fragmentation of nodes `rows` now; refreshes the cached aggregates of changed nodes."""
        state = self.state
        stale = rows[self._version[rows] != state.version[rows]]
        if len(stale) and self.shapes:
            count_ok, below, total = self.aggregates(stale, state.milli_free[stale])
            self._count_ok[stale] = count_ok
            self._below[stale] = below
            self._total[stale] = total
            self._frag[stale] = self.frag_from(count_ok, below, total, state.cpu_free[stale])
            self._version[stale] = state.version[stale]
        return self._frag[rows]

    def frag_after(
        self,
        rows: fleet.IntArray,
        cpu_after: fleet.IntArray,
        milli: int,
        hypothesis_node: fleet.IntArray,
        take_node: fleet.IntArray,
        take_gpu: fleet.IntArray,
        take_hypothesis: fleet.IntArray | None = None,
    ) -> FloatArray:
        """Fragmentation under hypothetical placements, one value per hypothesis.

        Hypothesis h places the pod on node `rows[hypothesis_node[h]]`, taking `milli` from each GPU
        `take_gpu[t]` of node `rows[take_node[t]]` for the takes t with `take_hypothesis[t] == h`
        (default: take t belongs to hypothesis t). `cpu_after[i]` is node i's free CPU afterwards.
        Call `current(rows)` first: the deltas start from the cached aggregates.
        """
        if not self.shapes:
            return np.zeros(len(hypothesis_node), dtype=np.float64)
        global_rows = rows[hypothesis_node]
        count_ok = self._count_ok[global_rows].copy()
        below = self._below[global_rows].copy()
        total = self._total[global_rows].copy()
        if len(take_node):
            free = self.state.milli_free[rows[take_node], take_gpu]
            after = free - milli
            model_ok = self.model_ok[rows[take_node], take_gpu]
            was_ok = (free[:, None] >= self.milli) & model_ok
            now_ok = (after[:, None] >= self.milli) & model_ok
            d_count = now_ok.astype(np.int64) - was_ok
            d_below = np.where(now_ok, 0, after[:, None]) - np.where(was_ok, 0, free[:, None])
            if take_hypothesis is None:
                count_ok += d_count
                below += d_below
                total -= milli
            else:
                np.add.at(count_ok, take_hypothesis, d_count)
                np.add.at(below, take_hypothesis, d_below)
                np.subtract.at(total, take_hypothesis, milli)
        return self.frag_from(count_ok, below, total, cpu_after[hypothesis_node])
