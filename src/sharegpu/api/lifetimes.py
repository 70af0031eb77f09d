"""When a pod held its GPUs, read from the pod's own record in the API (no sidecar, no agent).

A pod holds its GPUs from its binding (the PodScheduled condition turns True at the bind, with the
API server's time) until it finishes (the last container's `finishedAt`) or is deleted. `TimedPod`
decodes only the fields this needs; `Lifetime` is what the budget controller keeps per pod.

**A ResourceClaim is one share, however many use it** (`claim_lifetime`). Pods of a namespace may
name one claim, and several containers of a pod may use it; the claim holds one allocation, so it
counts once: once in the ledger (`api.dra.claim_key`), once in the budgets (charged to the claim's
namespace, at the claim's share, from the binding of the first pod that uses it to the end of the
last one), and once in what the node enforces (its users together are held to its limits). Its
users' own lifetimes charge nothing for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from sharegpu.api import dra, names, pods, quantity, wire
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
    resource_claim_statuses: list[wire.PodResourceClaimStatus] = msgspec.field(default_factory=list)


class TimedSpec(wire.Message, kw_only=True, frozen=True):
    node_name: str = ""
    containers: list[wire.Container] = msgspec.field(default_factory=list)
    resource_claims: list[wire.PodResourceClaim] = msgspec.field(default_factory=list)


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
    meta, spec = pod.metadata, pod.spec
    role = meta.labels.get(names.LABEL_ROLE) if meta.namespace == names.HOLDING_NAMESPACE else None  # pods.role
    if not spec.node_name or role == names.ROLE_RESERVATION:
        return None
    charged = pods.charged_namespace(meta.namespace, meta.labels)  # a group's GPUs are its namespace's use
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
    span = _span(pod)
    if span is None:
        return None
    start, end, terminal = span
    return Lifetime(
        uid=meta.uid,
        key=key,
        namespace=charged,
        node=spec.node_name,
        allocation=alloc,
        whole_gpus=whole,
        start=start,
        end=end,
        terminal=terminal,
    )


def _span(pod: TimedPod) -> tuple[int, int | None, bool] | None:
    """(start, end, finished) of a bound pod's holding; None when no start can be read."""
    meta, status = pod.metadata, pod.status
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
        if not known:  # ended with no container's end (refused at admission, say): its conditions' last change
            known = [t for t in (_time(c.last_transition_time) for c in status.conditions) if t is not None]
        end = max(known) if known else start
    return start, max(end, start) if end is not None else None, terminal


@dataclass(frozen=True, slots=True)
class ClaimUse:
    """A bound pod's use of ResourceClaims (of its namespace, by name), and when it used them."""

    uid: str
    namespace: str
    claims: tuple[str, ...]
    start: int
    end: int | None
    """When it finished or went; None while it runs."""


def claim_use(pod: TimedPod) -> ClaimUse | None:
    """What claims a bound pod uses (named, or made for it from a template, as its status says);
    None for a pod that uses none, or is not bound."""
    if not pod.spec.node_name or not pod.spec.resource_claims:
        return None
    made = {s.name: s.resource_claim_name or "" for s in pod.status.resource_claim_statuses}
    names_ = tuple(sorted({c.resource_claim_name or made.get(c.name, "") for c in pod.spec.resource_claims} - {""}))
    span = _span(pod)
    if not names_ or span is None:
        return None
    start, end, _ = span
    return ClaimUse(uid=pod.metadata.uid, namespace=pod.metadata.namespace, claims=names_, start=start, end=end)


def claim_lifetime(
    uid: str,
    namespace: str,
    name: str,
    held: allocation.Allocation,
    uses: Iterable[ClaimUse],
    created: int | None = None,
) -> Lifetime | None:
    """A claim's holding as the budgets count it (the module's rule: one share, however many use it):
    charged to its namespace at its allocation (`held`), from the first user's start to the last
    user's end (None while any runs; the time between users who do not overlap counts too, as the
    claim keeps its GPU then); None while no pod has used it. Pods name claims, not their UIDs: with
    the claim's creation time (`created`, seconds), a use that ended before it was of an older
    claim of that name and does not count."""
    mine = [
        u for u in uses
        if u.namespace == namespace and name in u.claims and (created is None or u.end is None or u.end > created)
    ]  # fmt: skip
    if not mine:
        return None
    running = any(u.end is None for u in mine)
    return Lifetime(
        uid=uid,
        key=dra.claim_key(namespace, name),
        namespace=namespace,
        node=held.node,
        allocation=held,
        whole_gpus=0,
        start=min(u.start for u in mine),
        end=None if running else max(u.end or 0 for u in mine),
        terminal=not running,
    )
