"""Pod groups of other schedulers, read as sharegpu gangs: which group a pod names, and what of it is honoured.

A pod names its group the way its scheduler expects; the webhook reads that group at admission
(`reference`, then the object at `GroupRef.path`) and writes sharegpu's gang annotations from it
(`gang_annotations`), with one admission Warning per field it does not honour. docs/gangs.md
tables, per format, how a pod names its group and which fields are honoured; each reader below
(`_kubernetes`, `_coscheduling`, `_volcano`, `_kai`) is one row. The formats are those of Kubernetes'
Workload API (scheduling.k8s.io/v1beta1 in 1.37, GenericWorkload), scheduler-plugins' coscheduling
(scheduling.x-k8s.io/v1alpha1, scheduling.sigs.k8s.io before), Volcano (scheduling.volcano.sh/v1beta1)
and KAI (scheduling.run.ai/v2alpha2); Kueue's pod groups live on the pods (`api.gangs.translate`).

A group whose policy is not a gang (Kubernetes' `basic`; a minimum of 1) makes no gang. Queues and
priorities are Kueue's and the pod's own (docs/queues.md), not the group's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta

from sharegpu.api import gangs, names, paths, quantity, wire
from sharegpu.core import errors

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    group: str
    version: str
    plural: str = "podgroups"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


KUBERNETES: Final = Format("kubernetes", "scheduling.k8s.io", "v1beta1")
COSCHEDULING: Final = Format("coscheduling", "scheduling.x-k8s.io", "v1alpha1")
COSCHEDULING_LEGACY: Final = Format("coscheduling", "scheduling.sigs.k8s.io", "v1alpha1")
VOLCANO: Final = Format("volcano", "scheduling.volcano.sh", "v1beta1")
KAI: Final = Format("kai", "scheduling.run.ai", "v2alpha2")
FORMATS: Final = (KUBERNETES, COSCHEDULING, COSCHEDULING_LEGACY, VOLCANO, KAI)

COSCHEDULING_LABEL: Final = "scheduling.x-k8s.io/pod-group"
COSCHEDULING_LEGACY_LABEL: Final = "pod-group.scheduling.sigs.k8s.io"
VOLCANO_ANNOTATION: Final = "scheduling.k8s.io/group-name"
KAI_ANNOTATION: Final = "pod-group-name"


@dataclass(frozen=True, slots=True)
class GroupRef:
    """The group object a pod names."""

    format: Format
    namespace: str
    name: str

    @property
    def path(self) -> str:
        f = self.format
        return paths.custom(f.group, f.version, f.plural, self.namespace, self.name)

    def __str__(self) -> str:
        return f"{self.format.name} PodGroup {self.namespace}/{self.name} ({self.format.api_version})"


def reference(
    namespace: str, spec: Mapping[str, Any], labels: Mapping[str, str], annotations: Mapping[str, str]
) -> GroupRef | None:
    """The group a pod names, in the first format that it uses (None: none, or the pod states its
    gang in sharegpu's own annotations, which win)."""
    if names.GANG in annotations:
        return None
    scheduling_group = spec.get("schedulingGroup")
    if isinstance(scheduling_group, Mapping) and isinstance(scheduling_group.get("podGroupName"), str):
        return GroupRef(KUBERNETES, namespace, scheduling_group["podGroupName"])
    for source, key, fmt in (
        (labels, COSCHEDULING_LABEL, COSCHEDULING),
        (labels, COSCHEDULING_LEGACY_LABEL, COSCHEDULING_LEGACY),
        (annotations, VOLCANO_ANNOTATION, VOLCANO),
        (annotations, KAI_ANNOTATION, KAI),
    ):
        value = source.get(key)
        if value:
            return GroupRef(fmt, namespace, value)
    return None


def gang_annotations(ref: GroupRef, group: Json) -> tuple[dict[str, str], list[str]]:
    """sharegpu's gang annotations for a member of `group` (empty: the group is no gang), and a
    Warning per field set there that is not honoured. InvalidRequestError names a malformed field."""
    spec = group.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    reader = _READERS[ref.format.name]
    minimum, timeout, topology, ignored = reader(spec)
    warnings = [f"{ref}: spec.{field} is not honoured by sharegpu ({why})" for field, why in ignored]
    if minimum <= 1:
        return {}, warnings
    out = {names.GANG: ref.name, names.GANG_MIN: str(minimum)}
    if timeout is not None:
        out[names.GANG_TIMEOUT] = str(timeout)
    if topology:
        out[names.GANG_TOPOLOGY] = topology
    gangs.of(ref.namespace, out)  # the translation is held to the same checks as a pod's own
    return out, warnings


Read = tuple[int, int | None, str | None, list[tuple[str, str]]]
"""Minimum, timeout (None: sharegpu's default), topology label (None: any nodes), and the fields set
that are not honoured with why."""
QUEUE = "queues are Kueue's: docs/queues.md"
PRIORITY = "a pod's own priority class decides"
RESOURCES = "each member's own request is placed"


def _unhonoured(spec: Json, *fields: tuple[str, str]) -> list[tuple[str, str]]:
    """The (field, why) pairs whose field the group's spec sets."""
    return [(field, why) for field, why in fields if spec.get(field)]


def _count(value: object, what: str) -> int:
    return 0 if value is None else quantity.integer(value, what, 0, gangs.MAX_MEMBERS)


def _kubernetes(spec: Json) -> Read:
    policy = spec.get("schedulingPolicy") or {}
    gang = policy.get("gang") if isinstance(policy, dict) else None
    minimum = _count(gang.get("minCount"), "spec.schedulingPolicy.gang.minCount") if isinstance(gang, dict) else 0
    constraints = spec.get("schedulingConstraints") or {}
    keys = [t.get("key") for t in (constraints.get("topology") or []) if isinstance(t, dict)]
    ignored = _unhonoured(
        spec,
        ("priorityClassName", PRIORITY),
        ("priority", PRIORITY),
        ("disruptionMode", "a member that ends does not end the others"),
        ("resourceClaims", "a gang's members bring their own claims"),
    )
    if len(keys) > 1:
        ignored.append(("schedulingConstraints.topology[1:]", "one topology key is honoured, the first"))
    first = keys[0] if keys and isinstance(keys[0], str) else None
    return minimum, None, first, ignored


def _coscheduling(spec: Json) -> Read:
    timeout = spec.get("scheduleTimeoutSeconds")
    seconds = (
        None if timeout is None else quantity.integer(timeout, "spec.scheduleTimeoutSeconds", 1, gangs.MAX_TIMEOUT)
    )
    ignored = _unhonoured(spec, ("minResources", RESOURCES))
    return _count(spec.get("minMember"), "spec.minMember"), seconds, None, ignored


def _volcano(spec: Json) -> Read:
    ignored = _unhonoured(
        spec,
        ("queue", QUEUE),
        ("priorityClassName", PRIORITY),
        ("minTaskMember", "the group's minimum is honoured, not each task's"),
        ("minResources", RESOURCES),
    )
    return _count(spec.get("minMember"), "spec.minMember"), None, None, ignored


def _kai(spec: Json) -> Read:
    constraint = spec.get("topologyConstraint") or {}
    required = constraint.get("requiredTopologyLevel") if isinstance(constraint, dict) else None
    ignored = _unhonoured(
        spec,
        ("queue", QUEUE),
        ("priorityClassName", PRIORITY),
        ("subGroups", "the group's minimum is honoured, not each subgroup's"),
    )
    if isinstance(constraint, dict) and constraint.get("preferredTopologyLevel"):
        ignored.append(("topologyConstraint.preferredTopologyLevel", "a gang is packed onto few nodes anyway"))
    return (
        _count(spec.get("minMember"), "spec.minMember"),
        None,
        required if isinstance(required, str) else None,
        ignored,
    )


_READERS = {"kubernetes": _kubernetes, "coscheduling": _coscheduling, "volcano": _volcano, "kai": _kai}


# ----------------------------------------------------------------- the groups sharegpu serves (`--compat`)
# Written from each project's documented API; the fields sharegpu does not model are kept as written
# (the definitions preserve unknown fields), so that nothing a user set is pruned away.

Members = Annotated[int, Meta(ge=0, le=gangs.MAX_MEMBERS)]


class CoschedulingSpec(wire.Message, kw_only=True, frozen=True):
    """scheduler-plugins' coscheduling PodGroup."""

    min_member: Annotated[Members, Meta(description="Members placed together before any is bound.")] = 0
    min_resources: dict[str, Any] = msgspec.field(default_factory=dict)
    schedule_timeout_seconds: Annotated[int, Meta(ge=1, le=gangs.MAX_TIMEOUT)] | None = None


class VolcanoSpec(wire.Message, kw_only=True, frozen=True):
    """Volcano's PodGroup."""

    min_member: Annotated[Members, Meta(description="Members placed together before any is bound.")] = 0
    min_task_member: dict[str, int] = msgspec.field(default_factory=dict)
    queue: str = ""
    priority_class_name: str = ""
    min_resources: dict[str, Any] = msgspec.field(default_factory=dict)


class KaiTopologyConstraint(wire.Message, kw_only=True, frozen=True):
    preferred_topology_level: str = ""
    required_topology_level: Annotated[
        str, Meta(description="A node label every member's node shares one value of.")
    ] = ""
    topology: str = ""


class KaiSpec(wire.Message, kw_only=True, frozen=True):
    """KAI's PodGroup."""

    min_member: Annotated[Members, Meta(description="Members placed together before any is bound.")] = 0
    queue: str = ""
    priority_class_name: str = ""
    topology_constraint: KaiTopologyConstraint = msgspec.field(default_factory=KaiTopologyConstraint)
    sub_groups: list[dict[str, Any]] = msgspec.field(default_factory=list)


def missing(ref: GroupRef) -> errors.InvalidRequestError:
    """The refusal of a pod whose group does not exist (yet)."""
    return errors.InvalidRequestError(f"{ref} does not exist: create the group before its pods")
