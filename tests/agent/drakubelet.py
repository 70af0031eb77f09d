"""The kubelet's side of the DRA plugin protocols, as a gRPC client over the plugin's unix sockets
(pluginregistration v1, DRAPlugin v1 and v1beta1): what the agent's plugin tests drive it with."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from sharegpu.agent import draplugin
from sharegpu.agent import draplugin_pb2 as pb
from sharegpu.agent import pluginregistration_pb2 as reg

A = TypeVar("A", bound=Message)


class Kubelet:
    """What the kubelet does with a DRA plugin, over its sockets."""

    def __init__(self, paths: draplugin.Paths, namespace: str = "ns") -> None:
        self.paths = paths
        self.namespace = namespace

    async def call(self, socket: Path, method: str, request: Message, answer: type[A]) -> A:
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = channel.unary_unary(method, type(request).SerializeToString, answer.FromString)
            found: A = await stub(request, timeout=5)
            return found

    async def info(self) -> reg.PluginInfo:
        method = f"/{draplugin.REGISTRATION}/GetInfo"
        return await self.call(self.paths.registration_socket, method, reg.InfoRequest(), reg.PluginInfo)

    async def notify(self, registered: bool, error: str = "") -> None:
        method = f"/{draplugin.REGISTRATION}/NotifyRegistrationStatus"
        status = reg.RegistrationStatus(plugin_registered=registered, error=error)
        await self.call(self.paths.registration_socket, method, status, reg.RegistrationStatusResponse)

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
