"""Extender filter + prioritize latency for one pod over 1000 candidate nodes x 8 GPUs, in process.

Builds the extender's cluster cache from synthetic Node and Device objects (no API server), fills
the GPUs part-way with sharing pods, then times the filter and prioritize handlers (the work a
kube-scheduler request costs, without HTTP) for a stream of pods of mixed shapes, placing each.

    python bench/extender_latency.py [--nodes 1000] [--gpus 8] [--pods 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sharegpu.core import devices
from sharegpu.extender import cache, server
from sharegpu.kube import objects

Json = dict[str, Any]


def node_objects(count: int, gpus: int) -> tuple[list[Json], list[Json]]:
    nodes, devs = [], []
    for i in range(count):
        name = f"node-{i:04d}"
        inventory = devices.uniform_node(
            name,
            gpu_count=gpus,
            model="A100",
            gpu_memory_mib=81920,
            cpu_milli=128000,
            memory_mib=1 << 20,
            nvlink_all=True,
        )
        nodes.append(
            {
                "metadata": {"name": name},
                "spec": {},
                "status": {
                    "allocatable": {"cpu": "128", "memory": "1Ti"},
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }
        )
        devs.append(objects.device_object(inventory))
    return nodes, devs


def pod(name: str, milli: int, count: int = 1) -> Json:
    limits = {names.GPU: str(count), names.GPU_MILLI: str(milli), "cpu": "1", "memory": "1Gi"}
    return {
        "metadata": {"name": name, "namespace": "bench", "uid": name, "annotations": {}},
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            "containers": [{"name": "main", "resources": {"limits": limits, "requests": limits}}],
        },
    }


async def run(args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(1)
    view = cache.ClusterCache("fgd-used")
    nodes, devs = node_objects(args.nodes, args.gpus)
    for n in nodes:
        view.on_node("ADDED", n)
    for d in devs:
        view.on_device("ADDED", d)
    view.rebuild()
    extender = server.Extender(None, view)  # type: ignore[arg-type]  # no API calls on these paths
    names = [n["metadata"]["name"] for n in nodes]
    shapes = [(100, 1), (250, 1), (300, 1), (500, 1), (700, 1), (1000, 1), (1000, 2)]
    timings = []
    for i in range(args.pods):
        milli, count = rng.choice(shapes)
        manifest = pod(f"p{i}", milli, count)
        started = time.perf_counter()
        filtered = await extender.filter({"Pod": manifest, "NodeNames": names})
        await extender.prioritize({"Pod": manifest, "NodeNames": filtered["NodeNames"]})
        timings.append((time.perf_counter() - started) * 1000)
        if filtered["NodeNames"]:  # place it, as a bind would, so the cluster fills up
            request = objects.pod_request(manifest)
            row = view.state.row(filtered["NodeNames"][0])
            decision = view.placer.decide(request.demand, np.array([row]))
            view.ledger.add(view.placer.allocation_for(request, decision))
    values = np.array(timings)
    return {
        "p50_ms": round(float(np.percentile(values, 50)), 4),
        "p99_ms": round(float(np.percentile(values, 99)), 4),
        "mean_ms": round(float(values.mean()), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(
        f"filter+prioritize over {args.nodes} nodes x {args.gpus} GPUs, {args.pods} pods: "
        f"p50 {result['p50_ms']:.3f} ms, p99 {result['p99_ms']:.3f} ms, mean {result['mean_ms']:.3f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
