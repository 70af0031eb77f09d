"""The SharedDeviceGroup resource: a named set of GPUs on one node that many pods join.

A group holds `gpus` GPUs of one node (whole, or a share of each) through its holder pod; a pod
joins it with the annotation `sharegpu.io/device-group: <name>` and sees exactly the group's devices
(and, for a share, the share's limits).
These types are what the controller and the extender read and write, and the CRD's schema is
generated from them (`api.resources`), so the API server refuses what the code would not read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from sharegpu.api import handoff, names, pods, wire
from sharegpu.core import errors

PHASE_PENDING: Final = "Pending"
PHASE_BOUND: Final = "Bound"
PHASE_FAILED: Final = "Failed"

Strategy = Literal["binpack", "spread"]
Phase = Literal["Pending", "Bound", "Failed"]
Name = Annotated[str, Meta(min_length=1, max_length=253)]


class Share(wire.Message, kw_only=True, frozen=True):
    """A share of each of the group's GPUs instead of whole ones."""

    milli: Annotated[int, Meta(ge=1, le=1000, description="Compute per GPU, in milli-GPU.")]
    memory_mib: Annotated[
        int, Meta(ge=0, le=1 << 30, description="Memory per GPU in MiB; 0: the same share of each GPU's memory.")
    ] = msgspec.field(default=0, name="memoryMiB")


class Members(wire.Message, kw_only=True, frozen=True):
    """Who may join: pods of the group's namespace, and of these namespaces too."""

    namespaces: list[Name] = msgspec.field(default_factory=list)


class GroupSpec(wire.Message, kw_only=True, frozen=True):
    """How many GPUs the group holds, where, and who may join it."""

    gpus: Annotated[int, Meta(ge=1, le=64, description="How many GPUs of one node the group holds.")]
    share: Share | None = None
    scheduling_strategy: Annotated[
        Strategy, Meta(description="binpack: the fullest node that fits; spread: the emptiest.")
    ] = "binpack"
    node_selector: dict[str, str] = msgspec.field(default_factory=dict)
    models: Annotated[list[Name], Meta(description="GPU models the group may use; empty: any.")] = msgspec.field(
        default_factory=list
    )
    members: Members = msgspec.field(default_factory=Members)
    bind_eagerly: Annotated[bool, Meta(description="Bind at creation instead of when the first member schedules.")] = (
        False
    )


class GroupDevice(wire.Message, kw_only=True, frozen=True):
    index: Annotated[int, Meta(ge=0, le=62)]
    uuid: str = ""


class Condition(wire.Message, kw_only=True, frozen=True):
    """A condition as Kubernetes writes them (metav1.Condition's fields)."""

    type: Name
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0


class GroupStatus(wire.Message, kw_only=True, frozen=True):
    phase: Phase = "Pending"
    node_name: str = ""
    devices: list[GroupDevice] = msgspec.field(default_factory=list)
    member_pods: Annotated[list[str], Meta(description="namespace/name of each member pod.")] = msgspec.field(
        default_factory=list
    )
    conditions: list[Condition] = msgspec.field(default_factory=list)
    observed_generation: int = 0


class SharedDeviceGroup(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: GroupSpec
    status: GroupStatus = msgspec.field(default_factory=GroupStatus)


# ----------------------------------------------------------------- what the controller and webhook write

BOUND: Final = "true"
"""The value of a group's node label on the node it is bound to."""
VISIBLE_DEVICES: Final = handoff.VISIBLE_DEVICES
LIMITS: Final = (handoff.SM_LIMIT, handoff.MPS_THREADS, handoff.MEMORY_LIMIT, handoff.MPS_MEMORY)
"""What a share group's members are limited by (the share of each GPU): the keys of the group's
hand-off ConfigMap besides NVIDIA_VISIBLE_DEVICES, read as optional env references (a whole-GPU
group writes none of them)."""
MEMBER_VARIABLES: Final = (VISIBLE_DEVICES, *LIMITS)
"""Every variable a member reads from the group's hand-off ConfigMap, under its own name as key."""


def _digest(namespace: str, name: str) -> str:
    return hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:16]


def node_label(namespace: str, name: str) -> str:
    """The label of the node a group is bound to: its members select it (`nodeSelector`), so they
    cannot be scheduled before the group is bound, and only there after."""
    return f"{names.DOMAIN}/group-{_digest(namespace, name)}"


