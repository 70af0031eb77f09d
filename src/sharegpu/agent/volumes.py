"""The agent's CSI node plugin: the node-side folders a sharing pod of the extender path needs (its
GPU's MPS tenant folder, the node's HAMi-core library), bound read-only into the pod's volumes by the
agent, so that the pod names no hostPath and its namespace can stay PodSecurity `restricted` (which
allows inline CSI volumes). The DRA path needs none of it: its mounts come through CDI.

The webhook gives such a pod inline ephemeral volumes of the driver `names.VOLUMES_DRIVER`
(`api.handoff.mps_volume`, `api.handoff.hami_volume`), each naming a `folder` (and, for `mps`, the
`container` it is for). The kubelet calls NodePublishVolume with the pod's name, namespace and UID
(the chart's CSIDriver sets podInfoOnMount); `resolve` decides from the pod as the agent's informer
has it, never from what the pod's author wrote beyond which of its own containers a volume is for:

- `mps`: the pod must demand mps and hold, in that container, one GPU of this node by its allocation
  (the annotation only sharegpu writes); the source is that GPU's tenant folder
  (`agent.mps.Layout.tenant`, which holds only the link to its daemon's control socket), the GPU being
  the one the slot's reservation reported, as the hand-off names it;
- `hami-core`: the pod must demand hami-core; the source is the folder the library is installed in.

A refusal (the pod is not one the folder is for) answers FAILED_PRECONDITION with the reason; what is
not known yet (the informer has not seen the pod, the reservation has not reported its GPU, the folder
is not made yet) answers UNAVAILABLE; the kubelet retries both and records them as the pod's events.
NodeUnpublishVolume unmounts and removes the target. Both are idempotent, across agent restarts too:
the mounts are the only state. The mounts themselves go through a narrow `Mounter` (`BindMounts` with
mount(2); `FakeMounts` for the tests, held to it by a contract test).

Served like the DRA plugin: `csi.v1.Identity` and `csi.v1.Node` on `<plugins>/<driver>/csi.sock`,
registered with the kubelet as a `CSIPlugin` (`agent.registration`).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import logging
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import grpc

from sharegpu.agent import csi_pb2 as pb
from sharegpu.agent import host, mps, registration
from sharegpu.api import handoff, names, wire
from sharegpu.api import pods as api_pods
from sharegpu.core import devices
from sharegpu.core import errors as core_errors
from sharegpu.serving import unixgrpc

log = logging.getLogger(__name__)

PLUGIN_TYPE: Final = "CSIPlugin"
VERSIONS: Final = ("1.0.0",)
IDENTITY: Final = "csi.v1.Identity"
NODE: Final = "csi.v1.Node"
POD_NAME: Final = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE: Final = "csi.storage.k8s.io/pod.namespace"
POD_UID: Final = "csi.storage.k8s.io/pod.uid"
EPHEMERAL: Final = "csi.storage.k8s.io/ephemeral"
"""What the kubelet adds to the volume context of a publish (podInfoOnMount; ephemeral for an inline volume)."""


@dataclass(frozen=True, slots=True)
class Paths:
    plugin_socket: Path
    registration_socket: Path

    @classmethod
    def under(cls, plugins: Path = host.KUBELET_PLUGINS_DIR, registry: Path = host.KUBELET_REGISTRY_DIR) -> Paths:
        return cls(*registration.sockets(names.VOLUMES_DRIVER, "csi.sock", plugins, registry))


# ----------------------------------------------------------------- what to bind


class Verdict(enum.Enum):
    BIND = "bind"
    WAIT = "wait"
    """Not known yet: the kubelet is told to try again (UNAVAILABLE)."""
    REFUSE = "refuse"
    """Not the pod's to have (FAILED_PRECONDITION)."""


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    source: Path | None = None
    reason: str = ""

    @classmethod
    def wait(cls, reason: str) -> Decision:
        return cls(Verdict.WAIT, reason=reason)

    @classmethod
    def refuse(cls, reason: str) -> Decision:
        return cls(Verdict.REFUSE, reason=reason)


