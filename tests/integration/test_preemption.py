"""Preemption on the real kube-apiserver and kube-scheduler (the sharegpu profile, its own preemption
off): a high-priority GPU pod that fits nowhere preempts the fewest lower-priority sharing pods and is
placed on the GPU they freed, with nothing over-committed at any moment; a pod a PodDisruptionBudget
protects is spared where another makes room; a pod whose PriorityClass says `preemptionPolicy: Never`
preempts nothing."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sharegpu.api import names, paths
from sharegpu.core import allocation, units
from sharegpu.devcluster import fakecluster, oracle
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.integration.conftest import consistent, gpu_pod, refusal, wait_for

Json = dict[str, Any]
CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"


@pytest.fixture
async def classes(admin: client.KubeClient) -> AsyncIterator[dict[str, str]]:
    """PriorityClasses of this test: low (100), high (1000), high-never (1000, preemptionPolicy Never)."""
    tag = uuid.uuid4().hex[:6]
    made = {"low": (100, None), "high": (1000, None), "high-never": (1000, "Never")}
    found: dict[str, str] = {}
    for role, (value, policy) in made.items():
        name = f"t-{tag}-{role}"
        body: Json = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                      "value": value}  # fmt: skip
        if policy:
            body["preemptionPolicy"] = policy
        await admin.create(CLASSES, body)
        found[role] = name
    yield found
    for name in found.values():
        await admin.delete(f"{CLASSES}/{name}")


def with_class(pod: Json, priority_class: str) -> Json:
    pod["spec"]["priorityClassName"] = priority_class
    return pod


async def pods_by_name(kube: client.KubeClient, namespace: str) -> dict[str, Json]:
    items, _ = await kube.list_all(f"/api/v1/namespaces/{namespace}/pods")
    return {p["metadata"]["name"]: p for p in items}


async def never_overcommitted(kube: client.KubeClient, node: str) -> None:
    found = await oracle.inspect(kube, nodes={node})
    assert not (found.overcommits or found.double_allocations), found.problems()


async def high_bound(kube: client.KubeClient, namespace: str, nodes: list[str]) -> dict[str, Json] | None:
    """The namespace's pods by name once the pod `high` is bound (none of `nodes` over-committed at
    any poll on the way)."""
    for node in nodes:
        await never_overcommitted(kube, node)
    found = await pods_by_name(kube, namespace)
    high = found.get("high")
    return found if high is not None and high["spec"].get("nodeName") else None


async def reasons(kube: client.KubeClient, namespace: str) -> set[tuple[str, str]]:
    """(reason, pod) of the namespace's events."""
    events, _ = await kube.list_all(f"/api/v1/namespaces/{namespace}/events")
    return {(e["reason"], e["involvedObject"]["name"]) for e in events}


async def placed_in_turn(admin: client.KubeClient, namespace: str, bodies: list[Json]) -> None:
    """Create the pods one after the other, each bound before the next is made."""
    for body in bodies:
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", body)
        name = body["metadata"]["name"]
        await wait_for(functools.partial(_bound, admin, namespace, name), what=f"{name} bound")


async def high_preempts(
    admin: client.KubeClient, namespace: str, node: str, classes: dict[str, str]
) -> tuple[dict[str, Json], set[tuple[str, str]]]:
    """A 600-milli pod of the high class made and bound on `node` by preempting (nothing over-committed
    on the way, the ledger consistent after): the namespace's pods by name, and its events' reasons."""
    body = with_class(gpu_pod("high", namespace, milli=600), classes["high"])
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", body)
    placed = functools.partial(high_bound, admin, namespace, [node])
    found = await wait_for(placed, timeout=60, what="high bound after preempting")
    assert found["high"]["spec"]["nodeName"] == node
    await consistent(admin, [node])
    return found, await reasons(admin, namespace)


async def test_a_high_priority_pod_preempts_lower_priority_shares_and_takes_their_gpu(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    classes: dict[str, str],
) -> None:
    (node,) = await nodes(1, gpus=1)
    lows = [with_class(gpu_pod(name, namespace, milli=400), classes["low"]) for name in ("low-a", "low-b")]
    await placed_in_turn(admin, namespace, lows)
    found, said = await high_preempts(admin, namespace, node, classes)
    assert set(found) == {"high", "low-a"}, "the newer of the two low pods went, and only it"
    assert ("Preempted", "low-b") in said and ("Preempting", "high") in said, said


