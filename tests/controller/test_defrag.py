"""The defragmenter over the fake API server: a fragmented two-node cluster with a pending whole-GPU
pod; it evicts (Eviction API) the one pod a PodDisruptionBudget allows, reports only in a dry run,
stops at a refusal, keeps its hourly budget, and never plans for pods without an owner."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import types
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import orjson
import pytest

from sharegpu.api import names, paths, wire
from sharegpu.controller import defrag, defrag_inputs, runtime
from sharegpu.core import defrag as core_defrag
from sharegpu.kube import client, fake, reconcile
from sharegpu.kube import errors as kube_errors
from tests.builders import Clock
from tests.conftest import eventually
from tests.controller.conftest import T0
from tests.extender.conftest import add_node, gpu_pod, settle

Json = dict[str, Any]
NS = "team"
PDB = paths.pod_disruption_budgets(NS)


def running(name: str, node: str, milli: int, *, owner: bool = True) -> Json:
    """A pod of a ReplicaSet (or of no one) bound to `node`'s GPU 0 with `milli`."""
    grant = {"index": 0, "uuid": f"GPU-{node}-0", "milli": milli, "limitMilli": milli, "memoryMiB": 0}
    alloc = {"version": 1, "node": node, "exclusive": False,
             "containers": [{"name": "main", "init": False, "devices": [grant]}]}  # fmt: skip
    body = gpu_pod(name, milli=milli, namespace=NS, annotations={names.ALLOCATION: orjson.dumps(alloc).decode()},
                   spec={"nodeName": node})  # fmt: skip
    body["metadata"]["labels"] = {"app": name}
    if owner:
        body["metadata"]["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name, "uid": f"rs-{name}", "controller": True}
        ]
    body["status"] = {"phase": "Running"}
    return body


def pending(name: str, spec: Json | None = None) -> Json:
    body = gpu_pod(name, milli=None, namespace=NS, spec=spec)
    body["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes"}]}  # fmt: skip
    return body


def budget(name: str, app: str, allowed: int) -> Json:
    return {"metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": app}}, "maxUnavailable": 0},
            "status": {"disruptionsAllowed": allowed}}  # fmt: skip


