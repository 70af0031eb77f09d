"""A real container runtime for a test node: containerd (built from its Go module by
scripts/build-runtime) running Debian's runc, with a root, state, socket, CNI network and CDI folder
of its own, so that several run side by side on one machine, each a node of its own.

A node's containerd serves the CRI with CDI on (the specs in its `cdi` folder: the fake NVIDIA
toolkit's and sharegpu's DRA plugin's, applied by containerd itself), `restrict_oom_score_adj` (this
machine refuses the negative OOM scores CRI gives sandboxes), no NRI, and a bridge network of its own
(`sgbr<n>`, 10.244.<n>.0/24, the CNI plugins from the same build). Registries cannot be reached here,
so the images a node needs are made from files and imported (`image_archive`, `Containerd.load`):
the sandbox image (our pause program, under `SANDBOX_IMAGE`, the name the configuration pins) and a
busybox image (Debian's static busybox, `BUSYBOX_IMAGE`).

`stop` leaves nothing behind: the pods are removed through the CRI (their network namespaces and
mounts with them), containerd stops, any shim left is killed, what is still mounted under the node's
folder is unmounted, and its bridge is deleted.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from sharegpu.devcluster import controlplane

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
        "config": {"Cmd": command, "Env": ["PATH=/bin:/usr/bin"], "WorkingDir": "/"},
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
        return self.folder / "cdi"

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
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = '{runc()}'
  SystemdCgroup = false
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['{self.bin_dir}']
  conf_dir = '{f / "cni"}'
"""

    def network(self) -> dict[str, Any]:
        """The node's pod network (a CNI configuration list): a bridge of its own, addresses from its subnet."""
        ipam = {"type": "host-local", "ranges": [[{"subnet": self.subnet}]], "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": str(self.folder / "ipam")}  # fmt: skip
        bridge = {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False, "ipam": ipam}
        return {"cniVersion": "1.0.0", "name": f"sharegpu-{self.number}", "plugins": [bridge]}

    def start(self) -> None:
        for sub in ("cdi", "cni", "ipam"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        (self.folder / "config.toml").write_text(self.config())
        (self.folder / "cni" / "10-sharegpu.conflist").write_text(json.dumps(self.network()))
        with self.log.open("ab") as handle:
            self.process = subprocess.Popen(
                [str(self.bin_dir / "containerd"), "--config", str(self.folder / "config.toml")],
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
    """`/name` and the cgroups under it, in every hierarchy, deepest first (left where a process stays)."""
    for hierarchy in _hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
