"""Builders for the extender's unit tests: a fake API server with GPU nodes, pods in the canonical
format, and a running `Extender` (informers, cache, roles) over it, with its clock in the test's hands."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sharegpu.api import extender as api_extender
from sharegpu.api import names, paths, wire
from sharegpu.extender import runtime
from sharegpu.kube import client, fake
from tests import builders

Json = dict[str, Any]


START = 1000.0
"""Where the extender's clock starts (a builders.Clock in the test's hands)."""


def add_node(
    server: fake.FakeApiServer, name: str, gpus: int = 2, model: str = "T4", memory: int = 16384, *, dra: bool = False
) -> None:
    """A ready node in zone a with its Device: `gpus` GPUs of `model` with `memory` MiB each (`dra`:
    the node serves DRA claims only)."""
    node = builders.MakeNode(name).labels({"zone": "a", "kubernetes.io/hostname": name}).ready()
    node.allocatable({"cpu": "32", "memory": "128Gi", names.NVIDIA_GPU: str(gpus)})
    server.put_object(paths.NODES, node.obj())
    server.put_object(paths.DEVICES, builders.MakeDevice(name).gpus(gpus, model, memory).dra(dra).obj())


def gpu_pod(
    name: str,
    *,
    milli: int | None = 500,
    count: int = 1,
    nvidia: int | None = None,
    namespace: str = "ns",
    annotations: dict[str, str] | None = None,
    spec: Json | None = None,
) -> Json:
    """A pod for sharegpu's scheduler: `count` GPUs with `milli` of each (or `nvidia` whole ones)."""
    limits = builders.gpu_limits(count=count, milli=milli, nvidia=nvidia)
    pod = builders.MakePod(name, namespace).annotations(annotations or {}).scheduler()
    return pod.container(limits=limits, requests=limits).spec(**(spec or {})).obj()


async def settle(server: fake.FakeApiServer, rounds: int = 20) -> None:
    """Let informers deliver what the fake server has emitted."""
    for _ in range(rounds):
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)


class Harness:
    """A running extender over a fake API server."""

    def __init__(self, server: fake.FakeApiServer, extender: runtime.Extender, clock: builders.Clock) -> None:
        self.server = server
        self.extender = extender
        self.clock = clock
        self.api = client.KubeClient(server)

    async def create(self, body: Json) -> Json:
        made = await self.api.create(paths.pods(body["metadata"]["namespace"]), body)
        await settle(self.server)
        return made

    def args(self, pod: Json, nodes: list[str] | None = None) -> api_extender.Args:
        stored = self.server.get_object(paths.pod(pod["metadata"]["namespace"], pod["metadata"]["name"])) or pod
        return api_extender.Args.of(wire.convert(stored, wire.Pod), nodes or sorted(self.extender.cache.nodes))

    async def schedule(self, pod: Json, nodes: list[str] | None = None) -> str:
        """Filter then bind, as kube-scheduler does; returns the node (AssertionError if none)."""
        verdict = self.extender.scheduling.filter(self.args(pod, nodes))
        assert verdict.node_names, verdict.failed_nodes
        meta = (self.server.get_object(paths.pod(pod["metadata"]["namespace"], pod["metadata"]["name"])) or {})[
            "metadata"
        ]
        node = verdict.node_names[0]
        result = await self.extender.scheduling.bind(
            api_extender.BindingArgs(
                pod_name=meta["name"], pod_namespace=meta["namespace"], pod_uid=meta["uid"], node=node
            )
        )
        assert result.error == "", result.error
        await settle(self.server)
        return node


@pytest.fixture
async def harness() -> AsyncIterator[Callable[..., Any]]:
    started: list[runtime.Extender] = []

    async def make(nodes: int = 2, gpus: int = 2, model: str = "T4", *, dra: int = 0, **options: Any) -> Harness:
        """`nodes` nodes n0.. for pods, and `dra` nodes d0.. serving DRA claims (resource.k8s.io/v1
        then served, and the DRA allocator running with no fence)."""
        server = fake.FakeApiServer(served=frozenset({"resource.k8s.io/v1"}) if dra else frozenset())
        for i in range(nodes):
            add_node(server, f"n{i}", gpus, model)
        for i in range(dra):
            add_node(server, f"d{i}", gpus, model, dra=True)
        if dra:
            options.setdefault("dra_fence", 0.0)
        server.put_object(paths.NAMESPACES, {"metadata": {"name": names.SYSTEM_NAMESPACE}})
        server.put_object(paths.NAMESPACES, {"metadata": {"name": names.HOLDING_NAMESPACE}})
        clock = builders.Clock(START)
        extender = runtime.Extender(
            client.KubeClient(server),
            runtime.Options(leader_elect=False, reservation_idle=0.0, pace=0.01, **options),
            clock=clock,
        )
        await extender.start()
        started.append(extender)
        return Harness(server, extender, clock)

    yield make
    for extender in started:
        stopping = asyncio.ensure_future(extender.stop())
        done, _ = await asyncio.wait([stopping], timeout=8)
        if not done:  # a task that ignores cancellation: say which instead of hanging the suite
            for task in asyncio.all_tasks():
                print("TASK", task.get_name(), task, file=sys.stderr)
                task.print_stack(limit=8, file=sys.stderr)
            raise AssertionError("extender.stop hung")
