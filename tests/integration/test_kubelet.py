"""The real kubelet (1.37, built from its Go module with the control plane) running pods, its container
runtime the project's fake CRI (`devcluster.fakecri`: records, no processes; CDI devices resolved and
applied as containerd does). What the harness plays elsewhere is real here:

- the DRA path: the kubelet registers sharegpu's DRA plugin, calls NodePrepareResources for a claim
  sharegpu's allocator placed, and the container gets the GPU's CDI device (from the NVIDIA toolkit's
  spec) and the hand-off's variables (from sharegpu's spec); deleting the pod unprepares the claim;
- the extender path: a fake NVIDIA device plugin registers `nvidia.com/gpu` with the kubelet, which
  admits sharegpu's reservation pod and calls Allocate; the reservation reports the UUID its
  environment names (as `sharegpu reserve` does); the kubelet resolves the sharing pod's hand-off
  references, so its container gets that GPU; the agent reads the kubelet's own PodResources API and
  corrects a reservation that misreports its GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from sharegpu.agent import draplugin, mps, podresources, reserve, volumes, watchdog
from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import cdi, dra, handoff, names, paths
from sharegpu.devcluster import controlplane, fakecri, fakedeviceplugin, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client, errors
from tests import builders
from tests.agent.fake_mps_daemon import write_fake_daemon
from tests.builders import NVML_FILE, nvml_with, write_nvml
from tests.integration.conftest import Json, get_or_none, gpu_pod, leaving, wait_for

UUIDS = ("GPU-0", "GPU-1", "GPU-2")
"""The GPUs of NVML_FILE."""


@dataclass
class RealNode:
    """A node served by a real kubelet and the fake CRI, with its folders (short: unix socket paths)."""

    name: str
    folder: Path
    cri: fakecri.FakeCri
    kubelet: str

    @property
    def root(self) -> Path:
        return self.folder / "root"

    @property
    def cdi_dir(self) -> Path:
        return self.folder / "cdi"

    @property
    def proc(self) -> Path:
        """The node's /proc as an agent given it as `proc` reads it (`process`)."""
        return self.folder / "proc"

    def process(self, pid: int, pod: Json) -> None:
        """Process `pid` in a container of `pod`, as its cgroup file says."""
        (self.proc / str(pid)).mkdir()
        (self.proc / str(pid) / "cgroup").write_text(
            f"0::/kubepods/besteffort/pod{pod['metadata']['uid']}/{'c' * 64}\n"
        )

    def nvml(self) -> fakenvml.FakeNvml:
        path = self.folder / "nvml.yaml"
        write_nvml(path, NVML_FILE)
        return fakenvml.FakeNvml(path)

    @property
    def plugin_paths(self) -> draplugin.Paths:
        """Where the agent serves the DRA plugin for this kubelet, and writes its CDI specs."""
        return draplugin.Paths.under(self.root / "plugins", self.root / "plugins_registry", self.cdi_dir)

    async def claim_pod(self, admin: client.KubeClient, namespace: str) -> Json:
        """Claim `c` (300 milli, 4 GiB of sharegpu's class) and pod `p` using it, gated, bound for this node."""
        await admin.create(dra.claim_path(namespace), builders.MakeClaim("c", namespace).ask(300, "4Gi").obj())
        made = builders.MakePod("p", namespace).scheduler().grace(0)
        made.node_selector({"kubernetes.io/hostname": self.name}).container(image="busybox").claim("c").gate()
        body = made.obj()
        body["spec"]["automountServiceAccountToken"] = False
        pod: Json = await admin.create(paths.pods(namespace), body)
        return pod

    def running(self, admin: client.KubeClient, namespace: str) -> Callable[[], Awaitable[bool]]:
        """Whether pod `p` runs: Running, and its container in this node's runtime."""

        async def check() -> bool:
            found = await admin.get(paths.pod(namespace, "p"))
            return found["status"].get("phase") == "Running" and bool(self.cri.running(namespace, "p"))

        return check


