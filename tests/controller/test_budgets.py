"""The budget reconciler over the fake API server, its clock in the test's hands: usage from pod
lifetimes, settling of deleted pods, books that survive a restart, events recorded once, conflicts."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sharegpu.api import budgets, dra, paths, resources, wire
from sharegpu.controller import budgets as budgets_controller
from sharegpu.controller import runtime
from sharegpu.core import units
from sharegpu.kube import client, fake
from tests import builders
from tests.controller.conftest import T0
from tests.extender.conftest import add_node, settle

Json = dict[str, Any]
HOUR = 3600


def gpu_pod(name: str, grants: list[tuple[int, int, int]], *, at: int = T0, namespace: str = "team") -> Json:
    """A pod bound to n0 at `at` holding (GPU index, milli, memory MiB) grants."""
    alloc = builders.MakeAllocation(units.pod_key(namespace, name), "n0").grants(*grants)
    pod = builders.MakePod(name, namespace).allocation(alloc.obj()).node("n0").container()
    return pod.phase("Running").scheduled_at(at).obj()


def budget(name: str = "b", namespace: str = "team", **spec: Any) -> Json:
    return {
        "apiVersion": resources.GPU_BUDGET.api_version,
        "kind": resources.GPU_BUDGET.kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"gpuHours": 10, "periodStart": "2026-11-01T00:00:00Z", **spec},
    }


class Env:
    def __init__(self, *, dra_node: bool = False) -> None:
        """n0 with two 16 GiB GPUs; `dra_node`: it serves DRA claims (resource.k8s.io/v1 served)."""
        self.server = fake.FakeApiServer(  # objects made a day before the clock starts, as made before it
            served=frozenset({dra.API_VERSION}) if dra_node else frozenset(),
            epoch=datetime.datetime.fromtimestamp(T0 - 86400, datetime.UTC),
        )
        self.api = client.KubeClient(self.server)
        self.clock = builders.Clock(T0)
        self.controllers: list[runtime.Controller] = []
        add_node(self.server, "n0", gpus=2, memory=16384, dra=dra_node)

    async def start(self, fence: float = 0.0) -> runtime.Controller:
        """A controller on the test's clock (`fence`: its budget passes' wait at a new term)."""
        options = runtime.Options(leader_elect=False, tick=3600, pace=0.01, budget_fence=fence)
        made = runtime.Controller(client.KubeClient(self.server), options, clock=self.clock)
        await made.start()
        self.controllers.append(made)
        await self.pass_(made)
        return made

    async def pass_(self, controller: runtime.Controller) -> None:
        """Let events arrive, then run one reconcile pass to its end."""
        await settle(self.server)
        loop = controller.budgets.loop
        target = loop.passes + 1  # a pass that begins after this point (one under way may predate it)
        loop.wake()
        for _ in range(200):
            if loop.completed >= target:
                break
            await asyncio.sleep(0.01)
        assert loop.completed >= target, "no reconcile pass ran"
        await settle(self.server)

    async def add(self, body: Json, collection: str) -> None:
        self.server.put_object(collection, body)

    def status(self, name: str = "b", namespace: str = "team") -> budgets.BudgetStatus:
        stored = self.server.get_object(resources.GPU_BUDGET.path(namespace, name))
        assert stored is not None
        return wire.convert(stored, budgets.GPUBudget).status

    def events(self, reason: str) -> list[Json]:
        found = self.server.list_objects(paths.events("team"))
        return [e for e in found if e["reason"] == reason]


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    made = Env()
    yield made
    for controller in made.controllers:
        await controller.stop()


PODS = paths.pods("team")


async def test_usage_is_each_pods_weight_times_the_time_it_held_and_deleted_pods_are_settled(env: Env) -> None:
    # a: 500 milli on each of both GPUs (weight 1000); b: a quarter of compute but half the memory (500).
    await env.add(gpu_pod("a", [(0, 500, 0), (1, 500, 0)]), PODS)
    await env.add(gpu_pod("b", [(0, 250, 8192)]), PODS)
    await env.add(budget(), resources.GPU_BUDGET.path("team"))
    controller = await env.start()
    env.clock.now = T0 + HOUR
    await env.pass_(controller)
    status = env.status()
    assert status.used_gpu_seconds == 3600 + 1800
    assert status.remaining_gpu_seconds == 10 * HOUR - 5400
    assert [c.pod for c in status.top_consumers] == ["team/a", "team/b"]
    # a is deleted one hour in; another hour later it has stopped counting, b has not.
    await env.api.delete(paths.pod("team", "a"), grace_period=0)
    await settle(env.server)
    env.clock.now = T0 + 2 * HOUR
    await env.pass_(controller)
    status = env.status()
    assert status.accounting.settled_milli_gpu_seconds == 1000 * HOUR
    assert [p.pod for p in status.accounting.pods] == ["team/b"]
    assert status.used_gpu_seconds == 3600 + 3600
    assert controller.budgets.gone == {}  # settled in every budget of the namespace: forgotten


async def test_the_books_survive_a_restart_and_a_pod_deleted_meanwhile_keeps_its_written_use(env: Env) -> None:
    await env.add(gpu_pod("a", [(0, 1000, 0)]), PODS)
    await env.add(gpu_pod("c", [(1, 1000, 0)]), PODS)
    await env.add(budget(), resources.GPU_BUDGET.path("team"))
    first = await env.start()
    env.clock.now = T0 + HOUR
    await env.pass_(first)
    assert env.status().used_gpu_seconds == 2 * HOUR
    await first.stop()
    env.controllers.remove(first)
    # While no controller runs: c goes, an hour passes.
    env.server.remove_object(paths.pod("team", "c"))
    env.clock.now = T0 + 2 * HOUR
    second = await env.start()
    status = env.status()
    assert status.used_gpu_seconds == 2 * HOUR + HOUR  # a: 2 h; c: the hour written before it went
    assert status.accounting.settled_milli_gpu_seconds == 1000 * HOUR
    await env.pass_(second)
    assert env.status().used_gpu_seconds == 3 * HOUR  # settled once, not again


async def test_crossings_are_recorded_once_even_by_two_controllers(env: Env) -> None:
    await env.add(gpu_pod("a", [(0, 1000, 0)]), PODS)
    await env.add(budget(gpuHours=1, warnAtPercent=50, whenExhausted="Deny"), resources.GPU_BUDGET.path("team"))
    one = await env.start()
    two = await env.start()
    env.clock.now = T0 + HOUR // 2
    await asyncio.gather(env.pass_(one), env.pass_(two))
    assert env.status().state == "Warning"
    env.clock.now = T0 + HOUR
    await asyncio.gather(env.pass_(one), env.pass_(two))
    await env.pass_(one)
    status = env.status()
    assert status.state == "Exhausted"
    assert len(env.events("BudgetWarning")) == 1
    exhausted = env.events("BudgetExhausted")
    assert len(exhausted) == 1
    assert "refused" in exhausted[0]["message"] and "1.00 of 1 GPU-hours" in exhausted[0]["message"]
    assert exhausted[0]["involvedObject"]["kind"] == "GPUBudget"
    assert one.recorder.recorded + two.recorder.recorded == 2


async def test_a_conflicting_write_is_retried_from_the_newer_books(env: Env) -> None:
    await env.add(gpu_pod("a", [(0, 1000, 0)]), PODS)
    await env.add(budget(), resources.GPU_BUDGET.path("team"))
    controller = await env.start()
    env.server.fail(409, method="PUT", path=resources.GPU_BUDGET.path("team", "b"), reason="Conflict")
    env.clock.now = T0 + HOUR
    await env.pass_(controller)
    assert controller.budgets.conflicts == 1
    await env.pass_(controller)
    assert env.status().used_gpu_seconds == HOUR


async def test_budget_use_and_leadership_are_on_metrics(env: Env) -> None:
    await env.add(budget(), resources.GPU_BUDGET.path("team"))
    controller = await env.start()
    ready, detail = controller.readiness()
    assert ready and detail["leader"] is True
    text = controller.metrics.registry.get_sample_value(
        "sharegpu_budget_limit_gpu_seconds", {"namespace": "team", "budget": "b"}
    )
    assert text == 10 * HOUR
    assert controller.metrics.registry.get_sample_value("sharegpu_controller_leader") == 1
    states = {
        state: controller.metrics.registry.get_sample_value(
            "sharegpu_budget_state", {"namespace": "team", "budget": "b", "state": state}
        )
        for state in ("Within", "Warning", "Exhausted")
    }
    assert states == {"Within": 1, "Warning": 0, "Exhausted": 0}
    informer = {"informer": "pods"}
    assert controller.metrics.registry.get_sample_value("sharegpu_controller_informer_ready", informer) == 1


# ----------------------------------------------------------------- cluster budgets


def cluster_budget(name: str = "research", selector: Json | None = None, **spec: Any) -> Json:
    return {
        "apiVersion": resources.CLUSTER_GPU_BUDGET.api_version,
        "kind": resources.CLUSTER_GPU_BUDGET.kind,
        "metadata": {"name": name},
        "spec": {"gpuHours": 10, "periodStart": "2026-11-01T00:00:00Z", "namespaceSelector": selector or {}, **spec},
    }


def namespace(name: str, **labels: str) -> Json:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def cluster_status(env: Env, name: str = "research") -> budgets.BudgetStatus:
    stored = env.server.get_object(resources.CLUSTER_GPU_BUDGET.path(None, name))
    assert stored is not None
    return wire.convert(stored, budgets.ClusterGPUBudget).status


async def test_a_cluster_budget_pools_the_namespaces_it_selects_and_follows_their_labels(env: Env) -> None:
    for name, org in (("vision", "research"), ("speech", "research"), ("shop", "sales")):
        await env.add(namespace(name, org=org), paths.NAMESPACES)
        await env.add(gpu_pod("p", [(0, 500, 0)], namespace=name), paths.pods(name))
    await env.add(
        cluster_budget(selector={"matchLabels": {"org": "research"}}, gpuHours=1, whenExhausted="Deny"),
        resources.CLUSTER_GPU_BUDGET.path(),
    )
    controller = await env.start()
    env.clock.now = T0 + HOUR
    await env.pass_(controller)
    status = cluster_status(env)
    assert status.used_gpu_seconds == 2 * HOUR // 2  # vision and speech at half a GPU; not shop
    assert [c.pod for c in status.top_consumers] == ["speech/p", "vision/p"]
    assert status.state == "Exhausted"
    exhausted = env.server.list_objects(paths.events("default"))  # cluster-scoped: events in default
    assert [(e["reason"], e["involvedObject"]["kind"], e["involvedObject"]["name"]) for e in exhausted] == [
        ("BudgetExhausted", "ClusterGPUBudget", "research")
    ]
    assert "ClusterGPUBudget research: 1.00 of 1 GPU-hours" in exhausted[0]["message"]
    # speech leaves the organisation: what it used stays counted, nothing more is added.
    await env.api.patch(paths.namespace("speech"), {"metadata": {"labels": {"org": "sales"}}})
    env.clock.now = T0 + 2 * HOUR
    await env.pass_(controller)
    status = cluster_status(env)
    assert [p.pod for p in status.accounting.pods] == ["vision/p"]
    assert status.accounting.settled_milli_gpu_seconds == 500 * HOUR
    assert status.used_gpu_seconds == HOUR // 2 + HOUR  # speech: its first hour; vision: two
    labels = {"namespace": "", "budget": "research"}
    assert controller.metrics.registry.get_sample_value("sharegpu_budget_used_gpu_seconds", labels) == 1.5 * HOUR
    # ...and comes back: its pod counts again from its return, its first hour not a second time.
    await env.api.patch(paths.namespace("speech"), {"metadata": {"labels": {"org": "research"}}})
    await env.pass_(controller)
    status = cluster_status(env)
    assert [p.pod for p in status.accounting.pods] == ["speech/p", "vision/p"]
    assert status.used_gpu_seconds == HOUR // 2 + HOUR, "back at the moment of the last write: nothing more yet"
    env.clock.now = T0 + 3 * HOUR
    await env.pass_(controller)
    assert cluster_status(env).used_gpu_seconds == HOUR // 2 + HOUR + 2 * (HOUR // 2)
    # A restarted controller (or a new leader) reads the same books: nothing counted twice.
    await controller.stop()
    env.controllers.remove(controller)
    env.clock.now = T0 + 4 * HOUR
    again = await env.start()
    await env.pass_(again)
    assert cluster_status(env).used_gpu_seconds == HOUR // 2 + HOUR + 4 * (HOUR // 2)


async def test_a_cluster_budget_with_a_malformed_selector_covers_nothing_and_says_why(env: Env) -> None:
    await env.add(namespace("vision", org="research"), paths.NAMESPACES)
    await env.add(gpu_pod("p", [(0, 1000, 0)], namespace="vision"), paths.pods("vision"))
    bad = {"matchExpressions": [{"key": "org", "operator": "In", "values": []}]}
    await env.add(cluster_budget(selector=bad), resources.CLUSTER_GPU_BUDGET.path())
    controller = await env.start()
    env.clock.now = T0 + HOUR
    await env.pass_(controller)
    await env.pass_(controller)
    assert cluster_status(env).used_gpu_seconds == 0
    warned = [e for e in env.server.list_objects(paths.events("default")) if e["reason"] == "InvalidSelector"]
    assert len(warned) == 1  # once, not once per pass
    assert warned[0]["message"].startswith("spec.namespaceSelector: matchExpressions[0] (org In) needs values")


def allocated_claim(name: str, milli: int, memory: str, uid: str) -> Json:
    """A claim of sharegpu's class in team, allocated on GPU 0 of n0 (as the allocator writes it)."""
    result = {"request": "gpu", "driver": dra.DRIVER, "pool": "n0", "device": "gpu-0", "shareID": f"s-{name}",
              "consumedCapacity": {dra.MILLI: str(milli), "memory": memory}}  # fmt: skip
    made = builders.MakeClaim(name, "team").ask(milli, memory).obj()
    made["metadata"]["uid"] = uid
    made["status"] = {"allocation": {"devices": {"results": [result]}}}
    return made


