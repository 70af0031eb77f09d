"""The real kubelet (1.37, built from its Go module with the control plane) and sharegpu's DRA kubelet
plugin: the kubelet registers the node (its container runtime the project's fake CRI), the agent
with --dra publishes the node's GPUs and serves the plugin in the kubelet's own folders, the kubelet
registers the plugin, sharegpu's allocator allocates a pod's claim there, kube-scheduler binds the
pod, and the kubelet itself calls NodePrepareResources: the claim's CDI spec appears with the GPU
the claim holds. Deleting the pod makes the kubelet unprepare it."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import orjson
import pytest

from sharegpu.agent import draplugin, fakenvml
from sharegpu.agent import runtime as agent_runtime
from sharegpu.api import cdi, dra, names, paths
from sharegpu.devcluster import controlplane, fakecri, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests import builders
from tests.builders import NVML_FILE, write_nvml
from tests.integration.conftest import Json, get_or_none, wait_for


async def ready_node(admin: client.KubeClient, name: str) -> Json | None:
    found = await get_or_none(admin, paths.node(name))
    conditions = ((found or {}).get("status") or {}).get("conditions") or []
    return found if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None


async def test_the_real_kubelet_registers_the_plugin_and_prepares_the_claim_through_it(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    namespace: str,
    device_class: str,
) -> None:
    if tuple(int(p) for p in control_plane.version.split(".")[:2]) < (1, 37) or not control_plane.has_kubelet:
        pytest.skip("the kubelet is built with the suite's control plane (1.37)")
    node = f"kubelet-{uuid.uuid4().hex[:6]}"
    folder = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))  # short: unix socket paths
    cri = fakecri.FakeCri(folder / "cri.sock")
    await cri.start()
    kubelet = control_plane.start_kubelet(node, folder / "root", cri.endpoint, {"sharegpu.io/test": namespace})
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    agent: agent_runtime.Agent | None = None
    try:

        async def registered_ready() -> Json | None:
            return await ready_node(admin, node)

        try:
            await wait_for(registered_ready, timeout=90, what=f"the kubelet's node {node} Ready")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{control_plane.log(kubelet)[-4000:]}") from None
        # No node lifecycle controller runs here to lift the not-ready taint of registration.
        await admin.patch(paths.node(node), {"spec": {"taints": None}})
        nvml = folder / "nvml.yaml"
        write_nvml(nvml, NVML_FILE)
        plugin_paths = draplugin.Paths.under(folder / "root" / "plugins", folder / "root" / "plugins_registry",
                                             folder / "cdi")  # fmt: skip
        options = agent_runtime.Options(interval=0.5, dra=True, dra_plugin=plugin_paths)
        agent = agent_runtime.Agent(kube, node, fakenvml.FakeNvml(nvml).open(), options)
        await agent.start()
        plugin = agent.plugin
        assert plugin is not None

        async def plugin_registered() -> bool:
            return plugin.registered is True

        await wait_for(plugin_registered, timeout=60, what="the kubelet registered sharegpu's DRA plugin")
        await wait_for(lambda: get_or_none(admin, dra.slice_path(node)), what="the node's ResourceSlice")

        claims = dra.claim_path(namespace)
        await admin.create(claims, builders.MakeClaim("c", namespace).ask(300, "4Gi").obj())
        pod = builders.MakePod("p", namespace).scheduler().grace(0).node_selector({"kubernetes.io/hostname": node})
        await admin.create(paths.pods(namespace), pod.container(image="busybox").claim("c").gate().obj())

        async def bound() -> str | None:
            found = await admin.get(paths.pod(namespace, "p"))
            node_name: str | None = found["spec"].get("nodeName")
            return node_name

        assert await wait_for(bound, timeout=90, what="the pod bound to the kubelet's node") == node
        claim = await admin.get(f"{claims}/c")
        uid = claim["metadata"]["uid"]
        spec_file = plugin_paths.cdi_dir / cdi.file_name(uid)

        async def prepared() -> bool:
            return spec_file.exists()

        try:
            await wait_for(prepared, timeout=60, what="the kubelet prepared the claim through the plugin")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{control_plane.log(kubelet)[-4000:]}") from None
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        index = int(result["device"].removeprefix("gpu-"))
        written = orjson.loads(spec_file.read_bytes())
        assert f"{names.DOMAIN}/claim" == written["kind"]
        assert f"NVIDIA_VISIBLE_DEVICES=GPU-{index}" in written["devices"][0]["containerEdits"]["env"]
        assert cri.calls["RunPodSandbox"] >= 1, "the kubelet went on to the runtime after preparing"

        await admin.delete(paths.pod(namespace, "p"), grace_period=0)

        async def unprepared() -> bool:
            return not spec_file.exists()

        await wait_for(unprepared, timeout=90, what="the kubelet unprepared the claim once the pod went")
    finally:
        if agent is not None:
            await agent.stop()
        control_plane.stop_process(kubelet)
        await cri.stop()
        await kube.close()
        await admin.delete(paths.node(node))
        shutil.rmtree(folder, ignore_errors=True)
