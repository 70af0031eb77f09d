"""A fake container runtime at the kubelet's CRI seam (runtime.v1), enough for a real kubelet to run
and admit pods, where no container runtime exists: it says what it is (`Version`), that it is ready
(`Status`: RuntimeReady and NetworkReady), and that it holds nothing (every List, stats and image
query answered with an empty message). It runs nothing: creating a pod sandbox or a container is
answered UNIMPLEMENTED, so the kubelet's work for a pod ends there, after it prepared the pod's
resources (the DRA kubelet plugins' NodePrepareResources among them), and it retries.

Every call is counted by method (`calls`), so a test can see how far the kubelet got. The few
answers with content are typed (`cri.proto`); an empty message needs no type.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from sharegpu.devcluster import cri_pb2 as pb
from sharegpu.serving import unixgrpc

RUNTIME = "runtime.v1.RuntimeService"
IMAGES = "runtime.v1.ImageService"
STREAMS = frozenset({"GetContainerEvents"})
"""Methods that answer a stream (kept open, empty)."""
REFUSED = frozenset({"RunPodSandbox", "CreateContainer", "StartContainer", "PullImage"})
"""What the fake does not do (UNIMPLEMENTED): it runs nothing."""


def _raw(value: bytes) -> bytes:
    return value


if TYPE_CHECKING:  # generic in the stubs only
    _Base = grpc.GenericRpcHandler[Any, Any]
else:
    _Base = grpc.GenericRpcHandler


class _Handler(_Base):
    def __init__(self, cri: FakeCri) -> None:
        self.cri = cri

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = details.method
        service, _, name = method.strip("/").partition("/")
        if service not in (RUNTIME, IMAGES):
            return None
        self.cri.calls[name] += 1
        if name in STREAMS:
            return grpc.unary_stream_rpc_method_handler(
                self._stream, request_deserializer=_raw, response_serializer=_raw
            )
        return grpc.unary_unary_rpc_method_handler(
            self._answer(name), request_deserializer=_raw, response_serializer=_raw
        )

    def _answer(self, name: str) -> Any:
        async def answer(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            if name == "Version":
                return pb.VersionResponse(
                    version="0.1.0", runtime_name="sharegpu-fake-cri", runtime_version="0.1.0",
                    runtime_api_version="v1",
                ).SerializeToString()  # fmt: skip
            if name == "Status":
                ready = [pb.RuntimeCondition(type=t, status=True) for t in ("RuntimeReady", "NetworkReady")]
                return pb.StatusResponse(status=pb.RuntimeStatus(conditions=ready)).SerializeToString()
            if name in REFUSED:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"the fake CRI does not {name}")
            return b""  # an empty message: no sandboxes, containers, images or stats

        return answer

    async def _stream(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
        await asyncio.Event().wait()  # no events, ever (until the kubelet goes)
        yield b""


class FakeCri:
    """Serves the fake runtime on a unix socket."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.calls: Counter[str] = Counter()
        self._server: grpc.aio.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket_path}"

    async def start(self) -> None:
        self._server = await unixgrpc.serve(self.socket_path, [_Handler(self)])

    async def stop(self) -> None:
        server, self._server = self._server, None
        await unixgrpc.stop(server, self.socket_path)
