"""Pods on a real container runtime: the real kubelet (1.37) on containerd (built from its Go module,
`devcluster.containerd`) running Debian's runc, the node with a containerd, pod network and cgroup
root of its own. What the fake CRI plays in test_kubelet is done for real here:

- a pod's container is a process: its network on the node's bridge, its cgroup the kubelet's per-pod
  cgroup under the node's own root, read from inside the container;
- the DRA path's CDI devices are applied by containerd itself: the claim's GPU (the fake toolkit's
  device node, a real character device) and sharegpu's variables, as the container sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import uuid
from collections.abc import AsyncIterator

import pytest

from sharegpu.agent import draplugin
from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import dra, paths
from sharegpu.devcluster import containerd, controlplane, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests import builders
from tests.builders import NVML_FILE, write_nvml
from tests.integration.conftest import get_or_none, wait_for

pytestmark = pytest.mark.runtime

UUIDS = ("GPU-0", "GPU-1", "GPU-2")
"""The GPUs of NVML_FILE."""


@contextlib.asynccontextmanager
async def containerd_node(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, namespace: str
) -> AsyncIterator[containerd.Node]:
    if tuple(int(p) for p in control_plane.version.split(".")[:2]) < (1, 37) or not control_plane.has_kubelet:
        pytest.skip("the kubelet is built with the suite's control plane (1.37)")
    bin_dir = await asyncio.to_thread(containerd.binaries)
    node = containerd.Node.make(f"ctd-{uuid.uuid4().hex[:6]}", bin_dir, random.randrange(1, 250), UUIDS)
    try:
        images = [containerd.sandbox_archive(bin_dir, node.folder), containerd.busybox_archive(node.folder)]
        await node.start(control_plane, admin, images, {"sharegpu.io/test": namespace})
        yield node
    finally:
        await node.stop(control_plane, admin)


async def explained(
    control_plane: controlplane.ControlPlane, node: containerd.Node, predicate: object, what: str
) -> object:
    """`wait_for`, with the end of the kubelet's and containerd's logs when it times out."""
    try:
        return await wait_for(predicate, timeout=90, what=what)  # type: ignore[arg-type]
    except AssertionError as exc:
        logs = f"{control_plane.log(node.kubelet)[-4000:]}\n--- containerd\n{node.runtime.log.read_text()[-3000:]}"
        raise AssertionError(f"{exc}\n{logs}") from None


async def test_a_pod_runs_in_containerd_on_the_node_s_network_under_its_own_per_pod_cgroup(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    async with containerd_node(admin, control_plane, namespace) as node:
        made = await admin.create(
            paths.pods(namespace), builders.MakePod("p", namespace).grace(0).node(node.name).container().busybox().obj()
        )

        running = functools.partial(node.running, admin, namespace, "p")
        container = await explained(control_plane, node, running, "the pod's container running in containerd")
        assert isinstance(container, str)
        found = await admin.get(paths.pod(namespace, "p"))
        assert found["status"]["podIP"].startswith(node.runtime.subnet.rsplit(".", 2)[0] + "."), found["status"]
        cgroups = node.inside(container, "cat", "/proc/self/cgroup")
        uid = made["metadata"]["uid"]
        memory = next(line for line in cgroups.splitlines() if ":memory:" in line)
        assert f"/{node.cgroup}/kubepods/besteffort/pod{uid}/{container}" in memory, cgroups
        await admin.delete(paths.pod(namespace, "p"), grace_period=0)

        async def gone() -> bool:
            listed = json.loads(node.runtime.crictl("ps", "-a", "-o", "json").stdout)["containers"]
            return not listed and await get_or_none(admin, paths.pod(namespace, "p")) is None

        await explained(control_plane, node, gone, "the pod and its container gone")

        # The node shares this machine's disk: the kubelet's pressure thresholds are absolute floors, not
        # shares of the filesystem that a machine full of builds crosses (then every pod is refused).
        served = (await admin.get(f"{paths.node(node.name)}/proxy/configz"))["kubeletconfig"]
        assert not [v for v in served["evictionHard"].values() if "%" in v and v != "1%"], served["evictionHard"]
        assert served["imageGCHighThresholdPercent"] == 100, served


async def test_containerd_applies_the_claim_s_cdi_devices_the_container_sees_its_gpu_and_sharegpu_s_variables(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    namespace: str,
    device_class: str,
) -> None:
    async with containerd_node(admin, control_plane, namespace) as node:
        kube = stack.kube_for(control_plane, "sharegpu-agent")
        nvml_file = node.folder / "nvml.yaml"
        write_nvml(nvml_file, NVML_FILE)
        plugin_paths = draplugin.Paths.under(
            node.root / "plugins", node.root / "plugins_registry", node.runtime.cdi_dir
        )
        options = agent_runtime.Options(dra=True, dra_plugin=plugin_paths, interval=0.5)
        agent = agent_runtime.Agent(kube, node.name, fakenvml.FakeNvml(nvml_file).open(), options)
        await agent.start()
        try:
            await wait_for(lambda: get_or_none(admin, dra.slice_path(node.name)), what="the node's ResourceSlice")
            await admin.create(dra.claim_path(namespace), builders.MakeClaim("c", namespace).ask(300, "4Gi").obj())
            # NVIDIA_VISIBLE_DEVICES=void in the container's own env, as the webhook sets it on every
            # container it gives no GPU: the claim's CDI spec, applied by containerd over it, wins
            made = builders.MakePod("p", namespace).scheduler().grace(0)
            made.container(env={"NVIDIA_VISIBLE_DEVICES": "void"}).claim("c").gate()
            await admin.create(
                paths.pods(namespace), made.node_selector({"kubernetes.io/hostname": node.name}).busybox().obj()
            )

            running = functools.partial(node.running, admin, namespace, "p")
            container = await explained(control_plane, node, running, "the DRA pod running in containerd")
            assert isinstance(container, str)
            claim = await admin.get(dra.claim_path(namespace, "c"))
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            index = int(result["device"].removeprefix("gpu-"))
            env = dict(line.split("=", 1) for line in node.inside(container, "env").splitlines() if "=" in line)
            assert env["NVIDIA_VISIBLE_DEVICES"] == f"GPU-{index}"
            devices = node.inside(container, "ls", "-l", "/dev").splitlines()
            named = {line.split()[-1]: line for line in devices if line.startswith("c")}
            assert f"nvidia{index}" in named and named[f"nvidia{index}"].split()[4:6] == ["195,", str(index)], devices
            assert {f"nvidia{i}" for i in range(len(UUIDS)) if i != index}.isdisjoint(named), "only the claim's GPU"
            assert {"nvidiactl", "nvidia-uvm"} <= set(named)
        finally:
            await agent.stop()
            await kube.close()