Start = Callable[..., Coroutine[Any, Any, tuple[fake.FakeApiServer, runtime.Controller]]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """Two 1-GPU nodes, `a` (300) on n0 and `b` (300) on n1, `p` pending for a whole GPU, a PDB that
    allows no disruption of `b`; then a controller with the given options."""
    made: list[runtime.Controller] = []

    async def make(
        *,
        owners: bool = True,
        refuse: bool = False,
        events_refused: int = 0,
        before: tuple[Json, ...] = (),
        pending_spec: Json | None = None,
        elector: Any = None,
        **options: Any,
    ) -> tuple[fake.FakeApiServer, runtime.Controller]:
        server = fake.FakeApiServer()
        for event in before:
            server.put_object(paths.events(NS), event)
        if refuse:  # the API server refuses the first eviction of `a` (its budget changed meanwhile)
            server.fail(429, method="POST", path=paths.eviction(NS, "a"), reason="TooManyRequests")
        if events_refused:  # the API server refuses the first events (restarting)
            server.fail(503, method="POST", path=paths.events(NS), times=events_refused)
        add_node(server, "n0", gpus=1)
        add_node(server, "n1", gpus=1)
        server.put_object(paths.pods(NS), running("a", "n0", 300, owner=owners))
        server.put_object(paths.pods(NS), running("b", "n1", 300, owner=owners))
        server.put_object(paths.pods(NS), pending("p", pending_spec))
        server.put_object(PDB, budget("keep-b", "b", 0))
        controller = runtime.Controller(
            client.KubeClient(server), runtime.Options(leader_elect=False, tick=3600, **options), Clock(T0)
        )
        if elector is not None:
            controller.elector = elector
        await controller.start()
        made.append(controller)
        await settle(server)
        reconciler = controller.defrag
        if reconciler is not None:  # its first pass plans in a worker thread
            await eventually(lambda: reconciler.loop.completed >= 1, "the defragmenter's first pass")
            await settle(server)
        return server, controller

    yield make
    for controller in made:
        await controller.stop()


def events(server: fake.FakeApiServer, reason: str) -> list[Json]:
    return [e for e in server.list_objects(paths.events(NS)) if e["reason"] == reason]


def evictions(server: fake.FakeApiServer) -> list[str]:
    return [path for method, path in server.requests if method == "POST" and path.endswith("/eviction")]


async def test_it_evicts_the_pod_the_disruption_budget_allows_and_then_waits(start: Start) -> None:
    server, controller = await start(defrag=True, defrag_budget_per_hour=5)
    reconciler = controller.defrag
    assert reconciler is not None  # its first pass ran at start
    await reconciler.reconcile()
    await settle(server)
    assert evictions(server) == [paths.eviction(NS, "a")]
    gone = server.get_object(paths.pod(NS, "a"))
    assert gone is not None and gone["metadata"].get("deletionTimestamp"), "evicted: deleted gracefully"
    kept = server.get_object(paths.pod(NS, "b"))
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
    assert reconciler.counters.evictions == 1 and reconciler.allowance() == 4
    (evicted,) = events(server, "DefragEvicted")
    assert evicted["involvedObject"]["name"] == "a" and "ReplicaSet/a recreates it" in evicted["message"]
    (moved,) = events(server, "DefragMoved")
    assert moved["involvedObject"]["name"] == "p" and "fits on n0" in moved["message"]
    registry = controller.metrics.registry
    assert registry.get_sample_value("sharegpu_defrag_evictions_total") == 1
    assert registry.get_sample_value("sharegpu_defrag_planned_gain_gpus") == 1.0
    # The next pass: `a` is leaving and `p` has just had its move; nothing more is evicted.
    await reconciler.reconcile()
    controller.defrag.clock.now += 120  # type: ignore[union-attr]  # past the cool-down
    await reconciler.reconcile()
    assert evictions(server) == [paths.eviction(NS, "a")], "a still holds n0's GPU while it leaves"
    server.finish_deletions()  # its kubelet has ended it: p now fits on n0
    await settle(server)
    await reconciler.reconcile()
    assert evictions(server) == [paths.eviction(NS, "a")]
    assert reconciler.last_plan is not None and reconciler.last_plan.skipped[0].why is core_defrag.Why.FITS


async def test_events_that_could_not_be_written_neither_stop_the_move_nor_are_lost(start: Start) -> None:
    server, controller = await start(defrag=True, defrag_budget_per_hour=5, events_refused=2)
    reconciler = controller.defrag
    assert reconciler is not None
    await reconciler.reconcile()
    await settle(server)
    assert evictions(server) == [paths.eviction(NS, "a")] and reconciler.counters.evictions == 1
    assert list(reconciler.moved_for) == [f"{NS}/p"], "the move is made: p cools down"
    assert not server.faults, "both events were refused once"
    await reconciler.reconcile()
    await settle(server)
    assert [e["involvedObject"]["name"] for e in events(server, "DefragEvicted")] == ["a"]
    assert [e["involvedObject"]["name"] for e in events(server, "DefragMoved")] == ["p"]
    assert not reconciler.recorder.untold
    assert evictions(server) == [paths.eviction(NS, "a")]


async def test_a_dry_run_reports_the_plan_and_evicts_nothing(start: Start) -> None:
    server, controller = await start(defrag_dry_run=True)
    assert controller.defrag is not None
    await controller.defrag.reconcile()
    await settle(server)
    assert evictions(server) == []
    (planned,) = events(server, "DefragPlanned")
    assert planned["involvedObject"]["name"] == "p"
    assert "team/a (n0 gpu0 300m, ReplicaSet/a)" in planned["message"] and "fit on n0" in planned["message"]
    assert controller.metrics.registry.get_sample_value("sharegpu_defrag_planned_evictions") == 1
    await controller.defrag.reconcile()
    await settle(server)
    assert len(events(server, "DefragPlanned")) == 1, "the same plan is one event"


async def test_a_refused_eviction_ends_the_move_and_the_next_pass_plans_again(start: Start) -> None:
    server, controller = await start(defrag=True, refuse=True)  # its first pass runs at once
    reconciler = controller.defrag
    assert reconciler is not None
    assert reconciler.counters.refused == 1 and reconciler.counters.evictions == 0
    pod = server.get_object(paths.pod(NS, "a"))
    assert pod is not None and not pod["metadata"].get("deletionTimestamp")
    assert controller.metrics.registry.get_sample_value("sharegpu_defrag_evictions_refused_total") == 1
    await reconciler.reconcile()  # no cool-down after a refusal: it plans again at once
    await settle(server)
    assert reconciler.counters.evictions == 1


async def test_the_hourly_budget_and_pods_without_owner(start: Start) -> None:
    server, controller = await start(defrag=True, defrag_budget_per_hour=0)
    assert controller.defrag is not None
    await controller.defrag.reconcile()
    assert evictions(server) == []
    assert controller.defrag.last_plan is not None
    assert [s.why for s in controller.defrag.last_plan.skipped] == [core_defrag.Why.BUDGET]
    server, controller = await start(defrag=True, owners=False)
    assert controller.defrag is not None
    await controller.defrag.reconcile()
    assert evictions(server) == []
    assert controller.defrag.last_plan is not None
    assert [s.why for s in controller.defrag.last_plan.skipped] == [core_defrag.Why.NO_SAFE_MOVE]


async def test_the_pending_pods_node_affinity_is_kept(start: Start) -> None:
    """`p` may only run on n1 (required node affinity); there only `b` could move, and its budget
    forbids it: so nothing is evicted, though moving `a` would free n0."""
    only_n1 = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
    affinity = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [only_n1]}}}}  # fmt: skip
    server, controller = await start(defrag=True, pending_spec=affinity)
    assert controller.defrag is not None and controller.defrag.last_plan is not None
    assert evictions(server) == []
    assert [s.why for s in controller.defrag.last_plan.skipped] == [core_defrag.Why.NO_SAFE_MOVE]


