"""Other schedulers' pod groups read as gangs: which group a pod names in each format, what of the
group is honoured, and a Warning for each field set that is not."""

from __future__ import annotations

from typing import Any

import pytest

from sharegpu.api import names, podgroups, resources
from sharegpu.core import errors


@pytest.mark.parametrize(
    ("spec", "labels", "annotations", "fmt", "name"),
    [
        ({"schedulingGroup": {"podGroupName": "pg"}}, {}, {}, podgroups.KUBERNETES, "pg"),
        ({}, {podgroups.COSCHEDULING_LABEL: "pg"}, {}, podgroups.COSCHEDULING, "pg"),
        ({}, {podgroups.COSCHEDULING_LEGACY_LABEL: "old"}, {}, podgroups.COSCHEDULING_LEGACY, "old"),
        ({}, {}, {podgroups.VOLCANO_ANNOTATION: "vg"}, podgroups.VOLCANO, "vg"),
        ({}, {}, {podgroups.KAI_ANNOTATION: "kg"}, podgroups.KAI, "kg"),
    ],
)
def test_each_format_names_its_group(
    spec: dict[str, Any], labels: dict[str, str], annotations: dict[str, str], fmt: podgroups.Format, name: str
) -> None:
    ref = podgroups.reference("team", spec, labels, annotations)
    assert ref == podgroups.GroupRef(fmt, "team", name)
    assert ref.path == f"/apis/{fmt.group}/{fmt.version}/namespaces/team/podgroups/{name}"
    own = {**annotations, names.GANG: "mine"}
    assert podgroups.reference("team", spec, labels, own) is None, "sharegpu's own gang annotations win"


def test_no_group() -> None:
    assert podgroups.reference("team", {}, {}, {}) is None


def ref(fmt: podgroups.Format) -> podgroups.GroupRef:
    return podgroups.GroupRef(fmt, "team", "g")


def test_kubernetes_gang_policy_topology_and_warnings() -> None:
    group = {"spec": {"schedulingPolicy": {"gang": {"minCount": 4}}, "priorityClassName": "high",
                      "schedulingConstraints": {"topology": [{"key": "rack"}, {"key": "zone"}]}}}  # fmt: skip
    out, warnings = podgroups.gang_annotations(ref(podgroups.KUBERNETES), group)
    assert out == {names.GANG: "g", names.GANG_MIN: "4", names.GANG_TOPOLOGY: "rack"}
    assert any("spec.priorityClassName is not honoured" in w for w in warnings)
    assert any("topology[1:]" in w for w in warnings)
    basic, _ = podgroups.gang_annotations(ref(podgroups.KUBERNETES), {"spec": {"schedulingPolicy": {"basic": {}}}})
    assert basic == {}, "a basic policy makes no gang"


def test_coscheduling_minimum_and_timeout() -> None:
    group = {"spec": {"minMember": 3, "scheduleTimeoutSeconds": 90, "minResources": {"cpu": "3"}}}
    out, warnings = podgroups.gang_annotations(ref(podgroups.COSCHEDULING), group)
    assert out == {names.GANG: "g", names.GANG_MIN: "3", names.GANG_TIMEOUT: "90"}
    assert len(warnings) == 1 and "spec.minResources" in warnings[0]


def test_volcano_minimum_and_its_queue_warned() -> None:
    out, warnings = podgroups.gang_annotations(ref(podgroups.VOLCANO), {"spec": {"minMember": 2, "queue": "q1"}})
    assert out == {names.GANG: "g", names.GANG_MIN: "2"}
    assert len(warnings) == 1 and "spec.queue" in warnings[0] and "Kueue" in warnings[0]


def test_kai_minimum_and_required_topology_level() -> None:
    group = {
        "spec": {
            "minMember": 8,
            "topologyConstraint": {"requiredTopologyLevel": "rack", "preferredTopologyLevel": "host"},
        }
    }
    out, warnings = podgroups.gang_annotations(ref(podgroups.KAI), group)
    assert out == {names.GANG: "g", names.GANG_MIN: "8", names.GANG_TOPOLOGY: "rack"}
    assert any("preferredTopologyLevel" in w for w in warnings)


def test_a_group_of_one_is_no_gang_and_malformed_fields_are_named() -> None:
    assert podgroups.gang_annotations(ref(podgroups.VOLCANO), {"spec": {"minMember": 1}})[0] == {}
    with pytest.raises(errors.InvalidRequestError, match=r"spec\.minMember"):
        podgroups.gang_annotations(ref(podgroups.VOLCANO), {"spec": {"minMember": "many"}})
    with pytest.raises(errors.InvalidRequestError, match="scheduleTimeoutSeconds"):
        podgroups.gang_annotations(ref(podgroups.COSCHEDULING), {"spec": {"minMember": 2, "scheduleTimeoutSeconds": 0}})


def test_the_served_definitions_keep_the_fields_sharegpu_does_not_model() -> None:
    for key in ("coscheduling", "volcano", "kai"):
        (crd,) = resources.COMPAT[key]
        spec = crd.manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        assert spec["x-kubernetes-preserve-unknown-fields"] is True and "minMember" in spec["properties"]
