"""The requeuer on a quiet control plane of its own (in the shared one, other tests' events make
kube-scheduler try every waiting pod again anyway): a GPU heals in its Device only, which is no event
kube-scheduler watches, and the pod it turned away is placed within seconds all the same, because the
extender asks kube-scheduler to try it again; without that it would wait up to five minutes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from sharegpu.api import paths
from sharegpu.core import devices
from sharegpu.devcluster import controlplane, fakecluster, stack
from sharegpu.extender import requeue
from sharegpu.kube import client
from tests.integration.conftest import gpu_pod, refusal, wait_for

Json = dict[str, Any]
NAMESPACE = "quiet"
NODE = "quiet-0"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    made = controlplane.ControlPlane(tmp_path_factory.mktemp("quiet"), controlplane.binaries())
    made.start()
    yield made
    made.stop()


@pytest.fixture(scope="module")
async def quiet(plane: controlplane.ControlPlane) -> AsyncIterator[tuple[client.KubeClient, fakecluster.FakeCluster]]:
    admin = stack.kube_for(plane, "admin")
    await stack.install(admin)
    harness = fakecluster.FakeCluster(admin)
    await harness.start()
    node = devices.uniform_node(NODE, gpu_count=1, model="T4", gpu_memory_mib=16384, cpu_milli=32000, memory_mib=65536)
    await harness.add_nodes([node])
    extender = stack.ExtenderProcess(plane, "fgd-used")
    extender.start()
    await extender.wait_ready()
    plane.start_scheduler(stack.scheduler_config(plane, extender))
    await admin.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    yield admin, harness
    extender.kill()
    await harness.stop()
    await admin.close()


async def test_room_kube_scheduler_cannot_see_appear_gets_the_pod_tried_again(
    quiet: tuple[client.KubeClient, fakecluster.FakeCluster],
) -> None:
    admin, harness = quiet
    healthy = harness.inventory[NODE]
    sick = dataclasses.replace(healthy, gpus=tuple(dataclasses.replace(g, healthy=False) for g in healthy.gpus))
    await harness.publish(sick)
    await wait_for(lambda: _device_unhealthy(admin), what="the Device saying the GPU is unhealthy")
    body = gpu_pod("patient", NAMESPACE, milli=500)
    del body["spec"]["nodeSelector"]
    await admin.create(f"/api/v1/namespaces/{NAMESPACE}/pods", body)
    message = await wait_for(lambda: refusal(admin, NAMESPACE, "patient"), what="patient turned away")
    assert "healthy" in message, message
    await asyncio.sleep(3)  # past kube-scheduler's first backoff: only an event would bring it back now
    healed = time.monotonic()
    await harness.publish(healthy)
    pod = await wait_for(lambda: _bound_pod(admin, "patient"), timeout=30, what="patient bound")
    took = time.monotonic() - healed
    print(f"bound {took:.2f} s after the GPU healed")
    conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
    assert requeue.CONDITION in conditions, conditions
    assert conditions[requeue.CONDITION]["reason"] == "RoomFreed" and NODE in conditions[requeue.CONDITION]["message"]
    assert took < 15, f"bound {took:.1f} s after the GPU healed"


async def _device_unhealthy(kube: client.KubeClient) -> bool:
    device = await kube.get(paths.device(NODE))
    return any(not g.get("healthy", True) for g in device.get("spec", {}).get("gpus", []))


async def _bound_pod(kube: client.KubeClient, name: str) -> Json | None:
    pod = await kube.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    return pod if pod["spec"].get("nodeName") else None
