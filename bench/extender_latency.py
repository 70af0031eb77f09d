"""Extender filter + prioritize latency for one pod over N candidate nodes x 8 GPUs, in process.

Runs the real extender (informers, cache, scheduling service) over the in-memory fake API server
holding N GPU nodes, then for a stream of pods of mixed shapes times what one kube-scheduler request
costs the extender without the HTTP transport: decoding the request body (the pod and every
candidate node name, in another order from pod to pod as kube-scheduler sends them) into typed messages,
filter, prioritize when kube-scheduler would call it (more than one node left), and encoding the
answers. Each pod is then bound through the same service, so the cluster fills up.

    python bench/extender_latency.py [--nodes 1000] [--gpus 8] [--pods 2000] [--policies A,B] [--json PATH]

Writes {"p50_ms", "p99_ms", "mean_ms", "nodes", "first_of_shape_max_ms"} for the first policy named
(default: the extender's default): the first pod of each shape is scored on every node (later ones
only on nodes changed since), and that cost is reported apart as well as inside the percentiles.
With several policies (`--policies fgd-balance,fgd-fill`), each runs the same stream in turn, and
"by_policy" holds each one's figures and "p99_ratio" each one's p99 over the first's. The first run
of a process is slower (imports, caches): with `--rounds 2` the policies run forth then back (A B B
A) and each figure is the mean over its rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from sharegpu.api import devices as api_devices
from sharegpu.api import extender as api_extender
from sharegpu.api import names, paths, wire
from sharegpu.core import devices, policies
from sharegpu.extender import runtime
from sharegpu.kube import client, fake

Json = dict[str, Any]


def cluster(count: int, gpus: int) -> fake.FakeApiServer:
    server = fake.FakeApiServer()
    for i in range(count):
        name = f"node-{i:04d}"
        inventory = devices.uniform_node(
            name, gpu_count=gpus, model="A100", gpu_memory_mib=81920, cpu_milli=128000, memory_mib=1 << 20,
            nvlink_all=True,
        )  # fmt: skip
        server.put_object(
            paths.NODES,
            {
                "metadata": {"name": name},
                "status": {
                    "allocatable": {"cpu": "128", "memory": "1Ti"},
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            },
        )
        server.put_object(paths.DEVICES, wire.encode(api_devices.device(inventory)))
    return server


def pod(name: str, milli: int, count: int = 1) -> Json:
    limits = {names.GPU: str(count), names.GPU_MILLI: str(milli), "cpu": "1", "memory": "1Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "bench", "annotations": {}},
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            "containers": [{"name": "main", "resources": {"limits": limits, "requests": limits}}],
        },
    }


def kube_scheduler_order(names: list[str], cycle: int, rng: random.Random) -> list[str]:
    """The candidates in an order like kube-scheduler's: it starts each cycle at another node, and
    its 16 filter goroutines append the nodes that pass as they finish (neighbours swap places)."""
    start = (cycle * 97) % len(names)
    order = names[start:] + names[:start]
    for i in range(0, len(order) - 1, 2):
        if rng.random() < 0.2:
            order[i], order[i + 1] = order[i + 1], order[i]
    return order


async def run(args: argparse.Namespace, policy: str) -> dict[str, float]:
    rng = random.Random(1)
    server = cluster(args.nodes, args.gpus)
    api = client.KubeClient(server)
    extender = runtime.Extender(api, runtime.Options(leader_elect=False, policy=policy))
    await extender.start()
    service = extender.scheduling
    node_names = sorted(extender.cache.nodes)
    shapes = [(100, 1), (250, 1), (300, 1), (500, 1), (700, 1), (1000, 1), (1000, 2)]
    timings = []
    cold: list[float] = []
    seen: set[tuple[int, int]] = set()
    try:
        for i in range(args.pods):
            milli, count = rng.choice(shapes)
            made = await api.create(paths.pods("bench"), pod(f"p{i}", milli, count))
            body = msgspec.json.encode({"Pod": made, "NodeNames": kube_scheduler_order(node_names, i, rng)})
            started = time.perf_counter()
            verdict = service.filter(wire.decode(body, api_extender.Args))
            api_extender.ENCODER.encode(verdict)
            if len(verdict.node_names) > 1:  # kube-scheduler calls prioritize only when several nodes are left
                again = msgspec.json.encode({"Pod": made, "NodeNames": verdict.node_names})
                api_extender.ENCODER.encode(service.prioritize(wire.decode(again, api_extender.Args)))
            timings.append((time.perf_counter() - started) * 1000)
            if (milli, count) not in seen:  # the first pod of a shape scores every node once
                seen.add((milli, count))
                cold.append(timings[-1])
            if verdict.node_names:  # bind it through the same service, so the cluster fills up
                await asyncio.sleep(0)
                binding = api_extender.BindingArgs(
                    pod_name=f"p{i}", pod_namespace="bench", pod_uid=made["metadata"]["uid"], node=verdict.node_names[0]
                )
                result = await service.bind(binding)
                assert not result.error, result.error
    finally:
        await extender.stop()
    values = np.array(timings)
    return {
        "nodes": args.nodes,
        "p50_ms": round(float(np.percentile(values, 50)), 4),
        "p99_ms": round(float(np.percentile(values, 99)), 4),
        "mean_ms": round(float(values.mean()), 4),
        "first_of_shape_max_ms": round(max(cold), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--policies", default=policies.DEFAULT, help="comma-separated; the first is the reference")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each policy, forth then back")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    names = [policies.check(name) for name in args.policies.split(",")]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            runs[name].append(asyncio.run(run(args, name)))
    figures = {
        name: {key: round(statistics.fmean(r[key] for r in done), 4) for key in done[0]} for name, done in runs.items()
    }
    for name, result in figures.items():
        print(
            f"{name}: filter+prioritize over {args.nodes} nodes x {args.gpus} GPUs, {args.pods} pods"
            f"{f' (mean of {args.rounds} rounds)' if args.rounds > 1 else ''}: "
            f"p50 {result['p50_ms']:.3f} ms, p99 {result['p99_ms']:.3f} ms, mean {result['mean_ms']:.3f} ms; "
            f"the first pod of a shape (all nodes scored): up to {result['first_of_shape_max_ms']:.1f} ms"
        )
    first = figures[names[0]]
    out: dict[str, Any] = {**first, "policy": names[0]}
    if len(names) > 1:
        out["by_policy"] = figures
        out["p99_ratio"] = {name: round(f["p99_ms"] / first["p99_ms"], 3) for name, f in figures.items()}
        print("p99 over " + names[0] + "'s: " + ", ".join(f"{n} {r:.2f}" for n, r in out["p99_ratio"].items()))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
