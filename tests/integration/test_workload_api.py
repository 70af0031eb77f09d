"""Kubernetes' own gangs (the Workload API: GenericWorkload, beta and off by default in 1.37) with
sharegpu: a control plane of its own with the gate and scheduling.k8s.io/v1beta1 on. The facts found
here are in docs/gangs.md: the version that serves PodGroup, the Pod field that names it, and how
kube-scheduler's gang scheduling and sharegpu's compose (both hold the gang; neither binds a part)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sharegpu.api import names, podgroups
from sharegpu.core import devices
from sharegpu.devcluster import controlplane, stack
from tests import builders
from tests.integration.conftest import refusal, wait_for

Json = dict[str, Any]
NAMESPACE = "training"
pytestmark = pytest.mark.skipif(
    tuple(int(p) for p in controlplane.k8s_version().split(".")[:2]) < (1, 37),
    reason="PodGroup is served at scheduling.k8s.io/v1beta1 from Kubernetes 1.37",
)


@pytest.fixture(scope="module")
async def workload(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[stack.Stack]:
    whole = stack.Stack(
        Path(tmp_path_factory.mktemp("workload")),
        webhook=True,
        feature_gates=("GenericWorkload=true",),
        runtime_config=("scheduling.k8s.io/v1beta1=true",),
    )
    await whole.start()
    assert whole.harness is not None and whole.admin is not None
    await whole.harness.add_nodes(
        [
            devices.uniform_node(
                f"gpu-{i}", gpu_count=2, model="T4", gpu_memory_mib=16384, cpu_milli=32000, memory_mib=131072
            )
            for i in range(2)
        ]
    )
    await whole.admin.create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
    yield whole
    await whole.stop()


def member(name: str, group: str) -> Json:
    limits = builders.gpu_limits(count=1, milli=600)
    pod = builders.MakePod(name, NAMESPACE).grace(0).spec(schedulingGroup={"podGroupName": group})
    return pod.container(image="busybox", limits=limits, requests=limits).obj()


async def test_kubernetes_podgroups_gang_on_sharegpu_gpus(workload: stack.Stack) -> None:
    kube = workload.admin
    assert kube is not None
    fmt = podgroups.KUBERNETES
    group = {
        "apiVersion": fmt.api_version, "kind": "PodGroup", "metadata": {"name": "train"},
        "spec": {"schedulingPolicy": {"gang": {"minCount": 3}}},
    }  # fmt: skip
    await kube.create(f"/apis/{fmt.group}/{fmt.version}/namespaces/{NAMESPACE}/podgroups", group)
    pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
    made = [await kube.create(pods, member(f"w-{i}", "train")) for i in range(2)]
    stored = made[0]
    assert stored["spec"]["schedulingGroup"] == {"podGroupName": "train"}, "1.37 keeps the field with the gate on"
    assert stored["spec"]["schedulerName"] == names.SCHEDULER_NAME
    annotations = stored["metadata"]["annotations"]
    assert (annotations[names.GANG], annotations[names.GANG_MIN]) == ("train", "3")
    await asyncio.sleep(3)
    for pod in made:
        got = await kube.get(f"{pods}/{pod['metadata']['name']}")
        assert not got["spec"].get("nodeName"), "two of three: none bound"
    # kube-scheduler's own gang scheduling holds the pods before their scheduling cycle (PreEnqueue):
    # never tried, so no PodScheduled condition, and sharegpu's extender is not asked about them
    assert await refusal(kube, NAMESPACE, "w-0") is None
    await kube.create(pods, member("w-2", "train"))

    async def whole() -> list[str] | None:
        items = [await kube.get(f"{pods}/w-{i}") for i in range(3)]
        found = [p["spec"].get("nodeName") or "" for p in items]
        return found if all(found) else None

    placed = await wait_for(whole, what="the gang of three bound")
    assert sorted(placed).count(placed[0]) in (1, 2) and len(set(placed)) == 2, placed
