"""The whole sharegpu stack on a local control plane, as one object: used by the benchmarks and by
`sharegpu devcluster`. Starts the control plane, installs the project's CRDs and RBAC, runs the
extender as its own process (with its own credentials) and kube-scheduler with the project's
scheduler configuration, and optionally the fake-cluster harness."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from sharegpu.kube import client, objects
from sharegpu.testing import controlplane, fakecluster

Json = dict[str, Any]
DEPLOY = controlplane.data_path("deploy")

_PATHS = {
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
    "Namespace": "/api/v1/namespaces",
}


async def apply(kube: client.KubeClient, doc: Json) -> None:
    """Create `doc` unless it exists."""
    path = _PATHS[doc["kind"]].format(namespace=doc["metadata"].get("namespace", ""))
    try:
        await kube.create(path, doc)
    except Exception as exc:
        if "AlreadyExists" not in str(exc):
            raise


def as_user(doc: Json, service_account: str, user: str) -> Json:
    """The chart binds roles to service accounts; the local control plane has token users instead."""
    for subject in doc.get("subjects") or []:
        if subject.get("kind") == "ServiceAccount" and subject.get("name") == service_account:
            subject.clear()
            subject.update({"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"})
    return doc


def kube_for(plane: controlplane.ControlPlane, user: str, connections: int = 64) -> client.KubeClient:
    assert plane.bundle is not None
    return client.KubeClient(
        client.Credentials(plane.url, plane.token(user), str(plane.bundle.ca_cert)), connections=connections
    )


async def install(kube: client.KubeClient) -> None:
    """Namespace, CRDs and RBAC from deploy/, then wait until the Device resource is served."""
    await apply(kube, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": objects.SYSTEM_NAMESPACE}})
    for path in sorted((DEPLOY / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            await apply(kube, doc)
    for component in ("extender", "webhook"):
        for doc in yaml.safe_load_all((DEPLOY / "rbac" / f"{component}.yaml").read_text()):
            await apply(kube, as_user(doc, f"sharegpu-{component}", f"sharegpu-{component}"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            await kube.get(objects.DEVICES_PATH)
            return
        await asyncio.sleep(0.2)
    raise controlplane.ControlPlaneError("the Device CRD was not served in time")


class ExtenderProcess:
    """`sharegpu extender` as a real process (so it can be SIGKILLed), with its own credentials."""

    def __init__(self, plane: controlplane.ControlPlane, policy: str = "fgd-used", *extra: str) -> None:
        self.plane = plane
        self.port = controlplane.free_port()
        self.policy = policy
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.log = plane.workdir / "logs" / f"extender-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "sharegpu", "extender",
            "--kubeconfig", str(self.plane.kubeconfig("sharegpu-extender")),
            "--host", "127.0.0.1", "--port", str(self.port), "--policy", self.policy, "--log-level", "WARNING",
            *self.extra,
        ]  # fmt: skip
        with self.log.open("ab") as handle:
            self.process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise controlplane.ControlPlaneError(f"extender exited:\n{self.log.read_text()[-3000:]}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{self.url}/readyz") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise controlplane.ControlPlaneError("extender not ready in time")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=10)

    async def debug_nodes(self) -> list[Json]:
        async with aiohttp.ClientSession() as session, session.get(f"{self.url}/debug/nodes") as response:
            body: Json = await response.json()
            return list(body["nodes"])


def scheduler_config(plane: controlplane.ControlPlane, extender_url: str) -> Path:
    """deploy/scheduler/scheduler-config.v1beta1.yaml with its placeholders filled in."""
    text = (DEPLOY / "scheduler" / "scheduler-config.v1beta1.yaml").read_text()
    for key, value in {
        "${KUBECONFIG}": str(plane.kubeconfig("system:kube-scheduler")),
        "${EXTENDER_URL}": extender_url,
        "${HEALTHZ_ADDRESS}": f"127.0.0.1:{controlplane.free_port()}",
        "${METRICS_ADDRESS}": f"127.0.0.1:{controlplane.free_port()}",
    }.items():
        text = text.replace(key, value)
    path = plane.workdir / "scheduler-config.yaml"
    path.write_text(text)
    return path


class Stack:
    def __init__(self, workdir: Path, policy: str = "fgd-used", extender_args: tuple[str, ...] = ()) -> None:
        self.plane = controlplane.ControlPlane(workdir, controlplane.binaries())
        self.policy = policy
        self.extender_args = extender_args
        self.extender: ExtenderProcess | None = None
        self.admin: client.KubeClient | None = None
        self.harness: fakecluster.FakeCluster | None = None

    async def start(self, harness: bool = True) -> None:
        try:
            await self._start(harness)
        except BaseException:
            await self.stop()  # leave no process behind when a part fails to start
            raise

    async def _start(self, harness: bool) -> None:
        self.plane.start()
        self.admin = kube_for(self.plane, "admin", connections=128)
        await install(self.admin)
        self.extender = ExtenderProcess(self.plane, self.policy, *self.extender_args)
        self.extender.start()
        await self.extender.wait_ready()
        self.plane.start_scheduler(scheduler_config(self.plane, self.extender.url))
        self.harness = fakecluster.FakeCluster(self.admin)
        if harness:
            await self.harness.start()

    async def stop(self) -> None:
        if self.harness is not None:
            await self.harness.stop()
        if self.extender is not None:
            self.extender.kill(signal.SIGTERM)
        if self.admin is not None:
            await self.admin.close()
        self.plane.stop()
