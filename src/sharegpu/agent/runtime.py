"""`sharegpu agent`: one per GPU node; keeps the node's Device resource and GPU labels current,
and serves /healthz, /readyz and /metrics. The `Agent` runs the pass and hands each part its job:

- the inventory (`agent.inventory`): a pass reads NVML (in a worker thread: NVML calls block), folds
  in the health it has learnt (XID events, which a second task waits for, and GPUs NVML cannot
  read), builds the Device spec (with the GPUs the node's pods hold, from a pod informer on this
  node) and writes it when it differs from what the API holds: created owned by the Node (it goes
  with the node), replaced with the resourceVersion it was computed from (a 409 means someone else
  wrote: the next pass starts from theirs). Node labels for the model and the GPU count follow. A
  GPU with a critical XID stays unhealthy while this agent runs (a GPU needs a reset to recover;
  after it, restart the agent); one NVML cannot read is unhealthy while that lasts;
- isolation (`agent.isolation`): the modes the node offers, each proven first (`agent.proof`), its
  MPS daemons (`agent.mps`), and what each mode enforces, into the same Device spec;
- drift repair (`agent.repair`, with a kubelet): the kubelet's PodResources API against the API;
- the usage watchdog (`agent.watchdog`): NVML's GPU processes mapped to pods through their cgroups
  (`agent.cgroups`, under `Options.proc`), each pod's memory on each GPU against its allocation
  (per-pod and per-GPU usage on /metrics), and on a violation `agent.actions` acts as configured
  (`--on-violation`: report, kill, evict) — not while a reservation's reported GPU is being
  corrected. A second informer keeps the SharedDeviceGroups (which namespaces each admits): a pod
  labelled with a group counts as its member only in those;
- the kubelet's plugins: the volume plugin (`agent.volumes`, unless `Options.volumes` is None),
  which binds a sharing pod's MPS tenant folder or HAMi-core's library into its volumes, and with
  `--dra` the ResourceSlice (`agent.publication`) and the DRA plugin (`agent.draplugin`).

/readyz is ok once both informers listed, the last pass succeeded, the API accepts the agent's
credentials, and the kubelet has registered the plugins the agent serves; while the kubelet's
PodResources socket is gone (a kubelet restart) its detail says so and the agent stays ready.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sharegpu.agent import (
    actions,
    cgroups,
    draplugin,
    drift,
    host,
    inventory,
    isolation,
    mps,
    notices,
    nvml,
    podresources,
    proof,
    publication,
    repair,
    usagereport,
    volumes,
    watchdog,
)
from sharegpu.api import cdi, dra, handoff, names, paths, resources, usage, wire
from sharegpu.api import devices as api_devices
from sharegpu.api import groups as api_groups
from sharegpu.api import pods as api_pods
from sharegpu.core import devices
from sharegpu.kube import client, errors, informer, reconcile, reviews
from sharegpu.kube import events as kube_events
from sharegpu.serving import access, health

log = logging.getLogger(__name__)


class Source(nvml.Discovery, nvml.Health, nvml.Processes, nvml.Utilisation, Protocol):
    """What the inventory reads: NVML or the fake."""

    def refresh(self) -> bool:
        """Take in what changed since the last pass; True if anything did (the fake re-reads its file;
        NVML answers live, so never)."""
        ...

    def close(self) -> None: ...


"""Where HAMi-core's library is installed on a node (HAMi's own layout)."""
XID_RETRY = 1.0
"""Seconds before a failed wait for XID events is tried again (doubling up to `XID_RETRY_MAX`)."""
XID_RETRY_MAX = 60.0


@dataclass(frozen=True, slots=True)
class Options:
    interval: float = 10.0
    """Seconds between passes (a critical XID starts one at once)."""
    hami_core_library: Path | None = host.HAMI_CORE_LIBRARY
    """The node offers hami-core while this file exists (and is installed); None: never."""
    hami_core_dir: Path = host.HAMI_CORE_DIR
    """Where the library is installed for containers (the webhook mounts this host folder)."""
    on_violation: watchdog.Action = watchdog.Action.REPORT
    proc: Path = host.PROC
    """Where the node's processes are seen (the agent runs with the host's PID namespace)."""
    slack_mib: int = 0
    """How far a pod may exceed its GPU memory before it violates."""
    drift_grace: float = 60.0
    """Seconds a pod may run before the kubelet must list the GPUs the API says it holds."""
    hami_core_compute: bool = False
    """The operator measured (scripts/gpu-check) that this node's HAMi-core enforces compute shares."""
    dra: bool = False
    """Also publish the node's GPUs as a ResourceSlice of sharegpu's DRA driver (`agent.publication`)."""
    dra_plugin: draplugin.Paths | None = None
    """With `dra`: serve the kubelet's DRA plugin on these sockets (`agent.draplugin`); None: not served."""
    volumes: volumes.Paths | None = None
    """Serve the kubelet's CSI plugin that binds sharing pods' node folders on these sockets
    (`agent.volumes`); None: not served (such pods of the extender path cannot start here)."""
    usage_interval: float = 60.0
    """Write the node's GpuUsage at most this often, in seconds (`agent.usagereport`); 0: never."""
    usage_refresh: float = usage.REFRESH
    """Write it again, changed or not, once what was written is this many seconds old."""


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
        prover: proof.Prover | None = None,
        mounter: volumes.Mounter | None = None,
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
        own = cgroups.read_owner(os.getpid(), options.proc)
        self.own_pod = frozenset({own.pod_uid}) if own is not None else frozenset()
        """The UID of the agent's own pod, read from its own cgroup (empty outside a pod): the
        processes there are the node's (the MPS daemons and servers the agent starts), never judged
        as a tenant's."""
        self.clock = clock
        self.wall = wall
        self.warnings = notices.Notices(kube_events.Recorder(api, "sharegpu-agent", node, wall))
        settings = isolation.HamiCore(options.hami_core_library, options.hami_core_dir, options.hami_core_compute)
        self.isolation = isolation.Isolation(api, node, settings, self.warnings, supervisor=supervisor, prover=prover)
        self.enforcer = actions.Enforcer(api, self.warnings, options.proc)
        self.publisher = publication.SlicePublisher(api, node, clock=clock) if options.dra else None
        self.plugin = (
            draplugin.DraPlugin(api, node, options.dra_plugin, lambda: self.written, self._enforcement)
            if options.dra and options.dra_plugin is not None
            else None
        )
        """The kubelet's DRA plugin of this node (prepares sharegpu's claims); None: not served."""
        folders = volumes.Folders(supervisor.layout if supervisor is not None else None, options.hami_core_dir)
        self.volumes = (
            volumes.VolumesPlugin(
                node,
                options.volumes,
                lambda context: volumes.resolve(context, self._live(), self.written, folders),
                mounter,
            )
            if options.volumes is not None
            else None
        )
        """The kubelet's CSI plugin of this node (binds sharing pods' node folders); None: not served."""
        self.repair = (
            repair.DriftRepair(api, kubelet, self.warnings, options.drift_grace, wall) if kubelet is not None else None
        )
        """Drift repair against the kubelet's PodResources API; None: not checked."""
        self.reporter = (
            usagereport.UsageReporter(api, node, options.usage_interval, pass_interval=options.interval,
                                      refresh=options.usage_refresh, clock=clock, wall=wall)
            if options.usage_interval > 0
            else None
        )  # fmt: skip
        """Writes the node's GpuUsage; None: not written."""
        self.last_success: float | None = None
        self.usage = watchdog.Assessment((), (), ())
        self.metrics = _Metrics(self)
        self.pods: dict[str, wire.Pod] = {}
        self.xids: dict[str, str] = {}
        """UUID -> the critical XID that made it unhealthy."""
        self.xid_failures = 0
        """Waits for XID events that failed (each tried again, `_watch_xids`)."""
        self.written: wire.DeviceSpec | None = None
        self.labels: dict[str, str | None] = {}
        self.loop = reconcile.Loop(f"agent-{node}", self.reconcile)
        self.pod_informer: informer.Informer[Any, Any] = informer.Informer(
            api, paths.PODS, wire.Pod, informer.identity, self._on_pod, name="node-pods",
            params={"fieldSelector": f"spec.nodeName={node}"},
        )  # fmt: skip
        self.admits: dict[tuple[str, str], frozenset[str]] = {}
        """The SharedDeviceGroups by (namespace, name): the namespaces whose pods may join each."""
        self.group_informer: informer.Informer[Any, Any] = informer.Informer(
            api, resources.SHARED_DEVICE_GROUP.path(), api_groups.SharedDeviceGroup, informer.identity,
            self._on_group, name="shareddevicegroups",
        )  # fmt: skip
        self.tasks: list[asyncio.Task[None]] = []
        self.slice_left = False
        """A ResourceSlice from when this node served DRA could not be deleted yet."""

    def _on_pod(self, kind: wire.EventType, pod: wire.Pod) -> None:
        informer.remember(self.pods, kind, pod)

    def _on_group(self, kind: wire.EventType, group: api_groups.SharedDeviceGroup) -> None:
        key = (group.metadata.namespace, group.metadata.name)
        if kind == wire.EventType.DELETED:
            self.admits.pop(key, None)
        else:
            self.admits[key] = frozenset((key[0], *group.spec.members.namespaces))

    async def start(self) -> None:
        if not self.options.dra:
            self.slice_left = not await self._withdraw_slice()
        self.tasks = [
            asyncio.create_task(self.pod_informer.run(), name="agent-pods"),
            asyncio.create_task(self.group_informer.run(), name="agent-groups"),
        ]
        await self.pod_informer.synced.wait()
        self.loop.wake()
        self.tasks += [
            asyncio.create_task(self.loop.run(tick=self.interval), name="agent-inventory"),
            asyncio.create_task(self._watch_xids(), name="agent-xids"),
        ]
        if self.plugin is not None:
            await self.plugin.start()
            self.tasks.append(asyncio.create_task(self.plugin.keep(), name="agent-dra-registration"))
        if self.volumes is not None:
            await self.volumes.start()
            self.tasks.append(asyncio.create_task(self.volumes.keep(), name="agent-volumes-registration"))

    async def _withdraw_slice(self) -> bool:
        """Delete this node's ResourceSlice, left by the agent when it served DRA (without `--dra` no
        claim may be placed here); False if it could not be deleted now (each pass tries again)."""
        try:
            await self.api.delete(dra.slice_path(self.node))
        except errors.NotFoundError:
            return True
        except errors.KubeError as error:
            log.warning("cannot delete ResourceSlice %s left from when this node served DRA (again at the next "
                        "pass): %s", dra.slice_name(self.node), error)  # fmt: skip
            return False
        log.info("ResourceSlice %s deleted: this node does not serve DRA now", dra.slice_name(self.node))
        return True

    def _enforcement(self) -> handoff.Enforcement:
        """The limits this node enforces for a claim (it demands no mode: what the extender path gives
        a pod that demands none)."""
        if self.written is None:
            return handoff.Enforcement()
        offered = api_devices.isolation_modes(wire.Device(spec=self.written))
        return handoff.Enforcement.of(offered, None)

    async def stop(self) -> None:
        await informer.cancel(reversed(self.tasks))
        if self.plugin is not None:
            await self.plugin.stop()
        if self.volumes is not None:
            await self.volumes.stop()
        if self.supervisor is not None:
            await self.supervisor.stop()

    async def _watch_xids(self) -> None:
        """Mark the GPUs that report a critical XID. A wait that fails is tried again after a pause
        that doubles up to `XID_RETRY_MAX` (the task never ends: it would leave later XIDs unseen)."""
        pause = XID_RETRY
        while True:
            try:
                events = await asyncio.to_thread(self.source.xid_events, 1000)
            except Exception as exc:  # anything NVML raises: the watch goes on
                self.xid_failures += 1
                log.warning("XID events: %s; trying again in %g s", exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, XID_RETRY_MAX)
                continue
            if pause != XID_RETRY:
                log.info("XID events: waiting for them again")
                pause = XID_RETRY
            for event in events:
                if event.code in nvml.CRITICAL_XIDS and event.uuid not in self.xids:
                    log.warning("GPU %s: critical XID %d; unhealthy from now on", event.uuid, event.code)
                    self.xids[event.uuid] = api_devices.xid(event.code)
                    self.loop.wake()
                else:
                    log.info("GPU %s: XID %d (not the GPU's fault)", event.uuid, event.code)

    # ----------------------------------------------------------------- the pass

    async def reconcile(self) -> None:
        await self.warnings.retell()
        if self.slice_left:
            self.slice_left = not await self._withdraw_slice()
        gpus, links, unreadable = await asyncio.to_thread(self._read)
        unhealthy = {**dict.fromkeys(unreadable, api_devices.UNREADABLE), **self.xids}
        current = await self._current()
        previous = current.spec if current is not None else None
        held = inventory.held_uuids(list(self.pods.values()), previous)
        claims = self.plugin.claims if self.plugin is not None else None
        # A GPU that leaves NVML while pods hold it stays, gone, at its index: those of the extender
        # path (`held`) and those of the DRA claims prepared here alike (no other GPU takes its index
        # under a claim that names it).
        claimed = {uuid for claim in (claims or {}).values() for uuid in claim.gpus}
        spec = inventory.device_spec(gpus, links, unhealthy, previous, held | claimed)
        live = self._live()
        ids = drift.DeviceIds(spec, {gpu.index: gpu.uuid for gpu in gpus})  # the device plugin's index IDs: NVML's
        assigned = await self.repair.assigned() if self.repair is not None else None
        given = _given(assigned, ids)
        spec = await self.isolation.apply(spec, gpus, live, claims, assigned=given)
        if self.options.dra:
            spec = msgspec.structs.replace(spec, dra=True)
        if current is None:
            await self._create(spec)
        elif current.spec != spec:
            body = wire.encode(api_devices.published(current.metadata, spec))
            await self.api.replace(paths.device(self.node), body)
            log.info("Device %s updated: %d GPU(s)", self.node, len(spec.gpus))
        self.written = spec
        if self.publisher is not None:
            await self.publisher.publish(spec, frozenset(held))
        labels = inventory.node_labels(spec)
        if labels != self.labels:
            await self.api.patch(paths.node(self.node), {"metadata": {"labels": labels}})
            self.labels = labels
        settled = True
        if self.repair is not None and assigned is not None:
            settled = await self.repair.repair(assigned, live, spec, ids)
            await self.repair.compare_allocatable(spec, ids)
        await self._watch_usage(spec, live, given, claims, act=settled)
        self.last_success = self.clock()

    # ----------------------------------------------------------------- usage watchdog

    def _live(self) -> dict[str, wire.Pod]:
        """The node's pods that may hold GPUs now, by UID."""
        return {
            p.metadata.uid: p for p in self.pods.values()
            if not api_pods.is_terminal(p) and p.metadata.uid
        }  # fmt: skip

    async def _watch_usage(
        self,
        spec: wire.DeviceSpec,
        live: dict[str, wire.Pod],
        given: dict[str, set[str]] | None,
        claims: Mapping[tuple[str, str], cdi.PreparedClaim] | None,
        *,
        act: bool,
    ) -> None:
        """Assess the node's GPU use (`given`: the device plugin's GPUs of each pod, by the kubelet; None
        while it cannot be read); act on violations only when `act` (not while a reservation's reported
        GPU is being corrected: which GPU a sharing pod was given depends on it)."""
        processes, owners, utilization = await asyncio.to_thread(self._processes)
        self.usage = watchdog.assess(
            processes, owners.get, live, spec, assigned=given,
            exempt=self.own_pod, slack_mib=self.options.slack_mib,
            groups=self.admits if self.group_informer.synced.is_set() else None, claims=claims, utilization=utilization,
        )  # fmt: skip
        if act:
            await self.enforcer.enforce(self.usage, self.options.on_violation)
        if self.reporter is not None:
            await self.reporter.report(self.usage)

    def _processes(self) -> tuple[list[nvml.GpuProcess], dict[int, cgroups.Owner | None], list[nvml.Utilization]]:
        processes = self.source.running()
        utilization = self.source.utilization()
        return processes, {p.pid: cgroups.read_owner(p.pid, self.options.proc) for p in processes}, utilization

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready once both informers listed, the last pass succeeded (within three intervals), the
        API accepts the agent's credentials and the kubelet has registered the plugins the agent serves
        (DRA, volumes)."""
        fresh = self.last_success is not None and self.clock() - self.last_success <= 3 * self.interval + 5
        refused = self.api.refused
        ready = self.pod_informer.ready and self.group_informer.ready and fresh and not refused
        detail = {"informer": self.pod_informer.status(), "groups": self.group_informer.status(),
                  "lastPassOk": fresh, "credentialsRefused": refused}  # fmt: skip
        if self.repair is not None and self.repair.problem:
            detail["kubelet"] = self.repair.problem
        if self.publisher is not None and self.publisher.problem:
            detail["dra"] = self.publisher.problem
        if self.reporter is not None and self.reporter.problem:
            detail["usage"] = self.reporter.problem
        if self.plugin is not None:
            registered = self.plugin.registration.registered
            # Where no claim can come (resource.k8s.io/v1 not served), the kubelet may never register it.
            ready = ready and (registered is True or (self.publisher is not None and self.publisher.unserved))
            detail["draPlugin"] = self.plugin.registration.status()
        if self.volumes is not None:
            ready = ready and self.volumes.registration.registered is True
            detail["volumesPlugin"] = self.volumes.registration.status()
        return ready, detail

    def _read(self) -> tuple[list[nvml.Gpu], list[nvml.Link], set[str]]:
        self.source.refresh()
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
        proven = GaugeMetricFamily(
            "sharegpu_agent_isolation_proven", "1 for each mode whose memory limit a probe proved here", labels=["mode"]
        )
        for entry in spec.enforcement:
            proven.add_metric([entry.mode], 1 if entry.memory else 0)
        probes = CounterMetricFamily(
            "sharegpu_agent_isolation_probes", "Probes of the isolation modes, by outcome", labels=["mode", "outcome"]
        )
        for (mode_name, outcome), count in sorted(
            (self.agent.isolation.prover.probes if self.agent.isolation.prover else {}).items()
        ):
            probes.add_metric([mode_name, outcome], count)
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
        xid_waits = CounterMetricFamily(
            "sharegpu_agent_xid_wait_failures", "Waits for XID events NVML failed (each tried again)"
        )
        xid_waits.add_metric([], self.agent.xid_failures)
        yield from (gpus, modes, proven, probes, up, restarts, passes, xid_waits)
        families = {s.name: GaugeMetricFamily(s.name, s.help, labels=list(s.labels)) for s in watchdog.SERIES}
        for sample in self.agent.usage.samples():
            families[sample.series.name].add_metric(list(sample.labels), sample.series.exported(sample.value))
        yield from families.values()
        violations = GaugeMetricFamily(
            "sharegpu_agent_violations", "Pods over their GPU allocation now, by kind", labels=["kind"]
        )
        for kind in watchdog.Kind:
            violations.add_metric([kind.value], sum(1 for v in self.agent.usage.violations if v.kind is kind))
        acted = CounterMetricFamily("sharegpu_agent_actions", "Processes killed and pods evicted", labels=["action"])
        acted.add_metric(["kill"], self.agent.enforcer.killed)
        acted.add_metric(["evict"], self.agent.enforcer.evicted)
        drifted = GaugeMetricFamily(
            "sharegpu_agent_drift", "Mismatches between the kubelet's and the API's GPUs, by kind", labels=["kind"]
        )
        checker = self.agent.repair
        tracker = checker.tracker if checker is not None else drift.DriftTracker()
        for drift_kind, count in tracker.counts().items():
            drifted.add_metric([drift_kind.value], count)
        drifted.add_metric(["unadvertised_gpu"], len(checker.unadvertised) if checker is not None else 0)
        drifted.add_metric(["unknown_allocatable"], len(checker.unknown_allocatable) if checker is not None else 0)
        repaired = CounterMetricFamily("sharegpu_agent_drift_repairs", "Reported GPU UUIDs corrected")
        repaired.add_metric([], tracker.repairs_done)
        yield from (violations, acted, drifted, repaired)


async def serve(
    kubeconfig: str | None,
    node: str,
    source: Source,
    options: Options = Options(),
    *,
    supervisor: mps.Supervisor | None = None,
    kubelet: podresources.KubeletPodResources | None = None,
    prover: proof.Prover | None = None,
    health_port: health.Endpoint | None = None,
) -> None:
    """Run the agent until cancelled, with /healthz, /readyz and /metrics on `health_port` (none
    without one)."""
    async with client.KubeClient.connect(kubeconfig) as api:
        agent = Agent(api, node, source, options, supervisor=supervisor, kubelet=kubelet, prover=prover)
        gate = access.Gate(reviews.ApiReviewer(api)) if health_port is not None and health_port.metrics_auth else None
        server = health.HealthServer(agent.readiness, agent.metrics.registry, gate)
        try:
            if health_port is not None:
                await server.start(health_port)
            await agent.start()
            await asyncio.Event().wait()
        finally:
            await agent.stop()
            await server.stop()
            if kubelet is not None:
                await kubelet.close()


def _given(assigned: list[podresources.Assigned] | None, ids: drift.DeviceIds) -> dict[str, set[str]] | None:
    """ "namespace/pod" -> the UUIDs of the device plugin's GPUs the kubelet gave it (whichever ID
    strategy the device plugin uses); None while the kubelet's assignments cannot be read."""
    if assigned is None:
        return None
    given: dict[str, set[str]] = {}
    for row in assigned:
        if row.resource == names.NVIDIA_GPU:
            given.setdefault(f"{row.namespace}/{row.pod}", set()).update(ids.resolve(row.device_ids)[0])
    return given
