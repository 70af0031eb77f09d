"""Gangs: pods placed all or nothing, as sharegpu's annotations state them, and the formats translated into them.

A pod joins a gang of its namespace with `sharegpu.io/gang: NAME` and says how many members must be
placed together with `sharegpu.io/gang-min: N`; optional `sharegpu.io/gang-timeout` (seconds a
placed gang's members have to reach their binding) and `sharegpu.io/gang-topology` (a node label
whose one value every member's node shares). Every member states the same values: a member that
disagrees makes the gang unplaceable, named as such, until it is gone (`Gang.agrees`).

What a gang holds before it completes (docs/gangs.md): nothing while fewer than its minimum of
members exist or fit. Once they fit, every waiting member that fits is planned at once (at least the
minimum, up to all of them); the plan holds their GPUs for at most the timeout, and each member's
binding waits until every planned member has reached its own, so the gang is bound together. Members
beyond the minimum that did not fit are placed later, one by one, as any pod.

Formats translated into these annotations by the webhook (`translate`): Kueue's plain pod groups
(label `kueue.x-k8s.io/pod-group-name`, annotation `kueue.x-k8s.io/pod-group-total-count`: every
pod of the group, so the minimum is the total).

A released plan (every planned member reached its binding, so members are being bound) is kept in the
API as a ConfigMap in the system namespace (`plan_configmap`, read back by `read_plan`): the members,
their UIDs and allocations. The extender that follows a killed one (or the one beside the next
kube-scheduler leader) holds the rest of the gang's room from it, so a gang bound in part is completed
where it was planned.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from sharegpu.api import names, quantity, wire
from sharegpu.core import allocation, errors, units

DEFAULT_TIMEOUT: Final = 60
"""Seconds a planned gang's members have to reach their binding when the gang does not say."""
MAX_MEMBERS: Final = 10_000
MAX_TIMEOUT: Final = 86_400
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

KUEUE_GROUP_LABEL: Final = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_ANNOTATION: Final = "kueue.x-k8s.io/pod-group-total-count"
ANNOTATIONS: Final = (names.GANG, names.GANG_MIN, names.GANG_TIMEOUT, names.GANG_TOPOLOGY)
"""The annotations that state a pod's gang."""


@dataclass(frozen=True, slots=True)
class Gang:
    """One pod's view of its gang."""

    namespace: str
    name: str
    min_count: int
    timeout_s: int = DEFAULT_TIMEOUT
    topology: str | None = None
    """The node label whose one value every member's node shares; None: any nodes."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def agrees(self, other: Gang) -> bool:
        """Whether two members state the same gang."""
        return self == other


def of(namespace: str, annotations: Mapping[str, str]) -> Gang | None:
    """The gang a pod's annotations put it in; None if none. InvalidRequestError names a malformed value."""
    name = annotations.get(names.GANG)
    if name is None:
        for key in ANNOTATIONS[1:]:
            if key in annotations:
                raise errors.InvalidRequestError(f"annotation {key} needs {names.GANG} (the gang's name)")
        return None
    if not _NAME.match(name):
        raise errors.InvalidRequestError(
            f"annotation {names.GANG}: {name!r} is not a valid name (lower-case letters, digits, '-' and '.')"
        )
    text = annotations.get(names.GANG_MIN)
    if text is None:
        raise errors.InvalidRequestError(
            f"annotation {names.GANG_MIN} is required with {names.GANG} (how many members are placed together)"
        )
    minimum = quantity.integer(text, f"annotation {names.GANG_MIN}", 1, MAX_MEMBERS)
    timeout = annotations.get(names.GANG_TIMEOUT)
    seconds = (
        DEFAULT_TIMEOUT
        if timeout is None
        else quantity.integer(timeout, f"annotation {names.GANG_TIMEOUT} (seconds)", 1, MAX_TIMEOUT)
    )
    topology = annotations.get(names.GANG_TOPOLOGY) or None
    if topology is not None and not _LABEL_KEY.match(topology):
        raise errors.InvalidRequestError(f"annotation {names.GANG_TOPOLOGY}: {topology!r} is not a label key")
    return Gang(namespace, name, minimum, seconds, topology)


