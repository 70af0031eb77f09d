"""sharegpu as a Dynamic Resource Allocation driver: the ResourceSlice a node publishes
(`resource.k8s.io/v1`), built from the same Device spec the agent writes.

One slice per node, in a pool named after the node, for the driver `DRIVER`. One device per GPU,
named `gpu-<index>`:

- attributes, under the driver's domain: `uuid`, `model`, `index`, `numaNode`, `pcieSwitch` (where
  known), `nvlinkPeers` (the indexes it is NVLinked to, comma-separated), `mig`;
- capacities that several claims share (`allowMultipleAllocations`): `memory` (the GPU's memory, in
  Mi: a claim asks `4Gi` or `4096Mi`) and `milli` (compute, 1000 = the whole GPU), each with a
  request policy that keeps requests in sharegpu's units: memory in steps of 1 MiB, compute in
  steps of 1 milli-GPU, a claim that says nothing taking 1 milli-GPU and 1 MiB;
- an unhealthy GPU carries a NoSchedule device taint (`<driver>/unhealthy`, its reason as the
  value, cut to the API's 63 characters), so no new claim is given it.

Pure: no I/O. The agent writes the slice (`agent.publication`).
"""

from __future__ import annotations

from typing import Any, Final

from sharegpu.api import names, wire

DRIVER: Final = f"gpu.{names.DOMAIN}"
"""The driver's name: the DeviceClass selects on it, the kubelet plugin registers under it."""
GROUP: Final = "resource.k8s.io"
VERSION: Final = "v1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
SLICES: Final = f"/apis/{GROUP}/{VERSION}/resourceslices"
MEMORY: Final = "memory"
"""The capacity a claim asks GPU memory of (a quantity; the device's is in Mi)."""
MILLI: Final = "milli"
"""The capacity a claim asks GPU compute of (an integer; 1000 = the whole GPU)."""
UNHEALTHY: Final = f"{DRIVER}/unhealthy"
"""The taint key of an unhealthy GPU."""
TAINT_VALUE_MAX: Final = 63


def slice_name(node: str) -> str:
    """The node's ResourceSlice: one per node, named after it and the driver."""
    return f"{node}-{DRIVER}"


def slice_path(node: str) -> str:
    return f"{SLICES}/{slice_name(node)}"


def device_name(index: int) -> str:
    return f"gpu-{index}"


def _attribute(value: str | int | bool) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def _peers(index: int, nvlinks: list[tuple[int, int]]) -> str:
    found = sorted({b if a == index else a for a, b in nvlinks if index in (a, b)})
    return ",".join(map(str, found))


def device(gpu: wire.GpuSpec, nvlinks: list[tuple[int, int]]) -> dict[str, Any]:
    """One GPU as a device of the slice (see the module docstring)."""
    attributes: dict[str, Any] = {
        "uuid": _attribute(gpu.uuid),
        "model": _attribute(gpu.model),
        "index": _attribute(gpu.index),
        "numaNode": _attribute(gpu.numa_node),
        "mig": _attribute(gpu.mig),
        "nvlinkPeers": _attribute(_peers(gpu.index, nvlinks)),
    }
    if gpu.pcie_switch is not None:
        attributes["pcieSwitch"] = _attribute(gpu.pcie_switch)
    out: dict[str, Any] = {
        "name": device_name(gpu.index),
        "attributes": {f"{DRIVER}/{key}": value for key, value in attributes.items()},
        "capacity": {
            MEMORY: {
                "value": f"{gpu.memory_mib}Mi",
                "requestPolicy": {"default": "1Mi", "validRange": {"min": "1Mi", "step": "1Mi"}},
            },
            MILLI: {
                "value": "1000",
                "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1000", "step": "1"}},
            },
        },
        "allowMultipleAllocations": True,
    }
    if not gpu.healthy:
        reason = (gpu.reason or "unhealthy")[:TAINT_VALUE_MAX]
        out["taints"] = [{"key": UNHEALTHY, "value": _taint_value(reason), "effect": "NoSchedule"}]
    return out


def _taint_value(text: str) -> str:
    """A reason as a taint value (a label value: letters, digits, '-', '_', '.'; starts and ends
    alphanumeric)."""
    kept = "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-_.")
    return kept or "unhealthy"


def resource_slice(node: str, node_uid: str, spec: wire.DeviceSpec, generation: int = 1) -> dict[str, Any]:
    """The node's ResourceSlice, owned by its Node (it goes with the node)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {
            "name": slice_name(node),
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [device(gpu, spec.nvlinks) for gpu in spec.gpus],
        },
    }
