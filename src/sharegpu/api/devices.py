"""The Device resource (one per GPU node, written by the node agent) and Node objects, to and from
the placement core's `NodeInventory`.

A node's inventory joins two objects: its Device (the GPUs: index, UUID, model, memory, health,
NUMA node, PCIe switch, NVLink pairs) and its Node (allocatable CPU and memory, readiness).
`device` builds the Device a writer publishes from an inventory; `inventory` reads it back, so the
two cannot disagree on a field name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sharegpu.api import constraints, names, quantity, wire
from sharegpu.core import devices, errors, units

UNREADABLE: Final = "NVML cannot read it"
"""Why a GPU is unhealthy while NVML cannot read it (it may pass)."""
GONE: Final = "gone from NVML while pods hold it"
"""Why a GPU that vanished is kept, unhealthy, while pods hold it."""
XID_PREFIX: Final = "XID "


def xid(code: int) -> str:
    """Why a GPU is unhealthy after a critical XID (`XID 79`): until it is reset and the agent restarted."""
    return f"{XID_PREFIX}{code}"


def lasting(reason: str) -> bool:
    """Whether an unhealthy GPU's reason lasts until the GPU is reset or comes back (a critical XID,
    gone while pods hold it): the pods using it cannot go on. One that may pass (NVML cannot read
    it) does not."""
    return reason.startswith(XID_PREFIX) or reason == GONE


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What placement needs of a Node object."""

    name: str
    schedulable: bool
    cpu_milli: int
    memory_mib: int
    terms: constraints.NodeTerms | None = None
    """Its labels and taints (what pods' node constraints look at)."""
    pods: int = 0
    """How many pods it takes (`allocatable.pods`; 0: not said, no limit known)."""


def node_facts(node: wire.Node) -> NodeFacts:
    ready = next((c.status == "True" for c in node.status.conditions if c.type == "Ready"), False)
    allocatable = node.status.allocatable
    try:
        cpu = quantity.milli_cpu(allocatable.get("cpu", 0))
        memory = quantity.mebibytes(allocatable.get("memory", 0))
        capacity = quantity.integer(allocatable.get("pods", 0), "pods", 0, 1 << 20)
    except errors.InvalidInputError:
        cpu, memory, capacity, ready = 0, 0, 0, False
    return NodeFacts(
        node.metadata.name, ready and not node.spec.unschedulable, cpu, memory, constraints.NodeTerms.of(node), capacity
    )


def gpus(device: wire.Device) -> tuple[tuple[devices.GpuDevice, ...], frozenset[tuple[int, int]]]:
    """The GPUs and NVLink pairs a Device describes; InvalidInventoryError if they contradict themselves."""
    try:
        found = tuple(
            devices.GpuDevice(
                index=g.index,
                uuid=units.GpuUuid(g.uuid),
                model=g.model,
                memory_mib=units.MiB(g.memory_mib),
                healthy=g.healthy,
                numa_node=g.numa_node,
                pcie_switch=g.pcie_switch,
            )
            for g in sorted(device.spec.gpus, key=lambda g: g.index)
        )
    except errors.InvalidInputError as exc:
        raise errors.InvalidInventoryError(f"Device {device.metadata.name}: {exc}") from None
    links = frozenset((min(a, b), max(a, b)) for a, b in device.spec.nvlinks)
    return found, links


def inventory(device: wire.Device, node: NodeFacts | None) -> devices.NodeInventory:
    """A node's inventory from its Device and its Node facts (None: no CPU or memory known)."""
    found, links = gpus(device)
    try:
        return devices.NodeInventory(
            name=units.NodeName(device.metadata.name),
            cpu_milli=units.MilliCpu(node.cpu_milli if node else 0),
            memory_mib=units.MiB(node.memory_mib if node else 0),
            gpus=found,
            nvlinks=links,
            isolation=isolation_modes(device),
            compute_isolation=compute_modes(device),
        )
    except errors.InvalidInputError as exc:
        raise errors.InvalidInventoryError(f"Device {device.metadata.name}: {exc}") from None


def isolation_modes(device: wire.Device) -> frozenset[devices.Isolation]:
    """The isolation modes a Device says its node offers; an unknown one is an invalid inventory."""
    return frozenset(
        _mode(device, f"spec.isolation[{position}]", text) for position, text in enumerate(device.spec.isolation)
    )


def compute_modes(device: wire.Device) -> frozenset[devices.Isolation]:
    """The modes a Device says are offered and enforce a pod's compute share (`spec.enforcement`)."""
    return frozenset(
        _mode(device, f"spec.enforcement[{position}].mode", entry.mode)
        for position, entry in enumerate(device.spec.enforcement)
        if entry.offered and entry.compute
    )


def _mode(device: wire.Device, where: str, text: str) -> devices.Isolation:
    try:
        return devices.Isolation(text)
    except ValueError:
        known = ", ".join(m.value for m in devices.Isolation)
        raise errors.InvalidInventoryError(
            f"Device {device.metadata.name}: {where}: unknown mode {text!r} (known: {known})"
        ) from None


def published(metadata: wire.ObjectMeta, spec: wire.DeviceSpec) -> wire.Device:
    """A Device as it is written to the API (apiVersion and kind set)."""
    return wire.Device(api_version=names.GROUP_VERSION, kind=names.DEVICE_KIND, metadata=metadata, spec=spec)


def device(node: devices.NodeInventory) -> wire.Device:
    """The Device resource describing `node`'s GPUs (what the node agent publishes)."""
    return published(
        metadata=wire.ObjectMeta(name=node.name),
        spec=wire.DeviceSpec(
            gpus=[
                wire.GpuSpec(
                    index=g.index,
                    uuid=g.uuid,
                    model=g.model,
                    memory_mib=g.memory_mib,
                    healthy=g.healthy,
                    numa_node=g.numa_node,
                    pcie_switch=g.pcie_switch,
                )
                for g in node.gpus
            ],
            nvlinks=sorted(node.nvlinks),
            isolation=sorted(m.value for m in node.isolation),
            enforcement=[
                wire.ModeEnforcement(mode=m.value, offered=True, memory=True, compute=m in node.compute_isolation)
                for m in sorted(node.isolation, key=lambda m: m.value)
            ],
        ),
    )
