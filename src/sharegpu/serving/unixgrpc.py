"""gRPC servers on unix sockets, as the kubelet's protocols want them (the DRA plugin and its
registration, and the fakes of the kubelet's PodResources and of a container runtime): a socket
left by an earlier process is replaced, and stopping removes it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # generic in the stubs only
    GenericHandler = grpc.GenericRpcHandler[Any, Any]
else:
    GenericHandler = grpc.GenericRpcHandler
"""The base of a handler that routes methods itself (the fakes answering raw messages)."""


def unary(handler: Any, request: Any, response: Any) -> grpc.RpcMethodHandler[Any, Any]:
    """A unary method served by `handler`, its messages the protobuf types `request` and `response`."""
    return grpc.unary_unary_rpc_method_handler(
        handler, request_deserializer=request.FromString, response_serializer=response.SerializeToString
    )


def raw(value: bytes) -> bytes:
    """The (de)serializer of a handler that reads and writes its messages' bytes itself."""
    return value


async def serve(socket: Path, handlers: list[grpc.GenericRpcHandler[Any, Any]]) -> grpc.aio.Server:
    """Serve `handlers` on `socket` (its folder made, a file already there replaced)."""
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(handlers)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    return server


async def stop(server: grpc.aio.Server | None, socket: Path | None) -> None:
    """Stop serving (calls in flight end cancelled) and remove the socket."""
    if server is not None:
        await server.stop(grace=None)
    if socket is not None:
        socket.unlink(missing_ok=True)
