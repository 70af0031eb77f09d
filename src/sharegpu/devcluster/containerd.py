"""A real container runtime for a test node: containerd (built from its Go module by
scripts/build-runtime) running Debian's runc, with a root, state, socket, CNI network and CDI folder
of its own, so that several run side by side on one machine, each a node of its own.

A node's containerd serves the CRI with CDI on (the specs in its `cdi` folder: the fake NVIDIA
toolkit's and sharegpu's DRA plugin's, applied by containerd itself), `restrict_oom_score_adj` (this
machine refuses the negative OOM scores CRI gives sandboxes), no NRI, pods' network namespaces under
its own state folder, and a bridge network of its own
(`sgbr<n>`, 10.244.<n>.0/24, the CNI plugins from the same build). Registries cannot be reached here,
so the images a node needs are made from files and imported (`image_archive`, `Containerd.load`):
the sandbox image (our pause program, under `SANDBOX_IMAGE`, the name the configuration pins) and a
busybox image (Debian's static busybox, `BUSYBOX_IMAGE`).

`Node` is a test node on it: containerd, the real kubelet, fake GPUs (device nodes and the toolkit's
CDI spec). Each node's containerd and kubelet run in a mount namespace of the node's own
(`MountNamespace`), where the machine paths a node's kubelet, runtime and agent use (`NODE_PATHS`:
the kubelet's root, whose device plugin folder the kubelet fixes, the CDI folder, ...) are folders
of the node's: so the chart's default paths hold, and several nodes with GPUs run side by side on
one machine. `stop` leaves nothing behind: the pods are removed through
the CRI (their network namespaces and mounts with them), containerd stops, any shim left is killed,
the namespace's holder ends, what is still mounted under the node's folder is unmounted, and its
bridge is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from sharegpu.api import paths
from sharegpu.devcluster import controlplane, fakecri, fakedeviceplugin
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

VERSION: Final = "2.4.2"
"""containerd's release (`controlplane/containerd-2.4/go.mod`)."""
SANDBOX_IMAGE: Final = "sharegpu.test/pause:1"
"""The sandbox image every node's containerd pins (made from our pause program)."""
BUSYBOX_IMAGE: Final = "sharegpu.test/busybox:1"
"""A shell for test pods: Debian's static busybox, its applets linked in /bin."""
BUSYBOX: Final = Path("/bin/busybox")
"""Debian's busybox-static (scripts/build-runtime installs it when missing)."""
APPLETS: Final = ("sh", "cat", "env", "ls", "sleep", "echo", "grep", "head", "id", "ps", "readlink", "wc")
BINARIES: Final = (
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "crictl",
    "bridge",
    "host-local",
    "loopback",
    "pause",
)
NAMESPACE: Final = "k8s.io"
"""The containerd namespace the CRI keeps its images and containers in."""


