"""The defragmenter's pass at scale, and what it does to the controller's event loop.

Builds a `controller.defrag.DefragReconciler` (dry run, over the in-process fake API server) fed
N nodes with 8 GPUs each, fills each GPU with running pods of 300 to 700 milli-GPU drawn at random
until the next one drawn does not fit (owned by ReplicaSets, so all are movable), and marks a few
pods of 700 milli pending and Unschedulable. Then it runs the
reconciler's own loop for `--seconds` with a heartbeat task beside it that wakes every 10 ms, and
reports: passes run and planned, the seconds per planning pass, and the longest the heartbeat
waited (how long the controller's event loop, which also renews its Lease, answers /readyz and
feeds every informer, was held). Without `--churn` nothing changes meanwhile, as in a cluster
whose pending pods wait for GPUs nobody frees; `--churn N` delivers N pod events a second (a busy
cluster: every event may change the plan).

    python bench/defrag_pass.py --nodes 5000 [--pending 8] [--seconds 20] [--churn 20] [--json PATH]

Writes {"nodes", "pods", "passes", "planned_passes", "pass_seconds_max", "loop_stall_max_ms"}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from sharegpu.api import devices as api_devices
from sharegpu.api import names, wire
from sharegpu.controller import defrag, defrag_inputs
from sharegpu.core import devices
from sharegpu.kube import client, fake
from sharegpu.kube import events as kube_events

Json = dict[str, Any]
GPUS = 8


def node(name: str) -> wire.Node:
    body = {
        "metadata": {"name": name, "labels": {}},
        "status": {
            "allocatable": {"cpu": "128", "memory": "1024Gi", names.NVIDIA_GPU: str(GPUS)},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    return wire.convert(body, wire.Node)


def device(name: str) -> wire.Device:
    inventory = devices.uniform_node(
        name, gpu_count=GPUS, model="A100", gpu_memory_mib=81920, cpu_milli=1, memory_mib=1
    )
    return wire.convert(wire.encode(api_devices.device(inventory)), wire.Device)


def pod(name: str, milli: int, node_name: str | None = None, gpu: int = 0) -> wire.Pod:
    limits = {"cpu": "100m", "memory": "64Mi", names.GPU: "1", names.GPU_MILLI: str(milli)}
    meta: Json = {
        "name": name,
        "namespace": "team",
        "uid": f"uid-{name}",
        "labels": {"app": name},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name, "uid": f"rs-{name}",
                             "controller": True}],
    }  # fmt: skip
    spec: Json = {
        "schedulerName": names.SCHEDULER_NAME,
        "containers": [{"name": "main", "resources": {"limits": limits, "requests": dict(limits)}}],
    }
    status: Json = {"phase": "Running"}
    if node_name is None:
        status = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "no GPU"}]}  # fmt: skip
    else:
        grant = {"index": gpu, "uuid": f"GPU-{node_name}-{gpu}", "milli": milli, "limitMilli": milli, "memoryMiB": 0}
        alloc = {"version": 1, "node": node_name, "exclusive": False,
                 "containers": [{"name": "main", "init": False, "devices": [grant]}]}  # fmt: skip
        meta["annotations"] = {names.ALLOCATION: orjson.dumps(alloc).decode()}
        spec["nodeName"] = node_name
    return wire.convert({"metadata": meta, "spec": spec, "status": status}, wire.Pod)


def build(nodes: int, pending: int, seed: int) -> defrag.DefragReconciler:
    """A dry-run reconciler fed as its informers would feed it."""
    api = client.KubeClient(fake.FakeApiServer())
    recorder = kube_events.Recorder(api, "sharegpu-bench", "bench", time.time)
    reconciler = defrag.DefragReconciler(api, recorder, evict=False, cooldown=3600)
    rng = random.Random(seed)
    count = 0
    for n in range(nodes):
        name = f"node-{n:05d}"
        reconciler.on_node(wire.EventType.ADDED, defrag_inputs.node_view(node(name)))
        reconciler.on_device(wire.EventType.ADDED, device(name))
        for g in range(GPUS):
            free = 1000
            while free >= 300:
                milli = rng.choice([300, 400, 500, 600, 700])
                if milli > free:
                    break
                free -= milli
                reconciler.on_pod(wire.EventType.ADDED, defrag_inputs.facts(pod(f"p{count}", milli, name, g)))
                count += 1
    for i in range(pending):
        reconciler.on_pod(wire.EventType.ADDED, defrag_inputs.facts(pod(f"pending-{i}", 700)))
    return reconciler


async def measure(reconciler: defrag.DefragReconciler, seconds: float, churn: float) -> dict[str, Any]:
    stall = 0.0
    durations: list[float] = []
    original = reconciler.reconcile

    async def timed() -> None:
        started = time.perf_counter()
        before = reconciler.counters.passes
        await original()
        if reconciler.counters.passes > before:
            durations.append(time.perf_counter() - started)

    reconciler.loop.reconcile = timed

    async def heartbeat() -> None:
        nonlocal stall
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            stall = max(stall, now - last - 0.01)
            last = now

    async def events() -> None:
        running = [item for item in reconciler.pods.values() if item.record.node]
        for item in itertools.cycle(running):
            await asyncio.sleep(1 / churn)
            reconciler.on_pod(wire.EventType.MODIFIED, item)

    tasks = [asyncio.create_task(reconciler.loop.run()), asyncio.create_task(heartbeat())]
    if churn > 0:
        tasks.append(asyncio.create_task(events()))
    await asyncio.sleep(seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "passes": reconciler.loop.passes,
        "planned_passes": len(durations),
        "pass_seconds_max": round(max(durations, default=0.0), 3),
        "loop_stall_max_ms": round(stall * 1000, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pending", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--churn", type=float, default=0.0, help="pod events a second while measuring")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.perf_counter()
    reconciler = build(args.nodes, args.pending, args.seed)
    pods = len(reconciler.pods)
    print(f"{args.nodes} nodes x {GPUS} GPUs, {pods} pods ({args.pending} pending) built in "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    result = {"nodes": args.nodes, "pods": pods, **asyncio.run(measure(reconciler, args.seconds, args.churn))}
    plan = reconciler.last_plan
    print(
        f"over {args.seconds:.0f} s: {result['passes']} passes, {result['planned_passes']} planned "
        f"(longest {result['pass_seconds_max']:.2f} s, {len(plan.moves) if plan else 0} moves); "
        f"the event loop was held for up to {result['loop_stall_max_ms']:.0f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
