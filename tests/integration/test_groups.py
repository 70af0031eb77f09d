"""SharedDeviceGroups on the real control plane, with the webhook registered and the controller
running: a group of 2 GPUs binds where its nodeSelector says when its first member arrives, holds its
GPUs through its holder pod (no other group or pod can take them), its 3 members run on its node
with the same device list, deleting it with members is refused, and once they are gone it goes with
its holder pod, node label and hand-off ConfigMaps, freeing its GPUs for the next group."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from sharegpu.api import groups, names, paths, resources
from sharegpu.api import pods as api_pods
from sharegpu.controller import runtime
from sharegpu.core import units
from sharegpu.devcluster import fakecluster, stack
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from tests.builders import MakePod
from tests.integration.conftest import (
    RunningWebhook,
    bound_with,
    get_or_none,
    gpu_pod,
    group_body,
    group_of,
    wait_for,
)

Json = dict[str, Any]


def member(name: str, namespace: str, group: str) -> Json:
    """A pod joining `group` (sharegpu's annotation), as a member asks for its devices."""
    made = MakePod(name, namespace).annotations({names.DEVICE_GROUP_ANNOTATION: group}).grace(0)
    return made.container(image="busybox", env={"NVIDIA_VISIBLE_DEVICES": "all"}).obj()


async def webhook_knows(hook: RunningWebhook, namespace: str, name: str) -> None:
    async def known() -> bool:
        return f"{namespace}/{name}" in hook.policy.groups

    await wait_for(known, what=f"the webhook to know group {name}")


async def members_running(kube: client.KubeClient, namespace: str, count: int) -> list[Json]:
    """The member pods m0..m<count-1>, once all of them run."""

    async def running() -> list[Json] | None:
        listed = [await kube.get(paths.pod(namespace, f"m{i}")) for i in range(count)]
        return listed if all(p["status"].get("phase") == "Running" for p in listed) else None

    found: list[Json] = await wait_for(running, what="the members running")
    return found


async def without_members(kube: client.KubeClient, namespace: str, name: str) -> None:
    async def empty() -> bool:
        found = await group_of(kube, namespace, name)
        return found is not None and found.status.member_pods == []

    await wait_for(empty, what=f"group {name} without members")


async def test_a_group_binds_holds_its_gpus_for_its_members_and_goes_only_without_them(
    admin: client.KubeClient,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    nodes: Any,
    webhook: RunningWebhook,
    controller: runtime.Controller,
) -> None:
    made = await nodes(2, gpus=2)
    target = made[1]
    await admin.patch(paths.node(target), {"metadata": {"labels": {"pool": "a"}}})
    test_nodes = {"sharegpu.io/test": namespace}
    pool = {**test_nodes, "pool": "a"}
    await admin.create(resources.SHARED_DEVICE_GROUP.path(namespace), group_body("a", namespace, 2, pool))

    await webhook_knows(webhook, namespace, "a")
    unbound = await group_of(admin, namespace, "a")
    assert unbound is not None and unbound.status.phase == "Pending"  # binds when its first member arrives
    for i in range(3):
        await admin.create(paths.pods(namespace), member(f"m{i}", namespace, "a"))

    group = await bound_with(admin, namespace, "a", 3)
    assert group.status.node_name == target
    assert [d.index for d in group.status.devices] == [0, 1]
    uuids = ",".join(d.uuid for d in group.status.devices)
    assert group.metadata.finalizers == [names.GROUP_FINALIZER]
    assert group.status.conditions[0].type == "Bound" and group.status.conditions[0].status == "True"

    running = await members_running(admin, namespace, 3)
    handoff = await admin.get(paths.configmap(namespace, groups.handoff_name(namespace, "a")))
    assert handoff["data"] == {"NVIDIA_VISIBLE_DEVICES": uuids}
    for pod in running:
        assert pod["spec"]["nodeName"] == target
        env = pod["spec"]["containers"][0]["env"]
        assert env[0] == {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {
            "name": groups.handoff_name(namespace, "a"), "key": "NVIDIA_VISIBLE_DEVICES"}}}  # fmt: skip
        assert [e["name"] for e in env[1:]] == list(groups.LIMITS)  # optional: a whole-GPU group sets none
    node = await admin.get(paths.node(target))
    assert node["metadata"]["labels"][groups.node_label(namespace, "a")] == "true"
    await _edits_of_a_bound_group(admin, namespace, target)
    # While members run there, the holder may not be evicted (a drain waits for them first).
    holder_name = groups.holder_name(namespace, "a")
    guard = paths.pod_disruption_budget(names.HOLDING_NAMESPACE, holder_name)
    await wait_for(functools.partial(get_or_none, admin, guard), what="the holder's disruption budget")
    holder = await admin.get(paths.pod(names.HOLDING_NAMESPACE, holder_name))
    with pytest.raises(kube_errors.BusyError):
        await admin.create(paths.eviction(names.HOLDING_NAMESPACE, holder_name), api_pods.eviction(
            units.pod_key(names.HOLDING_NAMESPACE, holder_name), holder["metadata"]["uid"]))  # fmt: skip

    # The group's GPUs are nobody else's: a second group on that node and a sharing pod there wait.
    await admin.create(
        resources.SHARED_DEVICE_GROUP.path(namespace), group_body("b", namespace, 2, pool, bindEagerly=True)
    )
    sharing = gpu_pod("sharing", namespace, milli=100)
    sharing["spec"]["nodeSelector"] = pool
    await admin.create(paths.pods(namespace), sharing)

    async def b_unschedulable() -> groups.SharedDeviceGroup | None:
        found = await group_of(admin, namespace, "b")
        ok = found is not None and found.status.conditions and found.status.conditions[0].reason == "Unschedulable"
        return found if ok else None

    b = await wait_for(b_unschedulable, what="group b to wait for GPUs")
    assert b.status.phase == "Pending"
    assert (await admin.get(paths.pod(namespace, "sharing")))["spec"].get("nodeName") is None
    # Gone before the GPUs are free: else it races group b for them (a share of one keeps b off the node).
    await admin.delete(paths.pod(namespace, "sharing"), grace_period=0)

    # Deleting a group with members is refused, naming them.
    with pytest.raises(kube_errors.KubeError) as refused:
        await admin.delete(resources.SHARED_DEVICE_GROUP.path(namespace, "a"), missing_ok=False)
    message = str(refused.value)
    assert "still has 3 member pod(s)" in message and f"{namespace}/m0" in message

    # The members go; then the group can go, and takes its holder, label and ConfigMap with it.
    for i in range(3):
        await admin.delete(paths.pod(namespace, f"m{i}"), grace_period=0)

    await without_members(admin, namespace, "a")

    async def unguarded() -> bool:
        return await get_or_none(admin, guard) is None

    await wait_for(unguarded, what="the holder's disruption budget gone with the members")
    await admin.delete(resources.SHARED_DEVICE_GROUP.path(namespace, "a"), missing_ok=False)

    async def a_gone() -> bool:
        return await group_of(admin, namespace, "a") is None

    await wait_for(a_gone, what="group a deleted")
    assert await get_or_none(admin, paths.pod(names.HOLDING_NAMESPACE, holder_name)) is None
    assert await get_or_none(admin, paths.configmap(namespace, groups.handoff_name(namespace, "a"))) is None
    node = await admin.get(paths.node(target))
    assert groups.node_label(namespace, "a") not in node["metadata"]["labels"]

    # Its GPUs are free again: group b (eager) binds there.
    async def b_bound() -> groups.SharedDeviceGroup | None:
        found = await group_of(admin, namespace, "b")
        return found if found is not None and found.status.phase == "Bound" else None

    b = await wait_for(b_bound, what="group b bound")
    assert b.status.node_name == target
    await admin.delete(resources.SHARED_DEVICE_GROUP.path(namespace, "b"))
    await wait_for(functools.partial(_gone, admin, namespace, "b"), what="group b deleted")


