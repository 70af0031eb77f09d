"""Gangs on the extender path: nothing held until every needed member is here and fits, then the
whole gang planned and held at once, bound together, and given back whole at its timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from sharegpu.api import extender as api_extender
from sharegpu.api import gangs, names, paths, pods, wire
from sharegpu.core import allocation, units
from sharegpu.extender import runtime
from sharegpu.kube import client
from tests.extender.conftest import Harness, Json, gpu_pod, settle


def member(name: str, gang: str = "job", minimum: int = 4, **extra: str) -> Json:
    annotations = {names.GANG: gang, names.GANG_MIN: str(minimum), **extra}
    return gpu_pod(name, milli=None, count=1, annotations=annotations)


def binding(h: Harness, name: str, node: str) -> api_extender.BindingArgs:
    stored = h.server.get_object(paths.pod("ns", name))
    assert stored is not None
    return api_extender.BindingArgs(pod_name=name, pod_namespace="ns", pod_uid=stored["metadata"]["uid"], node=node)


async def planned_pair(harness: Callable[..., Any], *, gpus: int = 2, timeout: str | None = None) -> Harness:
    """One node of `gpus` GPUs, gang members a and b (minimum 2, and `timeout` seconds when given) on
    it, planned by a's filter."""
    extra = {names.GANG_TIMEOUT: timeout} if timeout is not None else {}
    h: Harness = await harness(nodes=1, gpus=gpus, assume_ttl=300.0)
    a = await h.create(member("a", minimum=2, **extra))
    await h.create(member("b", minimum=2, **extra))
    assert h.extender.scheduling.filter(h.args(a)).node_names == ["n0"]
    return h


def free_gpus(h: Harness) -> int:
    state = h.extender.cache.state
    return int(((state.milli_free == 1000) & state.present).sum())


async def test_a_gang_waits_for_its_members_holding_nothing_then_is_planned_whole(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2, gpus=2)
    pods = [await h.create(member(f"w{i}")) for i in range(3)]
    verdict = h.extender.scheduling.filter(h.args(pods[0]))
    assert not verdict.node_names
    assert "gang ns/job waits for its members: 3 of 4" in next(iter(verdict.failed_nodes.values()))
    assert free_gpus(h) == 4, "a gang short of members holds nothing"
    pods.append(await h.create(member("w3")))
    first = h.extender.scheduling.filter(h.args(pods[0]))
    assert len(first.node_names) == 1
    assert free_gpus(h) == 0, "the whole gang is held at once"
    outsider = await h.create(gpu_pod("outsider", milli=None, count=1))
    assert not h.extender.scheduling.filter(h.args(outsider)).node_names, "no pod takes the gang's room"
    planned = {}
    for pod in pods:
        verdict = h.extender.scheduling.filter(h.args(pod))
        assert len(verdict.node_names) == 1
        planned[pod["metadata"]["name"]] = verdict.node_names[0]
    assert sorted(planned.values()) == ["n0", "n0", "n1", "n1"]
    binds = [
        asyncio.ensure_future(h.extender.scheduling.bind(binding(h, n, node))) for n, node in list(planned.items())[:3]
    ]
    await asyncio.sleep(0.05)
    assert not any(b.done() for b in binds), "members wait at their binding for the rest of the gang"
    assert all(not (h.server.get_object(paths.pod("ns", n)) or {})["spec"].get("nodeName") for n in planned)
    last = await h.extender.scheduling.bind(binding(h, "w3", planned["w3"]))
    results = [await b for b in binds]
    assert last.error == "" and all(r.error == "" for r in results), [r.error for r in results]
    await settle(h.server)
    for name, node in planned.items():
        assert (h.server.get_object(paths.pod("ns", name)) or {})["spec"]["nodeName"] == node
    await h.extender.scheduling.expire()
    assert not h.extender.scheduling.gangs.plans, "a complete gang's plan ends"


async def test_a_member_that_waited_in_vain_is_tried_again_with_its_place_held(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=2)
    h.extender.scheduling.gangs.barrier_wait = 0.05
    a, b = await h.create(member("a", minimum=2)), await h.create(member("b", minimum=2))
    assert h.extender.scheduling.filter(h.args(a)).node_names == ["n0"]
    early = await h.extender.scheduling.bind(binding(h, "a", "n0"))
    assert "1 of 2 planned members have reached their binding" in early.error
    assert free_gpus(h) == 0, "its place is still held"
    assert h.extender.scheduling.filter(h.args(b)).node_names == ["n0"]
    assert (await h.extender.scheduling.bind(binding(h, "b", "n0"))).error == ""
    assert h.extender.scheduling.filter(h.args(a)).node_names == ["n0"], "its next try: the node still held"
    assert (await h.extender.scheduling.bind(binding(h, "a", "n0"))).error == ""
    await settle(h.server)
    assert all((h.server.get_object(paths.pod("ns", n)) or {})["spec"].get("nodeName") == "n0" for n in "ab")


