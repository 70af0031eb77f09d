"""GPU quotas that count every GPU: the accounting totals of a request, and the ResourceQuota limits
on them.

One definition for both enforcers: the webhook writes a container's totals
(`container_totals`) as the resources `names.QUOTA_RESOURCES`, which Kubernetes' own quota
admission counts when a pod is created; the extender checks a pod's totals (`pod_totals`, as
Kubernetes sums a pod: its app containers, or its largest init container if that is more) against
the namespace's ResourceQuotas again when it places the pod (`refusal`), so a quota created or
lowered after pods were admitted still holds for the pods that have not started yet.

Pure: ResourceQuota objects in, a refusal message (or None) out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from sharegpu.api import names, quantity, wire
from sharegpu.core import errors, requests


class QuotaSpec(wire.Message, kw_only=True, frozen=True):
    hard: dict[str, str] = msgspec.field(default_factory=dict)


class ResourceQuota(wire.Message, kw_only=True, frozen=True):
    """The part of a ResourceQuota the extender reads."""

    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: QuotaSpec = msgspec.field(default_factory=QuotaSpec)


@dataclass(frozen=True, slots=True)
class Limit:
    """One ResourceQuota's hard limits on sharegpu's totals (None: not limited)."""

    name: str
    milli: int | None
    memory_mib: int | None


def container_totals(gpu: requests.GpuRequest | None) -> tuple[int, int | None]:
    """A container's totals: GPU count x compute per GPU (a whole GPU is 1000), and GPU count x memory
    per GPU when it is given in MiB (None otherwise)."""
    if gpu is None:
        return 0, None
    return gpu.count * gpu.milli, gpu.count * gpu.memory_mib if gpu.memory_mib else None


def pod_totals(request: requests.PodRequest) -> tuple[int, int]:
    """A pod's totals as Kubernetes' quota sums a pod (`requests.peak`): app containers and native
    sidecars add up; a regular init container counts beside the sidecars declared before it."""
    totals = [(c.init, container_totals(c.gpu)) for c in request.containers]
    milli = requests.peak([(init, m) for init, (m, _) in totals])
    memory = requests.peak([(init, m or 0) for init, (_, m) in totals])
    return milli, memory


def limit(quota: ResourceQuota) -> Limit | None:
    """The quota's limits on the totals (`requests.<resource>` or `<resource>`, the lower of the two);
    None when it limits neither. A malformed value is the API server's to refuse: not here."""
    found: list[int | None] = []
    for resource in names.QUOTA_RESOURCES:
        values = []
        for key in (f"requests.{resource}", resource):
            if key in quota.spec.hard:
                try:
                    values.append(int(quantity.parse(quota.spec.hard[key])))
                except errors.InvalidInputError:
                    continue
        found.append(min(values) if values else None)
    milli, memory = found
    if milli is None and memory is None:
        return None
    return Limit(quota.metadata.name, milli, memory)


def refusal(namespace: str, limits: Iterable[Limit], held: tuple[int, int], asks: tuple[int, int]) -> str | None:
    """Why a pod that `asks` these totals may not be placed while the namespace's placed pods hold
    `held`; None if every limit allows it."""
    for item in limits:
        for what, resource, cap, used, more in (
            ("milli-GPU", names.GPU_MILLI_TOTAL, item.milli, held[0], asks[0]),
            ("MiB of GPU memory", names.GPU_MEMORY_TOTAL, item.memory_mib, held[1], asks[1]),
        ):
            if cap is not None and more and used + more > cap:
                return (
                    f"namespace {namespace}: ResourceQuota {item.name} allows {cap} {what} "
                    f"(requests.{resource}); its placed pods hold {used} and this pod asks {more}: it waits "
                    "until they free some, or the quota is raised"
                )
    return None
