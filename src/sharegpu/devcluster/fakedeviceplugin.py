"""A fake NVIDIA device plugin at the kubelet's device plugin seam (v1beta1), for a real kubelet on a
machine without GPUs: it offers `nvidia.com/gpu`, one device per GPU UUID of the node's fake NVML
file, and answers Allocate as NVIDIA's plugin does with its default (environment variable) strategy:
`NVIDIA_VISIBLE_DEVICES` naming the UUIDs the kubelet picked.

It serves `v1beta1.DevicePlugin` on its own socket in the kubelet's device plugin folder and
registers there with the kubelet's `v1beta1.Registration`; when the kubelet's socket is made again (a
kubelet restart), it registers again, as a real plugin must. A GPU turned unhealthy (`set_health`) is
sent to the kubelet at once through the open ListAndWatch stream. Every Allocate is recorded
(`allocated`), so a test sees what the kubelet asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc

from sharegpu.api import names
from sharegpu.devcluster import deviceplugin_pb2 as pb
from sharegpu.serving import unixgrpc

FOLDER = Path("/var/lib/kubelet/device-plugins")
"""The kubelet's device plugin folder: fixed in the kubelet, whatever its --root-dir."""
KUBELET_SOCKET = "kubelet.sock"
VERSION = "v1beta1"
SERVICE = "v1beta1.DevicePlugin"
REGISTER = "/v1beta1.Registration/Register"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
VISIBLE = "NVIDIA_VISIBLE_DEVICES"

log = logging.getLogger(__name__)


_Context = grpc.aio.ServicerContext[bytes, bytes]


class _Handler(unixgrpc.GenericHandler):
    def __init__(self, plugin: FakeDevicePlugin) -> None:
        self.plugin = plugin

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = details.method
        service, _, name = method.strip("/").partition("/")
        if service != SERVICE:
            return None
        if name == "ListAndWatch":
            return grpc.unary_stream_rpc_method_handler(
                self.plugin.list_and_watch, request_deserializer=unixgrpc.raw, response_serializer=unixgrpc.raw
            )
        answers = {"GetDevicePluginOptions": self.plugin.options, "Allocate": self.plugin.allocate}
        answer = answers.get(name)
        if answer is None:
            return None  # GetPreferredAllocation and PreStartContainer: not offered in the options
        return grpc.unary_unary_rpc_method_handler(
            answer, request_deserializer=unixgrpc.raw, response_serializer=unixgrpc.raw
        )


class FakeDevicePlugin:
    """Offers `uuids` as `nvidia.com/gpu` to the kubelet whose device plugin folder is `folder`."""

    def __init__(self, uuids: Iterable[str], name: str, folder: Path = FOLDER) -> None:
        self.health = dict.fromkeys(uuids, HEALTHY)
        self.folder = folder
        self.endpoint = f"sharegpu-fake-nvidia-{name}.sock"
        self.allocated: list[tuple[str, ...]] = []
        self.registrations = 0
        self._changed = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._server = await unixgrpc.serve(self.folder / self.endpoint, [_Handler(self)])
        self._task = asyncio.create_task(self._keep_registered())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        server, self._server = self._server, None
        await unixgrpc.stop(server, self.folder / self.endpoint)

    def set_health(self, uuid: str, healthy: bool) -> None:
        self.health[uuid] = HEALTHY if healthy else UNHEALTHY
        self._changed.set()

    async def options(self, request: bytes, context: _Context) -> bytes:
        return pb.DevicePluginOptions().SerializeToString()

    async def list_and_watch(self, request: bytes, context: _Context) -> AsyncIterator[bytes]:
        while True:
            self._changed.clear()
            devices = [pb.Device(ID=u, health=h) for u, h in self.health.items()]
            yield pb.ListAndWatchResponse(devices=devices).SerializeToString()
            await self._changed.wait()

    async def allocate(self, request: bytes, context: _Context) -> bytes:
        asked = pb.AllocateRequest.FromString(request)
        answers = []
        for container in asked.container_requests:
            ids = tuple(container.devices_ids)
            self.allocated.append(ids)
            answers.append(pb.ContainerAllocateResponse(envs={VISIBLE: ",".join(ids)}))
        return pb.AllocateResponse(container_responses=answers).SerializeToString()

    async def _keep_registered(self) -> None:
        """Register, and register again whenever the kubelet's socket is a new file."""
        registered: tuple[int, int] | None = None
        kubelet = self.folder / KUBELET_SOCKET
        while True:
            try:
                found = kubelet.stat()
                made: tuple[int, int] | None = (found.st_ino, found.st_ctime_ns)  # an inode may be reused
            except FileNotFoundError:
                made = None
            if made is not None and made != registered:
                try:
                    await self._register(kubelet)
                    registered = made
                    self.registrations += 1
                except grpc.aio.AioRpcError as exc:  # the kubelet not serving yet: try again
                    log.debug("fake device plugin: register: %s", exc.code())
            await asyncio.sleep(0.5)

    async def _register(self, kubelet: Path) -> None:
        request = pb.RegisterRequest(version=VERSION, endpoint=self.endpoint, resource_name=names.NVIDIA_GPU)
        async with grpc.aio.insecure_channel(f"unix://{kubelet}") as channel:
            call = channel.unary_unary(REGISTER, request_serializer=unixgrpc.raw, response_deserializer=unixgrpc.raw)
            await call(request.SerializeToString(), timeout=5)
