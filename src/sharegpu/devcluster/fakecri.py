"""A fake container runtime at the kubelet's CRI seam (runtime.v1), so that a real kubelet runs pods
where no container runtime exists. It keeps pod sandboxes and containers as records and runs no
process: a started container is running until the kubelet stops it.

What a real runtime does with a container's configuration, it does with the record: the variables
the kubelet resolved (values, ConfigMap and Secret references, a device plugin's Allocate answer)
are kept; the CDI devices the kubelet names (from DRA kubelet plugins, or a device plugin's answer)
are resolved against the CDI spec files in `cdi_dirs` and their container edits applied (variables,
device nodes, mounts), and a device no spec defines fails the container's creation, as containerd
does. So a test reads, per container, exactly what it would have been given (`containers`).

Every image is present (`ImageStatus` answers for any name), so nothing is pulled. Lists honour
their filters (id, state, sandbox, labels), which is how the kubelet finds a pod's sandboxes and
containers. The streaming lists are answered UNIMPLEMENTED (the kubelet then uses the plain ones);
stats, metrics and the rest are empty messages.

`on_start` callbacks run when a container starts, with its record: what the container's own process
would do at once (e.g. `sharegpu reserve` reporting the GPU its environment names) is played there.
Every call is counted by method (`calls`), so a test can see how far the kubelet got.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import stat
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson

from sharegpu.devcluster import cri_pb2 as pb
from sharegpu.serving import unixgrpc

RUNTIME = "runtime.v1.RuntimeService"
IMAGES = "runtime.v1.ImageService"
EVENTS = "GetContainerEvents"
"""The one stream kept open (empty: the kubelet's evented PLEG is off by default)."""
POD_NAME = "io.kubernetes.pod.name"
POD_NAMESPACE = "io.kubernetes.pod.namespace"
POD_UID = "io.kubernetes.pod.uid"
CONTAINER_NAME = "io.kubernetes.container.name"
"""The labels the kubelet puts on every sandbox and container it creates (and reads back)."""

log = logging.getLogger(__name__)


class CdiError(Exception):
    """A CDI device no spec defines (the container is not created)."""


@dataclass(slots=True)
class Sandbox:
    id: str
    metadata: pb.PodSandboxMetadata
    labels: dict[str, str]
    annotations: dict[str, str]
    runtime_handler: str
    created_at: int
    ip: str
    state: pb.PodSandboxState = pb.SANDBOX_READY

    def listed(self) -> pb.PodSandbox:
        return pb.PodSandbox(
            id=self.id, metadata=self.metadata, state=self.state, created_at=self.created_at,
            labels=self.labels, annotations=self.annotations, runtime_handler=self.runtime_handler,
        )  # fmt: skip

    def status(self) -> pb.PodSandboxStatus:
        return pb.PodSandboxStatus(
            id=self.id, metadata=self.metadata, state=self.state, created_at=self.created_at,
            network=pb.PodSandboxNetworkStatus(ip=self.ip), labels=self.labels, annotations=self.annotations,
            runtime_handler=self.runtime_handler,
        )  # fmt: skip


@dataclass(slots=True)
class Container:
    """One container as created: its configuration, and what the runtime gave it on top (CDI)."""

    id: str
    sandbox_id: str
    config: pb.ContainerConfig
    env: dict[str, str]
    """The container's variables: the kubelet's, then the CDI edits' (which win)."""
    cdi_devices: tuple[str, ...]
    device_nodes: tuple[str, ...]
    """Host device paths: the kubelet's (device plugins) and the CDI edits'."""
    mounts: tuple[tuple[str, str], ...]
    """(host path, container path) of every mount: the kubelet's and the CDI edits'."""
    created_at: int
    state: pb.ContainerState = pb.CONTAINER_CREATED
    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0

    @property
    def namespace(self) -> str:
        return self.config.labels.get(POD_NAMESPACE, "")

    @property
    def pod(self) -> str:
        return self.config.labels.get(POD_NAME, "")

    @property
    def name(self) -> str:
        return self.config.metadata.name

    def listed(self) -> pb.Container:
        image = self.config.image
        return pb.Container(
            id=self.id, pod_sandbox_id=self.sandbox_id, metadata=self.config.metadata, image=image,
            image_ref=_image_id(image.image), state=self.state, created_at=self.created_at,
            labels=self.config.labels, annotations=self.config.annotations, image_id=_image_id(image.image),
        )  # fmt: skip

    def status(self) -> pb.ContainerStatus:
        image = self.config.image
        exited = self.state == pb.CONTAINER_EXITED
        return pb.ContainerStatus(
            id=self.id, metadata=self.config.metadata, state=self.state, created_at=self.created_at,
            started_at=self.started_at, finished_at=self.finished_at, exit_code=self.exit_code,
            image=image, image_ref=_image_id(image.image), image_id=_image_id(image.image),
            reason="Completed" if exited else "", labels=self.config.labels,
            annotations=self.config.annotations, log_path=self.config.log_path,
            mounts=[pb.Mount(host_path=h, container_path=c) for h, c in self.mounts],
        )  # fmt: skip


@dataclass(slots=True)
class _Edits:
    env: dict[str, str] = field(default_factory=dict)
    device_nodes: list[str] = field(default_factory=list)
    mounts: list[tuple[str, str]] = field(default_factory=list)

    def apply(self, edits: Mapping[str, Any]) -> None:
        for entry in edits.get("env") or ():
            key, _, value = str(entry).partition("=")
            self.env[key] = value
        self.device_nodes.extend(str(d["path"]) for d in edits.get("deviceNodes") or ())
        self.mounts.extend((str(m["hostPath"]), str(m["containerPath"])) for m in edits.get("mounts") or ())


def resolve_cdi(dirs: Iterable[Path], wanted: Iterable[str]) -> _Edits:
    """The container edits of the CDI devices `wanted` (`vendor/class=name`), read from the JSON spec
    files in `dirs`: each spec's own edits once, then each device's. Raises CdiError naming the
    devices no spec defines."""
    wanted = list(wanted)
    specs: dict[str, Mapping[str, Any]] = {}
    devices: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for directory in dirs:
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            try:
                spec = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError) as exc:  # a spec being replaced: it is read again next time
                log.debug("fake CRI: spec %s unreadable: %s", path, exc)
                continue
            specs[str(path)] = spec
            for device in spec.get("devices") or ():
                devices[f"{spec.get('kind')}={device.get('name')}"] = (str(path), device)
    missing = [name for name in wanted if name not in devices]
    if missing:
        raise CdiError(f"unresolvable CDI devices {', '.join(missing)}")
    out = _Edits()
    for spec_path in dict.fromkeys(devices[name][0] for name in wanted):
        out.apply(specs[spec_path].get("containerEdits") or {})
    for name in wanted:
        out.apply(devices[name][1].get("containerEdits") or {})
    return out


