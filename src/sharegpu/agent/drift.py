"""Drift between the GPUs the kubelet really gave each container and what the API records: pure, no I/O.

The kubelet's PodResources `List` (`agent.podresources.Assigned`) is the ground truth of which
devices each container got. The API records two things that can disagree with it: the UUID a
reservation pod reported (annotation `sharegpu.io/gpu-uuid`, which the pods sharing that GPU are
told) and the GPUs the extender chose for a whole-GPU pod (by index, in its allocation annotation;
the device plugin may give others). `check` compares one pass's three snapshots, `repairs` says
what the agent mends by itself, and `DriftTracker` says which disagreements are news; the runtime
calls the kubelet, records the events and sends the patches.

Device IDs. Only `nvidia.com/gpu` counts. The NVIDIA device plugin names a device by its GPU UUID,
or by its index with DEVICE_ID_STRATEGY=index. An ID that is the UUID of a GPU of the node's Device
stays; one that is an index becomes the UUID of the GPU NVML numbers so now, as the device plugin
does (the Device keeps a GPU's index when NVML renumbers the GPUs behind one that fell off the bus;
the device plugin does not, so an index ID is read by NVML's numbering, where the runtime gives it,
else by the Device's); any other (a MIG-... device, a GPU the Device does not list) is kept as it
is and flagged.

Pods. `pods` maps `namespace/name` (the key the agent's pod informer keeps, `wire.key`) to the
node's pods, because the kubelet names pods by namespace and name, not by UID. Only Running pods
not being deleted are compared: a finished pod holds nothing, and before it runs or while it goes,
a pod may share its name with a predecessor the kubelet still lists.

Rules, one `Mismatch` per container:

- RESERVATION_UUID: a reservation pod (`api.pods.is_reservation`) that the kubelet lists with GPUs
  reported UUIDs other than those of its `reserve` container, or none yet. Repaired by writing the
  kubelet's UUID into the annotation, but only where every ID is a GPU of the Device (the annotation
  promises a GPU UUID; an unknown ID is only reported).
- WHOLE_GPU: any other pod with a valid allocation annotation that gives whole GPUs
  (`Allocation.exclusive`), which the kubelet lists with GPUs: for each app container that asks for
  `nvidia.com/gpu` and each container the kubelet lists, the UUIDs of the GPU indexes the allocation
  names (through the Device; an index it lacks reads "index N") differ, as a set, from the kubelet's,
  counts included. Only reported: the allocation is the extender's record. A pod without an
  allocation was not placed by sharegpu, and a malformed one is the extender's reconcilers' to mend:
  nothing to compare.
- UNKNOWN_DEVICE: the kubelet gave any container of any pod (whether the API shows the pod or not)
  IDs that map to no GPU of the Device.
- MISSING: a reservation pod, or a whole-GPU pod as above, for which the kubelet lists no
  `nvidia.com/gpu` at all, for each container that should hold GPUs. The kubelet allocates a pod's
  devices before its containers start, so a Running pod it does not list is drift; but the pods and
  the kubelet's list are read at different moments, and a pod that began just after the kubelet
  answered would look missing. So MISSING needs evidence: the kubelet lists the pod with other
  devices (it knows the pod and gave it no GPU), or the pod was created at least `grace` seconds
  before `now` (a pod without a readable creation time has only the first). Reading the pods
  before asking the kubelet leaves only pods that end in between, which clear on the next pass.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sharegpu.agent.podresources import Assigned
from sharegpu.api import names, paths, quantity, wire
from sharegpu.api import pods as api_pods
from sharegpu.core import errors, units


class Kind(enum.Enum):
    """What disagrees; the value is the metric label."""

    RESERVATION_UUID = "reservation_uuid"
    WHOLE_GPU = "whole_gpu"
    UNKNOWN_DEVICE = "unknown_device"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One container whose GPUs the API records otherwise than the kubelet gave them."""

    kind: Kind
    pod: units.PodKey
    container: str
    api: tuple[str, ...]
    """What the API says the container holds (UUIDs, sorted; empty: nothing recorded). For
    UNKNOWN_DEVICE: empty, the Device names none of them."""
    kubelet: tuple[str, ...]
    """What the kubelet gave it (UUIDs, sorted; IDs the Device does not know kept as they are)."""
    known: bool = True
    """Every ID the kubelet gave the container maps to a GPU of the Device."""

    @property
    def message(self) -> str:
        """The mismatch in a sentence for a person (an event's message, a log line)."""
        api, kubelet = ", ".join(self.api), ", ".join(self.kubelet)
        match self.kind:
            case Kind.RESERVATION_UUID:
                said = f"reported {api}" if self.api else "has not reported its GPU yet"
                tail = "" if self.known else " (not repaired: the node's Device does not list it)"
                return f"reservation pod {self.pod} {said} but the kubelet gave it {kubelet}{tail}"
            case Kind.WHOLE_GPU:
                counts = len(self.api), len(self.kubelet)
                count = f" ({counts[0]} allocated, {counts[1]} given)" if counts[0] != counts[1] else ""
                return (
                    f"pod {self.pod} container {self.container}: the extender allocated {api or 'no GPU'}"
                    f" but the kubelet gave it {kubelet or 'none'}{count}"
                )
            case Kind.UNKNOWN_DEVICE:
                return (
                    f"the kubelet gave pod {self.pod} container {self.container} {kubelet},"
                    " which the node's Device does not list as a GPU (a MIG device, or a GPU the agent has not seen)"
                )
            case Kind.MISSING:
                holds = api or "GPUs"
                return (
                    f"pod {self.pod} container {self.container} holds {holds} according to the API,"
                    f" but the kubelet lists no {names.NVIDIA_GPU} for the pod"
                )