async def test_a_pass_plans_again_only_when_something_changed(start: Start) -> None:
    """Pods pending because nothing can help them cost one plan, not one every pass; any informer
    event, or the cool-down of a move ending, brings a new plan."""
    server, controller = await start(defrag_dry_run=True)
    reconciler = controller.defrag
    assert reconciler is not None
    planned = reconciler.counters.passes
    assert planned >= 1
    for _ in range(3):
        await reconciler.reconcile()
    assert reconciler.counters.passes == planned, "nothing changed: no new plan"
    server.put_object(paths.pods(NS), running("c", "n1", 100))
    await settle(server)
    await reconciler.reconcile()
    assert reconciler.counters.passes == planned + 1
    assert reconciler.last_plan is not None and reconciler.last_plan.moves
    assert reconciler.loop.rest_factor == defrag.REST_FACTOR > 0


async def test_the_plan_is_worked_out_off_the_event_loop(start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a slow plan is worked out, the event loop goes on (it renews the Lease and feeds the
    informers): a task beside it keeps ticking."""
    server, controller = await start(defrag_dry_run=True)
    reconciler = controller.defrag
    assert reconciler is not None
    original = defrag_inputs.plan

    def slow(found: defrag_inputs.Inputs, evictions: int) -> core_defrag.Plan:
        time.sleep(0.3)
        return original(found, evictions)

    monkeypatch.setattr(defrag_inputs, "plan", slow)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    server.put_object(paths.pods(NS), running("c", "n1", 100))  # something changed: a new plan
    await settle(server)
    ticks = 0
    started = time.monotonic()
    await reconciler.reconcile()
    took = time.monotonic() - started
    ticker.cancel()
    assert took >= 0.3 and reconciler.counters.passes >= 2
    assert ticks >= 10, f"the event loop ticked {ticks} times in {took:.2f} s of planning"


async def test_a_loop_rests_in_proportion_to_its_pass() -> None:
    """A loop with heavy passes rests `rest_factor` times as long as a pass took, however often it
    is woken: the defragmenter takes at most a fifth of the time for planning."""
    starts: list[float] = []

    async def heavy() -> None:
        starts.append(time.monotonic())
        await asyncio.sleep(0.05)

    loop = reconcile.Loop("heavy", heavy, rest_factor=4.0)
    runner = asyncio.create_task(loop.run(tick=0.01, pace=0.01))
    waker = asyncio.create_task(wake_often(loop))
    await eventually(lambda: len(starts) >= 3, "three passes")
    runner.cancel()
    waker.cancel()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(gap >= 0.05 * 5 for gap in gaps), gaps


async def wake_often(loop: reconcile.Loop) -> None:
    while True:
        loop.wake()
        await asyncio.sleep(0.005)


def evicted_event(name: str, seconds_ago: int, component: str = names.CONTROLLER) -> Json:
    """A DefragEvicted Event as an earlier controller (or another component) left it."""
    return {"metadata": {"name": name, "namespace": NS}, "reason": defrag.EVICTED, "type": "Normal",
            "involvedObject": {"kind": "Pod", "namespace": NS, "name": name}, "source": {"component": component},
            "lastTimestamp": wire.timestamp(T0 - seconds_ago), "count": 1}  # fmt: skip


async def test_a_new_controller_inherits_the_hourly_budget_from_the_events(start: Start) -> None:
    """Two evictions by the previous leader 10 and 50 minutes ago use up a budget of 2; one 70 minutes
    ago and one another component reported do not count."""
    earlier = (
        evicted_event("x", 600), evicted_event("y", 3000), evicted_event("z", 4200),
        evicted_event("w", 60, component="someone-else"),
    )  # fmt: skip
    server, controller = await start(defrag=True, defrag_budget_per_hour=2, before=earlier)
    reconciler = controller.defrag
    assert reconciler is not None and reconciler.recalled
    assert evictions(server) == []
    assert reconciler.last_plan is not None
    assert [s.why for s in reconciler.last_plan.skipped] == [core_defrag.Why.BUDGET]
    reconciler.clock.now += 600  # type: ignore[attr-defined]  # the eviction 50 minutes ago leaves the window
    await reconciler.reconcile()
    await settle(server)
    assert evictions(server) == [paths.eviction(NS, "a")]


class Turns:
    """Leadership that the test takes away and gives back."""

    def __init__(self) -> None:
        self.leading = asyncio.Event()
        self.leading.set()

    @property
    def is_leader(self) -> bool:
        return self.leading.is_set()

    async def run(self) -> None:
        await asyncio.Event().wait()


async def test_a_replica_leading_again_recalls_what_others_evicted_meanwhile(start: Start) -> None:
    """Budget 4: the previous leader's eviction 10 minutes ago, this replica's own of `a`, then one by
    another replica while this one did not lead. Leading again, it counts the three (its own once):
    one left, not the two it would have kept counting on."""
    turns = Turns()
    server, controller = await start(
        defrag=True, defrag_budget_per_hour=4, before=(evicted_event("x", 600),), elector=turns
    )
    reconciler = controller.defrag
    assert reconciler is not None
    assert evictions(server) == [paths.eviction(NS, "a")]
    assert reconciler.allowance() == 2
    turns.leading.clear()
    await asyncio.sleep(0.3)  # the reconcilers notice within 0.05 s and stop
    server.put_object(paths.events(NS), evicted_event("y", 0))  # another replica, meanwhile
    passes = reconciler.loop.completed
    reconciler.clock.now += 120  # type: ignore[attr-defined]  # p's cool-down over: it is planned for again
    turns.leading.set()
    await eventually(lambda: reconciler.loop.completed > passes, "a pass of the new term")
    assert reconciler.allowance() == 1


async def test_the_fake_eviction_api_honours_disruption_budgets() -> None:
    server = fake.FakeApiServer()
    server.put_object(paths.pods(NS), running("b", "n1", 300))
    server.put_object(PDB, budget("keep-b", "b", 0))
    api = client.KubeClient(server)
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "b", "namespace": NS}}
    with pytest.raises(kube_errors.BusyError):
        await api.create(paths.eviction(NS, "b"), body)
    server.put_object(PDB, budget("allow-b", "b", 1))
    with pytest.raises(kube_errors.BusyError):  # every budget that selects the pod must allow it
        await api.create(paths.eviction(NS, "b"), body)
    server.remove_object(paths.pod_disruption_budgets(NS) + "/keep-b")
    await api.create(paths.eviction(NS, "b"), body)
    allowing = server.get_object(paths.pod_disruption_budgets(NS) + "/allow-b")
    assert allowing is not None and allowing["status"]["disruptionsAllowed"] == 0


def test_pod_facts_read_owner_priority_and_the_scheduler_verdict() -> None:
    from sharegpu.api import wire

    facts = defrag_inputs.facts(
        wire.convert({**pending("p"), "spec": {**pending("p")["spec"], "priority": 7}}, wire.Pod)
    )
    assert facts.pending and facts.priority == 7 and not facts.movable
    bound = defrag_inputs.facts(wire.convert(running("a", "n0", 300), wire.Pod))
    assert bound.movable and bound.owner == "ReplicaSet/a" and not bound.pending
    daemon = running("d", "n0", 300)
    daemon["metadata"]["ownerReferences"][0]["kind"] = "DaemonSet"
    assert not defrag_inputs.facts(wire.convert(daemon, wire.Pod)).movable


async def test_an_eviction_whose_event_was_refused_still_counts_after_a_recall(start: Start) -> None:
    """The Events are what a recall reads: an eviction of this replica's that has none yet is kept."""
    server, controller = await start(defrag=True, defrag_budget_per_hour=2, events_refused=100)
    reconciler = controller.defrag
    assert reconciler is not None
    assert evictions(server) == [paths.eviction(NS, "a")] and events(server, defrag.EVICTED) == []
    reconciler.new_term()
    await reconciler.recall()
    assert reconciler.allowance() == 1


# ----------------------------------------------------------------- found by a review (stop 64)


Meanwhile = Callable[[fake.FakeApiServer], Coroutine[Any, Any, None]]


async def planned_while(
    monkeypatch: pytest.MonkeyPatch, meanwhile: Meanwhile
) -> tuple[fake.FakeApiServer, runtime.Controller]:
    """Two nodes of one GPU, a on n0 and b on n1 (b kept by a budget), p pending for a whole GPU:
    the plan moves a. `meanwhile` changes the cluster while the plan is worked out (in its thread)."""
    server = fake.FakeApiServer()
    add_node(server, "n0", gpus=1)
    add_node(server, "n1", gpus=1)
    server.put_object(paths.pods(NS), running("a", "n0", 300))
    server.put_object(paths.pods(NS), running("b", "n1", 300))
    server.put_object(paths.pods(NS), pending("p"))
    server.put_object(PDB, budget("keep-b", "b", 0))
    work_out = asyncio.to_thread

    async def to_thread(fn: Any, *args: Any) -> Any:
        result = await work_out(fn, *args)
        await meanwhile(server)
        await settle(server)
        return result

    monkeypatch.setattr("sharegpu.controller.defrag.asyncio", types.SimpleNamespace(to_thread=to_thread))
    controller = runtime.Controller(
        client.KubeClient(server), runtime.Options(leader_elect=False, tick=3600, defrag=True), Clock(T0)
    )
    await controller.start()
    await settle(server)
    reconciler = controller.defrag
    assert reconciler is not None
    await eventually(lambda: reconciler.loop.completed >= 1, "the first pass")
    await settle(server)
    return server, controller


async def test_a_pod_made_again_under_a_planned_victims_name_is_not_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the plan is worked out, a goes and a new a (another UID) runs on n1: not evicted."""

    async def replaced(server: fake.FakeApiServer) -> None:
        server.remove_object(paths.pod(NS, "a"))
        server.put_object(paths.pods(NS), running("a", "n1", 100))

    server, controller = await planned_while(monkeypatch, replaced)
    try:
        now = server.get_object(paths.pod(NS, "a"))
        assert now is not None and not now["metadata"].get("deletionTimestamp") and not evictions(server)
    finally:
        await controller.stop()


async def test_nothing_is_evicted_for_a_pending_pod_bound_while_its_move_was_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the plan is worked out, b ends and p is bound to n1: a is not evicted for p."""

    async def bound(server: fake.FakeApiServer) -> None:
        server.remove_object(paths.pod(NS, "b"))
        server.remove_object(paths.pod(NS, "p"))
        placed = pending("p")
        placed["spec"]["nodeName"] = "n1"
        placed["status"] = {"phase": "Running"}
        server.put_object(paths.pods(NS), placed)

    server, controller = await planned_while(monkeypatch, bound)
    try:
        a = server.get_object(paths.pod(NS, "a"))
        assert a is not None and not a["metadata"].get("deletionTimestamp") and not evictions(server)
    finally:
        await controller.stop()


@contextlib.asynccontextmanager
async def defragmenting(
    server: fake.FakeApiServer, clock: Clock | None = None
) -> AsyncIterator[defrag.DefragReconciler]:
    """A controller evicting to defragment over `server`, once its first pass has run."""
    options = runtime.Options(leader_elect=False, tick=3600, defrag=True)
    controller = runtime.Controller(client.KubeClient(server), options, clock or Clock(T0))
    await controller.start()
    try:
        reconciler = controller.defrag
        assert reconciler is not None
        await eventually(lambda: reconciler.loop.completed >= 1, "the defragmenter's first pass")
        await settle(server)
        yield reconciler
    finally:
        await controller.stop()


def _on_two(name: str, node: str, milli: int, spec: Json | None = None, owner_kind: str = "ReplicaSet") -> Json:
    """A pod of `owner_kind` holding `milli` on each of `node`'s GPUs 0 and 1."""
    grants = [{"index": i, "uuid": f"GPU-{node}-{i}", "milli": milli, "limitMilli": milli, "memoryMiB": 0}
              for i in (0, 1)]  # fmt: skip
    alloc = {"version": 1, "node": node, "exclusive": False,
             "containers": [{"name": "main", "init": False, "devices": grants}]}  # fmt: skip
    notes = {names.ALLOCATION: orjson.dumps(alloc).decode()}
    body = gpu_pod(name, milli=milli, count=2, namespace=NS, annotations=notes, spec={"nodeName": node, **(spec or {})})
    body["metadata"]["labels"] = {"app": name}
    body["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": owner_kind, "name": name, "uid": f"o-{name}", "controller": True}
    ]
    body["status"] = {"phase": "Running"}
    return body


