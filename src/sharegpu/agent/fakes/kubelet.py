"""A fake kubelet PodResources API, for the tests, where no kubelet hands out devices: it serves
`v1.PodResourcesLister` on a unix socket from a table kept in memory.

The table says which devices of which resource each container holds, and which devices the node can
allocate; change it at any time and the next call sees the change. Like a kubelet since 1.21, it
answers each device of a container in its own ContainerDevices. Made with `allocatable_api=False`
it is a 1.20 kubelet: GetAllocatableResources is answered UNIMPLEMENTED.

`stop()` removes the socket and a later `start()` serves anew on the same path, as a restarting
kubelet does. `stall()` makes it take calls and answer none of them until `resume()` (or `stop()`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import grpc

from sharegpu.agent import podresources
from sharegpu.agent import podresources_pb2 as pb
from sharegpu.serving import unixgrpc

# (namespace, pod) -> container -> resource -> device IDs
_Pods = dict[tuple[str, str], dict[str, dict[str, tuple[str, ...]]]]


class FakeKubelet:
    """Serves the kubelet's PodResources API from an in-memory table on `socket_path`."""

    def __init__(self, socket_path: Path, *, allocatable_api: bool = True) -> None:
        self.socket_path = socket_path.absolute()
        self.allocatable_api = allocatable_api
        self._pods: _Pods = {}
        self._allocatable: dict[str, tuple[str, ...]] = {}
        self._answering = asyncio.Event()
        self._answering.set()
        self._server: grpc.aio.Server | None = None
        self._failures: list[grpc.StatusCode] = []
        self.calls = 0
        """Calls answered or failed so far."""

    def set_devices(self, namespace: str, pod: str, container: str, resource: str, device_ids: Iterable[str]) -> None:
        """The container now holds exactly these devices of the resource (none: it holds none of it).
        The pod and the container are listed from now on, with or without devices."""
        _replace(self._pods.setdefault((namespace, pod), {}).setdefault(container, {}), resource, device_ids)

    def remove_pod(self, namespace: str, pod: str) -> None:
        """The pod is gone from the node, with its devices (a pod never listed is ignored)."""
        self._pods.pop((namespace, pod), None)

    def set_allocatable(self, resource: str, device_ids: Iterable[str]) -> None:
        """The node can allocate exactly these devices of the resource (none: the resource is gone)."""
        _replace(self._allocatable, resource, device_ids)

    def stall(self) -> None:
        """Calls from now on wait, unanswered, until `resume()`: a kubelet that hangs."""
        self._answering.clear()

    def resume(self) -> None:
        """Answers the waiting calls and every call after them."""
        self._answering.set()

    def fail_next(self, code: grpc.StatusCode) -> None:
        """The next call ends with `code` (UNAVAILABLE: what a call written into a dead connection sees)."""
        self._failures.append(code)

    async def start(self) -> None:
        """Serves on the socket, replacing a file left there (as the kubelet does when it starts)."""
        handlers = {
            podresources.LIST: grpc.unary_unary_rpc_method_handler(
                self._list,
                request_deserializer=pb.ListPodResourcesRequest.FromString,
                response_serializer=pb.ListPodResourcesResponse.SerializeToString,
            )
        }
        if self.allocatable_api:
            handlers[podresources.GET_ALLOCATABLE] = grpc.unary_unary_rpc_method_handler(
                self._get_allocatable,
                request_deserializer=pb.AllocatableResourcesRequest.FromString,
                response_serializer=pb.AllocatableResourcesResponse.SerializeToString,
            )
        handler = grpc.method_handlers_generic_handler(podresources.SERVICE, handlers)
        self._server = await unixgrpc.serve(self.socket_path, [handler])

    async def stop(self) -> None:
        """Stops serving (calls in flight end cancelled) and removes the socket."""
        server, self._server = self._server, None
        await unixgrpc.stop(server, self.socket_path)

    async def _list(
        self,
        request: pb.ListPodResourcesRequest,
        context: grpc.aio.ServicerContext[pb.ListPodResourcesRequest, pb.ListPodResourcesResponse],
    ) -> pb.ListPodResourcesResponse:
        await self._answering.wait()
        self.calls += 1
        if self._failures:
            await context.abort(self._failures.pop(0), "injected by the fake kubelet")
        return pb.ListPodResourcesResponse(
            pod_resources=[
                pb.PodResources(
                    namespace=namespace,
                    name=pod,
                    containers=[
                        pb.ContainerResources(name=container, devices=_devices(held))
                        for container, held in containers.items()
                    ],
                )
                for (namespace, pod), containers in self._pods.items()
            ]
        )

    async def _get_allocatable(
        self,
        request: pb.AllocatableResourcesRequest,
        context: grpc.aio.ServicerContext[pb.AllocatableResourcesRequest, pb.AllocatableResourcesResponse],
    ) -> pb.AllocatableResourcesResponse:
        await self._answering.wait()
        return pb.AllocatableResourcesResponse(devices=_devices(self._allocatable))


def _replace(by_resource: dict[str, tuple[str, ...]], resource: str, device_ids: Iterable[str]) -> None:
    ids = tuple(device_ids)
    if ids:
        by_resource[resource] = ids
    else:
        by_resource.pop(resource, None)


def _devices(by_resource: dict[str, tuple[str, ...]]) -> list[pb.ContainerDevices]:
    return [
        pb.ContainerDevices(resource_name=resource, device_ids=[device])
        for resource, device_ids in by_resource.items()
        for device in device_ids
    ]
