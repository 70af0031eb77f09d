"""The kubelet PodResources client against the fake kubelet, over real gRPC on a unix socket: what
each container got, what the node can allocate, a 1.20 kubelet, a missing socket, a kubelet that
restarts, one that hangs, and errors translated by status code."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from sharegpu.agent import podresources
from sharegpu.agent import podresources_pb2 as pb
from sharegpu.agent.fakes import kubelet as fakekubelet
from sharegpu.agent.podresources import Assigned
from sharegpu.core import errors

GPU = "nvidia.com/gpu"
SHARE = "sharegpu.io/gpu-share"


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # pytest's tmp_path can exceed the 107 bytes a unix socket path may have.
    folder = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    yield folder / "pod-resources" / "kubelet.sock"
    shutil.rmtree(folder)


@pytest.fixture
async def kubelet(socket_path: Path) -> AsyncIterator[fakekubelet.FakeKubelet]:
    fake = fakekubelet.FakeKubelet(socket_path)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def client(socket_path: Path) -> AsyncIterator[podresources.KubeletPodResources]:
    pod_resources = podresources.KubeletPodResources(socket_path, timeout=5.0)
    yield pod_resources
    await pod_resources.close()


async def test_list_names_each_containers_devices_per_resource(
    kubelet: fakekubelet.FakeKubelet, client: podresources.KubeletPodResources
) -> None:
    assert await client.assigned() == []
    kubelet.set_devices("ml", "train", "worker", GPU, ["GPU-1", "GPU-0"])
    kubelet.set_devices("ml", "train", "worker", SHARE, ["GPU-2-share-3"])
    kubelet.set_devices("ml", "train", "sidecar", GPU, ["GPU-3"])
    kubelet.set_devices("ml", "train", "logs", GPU, [])  # listed, holds nothing
    kubelet.set_devices("web", "serve", "main", SHARE, ["GPU-2-share-0", "GPU-2-share-1"])
    assert await client.assigned() == [
        Assigned("ml", "train", "sidecar", GPU, ("GPU-3",)),
        Assigned("ml", "train", "worker", GPU, ("GPU-0", "GPU-1")),
        Assigned("ml", "train", "worker", SHARE, ("GPU-2-share-3",)),
        Assigned("web", "serve", "main", SHARE, ("GPU-2-share-0", "GPU-2-share-1")),
    ]

    kubelet.remove_pod("ml", "train")
    kubelet.set_devices("web", "serve", "main", SHARE, ["GPU-2-share-1"])
    assert await client.assigned() == [Assigned("web", "serve", "main", SHARE, ("GPU-2-share-1",))]


async def test_allocatable_names_every_device_per_resource(
    kubelet: fakekubelet.FakeKubelet, client: podresources.KubeletPodResources
) -> None:
    assert await client.allocatable() == {}
    kubelet.set_allocatable(GPU, ["GPU-1", "GPU-0"])
    kubelet.set_allocatable(SHARE, [f"GPU-0-share-{i}" for i in range(3)])
    assert await client.allocatable() == {
        GPU: ("GPU-0", "GPU-1"),
        SHARE: ("GPU-0-share-0", "GPU-0-share-1", "GPU-0-share-2"),
    }
    kubelet.set_allocatable(SHARE, [])
    assert await client.allocatable() == {GPU: ("GPU-0", "GPU-1")}


async def test_a_1_20_kubelet_cannot_say_what_is_allocatable(
    socket_path: Path, client: podresources.KubeletPodResources
) -> None:
    kubelet = fakekubelet.FakeKubelet(socket_path, allocatable_api=False)
    kubelet.set_devices("ml", "train", "worker", GPU, ["GPU-0"])
    kubelet.set_allocatable(GPU, ["GPU-0"])
    await kubelet.start()
    try:
        assert await client.allocatable() is None
        assert await client.assigned() == [Assigned("ml", "train", "worker", GPU, ("GPU-0",))]
    finally:
        await kubelet.stop()


async def test_a_missing_socket_is_unavailable_and_named(
    socket_path: Path, client: podresources.KubeletPodResources
) -> None:
    with pytest.raises(podresources.PodResourcesUnavailableError, match=str(socket_path)):
        await client.assigned()
    with pytest.raises(podresources.PodResourcesUnavailableError, match=str(socket_path)):
        await client.allocatable()


async def test_after_a_kubelet_restart_the_next_call_reconnects(
    socket_path: Path, kubelet: fakekubelet.FakeKubelet, client: podresources.KubeletPodResources
) -> None:
    kubelet.set_devices("ml", "train", "worker", GPU, ["GPU-0"])
    assert await client.assigned() == [Assigned("ml", "train", "worker", GPU, ("GPU-0",))]

    await kubelet.stop()
    assert not socket_path.exists()
    with pytest.raises(podresources.PodResourcesUnavailableError, match=str(socket_path)) as raised:
        await client.assigned()
    assert isinstance(raised.value, errors.SharegpuError)

    kubelet.remove_pod("ml", "train")
    kubelet.set_devices("ml", "infer", "main", GPU, ["GPU-1"])
    await kubelet.start()
    assert await client.assigned() == [Assigned("ml", "infer", "main", GPU, ("GPU-1",))]

    # A restart between two calls goes unnoticed: the connection is made again to the new socket.
    await kubelet.stop()
    kubelet.set_devices("ml", "infer", "main", GPU, ["GPU-2"])
    await kubelet.start()
    assert await client.assigned() == [Assigned("ml", "infer", "main", GPU, ("GPU-2",))]


async def test_a_socket_nobody_serves_is_unavailable(
    socket_path: Path, kubelet: fakekubelet.FakeKubelet, client: podresources.KubeletPodResources
) -> None:
    await kubelet.stop()
    socket_path.touch()  # left behind by a kubelet that died
    with pytest.raises(podresources.PodResourcesUnavailableError, match=str(socket_path)):
        await client.assigned()
    await kubelet.start()
    assert await client.assigned() == []


async def test_a_kubelet_that_hangs_fails_the_call_by_its_deadline(
    socket_path: Path, kubelet: fakekubelet.FakeKubelet
) -> None:
    client = podresources.KubeletPodResources(socket_path, timeout=0.3)
    try:
        kubelet.stall()
        started = time.monotonic()
        with pytest.raises(podresources.PodResourcesUnavailableError, match="did not answer") as raised:
            await client.assigned()
        assert time.monotonic() - started < 2
        assert str(socket_path) in str(raised.value)
        kubelet.resume()
        assert await client.allocatable() == {}
    finally:
        await client.close()


async def _serve(socket_path: Path, handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]]) -> grpc.aio.Server:
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(podresources.SERVICE, handlers)])
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    return server


async def test_a_kubelet_without_the_api_is_unimplemented(
    socket_path: Path, client: podresources.KubeletPodResources
) -> None:
    server = await _serve(socket_path, {})
    try:
        with pytest.raises(podresources.PodResourcesUnimplementedError, match=r"v1\.PodResourcesLister/List"):
            await client.assigned()
    finally:
        await server.stop(grace=None)


async def test_other_failures_are_translated_by_status_code(
    socket_path: Path, client: podresources.KubeletPodResources
) -> None:
    async def refuse(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not for you")

    server = await _serve(socket_path, {podresources.LIST: grpc.unary_unary_rpc_method_handler(refuse)})
    try:
        with pytest.raises(podresources.PodResourcesError, match="PERMISSION_DENIED: not for you") as raised:
            await client.assigned()
        assert not isinstance(raised.value, podresources.PodResourcesUnavailableError)
    finally:
        await server.stop(grace=None)


async def test_a_device_sent_once_per_numa_node_is_listed_once(
    socket_path: Path, client: podresources.KubeletPodResources
) -> None:
    def numa(*nodes: int) -> pb.TopologyInfo:
        return pb.TopologyInfo(nodes=[pb.NUMANode(ID=node) for node in nodes])

    # As a kubelet sends it: one ContainerDevices per device and NUMA node, CPUs and memory beside them.
    answer = pb.ListPodResourcesResponse(
        pod_resources=[
            pb.PodResources(
                namespace="ml",
                name="train",
                containers=[
                    pb.ContainerResources(
                        name="worker",
                        devices=[
                            pb.ContainerDevices(resource_name=GPU, device_ids=["GPU-1"], topology=numa(0)),
                            pb.ContainerDevices(resource_name=GPU, device_ids=["GPU-1"], topology=numa(1)),
                            pb.ContainerDevices(resource_name=GPU, device_ids=["GPU-0"], topology=numa(0)),
                        ],
                        cpu_ids=[2, 3],
                        memory=[pb.ContainerMemory(memory_type="memory", size=1 << 30, topology=numa(0))],
                    )
                ],
            )
        ]
    )

    async def answer_list(
        request: pb.ListPodResourcesRequest,
        context: grpc.aio.ServicerContext[pb.ListPodResourcesRequest, pb.ListPodResourcesResponse],
    ) -> pb.ListPodResourcesResponse:
        return answer

    handler = grpc.unary_unary_rpc_method_handler(
        answer_list,
        request_deserializer=pb.ListPodResourcesRequest.FromString,
        response_serializer=pb.ListPodResourcesResponse.SerializeToString,
    )
    server = await _serve(socket_path, {podresources.LIST: handler})
    try:
        assert await client.assigned() == [Assigned("ml", "train", "worker", GPU, ("GPU-0", "GPU-1"))]
    finally:
        await server.stop(grace=None)


async def test_a_call_that_fails_unavailable_on_an_old_connection_is_made_once_more(
    kubelet: fakekubelet.FakeKubelet, client: podresources.KubeletPodResources
) -> None:
    """A call written into a connection the kubelet's restart killed fails UNAVAILABLE ("Stream
    removed") before gRPC notices: it is made again on a new connection, once; a call on a new
    connection is not repeated."""
    kubelet.set_devices("ml", "train", "worker", GPU, ["GPU-0"])
    assert await client.assigned() == [Assigned("ml", "train", "worker", GPU, ("GPU-0",))]
    kubelet.fail_next(grpc.StatusCode.UNAVAILABLE)
    before = kubelet.calls
    assert await client.assigned() == [Assigned("ml", "train", "worker", GPU, ("GPU-0",))]
    assert kubelet.calls == before + 2, "failed once, answered on the new connection"
    kubelet.fail_next(grpc.StatusCode.UNAVAILABLE)
    kubelet.fail_next(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(podresources.PodResourcesUnavailableError):
        await client.assigned()
    assert kubelet.calls == before + 4, "tried on the new connection once, not again"
