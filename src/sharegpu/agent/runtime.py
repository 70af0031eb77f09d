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

Isolation: the node offers `hami-core` while HAMi-core's library file is on the node, installed
where sharing containers preload it (`agent.hamicore`) and proven to enforce a memory limit by a
probe of the installed copy (`agent.proof`); `mps` while the MPS supervisor (`--mps`) has a daemon
running, and proven, for every healthy GPU; `mig` when a GPU has MIG mode on. Without a prover
(probing off: a fake NVML has no GPU to probe) a mode is offered unproven and the Device says so.
The Device's `enforcement` says per mode whether it is offered, what it enforces (memory: proven;
compute: `proof.COMPUTE`, or for hami-core `--hami-core-enforces-compute`) and why not; a failed
proof is also a Warning event on the Node (`IsolationNotProven`) and a metric. Each pass hands the
healthy GPUs to the supervisor first, so a restarted daemon shows (and is probed) in the same pass.
/readyz is ok once the pod informer listed, the last pass succeeded, and the API accepts the
agent's credentials.
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

from sharegpu.agent import cgroups, drift, hamicore, inventory, mps, nvml, podresources, proof, watchdog
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
    hami_core_compute: bool = False
    """The operator measured (scripts/gpu-check) that this node's HAMi-core enforces compute shares."""


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
        self.prover = prover
        """Proves each isolation mode before it is offered; None: modes are offered unproven."""
        self.announced: set[tuple[str, str, str]] = set()
        """(mode, subject, reason) of the failed proofs told in a Warning event."""
        self.node_uid = ""
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

    def _on_pod(self, kind: wire.EventType, pod: wire.Pod) -> None:
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
        subject = events.pod(pod.namespace, pod.name, pod.uid)
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
            subject = events.pod(namespace, name, pod.metadata.uid if pod else "")
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
        """`spec` with the isolation modes the node offers now, what each enforces, and its MPS daemons."""
        promised = watchdog.promised(self._live(), spec)
        room = {g.uuid: g.memory_mib - promised.get(g.uuid, 0) for g in spec.gpus if g.healthy}
        hami = await self._hami_core(room)
        mps_entry, daemons = await self._mps(room)
        mig = any(g.mig for g in gpus)
        no_mig = "" if mig else "no GPU in MIG mode"
        entries = sorted([hami, mps_entry, _entry(devices.Isolation.MIG, mig, reason=no_mig)], key=lambda e: e.mode)
        for entry in entries:
            if not entry.offered and self._failed(entry):
                await self._not_proven(entry)
        modes = [e.mode for e in entries if e.offered]
        return msgspec.structs.replace(spec, isolation=modes, mps=daemons, enforcement=entries)

    async def _hami_core(self, room: dict[str, int]) -> wire.ModeEnforcement:
        mode = devices.Isolation.HAMI_CORE
        compute = self.options.hami_core_compute
        library = self.options.hami_core_library
        if library is None:
            return _entry(mode, False, compute=compute, reason="no library configured (--hami-core-library '')")
        try:
            if not await asyncio.to_thread(hamicore.install, library, self.options.hami_core_dir):
                return _entry(mode, False, compute=compute, reason=f"no library at {library}")
        except OSError as exc:
            log.error("HAMi-core's library %s cannot be installed in %s (hami-core not offered): %s",
                      library, self.options.hami_core_dir, exc)  # fmt: skip
            return _entry(mode, False, compute=compute, reason=f"{library} cannot be installed: {exc}")
        unenforced = "" if compute else "compute shares are not enforced (docs/isolation.md)"
        if self.prover is None:
            return _entry(mode, True, compute=compute, reason=_join("not proven: probing is off", unenforced))
        found = await self.prover.hami(self.options.hami_core_dir / hamicore.LIBRARY_NAME, room)
        return _entry(
            mode, found.proven, memory=found.proven, compute=compute, subject=found.subject,
            at=found.at, reason=_join(found.reason, unenforced),
        )  # fmt: skip

    async def _mps(self, room: dict[str, int]) -> tuple[wire.ModeEnforcement, list[wire.MpsDaemon]]:
        mode = devices.Isolation.MPS
        if self.supervisor is None:
            return _entry(mode, False, compute=True, reason="no MPS daemons (the agent runs without --mps)"), []
        await self.supervisor.ensure(set(room))
        states = self.supervisor.status()
        layout = self.supervisor.layout
        prover = self.prover

        async def proven(state: mps.Status) -> proof.Proof | None:
            if prover is None or not state.running or state.pid is None:
                return None
            return await prover.mps(
                state.uuid, state.pid, layout.pipe(state.uuid), layout.log(state.uuid), room.get(state.uuid, 0)
            )

        found = dict(zip(states, await asyncio.gather(*(proven(s) for s in states.values())), strict=True))
        if prover is not None:
            prover.forget(set(room))
        daemons = []
        problems = []
        for uuid, state in states.items():
            made = found[uuid]
            problem = state.problem or (made.reason if made is not None and not made.proven else "")
            daemons.append(wire.MpsDaemon(uuid=uuid, running=state.running, restarts=state.restarts,
                                          problem=problem, proven=made is not None and made.proven))  # fmt: skip
            if problem:
                problems.append(f"{uuid}: {problem}")
        missing = sorted(set(room) - set(states))
        problems += [f"{uuid}: no daemon" for uuid in missing]
        running = bool(room) and not missing and all(states[u].running for u in room)
        proofs = [found[u] for u in sorted(room) if u in found]
        every = running and prover is not None and all(p is not None and p.proven for p in proofs)
        offered = every or (running and prover is None)
        reason = "; ".join(problems) if problems else ("" if room else "no healthy GPU")
        if prover is None and offered:
            reason = "not proven: probing is off"
        subject = ", ".join(f"{uuid} {p.subject}" for uuid, p in zip(sorted(room), proofs, strict=False) if p)
        times = [p.at for p in proofs if p is not None and p.at is not None]
        return (
            _entry(mode, offered, memory=every, compute=True, subject=subject,
                   at=max(times) if every and times else None, reason=reason),
            daemons,
        )  # fmt: skip

    def _failed(self, entry: wire.ModeEnforcement) -> bool:
        """Whether a probe failed for what the entry is about (not: waiting for one, or not configured)."""
        if self.prover is None:
            return False
        if entry.mode == devices.Isolation.HAMI_CORE.value:
            known = self.prover.hami_core
            return known is not None and known.subject == entry.subject and known.state is proof.State.FAILED
        if entry.mode == devices.Isolation.MPS.value:
            return any(p.state is proof.State.FAILED for p in self.prover.daemons.values())
        return False

    async def _not_proven(self, entry: wire.ModeEnforcement) -> None:
        """A Warning event on the Node, once per (mode, subject, reason)."""
        told = (entry.mode, entry.subject, entry.reason)
        if told in self.announced:
            return
        log.warning("isolation %s not offered: %s", entry.mode, entry.reason)
        try:
            if not self.node_uid:
                self.node_uid = (await self.api.get(paths.node(self.node)))["metadata"]["uid"]
        except errors.KubeError as exc:
            log.warning("event IsolationNotProven not recorded: %s", exc)
            return
        subject = events.node(self.node, self.node_uid)
        decision = f"{entry.mode}/{entry.subject}"
        await self._record(
            subject, "IsolationNotProven", f"isolation {entry.mode} not offered: {entry.reason}", decision
        )
        self.announced.add(told)

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


