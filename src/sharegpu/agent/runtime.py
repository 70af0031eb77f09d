"""`sharegpu agent`: one per GPU node; keeps the node's Device resource and GPU labels current.

A pass reads NVML (in a worker thread: NVML calls block), folds in the health it has learnt (XID
events, which a second task waits for, and GPUs NVML cannot read), builds the Device spec
(`agent.inventory`, with the GPUs the node's pods hold, from a pod informer on this node) and writes
it when it differs from what the API holds: created owned by the Node (it goes with the node),
replaced with the resourceVersion it was computed from (a 409 means someone else wrote: the next
pass starts from theirs). Node labels for the model and the GPU count follow.

A GPU with a critical XID stays unhealthy while this agent runs (a GPU needs a reset to recover;
after it, restart the agent); one NVML cannot read is unhealthy while that lasts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from sharegpu.agent import inventory, nvml
from sharegpu.api import devices as api_devices
from sharegpu.api import paths, wire
from sharegpu.kube import client, errors, informer, reconcile

log = logging.getLogger(__name__)


class Source(nvml.Discovery, nvml.Health, Protocol):
    """What the inventory reads: NVML or the fake."""

    def close(self) -> None: ...


class Agent:
    def __init__(self, api: client.KubeApi, node: str, source: Source, *, interval: float = 10.0) -> None:
        self.api = api
        self.node = node
        self.source = source
        self.interval = interval
        self.pods: dict[str, wire.Pod] = {}
        self.xids: dict[str, str] = {}
        """UUID -> the critical XID that made it unhealthy."""
        self.written: wire.DeviceSpec | None = None
        self.labels: dict[str, str | None] = {}
        self.loop = reconcile.Loop(f"agent-{node}", self.reconcile)
        self.pod_informer: informer.Informer[Any, Any] = informer.Informer(
            api, paths.PODS, wire.Pod, informer.identity, self._on_pod, name="node-pods",
            params={"fieldSelector": f"spec.nodeName={node}"},
        )  # fmt: skip
        self.tasks: list[asyncio.Task[None]] = []

    def _on_pod(self, kind: str, pod: wire.Pod) -> None:
        informer.remember(self.pods, kind, pod)

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self.pod_informer.run(), name="agent-pods")]
        await self.pod_informer.synced.wait()
        self.loop.wake()
        self.tasks += [
            asyncio.create_task(self.loop.run(tick=self.interval), name="agent-inventory"),
            asyncio.create_task(self._watch_xids(), name="agent-xids"),
        ]

    async def stop(self) -> None:
        await informer.cancel(reversed(self.tasks))

    async def _watch_xids(self) -> None:
        while True:
            events = await asyncio.to_thread(self.source.xid_events, 1000)
            for event in events:
                if event.code in nvml.CRITICAL_XIDS and event.uuid not in self.xids:
                    log.warning("GPU %s: critical XID %d; unhealthy from now on", event.uuid, event.code)
                    self.xids[event.uuid] = f"XID {event.code}"
                    self.loop.wake()
                else:
                    log.info("GPU %s: XID %d (not the GPU's fault)", event.uuid, event.code)

    # ----------------------------------------------------------------- the pass

    async def reconcile(self) -> None:
        gpus, links, unreadable = await asyncio.to_thread(self._read)
        unhealthy = {**dict.fromkeys(unreadable, "NVML cannot read it"), **self.xids}
        current = await self._current()
        previous = current.spec if current is not None else None
        held = inventory.held_uuids(list(self.pods.values()), previous)
        spec = inventory.device_spec(gpus, links, unhealthy, previous, held)
        if current is None:
            await self._create(spec)
        elif current.spec != spec:
            body = wire.encode(api_devices.published(current.metadata, spec))
            await self.api.replace(paths.device(self.node), body)
            log.info("Device %s updated: %d GPU(s)", self.node, len(spec.gpus))
        self.written = spec
        labels = inventory.node_labels(spec)
        if labels != self.labels:
            await self.api.patch(paths.node(self.node), {"metadata": {"labels": labels}})
            self.labels = labels

    def _read(self) -> tuple[list[nvml.Gpu], list[nvml.Link], set[str]]:
        refresh: Callable[[], object] | None = getattr(self.source, "refresh", None)
        if refresh is not None:
            refresh()
        return self.source.gpus(), self.source.links(), self.source.unreadable()

    async def _current(self) -> wire.Device | None:
        try:
            return wire.convert(await self.api.get(paths.device(self.node)), wire.Device)
        except errors.NotFoundError:
            return None

    async def _create(self, spec: wire.DeviceSpec) -> None:
        node = await self.api.get(paths.node(self.node))
        owner = wire.OwnerReference(api_version="v1", kind="Node", name=self.node, uid=node["metadata"]["uid"])
        device = api_devices.published(wire.ObjectMeta(name=self.node, owner_references=[owner]), spec)
        await self.api.create(paths.DEVICES, wire.encode(device))
        log.info("Device %s created: %d GPU(s)", self.node, len(spec.gpus))


async def serve(kubeconfig: str | None, node: str, source: Source, *, interval: float = 10.0) -> None:
    """Run the agent until cancelled."""
    async with client.KubeClient.connect(kubeconfig) as api:
        agent = Agent(api, node, source, interval=interval)
        try:
            await agent.start()
            await asyncio.Event().wait()
        finally:
            await agent.stop()
