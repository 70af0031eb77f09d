"""The group reconciler over the fake API server: binding from the holder's reported UUIDs, the
hand-off only in namespaces the group admits, clean-up behind the finalizer."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sharegpu.api import groups, names, paths, resources, wire
from sharegpu.api import pods as api_pods
from sharegpu.controller import runtime
from sharegpu.core import units
from sharegpu.kube import client, fake
from sharegpu.kube import errors as kube_errors
from tests.builders import Clock, MakePod
from tests.controller.conftest import T0
from tests.extender.conftest import add_node, settle


@pytest.fixture
async def env() -> AsyncIterator[tuple[fake.FakeApiServer, runtime.Controller]]:
    server = fake.FakeApiServer()
    add_node(server, "n0", gpus=2)
    made = runtime.Controller(client.KubeClient(server), runtime.Options(leader_elect=False, tick=3600), Clock(T0))
    await made.start()
    yield server, made
    await made.stop()


def member(name: str, namespace: str, group: str) -> dict[str, object]:
    return MakePod(name, namespace).labels(groups.group_labels(*group.split("/"))).obj()


async def passes(controller: runtime.Controller, server: fake.FakeApiServer, count: int = 3) -> None:
    for _ in range(count):
        await settle(server)
        await controller.groups.reconcile()
    await settle(server)


async def test_a_group_binds_from_its_holder_and_admits_only_its_namespaces(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    server, controller = env
    body = {"metadata": {"name": "g", "namespace": "team"}, "spec": {"gpus": 2, "members": {"namespaces": ["friends"]}}}
    server.put_object(resources.SHARED_DEVICE_GROUP.path("team"), body)
    await passes(controller, server)
    holder_path = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "g"))
    assert server.get_object(holder_path) is None, "no member, not eager: no holder yet"
    for name, namespace in (("a", "team"), ("b", "friends"), ("c", "strangers")):
        server.put_object(paths.pods(namespace), member(name, namespace, "team/g"))
    await passes(controller, server)
    holder = server.get_object(holder_path)
    assert holder is not None and holder["spec"]["containers"][0]["resources"]["limits"][names.NVIDIA_GPU] == "2"
    # As kube-scheduler and the device plugin would: bound to n0, given both GPUs.
    device = server.get_object(paths.device("n0"))
    assert device is not None
    uuids = [g["uuid"] for g in device["spec"]["gpus"]]
    holder["spec"]["nodeName"] = "n0"
    holder["metadata"]["annotations"][names.GPU_UUID] = ",".join(reversed(uuids))
    await controller.api.replace(holder_path, holder)
    await passes(controller, server)
    stored = server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "g"))
    assert stored is not None
    group = wire.convert(stored, groups.SharedDeviceGroup)
    assert group.status.phase == "Bound" and group.status.node_name == "n0"
    assert [(d.index, d.uuid) for d in group.status.devices] == [(0, uuids[0]), (1, uuids[1])]
    assert group.status.member_pods == ["friends/b", "team/a"], "a label where the group does not admit makes no member"
    assert group.metadata.finalizers == [names.GROUP_FINALIZER]
    handoff = groups.handoff_name("team", "g")
    assert server.get_object(paths.configmap("team", handoff)) is not None
    assert server.get_object(paths.configmap("friends", handoff)) is not None
    assert server.get_object(paths.configmap("strangers", handoff)) is None
    node = server.get_object(paths.node("n0"))
    assert node is not None and node["metadata"]["labels"][groups.node_label("team", "g")] == "true"
    # Members gone, the group deleted: holder, label and ConfigMaps go, then the finalizer.
    for name, namespace in (("a", "team"), ("b", "friends"), ("c", "strangers")):
        server.remove_object(paths.pod(namespace, name))
    await controller.api.delete(resources.SHARED_DEVICE_GROUP.path("team", "g"))
    stored = server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "g"))
    assert stored is not None and stored["metadata"].get("deletionTimestamp")
    await passes(controller, server)
    assert server.get_object(holder_path) is None
    assert server.get_object(paths.configmap("team", handoff)) is None
    node = server.get_object(paths.node("n0"))
    assert node is not None and groups.node_label("team", "g") not in node["metadata"].get("labels", {})
    remaining = server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "g"))
    assert remaining is None or not remaining["metadata"].get("finalizers")


async def test_a_share_group_holds_a_share_of_each_gpu_and_hands_its_members_the_limits(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    server, controller = env
    body = {"metadata": {"name": "s", "namespace": "team"},
            "spec": {"gpus": 2, "share": {"milli": 300}, "bindEagerly": True}}  # fmt: skip
    server.put_object(resources.SHARED_DEVICE_GROUP.path("team"), body)
    await passes(controller, server)
    holder_path = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "s"))
    holder = server.get_object(holder_path)
    assert holder is not None, "bindEagerly: a holder at once"
    container = holder["spec"]["containers"][0]
    assert container["resources"]["limits"] == {
        names.GPU: "2",
        names.GPU_MILLI: "300",
        "cpu": "10m",
        "memory": "32Mi",
    }  # sharegpu's resources, no device-plugin GPU
    assert {"name": names.ROLE_ENV, "value": names.ROLE_GROUP_SHARE} in container["env"]
    annotations = holder["metadata"]["annotations"]
    assert annotations[names.MEMORY_PERMILLE] == "300"  # no memoryMiB: the same share of the memory
    source = annotations[names.HANDOFF]
    assert source == groups.holder_handoff_name("team", "s")
    # Bound by kube-scheduler and the extender, but no hand-off yet: not Bound.
    holder["spec"]["nodeName"] = "n0"
    await controller.api.replace(holder_path, holder)
    await passes(controller, server)
    stored = server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "s"))
    assert stored is not None
    waiting = wire.convert(stored, groups.SharedDeviceGroup).status
    assert waiting.phase == "Pending" and waiting.conditions[0].reason == "Starting"
    # The extender writes the holder's hand-off (its own format: per container, per device).
    device = server.get_object(paths.device("n0"))
    assert device is not None
    uuids = [g["uuid"] for g in device["spec"]["gpus"]]
    written = {
        "reserve.NVIDIA_VISIBLE_DEVICES": ",".join(uuids), "reserve.CUDA_DEVICE_SM_LIMIT": "30",
        "reserve.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "reserve.CUDA_DEVICE_MEMORY_LIMIT_0": "4915m",
        "reserve.CUDA_DEVICE_MEMORY_LIMIT_1": "4915m", "reserve.CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4915M,1=4915M",
    }  # fmt: skip
    server.put_object(paths.configmaps(names.HOLDING_NAMESPACE), {
        "metadata": {"name": source, "labels": {names.LABEL_ROLE: names.ROLE_HANDOFF}}, "data": written,
    })  # fmt: skip
    await passes(controller, server)
    stored = server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "s"))
    assert stored is not None
    group = wire.convert(stored, groups.SharedDeviceGroup)
    assert group.status.phase == "Bound" and [d.uuid for d in group.status.devices] == uuids
    assert group.status.conditions[0].message == "holds 300 milli-GPU and 30% of the memory of each of 2 GPU(s) of n0"
    handed = server.get_object(paths.configmap("team", groups.handoff_name("team", "s")))
    assert handed is not None and handed["data"] == {
        "NVIDIA_VISIBLE_DEVICES": ",".join(uuids), "CUDA_DEVICE_SM_LIMIT": "30",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_DEVICE_MEMORY_LIMIT": "4915m",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4915M,1=4915M",
    }  # fmt: skip


def test_a_share_holders_hand_off_becomes_one_set_of_member_variables() -> None:
    assert groups.member_handoff({}) is None
    assert groups.member_handoff({"other.NVIDIA_VISIBLE_DEVICES": "GPU-a"}) is None  # not the holder's container
    mixed = {"reserve.NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b", "reserve.CUDA_DEVICE_SM_LIMIT": "50",
             "reserve.CUDA_DEVICE_MEMORY_LIMIT_0": "12000m", "reserve.CUDA_DEVICE_MEMORY_LIMIT_1": "8000m"}  # fmt: skip
    # GPUs of two sizes on one node: every member limited to the smaller share (never beyond either).
    assert groups.member_handoff(mixed) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "CUDA_DEVICE_SM_LIMIT": "50",
        "CUDA_DEVICE_MEMORY_LIMIT": "8000m",
    }


async def test_a_group_handoff_a_tenant_wrote_is_taken_back_before_members_can_run(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    """The members' ConfigMap name is predictable: a tenant makes it first (immutable, every GPU in it)
    and later changes it. The controller replaces it whole before it labels the node (which lets
    members be scheduled), and again after the change, each time with a Warning event on the group."""
    server, controller = env
    handoff = groups.handoff_name("team", "g")
    path = paths.configmap("team", handoff)
    forged = {"metadata": {"name": handoff, "namespace": "team", "labels": {"mine": "yes"}},
              "data": {"NVIDIA_VISIBLE_DEVICES": "all", "EXTRA": "x"}, "immutable": True}  # fmt: skip
    await controller.api.create(paths.configmaps("team"), forged)
    server.put_object(resources.SHARED_DEVICE_GROUP.path("team"), {"metadata": {"name": "g", "namespace": "team"},
                                                                   "spec": {"gpus": 1}})  # fmt: skip
    server.put_object(paths.pods("team"), member("a", "team", "team/g"))
    await passes(controller, server)
    holder_path = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "g"))
    holder = server.get_object(holder_path)
    assert holder is not None
    device = server.get_object(paths.device("n0"))
    assert device is not None
    uuid = device["spec"]["gpus"][1]["uuid"]
    holder["spec"]["nodeName"] = "n0"
    holder["metadata"]["annotations"][names.GPU_UUID] = uuid
    await controller.api.replace(holder_path, holder)
    writes_before = len(server.requests)
    await passes(controller, server)
    stored = server.get_object(path)
    assert stored is not None and stored["data"] == {"NVIDIA_VISIBLE_DEVICES": uuid}
    assert "mine" not in stored["metadata"]["labels"] and not stored.get("immutable")
    order = [(m, p) for m, p in server.requests[writes_before:] if m != "GET"]
    handed = next(i for i, (m, p) in enumerate(order) if m == "POST" and p == paths.configmaps("team"))
    labelled = next(i for i, (m, p) in enumerate(order) if m == "PATCH" and p == paths.node("n0"))
    assert handed < labelled, "the hand-off is right before members can be scheduled"

    def alarms() -> list[str]:
        return sorted(o["message"] for k, o in server.objects.items()
                      if k[0] == "/api/v1|events" and o["reason"] == "HandoffForged")  # fmt: skip

    assert len(alarms()) == 1 and "written by someone other than sharegpu" in alarms()[0]
    await controller.api.patch(path, {"data": {"NVIDIA_VISIBLE_DEVICES": "all"}})
    await passes(controller, server)
    stored = server.get_object(path)
    assert stored is not None and stored["data"] == {"NVIDIA_VISIBLE_DEVICES": uuid}
    assert len(alarms()) == 2 and "changed after sharegpu wrote it" in " ".join(alarms())


async def bind_eagerly(server: fake.FakeApiServer, controller: runtime.Controller, namespace: str, name: str) -> None:
    """An eager group of both of n0's GPUs, its holder bound there as kube-scheduler and the device
    plugin would, and the passes that make it Bound."""
    body = {"metadata": {"name": name, "namespace": namespace}, "spec": {"gpus": 2, "bindEagerly": True}}
    server.put_object(resources.SHARED_DEVICE_GROUP.path(namespace), body)
    await passes(controller, server)
    holder_path = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name(namespace, name))
    holder, device = server.get_object(holder_path), server.get_object(paths.device("n0"))
    assert holder is not None and device is not None
    holder["spec"]["nodeName"] = "n0"
    holder["metadata"]["annotations"][names.GPU_UUID] = ",".join(g["uuid"] for g in device["spec"]["gpus"])
    await controller.api.replace(holder_path, holder)
    await passes(controller, server)


async def test_a_bound_groups_node_label_lost_by_hand_or_with_the_node_is_written_again(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    """Members select the label: a node that lost it (an admin removed it, or the node registered
    again after a repair) would keep them Pending while the group says Bound."""
    server, controller = env
    await bind_eagerly(server, controller, "team", "g")
    label = groups.node_label("team", "g")

    def labelled() -> bool:
        node = server.get_object(paths.node("n0"))
        return node is not None and node["metadata"].get("labels", {}).get(label) == groups.BOUND

    assert labelled()
    await controller.api.patch(paths.node("n0"), {"metadata": {"labels": {label: None}}})
    await passes(controller, server)
    assert labelled(), "removed by hand: written again"
    node = server.get_object(paths.node("n0"))
    assert node is not None
    server.remove_object(paths.node("n0"))
    del node["metadata"]["labels"][label]
    for field in ("resourceVersion", "uid", "creationTimestamp"):
        node["metadata"].pop(field, None)
    server.put_object(paths.NODES, node)
    await passes(controller, server)
    assert labelled(), "the node registered again without it: written again"


async def test_a_node_gone_for_a_while_does_not_make_the_controller_forget_its_group(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    """The 404 of the node's label patch is not the group's own: the group is still reconciled, and
    labels its node once it is back."""
    server, controller = env
    await bind_eagerly(server, controller, "team", "g")
    node = server.get_object(paths.node("n0"))
    assert node is not None
    server.remove_object(paths.node("n0"))
    await passes(controller, server)
    assert "team/g" in controller.groups.groups
    label = groups.node_label("team", "g")
    del node["metadata"]["labels"][label]
    for field in ("resourceVersion", "uid", "creationTimestamp"):
        node["metadata"].pop(field, None)
    server.put_object(paths.NODES, node)
    await passes(controller, server)
    back = server.get_object(paths.node("n0"))
    assert back is not None and back["metadata"]["labels"].get(label) == groups.BOUND


def _status(server: fake.FakeApiServer, namespace: str, name: str) -> groups.GroupStatus:
    stored = server.get_object(resources.SHARED_DEVICE_GROUP.path(namespace, name))
    assert stored is not None
    return wire.convert(stored, groups.SharedDeviceGroup).status


async def test_a_lost_holder_withholds_the_members_devices_until_its_replacement_holds_some(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    """The GPUs a lost holder held are free in the extender's ledger at once: a member starting in the
    gap must not be handed them (another pod may be placed there). Its hand-off is emptied (it waits:
    NVIDIA_VISIBLE_DEVICES is required) until the replacement, pinned to the node, reports its GPUs."""
    server, controller = env
    body = {"metadata": {"name": "g", "namespace": "team"}, "spec": {"gpus": 1, "bindEagerly": True}}
    server.put_object(resources.SHARED_DEVICE_GROUP.path("team"), body)
    await passes(controller, server)
    holder_path = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "g"))
    holder, device = server.get_object(holder_path), server.get_object(paths.device("n0"))
    assert holder is not None and device is not None
    first, second = (g["uuid"] for g in device["spec"]["gpus"])
    holder["spec"]["nodeName"] = "n0"
    holder["metadata"]["annotations"][names.GPU_UUID] = first
    await controller.api.replace(holder_path, holder)
    await passes(controller, server)
    handoff = paths.configmap("team", groups.handoff_name("team", "g"))

    def handed() -> dict[str, str]:
        stored = server.get_object(handoff)
        assert stored is not None
        return dict(stored.get("data") or {})

    assert handed() == {groups.VISIBLE_DEVICES: first}
    server.remove_object(holder_path)  # deleted by hand, evicted, its node's kubelet gave it up
    await passes(controller, server)
    status = _status(server, "team", "g")
    assert status.phase == "Bound" and status.node_name == "n0" and status.devices == []
    assert [(c.status, c.reason) for c in status.conditions] == [("False", "HolderLost")]
    assert handed() == {}, "a member starting now would run on a GPU nobody holds"
    reasons = {e["reason"]: e for e in server.list_objects(paths.events("team"))}
    assert reasons["HolderLost"]["type"] == "Warning"
    replacement = server.get_object(holder_path)
    assert replacement is not None
    pin = replacement["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert pin["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n0"]
    replacement["spec"]["nodeName"] = "n0"  # the device plugin gives it the other GPU
    await controller.api.replace(holder_path, replacement)
    await passes(controller, server)
    assert handed() == {}, "on the node but not reporting yet: still nothing"
    replacement = server.get_object(holder_path)
    assert replacement is not None
    replacement["metadata"]["annotations"][names.GPU_UUID] = second
    await controller.api.replace(holder_path, replacement)
    await passes(controller, server)
    assert handed() == {groups.VISIBLE_DEVICES: second}
    status = _status(server, "team", "g")
    assert [(d.index, d.uuid) for d in status.devices] == [(1, second)] and status.conditions[0].status == "True"


async def test_a_group_not_bound_yet_gets_a_holder_for_its_edited_placement(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    """A holder made for the old spec would bind with the old count (and never match the new one) or
    the old share: it is replaced. Once bound, the webhook refuses such edits."""
    server, controller = env
    body = {"metadata": {"name": "g", "namespace": "team"},
            "spec": {"gpus": 1, "bindEagerly": True, "nodeSelector": {"pool": "none"}}}  # fmt: skip
    server.put_object(resources.SHARED_DEVICE_GROUP.path("team"), body)
    await passes(controller, server)
    holder_path = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "g"))
    made = server.get_object(holder_path)
    assert made is not None and made["spec"]["nodeSelector"] == {"pool": "none"}
    await controller.api.patch(resources.SHARED_DEVICE_GROUP.path("team", "g"),
                               {"spec": {"gpus": 2, "nodeSelector": None}})  # fmt: skip
    await passes(controller, server, count=4)
    again = server.get_object(holder_path)
    assert again is not None and again["metadata"]["uid"] != made["metadata"]["uid"]
    assert again["spec"]["nodeSelector"] == {}
    assert again["spec"]["containers"][0]["resources"]["limits"][names.NVIDIA_GPU] == "2"
    # Members or bindEagerly edited: the holder stays.
    await controller.api.patch(resources.SHARED_DEVICE_GROUP.path("team", "g"),
                               {"spec": {"members": {"namespaces": ["friends"]}}})  # fmt: skip
    await passes(controller, server)
    kept = server.get_object(holder_path)
    assert kept is not None and kept["metadata"]["uid"] == again["metadata"]["uid"]


async def test_a_holder_is_not_evicted_while_members_run_on_its_gpus(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    """Its GPUs are free in the ledger the moment it goes, while members still run on them: a drain
    (the Eviction API) must wait for the members first."""
    server, controller = env
    await bind_eagerly(server, controller, "team", "g")
    holder_path = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "g"))
    guard_path = paths.pod_disruption_budget(names.HOLDING_NAMESPACE, groups.holder_name("team", "g"))
    await controller.api.patch(f"{holder_path}/status", {"status": {"phase": "Running"}})
    assert server.get_object(guard_path) is None, "no member runs: nothing to guard"
    worker = MakePod("w", "team").labels(groups.group_labels("team", "g")).node("n0").obj()
    server.put_object(paths.pods("team"), worker)
    await passes(controller, server)
    assert server.get_object(guard_path) is not None
    holder = server.get_object(holder_path)
    assert holder is not None
    eviction = api_pods.eviction(units.pod_key(names.HOLDING_NAMESPACE, holder["metadata"]["name"]),
                                 holder["metadata"]["uid"])  # fmt: skip
    with pytest.raises(kube_errors.BusyError):
        await controller.api.create(paths.eviction(names.HOLDING_NAMESPACE, holder["metadata"]["name"]), eviction)
    server.remove_object(paths.pod("team", "w"))
    await passes(controller, server)
    assert server.get_object(guard_path) is None, "no member runs any more: the holder may go"
    await controller.api.create(paths.eviction(names.HOLDING_NAMESPACE, holder["metadata"]["name"]), eviction)


def used_up(namespace: str, when_exhausted: str) -> dict[str, object]:
    """A GPUBudget of `namespace` whose period is used up."""
    return {
        "apiVersion": resources.GPU_BUDGET.api_version, "kind": resources.GPU_BUDGET.kind,
        "metadata": {"name": "b", "namespace": namespace},
        "spec": {"gpuHours": 1, "whenExhausted": when_exhausted, "periodStart": "2026-11-01T00:00:00Z"},
        "status": {"state": "Exhausted", "usedGPUSeconds": 7200, "periodEnd": "2026-12-01T00:00:00Z"},
    }  # fmt: skip


@pytest.mark.parametrize("when_exhausted", ["Deny", "Demote"])
async def test_a_group_takes_no_gpus_while_its_namespaces_budget_is_used_up(
    env: tuple[fake.FakeApiServer, runtime.Controller], when_exhausted: str
) -> None:
    """The holder is the controller's, at system-cluster-critical: no webhook judges it and no demotion
    applies, so a tenant whose budget was used up got GPUs through a group. Now no holder is made (one
    not placed yet is taken back), and the group says why; a group bound before keeps its GPUs."""
    server, controller = env
    await bind_eagerly(server, controller, "team", "kept")
    body = {"metadata": {"name": "g", "namespace": "team"}, "spec": {"gpus": 1}}
    server.put_object(resources.SHARED_DEVICE_GROUP.path("team"), body)
    server.put_object(paths.pods("team"), member("m", "team", "team/g"))
    await passes(controller, server)
    waiting = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "g"))
    assert server.get_object(waiting) is not None, "within the budget: its holder waits to be placed"
    server.put_object(resources.GPU_BUDGET.path("team"), used_up("team", when_exhausted))
    await passes(controller, server)
    assert server.get_object(waiting) is None, "not placed yet: taken back"
    (condition,) = _status(server, "team", "g").conditions
    assert (condition.status, condition.reason) == ("False", "BudgetExhausted") and "used up" in condition.message
    told = [e for e in server.list_objects("/api/v1/events") if e["reason"] == "BudgetExhausted"]
    assert len(told) == 1 and told[0]["type"] == "Warning"
    kept = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "kept"))
    assert server.get_object(kept) is not None and _status(server, "team", "kept").devices, "bound: kept"
    await controller.api.delete(resources.GPU_BUDGET.path("team", "b"))
    await passes(controller, server)
    assert server.get_object(waiting) is not None, "the budget gone: the holder is made again"
