"""Stale views of pods on the extender path (found by a review, stop 64): events of a pod's
predecessor of the same name, a bound pod counted by a rebuild while still assumed, a pod filtered
again after its binding landed, and a pod held as bound that went while the watch was away. Each
would free room a binding holds, or hold room for ever."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from sharegpu.api import extender as api_extender
from sharegpu.api import paths, wire
from sharegpu.core import units
from tests.extender.conftest import Harness, gpu_pod, settle


def stored(h: Harness, name: str) -> dict[str, Any]:
    found = h.server.get_object(paths.pod("ns", name))
    assert found is not None
    return found


def pod_a(h: Harness) -> dict[str, Any]:
    return stored(h, "a")


def pod_b(h: Harness) -> dict[str, Any]:
    return stored(h, "b")


def record(h: Harness, key: str) -> Any:
    found = h.extender.cache.record(units.PodKey(key))
    assert found is not None
    return found


def bind_a(uid: str) -> api_extender.BindingArgs:
    return api_extender.BindingArgs(pod_name="a", pod_namespace="ns", pod_uid=uid, node="n0")


def _made_again_unseen(h: Harness) -> None:
    """Pod a (one GPU's 600 milli on n0) is deleted and made again under its name while the
    extender's pod watch lags (kube-scheduler's does not), with b waiting beside it; kube-scheduler
    filters the new a, which the extender places on n0."""
    _late_watches(h)
    h.server.remove_object(paths.pod("ns", "a"))
    h.server.put_object(paths.pods("ns"), gpu_pod("a", milli=600))
    h.server.put_object(paths.pods("ns"), gpu_pod("b", milli=600))
    assert h.extender.scheduling.filter(h.args(pod_a(h))).node_names == ["n0"]


def _late_watches(h: Harness) -> None:
    h.server.cut_watches()
    h.server.fail(503, method="WATCH", times=10_000)


async def test_old_uid_deleted_late_while_new_uid_binding_is_written(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    first = await h.create(gpu_pod("a", milli=600))
    old = h.extender.cache.record(units.PodKey("ns/a"))
    assert old is not None and old.uid == first["metadata"]["uid"]
    _made_again_unseen(h)
    service, cache, key = h.extender.scheduling, h.extender.cache, units.PodKey("ns/a")

    async def deleted_event_arrives(record: Any, alloc: Any) -> None:
        cache.on_pod(wire.EventType.DELETED, old)  # the lagging watch delivers uid1's deletion now

    monkeypatch.setattr(service, "prepare", deleted_event_arrives)
    meta = pod_a(h)["metadata"]
    result = await service.bind(bind_a(meta["uid"]))
    assert result.error == "", result.error
    assert pod_a(h)["spec"]["nodeName"] == "n0"
    # uid2 is bound on n0 with 600 milli; the watch has not shown it yet
    assert key in cache.ledger, "the bound pod's room was dropped from the ledger"


async def test_relist_after_410_drops_an_unsure_binding_of_the_new_uid(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await h.create(gpu_pod("a", milli=600))
    _made_again_unseen(h)
    service, cache, key = h.extender.scheduling, h.extender.cache, units.PodKey("ns/a")
    h.server.lose(method="POST", path=paths.binding("ns", "a"), after_commit=False)
    meta = pod_a(h)["metadata"]
    result = await service.bind(bind_a(meta["uid"]))
    assert "outcome unknown" in result.error
    assert key in service.unsure and key in cache.ledger
    # the watch comes back with a relist (410): uid1 is gone, uid2 shown still unbound
    h.server.faults.clear()
    h.server.expire_watches()
    for _ in range(50):
        await settle(h.server)
        if cache.record(key) is not None and record(h, key).uid == meta["uid"]:
            break
    assert record(h, key).uid == meta["uid"]
    h.clock.advance(5)  # well within SETTLE_AFTER: the binding may still land
    verdict = service.filter(h.args(pod_b(h)))
    assert verdict.node_names == [], "b was given the room a's unsure binding may still take"


async def test_bound_pod_seen_while_dirty_leaks_its_room_when_deleted(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    h: Harness = await harness(nodes=2, gpus=1)
    pod = await h.create(gpu_pod("a", milli=600))
    service, cache, key = h.extender.scheduling, h.extender.cache, units.PodKey("ns/a")
    assert service.filter(h.args(pod, ["n0"])).node_names == ["n0"]  # reserved (assumed)
    create = service.api.create

    async def create_then_a_node_changes(path: str, body: Any, **kw: Any) -> Any:
        made = await create(path, body, **kw)
        # any Node/Device event that lands before the watch shows the pod bound
        facts = cache.nodes["n1"]
        cache.on_node(wire.EventType.MODIFIED, dataclasses.replace(facts, cpu_milli=facts.cpu_milli - 1000))
        return made

    monkeypatch.setattr(service.api, "create", create_then_a_node_changes)
    meta = pod_a(h)["metadata"]
    result = await service.bind(bind_a(meta["uid"]))
    assert result.error == "", result.error
    await settle(h.server)
    assert record(h, key).node == "n0"
    entry = cache.ledger.get(key)
    assert entry is not None and entry.phase.value == "Added"  # the rebuild loaded it
    # the pod is deleted (force, or its DELETED without a terminal phase first)
    h.server.remove_object(paths.pod("ns", "a"))
    await settle(h.server)
    assert cache.record(key) is None
    assert key not in cache.ledger, "a pod that is gone is still counted"
    assert service.filter(h.args(gpu_pod("b", milli=600) | {}, ["n0"])).node_names == ["n0"]


async def test_refilter_after_a_bind_that_landed_frees_its_room(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2, gpus=1)
    a = await h.create(gpu_pod("a", milli=600))
    b = await h.create(gpu_pod("b", milli=600))
    service = h.extender.scheduling
    h.server.cut_watches()
    h.server.fail(503, method="WATCH", times=10_000)  # the watch lags
    assert service.filter(h.args(a, ["n0"])).node_names == ["n0"]
    meta = pod_a(h)["metadata"]
    ok = await service.bind(bind_a(meta["uid"]))
    assert ok.error == ""  # landed; kube-scheduler's HTTP call had timed out, so it retries the pod
    assert pod_a(h)["spec"]["nodeName"] == "n0"
    service.filter(h.args(a, ["n1"]))  # kube-scheduler filters a again (its cache too shows it unbound)
    assert service.filter(h.args(b, ["n0"])).node_names == [], "b given a's room on n0"


async def test_confirmed_pod_deleted_during_a_watch_outage_leaks(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    service, cache, key = h.extender.scheduling, h.extender.cache, units.PodKey("ns/a")
    pods_informer = next(i for i in h.extender.informers if i.name == "pods")
    h.server.cut_watches()
    h.server.fail(503, method="WATCH", times=10_000)  # the extender's watch is away
    h.server.put_object(paths.pods("ns"), gpu_pod("a", milli=600))
    stored = pod_a(h)
    assert cache.record(key) is None
    assert service.filter(h.args(stored, ["n0"])).node_names == ["n0"]
    h.server.lose(method="POST", path=paths.binding("ns", "a"), after_commit=True)  # bound; answer lost
    result = await service.bind(bind_a(stored["metadata"]["uid"]))
    assert "outcome unknown" in result.error
    assert await service.settle(key) is True  # read back bound: cache.confirm
    assert key in cache.confirmed and key in cache.ledger
    h.server.remove_object(paths.pod("ns", "a"))  # the pod goes (finished job deleted, ...)
    lists = pods_informer.lists
    h.server.faults.clear()
    h.server.expire_watches()  # history compacted: the watch comes back with a relist
    for _ in range(300):
        await asyncio.sleep(0.02)
        if pods_informer.lists > lists:
            break
    await settle(h.server)
    assert pods_informer.lists > lists
    assert cache.record(key) is None
    h.clock.advance(120)
    await service.expire()
    assert key not in cache.ledger, "a pod that is gone is still counted"
    node = await h.api.get(paths.node("n0"))
    node["metadata"].setdefault("labels", {})["x"] = "y"  # any later rebuild
    await h.api.replace(paths.node("n0"), node)
    await settle(h.server)
    assert key not in cache.ledger, "a pod that is gone is still counted (and re-added at every rebuild)"
