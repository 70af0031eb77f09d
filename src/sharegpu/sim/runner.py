"""Running many simulations: one run per (trace, policy, seed), spread over processes.

Each worker process loads its inputs once (cached per process) and returns a `RunResult`: plain
numbers and short curves, cheap to pickle. With one job everything runs in this process. On an
existing Dask cluster (`sim.cluster`) the inputs are loaded here and sent to the workers once, and
each run is `execute_loaded`: the same figures as a local run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sharegpu.core import devices, errors, frag, units
from sharegpu.sim import catalog, replay, synthetic, trace

SYNTHETIC = "synthetic"
CURVE_POINTS = 261


@dataclass(frozen=True, slots=True)
class Source:
    """Where a run's cluster and pods come from: files, or the embedded synthetic workload."""

    label: str
    nodes_path: str | None = None
    pods_path: str | None = None


@dataclass(frozen=True, slots=True)
class RunSpec:
    source: Source
    policy: str
    seed: int
    tune: float = 1.3
    mode: str = "static"
    time_scale: float = 1.0
    """Dynamic mode: arrivals come this many times faster than in the trace (run times unchanged)."""
    defrag_budget: int = 0
    """Dynamic mode: evictions per hour of virtual time the defragmenter may make (0: it is off)."""


@dataclass(frozen=True, slots=True)
class RunResult:
    trace: str
    policy: str
    seed: int
    mode: str
    pods: int
    placed: int
    failed: int
    wall_seconds: float
    unallocated_gpu_pct_at_arrived_100: float | None = None
    frag_gpu_pct_at_arrived_100: float | None = None
    mean_allocated_gpu_pct: float | None = None
    wait_p50_seconds: float | None = None
    wait_p99_seconds: float | None = None
    evictions: int | None = None
    """Dynamic mode: running pods the defragmenter moved."""
    curve_x: list[float] = field(default_factory=list)
    """Static: arrived GPU % of capacity; dynamic: hours since the first arrival."""
    curve_y: list[float] = field(default_factory=list)
    """Allocated GPU % of capacity."""


@functools.lru_cache(maxsize=8)
def load_source(source: Source) -> tuple[list[devices.NodeInventory], trace.Trace]:
    if source.nodes_path is None or source.pods_path is None:
        return synthetic.cluster(), synthetic.workload()
    return trace.load_nodes(Path(source.nodes_path)), trace.load_pods(Path(source.pods_path))


@functools.lru_cache(maxsize=8)
def _shapes(source: Source) -> tuple[frag.WeightedShape, ...]:
    return load_source(source)[1].typical_shapes()


def _downsample(x: np.ndarray, y: np.ndarray) -> tuple[list[float], list[float]]:
    if len(x) <= CURVE_POINTS:
        return [round(float(v), 4) for v in x], [round(float(v), 4) for v in y]
    picks = np.unique(np.linspace(0, len(x) - 1, CURVE_POINTS).astype(np.int64))
    return [round(float(v), 4) for v in x[picks]], [round(float(v), 4) for v in y[picks]]


Loaded = tuple[list[devices.NodeInventory], trace.Trace]
"""A source's cluster and pods, as `load_source` reads them."""
_SHAPES_SEEN: dict[Source, tuple[frag.WeightedShape, ...]] = {}
"""A worker's typical shapes of the sources it was sent (a few per sweep)."""


def execute(spec: RunSpec) -> RunResult:
    """One run, its inputs read from the spec's files (cached per process)."""
    return execute_loaded(spec, load_source(spec.source), _shapes(spec.source))


def execute_loaded(spec: RunSpec, loaded: Loaded, shapes: tuple[frag.WeightedShape, ...] | None = None) -> RunResult:
    """One run on inputs already loaded (its source's files are not read: a remote worker may not have them)."""
    nodes, pods = loaded
    if shapes is None:
        if spec.source not in _SHAPES_SEEN:
            if len(_SHAPES_SEEN) >= 8:
                _SHAPES_SEEN.clear()
            _SHAPES_SEEN[spec.source] = pods.typical_shapes()
        shapes = _SHAPES_SEEN[spec.source]
    policy = catalog.make(spec.policy, shapes)
    if spec.mode == "dynamic":
        dyn = replay.replay_dynamic(
            nodes, pods.pods, policy, spec.seed, spec.time_scale, defrag_budget_per_hour=spec.defrag_budget
        )
        return dataclasses.replace(
            _counted(
                spec, dyn.pods, dyn.never_placed, dyn.wall_seconds, _downsample(dyn.times / 3600.0, dyn.allocated_pct)
            ),
            mean_allocated_gpu_pct=round(dyn.mean_allocated_pct, 4),
            wait_p50_seconds=round(dyn.wait_p50, 1),
            wait_p99_seconds=round(dyn.wait_p99, 1),
            evictions=dyn.evictions,
        )
    started = time.perf_counter()
    capacity = sum(node.gpu_count for node in nodes) * units.MILLI_PER_GPU
    workload = replay.build_workload(pods.pods, capacity, len(nodes), spec.tune, spec.seed)
    result = replay.replay_static(nodes, workload, policy, shapes, spec.seed)
    figure = result.unallocated_pct_at_100
    frag = result.frag_pct_at_100
    return dataclasses.replace(
        _counted(
            spec,
            result.pods,
            result.failed,
            time.perf_counter() - started,
            _downsample(result.arrived_pct, result.allocated_pct),
        ),
        unallocated_gpu_pct_at_arrived_100=None if np.isnan(figure) else round(figure, 4),
        frag_gpu_pct_at_arrived_100=None if np.isnan(frag) else round(frag, 4),
    )


def _counted(
    spec: RunSpec, pods: int, failed: int, wall_seconds: float, curve: tuple[list[float], list[float]]
) -> RunResult:
    """What every run's result says, whatever its mode: which run, its pods placed and not, its curve."""
    return RunResult(
        trace=spec.source.label, policy=spec.policy, seed=spec.seed, mode=spec.mode, pods=pods,
        placed=pods - failed, failed=failed, wall_seconds=round(wall_seconds, 3), curve_x=curve[0], curve_y=curve[1],
    )  # fmt: skip


def validate_sources(sources: Sequence[Source]) -> None:
    """Load every source once here, so bad files fail before any worker starts: unreadable ones, and
    pods none of which asks for a GPU (nothing to replay: drawing more would never fill the GPUs)."""
    for source in sources:
        _, pods = load_source(source)  # a nodes file without a GPU node is refused as it is read
        if not any(pod.gpu_milli_total for pod in pods.pods):
            raise errors.InvalidInputError(f"{source.pods_path}: no pod asks for a GPU: nothing to replay")


def run_all(
    specs: Sequence[RunSpec], jobs: int | None = None, on_done: Callable[[RunResult], None] | None = None
) -> list[RunResult]:
    """Run every spec on `jobs` local processes; results come back in the order of `specs`
    (`sim.cluster.run_on_dask` runs them on a Dask cluster instead)."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    results: dict[int, RunResult] = {}
    if jobs == 1:
        for i, spec in enumerate(specs):
            results[i] = execute(spec)
            if on_done:
                on_done(results[i])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(execute, spec): i for i, spec in enumerate(specs)}
            for future in as_completed(futures):
                result = future.result()
                results[futures[future]] = result
                if on_done:
                    on_done(result)
    return [results[i] for i in range(len(specs))]
