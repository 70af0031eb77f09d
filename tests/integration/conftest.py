"""Integration fixtures: one real control plane per test run, the project's own manifests and
scheduler configuration, the extender as a separate process (so tests can SIGKILL it), and the fake
cluster harness. Each test gets a fresh namespace and its own nodes (pods select them by label).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharegpu.core import devices
from sharegpu.kube import client, objects
from sharegpu.testing import controlplane, fakecluster

Json = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    plane = controlplane.ControlPlane(tmp_path_factory.mktemp("controlplane"), controlplane.binaries())
    plane.start()
    yield plane
    plane.stop()


def kube_for(plane: controlplane.ControlPlane, user: str) -> client.KubeClient:
    assert plane.bundle is not None
    return client.KubeClient(client.Credentials(plane.url, plane.token(user), str(plane.bundle.ca_cert)))


@pytest.fixture(scope="session")
async def admin(control_plane: controlplane.ControlPlane) -> AsyncIterator[client.KubeClient]:
    kube = kube_for(control_plane, "admin")
    yield kube
    await kube.close()


async def apply_manifest(kube: client.KubeClient, doc: Json) -> None:
    kind, meta = doc["kind"], doc["metadata"]
    paths = {
        "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{meta.get('namespace')}/roles",
        "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{meta.get('namespace')}/rolebindings",
        "Namespace": "/api/v1/namespaces",
    }
    try:
        await kube.create(paths[kind], doc)
    except Exception as exc:  # already there from an earlier fixture
        if "AlreadyExists" not in str(exc):
            raise


def as_user(doc: Json, service_account: str, user: str) -> Json:
    """The chart binds roles to service accounts; the test control plane has users with tokens."""
    for subject in doc.get("subjects") or []:
        if subject.get("kind") == "ServiceAccount" and subject.get("name") == service_account:
            subject.clear()
            subject.update({"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"})
    return doc


@pytest.fixture(scope="session")
async def system(admin: client.KubeClient) -> None:
    await apply_manifest(
        admin, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": objects.SYSTEM_NAMESPACE}}
    )
    for path in sorted((REPO / "deploy" / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            await apply_manifest(admin, doc)
    for doc in yaml.safe_load_all((REPO / "deploy" / "rbac" / "extender.yaml").read_text()):
        await apply_manifest(admin, as_user(doc, "sharegpu-extender", "sharegpu-extender"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            await admin.get(objects.DEVICES_PATH)
            return
        except Exception:
            await asyncio.sleep(0.2)
    raise RuntimeError("the Device CRD was not served in time")


class ExtenderProcess:
    """`sharegpu extender` as a real process, with the extender's own credentials."""

    def __init__(self, plane: controlplane.ControlPlane, policy: str = "fgd-used") -> None:
        self.plane = plane
        self.port = controlplane.free_port()
        self.policy = policy
        self.process: subprocess.Popen[bytes] | None = None
        self.log = plane.workdir / "logs" / f"extender-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as handle:
            self.process = self._spawn(handle)

    def _spawn(self, handle: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sharegpu",
                "extender",
                "--kubeconfig",
                str(self.plane.kubeconfig("sharegpu-extender")),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--policy",
                self.policy,
                "--log-level",
                "WARNING",
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    async def wait_ready(self, timeout: float = 60) -> None:
        import aiohttp

        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RuntimeError(f"extender exited:\n{self.log.read_text()[-3000:]}")
                try:
                    async with session.get(f"{self.url}/readyz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError("extender not ready in time")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=10)

    async def debug_nodes(self) -> list[Json]:
        import aiohttp

        async with aiohttp.ClientSession() as session, session.get(f"{self.url}/debug/nodes") as response:
            body: Json = await response.json()
            return list(body["nodes"])


@pytest.fixture(scope="session")
async def harness(admin: client.KubeClient, system: None) -> AsyncIterator[fakecluster.FakeCluster]:
    cluster = fakecluster.FakeCluster(admin)
    await cluster.start()
    yield cluster
    await cluster.stop()


@pytest.fixture(scope="session")
async def extender(control_plane: controlplane.ControlPlane, system: None) -> AsyncIterator[ExtenderProcess]:
    process = ExtenderProcess(control_plane)
    process.start()
    await process.wait_ready()
    config = (REPO / "deploy" / "scheduler" / "scheduler-config.v1beta1.yaml").read_text()
    config = config.replace("${KUBECONFIG}", str(control_plane.kubeconfig("system:kube-scheduler")))
    config = config.replace("${EXTENDER_URL}", process.url)
    config = config.replace("${HEALTHZ_ADDRESS}", f"127.0.0.1:{controlplane.free_port()}")
    config = config.replace("${METRICS_ADDRESS}", f"127.0.0.1:{controlplane.free_port()}")
    path = control_plane.workdir / "scheduler-config.yaml"
    path.write_text(config)
    control_plane.start_scheduler(path)
    yield process
    control_plane.stop_process("kube-scheduler")
    process.kill(signal.SIGTERM)


@pytest.fixture
async def namespace(admin: client.KubeClient) -> AsyncIterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    await admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    await admin.request("DELETE", f"/api/v1/namespaces/{name}/pods", params={"gracePeriodSeconds": 0})
    await admin.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture
async def nodes(harness: fakecluster.FakeCluster, namespace: str) -> Callable[..., Any]:
    """Create this test's own nodes: nodes(count, gpus=, model=, ...) -> names (label sharegpu.io/test=<ns>)."""

    async def make(
        count: int = 1,
        gpus: int = 2,
        model: str = "T4",
        memory: int = 16384,
        cpu: int = 32000,
        nvlink_all: bool = False,
    ) -> list[str]:
        made = []
        for _ in range(count):
            name = f"{namespace}-{model.lower()}-{uuid.uuid4().hex[:5]}"
            inventory = devices.uniform_node(
                name,
                gpu_count=gpus,
                model=model,
                gpu_memory_mib=memory,
                cpu_milli=cpu,
                memory_mib=256 * 1024,
                nvlink_all=nvlink_all,
            )
            made.append(inventory)
        await harness.add_nodes(made)
        await asyncio.gather(
            *(
                harness.kube.patch(f"/api/v1/nodes/{n.name}", {"metadata": {"labels": {"sharegpu.io/test": namespace}}})
                for n in made
            )
        )
        return [n.name for n in made]

    return make


def gpu_pod(
    name: str,
    namespace: str,
    *,
    milli: int | None = None,
    count: int = 1,
    memory: int | None = None,
    nvidia: int | None = None,
    annotations: dict[str, str] | None = None,
    cpu: str = "100m",
) -> Json:
    limits: dict[str, str] = {"cpu": cpu, "memory": "64Mi"}
    if nvidia is not None:
        limits[objects.NVIDIA_GPU] = str(nvidia)
    else:
        limits[objects.GPU] = str(count)
        if milli is not None:
            limits[objects.GPU_MILLI] = str(milli)
        if memory is not None:
            limits[objects.GPU_MEMORY] = str(memory)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {
            "schedulerName": objects.SCHEDULER_NAME,
            "nodeSelector": {"sharegpu.io/test": namespace},
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": limits}}],
        },
    }


async def wait_for(predicate: Callable[[], Any], timeout: float = 60, every: float = 0.2, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or predicate}: last {last!r}")
