"""The node's Device resource from what NVML reports: pure, no I/O.

- Indexes are stable by UUID: a GPU keeps the index the Device gave it before (allocations name
  GPUs by index, and NVML renumbers the GPUs behind one that fell off the bus); a new GPU takes its
  NVML index if free, else the lowest free one.
- A GPU with a critical XID, or that NVML cannot read, is marked unhealthy with the reason.
- A GPU gone from NVML is dropped, unless pods still hold it: then it stays, unhealthy, "gone".
- PCIe switches: NVML's common-ancestor levels group GPUs (the smallest index of a group names it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from sharegpu.agent import nvml
from sharegpu.api import devices as api_devices
from sharegpu.api import names, wire
from sharegpu.api import pods as api_pods
from sharegpu.core import allocation, devices, errors, units

MODEL_LABEL: Final = f"{names.DOMAIN}/gpu-model"
COUNT_LABEL: Final = f"{names.DOMAIN}/gpu-count"
HEALTHY_LABEL: Final = f"{names.DOMAIN}/gpu-healthy"
"""How many of the node's GPUs are healthy. Besides telling people, its change is a Node update
kube-scheduler sees: a pod the extender turned away waits in kube-scheduler's queue for a cluster
event (up to five minutes without one, from 1.27), and a GPU that heals changes nothing else
kube-scheduler watches (the Device is sharegpu's own resource)."""


def switches(count: int, links: Sequence[nvml.Link]) -> dict[int, int]:
    """NVML index -> its PCIe switch group (the smallest index behind the same switch)."""
    group = list(range(count))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for link in links:
        if link.same_switch:
            a, b = root(link.a), root(link.b)
            group[max(a, b)] = min(a, b)
    roots = {i: root(i) for i in range(count)}
    sizes = Counter(roots.values())
    return {i: r for i, r in roots.items() if sizes[r] > 1}


def device_spec(
    gpus: Sequence[nvml.Gpu],
    links: Sequence[nvml.Link],
    unhealthy: Mapping[str, str],
    previous: wire.DeviceSpec | None,
    held: set[str],
) -> wire.DeviceSpec:
    """The Device spec (see the module docstring). `unhealthy`: UUID -> why; `held`: UUIDs pods hold."""
    before = {g.uuid: g for g in previous.gpus} if previous is not None else {}
    taken: set[int] = set()
    index_of: dict[str, int] = {}
    for gpu in gpus:  # known GPUs keep their index
        known = before.get(gpu.uuid)
        if known is not None and known.index not in taken:
            index_of[gpu.uuid] = known.index
            taken.add(known.index)
    seen = {g.uuid for g in gpus}
    kept = [g for u, g in before.items() if u not in seen and u in held and g.index not in taken]
    taken.update(g.index for g in kept)
    for gpu in gpus:
        if gpu.uuid not in index_of:
            index = gpu.index if gpu.index not in taken else min(set(range(len(gpus) + len(kept) + 1)) - taken)
            index_of[gpu.uuid] = index
            taken.add(index)
    group = switches(len(gpus), links)
    out = [
        wire.GpuSpec(
            index=index_of[g.uuid], uuid=g.uuid, model=g.model, memory_mib=g.memory_mib,
            healthy=g.uuid not in unhealthy, numa_node=g.numa_node,
            pcie_switch=g.pcie_switch if g.pcie_switch is not None else _switch(group, g.index, index_of, gpus),
            minor=g.minor, mig=g.mig, reason=unhealthy.get(g.uuid, ""), **_facts(g),
        )
        for g in gpus
    ]  # fmt: skip
    out += [msgspec.structs.replace(g, healthy=False, reason=api_devices.GONE) for g in kept]
    out.sort(key=lambda g: g.index)
    nvlinks = sorted(
        tuple(sorted((index_of[gpus[link.a].uuid], index_of[gpus[link.b].uuid]))) for link in links if link.nvlinks
    )
    return wire.DeviceSpec(gpus=out, nvlinks=[(a, b) for a, b in nvlinks])


def _facts(gpu: nvml.Gpu) -> dict[str, str]:
    """What NVML says of a GPU that the Device carries for DRA selectors only."""
    return {
        "architecture": gpu.architecture, "compute_capability": gpu.compute_capability,
        "driver_version": gpu.driver_version, "cuda_driver_version": gpu.cuda_driver_version,
        "pci_bus_id": gpu.pci_bus_id, "pcie_root": gpu.pcie_root,
    }  # fmt: skip


def with_facts(spec: wire.DeviceSpec, gpus: Sequence[nvml.Gpu]) -> wire.DeviceSpec:
    """`spec` with what NVML says of each of its GPUs (by UUID) for DRA selectors: what a simulated
    node (`sharegpu devcluster`'s fake nodes) publishes as its agent on the fake NVML would."""
    said = {g.uuid: g for g in gpus}
    return msgspec.structs.replace(
        spec,
        gpus=[msgspec.structs.replace(g, **_facts(said[g.uuid])) if g.uuid in said else g for g in spec.gpus],
    )


def _switch(
    group: Mapping[int, int], nvml_index: int, index_of: Mapping[str, int], gpus: Sequence[nvml.Gpu]
) -> int | None:
    root = group.get(nvml_index)
    return None if root is None else index_of[gpus[root].uuid]


_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")


def isolation_label(mode: devices.Isolation) -> str:
    """The node label saying the node offers `mode` (value "true")."""
    return f"{names.DOMAIN}/isolation-{mode.value}"


def node_labels(spec: wire.DeviceSpec) -> dict[str, str | None]:
    """The node's GPU labels: its model (the most common, as a label value), GPU count, healthy GPU
    count (`HEALTHY_LABEL`), and one per isolation mode it offers; None (remove) for what it does not
    have."""
    offered = set(spec.isolation)
    modes: dict[str, str | None] = {
        isolation_label(m): "true" if m.value in offered else None for m in devices.Isolation
    }
    if not spec.gpus:
        return {MODEL_LABEL: None, COUNT_LABEL: None, HEALTHY_LABEL: None, **modes}
    models = [g.model for g in spec.gpus]
    model = max(sorted(set(models)), key=models.count)
    value = _LABEL_VALUE.sub("-", model).strip("-_.")[:63].rstrip("-_.")
    healthy = str(sum(1 for g in spec.gpus if g.healthy))
    return {MODEL_LABEL: value or None, COUNT_LABEL: str(len(spec.gpus)), HEALTHY_LABEL: healthy, **modes}


def held_uuids(pods: Sequence[wire.Pod], spec: wire.DeviceSpec | None) -> set[str]:
    """The UUIDs the node's live pods hold: reported by GPU-holding pods (reservations, group
    holders), or named by index in sharing pods' allocations (through the Device's indexes)."""
    by_index = {g.index: g.uuid for g in spec.gpus} if spec is not None else {}
    out: set[str] = set()
    for pod in pods:
        if api_pods.is_terminal(pod):
            continue
        annotations = pod.metadata.annotations
        out.update(u for u in annotations.get(names.GPU_UUID, "").split(",") if u)
        text = annotations.get(names.ALLOCATION)
        if not text:
            continue
        try:
            alloc = allocation.Allocation.from_json(text, pod=units.pod_key(pod.metadata.namespace, pod.metadata.name))
        except errors.InvalidInputError:
            continue  # not one of ours to judge: the extender's reconcilers deal with it
        out.update(by_index[d.index] for c in alloc.containers for d in c.devices if d.index in by_index)
    return out
