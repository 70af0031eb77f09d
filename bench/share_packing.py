"""How tightly a policy packs the shares it places, against the fewest GPUs those shares could fill.

On openb, at arrived = 100% nearly all the free GPU compute sits in gaps on GPUs that hold
sharing pods. This asks how much of it a better *packing* of the same shares could take back:
replay the paper's method (tune 1.3) with the policy, take the sharing pods placed at the first
arrival whose arrived % rounds to 100, and compare the GPUs they occupy with

- `lp_gpus`: a lower bound on the GPUs any packing of that multiset of share sizes needs (the
  one-dimensional cutting-stock LP of Gilmore and Gomory, solved by column generation with HiGHS;
  host CPU, memory and models are left out, which only lowers it), and
- `bfd_gpus`: best-fit decreasing of the same shares, an offline packing that sorts them first
  (`bfd_unallocated_pct`: the run's figure less the GPUs that packing frees).

`perfect_unallocated_pct` is the run's unallocated % less the GPUs a packing into `lp_gpus` GPUs
would free (each counted as filled, by the whole-GPU pods that failed): no packing of the shares
that policy placed goes lower. `free_pct_at_100` and `share_gap_pct` are the free compute at that
arrival and the part of it in gaps beside shares. Another policy places another set: this bounds
what better packing could give, not a better choice of what is placed.

    python bench/share_packing.py [--openb DIR] [--traces T,...] [--seeds 42-44] [--policy default]
        [--jobs N] [--json PATH]

Prints a row per trace (means over the seeds) and writes {"runs": [...], "by_trace": {...},
"mean_ratio_to_fgd", "mean_bfd_ratio_to_fgd", "mean_perfect_ratio_to_fgd"} to --json; ratios are to
fgd's unallocated % in the same runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from sharegpu import cli
from sharegpu.core import ledger as core_ledger
from sharegpu.core import prices, units
from sharegpu.sim import catalog, replay, runner, trace

HERE = Path(__file__).resolve().parent
WHOLE = units.MILLI_PER_GPU
Json = dict[str, Any]


def lp_gpus(items: Sequence[int]) -> float:
    """The cutting-stock LP's optimum: fewest GPUs (fractionally) that hold every share in `items`.

    `core.prices.prices` solves it by column generation (the pricing problem, a pattern worth most at
    the LP's duals, an unbounded knapsack over 0..1000 milli solved exactly), so at the end no
    pattern prices out; by duality the optimum is what the prices make the shares worth together."""
    if not items:
        return 0.0
    counts = Counter(items)
    sizes = sorted(counts)
    need = [float(counts[s]) for s in sizes]
    return float(prices.prices(sizes, need, []) @ np.array(need))


def bfd_gpus(items: Sequence[int]) -> int:
    """GPUs best-fit decreasing fills with `items`: largest share first, into the fullest GPU it fits."""
    free_count = np.zeros(WHOLE + 1, dtype=np.int64)  # GPUs opened, by free milli
    for size in sorted(items, reverse=True):
        fits = np.flatnonzero(free_count[size:]) + size
        room = int(fits[0]) if len(fits) else WHOLE
        if len(fits):
            free_count[room] -= 1
        free_count[room - size] += 1
    return int(free_count.sum())


def shares_on_gpus(ledger: core_ledger.Ledger) -> dict[tuple[str, int], list[int]]:
    """Per (node, GPU index): the milli of each sharing pod there."""
    held: dict[tuple[str, int], list[int]] = {}
    for alloc in ledger.allocations():
        if alloc.exclusive:
            continue
        for gpu, (milli, _memory) in alloc.gpu_usage().items():
            if 0 < milli < WHOLE:
                held.setdefault((alloc.node, gpu), []).append(milli)
    return held


def one_run(source: runner.Source, policy: str, seed: int) -> Json:
    nodes, pods = runner.load_source(source)
    shapes = pods.typical_shapes()
    capacity = sum(node.gpu_count for node in nodes) * WHOLE
    workload = replay.build_workload(pods.pods, capacity, len(nodes), 1.3, seed)
    seen: dict[str, Any] = {}

    def look(ledger: core_ledger.Ledger) -> None:
        seen["shares"] = shares_on_gpus(ledger)
        seen["allocated"] = sum(m for a in ledger.allocations() for m, _ in a.gpu_usage().values())

    result = replay.replay_static(nodes, workload, catalog.make(policy, shapes), shapes, seed, at_100=look)
    fgd = replay.replay_static(nodes, workload, catalog.make("fgd", shapes), shapes, seed)
    held: dict[tuple[str, int], list[int]] = seen["shares"]
    items = [milli for on_gpu in held.values() for milli in on_gpu]
    bound = lp_gpus(items)
    gaps = sum(WHOLE - sum(on_gpu) for on_gpu in held.values())
    free = capacity - int(seen["allocated"])
    headline = result.unallocated_pct_at_100
    sorted_first = bfd_gpus(items)

    def packed_into(gpus: int) -> float:
        """The headline figure with the shares packed into `gpus` GPUs: each GPU freed is filled."""
        return headline - (len(held) - gpus) * WHOLE / capacity * 100

    return {
        "trace": source.label,
        "seed": seed,
        "unallocated_pct": round(headline, 4),
        "fgd_unallocated_pct": round(fgd.unallocated_pct_at_100, 4),
        "free_pct_at_100": round(free / capacity * 100, 4),
        "share_gap_pct": round(gaps / capacity * 100, 4),
        "shares": len(items),
        "share_gpus": len(held),
        "bfd_gpus": sorted_first,
        "lp_gpus": round(bound, 3),
        "bfd_unallocated_pct": round(packed_into(sorted_first), 4),
        "perfect_unallocated_pct": round(packed_into(int(np.ceil(bound - 1e-6))), 4),
    }


def summarise(runs: list[Json]) -> Json:
    by_trace: dict[str, Json] = {}
    for label in dict.fromkeys(run["trace"] for run in runs):
        mine = [run for run in runs if run["trace"] == label]

        def mean(key: str, rows: list[Json] = mine) -> float:
            return round(statistics.fmean(row[key] for row in rows), 4)

        fgd = mean("fgd_unallocated_pct")
        by_trace[label] = {
            "unallocated_pct": mean("unallocated_pct"),
            "fgd_unallocated_pct": fgd,
            "ratio_to_fgd": round(mean("unallocated_pct") / fgd, 4),
            "share_gpus": mean("share_gpus"),
            "bfd_gpus": mean("bfd_gpus"),
            "lp_gpus": mean("lp_gpus"),
            "bfd_ratio_to_fgd": round(mean("bfd_unallocated_pct") / fgd, 4),
            "perfect_unallocated_pct": mean("perfect_unallocated_pct"),
            "perfect_ratio_to_fgd": round(mean("perfect_unallocated_pct") / fgd, 4),
        }
    return {
        "by_trace": by_trace,
        "mean_ratio_to_fgd": round(statistics.fmean(t["ratio_to_fgd"] for t in by_trace.values()), 4),
        "mean_bfd_ratio_to_fgd": round(statistics.fmean(t["bfd_ratio_to_fgd"] for t in by_trace.values()), 4),
        "mean_perfect_ratio_to_fgd": round(statistics.fmean(t["perfect_ratio_to_fgd"] for t in by_trace.values()), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openb", type=Path, default=HERE.parent.parent / "shared" / "traces" / "openb")
    parser.add_argument("--traces", default=",".join(trace.OPENB_TRACES))
    parser.add_argument("--seeds", default="42-44")
    parser.add_argument("--policy", default="default")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    catalog.check(args.policy)
    nodes = str(args.openb / trace.NODE_FILE)
    sources = [runner.Source(label, nodes, str(args.openb / trace.pod_file(label))) for label in args.traces.split(",")]
    runner.validate_sources(sources)
    jobs = [(source, args.policy, seed) for source in sources for seed in cli.parse_seeds(args.seeds)]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(one_run, *zip(*jobs, strict=True)))
    summary = summarise(runs)
    heads = ("unalloc %", "/fgd", "share GPUs", "BFD", "/fgd", "LP", "perfect %", "/fgd")
    print(
        f"{'trace':11} "
        + " ".join(f"{head:>{width}}" for head, width in zip(heads, (9, 6, 10, 7, 6, 8, 9, 6), strict=True))
    )
    for label, row in summary["by_trace"].items():
        print(
            f"{label:11} {row['unallocated_pct']:9.2f} {row['ratio_to_fgd']:6.3f} {row['share_gpus']:10.1f} "
            f"{row['bfd_gpus']:7.1f} {row['bfd_ratio_to_fgd']:6.3f} {row['lp_gpus']:8.1f} "
            f"{row['perfect_unallocated_pct']:9.2f} {row['perfect_ratio_to_fgd']:6.3f}"
        )
    print(
        f"mean ratio to fgd {summary['mean_ratio_to_fgd']}; the same shares packed by BFD "
        f"{summary['mean_bfd_ratio_to_fgd']}, perfectly {summary['mean_perfect_ratio_to_fgd']}"
    )
    if args.json:
        args.json.write_text(json.dumps({"policy": args.policy, "runs": runs, **summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