async def test_a_plan_not_bound_by_the_gangs_timeout_is_given_back_whole(harness: Callable[..., Any]) -> None:
    h = await planned_pair(harness, timeout="20")
    assert free_gpus(h) == 0
    h.clock.advance(10)
    await h.extender.scheduling.expire()
    assert free_gpus(h) == 0, "held until the timeout"
    h.clock.advance(11)
    await h.extender.scheduling.expire()
    assert free_gpus(h) == 2 and not h.extender.scheduling.gangs.plans
    assert not h.extender.cache.assumed


async def test_a_gang_that_cannot_fit_holds_nothing_and_says_why(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=2)
    pods = [await h.create(member(f"w{i}", minimum=3)) for i in range(3)]
    verdict = h.extender.scheduling.filter(h.args(pods[0]))
    assert "gang ns/job: fewer than 3 of 3 member(s) fit together" in next(iter(verdict.failed_nodes.values()))
    assert free_gpus(h) == 2 and not h.extender.cache.assumed


async def test_members_that_disagree_are_refused_with_the_difference_named(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=2)
    a = await h.create(member("a", minimum=2))
    await h.create(member("b", minimum=3))
    message = next(iter(h.extender.scheduling.filter(h.args(a)).failed_nodes.values()))
    assert "its members disagree" in message and "minimum 3" in message and "minimum 2" in message
    assert h.extender.metrics.gangs.labels("refused")._value.get() >= 1


async def test_a_gang_with_its_minimum_running_places_later_members_alone(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2, gpus=2)
    a, b = await h.create(member("a", minimum=2)), await h.create(member("b", minimum=2))
    nodes = {n: h.extender.scheduling.filter(h.args(p)).node_names[0] for n, p in (("a", a), ("b", b))}
    binds = [asyncio.ensure_future(h.extender.scheduling.bind(binding(h, n, node))) for n, node in nodes.items()]
    assert [r.error for r in await asyncio.gather(*binds)] == ["", ""]
    await settle(h.server)
    await h.extender.scheduling.expire()
    c = await h.create(member("c", minimum=2))
    assert len(h.extender.scheduling.filter(h.args(c)).node_names) == 1
    assert units.PodKey("ns/c") in h.extender.cache.assumed and not h.extender.scheduling.gangs.plans