def translate(labels: Mapping[str, str], annotations: Mapping[str, str]) -> dict[str, str]:
    """The sharegpu annotations another format's group stated on a pod implies (empty: none, or the
    pod states its gang in sharegpu's own annotations already). InvalidRequestError names a
    malformed value."""
    if names.GANG in annotations:
        return {}
    group = labels.get(KUEUE_GROUP_LABEL)
    if group is None:
        return {}
    total = annotations.get(KUEUE_TOTAL_ANNOTATION)
    if total is None:
        raise errors.InvalidRequestError(
            f"label {KUEUE_GROUP_LABEL} needs the annotation {KUEUE_TOTAL_ANNOTATION} (the group's pod count)"
        )
    count = quantity.integer(total, f"annotation {KUEUE_TOTAL_ANNOTATION}", 1, MAX_MEMBERS)
    return {names.GANG: group, names.GANG_MIN: str(count)}


# ----------------------------------------------------------------- a released plan, kept in the API

PLAN_KEY: Final = "plan"
"""The data key of a plan ConfigMap."""


class PlannedMember(wire.Message, kw_only=True, frozen=True):
    pod: str
    uid: str
    allocation: str
    """The member's allocation (`core.allocation.Allocation.to_json`)."""
    cpu_milli: Annotated[int, msgspec.Meta(ge=0)] = 0
    memory_mib: Annotated[int, msgspec.Meta(ge=0)] = 0


class StoredPlan(wire.Message, kw_only=True, frozen=True):
    gang: str
    """The gang's key (namespace/name)."""
    members: list[PlannedMember]


@dataclass(frozen=True, slots=True)
class KeptPlan:
    """A plan read back from its ConfigMap."""

    gang: str
    name: str
    uid: str
    """The ConfigMap's UID (a deletion names it, so a newer plan of the gang is never deleted)."""
    members: dict[units.PodKey, tuple[str, allocation.Allocation]]


def plan_name(gang_key: str) -> str:
    """The ConfigMap name of a gang's plan: readable, cut to fit, unique by a digest of the key."""
    readable = (names.GANG_PLAN_PREFIX + gang_key.replace("/", "-"))[:200].rstrip("-.")
    return f"{readable}-{hashlib.sha256(gang_key.encode()).hexdigest()[:12]}"


def plan_configmap(gang_key: str, members: Mapping[units.PodKey, tuple[str, allocation.Allocation]]) -> dict[str, Any]:
    """The ConfigMap that keeps a released plan: member -> (its UID, its allocation)."""
    stored = StoredPlan(
        gang=gang_key,
        members=[
            PlannedMember(pod=k, uid=uid, allocation=a.to_json(), cpu_milli=a.cpu_milli, memory_mib=a.memory_mib)
            for k, (uid, a) in sorted(members.items())
        ],
    )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": plan_name(gang_key),
            "namespace": names.SYSTEM_NAMESPACE,
            "labels": {names.LABEL_ROLE: names.ROLE_GANG_PLAN},
        },
        "data": {PLAN_KEY: msgspec.json.encode(stored).decode()},
    }


def read_plan(obj: wire.ConfigMap) -> KeptPlan:
    """A plan ConfigMap read back; InvalidInputError names what is malformed (a plan whose members are
    not of its gang, or whose allocations are not the members' own, is malformed too)."""
    where = f"gang plan {obj.metadata.namespace}/{obj.metadata.name}"
    text = obj.data.get(PLAN_KEY)
    if text is None:
        raise errors.InvalidInputError(f"{where}: no {PLAN_KEY!r} key")
    try:
        stored = msgspec.json.decode(text, type=StoredPlan)
    except msgspec.DecodeError as exc:
        raise errors.InvalidInputError(f"{where}: {exc}") from None
    if obj.metadata.name != plan_name(stored.gang):
        raise errors.InvalidInputError(
            f"{where}: it names gang {stored.gang!r}, whose plan is not kept under this name"
        )
    namespace = stored.gang.split("/", 1)[0]
    members: dict[units.PodKey, tuple[str, allocation.Allocation]] = {}
    for member in stored.members:
        if member.pod.split("/", 1)[0] != namespace or "/" not in member.pod:
            raise errors.InvalidInputError(f"{where}: member {member.pod!r} is not in the gang's namespace")
        key = units.PodKey(member.pod)
        members[key] = (
            member.uid,
            allocation.Allocation.from_json(
                member.allocation, pod=key, cpu_milli=member.cpu_milli, memory_mib=member.memory_mib
            ),
        )
    return KeptPlan(stored.gang, obj.metadata.name, obj.metadata.uid, members)
