"""How fast the extender rebuilds its cache from a real API server holding a large cluster, and
how much memory it then holds.

Starts the local control plane, writes N Nodes, their Devices (8 GPUs each) and M pods already
bound with their allocation annotations (as a running cluster would hold them), then starts
`sharegpu extender` as its own process and measures: the time from the end of its list calls to a
built cache (the extender reports it), the time from process start to /readyz, and its resident
memory once ready.

    python bench/rebuild.py --nodes 5000 --pods 50000 [--json PATH]

Writes {"rebuild_seconds", "list_seconds", "ready_from_process_start_seconds", "rss_mib", "nodes",
"pods"}. Targets: rebuild < 3 s, rss < 500 MiB.
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

import aiohttp

from sharegpu.api import devices as api_devices
from sharegpu.api import names, paths, wire
from sharegpu.core import allocation, devices, units
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

Json = dict[str, Any]
GPUS = 8


def node(i: int) -> tuple[Json, Json]:
    name = f"node-{i:05d}"
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "capacity": {"cpu": "128", "memory": "1Ti", "pods": "250", names.NVIDIA_GPU: str(GPUS)},
            "allocatable": {"cpu": "128", "memory": "1Ti", "pods": "250", names.NVIDIA_GPU: str(GPUS)},
            "conditions": [{"type": "Ready", "status": "True", "reason": "Bench"}],
        },
    }
    inventory = devices.uniform_node(
        name, gpu_count=GPUS, model="A100", gpu_memory_mib=81920, cpu_milli=1, memory_mib=1, nvlink_all=True
    )
    return body, wire.encode(api_devices.device(inventory))


def pod(i: int, nodes: int) -> Json:
    """A sharing pod bound to its node with its allocation (the way the extender leaves them)."""
    node_name = f"node-{i % nodes:05d}"
    gpu = (i // nodes) % GPUS
    grant = allocation.DeviceGrant(gpu, 100, 2048, 200, uuid=f"GPU-{node_name}-{gpu}")
    alloc = allocation.Allocation(
        units.PodKey(f"bench/p{i}"), units.NodeName(node_name), (allocation.ContainerAllocation("main", (grant,)),)
    )
    limits = {names.GPU: "1", names.GPU_MILLI: "100", names.GPU_MEMORY: "2048", "cpu": "500m", "memory": "1Gi"}
    reference = {"name": f"sharegpu-handoff-{i:016x}", "key": "main.NVIDIA_VISIBLE_DEVICES"}
    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": reference}}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"p{i}",
            "labels": {"app": f"trainer-{i % 97}", "team": f"team-{i % 13}"},
            "annotations": {
                names.ALLOCATION: alloc.to_json(),
                names.HANDOFF: f"sharegpu-handoff-{i:016x}",
                names.LIMIT_MILLI: "200",
            },
        },
        "spec": {
            "nodeName": node_name,
            "schedulerName": names.SCHEDULER_NAME,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.example.com/ml/trainer:2026.11",
                    "command": ["python", "-m", "trainer", "--epochs", "30"],
                    "env": env,
                    "resources": {"limits": limits, "requests": limits},
                }
            ],
        },
    }


async def populate(kube: client.KubeClient, nodes: int, pods: int, parallel: int = 64) -> None:
    limit = asyncio.Semaphore(parallel)
    started = time.perf_counter()

    async def create(path: str, body: Json) -> None:
        async with limit:
            for _ in range(5):
                try:
                    await kube.create(path, body)
                    return
                except kube_errors.TemporaryError:
                    await asyncio.sleep(1)

    made = [node(i) for i in range(nodes)]
    await asyncio.gather(*(create(paths.NODES, n) for n, _ in made))
    await asyncio.gather(*(create(paths.DEVICES, d) for _, d in made))
    print(f"{nodes} nodes and Devices written in {time.perf_counter() - started:.0f} s", flush=True)
    await kube.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}})
    batch = 5000
    for start in range(0, pods, batch):
        await asyncio.gather(
            *(create(paths.pods("bench"), pod(i, nodes)) for i in range(start, min(pods, start + batch)))
        )
        print(f"  {min(pods, start + batch)} pods written ({time.perf_counter() - started:.0f} s)", flush=True)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def run(args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="sharegpu-rebuild-") as tmp:
        plane = controlplane.ControlPlane(Path(tmp), controlplane.binaries())
        plane.start()
        try:
            admin = stack.kube_for(plane, "admin", connections=128)
            await stack.install(admin)
            await populate(admin, args.nodes, args.pods)
            await admin.close()
            extender = stack.ExtenderProcess(plane, "fgd-used", "--no-leader-elect")
            started = time.perf_counter()
            extender.start()
            await extender.wait_ready(timeout=600)
            ready = time.perf_counter() - started
            assert extender.process is not None
            memory = rss_mib(extender.process.pid)
            async with aiohttp.ClientSession(headers=extender.headers) as session:
                async with session.get(f"{extender.health_url}/debug/informers", ssl=extender.health_ssl) as response:
                    startup = (await response.json())["startup"]
                async with session.get(f"{extender.health_url}/debug/nodes", ssl=extender.health_ssl) as response:
                    summary = await response.json()
            extender.kill()
        finally:
            plane.stop()
    held = sum(len(g["holders"]) for n in summary["nodes"] for g in n["gpus"])
    assert held == args.pods, f"the rebuilt ledger holds {held} allocations, expected {args.pods}"
    return {
        "nodes": args.nodes,
        "pods": args.pods,
        "list_seconds": startup["listSeconds"],
        "rebuild_seconds": startup["rebuildSeconds"],
        "ready_from_process_start_seconds": round(ready, 3),
        "rss_mib": round(memory, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=50000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(
        f"extender over {args.nodes} nodes and {args.pods} pods: lists {result['list_seconds']:.2f} s, "
        f"cache built {result['rebuild_seconds']:.2f} s after the last page, ready "
        f"{result['ready_from_process_start_seconds']:.2f} s after process start, RSS {result['rss_mib']:.0f} MiB"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
