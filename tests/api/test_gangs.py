"""A pod's gang as its annotations state it: required minimum, bounded values, names checked;
Kueue's plain pod groups translated into it; and a released plan kept in a ConfigMap and read back."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sharegpu.api import gangs, names, wire
from sharegpu.core import allocation, errors, units


def test_a_gang_with_every_field() -> None:
    found = gangs.of(
        "team",
        {
            names.GANG: "job-1",
            names.GANG_MIN: "8",
            names.GANG_TIMEOUT: "120",
            names.GANG_TOPOLOGY: "topology.kubernetes.io/zone",
        },
    )
    assert found == gangs.Gang("team", "job-1", 8, 120, "topology.kubernetes.io/zone")
    assert found is not None and found.key == "team/job-1"


def test_no_gang_and_the_defaults() -> None:
    assert gangs.of("team", {}) is None
    found = gangs.of("team", {names.GANG: "j", names.GANG_MIN: "2"})
    assert found is not None and found.timeout_s == gangs.DEFAULT_TIMEOUT and found.topology is None


@pytest.mark.parametrize(
    ("annotations", "words"),
    [
        ({names.GANG: "j"}, f"{names.GANG_MIN} is required"),
        ({names.GANG_MIN: "3"}, f"needs {names.GANG}"),
        ({names.GANG: "Bad_Name", names.GANG_MIN: "3"}, "not a valid name"),
        ({names.GANG: "j", names.GANG_MIN: "0"}, "integer in 1..10000"),
        ({names.GANG: "j", names.GANG_MIN: "2.5"}, "integer in 1..10000"),
        ({names.GANG: "j", names.GANG_MIN: "2", names.GANG_TIMEOUT: "-1"}, "(seconds) must be an integer"),
        ({names.GANG: "j", names.GANG_MIN: "2", names.GANG_TOPOLOGY: "a b"}, "is not a label key"),
    ],
)
def test_malformed_gangs_are_named(annotations: dict[str, str], words: str) -> None:
    with pytest.raises(
        errors.InvalidRequestError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        gangs.of("team", annotations)


def test_kueue_pod_groups_become_gangs_of_their_total_count() -> None:
    labels = {gangs.KUEUE_GROUP_LABEL: "train"}
    assert gangs.translate(labels, {gangs.KUEUE_TOTAL_ANNOTATION: "4"}) == {names.GANG: "train", names.GANG_MIN: "4"}
    assert gangs.translate({}, {}) == {}
    assert gangs.translate(labels, {names.GANG: "own", names.GANG_MIN: "2"}) == {}, "sharegpu's own wins"
    with pytest.raises(errors.InvalidRequestError, match="needs the annotation"):
        gangs.translate(labels, {})


def _alloc(pod: str, index: int) -> allocation.Allocation:
    grant = allocation.DeviceGrant(index=index, milli=250, memory_mib=4096, limit_milli=250)
    return allocation.Allocation(
        pod=units.PodKey(pod), node=units.NodeName("n1"),
        containers=(allocation.ContainerAllocation("main", (grant,)),), cpu_milli=500, memory_mib=1024,
    )  # fmt: skip


def _read(body: dict[str, Any]) -> gangs.KeptPlan:
    return gangs.read_plan(msgspec.convert({**body, "metadata": {**body["metadata"], "uid": "u1"}}, wire.ConfigMap))


def test_a_kept_plan_reads_back_as_it_was_written() -> None:
    members = {
        units.PodKey("team/w0"): ("uid-0", _alloc("team/w0", 0)),
        units.PodKey("team/w1"): ("uid-1", _alloc("team/w1", 3)),
    }
    body = gangs.plan_configmap("team/job", members)
    assert body["metadata"]["namespace"] == names.SYSTEM_NAMESPACE
    assert body["metadata"]["name"].startswith(names.GANG_PLAN_PREFIX + "team-job-")
    kept = _read(body)
    assert (kept.gang, kept.uid, kept.members) == ("team/job", "u1", members)


def test_plan_names_are_distinct_and_valid_for_long_and_look_alike_keys() -> None:
    one, two = gangs.plan_name("a-b/c"), gangs.plan_name("a/b-c")
    assert one != two
    long = gangs.plan_name("n" * 63 + "/" + "g" * 253)
    assert len(long) <= 253 and long[-1].isalnum()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update({gangs.PLAN_KEY: "{not json"}), "gang plan sharegpu-system/"),
        (lambda d: d.pop(gangs.PLAN_KEY), "no 'plan' key"),
        (lambda d: d.update({gangs.PLAN_KEY: d[gangs.PLAN_KEY].replace('"team/w0"', '"other/w0"')}),
         "member 'other/w0' is not in the gang's namespace"),
        (lambda d: d.update({gangs.PLAN_KEY: d[gangs.PLAN_KEY].replace('"team/job"', '"team/else"')}),
         "it names gang 'team/else', whose plan is not kept under this name"),
        (lambda d: d.update({gangs.PLAN_KEY: d[gangs.PLAN_KEY].replace('"cpuMilli":500', '"cpuMilli":-5')}),
         "Expected `int` >= 0"),
        (lambda d: d.update({gangs.PLAN_KEY: d[gangs.PLAN_KEY].replace('\\"milli\\":250', '\\"milli\\":0')}),
         "allocation of team/w0"),
    ],
)  # fmt: skip
def test_a_malformed_kept_plan_is_refused_by_name(change: Any, message: str) -> None:
    body = gangs.plan_configmap("team/job", {units.PodKey("team/w0"): ("uid-0", _alloc("team/w0", 0))})
    change(body["data"])
    with pytest.raises(errors.InvalidInputError) as caught:
        _read(body)
    assert message in str(caught.value)
