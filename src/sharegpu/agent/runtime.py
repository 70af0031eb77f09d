"""`sharegpu agent`: one per GPU node; keeps the node's Device resource and GPU labels current,
runs the MPS daemons in MPS mode, and serves /healthz, /readyz and /metrics.

A pass reads NVML (in a worker thread: NVML calls block), folds in the health it has learnt (XID
events, which a second task waits for, and GPUs NVML cannot read), builds the Device spec
(`agent.inventory`, with the GPUs the node's pods hold, from a pod informer on this node) and writes
it when it differs from what the API holds: created owned by the Node (it goes with the node),
replaced with the resourceVersion it was computed from (a 409 means someone else wrote: the next
pass starts from theirs). Node labels for the model and the GPU count follow.

A GPU with a critical XID stays unhealthy while this agent runs (a GPU needs a reset to recover;
after it, restart the agent); one NVML cannot read is unhealthy while that lasts.

Isolation: the node offers `hami-core` while HAMi-core's library file is on the node, `mps` while
the MPS supervisor (`--mps`) has a daemon running for every healthy GPU, `mig` when a GPU has MIG
mode on. Each pass hands the healthy GPUs to the supervisor first, so a restarted daemon shows in the
same pass. /readyz is ok once the pod informer listed, the last pass succeeded, and the API accepts
the agent's credentials.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sharegpu.agent import inventory, mps, nvml
from sharegpu.api import devices as api_devices
from sharegpu.api import paths, wire
from sharegpu.core import devices
from sharegpu.kube import client, errors, informer, reconcile
from sharegpu.serving import health

log = logging.getLogger(__name__)


class Source(nvml.Discovery, nvml.Health, Protocol):
    """What the inventory reads: NVML or the fake."""

    def close(self) -> None: ...


HAMI_CORE_LIBRARY = Path("/usr/local/vgpu/libvgpu.so")
"""Where HAMi-core's library is installed on a node (HAMi's own layout)."""


@dataclass(frozen=True, slots=True)
class Options:
    interval: float = 10.0
    """Seconds between passes (a critical XID starts one at once)."""
    hami_core_library: Path | None = HAMI_CORE_LIBRARY
    """The node offers hami-core while this file exists; None: never."""


class Agent:
    def __init__(
        self,
        api: client.KubeApi,
        node: str,
        source: Source,
        options: Options = Options(),
        *,
        supervisor: mps.Supervisor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.node = node
        self.source = source
        self.options = options
        self.interval = options.interval
        self.supervisor = supervisor
        """Runs one MPS control daemon per healthy GPU (MPS mode); None: no MPS on this node."""
        self.clock = clock
        self.last_success: float | None = None
        self.metrics = _Metrics(self)
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
        if self.supervisor is not None:
            await self.supervisor.stop()

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
        spec = await self._isolation(spec, gpus)
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
        self.last_success = self.clock()

    async def _isolation(self, spec: wire.DeviceSpec, gpus: list[nvml.Gpu]) -> wire.DeviceSpec:
        """`spec` with the isolation modes the node offers now and its MPS daemons' state."""
        offered: set[devices.Isolation] = set()
        library = self.options.hami_core_library
        if library is not None and await asyncio.to_thread(library.is_file):
            offered.add(devices.Isolation.HAMI_CORE)
        if any(g.mig for g in gpus):
            offered.add(devices.Isolation.MIG)
        daemons: list[wire.MpsDaemon] = []
        if self.supervisor is not None:
            healthy = {g.uuid for g in spec.gpus if g.healthy}
            await self.supervisor.ensure(healthy)
            states = self.supervisor.status()
            daemons = [
                wire.MpsDaemon(uuid=s.uuid, running=s.running, restarts=s.restarts, problem=s.problem)
                for s in states.values()
            ]
            if healthy and all(states[u].running for u in healthy if u in states) and healthy <= set(states):
                offered.add(devices.Isolation.MPS)
        modes = sorted(m.value for m in offered)
        return msgspec.structs.replace(spec, isolation=modes, mps=daemons)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready once the pod informer listed, the last pass succeeded (within three intervals) and the
        API accepts the agent's credentials."""
        fresh = self.last_success is not None and self.clock() - self.last_success <= 3 * self.interval + 5
        refused = self.api.refused
        ready = self.pod_informer.ready and fresh and not refused
        return ready, {"informer": self.pod_informer.status(), "lastPassOk": fresh, "credentialsRefused": refused}

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


class _Metrics(Collector):
    """What the agent knows, read at each scrape: GPUs by health, the isolation modes offered, the MPS
    daemons (up, restarts), and the agent's passes."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.registry = prometheus_client.CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        spec = self.agent.written or wire.DeviceSpec()
        gpus = GaugeMetricFamily("sharegpu_agent_gpus", "GPUs in the node's Device, by health", labels=["healthy"])
        gpus.add_metric(["true"], sum(1 for g in spec.gpus if g.healthy))
        gpus.add_metric(["false"], sum(1 for g in spec.gpus if not g.healthy))
        modes = GaugeMetricFamily("sharegpu_agent_isolation", "1 for each isolation mode offered", labels=["mode"])
        for mode in devices.Isolation:
            modes.add_metric([mode.value], 1 if mode.value in spec.isolation else 0)
        up = GaugeMetricFamily("sharegpu_agent_mps_daemon_up", "1 while the GPU's MPS daemon runs", labels=["gpu"])
        restarts = CounterMetricFamily(
            "sharegpu_agent_mps_daemon_restarts", "Restarts of the GPU's MPS daemon", labels=["gpu"]
        )
        for daemon in spec.mps:
            up.add_metric([daemon.uuid], 1 if daemon.running else 0)
            restarts.add_metric([daemon.uuid], daemon.restarts)
        passes = CounterMetricFamily("sharegpu_agent_passes", "Inventory passes, by outcome", labels=["outcome"])
        loop = self.agent.loop
        passes.add_metric(["ok"], loop.completed - loop.failures)
        passes.add_metric(["failed"], loop.failures)
        yield from (gpus, modes, up, restarts, passes)


async def serve(
    kubeconfig: str | None,
    node: str,
    source: Source,
    options: Options = Options(),
    *,
    supervisor: mps.Supervisor | None = None,
    health_address: tuple[str, int] | None = None,
) -> None:
    """Run the agent until cancelled (with /healthz, /readyz and /metrics on `health_address`)."""
    async with client.KubeClient.connect(kubeconfig) as api:
        agent = Agent(api, node, source, options, supervisor=supervisor)
        server = health.HealthServer(agent.readiness, agent.metrics.registry)
        try:
            if health_address is not None:
                await server.start(*health_address)
            await agent.start()
            await asyncio.Event().wait()
        finally:
            await agent.stop()
            await server.stop()
