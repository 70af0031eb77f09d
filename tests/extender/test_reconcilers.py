"""The reservation and hand-off reconcilers over the fake API server: one reservation per shared GPU,
replacement with backoff, idle and duplicate cleanup, ConfigMaps written once and only for their owner."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sharegpu.api import extender as api_extender
from sharegpu.api import names, paths, pods, quantity, wire
from sharegpu.core import units
from sharegpu.extender import reservations, runtime
from sharegpu.kube import client
from tests.conftest import eventually
from tests.extender.conftest import Harness, gpu_pod, settle

SYSTEM = names.HOLDING_NAMESPACE


def reservations_in(h: Harness, live_only: bool = True) -> list[dict[str, Any]]:
    found = [
        obj
        for key, obj in h.server.objects.items()
        if key[0] == "/api/v1|pods"
        and key[1] == SYSTEM
        and not (live_only and obj["metadata"].get("deletionTimestamp"))
    ]
    return sorted(found, key=lambda o: o["metadata"]["name"])


async def report_uuids(h: Harness) -> None:
    """Play the device plugin and `sharegpu reserve`: every reservation reports a UUID."""
    for obj in reservations_in(h):
        labels = obj["metadata"]["labels"]
        if names.GPU_UUID not in (obj["metadata"].get("annotations") or {}):
            uuid = f"GPU-{labels[names.LABEL_NODE]}-{labels[names.LABEL_SLOT]}-{obj['metadata']['name'][-6:]}"
            await h.api.patch(
                paths.pod(SYSTEM, obj["metadata"]["name"]), {"metadata": {"annotations": {names.GPU_UUID: uuid}}}
            )
    await settle(h.server)


async def test_one_reservation_per_shared_gpu_and_none_when_idle(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=2)
    first = await h.create(gpu_pod("a", milli=300))
    await h.schedule(first)
    second = await h.create(gpu_pod("b", milli=300))
    await h.schedule(second)
    await eventually(lambda: len(reservations_in(h)) == 1, "one reservation for the one shared GPU")
    await settle(h.server)
    assert len(reservations_in(h)) == 1, "no second reservation while the first is pending or live"
    pod = reservations_in(h)[0]
    assert pod["spec"]["nodeName"] == "n0"
    assert pod["spec"]["containers"][0]["resources"]["limits"][names.NVIDIA_GPU] == "1"
    for name in ("a", "b"):
        await h.api.delete(paths.pod("ns", name), grace_period=0)
    await eventually(lambda: not reservations_in(h), "the idle reservation deleted")
    assert h.extender.metrics.reservations.labels("created")._value.get() == 1


async def test_reservation_pods_leave_kube_schedulers_count_of_host_room_as_the_ledger_has_it(
    harness: Callable[..., Any],
) -> None:
    """kube-scheduler counts the CPU and memory requests of every pod bound to a node, reservation
    pods included; the ledger (and the simulator) leave reservations out. Were the two counts to
    differ, kube-scheduler would filter out the node the extender ranks best whenever a pod fills
    what is left of it exactly, and the extender would pick another one (placement_fidelity at 1213
    openb nodes: 42.8% of pods on the simulator's node, first apart at the 1170th pod)."""
    h: Harness = await harness(nodes=1, gpus=2)
    await h.schedule(await h.create(gpu_pod("a", milli=300)))
    await h.schedule(await h.create(gpu_pod("b", milli=1000)))
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation for the shared GPU")
    node = h.server.get_object(paths.node("n0"))
    assert node is not None
    allocatable = node["status"]["allocatable"]
    bound = [wire.convert(o, wire.Pod) for o in h.server.list_objects(paths.PODS) if o["spec"].get("nodeName") == "n0"]
    assert len(bound) == 3, "both pods and the reservation are bound to n0"
    cpu = quantity.milli_cpu(allocatable["cpu"]) - sum(pods.host_request(p)[0] for p in bound)
    memory = quantity.mebibytes(allocatable["memory"]) - sum(pods.host_request(p)[1] for p in bound)
    state = h.extender.cache.state
    row = state.row("n0")
    assert row is not None
    assert (cpu, memory) == (int(state.cpu_free[row]), int(state.mem_free[row]))


async def test_a_lost_reservation_is_replaced_with_backoff(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    reconciler = h.extender.reservations
    await h.schedule(await h.create(gpu_pod("a", milli=300)))
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation")
    lost = reservations_in(h)[0]["metadata"]["name"]
    await h.api.patch(paths.pod(SYSTEM, lost) + "/status", {"status": {"phase": "Failed"}})
    h.clock.advance(1)  # past the first backoff (0.5 s)
    await eventually(
        lambda: len(reservations_in(h)) == 1 and reservations_in(h)[0]["metadata"]["name"] != lost, "a replacement"
    )

    def ended_gone() -> bool:
        ended = h.server.get_object(paths.pod(SYSTEM, lost))
        return ended is None or bool(ended["metadata"].get("deletionTimestamp"))

    await eventually(ended_gone, "the ended one deleted")
    backoff = reconciler.backoff[("n0", 0)]
    assert backoff.attempts == 2 and backoff.not_before > h.clock.now
    replacement = reservations_in(h)[0]["metadata"]["name"]

    def created() -> int:
        return sum(1 for m, p in h.server.requests if m == "POST" and p == paths.pods(SYSTEM))

    assert created() == 2
    await h.api.patch(paths.pod(SYSTEM, replacement) + "/status", {"status": {"phase": "Failed"}})
    for _ in range(5):
        reconciler.wake()
        await settle(h.server)
    assert created() == 2, "the backoff holds a third one back"
    h.clock.advance(60)
    await eventually(
        lambda: any(o["metadata"]["name"] not in (lost, replacement) for o in reservations_in(h)),
        "a third after the backoff",
    )
    await report_uuids(h)
    await eventually(lambda: ("n0", 0) not in reconciler.backoff, "a reported UUID resets the backoff")


def creations(h: Harness) -> int:
    return sum(1 for m, p in h.server.requests if m == "POST" and p == paths.pods(SYSTEM))


async def passes(h: Harness, count: int = 5) -> None:
    for _ in range(count):
        h.extender.reservations.wake()
        await settle(h.server)


async def test_a_reservation_created_with_its_answer_lost_is_not_created_twice(harness: Callable[..., Any]) -> None:
    """The creation happened, its answer was lost and the watch lags: the GPU must not get a second one."""
    h: Harness = await harness(nodes=1, gpus=1)
    pod = await h.create(gpu_pod("a", milli=300))
    h.server.cut_watches()
    h.server.fail(503, method="WATCH", times=10_000)
    h.server.lose(method="POST", path=paths.pods(SYSTEM))
    await h.schedule(pod)
    await eventually(lambda: creations(h) == 1, "the creation sent")
    for step in range(6):  # past every backoff, and past the read-back: it exists
        h.clock.advance(1 + step)
        await passes(h)
    assert creations(h) == 1 and len(reservations_in(h)) == 1, "one reservation, not two"
    assert not h.extender.reservations.unsure, "read back: it exists"
    h.server.faults.clear()


async def test_a_reservation_lost_on_its_way_in_is_made_again_after_reading_back(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    h.server.lose(method="POST", path=paths.pods(SYSTEM), after_commit=False)
    await h.schedule(await h.create(gpu_pod("a", milli=300)))
    await eventually(lambda: creations(h) == 1, "the creation sent")
    h.clock.advance(1)  # past the first backoff
    await passes(h)
    assert creations(h) == 1, "pending: it may exist"
    h.clock.advance(3)
    await eventually(lambda: len(reservations_in(h)) == 1 and creations(h) == 2, "read back as missing, made again")


async def test_a_reservation_whose_deletion_answer_was_lost_is_handed_to_nobody_and_deleted_again(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    reconciler = h.extender.reservations
    await h.schedule(await h.create(gpu_pod("a", milli=300)))
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation")
    await report_uuids(h)
    name = reservations_in(h)[0]["metadata"]["name"]
    h.server.lose(method="DELETE", path=paths.pod(SYSTEM, name), after_commit=False)
    await h.api.delete(paths.pod("ns", "a"), grace_period=0)  # idle now: deleted (reservation_idle 0)
    await eventually(lambda: not h.server.faults, "the deletion sent, its answer lost")
    await passes(h)
    assert reservations_in(h), "not deleted: it was lost on its way in"
    assert reconciler.holder("n0", 0) is None, "a reservation being retired is handed to nobody"
    h.clock.advance(reconciler.settle)
    await eventually(lambda: not reservations_in(h), "deleted again")


async def test_duplicates_are_cut_to_the_one_that_reported(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await h.schedule(await h.create(gpu_pod("a", milli=300)))
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation")
    await report_uuids(h)
    keeper = reservations_in(h)[0]["metadata"]["name"]
    extra = reservations.reservation_pod(names.reservation_name("n0", 0, "zzzzzz"), "n0", 0, "img")
    await h.api.create(paths.pods(SYSTEM), extra)
    await eventually(lambda: [o["metadata"]["name"] for o in reservations_in(h)] == [keeper], "the duplicate gone")


async def test_handoff_is_written_once_for_its_owner_only(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    configmap = "sharegpu-handoff-0123456789abcdef"
    owner = await h.create(gpu_pod("owner", milli=300, annotations={names.HANDOFF: configmap}))
    await h.schedule(owner)
    path = paths.configmap("ns", configmap)
    claimed = h.server.get_object(path)
    assert claimed is not None, "the bind claims the name first"
    assert claimed.get("data", {}) == {}, "nothing to see before the GPU's UUID is known: the container waits"
    assert [r["name"] for r in claimed["metadata"]["ownerReferences"]] == ["owner"]
    copycat = await h.create(gpu_pod("copycat", milli=300, annotations={names.HANDOFF: configmap}))
    verdict = h.extender.scheduling.filter(h.args(copycat))
    meta = h.server.get_object(paths.pod("ns", "copycat"))["metadata"]  # type: ignore[index]
    refused = await h.extender.scheduling.bind(
        api_extender.BindingArgs(pod_name="copycat", pod_namespace="ns", pod_uid=meta["uid"],
                                 node=verdict.node_names[0])
    )  # fmt: skip
    assert f"hand-off ConfigMap ns/{configmap} belongs to pod ns/owner" in refused.error
    assert not h.server.get_object(paths.pod("ns", "copycat"))["spec"].get("nodeName")  # type: ignore[index]
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation")
    await report_uuids(h)
    uuid = reservations_in(h)[0]["metadata"]["annotations"][names.GPU_UUID]
    await eventually(
        lambda: (h.server.get_object(path) or {}).get("data", {}).get("main.NVIDIA_VISIBLE_DEVICES") == uuid,
        "the hand-off filled",
    )
    written = h.server.get_object(path)
    assert written is not None
    assert [r["name"] for r in written["metadata"]["ownerReferences"]] == ["owner"]
    writes = sum(1 for m, p in h.server.requests if m in ("POST", "PATCH") and p.startswith(paths.configmaps("ns")))
    for _ in range(5):
        h.extender.handoffs.wake()
        await settle(h.server)
    again = sum(1 for m, p in h.server.requests if m in ("POST", "PATCH") and p.startswith(paths.configmaps("ns")))
    assert again == writes == 2, "claimed at the bind, filled once: a ConfigMap that is right is not written again"
    # The GPU's reservation is replaced: the hand-off follows the new UUID.
    old = reservations_in(h)[0]["metadata"]["name"]
    await h.api.delete(paths.pod(SYSTEM, old), grace_period=0)
    await eventually(lambda: any(o["metadata"]["name"] != old for o in reservations_in(h)), "a new reservation")
    await report_uuids(h)
    new_uuid = reservations_in(h)[0]["metadata"]["annotations"][names.GPU_UUID]
    await eventually(
        lambda: (h.server.get_object(path) or {}).get("data", {}).get("main.NVIDIA_VISIBLE_DEVICES") == new_uuid,
        "the hand-off follows the new UUID",
    )
    assert h.extender.metrics.handoffs.labels("repaired")._value.get() == 0, "nothing of this was forged"


async def test_a_pod_placed_beside_a_reported_reservation_gets_its_handoff_in_one_write(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await h.schedule(await h.create(gpu_pod("first", milli=300, annotations={names.HANDOFF: "sharegpu-handoff-1"})))
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation")
    await report_uuids(h)
    uuid = reservations_in(h)[0]["metadata"]["annotations"][names.GPU_UUID]
    first = paths.configmap("ns", "sharegpu-handoff-1")
    await eventually(lambda: bool((h.server.get_object(first) or {}).get("data")), "the first pod's hand-off filled")
    before = len(h.server.requests)
    await h.schedule(await h.create(gpu_pod("second", milli=300, annotations={names.HANDOFF: "sharegpu-handoff-2"})))
    for _ in range(3):
        h.extender.handoffs.wake()
        await settle(h.server)
    written = h.server.get_object(paths.configmap("ns", "sharegpu-handoff-2"))
    assert written is not None and written["data"]["main.NVIDIA_VISIBLE_DEVICES"] == uuid
    writes = [(m, p) for m, p in h.server.requests[before:] if m in ("POST", "PATCH", "PUT") and "configmaps" in p]
    assert writes == [("POST", paths.configmaps("ns"))], "written whole before the bind, and never again"


FORGED = {"main.NVIDIA_VISIBLE_DEVICES": "all"}


def forged_events(h: Harness) -> list[dict[str, Any]]:
    return [o for k, o in h.server.objects.items() if k[0] == "/api/v1|events" and o["reason"] == "HandoffForged"]


async def test_a_handoff_a_tenant_wrote_first_is_replaced_before_the_pod_is_bound(harness: Callable[..., Any]) -> None:
    """The tenant creates the ConfigMap its pod will read (no sharegpu label, as a gated pod lets it),
    with every GPU in it, even immutable so it cannot be updated: the bind reads it back, deletes and
    makes it again with what the allocation gives, raises the alarm, and only then binds."""
    h: Harness = await harness(nodes=1, gpus=2)
    for name, immutable in (("plain", False), ("frozen", True)):
        configmap = f"sharegpu-handoff-{name}"
        forged = {"metadata": {"name": configmap, "namespace": "ns"}, "data": dict(FORGED), "immutable": immutable}
        await h.api.create(paths.configmaps("ns"), forged)
        pod = await h.create(gpu_pod(name, milli=300, annotations={names.HANDOFF: configmap}))
        await h.schedule(pod)
        stored = h.server.get_object(paths.configmap("ns", configmap))
        assert stored is not None
        assert stored.get("data", {}) == {} and not stored.get("immutable"), "nothing the tenant wrote is left"
        assert stored["metadata"]["labels"] == {names.LABEL_ROLE: names.ROLE_HANDOFF}
        assert [r["name"] for r in stored["metadata"]["ownerReferences"]] == [name]
    assert h.extender.metrics.handoffs.labels("repaired")._value.get() == 2
    alarms = forged_events(h)
    assert sorted(e["involvedObject"]["name"] for e in alarms) == ["frozen", "plain"]
    assert all(e["type"] == "Warning" and "written by someone other than sharegpu" in e["message"] for e in alarms)


async def test_a_handoff_changed_after_it_was_right_is_repaired_with_an_alarm(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    configmap = "sharegpu-handoff-changed"
    await h.schedule(await h.create(gpu_pod("a", milli=300, annotations={names.HANDOFF: configmap})))
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation")
    await report_uuids(h)
    path = paths.configmap("ns", configmap)
    uuid = reservations_in(h)[0]["metadata"]["annotations"][names.GPU_UUID]

    def visible() -> str | None:
        return str((h.server.get_object(path) or {}).get("data", {}).get("main.NVIDIA_VISIBLE_DEVICES"))

    await eventually(lambda: visible() == uuid, "the hand-off")
    await h.api.patch(path, {"data": FORGED})  # labels and owner kept
    await eventually(lambda: visible() == uuid, "repaired")
    assert "changed after sharegpu wrote it" in forged_events(h)[0]["message"]
    await h.api.patch(path, {"metadata": {"labels": None, "ownerReferences": None}, "data": FORGED})
    await eventually(lambda: visible() == uuid and len(forged_events(h)) == 2, "taken back from out of sight")
    stored = h.server.get_object(path)
    assert stored is not None and stored["metadata"]["labels"] == {names.LABEL_ROLE: names.ROLE_HANDOFF}


async def test_a_new_leader_rewrites_nothing_that_is_right(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    configmap = "sharegpu-handoff-00000000000000ff"
    await h.schedule(await h.create(gpu_pod("a", milli=300, annotations={names.HANDOFF: configmap})))
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation")
    await report_uuids(h)
    await eventually(lambda: bool((h.server.get_object(paths.configmap("ns", configmap)) or {}).get("data")),
                     "the ConfigMap filled")  # fmt: skip
    before = len(h.server.requests)
    options = runtime.Options(leader_elect=False, reservation_idle=0.0, pace=0.01)
    successor = runtime.Extender(client.KubeClient(h.server), options)
    await successor.start()
    try:
        for _ in range(5):
            successor.handoffs.wake()
            successor.reservations.wake()
            await settle(h.server)
    finally:
        await successor.stop()
    writes = [(m, p) for m, p in h.server.requests[before:] if m in ("POST", "PATCH", "PUT", "DELETE")]
    assert writes == [], "the successor found everything as it should be"
    assert units.PodKey("ns/a") in successor.cache.ledger


async def test_the_preemption_and_requeue_tasks_outlive_a_pass_that_raises(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their tasks are not watched by anyone: one that ended on an unexpected error would leave
    nominated room held, or turned-away pods waiting, until the extender restarts."""
    h: Harness = await harness(nodes=1, gpus=1, preemption=True)
    preemptor, requeuer = h.extender.preemptor, h.extender.requeuer
    assert preemptor is not None
    calls = {"preemption": 0, "requeue": 0}

    def failing_once(name: str) -> Callable[[], Awaitable[None]]:
        async def reconcile() -> None:
            calls[name] += 1
            if calls[name] == 1:
                raise RuntimeError(f"a bug in the {name} pass")

        return reconcile

    monkeypatch.setattr(preemptor, "reconcile", failing_once("preemption"))
    monkeypatch.setattr(requeuer, "reconcile", failing_once("requeue"))
    tasks = [asyncio.create_task(preemptor.run(tick=0.01)), asyncio.create_task(requeuer.run(tick=0.01))]
    try:
        await eventually(lambda: min(calls.values()) >= 3, "passes after the failing one")
        assert not any(t.done() for t in tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ----------------------------------------------------------------- found by a review (stop 64)


@pytest.mark.parametrize("outage", ["cordoned", "not ready"])
async def test_a_node_the_fleet_does_not_count_keeps_the_reservations_its_sharers_run_on(
    harness: Callable[..., Any], outage: str
) -> None:
    """A cordoned or NotReady node leaves the fleet (nothing new goes there), but its sharing pods run
    on: their GPUs' reservations stay (deleted as idle, the GPU went back to the device plugin while
    the sharer ran on it)."""
    h: Harness = await harness(nodes=1, gpus=1)
    await h.schedule(await h.create(gpu_pod("a", milli=300, annotations={names.HANDOFF: "sharegpu-handoff-a"})))
    await eventually(lambda: len(reservations_in(h)) == 1, "a reservation")
    await report_uuids(h)
    name = reservations_in(h)[0]["metadata"]["name"]
    h.extender.reservations.idle = 3.0  # the default --reservation-idle
    await h.api.patch(f"{paths.pod('ns', 'a')}/status", {"status": {"phase": "Running"}})
    if outage == "cordoned":
        await h.api.patch(paths.node("n0"), {"spec": {"unschedulable": True}})
    else:
        node = h.server.get_object(paths.node("n0"))
        assert node is not None
        conditions = [{**c, "status": "Unknown"} if c["type"] == "Ready" else c for c in node["status"]["conditions"]]
        await h.api.patch(f"{paths.node('n0')}/status", {"status": {"conditions": conditions}})
    await settle(h.server)
    assert h.extender.cache.state.row("n0") is None, "out of the fleet"
    for _ in range(5):
        h.clock.advance(5)
        await passes(h)
    assert [o["metadata"]["name"] for o in reservations_in(h)] == [name]


async def test_an_idle_reservation_is_not_deleted_under_a_pod_bound_to_its_gpu_during_the_pass(
    harness: Callable[..., Any],
) -> None:
    """A pass decides GPU x's reservation is idle, but first awaits the deletion of another; meanwhile
    a pod is bound to x with x's reservation in its hand-off. The pass looks again before deleting."""
    h: Harness = await harness(nodes=1, gpus=2)
    reconciler = h.extender.reservations
    reconciler.idle = 1e9  # nothing retires while the scene is set
    await h.schedule(await h.create(gpu_pod("w", milli=1000)))  # a whole GPU, y: no reservation
    held = h.extender.cache.ledger.get(units.PodKey("ns/w"))
    assert held is not None
    y = held.alloc.gpu_indices[0]
    x = 1 - y
    for slot, uuid in ((y, "GPU-y"), (x, "GPU-x")):  # two reported reservations left by earlier sharers
        body = reservations.reservation_pod(names.reservation_name("n0", slot, f"aaaa0{slot}"), "n0", slot, "img")
        body["metadata"]["annotations"] = {names.GPU_UUID: uuid}
        await h.api.create(paths.pods(SYSTEM), body)
        await settle(h.server)
    await passes(h)
    assert len(reservations_in(h)) == 2
    y_path = paths.pod(SYSTEM, names.reservation_name("n0", y, f"aaaa0{y}"))
    entered, answer = asyncio.Event(), asyncio.Event()
    send = h.server.send

    async def slow(request: Any, timeout: float) -> Any:
        if request.method == "DELETE" and request.path == y_path:
            entered.set()
            await answer.wait()  # the API server is slow to answer this one deletion
        return await send(request, timeout)

    h.server.send = slow  # type: ignore[method-assign]
    reconciler.idle = 3.0
    h.clock.advance(5)
    reconciler.wake()
    await asyncio.wait_for(entered.wait(), 5)
    await h.schedule(await h.create(gpu_pod("p", milli=300, annotations={names.HANDOFF: "sharegpu-handoff-p"})))
    handed = (h.server.get_object(paths.configmap("ns", "sharegpu-handoff-p")) or {}).get("data", {})
    assert "GPU-x" in handed.values()
    answer.set()
    await passes(h)
    kept = h.server.get_object(paths.pod(SYSTEM, names.reservation_name("n0", x, f"aaaa0{x}")))
    assert kept is not None and not kept["metadata"].get("deletionTimestamp"), "x's reservation deleted under p"


async def test_a_silent_watch_does_not_make_a_second_reservation(harness: Callable[..., Any]) -> None:
    """The pods watch goes silent (given up only after 150 s): a creation the watch has not shown for
    `pending_timeout` is read back, found, and no second reservation is made for the GPU."""
    h: Harness = await harness(nodes=1, gpus=1)
    pod = await h.create(gpu_pod("a", milli=300))
    h.server.stall_watches()
    await h.schedule(pod)
    await passes(h)
    assert creations(h) == 1
    for _ in range(4):
        h.clock.advance(31)
        await passes(h)
    assert creations(h) == 1


async def test_a_pod_copying_anothers_handoff_does_not_take_it_before_the_watch_shows_it(
    harness: Callable[..., Any],
) -> None:
    """A tenant's second pod names the hand-off ConfigMap of its first; the first is bound (its
    ConfigMap made), the second comes to its bind before the ConfigMap watch shows that. The
    ConfigMap read back belongs to a live pod: the second is not bound, the first keeps its GPU."""
    h: Harness = await harness(nodes=1, gpus=2)
    shared = "sharegpu-handoff-0123456789abcdef"
    owner = await h.create(gpu_pod("owner", milli=600, annotations={names.HANDOFF: shared}))
    copycat = await h.create(gpu_pod("copycat", milli=600, annotations={names.HANDOFF: shared}))
    for watch in [w for w in h.server.watches if w.collection == "/api/v1|configmaps"]:
        h.server.watches.remove(watch)  # the ConfigMap watch lags
    await h.schedule(owner)
    verdict = h.extender.scheduling.filter(h.args(copycat))
    stored = h.server.get_object(paths.pod("ns", "copycat"))
    assert stored is not None
    args = api_extender.BindingArgs(
        pod_name="copycat", pod_namespace="ns", pod_uid=stored["metadata"]["uid"], node=verdict.node_names[0]
    )
    result = await h.extender.scheduling.bind(args)
    await settle(h.server)
    configmap = h.server.get_object(paths.configmap("ns", shared))
    assert configmap is not None
    assert [r["name"] for r in configmap["metadata"]["ownerReferences"]] == ["owner"]
    assert result.error and not (h.server.get_object(paths.pod("ns", "copycat")) or {})["spec"].get("nodeName")