@dataclass(frozen=True, slots=True)
class Folders:
    """Where the node's folders are: the MPS daemons' layout (None: the node runs none), and the
    folder HAMi-core's library is installed in."""

    mps: mps.Layout | None
    hami_core: Path


def resolve(
    context: Mapping[str, str], live: Mapping[str, wire.Pod], spec: wire.DeviceSpec | None, folders: Folders
) -> Decision:
    """What to bind for a publish whose volume context is `context`, with the node's live pods (UID ->
    pod) and its Device (see the module docstring)."""
    uid, namespace, name = context.get(POD_UID), context.get(POD_NAMESPACE), context.get(POD_NAME)
    if not (uid and namespace and name):
        return Decision.refuse(
            f"the publish names no pod ({POD_UID}, {POD_NAMESPACE}, {POD_NAME}): "
            f"the CSIDriver {names.VOLUMES_DRIVER} must have podInfoOnMount: true"
        )
    if context.get(EPHEMERAL) != "true":
        return Decision.refuse(f"{names.VOLUMES_DRIVER} serves only inline (ephemeral) volumes of a pod")
    folder = context.get(handoff.VOLUME_FOLDER, "")
    if folder not in (handoff.FOLDER_MPS, handoff.FOLDER_HAMI_CORE):
        return Decision.refuse(
            f"volume attribute {handoff.VOLUME_FOLDER}={folder!r}: "
            f"must be {handoff.FOLDER_MPS} or {handoff.FOLDER_HAMI_CORE}"
        )
    pod = live.get(uid)
    if pod is None or (pod.metadata.namespace, pod.metadata.name) != (namespace, name):
        return Decision.wait(f"pod {namespace}/{name} (UID {uid}) is not yet seen on this node")
    demanded = pod.metadata.annotations.get(names.ISOLATION)
    if folder == handoff.FOLDER_HAMI_CORE:
        if demanded != devices.Isolation.HAMI_CORE.value:
            return Decision.refuse(f"pod {namespace}/{name} does not demand isolation hami-core")
        return _existing(folders.hami_core, "HAMi-core's library folder")
    if demanded != devices.Isolation.MPS.value:
        return Decision.refuse(f"pod {namespace}/{name} does not demand isolation mps")
    if folders.mps is None:
        return Decision.refuse("this node runs no MPS daemons (the agent runs without --mps)")
    container = context.get(handoff.VOLUME_CONTAINER, "")
    try:
        alloc = api_pods.allocation_of(pod)
    except core_errors.InvalidInputError as exc:
        return Decision.refuse(f"pod {namespace}/{name}: {exc}")
    grants = next((c.devices for c in alloc.containers if c.name == container), ()) if alloc is not None else ()
    indexes = {g.index for g in grants}
    if alloc is None or alloc.exclusive or len(indexes) != 1:
        return Decision.refuse(
            f"container {container!r} of pod {namespace}/{name} holds no shared GPU of this node "
            "(an mps container holds exactly one)"
        )
    if spec is None:
        return Decision.wait("the node's GPUs are not discovered yet")
    (index,) = indexes
    # The GPU its reservation reported, as the hand-off names it: never the Device's GPU of that index,
    # which may differ where the device plugin numbers GPUs otherwise (the mount lasts the pod's life).
    # Nor one being deleted: the hand-off names its successor's GPU, which may be another.
    slots = [
        slot for pod in live.values()
        if not pod.metadata.deletion_timestamp and (slot := api_pods.slot_of(pod)) is not None and slot.index == index
    ]  # fmt: skip
    uuids = {slot.uuid for slot in slots if slot.uuid} & {g.uuid for g in spec.gpus}
    if len(uuids) != 1:
        return Decision.wait(f"GPU {index} of pod {namespace}/{name} is not reported by its reservation yet")
    (uuid,) = uuids
    return _existing(folders.mps.tenant(uuid), f"the MPS tenant folder of {uuid}")


