"""The defragmenter on the real control plane: two 1-GPU nodes, one holding `a` (300 milli-GPU) and
the other `b` (200), each of its own ReplicaSet, and a pending pod that wants a whole GPU (1500
milli-GPU free in total, no GPU entirely free). Moving `b` would be cheaper (less compute moved), but
a PodDisruptionBudget forbids disrupting `b`. `sharegpu defrag` (dry run) prints the
plan: evict `a`, and evicts nothing. The controller with --defrag then evicts `a` through the
Eviction API, its ReplicaSet recreates it, it lands beside `b`, and the pending pod schedules on the
GPU `a` left."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sharegpu.api import paths
from sharegpu.controller import runtime
from sharegpu.devcluster import controlplane, fakecluster, stack
from sharegpu.kube import client
from tests import builders
from tests.integration.conftest import gpu_pod, wait_for

Json = dict[str, Any]


def replica_set(name: str, namespace: str, milli: int) -> Json:
    template = gpu_pod(name, namespace, milli=milli)
    template["metadata"] = {"labels": {"app": name}}
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": template},
    }


async def pods_of(kube: client.KubeClient, namespace: str, app: str) -> list[Json]:
    listed = await kube.get(paths.pods(namespace), labelSelector=f"app={app}")
    found: list[Json] = listed["items"]
    return found


async def running_on(kube: client.KubeClient, namespace: str, app: str) -> Json | None:
    """The app's one live pod once it is bound and running (None before)."""
    live = [p for p in await pods_of(kube, namespace, app) if not p["metadata"].get("deletionTimestamp")]
    if len(live) == 1 and live[0]["spec"].get("nodeName") and live[0]["status"].get("phase") == "Running":
        return live[0]
    return None


async def cordon(kube: client.KubeClient, node: str, unschedulable: bool) -> None:
    await kube.patch(paths.node(node), {"spec": {"unschedulable": unschedulable}})


@pytest.fixture
async def defragmenter(control_plane: controlplane.ControlPlane, system: None) -> AsyncIterator[runtime.Controller]:
    kube = stack.kube_for(control_plane, "sharegpu-controller")
    options = runtime.Options(leader_elect=False, tick=1.0, defrag=True, defrag_budget_per_hour=5)
    made = runtime.Controller(kube, options)
    yield made
    await made.stop()
    await kube.close()


async def test_the_controller_evicts_the_pod_the_budget_allows_and_the_pending_pod_schedules(
    control_plane: controlplane.ControlPlane,
    admin: client.KubeClient,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    nodes: Any,
    defragmenter: runtime.Controller,
) -> None:
    first, second = await nodes(2, gpus=1)
    # Lay the cluster out by hand: `a` on the first node, `b` on the second (cordoning the other).
    await cordon(admin, second, True)
    await admin.create(f"/apis/apps/v1/namespaces/{namespace}/replicasets", replica_set("a", namespace, 300))
    a = await wait_for(lambda: running_on(admin, namespace, "a"), what="a running")
    assert a["spec"]["nodeName"] == first
    await cordon(admin, second, False)
    await cordon(admin, first, True)
    await admin.create(f"/apis/apps/v1/namespaces/{namespace}/replicasets", replica_set("b", namespace, 200))
    b = await wait_for(lambda: running_on(admin, namespace, "b"), what="b running")
    assert b["spec"]["nodeName"] == second
    await cordon(admin, first, False)
    budget = builders.MakePDB("keep-b", namespace).max_unavailable(0).match_labels({"app": "b"}).obj()
    await admin.create(paths.pod_disruption_budgets(namespace), budget)

    async def observed() -> bool:
        found = await admin.get(f"{paths.pod_disruption_budgets(namespace)}/keep-b")
        return bool((found.get("status") or {}).get("observedGeneration"))

    await wait_for(observed, what="the disruption controller to see the budget")
    await admin.create(paths.pods(namespace), gpu_pod("p", namespace))  # a whole GPU

    async def unschedulable() -> bool:
        pod = await admin.get(paths.pod(namespace, "p"))
        conditions = (pod.get("status") or {}).get("conditions") or []
        return any(c.get("reason") == "Unschedulable" for c in conditions)

    await wait_for(unschedulable, what="p found Unschedulable")

    # The dry run prints the plan and evicts nothing.
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sharegpu", "defrag", "--dry-run", "--kubeconfig",
         str(control_plane.kubeconfig("admin"))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    moves = [i for i, line in enumerate(lines) if line.startswith(f"{namespace}/p: to {first}")]
    assert len(moves) == 1, done.stdout
    (move,) = moves
    assert lines[move + 1].strip().startswith(f"{namespace}/{a['metadata']['name']} ({first} gpu0 300m, ReplicaSet/a)")
    assert lines[move + 1].endswith(f"-> fits on {second}")
    assert "gain" in lines[-1]
    still = await running_on(admin, namespace, "a")
    assert still is not None and still["metadata"]["uid"] == a["metadata"]["uid"], "the dry run evicted nothing"

    # The controller evicts `a` (not `b`: its budget forbids it); the ReplicaSet recreates it beside b.
    await defragmenter.start()

    async def placed() -> Json | None:
        pod = await admin.get(paths.pod(namespace, "p"))
        return pod if pod["spec"].get("nodeName") else None

    pod = await wait_for(placed, timeout=90, what="p scheduled")
    assert pod["spec"]["nodeName"] == first

    async def recreated() -> Json | None:
        found = await running_on(admin, namespace, "a")
        return found if found is not None and found["metadata"]["uid"] != a["metadata"]["uid"] else None

    again = await wait_for(recreated, what="a recreated and running")
    assert again["spec"]["nodeName"] == second
    kept = await running_on(admin, namespace, "b")
    assert kept is not None and kept["metadata"]["uid"] == b["metadata"]["uid"], "b (its budget forbids it) stayed"
    reconciler = defragmenter.defrag
    assert reconciler is not None and reconciler.counters.evictions == 1 and reconciler.counters.refused == 0
    listed = await admin.get(paths.events(namespace))
    reasons = {(e["reason"], e["involvedObject"]["name"]) for e in listed["items"]}
    assert ("DefragEvicted", a["metadata"]["name"]) in reasons and ("DefragMoved", "p") in reasons