def _object_name(prefix: str, namespace: str, name: str) -> str:
    """A DNS-1123 name for a group's object: readable, cut to fit, unique by a digest."""
    readable = f"{prefix}{namespace}-{name}"[:200].rstrip("-.")
    return f"{readable}-{_digest(namespace, name)[:8]}"


def holder_name(namespace: str, name: str) -> str:
    return _object_name(names.GROUP_PREFIX, namespace, name)


def handoff_name(namespace: str, name: str) -> str:
    """The ConfigMap (in each member's namespace) whose NVIDIA_VISIBLE_DEVICES the members read."""
    return _object_name(names.GROUP_PREFIX, namespace, name)


def holder_handoff_name(namespace: str, name: str) -> str:
    """The hand-off ConfigMap (beside the holder, in the holding namespace) the extender writes for a
    share group's holder."""
    return _object_name(names.HANDOFF_PREFIX + "group-", namespace, name)


def member_env(container: dict[str, Any], namespace: str, name: str) -> None:
    """Make a member's container read the group's devices (required: it waits for them) and limits
    (optional) from the group's hand-off ConfigMap; whatever the author set for them is replaced."""
    source = handoff_name(namespace, name)
    env = [e for e in container.get("env") or [] if e.get("name") not in MEMBER_VARIABLES]
    for variable in MEMBER_VARIABLES:
        ref = {"name": source, "key": variable, **({} if variable == VISIBLE_DEVICES else {"optional": True})}
        env.append({"name": variable, "valueFrom": {"configMapKeyRef": ref}})
    container["env"] = env


def member_handoff(holder: dict[str, str]) -> dict[str, str] | None:
    """The group's hand-off data from its share holder's (the extender's `<container>.<VARIABLE>`
    keys): the same devices and limits, a single memory limit for every GPU (the smallest of the
    holder's, which are equal unless the node mixes GPU models). None until the devices are there."""
    mine = {k.split(".", 1)[1]: v for k, v in holder.items() if k.startswith(f"{pods.RESERVE_CONTAINER}.")}
    if not mine.get(VISIBLE_DEVICES):
        return None
    copied: tuple[str, ...] = (VISIBLE_DEVICES, handoff.SM_LIMIT, handoff.MPS_THREADS, handoff.MPS_MEMORY)
    out: dict[str, str] = {k: mine[k] for k in copied if k in mine}
    memory = [v for k, v in mine.items() if k == handoff.MEMORY_LIMIT or k.startswith(f"{handoff.MEMORY_LIMIT}_")]
    if memory:
        out[handoff.MEMORY_LIMIT] = min(memory, key=lambda v: int(v.rstrip("m")))
    return out


def group_labels(namespace: str, name: str) -> dict[str, str]:
    """Labels naming the group (values cut to a label's 63 characters; names of that length are rare
    and the digest in the object names keeps those apart)."""
    return {names.LABEL_GROUP_NAMESPACE: namespace[:63], names.LABEL_GROUP_NAME: name[:63]}


def group_selector(namespace: str, name: str) -> str:
    """The label selector of the group's pods and ConfigMaps."""
    return ",".join(f"{k}={v}" for k, v in group_labels(namespace, name).items())


def membership(annotations: dict[str, str], namespace: str) -> tuple[str, str] | None:
    """(namespace, name) of the group a pod joins (`name` or `namespace/name`; the shared-device-group
    project's annotation names a group of the pod's namespace); None if it joins none.
    InvalidRequestError if the annotation is malformed or the two annotations name different groups."""
    value = annotations.get(names.DEVICE_GROUP_ANNOTATION)
    compat = annotations.get(names.DEVICESHARE_GROUP_ANNOTATION)
    if compat is not None:
        joined = compat.strip()
        if not joined or "/" in joined:
            raise errors.InvalidRequestError(
                f"{names.DEVICESHARE_GROUP_ANNOTATION} must be the name of a group in the pod's namespace, "
                f"got {compat!r}"
            )
        if value is not None and _parse(value, namespace) != (namespace, joined):
            raise errors.InvalidRequestError(
                f"{names.DEVICE_GROUP_ANNOTATION} ({value!r}) and {names.DEVICESHARE_GROUP_ANNOTATION} ({compat!r}) "
                "name different groups: keep one"
            )
        return namespace, joined
    return None if value is None else _parse(value, namespace)


def _parse(value: str, namespace: str) -> tuple[str, str]:
    parts = value.strip().split("/")
    if len(parts) == 1 and parts[0]:
        return namespace, parts[0]
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1]
    raise errors.InvalidRequestError(
        f"{names.DEVICE_GROUP_ANNOTATION} must be a group's name or namespace/name, got {value!r}"
    )