def _only(*nodes: str, priority: int = 0) -> Json:
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": list(nodes)}]}
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    return {"priority": priority, "affinity": {"nodeAffinity": required}}


async def test_a_move_that_stops_stops_the_moves_planned_on_it() -> None:
    """p1's move evicts v1 from A; p2's move puts v2 on A in the room v1 leaves. v1's eviction is
    refused: v2 must stay where it is, or it is evicted with nowhere to go."""
    server = fake.FakeApiServer()
    server.fail(429, method="POST", path=paths.eviction(NS, "v1"), reason="TooManyRequests")
    add_node(server, "A", gpus=2)
    add_node(server, "B", gpus=1)
    add_node(server, "C", gpus=2)
    server.put_object(paths.pods(NS), _on_two("v1", "A", 600))
    v2 = running("v2", "B", 500)
    v2["spec"]["affinity"] = _only("A", "B")["affinity"]
    server.put_object(paths.pods(NS), v2)
    server.put_object(paths.pods(NS), pending("p1", _only("A", priority=10)))
    server.put_object(paths.pods(NS), pending("p2", _only("B", priority=5)))
    async with defragmenting(server) as reconciler:
        plan = reconciler.last_plan
        assert plan is not None and [m.pod for m in plan.moves] == [f"{NS}/p1", f"{NS}/p2"], "the scenario as meant"
        assert evictions(server) == [paths.eviction(NS, "v1")], "v2 evicted though the move it relied on stopped"


