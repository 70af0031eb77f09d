"""A pod's gang as its annotations state it: required minimum, bounded values, names checked; and
Kueue's plain pod groups translated into it."""

from __future__ import annotations

import pytest

from sharegpu.api import gangs, names
from sharegpu.core import errors


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