@dataclass(frozen=True, slots=True)
class Repair:
    """A patch that mends a reservation pod's reported UUID: send `body` to `path`."""

    pod: units.PodKey
    path: str
    uuid: str
    """The truth written (several GPUs: comma-separated, as `sharegpu reserve` writes them)."""

    @property
    def body(self) -> dict[str, Any]:
        return {"metadata": {"annotations": {names.GPU_UUID: self.uuid}}}


def check(
    assigned: Sequence[Assigned],
    pods: Mapping[str, wire.Pod],
    spec: wire.DeviceSpec,
    *,
    now: float,
    grace: float,
    ids: DeviceIds | None = None,
) -> list[Mismatch]:
    """Every mismatch of one pass (see the module docstring), sorted by pod, container and kind.
    `pods`: by `namespace/name`; `now`: seconds since the epoch; `grace`: seconds (MISSING); `ids`:
    how the device plugin's IDs read (the Device's own numbering where not given)."""
    ids = ids if ids is not None else DeviceIds(spec)
    given: dict[units.PodKey, dict[str, tuple[tuple[str, ...], bool]]] = {}
    listed: set[units.PodKey] = set()
    found: list[Mismatch] = []
    for entry in assigned:
        pod = units.pod_key(entry.namespace, entry.pod)
        listed.add(pod)
        if entry.resource != names.NVIDIA_GPU:
            continue
        uuids, unknown = ids.resolve(entry.device_ids)
        given.setdefault(pod, {})[entry.container] = (uuids, not unknown)
        if unknown:
            found.append(Mismatch(Kind.UNKNOWN_DEVICE, pod, entry.container, (), unknown, known=False))
    for text_key, pod_object in pods.items():
        meta = pod_object.metadata
        if pod_object.status.phase != "Running" or meta.deletion_timestamp is not None:
            continue
        pod = units.PodKey(text_key)
        record = _record(pod_object, ids)
        if record is None:
            continue
        containers = given.get(pod)
        if containers is None:
            if pod in listed or _older(meta.creation_timestamp, now, grace):
                found += [Mismatch(Kind.MISSING, pod, c, record.says(c), ()) for c in record.holders]
            continue
        compared = record.holders if record.kind is Kind.RESERVATION_UUID else {*record.holders, *containers}
        for container in sorted(compared):
            api = record.says(container)
            truth, known = containers.get(container, ((), True))
            if set(api) != set(truth):
                found.append(Mismatch(record.kind, pod, container, api, truth, known))
    return sorted(found, key=_order)


def repairs(mismatches: Iterable[Mismatch]) -> list[Repair]:
    """The patches that mend what the agent may mend: a reservation pod's reported UUID, where the
    kubelet gave it GPUs that the Device lists. Nothing else is rewritten."""
    out: list[Repair] = []
    for mismatch in mismatches:
        if mismatch.kind is Kind.RESERVATION_UUID and mismatch.known and mismatch.kubelet:
            namespace, name = mismatch.pod.split("/", 1)
            out.append(Repair(mismatch.pod, paths.pod(namespace, name), ",".join(mismatch.kubelet)))
    return out


@dataclass(frozen=True, slots=True)
class Changes:
    """What one pass changed: mismatches to report now, and those that ended."""

    new: tuple[Mismatch, ...]
    cleared: tuple[Mismatch, ...]