def claim_user(name: str, claim: str, at: int) -> Json:
    pod = builders.MakePod(name, "team").node("n0").container().claim(claim)
    return pod.phase("Running").scheduled_at(at).obj()


async def test_a_claim_used_by_two_pods_is_charged_once_from_its_first_users_start_to_its_last_users_end() -> None:
    """The rule of `api.lifetimes`: a claim is one share, however many pods use it; a claim written by
    hand is charged like one the webhook made."""
    env = Env(dra_node=True)
    server, clock = env.server, env.clock
    server.put_object(dra.claim_path("team"), allocated_claim("shared", 500, "0", "c-1"))
    server.put_object(PODS, claim_user("first", "shared", T0))
    server.put_object(PODS, claim_user("second", "shared", T0 + HOUR // 2))
    server.put_object(resources.GPU_BUDGET.path("team"), budget())
    controller = await env.start()
    try:
        clock.now = T0 + HOUR
        await env.pass_(controller)
        status = env.status()
        assert [p.pod for p in status.accounting.pods] == ["team/shared#claim"], "the claim, not its two users"
        assert status.used_gpu_seconds == HOUR // 2, "500 milli for one hour, once"
        # Both users go (the first at 1 h, the second at 2 h): the claim stops counting with the last.
        await controller.api.delete(paths.pod("team", "first"), grace_period=0)
        await settle(server)
        clock.now = T0 + 2 * HOUR
        await controller.api.delete(paths.pod("team", "second"), grace_period=0)
        await settle(server)
        clock.now = T0 + 3 * HOUR
        await env.pass_(controller)
        assert env.status().used_gpu_seconds == HOUR, "2 h at half a GPU, the third hour not"
        # The claim goes (its allocation cleared first, as when its last user went): settled at that use.
        await controller.api.delete(f"{dra.claim_path('team')}/shared")
        await settle(server)
        clock.now = T0 + 4 * HOUR
        await env.pass_(controller)
        status = env.status()
        assert status.used_gpu_seconds == HOUR and status.accounting.pods == []
        assert status.accounting.settled_milli_gpu_seconds == 500 * 2 * HOUR
        assert controller.budgets.uses == {}, "the users' records go with their claim"
    finally:
        await controller.stop()


async def test_a_crossing_whose_event_could_not_be_recorded_is_recorded_at_a_later_pass(env: Env) -> None:
    """The status written says Warning, so the next pass sees no crossing: the event must be kept."""
    await env.add(gpu_pod("a", [(0, 1000, 0)]), PODS)
    await env.add(budget(gpuHours=1, warnAtPercent=50), resources.GPU_BUDGET.path("team"))
    controller = await env.start()
    env.server.fail(503, method="POST", path=paths.events("team"), times=2)
    env.clock.now = T0 + HOUR // 2
    await env.pass_(controller)
    assert env.status().state == "Warning"
    for _ in range(3):  # passes also run on their own (the status written wakes the loop)
        await env.pass_(controller)
    assert not env.server.faults, "both refusals were met"
    (warning,) = env.events("BudgetWarning")
    assert "0.50 of 1 GPU-hours" in warning["message"], warning["message"]
    await env.pass_(controller)
    assert len(env.events("BudgetWarning")) == 1 and not controller.budgets.recorder.untold


# ----------------------------------------------------------------- found by a review (stop 64)

DAY = 24 * HOUR


async def test_a_pod_refused_at_admission_is_not_charged_from_each_restart() -> None:
    """Failed at admission, no container's end: charged to its conditions' last change, not to when
    a controller (restarted two days later) first saw it failed."""
    env = Env()
    failed = gpu_pod("f", [(0, 1000, 0)], at=T0)
    failed["status"].update(phase="Failed", reason="UnexpectedAdmissionError")
    env.server.put_object(PODS, failed)
    env.server.put_object(resources.GPU_BUDGET.path("team"), budget(gpuHours=100))
    try:
        env.clock.now = T0 + 10
        first = await env.start()
        assert env.status().used_gpu_seconds <= 10
        await first.stop()
        env.controllers.remove(first)
        env.clock.now = T0 + 2 * DAY
        await env.start()
        assert env.status().used_gpu_seconds <= 10
    finally:
        for controller in env.controllers:
            await controller.stop()


async def test_a_claims_use_before_its_current_user_survives_a_restart() -> None:
    """A claim used 0-10 h by one pod, then by another: a controller started after the first went
    knows only the second, and continues from the use the last write listed."""
    env = Env(dra_node=True)
    server, clock = env.server, env.clock
    server.put_object(dra.claim_path("team"), allocated_claim("shared", 1000, "0", "c-1"))
    server.put_object(PODS, claim_user("first", "shared", T0))
    server.put_object(resources.GPU_BUDGET.path("team"), budget(gpuHours=100))
    controller = await env.start()
    try:
        clock.now = T0 + 10 * HOUR
        await env.pass_(controller)
        await controller.api.delete(paths.pod("team", "first"), grace_period=0)
        await settle(server)
        server.put_object(PODS, claim_user("second", "shared", T0 + 10 * HOUR))
        clock.now = T0 + 11 * HOUR
        await env.pass_(controller)
        assert env.status().used_gpu_seconds == 11 * HOUR
        await controller.stop()
        env.controllers.remove(controller)
        clock.now = T0 + 12 * HOUR
        controller = await env.start()
        assert env.status().used_gpu_seconds == 12 * HOUR
        clock.now = T0 + 13 * HOUR
        await env.pass_(controller)
        assert env.status().used_gpu_seconds == 13 * HOUR, "and goes on counting"
    finally:
        for running in env.controllers:
            await running.stop()


async def test_a_claim_whose_only_user_failed_with_no_containers_end_stops_counting() -> None:
    env = Env(dra_node=True)
    env.server.put_object(dra.claim_path("team"), allocated_claim("shared", 1000, "0", "c-1"))
    user = claim_user("first", "shared", T0)
    user["status"]["phase"] = "Failed"
    env.server.put_object(PODS, user)
    env.server.put_object(resources.GPU_BUDGET.path("team"), budget(gpuHours=100))
    env.clock.now = T0 + 10
    controller = await env.start()
    try:
        env.clock.now = T0 + 2 * DAY
        await env.pass_(controller)
        assert env.status().used_gpu_seconds <= 10
    finally:
        await controller.stop()


async def test_a_pod_deleted_within_the_clocks_skew_of_its_binding_does_not_stop_the_books(env: Env) -> None:
    """The API server's clock is 2 s ahead of the controller's: a pod bound and deleted at once ends,
    by the controller's clock, before it started. It held nothing, and every later pass still
    accounts (each had failed on it, for every budget)."""
    await env.add(gpu_pod("a", [(0, 1000, 0)]), PODS)
    await env.add(budget(gpuHours=100), resources.GPU_BUDGET.path("team"))
    controller = await env.start()
    env.clock.now = T0 + HOUR
    await env.pass_(controller)
    await env.add(gpu_pod("b", [(1, 1000, 0)], at=T0 + HOUR + 2), PODS)
    await settle(env.server)
    await env.api.delete(paths.pod("team", "b"), grace_period=0)
    await settle(env.server)
    env.clock.now = T0 + 3 * HOUR
    await env.pass_(controller)
    assert controller.budgets.loop.failures == 0
    assert env.status().used_gpu_seconds == 3 * HOUR


async def test_a_pod_back_in_a_cluster_budgets_cover_is_settled_from_its_return_when_it_goes(env: Env) -> None:
    """Relabelled out for an hour and back: deleted while watched, it is settled from its return
    (`counted_from`), not from its start, which would charge its earlier hour twice and the hour
    outside the cover."""
    await env.add(namespace("speech", org="research"), paths.NAMESPACES)
    await env.add(gpu_pod("p", [(0, 1000, 0)], namespace="speech"), paths.pods("speech"))
    selector = {"matchLabels": {"org": "research"}}
    await env.add(cluster_budget(selector=selector, gpuHours=100), resources.CLUSTER_GPU_BUDGET.path())
    controller = await env.start()
    env.clock.now = T0 + HOUR
    await env.pass_(controller)
    await env.api.patch(paths.namespace("speech"), {"metadata": {"labels": {"org": "sales"}}})
    await env.pass_(controller)
    env.clock.now = T0 + 2 * HOUR
    await env.api.patch(paths.namespace("speech"), {"metadata": {"labels": {"org": "research"}}})
    await env.pass_(controller)
    env.clock.now = T0 + 3 * HOUR
    await env.pass_(controller)
    assert cluster_status(env).used_gpu_seconds == 2 * HOUR
    await env.api.delete(paths.pod("speech", "p"), grace_period=0)
    await env.pass_(controller)
    assert cluster_status(env).used_gpu_seconds == 2 * HOUR


async def test_a_conflict_reads_the_budget_again_when_the_kept_copy_is_older_than_the_watchs() -> None:
    """An admin raises gpuHours just after a status write, and the watch brings both versions before
    the write's answer is handled: the answer's copy (older) replaced the watch's, every later write
    got a 409 and no event came to mend it. After a 409 the budget is read again."""
    env = Env()
    await env.add(gpu_pod("a", [(0, 1000, 0)]), PODS)
    await env.add(budget(), resources.GPU_BUDGET.path("team"))
    controller = await env.start()
    try:
        admin = client.KubeClient(env.server)
        write = controller.budgets.api.replace
        edited: list[bool] = []

        async def replace(path: str, body: Any, *args: Any, **kwargs: Any) -> Json:
            stored: Json = await write(path, body, *args, **kwargs)
            if not edited:
                edited.append(True)
                await admin.patch(resources.GPU_BUDGET.path("team", "b"), {"spec": {"gpuHours": 20}})
                await settle(env.server)
            return stored

        controller.budgets.api.replace = replace  # type: ignore[method-assign]
        for hours in (1, 2, 3):
            env.clock.now = T0 + hours * HOUR
            await env.pass_(controller)
        assert env.status().limit_gpu_seconds == 20 * HOUR and env.status().used_gpu_seconds == 3 * HOUR
    finally:
        for running in env.controllers:
            await running.stop()


async def test_a_claim_deleted_after_a_restart_is_settled_with_the_use_its_books_listed() -> None:
    """A claim used for 10 h by one pod, then by another; the controller restarts knowing only the
    second user. When both go, the claim is settled at no less than the books listed (13 h), not from
    the one user the new controller saw (3 h): an Exhausted budget went back to Within so."""
    env = Env(dra_node=True)
    env.server.put_object(dra.claim_path("team"), allocated_claim("shared", 1000, "0", "c-1"))
    env.server.put_object(PODS, claim_user("first", "shared", T0))
    env.server.put_object(resources.GPU_BUDGET.path("team"), budget(gpuHours=100))
    controller = await env.start()
    try:
        env.clock.now = T0 + 10 * HOUR
        await env.pass_(controller)
        await controller.api.delete(paths.pod("team", "first"), grace_period=0)
        await settle(env.server)
        env.server.put_object(PODS, claim_user("second", "shared", T0 + 10 * HOUR))
        env.clock.now = T0 + 11 * HOUR
        await env.pass_(controller)
        await controller.stop()
        env.controllers.remove(controller)
        env.clock.now = T0 + 12 * HOUR
        controller = await env.start()
        env.clock.now = T0 + 13 * HOUR
        await controller.api.delete(paths.pod("team", "second"), grace_period=0)
        await settle(env.server)
        await controller.api.delete(f"{dra.claim_path('team')}/shared")
        await env.pass_(controller)
        assert env.status().used_gpu_seconds == 13 * HOUR
    finally:
        for running in env.controllers:
            await running.stop()


async def test_a_budget_whose_period_start_cannot_be_read_says_so_once(env: Env) -> None:
    """A periodStart stored before the definition's pattern refused it (a date alone): the budget is
    not accounted, and a Warning event says why, once, instead of a log line only."""
    await env.add(gpu_pod("a", [(0, 1000, 0)]), PODS)
    await env.add(budget(periodStart="2026-11-01"), resources.GPU_BUDGET.path("team"))
    controller = await env.start()
    for hours in (1, 2):
        env.clock.now = T0 + hours * HOUR
        await env.pass_(controller)
    warned = [e for e in env.server.list_objects("/api/v1/events") if e["reason"] == "InvalidSpec"]
    assert len(warned) == 1 and "spec.periodStart" in warned[0]["message"], warned
    assert controller.budgets.writes == 0


def test_a_replica_that_does_not_lead_forgets_pods_that_went_long_ago() -> None:
    """Only the leader runs passes (which drop settled pods): a standby replica kept every GPU pod it
    saw deleted, for as long as it ran. Those gone over `GONE_RETENTION` ago are let go as others go."""
    from sharegpu.api import lifetimes
    from sharegpu.controller import budgets as controller_budgets
    from sharegpu.kube import events as kube_events

    clock = builders.Clock(T0)
    api = client.KubeClient(fake.FakeApiServer())
    standby = controller_budgets.BudgetReconciler(api, kube_events.Recorder(api, "c", "c-1", clock), clock)
    for hour in range(6):
        clock.now = T0 + hour * HOUR
        for n in range(5):
            body = gpu_pod(f"p{hour}-{n}", [(0, 500, 0)], at=T0 + hour * HOUR - 60)
            body["metadata"]["uid"] = f"uid-{hour}-{n}"
            pod = wire.convert(body, lifetimes.TimedPod)
            standby.on_pod(wire.EventType.DELETED, controller_budgets.pod_books(pod))
    assert 5 <= len(standby.gone) <= 10, len(standby.gone)
    assert all(clock.now - end <= controller_budgets.GONE_RETENTION for _, end in standby.gone.values())


async def test_a_new_leader_waits_for_its_watches_before_it_counts_what_the_last_one_settled(env: Env) -> None:
    """The old leader saw pod a deleted, settled it and wrote; the new leader's pod watch is a moment
    behind, still showing a. Counting at once, it charged a again from its start (not listed in the
    books, so taken for a pod the writer did not know), then settled it a second time."""
    await env.add(gpu_pod("a", [(0, 1000, 0)]), PODS)
    await env.add(gpu_pod("keep", [(1, 1000, 0)]), PODS)
    await env.add(budget(gpuHours=100), resources.GPU_BUDGET.path("team"))
    old = await env.start()
    env.clock.now = T0 + HOUR
    await env.pass_(old)
    new = await env.start(fence=float("inf"))  # not leading yet: it counts nothing
    new.budgets.monotonic = env.clock  # the fence's time is the test's too
    held: list[tuple[wire.EventType, budgets_controller.PodBooks]] = []
    deliver = new.budgets.on_pod

    def lagging(kind: wire.EventType, books: budgets_controller.PodBooks) -> None:
        if kind == wire.EventType.DELETED:
            held.append((kind, books))
        else:
            deliver(kind, books)

    for made in new.informers:
        if made.name == "pods":
            made.handler = lagging
    await env.api.delete(paths.pod("team", "a"), grace_period=0)
    await settle(env.server)
    env.clock.now = T0 + HOUR + 60
    await env.pass_(old)  # settles a and writes
    assert env.status().used_gpu_seconds == 2 * HOUR + 60
    await old.stop()
    env.controllers.remove(old)
    new.budgets.fence = budgets_controller.FENCE
    new.budgets.new_term()  # takes over
    await env.pass_(new)  # its watch still shows a
    for kind, books in held:
        deliver(kind, books)
    env.clock.now = T0 + HOUR + 120
    await env.pass_(new)
    assert env.status().used_gpu_seconds == 2 * HOUR + 120, "a once (1 h), keep 1 h 2 min"
