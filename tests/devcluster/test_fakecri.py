"""The fake CRI and the fake NVIDIA device plugin, spoken to over gRPC as the kubelet does."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from sharegpu.devcluster import cri_pb2 as pb
from sharegpu.devcluster import deviceplugin_pb2 as dp
from sharegpu.devcluster import fakecri, fakedeviceplugin
from sharegpu.serving import unixgrpc


def _bytes(read: object) -> bytes:
    assert isinstance(read, bytes), read  # not the stream's end
    return read


@pytest.fixture
def folder() -> Iterator[Path]:
    made = Path(tempfile.mkdtemp(prefix="cri-", dir="/tmp"))  # short: unix socket paths
    yield made
    shutil.rmtree(made, ignore_errors=True)


def write_spec(folder: Path, name: str, spec: dict[str, Any]) -> None:
    (folder / name).write_bytes(orjson.dumps(spec))


CLAIM_SPEC = {
    "cdiVersion": "0.6.0",
    "kind": "sharegpu.io/claim",
    "devices": [{"name": "c1-gpu", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-1", "A=device"]}}],
    "containerEdits": {"env": ["A=spec", "B=spec"], "mounts": [{"hostPath": "/h", "containerPath": "/c"}]},
}


def test_cdi_devices_resolve_to_their_spec_s_edits_once_then_their_own(folder: Path) -> None:
    write_spec(folder, "nvidia.json", fakecri.toolkit_spec(["GPU-0", "GPU-1"]))
    write_spec(folder, "claim.json", CLAIM_SPEC)
    edits = fakecri.resolve_cdi([folder], ["nvidia.com/gpu=GPU-1", "sharegpu.io/claim=c1-gpu"])
    assert edits.env == {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "A": "device", "B": "spec"}
    assert edits.device_nodes == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia1"]
    assert edits.mounts == [("/h", "/c")]
    with pytest.raises(fakecri.CdiError, match=r"unresolvable CDI devices nvidia.com/gpu=GPU-7$"):
        fakecri.resolve_cdi([folder], ["nvidia.com/gpu=GPU-7", "nvidia.com/gpu=GPU-0"])


class Runtime:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel

    async def call(self, method: str, request: Any, answer: Any = None) -> Any:
        call = self.channel.unary_unary(f"/runtime.v1.RuntimeService/{method}", unixgrpc.raw, unixgrpc.raw)
        raw = await call(request.SerializeToString(), timeout=5)
        return answer.FromString(raw) if answer is not None else raw


@pytest.fixture
async def cri(folder: Path) -> AsyncIterator[tuple[fakecri.FakeCri, Runtime]]:
    runtime = fakecri.FakeCri(folder / "cri.sock", cdi_dirs=[folder])
    await runtime.start()
    async with grpc.aio.insecure_channel(runtime.endpoint) as channel:
        yield runtime, Runtime(channel)
    await runtime.stop()


def pod_labels(pod: str) -> dict[str, str]:
    return {fakecri.POD_NAMESPACE: "ns", fakecri.POD_NAME: pod, fakecri.POD_UID: f"uid-{pod}"}


async def test_a_pod_s_sandbox_and_container_run_with_its_variables_and_cdi_edits(
    folder: Path, cri: tuple[fakecri.FakeCri, Runtime]
) -> None:
    runtime, client = cri
    write_spec(folder, "claim.json", CLAIM_SPEC)
    started: list[str] = []

    async def on_start(container: fakecri.Container) -> None:
        started.append(f"{container.pod}/{container.name}={container.env['NVIDIA_VISIBLE_DEVICES']}")

    runtime.on_start.append(on_start)
    sandboxes = {}
    for pod in ("p", "q"):
        config = pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name=pod, namespace="ns"), labels=pod_labels(pod))
        made = await client.call("RunPodSandbox", pb.RunPodSandboxRequest(config=config), pb.RunPodSandboxResponse)
        sandboxes[pod] = made.pod_sandbox_id
    main = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="main"), image=pb.ImageSpec(image="busybox"),
        envs=[pb.KeyValue(key="A", value="kubelet"), pb.KeyValue(key="C", value="kubelet")],
        labels={**pod_labels("p"), fakecri.CONTAINER_NAME: "main"},
        CDI_devices=[pb.CDIDevice(name="sharegpu.io/claim=c1-gpu")],
    )  # fmt: skip
    request = pb.CreateContainerRequest(pod_sandbox_id=sandboxes["p"], config=main)
    container_id = (await client.call("CreateContainer", request, pb.CreateContainerResponse)).container_id
    await client.call("StartContainer", pb.ContainerIdRequest(container_id=container_id))
    running = runtime.running("ns", "p")["main"]
    assert running.env == {"A": "device", "B": "spec", "C": "kubelet", "NVIDIA_VISIBLE_DEVICES": "GPU-1"}
    for _ in range(50):
        if started:
            break
        await asyncio.sleep(0.01)
    assert started == ["p/main=GPU-1"]

    # The kubelet's lists, filtered as it filters them: by pod label and by state.
    selector = pb.ContainerFilter(label_selector={fakecri.POD_UID: "uid-p"})
    listed = await client.call("ListContainers", pb.ListContainersRequest(filter=selector), pb.ListContainersResponse)
    assert [(c.id, c.state) for c in listed.containers] == [(container_id, pb.CONTAINER_RUNNING)]
    other = pb.ContainerFilter(label_selector={fakecri.POD_UID: "uid-q"})
    listed = await client.call("ListContainers", pb.ListContainersRequest(filter=other), pb.ListContainersResponse)
    assert not listed.containers
    ready = pb.PodSandboxFilter(state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY))
    found = await client.call("ListPodSandbox", pb.ListPodSandboxRequest(filter=ready), pb.ListPodSandboxResponse)
    assert {s.metadata.name for s in found.items} == {"p", "q"}

    # Stopping the sandbox ends its containers; removing it forgets them.
    await client.call("StopPodSandbox", pb.PodSandboxIdRequest(pod_sandbox_id=sandboxes["p"]))
    status = await client.call(
        "ContainerStatus", pb.ContainerIdRequest(container_id=container_id), pb.ContainerStatusResponse
    )
    assert status.status.state == pb.CONTAINER_EXITED and status.status.finished_at >= status.status.started_at > 0
    found = await client.call("ListPodSandbox", pb.ListPodSandboxRequest(filter=ready), pb.ListPodSandboxResponse)
    assert {s.metadata.name for s in found.items} == {"q"}
    await client.call("RemovePodSandbox", pb.PodSandboxIdRequest(pod_sandbox_id=sandboxes["p"]))
    assert container_id not in runtime.containers
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.call("ContainerStatus", pb.ContainerIdRequest(container_id=container_id))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_container_whose_cdi_device_no_spec_defines_is_not_created(
    cri: tuple[fakecri.FakeCri, Runtime],
) -> None:
    runtime, client = cri
    config = pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name="p", namespace="ns"), labels=pod_labels("p"))
    sandbox = await client.call("RunPodSandbox", pb.RunPodSandboxRequest(config=config), pb.RunPodSandboxResponse)
    wanting = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="main"), CDI_devices=[pb.CDIDevice(name="nvidia.com/gpu=GPU-9")]
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.call(
            "CreateContainer", pb.CreateContainerRequest(pod_sandbox_id=sandbox.pod_sandbox_id, config=wanting)
        )
    assert refused.value.code() == grpc.StatusCode.UNKNOWN
    assert "unresolvable CDI devices nvidia.com/gpu=GPU-9" in (refused.value.details() or "")
    assert not runtime.containers
    # Every image is present; the streaming lists are left to the plain ones.
    status = client.channel.unary_unary("/runtime.v1.ImageService/ImageStatus", unixgrpc.raw, unixgrpc.raw)
    answer = pb.ImageStatusResponse.FromString(
        await status(pb.ImageStatusRequest(image=pb.ImageSpec(image="busybox")).SerializeToString())
    )
    assert answer.image.repo_tags == ["busybox"] and answer.image.id.startswith("sha256:")
    stream = client.channel.unary_stream("/runtime.v1.RuntimeService/StreamPodSandboxes", unixgrpc.raw, unixgrpc.raw)
    with pytest.raises(grpc.aio.AioRpcError) as unimplemented:
        async for _ in stream(b""):
            pass
    assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED


class FakeRegistration(unixgrpc.GenericHandler):
    """The kubelet's side of device plugin registration: records who registered."""

    def __init__(self) -> None:
        self.requests: list[dp.RegisterRequest] = []

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        if details.method != fakedeviceplugin.REGISTER:
            return None

        async def register(request: bytes, context: Any) -> bytes:
            self.requests.append(dp.RegisterRequest.FromString(request))
            return b""

        return grpc.unary_unary_rpc_method_handler(
            register, request_deserializer=unixgrpc.raw, response_serializer=unixgrpc.raw
        )


