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

Usage watchdog (`agent.watchdog`): each pass maps NVML's GPU processes to pods through their cgroups
(`agent.cgroups`, under `Options.proc`), compares each pod's memory on each GPU with its allocation,
and on a violation records a Warning event on the pod and acts as configured (`--on-violation`:
report; kill the offending processes, their owner checked again just before; evict the pod through
the Eviction API). Per-pod and per-GPU usage are on /metrics.

Drift repair (`agent.drift`, with a kubelet): the kubelet's PodResources API says which GPUs each
container really got; a mismatch with what the API records gets a Warning event and a metric, and a
reservation pod's reported UUID is corrected. While the kubelet's socket is gone (a kubelet restart)
the check waits and says so on /readyz's detail; the agent stays ready.

Isolation: the node offers `hami-core` while HAMi-core's library file is on the node and installed
where sharing containers preload it (`agent.hamicore`), `mps` while
the MPS supervisor (`--mps`) has a daemon running for every healthy GPU, `mig` when a GPU has MIG
mode on. Each pass hands the healthy GPUs to the supervisor first, so a restarted daemon shows in the
same pass. /readyz is ok once the pod informer listed, the last pass succeeded, and the API accepts
the agent's credentials.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sharegpu.agent import cgroups, drift, hamicore, inventory, mps, nvml, podresources, watchdog
from sharegpu.api import devices as api_devices
from sharegpu.api import events, handoff, names, paths, wire
from sharegpu.api import pods as api_pods
from sharegpu.core import devices, units
from sharegpu.core import errors as core_errors
from sharegpu.kube import client, errors, informer, reconcile
from sharegpu.kube import events as kube_events
from sharegpu.serving import health

log = logging.getLogger(__name__)


class Source(nvml.Discovery, nvml.Health, nvml.Processes, Protocol):
    """What the inventory reads: NVML or the fake."""

    def close(self) -> None: ...


HAMI_CORE_LIBRARY = Path("/usr/local/vgpu/libvgpu.so")
"""Where HAMi-core's library is installed on a node (HAMi's own layout)."""


@dataclass(frozen=True, slots=True)
class Options:
    interval: float = 10.0
    """Seconds between passes (a critical XID starts one at once)."""
    hami_core_library: Path | None = HAMI_CORE_LIBRARY
    """The node offers hami-core while this file exists (and is installed); None: never."""
    hami_core_dir: Path = Path(handoff.HAMI_HOST_DIR)
    """Where the library is installed for containers (the webhook mounts this host folder)."""
    on_violation: watchdog.Action = watchdog.Action.REPORT
    proc: Path = Path("/proc")
    """Where the node's processes are seen (the agent runs with the host's PID namespace)."""
    slack_mib: int = 0
    """How far a pod may exceed its GPU memory before it violates."""
    drift_grace: float = 60.0
    """Seconds a pod may run before the kubelet must list the GPUs the API says it holds."""