async def test_job_pods_and_gang_members_are_never_moved() -> None:
    """`a` on n0 and `b` on n1 (300 milli each), `p` pending for a whole GPU: either could move. Owned
    by a Job (an eviction counts against its backoffLimit), or members of a gang (moved alone, one
    breaks its gang), or `p` says `preemptionPolicy: Never`: nothing is evicted. Otherwise one is."""
    for change in ("job", "gang", "never", "replicaset"):
        server = fake.FakeApiServer()
        add_node(server, "n0", gpus=1)
        add_node(server, "n1", gpus=1)
        for name, node in (("a", "n0"), ("b", "n1")):
            body = running(name, node, 300)
            if change == "job":
                body["metadata"]["ownerReferences"][0].update(apiVersion="batch/v1", kind="Job")
            elif change == "gang":
                body["metadata"]["annotations"].update({names.GANG: "train", names.GANG_MIN: "2"})
            server.put_object(paths.pods(NS), body)
        server.put_object(paths.pods(NS), pending("p", {"preemptionPolicy": "Never"} if change == "never" else None))
        async with defragmenting(server):
            assert len(evictions(server)) == (1 if change == "replicaset" else 0), f"{change}: {evictions(server)}"


async def test_a_pending_pod_gone_in_the_middle_of_its_move_stops_it() -> None:
    """`p` needs n0's GPU, which `a` and `b` share; both fit beside `c` on n1. `p` is deleted once
    `a` is evicted: `b` stays."""
    server = fake.FakeApiServer()
    add_node(server, "n0", gpus=1)
    add_node(server, "n1", gpus=1)
    server.put_object(paths.pods(NS), running("a", "n0", 300))
    server.put_object(paths.pods(NS), running("b", "n0", 300))
    server.put_object(paths.pods(NS), running("c", "n1", 400, owner=False))
    options = runtime.Options(leader_elect=False, tick=3600, defrag=True)
    controller = runtime.Controller(client.KubeClient(server), options, Clock(T0))
    await controller.start()
    try:
        reconciler = controller.defrag
        assert reconciler is not None
        evict = reconciler.api.create

        async def create(path: str, body: Any, **params: Any) -> Any:
            out = await evict(path, body, **params)
            if path.endswith("/eviction"):  # the user gives up on `p`; the watch shows it at once
                gone = server.get_object(paths.pod(NS, "p"))
                if gone is not None:
                    server.remove_object(paths.pod(NS, "p"))
                    reconciler.on_pod(wire.EventType.DELETED, defrag_inputs.facts(wire.convert(gone, wire.Pod)))
            return out

        reconciler.api.create = create  # type: ignore[method-assign]
        server.put_object(paths.pods(NS), pending("p"))
        await eventually(lambda: len(evictions(server)) >= 1, "the first eviction for p")
        await reconciler.reconcile()
        await settle(server)
        assert len(evictions(server)) == 1, evictions(server)
    finally:
        await controller.stop()


