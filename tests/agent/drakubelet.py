"""The kubelet's side of the plugin protocols, as a gRPC client over a plugin's unix sockets
(pluginregistration v1 for any plugin; DRAPlugin v1 and v1beta1): what the agent's plugin tests drive
its plugins with."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from sharegpu.agent import draplugin, registration
from sharegpu.agent import draplugin_pb2 as pb
from sharegpu.agent import pluginregistration_pb2 as reg

A = TypeVar("A", bound=Message)


async def call(socket: Path, method: str, request: Message, answer: type[A]) -> A:
    """One unary call, as the kubelet makes it (`/<service>/<method>`)."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = channel.unary_unary(method, type(request).SerializeToString, answer.FromString)
        found: A = await stub(request, timeout=5)
        return found


async def info(socket: Path) -> reg.PluginInfo:
    """What the plugin registering at `socket` says it is."""
    return await call(socket, f"/{registration.SERVICE}/GetInfo", reg.InfoRequest(), reg.PluginInfo)


async def notify(socket: Path, registered: bool, error: str = "") -> None:
    """Tell the plugin registering at `socket` whether the kubelet registered it."""
    status = reg.RegistrationStatus(plugin_registered=registered, error=error)
    await call(socket, f"/{registration.SERVICE}/NotifyRegistrationStatus", status, reg.RegistrationStatusResponse)


class Kubelet:
    """What the kubelet does with a DRA plugin, over its sockets."""

    def __init__(self, paths: draplugin.Paths, namespace: str = "ns") -> None:
        self.paths = paths
        self.namespace = namespace
        self.call = call

    async def info(self) -> reg.PluginInfo:
        return await info(self.paths.registration_socket)

    async def notify(self, registered: bool, error: str = "") -> None:
        await notify(self.paths.registration_socket, registered, error)

    async def prepare(self, *claims: tuple[str, str], version: str = "v1") -> pb.NodePrepareResourcesResponse:
        method = f"/k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin/NodePrepareResources"
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=self.namespace, name=n, uid=u) for n, u in claims]
        )
        return await self.call(self.paths.plugin_socket, method, request, pb.NodePrepareResourcesResponse)

    async def unprepare(self, *claims: tuple[str, str]) -> pb.NodeUnprepareResourcesResponse:
        method = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=self.namespace, name=n, uid=u) for n, u in claims]
        )
        return await self.call(self.paths.plugin_socket, method, request, pb.NodeUnprepareResourcesResponse)