async def test_a_pod_a_disruption_budget_protects_is_not_the_one_preempted(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    classes: dict[str, str],
) -> None:
    """Two equal low pods on the two GPUs of a node; the one that would go by kube-scheduler's order
    is protected by a PodDisruptionBudget (minAvailable 1 of 1: it allows no disruption). The high
    pod preempts the other instead (the extender watches the budget, as kube-scheduler does)."""
    (node,) = await nodes(1, gpus=2)
    budget: Json = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "keep", "namespace": namespace},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
    }  # fmt: skip
    await admin.create(paths.pod_disruption_budgets(namespace), budget)
    # Equals are kept the older first, then by name (creation times have seconds only): without the
    # budget "second" would go.
    lows = []
    for name, app in (("first", "free"), ("second", "guarded")):
        body = with_class(gpu_pod(name, namespace, milli=800), classes["low"])
        body["metadata"].setdefault("labels", {})["app"] = app
        lows.append(body)
    await placed_in_turn(admin, namespace, lows)
    found, said = await high_preempts(admin, namespace, node, classes)
    assert set(found) == {"high", "second"}, "the unprotected pod went, not the usual victim"
    assert ("Preempted", "first") in said and ("Preempted", "second") not in said, said


async def test_a_pod_that_may_not_preempt_waits(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    classes: dict[str, str],
) -> None:
    (node,) = await nodes(1, gpus=1)
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    await admin.create(pods_path, with_class(gpu_pod("low", namespace, milli=800), classes["low"]))
    await wait_for(lambda: _bound(admin, namespace, "low"), what="low bound")
    await admin.create(pods_path, with_class(gpu_pod("polite", namespace, milli=600), classes["high-never"]))
    message = await wait_for(lambda: refusal(admin, namespace, "polite"), what="polite turned away")
    assert "preempting" not in message and "milli-GPU free" in message, message
    found = await pods_by_name(admin, namespace)
    assert not found["low"]["metadata"].get("deletionTimestamp")
    await admin.request("DELETE", f"{pods_path}/low", params={"gracePeriodSeconds": 0})
    await wait_for(lambda: _bound(admin, namespace, "polite"), what="polite placed once room appears")
    await consistent(admin, [node])


async def _bound(kube: client.KubeClient, namespace: str, name: str) -> bool:
    pod = await kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    return bool(pod["spec"].get("nodeName")) and names.ALLOCATION in pod["metadata"].get("annotations", {})


async def test_victims_that_take_time_to_stop_keep_their_gpu_for_the_pod_that_preempted_them(
    admin: client.KubeClient,
    harness: fakecluster.FakeCluster,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    classes: dict[str, str],
) -> None:
    """Two GPUs, two 500-milli pods on each: a whole-GPU pod needs the two of one GPU to go. They stop
    slowly, one after 2 s and one after 5 s (played by the harness): a low pod that would fit in the
    room the first one leaves does not land there, and once both have gone the whole-GPU pod does."""
    (node,) = await nodes(1, gpus=2)
    for i in range(4):
        harness.linger[f"{namespace}/low-{i}"] = 2.0 if i % 2 == 0 else 5.0
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    for i in range(4):
        body = with_class(gpu_pod(f"low-{i}", namespace, milli=500), classes["low"])
        body["spec"]["terminationGracePeriodSeconds"] = 30
        await admin.create(pods_path, body)
        await wait_for(functools.partial(_bound, admin, namespace, f"low-{i}"), what=f"low-{i} bound")
    before = {n: _gpus(p) for n, p in (await pods_by_name(admin, namespace)).items()}
    await admin.create(pods_path, with_class(gpu_pod("whole", namespace, milli=1000), classes["high"]))

    async def terminating() -> list[str] | None:
        found = await pods_by_name(admin, namespace)
        going = sorted(n for n, p in found.items() if p["metadata"].get("deletionTimestamp"))
        return going if len(going) >= 2 else None  # the victims' deletions are written one after the other

    going = await wait_for(terminating, what="both victims being deleted")
    assert len(going) == 2 and len({before[n] for n in going}) == 1, (going, before)
    (freed,) = {before[n] for n in going}
    assert (await admin.get(f"{pods_path}/whole"))["status"].get("nominatedNodeName") == node

    async def one_left() -> bool:
        found = await pods_by_name(admin, namespace)
        return sum(n in found for n in going) == 1

    await wait_for(one_left, what="the first victim stopped")
    # 500 milli-GPU of the GPU being freed is free now: a 400 pod would fit there, but it is held.
    await admin.create(pods_path, with_class(gpu_pod("late", namespace, milli=400), classes["low"]))
    await wait_for(lambda: refusal(admin, namespace, "late"), what="late turned away")

    async def placed() -> dict[str, Json] | None:
        await never_overcommitted(admin, node)
        found = await pods_by_name(admin, namespace)
        assert not found["late"]["spec"].get("nodeName"), "late took the room being freed for whole"
        return found if found["whole"]["spec"].get("nodeName") else None

    found = await wait_for(placed, timeout=30, what="whole bound")
    assert set(going).isdisjoint(found), "both victims have stopped"
    assert _gpus(found["whole"]) == freed
    assert not found["late"]["spec"].get("nodeName"), "the low pod still has no room"
    await consistent(admin, [node])