async def test_a_member_behind_anyones_scheduling_gate_is_not_here_yet(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=2)
    a = await h.create(member("a", minimum=2))
    gated = member("b", minimum=2)
    gated["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    await h.create(gated)
    message = next(iter(h.extender.scheduling.filter(h.args(a)).failed_nodes.values()))
    assert "waits for its members: 1 of 2" in message and free_gpus(h) == 2, "a gated member is not planned"


async def test_a_released_member_whose_bind_fails_keeps_its_place_for_the_next_try(harness: Callable[..., Any]) -> None:
    """Found by bench/chaos.py --gangs: a member's hand-off could not be written yet, its bind failed
    and gave its room away, another pod took it, and the gang stayed partial."""
    h = await planned_pair(harness, timeout="20")
    real = h.extender.scheduling.prepare
    refusals = iter(["hand-off ConfigMap could not be written yet"])

    async def flaky(record: Any, alloc: Any) -> str | None:
        if record.key == "ns/b":
            return next(refusals, None)
        return await real(record, alloc) if real is not None else None

    h.extender.scheduling.prepare = flaky
    binds = [asyncio.ensure_future(h.extender.scheduling.bind(binding(h, n, "n0"))) for n in "ab"]
    results = [r.error for r in await asyncio.gather(*binds)]
    assert results[0] == "" and "could not be written yet" in results[1]
    await settle(h.server)
    assert free_gpus(h) == 0, "the failed member's place is still held"
    outsider = await h.create(gpu_pod("outsider", milli=None, count=1))
    assert not h.extender.scheduling.filter(h.args(outsider)).node_names, "no one takes it meanwhile"
    h.clock.advance(60)  # past the gang's timeout: a released plan keeps its room while a member binds
    await h.extender.scheduling.expire()
    assert free_gpus(h) == 0
    assert (await h.extender.scheduling.bind(binding(h, "b", "n0"))).error == ""
    await settle(h.server)
    await h.extender.scheduling.expire()
    assert not h.extender.scheduling.gangs.plans


async def test_a_released_plan_with_a_member_gone_gives_back_the_rest(harness: Callable[..., Any]) -> None:
    h = await planned_pair(harness)
    h.extender.scheduling.gangs.barrier_wait = 0.05
    for name in "ab":  # both reach their bind once: released
        record = h.extender.cache.record(units.PodKey(f"ns/{name}"))
        assert record is not None
        await h.extender.scheduling.gangs.arrive(record)
    await h.api.delete(paths.pod("ns", "b"))
    await settle(h.server)
    await h.extender.scheduling.expire()
    assert not h.extender.scheduling.gangs.plans and free_gpus(h) == 2


async def test_a_released_member_whose_binding_is_read_back_undone_keeps_its_place(harness: Callable[..., Any]) -> None:
    """Found by bench/chaos.py --gangs: a 409 on the binding (read like a lost answer), read back as not
    done, gave the member's room away, and its gang stayed partial."""
    h = await planned_pair(harness)
    h.server.fail(503, method="POST", path=paths.binding("ns", "b"))  # before the commit: not bound
    binds = [asyncio.ensure_future(h.extender.scheduling.bind(binding(h, n, "n0"))) for n in "ab"]
    results = [r.error for r in await asyncio.gather(*binds)]
    assert results[0] == "" and "outcome unknown" in results[1]
    h.clock.advance(h.extender.scheduling.settle_after + 1)  # a late landing is no longer possible
    assert await h.extender.scheduling.settle(units.PodKey("ns/b")) is False
    assert free_gpus(h) == 0, "read back as not bound, the member still holds its place"
    assert (await h.extender.scheduling.bind(binding(h, "b", "n0"))).error == ""
    h.server.faults.clear()


async def successor(h: Harness) -> runtime.Extender:
    """Another extender over the same API server (the one that follows a killed one, or the one beside
    the next kube-scheduler leader): it knows only what the API keeps."""
    extender = runtime.Extender(
        client.KubeClient(h.server), runtime.Options(leader_elect=False, reservation_idle=0.0, pace=0.01), clock=h.clock
    )
    await extender.start()
    return extender


def kept_plans(h: Harness) -> list[Json]:
    found = h.server.list_objects(paths.configmaps(names.SYSTEM_NAMESPACE))
    return [c for c in found if (c["metadata"].get("labels") or {}).get(names.LABEL_ROLE) == names.ROLE_GANG_PLAN]


async def test_a_released_plan_is_kept_and_the_next_extender_binds_the_rest_where_it_was_planned(
    harness: Callable[..., Any],
) -> None:
    """Found by bench/chaos.py --gangs: the extender killed while a released gang was being bound; the
    next one planned the unbound members again, others took their room meanwhile, and the gang stayed
    partial past its timeout."""
    h = await planned_pair(harness, gpus=3)
    assert not kept_plans(h), "a plan not released yet is not kept (none of its members is bound)"
    real = h.extender.scheduling.prepare

    async def refuse_b(record: Any, alloc: Any) -> str | None:
        if record.key == "ns/b":
            return "hand-off ConfigMap could not be written yet"
        return await real(record, alloc) if real is not None else None

    h.extender.scheduling.prepare = refuse_b
    binds = [asyncio.ensure_future(h.extender.scheduling.bind(binding(h, n, "n0"))) for n in "ab"]
    assert [bool(r.error) for r in await asyncio.gather(*binds)] == [False, True]
    await settle(h.server)
    (kept,) = kept_plans(h)
    planned_b = h.extender.cache.assumed[units.PodKey("ns/b")]
    next_one = await successor(h)
    try:
        assert next_one.cache.assumed.get(units.PodKey("ns/b")) == planned_b, "b's room held before anything is served"
        outsider = await h.create(gpu_pod("outsider", milli=None, count=2))
        assert not next_one.scheduling.filter(h.args(outsider)).node_names, "nobody takes the gang's room"
        assert next_one.scheduling.filter(h.args(h.server.get_object(paths.pod("ns", "b")) or {})).node_names == ["n0"]
        assert (await next_one.scheduling.bind(binding(h, "b", "n0"))).error == "", "bound at once: released"
        await settle(h.server)
        shown = (h.server.get_object(paths.pod("ns", "b")) or {})["metadata"]["annotations"][names.ALLOCATION]
        assert shown == planned_b.to_json(), "on the GPUs planned for it"
        await next_one.scheduling.expire()
        await settle(h.server)
        assert not next_one.scheduling.gangs.plans, "the complete gang's plan ends"
        assert not kept_plans(h), f"and its ConfigMap {kept['metadata']['name']} is deleted"
    finally:
        await next_one.stop()


async def test_a_plan_that_cannot_be_kept_is_not_released(harness: Callable[..., Any]) -> None:
    h = await planned_pair(harness)
    h.extender.scheduling.gangs.barrier_wait = 0.05
    h.server.fail(503, method="POST", path=paths.configmaps(names.SYSTEM_NAMESPACE))
    binds = [asyncio.ensure_future(h.extender.scheduling.bind(binding(h, n, "n0"))) for n in "ab"]
    errors = [r.error for r in await asyncio.gather(*binds)]
    assert all(errors) and any("its plan cannot be written to the API yet" in e for e in errors), errors
    await settle(h.server)
    assert not any((h.server.get_object(paths.pod("ns", n)) or {})["spec"].get("nodeName") for n in "ab")
    assert free_gpus(h) == 0, "still planned, and held"
    binds = [asyncio.ensure_future(h.extender.scheduling.bind(binding(h, n, "n0"))) for n in "ab"]
    assert [r.error for r in await asyncio.gather(*binds)] == ["", ""]
    assert len(kept_plans(h)) == 1


async def test_a_kept_plan_whose_members_are_gone_is_deleted_not_restored(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=2, assume_ttl=300.0)
    kept = gangs.plan_configmap("ns/old", {units.PodKey("ns/x"): ("uid-gone", h_alloc("ns/x"))})
    await h.api.create(paths.configmaps(names.SYSTEM_NAMESPACE), kept)
    forged = gangs.plan_configmap("ns/other", {units.PodKey("ns/y"): ("u", h_alloc("ns/y"))})
    forged["metadata"]["name"] = gangs.plan_name("ns/elsewhere")  # a name that is not its gang's
    await h.api.create(paths.configmaps(names.SYSTEM_NAMESPACE), forged)
    await settle(h.server)
    assert h.extender.scheduling.gangs.restore() == 0
    await h.extender.scheduling.expire()
    await settle(h.server)
    assert [c["metadata"]["name"] for c in kept_plans(h)] == [forged["metadata"]["name"]], "the ended plan is deleted"
    assert free_gpus(h) == 2 and not h.extender.cache.assumed, "and neither holds anything"


def h_alloc(pod: str) -> allocation.Allocation:
    grant = allocation.DeviceGrant(index=0, milli=1000, memory_mib=16384, limit_milli=1000)
    return allocation.Allocation(
        pod=units.PodKey(pod), node=units.NodeName("n0"), containers=(allocation.ContainerAllocation("main", (grant,)),)
    )


async def test_a_late_deletion_of_an_older_plan_leaves_the_newer_one_kept(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=2)
    book = h.extender.scheduling.gangs
    body = gangs.plan_configmap("ns/job", {units.PodKey("ns/a"): ("uid-a", h_alloc("ns/a"))})

    def shown(uid: str) -> wire.ConfigMap:
        return msgspec.convert({**body, "metadata": {**body["metadata"], "uid": uid}}, wire.ConfigMap)

    book.on_configmap(wire.EventType.ADDED, shown("new"))
    book.on_configmap(wire.EventType.DELETED, shown("old"))
    assert book.kept["ns/job"].uid == "new", "the older plan's deletion does not drop the newer"
    book.on_configmap(wire.EventType.DELETED, shown("new"))
    assert "ns/job" not in book.kept


async def test_a_member_bound_after_the_fleet_changed_while_its_gang_gathered_goes_to_the_node_named(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """n0 leaves sharegpu's inventory while the members wait for each other at the bind, so n1 moves
    from row 1 to row 0, and a member's assumption is lost meanwhile: the member is placed on the row
    of the node kube-scheduler named now, not on the row that node had before the wait."""
    h: Harness = await harness(nodes=2, gpus=2, assume_ttl=300.0)
    assert await h.schedule(await h.create(gpu_pod("filler", milli=None, count=2)), ["n0"]) == "n0"
    await settle(h.server)
    a = await h.create(member("a", minimum=2))
    await h.create(member("b", minimum=2))
    assert h.extender.scheduling.filter(h.args(a)).node_names == ["n1"]
    book = h.extender.scheduling.gangs
    gather = book.arrive
    changed = False

    async def arrive(record: pods.Record) -> str | None:
        nonlocal changed
        if not changed:
            changed = True
            h.server.remove_object(paths.device("n0"))
            await settle(h.server)
            assert h.extender.cache.state.row("n1") == 0
            h.extender.cache.forget(record.key)  # its assumption lost meanwhile
        return await gather(record)

    monkeypatch.setattr(book, "arrive", arrive)
    binds = [asyncio.ensure_future(h.extender.scheduling.bind(binding(h, n, "n1"))) for n in "ab"]
    assert [r.error for r in await asyncio.gather(*binds)] == ["", ""]
    await settle(h.server)
    for name in "ab":
        stored = h.server.get_object(paths.pod("ns", name))
        assert stored is not None
        shown = pods.allocation_of(wire.convert(stored, wire.Pod))
        assert shown is not None and shown.node == "n1" == stored["spec"]["nodeName"]


# ----------------------------------------------------------------- found by a review (stop 64)


async def test_a_gang_beyond_its_namespaces_quota_holds_nothing(harness: Callable[..., Any]) -> None:
    """A member's own filter counts itself alone; the plan holds every member at once, so the plan is
    what the quota must allow: six one-GPU members under a quota of two GPUs hold nothing (before,
    the first filter held all six for the gang's timeout, again and again)."""
    h: Harness = await harness(nodes=2, gpus=4, assume_ttl=300.0)

    def quota(milli: int) -> None:
        hard = {"requests.sharegpu.io/gpu-milli-total": str(milli)}
        if h.server.get_object("/api/v1/namespaces/ns/resourcequotas/gpus") is not None:
            h.server.remove_object("/api/v1/namespaces/ns/resourcequotas/gpus")
        h.server.put_object(
            paths.RESOURCE_QUOTAS, {"metadata": {"name": "gpus", "namespace": "ns"}, "spec": {"hard": hard}}
        )

    quota(2000)
    await settle(h.server)
    made = [await h.create(member(f"w{i}", minimum=6)) for i in range(6)]
    verdict = h.extender.scheduling.filter(h.args(made[0]))
    assert not verdict.node_names and not h.extender.cache.assumed and not h.extender.scheduling.gangs.plans
    assert "6 member(s) at once" in next(iter(verdict.failed_nodes.values()))
    quota(6000)
    await settle(h.server)
    assert h.extender.scheduling.filter(h.args(made[0])).node_names, "within the quota: planned"
    assert len(h.extender.cache.assumed) == 6


async def test_a_gang_with_more_members_waiting_than_its_quota_admits_is_placed_within_it(
    harness: Callable[..., Any],
) -> None:
    """Minimum two, three waiting, a quota of two GPUs, room for all three: the plan takes as many
    members as the quota admits together (two), not every one that fits, which the quota then
    refused, again and again, while the GPUs stayed free."""
    h: Harness = await harness(nodes=1, gpus=3, assume_ttl=300.0)
    hard = {"requests.sharegpu.io/gpu-milli-total": "2000"}
    quota = {"metadata": {"name": "gpus", "namespace": "ns"}, "spec": {"hard": hard}}
    h.server.put_object(paths.RESOURCE_QUOTAS, quota)
    await settle(h.server)
    made = [await h.create(member(f"w{i}", minimum=2)) for i in range(3)]
    verdict = h.extender.scheduling.filter(h.args(made[0]))
    assert verdict.node_names == ["n0"], verdict.failed_nodes
    assert len(h.extender.cache.assumed) == 2, "two members held: what the quota admits at once"


async def test_a_member_whose_plan_was_given_back_does_not_bind_alone(harness: Callable[..., Any]) -> None:
    """kube-scheduler's bind of a member can come after its plan was given back at the gang's
    timeout (a slow PreBind): it is refused, not bound alone into a gang that may never complete."""
    h = await planned_pair(harness, timeout="20")
    h.clock.advance(21)
    await h.extender.scheduling.expire()
    assert not h.extender.scheduling.gangs.plans
    result = await h.extender.scheduling.bind(binding(h, "a", "n0"))
    await settle(h.server)
    assert "no plan holds this member" in result.error
    assert not (h.server.get_object(paths.pod("ns", "a")) or {})["spec"].get("nodeName")


async def test_a_member_with_no_plan_at_all_does_not_bind_alone_but_one_beyond_the_minimum_does(
    harness: Callable[..., Any],
) -> None:
    """A bind with no plan made here (an extender started between the member's filter and its bind):
    refused while the gang lacks its minimum; a member beyond a minimum already running binds."""
    h: Harness = await harness(nodes=1, gpus=3)
    await h.create(member("a", minimum=2))
    await h.create(member("b", minimum=2))
    assert "no plan holds this member" in (await h.extender.scheduling.bind(binding(h, "a", "n0"))).error
    for name in "ab":  # bound by something else meanwhile
        target = {"apiVersion": "v1", "kind": "Node", "name": "n0"}
        await h.api.create(paths.binding("ns", name), {"metadata": {"name": name}, "target": target})
    await settle(h.server)
    await h.create(member("c", minimum=2))
    assert (await h.extender.scheduling.bind(binding(h, "c", "n0"))).error == ""


async def test_a_member_bound_before_the_watch_shows_it_keeps_its_room(harness: Callable[..., Any]) -> None:
    """A released plan given back because a member went (here c, whose hand-off could not be made)
    must not free the room of members whose binding was written but not yet seen on the watch."""
    h: Harness = await harness(nodes=1, gpus=3, assume_ttl=300.0)
    made = [await h.create(member(n, minimum=3)) for n in "abc"]
    for pod in made:
        assert h.extender.scheduling.filter(h.args(pod)).node_names == ["n0"]
    ready = h.extender.scheduling.prepare

    async def refuse_c(record: pods.Record, alloc: allocation.Allocation) -> str | None:
        if record.key == "ns/c":
            return "hand-off not written yet"
        return await ready(record, alloc) if ready is not None else None

    h.extender.scheduling.prepare = refuse_c
    c = h.extender.cache.record(units.PodKey("ns/c"))
    assert c is not None
    h.server.stall_watches()  # a's and b's bindings are not shown yet
    results = await asyncio.gather(*(h.extender.scheduling.bind(binding(h, n, "n0")) for n in "abc"))
    assert [bool(r.error) for r in results] == [False, False, True]
    h.extender.cache.on_pod(wire.EventType.DELETED, c)  # c goes, shown before a's and b's bindings
    h.extender.scheduling.gangs.settle(lambda key: False)
    assert units.PodKey("ns/a") in h.extender.cache.ledger and units.PodKey("ns/b") in h.extender.cache.ledger
    assert free_gpus(h) == 1, "only c's GPU is free"


async def test_a_replacement_member_stays_in_the_rack_its_gang_runs_in(harness: Callable[..., Any]) -> None:
    """A gang with `gang-topology: rack` running in r0 loses a member; its replacement goes to r0 or
    waits, never to r1 (the running members' rack bounds the plan)."""
    h: Harness = await harness(nodes=2, gpus=2, assume_ttl=300.0)
    for node, value in (("n0", "r0"), ("n1", "r1")):
        await h.api.patch(paths.node(node), {"metadata": {"labels": {"rack": value}}})
    await settle(h.server)
    rack = {names.GANG_TOPOLOGY: "rack"}
    a, b = await h.create(member("a", minimum=2, **rack)), await h.create(member("b", minimum=2, **rack))
    there = h.extender.scheduling.filter(h.args(a)).node_names[0]
    assert h.extender.scheduling.filter(h.args(b)).node_names == [there]
    results = await asyncio.gather(*(h.extender.scheduling.bind(binding(h, n, there)) for n in "ab"))
    assert [r.error for r in results] == ["", ""]
    await settle(h.server)
    await h.extender.scheduling.expire()
    await h.api.delete(paths.pod("ns", "b"))  # b fails; its controller makes b2
    h.server.finish_deletions()
    await settle(h.server)
    filler = await h.create(gpu_pod("filler", milli=None, count=1))
    assert await h.schedule(filler, [there]) == there  # a lone pod takes b's GPU meanwhile
    b2 = await h.create(member("b2", minimum=2, **rack))
    verdict = h.extender.scheduling.filter(h.args(b2))
    assert not verdict.node_names, f"b2 planned outside a's rack: {verdict.node_names}"
