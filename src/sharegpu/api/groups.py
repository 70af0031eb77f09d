"""The SharedDeviceGroup resource: a named set of GPUs on one node that many pods join.

A group holds `gpus` GPUs of one node (whole, or a share of each) through reservation pods; a pod
joins it with the annotation `sharegpu.io/device-group: <name>` and sees exactly the group's devices.
These types are what the controller and the extender read and write, and the CRD's schema is
generated from them (`api.resources`), so the API server refuses what the code would not read.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from sharegpu.api import wire

PHASE_PENDING: Final = "Pending"
PHASE_BOUND: Final = "Bound"
PHASE_FAILED: Final = "Failed"

Strategy = Literal["binpack", "spread"]
Phase = Literal["Pending", "Bound", "Failed"]
Name = Annotated[str, Meta(min_length=1, max_length=253)]


class Share(wire.Message, kw_only=True, frozen=True):
    """A share of each of the group's GPUs instead of whole ones."""

    milli: Annotated[int, Meta(ge=1, le=1000, description="Compute per GPU, in milli-GPU.")]
    memory_mib: Annotated[int, Meta(ge=0, description="Memory per GPU in MiB; 0: in proportion to milli.")] = (
        msgspec.field(default=0, name="memoryMiB")
    )


class Members(wire.Message, kw_only=True, frozen=True):
    """Who may join: pods of the group's namespace, and of these namespaces too."""

    namespaces: list[Name] = msgspec.field(default_factory=list)


class GroupSpec(wire.Message, kw_only=True, frozen=True):
    """How many GPUs the group holds, where, and who may join it."""

    gpus: Annotated[int, Meta(ge=1, le=64, description="How many GPUs of one node the group holds.")]
    share: Share | None = None
    scheduling_strategy: Annotated[
        Strategy, Meta(description="binpack: the fullest node that fits; spread: the emptiest.")
    ] = "binpack"
    node_selector: dict[str, str] = msgspec.field(default_factory=dict)
    models: Annotated[list[Name], Meta(description="GPU models the group may use; empty: any.")] = msgspec.field(
        default_factory=list
    )
    members: Members = msgspec.field(default_factory=Members)
    bind_eagerly: Annotated[bool, Meta(description="Bind at creation instead of when the first member schedules.")] = (
        False
    )


class GroupDevice(wire.Message, kw_only=True, frozen=True):
    index: Annotated[int, Meta(ge=0, le=62)]
    uuid: str = ""


class Condition(wire.Message, kw_only=True, frozen=True):
    """A condition as Kubernetes writes them (metav1.Condition's fields)."""

    type: Name
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0


class GroupStatus(wire.Message, kw_only=True, frozen=True):
    phase: Phase = "Pending"
    node_name: str = ""
    devices: list[GroupDevice] = msgspec.field(default_factory=list)
    member_pods: Annotated[list[str], Meta(description="namespace/name of each member pod.")] = msgspec.field(
        default_factory=list
    )
    conditions: list[Condition] = msgspec.field(default_factory=list)
    observed_generation: int = 0


class SharedDeviceGroup(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: GroupSpec
    status: GroupStatus = msgspec.field(default_factory=GroupStatus)