async def _edits_of_a_bound_group(admin: client.KubeClient, namespace: str, target: str) -> None:
    """Group a, bound on `target` with members m0..m2: its placement cannot change (its holder and
    members run with it), and a namespace leaves it only once no member runs there."""
    path = resources.SHARED_DEVICE_GROUP.path(namespace, "a")
    with pytest.raises(kube_errors.KubeError) as edited:
        await admin.patch(path, {"spec": {"gpus": 1, "share": {"milli": 500}}})
    assert f"is bound to node {target}; spec gpus, share cannot change while it is bound" in str(edited.value)
    friends = f"{namespace}-f"
    await admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": friends}})
    try:
        await admin.patch(path, {"spec": {"members": {"namespaces": [friends]}}})
        await admin.create(paths.pods(friends), member("guest", friends, f"{namespace}/a"))

        async def guest_counted() -> bool:
            found = await group_of(admin, namespace, "a")
            return found is not None and f"{friends}/guest" in found.status.member_pods

        await wait_for(guest_counted, what="the guest counted as a member")
        with pytest.raises(kube_errors.KubeError) as left:
            await admin.patch(path, {"spec": {"members": {"namespaces": []}}})
        assert f"namespace(s) {friends} cannot leave spec.members.namespaces" in str(left.value)
        assert f"1 in namespace {friends}" in str(left.value), "counted: another namespace's pods are not named"
        assert "guest" not in str(left.value)
        await admin.delete(paths.pod(friends, "guest"), grace_period=0)

        async def guest_gone() -> bool:
            return await get_or_none(admin, paths.pod(friends, "guest")) is None

        await wait_for(guest_gone, what="the guest gone")
        await admin.patch(path, {"spec": {"members": {"namespaces": []}}})
    finally:
        await admin.delete(f"/api/v1/namespaces/{friends}")


async def _gone(kube: client.KubeClient, namespace: str, name: str) -> bool:
    return await group_of(kube, namespace, name) is None


