"""`sharegpu reserve`: what runs in a reservation pod.

The NVIDIA device plugin gives the reservation pod one physical GPU and says which in
NVIDIA_VISIBLE_DEVICES. The pod reports that UUID in its own annotation (`sharegpu.io/gpu-uuid`) so
the hand-off loop can give it to the pods sharing the GPU, then holds the GPU until it is deleted.
A group's holder reports the several GPUs it was given; one that holds a share of each (placed and
handed off like a sharing pod) has nothing to report and only holds.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable, Mapping

from sharegpu.api import names, paths
from sharegpu.core import errors
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9][A-Za-z0-9/._-]*$")


def visible_gpu(env: Mapping[str, str]) -> str:
    """The single GPU UUID the device plugin gave this container; anything else is an error."""
    value = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if not value:
        raise errors.InvalidInputError("NVIDIA_VISIBLE_DEVICES is not set: was the pod given nvidia.com/gpu: 1?")
    if "," in value:
        raise errors.InvalidInputError(f"NVIDIA_VISIBLE_DEVICES names several GPUs ({value}); a reservation holds one")
    if not _UUID.match(value):
        raise errors.InvalidInputError(f"NVIDIA_VISIBLE_DEVICES is {value!r}, not a GPU UUID")
    return value


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """Every GPU UUID the device plugin gave this container (a group's holder pod holds several)."""
    value = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    found = [v.strip() for v in value.split(",") if v.strip()]
    if not found:
        raise errors.InvalidInputError("NVIDIA_VISIBLE_DEVICES is not set: was the pod given nvidia.com/gpu?")
    for uuid in found:
        if not _UUID.match(uuid):
            raise errors.InvalidInputError(f"NVIDIA_VISIBLE_DEVICES holds {uuid!r}, not a GPU UUID")
    return found


async def report(
    kube: client.KubeApi, namespace: str, name: str, env: Mapping[str, str], *, several: bool = False
) -> str:
    """Write the UUID(s) into the pod's annotation; a reservation pod holds exactly one."""
    uuid = ",".join(visible_gpus(env)) if several else visible_gpu(env)
    await kube.patch(paths.pod(namespace, name), {"metadata": {"annotations": {names.GPU_UUID: uuid}}})
    return uuid


async def report_until_done(
    kube: client.KubeApi,
    namespace: str,
    name: str,
    env: Mapping[str, str],
    *,
    several: bool = False,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> str:
    """`report`, tried again after temporary API errors (an API server restarting as the pod starts)
    with backoff from 0.5 s up to 8 s: the sharers' hand-offs wait for this report, and a container
    that exits instead waits out the kubelet's crash-loop backoff. Other errors are raised."""
    wait = 0.5
    while True:
        try:
            return await report(kube, namespace, name, env, several=several)
        except kube_errors.TemporaryError:
            await sleep(wait)
            wait = min(wait * 2, 8.0)


async def main(kubeconfig: str | None = None) -> None:
    namespace = os.environ.get("POD_NAMESPACE", "")
    name = os.environ.get("POD_NAME", "")
    if not namespace or not name:
        raise errors.InvalidInputError("POD_NAME and POD_NAMESPACE must be set (downward API)")
    role = os.environ.get(names.ROLE_ENV, "")
    if role != names.ROLE_GROUP_SHARE:  # a share group's holder has no GPU of its own to report
        async with client.KubeClient.connect(kubeconfig) as kube:
            await report_until_done(kube, namespace, name, os.environ, several=role == names.ROLE_GROUP_HOLDER)
    await asyncio.Event().wait()  # hold the GPU until the pod is deleted
