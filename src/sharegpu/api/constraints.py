"""Which nodes a pod may run on by its own constraints, as kube-scheduler's filters judge them.

The nodeSelector (every label equal), the required node affinity (its terms ORed, each term's
expressions and fields ANDed; In, NotIn, Exists, DoesNotExist, Gt, Lt on labels, In and NotIn on
`metadata.name`) and the node's NoSchedule and NoExecute taints the pod does not tolerate. The
extender never needs this (kube-scheduler sends it only nodes that pass these filters); components
that predict placements without kube-scheduler do: the defragmenter plans where a pending pod and
the pods moved out of its way may go, and gang planning, which also reads the topologies in which a
gang's members keep apart from each other (`apart_from_itself`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from sharegpu.api import wire

BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


@dataclass(frozen=True, slots=True)
class NodeTerms:
    """What of a Node the pods' constraints look at."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[wire.Taint, ...] = ()

    @classmethod
    def of(cls, node: wire.Node) -> NodeTerms:
        return cls(node.metadata.name, dict(node.metadata.labels), tuple(node.spec.taints))


@dataclass(frozen=True, slots=True)
class PodTerms:
    """A pod's own constraints on its node."""

    selector: Mapping[str, str]
    required: wire.NodeSelector | None = None
    tolerations: tuple[wire.Toleration, ...] = ()
    apart: tuple[str, ...] = ()
    """The topology keys in which the pod keeps off pods like itself (`apart_from_itself`)."""

    @classmethod
    def of(cls, spec: wire.PodSpec, meta: wire.ObjectMeta | None = None) -> PodTerms:
        affinity = spec.affinity.node_affinity if spec.affinity is not None else None
        required = affinity.required_during_scheduling_ignored_during_execution if affinity is not None else None
        apart = apart_from_itself(spec, meta) if meta is not None else ()
        return cls(dict(spec.node_selector), required, tuple(spec.tolerations), apart)

    @property
    def key(self) -> bytes:
        """Equal for pods with the same constraints (the pods of one controller share theirs)."""
        return msgspec.json.encode((sorted(self.selector.items()), self.required, self.tolerations))

    @property
    def unconstrained(self) -> bool:
        return not self.selector and self.required is None and not self.tolerations

    def allows(self, node: NodeTerms) -> bool:
        if any(node.labels.get(key) != value for key, value in self.selector.items()):
            return False
        if self.required is not None and not any(_term(t, node) for t in self.required.node_selector_terms):
            return False
        return all(
            taint.effect not in BLOCKING_EFFECTS or any(_tolerates(t, taint) for t in self.tolerations)
            for taint in node.taints
        )


def apart_from_itself(spec: wire.PodSpec, meta: wire.ObjectMeta) -> tuple[str, ...]:
    """The topology keys of the pod's required pod anti-affinity terms that select the pod itself (its
    own labels, in its own namespace): pods of its template (a gang's workers) keep apart in them,
    one per node with `kubernetes.io/hostname`. Terms choosing namespaces by their labels are not
    judged here (kube-scheduler still does)."""
    anti = spec.affinity.pod_anti_affinity if spec.affinity is not None else None
    if anti is None:
        return ()
    keys: list[str] = []
    for term in anti.required_during_scheduling_ignored_during_execution:
        if term.label_selector is None or not term.topology_key:
            continue  # a term without a selector matches no pod
        chosen = term.namespace_selector
        own = (not term.namespaces or meta.namespace in term.namespaces) if chosen is None else not (
            chosen.match_labels or chosen.match_expressions
        )  # fmt: skip
        if own and wire.selects(term.label_selector, meta.labels) and term.topology_key not in keys:
            keys.append(term.topology_key)
    return tuple(keys)


def _term(term: wire.NodeSelectorTerm, node: NodeTerms) -> bool:
    """A term with no requirement matches no node (as in Kubernetes)."""
    if not term.match_expressions and not term.match_fields:
        return False
    fields = {"metadata.name": node.name}
    return all(_requirement(r, node.labels) for r in term.match_expressions) and all(
        r.key in fields and r.operator in ("In", "NotIn") and _requirement(r, fields) for r in term.match_fields
    )


def _requirement(requirement: wire.NodeSelectorRequirement, labels: Mapping[str, str]) -> bool:
    value = labels.get(requirement.key)
    match requirement.operator:
        case "In":
            return value is not None and value in requirement.values
        case "NotIn":
            return value is None or value not in requirement.values
        case "Exists":
            return value is not None
        case "DoesNotExist":
            return value is None
        case "Gt" | "Lt":
            if value is None or len(requirement.values) != 1:
                return False
            try:
                have, bound = int(value), int(requirement.values[0])
            except ValueError:
                return False
            return have > bound if requirement.operator == "Gt" else have < bound
        case _:
            return False


def _tolerates(toleration: wire.Toleration, taint: wire.Taint) -> bool:
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.operator == "Exists":
        return not toleration.key or toleration.key == taint.key
    return toleration.key == taint.key and toleration.value == taint.value
