"""Summaries of simulation runs: per (trace, policy) statistics, JSON, and the allocation plot; and,
for a snapshot of a cluster (`kubectl sharegpu snapshot`), what the cluster held when it was taken."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from sharegpu.core import units
from sharegpu.sim import runner


@dataclass(frozen=True, slots=True)
class Stat:
    mean: float
    sd: float
    n: int

    def __str__(self) -> str:
        if self.n == 0 or math.isnan(self.mean):
            return "-"
        return f"{self.mean:.2f}±{self.sd:.2f}" if self.n > 1 else f"{self.mean:.2f}"


def stat(values: Sequence[float | None]) -> Stat:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    if not clean:
        return Stat(float("nan"), float("nan"), 0)
    sd = float(np.std(clean, ddof=1)) if len(clean) > 1 else 0.0
    return Stat(float(np.mean(clean)), sd, len(clean))


@dataclass(frozen=True, slots=True)
class Summary:
    trace: str
    policy: str
    mode: str
    seeds: int
    unallocated: Stat
    frag: Stat
    mean_allocated: Stat
    wait_p50: Stat
    wait_p99: Stat
    failed: Stat
    wall: Stat
    evictions: Stat
    """Dynamic mode: pods the defragmenter moved (n = 0 in static mode)."""


def summarise(results: Sequence[runner.RunResult]) -> list[Summary]:
    groups: dict[tuple[str, str, str], list[runner.RunResult]] = {}
    for r in results:
        groups.setdefault((r.trace, r.policy, r.mode), []).append(r)
    return [
        Summary(
            trace=trace,
            policy=policy,
            mode=mode,
            seeds=len(runs),
            unallocated=stat([r.unallocated_gpu_pct_at_arrived_100 for r in runs]),
            frag=stat([r.frag_gpu_pct_at_arrived_100 for r in runs]),
            mean_allocated=stat([r.mean_allocated_gpu_pct for r in runs]),
            wait_p50=stat([r.wait_p50_seconds for r in runs]),
            wait_p99=stat([r.wait_p99_seconds for r in runs]),
            failed=stat([float(r.failed) for r in runs]),
            wall=stat([r.wall_seconds for r in runs]),
            evictions=stat([None if r.evictions is None else float(r.evictions) for r in runs]),
        )
        for (trace, policy, mode), runs in groups.items()
    ]


@dataclass(frozen=True, slots=True)
class ClusterNow:
    """What a snapshot's cluster held when it was taken: its bound GPU pods on its GPUs, and the GPU
    pods still pending."""

    trace: str
    capacity_milli: int
    held_milli: int
    bound_pods: int
    pending_pods: int
    pending_milli: int

    @property
    def unallocated_pct(self) -> float:
        return 100.0 - 100.0 * self.held_milli / self.capacity_milli if self.capacity_milli else math.nan

    @property
    def requested_pct(self) -> float:
        """Bound and pending GPU requests over capacity (the simulator's "arrived")."""
        total = self.held_milli + self.pending_milli
        return 100.0 * total / self.capacity_milli if self.capacity_milli else math.nan

    def describe(self) -> str:
        return (
            f"{self.trace}: the cluster now holds {self.held_milli / units.MILLI_PER_GPU:g} of "
            f"{self.capacity_milli // units.MILLI_PER_GPU} GPUs for {self.bound_pods} GPU pods "
            f"({self.unallocated_pct:.2f}% unallocated); {self.pending_pods} GPU pods pending ask for "
            f"{self.pending_milli / units.MILLI_PER_GPU:g} more (requested: {self.requested_pct:.2f}% of capacity)"
        )


def cluster_now(source: runner.Source) -> ClusterNow | None:
    """For a snapshot (its pods say where they are), what its cluster held; None for other traces."""
    nodes, pods = runner.load_source(source)
    if not pods.snapshot:
        return None
    gpu = [p for p in pods.pods if p.num_gpu]
    bound = [p for p in gpu if p.node]
    return ClusterNow(
        trace=source.label,
        capacity_milli=sum(n.gpu_count for n in nodes) * units.MILLI_PER_GPU,
        held_milli=sum(p.gpu_milli_total for p in bound),
        bound_pods=len(bound),
        pending_pods=len(gpu) - len(bound),
        pending_milli=sum(p.gpu_milli_total for p in gpu if not p.node),
    )


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def to_json(results: Sequence[runner.RunResult], command: str, now: Sequence[ClusterNow] = ()) -> bytes:
    summaries = []
    for s in summarise(results):
        item: dict[str, Any] = {"trace": s.trace, "policy": s.policy, "mode": s.mode, "seeds": s.seeds}
        for name in ("unallocated", "frag", "mean_allocated", "wait_p50", "wait_p99", "failed", "wall", "evictions"):
            value: Stat = getattr(s, name)
            item[name] = {"mean": _finite(value.mean), "sd": _finite(value.sd)}
        summaries.append(item)
    body: dict[str, Any] = {"command": command, "runs": [asdict(r) for r in results], "summary": summaries}
    if now:
        body["cluster_now"] = [
            {**asdict(n), "unallocated_pct": _finite(n.unallocated_pct), "requested_pct": _finite(n.requested_pct)}
            for n in now
        ]
    return orjson.dumps(body, option=orjson.OPT_INDENT_2)


def plot(results: Sequence[runner.RunResult], path: Path) -> None:
    """Allocation vs arrived workload (static) or vs time (dynamic), one panel per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in results))
    fig, axes = plt.subplots(1, len(traces), figsize=(6.4 * len(traces), 4.6), squeeze=False)
    for axis, trace in zip(axes[0], traces, strict=True):
        runs = [r for r in results if r.trace == trace]
        dynamic = runs[0].mode == "dynamic"
        for policy in dict.fromkeys(r.policy for r in runs):
            mine = [r for r in runs if r.policy == policy]
            grid = np.linspace(0, max(max(r.curve_x) for r in mine), 300)
            ys = np.array([np.interp(grid, r.curve_x, r.curve_y) for r in mine])
            axis.plot(grid, ys.mean(axis=0), label=f"{policy} ({len(mine)} seed{'s' if len(mine) > 1 else ''})")
        if dynamic:
            axis.set_xlabel("hours since first arrival")
        else:
            axis.plot([0, 130], [0, 130], color="0.7", linestyle=":", linewidth=1, label="ideal")
            axis.axvline(100, color="0.8", linewidth=0.8)
            axis.set_xlabel("arrived GPU request (% of capacity)")
            axis.set_xlim(0, 130)
        axis.set_ylabel("allocated GPU (% of capacity)")
        axis.set_title(f"{trace} ({'dynamic' if dynamic else 'static arrivals'})")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
