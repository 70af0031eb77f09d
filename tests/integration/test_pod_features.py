"""Current pod features meet sharegpu's books, on the suite's Kubernetes (1.37): a native sidecar's
GPU share adds to the app containers' (it runs beside them), pod-level CPU and memory replace the
containers' total, and a CPU resize in place changes what the node has free as kube-scheduler counts
it (growing at once, shrinking once the kubelet reports it done)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sharegpu.api import paths
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.integration.conftest import gpu_pod, refusal, wait_for

Json = dict[str, Any]


async def gpu0(extender: ExtenderProcess, node: str) -> Json:
    summary = {n["node"]: n for n in await extender.debug_nodes()}
    found: Json = summary[node]["gpus"][0]
    return found


async def cpu_free(extender: ExtenderProcess, node: str) -> int:
    summary = {n["node"]: n for n in await extender.debug_nodes()}
    return int(summary[node]["cpu"]["free"])


async def bound(admin: client.KubeClient, namespace: str, name: str) -> bool:
    return bool((await admin.get(paths.pod(namespace, name)))["spec"].get("nodeName"))


async def test_a_native_sidecars_share_adds_to_the_app_containers(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=1)
    pod = gpu_pod("sidecar", namespace, milli=400)
    sidecar = {**pod["spec"]["containers"][0], "name": "log", "restartPolicy": "Always"}
    pod["spec"]["initContainers"] = [sidecar]
    await admin.create(paths.pods(namespace), pod)
    await wait_for(lambda: bound(admin, namespace, "sidecar"), what="the pod with a GPU sidecar bound")

    async def held() -> bool:
        return int((await gpu0(extender, node))["milli"]["used"]) == 800

    await wait_for(held, what="800 milli held: the sidecar's 400 beside the app's 400")
    await admin.create(paths.pods(namespace), gpu_pod("late", namespace, milli=300))

    message = await wait_for(lambda: refusal(admin, namespace, "late"), what="the late pod turned away")
    assert "no GPU with 300 milli-GPU free" in message


async def test_pod_level_resources_and_an_in_place_resize_move_the_nodes_free_cpu(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=1, cpu=8000)
    pooled = gpu_pod("pooled", namespace, milli=200)
    pooled["spec"]["resources"] = {"requests": {"cpu": "3", "memory": "128Mi"}}
    await admin.create(paths.pods(namespace), pooled)
    await wait_for(lambda: bound(admin, namespace, "pooled"), what="the pod with pod-level resources bound")

    async def free_is(value: int) -> bool:
        return await cpu_free(extender, node) == value

    await wait_for(lambda: free_is(5000), what="the pod-level 3 CPU held, not the container's 100m")

    await admin.create(paths.pods(namespace), gpu_pod("resized", namespace, milli=200, cpu="1"))
    await wait_for(lambda: bound(admin, namespace, "resized"), what="the pod to resize bound")
    await wait_for(lambda: free_is(4000), what="1 more CPU held")
    resize = f"{paths.pod(namespace, 'resized')}/resize"

    async def kubelet_holds(cpu: str) -> None:
        """What the kubelet reports once it has resized the container: what it holds now."""
        held = {"name": "main", "image": "busybox", "imageID": "", "ready": True, "restartCount": 0,
                "allocatedResources": {"cpu": cpu, "memory": "64Mi"},
                "resources": {"requests": {"cpu": cpu, "memory": "64Mi"}}}  # fmt: skip
        await admin.patch(f"{paths.pod(namespace, 'resized')}/status", {"status": {"containerStatuses": [held]}})

    await kubelet_holds("1")
    grow = {"spec": {"containers": [{"name": "main", "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "2"}}}]}}
    await admin.patch(resize, grow, client.STRATEGIC_PATCH)
    await wait_for(lambda: free_is(3000), what="growing counts at once")
    await kubelet_holds("2")
    shrink = {"spec": {"containers": [{"name": "main", "resources": {"requests": {"cpu": "500m"},
                                                                    "limits": {"cpu": "500m"}}}]}}  # fmt: skip
    await admin.patch(resize, shrink, client.STRATEGIC_PATCH)
    await asyncio.sleep(2)  # the watch has brought the new spec
    assert await cpu_free(extender, node) == 3000, "shrinking waits for the kubelet: 2 CPU still held"
    await kubelet_holds("500m")
    await wait_for(lambda: free_is(4500), what="the smaller request once the kubelet holds it")
