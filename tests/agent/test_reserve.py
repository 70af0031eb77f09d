from __future__ import annotations

import asyncio

import pytest

from sharegpu.agent import reserve
from sharegpu.api import names, paths
from sharegpu.core import errors
from sharegpu.kube import client, fake
from sharegpu.kube import errors as kube_errors


def test_one_gpu_uuid_is_reported() -> None:
    assert reserve.visible_gpu({"NVIDIA_VISIBLE_DEVICES": " GPU-3f2a-11 "}) == "GPU-3f2a-11"
    assert reserve.visible_gpu({"NVIDIA_VISIBLE_DEVICES": "MIG-GPU-1/2/0"}) == "MIG-GPU-1/2/0"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "is not set"),
        ("all", "not a GPU UUID"),
        ("GPU-a,GPU-b", "names several GPUs"),
        ("0", "not a GPU UUID"),
    ],
)
def test_anything_but_one_uuid_is_refused(value: str, message: str) -> None:
    with pytest.raises(errors.InvalidInputError, match=message):
        reserve.visible_gpu({"NVIDIA_VISIBLE_DEVICES": value})


async def test_a_share_groups_holder_reports_nothing_and_only_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "holder")
    monkeypatch.setenv("POD_NAMESPACE", "sharegpu-system")
    monkeypatch.setenv(names.ROLE_ENV, names.ROLE_GROUP_SHARE)
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    # No API to reach (the kubeconfig does not exist) and no GPU in the environment: a whole-GPU
    # holder would fail at once; this one holds until cancelled.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reserve.main("/nonexistent/kubeconfig"), timeout=0.2)
    monkeypatch.setenv(names.ROLE_ENV, names.ROLE_GROUP_HOLDER)
    with pytest.raises(errors.SharegpuError):
        await asyncio.wait_for(reserve.main("/nonexistent/kubeconfig"), timeout=5)


async def test_the_report_is_tried_again_after_temporary_api_errors() -> None:
    server = fake.FakeApiServer()
    body = {"metadata": {"name": "r", "namespace": names.SYSTEM_NAMESPACE}}
    server.put_object(paths.pods(names.SYSTEM_NAMESPACE), body)
    server.fail(503, method="PATCH", times=2)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    kube = client.KubeClient(server)
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-1"}
    assert await reserve.report_until_done(kube, names.SYSTEM_NAMESPACE, "r", env, sleep=sleep) == "GPU-1"
    assert waits == [0.5, 1.0]
    pod = await kube.get(paths.pod(names.SYSTEM_NAMESPACE, "r"))
    assert pod["metadata"]["annotations"][names.GPU_UUID] == "GPU-1"
    server.fail(403, method="PATCH", times=1)
    with pytest.raises(kube_errors.ForbiddenError):  # not temporary: the container exits and says why
        await reserve.report_until_done(kube, names.SYSTEM_NAMESPACE, "r", env, sleep=sleep)