class DriftTracker:
    """Remembers the mismatches of the last pass so that each is reported once while it lasts (and
    again if it ends and comes back), and keeps the figures for the metrics. A mismatch is the same
    while its kind, pod, container and both sides are: a new wrong value is news."""

    def __init__(self) -> None:
        self.current: frozenset[Mismatch] = frozenset()
        self.repairs_done = 0
        """Repairs sent successfully (a counter's value)."""

    def observe(self, mismatches: Iterable[Mismatch]) -> Changes:
        """Take one pass's mismatches; what is news and what ended since the pass before."""
        now = list(dict.fromkeys(mismatches))
        before = self.current
        self.current = frozenset(now)
        return Changes(
            new=tuple(m for m in now if m not in before),
            cleared=tuple(sorted(before - self.current, key=_order)),
        )

    def repaired(self, done: Sequence[Repair]) -> None:
        """Count the repairs the caller has sent successfully."""
        self.repairs_done += len(done)

    def counts(self) -> dict[Kind, int]:
        """Current mismatches by kind, every kind present (gauge values)."""
        found = Counter(m.kind for m in self.current)
        return {kind: found[kind] for kind in Kind}


class DeviceIds:
    """The node's Device as a translator of the device plugin's IDs (UUIDs, or indexes with
    DEVICE_ID_STRATEGY=index): what the drift check, the watchdog and the allocatable comparison read
    the kubelet's answers through."""

    def __init__(self, spec: wire.DeviceSpec, numbering: Mapping[int, str] | None = None) -> None:
        """`numbering`: NVML's index -> UUID now (what the device plugin's index IDs mean); the Device's
        indexes where not given."""
        self.uuids = {g.uuid for g in spec.gpus}
        self.by_index = {g.index: g.uuid for g in spec.gpus}
        current = numbering if numbering is not None else self.by_index
        self.by_text = {str(index): uuid for index, uuid in current.items() if uuid in self.uuids}

    def resolve(self, device_ids: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(every ID as a UUID where the Device knows it, kept otherwise; the IDs it does not know)."""
        uuids: set[str] = set()
        unknown: set[str] = set()
        for device in device_ids:
            if device in self.uuids:
                uuids.add(device)
            elif device in self.by_text:
                uuids.add(self.by_text[device])
            else:
                uuids.add(device)
                unknown.add(device)
        return tuple(sorted(uuids)), tuple(sorted(unknown))

    def of_index(self, index: int) -> str:
        return self.by_index.get(index, f"index {index}")


@dataclass(frozen=True, slots=True)
class _Record:
    """What the API says about a pod that holds GPUs through the kubelet."""

    kind: Kind
    """How a disagreement about it reads: RESERVATION_UUID or WHOLE_GPU."""
    holders: tuple[str, ...]
    """The containers that must hold GPUs: a reservation's `reserve`, a whole-GPU pod's app
    containers that ask for `nvidia.com/gpu`."""
    recorded: Mapping[str, tuple[str, ...]]
    """The UUIDs the API gives each container (sorted)."""

    def says(self, container: str) -> tuple[str, ...]:
        return self.recorded.get(container, ())


def _record(pod: wire.Pod, ids: DeviceIds) -> _Record | None:
    """The pod's record; None for a pod that holds no GPU through the kubelet by sharegpu's account
    (or whose allocation cannot be read: the extender's reconcilers deal with it)."""
    if api_pods.is_reservation(pod):
        reported = pod.metadata.annotations.get(names.GPU_UUID, "")
        uuids = tuple(sorted({u.strip() for u in reported.split(",") if u.strip()}))
        return _Record(Kind.RESERVATION_UUID, (api_pods.RESERVE_CONTAINER,), {api_pods.RESERVE_CONTAINER: uuids})
    try:
        alloc = api_pods.allocation_of(pod)
    except errors.InvalidInputError:
        return None
    holders = tuple(c.name for c in pod.spec.containers if _asks_gpus(c))
    if alloc is None or not alloc.exclusive or not holders:
        return None
    recorded = {c.name: tuple(sorted({ids.of_index(d.index) for d in c.devices})) for c in alloc.containers}
    return _Record(Kind.WHOLE_GPU, holders, recorded)


_KINDS = {kind: i for i, kind in enumerate(Kind)}


def _order(mismatch: Mismatch) -> tuple[str, str, int]:
    return mismatch.pod, mismatch.container, _KINDS[mismatch.kind]


def _asks_gpus(container: wire.Container) -> bool:
    value = container.resources.merged().get(names.NVIDIA_GPU)
    try:
        return value is not None and quantity.parse(value) > 0
    except errors.InvalidInputError:
        return False


def _older(created: str | None, now: float, grace: float) -> bool:
    if not created:
        return False
    try:
        return now - wire.seconds(created) >= grace
    except errors.InvalidInputError:
        return False
