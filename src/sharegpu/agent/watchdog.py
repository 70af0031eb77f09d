"""The GPU usage watchdog's decisions: who uses which GPU memory, who breaks their grant, what to do.

Pure, no I/O. Each pass the agent's runtime reads NVML's process list, finds the pod behind each
process from its cgroup (`agent.cgroups`) and calls `assess` with the node's live pods and its Device
spec; `Watchdog.decide` turns the assessment into the `Act`s the runtime then carries out (events,
kills, evictions). What `assess` answers:

- `Usage`, per pod and GPU it runs processes on: the memory they use there and the memory the pod
  was given there (`allocated_mib`; None where it asked for no memory limit);
- `GpuTotal`, per GPU: the memory every process on it uses, split into the given pods', the node's
  own (processes in no pod: system services, the driver's persistence daemon, MPS servers; and
  those of the pods in `exempt`, the agent's own) and that of pods not given (just deleted, or
  another node's static pod), plus the SM utilisation where the caller read it;
- `Violation`s: a pod over its memory on a GPU (OVER_MEMORY), or on a GPU it was not given
  (UNALLOCATED_GPU: a CPU-only pod that sees every GPU, a sharing pod on another GPU than its own);
  only pods given to `assess` can violate. Pods with no memory limit on a GPU (they asked for compute
  only) share what no other pod was given there: where together they use more, the largest of them
  is OVER_MEMORY (`_beyond_the_rest`), so no one takes memory another pod holds;
- `Assessment.samples()`: the values of the /metrics gauges (`SERIES`).

What a pod was given on a GPU, its grant:

- A sharing pod (an allocation of shares): on each GPU index of its allocation, the memory
  `Allocation.gpu_usage` says it holds there; no limit (None) where one of its grants there has no
  memory (it asked for compute only). An index is a slot: its physical GPU is the one the
  reservation pod of that index reported (the Device's GPU of that index while none has).
- Whole GPUs from the device plugin (`nvidia.com/gpu`: whole-GPU pods, reservation pods, a group's
  holder): each GPU's whole memory, on the GPUs the kubelet says it gave the pod (`assigned`, from
  its PodResources API) or the pod reported (`sharegpu.io/gpu-uuid`). While neither is known, on
  whichever GPU it uses: the device plugin chose them, and a container sees no others.
- A member of a SharedDeviceGroup: what the group's holder pod holds (each member is limited to the
  group's share on its own, docs/groups.md). Not judged (None) while the holder is not on the node,
  nor while the groups are not known yet. A pod labelled with a group that does not exist, or whose
  namespace the group does not admit, is no member (a label proves nothing): it is judged on its own.
- A pod whose allocation annotation is malformed: not judged (None).
- Any other pod (one that asked for no GPU): nothing, 0 on every GPU.

The `Watchdog` reports every new violation, and under KILL or EVICT acts on it once; a violation
that outlives the act (the process did not die, another took its place, the eviction was refused)
is acted on again after `retry_after` passes, and one that clears and comes back is new again.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Final

from sharegpu.agent import cgroups, nvml
from sharegpu.api import cdi, names, quantity, wire
from sharegpu.api import pods as api_pods
from sharegpu.api import usage as api_usage
from sharegpu.core import errors, units


class Kind(enum.Enum):
    OVER_MEMORY = "over-memory"
    """More memory on a GPU than the pod was given there."""
    UNALLOCATED_GPU = "unallocated-gpu"
    """A GPU the pod was not given at all."""


class Action(enum.Enum):
    """What the watchdog does about a violation (the agent's `--on-violation`); every new one is
    reported whatever the action."""

    REPORT = "report"
    KILL = "kill"
    """Kill the pod's processes on the GPU: the fewest, largest first, that bring it back within its grant."""
    EVICT = "evict"

    @classmethod
    def parse(cls, text: str) -> Action:
        try:
            return cls(text.strip().lower())
        except ValueError:
            valid = ", ".join(action.value for action in cls)
            raise errors.InvalidInputError(f"--on-violation: unknown action {text!r} (valid: {valid})") from None


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> units.PodKey:
        return units.pod_key(self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class Usage:
    """What one pod's processes use on one GPU, and what the pod was given there."""

    pod: PodRef
    uuid: str
    index: int | None
    """The GPU's index in the Device; None for a GPU the Device does not list."""
    used_mib: int
    allocated_mib: int | None
    """None: no memory limit there (or the pod is not judged); 0: the GPU was not given to it."""
    processes: tuple[tuple[int, int], ...]
    """(pid, MiB), by pid."""
    sm_percent: int | None = None
    """The SM utilisation of its processes there, summed (None: the GPU takes no per-process samples,
    or none were read)."""
    share_milli: int | None = None
    """The compute the pod was given there, in milli-GPU (None: not known, or not judged)."""
    containers: tuple[api_usage.ContainerUse, ...] = ()
    """The same, per container (by name; "" for processes in the pod's own cgroup), as the node's
    GpuUsage reports it."""

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(pid for pid, _ in self.processes)


@dataclass(frozen=True, slots=True)
class GpuTotal:
    """One GPU's memory in use, by whom: `used_mib` = `pods_mib` + `node_mib` + `unknown_mib`."""

    uuid: str
    index: int | None
    memory_mib: int | None
    """Its memory, from the Device; None if the Device does not list it."""
    used_mib: int
    pods_mib: int
    """Used by processes of the given pods."""
    node_mib: int
    """Used by processes in no pod, or in an exempt one."""
    unknown_mib: int
    """Used by processes of pods that were not given."""
    sm_percent: int | None


@dataclass(frozen=True, slots=True)
class Violation:
    kind: Kind
    pod: PodRef
    uuid: str
    index: int | None
    used_mib: int
    allocated_mib: int
    """0 for UNALLOCATED_GPU."""
    pids: tuple[int, ...]
    """The pod's processes on the GPU, largest user first."""
    kill: tuple[int, ...]
    """The fewest of `pids`, from the first, whose end brings the pod back within its grant (all for
    UNALLOCATED_GPU)."""
    message: str

    @property
    def key(self) -> tuple[str, str, Kind]:
        """The same violation in successive passes has the same key."""
        return self.pod.uid, self.uuid, self.kind


@dataclass(frozen=True, slots=True)
class Series:
    """A gauge family of /metrics: its name, help and label names; a sample's value (in sharegpu's
    own unit: MiB, percent, milli-GPU) is divided by `per` for the base unit the name ends in."""

    name: str
    help: str
    labels: tuple[str, ...]
    per: float = 1
    """How many of sharegpu's unit make one of the exported unit (`core.units`)."""

    def exported(self, value: int) -> float:
        return value / self.per


POD_USED: Final = Series(
    "sharegpu_pod_gpu_memory_used_bytes", "GPU memory the processes of a pod use on a GPU",
    ("namespace", "pod", "uuid"), 1 / units.BYTES_PER_MIB,
)  # fmt: skip
POD_ALLOCATED: Final = Series(
    "sharegpu_pod_gpu_memory_allocated_bytes",
    "GPU memory a pod was given on a GPU it uses (absent where it has no memory limit)",
    ("namespace", "pod", "uuid"),
    1 / units.BYTES_PER_MIB,
)
GPU_USED: Final = Series(
    "sharegpu_gpu_memory_used_bytes", "GPU memory all processes on a GPU use, in pods or not", ("uuid", "gpu"),
    1 / units.BYTES_PER_MIB,
)  # fmt: skip
GPU_SM: Final = Series(
    "sharegpu_gpu_sm_utilization_ratio", "SM utilisation of a GPU (0 to 1)", ("uuid", "gpu"), units.PERCENT
)
POD_SM: Final = Series(
    "sharegpu_pod_gpu_sm_utilization_ratio",
    "SM utilisation of a pod's processes on a GPU, as a share of the GPU (0 to 1; absent where the GPU takes "
    "no per-process samples)",
    ("namespace", "pod", "uuid"),
    units.PERCENT,
)
POD_SHARE: Final = Series(
    "sharegpu_pod_gpu_share_gpus", "The compute a pod was given on a GPU it uses, in GPUs (0.3: 30% of it)",
    ("namespace", "pod", "uuid"), units.MILLI_PER_GPU,
)  # fmt: skip
CONTAINER_USED: Final = Series(
    "sharegpu_container_gpu_memory_used_bytes", "GPU memory the processes of a container use on a GPU",
    ("namespace", "pod", "container", "uuid"), 1 / units.BYTES_PER_MIB,
)  # fmt: skip
CONTAINER_SM: Final = Series(
    "sharegpu_container_gpu_sm_utilization_ratio",
    "SM utilisation of a container's processes on a GPU, as a share of the GPU (0 to 1)",
    ("namespace", "pod", "container", "uuid"),
    units.PERCENT,
)
SERIES: Final = (POD_USED, POD_ALLOCATED, POD_SM, POD_SHARE, CONTAINER_USED, CONTAINER_SM, GPU_USED, GPU_SM)


@dataclass(frozen=True, slots=True)
class Sample:
    """One gauge's value: label values in the order of `series.labels`."""

    series: Series
    labels: tuple[str, ...]
    value: int


@dataclass(frozen=True, slots=True)
class Assessment:
    usages: tuple[Usage, ...]
    """By pod, then GPU index."""
    gpus: tuple[GpuTotal, ...]
    """Every GPU of the Device and every other GPU a process runs on, by index."""
    violations: tuple[Violation, ...]
    """In the order of `usages`."""

    def samples(self) -> list[Sample]:
        """The gauges' values for this pass; a label set absent from them is stale (its pod or GPU is gone)."""
        out: list[Sample] = []
        for usage in self.usages:
            labels = (usage.pod.namespace, usage.pod.name, usage.uuid)
            out.append(Sample(POD_USED, labels, usage.used_mib))
            if usage.allocated_mib is not None:
                out.append(Sample(POD_ALLOCATED, labels, usage.allocated_mib))
            if usage.sm_percent is not None:
                out.append(Sample(POD_SM, labels, usage.sm_percent))
            if usage.share_milli is not None:
                out.append(Sample(POD_SHARE, labels, usage.share_milli))
            for container in usage.containers:
                where = (usage.pod.namespace, usage.pod.name, container.name, usage.uuid)
                out.append(Sample(CONTAINER_USED, where, container.used_mib))
                if container.sm_percent is not None:
                    out.append(Sample(CONTAINER_SM, where, container.sm_percent))
        for gpu in self.gpus:
            gpu_labels = (gpu.uuid, "" if gpu.index is None else str(gpu.index))
            out.append(Sample(GPU_USED, gpu_labels, gpu.used_mib))
            if gpu.sm_percent is not None:
                out.append(Sample(GPU_SM, gpu_labels, gpu.sm_percent))
        return out


def assess(
    processes: Sequence[nvml.GpuProcess],
    owner: Callable[[int], cgroups.Owner | None],
    pods: Mapping[str, wire.Pod],
    device: wire.DeviceSpec,
    *,
    assigned: Mapping[str, Collection[str]] | None = None,
    exempt: Set[str] = frozenset(),
    slack_mib: int = 0,
    utilization: Sequence[nvml.Utilization] = (),
    groups: Mapping[tuple[str, str], Collection[str]] | None = None,
    claims: Mapping[tuple[str, str], cdi.PreparedClaim] | None = None,
) -> Assessment:
    """One pass's `Assessment` (see the module docstring).

    `owner`: pid -> the pod and container it runs in (asked once per pid); `pods`: the node's live
    pods by UID; `assigned`: `namespace/name` -> the GPU UUIDs the kubelet gave the pod through the
    device plugin, where known; `exempt`: UIDs of pods whose processes count as the node's own (the
    agent's: its MPS servers); `slack_mib`: how far a pod may exceed its memory before it violates
    (NVML counts each process's CUDA context, which a limit enforced inside the process may not);
    `utilization`: each GPU's SM utilisation, as a whole and per process, where read (a pod's is its
    processes' sum; a process a GPU's samples do not name used none there); `groups`: the SharedDeviceGroups that exist,
    (namespace, name) -> the namespaces whose pods may join it (its own included), None while not
    known (then no pod labelled with a group is judged); `claims`: the ResourceClaims prepared on this
    node by sharegpu's DRA plugin, (namespace, name) -> what each holds, None where the node serves no
    DRA plugin or has not read them yet (then no pod that uses a claim is judged).
    """
    index_of = {gpu.uuid: gpu.index for gpu in device.gpus}
    grants = _Grants(pods, device, assigned or {}, groups, claims)
    owners: dict[int, cgroups.Owner | None] = {}
    tallies: dict[str, list[int]] = {gpu.uuid: [0, 0, 0] for gpu in device.gpus}
    by_pod: dict[tuple[str, str], dict[int, int]] = {}
    for process in processes:
        if process.pid not in owners:
            owners[process.pid] = owner(process.pid)
        found = owners[process.pid]
        tally = tallies.setdefault(process.uuid, [0, 0, 0])
        if found is None or found.pod_uid in exempt:
            tally[1] += process.used_mib
        elif found.pod_uid not in pods:
            tally[2] += process.used_mib
        else:
            tally[0] += process.used_mib
            used = by_pod.setdefault((found.pod_uid, process.uuid), {})
            used[process.pid] = used.get(process.pid, 0) + process.used_mib

    sampled = {u.uuid: dict(u.processes) for u in utilization if u.processes is not None}
    usages = []
    for (uid, uuid), used in by_pod.items():
        pod = pods[uid]
        meta = pod.metadata
        grant = grants.of(uid)
        samples = sampled.get(uuid)
        usages.append(
            Usage(
                pod=PodRef(meta.namespace, meta.name, uid), uuid=uuid, index=index_of.get(uuid),
                used_mib=sum(used.values()), allocated_mib=grant.allocated(uuid, grants.capacity),
                processes=tuple(sorted(used.items())),
                sm_percent=None if samples is None else sum(samples.get(pid, 0) for pid in used),
                share_milli=grant.milli.get(uuid) if grant.judged else None,
                containers=_containers(pod, used, owners, samples),
            )
        )  # fmt: skip
    usages.sort(key=lambda u: (u.pod.namespace, u.pod.name, u.pod.uid, _gpu_order(u.index, u.uuid)))
    pooled, shared = _shared_claims(usages, grants, slack_mib)
    alone = (_violation(u, slack_mib) for u in usages if (u.pod.uid, u.uuid) not in pooled)
    violations = [v for v in alone if v is not None] + shared
    given = _promised(grants, pods, claims, unlimited=False)
    violations += _beyond_the_rest(usages, grants, given, {uuid: t[1] + t[2] for uuid, t in tallies.items()}, slack_mib)
    sm = {u.uuid: u.sm_percent for u in utilization if u.sm_percent is not None}
    gpus = sorted(
        (
            GpuTotal(
                uuid=uuid, index=index_of.get(uuid), memory_mib=grants.capacity.get(uuid), used_mib=sum(tally),
                pods_mib=tally[0], node_mib=tally[1], unknown_mib=tally[2], sm_percent=sm.get(uuid),
            )
            for uuid, tally in tallies.items()
        ),
        key=lambda g: _gpu_order(g.index, g.uuid),
    )  # fmt: skip
    return Assessment(tuple(usages), tuple(gpus), tuple(violations))


def _containers(
    pod: wire.Pod,
    used: Mapping[int, int],
    owners: Mapping[int, cgroups.Owner | None],
    samples: Mapping[int, int] | None,
) -> tuple[api_usage.ContainerUse, ...]:
    """A pod's use of one GPU per container, by name: a process's container is the one whose runtime
    id its cgroup names ("" for the pod's own cgroup, or a container the kubelet has not reported)."""
    named = {
        status.container_id.partition("://")[2]: status.name
        for status in (*pod.status.init_container_statuses, *pod.status.container_statuses)
        if status.container_id
    }
    tally: dict[str, list[int]] = {}
    for pid, mib in used.items():
        owner = owners.get(pid)
        name = named.get(owner.container_id or "", "") if owner is not None else ""
        found = tally.setdefault(name, [0, 0])
        found[0] += mib
        found[1] += samples.get(pid, 0) if samples is not None else 0
    return tuple(
        api_usage.ContainerUse(name=name, used_mib=mib, sm_percent=None if samples is None else sm)
        for name, (mib, sm) in sorted(tally.items())
    )


def _shared_claims(
    usages: Sequence[Usage], grants: _Grants, slack_mib: int
) -> tuple[set[tuple[str, str]], list[Violation]]:
    """The pods that use a ResourceClaim together with another pod on a GPU, judged together: a claim
    is one share however many pods use it (`api.lifetimes`), so their memory there is summed against
    what their claims hold there, each counted once (pods linked through any shared claim form one
    pool). Returns the (pod UID, UUID) pairs judged so, and their violations: one per pod whose
    processes are among the largest of the pool that, killed, bring it back within (an eviction of
    those pods does the same)."""
    on_gpu: dict[str, list[Usage]] = {}
    for usage in usages:
        grant = grants.of(usage.pod.uid)
        if grant.by_claims and grant.claimed.get(usage.uuid):
            on_gpu.setdefault(usage.uuid, []).append(usage)
    pooled: set[tuple[str, str]] = set()
    violations: list[Violation] = []
    for uuid, members in on_gpu.items():
        claimed = {u.pod.uid: grants.of(u.pod.uid).claimed[uuid] for u in members}
        for pool in _linked(members, claimed):
            if len(pool) < 2:
                continue
            pooled.update((u.pod.uid, uuid) for u in pool)
            keys = sorted(set().union(*(claimed[u.pod.uid] for u in pool)))
            held = [grants.claims[k].gpus.get(uuid) for k in keys] if grants.claims is not None else [None]
            if any(mib is None for mib in held):
                continue  # a claim without a memory limit there
            allocated = sum(mib or 0 for mib in held)
            used = sum(u.used_mib for u in pool)
            if used <= allocated + slack_mib:
                continue
            largest = sorted(((mib, pid, u) for u in pool for pid, mib in u.processes), key=lambda p: (-p[0], p[1]))
            kill: dict[str, list[int]] = {}
            left = used
            for mib, pid, usage in largest:
                if left <= allocated + slack_mib:
                    break
                kill.setdefault(usage.pod.uid, []).append(pid)
                left -= mib
            gpu = _gpu_words(uuid, pool[0].index)
            claims = ", ".join(f"{ns}/{name}" for ns, name in keys)
            who = ", ".join(u.pod.key for u in pool)
            message = f"pods {who} use {used} MiB of {gpu} together; their claim(s) {claims} hold {allocated} MiB"
            for usage in pool:
                if usage.pod.uid in kill:
                    pids = tuple(pid for pid, _ in sorted(usage.processes, key=lambda p: (-p[1], p[0])))
                    violations.append(Violation(Kind.OVER_MEMORY, usage.pod, uuid, usage.index, usage.used_mib,
                                                allocated, pids, tuple(kill[usage.pod.uid]), message))  # fmt: skip
    return pooled, violations


def _linked(members: Sequence[Usage], keys: Mapping[str, frozenset[tuple[str, str]]]) -> list[list[Usage]]:
    """`members` grouped so that two whose pods (`keys`: by UID) share a claim are in one group."""
    groups: list[tuple[set[tuple[str, str]], list[Usage]]] = []
    for member in members:
        mine = set(keys[member.pod.uid])
        joined = [g for g in groups if g[0] & mine]
        merged = (mine.union(*(g[0] for g in joined)), [u for g in joined for u in g[1]] + [member])
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    return [sorted(g[1], key=lambda u: (u.pod.namespace, u.pod.name, u.pod.uid)) for g in groups]


def _gpu_order(index: int | None, uuid: str) -> tuple[bool, int, str]:
    return index is None, index or 0, uuid


def _violation(usage: Usage, slack_mib: int) -> Violation | None:
    allocated = usage.allocated_mib
    if allocated is None:
        return None
    pod, used = usage.pod, usage.used_mib
    gpu = _gpu_words(usage.uuid, usage.index)
    if allocated == 0:
        pids, _ = _fewest(usage, 0)
        message = f"pod {pod.key} uses {gpu}, which sharegpu did not give it ({used} MiB)"
        return Violation(Kind.UNALLOCATED_GPU, pod, usage.uuid, usage.index, used, 0, pids, pids, message)
    if used <= allocated + slack_mib:
        return None
    pids, kill = _fewest(usage, allocated + slack_mib)
    message = f"pod {pod.key} uses {used} MiB of {gpu}; it was allocated {allocated} MiB"
    return Violation(Kind.OVER_MEMORY, pod, usage.uuid, usage.index, used, allocated, pids, kill, message)


def promised(
    pods: Mapping[str, wire.Pod],
    device: wire.DeviceSpec,
    claims: Mapping[tuple[str, str], cdi.PreparedClaim] | None = None,
    *,
    assigned: Mapping[str, Collection[str]] | None = None,
) -> dict[str, int]:
    """GPU UUID -> MiB of it the node's live pods (by UID) and prepared claims were promised: their
    grants, a grant with no memory limit or a whole GPU counting all of it. Reservation pods count
    nothing (the sharing pods on their GPU do), a group's members nothing (their holder does), a pod
    whose grant cannot be told nothing; a claim counts once, whether no pod, one or several use it
    (and a pod that uses claims, nothing more). A whole-GPU pod counts on the GPUs the kubelet gave it
    (`assigned`: "namespace/pod" -> UUIDs) or it reported; on every GPU where neither is known."""
    grants = _Grants(pods, device, assigned or {}, claims=claims)
    return _promised(grants, pods, claims, unlimited=True)


def _promised(
    grants: _Grants,
    pods: Mapping[str, wire.Pod],
    claims: Mapping[tuple[str, str], cdi.PreparedClaim] | None,
    *,
    unlimited: bool,
) -> dict[str, int]:
    """`promised`'s sum over `grants`; a grant with no memory limit counts all of the GPU where
    `unlimited`, nothing otherwise (what the pods with a limit were given)."""
    out = dict.fromkeys(grants.capacity, 0)
    for claim in (claims or {}).values():
        for uuid, mib in claim.gpus.items():
            if uuid in out:
                out[uuid] += (grants.capacity[uuid] if unlimited else 0) if mib is None else mib
    for uid, pod in pods.items():
        labels = pod.metadata.labels
        if api_pods.is_reservation(pod) or (api_pods.role(pod) is None and _group(labels) is not None):
            continue
        grant = grants.of(uid)
        if not grant.judged or grant.by_claims:
            continue
        for uuid, capacity in grants.capacity.items():
            given = grant.allocated(uuid, grants.capacity)
            out[uuid] += (capacity if unlimited else 0) if given is None else given
    return {uuid: min(mib, grants.capacity[uuid]) for uuid, mib in out.items()}


def _beyond_the_rest(
    usages: Sequence[Usage], grants: _Grants, given: Mapping[str, int], taken: Mapping[str, int], slack_mib: int
) -> list[Violation]:
    """The pods with no memory limit on a GPU (they asked for compute only) share what no other pod
    was given there: its memory less the grants with a limit (`given`) and what processes in no judged
    pod use (`taken`: the node's own, pods not given). Where together they use more, the largest of
    them is over: it takes memory another pod was given (its processes, largest first, until the rest
    fit). One a pass: the next pass judges the others anew."""
    unlimited: dict[str, list[Usage]] = {}
    for usage in usages:
        if usage.allocated_mib is None and grants.of(usage.pod.uid).judged:
            unlimited.setdefault(usage.uuid, []).append(usage)
    found = []
    for uuid, users in unlimited.items():
        capacity = grants.capacity.get(uuid)
        if capacity is None:
            continue
        rest = max(0, capacity - given.get(uuid, 0) - taken.get(uuid, 0))
        together = sum(u.used_mib for u in users)
        if together <= rest + slack_mib:
            continue
        largest = max(users, key=lambda u: (u.used_mib, u.pod.key))
        allowed = max(0, rest - (together - largest.used_mib))
        pids, kill = _fewest(largest, allowed + slack_mib)
        message = (
            f"pod {largest.pod.key} uses {largest.used_mib} MiB of {_gpu_words(uuid, largest.index)}; it asked for "
            f"no fixed memory, and the pods with none there use {together} MiB together, where {rest} MiB are not "
            "given to other pods"
        )
        found.append(Violation(Kind.OVER_MEMORY, largest.pod, uuid, largest.index, largest.used_mib, allowed, pids,
                               kill, message))  # fmt: skip
    return found


def _fewest(usage: Usage, within: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The pod's processes on the GPU, largest user first, and the fewest of them, from the first,
    whose end brings its use to `within` MiB."""
    largest = sorted(usage.processes, key=lambda p: (-p[1], p[0]))
    kill: list[int] = []
    left = usage.used_mib
    for pid, mib in largest:
        if left <= within:
            break
        kill.append(pid)
        left -= mib
    return tuple(pid for pid, _ in largest), tuple(kill)


def _gpu_words(uuid: str, index: int | None) -> str:
    return f"GPU {uuid}" + ("" if index is None else f" (index {index})")


def slots(pods: Mapping[str, wire.Pod], device: wire.DeviceSpec) -> dict[int, frozenset[str]]:
    """GPU index (a slot of the allocations) -> the UUIDs of the physical GPUs it stands for: those its
    reservation pods reported, else the Device's GPU of that index (as `promised` counts them)."""
    grants = _Grants(pods, device, {})
    indexes = set(grants.by_index) | set(grants.reserved)
    return {i: frozenset(grants.slot(i)) for i in indexes}


@dataclass(frozen=True, slots=True)
class _Grant:
    """What one pod was given: memory per GPU UUID (None: no limit there); `unnamed`: whole GPUs
    whose UUIDs are not known, so any GPU it uses counts as one; `judged`: False for a pod whose
    grant cannot be told."""

    memory: Mapping[str, int | None]
    unnamed: bool = False
    judged: bool = True
    milli: Mapping[str, int] = field(default_factory=dict)
    """GPU UUID -> the compute given there, in milli-GPU (whole GPUs: 1000), where known."""
    by_claims: bool = False
    """What the ResourceClaims it uses hold (counted once per claim by `promised`)."""
    claimed: Mapping[str, frozenset[tuple[str, str]]] = field(default_factory=dict)
    """GPU UUID -> the claims it uses that hold memory there, (namespace, name)."""

    def allocated(self, uuid: str, capacity: Mapping[str, int]) -> int | None:
        if not self.judged:
            return None
        if uuid in self.memory:
            return self.memory[uuid]
        return capacity.get(uuid) if self.unnamed else 0


_UNJUDGED: Final = _Grant({}, judged=False)


class _Grants:
    """The grants of the node's pods (module docstring), each worked out when first asked for."""

    def __init__(
        self,
        pods: Mapping[str, wire.Pod],
        device: wire.DeviceSpec,
        assigned: Mapping[str, Collection[str]],
        groups: Mapping[tuple[str, str], Collection[str]] | None = None,
        claims: Mapping[tuple[str, str], cdi.PreparedClaim] | None = None,
    ) -> None:
        self.pods = pods
        self.assigned = assigned
        self.groups = groups
        self.claims = claims
        self.capacity = {gpu.uuid: gpu.memory_mib for gpu in device.gpus}
        self.by_index = {gpu.index: gpu.uuid for gpu in device.gpus}
        self.reserved: dict[int, set[str]] = {}
        """GPU index -> the UUIDs its reservation pods hold."""
        self.holders: dict[tuple[str, str], str] = {}
        """(namespace, name) of a SharedDeviceGroup -> the UID of its holder pod."""
        for uid, pod in pods.items():
            labels = pod.metadata.labels
            if api_pods.is_reservation(pod):
                with contextlib.suppress(ValueError):
                    self.reserved.setdefault(int(labels.get(names.LABEL_SLOT, "")), set()).update(self._named(pod))
            elif api_pods.role(pod) == names.ROLE_GROUP_HOLDER and (group := _group(labels)) is not None:
                self.holders[group] = uid
        self.grants: dict[str, _Grant] = {}

    def of(self, uid: str) -> _Grant:
        found = self.grants.get(uid)
        if found is None:
            found = self.grants[uid] = self._grant(self.pods[uid])
        return found

    def _grant(self, pod: wire.Pod) -> _Grant:
        labels = pod.metadata.labels
        group = _group(labels)
        if api_pods.role(pod) is None and group is not None:
            if self.groups is None:
                return _UNJUDGED
            if pod.metadata.namespace in self.groups.get(group, ()):
                holder = self.holders.get(group)
                return _UNJUDGED if holder is None else self.of(holder)
        try:
            alloc = api_pods.allocation_of(pod)
        except errors.InvalidInputError:
            return _UNJUDGED
        memory: dict[str, int | None] = {}
        milli: dict[str, int] = {}
        whole = _device_plugin_gpus(pod)
        if alloc is None and not whole and pod.spec.resource_claims:
            return self._claimed(pod)
        if alloc is not None and alloc.exclusive:
            whole = True
        elif alloc is not None:
            for index, (share, mib) in alloc.gpu_usage().items():
                limited = all(g.memory_mib for c in alloc.containers for g in c.devices if g.index == index)
                slot = self.slot(index)
                memory.update(dict.fromkeys(slot, mib if limited else None))
                milli.update(dict.fromkeys(slot, share))
        if not whole:
            return self._known(_Grant(memory, milli=milli))
        named = self._named(pod)
        memory.update({uuid: self.capacity.get(uuid) for uuid in named})
        milli.update(dict.fromkeys(named, units.MILLI_PER_GPU))
        return self._known(_Grant(memory, unnamed=not named, milli=milli))

    def _known(self, grant: _Grant) -> _Grant:
        """A grant that names a device the Device does not list (a MIG device, a time-sliced replica:
        NVML tells their processes by the whole GPU's UUID) cannot be matched to what NVML shows:
        not judged (an intruder there would otherwise be a legitimate pod)."""
        return grant if grant.memory.keys() <= self.capacity.keys() else _UNJUDGED

    def slot(self, index: int) -> set[str]:
        """The UUIDs GPU index `index` of the allocations stands for: what its reservation pods reported,
        else the Device's GPU of that index (none where neither is known)."""
        return self.reserved.get(index) or ({self.by_index[index]} if index in self.by_index else set())

    def _claimed(self, pod: wire.Pod) -> _Grant:
        """What the claims a pod uses hold, summed per GPU; not judged while any of them is unknown
        here (not made yet, not prepared yet, another driver's, or the plugin not read yet)."""
        if self.claims is None:
            return _UNJUDGED
        memory: dict[str, int | None] = {}
        milli: dict[str, int] = {}
        claimed: dict[str, set[tuple[str, str]]] = {}
        for ref in api_pods.claim_refs(pod):
            key = (pod.metadata.namespace, ref.claim)
            found = self.claims.get(key) if ref.claim else None
            if found is None:
                return _UNJUDGED
            for uuid, mib in found.gpus.items():
                if uuid in claimed and key in claimed[uuid]:
                    continue  # named twice in the pod: counted once
                claimed.setdefault(uuid, set()).add(key)
                memory[uuid] = cdi.summed(memory.get(uuid, 0), mib)
                if uuid in found.milli:
                    milli[uuid] = milli.get(uuid, 0) + found.milli[uuid]
        return _Grant(memory, by_claims=True, claimed={u: frozenset(k) for u, k in claimed.items()}, milli=milli)

    def _named(self, pod: wire.Pod) -> set[str]:
        """The UUIDs of the device plugin's GPUs known to be the pod's: the kubelet's word and the pod's report."""
        meta = pod.metadata
        reported = {u.strip() for u in meta.annotations.get(names.GPU_UUID, "").split(",") if u.strip()}
        return reported | set(self.assigned.get(units.pod_key(meta.namespace, meta.name), ()))


def _group(labels: Mapping[str, str]) -> tuple[str, str] | None:
    namespace, name = labels.get(names.LABEL_GROUP_NAMESPACE), labels.get(names.LABEL_GROUP_NAME)
    return None if namespace is None or name is None else (namespace, name)


def _device_plugin_gpus(pod: wire.Pod) -> bool:
    """Whether a container of the pod asks the device plugin for whole GPUs (`nvidia.com/gpu`)."""
    for _, container in api_pods.containers(pod):
        value = container.resources.merged().get(names.NVIDIA_GPU)
        if value is not None:
            with contextlib.suppress(errors.InvalidInputError):
                if quantity.integer(value, names.NVIDIA_GPU, 0, units.MAX_GPUS_PER_NODE) > 0:
                    return True
    return False


@dataclass(frozen=True, slots=True)
class Act:
    """One thing the runtime is to do about a violation."""

    what: Action
    violation: Violation
    pids: tuple[int, ...] = ()
    """KILL: the processes to kill (read this pass: the runtime checks each one's owner again first)."""
    pod: PodRef | None = None
    """EVICT: the pod to evict."""
    repeat: bool = False
    """The violation outlived an earlier act on it."""


class Watchdog:
    """Turns successive assessments into acts: each violation is reported when it appears and acted
    on once, again every `retry_after` passes while it lasts, and as new after it clears. A pod is
    evicted at most once per `retry_after` passes, however many GPUs it violates on."""

    def __init__(self, retry_after: int = 3) -> None:
        if retry_after < 1:
            raise errors.InvalidInputError(f"retry_after must be at least 1 pass, got {retry_after}")
        self.retry_after = retry_after
        self.passes = 0
        self.acted: dict[tuple[str, str, Kind], int] = {}
        """The ongoing violations, by key -> the pass they were last acted on."""
        self.evicted: dict[str, int] = {}
        """UID of a violating pod -> the pass it was last evicted in."""

    def decide(self, assessment: Assessment, action: Action) -> list[Act]:
        self.passes += 1
        now = self.passes
        current = {v.key: v for v in assessment.violations}
        violating = {v.pod.uid for v in assessment.violations}
        self.acted = {key: at for key, at in self.acted.items() if key in current}
        self.evicted = {uid: at for uid, at in self.evicted.items() if uid in violating}
        acts: list[Act] = []
        for key, violation in current.items():
            last = self.acted.get(key)
            if last is None:
                acts.append(Act(Action.REPORT, violation))
            elif action is Action.REPORT or now - last < self.retry_after:
                continue
            self.acted[key] = now
            repeat = last is not None
            if action is Action.KILL:
                acts.append(Act(Action.KILL, violation, pids=violation.kill, repeat=repeat))
            elif action is Action.EVICT and self._may_evict(violation.pod.uid, now):
                self.evicted[violation.pod.uid] = now
                acts.append(Act(Action.EVICT, violation, pod=violation.pod, repeat=repeat))
        return acts

    def _may_evict(self, uid: str, now: int) -> bool:
        last = self.evicted.get(uid)
        return last is None or now - last >= self.retry_after
