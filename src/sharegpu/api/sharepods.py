"""KubeShare's SharePod (`kubeshare.nthu/v1`), as an optional compatibility CRD
(`sharegpu crds --compat kubeshare`).

A SharePod is a PodSpec with KubeShare's annotations (`kubeshare/gpu_request`, `gpu_limit`,
`gpu_mem`, `sched_affinity`, `sched_anti-affinity`, `sched_exclusion`, `GPUID`). As in KubeShare,
the controller creates the Pod behind it: same namespace and name, the SharePod's labels and
annotations, its spec, owned by it (the garbage collector deletes the Pod with the SharePod). The
Pod goes through sharegpu's webhook like any other, which translates KubeShare's annotations
(`GPUID` becomes `sharegpu.io/group`: pods with the same <node, GPUID> share one GPU) and turns a
`spec.nodeName` into a required node affinity, so sharegpu places it. The controller then mirrors
the Pod into the SharePod's status in KubeShare's format: `PodStatus`, `PodObjectMeta` and
`BoundDeviceID` (KubeShare's Go types carry no JSON tags, so those are the field names).

Pure: the types the controller reads and the functions that build the Pod and the status.
"""

from __future__ import annotations

import copy
from typing import Any, Final

import msgspec

from sharegpu.api import names, wire
from sharegpu.core import allocation, units

GROUP: Final = "kubeshare.nthu"
VERSION: Final = "v1"
LABEL: Final = f"{names.DOMAIN}/sharepod-uid"
"""On the Pod made for a SharePod: the SharePod's UID (the controller's informer selects by it)."""
LAST_APPLIED: Final = "kubectl.kubernetes.io/last-applied-configuration"

PodSpec = dict[str, Any]
"""The SharePod's spec: a PodSpec, kept as written (the API server validates it when the Pod is made)."""


class Status(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """KubeShare's SharePodStatus, with the field names its Go types write; Message is sharegpu's own."""

    pod_status: dict[str, Any] | None = msgspec.field(default=None, name="PodStatus")
    pod_object_meta: dict[str, Any] | None = msgspec.field(default=None, name="PodObjectMeta")
    bound_device_id: str = msgspec.field(default="", name="BoundDeviceID")
    message: str = msgspec.field(default="", name="Message")


class MadePod(wire.Message, kw_only=True, frozen=True):
    """The Pod made for a SharePod, as the controller reads it: its status is copied as it is."""

    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: wire.PodSpec = msgspec.field(default_factory=wire.PodSpec)
    status: dict[str, Any] = msgspec.field(default_factory=dict)


class SharePod(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=dict)
    status: Status = msgspec.field(default_factory=Status)


def pod_for(share: SharePod) -> dict[str, Any]:
    """The Pod a SharePod describes (see the module docstring)."""
    meta = share.metadata
    annotations = {k: v for k, v in meta.annotations.items() if k != LAST_APPLIED}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": meta.name,
            "namespace": meta.namespace,
            "labels": {**meta.labels, LABEL: meta.uid},
            "annotations": annotations,
            "ownerReferences": [wire.encode(wire.controller_reference(f"{GROUP}/{VERSION}", "SharePod", meta))],
        },
        "spec": copy.deepcopy(share.spec),
    }


def made_for(pod: MadePod, share: SharePod) -> bool:
    """Whether `pod` is the Pod this very SharePod made (not one of the same name made otherwise)."""
    return pod.metadata.labels.get(LABEL) == share.metadata.uid and any(
        ref.uid == share.metadata.uid for ref in pod.metadata.owner_references
    )


def gpu_indexes(pod: MadePod) -> list[int]:
    """The indexes of the GPUs sharegpu gave the Pod (from its allocation); empty until it is bound."""
    text = pod.metadata.annotations.get(names.ALLOCATION)
    if not text or not pod.spec.node_name:
        return []
    given = allocation.Allocation.from_json(text, pod=units.PodKey(wire.key(pod.metadata)), cpu_milli=0, memory_mib=0)
    return sorted(given.gpu_usage())


def status_of(pod: MadePod, devices: str) -> Status:
    """The SharePod's status from its Pod (`devices`: the GPUs it was given)."""
    meta = wire.encode(pod.metadata)
    kept = ("name", "namespace", "uid", "labels", "annotations", "creationTimestamp", "deletionTimestamp")
    return Status(
        pod_status=dict(pod.status),
        pod_object_meta={k: meta[k] for k in kept if k in meta},
        bound_device_id=devices,
    )
