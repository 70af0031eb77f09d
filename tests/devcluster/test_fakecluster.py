"""The fake-cluster harness acts as kubelet and reservation container: a report lost to an API
fault is tried again, so no reservation ends up running without naming its GPU."""

from __future__ import annotations

import asyncio
from typing import Any

from sharegpu.api import names, paths
from sharegpu.core import devices
from sharegpu.devcluster import fakecluster
from sharegpu.extender import reservations
from sharegpu.kube import client, fake


async def test_a_reservation_whose_report_failed_is_reported_on_the_next_try() -> None:
    server = fake.FakeApiServer()
    server.put_object(paths.NAMESPACES, {"metadata": {"name": names.HOLDING_NAMESPACE}})
    kube = client.KubeClient(server)
    harness = fakecluster.FakeCluster(kube)
    await harness.add_node(
        devices.uniform_node("n0", gpu_count=2, model="T4", gpu_memory_mib=16384, cpu_milli=8000, memory_mib=32768)
    )
    await harness.start(workers=1)
    try:
        name = names.reservation_name("n0", 1, "abcdef")
        server.fail(503, method="PATCH", times=1)  # the UUID report meets an API server restart
        body = reservations.reservation_pod(name, "n0", 1, "img")
        body["status"] = {"phase": "Pending"}  # as the API server creates it (the fake stores what it is given)
        await kube.create(paths.pods(names.HOLDING_NAMESPACE), body)

        async def reported() -> dict[str, Any]:
            while True:
                pod = await kube.get(paths.pod(names.HOLDING_NAMESPACE, name))
                if pod.get("status", {}).get("phase") == "Running" and names.GPU_UUID in pod["metadata"].get(
                    "annotations", {}
                ):
                    return pod
                await asyncio.sleep(0.05)

        pod = await asyncio.wait_for(reported(), 5)
        assert str(pod["metadata"]["annotations"][names.GPU_UUID]).startswith("GPU-n0-")
    finally:
        await harness.stop()
