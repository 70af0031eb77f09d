"""A pod's own node constraints as kube-scheduler's NodeAffinity and TaintToleration filters judge them."""

from __future__ import annotations

from typing import Any

import pytest

from sharegpu.api import constraints
from tests import builders


def node(labels: dict[str, str], taints: list[dict[str, str]] | None = None, name: str = "n1") -> constraints.NodeTerms:
    return constraints.NodeTerms.of(builders.MakeNode(name).labels(labels).taints(taints or []).wire())


def pod(spec: dict[str, Any]) -> constraints.PodTerms:
    return constraints.PodTerms.of(builders.MakePod("p").spec(**spec).wire().spec)


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}}  # fmt: skip


def expression(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": operator, "values": list(values)}]}


def test_a_pod_without_constraints_goes_anywhere_untainted() -> None:
    terms = pod({})
    assert terms.unconstrained and terms.allows(node({"zone": "a"}))


def test_the_node_selector_needs_every_label() -> None:
    terms = pod({"nodeSelector": {"zone": "a", "gpu": "t4"}})
    assert terms.allows(node({"zone": "a", "gpu": "t4", "other": "x"}))
    assert not terms.allows(node({"zone": "a"}))
    assert not terms.allows(node({"zone": "b", "gpu": "t4"}))


@pytest.mark.parametrize(
    ("term", "labels", "allowed"),
    [
        (expression("zone", "In", "a", "b"), {"zone": "b"}, True),
        (expression("zone", "In", "a"), {}, False),
        (expression("zone", "NotIn", "a"), {}, True),
        (expression("zone", "NotIn", "a"), {"zone": "a"}, False),
        (expression("gpu", "Exists"), {"gpu": ""}, True),
        (expression("gpu", "DoesNotExist"), {"gpu": "x"}, False),
        (expression("cores", "Gt", "8"), {"cores": "16"}, True),
        (expression("cores", "Lt", "8"), {"cores": "16"}, False),
        (expression("cores", "Gt", "8"), {"cores": "many"}, False),
        ({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}, {}, True),
        ({"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}]}, {}, False),
        ({}, {"zone": "a"}, False),  # an empty term matches no node
    ],
)
def test_required_node_affinity(term: dict[str, Any], labels: dict[str, str], allowed: bool) -> None:
    assert pod(required(term)).allows(node(labels)) is allowed


def test_affinity_terms_are_ored_and_requirements_anded() -> None:
    both = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]},
                                 {"key": "gpu", "operator": "Exists"}]}  # fmt: skip
    terms = pod(required(both, expression("zone", "In", "c")))
    assert terms.allows(node({"zone": "a", "gpu": "t4"}))
    assert not terms.allows(node({"zone": "a"}))
    assert terms.allows(node({"zone": "c"}))


def test_taints_keep_off_pods_that_do_not_tolerate_them() -> None:
    tainted = node({}, [{"key": "gpu", "value": "shared", "effect": "NoSchedule"}])
    assert not pod({}).allows(tainted)
    assert pod({}).allows(node({}, [{"key": "gpu", "effect": "PreferNoSchedule"}]))
    assert not pod({}).allows(node({}, [{"key": "gpu", "effect": "NoExecute"}]))
    equal = {"key": "gpu", "operator": "Equal", "value": "shared", "effect": "NoSchedule"}
    assert pod({"tolerations": [equal]}).allows(tainted)
    assert not pod({"tolerations": [{**equal, "value": "other"}]}).allows(tainted)
    assert not pod({"tolerations": [{**equal, "effect": "NoExecute"}]}).allows(tainted)
    assert pod({"tolerations": [{"key": "gpu", "operator": "Exists"}]}).allows(tainted)
    assert pod({"tolerations": [{"operator": "Exists"}]}).allows(tainted)  # tolerates everything


def test_pods_with_the_same_constraints_share_a_key() -> None:
    spec = {"nodeSelector": {"zone": "a"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}
    assert pod(spec).key == pod(dict(spec)).key
    assert pod(spec).key != pod({**spec, "nodeSelector": {"zone": "b"}}).key
    assert pod(spec).key != pod({"nodeSelector": {"zone": "a"}}).key


def test_a_pod_keeps_apart_where_its_required_anti_affinity_selects_itself() -> None:
    def apart(*terms: dict[str, Any], labels: dict[str, str] | None = None) -> tuple[str, ...]:
        made = builders.MakePod("p", "ns").labels(labels or {"job": "w"})
        spec = {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}}
        wired = made.spec(**spec).wire()
        return constraints.PodTerms.of(wired.spec, wired.metadata).apart

    host, zone = "kubernetes.io/hostname", "topology.kubernetes.io/zone"
    mine = {"matchLabels": {"job": "w"}}
    assert apart({"labelSelector": mine, "topologyKey": host}, {"labelSelector": mine, "topologyKey": zone}) == (
        host,
        zone,
    )
    assert apart({"labelSelector": {"matchLabels": {"job": "other"}}, "topologyKey": host}) == ()
    assert apart({"labelSelector": mine, "topologyKey": host}, labels={"job": "x"}) == ()
    assert apart({"topologyKey": host}) == (), "no selector: matches no pod"
    assert apart({"labelSelector": mine, "topologyKey": host, "namespaces": ["elsewhere"]}) == ()
    assert apart({"labelSelector": mine, "topologyKey": host, "namespaces": ["ns"]}) == (host,)
    assert apart({"labelSelector": mine, "topologyKey": host, "namespaceSelector": {}}) == (host,)
    assert apart({"labelSelector": mine, "topologyKey": host, "namespaceSelector": {"matchLabels": {"a": "b"}}}) == ()
    expressions = {"matchExpressions": [{"key": "job", "operator": "In", "values": ["w", "v"]}]}
    assert apart({"labelSelector": expressions, "topologyKey": host}) == (host,)
    assert pod({}).apart == (), "read only with the pod's own labels"
