"""How soon a pod the extender turned away lands once GPUs free up, on the real control plane.

kube-scheduler (1.27 and later) keeps a pod that an extender refused among its unschedulable pods
until a cluster event it watches moves it (the extender's refusal names no plugin, so any such
event does), or for five minutes. Two ways a GPU frees up are measured, each `--runs` times, from
the moment the GPU frees to the waiting pod's binding:

- `deleted`: the GPU pod holding the GPU is deleted (an assigned pod's deletion: kube-scheduler sees it);
- `healed`: the GPU was unhealthy and the node's agent sees it healthy again (the Device is sharegpu's
  own resource; the agent's `sharegpu.io/gpu-healthy` node label is the event kube-scheduler sees).

The waiting pod is left among the unschedulable pods for `--settle` seconds first (past its backoff).

    python bench/requeue.py [--runs 5] [--settle 12] [--json PATH]

Writes {"kubernetes", "deleted_seconds": [...], "healed_seconds": [...], "deleted_max", "healed_max"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import names, paths
from sharegpu.core import devices
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client

Json = dict[str, Any]
NS = "requeue"


def pod(name: str, node: str, milli: int | None) -> Json:
    limits = {"cpu": "100m", "memory": "64Mi"}
    limits |= {names.GPU: "1", names.GPU_MILLI: str(milli)} if milli else {names.NVIDIA_GPU: "1"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": limits}}],
        },
    }


async def bound(api: client.KubeClient, name: str) -> bool:
    return bool((await api.get(paths.pod(NS, name)))["spec"].get("nodeName"))


async def turned_away(api: client.KubeClient, name: str) -> bool:
    found = await api.get(paths.pod(NS, name))
    conditions = (found.get("status") or {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c["status"] == "False" for c in conditions)


async def until(check: Any, timeout: float) -> float:
    """Seconds until `check()` holds (raises after `timeout`)."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not within {timeout:.0f} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def deleted_run(api: client.KubeClient, node: str, settle: float) -> float:
    tag = uuid.uuid4().hex[:5]
    await api.create(paths.pods(NS), pod(f"holder-{tag}", node, 700))
    await until(lambda: bound(api, f"holder-{tag}"), 60)
    await api.create(paths.pods(NS), pod(f"waiting-{tag}", node, 700))
    await until(lambda: turned_away(api, f"waiting-{tag}"), 60)
    await asyncio.sleep(settle)
    await api.delete(paths.pod(NS, f"holder-{tag}"), grace_period=0)
    seconds = await until(lambda: bound(api, f"waiting-{tag}"), 400)
    await api.delete(paths.pod(NS, f"waiting-{tag}"), grace_period=0)
    await asyncio.sleep(2)  # its share released before the next run
    return seconds


async def healed_run(api: client.KubeClient, node: str, nvml: Path, inventory: devices.NodeInventory,
                     settle: float) -> float:  # fmt: skip
    tag = uuid.uuid4().hex[:5]
    nvml.write_text(fakenvml.describe(inventory) + "faults: {unreadable: [0]}\n")
    await asyncio.sleep(3)  # the agent marks the GPU unhealthy
    await api.create(paths.pods(NS), pod(f"whole-{tag}", node, None))
    await until(lambda: turned_away(api, f"whole-{tag}"), 60)
    await asyncio.sleep(settle)
    nvml.write_text(fakenvml.describe(inventory))
    healed = time.monotonic()
    await until(lambda: bound(api, f"whole-{tag}"), 400)
    seconds = time.monotonic() - healed  # includes the agent's pass (every 0.5 s here)
    await api.delete(paths.pod(NS, f"whole-{tag}"), grace_period=0)
    await asyncio.sleep(2)
    return seconds


async def run(args: argparse.Namespace) -> Json:
    with tempfile.TemporaryDirectory(prefix="sharegpu-requeue-") as tmp:
        made = stack.Stack(Path(tmp))
        try:
            await made.start()
            assert made.admin is not None and made.harness is not None
            api = made.admin
            await api.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
            shared = devices.uniform_node("rq-shared", gpu_count=1, model="T4", gpu_memory_mib=16384,
                                          cpu_milli=32000, memory_mib=65536)  # fmt: skip
            await made.harness.add_node(shared)
            whole = devices.uniform_node("rq-agent", gpu_count=1, model="T4", gpu_memory_mib=16384,
                                         cpu_milli=32000, memory_mib=65536)  # fmt: skip
            await made.harness.add_node(whole, publish=False)
            nvml = Path(tmp) / "nvml.yaml"
            nvml.write_text(fakenvml.describe(whole))
            kube = stack.kube_for(made.plane, "sharegpu-agent")
            agent = agent_runtime.Agent(kube, whole.name, fakenvml.FakeNvml(nvml).open(),
                                        agent_runtime.Options(interval=0.5))  # fmt: skip
            await agent.start()
            try:
                deleted = [await deleted_run(api, shared.name, args.settle) for _ in range(args.runs)]
                healed = [await healed_run(api, whole.name, nvml, whole, args.settle) for _ in range(args.runs)]
            finally:
                await agent.stop()
                await kube.close()
        finally:
            await made.stop()
    return {
        "kubernetes": controlplane.k8s_version(),
        "deleted_seconds": [round(s, 2) for s in deleted],
        "healed_seconds": [round(s, 2) for s in healed],
        "deleted_max": round(max(deleted), 2),
        "healed_max": round(max(healed), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--settle", type=float, default=12.0, help="seconds the pod waits turned away first")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