def toolkit_spec(uuids: Iterable[str], device_dir: Path | None = None) -> dict[str, Any]:
    """The NVIDIA container toolkit's CDI spec for the GPUs `uuids` in the shape `nvidia-ctk cdi
    generate --device-name-strategy=uuid` writes (kind nvidia.com/gpu, a device per UUID giving its
    device node), for a node that has no toolkit: index i's node is /dev/nvidia<i>, taken from
    `device_dir` (`fake_device_nodes`) when given, for a real runtime to create in the container."""

    def node(name: str) -> dict[str, str]:
        return {"path": f"/dev/{name}"} | ({"hostPath": str(device_dir / name)} if device_dir is not None else {})

    return {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": u, "containerEdits": {"deviceNodes": [node(f"nvidia{i}")]}} for i, u in enumerate(uuids)],
        "containerEdits": {"deviceNodes": [node("nvidiactl"), node("nvidia-uvm")]},
    }


def fake_device_nodes(device_dir: Path, count: int) -> None:
    """Character devices in `device_dir` numbered as the NVIDIA driver's are (major 195: nvidia<i> minor
    i, nvidiactl 255; nvidia-uvm, whose major is dynamic, 195/254 here), for `toolkit_spec`'s hostPaths."""
    device_dir.mkdir(parents=True, exist_ok=True)
    for name, minor in [*((f"nvidia{i}", i) for i in range(count)), ("nvidiactl", 255), ("nvidia-uvm", 254)]:
        path = device_dir / name
        if not path.exists():
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(195, minor))


def _now() -> int:
    return time.time_ns()


