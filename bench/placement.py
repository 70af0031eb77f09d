"""Per-pod placement decision latency on the 1213-node openb cluster, for each policy.

Replays the first --pods arrivals of the default openb trace (seed 42, the paper's method) and times
each decision (filter + score + choice, then assume in the ledger). Two figures per policy:
`cached` is the deployed path (results cached per request shape and node version), `uncached`
recomputes every node for every pod (the worst case: a shape never seen before).

    python bench/placement.py [--openb DIR] [--pods 4000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from sharegpu.core import devices, fleet
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from sharegpu.sim import catalog, replay, trace

HERE = Path(__file__).resolve().parent


def measure(
    nodes: list[devices.NodeInventory],
    pods: trace.Trace,
    name: str,
    count: int,
    cache: bool,
) -> list[float]:
    shapes = pods.typical_shapes()
    capacity = sum(n.gpu_count for n in nodes) * 1000
    workload = replay.build_workload(pods.pods, capacity, len(nodes), 1.3, seed=42)
    state = fleet.FleetState(nodes)
    ledger = core_ledger.Ledger(state)
    placer = core_placer.Placer(
        state, catalog.make(name, shapes), priority=workload.node_priority, seed=42, cache_shapes=1024 if cache else 0
    )
    timings = []
    for i, pod in enumerate(workload.pods[:count]):
        request = pod.request(f"{pod.name}#{i}")
        started = time.perf_counter()
        placer.place(ledger, request)
        timings.append((time.perf_counter() - started) * 1000)
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openb", type=Path, default=HERE.parent.parent / "shared" / "traces" / "openb")
    parser.add_argument("--pods", type=int, default=4000, help="arrivals to time per policy")
    parser.add_argument("--policy", action="append", help="policies (default: all)")
    parser.add_argument("--json", type=Path, help="write {'policies': {name: {'p50_ms', 'p99_ms', ...}}}")
    args = parser.parse_args()
    nodes_file = args.openb / "openb_node_list_gpu_node.csv"
    if not nodes_file.is_file():
        print(f"bench/placement.py: error: {nodes_file} not found (use --openb DIR)", file=sys.stderr)
        return 2
    nodes = trace.load_nodes(nodes_file)
    pods = trace.load_pods(args.openb / "openb_pod_list_default.csv")
    names = args.policy or list(catalog.REGISTRY)
    print(f"{len(nodes)} nodes, {sum(n.gpu_count for n in nodes)} GPUs; first {args.pods} arrivals of openb default")
    print(f"{'policy':<16}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}   {'uncached p50':>12}{'p99':>8}")
    report: dict[str, dict[str, float]] = {}
    for name in names:
        cached = np.array(measure(nodes, pods, name, args.pods, cache=True))
        uncached = np.array(measure(nodes, pods, name, min(args.pods, 1000), cache=False))
        row = {
            "p50_ms": round(float(np.percentile(cached, 50)), 4),
            "p99_ms": round(float(np.percentile(cached, 99)), 4),
            "mean_ms": round(float(cached.mean()), 4),
            "uncached_p50_ms": round(float(np.percentile(uncached, 50)), 4),
            "uncached_p99_ms": round(float(np.percentile(uncached, 99)), 4),
        }
        report[name] = row
        print(
            f"{name:<16}{row['p50_ms']:>9.3f}{row['p99_ms']:>9.3f}{row['mean_ms']:>9.3f}   "
            f"{row['uncached_p50_ms']:>12.3f}{row['uncached_p99_ms']:>8.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"nodes": len(nodes), "pods": args.pods, "policies": report}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
