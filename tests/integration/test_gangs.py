"""Gangs through the real kube-apiserver and kube-scheduler with the extender as its own process: a
gang short of members holds nothing and says so; complete, it is placed and bound whole, packed onto
as few nodes as hold it; a gang that cannot fit holds nothing while other pods go on being placed."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from sharegpu.api import names
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.integration.conftest import consistent, gpu_pod, pods_in, refusal, wait_for

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
    assert "3 of 4" in message
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
