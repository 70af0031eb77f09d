"""The scheduling service (filter, prioritize, bind, expiry) over the fake API server."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sharegpu.api import extender as api_extender
from sharegpu.api import names, paths, pods, reasons, wire
from sharegpu.core import allocation, units
from sharegpu.extender import scheduling
from tests import builders
from tests.builders import MakeAllocation
from tests.extender.conftest import Harness, gpu_pod, settle


async def test_filter_narrows_to_the_policys_choice_and_bind_records_the_allocation(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=3)
    first = await h.create(gpu_pod("a", milli=300))
    node = await h.schedule(first)
    stored = h.server.get_object(paths.pod("ns", "a"))
    assert stored is not None and stored["spec"]["nodeName"] == node
    alloc = allocation.Allocation.from_json(
        stored["metadata"]["annotations"][names.ALLOCATION], pod=units.PodKey("ns/a")
    )
    assert alloc.node == node and alloc.gpu_milli_total == 300
    second = await h.create(gpu_pod("b", milli=300))
    verdict = h.extender.scheduling.filter(h.args(second))
    assert verdict.node_names == [node], "a sharing pod packs next to the first (fgd-used)"
    entry = h.extender.cache.ledger.get(units.PodKey("ns/a"))
    assert entry is not None and entry.phase.value == "Added"


async def test_pods_with_soft_preferences_are_not_narrowed(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=3)
    preferred = {
        "affinity": {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 10,
                        "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    }
                ]
            }
        }
    }
    pod = await h.create(gpu_pod("p", milli=300, spec=preferred))
    verdict = h.extender.scheduling.filter(h.args(pod))
    assert sorted(verdict.node_names) == ["n0", "n1", "n2"]
    scores = {p.host: p.score for p in h.extender.scheduling.prioritize(h.args(pod, verdict.node_names))}
    assert sorted(scores.values())[-1] == api_extender.MAX_SCORE
    assert all(5 <= s <= api_extender.MAX_SCORE for s in scores.values()), "feasible nodes keep within half the range"


async def test_unschedulable_pods_get_short_aggregated_reasons_at_any_size(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=120, gpus=1)
    for i in range(120):
        filler = MakeAllocation(f"ns/fill-{i}", f"n{i}").grant(0, 400 + (i % 5) * 100, limit=800)
        h.extender.cache.ledger.add(filler.obj())
    pod = await h.create(gpu_pod("big", milli=700, annotations={names.MODELS: "T4"}))
    nodes = [*sorted(h.extender.cache.nodes), "no-such-node"]
    verdict = h.extender.scheduling.filter(h.args(pod, nodes))
    assert verdict.node_names == []
    assert set(verdict.failed_nodes) == set(nodes)
    assert verdict.failed_and_unresolvable == {"no-such-node": reasons.NO_INVENTORY}
    texts = set(verdict.failed_nodes.values())
    assert texts == {reasons.NO_INVENTORY, "sharegpu: no GPU with 700 milli-GPU free (largest free: 600)"}
    message = reasons.Failures(verdict.failed_nodes, {}).message(len(nodes))
    assert message.startswith("0/121 nodes are available: 1 sharegpu: node has no GPU inventory")
    assert len(message) < 400


async def test_wrong_models_are_unresolvable_and_malformed_requests_say_why(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2)
    pod = await h.create(gpu_pod("a100", milli=300, annotations={names.MODELS: "A100"}))
    verdict = h.extender.scheduling.filter(h.args(pod))
    assert set(verdict.failed_and_unresolvable) == {"n0", "n1"}
    assert set(verdict.failed_nodes.values()) == {"sharegpu: no GPU of model A100"}
    bad = gpu_pod("bad", milli=300)
    bad["spec"]["containers"][0]["resources"]["limits"][names.GPU_MILLI] = "3000"
    verdict = h.extender.scheduling.filter(api_extender.Args.of(wire.convert(bad, wire.Pod), ["n0"]))
    assert "sharegpu.io/gpu-milli must be an integer in 1..1000" in verdict.failed_nodes["n0"]
    assert verdict.failed_and_unresolvable == verdict.failed_nodes


async def test_a_pod_demanding_an_isolation_mode_goes_only_where_it_is_offered(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2)
    pod = await h.create(gpu_pod("mps", milli=300, annotations={names.ISOLATION: "mps"}))
    verdict = h.extender.scheduling.filter(h.args(pod))
    assert set(verdict.failed_and_unresolvable) == {"n0", "n1"}
    assert set(verdict.failed_nodes.values()) == {"sharegpu: isolation mps not offered on the node"}
    device = h.server.get_object(paths.device("n1"))
    assert device is not None
    device["spec"]["isolation"] = ["hami-core", "mps"]
    h.server.remove_object(paths.device("n1"))
    h.server.put_object(paths.DEVICES, device)
    await settle(h.server)
    assert await h.schedule(pod) == "n1"
    typo = gpu_pod("typo", milli=300, annotations={names.ISOLATION: "mpss"})
    verdict = h.extender.scheduling.filter(api_extender.Args.of(wire.convert(typo, wire.Pod), ["n0"]))
    assert "unknown isolation mode 'mpss' (known: none, hami-core, mps, mig)" in verdict.failed_nodes["n0"]


async def test_a_compute_guarantee_goes_only_where_the_mode_enforces_compute(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2)
    annotations = {names.ISOLATION: "hami-core", names.COMPUTE_GUARANTEE: "true"}
    pod = await h.create(gpu_pod("sure", milli=300, annotations=annotations))
    for name, compute in (("n0", False), ("n1", True)):
        device = h.server.get_object(paths.device(name))
        assert device is not None
        device["spec"]["isolation"] = ["hami-core"]
        device["spec"]["enforcement"] = [{"mode": "hami-core", "offered": True, "memory": True, "compute": compute}]
        h.server.remove_object(paths.device(name))
        h.server.put_object(paths.DEVICES, device)
    await settle(h.server)
    verdict = h.extender.scheduling.filter(h.args(pod, ["n0"]))
    reason = "sharegpu: isolation hami-core enforcing compute not offered on the node"
    assert verdict.failed_and_unresolvable == {"n0": reason}
    assert await h.schedule(pod) == "n1"


async def test_a_refused_binding_forgets_the_assumption_once(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1)
    await h.create(gpu_pod("a", milli=600))
    meta = h.server.get_object(paths.pod("ns", "a"))["metadata"]  # type: ignore[index]
    h.server.fail(403, method="POST", path=paths.binding("ns", "a"))
    args = api_extender.BindingArgs(pod_name="a", pod_namespace="ns", pod_uid=meta["uid"], node="n0")
    result = await h.extender.scheduling.bind(args)
    assert "binding ns/a to n0 failed" in result.error
    assert units.PodKey("ns/a") not in h.extender.cache.ledger
    assert not h.extender.scheduling.unsure
    assert int(h.extender.cache.state.milli_free.sum()) == 2000, "nothing leaked"
    assert (await h.extender.scheduling.bind(args)).error == ""


def _late_watches(h: Harness) -> None:
    """The watch shows nothing for now (the API server's watch cache lags after its restart)."""
    h.server.cut_watches()
    h.server.fail(503, method="WATCH", times=10_000)


async def _bind(h: Harness, name: str, node: str = "n0") -> api_extender.BindingResult:
    meta = h.server.get_object(paths.pod("ns", name))["metadata"]  # type: ignore[index]
    args = api_extender.BindingArgs(pod_name=name, pod_namespace="ns", pod_uid=meta["uid"], node=node)
    return await h.extender.scheduling.bind(args)


@pytest.mark.parametrize("fault", ["lost", "5xx", "409"])
async def test_a_binding_whose_answer_was_lost_keeps_its_room_until_it_is_read_back(
    harness: Callable[..., Any], fault: str
) -> None:
    """The API server commits the binding and the answer never arrives (or a proxy answers 503, or
    the API server itself 409, as pods/binding does for an etcd error after the commit: seen in
    bench/chaos.py): the pod is bound, so its share must stay in the books and nothing else may be
    placed in its room."""
    h: Harness = await harness(nodes=1, gpus=1)
    await h.create(gpu_pod("a", milli=600))
    second = await h.create(gpu_pod("b", milli=600))
    _late_watches(h)
    if fault == "lost":
        h.server.lose(method="POST", path=paths.binding("ns", "a"))
    else:
        h.server.fail(int(fault.replace("5xx", "503")), method="POST", path=paths.binding("ns", "a"), after_commit=True)
    result = await _bind(h, "a")
    stored = h.server.get_object(paths.pod("ns", "a"))
    assert stored is not None and stored["spec"]["nodeName"] == "n0", "the binding did happen"
    cache = h.extender.cache
    verdict = h.extender.scheduling.filter(h.args(second))
    assert verdict.node_names == [], "nothing is placed in the room of a binding that may have happened"
    assert int(cache.state.milli_free[0, 0]) == 400, "its share is still held"
    assert "outcome unknown" in result.error
    again = h.extender.scheduling.filter(h.args(await h.create(gpu_pod("a2", milli=300))))
    assert again.node_names == ["n0"], "the rest of the GPU is still usable"
    assert await h.extender.scheduling.settle(units.PodKey("ns/a")) is True
    entry = cache.ledger.get(units.PodKey("ns/a"))
    assert entry is not None and entry.phase.value == "Added", "confirmed from the API"
    assert not h.extender.scheduling.unsure
    h.server.faults.clear()


@pytest.mark.parametrize("then", ["stale-view", "rebuild"])
async def test_a_binding_read_back_as_done_keeps_its_room_against_older_views(
    harness: Callable[..., Any], then: str
) -> None:
    """A binding whose answer was lost, read back as done before the watch shows it: an older view
    of the pod (unbound: a relist served from a lagging cache after an API server restart) or a
    ledger rebuild (a Device changed) must not give its room away (bench/chaos.py --dra seed 19: one
    GPU at 1500 milli). A pod once bound never becomes unbound, so such a view is stale."""
    h: Harness = await harness(nodes=1, gpus=1)
    unbound = await h.create(gpu_pod("a", milli=600))
    second = await h.create(gpu_pod("b", milli=600))
    _late_watches(h)
    h.server.fail(503, method="POST", path=paths.binding("ns", "a"), after_commit=True)
    assert "outcome unknown" in (await _bind(h, "a")).error
    assert await h.extender.scheduling.settle(units.PodKey("ns/a")) is True, "read back: bound"
    cache = h.extender.cache
    if then == "stale-view":
        cache.on_pod(wire.EventType.MODIFIED, pods.record(wire.convert(unbound, wire.Pod)))
    else:
        cache.rebuild()
    assert int(cache.state.milli_free[0, 0]) == 400, "its share is still held"
    assert h.extender.scheduling.filter(h.args(second)).node_names == [], "nothing placed in its room"
    h.server.faults.clear()


async def test_a_binding_lost_on_its_way_in_is_read_back_then_written_again(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1, assume_ttl=30.0)
    pod = await h.create(gpu_pod("a", milli=600))
    second = await h.create(gpu_pod("b", milli=600))
    h.server.lose(method="POST", path=paths.binding("ns", "a"), after_commit=False)
    assert "outcome unknown" in (await _bind(h, "a")).error
    service = h.extender.scheduling
    assert service.filter(h.args(pod)).node_names == ["n0"], "offered only the node it holds"
    assert service.filter(h.args(pod, ["n9"])).failed_nodes == {"n9": scheduling.UNSURE_MESSAGE}
    assert service.filter(h.args(second)).node_names == []
    assert await service.settle(units.PodKey("ns/a")) is None, "unbound, but too soon to believe it"
    h.clock.advance(60)
    assert await service.expire() == 0, "expiry leaves unknown bindings to the read-back"
    assert units.PodKey("ns/a") in h.extender.cache.assumed
    service.settle_after = 0.05
    h.clock.now -= 60  # the bind waits out the rest of the settle time on its own
    result = await _bind(h, "a")
    assert result.error == "", "read back as not done, then written"
    stored = h.server.get_object(paths.pod("ns", "a"))
    assert stored is not None and stored["spec"]["nodeName"] == "n0"
    await settle(h.server)
    entry = h.extender.cache.ledger.get(units.PodKey("ns/a"))
    assert entry is not None and entry.phase.value == "Added" and int(h.extender.cache.state.milli_free[0, 0]) == 400


async def test_an_unknown_binding_of_a_pod_that_went_is_forgotten(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await h.create(gpu_pod("a", milli=600))
    _late_watches(h)
    h.server.lose(method="POST", path=paths.binding("ns", "a"), after_commit=False)
    assert "outcome unknown" in (await _bind(h, "a")).error
    h.server.remove_object(paths.pod("ns", "a"))
    await h.extender.scheduling.settle_all()
    assert not h.extender.scheduling.unsure
    assert int(h.extender.cache.state.milli_free[0, 0]) == 1000
    h.server.faults.clear()


async def test_a_bind_whose_caller_gives_up_still_completes(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1)
    await h.create(gpu_pod("a", milli=600))
    meta = h.server.get_object(paths.pod("ns", "a"))["metadata"]  # type: ignore[index]
    args = api_extender.BindingArgs(pod_name="a", pod_namespace="ns", pod_uid=meta["uid"], node="n0")
    call = asyncio.create_task(h.extender.scheduling.bind(args))
    await asyncio.sleep(0)
    call.cancel()  # kube-scheduler's HTTP timeout
    await asyncio.sleep(0.05)
    stored = h.server.get_object(paths.pod("ns", "a"))
    assert stored is not None and stored["spec"].get("nodeName") == "n0", "the shielded binding went through"
    await settle(h.server)
    entry = h.extender.cache.ledger.get(units.PodKey("ns/a"))
    assert entry is not None and entry.phase.value == "Added"


async def test_binds_are_refused_for_replaced_bound_or_unfit_pods(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1)
    pod = await h.create(gpu_pod("a", milli=600))
    await h.schedule(pod)
    uid = h.server.get_object(paths.pod("ns", "a"))["metadata"]["uid"]  # type: ignore[index]
    again = await h.extender.scheduling.bind(
        api_extender.BindingArgs(pod_name="a", pod_namespace="ns", pod_uid=uid, node="n0")
    )
    assert "already bound to n0" in again.error
    replaced = await h.extender.scheduling.bind(
        api_extender.BindingArgs(pod_name="a", pod_namespace="ns", pod_uid="old-uid", node="n0")
    )
    assert "was replaced" in replaced.error
    big = await h.create(gpu_pod("big", nvidia=2))
    uid = big["metadata"]["uid"]
    refused = await h.extender.scheduling.bind(
        api_extender.BindingArgs(pod_name="big", pod_namespace="ns", pod_uid=uid, node="n0")
    )
    assert "pod ns/big no longer fits on n0" in refused.error and "a whole GPU must be entirely free" in refused.error


async def test_stale_assumptions_are_confirmed_or_forgotten_from_the_api(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, assume_ttl=30.0)
    cache = h.extender.cache
    await h.create(gpu_pod("bound", milli=200))
    await h.create(gpu_pod("never", milli=300))
    decision = cache.placer.decide(cache.record(units.PodKey("ns/never")).request.demand)  # type: ignore[union-attr]
    for name in ("bound", "never"):
        record = cache.record(units.PodKey(f"ns/{name}"))
        assert record is not None and record.request is not None
        alloc = cache.placer.allocation_for(record.request, cache.placer.decide(record.request.demand))
        assert cache.assume(alloc)
        if name == "bound":  # the binding happened, but its watch event is lost
            body = {
                "metadata": {"name": name, "annotations": {names.ALLOCATION: alloc.to_json()}},
                "target": {"name": "n0"},
            }
            h.server.cut_watches()
            h.server.fail(503, method="WATCH", times=1000)
            await h.api.create(paths.binding("ns", name), body)
    del decision
    assert await h.extender.scheduling.expire() == 0, "not stale yet"
    h.clock.advance(31)
    assert await h.extender.scheduling.expire() == 1
    assert units.PodKey("ns/never") not in cache.ledger
    entry = cache.ledger.get(units.PodKey("ns/bound"))
    assert entry is not None and entry.phase.value == "Added", "confirmed from the API, not forgotten"
    assert await h.extender.scheduling.expire() == 0, "forgotten once"
    h.server.faults.clear()


async def test_filter_reserves_its_choice_until_the_bind(harness: Callable[..., Any]) -> None:
    """kube-scheduler filters the next pod while the last one's bind is on its way: the next pod
    must see the last one's share, or both get the same GPU and the second bind fails."""
    h: Harness = await harness(nodes=1, gpus=1)
    first = await h.create(gpu_pod("first", milli=600))
    second = await h.create(gpu_pod("second", milli=600))
    assert h.extender.scheduling.filter(h.args(first)).node_names == ["n0"]
    verdict = h.extender.scheduling.filter(h.args(second))
    assert verdict.node_names == [], "the first pod's reservation holds the GPU"
    again = h.extender.scheduling.filter(h.args(first))
    assert again.node_names == ["n0"], "filtering the same pod again replaces its reservation, not adds one"
    assert int(h.extender.cache.state.milli_free[0, 0]) == 400
    uid = first["metadata"]["uid"]
    result = await h.extender.scheduling.bind(
        api_extender.BindingArgs(pod_name="first", pod_namespace="ns", pod_uid=uid, node="n0")
    )
    assert result.error == ""
    await settle(h.server)
    entry = h.extender.cache.ledger.get(units.PodKey("ns/first"))
    assert entry is not None and entry.phase.value == "Added" and int(h.extender.cache.state.milli_free[0, 0]) == 400


async def test_a_reservation_whose_bind_never_comes_expires(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1, assume_ttl=30.0)
    pod = await h.create(gpu_pod("abandoned", milli=600))
    assert h.extender.scheduling.filter(h.args(pod)).node_names == ["n0"]
    assert int(h.extender.cache.state.milli_free[0, 0]) == 400
    h.clock.advance(31)
    assert await h.extender.scheduling.expire() == 1
    assert int(h.extender.cache.state.milli_free[0, 0]) == 1000
    assert not h.extender.scheduling.reserved or await h.extender.scheduling.expire() == 0
    assert not h.extender.scheduling.reserved


async def test_candidate_lists_in_any_order_map_to_their_rows_and_a_repeat_is_not_mapped_again(
    harness: Callable[..., Any],
) -> None:
    """kube-scheduler starts filtering at a different node each cycle and its filter goroutines
    append passing nodes as they finish, so the same candidates come in another order: every order
    maps each name to its own row (unknown names to -1), and a text seen lately is not mapped again."""
    h: Harness = await harness(nodes=4)
    service = h.extender.scheduling
    pod = await h.create(gpu_pod("a", milli=300))
    row = h.extender.cache.state.row_of
    order = ["n0", "n1", "n2", "n3"]
    first = service._candidates(h.args(pod, order))
    assert service._candidates(h.args(pod, order)) is first
    for other in [*itertools.permutations(order), ("n1", "n2", "n3"), ("n3", "n0", "n1", "n9"), ("x", "n2")]:
        got = service._candidates(h.args(pod, list(other)))
        assert got.looked.tolist() == [row.get(n, -1) for n in other]
        assert got.rows.tolist() == [row[n] for n in other if n in row]
        sent, known, missing = got.split()
        assert sent == list(other) and got.names() == list(other)
        assert known == [n for n in other if n in row]
        assert missing == [n for n in other if n not in row]


async def test_filter_chooses_the_policys_best_candidate_whether_or_not_the_best_node_of_all_is_one(
    harness: Callable[..., Any],
) -> None:
    """Filter first looks for the best node of all in the candidate text (no mapping of the names);
    whatever kube-scheduler left out, the answer is the policy's choice among the candidates."""
    h: Harness = await harness(nodes=12, gpus=2)
    for i in range(12):  # nodes differ, so the policy has an order
        filler = MakeAllocation(f"ns/fill-{i}", f"n{i}").grant(i % 2, 100 + (i * 70) % 800, limit=800)
        h.extender.cache.ledger.add(filler.obj())
    service = h.extender.scheduling
    cache = h.extender.cache
    pod = await h.create(gpu_pod("p", milli=300))
    key = pods.key(h.args(pod).pod)
    demand = service._request(h.args(pod).pod).demand
    everyone = sorted(cache.nodes)
    ranked: list[str] = []
    left = list(everyone)
    while left:  # the policy's order over all nodes
        best = cache.placer.decide(demand, np.array([cache.state.row_of[n] for n in left])).node
        assert best is not None
        ranked.append(best)
        left.remove(best)
    rng = random.Random(5)
    for dropped in [0, 0, 1, 2, 3, 4, 5, 8, 11]:
        offered = [n for n in everyone if n not in ranked[:dropped]]
        rng.shuffle(offered)
        offered.append("cpu-only-node")
        service._lists.clear()
        verdict = service.filter(h.args(pod, offered))
        assert verdict.node_names == [ranked[dropped]]
        assert bool(service._lists) == (dropped >= scheduling.QUICK_TRIES), "mapped only after the quick tries"
        assert service.outcomes[key].chosen == ranked[dropped]
        cache.forget(key)


async def test_filter_takes_the_request_the_cache_parsed_unless_the_pod_says_otherwise(
    harness: Callable[..., Any],
) -> None:
    """The informer parsed the pod's request already; filter reuses it for that pod, and parses the
    pod it is sent when that one carries other request annotations (a newer version)."""
    h: Harness = await harness(nodes=2)
    service = h.extender.scheduling
    pod = await h.create(gpu_pod("a", milli=300))
    known = h.extender.cache.record(pods.key(h.args(pod).pod))
    assert known is not None and known.request is not None
    assert service._request(h.args(pod).pod) is known.request
    newer = h.args(pod).pod
    newer.metadata.annotations[names.LIMIT_MILLI] = "800"
    parsed = service._request(newer)
    assert parsed is not known.request
    assert parsed.containers[0].gpu is not None and parsed.containers[0].gpu.limit_milli == 800


async def test_a_pod_may_ask_for_binpack_or_spread_placement(harness: Callable[..., Any]) -> None:
    """A SharedDeviceGroup's holder pod carries its group's strategy; other pods follow the policy."""
    h: Harness = await harness(nodes=3, gpus=4)
    first = await h.create(gpu_pod("first", milli=None, nvidia=2))
    fuller = await h.schedule(first)
    packed = await h.create(gpu_pod("packed", milli=None, nvidia=2, annotations={names.PLACEMENT: "binpack"}))
    assert h.extender.scheduling.filter(h.args(packed)).node_names == [fuller]
    spread = await h.create(gpu_pod("spread", milli=None, nvidia=2, annotations={names.PLACEMENT: "spread"}))
    chosen = h.extender.scheduling.filter(h.args(spread)).node_names
    assert chosen is not None and chosen != [fuller]
    ranked = {p.host: p.score for p in h.extender.scheduling.prioritize(h.args(spread))}
    assert ranked[chosen[0]] > ranked[fuller]


async def test_a_lost_binding_read_back_unbound_is_believed_only_after_a_write_could_have_landed(
    harness: Callable[..., Any],
) -> None:
    """An API server may carry the binding out long after its answer was lost (its request timeout,
    an etcd proposal that timed out and still commits): the room stays held for `SETTLE_AFTER`, and a
    bind meanwhile fails at once rather than holding kube-scheduler's call for a minute."""
    h: Harness = await harness(nodes=1, gpus=1)
    await h.create(gpu_pod("a", milli=600))
    second = await h.create(gpu_pod("b", milli=600))
    h.server.lose(method="POST", path=paths.binding("ns", "a"), after_commit=False)
    assert "outcome unknown" in (await _bind(h, "a")).error
    service, key = h.extender.scheduling, units.PodKey("ns/a")
    h.clock.advance(5)
    assert await service.settle(key) is None, "unbound 5 s later: it could still land"
    assert "cannot be read yet" in (await _bind(h, "a")).error
    assert service.filter(h.args(second)).node_names == [], "its room is held meanwhile"
    h.clock.advance(scheduling.SETTLE_AFTER)
    assert await service.settle(key) is False
    assert service.filter(h.args(second)).node_names == ["n0"]


async def test_a_lost_binding_of_a_pod_replaced_since_is_forgotten_at_once(harness: Callable[..., Any]) -> None:
    """The binding carries the pod's UID: it cannot land on the pod of that name made since, so its
    room is not held for the minute a binding of the same pod could take."""
    h: Harness = await harness(nodes=1, gpus=1)
    first = await h.create(gpu_pod("a", milli=600))
    h.server.lose(method="POST", path=paths.binding("ns", "a"), after_commit=False)
    assert "outcome unknown" in (await _bind(h, "a")).error
    _late_watches(h)  # the replacement is seen by a read only
    h.server.remove_object(paths.pod("ns", "a"))
    replacement = gpu_pod("a", milli=600)
    h.server.put_object(paths.pods("ns"), replacement)
    stored = h.server.get_object(paths.pod("ns", "a"))
    assert stored is not None and stored["metadata"]["uid"] != first["metadata"]["uid"]
    assert await h.extender.scheduling.settle(units.PodKey("ns/a")) is False
    assert units.PodKey("ns/a") not in h.extender.cache.assumed
    h.server.faults.clear()


async def test_a_binding_to_a_pod_replaced_while_it_was_prepared_binds_nothing(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleted and made again under the same name while its hand-off was written: the binding names
    the pod that went, so the new one is not bound with an allocation meant for another."""
    h: Harness = await harness(nodes=1, gpus=1)
    await h.create(gpu_pod("a", milli=600))
    service = h.extender.scheduling

    async def replaced_meanwhile(record: Any, alloc: Any) -> None:
        h.server.remove_object(paths.pod("ns", "a"))
        h.server.put_object(paths.pods("ns"), gpu_pod("a", milli=900))

    monkeypatch.setattr(service, "prepare", replaced_meanwhile)
    result = await _bind(h, "a")
    assert result.error
    stored = h.server.get_object(paths.pod("ns", "a"))
    assert stored is not None and not stored["spec"].get("nodeName")


async def test_expiry_leaves_an_assumption_whose_bind_began_during_its_read(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read shows the pod unbound because the bind that began meanwhile has not written yet:
    forgetting now would free the room the binding is about to take."""
    h: Harness = await harness(nodes=1, gpus=1, assume_ttl=30.0)
    pod = await h.create(gpu_pod("a", milli=600))
    service, key = h.extender.scheduling, units.PodKey("ns/a")
    assert service.filter(h.args(pod)).node_names == ["n0"]  # reserved: assumed until its bind
    h.clock.advance(31)
    read = service.api.get

    async def get_while_a_bind_begins(path: str, **params: str | int) -> dict[str, Any]:
        found = await read(path, **params)
        service.binding.add(key)  # kube-scheduler's bind arrived while the read was on its way
        return found

    monkeypatch.setattr(service.api, "get", get_while_a_bind_begins)
    assert await service.expire() == 0
    assert key in h.extender.cache.assumed


async def test_a_reserved_gpu_that_fails_before_the_bind_is_not_bound_to(harness: Callable[..., Any]) -> None:
    """The filter reserved GPU 0; it turns unhealthy (a critical XID) before kube-scheduler's bind: the
    bind decides again on that node instead of binding the pod to a broken GPU."""
    h: Harness = await harness(nodes=1, gpus=2)
    pod = await h.create(gpu_pod("a", milli=600))
    assert h.extender.scheduling.filter(h.args(pod)).node_names == ["n0"]
    held = h.extender.cache.assumed[units.PodKey("ns/a")]
    (reserved,) = held.gpu_usage()
    device = h.server.get_object(paths.device("n0"))
    assert device is not None
    device["spec"]["gpus"][reserved].update(healthy=False, reason="XID 79")
    await h.api.replace(paths.device("n0"), device)
    await settle(h.server)
    assert (await _bind(h, "a")).error == ""
    stored = h.server.get_object(paths.pod("ns", "a"))
    assert stored is not None
    shown = pods.allocation_of(wire.convert(stored, wire.Pod))
    assert shown is not None and list(shown.gpu_usage()) == [1 - reserved]


async def test_an_unknown_binding_whose_node_left_the_inventory_for_a_while_keeps_its_room(
    harness: Callable[..., Any],
) -> None:
    """The node's Device goes and comes back while the binding's outcome is unknown: the binding may
    still land there, so its assumption is kept aside meanwhile and holds its room again once the
    node is back."""
    h: Harness = await harness(nodes=1, gpus=1)
    await h.create(gpu_pod("a", milli=600))
    second = await h.create(gpu_pod("b", milli=600))
    h.server.lose(method="POST", path=paths.binding("ns", "a"), after_commit=False)
    assert "outcome unknown" in (await _bind(h, "a")).error
    device = h.server.get_object(paths.device("n0"))
    assert device is not None
    h.server.remove_object(paths.device("n0"))
    await settle(h.server)
    service, key = h.extender.scheduling, units.PodKey("ns/a")
    assert await service.settle(key) is None, "unbound, but it could still land"
    for field in ("resourceVersion", "uid", "creationTimestamp"):
        device["metadata"].pop(field, None)
    h.server.put_object(paths.DEVICES, device)
    await settle(h.server)
    assert service.filter(h.args(second)).node_names == [], "its room is held again"
    h.clock.advance(scheduling.SETTLE_AFTER)
    assert await service.settle(key) is False
    assert service.filter(h.args(second)).node_names == ["n0"]


async def test_a_reservation_set_aside_by_a_rebuild_expires_or_is_decided_again_at_the_bind(
    harness: Callable[..., Any],
) -> None:
    """A reservation whose GPU left the node's inventory holds nothing: its bind decides again (here
    on the GPU left), and one never bound is forgotten after `assume_ttl` like any other."""
    h: Harness = await harness(nodes=1, gpus=2, assume_ttl=30.0)
    first, second = await h.create(gpu_pod("a", milli=600)), await h.create(gpu_pod("b", milli=600))
    service, cache = h.extender.scheduling, h.extender.cache
    for pod in (first, second):
        assert service.filter(h.args(pod)).node_names == ["n0"]
    on_gpu = {name: next(iter(cache.assumed[units.PodKey(f"ns/{name}")].gpu_usage())) for name in "ab"}
    assert sorted(on_gpu.values()) == [0, 1]
    device = h.server.get_object(paths.device("n0"))
    assert device is not None
    device["spec"]["gpus"] = device["spec"]["gpus"][:1]  # GPU 1 is gone from the node
    await h.api.replace(paths.device("n0"), device)
    await settle(h.server)
    gone = next(name for name, gpu in on_gpu.items() if gpu == 1)
    kept = next(name for name, gpu in on_gpu.items() if gpu == 0)
    assert not cache.counts_assumed(units.PodKey(f"ns/{gone}")) and cache.counts_assumed(units.PodKey(f"ns/{kept}"))
    assert "GPU" in (await _bind(h, gone)).error, "decided again: GPU 0 is taken by the other reservation"
    h.clock.advance(31)
    await service.expire()
    assert units.PodKey(f"ns/{gone}") not in cache.assumed


def memory_pod(name: str, milli: int, memory: int) -> dict[str, Any]:
    limits = builders.gpu_limits(count=1, milli=milli, memory=memory)
    return builders.MakePod(name, "ns").scheduler().container(limits=limits, requests=limits).obj()


async def test_a_binding_under_way_keeps_its_room_when_a_rebuild_finds_it_no_longer_fits(
    harness: Callable[..., Any],
) -> None:
    """The agent reports its GPU 1 MiB smaller while a binding's answer is lost: the binding may
    still land, so its room stays counted (the GPU over-committed: nothing more lands there) rather
    than given to the next pod, which would make the landing binding over-commit the GPU for real."""
    h: Harness = await harness(nodes=1, gpus=1)
    await h.schedule(await h.create(memory_pod("a", 500, 8192)))
    p = await h.create(memory_pod("p", 500, 8192))
    service, cache = h.extender.scheduling, h.extender.cache
    assert service.filter(h.args(p)).node_names == ["n0"]
    h.server.lose(method="POST", path=paths.binding("ns", "p"), after_commit=False)
    assert "outcome unknown" in (await _bind(h, "p")).error
    device = h.server.get_object(paths.device("n0"))
    assert device is not None
    device["spec"]["gpus"][0]["memoryMiB"] -= 1
    await h.api.replace(paths.device("n0"), device)
    await settle(h.server)
    key = units.PodKey("ns/p")
    assert key in cache.ledger and not cache.counts_assumed(key), "counted, but no bind of its own uses it"
    q = await h.create(memory_pod("q", 400, 4000))
    assert service.filter(h.args(q)).node_names == [], "q was offered the room of p's binding"
    h.clock.advance(scheduling.SETTLE_AFTER)
    assert await service.settle(key) is False, "read back: it never landed"
    assert key not in cache.ledger and service.filter(h.args(q)).node_names == ["n0"], "its room is free again"


@pytest.mark.parametrize("rebuilds", [False, True])
async def test_a_reservation_expires_on_time_whatever_rebuilds_come_between(
    harness: Callable[..., Any], rebuilds: bool
) -> None:
    """A filter's reservation whose bind never comes is let go after `assume_ttl` from when it was
    made: a rebuild (here a node's label changing every 20 s) re-applies it but keeps its age."""
    h: Harness = await harness(nodes=2, gpus=1, assume_ttl=30.0)
    pod = await h.create(gpu_pod("p", milli=600))
    service, cache = h.extender.scheduling, h.extender.cache
    assert service.filter(h.args(pod)).node_names
    key = units.PodKey("ns/p")
    before = cache.counters.rebuilds
    for tick in range(2):
        h.clock.advance(20)
        if rebuilds:
            node = h.server.get_object(paths.node("n1"))
            assert node is not None
            node["metadata"]["labels"]["tick"] = str(tick)
            await h.api.replace(paths.node("n1"), node)
            await settle(h.server)
            assert cache.state is not None
        await service.expire()
    assert (cache.counters.rebuilds > before) is rebuilds
    assert key not in cache.assumed and key not in cache.ledger, "40 s on, the 30 s reservation is still held"


async def test_co_tenancy_labels_are_their_namespaces_own(harness: Callable[..., Any]) -> None:
    """A tenant writing another's label joins nothing of theirs: not the GPU a group holds alone
    (KubeShare's GPUID), not the GPU an affinity keeps to its own pods, not past an exclusion."""
    h = await harness(nodes=1, gpus=2)
    for name, rule in (("group", names.GROUP), ("affinity", names.AFFINITY), ("exclusion", names.EXCLUSION)):
        await h.create(gpu_pod(f"{name}-a", milli=300, namespace="team-a", annotations={rule: "secret"}))
        await h.schedule(gpu_pod(f"{name}-a", milli=300, namespace="team-a", annotations={rule: "secret"}))
        mine = await h.create(gpu_pod(f"{name}-a2", milli=300, namespace="team-a", annotations={rule: "secret"}))
        await h.schedule(mine)
        theirs = await h.create(gpu_pod(f"{name}-b", milli=300, namespace="team-b", annotations={rule: "secret"}))
        await h.schedule(theirs)
        placed = {ns: gpus_of(h, ns, pod) for ns, pod in (("team-a", f"{name}-a2"), ("team-b", f"{name}-b"))}
        assert placed["team-a"] != placed["team-b"], f"{name}: team-b's pod joined team-a's GPU {placed}"
        for ns, pod in (("team-a", f"{name}-a"), ("team-a", f"{name}-a2"), ("team-b", f"{name}-b")):
            await h.api.delete(paths.pod(ns, pod), grace_period=0)
        await settle(h.server)


def gpus_of(h: Harness, namespace: str, name: str) -> tuple[int, ...]:
    found = h.server.get_object(paths.pod(namespace, name))
    assert found is not None
    text = found["metadata"]["annotations"][names.ALLOCATION]
    return allocation.Allocation.from_json(text, pod=units.pod_key(namespace, name)).gpu_indices
