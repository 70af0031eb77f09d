"""The shared-device-group project's resource, `deviceshare.io/v1alpha1` SharedDeviceGroup, as an
optional compatibility CRD (`sharegpu crds --compat deviceshare`).

Its users apply their manifests unchanged: the controller mirrors each such group into sharegpu's
own SharedDeviceGroup of the same namespace and name (`mirror_spec`, owned by the original, so the
garbage collector removes the mirror with it), and writes the mirror's status back in the project's
format (`status_of`: phase, nodeName, `selectedDevices: {nvidia.com/gpu: "0,1"}`, allocatedPods).
A pod joins with the project's annotation `deviceshare.io/group: <name>` (read by
`api.groups.membership` beside sharegpu's own), and the webhook takes over its scheduler
`deviceshare-scheduler` (one of `names.REPLACED_SCHEDULERS`).

Pure: the types the controller reads and the functions that translate between the two resources.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from sharegpu.api import groups, names, quantity, wire
from sharegpu.core import errors

GROUP: Final = "deviceshare.io"
VERSION: Final = "v1alpha1"
ANNOTATION: Final = names.DEVICESHARE_GROUP_ANNOTATION
SCHEDULER: Final = "deviceshare-scheduler"
LABEL_MIRROR: Final = f"{names.DOMAIN}/mirror-of"
"""On a sharegpu SharedDeviceGroup made by the controller: the API group of the resource it mirrors."""


class Spec(wire.Message, kw_only=True, frozen=True):
    """What the project's users write: whole GPUs of one node, how to pick the node, where."""

    resources: Annotated[
        dict[str, int | str], Meta(description="nvidia.com/gpu: how many whole GPUs of one node the group holds.")
    ] = msgspec.field(default_factory=dict)
    scheduling_strategy: Annotated[
        Literal["binpack", "spread"], Meta(description="binpack: the fullest node that fits; spread: the emptiest.")
    ] = "binpack"
    node_selector: dict[str, str] = msgspec.field(default_factory=dict)


class Status(wire.Message, kw_only=True, frozen=True):
    """The project's status fields, written from the mirror's (`status_of`)."""

    phase: str = ""
    node_name: str = ""
    selected_devices: Annotated[dict[str, str], Meta(description='nvidia.com/gpu: "0,1" (device indexes).')] = (
        msgspec.field(default_factory=dict)
    )
    allocated_pods: list[str] = msgspec.field(default_factory=list)
    message: str = ""
    mirror: Annotated[str, Meta(description="The sharegpu.io SharedDeviceGroup that does the work.")] = ""


class DeviceShareGroup(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: Spec = msgspec.field(default_factory=Spec)
    status: Status = msgspec.field(default_factory=Status)


def mirror_spec(source: DeviceShareGroup) -> groups.GroupSpec:
    """sharegpu's spec for a deviceshare.io group; InvalidRequestError naming what cannot be mirrored."""
    spec = source.spec
    unknown = sorted(set(spec.resources) - {names.NVIDIA_GPU})
    if unknown:
        raise errors.InvalidRequestError(
            f"spec.resources: only {names.NVIDIA_GPU} can be held by a group, got {', '.join(unknown)}"
        )
    if names.NVIDIA_GPU not in spec.resources:
        raise errors.InvalidRequestError(f"spec.resources: {names.NVIDIA_GPU} (how many GPUs) is required")
    count = quantity.integer(spec.resources[names.NVIDIA_GPU], f"spec.resources[{names.NVIDIA_GPU}]", 1, 64)
    return groups.GroupSpec(
        gpus=count, scheduling_strategy=spec.scheduling_strategy, node_selector=dict(spec.node_selector)
    )


def owner(source: DeviceShareGroup) -> wire.OwnerReference:
    return wire.controller_reference(f"{GROUP}/{VERSION}", "SharedDeviceGroup", source.metadata)


def mirrors(mirror: groups.SharedDeviceGroup, source: DeviceShareGroup) -> bool:
    """Whether `mirror` is the controller's mirror of `source` (owned by this very object)."""
    return any(ref.uid == source.metadata.uid and ref.controller for ref in mirror.metadata.owner_references)


def status_of(mirror: groups.SharedDeviceGroup, namespace: str) -> Status:
    """The project's status from the mirror's: member pods of the group's own namespace by name."""
    done = mirror.status
    indexes = ",".join(str(d.index) for d in done.devices)
    message = next((c.message for c in done.conditions if c.type == "Bound"), "")
    return Status(
        phase=done.phase,
        node_name=done.node_name,
        selected_devices={names.NVIDIA_GPU: indexes} if indexes else {},
        allocated_pods=[p.removeprefix(f"{namespace}/") for p in done.member_pods],
        message=message,
        mirror=f"{names.DOMAIN}/{mirror.metadata.namespace}/{mirror.metadata.name}",
    )