@pytest.mark.parametrize("where", ["dra-node", "leaving-pod"])
async def test_no_victim_is_planned_onto_a_dra_node_nor_into_room_a_leaving_pod_holds(where: str) -> None:
    """`p` needs n0's GPU, where `a` (300) is. n1 has no room for `a`: `b` holds 800 there, or `b`
    300 and `c` 600 while `c` is being deleted (its GPU held through its grace period). d0 serves DRA
    claims only: the extender would place `a`'s replacement on neither. No move."""
    server = fake.FakeApiServer()
    add_node(server, "n0", gpus=1)
    add_node(server, "n1", gpus=1)
    server.put_object(paths.pods(NS), running("a", "n0", 300))
    if where == "dra-node":
        add_node(server, "d0", gpus=1, dra=True)
        server.put_object(paths.pods(NS), running("b", "n1", 800))
    else:
        server.put_object(paths.pods(NS), running("b", "n1", 300))
        leaving = running("c", "n1", 600)
        leaving["metadata"]["finalizers"] = ["example.com/hold"]
        server.put_object(paths.pods(NS), leaving)
        await client.KubeClient(server).delete(paths.pod(NS, "c"))  # held by its finalizer: being deleted
    server.put_object(paths.pods(NS), pending("p", _only("n0", "n1")))
    found = await defrag_inputs.snapshot(client.KubeClient(server))
    plan = defrag_inputs.plan(found, 10)
    assert plan.moves == (), [(m.pod, [(v.pod, v.after.node) for v in m.victims]) for m in plan.moves]


