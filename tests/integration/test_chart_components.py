"""The chart's rendering for the control plane's version, run: every sharegpu component started as a
process on the host with exactly the arguments its Deployment or DaemonSet renders (the pod's mounts
pointed at files holding the rendered Secrets, its ports at free ones, a kubeconfig in place of the
in-cluster account), and kube-scheduler from the rendered configuration calling that extender with
the rendered certificates. A GPU pod submitted with kubectl is placed and gets its hand-off; the
webhook answers a review over TLS with the rendered certificate (checked against the rendered CA by
the Service's DNS name); the agent publishes its node's Device; the controller becomes ready; every
health port serves the rendered health certificate (checked against its CA by the name the PodMonitor
verifies)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import names, paths
from sharegpu.core import devices
from sharegpu.devcluster import controlplane, fakecluster, stack
from sharegpu.kube import client
from tests.conftest import one, render
from tests.integration.conftest import get_or_none, gpu_pod, kubectl, lease_holder, wait_for

Json = dict[str, Any]
MOUNTS = {"/etc/sharegpu/extender-tls": "sharegpu-extender-tls", "/etc/sharegpu/webhook-tls": "sharegpu-webhook-tls",
          "/etc/sharegpu/health-tls": "sharegpu-health-tls"}  # fmt: skip


def container(docs: list[Json], kind: str, name: str, index: int = 0) -> Json:
    found: Json = one(docs, kind, name)["spec"]["template"]["spec"]["containers"][index]
    return found


class Processes:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.running: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str]) -> None:
        with (self.folder / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.running.append((name, process))

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()[-3000:]

    def check(self) -> None:
        for name, process in self.running:
            assert process.poll() is None, f"{name} exited:\n{self.log(name)}"

    def stop(self) -> None:
        for _, process in self.running:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        for _, process in self.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(15)
            if process.poll() is None:
                process.kill()


IDENTITY = "chart-components-test"
"""Leader-election identity of this test's extender and controller: the Leases they took are freed
after them (a stopped process leaves its Lease held until it expires, which later tests would wait out)."""


@pytest.fixture
async def processes(admin: client.KubeClient, tmp_path: Path) -> AsyncIterator[Processes]:
    running = Processes(tmp_path)
    yield running
    running.stop()
    for lease in (names.EXTENDER_LEASE, names.CONTROLLER_LEASE):
        if await lease_holder(admin, lease) == IDENTITY:
            await admin.delete(paths.lease(names.SYSTEM_NAMESPACE, lease))


def sharegpu(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "sharegpu", *args]


async def ready(url: str, what: str, processes: Processes, ssl_context: ssl.SSLContext | bool = True,
                hostname: str | None = None) -> None:  # fmt: skip
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            processes.check()
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url, ssl=ssl_context, server_hostname=hostname) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise AssertionError(f"{what} not ready in time:\n{processes.log(what)}")


async def test_the_rendered_components_run_and_place_a_gpu_pod(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    processes: Processes,
    tmp_path: Path,
) -> None:
    docs = render(control_plane.version)
    mounts: dict[str, str] = {}
    for mount, secret in MOUNTS.items():
        folder = tmp_path / secret
        folder.mkdir()
        for key, value in one(docs, "Secret", secret)["data"].items():
            (folder / key).write_bytes(base64.b64decode(value))
        mounts[mount] = str(folder)

    def localize(args: list[str], **values: str) -> list[str]:
        """The rendered arguments with the pod's mount paths and variables replaced."""
        out = []
        for arg in args:
            local = arg
            for mount, folder in mounts.items():
                local = local.replace(mount, folder)
            for key, value in values.items():
                local = local.replace(f"$({key})", value)
            out.append(local)
        return out

    # The extender, beside the scheduler: its rendered arguments; loopback and free ports.
    port, health = controlplane.free_port(), controlplane.free_port()
    rendered = container(docs, "Deployment", "sharegpu-scheduler", 1)["args"]
    assert "--host=0.0.0.0" in rendered and "--follow-scheduler" in rendered
    # It follows the kube-scheduler of its pod on the Lease; here, with no pod, it campaigns for it.
    campaigning = ["--leader-elect" if a == "--follow-scheduler" else a for a in localize(rendered)]
    processes.start("extender", sharegpu([
        *campaigning, "--host=127.0.0.1", f"--port={port}", f"--health-port={health}",
        "--kubeconfig", str(control_plane.kubeconfig("sharegpu-extender")), f"--identity={IDENTITY}",
    ]))  # fmt: skip
    # Every health port serves the rendered health certificate, checked by its name as the PodMonitor does.
    health_ca = ssl.create_default_context(cafile=str(tmp_path / "sharegpu-health-tls" / "ca.crt"))
    health_name = f"sharegpu-health.{names.SYSTEM_NAMESPACE}.svc"
    await ready(f"https://127.0.0.1:{health}/readyz", "extender", processes, health_ca, health_name)

    # kube-scheduler from the rendered configuration, calling that extender with the rendered PKI.
    configuration = yaml.safe_load(one(docs, "ConfigMap", "sharegpu-scheduler")["data"]["config.yaml"])
    text = yaml.safe_dump(configuration)
    for mount, local in mounts.items():
        text = text.replace(mount, local)
    configuration = yaml.safe_load(text.replace("https://127.0.0.1:8888", f"https://127.0.0.1:{port}"))
    configuration["clientConnection"]["kubeconfig"] = str(control_plane.kubeconfig("admin"))
    configuration["leaderElection"]["resourceName"] = f"chart-{namespace}"
    (profile,) = configuration["profiles"]
    profile["schedulerName"] = f"chart-{namespace}"  # the test stack's scheduler serves the chart's name
    path = tmp_path / "scheduler.yaml"
    path.write_text(yaml.safe_dump(configuration))
    processes.start("kube-scheduler", [str(control_plane.bin_dir / "kube-scheduler"), f"--config={path}",
                                       "--secure-port=0"])  # fmt: skip

    # The webhook and the controller with their rendered arguments.
    hook_port = controlplane.free_port()
    processes.start("webhook", sharegpu([
        *localize(container(docs, "Deployment", "sharegpu-webhook")["args"]), "--host=127.0.0.1",
        f"--port={hook_port}", "--kubeconfig", str(control_plane.kubeconfig("sharegpu-webhook")),
    ]))  # fmt: skip
    controller_health = controlplane.free_port()
    processes.start("controller", sharegpu([
        *localize(container(docs, "Deployment", "sharegpu-controller")["args"]), "--host=127.0.0.1",
        f"--health-port={controller_health}", "--kubeconfig", str(control_plane.kubeconfig("sharegpu-controller")),
        f"--identity={IDENTITY}",
    ]))  # fmt: skip

    # The agent on a new fake GPU node, with its rendered arguments and a fake NVML.
    node = devices.uniform_node(f"{namespace}-chart", gpu_count=4, model="A100", gpu_memory_mib=40960,
                                cpu_milli=32000, memory_mib=256 * 1024)  # fmt: skip
    await harness.add_node(node, publish=False)
    await admin.patch(paths.node(node.name), {"metadata": {"labels": {"sharegpu.io/test": namespace}}})
    nvml = tmp_path / "nvml.yaml"
    nvml.write_text(fakenvml.describe(node))
    agent_health = controlplane.free_port()
    rendered = container(docs, "DaemonSet", "sharegpu-agent")["args"]
    processes.start("agent", sharegpu([
        # No kubelet here to register the volume plugin (test_kubelet.py runs it under a real one).
        *localize(rendered, NODE_NAME=node.name), "--fake-nvml", str(nvml), "--kubelet-socket", "", "--no-volumes",
        "--host=127.0.0.1", f"--health-port={agent_health}", "--hami-core-dir", str(tmp_path / "hami"),
        "--kubeconfig", str(control_plane.kubeconfig("sharegpu-agent")),
    ]))  # fmt: skip

    ca = ssl.create_default_context(cafile=str(tmp_path / "sharegpu-webhook-tls" / "ca.crt"))
    service = f"sharegpu-webhook.{names.SYSTEM_NAMESPACE}.svc"
    await ready(f"https://127.0.0.1:{hook_port}/readyz", "webhook", processes, ca, service)
    await ready(f"https://127.0.0.1:{controller_health}/readyz", "controller", processes, health_ca, health_name)
    await ready(f"https://127.0.0.1:{agent_health}/readyz", "agent", processes, health_ca, health_name)

    async def published() -> bool:
        found = await get_or_none(admin, paths.device(node.name))
        return found is not None and len(found["spec"]["gpus"]) == 4

    await wait_for(published, what="the agent's Device")

    # GPU pods, submitted with kubectl, placed by the rendered scheduler and extender: a share, a whole
    # GPU and a share of two GPUs.
    def handoff() -> dict[str, str]:
        return {names.HANDOFF: f"sharegpu-handoff-{uuid.uuid4().hex[:6]}"}

    sharing = gpu_pod("rendered", namespace, milli=300, annotations=handoff())
    whole = gpu_pod("whole", namespace, nvidia=1)
    multi = gpu_pod("multi", namespace, milli=400, count=2, annotations=handoff())
    for pod in (sharing, whole, multi):
        pod["spec"]["schedulerName"] = f"chart-{namespace}"
    submitted = tmp_path / "pods.yaml"
    submitted.write_text(yaml.safe_dump_all([sharing, whole, multi]))
    await kubectl(control_plane, "apply", "-n", namespace, "-f", str(submitted))

    async def handed_off(pod: Json) -> dict[str, str] | None:
        found = await admin.get(paths.pod(namespace, pod["metadata"]["name"]))
        if found["spec"].get("nodeName") != node.name:
            return None
        handoff = await get_or_none(admin, paths.configmap(namespace, pod["metadata"]["annotations"][names.HANDOFF]))
        return dict(handoff.get("data") or {}) or None if handoff is not None else None

    try:
        data = await wait_for(lambda: handed_off(sharing), timeout=60, what="the share placed with its hand-off")
        spread = await wait_for(lambda: handed_off(multi), timeout=60, what="the two-GPU share with its hand-off")
        await wait_for(lambda: _on(admin, namespace, "whole", node.name), timeout=60, what="the whole GPU pod placed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{processes.log('kube-scheduler')}\n{processes.log('extender')}") from None
    assert data["main.NVIDIA_VISIBLE_DEVICES"].startswith(f"GPU-{node.name}-")
    two = spread["main.NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(set(two)) == 2 and all(u.startswith(f"GPU-{node.name}-") for u in two), two

    # The webhook answers a review over TLS, by the Service's name, with the rendered certificate.
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u1", "operation": "CREATE", "namespace": namespace, "userInfo": {"username": "alice"},
        "object": {"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "main", "resources": {"limits": {"koordinator.sh/gpu-core": "30"}}}]}}}}  # fmt: skip
    url = f"https://127.0.0.1:{hook_port}/mutate/pods"
    async with aiohttp.ClientSession() as session, session.post(url, json=review, ssl=ca,
                                                                server_hostname=service) as response:  # fmt: skip
        answer = await response.json()
    assert answer["response"]["allowed"] and answer["response"]["patch"], answer
    processes.check()


async def _on(admin: client.KubeClient, namespace: str, name: str, node: str) -> bool:
    return bool((await admin.get(paths.pod(namespace, name)))["spec"].get("nodeName") == node)
