"""One ledger across both paths, on the real control plane: a DRA claim of sharegpu's driver that
someone else allocated (here the admin, as kube-scheduler's DRA allocator would) holds its share of
the GPU in the extender's ledger, so a sharing pod is never given what the claim holds, and gets it
once the claim goes. Kubernetes 1.34 and later (resource.k8s.io/v1)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from sharegpu.api import dra, names, paths
from sharegpu.devcluster import controlplane
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.integration.conftest import Json, all_bound, gpu_pod, refusal, wait_for


async def allocated_claim(admin: client.KubeClient, namespace: str, node: str, milli: int, memory: str) -> Json:
    """A claim of the driver's, allocated on GPU 0 of `node` by someone other than sharegpu."""
    request = {"name": "gpu", "exactly": {"deviceClassName": dra.DRIVER}}
    body = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaim", "metadata": {"name": "held"},
            "spec": {"devices": {"requests": [request]}}}  # fmt: skip
    made = await admin.create(dra.claim_path(namespace), body)
    consumed = {dra.MILLI: str(milli), dra.MEMORY: memory}
    result = {"request": "gpu", "driver": dra.DRIVER, "pool": node, "device": dra.device_name(0),
              "shareID": str(uuid.uuid4()), "consumedCapacity": consumed}  # fmt: skip
    selector = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}
    status = {"allocation": {"devices": {"results": [result]}, "nodeSelector": selector}}
    return await admin.replace(f"{dra.claim_path(namespace)}/held/status", {**made, "status": status})


async def test_a_claim_allocated_elsewhere_holds_its_share_in_the_extenders_ledger(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
) -> None:
    if tuple(int(p) for p in control_plane.version.split(".")[:2]) < (1, 34):
        pytest.skip("resource.k8s.io/v1 is served from Kubernetes 1.34")
    (node,) = await nodes(1, gpus=1)
    kept = await allocated_claim(admin, namespace, node, 700, "8Gi")
    assert kept["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] == {
        "milli": "700",
        "memory": "8Gi",
    }
    await admin.create(paths.pods(namespace), gpu_pod("big", namespace, milli=500))

    async def turned_away() -> str | None:
        return await refusal(admin, namespace, "big")

    reason = await wait_for(turned_away, what="the 500-milli pod turned away")
    assert "no GPU with 500 milli-GPU free (largest free: 300)" in reason, reason
    await admin.create(paths.pods(namespace), gpu_pod("small", namespace, milli=300))
    [small] = await wait_for(lambda: all_bound(admin, namespace, 1), what="the 300-milli pod bound")
    assert small["metadata"]["name"] == "small" and small["spec"]["nodeName"] == node
    assert '"index":0' in small["metadata"]["annotations"][names.ALLOCATION].replace(" ", "")

    await admin.delete(f"{dra.claim_path(namespace)}/held")
    await admin.delete(paths.pod(namespace, "small"), grace_period=0)
    bound = await wait_for(lambda: all_bound(admin, namespace, 1), timeout=90, what="the 500-milli pod bound")
    assert bound[0]["metadata"]["name"] == "big"
