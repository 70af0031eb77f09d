"""A write whose answer is lost may have happened: the real API server commits a binding, and the
answer never reaches the extender (the connection closes) or a 503 comes back in its place. The
extender must hold the pod's share until it reads the truth back, and place nothing in its room.
And when the API does show a GPU over-committed, the extender counts every pod, blocks the GPU,
says so and repairs it.

The extender replica of the first test reaches the API server through the fault proxy, and the tests
play kube-scheduler (their pods name no scheduler that runs), so the order of events is theirs."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sharegpu.api import paths
from sharegpu.devcluster import controlplane, fakecluster, faults
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.integration.conftest import MANUAL, bind_overcommitted, consistent, gpu_pod, wait_for

Json = dict[str, Any]


class Scheduler:
    """Calls a replica's filter and bind as kube-scheduler does (its client certificate, nodeCacheCapable)."""

    def __init__(self, replica: ExtenderProcess) -> None:
        self.replica = replica
        self.tls = ssl.create_default_context(cafile=str(replica.pki.ca))
        self.tls.load_cert_chain(replica.pki.client_cert, replica.pki.client_key)

    async def call(self, verb: str, body: Json) -> Json:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.replica.url}/{verb}", json=body, ssl=self.tls) as response,
        ):
            answer: Json = await response.json()
            return answer

    async def filter(self, pod: Json, node: str) -> list[str]:
        answer = await self.call("filter", {"Pod": pod, "NodeNames": [node]})
        return list(answer.get("NodeNames") or [])

    async def bind(self, pod: Json, node: str) -> str:
        meta = pod["metadata"]
        body = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node}
        return str((await self.call("bind", body)).get("Error") or "")


@pytest.fixture
async def proxied(
    control_plane: controlplane.ControlPlane, extender: ExtenderProcess, tmp_path: Path
) -> AsyncIterator[tuple[faults.FaultProxy, ExtenderProcess]]:
    """A second extender replica (not the Lease holder: scheduling only) behind a fault proxy."""
    assert control_plane.bundle is not None
    proxy = faults.FaultProxy(control_plane.url, str(control_plane.bundle.ca_cert))
    await proxy.start()
    config = json.loads(control_plane.kubeconfig("sharegpu-extender").read_text())
    config["clusters"][0]["cluster"] = {"server": proxy.url}
    kubeconfig = tmp_path / "proxied-kubeconfig"
    kubeconfig.write_text(json.dumps(config))
    replica = ExtenderProcess(control_plane, "fgd-used", kubeconfig=kubeconfig)
    replica.start()
    try:
        await replica.wait_ready()
        yield proxy, replica
    finally:
        replica.kill()
        await proxy.stop()


async def used_and_phases(replica: ExtenderProcess, node: str) -> tuple[int, list[str]]:
    summary = {n["node"]: n for n in await replica.debug_nodes()}
    gpu = summary[node]["gpus"][0]
    return int(gpu["milli"]["used"]), sorted(f"{h['pod']}={h['phase']}" for h in gpu["holders"])


@pytest.mark.parametrize("fault", ["answer-lost", "503-after-commit"])
async def test_a_committed_binding_whose_answer_was_lost_is_confirmed_not_forgotten(
    admin: client.KubeClient,
    proxied: tuple[faults.FaultProxy, ExtenderProcess],
    nodes: Callable[..., Any],
    namespace: str,
    fault: str,
) -> None:
    proxy, replica = proxied
    (node,) = await nodes(1, gpus=1)
    made = {}
    for name in ("first", "second"):
        body = gpu_pod(name, namespace, milli=600)
        body["spec"]["schedulerName"] = MANUAL
        made[name] = await admin.create(paths.pods(namespace), body)

    async def known() -> bool:
        return any(n["node"] == node for n in await replica.debug_nodes())

    await wait_for(known, what="the node in the replica's cache")
    scheduler = Scheduler(replica)
    assert await scheduler.filter(made["first"], node) == [node]
    # The watch lags (as after an API server restart): only a read can show the replica the binding.
    proxy.cut_watches()
    proxy.fail(503, times=100_000, method="WATCH")
    binding = paths.binding(namespace, "first")
    if fault == "answer-lost":
        proxy.lose(method="POST", path=binding)
    else:
        proxy.fail(503, method="POST", path=binding, after_commit=True)
    error = await scheduler.bind(made["first"], node)
    stored = await admin.get(paths.pod(namespace, "first"))
    assert stored["spec"].get("nodeName") == node, "the API server committed the binding"
    assert await scheduler.filter(made["second"], node) == [], "nothing may be placed in the room of the first"
    assert "outcome unknown" in error, error
    used, _ = await used_and_phases(replica, node)
    assert used == 600, "the first pod's share is held"

    async def confirmed() -> bool:
        return await used_and_phases(replica, node) == (600, [f"{namespace}/first=Added"])

    await wait_for(confirmed, timeout=30, what="the binding read back and confirmed while the watch is down")
    assert await scheduler.filter(made["second"], node) == []
    proxy.clear()
    await consistent(admin, [node])


async def test_an_overcommitted_gpu_is_counted_reported_and_repaired_by_evicting_the_newest(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    harness: fakecluster.FakeCluster,
    nodes: Callable[..., Any],
    namespace: str,
) -> None:
    """Two pods bound past the extender (as another scheduler could) to one GPU that cannot hold both:
    the extender counts both, blocks the GPU, puts a Warning on each, and evicts the newer (it has an
    owner and has not started) through the real Eviction API with its own RBAC."""
    (node,) = await nodes(1, gpus=1)
    played = harness.inventory.pop(node)  # no kubelet here for now: the pods stay Pending
    try:
        await overcommit_and_repair(admin, extender, node, namespace)
    finally:
        harness.inventory[node] = played  # the harness finishes what is left (the reservation's deletion)


async def overcommit_and_repair(admin: client.KubeClient, extender: ExtenderProcess, node: str, namespace: str) -> None:
    await bind_overcommitted(admin, node, namespace)

    async def evicted() -> bool:
        pod = await admin.get(paths.pod(namespace, "newer"))
        return bool(pod["metadata"].get("deletionTimestamp"))

    await wait_for(evicted, timeout=30, what="the newer tenant evicted")
    older = await admin.get(paths.pod(namespace, "older"))
    assert not older["metadata"].get("deletionTimestamp"), "only one is evicted"
    gpu = await used_and_gpu(extender, node)
    assert gpu["milli"]["used"] == 1200 and gpu["overcommitted"], "both counted while the evicted one is still there"
    found, _ = await admin.list_all(paths.events(namespace))
    said = sorted((e["reason"], e["involvedObject"]["name"]) for e in found if e["reason"].startswith("GPUOvercommit"))
    assert said == [("GPUOvercommitEvicted", "newer"), ("GPUOvercommitted", "newer"), ("GPUOvercommitted", "older")]
    await admin.delete(paths.pod(namespace, "newer"), grace_period=0)  # the kubelet finishes the eviction

    async def repaired() -> bool:
        gpu = await used_and_gpu(extender, node)
        return gpu["milli"]["used"] == 600 and not gpu["overcommitted"]

    await wait_for(repaired, timeout=30, what="the GPU repaired")


async def used_and_gpu(replica: ExtenderProcess, node: str) -> Json:
    summary = {n["node"]: n for n in await replica.debug_nodes()}
    gpu: Json = summary[node]["gpus"][0]
    return gpu
