"""Quantities and identifiers of the GPU vocabulary.

Every quantity is an integer: compute in milli-GPU (1000 = one whole GPU), memory in MiB, host CPU
in milli-cores. Identifiers are distinct types so a node name cannot be passed where a pod key is
expected.
"""

from __future__ import annotations

from typing import Final, NewType

MiB = NewType("MiB", int)
MilliCpu = NewType("MilliCpu", int)

NodeName = NewType("NodeName", str)
PodKey = NewType("PodKey", str)
"""`namespace/name` of a pod (the simulator uses the trace's pod name)."""
GpuUuid = NewType("GpuUuid", str)

MILLI_PER_GPU: Final = 1000
"""Compute capacity of one physical GPU, in milli-GPU."""

PERMILLE: Final = 1000
"""A whole, in per-mille (GPU memory given as a fraction of the GPU's memory)."""

BYTES_PER_MIB: Final = 1 << 20
"""Memory quantities are MiB inside sharegpu; /metrics says bytes (Prometheus's base unit)."""
PERCENT: Final = 100
"""Utilisation is a whole percentage inside sharegpu (as NVML gives it); /metrics says a ratio."""

MAX_GPUS_PER_NODE: Final = 63
"""Device choices are bit masks in an int64; nodes with more GPUs than this are refused."""


def pod_key(namespace: str, name: str) -> PodKey:
    """The canonical key of a pod."""
    return PodKey(f"{namespace}/{name}")