async def test_binpack_and_spread_decide_a_groups_node(
    admin: client.KubeClient,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    nodes: Any,
    controller: runtime.Controller,
) -> None:
    """Eager groups of one GPU on two 4-GPU nodes, one of them half used: binpack binds to the fuller
    node, spread to the emptier one."""
    made = await nodes(2, gpus=4)
    busy = gpu_pod("busy", namespace, nvidia=2)
    await admin.create(paths.pods(namespace), busy)

    async def busy_node() -> str | None:
        found = (await admin.get(paths.pod(namespace, "busy")))["spec"].get("nodeName")
        return str(found) if found else None

    fuller = await wait_for(busy_node, what="the busy pod placed")
    emptier = next(n for n in made if n != fuller)
    test_nodes = {"sharegpu.io/test": namespace}
    for name, strategy in (("packed", "binpack"), ("spread", "spread")):
        body = group_body(name, namespace, 1, test_nodes, bindEagerly=True, schedulingStrategy=strategy)
        await admin.create(resources.SHARED_DEVICE_GROUP.path(namespace), body)

        async def bound(name: str = name) -> groups.SharedDeviceGroup | None:
            found = await group_of(admin, namespace, name)
            return found if found is not None and found.status.phase == "Bound" else None

        group = await wait_for(bound, what=f"group {name} bound")
        assert group.status.node_name == (fuller if strategy == "binpack" else emptier), strategy
    for name in ("packed", "spread"):
        await admin.delete(resources.SHARED_DEVICE_GROUP.path(namespace, name))
        await wait_for(functools.partial(_gone, admin, namespace, name), what=f"group {name} deleted")


async def test_a_share_group_holds_a_share_of_its_gpu_and_its_members_run_within_it(
    admin: client.KubeClient,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    nodes: Any,
    webhook: RunningWebhook,
    controller: runtime.Controller,
) -> None:
    """A group of 400 milli-GPU and 4096 MiB of one GPU: its two members run on its node with the
    group's GPU and its limits; a 600-milli pod still fits beside it on that GPU, one more does not
    until the group is gone."""
    await nodes(1, gpus=1, memory=16384)
    test_nodes = {"sharegpu.io/test": namespace}
    share = {"milli": 400, "memoryMiB": 4096}
    await admin.create(resources.SHARED_DEVICE_GROUP.path(namespace), group_body("s", namespace, 1, test_nodes,
                                                                                 share=share))  # fmt: skip

    await webhook_knows(webhook, namespace, "s")
    for i in range(2):
        await admin.create(paths.pods(namespace), member(f"m{i}", namespace, "s"))

    group = await bound_with(admin, namespace, "s", 2)
    assert len(group.status.devices) == 1
    assert group.status.conditions[0].message.startswith("holds 400 milli-GPU and 4096 MiB of each of 1 GPU(s)")
    holder = await admin.get(paths.pod(names.HOLDING_NAMESPACE, groups.holder_name(namespace, "s")))
    assert names.NVIDIA_GPU not in holder["spec"]["containers"][0]["resources"]["limits"]
    assert holder["metadata"]["annotations"][names.ALLOCATION]  # placed by the extender like a sharing pod

    running = await members_running(admin, namespace, 2)
    assert {p["spec"]["nodeName"] for p in running} == {group.status.node_name}
    handoff = await admin.get(paths.configmap(namespace, groups.handoff_name(namespace, "s")))
    assert handoff["data"] == {
        "NVIDIA_VISIBLE_DEVICES": group.status.devices[0].uuid,
        "CUDA_DEVICE_SM_LIMIT": "40",
        "CUDA_DEVICE_MEMORY_LIMIT": "4096m",
    }, "the node offers HAMi-core, not MPS: its limits only"

    # The rest of the GPU is for others: 600 milli fits beside the group, 100 more does not.
    for name, milli in (("beside", 600), ("more", 100)):
        pod = gpu_pod(name, namespace, milli=milli)
        pod["spec"]["nodeSelector"] = test_nodes
        await admin.create(paths.pods(namespace), pod)

    async def beside_running() -> bool:
        found = await admin.get(paths.pod(namespace, "beside"))
        return bool(found["status"].get("phase") == "Running")

    await wait_for(beside_running, what="the 600-milli pod running beside the group")

    async def more_refused() -> Json | None:
        found = await admin.get(paths.pod(namespace, "more"))
        conditions = (found.get("status") or {}).get("conditions") or []
        refused = any(c["type"] == "PodScheduled" and c["status"] == "False" for c in conditions)
        return found if refused else None

    more = await wait_for(more_refused, what="the 100-milli pod found no room")
    assert more["spec"].get("nodeName") is None

    # Members gone, group deleted: its share is freed and the waiting pod runs.
    for i in range(2):
        await admin.delete(paths.pod(namespace, f"m{i}"), grace_period=0)

    await without_members(admin, namespace, "s")
    await admin.delete(resources.SHARED_DEVICE_GROUP.path(namespace, "s"))
    await wait_for(functools.partial(_gone, admin, namespace, "s"), what="the group deleted")

    async def more_placed() -> bool:
        found = await admin.get(paths.pod(namespace, "more"))
        return bool(found["spec"].get("nodeName"))

    await wait_for(more_placed, what="the waiting pod placed on the freed share")
