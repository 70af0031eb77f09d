"""A devcluster on a real container runtime, with sharegpu installed as users install it: the control
plane with a pod network (kube-proxy, and the default kube-scheduler for pods that are not
sharegpu's), nodes whose runtime is containerd and runc under the real kubelet (`containerd.Node`,
each with fake GPUs given as a real node gives them), and sharegpu's chart installed by Helm from the
image the repository builds (scripts/build-image), every component in its container.

`sharegpu devcluster --runtime containerd` runs one; the real-container tests build theirs from the
same parts (`start_nodes`, then their own `helm install`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import hashlib
import importlib.metadata
import json
import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from sharegpu.api import names, paths
from sharegpu.devcluster import containerd, controlplane, stack
from sharegpu.kube import client

CLUSTER_CIDR: Final = "10.244.0.0/16"
"""The nodes' pod networks (each node's containerd takes a /24 of it)."""
DRA_NODES: Final = {"sharegpu.io/dra": "true"}
"""The label of the nodes that serve DRA claims (the chart's agent.draNodeSelector)."""
GPU_NODES: Final = {"nvidia.com/gpu.present": "true"}
"""The label NVIDIA's GPU feature discovery gives GPU nodes (the chart's agent runs where it is)."""
IMAGE_REPOSITORY: Final = "localhost/sharegpu"
"""The name scripts/build-image gives the image (tagged with the project's version)."""
RELEASE: Final = "sharegpu"
SYSTEM = names.SYSTEM_NAMESPACE


def version() -> str:
    return importlib.metadata.version("sharegpu")


def image_inputs(root: Path) -> str:
    """A digest of what the image is built from: the Dockerfile, its build context as `.dockerignore`
    lets it in (its `!` lines, less its `**/` exclusions: caches and generated code) and the build
    script. An archive is reused only while this is unchanged: the version alone stays the same across
    edits of the source."""
    allowed: list[str] = []
    excluded: list[str] = []
    for line in (root / ".dockerignore").read_text().splitlines():
        entry = line.strip()
        if entry.startswith("!"):
            allowed.append(entry[1:].rstrip("/"))
        elif entry.startswith("**/"):
            excluded.append(entry[3:])
    files = [root / "Dockerfile", root / ".dockerignore", root / "scripts" / "build-image"]
    for name in allowed:
        top = root / name
        files.extend(sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top])
    digest = hashlib.sha256()
    for path in files:
        relative = path.relative_to(root)
        if any(fnmatch.fnmatch(part, pattern) for part in relative.parts for pattern in excluded):
            continue
        digest.update(f"{relative}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def image_archive() -> Path:
    """sharegpu's image as scripts/build-image writes it, built when missing or built from other sources
    than the checkout's (`image_inputs`, kept beside the archive; a minute or two; needs the source
    checkout); SHAREGPU_IMAGE_ARCHIVE names another."""
    named = os.environ.get("SHAREGPU_IMAGE_ARCHIVE")
    if named:
        return Path(named)
    root = controlplane.REPO_ROOT
    archive = root / "out" / f"sharegpu-{version()}.oci.tar"
    stamp = archive.with_name(archive.name + ".inputs")
    script = root / "scripts" / "build-image"
    if not script.is_file():
        if archive.is_file():
            return archive
        raise controlplane.ControlPlaneError(
            f"{archive} not found, and no source checkout to build it in: set SHAREGPU_IMAGE_ARCHIVE to "
            "an archive scripts/build-image wrote"
        )
    inputs = image_inputs(root)
    if archive.is_file() and stamp.is_file() and stamp.read_text().strip() == inputs:
        return archive
    stamp.unlink(missing_ok=True)
    done = subprocess.run([str(script)], capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0 or not archive.is_file():
        raise controlplane.ControlPlaneError(f"building the image failed:\n{done.stderr[-3000:]}")
    stamp.write_text(inputs + "\n")
    return archive


@functools.cache
def helm_binary() -> str:
    """Helm: SHAREGPU_HELM, else `helm` on the PATH, else the pinned one scripts/tools installs."""
    named = os.environ.get("SHAREGPU_HELM") or shutil.which("helm")
    if named:
        return named
    script = controlplane.REPO_ROOT / "scripts" / "tools"
    if not script.is_file():
        raise controlplane.ControlPlaneError("helm not found: put it on the PATH or set SHAREGPU_HELM")
    done = subprocess.run([str(script)], capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise controlplane.ControlPlaneError(f"installing helm failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@dataclass
class RealCluster:
    """The control plane and containerd nodes (`gpus`: each node's fake GPU UUIDs; `dra`: the nodes
    labelled `DRA_NODES`), and sharegpu's release once `install`ed."""

    workdir: Path
    gpus: dict[str, tuple[str, ...]]
    dra: frozenset[str] = frozenset()
    plane: controlplane.ControlPlane | None = None
    kube: client.KubeClient | None = None
    nodes: dict[str, containerd.Node] = field(default_factory=dict)

    async def start_nodes(self) -> None:
        """The control plane with its pod network, then the nodes, Ready, with every image they need
        imported (the pause and busybox images, kube-scheduler's, sharegpu's)."""
        plane = controlplane.ControlPlane(self.workdir / "plane", controlplane.binaries(), pod_network=True)
        if not plane.has_kubelet:
            raise controlplane.ControlPlaneError("the kubelet and kube-proxy come with the 1.37 control plane build")
        self.plane = plane
        await asyncio.to_thread(plane.start)
        plane.start_kube_proxy(CLUSTER_CIDR)
        plane.start_default_scheduler()
        self.kube = stack.kube_for(plane, "admin")
        bin_dir = await asyncio.to_thread(containerd.binaries)
        images_dir = self.workdir / "images"
        images_dir.mkdir(parents=True, exist_ok=True)
        images = [
            containerd.sandbox_archive(bin_dir, images_dir),
            containerd.busybox_archive(images_dir),
            containerd.scheduler_archive(plane.bin_dir, plane.version, images_dir),
            await asyncio.to_thread(image_archive),
        ]
        first = random.randrange(1, 250 - len(self.gpus))
        for i, (name, uuids) in enumerate(self.gpus.items()):
            self.nodes[name] = containerd.Node.make(name, bin_dir, first + i, uuids)
        kube = self.kube
        await asyncio.gather(*(
            node.start(plane, kube, images, GPU_NODES | (DRA_NODES if name in self.dra else {}))
            for name, node in self.nodes.items()
        ))  # fmt: skip

    def values(self, **more: Any) -> dict[str, Any]:
        """The chart values that run sharegpu from the built image on these nodes."""
        made: dict[str, Any] = {
            "image": {"repository": IMAGE_REPOSITORY, "tag": version(), "pullPolicy": "Never"},
            "agent": {"draNodeSelector": DRA_NODES} if self.dra else {},
        }
        return made | more

    async def helm(self, *args: str, timeout: float = 300) -> str:
        """Helm as the cluster's admin; its error, if any, raised with what it said."""
        assert self.plane is not None
        env = {**os.environ, "KUBECONFIG": str(self.plane.kubeconfig("admin"))}
        process = await asyncio.create_subprocess_exec(
            helm_binary(), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(process.communicate(), timeout)
        if process.returncode != 0:
            raise controlplane.ControlPlaneError(f"helm {' '.join(args)}: {err.decode().strip()}")
        return out.decode()

    async def release(self, verb: str, values: dict[str, Any]) -> str:
        """`helm install` or `helm upgrade` of sharegpu's release with `values`."""
        file = self.workdir / "values.json"
        file.write_text(json.dumps(values))
        made = ("--create-namespace",) if verb == "install" else ()
        return await self.helm(verb, RELEASE, str(stack.CHART), "-n", SYSTEM, *made, "-f", str(file))

    async def install(self, values: dict[str, Any], *, timeout: float = 300) -> None:
        """`helm install` the chart with `values`, until every component's pod is Ready."""
        await self.release("install", values)
        deadline = asyncio.get_running_loop().time() + timeout
        while not await self.components_ready():
            if asyncio.get_running_loop().time() > deadline:
                raise controlplane.ControlPlaneError(f"sharegpu's components not Ready in {timeout:g} s")
            await asyncio.sleep(1)

    async def components_ready(self) -> bool:
        assert self.kube is not None
        found = (await self.kube.get(paths.pods(SYSTEM)))["items"]
        daemons = (await self.kube.get(f"/apis/apps/v1/namespaces/{SYSTEM}/daemonsets"))["items"]
        deployments = (await self.kube.get(f"/apis/apps/v1/namespaces/{SYSTEM}/deployments"))["items"]
        wanted = sum(d["status"].get("desiredNumberScheduled", 0) for d in daemons) + sum(
            d["spec"].get("replicas", 1) for d in deployments
        )
        return bool(found) and len(found) >= wanted and all(ready(p) for p in found)

    async def stop(self) -> None:
        """The nodes (their pods, containerd, kubelet, mounts and bridges) and the control plane: gone."""
        if self.plane is not None:
            for node in self.nodes.values():
                await node.stop(self.plane, self.kube)
        self.nodes.clear()
        if self.kube is not None:
            await self.kube.close()
            self.kube = None
        if self.plane is not None:
            await asyncio.to_thread(self.plane.stop)
            self.plane = None