def _entry(
    mode: devices.Isolation,
    offered: bool,
    *,
    memory: bool | None = None,
    compute: bool | None = None,
    subject: str = "",
    at: float | None = None,
    reason: str = "",
) -> wire.ModeEnforcement:
    """One mode's line in the Device's `enforcement` (`memory`: proven, by default as `offered`;
    `compute`: by default what `proof.COMPUTE` says of the mode)."""
    return wire.ModeEnforcement(
        mode=mode.value,
        offered=offered,
        memory=offered if memory is None else memory,
        compute=proof.COMPUTE[mode] if compute is None else compute,
        subject=subject,
        proven_at=wire.timestamp(at) if at is not None else "",
        reason=reason,
    )


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


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
        for (mode_name, outcome), count in sorted((self.agent.prover.probes if self.agent.prover else {}).items()):
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
        yield from (gpus, modes, proven, probes, up, restarts, passes)
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
    prover: proof.Prover | None = None,
    health_address: tuple[str, int] | None = None,
) -> None:
    """Run the agent until cancelled (with /healthz, /readyz and /metrics on `health_address`)."""
    async with client.KubeClient.connect(kubeconfig) as api:
        agent = Agent(api, node, source, options, supervisor=supervisor, kubelet=kubelet, prover=prover)
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
