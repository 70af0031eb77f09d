"""Scheduling throughput through the real kube-scheduler, with and without the sharegpu extender.

Starts the local control plane (scripts/build-controlplane), the extender and kube-scheduler with the
project's configuration, creates N fake nodes with 8 GPUs each, then schedules the same number of
pods twice on them: plain pods (no GPU: kube-scheduler alone) and sharing pods (fractional GPUs:
filter, prioritize and bind through the extender, reservation pods included). Prints pods/s for
both and their ratio.

    python bench/e2e_throughput.py --nodes 1000 --pods 2000 [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sharegpu.api import names, paths, wire
from sharegpu.core import devices
from sharegpu.devcluster import stack
from sharegpu.kube import client, informer

Json = dict[str, Any]


def plain_pod(name: str, namespace: str) -> Json:
    limits = {"cpu": "100m", "memory": "64Mi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": limits}}],
        },
    }


def sharing_pod(name: str, namespace: str, milli: int) -> Json:
    body = plain_pod(name, namespace)
    limits = body["spec"]["containers"][0]["resources"]["limits"]
    limits.update({names.GPU_MILLI: str(milli)})
    body["spec"]["containers"][0]["resources"]["requests"] = dict(limits)
    return body


async def schedule(kube: client.KubeClient, namespace: str, pods: list[Json], timeout: float) -> float:
    """Create `pods` (64 at a time) and return pods/s from the first create to the last binding."""
    await kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    bound: set[str] = set()
    done = asyncio.Event()

    def seen(kind: str, pod: wire.Pod) -> None:
        if kind != "DELETED" and pod.spec.node_name:
            bound.add(pod.metadata.name)
            if len(bound) == len(pods):
                done.set()

    watcher: informer.Informer[wire.Pod, wire.Pod] = informer.Informer(
        kube, paths.pods(namespace), wire.Pod, informer.identity, seen, name=namespace
    )
    task = asyncio.create_task(watcher.run())
    await watcher.synced.wait()
    limit = asyncio.Semaphore(64)

    async def create(body: Json) -> None:
        async with limit:
            await kube.create(f"/api/v1/namespaces/{namespace}/pods", body)

    started = time.perf_counter()
    await asyncio.gather(*(create(p) for p in pods))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        raise SystemExit(
            f"only {len(bound)} of {len(pods)} pods in {namespace} were bound in {timeout:.0f} s"
        ) from None
    elapsed = time.perf_counter() - started
    await informer.cancel([task])
    return len(pods) / elapsed


async def run(args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="sharegpu-bench-") as tmp:
        whole = stack.Stack(Path(tmp))
        await whole.start(harness=False)
        try:
            assert whole.harness is not None and whole.admin is not None
            started = time.perf_counter()
            await whole.harness.add_nodes(
                [
                    devices.uniform_node(
                        f"bench-{i:04d}",
                        gpu_count=8,
                        model="A100",
                        gpu_memory_mib=81920,
                        cpu_milli=128000,
                        memory_mib=1 << 20,
                        nvlink_all=True,
                    )
                    for i in range(args.nodes)
                ],
                parallel=32,
            )
            print(f"{args.nodes} fake nodes with 8 GPUs each ready in {time.perf_counter() - started:.1f} s")
            await asyncio.sleep(3)  # let kube-scheduler's and the extender's caches see every node
            plain = await schedule(
                whole.admin,
                "bench-plain",
                [plain_pod(f"plain-{i}", "bench-plain") for i in range(args.pods)],
                args.timeout,
            )
            print(f"plain pods (kube-scheduler alone):   {plain:7.1f} pods/s")
            rng = random.Random(3)
            sharing = await schedule(
                whole.admin,
                "bench-sharing",
                [
                    sharing_pod(f"share-{i}", "bench-sharing", rng.choice([100, 200, 250, 300, 500]))
                    for i in range(args.pods)
                ],
                args.timeout,
            )
            print(f"sharing pods (through the extender): {sharing:7.1f} pods/s")
        finally:
            await whole.stop()
    return {
        "plain_pods_per_second": round(plain, 2),
        "extender_pods_per_second": round(sharing, 2),
        "ratio": round(sharing / plain, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"ratio extender/plain: {result['ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