async def test_a_later_move_does_not_take_the_room_an_earlier_one_promised() -> None:
    """Pass 1: `p` (n1 only) gets n1, `a` (300) evicted to fit beside `c` (600) on n2. Pass 2, while
    `a`'s replacement is on its way: `q` (n3 only) must not move `d` onto n2, into `a`'s room."""
    server = fake.FakeApiServer()
    for node in ("n1", "n2", "n3"):
        add_node(server, node, gpus=1)
    server.put_object(paths.pods(NS), running("a", "n1", 300))
    server.put_object(paths.pods(NS), running("c", "n2", 600, owner=False))
    server.put_object(paths.pods(NS), running("d", "n3", 300))
    server.put_object(paths.pods(NS), pending("p", _only("n1")))
    clock = Clock(T0)
    async with defragmenting(server, clock) as reconciler:
        assert evictions(server) == [paths.eviction(NS, "a")]
        plan = reconciler.last_plan
        assert plan is not None and [v.after.node for m in plan.moves for v in m.victims] == ["n2"]
        server.put_object(paths.pods(NS), pending("q", _only("n3")))
        await settle(server)
        clock.advance(10)
        await reconciler.reconcile()
        await settle(server)
        assert evictions(server) == [paths.eviction(NS, "a")], "d moved into the room promised to a's replacement"
        clock.advance(reconciler.cooldown)  # the promise has run out (a's replacement placed meanwhile, or not)
        await reconciler.reconcile()
        await settle(server)
        assert evictions(server)[1:] == [paths.eviction(NS, "d")]
