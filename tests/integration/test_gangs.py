"""Gangs through the real kube-apiserver and kube-scheduler with the extender as its own process: a
gang short of members holds nothing and says so; complete, it is placed and bound whole, packed onto
as few nodes as hold it; a gang that cannot fit holds nothing while other pods go on being placed."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import pytest

from sharegpu.api import names, podgroups
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from tests.integration.conftest import RunningWebhook, consistent, gpu_pod, pods_in, refusal, wait_for

Json = dict[str, Any]


def member(name: str, namespace: str, gang: str, minimum: int) -> Json:
    return gpu_pod(name, namespace, milli=600, annotations={names.GANG: gang, names.GANG_MIN: str(minimum)})


async def nodes_of(kube: client.KubeClient, namespace: str, prefix: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: (p.get("spec") or {}).get("nodeName") or ""
        for p in await pods_in(kube, namespace)
        if p["metadata"]["name"].startswith(prefix)
    }


async def test_a_gang_is_placed_whole_once_its_members_are_here_and_holds_nothing_before(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    await nodes(3, gpus=2)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    for i in range(3):
        await admin.create(pods, member(f"job-{i}", namespace, "job", 4))

    async def told_why() -> str | None:
        message = await refusal(admin, namespace, "job-0")
        return message if message and "waits for its members" in message else None

    message = await wait_for(told_why, what="job-0 turned away for its missing member")
    assert "of 4 needed are here" in message, message  # 1, 2 or 3 of 4: as many as its last try saw
    await admin.create(pods, gpu_pod("outsider", namespace, milli=600))
    await wait_for(
        functools.partial(_bound, admin, namespace, "outsider"),
        what="a pod outside the gang placed while the gang waits",
    )
    assert not any((await nodes_of(admin, namespace, "job-")).values()), "no member placed before the gang is whole"
    await admin.create(pods, member("job-3", namespace, "job", 4))

    async def whole() -> dict[str, str] | None:
        found = await nodes_of(admin, namespace, "job-")
        return found if all(found.values()) and len(found) == 4 else None

    placed = await wait_for(whole, what="the whole gang bound")
    assert sorted(placed.values()).count(sorted(placed.values())[0]) == 2 and len(set(placed.values())) == 2, (
        f"four members of one GPU each on two nodes of two GPUs: {placed}"
    )
    await consistent(admin)


async def test_a_gang_that_cannot_fit_holds_nothing_and_others_go_on(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    await nodes(1, gpus=2)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    for i in range(3):
        await admin.create(pods, member(f"big-{i}", namespace, "big", 3))

    async def told_why() -> str | None:
        message = await refusal(admin, namespace, "big-0")
        return message if message and "fit together" in message else None

    await wait_for(told_why, what="the gang turned away for want of room")
    for i in range(2):
        await admin.create(pods, gpu_pod(f"solo-{i}", namespace, milli=600))
    for name in ("solo-0", "solo-1"):
        await wait_for(functools.partial(_bound, admin, namespace, name), what=f"{name} bound")
    await asyncio.sleep(1)
    assert not any((await nodes_of(admin, namespace, "big-")).values())
    await consistent(admin)


async def _bound(kube: client.KubeClient, namespace: str, name: str) -> bool:
    pod = await kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    return bool((pod.get("spec") or {}).get("nodeName"))


FORMATS = {
    "coscheduling": (podgroups.COSCHEDULING, {"minMember": 2, "scheduleTimeoutSeconds": 120}),
    "volcano": (podgroups.VOLCANO, {"minMember": 2, "queue": "research"}),
    "kai": (podgroups.KAI, {"minMember": 2, "queue": "team-a"}),
}


def named(pod: Json, fmt: podgroups.Format, group: str) -> Json:
    """The pod naming `group` the way its scheduler's users write it."""
    meta = pod["metadata"]
    if fmt is podgroups.COSCHEDULING:
        meta.setdefault("labels", {})[podgroups.COSCHEDULING_LABEL] = group
    else:
        key = podgroups.VOLCANO_ANNOTATION if fmt is podgroups.VOLCANO else podgroups.KAI_ANNOTATION
        meta.setdefault("annotations", {})[key] = group
    return pod


@pytest.mark.parametrize("kind", sorted(FORMATS))
async def test_a_group_written_for_another_scheduler_is_placed_as_one_gang(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    webhook: RunningWebhook,
    nodes: Callable[..., Any],
    namespace: str,
    kind: str,
) -> None:
    fmt, spec = FORMATS[kind]
    await nodes(2, gpus=1)
    group = f"{kind}-job"
    body = {"apiVersion": fmt.api_version, "kind": "PodGroup", "metadata": {"name": group}, "spec": spec}
    await admin.create(f"/apis/{fmt.group}/{fmt.version}/namespaces/{namespace}/podgroups", body)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    with pytest.raises(kube_errors.KubeError, match="does not exist: create the group before its pods"):
        await admin.create(pods, named(gpu_pod("stray", namespace, milli=600), fmt, "no-such-group"))
    made = await admin.create(pods, named(gpu_pod("w-0", namespace, milli=600), fmt, group))
    annotations = made["metadata"]["annotations"]
    assert (annotations[names.GANG], annotations[names.GANG_MIN]) == (group, "2")

    async def told_why() -> str | None:
        message = await refusal(admin, namespace, "w-0")
        return message if message and "waits for its members: 1 of 2" in message else None

    await wait_for(told_why, what="the lone member turned away for its gang")
    await admin.create(pods, named(gpu_pod("w-1", namespace, milli=600), fmt, group))

    async def whole() -> dict[str, str] | None:
        found = await nodes_of(admin, namespace, "w-")
        return found if len(found) == 2 and all(found.values()) else None

    placed = await wait_for(whole, what=f"the {kind} gang bound")
    assert len(set(placed.values())) == 2, "one GPU per node: the gang spans both"
    await consistent(admin)


async def test_members_that_must_be_apart_are_planned_apart(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    """A gang whose members keep off each other's node (required pod anti-affinity, one worker per
    node) fits two nodes of two GPUs: the plan must not pack them onto one node, where kube-scheduler
    would turn the second away and the gang would be planned the same way again at every try."""
    await nodes(2, gpus=2)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    apart = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"job": "apart"}}, "topologyKey": "kubernetes.io/hostname"}]}}  # fmt: skip
    for i in range(2):
        pod = member(f"apart-{i}", namespace, "apart", 2)
        pod["metadata"].setdefault("labels", {})["job"] = "apart"
        pod["spec"]["affinity"] = apart
        await admin.create(pods, pod)

    async def whole() -> dict[str, str] | None:
        found = await nodes_of(admin, namespace, "apart-")
        return found if all(found.values()) and len(found) == 2 else None

    placed = await wait_for(whole, what="both members bound")
    assert len(set(placed.values())) == 2, placed
    await consistent(admin)
