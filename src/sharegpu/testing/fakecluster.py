"""A fake GPU cluster on a real API server: nodes with a chosen GPU inventory, and a harness that
plays the kubelet (bound pods run; deletions complete) and the NVIDIA device plugin (reservation and
whole-GPU pods are given free GPU UUIDs of their node, and reservation pods then run the real
`sharegpu reserve` logic with that environment).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sharegpu.agent import reserve
from sharegpu.core import devices, errors
from sharegpu.kube import client, informer, objects

Json = dict[str, Any]
log = logging.getLogger(__name__)


class FakeCluster:
    def __init__(self, kube: client.KubeClient) -> None:
        self.kube = kube
        self.inventory: dict[str, devices.NodeInventory] = {}
        self.held: dict[str, dict[str, list[str]]] = {}  # node -> pod key -> UUIDs it holds
        self._queue: asyncio.Queue[Json] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.informer = informer.Informer(kube, "/api/v1/pods", self._on_pod, name="harness-pods")
        self.running = 0

    # ----------------------------------------------------------------- nodes

    async def add_node(self, node: devices.NodeInventory, pods: int = 250) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "labels": {"kubernetes.io/hostname": node.name, "sharegpu.io/fake": "true"},
            },
        }
        try:
            await self.kube.create("/api/v1/nodes", body)
        except errors.SharegpuError as exc:
            if "AlreadyExists" not in str(exc):
                raise
        capacity = {
            "cpu": f"{node.cpu_milli}m",
            "memory": f"{node.memory_mib}Mi",
            "pods": str(pods),
            objects.NVIDIA_GPU: str(node.gpu_count),
        }
        status = {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "FakeKubelet",
                        "lastHeartbeatTime": None,
                        "lastTransitionTime": None,
                    }
                ],
            }
        }
        await self.kube.patch(f"/api/v1/nodes/{node.name}/status", status)
        # No node controller runs to lift the not-ready taint the API server added at creation.
        await self.kube.patch(f"/api/v1/nodes/{node.name}", {"spec": {"taints": None}})
        device = objects.device_object(node)
        try:
            await self.kube.create(objects.DEVICES_PATH, device)
        except errors.SharegpuError as exc:
            if "AlreadyExists" not in str(exc):
                raise
            current = await self.kube.get(f"{objects.DEVICES_PATH}/{node.name}")
            device["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            await self.kube.replace(f"{objects.DEVICES_PATH}/{node.name}", device)
        self.inventory[node.name] = node
        self.held.setdefault(node.name, {})

    async def add_nodes(self, nodes: list[devices.NodeInventory], parallel: int = 16) -> None:
        limit = asyncio.Semaphore(parallel)

        async def one(node: devices.NodeInventory) -> None:
            async with limit:
                await self.add_node(node)

        await asyncio.gather(*(one(n) for n in nodes))

    # ----------------------------------------------------------------- kubelet and device plugin

    async def start(self, workers: int = 8) -> None:
        self._tasks = [asyncio.create_task(self.informer.run())]
        self._tasks += [asyncio.create_task(self._worker()) for _ in range(workers)]
        await self.informer.synced.wait()

    async def stop(self) -> None:
        await informer.cancel(self._tasks)

    def _on_pod(self, kind: str, pod: Json) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or node not in self.inventory:
            return
        key = str(objects.pod_key(pod))
        if kind == "DELETED":
            self.held.get(node, {}).pop(key, None)
            return
        meta = pod.get("metadata") or {}
        phase = (pod.get("status") or {}).get("phase")
        if meta.get("deletionTimestamp") or phase == "Pending" or objects.is_terminal(pod):
            self._queue.put_nowait(pod)

    async def _worker(self) -> None:
        while True:
            pod = await self._queue.get()
            try:
                await self._handle(pod)
            except errors.SharegpuError as exc:
                log.debug("harness: %s", exc)
            except Exception:
                log.exception("harness: failed on %s", objects.pod_key(pod))

    async def _handle(self, pod: Json) -> None:
        meta = pod["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        node = pod["spec"]["nodeName"]
        key = str(objects.pod_key(pod))
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        if meta.get("deletionTimestamp") or objects.is_terminal(pod):
            self.held.get(node, {}).pop(key, None)
            if meta.get("deletionTimestamp"):
                await self.kube.delete(path, grace_period=0)
            return
        if (pod.get("status") or {}).get("phase") != "Pending":
            return
        wanted = _nvidia_gpus(pod)
        if wanted and key not in self.held[node]:
            taken = {u for uuids in self.held[node].values() for u in uuids}
            free = [str(g.uuid) for g in self.inventory[node].gpus if g.uuid not in taken]
            if len(free) < wanted:
                await self.kube.patch(
                    f"{path}/status",
                    {
                        "status": {
                            "phase": "Failed",
                            "reason": "UnexpectedAdmissionError",
                            "message": f"needs {wanted} GPU(s), {len(free)} free",
                        }
                    },
                )
                return
            self.held[node][key] = free[:wanted]
            if objects.is_reservation(pod):
                await reserve.report(self.kube, namespace, name, {"NVIDIA_VISIBLE_DEVICES": ",".join(free[:wanted])})
        await self.kube.patch(
            f"{path}/status",
            {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        )
        self.running += 1


def _nvidia_gpus(pod: Json) -> int:
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        if objects.NVIDIA_GPU in limits:
            total += int(objects.quantity(limits[objects.NVIDIA_GPU]))
    return total
