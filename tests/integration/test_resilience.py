"""Load and failure: many pods at once, and the extender killed (SIGKILL) and restarted during churn."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sharegpu.api import pods, wire
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.integration.conftest import consistent, gpu_pod, wait_for

Json = dict[str, Any]


async def settle(kube: client.KubeClient, namespace: str, quiet: float = 4.0, timeout: float = 180) -> int:
    """Wait until the number of bound pods stops changing for `quiet` seconds; returns it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last, since = -1, loop.time()
    while loop.time() < deadline:
        items, _ = await kube.list_all(f"/api/v1/namespaces/{namespace}/pods")
        bound = sum(1 for p in items if p["spec"].get("nodeName"))
        if bound != last:
            last, since = bound, loop.time()
        elif loop.time() - since >= quiet:
            return bound
        await asyncio.sleep(0.5)
    raise AssertionError(f"pods in {namespace} did not settle in {timeout} s")


def random_pod(rng: random.Random, name: str, namespace: str) -> Json:
    kind = rng.random()
    if kind < 0.7:
        return gpu_pod(name, namespace, milli=rng.choice([100, 200, 250, 300, 500, 700]))
    if kind < 0.9:
        return gpu_pod(name, namespace, nvidia=1)
    return gpu_pod(name, namespace, count=2)


async def extender_agrees_with_api(kube: client.KubeClient, extender: ExtenderProcess, node_names: list[str]) -> bool:
    """The extender's ledger holds exactly what the API's bound pods say (no leak, nothing stale)."""
    items, _ = await kube.list_of("/api/v1/pods", wire.Pod)
    expected: dict[tuple[str, int], int] = defaultdict(int)
    for pod in items:
        node = pod.spec.node_name
        if node not in node_names or pods.is_terminal(pod) or pods.is_reservation(pod):
            continue
        alloc = pods.allocation_of(pod)
        if alloc is not None:
            for index, (milli, _) in alloc.gpu_usage().items():
                expected[(node, index)] += milli
    summary = {n["node"]: n for n in await extender.debug_nodes()}
    for node in node_names:
        for gpu in summary[node]["gpus"]:
            if gpu["milli"]["used"] != expected.get((node, gpu["index"]), 0):
                return False
            if any(h["phase"] == "Assumed" for h in gpu["holders"]):
                return False
    return True


async def test_300_pods_at_once_on_20_nodes_never_overcommit(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    names = await nodes(20, gpus=4)
    rng = random.Random(7)
    pods = [random_pod(rng, f"load-{i}", namespace) for i in range(300)]
    await asyncio.gather(*(admin.create(f"/api/v1/namespaces/{namespace}/pods", p) for p in pods))
    bound = await settle(admin, namespace)
    assert bound > 100
    result = await consistent(admin)
    assert result.bound >= bound
    await wait_for(lambda: extender_agrees_with_api(admin, extender, names), what="extender ledger == API")


async def test_extender_killed_and_restarted_during_churn(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    names = await nodes(8, gpus=4)
    rng = random.Random(11)
    created: list[str] = []
    serial = 0

    async def churn(rounds: int) -> None:
        nonlocal serial
        for _ in range(rounds):
            for _ in range(6):
                name = f"churn-{serial}"
                serial += 1
                await admin.create(f"/api/v1/namespaces/{namespace}/pods", random_pod(rng, name, namespace))
                created.append(name)
            for _ in range(3):
                if created:
                    victim = created.pop(rng.randrange(len(created)))
                    await admin.delete(f"/api/v1/namespaces/{namespace}/pods/{victim}", grace_period=0)
            await asyncio.sleep(rng.uniform(0.05, 0.4))

    for _ in range(4):
        await churn(rng.randint(2, 6))
        extender.kill()  # SIGKILL, at a random point of the churn
        await churn(rng.randint(1, 3))  # pods come and go while it is down
        extender.start()
        await extender.wait_ready()
    await churn(3)
    await settle(admin, namespace)
    await consistent(admin)
    await wait_for(lambda: extender_agrees_with_api(admin, extender, names), what="extender ledger == API")

    async def no_orphan_reservations() -> bool:
        summary = {n["node"]: n for n in await extender.debug_nodes()}
        return all(not (gpu["reservation"] and not gpu["holders"]) for node in names for gpu in summary[node]["gpus"])

    await wait_for(no_orphan_reservations, what="no reservation without sharers")
