"""What each node's pods use of its GPUs, as the API keeps it: one `GpuUsage` per node, named after it
(its `status`: observed figures, written through the status subresource).

The node agent measures every pass (memory per process, SM utilisation per process where NVML
samples it: `agent.watchdog`) and writes the node's GpuUsage now and then (`agent.usagereport`:
at most once per `--usage-interval`, and only when something changed beyond the noise); readers
(`kubectl sharegpu top`, the GPU map) list them. Per GPU: its memory and SM use as a whole; per pod
and GPU: the share it was given beside what it uses, and the same per container.

The figures are the agent's last pass when it wrote (`observedAt`); a reader says how old they are.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from sharegpu.api import names, wire

REFRESH: float = 300.0
"""Seconds after which an agent writes unchanged figures again (their `observedAt` renewed): a reader
tells a live agent's steady figures from a dead one's, and idle policies count idle time by them."""

Count = Annotated[int, Meta(ge=0)]
Percent = Annotated[int, Meta(ge=0, le=100)]


class ContainerUse(wire.Message, kw_only=True, frozen=True):
    name: str
    """"" for processes in the pod's own cgroup (or a container the kubelet had not reported)."""
    used_mib: Count = msgspec.field(name="usedMiB")
    sm_percent: Percent | None = None


class PodUse(wire.Message, kw_only=True, frozen=True):
    namespace: str
    name: str
    uid: str
    uuid: str
    """The GPU it uses."""
    used_mib: Count = msgspec.field(name="usedMiB")
    sm_percent: Percent | None = None
    """None: the GPU takes no per-process samples (MIG), or none were read."""
    share_milli: Count | None = None
    """The compute it was given there (None: not known)."""
    allocated_mib: Count | None = msgspec.field(default=None, name="allocatedMiB")
    """The memory it was given there (None: no limit, or not known)."""
    containers: list[ContainerUse] = msgspec.field(default_factory=list)


class GpuUse(wire.Message, kw_only=True, frozen=True):
    uuid: str
    index: Count | None = None
    memory_mib: Count | None = msgspec.field(default=None, name="memoryMiB")
    used_mib: Count = msgspec.field(name="usedMiB")
    sm_percent: Percent | None = None


class UsageSpec(wire.Message, kw_only=True, frozen=True):
    node: Annotated[str, Meta(min_length=1, description="The node whose GPUs these are (the object's own name).")]


class UsageStatus(wire.Message, kw_only=True, frozen=True):
    observed_at: Annotated[str, Meta(description="When the agent measured these figures (RFC 3339).")] = ""
    interval_seconds: Annotated[int, Meta(ge=0, description="How often the agent measures (its pass).")] = 0
    gpus: list[GpuUse] = msgspec.field(default_factory=list)
    pods: list[PodUse] = msgspec.field(default_factory=list)


class GpuUsage(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: UsageSpec
    status: UsageStatus = msgspec.field(default_factory=UsageStatus)


def report(
    node: str,
    owner: wire.OwnerReference | None,
    observed_at: str,
    interval_seconds: int,
    gpus: list[GpuUse],
    pods: list[PodUse],
) -> GpuUsage:
    """Node `node`'s GpuUsage as its agent writes it (owned by the Node: it goes with it)."""
    return GpuUsage(
        api_version=names.GROUP_VERSION,
        kind=names.USAGE_KIND,
        metadata=wire.ObjectMeta(name=node, owner_references=[owner] if owner is not None else []),
        spec=UsageSpec(node=node),
        status=UsageStatus(observed_at=observed_at, interval_seconds=interval_seconds, gpus=gpus, pods=pods),
    )


def same_within_noise(a: UsageStatus, b: UsageStatus, *, mib: int = 64, points: int = 5) -> bool:
    """Whether two reports of a node say the same but for noise: the same GPUs and pods (and
    containers), every memory figure within `mib`, every SM figure within `points`."""
    if [(g.uuid, g.index, g.memory_mib) for g in a.gpus] != [(g.uuid, g.index, g.memory_mib) for g in b.gpus]:
        return False
    keys = [(p.uid, p.uuid, p.share_milli, p.allocated_mib, [c.name for c in p.containers]) for p in a.pods]
    if keys != [(p.uid, p.uuid, p.share_milli, p.allocated_mib, [c.name for c in p.containers]) for p in b.pods]:
        return False
    pairs: list[tuple[int, int | None, int, int | None]] = [
        *((x.used_mib, x.sm_percent, y.used_mib, y.sm_percent) for x, y in zip(a.gpus, b.gpus, strict=True)),
        *((x.used_mib, x.sm_percent, y.used_mib, y.sm_percent) for x, y in zip(a.pods, b.pods, strict=True)),
        *(
            (c.used_mib, c.sm_percent, d.used_mib, d.sm_percent)
            for x, y in zip(a.pods, b.pods, strict=True)
            for c, d in zip(x.containers, y.containers, strict=True)
        ),
    ]
    return all(
        abs(m1 - m2) <= mib and (s1 is None) == (s2 is None) and (s1 is None or s2 is None or abs(s1 - s2) <= points)
        for m1, s1, m2, s2 in pairs
    )


def read(body: object) -> GpuUsage:
    """A GpuUsage as the API returns it; InvalidInputError naming what is malformed."""
    return wire.convert(body, GpuUsage)