@contextlib.asynccontextmanager
async def dra_agent(
    control_plane: controlplane.ControlPlane, node: RealNode, **settings: Any
) -> AsyncIterator[tuple[agent_runtime.Agent, fakenvml.FakeNvml]]:
    """The agent with --dra (its own RBAC) serving the kubelet's DRA plugin on `node`, on the node's
    fake NVML (`settings`: more of its Options; a pass every 0.5 s unless said), and that NVML; yielded
    once the kubelet has registered the plugin. (A pod the kubelet sees before that fails to prepare,
    and the kubelet's next try may come after a test's wait: CI saw one not come within 90 s.)"""
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    nvml = node.nvml()
    options = agent_runtime.Options(dra=True, dra_plugin=node.plugin_paths, **{"interval": 0.5, **settings})
    agent = agent_runtime.Agent(kube, node.name, nvml.open(), options)
    try:
        await agent.start()
        plugin = agent.plugin
        assert plugin is not None

        async def registered() -> bool:
            return plugin.registration.registered is True

        await wait_for(registered, timeout=60, what="the kubelet registered sharegpu's DRA plugin")
        yield agent, nvml
    finally:
        await agent.stop()
        await kube.close()


@contextlib.asynccontextmanager
async def evicting_dra_agent(
    control_plane: controlplane.ControlPlane, node: RealNode
) -> AsyncIterator[tuple[agent_runtime.Agent, fakenvml.FakeNvml]]:
    """`dra_agent` with its watchdog evicting, seeing the node's processes in `node.proc` (`node.process`)."""
    node.proc.mkdir(exist_ok=True)
    settings = {"interval": 0.3, "on_violation": watchdog.Action.EVICT, "proc": node.proc}
    async with dra_agent(control_plane, node, **settings) as found:
        yield found


def _unmount_under(folder: Path) -> None:
    """Volumes the kubelet mounted (a pod's tmpfs) and did not unmount before it stopped."""
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(str(folder))]
    for point in sorted(points, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)


@contextlib.asynccontextmanager
async def real_node(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, namespace: str
) -> AsyncIterator[RealNode]:
    if tuple(int(p) for p in control_plane.version.split(".")[:2]) < (1, 37) or not control_plane.has_kubelet:
        pytest.skip("the kubelet is built with the suite's control plane (1.37)")
    name = f"kubelet-{uuid.uuid4().hex[:6]}"
    folder = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    (folder / "cdi").mkdir()
    # The NVIDIA container toolkit's spec for the node's GPUs (`nvidia-ctk cdi generate`), beside which
    # sharegpu's DRA plugin writes a spec per claim: the runtime resolves both.
    (folder / "cdi" / "nvidia.json").write_bytes(orjson.dumps(fakecri.toolkit_spec(UUIDS)))
    cri = fakecri.FakeCri(folder / "cri.sock", cdi_dirs=[folder / "cdi"])
    await cri.start()
    kubelet = control_plane.start_kubelet(name, folder / "root", cri.endpoint, {"sharegpu.io/test": namespace})
    node = RealNode(name, folder, cri, kubelet)
    try:
        try:
            await wait_for(lambda: ready_node(admin, name), timeout=90, what=f"the kubelet's node {name} Ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{control_plane.log(kubelet)[-4000:]}") from None
        # No node lifecycle controller runs here to lift the not-ready taint of registration.
        await admin.patch(paths.node(name), {"spec": {"taints": None}})
        yield node
    finally:
        control_plane.stop_process(kubelet)
        await cri.stop()
        await admin.delete(paths.node(name))
        _unmount_under(folder)
        shutil.rmtree(folder, ignore_errors=True)


async def ready_node(admin: client.KubeClient, name: str) -> Json | None:
    found = await get_or_none(admin, paths.node(name))
    conditions = ((found or {}).get("status") or {}).get("conditions") or []
    return found if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None


