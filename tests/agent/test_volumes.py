"""The agent's CSI node plugin (`agent.volumes`): what it binds for a publish, decided from the pod as
the agent knows it (never from what the pod's author wrote beyond which of its containers a volume is
for), driven over its unix sockets as the kubelet drives it (CSI v1, pluginregistration v1); and the
real bind mounts held against the fake's contract."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc
import msgspec
import pytest

from sharegpu.agent import csi_pb2 as pb
from sharegpu.agent import mps, volumes
from sharegpu.api import handoff, names, wire
from tests import builders
from tests.agent import drakubelet

NODE = "n0"
DEVICE = wire.DeviceSpec(
    gpus=[wire.GpuSpec(index=i, uuid=f"GPU-{i}", model="NVIDIA A100", memory_mib=16384) for i in range(2)]
)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory: a unix socket's path must fit in 108 bytes."""
    made = Path(tempfile.mkdtemp(prefix="vol-", dir="/tmp"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def sharer(name: str = "p", isolation: str | None = "mps", index: int = 1, container: str = "main") -> wire.Pod:
    alloc = builders.MakeAllocation(f"ns/{name}", NODE).container(container)
    alloc.grant(index, 300, 2048, container=container)
    made = builders.MakePod(name, "ns").uid(f"uid-{name}").allocation(alloc.obj())
    if isolation is not None:
        made.annotations({names.ISOLATION: isolation})
    return made.node(NODE).container(container).wire()


def reservation(index: int, uuid: str | None) -> wire.Pod:
    made = builders.MakePod(f"sharegpu-reserve-{NODE}-{index}", names.HOLDING_NAMESPACE).uid(f"uid-r{index}")
    made.labels({names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: NODE, names.LABEL_SLOT: str(index)})
    if uuid is not None:
        made.annotations({names.GPU_UUID: uuid})
    return made.node(NODE).container(limits={names.NVIDIA_GPU: "1"}).wire()


def context(pod: str = "p", folder: str = "mps", container: str = "main", **extra: str) -> dict[str, str]:
    return {volumes.POD_NAME: pod, volumes.POD_NAMESPACE: "ns", volumes.POD_UID: f"uid-{pod}",
            volumes.EPHEMERAL: "true", handoff.VOLUME_FOLDER: folder, handoff.VOLUME_CONTAINER: container,
            **extra}  # fmt: skip


class Node:
    """The node's folders, as the agent made them (an MPS daemon per GPU, HAMi-core installed)."""

    def __init__(self, root: Path) -> None:
        self.layout = mps.Layout(root / "mps")
        for gpu in DEVICE.gpus:
            self.layout.tenant_pipe(gpu.uuid).mkdir(parents=True)
        (root / "hami").mkdir()
        self.folders = volumes.Folders(self.layout, root / "hami")

    def decide(
        self, ctx: Mapping[str, str], *pods: wire.Pod, spec: wire.DeviceSpec | None = DEVICE
    ) -> volumes.Decision:
        return volumes.resolve(ctx, {p.metadata.uid: p for p in pods}, spec, self.folders)


def test_an_mps_container_gets_the_tenant_folder_of_the_gpu_its_reservation_reported(tmp_path: Path) -> None:
    node = Node(tmp_path)
    # Slot 1's reservation reported GPU-0 (the device plugin numbers GPUs otherwise than the Device).
    found = node.decide(context(), sharer(index=1), reservation(1, "GPU-0"), reservation(0, "GPU-1"))
    assert found == volumes.Decision(volumes.Verdict.BIND, source=node.layout.tenant("GPU-0"))


def test_a_reservation_being_deleted_names_no_gpu(tmp_path: Path) -> None:
    """Slot 1's reservation is going (its last sharer left) when a new sharer lands there: the hand-off
    names the GPU its successor reports, which may be another, so the plugin waits for that report
    rather than mount the old GPU's tenant folder for the pod's whole life."""
    going = reservation(1, "GPU-0")
    going = msgspec.structs.replace(
        going,
        metadata=msgspec.structs.replace(going.metadata, uid="uid-old", deletion_timestamp="2026-12-07T04:00:00Z"),
    )
    node = Node(tmp_path)
    found = node.decide(context(), sharer(index=1), going, reservation(1, None))
    assert found.verdict is volumes.Verdict.WAIT and "not reported by its reservation" in found.reason
    found = node.decide(context(), sharer(index=1), going, reservation(1, "GPU-1"))
    assert found == volumes.Decision(volumes.Verdict.BIND, source=node.layout.tenant("GPU-1"))


@pytest.mark.parametrize(
    ("why", "pods", "verdict", "reason"),
    [
        ("not seen yet", [], volumes.Verdict.WAIT, "pod ns/p (UID uid-p) is not yet seen on this node"),
        ("no report yet", [sharer(), reservation(1, None)], volumes.Verdict.WAIT,
         "GPU 1 of pod ns/p is not reported by its reservation yet"),
        ("no reservation", [sharer()], volumes.Verdict.WAIT, "GPU 1 of pod ns/p is not reported by its reservation"),
        ("a UUID not here", [sharer(), reservation(1, "GPU-9")], volumes.Verdict.WAIT, "not reported"),
        ("not mps", [sharer(isolation="hami-core"), reservation(1, "GPU-1")], volumes.Verdict.REFUSE,
         "pod ns/p does not demand isolation mps"),
        ("no demand", [sharer(isolation=None), reservation(1, "GPU-1")], volumes.Verdict.REFUSE,
         "does not demand isolation mps"),
        ("another container", [sharer(container="side"), reservation(1, "GPU-1")], volumes.Verdict.REFUSE,
         "container 'main' of pod ns/p holds no shared GPU of this node"),
    ],
)  # fmt: skip
def test_what_is_not_known_yet_waits_and_what_is_not_the_pods_is_refused(
    tmp_path: Path, why: str, pods: list[wire.Pod], verdict: volumes.Verdict, reason: str
) -> None:
    found = Node(tmp_path).decide(context(), *pods)
    assert (found.verdict, found.source) == (verdict, None), why
    assert reason in found.reason, why


def test_a_pod_of_the_same_name_but_another_uid_is_not_the_one_published(tmp_path: Path) -> None:
    other = sharer()
    found = Node(tmp_path).decide(context(**{volumes.POD_UID: "uid-stale"}), other, reservation(1, "GPU-1"))
    assert found.verdict is volumes.Verdict.WAIT


def test_the_volume_context_must_name_the_pod_an_inline_volume_and_a_known_folder(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pods = (sharer(), reservation(1, "GPU-1"))
    for ctx, reason in [
        ({k: v for k, v in context().items() if k != volumes.POD_UID}, "must have podInfoOnMount: true"),
        ({**context(), volumes.EPHEMERAL: "false"}, "serves only inline (ephemeral) volumes"),
        (context(folder="etc"), "volume attribute folder='etc': must be mps or hami-core"),
    ]:
        found = node.decide(ctx, *pods)
        assert found.verdict is volumes.Verdict.REFUSE and reason in found.reason


def test_hami_core_folder_only_for_a_pod_that_demands_it_and_no_mps_without_daemons(tmp_path: Path) -> None:
    node = Node(tmp_path)
    assert node.decide(context(folder="hami-core"), sharer(isolation="hami-core")).source == tmp_path / "hami"
    refused = node.decide(context(folder="hami-core"), sharer(isolation="mps"))
    assert refused.verdict is volumes.Verdict.REFUSE and "does not demand isolation hami-core" in refused.reason
    bare = volumes.resolve(context(), {"uid-p": sharer()}, DEVICE, volumes.Folders(None, tmp_path / "hami"))
    assert bare.verdict is volumes.Verdict.REFUSE and "runs no MPS daemons" in bare.reason


def test_a_folder_not_made_yet_or_replaced_by_a_link_is_waited_for(tmp_path: Path) -> None:
    node = Node(tmp_path)
    pods = (sharer(), reservation(1, "GPU-1"))
    tenant = node.layout.tenant("GPU-1")
    shutil.rmtree(tenant)
    assert node.decide(context(), *pods).verdict is volumes.Verdict.WAIT
    tenant.symlink_to("/etc")
    found = node.decide(context(), *pods)
    assert found.verdict is volumes.Verdict.WAIT and "is not a directory" in found.reason


class Csi:
    """The kubelet's side of CSI v1 over the plugin's socket."""

    def __init__(self, paths: volumes.Paths) -> None:
        self.paths = paths

    async def publish(self, target: Path, ctx: dict[str, str]) -> pb.Empty:
        request = pb.NodePublishVolumeRequest(
            volume_id="csi-abc", target_path=str(target), readonly=True, volume_context=ctx,
            volume_capability=pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume()),
        )  # fmt: skip
        return await drakubelet.call(self.paths.plugin_socket, f"/{volumes.NODE}/NodePublishVolume", request, pb.Empty)

    async def unpublish(self, target: Path) -> None:
        request = pb.NodeUnpublishVolumeRequest(volume_id="csi-abc", target_path=str(target))
        await drakubelet.call(self.paths.plugin_socket, f"/{volumes.NODE}/NodeUnpublishVolume", request, pb.Empty)


async def test_the_kubelet_registers_the_plugin_publishes_and_unpublishes_through_it(short_dir: Path) -> None:
    node = Node(short_dir)
    paths = volumes.Paths.under(short_dir / "plugins", short_dir / "registry")
    pods = [sharer(), reservation(1, None)]
    mounts = volumes.FakeMounts()
    plugin = volumes.VolumesPlugin(NODE, paths, lambda ctx: node.decide(ctx, *pods), mounts)
    await plugin.start()
    try:
        info = await drakubelet.info(paths.registration_socket)
        assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
            "CSIPlugin", "volumes.sharegpu.io", str(paths.plugin_socket), ["1.0.0"]
        )  # fmt: skip
        await drakubelet.notify(paths.registration_socket, True)
        assert plugin.registration.status() == "registered"
        about = await drakubelet.call(
            paths.plugin_socket, f"/{volumes.NODE}/NodeGetInfo", pb.Empty(), pb.NodeGetInfoResponse
        )
        assert about.node_id == NODE
        csi = Csi(paths)
        target = short_dir / "pods" / "uid-p" / "mount"
        with pytest.raises(grpc.aio.AioRpcError) as waiting:
            await csi.publish(target, context())
        assert waiting.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "not reported by its reservation yet" in str(waiting.value.details())
        assert mounts.mounts == {}

        pods[1] = reservation(1, "GPU-1")
        await csi.publish(target, context())
        await csi.publish(target, context())  # the kubelet retrying: the same mount, once
        assert mounts.mounts == {target: node.layout.tenant("GPU-1")}

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await csi.publish(short_dir / "other", context(container="side"))
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "container 'side' of pod ns/p holds no shared GPU" in str(refused.value.details())

        nameless = (
            ("NodePublishVolume", pb.NodePublishVolumeRequest(volume_id="csi-abc", volume_context=context())),
            ("NodeUnpublishVolume", pb.NodeUnpublishVolumeRequest(volume_id="csi-abc")),
        )
        for call, request in nameless:
            with pytest.raises(grpc.aio.AioRpcError) as no_target:
                await drakubelet.call(paths.plugin_socket, f"/{volumes.NODE}/{call}", request, pb.Empty)
            assert no_target.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert no_target.value.details() == f"{call} names no target_path"
        assert mounts.mounts == {target: node.layout.tenant("GPU-1")}

        await csi.unpublish(target)
        await csi.unpublish(target)  # gone already: done
        assert mounts.mounts == {} and not target.exists()
    finally:
        await plugin.stop()
    assert not paths.plugin_socket.exists() and not paths.registration_socket.exists()


def _can_mount() -> bool:
    return os.geteuid() == 0 and Path("/proc/self/mountinfo").exists()


@pytest.mark.parametrize("make", [volumes.FakeMounts, volumes.BindMounts])
def test_bind_mounts_keep_the_fakes_contract(tmp_path: Path, make: type[volumes.Mounter]) -> None:
    if make is volumes.BindMounts and not _can_mount():
        pytest.skip("bind mounts need root")
    mounter = make()
    source = tmp_path / "source"
    (source / "pipe").mkdir(parents=True)
    target = tmp_path / "pods" / "volume" / "mount"
    assert not mounter.bound(target)
    mounter.bind(source, target)
    try:
        assert mounter.bound(target)
        mounter.bind(source, target)  # again: left as it is
        if make is volumes.BindMounts:
            assert (target / "pipe").is_dir(), "the source's content is seen at the target"
            with pytest.raises(OSError, match="Read-only file system"):
                (target / "planted").write_text("x")
            assert not (source / "planted").exists()
            assert Path("/proc/self/mountinfo").read_text().count(f" {target} ") == 1, "bound once"
    finally:
        mounter.unbind(target)
    assert not mounter.bound(target) and not target.exists()
    mounter.unbind(target)  # gone: done
