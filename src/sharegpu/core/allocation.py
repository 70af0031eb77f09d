"""Allocations: which GPUs of which node a pod holds, per container, and their one JSON form.

The extender writes `Allocation.to_json()` into the pod's allocation annotation in the same
pods/binding write that binds it; every component rebuilds its state by parsing it back with
`Allocation.from_json`. The format is versioned (`"version": 1`) and documented in
docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import orjson

from sharegpu.core import errors, requests, units

ANNOTATION_VERSION = 1


@dataclass(frozen=True, slots=True)
class DeviceGrant:
    """One GPU given to one container: its index on the node and the share granted."""

    index: int
    milli: int
    memory_mib: int
    limit_milli: int
    uuid: str | None = None


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    name: str
    devices: tuple[DeviceGrant, ...]
    init: bool = False


@dataclass(frozen=True, slots=True)
class Allocation:
    """A pod's placement: node, per-container grants, host resources and co-tenancy labels."""

    pod: units.PodKey
    node: units.NodeName
    containers: tuple[ContainerAllocation, ...] = ()
    cpu_milli: int = 0
    memory_mib: int = 0
    cotenancy: requests.CoTenancy = requests.NO_RULES
    exclusive: bool = False
    """Whole GPUs: the pod holds its GPUs alone."""
    device_claim: bool = False
    """Held by a device claim (DRA), not by a pod: `pod` is the claim's key."""
    usage: Mapping[int, tuple[int, int]] = field(init=False, compare=False, repr=False)
    """Derived once: see `gpu_usage`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "usage", MappingProxyType(self._usage()))

    def gpu_usage(self) -> Mapping[int, tuple[int, int]]:
        """Per GPU index (ascending): (milli, memory MiB) the pod holds there.

        App containers and native sidecars run together, so their shares add up; a regular init
        container runs before them, beside the sidecars declared before it (`requests.peak`), and the
        pod holds the most of these at once.
        """
        return self.usage

    def _usage(self) -> dict[int, tuple[int, int]]:
        ordered: dict[int, list[tuple[bool, int, int]]] = {}
        for container in self.containers:  # in declared order, init containers first
            for grant in container.devices:
                ordered.setdefault(grant.index, []).append((container.init, grant.milli, grant.memory_mib))
        return {
            index: (
                requests.peak([(init, milli) for init, milli, _ in ordered[index]]),
                requests.peak([(init, memory) for init, _, memory in ordered[index]]),
            )
            for index in sorted(ordered)
        }

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        return tuple(self.gpu_usage())

    @property
    def gpu_milli_total(self) -> int:
        return sum(milli for milli, _ in self.gpu_usage().values())

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "version": ANNOTATION_VERSION,
            "node": self.node,
            "exclusive": self.exclusive,
            "containers": [
                {
                    "name": c.name,
                    "init": c.init,
                    "devices": [
                        {
                            "index": d.index,
                            "uuid": d.uuid,
                            "milli": d.milli,
                            "limitMilli": d.limit_milli,
                            "memoryMiB": d.memory_mib,
                        }
                        for d in c.devices
                    ],
                }
                for c in self.containers
            ],
        }
        rules = {
            key: value
            for key, value in (
                ("affinity", self.cotenancy.affinity),
                ("antiAffinity", self.cotenancy.anti_affinity),
                ("exclusion", self.cotenancy.exclusion),
                ("group", self.cotenancy.group),
            )
            if value is not None
        }
        if rules:
            body["cotenancy"] = rules
        return orjson.dumps(body).decode()

    @classmethod
    def from_json(cls, text: str | bytes, *, pod: units.PodKey, cpu_milli: int = 0, memory_mib: int = 0) -> Allocation:
        """Parse an allocation annotation; malformed text raises InvalidInputError naming the problem."""
        try:
            body = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise errors.InvalidInputError(f"allocation of {pod}: not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise errors.InvalidInputError(f"allocation of {pod}: expected a JSON object")
        version = body.get("version")
        if version != ANNOTATION_VERSION:
            raise errors.InvalidInputError(
                f"allocation of {pod}: unsupported version {version!r} (this build reads {ANNOTATION_VERSION})"
            )
        node = _field(body, "node", str, pod)
        containers_raw = _field(body, "containers", list, pod)
        containers = []
        for raw in containers_raw:
            if not isinstance(raw, dict):
                raise errors.InvalidInputError(f"allocation of {pod}: each container must be an object")
            devices = []
            for d in _field(raw, "devices", list, pod):
                if not isinstance(d, dict):
                    raise errors.InvalidInputError(f"allocation of {pod}: each device must be an object")
                grant = DeviceGrant(
                    index=_int(d, "index", pod, 0, units.MAX_GPUS_PER_NODE - 1),
                    milli=_int(d, "milli", pod, 1, units.MILLI_PER_GPU),
                    memory_mib=_int(d, "memoryMiB", pod, 0, 1 << 40),
                    limit_milli=_int(d, "limitMilli", pod, 1, units.MILLI_PER_GPU),
                    uuid=d.get("uuid") if isinstance(d.get("uuid"), str) else None,
                )
                devices.append(grant)
            containers.append(
                ContainerAllocation(
                    name=_field(raw, "name", str, pod), devices=tuple(devices), init=bool(raw.get("init", False))
                )
            )
        rules_raw = body.get("cotenancy", {})
        if not isinstance(rules_raw, dict):
            raise errors.InvalidInputError(f"allocation of {pod}: cotenancy must be an object")
        rules = requests.CoTenancy(
            affinity=rules_raw.get("affinity"),
            anti_affinity=rules_raw.get("antiAffinity"),
            exclusion=rules_raw.get("exclusion"),
            group=rules_raw.get("group"),
        ).scoped(pod.split("/", 1)[0])  # written before labels were scoped: read as the namespace's own
        return cls(
            pod=pod,
            node=units.NodeName(node),
            containers=tuple(containers),
            cpu_milli=cpu_milli,
            memory_mib=memory_mib,
            cotenancy=rules,
            exclusive=bool(body.get("exclusive", False)),
        )


def _field(body: Mapping[str, Any], key: str, kind: type, pod: str) -> Any:
    value = body.get(key)
    if not isinstance(value, kind):
        raise errors.InvalidInputError(f"allocation of {pod}: field {key!r} must be a {kind.__name__}")
    return value


def _int(body: Mapping[str, Any], key: str, pod: str, low: int, high: int) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise errors.InvalidInputError(f"allocation of {pod}: {key!r} must be an integer in {low}..{high}")
    return value


def build(
    pod: requests.PodRequest,
    node: units.NodeName,
    gpu_indices: Sequence[int],
    gpu_memory_mib: Sequence[int],
    gpu_uuids: Sequence[str] | None = None,
) -> Allocation:
    """The allocation that gives `pod` the GPUs `gpu_indices` of `node`.

    `gpu_memory_mib[i]` is the memory of the node's GPU i (to resolve whole GPUs and memory ratios).
    """
    demand = pod.demand
    if len(gpu_indices) != demand.count:
        raise errors.InvalidRequestError(f"pod {pod.key} needs {demand.count} GPU(s), {len(gpu_indices)} were chosen")
    containers: list[ContainerAllocation] = []
    next_whole = 0
    for container in pod.containers:
        gpu = container.gpu
        if gpu is None:
            continue
        if gpu.whole:
            # An init container runs beside the sidecars declared before it, on GPUs they do not hold;
            # the containers after it take its GPUs again.
            chosen = list(gpu_indices[next_whole : next_whole + gpu.count])
            if not container.init:
                next_whole += gpu.count
            grants = tuple(
                DeviceGrant(
                    index=i,
                    milli=units.MILLI_PER_GPU,
                    memory_mib=gpu_memory_mib[i],
                    limit_milli=units.MILLI_PER_GPU,
                    uuid=gpu_uuids[i] if gpu_uuids else None,
                )
                for i in chosen
            )
        else:
            grants = tuple(
                DeviceGrant(
                    index=i,
                    milli=gpu.milli,
                    memory_mib=max(gpu.memory_mib, gpu_memory_mib[i] * gpu.memory_permille // units.PERMILLE),
                    limit_milli=gpu.limit,
                    uuid=gpu_uuids[i] if gpu_uuids else None,
                )
                for i in gpu_indices
            )
        containers.append(ContainerAllocation(name=container.name, devices=grants, init=container.init))
    return Allocation(
        pod=pod.key,
        node=node,
        containers=tuple(containers),
        cpu_milli=pod.cpu_milli,
        memory_mib=pod.memory_mib,
        cotenancy=pod.cotenancy,
        exclusive=demand.whole and demand.count > 0,
    )