def binaries(build: bool = True) -> Path:
    """The folder with containerd, its shim, ctr, crictl, the CNI plugins and pause, building them if
    needed (minutes, once; `SHAREGPU_RUNTIME_BIN` names a folder that has them instead)."""
    explicit = os.environ.get("SHAREGPU_RUNTIME_BIN")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sharegpu" / f"containerd-v{VERSION}"
    if not build or all((cache / "bin" / b).is_file() for b in BINARIES):
        return cache / "bin"
    script = controlplane.data_path("scripts/build-runtime")
    if not script.is_file():
        raise controlplane.ControlPlaneError(
            f"{script} not found; set SHAREGPU_RUNTIME_BIN to a folder with the binaries"
        )
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise controlplane.ControlPlaneError(f"building containerd failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def runc() -> Path:
    """Debian's runc (crun refuses this machine's hybrid cgroup v1 layout)."""
    found = shutil.which("runc") or ("/usr/sbin/runc" if Path("/usr/sbin/runc").is_file() else None)
    if found is None:
        raise controlplane.ControlPlaneError(
            "runc not found (Debian's package runc; scripts/build-runtime installs it)"
        )
    return Path(found)


# ----------------------------------------------------------------- images


@dataclass(frozen=True, slots=True)
class Entry:
    """One file of an image's layer: a copy of `source`, or a symbolic link to `link`."""

    path: str
    source: Path | None = None
    link: str = ""
    mode: int = 0o755


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    return info, io.BytesIO(data)


def _layer(entries: list[Entry]) -> bytes:
    """An uncompressed tar of `entries`, their folders first (owned by root, timestamps 0)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folders = sorted({str(Path(e.path).parent) for e in entries} - {"."})
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for entry in entries:
            info = tarfile.TarInfo(entry.path)
            info.mtime, info.mode = 0, entry.mode
            if entry.link:
                info.type, info.linkname = tarfile.SYMTYPE, entry.link
                tar.addfile(info)
                continue
            assert entry.source is not None
            data = entry.source.read_bytes()
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def image_archive(path: Path, name: str, entries: list[Entry], command: list[str]) -> Path:
    """An OCI image archive at `path` of one layer holding `entries`, run as `command`, named `name`
    (as `ctr images import` reads the name)."""
    raw = _layer(entries)
    layer = gzip.compress(raw, mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": command, "Env": ["PATH=/usr/local/bin:/bin:/usr/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw).hexdigest()}"]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (layer, config_bytes)}
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": f"sha256:{hashlib.sha256(config_bytes).hexdigest()}", "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": f"sha256:{hashlib.sha256(layer).hexdigest()}", "size": len(layer)}],
    }  # fmt: skip
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    blobs[hashlib.sha256(manifest_bytes).hexdigest()] = manifest_bytes
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": f"sha256:{hashlib.sha256(manifest_bytes).hexdigest()}", "size": len(manifest_bytes),
                       "platform": {"architecture": "amd64", "os": "linux"},
                       "annotations": {"io.containerd.image.name": name,
                                       "org.opencontainers.image.ref.name": name.rpartition(":")[2]}}],
    }  # fmt: skip
    with tarfile.open(path, "w") as tar:
        tar.addfile(*_member("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'))
        tar.addfile(*_member("index.json", json.dumps(index).encode()))
        for digest, blob in blobs.items():
            tar.addfile(*_member(f"blobs/sha256/{digest}", blob))
    return path


def sandbox_archive(bin_dir: Path, folder: Path) -> Path:
    return image_archive(folder / "pause.tar", SANDBOX_IMAGE, [Entry("pause", bin_dir / "pause")], ["/pause"])


def scheduler_archive(k8s_bin: Path, version: str, folder: Path) -> Path:
    """kube-scheduler's image as the chart names it (registry.k8s.io/kube-scheduler:v<version>), made
    from the binary the suite builds (static, as the official image's is), at the same path."""
    entries = [Entry("usr/local/bin/kube-scheduler", k8s_bin / "kube-scheduler")]
    name = f"registry.k8s.io/kube-scheduler:v{version}"
    return image_archive(folder / "kube-scheduler.tar", name, entries, ["/usr/local/bin/kube-scheduler"])


def busybox_archive(folder: Path) -> Path:
    if not BUSYBOX.is_file():
        raise controlplane.ControlPlaneError(f"{BUSYBOX} not found (Debian's package busybox-static)")
    entries = [Entry("bin/busybox", BUSYBOX)] + [Entry(f"bin/{a}", link="busybox") for a in APPLETS]
    return image_archive(folder / "busybox.tar", BUSYBOX_IMAGE, entries, ["sh"])


# ----------------------------------------------------------------- one node's containerd


@dataclass
class Containerd:
    """containerd for one test node, everything of it under `folder` (keep it short: unix sockets)."""

    folder: Path
    bin_dir: Path
    number: int
    """Distinguishes the node's bridge and pod subnet from the other nodes' (0..250)."""
    gpus: tuple[Path, Path] | None = None
    """The node's fake NVML file and device folder: runc then runs behind the fake NVIDIA runtime
    (`nvidiaruntime`), which gives containers that ask for GPUs by their environment what the real
    one gives (the agent's DaemonSet among them)."""
    cdi: Path | None = None
    """The folder of CDI specs it reads (default: `cdi` in its own folder)."""
    enter: tuple[str, ...] = ()
    """A prefix that starts containerd in the node's mount namespace (`MountNamespace.enter`)."""
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def socket(self) -> Path:
        return self.folder / "containerd.sock"

    @property
    def endpoint(self) -> str:
        """The CRI endpoint the kubelet is given."""
        return f"unix://{self.socket}"

    @property
    def cdi_dir(self) -> Path:
        return self.cdi or self.folder / "cdi"

    @property
    def log(self) -> Path:
        return self.folder / "containerd.log"

    @property
    def bridge(self) -> str:
        return f"sgbr{self.number}"

    @property
    def subnet(self) -> str:
        return f"10.244.{self.number}.0/24"

    def config(self) -> str:
        """containerd's configuration (version 3) for this node."""
        f = self.folder
        return f"""version = 3
root = '{f / "root"}'
state = '{f / "state"}'

[plugins.'io.containerd.server.v1.grpc']
  address = '{self.socket}'
[plugins.'io.containerd.server.v1.ttrpc']
  address = '{self.socket}.ttrpc'
[plugins.'io.containerd.internal.v1.opt']
  path = '{f / "opt"}'
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{SANDBOX_IMAGE}'
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ['{self.cdi_dir}']
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = '{self.runtime_binary()}'
  SystemdCgroup = false
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['{self.bin_dir}']
  conf_dir = '{f / "cni"}'
"""

    def runtime_binary(self) -> Path:
        """runc, or with `gpus` a script that runs it behind the fake NVIDIA runtime."""
        if self.gpus is None:
            return runc()
        nvml, devices = self.gpus
        script = self.folder / "nvidia-container-runtime"
        script.write_text(
            f"#!/bin/sh\nexec {sys.executable} -m sharegpu.devcluster.nvidiaruntime --runc {runc()} "
            f'--nvml {nvml} --devices {devices} -- "$@"\n'
        )
        script.chmod(0o755)
        return script

    def network(self) -> dict[str, Any]:
        """The node's pod network (a CNI configuration list): a bridge of its own, addresses from its subnet."""
        ipam = {"type": "host-local", "ranges": [[{"subnet": self.subnet}]], "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(self.folder / "ipam")}  # fmt: skip
        bridge = {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False, "ipam": ipam}
        return {"cniVersion": "1.0.0", "name": f"sharegpu-{self.number}", "plugins": [bridge]}

    def start(self) -> None:
        for sub in (self.cdi_dir, self.folder / "cni", self.folder / "ipam"):
            sub.mkdir(parents=True, exist_ok=True)
        (self.folder / "config.toml").write_text(self.config())
        (self.folder / "cni" / "10-sharegpu.conflist").write_text(json.dumps(self.network()))
        with self.log.open("ab") as handle:
            self.process = subprocess.Popen(
                [*self.enter, str(self.bin_dir / "containerd"), "--config", str(self.folder / "config.toml")],
                stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout: float = 30) -> None:
        """Until the CRI answers and says its runtime and network are ready."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise controlplane.ControlPlaneError(f"containerd exited:\n{self.log.read_text()[-3000:]}")
            done = self.crictl("info", check=False)
            if done.returncode == 0:
                conditions = {c["type"]: c["status"] for c in json.loads(done.stdout)["status"]["conditions"]}
                if conditions.get("RuntimeReady") and conditions.get("NetworkReady"):
                    return
                last = str(conditions)
            else:
                last = done.stderr
            time.sleep(0.2)
        raise controlplane.ControlPlaneError(
            f"containerd not ready in {timeout:g} s: {last}\n{self.log.read_text()[-3000:]}"
        )

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin_dir / "ctr"), "--address", str(self.socket), "--namespace", NAMESPACE, *args]
        return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=300)

    def crictl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin_dir / "crictl"), "--runtime-endpoint", self.endpoint, "--image-endpoint", self.endpoint,
                "--timeout", "10s", *args]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60)

    def load(self, archive: Path) -> None:
        """Import an image archive into the CRI's namespace (unpacked for its snapshotter)."""
        done = self.ctr("images", "import", str(archive), check=False)
        if done.returncode != 0:
            raise controlplane.ControlPlaneError(f"importing {archive.name} failed: {done.stderr.strip()}")

    def restart(self) -> None:
        """Stop containerd alone (SIGKILL, as a crash: its shims and the containers run on) and start it
        again, until its CRI answers."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=15)
        self.start()
        self.wait_ready()

    def stop(self) -> None:
        """Stop containerd and everything it started; nothing of the node is left running or mounted."""
        if self.process is not None and self.process.poll() is None:
            self.crictl("rmp", "--all", "--force", check=False)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        for pid in self._shims():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        unmount_under(self.folder)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, check=False)

    def _shims(self) -> list[int]:
        """The shims this containerd started (their command line names its socket)."""
        found = []
        needle = str(self.socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                command = (entry / "cmdline").read_bytes()
                if b"containerd-shim" in command and needle in command:
                    found.append(int(entry.name))
        return found


def unmount_under(folder: Path) -> None:
    """Lazily unmount everything mounted under `folder`, deepest first."""
    prefix = str(folder.resolve())
    points = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    for point in sorted(points, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


# ----------------------------------------------------------------- a kubelet's cgroup root

CGROUPS: Final = Path("/sys/fs/cgroup")


def _hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies mounted here (each controller's, and systemd's named one)."""
    return [p for p in sorted(CGROUPS.iterdir()) if p.is_dir() and not p.is_symlink() and p.name != "unified"]


def make_cgroup(name: str) -> None:
    """The cgroup `/name` in every v1 hierarchy, as a kubelet's `--cgroup-root` must exist (cpuset's
    with its parent's CPUs and memory nodes, which a new cpuset cgroup lacks)."""
    for hierarchy in _hierarchies():
        folder = hierarchy / name
        folder.mkdir(parents=True, exist_ok=True)
        if hierarchy.name == "cpuset":
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (folder / knob).write_text((hierarchy / knob).read_text())


def remove_cgroup(name: str) -> None:
    """`/name` and the cgroups under it, in every hierarchy, deepest first; a process still in one
    (a container whose shim was killed outlives it) is killed first."""
    for hierarchy in _hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        folders = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for folder in [*folders, top]:
            for _ in range(50):
                with contextlib.suppress(OSError):
                    for pid in (folder / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # the killed processes are still leaving


# ----------------------------------------------------------------- a node's mount namespace


KUBELET_ROOT: Final = Path("/var/lib/kubelet")
CDI: Final = Path("/run/cdi")
NODE_PATHS: Final = (KUBELET_ROOT, CDI, Path("/run/sharegpu"), Path("/usr/local/vgpu"))
"""The machine paths a node has of its own in its mount namespace: the kubelet's root (its device
plugin folder, which the kubelet fixes at `/var/lib/kubelet/device-plugins` whatever `--root-dir`
says, with it), the CDI folder, and the folders the agent's DaemonSet mounts from the node."""


@dataclass
class MountNamespace:
    """A mount namespace of a node's own, held by a process that waits in it: a slave of the machine's
    (what the machine mounts reaches it; nothing mounted in it reaches the machine), in which each
    of `NODE_PATHS` is a folder under the node's own, and mounts under the node's folder propagate
    both ways (pods' Bidirectional mounts reach the kubelet and containerd, which run in it through
    `enter`). So the chart's default paths hold on every node, and several nodes with GPUs run side
    by side on one machine. It goes, with everything mounted in it, when its last process does."""

    folder: Path
    """The node's folder (a shared mount of its own already)."""
    process: subprocess.Popen[str] | None = field(default=None, repr=False)

    def path(self, inside: Path) -> Path:
        """The machine's path of what the namespace sees at `inside` (one of `NODE_PATHS`)."""
        return self.folder / "paths" / inside.relative_to("/").as_posix().replace("/", "-")

    def start(self) -> None:
        script = [f"mount --make-rshared {self.folder}"]
        for inside in NODE_PATHS:
            self.path(inside).mkdir(parents=True, exist_ok=True)
            script += [f"mkdir -p {inside}", f"mount --bind {self.path(inside)} {inside}"]
        self.process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "slave", "sh", "-c",
             " && ".join([*script, "echo ready", "exec sleep infinity"])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            _, err = self.process.communicate(timeout=10)
            self.process = None
            raise controlplane.ControlPlaneError(f"the node's mount namespace: {err.strip()}")

    @property
    def enter(self) -> tuple[str, ...]:
        """The command prefix that runs a program in the namespace."""
        assert self.process is not None, "start it first"
        return ("nsenter", f"--mount=/proc/{self.process.pid}/ns/mnt", "--")

    def stop(self) -> None:
        """Its holder ends: the namespace goes once the processes started in it have."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.communicate(timeout=10)  # and its pipes closed
        self.process = None


# ----------------------------------------------------------------- a node: containerd and the kubelet


@dataclass
class Node:
    """A test node with a real runtime: its containerd, the real kubelet on it (per-pod cgroups under
    the cgroup `/sharegpu-<name>`), the images it needs, and the GPUs a node without them can fake: a
    character device per GPU, the NVIDIA toolkit's CDI spec naming them (`fakecri.toolkit_spec`), a
    fake NVML file, the fake NVIDIA runtime (`nvidiaruntime`) and device plugin."""

    name: str
    folder: Path
    runtime: Containerd
    mounts: MountNamespace
    gpus: tuple[str, ...] = ()
    """The UUIDs of its fake GPUs (index i: /dev/nvidia<i>), which the fake NVIDIA device plugin
    offers the kubelet as nvidia.com/gpu."""
    kubelet: str = ""
    plugin: fakedeviceplugin.FakeDevicePlugin | None = None

    @classmethod
    def make(cls, name: str, bin_dir: Path, number: int, gpus: tuple[str, ...] = ()) -> Node:
        """A node `name` under a new short folder in /tmp (unix socket paths stay short); with `gpus`,
        its fake GPUs reach containers through the fake NVIDIA runtime too."""
        folder = Path(tempfile.mkdtemp(prefix=f"sg-{number}-", dir="/tmp"))
        mounts = MountNamespace(folder)
        fake = (folder / "nvml.yaml", folder / "dev") if gpus else None
        runtime = Containerd(folder / "c", bin_dir, number, fake, cdi=mounts.path(CDI))
        return cls(name, folder, runtime, mounts, gpus)

    @property
    def nvml(self) -> Path:
        """The node's fake NVML file (`agent.fakes.nvml`'s format): what its GPUs report."""
        return self.folder / "nvml.yaml"

    @property
    def root(self) -> Path:
        """The kubelet's root (`KUBELET_ROOT` to the node's processes and pods)."""
        return self.mounts.path(KUBELET_ROOT)

    @property
    def cgroup(self) -> str:
        return f"sharegpu-{self.name}"

    async def start(
        self, plane: controlplane.ControlPlane, admin: client.KubeApi, images: list[Path], labels: dict[str, str]
    ) -> None:
        """containerd with `images` imported, then the kubelet, until the node is Ready (its
        registration taint lifted: no node lifecycle controller runs here)."""
        runtime = self.runtime
        # A mount of its own, shared: pods' Bidirectional mounts (the agent's CSI plugin) need one.
        for args in (["--bind", str(self.folder), str(self.folder)], ["--make-rshared", str(self.folder)]):
            subprocess.run(["mount", *args], check=True, capture_output=True)
        self.mounts.start()
        runtime.enter = self.mounts.enter
        runtime.start()
        await asyncio.to_thread(runtime.wait_ready)
        for archive in images:
            await asyncio.to_thread(runtime.load, archive)
        if self.gpus:
            if not self.nvml.exists():
                rows = "".join(
                    f"  - {{uuid: {u}, model: NVIDIA A100-SXM4-80GB, memoryMiB: 81920}}\n" for u in self.gpus
                )
                self.nvml.write_text(f"gpus:\n{rows}")
            fakecri.fake_device_nodes(self.folder / "dev", len(self.gpus))
            spec = fakecri.toolkit_spec(self.gpus, device_dir=self.folder / "dev")
            (runtime.cdi_dir / "nvidia.json").write_text(json.dumps(spec))
        make_cgroup(self.cgroup)
        self.kubelet = plane.start_kubelet(
            self.name, self.root, runtime.endpoint, labels, cgroup_root=f"/{self.cgroup}",
            enter=self.mounts.enter, root_seen_as=KUBELET_ROOT,
        )  # fmt: skip
        deadline = time.monotonic() + 90
        while not await self._ready(admin):
            if time.monotonic() > deadline:
                raise controlplane.ControlPlaneError(
                    f"node {self.name} not Ready in 90 s:\n{plane.log(self.kubelet)[-3000:]}"
                )
            await asyncio.sleep(0.5)
        await admin.patch(paths.node(self.name), {"spec": {"taints": None}})
        if self.gpus:
            self.plugin = fakedeviceplugin.FakeDevicePlugin(self.gpus, self.name, self.root / "device-plugins")
            await self.plugin.start()

    async def _ready(self, admin: client.KubeApi) -> bool:
        try:
            found = await admin.get(paths.node(self.name))
        except kube_errors.NotFoundError:
            return False
        conditions = (found.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    async def stop(self, plane: controlplane.ControlPlane, admin: client.KubeApi | None) -> None:
        """The kubelet, the Node object, containerd and all it ran, the cgroups and the folder: gone."""
        if self.plugin is not None:
            await self.plugin.stop()
        if self.kubelet:
            plane.stop_process(self.kubelet)
        if admin is not None:
            with contextlib.suppress(Exception):
                await admin.delete(paths.node(self.name))
        await asyncio.to_thread(self.runtime.stop)
        remove_cgroup(self.cgroup)
        self.mounts.stop()
        unmount_under(self.folder)
        shutil.rmtree(self.folder, ignore_errors=True)

    def container(self, pod: str, name: str = "main") -> str:
        """The id of the running container `name` of `pod` (empty while there is none)."""
        found = self.runtime.crictl("ps", "--name", f"^{name}$", "--label", f"io.kubernetes.pod.name={pod}",
                                    "-o", "json")  # fmt: skip
        running = [c["id"] for c in json.loads(found.stdout)["containers"] if c["state"] == "CONTAINER_RUNNING"]
        return running[0] if running else ""

    async def running(self, admin: client.KubeApi, namespace: str, pod: str, name: str = "main") -> str:
        """The id of container `name` of `pod` while the API shows the pod Running (empty otherwise)."""
        found = await admin.get(paths.pod(namespace, pod))
        return self.container(pod, name) if found["status"].get("phase") == "Running" else ""

    def logs(self, pod: str, name: str, lines: int = 15) -> str:
        """The last `lines` of the output of the latest container `name` of `pod` (for a failure's message)."""
        found = self.runtime.crictl("ps", "-a", "--name", f"^{name}$", "--label", f"io.kubernetes.pod.name={pod}",
                                    "-q", check=False).stdout.split()  # fmt: skip
        if not found:
            return f"{pod}/{name}: no container"
        done = self.runtime.crictl("logs", "--tail", str(lines), found[0], check=False)
        return f"{pod}/{name}:\n{done.stdout}{done.stderr}"

    def inside(self, container: str, *command: str) -> str:
        """What `command` prints inside the container (exec through the CRI)."""
        return self.runtime.crictl("exec", container, *command).stdout
