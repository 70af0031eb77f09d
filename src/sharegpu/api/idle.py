"""Idle GPU shares: a namespace's policy (`GPUIdlePolicy`) and which of its pods hold a share they do
not use.

A share is idle while the SM utilisation its pod's processes show on every GPU it uses stays at or
below `idleAtMostPercent` of the GPU, as the node agents report it (`api.usage`). A pod whose SM use
is not measured on one of its GPUs (a MIG GPU takes no per-process samples) is never idle: what is
not measured is not judged. A pod idle for `idleAfterSeconds` is reported (an event, a metric, the
policy's status), and with `action: Evict` evicted through the Eviction API, its PodDisruptionBudgets
honoured; a gang's member only with every other member of its gang, all of them idle that long.

Why a resource of its own rather than a field of the GPU-time budgets: reclaiming idle shares is
wanted where no GPU-time limit is (a budget needs its GPU-hours), and the two answer different
questions (how much GPU time a namespace may spend; whether a share is being used at all). One
policy rules a namespace: where there are several, the oldest (then the first by name); the others
say in their status that they are not in force.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from sharegpu.api import usage, wire

Action = Literal["Report", "Evict"]


class IdleSpec(wire.Message, kw_only=True, frozen=True):
    idle_after_seconds: Annotated[
        int, Meta(ge=1, description="How long a share must stay idle before it is reported (and evicted).")
    ] = 1800
    idle_at_most_percent: Annotated[
        int, Meta(ge=0, le=100, description="SM utilisation of the GPU, in percent, at or below which a share is idle.")
    ] = 1
    action: Annotated[
        Action,
        Meta(description="Report: an event, a metric and the status; Evict: also evict the pod (Eviction API)."),
    ] = "Report"


class IdlePod(wire.Message, kw_only=True, frozen=True):
    name: str
    since: Annotated[str, Meta(description="Idle since (RFC 3339), as the agents' reports first showed it.")]
    share_milli: int | None = None
    """The compute it holds, summed over its GPUs (None: not known)."""


class IdleStatus(wire.Message, kw_only=True, frozen=True):
    in_force: Annotated[bool, Meta(description="This policy rules its namespace (the oldest of several does).")] = False
    idle: Annotated[list[IdlePod], Meta(description="The namespace's pods idle for longer than idleAfterSeconds.")] = (
        msgspec.field(default_factory=list)
    )
    evictions: Annotated[int, Meta(ge=0, description="Pods evicted for idling under this policy.")] = 0


class GPUIdlePolicy(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: IdleSpec = msgspec.field(default_factory=IdleSpec)
    status: IdleStatus = msgspec.field(default_factory=IdleStatus)


def in_force(policies: Sequence[GPUIdlePolicy]) -> GPUIdlePolicy | None:
    """The policy that rules a namespace: the oldest of its policies (then the first by name)."""
    if not policies:
        return None
    return min(policies, key=lambda p: (p.metadata.creation_timestamp or "", p.metadata.name))


@dataclass(frozen=True, slots=True)
class Seen:
    """One pod's use as one node's report shows it: idle or not (None: not measured), and its share."""

    namespace: str
    name: str
    idle: bool | None
    share_milli: int | None


def seen(report: usage.GpuUsage, threshold: Mapping[str, int]) -> dict[str, Seen]:
    """Pod UID -> what `report` shows of it, for the pods of the namespaces in `threshold` (namespace
    -> its policy's idleAtMostPercent): idle only if it is at or below on every GPU it uses there."""
    out: dict[str, Seen] = {}
    for use in report.status.pods:
        limit = threshold.get(use.namespace)
        if limit is None:
            continue
        here: bool | None = None if use.sm_percent is None else use.sm_percent <= limit
        before = out.get(use.uid)
        if before is not None:
            idle = None if before.idle is None or here is None else before.idle and here
            share = (
                None if before.share_milli is None or use.share_milli is None else before.share_milli + use.share_milli
            )
        else:
            idle, share = here, use.share_milli
        out[use.uid] = Seen(use.namespace, use.name, idle, share)
    return out