def _existing(source: Path, what: str) -> Decision:
    """Bind `source` if it is a real directory now; wait for it otherwise."""
    try:
        found = os.lstat(source)
    except FileNotFoundError:
        return Decision.wait(f"{what} ({source}) is not made yet")
    if not stat.S_ISDIR(found.st_mode):
        return Decision.wait(f"{what} ({source}) is not a directory")
    return Decision(Verdict.BIND, source=source)


# ----------------------------------------------------------------- mounting


class Mounter(Protocol):
    """Binds folders read-only at targets (the kubelet's volume paths)."""

    def bind(self, source: Path, target: Path) -> None:
        """Bind `source` read-only (nosuid, nodev) at `target`, made if missing; a target already bound
        is left as it is."""

    def unbind(self, target: Path) -> None:
        """Unmount `target` if bound and remove it; a target that is gone is done."""

    def bound(self, target: Path) -> bool:
        """Whether something is mounted at `target`."""


MS_RDONLY: Final = 0x1
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_REMOUNT: Final = 0x20
MS_BIND: Final = 0x1000
MNT_DETACH: Final = 0x2


class BindMounts:
    """mount(2) and umount2(2) through libc (the agent runs as root with the host's mounts of the
    kubelet's pod folders, propagated both ways)."""

    def __init__(self, mountinfo: Path = Path("/proc/self/mountinfo")) -> None:
        self.mountinfo = mountinfo
        self._libc = ctypes.CDLL(None, use_errno=True)

    def bind(self, source: Path, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        if self.bound(target):
            return
        # Through the folder's own descriptor: a link planted at the last component is not followed.
        fd = os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            self._call("mount", f"/proc/self/fd/{fd}".encode(), bytes(target), None, MS_BIND, None)
        finally:
            os.close(fd)
        try:
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
            self._call("mount", b"none", bytes(target), None, flags, None)
        except OSError:
            self._call("umount2", bytes(target), MNT_DETACH)  # never leave it writable
            raise

    def unbind(self, target: Path) -> None:
        while self.bound(target):
            try:
                self._call("umount2", bytes(target), 0)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                self._call("umount2", bytes(target), MNT_DETACH)
        with contextlib.suppress(FileNotFoundError):
            target.rmdir()

    def bound(self, target: Path) -> bool:
        wanted = os.path.realpath(target)
        with open(self.mountinfo, encoding="utf-8") as lines:
            return any(_unescape(line.split(" ")[4]) == wanted for line in lines)

    def _call(self, function: str, *args: Any) -> None:
        if getattr(self._libc, function)(*args) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{function} {args[1] if function == 'mount' else args[0]!r}: {os.strerror(code)}")


def _unescape(field: str) -> str:
    """A mountinfo path field (space, tab, newline and backslash are written as octal escapes)."""
    for code in ("040", "011", "012", "134"):
        field = field.replace(f"\\{code}", chr(int(code, 8)))
    return field


class FakeMounts:
    """A `Mounter` that records: target -> source (the tests' stand-in for `BindMounts`)."""

    def __init__(self) -> None:
        self.mounts: dict[Path, Path] = {}

    def bind(self, source: Path, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        self.mounts.setdefault(target, source)

    def unbind(self, target: Path) -> None:
        self.mounts.pop(target, None)
        with contextlib.suppress(FileNotFoundError):
            target.rmdir()

    def bound(self, target: Path) -> bool:
        return target in self.mounts


# ----------------------------------------------------------------- the plugin


class VolumesPlugin:
    """Serves the kubelet's CSI node plugin and its registration (see the module docstring)."""

    def __init__(
        self,
        node: str,
        paths: Paths,
        decide: Callable[[Mapping[str, str]], Decision],
        mounter: Mounter | None = None,
    ) -> None:
        self.node = node
        self.paths = paths
        self.decide = decide
        """The publish's volume context -> what to bind (`resolve` over the agent's pods and Device)."""
        self.mounter: Mounter = mounter if mounter is not None else BindMounts()
        self.registration = registration.Registration(
            paths.registration_socket, PLUGIN_TYPE, names.VOLUMES_DRIVER, paths.plugin_socket, VERSIONS
        )
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Serve the plugin, then register it."""
        await self._serve()
        await self.registration.start()

    async def keep(self, every: float = 5.0) -> None:
        """Serve both sockets again whenever one is gone (`registration.Registration.keep`)."""
        await self.registration.keep(self._serve, every)

    async def _serve(self) -> None:
        """Serve the plugin's own socket (anew: a server before is stopped)."""
        await unixgrpc.stop(self._server, None)
        identity = {
            "GetPluginInfo": unixgrpc.unary(self._info, pb.Empty, pb.GetPluginInfoResponse),
            "GetPluginCapabilities": unixgrpc.unary(self._nothing, pb.Empty, pb.Empty),
            "Probe": unixgrpc.unary(self._nothing, pb.Empty, pb.Empty),
        }
        node = {
            "NodeGetInfo": unixgrpc.unary(self._node_info, pb.Empty, pb.NodeGetInfoResponse),
            "NodeGetCapabilities": unixgrpc.unary(self._nothing, pb.Empty, pb.Empty),
            "NodePublishVolume": unixgrpc.unary(self._publish, pb.NodePublishVolumeRequest, pb.Empty),
            "NodeUnpublishVolume": unixgrpc.unary(self._unpublish, pb.NodeUnpublishVolumeRequest, pb.Empty),
        }
        handlers = [
            grpc.method_handlers_generic_handler(IDENTITY, identity),
            grpc.method_handlers_generic_handler(NODE, node),
        ]
        self._server = await unixgrpc.serve(self.paths.plugin_socket, handlers)

    async def stop(self) -> None:
        """Stop serving and remove the sockets (the mounts stay: their pods still run)."""
        await self.registration.stop()
        await unixgrpc.stop(self._server, self.paths.plugin_socket)
        self._server = None

    async def _info(self, request: pb.Empty, context: Any) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=names.VOLUMES_DRIVER, vendor_version="1")

    async def _node_info(self, request: pb.Empty, context: Any) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(node_id=self.node)

    async def _nothing(self, request: pb.Empty, context: Any) -> pb.Empty:
        """The answer without fields: no capabilities (plugin and node), ready (Probe)."""
        return pb.Empty()

    async def _publish(
        self, request: pb.NodePublishVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Empty:
        target = await _target(request, context)
        decision = self.decide(dict(request.volume_context))
        if decision.verdict is not Verdict.BIND or decision.source is None:
            waits = decision.verdict is Verdict.WAIT
            code = grpc.StatusCode.UNAVAILABLE if waits else grpc.StatusCode.FAILED_PRECONDITION
            log.warning("volume %s at %s not published: %s", request.volume_id, target, decision.reason)
            await context.abort(code, decision.reason)
        try:
            self.mounter.bind(decision.source, target)
        except OSError as exc:
            log.error("volume %s: cannot bind %s at %s: %s", request.volume_id, decision.source, target, exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot bind {decision.source} at {target}: {exc}")
        log.info("volume %s: %s bound read-only at %s", request.volume_id, decision.source, target)
        return pb.Empty()

    async def _unpublish(
        self, request: pb.NodeUnpublishVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Empty:
        target = await _target(request, context)
        try:
            self.mounter.unbind(target)
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot unmount {target}: {exc}")
        return pb.Empty()


async def _target(
    request: pb.NodePublishVolumeRequest | pb.NodeUnpublishVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
) -> Path:
    """The call's target path; a call without one ends INVALID_ARGUMENT, naming the call."""
    if not request.target_path:
        call = type(request).__name__.removesuffix("Request")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{call} names no target_path")
    return Path(request.target_path)
