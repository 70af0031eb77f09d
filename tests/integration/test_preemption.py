"""Preemption on the real kube-apiserver and kube-scheduler (the sharegpu profile, its own preemption
off): a high-priority GPU pod that fits nowhere preempts the fewest lower-priority sharing pods and is
placed on the GPU they freed, with nothing over-committed at any moment; a pod whose PriorityClass
says `preemptionPolicy: Never` preempts nothing."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sharegpu.api import names
from sharegpu.devcluster import oracle
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


async def test_a_high_priority_pod_preempts_lower_priority_shares_and_takes_their_gpu(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    classes: dict[str, str],
) -> None:
    (node,) = await nodes(1, gpus=1)
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    for name in ("low-a", "low-b"):
        await admin.create(pods_path, with_class(gpu_pod(name, namespace, milli=400), classes["low"]))
        await wait_for(functools.partial(_bound, admin, namespace, name), what=f"{name} bound")
    await admin.create(pods_path, with_class(gpu_pod("high", namespace, milli=600), classes["high"]))

    async def placed() -> Json | None:
        await never_overcommitted(admin, node)
        found = await pods_by_name(admin, namespace)
        high = found.get("high")
        return found if high is not None and high["spec"].get("nodeName") else None

    found = await wait_for(placed, timeout=60, what="high bound after preempting")
    assert found["high"]["spec"]["nodeName"] == node
    assert set(found) == {"high", "low-a"}, "the newer of the two low pods went, and only it"
    await consistent(admin, [node])
    events, _ = await admin.list_all(f"/api/v1/namespaces/{namespace}/events")
    said = {(e["reason"], e["involvedObject"]["name"]) for e in events}
    assert ("Preempted", "low-b") in said and ("Preempting", "high") in said, said


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
