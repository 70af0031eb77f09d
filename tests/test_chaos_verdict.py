"""bench/chaos.py's verdict on gang plans kept in the API: a plan with a member still waiting to be
bound lives; one whose members are all bound, gone, being deleted, ended or replaced has ended, and
counts as leaked while it is still there."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

from sharegpu.api import gangs, wire
from sharegpu.core import allocation, units

BENCH = Path(__file__).resolve().parents[1] / "bench" / "chaos.py"


@pytest.fixture(scope="module")
def chaos() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("bench_chaos", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def alloc(pod: str) -> allocation.Allocation:
    grant = allocation.DeviceGrant(index=0, milli=500, memory_mib=1024, limit_milli=500)
    return allocation.Allocation(
        pod=units.PodKey(pod), node=units.NodeName("n0"), containers=(allocation.ContainerAllocation("main", (grant,)),)
    )


def plan(gang: str, *members: str) -> wire.ConfigMap:
    body = gangs.plan_configmap(gang, {units.PodKey(m): (f"uid-{m}", alloc(m)) for m in members})
    body["metadata"]["uid"] = f"uid-plan-{gang}"
    return msgspec.convert(body, wire.ConfigMap)


def pod(key: str, *, uid: str = "", node: str = "", phase: str = "Pending", deleting: bool = False) -> wire.Pod:
    namespace, name = key.split("/")
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid or f"uid-{key}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T00:00:00Z"
    body = {"metadata": meta, "spec": {"containers": [{"name": "main"}], "nodeName": node}, "status": {"phase": phase}}
    return msgspec.convert(body, wire.Pod)


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
