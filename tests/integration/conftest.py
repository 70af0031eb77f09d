"""Integration fixtures: one real control plane per test run, the project's own manifests and
scheduler configuration, the extender as a separate process (so tests can SIGKILL it), and the fake
cluster harness. Each test gets a fresh namespace and its own nodes (pods select them by label).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from sharegpu.api import names, resources
from sharegpu.core import devices
from sharegpu.devcluster import controlplane, fakecluster, oracle, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

Json = dict[str, Any]


OLDEST = frozenset({
    "test_admission.py", "test_agent.py", "test_chart_components.py", "test_chart_install.py", "test_defrag.py",
    "test_fake_contract.py", "test_helm.py", "test_lost_answers.py", "test_preemption.py", "test_rbac.py", "test_requeue.py",
    "test_scheduling.py",
})  # fmt: skip
"""The modules scripts/test also runs on the oldest Kubernetes the chart admits (controlplane.OLDEST_VERSION):
the chart, scheduling and hand-off, admission, preemption, every eviction (defragmenter, watchdog,
over-commit repair), and the fake API server's contract."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            if item.path.name in OLDEST:
                item.add_marker(pytest.mark.oldest)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    plane = controlplane.ControlPlane(tmp_path_factory.mktemp("controlplane"), controlplane.binaries())
    plane.start()
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
async def admin(control_plane: controlplane.ControlPlane) -> AsyncIterator[client.KubeClient]:
    kube = stack.kube_for(control_plane, "admin")
    yield kube
    await kube.close()


@pytest.fixture(scope="session")
async def system(admin: client.KubeClient) -> None:
    await stack.install(
        admin, compat=tuple(resources.COMPAT)
    )  # the compatibility CRDs too (tests/integration/test_compat.py)


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
    control_plane.start_scheduler(stack.scheduler_config(control_plane, process))
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
        isolation: frozenset[devices.Isolation] = frozenset({devices.Isolation.HAMI_CORE}),
    ) -> list[str]:
        """Nodes offer HAMi-core unless told otherwise (their hand-offs then carry its limits)."""
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
            made.append(dataclasses.replace(inventory, isolation=isolation))
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
        limits[names.NVIDIA_GPU] = str(nvidia)
    else:
        limits[names.GPU] = str(count)
        if milli is not None:
            limits[names.GPU_MILLI] = str(milli)
        if memory is not None:
            limits[names.GPU_MEMORY] = str(memory)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
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


async def refusal(kube: client.KubeClient, namespace: str, name: str) -> str | None:
    """Why kube-scheduler turned the pod away (its PodScheduled=False message), or None while it has not."""
    pod = await kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition["type"] == "PodScheduled" and condition["status"] == "False":
            return str(condition.get("message", ""))
    return None


async def get_or_none(kube: client.KubeClient, path: str) -> Json | None:
    """The object at `path`, or None while it does not exist (yet)."""
    try:
        return await kube.get(path)
    except kube_errors.NotFoundError:
        return None


async def consistent(kube: client.KubeClient, nodes: list[str] | None = None, timeout: float = 60) -> oracle.Findings:
    """Wait until the oracle finds nothing wrong; over-commits and double allocations fail at once
    (they must never happen), reservations may take a moment to follow their sharers."""
    deadline = time.monotonic() + timeout
    while True:
        found = await oracle.inspect(kube, nodes=set(nodes) if nodes is not None else None)
        assert not (found.overcommits or found.double_allocations or found.missing_allocations), found.problems()
        if not found.problems():
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"the cluster did not settle: {found.problems()}")
        await asyncio.sleep(0.3)
