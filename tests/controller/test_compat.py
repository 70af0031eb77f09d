"""The compatibility reconcilers over the fake API server: deviceshare.io groups mirrored into
sharegpu's (spec one way, status the other, refusals named, mirrors removed with their original),
and KubeShare's SharePods run as Pods (made once, owned, status mirrored, removed with the SharePod,
remade when lost, a foreign Pod of the same name left alone)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sharegpu.api import deviceshare, groups, names, paths, resources, sharepods, wire
from sharegpu.controller import runtime
from sharegpu.core import errors, units
from sharegpu.kube import client, fake
from tests.builders import Clock, MakeAllocation
from tests.controller.conftest import T0
from tests.extender.conftest import add_node, settle

Json = dict[str, Any]


@pytest.fixture
async def env() -> AsyncIterator[tuple[fake.FakeApiServer, runtime.Controller]]:
    server = fake.FakeApiServer()
    add_node(server, "n0", gpus=2)
    options = runtime.Options(leader_elect=False, tick=3600, compat=frozenset({"deviceshare", "kubeshare"}))
    made = runtime.Controller(client.KubeClient(server), options, Clock(T0))
    await made.start()
    yield server, made
    await made.stop()


async def passes(controller: runtime.Controller, server: fake.FakeApiServer, count: int = 3) -> None:
    for _ in range(count):
        await settle(server)
        for loop in controller.loops():
            await loop.reconcile()
    await settle(server)


def events(server: fake.FakeApiServer, namespace: str) -> list[tuple[str, str]]:
    return sorted((e["reason"], e["message"]) for e in server.list_objects(paths.events(namespace)))


# ----------------------------------------------------------------- deviceshare.io


def source(name: str, resources_: Json, **spec: Any) -> Json:
    return {
        "apiVersion": resources.DEVICESHARE_GROUP.api_version,
        "kind": "SharedDeviceGroup",
        "metadata": {"name": name, "namespace": "team"},
        "spec": {"resources": resources_, **spec},
    }


def test_the_project_spec_becomes_sharegpus_and_bad_specs_are_named() -> None:
    ok = wire.convert(source("g", {"nvidia.com/gpu": "2"}, schedulingStrategy="spread",
                                  nodeSelector={"pool": "a"}), deviceshare.DeviceShareGroup)  # fmt: skip
    assert deviceshare.mirror_spec(ok) == groups.GroupSpec(
        gpus=2, scheduling_strategy="spread", node_selector={"pool": "a"}
    )
    for resources_, wording in (
        ({"nvidia.com/gpu": 2, "cpu": 1}, "only nvidia.com/gpu can be held by a group, got cpu"),
        ({}, "nvidia.com/gpu (how many GPUs) is required"),
        ({"nvidia.com/gpu": "0.5"}, "must be an integer in 1..64"),
        ({"nvidia.com/gpu": 65}, "must be an integer in 1..64"),
    ):
        bad = wire.convert(source("g", resources_), deviceshare.DeviceShareGroup)
        with pytest.raises(errors.InvalidRequestError, match=re.escape(wording)):
            deviceshare.mirror_spec(bad)


def test_a_pod_joins_with_either_annotation_but_not_two_different_groups() -> None:
    assert groups.membership({"deviceshare.io/group": "g"}, "team") == ("team", "g")
    both = {"deviceshare.io/group": "g", names.DEVICE_GROUP_ANNOTATION: "team/g"}
    assert groups.membership(both, "team") == ("team", "g")
    with pytest.raises(errors.InvalidRequestError, match="name different groups"):
        groups.membership({"deviceshare.io/group": "g", names.DEVICE_GROUP_ANNOTATION: "h"}, "team")
    with pytest.raises(errors.InvalidRequestError, match="in the pod's namespace"):
        groups.membership({"deviceshare.io/group": "other/g"}, "team")


async def test_a_deviceshare_group_is_mirrored_both_ways_and_its_mirror_goes_with_it(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    server, controller = env
    stored = server.put_object(resources.DEVICESHARE_GROUP.path("team"), source("g", {"nvidia.com/gpu": 2}))
    await passes(controller, server)
    mirror = server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "g"))
    assert mirror is not None
    assert wire.convert(mirror["spec"], groups.GroupSpec) == groups.GroupSpec(gpus=2, scheduling_strategy="binpack")
    assert mirror["metadata"]["labels"] == {deviceshare.LABEL_MIRROR: "deviceshare.io"}
    assert mirror["metadata"]["ownerReferences"] == [{
        "apiVersion": "deviceshare.io/v1alpha1", "kind": "SharedDeviceGroup", "name": "g",
        "uid": stored["metadata"]["uid"], "controller": True,
    }]  # fmt: skip
    # The group reconciler binds the mirror (as in tests/controller/test_groups.py); its status comes back.
    for name in ("m0", "m1"):
        labels = groups.group_labels("team", "g")
        server.put_object(paths.pods("team"), {"metadata": {"name": name, "namespace": "team", "labels": labels},
                                               "spec": {"containers": [{"name": "main"}]}})  # fmt: skip
    await passes(controller, server)
    holder_path = paths.pod(names.HOLDING_NAMESPACE, groups.holder_name("team", "g"))
    holder = server.get_object(holder_path)
    device = server.get_object(paths.device("n0"))
    assert holder is not None and device is not None
    holder["spec"]["nodeName"] = "n0"  # as kube-scheduler and the device plugin would
    holder["metadata"]["annotations"][names.GPU_UUID] = ",".join(g["uuid"] for g in device["spec"]["gpus"])
    await controller.api.replace(holder_path, holder)
    await passes(controller, server)
    back = server.get_object(resources.DEVICESHARE_GROUP.path("team", "g"))
    assert back is not None
    assert back["status"] == {
        "phase": "Bound", "nodeName": "n0", "selectedDevices": {"nvidia.com/gpu": "0,1"},
        "allocatedPods": ["m0", "m1"], "mirror": "sharegpu.io/team/g", "message": "holds 2 GPU(s) of n0",
    }  # fmt: skip
    assert ("Mirrored", "served by sharegpu.io/v1alpha1 SharedDeviceGroup team/g") in events(server, "team")
    # The original goes: so does its mirror.
    server.remove_object(resources.DEVICESHARE_GROUP.path("team", "g"))
    await passes(controller, server)
    gone = server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "g"))
    assert gone is None or gone["metadata"].get("deletionTimestamp")


async def test_a_bad_or_clashing_deviceshare_group_fails_with_the_reason_and_touches_nothing(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    server, controller = env
    server.put_object(resources.DEVICESHARE_GROUP.path("team"), source("bad", {"nvidia.com/gpu": 2, "cpu": 1}))
    own = {"metadata": {"name": "taken", "namespace": "team"}, "spec": {"gpus": 1}}
    server.put_object(resources.SHARED_DEVICE_GROUP.path("team"), own)
    server.put_object(resources.DEVICESHARE_GROUP.path("team"), source("taken", {"nvidia.com/gpu": 1}))
    await passes(controller, server)
    bad = server.get_object(resources.DEVICESHARE_GROUP.path("team", "bad"))
    assert bad is not None and bad["status"]["phase"] == "Failed"
    assert "only nvidia.com/gpu can be held by a group, got cpu" in bad["status"]["message"]
    assert server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "bad")) is None
    taken = server.get_object(resources.DEVICESHARE_GROUP.path("team", "taken"))
    assert taken is not None and taken["status"]["phase"] == "Failed"
    assert "exists and is not this group's mirror" in taken["status"]["message"]
    kept = server.get_object(resources.SHARED_DEVICE_GROUP.path("team", "taken"))
    assert kept is not None and not kept["metadata"].get("ownerReferences")
    reasons = [r for r, _ in events(server, "team")]
    assert reasons.count("Invalid") == 1 and reasons.count("NameTaken") == 1
    await passes(controller, server)  # nothing changes: no second event, no second write
    assert [r for r, _ in events(server, "team")] == reasons


# ----------------------------------------------------------------- KubeShare SharePods

SHAREPOD_NOTES = {
    "kubeshare/gpu_request": "0.5",
    "kubeshare/gpu_limit": "1.0",
    "kubeshare/gpu_mem": "1073741824",
    sharepods.LAST_APPLIED: "{}",
}


def sharepod(name: str) -> Json:
    return {
        "apiVersion": resources.SHAREPOD.api_version,
        "kind": "SharePod",
        "metadata": {"name": name, "namespace": "team", "labels": {"app": "x"}, "annotations": dict(SHAREPOD_NOTES)},
        "spec": {"containers": [{"name": "cuda", "image": "nvidia/cuda:9.0-base", "command": ["nvidia-smi", "-L"]}]},
    }


async def test_a_sharepod_runs_as_its_own_pod_mirrors_it_and_takes_it_along(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    server, controller = env
    stored = server.put_object(resources.SHAREPOD.path("team"), sharepod("shp1"))
    uid = stored["metadata"]["uid"]
    await passes(controller, server)
    pod = server.get_object(paths.pod("team", "shp1"))
    assert pod is not None
    assert pod["spec"] == stored["spec"]
    assert pod["metadata"]["labels"] == {"app": "x", sharepods.LABEL: uid}
    assert pod["metadata"]["annotations"] == {k: v for k, v in SHAREPOD_NOTES.items() if k != sharepods.LAST_APPLIED}
    assert pod["metadata"]["ownerReferences"] == [
        {"apiVersion": "kubeshare.nthu/v1", "kind": "SharePod", "name": "shp1", "uid": uid, "controller": True}
    ]
    # Bound by sharegpu to GPU 1 of n0, running: the SharePod shows it.
    device = server.get_object(paths.device("n0"))
    assert device is not None
    alloc = MakeAllocation(units.pod_key("team", "shp1"), "n0").grant(1, 500, 1024, limit=1000, container="cuda")
    pod["metadata"]["annotations"][names.ALLOCATION] = alloc.json()
    pod["spec"]["nodeName"] = "n0"
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.7"}
    await controller.api.replace(paths.pod("team", "shp1"), pod)
    await passes(controller, server)
    shown = server.get_object(resources.SHAREPOD.path("team", "shp1"))
    assert shown is not None
    assert shown["status"]["PodStatus"] == {"phase": "Running", "podIP": "10.0.0.7"}
    assert shown["status"]["BoundDeviceID"] == device["spec"]["gpus"][1]["uuid"]
    assert shown["status"]["PodObjectMeta"]["uid"] == pod["metadata"]["uid"]
    assert [r for r, _ in events(server, "team")] == ["PodCreated"]
    # Its Pod lost (evicted, deleted by hand): made again, as KubeShare does.
    server.remove_object(paths.pod("team", "shp1"))
    await passes(controller, server)
    again = server.get_object(paths.pod("team", "shp1"))
    assert again is not None and again["metadata"]["uid"] != pod["metadata"]["uid"]
    # The SharePod deleted: its Pod goes too.
    server.remove_object(resources.SHAREPOD.path("team", "shp1"))
    await passes(controller, server)
    gone = server.get_object(paths.pod("team", "shp1"))
    assert gone is None or gone["metadata"].get("deletionTimestamp")


async def test_a_pod_of_the_same_name_is_not_taken_over_and_the_sharepod_says_so(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    server, controller = env
    foreign = {"metadata": {"name": "shp2", "namespace": "team"}, "spec": {"containers": [{"name": "x"}]}}
    server.put_object(paths.pods("team"), foreign)
    server.put_object(resources.SHAREPOD.path("team"), sharepod("shp2"))
    await passes(controller, server)
    kept = server.get_object(paths.pod("team", "shp2"))
    assert kept is not None and not kept["metadata"].get("ownerReferences")
    shown = server.get_object(resources.SHAREPOD.path("team", "shp2"))
    assert shown is not None
    assert shown["status"]["Message"].startswith("a Pod team/shp2 exists that this SharePod did not make")
    assert [r for r, _ in events(server, "team")] == ["PodExists"]
    # The foreign pod goes; after the retry interval the SharePod gets its own.
    server.remove_object(paths.pod("team", "shp2"))
    await passes(controller, server)
    assert server.get_object(paths.pod("team", "shp2")) is None, "retried only after the interval"
    assert controller.sharepods is not None and isinstance(controller.sharepods.clock, Clock)
    controller.sharepods.clock.advance(31)
    await passes(controller, server)
    made = server.get_object(paths.pod("team", "shp2"))
    assert made is not None and made["metadata"]["labels"][sharepods.LABEL]


def test_unknown_compatibility_names_are_refused() -> None:
    with pytest.raises(errors.InvalidRequestError, match="compat: unknown nope"):
        runtime.Controller(client.KubeClient(fake.FakeApiServer()), runtime.Options(compat=frozenset({"nope"})))


async def test_a_pod_made_again_under_the_name_of_a_deleted_sharepods_pod_is_left_alone(
    env: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    """The SharePod and its Pod go; its owner makes a plain Pod of that name before the controller's
    watch has shown the old one gone: the clean-up of the old one must not delete the new one."""
    server, controller = env
    server.put_object(resources.SHAREPOD.path("team"), sharepod("shp3"))
    await passes(controller, server)
    old = server.get_object(paths.pod("team", "shp3"))
    assert old is not None and controller.sharepods is not None
    server.remove_object(resources.SHAREPOD.path("team", "shp3"))
    server.remove_object(paths.pod("team", "shp3"))
    plain = {"metadata": {"name": "shp3", "namespace": "team"}, "spec": {"containers": [{"name": "x"}]}}
    server.put_object(paths.pods("team"), plain)
    await settle(server)
    controller.sharepods.on_pod(wire.EventType.ADDED, wire.convert(old, sharepods.MadePod))  # the watch lags
    await controller.sharepods.reconcile()
    await settle(server)
    kept = server.get_object(paths.pod("team", "shp3"))
    assert kept is not None and not kept["metadata"].get("deletionTimestamp"), "the new pod was deleted"
