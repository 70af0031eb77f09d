"""A fake GPU cluster on a real API server: nodes with a chosen GPU inventory, and a harness that
plays the kubelet (bound pods run; deletions complete, at once or after their `linger`) and the
NVIDIA device plugin (reservation and whole-GPU pods are given free GPU UUIDs of their node, and
reservation pods then run the real `sharegpu reserve` logic with that environment).

The harness works from its own informer over all pods; per pod it acts at most once per state, on a
small pool of workers, and errors are logged and retried by the next event for that pod.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from sharegpu.agent import inventory, reserve
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import devices as api_devices
from sharegpu.api import dra as dra_api
from sharegpu.api import names, paths, pods, quantity, wire
from sharegpu.core import devices, errors
from sharegpu.kube import client, informer
from sharegpu.kube import errors as kube_errors

Json = dict[str, Any]
log = logging.getLogger(__name__)
RETRY = 0.5
"""Seconds before a pod whose handling met a temporary API error is handled again."""


def described(node: devices.NodeInventory) -> wire.Device:
    """The Device an agent on the fake NVML describing `node` (`agent.fakenvml.describe`) publishes:
    the inventory, with what that NVML says of each GPU for DRA selectors (architecture, compute
    capability, driver, PCI addresses)."""
    device = api_devices.device(node)
    gpus = fakenvml.reported(fakenvml.configured(node))
    return msgspec.structs.replace(device, spec=inventory.with_facts(device.spec, gpus))


class FakeCluster:
    def __init__(self, kube: client.KubeApi) -> None:
        self.kube = kube
        self.inventory: dict[str, devices.NodeInventory] = {}
        self.held: dict[str, dict[str, list[str]]] = {}  # node -> pod key -> UUIDs it holds
        self._queue: asyncio.Queue[wire.Pod] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.informer: informer.Informer[wire.Pod, wire.Pod] = informer.Informer(
            kube, paths.PODS, wire.Pod, informer.identity, self._on_pod, name="harness-pods"
        )
        self.running = 0
        self.linger: dict[str, float] = {}
        """Pod key or namespace -> seconds a deleted pod goes on terminating before it stops (a slow
        workload); others stop at once."""
        self._stopping: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------------- nodes

    async def add_node(
        self, node: devices.NodeInventory, pods_per_node: int = 250, *, publish: bool = True, dra: bool = False
    ) -> None:
        """A Ready node with the inventory's CPU, memory and GPUs; its Device written here unless
        `publish` is False (then the node's agent writes it); with `dra`, as an agent run with --dra
        writes them: the Device says the node serves DRA claims only, and its ResourceSlice is published."""
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "labels": {"kubernetes.io/hostname": node.name, "sharegpu.io/fake": "true"},
            },
        }
        try:
            made = await self.kube.create(paths.NODES, body)
        except kube_errors.ConflictError as exc:
            if not exc.already_exists:
                raise
            made = await self.kube.get(paths.node(node.name))
        capacity = {
            "cpu": f"{node.cpu_milli}m",
            "memory": f"{node.memory_mib}Mi",
            "pods": str(pods_per_node),
            names.NVIDIA_GPU: str(node.gpu_count),
        }
        ready = {"type": "Ready", "status": "True", "reason": "FakeKubelet", "lastHeartbeatTime": None,
                 "lastTransitionTime": None}  # fmt: skip
        await self.kube.patch(
            f"{paths.node(node.name)}/status",
            {"status": {"capacity": capacity, "allocatable": capacity, "conditions": [ready]}},
        )
        # No node controller runs to lift the not-ready taint the API server added at creation.
        await self.kube.patch(paths.node(node.name), {"spec": {"taints": None}})
        if publish:
            await self.publish(node, dra=dra)
        if publish and dra:
            spec = described(node).spec
            await self.kube.create(dra_api.SLICES, dra_api.resource_slice(node.name, made["metadata"]["uid"], spec))
        self.inventory[node.name] = node
        self.held.setdefault(node.name, {})

    async def publish(self, node: devices.NodeInventory, *, dra: bool = False) -> None:
        """Create or replace the node's Device resource (what the node agent does)."""
        device = wire.encode(described(node))
        if dra:
            device["spec"]["dra"] = True
        try:
            await self.kube.create(paths.DEVICES, device)
        except kube_errors.ConflictError as exc:
            if not exc.already_exists:
                raise
            current = await self.kube.get(paths.device(node.name))
            device["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            await self.kube.replace(paths.device(node.name), device)

    async def add_nodes(
        self, nodes: list[devices.NodeInventory], parallel: int = 16, *, publish: bool = True, dra: bool = False
    ) -> None:
        limit = asyncio.Semaphore(parallel)

        async def one(node: devices.NodeInventory) -> None:
            async with limit:
                await self.add_node(node, publish=publish, dra=dra)

        await asyncio.gather(*(one(n) for n in nodes))

    # ----------------------------------------------------------------- kubelet and device plugin

    async def start(self, workers: int = 8) -> None:
        self._tasks = [asyncio.create_task(self.informer.run())]
        self._tasks += [asyncio.create_task(self._worker()) for _ in range(workers)]
        await self.informer.synced.wait()

    async def stop(self) -> None:
        await informer.cancel([*self._tasks, *self._stopping])

    def _on_pod(self, kind: wire.EventType, pod: wire.Pod) -> None:
        node = pod.spec.node_name
        if not node or node not in self.inventory:
            return
        if kind == wire.EventType.DELETED:
            self.held.get(node, {}).pop(pods.key(pod), None)
            return
        if pod.metadata.deletion_timestamp or pod.status.phase == "Pending" or pods.is_terminal(pod):
            self._queue.put_nowait(pod)

    async def _worker(self) -> None:
        while True:
            pod = await self._queue.get()
            try:
                await self._handle(pod)
            except kube_errors.TemporaryError as exc:  # the API server restarting: try again, as a kubelet would
                log.debug("harness: %s; trying %s again", exc, pods.key(pod))
                asyncio.get_running_loop().call_later(RETRY, self._queue.put_nowait, pod)
            except errors.SharegpuError as exc:
                log.debug("harness: %s", exc)
            except Exception:
                log.exception("harness: failed on %s", pods.key(pod))

    async def _handle(self, pod: wire.Pod) -> None:
        meta = pod.metadata
        node = pod.spec.node_name
        key = pods.key(pod)
        path = paths.pod(meta.namespace, meta.name)
        if meta.deletion_timestamp or pods.is_terminal(pod):
            self.held.get(node, {}).pop(key, None)
            if meta.deletion_timestamp:
                delay = self.linger.get(key, self.linger.get(meta.namespace, 0.0))
                if delay:
                    task = asyncio.create_task(self._stop_later(path, delay))
                    self._stopping.add(task)
                    task.add_done_callback(self._stopping.discard)
                else:
                    await self.kube.delete(path, grace_period=0)
            return
        if pod.status.phase != "Pending":
            return
        wanted = _nvidia_gpus(pod)
        if wanted and key not in self.held[node]:
            taken = {u for uuids in self.held[node].values() for u in uuids}
            free = [str(g.uuid) for g in self.inventory[node].gpus if g.uuid not in taken]
            if len(free) < wanted:
                failed = {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                          "message": f"needs {wanted} GPU(s), {len(free)} free"}  # fmt: skip
                await self.kube.patch(f"{path}/status", {"status": failed})
                return
            self.held[node][key] = free[:wanted]
        holder = meta.labels.get(names.LABEL_ROLE) == names.ROLE_GROUP_HOLDER
        if wanted and (pods.is_reservation(pod) or holder) and not meta.annotations.get(names.GPU_UUID):
            # reported on every try until it succeeds: a report lost to an API server restart must
            # not leave a running reservation that never names its GPU
            visible = {"NVIDIA_VISIBLE_DEVICES": ",".join(self.held[node][key])}
            await reserve.report(self.kube, meta.namespace, meta.name, visible, several=holder)
        # As the kubelet: a strategic merge keeps the PodScheduled condition (the binding's time,
        # which GPU-time budgets count from) and adds the start time.
        running = {"phase": "Running", "startTime": _now(), "conditions": [{"type": "Ready", "status": "True"}]}
        await self.kube.patch(f"{path}/status", {"status": running}, client.STRATEGIC_PATCH)
        self.running += 1

    async def _stop_later(self, path: str, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self.kube.delete(path, grace_period=0)
        except errors.SharegpuError as exc:
            log.debug("harness: stopping %s: %s", path, exc)


def _now() -> str:
    return wire.timestamp(time.time())


def _nvidia_gpus(pod: wire.Pod) -> int:
    total = 0
    for container in pod.spec.containers:
        value = container.resources.limits.get(names.NVIDIA_GPU)
        if value is not None:
            total += int(quantity.parse(value))
    return total
