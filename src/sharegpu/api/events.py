"""Kubernetes Events (core/v1) as sharegpu writes them: one per decision, with a name derived from
the decision itself, so that a decision recorded twice (a retried write, a new leader that repeats
its predecessor's last pass) is refused by the API server as AlreadyExists instead of duplicated.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

Json = dict[str, Any]
Kind = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class Subject:
    """The object an event is about."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str


def pod(namespace: str, name: str, uid: str) -> Subject:
    """A Pod as an event's subject."""
    return Subject("v1", "Pod", namespace, name, uid)


def node(name: str, uid: str) -> Subject:
    """A Node as an event's subject (cluster-scoped: its events live in `CLUSTER_EVENTS`)."""
    return Subject("v1", "Node", "", name, uid)


CLUSTER_EVENTS = "default"
"""Where events about cluster-scoped objects live (as Kubernetes' own recorders put them)."""


def namespace_of(subject: Subject) -> str:
    """The namespace an event about the subject is written in."""
    return subject.namespace or CLUSTER_EVENTS


def name(subject: Subject, reason: str, decision: str) -> str:
    """A stable event name: the subject's name (cut to fit) and a digest of what was decided."""
    digest = hashlib.sha256(f"{subject.uid}\0{reason}\0{decision}".encode()).hexdigest()[:16]
    return f"{subject.name[:200]}.{digest}"


def event(
    subject: Subject,
    reason: str,
    message: str,
    *,
    decision: str,
    kind: Kind = "Normal",
    component: str,
    instance: str,
    now: str,
) -> Json:
    """The Event body; `decision` identifies the decision (same decision, same name)."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name(subject, reason, decision), "namespace": namespace_of(subject)},
        "involvedObject": {
            "apiVersion": subject.api_version,
            "kind": subject.kind,
            "namespace": subject.namespace,
            "name": subject.name,
            "uid": subject.uid,
        },
        "reason": reason,
        "message": message[:1024],
        "type": kind,
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
