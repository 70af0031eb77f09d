"""Which devices each container really got, as the kubelet tells it through its PodResources API.

The kubelet serves the gRPC service `v1.PodResourcesLister` on a unix socket
(`agent.host.PODRESOURCES_SOCKET` by default). `List` names the device IDs it allocated to every
container of every pod on the node; `GetAllocatableResources` names every device it can allocate
(kubelet 1.21 and later: a 1.20 kubelet answers UNIMPLEMENTED, which reads here as "not known", not
as a fault).

The agent depends on the narrow `PodResources` role; `KubeletPodResources` implements it over gRPC
and `agent.fakes.kubelet.FakeKubelet` serves the same API where no kubelet hands out devices. gRPC
errors end at this boundary, translated by status code into `PodResourcesError` and its subclasses.

A kubelet restart removes the socket and creates it again (a new file). A call that finds no socket,
or no kubelet answering on it, drops the connection and raises `PodResourcesUnavailableError`; the
next call connects afresh. A call on a connection made before a restart may be written into the
dead socket ("Stream removed", broken pipe) before gRPC notices: a call that fails UNAVAILABLE on a
connection an earlier call made is made once more on a new one (both methods only read).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from sharegpu.agent import podresources_pb2 as pb
from sharegpu.core import errors

SERVICE = "v1.PodResourcesLister"
LIST = "List"
GET_ALLOCATABLE = "GetAllocatableResources"
# The answer size the kubelet's own PodResources client accepts; gRPC's default (4 MiB) is less.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_Answer = TypeVar("_Answer", bound=Message)


class PodResourcesError(errors.SharegpuError):
    """The kubelet's PodResources API failed a call; the message names the socket and the method."""


class PodResourcesUnavailableError(PodResourcesError):
    """No kubelet answers on the socket now: it is missing, refuses connections or did not answer in
    time (a kubelet restarting looks like this). The next call connects afresh."""


class PodResourcesUnimplementedError(PodResourcesError):
    """The kubelet does not implement the method: it is older than the API."""


@dataclass(frozen=True, slots=True)
class Assigned:
    """The devices of one resource that the kubelet allocated to one container (IDs sorted)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResources(Protocol):
    """What the agent asks of the kubelet about devices."""

    async def assigned(self) -> list[Assigned]:
        """Every container's devices, one entry per container and resource, sorted."""
        ...

    async def allocatable(self) -> dict[str, tuple[str, ...]] | None:
        """Every allocatable device ID by resource name (sorted), or None where the kubelet cannot say."""
        ...


class KubeletPodResources:
    """The kubelet's PodResources API over its unix socket; every call ends by `timeout` seconds."""

    def __init__(self, socket_path: Path, timeout: float) -> None:
        self.socket_path = socket_path.absolute()
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None

    async def assigned(self) -> list[Assigned]:
        answer = await self._call(LIST, pb.ListPodResourcesRequest(), pb.ListPodResourcesResponse)
        return _assignments(answer)

    async def allocatable(self) -> dict[str, tuple[str, ...]] | None:
        try:
            answer = await self._call(
                GET_ALLOCATABLE, pb.AllocatableResourcesRequest(), pb.AllocatableResourcesResponse
            )
        except PodResourcesUnimplementedError:
            return None
        return _by_resource(answer.devices)

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(grace=None)

    async def _call(self, method: str, request: Message, answer_type: type[_Answer]) -> _Answer:
        reused = self._channel is not None
        try:
            return await self._call_once(method, request, answer_type)
        except PodResourcesUnavailableError as exc:
            cause = exc.__cause__
            dead = isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.UNAVAILABLE
            if not (reused and dead):
                raise
            return await self._call_once(method, request, answer_type)  # on a new connection

    async def _call_once(self, method: str, request: Message, answer_type: type[_Answer]) -> _Answer:
        if not self.socket_path.exists():
            await self.close()
            raise PodResourcesUnavailableError(
                f"the kubelet's PodResources socket {self.socket_path} does not exist (is the kubelet running?)"
            )
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_path}",
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    # A channel of its own connections: with gRPC's shared pool, the new channel made
                    # after a kubelet restart could reuse the old connection's reconnect backoff and
                    # fail at once although the new kubelet already listens.
                    ("grpc.use_local_subchannel_pool", 1),
                ],
            )
        call = self._channel.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=answer_type.FromString,
        )
        try:
            answer: _Answer = await call(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            raise await self._translate(method, error) from error
        return answer

    async def _translate(self, method: str, error: grpc.aio.AioRpcError) -> PodResourcesError:
        code = error.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            await self.close()
            return PodResourcesUnavailableError(
                f"no kubelet answers on the PodResources socket {self.socket_path}: {error.details()}"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            await self.close()
            return PodResourcesUnavailableError(
                f"the kubelet did not answer {SERVICE}/{method} within {self.timeout}s"
                f" on its PodResources socket {self.socket_path}"
            )
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return PodResourcesUnimplementedError(
                f"the kubelet on {self.socket_path} does not implement {SERVICE}/{method} (it is older than that API)"
            )
        return PodResourcesError(
            f"the kubelet on {self.socket_path} failed {SERVICE}/{method}: {code.name}: {error.details()}"
        )


def _assignments(answer: pb.ListPodResourcesResponse) -> list[Assigned]:
    # Newer kubelets send each device (and each NUMA node of it) in its own ContainerDevices: merge them.
    found: dict[tuple[str, str, str, str], set[str]] = {}
    for pod in answer.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                key = (pod.namespace, pod.name, container.name, devices.resource_name)
                found.setdefault(key, set()).update(devices.device_ids)
    return [Assigned(*key, device_ids=tuple(sorted(ids))) for key, ids in sorted(found.items()) if ids]


def _by_resource(groups: Iterable[pb.ContainerDevices]) -> dict[str, tuple[str, ...]]:
    found: dict[str, set[str]] = {}
    for devices in groups:
        found.setdefault(devices.resource_name, set()).update(devices.device_ids)
    return {resource: tuple(sorted(ids)) for resource, ids in sorted(found.items()) if ids}