def _gpus(pod: Json) -> tuple[int, ...]:
    text = pod["metadata"]["annotations"][names.ALLOCATION]
    return tuple(sorted(allocation.Allocation.from_json(text, pod=units.PodKey("x/y")).gpu_usage()))


async def test_a_gang_is_preempted_whole_for_a_higher_priority_pod(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    classes: dict[str, str],
) -> None:
    """A gang of two whole-GPU members on two one-GPU nodes (placed together), then a high-priority
    pod of 600 milli: it takes one member's GPU, and the other member goes with it (a gang is never
    left partial); both get the DisruptionTarget condition and the Preempted event."""
    both = await nodes(2, gpus=1)
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    gang = {names.GANG: "job", names.GANG_MIN: "2"}
    for name in ("w0", "w1"):
        await admin.create(
            pods_path, with_class(gpu_pod(name, namespace, milli=1000, annotations=gang), classes["low"])
        )
    for name in ("w0", "w1"):
        await wait_for(functools.partial(_bound, admin, namespace, name), what=f"{name} bound with its gang")
    await admin.create(pods_path, with_class(gpu_pod("high", namespace, milli=600), classes["high"]))
    found = await wait_for(functools.partial(high_bound, admin, namespace, both), timeout=60, what="high bound")
    assert set(found) == {"high"}, f"both members went before it was bound: {sorted(found)}"
    said = await reasons(admin, namespace)
    assert {("Preempted", "w0"), ("Preempted", "w1"), ("Preempting", "high")} <= said, said


async def test_a_gang_that_fits_nowhere_preempts_on_several_nodes_and_is_bound_whole(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    classes: dict[str, str],
) -> None:
    """Two one-GPU nodes, a low pod of 600 milli on each; a high-priority gang of two 600-milli members
    fits on neither: both low pods are preempted at once and the gang is bound whole, one member per
    node, with nothing over-committed at any poll on the way."""
    both = await nodes(2, gpus=1)
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    for name in ("low-a", "low-b"):
        await admin.create(pods_path, with_class(gpu_pod(name, namespace, milli=600), classes["low"]))
        await wait_for(functools.partial(_bound, admin, namespace, name), what=f"{name} bound")
    gang = {names.GANG: "job", names.GANG_MIN: "2"}
    for name in ("g0", "g1"):
        await admin.create(
            pods_path, with_class(gpu_pod(name, namespace, milli=600, annotations=gang), classes["high"])
        )

    async def gang_bound() -> dict[str, Json] | None:
        for node in both:
            await never_overcommitted(admin, node)
        found = await pods_by_name(admin, namespace)
        return found if all((found.get(n) or {}).get("spec", {}).get("nodeName") for n in ("g0", "g1")) else None

    found = await wait_for(gang_bound, timeout=90, what="the gang bound after preempting")
    assert set(found) == {"g0", "g1"}, f"both low pods went: {sorted(found)}"
    assert {found[n]["spec"]["nodeName"] for n in ("g0", "g1")} == set(both)
    await consistent(admin, both)
    said = await reasons(admin, namespace)
    assert {("Preempted", "low-a"), ("Preempted", "low-b"), ("Preempting", "g0"), ("Preempting", "g1")} <= said, said
