"""bench/chaos.py's verdict on gang plans kept in the API: a plan with a member still waiting to be
bound lives; one whose members are all bound, gone, being deleted, ended or replaced has ended, and
counts as leaked while it is still there."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import msgspec
import pytest

from sharegpu.api import gangs, wire
from sharegpu.core import units
from tests import builders
from tests.conftest import bench_script


@pytest.fixture(scope="module")
def chaos() -> Iterator[ModuleType]:
    with bench_script("chaos") as module:
        yield module


def plan(gang: str, *members: str) -> wire.ConfigMap:
    held = {units.PodKey(m): (f"uid-{m}", builders.MakeAllocation(m).grant(0, 500, 1024).obj()) for m in members}
    body = gangs.plan_configmap(gang, held)
    body["metadata"]["uid"] = f"uid-plan-{gang}"
    return msgspec.convert(body, wire.ConfigMap)


def pod(key: str, *, uid: str = "", node: str = "", phase: str = "Pending", deleting: bool = False) -> wire.Pod:
    namespace, name = key.split("/")
    made = builders.MakePod(name, namespace).uid(uid or f"uid-{key}").phase(phase)
    body = (made.node(node) if node else made).obj()
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-11-29T00:00:00Z"
    return wire.convert(body, wire.Pod)


def test_a_plan_with_a_member_waiting_lives_and_an_ended_one_is_named(chaos: ModuleType) -> None:
    kept = [
        plan("chaos/waits", "chaos/w0", "chaos/w1"),
        plan("chaos/bound", "chaos/b0", "chaos/b1"),
        plan("chaos/gone", "chaos/x0", "chaos/x1", "chaos/x2", "chaos/x3"),
    ]
    pods = [
        pod("chaos/w0", node="n0"),
        pod("chaos/w1"),  # still to bind: its plan holds its room
        pod("chaos/b0", node="n0"),
        pod("chaos/b1", node="n1"),
        pod("chaos/x0", uid="someone-else"),  # replaced under the name
        pod("chaos/x1", deleting=True),
        pod("chaos/x2", phase="Failed"),
    ]  # x3 gone
    ended = chaos.ended_plans(kept, pods)
    assert [line.split(": ", 1)[1] for line in ended] == [
        "gang chaos/bound, no member left to bind",
        "gang chaos/gone, no member left to bind",
    ]
    assert chaos.ended_plans(kept[:1], pods) == []