def _image_id(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def _labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


_Context = grpc.aio.ServicerContext[bytes, bytes]
_Method = Callable[[bytes, _Context], Awaitable[bytes]]


class _Handler(unixgrpc.GenericHandler):
    def __init__(self, cri: FakeCri) -> None:
        self.cri = cri

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = details.method
        service, _, name = method.strip("/").partition("/")
        if service not in (RUNTIME, IMAGES):
            return None
        self.cri.calls[name] += 1
        if name == EVENTS:
            return grpc.unary_stream_rpc_method_handler(
                self._events, request_deserializer=unixgrpc.raw, response_serializer=unixgrpc.raw
            )
        if name.startswith("Stream"):
            return None  # UNIMPLEMENTED: the kubelet then uses the plain lists
        answer: _Method = getattr(self.cri, f"_{name}", _empty)
        return grpc.unary_unary_rpc_method_handler(
            answer, request_deserializer=unixgrpc.raw, response_serializer=unixgrpc.raw
        )

    async def _events(self, request: bytes, context: _Context) -> AsyncIterator[bytes]:
        await asyncio.Event().wait()  # no events, ever (until the kubelet goes)
        yield b""


async def _empty(request: bytes, context: _Context) -> bytes:
    return b""  # an empty message: no stats, metrics or configuration


class FakeCri:
    """Serves the fake runtime on a unix socket; `sandboxes` and `containers` are what it holds."""

    def __init__(self, socket_path: Path, *, cdi_dirs: Iterable[Path] = ()) -> None:
        self.socket_path = socket_path
        self.cdi_dirs = tuple(cdi_dirs)
        self.calls: Counter[str] = Counter()
        self.sandboxes: dict[str, Sandbox] = {}
        self.containers: dict[str, Container] = {}
        self.on_start: list[Callable[[Container], Awaitable[None]]] = []
        self._ips = itertools.count(2)
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: grpc.aio.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket_path}"

    def running(self, namespace: str, pod: str) -> dict[str, Container]:
        """The running containers of one pod, by container name."""
        return {
            c.name: c
            for c in self.containers.values()
            if c.namespace == namespace and c.pod == pod and c.state == pb.CONTAINER_RUNNING
        }

    async def start(self) -> None:
        self._server = await unixgrpc.serve(self.socket_path, [_Handler(self)])

    async def stop(self) -> None:
        server, self._server = self._server, None
        await unixgrpc.stop(server, self.socket_path)
        for task in list(self._tasks):
            task.cancel()

    # The runtime service.

    async def _Version(self, request: bytes, context: _Context) -> bytes:  # noqa: N802 - the CRI's names
        return pb.VersionResponse(
            version="0.1.0", runtime_name="sharegpu-fake-cri", runtime_version="0.2.0", runtime_api_version="v1"
        ).SerializeToString()

    async def _Status(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        ready = [pb.RuntimeCondition(type=t, status=True) for t in ("RuntimeReady", "NetworkReady")]
        return pb.StatusResponse(status=pb.RuntimeStatus(conditions=ready)).SerializeToString()

    async def _RunPodSandbox(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        asked = pb.RunPodSandboxRequest.FromString(request)
        config = asked.config
        n = next(self._ips)
        sandbox = Sandbox(
            id=uuid.uuid4().hex, metadata=config.metadata, labels=dict(config.labels),
            annotations=dict(config.annotations), runtime_handler=asked.runtime_handler, created_at=_now(),
            ip=f"10.88.{n // 250 % 250}.{n % 250 + 2}",
        )  # fmt: skip
        self.sandboxes[sandbox.id] = sandbox
        return pb.RunPodSandboxResponse(pod_sandbox_id=sandbox.id).SerializeToString()

    async def _StopPodSandbox(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        sandbox = self.sandboxes.get(pb.PodSandboxIdRequest.FromString(request).pod_sandbox_id)
        if sandbox is not None:  # stopping what is gone is no error
            sandbox.state = pb.SANDBOX_NOTREADY
            for container in self.containers.values():
                if container.sandbox_id == sandbox.id:
                    self._exit(container)
        return b""

    async def _RemovePodSandbox(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        sandbox_id = pb.PodSandboxIdRequest.FromString(request).pod_sandbox_id
        self.sandboxes.pop(sandbox_id, None)
        for key in [k for k, c in self.containers.items() if c.sandbox_id == sandbox_id]:
            del self.containers[key]
        return b""

    async def _PodSandboxStatus(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        sandbox_id = pb.PodSandboxIdRequest.FromString(request).pod_sandbox_id
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pod sandbox {sandbox_id}")
        assert sandbox is not None  # abort raises
        return pb.PodSandboxStatusResponse(status=sandbox.status()).SerializeToString()

    async def _ListPodSandbox(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        wanted = pb.ListPodSandboxRequest.FromString(request).filter
        items = [
            s.listed()
            for s in self.sandboxes.values()
            if (not wanted.id or s.id == wanted.id)
            and (not wanted.HasField("state") or s.state == wanted.state.state)
            and _labels_match(s.labels, wanted.label_selector)
        ]
        return pb.ListPodSandboxResponse(items=items).SerializeToString()

    async def _CreateContainer(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        asked = pb.CreateContainerRequest.FromString(request)
        if asked.pod_sandbox_id not in self.sandboxes:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pod sandbox {asked.pod_sandbox_id}")
        config = asked.config
        cdi = tuple(d.name for d in config.CDI_devices)
        try:
            edits = resolve_cdi(self.cdi_dirs, cdi)
        except CdiError as exc:  # as containerd: the container is not created
            await context.abort(grpc.StatusCode.UNKNOWN, f"failed to inject CDI devices: {exc}")
        env = {kv.key: kv.value for kv in config.envs}
        env.update(edits.env)
        container = Container(
            id=uuid.uuid4().hex, sandbox_id=asked.pod_sandbox_id, config=config, env=env, cdi_devices=cdi,
            device_nodes=(*(d.host_path for d in config.devices), *edits.device_nodes),
            mounts=(*((m.host_path, m.container_path) for m in config.mounts), *edits.mounts), created_at=_now(),
        )  # fmt: skip
        self.containers[container.id] = container
        return pb.CreateContainerResponse(container_id=container.id).SerializeToString()

    async def _StartContainer(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        container = await self._container(request, context)
        if container.state != pb.CONTAINER_CREATED:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"container {container.id} is not created")
        container.state, container.started_at = pb.CONTAINER_RUNNING, _now()
        for callback in self.on_start:
            task = asyncio.create_task(self._call(callback, container))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return b""

    async def _StopContainer(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        container = self.containers.get(pb.ContainerIdRequest.FromString(request).container_id)
        if container is not None:
            self._exit(container)
        return b""

    async def _RemoveContainer(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        self.containers.pop(pb.ContainerIdRequest.FromString(request).container_id, None)
        return b""

    async def _ListContainers(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        wanted = pb.ListContainersRequest.FromString(request).filter
        found = [
            c.listed()
            for c in self.containers.values()
            if (not wanted.id or c.id == wanted.id)
            and (not wanted.pod_sandbox_id or c.sandbox_id == wanted.pod_sandbox_id)
            and (not wanted.HasField("state") or c.state == wanted.state.state)
            and _labels_match(c.config.labels, wanted.label_selector)
        ]
        return pb.ListContainersResponse(containers=found).SerializeToString()

    async def _ContainerStatus(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        container = await self._container(request, context)
        return pb.ContainerStatusResponse(status=container.status()).SerializeToString()

    # The image service: every image is present.

    async def _ImageStatus(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        spec = pb.ImageStatusRequest.FromString(request).image
        image = pb.Image(id=_image_id(spec.image), repo_tags=[spec.image], size=1, spec=spec)
        return pb.ImageStatusResponse(image=image).SerializeToString()

    async def _PullImage(self, request: bytes, context: _Context) -> bytes:  # noqa: N802
        spec = pb.PullImageRequest.FromString(request).image
        return pb.PullImageResponse(image_ref=_image_id(spec.image)).SerializeToString()

    async def _container(self, request: bytes, context: _Context) -> Container:
        container_id = pb.ContainerIdRequest.FromString(request).container_id
        container = self.containers.get(container_id)
        if container is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no container {container_id}")
        assert container is not None  # abort raises
        return container

    def _exit(self, container: Container) -> None:
        if container.state != pb.CONTAINER_EXITED:
            container.state, container.finished_at = pb.CONTAINER_EXITED, _now()
            container.started_at = container.started_at or container.finished_at

    async def _call(self, callback: Callable[[Container], Awaitable[None]], container: Container) -> None:
        try:
            await callback(container)
        except Exception:  # a callback's fault is the test's to see in the log, not the runtime's
            log.exception("fake CRI: on_start for %s/%s failed", container.namespace, container.pod)
