"""GPU fragmentation as the FGD paper measures it, vectorised over nodes and GPUs.

A node's fragmentation is the GPU compute it has free but that the workload is unlikely to use:
for each typical pod shape (weighted by how often it occurs), if the shape fits the node, the free
compute on GPUs too small for the shape counts; if it does not fit at all (too little CPU, too few
GPUs, wrong model, or a shape with no GPU), all the node's free GPU compute counts. Memory plays no
part. The typical shapes are the most popular ones covering 95% of a reference workload's pods.

`FragModel.frag` evaluates many nodes at once; `frag_after_one_gpu` evaluates, for every node and
every GPU, the node's fragmentation after a fractional pod lands on that GPU, from per-shape
aggregates, without materialising every hypothetical node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sharegpu.core import fleet

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


class FragModel:
    """Fragmentation of the nodes of one fleet with respect to a set of typical shapes."""

    def __init__(self, state: fleet.FleetState, shapes: tuple[WeightedShape, ...]) -> None:
        self.shapes = shapes
        self.cpu: fleet.IntArray = np.array([s.shape.cpu_milli for s in shapes], dtype=np.int64)
        self.milli: fleet.IntArray = np.array([s.shape.milli for s in shapes], dtype=np.int64)
        self.count: fleet.IntArray = np.array([s.shape.count for s in shapes], dtype=np.int64)
        self.weight: FloatArray = np.array([s.weight for s in shapes], dtype=np.float64)
        self.wants_gpu: fleet.BoolArray = self.milli > 0
        n, g = state.present.shape
        k = len(shapes)
        model_ok = np.repeat(state.present[:, :, None], k, axis=2)
        for j, item in enumerate(shapes):
            if item.shape.models:
                model_ok[:, :, j] &= np.isin(state.model_id, state.model_ids_for(item.shape.models))
        self.model_ok: fleet.BoolArray = model_ok
        self._shape = (n, g, k)

    def _aggregates(
        self, rows: fleet.IntArray, milli_free: fleet.IntArray
    ) -> tuple[fleet.IntArray, fleet.IntArray, fleet.IntArray]:
        """Per node and shape: GPUs that can host one unit, and free compute on the others."""
        free = milli_free[:, :, None]
        fits_gpu = (free >= self.milli) & self.model_ok[rows]
        count_ok = fits_gpu.sum(axis=1)
        below = np.where(fits_gpu, 0, free).sum(axis=1)
        return count_ok, below, milli_free.sum(axis=1)

    def frag(self, rows: fleet.IntArray, cpu_free: fleet.IntArray, milli_free: fleet.IntArray) -> FloatArray:
        """(n,) expected fragmentation of nodes `rows` in the given (possibly hypothetical) state."""
        if not self.shapes:
            return np.zeros(len(rows), dtype=np.float64)
        count_ok, below, total = self._aggregates(rows, milli_free)
        fits = (count_ok >= self.count) & (cpu_free[:, None] >= self.cpu) & self.wants_gpu
        amount = np.where(fits, below, total[:, None])
        return np.asarray(amount @ self.weight, dtype=np.float64)

    def frag_after_one_gpu(
        self, rows: fleet.IntArray, cpu_after: fleet.IntArray, milli_free: fleet.IntArray, milli: int
    ) -> FloatArray:
        """(n, width): fragmentation after `milli` more compute is taken from each GPU in turn.

        Entries for GPUs with less than `milli` free are meaningless; callers mask them.
        """
        n, g = milli_free.shape
        if not self.shapes:
            return np.zeros((n, g), dtype=np.float64)
        count_ok, below, total = self._aggregates(rows, milli_free)
        free = milli_free[:, :, None]
        after = free - milli
        model_ok = self.model_ok[rows]
        was_ok = (free >= self.milli) & model_ok
        now_ok = (after >= self.milli) & model_ok
        count_after = count_ok[:, None, :] - was_ok + now_ok
        below_after = below[:, None, :] - np.where(was_ok, 0, free) + np.where(now_ok, 0, after)
        fits = (count_after >= self.count) & (cpu_after[:, None, None] >= self.cpu) & self.wants_gpu
        amount = np.where(fits, below_after, (total - milli)[:, None, None])
        return np.asarray(amount @ self.weight, dtype=np.float64)