async def explained(control_plane: controlplane.ControlPlane, node: RealNode, predicate: Any, what: str) -> Any:
    """`wait_for`, with the end of the kubelet's log when it times out."""
    try:
        return await wait_for(predicate, timeout=90, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{control_plane.log(node.kubelet)[-6000:]}") from None


async def test_the_real_kubelet_prepares_a_claim_through_the_plugin_and_the_runtime_gives_its_gpu(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    namespace: str,
    device_class: str,
) -> None:
    async with real_node(admin, control_plane, namespace) as node, dra_agent(control_plane, node):
        await wait_for(lambda: get_or_none(admin, dra.slice_path(node.name)), what="the node's ResourceSlice")

        claims = dra.claim_path(namespace)
        await node.claim_pod(admin, namespace)

        async def bound() -> str | None:
            found = await admin.get(paths.pod(namespace, "p"))
            node_name: str | None = found["spec"].get("nodeName")
            return node_name

        assert await wait_for(bound, timeout=90, what="the pod bound to the kubelet's node") == node.name
        claim = await admin.get(f"{claims}/c")
        uid = claim["metadata"]["uid"]
        spec_file = node.plugin_paths.cdi_dir / cdi.file_name(uid)

        async def prepared() -> bool:
            return spec_file.exists()

        await explained(control_plane, node, prepared, "the kubelet prepared the claim through the plugin")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        index = int(result["device"].removeprefix("gpu-"))
        written = orjson.loads(spec_file.read_bytes())
        assert f"{names.DOMAIN}/claim" == written["kind"]
        assert f"NVIDIA_VISIBLE_DEVICES=GPU-{index}" in written["devices"][0]["containerEdits"]["env"]

        await explained(control_plane, node, node.running(admin, namespace), "the kubelet ran the pod's container")
        # What the runtime gave the container: the GPU the claim holds (the toolkit's CDI device, its
        # device node) and the hand-off's variables from sharegpu's spec, both named by the kubelet.
        (container,) = node.cri.running(namespace, "p").values()
        assert set(container.cdi_devices) == {cdi.nvidia_device(f"GPU-{index}"), cdi.device_id(uid, "gpu")}
        assert f"/dev/nvidia{index}" in container.device_nodes
        assert container.env["NVIDIA_VISIBLE_DEVICES"] == f"GPU-{index}"

        await admin.delete(paths.pod(namespace, "p"), grace_period=0)

        async def unprepared() -> bool:
            return not spec_file.exists()

        await wait_for(unprepared, timeout=90, what="the kubelet unprepared the claim once the pod went")


async def test_the_real_kubelets_dra_pod_is_judged_by_its_claim_left_alone_within_it_and_evicted_over_it(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    namespace: str,
    device_class: str,
) -> None:
    async with real_node(admin, control_plane, namespace) as node, evicting_dra_agent(control_plane, node) as pair:
        agent, nvml = pair
        await wait_for(lambda: get_or_none(admin, dra.slice_path(node.name)), what="the node's ResourceSlice")
        pod = await node.claim_pod(admin, namespace)
        await explained(control_plane, node, node.running(admin, namespace), "the kubelet ran the DRA pod")
        claim = await admin.get(dra.claim_path(namespace, "c"))
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        index = int(result["device"].removeprefix("gpu-"))
        # A process of the pod's container on the claim's GPU, as NVML and the pod's cgroup show it.
        node.process(4343, pod)

        def uses(mib: int) -> None:
            write_nvml(nvml.path, nvml_with(f"{{pid: 4343, gpu: {index}, usedMiB: {mib}}}"))

        uses(3072)  # within the claim's 4 GiB

        async def judged() -> bool:
            usages = agent.usage.usages if agent.usage is not None else ()
            return any(u.pod.name == "p" and u.allocated_mib == 4096 for u in usages)

        await wait_for(judged, what="the watchdog judging the pod by its claim's 4096 MiB")
        await asyncio.sleep(1.5)  # several passes
        assert agent.usage is not None and agent.usage.violations == ()
        found = await admin.get(paths.pod(namespace, "p"))
        assert not found["metadata"].get("deletionTimestamp"), "a DRA pod within its claim is left alone"

        uses(6144)  # over it

        await wait_for(
            functools.partial(leaving, admin, namespace, "p"), what="the DRA pod over its claim's memory evicted"
        )

        async def told() -> list[str] | None:  # the event is written once the eviction is answered
            events, _ = await admin.list_all(paths.events(namespace))
            found = [
                e["message"] for e in events if e["reason"] == "GPUPodEvicted" and e["involvedObject"]["name"] == "p"
            ]
            return found or None

        said = await wait_for(told, what="the GPUPodEvicted event")
        assert "uses 6144 MiB" in said[0] and "4096 MiB" in said[0], said


async def test_pods_and_containers_sharing_a_claim_get_one_share_and_are_judged_together(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    namespace: str,
    device_class: str,
) -> None:
    """Issue 39 item 2 with the real kubelet: a claim used by two pods, and one used by two containers
    of a pod, is allocated once (one result, one share of the GPU) and prepared once; every consumer's
    container gets the same devices. The watchdog holds the consumers of a claim to it together: two
    pods at 2048 + 1536 MiB of the claim's 4096 are left alone; when the second grows to 3072 (5120 in
    all) it, the pool's largest, is evicted, and the first is not."""
    async with real_node(admin, control_plane, namespace) as node, evicting_dra_agent(control_plane, node) as pair:
        agent, nvml = pair
        await wait_for(lambda: get_or_none(admin, dra.slice_path(node.name)), what="the node's ResourceSlice")
        first = await node.claim_pod(admin, namespace)  # claim c and pod p
        made = builders.MakePod("q", namespace).scheduler().grace(0)
        made.node_selector({"kubernetes.io/hostname": node.name}).container(image="busybox").claim("c").gate()
        body = made.obj()
        body["spec"]["automountServiceAccountToken"] = False
        second = await admin.create(paths.pods(namespace), body)
        await admin.create(dra.claim_path(namespace), builders.MakeClaim("d", namespace).ask(200, "2Gi").obj())
        both = builders.MakePod("two", namespace).scheduler().grace(0)
        both.node_selector({"kubernetes.io/hostname": node.name})
        both.container("a", image="busybox").container("b", image="busybox").claim("d").gate()
        body = both.obj()
        body["spec"]["containers"][1]["resources"] = {"claims": [{"name": "gpu"}]}  # both containers use it
        body["spec"]["automountServiceAccountToken"] = False
        await admin.create(paths.pods(namespace), body)

        async def running(name: str) -> bool:
            found = await admin.get(paths.pod(namespace, name))
            return found["status"].get("phase") == "Running" and bool(node.cri.running(namespace, name))

        for name in ("p", "q", "two"):
            await explained(control_plane, node, functools.partial(running, name), f"the kubelet ran {name}")
        claim = await admin.get(dra.claim_path(namespace, "c"))
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["consumedCapacity"][dra.MILLI] == "300", "one share, however many use it"
        assert {r["name"] for r in claim["status"]["reservedFor"]} == {"p", "q"}
        index = int(result["device"].removeprefix("gpu-"))
        specs = [f for f in node.plugin_paths.cdi_dir.iterdir() if f.name != "nvidia.json"]
        assert len(specs) == 2, "one spec per claim (c and d), not per consumer"
        devices_of = [set(c.cdi_devices) for n in ("p", "q", "two") for c in node.cri.running(namespace, n).values()]
        assert len(devices_of) == 4 and devices_of[0] == devices_of[1] and devices_of[2] == devices_of[3]
        shared = await admin.get(dra.claim_path(namespace, "d"))
        assert len(shared["status"]["allocation"]["devices"]["results"]) == 1

        node.process(4343, first)
        node.process(4444, second)

        def uses(p_mib: int, q_mib: int) -> None:
            listed = (f"{{pid: {pid}, gpu: {index}, usedMiB: {mib}}}" for pid, mib in ((4343, p_mib), (4444, q_mib)))
            write_nvml(nvml.path, nvml_with(*listed))

        uses(2048, 1536)  # 3584 of the claim's 4096: within, together

        async def judged() -> bool:
            usages = agent.usage.usages if agent.usage is not None else ()
            return {u.pod.name for u in usages} == {"p", "q"}

        await wait_for(judged, what="the watchdog judging both consumers of the claim")
        await asyncio.sleep(1.5)  # several passes
        assert agent.usage is not None and agent.usage.violations == (), agent.usage.violations

        uses(2048, 3072)  # 5120 together: over

        await wait_for(functools.partial(leaving, admin, namespace, "q"), what="the pool's largest consumer evicted")
        kept = await admin.get(paths.pod(namespace, "p"))
        assert not kept["metadata"].get("deletionTimestamp"), "the other consumer is left alone"


@dataclass
class ExtenderNode:
    """A real node served as the extender path serves one: the fake NVIDIA device plugin registered
    with the kubelet, reservations reporting their GPU as `sharegpu reserve` does, the agent (its own
    RBAC) reading the kubelet's PodResources."""

    node: RealNode
    plugin: fakedeviceplugin.FakeDevicePlugin
    lister: podresources.KubeletPodResources
    agent: agent_runtime.Agent

    def running(self, admin: client.KubeClient, namespace: str, name: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            found = await admin.get(paths.pod(namespace, name))
            return found["status"].get("phase") == "Running" and bool(self.node.cri.running(namespace, name))

        return check

    async def reservation(self, admin: client.KubeClient) -> tuple[str, str]:
        """The node's one reservation pod: its name and the GPU it reported."""
        items, _ = await admin.list_all(
            paths.pods(names.HOLDING_NAMESPACE), {"labelSelector": f"{names.LABEL_NODE}={self.node.name}"}
        )
        (reservation,) = items
        return reservation["metadata"]["name"], reservation["metadata"]["annotations"][names.GPU_UUID]


@contextlib.asynccontextmanager
async def extender_node(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    node: RealNode,
    options: agent_runtime.Options | None = None,
    supervisor: mps.Supervisor | None = None,
) -> AsyncIterator[ExtenderNode]:
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    agent: agent_runtime.Agent | None = None
    plugin: fakedeviceplugin.FakeDevicePlugin | None = None
    lister: podresources.KubeletPodResources | None = None
    try:

        async def play_reserve(container: fakecri.Container) -> None:
            """What `sharegpu reserve` does in a reservation's container: report the GPU its
            environment names (here from the device plugin's Allocate, through the kubelet)."""
            if container.namespace == names.HOLDING_NAMESPACE and container.pod.startswith(names.RESERVATION_PREFIX):
                await reserve.report_until_done(admin, container.namespace, container.pod, container.env)

        node.cri.on_start.append(play_reserve)
        plugin = fakedeviceplugin.FakeDevicePlugin(UUIDS, node.name)
        await plugin.start()

        async def offered() -> bool:
            found = await admin.get(paths.node(node.name))
            return bool(found["status"].get("allocatable", {}).get(names.NVIDIA_GPU) == str(len(UUIDS)))

        await explained(control_plane, node, offered, "the kubelet offers the device plugin's GPUs")
        lister = podresources.KubeletPodResources(node.root / "pod-resources" / "kubelet.sock", 5.0)
        agent = agent_runtime.Agent(
            kube,
            node.name,
            node.nvml().open(),
            options or agent_runtime.Options(interval=0.5),
            kubelet=lister,
            supervisor=supervisor,
        )
        await agent.start()
        await wait_for(lambda: get_or_none(admin, paths.device(node.name)), what="the node's Device")
        yield ExtenderNode(node, plugin, lister, agent)
    finally:
        if agent is not None:
            await agent.stop()
        if lister is not None:
            await lister.close()
        if plugin is not None:
            await plugin.stop()
        await kube.close()


async def test_the_real_kubelet_runs_the_extender_path_device_plugin_hand_off_and_pod_resources(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    webhook: Any,
    namespace: str,
) -> None:
    async with real_node(admin, control_plane, namespace) as node, extender_node(admin, control_plane, node) as served:
        body = gpu_pod("shared", namespace, milli=250, memory=2048)
        body["spec"]["automountServiceAccountToken"] = False
        await admin.create(paths.pods(namespace), body)
        await explained(
            control_plane, node, served.running(admin, namespace, "shared"), "the kubelet ran the sharing pod"
        )
        r_name, reported = await served.reservation(admin)
        assert (reported,) in served.plugin.allocated, "the kubelet allocated the reservation's GPU through the plugin"
        (main,) = node.cri.running(namespace, "shared").values()
        assert main.env["NVIDIA_VISIBLE_DEVICES"] == reported, "the kubelet resolved the hand-off for the container"
        # The node offers no HAMi-core, so no limit is written: the kubelet leaves the optional reference out.
        assert "CUDA_DEVICE_MEMORY_LIMIT" not in main.env
        (held,) = [a for a in await served.lister.assigned() if a.pod == r_name and a.resource == names.NVIDIA_GPU]
        assert held.device_ids == (reported,), "the kubelet's PodResources API names the same GPU"

        # A reservation that misreports its GPU is corrected from the kubelet's own PodResources.
        wrong = next(u for u in UUIDS if u != reported)
        await admin.patch(
            paths.pod(names.HOLDING_NAMESPACE, r_name), {"metadata": {"annotations": {names.GPU_UUID: wrong}}}
        )

        async def corrected() -> bool:
            found = await admin.get(paths.pod(names.HOLDING_NAMESPACE, r_name))
            return bool(found["metadata"]["annotations"][names.GPU_UUID] == reported)

        await wait_for(corrected, timeout=60, what="the agent corrected the reservation from PodResources")

        await admin.delete(paths.pod(namespace, "shared"), grace_period=0)

        async def stopped() -> bool:
            return not node.cri.running(names.HOLDING_NAMESPACE, r_name) and not node.cri.running(namespace, "shared")

        await explained(control_plane, node, stopped, "the kubelet stopped the reservation once its sharer went")


RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
"""A tenant namespace at PodSecurity restricted."""


def restricted_pod(body: Json) -> Json:
    """`body` made to meet PodSecurity restricted."""
    body["spec"]["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 4242,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for container in body["spec"]["containers"]:
        container["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    body["spec"]["automountServiceAccountToken"] = False
    return body


async def test_an_mps_pod_in_a_restricted_namespace_gets_its_gpus_tenant_folder_bound_by_the_agent(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    webhook: Any,
    namespace: str,
) -> None:
    """Issue 38 item 6 on the extender path: the namespace stays PodSecurity restricted (a hostPath to
    the MPS folders is refused there), yet a pod that demands mps runs: the kubelet asks the agent's
    CSI plugin to publish the pod's inline volume, and the agent binds, read-only, the tenant folder of
    the GPU the pod's reservation reported (holding only the link to that daemon's control socket).
    A pod of the namespace that names the driver without an mps allocation gets nothing: the kubelet
    cannot mount it, and says why. Deleting the pod unbinds the folder."""
    await admin.patch(paths.namespace(namespace), {"metadata": {"labels": RESTRICTED}})
    for doc in stack.manifests("files/volumes/csidriver.yaml"):  # as the chart ships it
        await stack.apply(admin, doc)
    folder = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    supervisor = mps.Supervisor(write_fake_daemon(folder / "bin"), mps.Layout(folder / "mps"))
    async with real_node(admin, control_plane, namespace) as node:
        options = agent_runtime.Options(
            interval=0.5, volumes=volumes.Paths.under(node.root / "plugins", node.root / "plugins_registry")
        )
        async with extender_node(admin, control_plane, node, options, supervisor) as served:

            async def offers_mps() -> bool:
                found = await get_or_none(admin, paths.device(node.name))
                return found is not None and "mps" in found["spec"].get("isolation", [])

            await wait_for(offers_mps, what="the node offers mps")
            plugin = served.agent.volumes
            assert plugin is not None

            async def registered() -> bool:
                return plugin.registration.registered is True

            await explained(control_plane, node, registered, "the kubelet registered the volume plugin")

            refused = restricted_pod(gpu_pod("hostpath", namespace, milli=250, memory=2048))
            refused["spec"]["volumes"] = [{"name": "mps", "hostPath": {"path": handoff.MPS_HOST_ROOT}}]
            with pytest.raises(errors.ForbiddenError, match="restricted"):
                await admin.create(paths.pods(namespace), refused)

            body = restricted_pod(
                gpu_pod("mps", namespace, milli=250, memory=2048, annotations={names.ISOLATION: "mps"})
            )
            await admin.create(paths.pods(namespace), body)
            await explained(control_plane, node, served.running(admin, namespace, "mps"), "the kubelet ran the mps pod")
            _, reported = await served.reservation(admin)
            (main,) = node.cri.running(namespace, "mps").values()
            assert main.env["NVIDIA_VISIBLE_DEVICES"] == reported
            assert main.env[handoff.MPS_PIPE] == handoff.MPS_CLIENT_PIPE
            (host,) = [h for h, c in main.mounts if c == handoff.MPS_MOUNT]
            assert host.startswith(str(node.root / "pods")), "a volume the kubelet published, not a host path"
            assert os.path.samefile(host, supervisor.layout.tenant(reported)), "the reported GPU's tenant folder"
            assert sorted(p.name for p in Path(host).iterdir()) == ["pipe"]
            assert (Path(host) / "pipe" / "control").exists(), "the link to the daemon's control socket"
            with pytest.raises(OSError, match="Read-only file system"):
                (Path(host) / "planted").write_text("x")

            # A tenant's own pod naming the driver: no mps allocation, nothing bound, the kubelet says why.
            posing = restricted_pod(builders.MakePod("posing", namespace).grace(0).container(image="busybox").obj())
            posing["spec"]["nodeName"] = node.name
            posing["spec"]["volumes"] = [handoff.mps_volume("mps", "main")]
            posing["spec"]["containers"][0]["volumeMounts"] = [{"name": "mps", "mountPath": handoff.MPS_MOUNT}]
            await admin.create(paths.pods(namespace), posing)

            async def told() -> list[Json]:
                found = await admin.get(paths.events(namespace), fieldSelector="involvedObject.name=posing")
                return [e for e in found["items"] if "does not demand isolation mps" in e.get("message", "")]

            await explained(control_plane, node, told, "the kubelet's event: the plugin refused the mount")
            assert not node.cri.running(namespace, "posing")

            await admin.delete(paths.pod(namespace, "mps"), grace_period=0)

            async def unbound() -> bool:
                return not node.cri.running(namespace, "mps") and host not in Path("/proc/self/mountinfo").read_text()

            await explained(control_plane, node, unbound, "the folder unbound once the pod went")
    shutil.rmtree(folder, ignore_errors=True)