def live_member(pod: wire.Pod, home: str, admitted: Collection[str]) -> bool:
    """Whether a pod labelled with a group (of namespace `home`, admitting pods of `admitted` too)
    counts as its member: in a namespace the group admits (a label is anyone's to set), not one of
    sharegpu's own pods (its holder), neither finished nor being deleted."""
    meta = pod.metadata
    return (
        (meta.namespace == home or meta.namespace in admitted)
        and pods.role(pod) is None
        and not pods.is_terminal(pod)
        and meta.deletion_timestamp is None
    )


def holder_guard(namespace: str, name: str) -> dict[str, Any]:
    """The PodDisruptionBudget beside a group's holder pod that allows it no eviction (`kubectl drain`,
    the Eviction API): kept while members run on the holder's GPUs, which the extender's ledger frees
    the moment the holder goes."""
    labels = group_labels(namespace, name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": holder_name(namespace, name),
            "namespace": names.HOLDING_NAMESPACE,
            "labels": {names.LABEL_ROLE: names.ROLE_GROUP_GUARD, **labels},
        },
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": {names.LABEL_ROLE: names.ROLE_GROUP_HOLDER, **labels}},
        },
    }


PLACEMENT_FIELDS: Final = ("gpus", "share", "schedulingStrategy", "nodeSelector", "models")
"""The spec's fields (as written) that say what a group holds and where: fixed once it is bound (its
holder and members use them); `members` and `bindEagerly` may change at any time."""


def placement(spec: GroupSpec) -> dict[str, Any]:
    """The spec's placement fields (`PLACEMENT_FIELDS`) as written."""
    written = wire.encode(spec)
    return {field: written.get(field) for field in PLACEMENT_FIELDS}


def placement_digest(spec: GroupSpec) -> str:
    """A digest of the spec's placement, written on the holder made for it (`names.GROUP_PLACEMENT`)."""
    return hashlib.sha256(msgspec.json.encode(placement(spec), order="sorted")).hexdigest()[:16]


def changed_placement(old: GroupSpec, new: GroupSpec) -> list[str]:
    """The placement fields (`PLACEMENT_FIELDS`, as written) that differ between two specs."""
    before, after = placement(old), placement(new)
    return [field for field in PLACEMENT_FIELDS if before[field] != after[field]]


def may_join(group: SharedDeviceGroup, namespace: str) -> bool:
    return namespace == group.metadata.namespace or namespace in group.spec.members.namespaces


def holder_pod(group: SharedDeviceGroup, image: str, node: str = "") -> dict[str, Any]:
    """The pod that holds the group's GPUs, placed by sharegpu with the group's node selector, models
    and strategy (it waits for room: it preempts no one); `node` pins it (a bound group never moves).
    Whole GPUs: `nvidia.com/gpu`, the device plugin's GPUs, which it reports. A share: sharegpu's
    resources, held like a sharing pod's (reservation pods, a hand-off ConfigMap the extender writes,
    named in its annotation)."""
    meta, spec = group.metadata, group.spec
    annotations = {names.MODELS: ",".join(spec.models)} if spec.models else {}
    annotations[names.PLACEMENT] = spec.scheduling_strategy
    annotations[names.GROUP_PLACEMENT] = placement_digest(spec)
    share, role = None, names.ROLE_GROUP_HOLDER
    if spec.share is not None:
        share, role = (spec.share.milli, spec.share.memory_mib), names.ROLE_GROUP_SHARE
        annotations[names.HANDOFF] = holder_handoff_name(meta.namespace, meta.name)
        if not spec.share.memory_mib:
            annotations[names.MEMORY_PERMILLE] = str(spec.share.milli)
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": holder_name(meta.namespace, meta.name),
            "namespace": names.HOLDING_NAMESPACE,
            "labels": {names.LABEL_ROLE: names.ROLE_GROUP_HOLDER, **group_labels(meta.namespace, meta.name)},
            "annotations": annotations,
        },
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            "serviceAccountName": names.RESERVE_ACCOUNT,
            "nodeSelector": dict(spec.node_selector),
            "priorityClassName": "system-cluster-critical",  # nothing preempts it; it preempts no one
            # (the extender's preemption leaves sharegpu's own pods out both ways, `extender.preemption`)
            "terminationGracePeriodSeconds": 5,
            "containers": [pods.reserve_container(image, spec.gpus, role=role, share=share)],
        },
    }
    if node:
        pin = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        body["spec"]["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [pin]}}
        }
    return body
