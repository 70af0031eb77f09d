"""Idle shares on the real control plane: a node agent (its own RBAC, on a fake NVML) reports what
three sharing pods use; the controller (its own RBAC) evicts the one idle past its namespace's
GPUIdlePolicy through the Eviction API, leaves the busy one alone, and is refused for the one a
PodDisruptionBudget guards (the refusal told in an event)."""

from __future__ import annotations

import uuid
from pathlib import Path

from sharegpu.agent import runtime as agent_runtime
from sharegpu.api import idle, paths, resources, wire
from sharegpu.controller import idle as controller_idle
from sharegpu.controller import runtime
from sharegpu.devcluster import controlplane
from sharegpu.kube import client
from tests.builders import MakeAllocation, MakeNode, MakePod, nvml_with, pod_process, write_nvml
from tests.integration.conftest import Json, agent_on, get_or_none, leaving, wait_for

PDBS = "/apis/policy/v1/namespaces/{}/poddisruptionbudgets"


async def reasons(kube: client.KubeClient, namespace: str, name: str) -> set[str]:
    found, _ = await kube.list_all(paths.events(namespace))
    return {e["reason"] for e in found if e["involvedObject"]["name"] == name}


async def test_an_idle_share_is_evicted_a_busy_one_kept_and_a_guarded_one_refused(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    controller: runtime.Controller,
    namespace: str,
    tmp_path: Path,
) -> None:
    name = f"idle-{uuid.uuid4().hex[:8]}"
    await admin.create(paths.NODES, MakeNode(name).obj())
    proc = tmp_path / "proc"
    processes = []
    for index, (pod, sm) in enumerate((("lazy", 0), ("busy", 60), ("guarded", 0))):
        placed = MakeAllocation(f"{namespace}/{pod}", name).grant(index, 300, 4096).obj()
        made = MakePod(pod, namespace).labels({"app": pod}).allocation(placed).node(name).container(image="busybox")
        stored = await admin.create(paths.pods(namespace), made.obj())
        # Running and ready, as the kubelet reports it (the Eviction API ignores disruption budgets for
        # pods still Pending).
        ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        await admin.patch(paths.pod_status(namespace, pod), {"status": ready})
        pid = 4240 + index
        pod_process(proc, pid, stored["metadata"]["uid"])
        processes.append(f"{{pid: {pid}, gpu: {index}, usedMiB: 1000, smPercent: {sm}}}")
    pdb: Json = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "guard", "namespace": namespace},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
    }  # fmt: skip
    await admin.create(PDBS.format(namespace), pdb)
    rule: Json = {
        "apiVersion": resources.GPU_IDLE_POLICY.api_version, "kind": "GPUIdlePolicy",
        "metadata": {"name": "reclaim", "namespace": namespace},
        "spec": {"idleAfterSeconds": 2, "idleAtMostPercent": 1, "action": "Evict"},
    }  # fmt: skip
    await admin.create(resources.GPU_IDLE_POLICY.path(namespace), rule)
    path = tmp_path / "nvml.yaml"
    write_nvml(path, nvml_with(*processes))
    options = agent_runtime.Options(interval=0.3, proc=proc, usage_interval=0.3, usage_refresh=1.0)
    try:
        async with agent_on(control_plane, name, path, options):
            await wait_for(lambda: leaving(admin, namespace, "lazy"), timeout=60, what="the idle pod evicted")
            assert {controller_idle.IDLE, controller_idle.EVICTED} <= await reasons(admin, namespace, "lazy")

            async def blocked() -> bool:
                return controller_idle.BLOCKED in await reasons(admin, namespace, "guarded")

            await wait_for(blocked, timeout=30, what="the guarded pod's eviction refused and told")
            assert not await leaving(admin, namespace, "guarded"), "its disruption budget keeps it"
            assert not await leaving(admin, namespace, "busy") and await reasons(admin, namespace, "busy") == set()

            async def counted() -> idle.IdleStatus | None:
                found = await admin.get(resources.GPU_IDLE_POLICY.path(namespace, "reclaim"))
                status = wire.convert(found, idle.GPUIdlePolicy).status
                return status if status.in_force and status.evictions == 1 else None

            status = await wait_for(counted, what="the policy's status counting the eviction")
            assert [p.name for p in status.idle] == ["guarded"], "the one still idle"
    finally:
        await admin.delete(paths.node(name))
        if await get_or_none(admin, paths.gpu_usage(name)) is not None:
            await admin.delete(paths.gpu_usage(name))
