"""The GPUBudget resource: GPU time a namespace may use per period, and what happens beyond it.

A GPUBudget lives in the namespace it governs. Usage is GPU-seconds weighted by the share held: a
pod holding 500 milli-GPU (or half a GPU's memory, whichever is larger) on each of 2 GPUs for an
hour uses 3,600 GPU-seconds. The controller computes it from pod lifetimes in the API and writes
the status; the webhook reads the status to demote or refuse new GPU pods.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from sharegpu.api import groups, wire
from sharegpu.core import budget

WITHIN: Final = budget.WITHIN
WARNING: Final = budget.WARNING
EXHAUSTED: Final = budget.EXHAUSTED

Action = Literal["Demote", "Deny", "Allow"]
State = Literal["Within", "Warning", "Exhausted"]


class BudgetSpec(wire.Message, kw_only=True, frozen=True):
    """How much GPU time per period, and what happens when it is used up."""

    gpu_hours: Annotated[int, Meta(ge=1, description="GPU-hours per period (a whole GPU for an hour is one).")]
    period_days: Annotated[int, Meta(ge=1, le=366, description="The period's length in days.")] = 30
    period_start: Annotated[str, Meta(description="Where periods are counted from (RFC 3339); empty: creation.")] = ""
    when_exhausted: Annotated[
        Action,
        Meta(
            description="Demote: new GPU pods get the demotion PriorityClass; Deny: they are refused at "
            "admission; Allow: only events and metrics."
        ),
    ] = "Demote"
    warn_at_percent: Annotated[int, Meta(ge=1, le=100, description="An event when usage passes this share.")] = 80
    demote_priority_class: Annotated[str, Meta(description="The PriorityClass of demoted pods.")] = (
        "sharegpu-over-budget"
    )


class Consumer(wire.Message, kw_only=True, frozen=True):
    pod: Annotated[str, Meta(description="namespace/name")]
    gpu_seconds: Annotated[int, Meta(ge=0)] = msgspec.field(default=0, name="gpuSeconds")


class BudgetStatus(wire.Message, kw_only=True, frozen=True):
    state: State = "Within"
    used_gpu_seconds: Annotated[int, Meta(ge=0)] = msgspec.field(default=0, name="usedGPUSeconds")
    remaining_gpu_seconds: int = msgspec.field(default=0, name="remainingGPUSeconds")
    period_start: str = ""
    top_consumers: list[Consumer] = msgspec.field(default_factory=list)
    conditions: list[groups.Condition] = msgspec.field(default_factory=list)
    observed_generation: int = 0


class GPUBudget(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: BudgetSpec
    status: BudgetStatus = msgspec.field(default_factory=BudgetStatus)
