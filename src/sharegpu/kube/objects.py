"""Kubernetes objects <-> sharegpu domain values: resource names, annotation keys, quantities,
pods to `PodRequest`s, Device resources to `NodeInventory`s.

The canonical request a sharegpu pod carries (the admission webhook translates every other format
into it):

    resources.limits (per container)
      sharegpu.io/gpu: N             GPUs for this container (fractional: 1)
      sharegpu.io/gpu-milli: M       compute per GPU, 1..1000 (omitted or 1000: whole GPUs)
      sharegpu.io/gpu-memory: MiB    GPU memory per GPU
      nvidia.com/gpu: N              whole GPUs through the NVIDIA device plugin
    annotations (pod)
      sharegpu.io/gpu-limit-milli    burst limit per GPU for fractional containers
      sharegpu.io/gpu-memory-permille  GPU memory as a fraction of the GPU's memory
      sharegpu.io/gpu-models         allowed models, comma-separated
      sharegpu.io/affinity, anti-affinity, exclusion, group   co-tenancy rules

The system writes `sharegpu.io/allocation` (the allocation JSON) in the binding, and reservation
pods report `sharegpu.io/gpu-uuid`.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from sharegpu.core import allocation, devices, errors, requests, units

DOMAIN = "sharegpu.io"
SCHEDULER_NAME = "sharegpu-scheduler"
SYSTEM_NAMESPACE = "sharegpu-system"

GPU = f"{DOMAIN}/gpu"
GPU_MILLI = f"{DOMAIN}/gpu-milli"
GPU_MEMORY = f"{DOMAIN}/gpu-memory"
NVIDIA_GPU = "nvidia.com/gpu"
MANAGED_RESOURCES = (GPU, GPU_MILLI, GPU_MEMORY)

ANNOTATION_ALLOCATION = f"{DOMAIN}/allocation"
ANNOTATION_LIMIT = f"{DOMAIN}/gpu-limit-milli"
ANNOTATION_MEMORY_PERMILLE = f"{DOMAIN}/gpu-memory-permille"
ANNOTATION_MODELS = f"{DOMAIN}/gpu-models"
ANNOTATION_AFFINITY = f"{DOMAIN}/affinity"
ANNOTATION_ANTI_AFFINITY = f"{DOMAIN}/anti-affinity"
ANNOTATION_EXCLUSION = f"{DOMAIN}/exclusion"
ANNOTATION_GROUP = f"{DOMAIN}/group"
ANNOTATION_HANDOFF = f"{DOMAIN}/handoff-configmap"
ANNOTATION_GPU_UUID = f"{DOMAIN}/gpu-uuid"

LABEL_ROLE = f"{DOMAIN}/role"
ROLE_RESERVATION = "reservation"
LABEL_NODE = f"{DOMAIN}/node"
LABEL_SLOT = f"{DOMAIN}/gpu-index"

DEVICE_GROUP = DOMAIN
DEVICE_VERSION = "v1alpha1"
DEVICE_PLURAL = "devices"
DEVICES_PATH = f"/apis/{DEVICE_GROUP}/{DEVICE_VERSION}/{DEVICE_PLURAL}"

_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
    "P": Decimal(10**15), "E": Decimal(10**18),
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def quantity(text: str | int | float) -> Decimal:
    """A Kubernetes quantity ("500m", "2Gi", "1.5") as an exact decimal."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return Decimal(str(text))
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise errors.InvalidInputError(f"{text!r} is not a Kubernetes quantity")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:
        raise errors.InvalidInputError(f"{text!r} is not a Kubernetes quantity") from None
    if not number.is_finite() or number.adjusted() > 30:
        raise errors.InvalidInputError(f"{str(text)[:40]!r} is too large a quantity")
    return number * _SUFFIXES[match.group(2) or ""]


def milli_cpu(text: str | int) -> int:
    return math.ceil(quantity(text) * 1000)


def mebibytes(text: str | int) -> int:
    return math.ceil(quantity(text) / (2**20))


