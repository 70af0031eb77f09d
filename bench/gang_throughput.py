"""Gang placement speed through the real kube-scheduler and extender: gangs of 8 at 1000 fake nodes.

Starts the local stack (control plane, extender, kube-scheduler) with N fake nodes of 8 GPUs, then
places the same pods twice: first as single pods (no gang), then as gangs (`sharegpu.io/gang`, the
minimum the gang's size), each member half a GPU. For the gangs: the time to place each gang (from
its first member's creation to its last member's binding; p50 and p99), gangs per second and pods
per second over the phase; for the single pods, pods per second and the creation-to-binding p99.

    python bench/gang_throughput.py --nodes 1000 --gangs 100 --size 8 [--json PATH]

JSON keys: gangs_per_second, p99_ms (gang placement), pods_per_second (gang members), p50_ms, and
singles: pods_per_second, p99_ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import e2e_throughput as e2e
from sharegpu.api import names
from sharegpu.core import devices
from sharegpu.devcluster import stack

Json = dict[str, Any]
MILLI = 500


def member(gang: int, index: int, size: int, namespace: str) -> Json:
    body = e2e.sharing_pod(f"g{gang:03d}-{index}", namespace, MILLI)
    body["metadata"]["annotations"] = {names.GANG: f"g{gang:03d}", names.GANG_MIN: str(size)}
    return body


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sharegpu-bench-") as tmp:
        whole = stack.Stack(Path(tmp))
        await whole.start(harness=False)
        try:
            assert whole.harness is not None and whole.admin is not None
            made = [
                devices.uniform_node(f"bench-{i:04d}", gpu_count=8, model="A100", gpu_memory_mib=81920,
                                     cpu_milli=128000, memory_mib=1 << 20, nvlink_all=True)
                for i in range(args.nodes)
            ]  # fmt: skip
            await whole.harness.add_nodes(made, parallel=32)
            await asyncio.sleep(3)
            total = args.gangs * args.size
            singles = [e2e.sharing_pod(f"s-{i}", "bench-singles", MILLI) for i in range(total)]
            created, bound, elapsed = await e2e.place(whole.admin, "bench-singles", singles, args.timeout)
            single_lat = sorted(bound[n] - created[n] for n in bound)
            single = {"pods_per_second": round(total / elapsed, 1), "p99_ms": e2e.percentile(single_lat, 99)}
            print(f"single pods: {single['pods_per_second']} pods/s, creation to binding p99 {single['p99_ms']:.0f} ms")
            members = [member(g, i, args.size, "bench-gangs") for g in range(args.gangs) for i in range(args.size)]
            created, bound, elapsed = await e2e.place(whole.admin, "bench-gangs", members, args.timeout)
            per_gang = []
            for g in range(args.gangs):
                names_ = [f"g{g:03d}-{i}" for i in range(args.size)]
                per_gang.append(max(bound[n] for n in names_) - min(created[n] for n in names_))
                spread = max(bound[n] for n in names_) - min(bound[n] for n in names_)
                if spread > 5:
                    print(f"gang {g}: its members were bound {spread:.1f} s apart", file=sys.stderr)
            result = {
                "gangs_per_second": round(args.gangs / elapsed, 2),
                "pods_per_second": round(total / elapsed, 1),
                "p50_ms": e2e.percentile(per_gang, 50),
                "p99_ms": e2e.percentile(per_gang, 99),
                "singles": single,
                "nodes": args.nodes,
                "gangs": args.gangs,
                "size": args.size,
            }
            print(f"gangs of {args.size}: {result['gangs_per_second']} gangs/s, {result['pods_per_second']} pods/s, "
                  f"time to place a gang p50 {result['p50_ms']:.0f} ms, p99 {result['p99_ms']:.0f} ms")  # fmt: skip
            return result
        finally:
            await whole.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gangs", type=int, default=100)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