class Agent:
    def __init__(
        self,
        api: client.KubeApi,
        node: str,
        source: Source,
        options: Options = Options(),
        *,
        supervisor: mps.Supervisor | None = None,
        kubelet: podresources.PodResources | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.node = node
        self.source = source
        self.options = options
        self.interval = options.interval
        self.supervisor = supervisor
        """Runs one MPS control daemon per healthy GPU (MPS mode); None: no MPS on this node."""
        self.clock = clock
        self.wall = wall
        self.kubelet = kubelet
        """The kubelet's PodResources API (drift repair); None: not checked."""
        self.kubelet_problem = ""
        self.unadvertised: tuple[str, ...] = ()
        """Healthy GPUs of the Device the kubelet cannot allocate (its device plugin does not offer them)."""
        self.unknown_allocatable: tuple[str, ...] = ()
        """Device IDs the kubelet can allocate that name no GPU of the Device."""
        self.last_success: float | None = None
        self.watchdog = watchdog.Watchdog()
        self.usage = watchdog.Assessment((), (), ())
        self.drift = drift.DriftTracker()
        self.killed = 0
        self.evicted = 0
        self.events = kube_events.Recorder(api, "sharegpu-agent", node, wall)
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
        live = self._live()
        ids = drift.DeviceIds(spec)
        assigned = await self._assigned()
        settled = True
        if assigned is not None:
            settled = await self._repair_drift(assigned, live, spec)
            await self._compare_allocatable(spec, ids)
        await self._watch_usage(spec, live, ids, assigned, act=settled)
        self.last_success = self.clock()

    # ----------------------------------------------------------------- usage watchdog

    def _live(self) -> dict[str, wire.Pod]:
        """The node's pods that may hold GPUs now, by UID."""
        return {
            p.metadata.uid: p for p in self.pods.values()
            if p.status.phase not in ("Succeeded", "Failed") and p.metadata.uid
        }  # fmt: skip

    async def _assigned(self) -> list[podresources.Assigned] | None:
        if self.kubelet is None:
            return None
        try:
            found = await self.kubelet.assigned()
        except podresources.PodResourcesError as exc:
            if str(exc) != self.kubelet_problem:
                log.warning("drift check waits: %s", exc)
            self.kubelet_problem = str(exc)
            return None
        if self.kubelet_problem:
            log.info("the kubelet's PodResources API answers again")
        self.kubelet_problem = ""
        return found

    async def _compare_allocatable(self, spec: wire.DeviceSpec, ids: drift.DeviceIds) -> None:
        """What the device plugin offers (GetAllocatableResources, kubelets 1.21 and later) against the
        Device: a healthy GPU it does not offer can never be given to a whole-GPU or reservation pod."""
        assert self.kubelet is not None
        try:
            offered = await self.kubelet.allocatable()
        except podresources.PodResourcesError:
            return  # said by `_assigned` already
        if offered is None:
            return
        uuids, unknown = ids.resolve(offered.get(names.NVIDIA_GPU, ()))
        unadvertised = tuple(sorted(g.uuid for g in spec.gpus if g.healthy and g.uuid not in uuids))
        if (unadvertised, unknown) != (self.unadvertised, self.unknown_allocatable) and (unadvertised or unknown):
            log.warning("the kubelet's %s: healthy GPUs not offered: %s; offered but not in the Device: %s",
                        names.NVIDIA_GPU, ", ".join(unadvertised) or "none", ", ".join(unknown) or "none")  # fmt: skip
        self.unadvertised, self.unknown_allocatable = unadvertised, unknown

    async def _watch_usage(
        self,
        spec: wire.DeviceSpec,
        live: dict[str, wire.Pod],
        ids: drift.DeviceIds,
        assigned: list[podresources.Assigned] | None,
        *,
        act: bool,
    ) -> None:
        """Assess the node's GPU use; act on violations only when `act` (not while a reservation's
        reported GPU is being corrected: which GPU a sharing pod was given depends on it)."""
        processes, owners = await asyncio.to_thread(self._processes)
        given: dict[str, set[str]] = {}
        for row in assigned or []:
            if row.resource == names.NVIDIA_GPU:  # as UUIDs, whichever ID strategy the device plugin uses
                given.setdefault(f"{row.namespace}/{row.pod}", set()).update(ids.resolve(row.device_ids)[0])
        self.usage = watchdog.assess(
            processes, owners.get, live, spec, assigned=given if assigned is not None else None,
            slack_mib=self.options.slack_mib,
        )  # fmt: skip
        if not act:
            return
        for step in self.watchdog.decide(self.usage, self.options.on_violation):
            await self._act(step)

    def _processes(self) -> tuple[list[nvml.GpuProcess], dict[int, cgroups.Owner | None]]:
        processes = self.source.running()
        return processes, {p.pid: cgroups.read_owner(p.pid, self.options.proc) for p in processes}

    async def _act(self, act: watchdog.Act) -> None:
        violation = act.violation
        pod = violation.pod
        subject = events.Subject("v1", "Pod", pod.namespace, pod.name, pod.uid)
        decision = f"{violation.kind.value}/{violation.uuid}/{self.watchdog.passes}"
        if act.what is watchdog.Action.REPORT:
            reason = "GPUMemoryExceeded" if violation.kind is watchdog.Kind.OVER_MEMORY else "GPUNotAllocated"
            await self._record(subject, reason, violation.message, decision)
        elif act.what is watchdog.Action.KILL:
            killed = await asyncio.to_thread(self._kill, act.pids, pod.uid)
            self.killed += len(killed)
            shown = ", ".join(map(str, killed)) or "none (gone meanwhile)"
            await self._record(
                subject, "GPUProcessKilled", f"{violation.message}; killed process(es) {shown}", decision
            )
        else:
            try:
                body = api_pods.eviction(units.pod_key(pod.namespace, pod.name), pod.uid)
                await self.api.create(paths.eviction(pod.namespace, pod.name), body)
            except (errors.NotFoundError, errors.ConflictError):
                return  # gone already, or made again under its name: the next pass sees
            except errors.KubeError as exc:  # 429: a disruption budget refuses it now; unknown: the watch tells
                log.warning("evicting %s/%s (%s): %s", pod.namespace, pod.name, errors.outcome(exc).value, exc)
                return
            self.evicted += 1
            await self._record(subject, "GPUPodEvicted", f"{violation.message}; the pod was evicted", decision)

    def _kill(self, pids: tuple[int, ...], uid: str) -> list[int]:
        """SIGKILL each process that still belongs to the pod (a pid may have been reused meanwhile)."""
        done = []
        for pid in pids:
            owner = cgroups.read_owner(pid, self.options.proc)
            if owner is None or owner.pod_uid != uid:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError) as exc:
                log.warning("killing process %d: %s", pid, exc)
                continue
            done.append(pid)
        return done

    async def _record(self, subject: events.Subject, reason: str, message: str, decision: str) -> None:
        try:
            await self.events.record(subject, reason, message, decision=decision, kind="Warning")
        except core_errors.SharegpuError as exc:
            log.warning("event %s on %s/%s not recorded: %s", reason, subject.namespace, subject.name, exc)

    # ----------------------------------------------------------------- drift repair

    async def _repair_drift(
        self, assigned: list[podresources.Assigned], live_by_uid: dict[str, wire.Pod], spec: wire.DeviceSpec
    ) -> bool:
        """Report and repair what the kubelet and the API disagree on; False while a reservation pod's
        reported GPU is wrong (this pass corrects it; the pods' view follows by the next)."""
        live = {wire.key(p.metadata): p for p in live_by_uid.values()}
        mismatches = drift.check(assigned, live, spec, now=self.wall(), grace=self.options.drift_grace)
        changes = self.drift.observe(mismatches)
        for found in changes.new:
            namespace, name = found.pod.split("/", 1)
            pod = live.get(found.pod)
            subject = events.Subject("v1", "Pod", namespace, name, pod.metadata.uid if pod else "")
            await self._record(subject, "GPUAssignmentDrift", found.message, f"{found.kind.value}/{found.kubelet}")
        done = []
        for repair in drift.repairs(mismatches):
            try:
                await self.api.patch(repair.path, repair.body)
            except errors.NotFoundError:
                continue
            except errors.KubeError as exc:
                log.warning("correcting %s: %s", repair.pod, exc)
                continue
            log.info("%s: reported GPU corrected to %s (the kubelet's assignment)", repair.pod, repair.uuid)
            done.append(repair)
        self.drift.repaired(done)
        return not any(m.kind is drift.Kind.RESERVATION_UUID for m in mismatches)

    async def _isolation(self, spec: wire.DeviceSpec, gpus: list[nvml.Gpu]) -> wire.DeviceSpec:
        """`spec` with the isolation modes the node offers now and its MPS daemons' state."""
        offered: set[devices.Isolation] = set()
        library = self.options.hami_core_library
        if library is not None:
            try:
                if await asyncio.to_thread(hamicore.install, library, self.options.hami_core_dir):
                    offered.add(devices.Isolation.HAMI_CORE)
            except OSError as exc:
                log.error("HAMi-core's library %s cannot be installed in %s (hami-core not offered): %s",
                          library, self.options.hami_core_dir, exc)  # fmt: skip
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
            if healthy and all(u in states and states[u].running for u in healthy):
                offered.add(devices.Isolation.MPS)
        modes = sorted(m.value for m in offered)
        return msgspec.structs.replace(spec, isolation=modes, mps=daemons)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready once the pod informer listed, the last pass succeeded (within three intervals) and the
        API accepts the agent's credentials."""
        fresh = self.last_success is not None and self.clock() - self.last_success <= 3 * self.interval + 5
        refused = self.api.refused
        ready = self.pod_informer.ready and fresh and not refused
        detail = {"informer": self.pod_informer.status(), "lastPassOk": fresh, "credentialsRefused": refused}
        if self.kubelet_problem:
            detail["kubelet"] = self.kubelet_problem
        return ready, detail

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
        up = GaugeMetricFamily("sharegpu_agent_mps_daemon_up", "1 while the GPU's MPS daemon runs", labels=["uuid"])
        restarts = CounterMetricFamily(
            "sharegpu_agent_mps_daemon_restarts", "Restarts of the GPU's MPS daemon", labels=["uuid"]
        )
        for daemon in spec.mps:
            up.add_metric([daemon.uuid], 1 if daemon.running else 0)
            restarts.add_metric([daemon.uuid], daemon.restarts)
        passes = CounterMetricFamily("sharegpu_agent_passes", "Inventory passes, by outcome", labels=["outcome"])
        loop = self.agent.loop
        passes.add_metric(["ok"], loop.completed - loop.failures)
        passes.add_metric(["failed"], loop.failures)
        yield from (gpus, modes, up, restarts, passes)
        families = {s.name: GaugeMetricFamily(s.name, s.help, labels=list(s.labels)) for s in watchdog.SERIES}
        for sample in self.agent.usage.samples():
            families[sample.series.name].add_metric(list(sample.labels), sample.value)
        yield from families.values()
        violations = GaugeMetricFamily(
            "sharegpu_agent_violations", "Pods over their GPU allocation now, by kind", labels=["kind"]
        )
        for kind in watchdog.Kind:
            violations.add_metric([kind.value], sum(1 for v in self.agent.usage.violations if v.kind is kind))
        actions = CounterMetricFamily("sharegpu_agent_actions", "Processes killed and pods evicted", labels=["action"])
        actions.add_metric(["kill"], self.agent.killed)
        actions.add_metric(["evict"], self.agent.evicted)
        drifted = GaugeMetricFamily(
            "sharegpu_agent_drift", "Mismatches between the kubelet's and the API's GPUs, by kind", labels=["kind"]
        )
        for drift_kind, count in self.agent.drift.counts().items():
            drifted.add_metric([drift_kind.value], count)
        drifted.add_metric(["unadvertised_gpu"], len(self.agent.unadvertised))
        drifted.add_metric(["unknown_allocatable"], len(self.agent.unknown_allocatable))
        repaired = CounterMetricFamily("sharegpu_agent_drift_repairs", "Reported GPU UUIDs corrected")
        repaired.add_metric([], self.agent.drift.repairs_done)
        yield from (violations, actions, drifted, repaired)


async def serve(
    kubeconfig: str | None,
    node: str,
    source: Source,
    options: Options = Options(),
    *,
    supervisor: mps.Supervisor | None = None,
    kubelet: podresources.KubeletPodResources | None = None,
    health_address: tuple[str, int] | None = None,
) -> None:
    """Run the agent until cancelled (with /healthz, /readyz and /metrics on `health_address`)."""
    async with client.KubeClient.connect(kubeconfig) as api:
        agent = Agent(api, node, source, options, supervisor=supervisor, kubelet=kubelet)
        server = health.HealthServer(agent.readiness, agent.metrics.registry)
        try:
            if health_address is not None:
                await server.start(*health_address)
            await agent.start()
            await asyncio.Event().wait()
        finally:
            await agent.stop()
            await server.stop()
            if kubelet is not None:
                await kubelet.close()