def whole_number(text: str | int, what: str, low: int, high: int) -> int:
    try:
        value = quantity(text)
    except errors.InvalidInputError as exc:
        raise errors.InvalidRequestError(f"{what}: {exc}") from None
    if value != value.to_integral_value() or not low <= value <= high:
        raise errors.InvalidRequestError(f"{what} must be an integer in {low}..{high}, got {text!r}")
    return int(value)


def pod_key(pod: dict[str, Any]) -> units.PodKey:
    meta = pod.get("metadata") or {}
    return units.pod_key(meta.get("namespace", ""), meta.get("name", ""))


def _resources(container: dict[str, Any]) -> dict[str, Any]:
    res = container.get("resources") or {}
    merged = dict(res.get("requests") or {})
    merged.update(res.get("limits") or {})
    return merged


def wants_gpu(pod: dict[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        res = _resources(container)
        if any(name in res for name in (*MANAGED_RESOURCES, NVIDIA_GPU)):
            return True
    return False


def is_reservation(pod: dict[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE) == ROLE_RESERVATION


def host_request(pod: dict[str, Any]) -> tuple[int, int]:
    """(milli-CPU, MiB) the pod requests: the larger of its app containers' sum and its largest init container."""
    spec = pod.get("spec") or {}

    def one(container: dict[str, Any]) -> tuple[int, int]:
        req = (container.get("resources") or {}).get("requests") or {}
        lim = (container.get("resources") or {}).get("limits") or {}
        cpu = req.get("cpu", lim.get("cpu", 0))
        mem = req.get("memory", lim.get("memory", 0))
        return milli_cpu(cpu), mebibytes(mem)

    apps = [one(c) for c in spec.get("containers") or []]
    inits = [one(c) for c in spec.get("initContainers") or []]
    cpu = max(sum(a[0] for a in apps), max((i[0] for i in inits), default=0))
    mem = max(sum(a[1] for a in apps), max((i[1] for i in inits), default=0))
    return cpu, mem


def pod_request(pod: dict[str, Any]) -> requests.PodRequest:
    """The normalised request of a pod; malformed requests raise InvalidRequestError naming the field."""
    meta = pod.get("metadata") or {}
    notes = meta.get("annotations") or {}
    spec = pod.get("spec") or {}
    key = pod_key(pod)
    limit = notes.get(ANNOTATION_LIMIT)
    permille = notes.get(ANNOTATION_MEMORY_PERMILLE)
    models_text = notes.get(ANNOTATION_MODELS, "")
    models = frozenset(m.strip() for m in models_text.split(",") if m.strip())
    containers: list[requests.ContainerRequest] = []
    for init, group in ((True, spec.get("initContainers") or []), (False, spec.get("containers") or [])):
        for container in group:
            res = _resources(container)
            name = str(container.get("name", ""))
            gpu: requests.GpuRequest | None = None
            try:
                if NVIDIA_GPU in res and any(k in res for k in MANAGED_RESOURCES):
                    raise errors.InvalidRequestError(
                        f"{NVIDIA_GPU} asks for whole GPUs; it cannot be combined with a share "
                        f"({', '.join(k for k in MANAGED_RESOURCES if k in res)})"
                    )
                if NVIDIA_GPU in res:
                    count = whole_number(res[NVIDIA_GPU], NVIDIA_GPU, 0, units.MAX_GPUS_PER_NODE)
                    if count:
                        gpu = requests.GpuRequest(count=count, models=models)
                elif GPU in res or GPU_MILLI in res:
                    count = whole_number(res.get(GPU, 1), GPU, 0, units.MAX_GPUS_PER_NODE)
                    milli = whole_number(res.get(GPU_MILLI, units.MILLI_PER_GPU), GPU_MILLI, 1, units.MILLI_PER_GPU)
                    if count:
                        whole = milli == units.MILLI_PER_GPU
                        gpu = requests.GpuRequest(
                            count=count,
                            milli=milli,
                            limit_milli=None
                            if whole or limit is None
                            else whole_number(limit, ANNOTATION_LIMIT, 1, 1000),
                            memory_mib=whole_number(res.get(GPU_MEMORY, 0), GPU_MEMORY, 0, 1 << 30),
                            memory_permille=0
                            if whole or permille is None
                            else whole_number(permille, ANNOTATION_MEMORY_PERMILLE, 1, 1000),
                            models=models,
                        )
            except errors.InvalidInputError as exc:
                raise errors.InvalidRequestError(f"pod {key}, container {name}: {exc}") from None
            containers.append(requests.ContainerRequest(name, gpu, init=init))
    cpu, mem = host_request(pod)
    rules = requests.CoTenancy(
        affinity=notes.get(ANNOTATION_AFFINITY),
        anti_affinity=notes.get(ANNOTATION_ANTI_AFFINITY),
        exclusion=notes.get(ANNOTATION_EXCLUSION),
        group=notes.get(ANNOTATION_GROUP),
    )
    return requests.PodRequest(key=key, containers=tuple(containers), cpu_milli=cpu, memory_mib=mem, cotenancy=rules)


def pod_allocation(pod: dict[str, Any]) -> allocation.Allocation | None:
    """The allocation recorded on a bound pod, or None if it carries none."""
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_ALLOCATION)
    if not text:
        return None
    cpu, mem = host_request(pod)
    return allocation.Allocation.from_json(text, pod=pod_key(pod), cpu_milli=cpu, memory_mib=mem)


def is_terminal(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def device_inventory(device: dict[str, Any], node: dict[str, Any] | None) -> devices.NodeInventory:
    """A node's inventory from its Device resource (GPUs) and Node object (allocatable CPU and memory)."""
    name = (device.get("metadata") or {}).get("name", "")
    spec = device.get("spec") or {}
    gpus = []
    try:
        for raw in sorted(spec.get("gpus") or [], key=lambda g: int(g.get("index", 0))):
            gpus.append(
                devices.GpuDevice(
                    index=int(raw["index"]),
                    uuid=units.GpuUuid(str(raw["uuid"])),
                    model=str(raw["model"]),
                    memory_mib=units.MiB(int(raw["memoryMiB"])),
                    healthy=bool(raw.get("healthy", True)),
                    numa_node=int(raw.get("numaNode", 0)),
                    pcie_switch=None if raw.get("pcieSwitch") is None else int(raw["pcieSwitch"]),
                )
            )
        links = frozenset(tuple(sorted((int(a), int(b)))) for a, b in spec.get("nvlinks") or [])
    except (KeyError, TypeError, ValueError) as exc:
        raise errors.InvalidInventoryError(f"Device {name}: malformed GPU entry ({exc})") from None
    allocatable = ((node or {}).get("status") or {}).get("allocatable") or {}
    return devices.NodeInventory(
        name=units.NodeName(name),
        cpu_milli=units.MilliCpu(milli_cpu(allocatable.get("cpu", 0))),
        memory_mib=units.MiB(mebibytes(allocatable.get("memory", 0))),
        gpus=tuple(gpus),
        nvlinks=links,  # type: ignore[arg-type]
    )


def device_object(node: devices.NodeInventory) -> dict[str, Any]:
    """The Device resource describing `node`'s GPUs (what the node agent publishes)."""
    return {
        "apiVersion": f"{DEVICE_GROUP}/{DEVICE_VERSION}",
        "kind": "Device",
        "metadata": {"name": node.name},
        "spec": {
            "gpus": [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "model": g.model,
                    "memoryMiB": g.memory_mib,
                    "healthy": g.healthy,
                    "numaNode": g.numa_node,
                    **({"pcieSwitch": g.pcie_switch} if g.pcie_switch is not None else {}),
                }
                for g in node.gpus
            ],
            "nvlinks": [list(pair) for pair in sorted(node.nvlinks)],
        },
    }


def reservation_name(node: str, slot: int) -> str:
    return f"sharegpu-reserve-{node}-{slot}"[:253]
