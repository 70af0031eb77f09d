"""When a pod held its GPUs, read from the pod's own record in the API (no sidecar, no agent).

A pod holds its GPUs from its binding (the PodScheduled condition turns True at the bind, with the
API server's time) until it finishes (the last container's `finishedAt`) or is deleted. `TimedPod`
decodes only the fields this needs; `Lifetime` is what the budget controller keeps per pod.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import msgspec

from sharegpu.api import names, pods, quantity, wire
from sharegpu.core import allocation, errors, units


class Terminated(wire.Message, kw_only=True, frozen=True):
    finished_at: str | None = None


class ContainerState(wire.Message, kw_only=True, frozen=True):
    terminated: Terminated | None = None


class ContainerStatus(wire.Message, kw_only=True, frozen=True):
    state: ContainerState = msgspec.field(default_factory=ContainerState)


class TimedCondition(wire.Message, kw_only=True, frozen=True):
    type: str = ""
    status: str = ""
    last_transition_time: str | None = None


class TimedStatus(wire.Message, kw_only=True, frozen=True):
    phase: str = ""
    start_time: str | None = None
    conditions: list[TimedCondition] = msgspec.field(default_factory=list)
    container_statuses: list[ContainerStatus] = msgspec.field(default_factory=list)


class TimedSpec(wire.Message, kw_only=True, frozen=True):
    node_name: str = ""
    containers: list[wire.Container] = msgspec.field(default_factory=list)


class TimedPod(wire.Message, kw_only=True, frozen=True):
    """A pod as the budget controller reads it."""

    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: TimedSpec = msgspec.field(default_factory=TimedSpec)
    status: TimedStatus = msgspec.field(default_factory=TimedStatus)


@dataclass(frozen=True, slots=True)
class Lifetime:
    """A bound GPU pod's holding as the API shows it (times in seconds since the epoch)."""

    uid: str
    key: units.PodKey
    namespace: str
    """The namespace charged: the pod's own, or a group holder's group's."""
    node: str
    allocation: allocation.Allocation | None
    """The allocation sharegpu bound it with; None for a pod some other scheduler placed."""
    whole_gpus: int
    """nvidia.com/gpu it asks for (counted whole when there is no allocation)."""
    start: int
    end: int | None
    """When its last container finished; None while it runs (or when a finished pod says no time)."""
    terminal: bool


def _time(stamp: str | None) -> int | None:
    if not stamp:
        return None
    try:
        return wire.seconds(stamp)
    except errors.InvalidInputError:
        return None


def lifetime(pod: TimedPod) -> Lifetime | None:
    """The pod's holding; None for a pod that holds no GPU (asks for none, is not bound, or is one
    of sharegpu's reservation pods, whose GPUs belong to the pods they serve). A group's holder pod is
    charged to the group's namespace."""
    meta, spec, status = pod.metadata, pod.spec, pod.status
    role = meta.labels.get(names.LABEL_ROLE) if meta.namespace == names.SYSTEM_NAMESPACE else None  # pods.role
    if not spec.node_name or role == names.ROLE_RESERVATION:
        return None
    charged = meta.namespace
    if role == names.ROLE_GROUP_HOLDER:  # a group's GPUs are its namespace's use
        charged = meta.labels.get(names.LABEL_GROUP_NAMESPACE) or meta.namespace
    key = units.pod_key(meta.namespace, meta.name)
    alloc = None
    text = meta.annotations.get(names.ALLOCATION)
    if text:
        try:
            alloc = allocation.Allocation.from_json(text, pod=key)
        except errors.InvalidInputError:
            alloc = None
    whole = 0
    for container in spec.containers:
        value = container.resources.merged().get(names.NVIDIA_GPU)
        if value is not None:
            with contextlib.suppress(errors.InvalidInputError):  # the webhook refuses such pods
                whole += quantity.integer(value, names.NVIDIA_GPU, 0, units.MAX_GPUS_PER_NODE)
    if alloc is None and not whole:
        return None
    scheduled = next((c for c in status.conditions if c.type == "PodScheduled" and c.status == "True"), None)
    start = _time(scheduled.last_transition_time if scheduled else None)
    if start is None:
        start = _time(status.start_time) or _time(meta.creation_timestamp)
    if start is None:
        return None
    terminal = status.phase in pods.TERMINAL_PHASES
    end = None
    if terminal:
        finished = [_time(c.state.terminated.finished_at) for c in status.container_statuses if c.state.terminated]
        known = [f for f in finished if f is not None]
        end = max(known) if known else None
    return Lifetime(
        uid=meta.uid,
        key=key,
        namespace=charged,
        node=spec.node_name,
        allocation=alloc,
        whole_gpus=whole,
        start=start,
        end=max(end, start) if end is not None else None,
        terminal=terminal,
    )
