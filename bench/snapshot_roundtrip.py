"""An openb trace loaded into devcluster and taken back by `kubectl sharegpu snapshot`: does the replay
of the snapshot give the simulator's figures for the trace itself?

A real kube-apiserver (devcluster's, built from the Go module) gets the trace's nodes as fake GPU nodes
with their Devices and its pods, one by one in the trace's order, pending, in three request formats
(`devcluster.traces`); the snapshot is read from the API (paged) as the plugin reads it, written in the
openb format, and both files are replayed with the paper's method, seed by seed.

    python bench/snapshot_roundtrip.py [--trace default] [--seeds 42-51] [--policies fgd-balance,fgd]
        [--openb DIR] [--json PATH]

Prints a row per (policy, seed) and writes {"trace", "nodes", "pods", "load_seconds",
"snapshot_seconds", "runs": [{"policy", "seed", "trace_pct", "snapshot_pct", "equal"}], "all_equal"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sharegpu.cli.simulation import parse_policies, parse_seeds
from sharegpu.devcluster import controlplane, fakecluster, stack, traces
from sharegpu.kubectl import snapshot
from sharegpu.sim import runner, trace

HERE = Path(__file__).resolve().parent
Json = dict[str, Any]


async def take(openb: Path, name: str, out: Path, work: Path) -> Json:
    nodes_file, pods_file = openb / trace.NODE_FILE, openb / trace.pod_file(name)
    nodes, pods = trace.load_nodes(nodes_file), trace.load_pods(pods_file)
    plane = controlplane.ControlPlane(work / "controlplane", controlplane.binaries())
    plane.start()
    try:
        admin = stack.kube_for(plane, "admin")
        try:
            await stack.install(admin)
            started = time.perf_counter()
            await traces.load(admin, fakecluster.FakeCluster(admin), nodes, pods, "openb")
            loaded = time.perf_counter() - started
            started = time.perf_counter()
            found = snapshot.take(await snapshot.read(admin, namespace="openb"), pending_cpu_pods=True)
            snapshot.write(found, out, "bench/snapshot_roundtrip.py")
            taken = time.perf_counter() - started
        finally:
            await admin.close()
    finally:
        plane.stop()
    return {"trace": name, "nodes": len(nodes), "pods": len(pods.pods), "load_seconds": round(loaded, 1),
            "snapshot_seconds": round(taken, 2), "left_out": list(found.skipped)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openb", type=Path, default=HERE.parent.parent / "shared" / "traces" / "openb")
    parser.add_argument("--trace", default="default")
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--policies", default="fgd-balance,fgd")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not (args.openb / trace.NODE_FILE).is_file():
        print(
            f"bench/snapshot_roundtrip.py: error: {args.openb / trace.NODE_FILE} not found (--openb DIR)",
            file=sys.stderr,
        )
        return 2
    seeds, policies = parse_seeds(args.seeds), parse_policies([args.policies])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "snapshot"
        summary = asyncio.run(take(args.openb, args.trace, out, Path(tmp)))
        print(f"loaded {summary['nodes']} nodes and {summary['pods']} pods in {summary['load_seconds']} s; "
              f"snapshot in {summary['snapshot_seconds']} s; left out: {len(summary['left_out'])}")  # fmt: skip
        original = runner.Source(
            args.trace, str(args.openb / trace.NODE_FILE), str(args.openb / trace.pod_file(args.trace))
        )
        taken = runner.Source("snapshot", str(out / trace.NODE_FILE), str(out / trace.pod_file(snapshot.TRACE)))
        specs = [runner.RunSpec(s, p, seed) for p in policies for seed in seeds for s in (original, taken)]
        results = runner.run_all(specs)
    runs = []
    for i in range(0, len(results), 2):
        one, two = results[i], results[i + 1]
        equal = (one.unallocated_gpu_pct_at_arrived_100, one.placed, one.curve_y) == (
            two.unallocated_gpu_pct_at_arrived_100, two.placed, two.curve_y,
        )  # fmt: skip
        runs.append({"policy": one.policy, "seed": one.seed, "trace_pct": one.unallocated_gpu_pct_at_arrived_100,
                     "snapshot_pct": two.unallocated_gpu_pct_at_arrived_100, "equal": equal})  # fmt: skip
        print(f"{one.policy:12} seed {one.seed}: trace {one.unallocated_gpu_pct_at_arrived_100}  "
              f"snapshot {two.unallocated_gpu_pct_at_arrived_100}  {'equal' if equal else 'DIFFERENT'}")  # fmt: skip
    summary |= {"runs": runs, "all_equal": all(r["equal"] for r in runs)}
    print(f"all equal: {summary['all_equal']}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
