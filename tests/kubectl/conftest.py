"""A cluster for the plugin's unit tests: the fake API server with GPU nodes, and the real extender
over it placing the pods (filter, then bind), so the plugin reads allocations the extender wrote."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from sharegpu.api import names, paths
from sharegpu.extender import runtime
from sharegpu.kube import client, fake
from sharegpu.kubectl import read, views
from tests.builders import Clock
from tests.extender.conftest import START, Harness, add_node, gpu_pod

Json = dict[str, Any]


def bound(name: str, node: str, index: int, milli: int, namespace: str = "ns") -> Json:
    pod = gpu_pod(name, milli=milli, namespace=namespace)
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Running"}
    grant = {"index": index, "uuid": f"GPU-{node}-{index}", "milli": milli, "limitMilli": milli, "memoryMiB": 0}
    pod["metadata"]["annotations"][names.ALLOCATION] = orjson.dumps(
        {"version": 1, "node": node, "exclusive": False, "containers": [{"name": "main", "devices": [grant]}]}
    ).decode()
    return pod


async def snapshot(h: Harness, policy: str = "fgd-used") -> views.Cluster:
    """The plugin's view of the harness's cluster, read through the API as the command reads it."""
    return views.cluster(await read.cluster(h.api), policy)


@pytest.fixture
async def placed() -> AsyncIterator[Callable[..., Any]]:
    """placed(nodes=2, gpus=2) -> a Harness: a running extender over a fake API server with T4 nodes n0.."""
    started: list[runtime.Extender] = []

    async def make(nodes: int = 2, gpus: int = 2) -> Harness:
        server = fake.FakeApiServer()
        for i in range(nodes):
            add_node(server, f"n{i}", gpus)
        server.put_object(paths.NAMESPACES, {"metadata": {"name": names.SYSTEM_NAMESPACE}})
        server.put_object(paths.NAMESPACES, {"metadata": {"name": names.HOLDING_NAMESPACE}})
        clock = Clock(START)
        extender = runtime.Extender(
            client.KubeClient(server), runtime.Options(leader_elect=False, reservation_idle=0.0), clock=clock
        )
        await extender.start()
        started.append(extender)
        return Harness(server, extender, clock)

    yield make
    for extender in started:
        await asyncio.wait_for(extender.stop(), 8)
