"""Outcomes as values: a code plus structured reasons.

Modelled on kube-scheduler's framework Status. "Does not fit" is an ordinary answer, carried by a
`Status` with `Code.UNSCHEDULABLE` and one `Reason` per shortfall (resource, requested, free,
capacity, and where: node and GPU). Exceptions stay for faults.

`Resource` names what fell short in the domain's own words; the wire layer (`sharegpu.api`) maps
each to the resource name users write, so the two can never drift apart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Resource(enum.Enum):
    """What a `Reason` is about."""

    HOST_CPU = "cpu"
    HOST_MEMORY = "memory"
    GPU_MILLI = "gpu-milli"
    GPU_MEMORY = "gpu-memory-mib"
    GPU_COUNT = "gpus"
    GPU_MODEL = "gpu-model"
    GPU_HEALTH = "gpu-health"
    COTENANCY = "co-tenancy"
    ISOLATION = "isolation"
    OVERCOMMITTED = "gpu-overcommitted"
    """The GPU's tenants do not fit on it together; it takes no new one until they do."""
    HELD = "gpu-held"
    """The GPU is kept for a pod that preempted its tenants."""
    SELECTOR = "gpu-selector"
    """The GPU is not among those the request's device selectors pick."""


class Code(enum.Enum):
    SUCCESS = "Success"
    UNSCHEDULABLE = "Unschedulable"
    """Does not fit now; may fit once something is freed."""
    UNSCHEDULABLE_AND_UNRESOLVABLE = "UnschedulableAndUnresolvable"
    """Can never fit on this node as it is built (wrong model, too few GPUs)."""
    CONFLICT = "Conflict"
    """The request contradicts the ledger's state (already assumed, unknown pod, over-commit)."""
    ERROR = "Error"


@dataclass(frozen=True, slots=True)
class Reason:
    """One shortfall: `resource` wanted `requested`, only `free` of `capacity` was there."""

    resource: Resource
    requested: int
    free: int
    capacity: int
    node: str | None = None
    gpu: int | None = None
    detail: str = ""

    def __str__(self) -> str:
        where = ""
        if self.node is not None:
            where = f"{self.node}"
            if self.gpu is not None:
                where += f"/gpu{self.gpu}"
            where += ": "
        text = f"{where}{self.resource.value} requested {self.requested}, free {self.free} of {self.capacity}"
        return f"{text} ({self.detail})" if self.detail else text


@dataclass(frozen=True, slots=True)
class Status:
    code: Code
    message: str = ""
    reasons: tuple[Reason, ...] = ()

    @property
    def ok(self) -> bool:
        return self.code is Code.SUCCESS

    def __str__(self) -> str:
        parts = [self.code.value]
        if self.message:
            parts.append(self.message)
        parts.extend(str(r) for r in self.reasons)
        return "; ".join(parts)


SUCCESS = Status(Code.SUCCESS)


def conflict(message: str, *reasons: Reason) -> Status:
    return Status(Code.CONFLICT, message, tuple(reasons))


def unschedulable(message: str, *reasons: Reason) -> Status:
    return Status(Code.UNSCHEDULABLE, message, tuple(reasons))
