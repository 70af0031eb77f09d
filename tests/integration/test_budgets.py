"""GPU-time budgets on the real control plane: pods placed by kube-scheduler + extender and run by
the fake kubelet consume a budget while the controller's clock advances (no sleeping); the figures
match the pods' lifetimes within 1% and survive a controller restart; an exhausted budget refuses
(Deny) or demotes (Demote) new GPU pods through the registered webhook; each crossing is one event."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sharegpu.api import budgets, names, paths, resources, wire
from sharegpu.controller import runtime
from sharegpu.devcluster import controlplane, fakecluster, stack
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from tests.builders import Clock, MakePod
from tests.integration.conftest import RunningWebhook, bound_long_ago, budget_body, events, gpu_pod, wait_for

Json = dict[str, Any]


class Controllers:
    """In-process controllers on the real API server, sharing one clock; restartable."""

    def __init__(self, plane: controlplane.ControlPlane) -> None:
        self.plane = plane
        self.clock = Clock(time.time())
        self.running: runtime.Controller | None = None
        self.kube: client.KubeClient | None = None

    async def start(self) -> runtime.Controller:
        self.kube = stack.kube_for(self.plane, "sharegpu-controller")
        # No fence at a new term: these tests jump the clock as soon as it starts (test_controller_replicas
        # hands over for real).
        options = runtime.Options(leader_elect=False, tick=3600, budget_fence=0.0)
        made = runtime.Controller(self.kube, options, clock=self.clock)
        await made.start()
        self.running = made
        return made

    async def stop(self) -> None:
        if self.running is not None:
            await self.running.stop()
        if self.kube is not None:
            await self.kube.close()
        self.running = self.kube = None

    async def pass_(self) -> None:
        assert self.running is not None
        loop = self.running.budgets.loop
        before = loop.completed
        loop.wake()
        await wait_for(_async(lambda: loop.completed > before), timeout=20, what="a reconcile pass")


def _async(check: Any) -> Any:
    async def predicate() -> Any:
        return check()

    return predicate


@pytest.fixture
async def controllers(control_plane: controlplane.ControlPlane, system: None) -> AsyncIterator[Controllers]:
    made = Controllers(control_plane)
    yield made
    await made.stop()


async def status_of(kube: client.KubeClient, namespace: str, name: str) -> budgets.BudgetStatus:
    stored = await kube.get(resources.GPU_BUDGET.path(namespace, name))
    return wire.convert(stored, budgets.GPUBudget).status


async def running(kube: client.KubeClient, namespace: str, name: str) -> int:
    """Wait until the pod runs; its binding time (the PodScheduled condition) in seconds."""

    async def bound() -> int | None:
        pod = await kube.get(paths.pod(namespace, name))
        if (pod.get("status") or {}).get("phase") != "Running":
            return None
        for condition in pod["status"].get("conditions") or []:
            if condition["type"] == "PodScheduled" and condition["status"] == "True":
                return wire.seconds(condition["lastTransitionTime"])
        return None

    started: int = await wait_for(bound, what=f"{name} running")
    return started


async def test_a_budget_is_consumed_by_running_pods_survives_a_restart_and_then_refuses(
    admin: client.KubeClient,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    nodes: Any,
    webhook: RunningWebhook,
    controllers: Controllers,
) -> None:
    await nodes(1, gpus=2, memory=16384)
    await admin.create(resources.GPU_BUDGET.path(namespace), budget_body("team", namespace, warnAtPercent=50,
                                                                         whenExhausted="Deny"))  # fmt: skip
    # a: 500 milli on each of 2 GPUs (weight 1000); b: 250 milli with half a GPU's memory (weight 500).
    await admin.create(paths.pods(namespace), gpu_pod("a", namespace, milli=500, count=2))
    await admin.create(paths.pods(namespace), gpu_pod("b", namespace, milli=250, memory=8192))
    start_a = await running(admin, namespace, "a")
    start_b = await running(admin, namespace, "b")
    await controllers.start()
    clock = controllers.clock
    clock.now = time.time() + 1200
    await controllers.pass_()

    def expected(now: float, end_b: float | None = None) -> float:
        return 1.0 * (now - start_a) + 0.5 * ((end_b or now) - start_b)

    status = await status_of(admin, namespace, "team")
    assert status.used_gpu_seconds == pytest.approx(expected(clock.now), rel=0.01)
    assert status.state == "Warning"  # past 50% of 3600
    assert [c.pod for c in status.top_consumers] == [f"{namespace}/a", f"{namespace}/b"]

    # Restart: a fresh controller reads the books from the status and agrees.
    await controllers.stop()
    await controllers.start()
    await controllers.pass_()
    again = await status_of(admin, namespace, "team")
    assert again.used_gpu_seconds == pytest.approx(expected(clock.now), rel=0.01)
    assert len(await events(admin, namespace, "BudgetWarning")) == 1

    # b goes; 40 more minutes: only a counts from then on, and the budget is used up.
    end_b = clock.now
    await admin.delete(paths.pod(namespace, "b"), grace_period=0)

    async def settled() -> bool:
        await controllers.pass_()
        current = await status_of(admin, namespace, "team")
        return all(p.pod != f"{namespace}/b" for p in current.accounting.pods)

    await wait_for(settled, what="b settled")
    clock.advance(2400)
    await controllers.pass_()
    spent = await status_of(admin, namespace, "team")
    assert spent.used_gpu_seconds == pytest.approx(expected(clock.now, end_b), rel=0.01)
    assert spent.state == "Exhausted" and spent.remaining_gpu_seconds == 0
    assert len(await events(admin, namespace, "BudgetExhausted")) == 1
    assert len(await events(admin, namespace, "BudgetWarning")) == 1

    # The webhook sees the exhausted budget and refuses a new GPU pod, saying why; CPU pods still run.
    async def webhook_knows() -> bool:
        found = webhook.policy.budgets.get(namespace, ())
        return any(b.status.state == "Exhausted" for b in found)

    await wait_for(webhook_knows, what="the webhook to see the exhausted budget")
    with pytest.raises(kube_errors.KubeError) as refused:
        await admin.create(paths.pods(namespace), gpu_pod("c", namespace, milli=100))
    message = str(refused.value)
    assert f"GPUBudget {namespace}/team" in message and "refuses new GPU pods" in message
    await admin.create(paths.pods(namespace), MakePod("cpu", namespace).container("m", image="busybox").obj())


async def test_an_exhausted_demote_budget_gives_new_gpu_pods_the_demotion_class(
    admin: client.KubeClient,
    system_kube: client.KubeClient,
    namespace: str,
    webhook: RunningWebhook,
    controllers: Controllers,
) -> None:
    await admin.create(resources.GPU_BUDGET.path(namespace), budget_body("team", namespace))
    await bound_long_ago(system_kube, namespace, "old", 7200)
    await controllers.start()
    await controllers.pass_()
    status = await status_of(admin, namespace, "team")
    assert status.state == "Exhausted"
    assert status.used_gpu_seconds == pytest.approx(7200, rel=0.01)

    async def webhook_knows() -> bool:
        return any(b.status.state == "Exhausted" for b in webhook.policy.budgets.get(namespace, ()))

    await wait_for(webhook_knows, what="the webhook to see the exhausted budget")
    new = await admin.create(paths.pods(namespace), gpu_pod("new", namespace, milli=200))
    assert new["spec"]["priorityClassName"] == "sharegpu-over-budget"
    assert new["spec"]["priority"] == -1000
    assert f"GPUBudget {namespace}/team" in new["metadata"]["annotations"][names.DEMOTED]


async def test_a_cluster_budget_pools_the_namespaces_it_selects_and_refuses_in_each_of_them(
    admin: client.KubeClient,
    system_kube: client.KubeClient,
    namespace: str,
    webhook: RunningWebhook,
    controllers: Controllers,
) -> None:
    org = f"org-{namespace}"
    other = f"{namespace}-b"
    name = f"pool-{namespace}"
    made = [other, f"{namespace}-new", f"{namespace}-out"]
    await admin.patch(paths.namespace(namespace), {"metadata": {"labels": {"org": org}}})
    await admin.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace",
                                          "metadata": {"name": other, "labels": {"org": org}}})  # fmt: skip
    body = budget_body(name, "", whenExhausted="Deny", namespaceSelector={"matchLabels": {"org": org}})
    body["kind"], body["apiVersion"] = resources.CLUSTER_GPU_BUDGET.kind, resources.CLUSTER_GPU_BUDGET.api_version
    del body["metadata"]["namespace"]
    await admin.create(resources.CLUSTER_GPU_BUDGET.path(), body)
    try:
        # Half an hour of a whole GPU in each namespace: the pool's 3600 GPU-seconds.
        await bound_long_ago(system_kube, namespace, "one", 1800)
        await bound_long_ago(system_kube, other, "two", 1800)
        await controllers.start()
        controllers.clock.now = time.time() + 120  # two more minutes each: past the pool's 3600
        await controllers.pass_()
        stored = await admin.get(resources.CLUSTER_GPU_BUDGET.path(None, name))
        status = wire.convert(stored, budgets.ClusterGPUBudget).status
        assert status.used_gpu_seconds == pytest.approx(2 * (1800 + 120), rel=0.01)
        assert sorted(c.pod for c in status.top_consumers) == sorted([f"{namespace}/one", f"{other}/two"])
        assert status.state == "Exhausted"
        exhausted = [e for e in await events(admin, "default", "BudgetExhausted")
                     if e["involvedObject"]["name"] == name]  # fmt: skip
        assert len(exhausted) == 1 and exhausted[0]["involvedObject"]["kind"] == "ClusterGPUBudget"

        async def webhook_knows() -> bool:
            return any(b.status.state == "Exhausted" for b in webhook.policy.cluster_budgets)

        await wait_for(webhook_knows, what="the webhook to see the exhausted cluster budget")
        # Refused in each namespace the selector picks, a namespace created with the label a moment
        # ago included; admitted in one it does not pick.
        await admin.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace",
                                              "metadata": {"name": made[1], "labels": {"org": org}}})  # fmt: skip
        for where in (namespace, other, made[1]):
            with pytest.raises(kube_errors.KubeError) as refused:
                await admin.create(paths.pods(where), gpu_pod("c", where, milli=100))
            assert f"ClusterGPUBudget {name}: 1.0" in str(refused.value) and "of 1 GPU-hours used" in str(refused.value)
        await admin.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": made[2]}})
        await admin.create(paths.pods(made[2]), gpu_pod("c", made[2], milli=100))
    finally:
        await admin.delete(resources.CLUSTER_GPU_BUDGET.path(None, name))
        for ns in made:
            with contextlib.suppress(kube_errors.NotFoundError):
                await admin.request("DELETE", f"{paths.pods(ns)}", params={"gracePeriodSeconds": 0})
                await admin.delete(paths.namespace(ns))
