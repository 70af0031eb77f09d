"""Device inventory: the GPUs of a node and how they are connected.

A `NodeInventory` is what the node agent discovers (through NVML) and what the simulator builds from
a trace. It is a frozen value; the mutable bookkeeping of who holds what lives in `fleet` and
`ledger`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sharegpu.core import errors, units


class Link(enum.IntEnum):
    """How two GPUs of one node talk to each other; a higher value is a faster path."""

    CROSS_NUMA = 0
    """Through the inter-socket link (nvidia-smi topo: SYS)."""
    SAME_NUMA = 1
    """Through the host bridge of one NUMA node (NODE, PHB)."""
    SAME_PCIE_SWITCH = 2
    """Behind one PCIe switch (PIX, PXB)."""
    NVLINK = 3
    """A direct NVLink connection (NV#)."""


class Isolation(enum.Enum):
    """A way a node can enforce the shares of the pods on a GPU (beyond telling them their GPU):
    HAMi-core's CUDA interception library, NVIDIA MPS (a control daemon per GPU), or MIG partitions.
    What each guarantees is in docs/isolation.md."""

    HAMI_CORE = "hami-core"
    MPS = "mps"
    MIG = "mig"

    @property
    def bit(self) -> int:
        return 1 << list(Isolation).index(self)


def isolation_bits(modes: frozenset[Isolation]) -> int:
    """The modes as a bit mask (`Isolation.bit`)."""
    return sum(mode.bit for mode in modes)


@dataclass(frozen=True, slots=True)
class GpuDevice:
    """One physical GPU as the inventory reports it."""

    index: int
    uuid: units.GpuUuid
    model: str
    memory_mib: units.MiB
    healthy: bool = True
    numa_node: int = 0
    pcie_switch: int | None = None
    """Identifier of the PCIe switch the GPU sits behind, if known."""

    def __post_init__(self) -> None:
        if self.index < 0:
            raise errors.InvalidInventoryError(f"GPU index must be >= 0, got {self.index}")
        if not self.uuid:
            raise errors.InvalidInventoryError(f"GPU {self.index} has an empty UUID")
        if not self.model:
            raise errors.InvalidInventoryError(f"GPU {self.index} ({self.uuid}) has an empty model name")
        if self.memory_mib <= 0:
            raise errors.InvalidInventoryError(
                f"GPU {self.index} ({self.uuid}) must have memory > 0 MiB, got {self.memory_mib}"
            )


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """A node's host resources and its GPUs (indices 0..n-1, in order)."""

    name: units.NodeName
    cpu_milli: units.MilliCpu
    memory_mib: units.MiB
    gpus: tuple[GpuDevice, ...] = ()
    nvlinks: frozenset[tuple[int, int]] = field(default_factory=frozenset)
    """Unordered pairs of GPU indices joined by NVLink, stored with the smaller index first."""
    isolation: frozenset[Isolation] = field(default_factory=frozenset)
    """The isolation modes the node offers (its agent reports them)."""
    compute_isolation: frozenset[Isolation] = field(default_factory=frozenset)
    """Those of `isolation` that hold a pod to its compute share there (its agent reports them)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise errors.InvalidInventoryError("node name must not be empty")
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise errors.InvalidInventoryError(
                f"node {self.name}: CPU and memory must be >= 0, got {self.cpu_milli}m and {self.memory_mib} MiB"
            )
        if len(self.gpus) > units.MAX_GPUS_PER_NODE:
            raise errors.InvalidInventoryError(
                f"node {self.name} has {len(self.gpus)} GPUs; at most {units.MAX_GPUS_PER_NODE} are supported"
            )
        for position, gpu in enumerate(self.gpus):
            if gpu.index != position:
                raise errors.InvalidInventoryError(
                    f"node {self.name}: GPU at position {position} has index {gpu.index}; "
                    "indices must be 0..n-1 in order"
                )
        uuids = [gpu.uuid for gpu in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise errors.InvalidInventoryError(f"node {self.name}: GPU UUIDs are not unique")
        for a, b in self.nvlinks:
            if not (0 <= a < b < len(self.gpus)):
                raise errors.InvalidInventoryError(
                    f"node {self.name}: NVLink pair ({a}, {b}) must name two distinct GPUs, smaller first"
                )

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def link(self, a: int, b: int) -> Link:
        """The best path between GPUs `a` and `b` of this node."""
        low, high = min(a, b), max(a, b)
        if (low, high) in self.nvlinks:
            return Link.NVLINK
        gpu_a, gpu_b = self.gpus[a], self.gpus[b]
        if gpu_a.pcie_switch is not None and gpu_a.pcie_switch == gpu_b.pcie_switch:
            return Link.SAME_PCIE_SWITCH
        if gpu_a.numa_node == gpu_b.numa_node:
            return Link.SAME_NUMA
        return Link.CROSS_NUMA


def uniform_node(
    name: str,
    *,
    gpu_count: int,
    model: str,
    gpu_memory_mib: int,
    cpu_milli: int,
    memory_mib: int,
    nvlink_all: bool = False,
) -> NodeInventory:
    """A node of identical GPUs, split evenly over two NUMA nodes (one PCIe switch per pair)."""
    half = max(1, gpu_count // 2)
    gpus = tuple(
        GpuDevice(
            index=i,
            uuid=units.GpuUuid(f"GPU-{name}-{i}"),
            model=model,
            memory_mib=units.MiB(gpu_memory_mib),
            numa_node=i // half,
            pcie_switch=i // 2,
        )
        for i in range(gpu_count)
    )
    links = frozenset((a, b) for a in range(gpu_count) for b in range(a + 1, gpu_count)) if nvlink_all else frozenset()
    return NodeInventory(
        name=units.NodeName(name),
        cpu_milli=units.MilliCpu(cpu_milli),
        memory_mib=units.MiB(memory_mib),
        gpus=gpus,
        nvlinks=links,
    )