async def test_the_device_plugin_registers_lists_its_gpus_allocates_and_registers_again(folder: Path) -> None:
    kubelet = FakeRegistration()
    server = await unixgrpc.serve(folder / fakedeviceplugin.KUBELET_SOCKET, [kubelet])
    plugin = fakedeviceplugin.FakeDevicePlugin(["GPU-a", "GPU-b"], "n1", folder)
    await plugin.start()
    try:
        for _ in range(100):
            if kubelet.requests:
                break
            await asyncio.sleep(0.05)
        (asked,) = kubelet.requests
        assert (asked.version, asked.resource_name, asked.endpoint) == ("v1beta1", "nvidia.com/gpu", plugin.endpoint)
        async with grpc.aio.insecure_channel(f"unix://{folder / plugin.endpoint}") as channel:
            watch = channel.unary_stream("/v1beta1.DevicePlugin/ListAndWatch", unixgrpc.raw, unixgrpc.raw)(b"")
            first = dp.ListAndWatchResponse.FromString(_bytes(await watch.read()))
            assert [(d.ID, d.health) for d in first.devices] == [("GPU-a", "Healthy"), ("GPU-b", "Healthy")]
            plugin.set_health("GPU-b", False)
            second = dp.ListAndWatchResponse.FromString(_bytes(await watch.read()))
            assert [(d.ID, d.health) for d in second.devices] == [("GPU-a", "Healthy"), ("GPU-b", "Unhealthy")]
            watch.cancel()
            allocate = channel.unary_unary("/v1beta1.DevicePlugin/Allocate", unixgrpc.raw, unixgrpc.raw)
            request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=["GPU-a"])])
            answer = dp.AllocateResponse.FromString(await allocate(request.SerializeToString()))
            assert [dict(c.envs) for c in answer.container_responses] == [{"NVIDIA_VISIBLE_DEVICES": "GPU-a"}]
            assert plugin.allocated == [("GPU-a",)]
        # The kubelet restarts: a new socket; the plugin registers again.
        await unixgrpc.stop(server, folder / fakedeviceplugin.KUBELET_SOCKET)
        server = await unixgrpc.serve(folder / fakedeviceplugin.KUBELET_SOCKET, [kubelet])
        for _ in range(100):  # the kubelet records the request before the plugin sees the answer
            if len(kubelet.requests) == 2 and plugin.registrations == 2:
                break
            await asyncio.sleep(0.05)
        assert len(kubelet.requests) == 2 and plugin.registrations == 2
    finally:
        await plugin.stop()
        await unixgrpc.stop(server, folder / fakedeviceplugin.KUBELET_SOCKET)
