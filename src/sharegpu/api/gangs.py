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
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sharegpu.api import names, quantity
from sharegpu.core import errors

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
