"""The chart installed for real: `helm install` with the image the repository builds
(scripts/build-image) and kube-scheduler's image made from the binary the suite builds, into a
control plane whose pods reach the API server through its `kubernetes` Service (kube-proxy), on a
node whose runtime is containerd and runc under the real kubelet. Every component then runs in a
container as the chart runs it (its user, read-only root, probes, mounts, RBAC, in-cluster
credentials) and must become Ready by its own probes; the extender beside the kube-scheduler that
holds the Lease leads; the API server must reach the webhook through its Service; `helm uninstall`
must leave nothing of sharegpu but its CRDs (and the namespace, which Helm made and leaves).

Not here yet: the agent's DaemonSet (it needs the fake NVIDIA runtime that gives a container NVML),
hence no GPU pod placed and run by the chart's scheduler."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import random
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from sharegpu.api import names, paths
from sharegpu.devcluster import containerd, controlplane, stack
from sharegpu.kube import client
from tests import builders
from tests.conftest import REPO, helm
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.runtime

Json = dict[str, Any]
SYSTEM = names.SYSTEM_NAMESPACE
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
RBAC = "/apis/rbac.authorization.k8s.io/v1"
VERSION = importlib.metadata.version("sharegpu")
"""The image's tag (scripts/build-image tags it with the project's version)."""
CLUSTER_CIDR = "10.244.0.0/16"
"""The nodes' pod networks (each node's containerd takes a /24 of it)."""


def image_archive() -> Path:
    """sharegpu's image as scripts/build-image writes it (built here when missing: a minute or two);
    SHAREGPU_IMAGE_ARCHIVE names another."""
    named = os.environ.get("SHAREGPU_IMAGE_ARCHIVE")
    if named:
        return Path(named)
    archive = REPO / "out" / f"sharegpu-{VERSION}.oci.tar"
    if not archive.is_file():
        subprocess.run([REPO / "scripts" / "build-image"], check=True, capture_output=True, timeout=1200)
    return archive


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    made = controlplane.ControlPlane(tmp_path_factory.mktemp("real"), controlplane.binaries(), pod_network=True)
    if tuple(int(p) for p in made.version.split(".")[:2]) < (1, 37) or not made.has_kubelet:
        pytest.skip("the kubelet and kube-proxy are built with the suite's control plane (1.37)")
    made.start()
    made.start_kube_proxy(CLUSTER_CIDR)
    made.start_default_scheduler()
    yield made
    made.stop()


@pytest.fixture(scope="module")
async def kube(plane: controlplane.ControlPlane) -> AsyncIterator[client.KubeClient]:
    made = stack.kube_for(plane, "admin")
    yield made
    await made.close()


@pytest.fixture(scope="module")
async def node(plane: controlplane.ControlPlane, kube: client.KubeClient) -> AsyncIterator[containerd.Node]:
    bin_dir = await asyncio.to_thread(containerd.binaries)
    made = containerd.Node.make("gpu-node-1", bin_dir, random.randrange(1, 250))
    try:
        images = [
            containerd.sandbox_archive(bin_dir, made.folder),
            containerd.busybox_archive(made.folder),
            containerd.scheduler_archive(plane.bin_dir, plane.version, made.folder),
            await asyncio.to_thread(image_archive),
        ]
        await made.start(plane, kube, images, {})
        yield made
    finally:
        await made.stop(plane, kube)


async def run_helm(plane: controlplane.ControlPlane, *args: str) -> str:
    env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig("admin"))}
    process = await asyncio.create_subprocess_exec(
        helm(), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, f"helm {' '.join(args)}: {err.decode()}"
    return out.decode()


async def pods_of(kube: client.KubeClient, namespace: str) -> list[Json]:
    listed = await kube.get(paths.pods(namespace))
    found: list[Json] = listed["items"]
    return found


def ready(pod: Json) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def describe(pods: list[Json]) -> str:
    lines = []
    for pod in pods:
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        states = {s["name"]: (s.get("state"), s.get("restartCount")) for s in statuses}
        lines.append(f"{pod['metadata']['name']}: {pod.get('status', {}).get('phase')} {states}")
    return "\n".join(lines)


async def test_helm_install_runs_every_component_in_containerd_ready_by_its_own_probes(
    plane: controlplane.ControlPlane, kube: client.KubeClient, node: containerd.Node, tmp_path: Path
) -> None:
    values = {
        "image": {"repository": "localhost/sharegpu", "tag": VERSION, "pullPolicy": "Never"},
        "agent": {"nodeSelector": {"sharegpu.io/no-agent-yet": "true"}},
    }
    (tmp_path / "values.json").write_text(json.dumps(values))
    await run_helm(plane, "install", "sharegpu", str(stack.CHART), "-n", SYSTEM, "--create-namespace",
                   "-f", str(tmp_path / "values.json"))  # fmt: skip

    async def all_ready() -> bool:
        found = await pods_of(kube, SYSTEM)
        return len(found) >= 6 and all(ready(p) for p in found)

    try:
        await wait_for(all_ready, timeout=240, what="every component's pod Ready")
    except AssertionError as exc:
        found = await pods_of(kube, SYSTEM)
        logs = [
            node.logs(p["metadata"]["name"], c["name"]) for p in found if not ready(p) for c in p["spec"]["containers"]
        ]
        raise AssertionError(f"{exc}\n{describe(found)}\n" + "\n".join(logs)) from None
    kinds = sorted(p["metadata"]["labels"].get("app.kubernetes.io/component", "") for p in await pods_of(kube, SYSTEM))
    assert kinds == ["controller", "controller", "scheduler", "scheduler", "webhook", "webhook"], kinds

    # The scheduling pods lead together: kube-scheduler holds the Lease, the extender beside it follows.
    lease = await kube.get(paths.lease(SYSTEM, names.EXTENDER_LEASE))
    holder = lease["spec"]["holderIdentity"].split("_", 1)[0]
    assert holder.startswith("sharegpu-scheduler-"), lease["spec"]
    assert "leading" in node.logs(holder, "extender", lines=200), node.logs(holder, "extender")

    # The API server calls the webhook through its Service (kube-proxy): a GPU pod is sharegpu's.
    await kube.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    body = builders.MakePod("gpu", "team").container(image=containerd.BUSYBOX_IMAGE).obj()
    body["spec"]["containers"][0]["resources"] = {"limits": {names.NVIDIA_GPU: "1"}}
    made = await kube.create(paths.pods("team"), body)
    assert made["spec"]["schedulerName"] == names.SCHEDULER_NAME
    await kube.delete(paths.pod("team", "gpu"), grace_period=0)

    await run_helm(plane, "uninstall", "sharegpu", "-n", SYSTEM, "--wait")

    async def nothing_left() -> bool:
        return not await pods_of(kube, SYSTEM)

    await wait_for(nothing_left, timeout=120, what="every component's pod gone")
    left = [
        f"{kind} {item['metadata']['name']}"
        for kind, path in (("MutatingWebhookConfiguration", f"{ADMISSION}/mutatingwebhookconfigurations"),
                           ("ValidatingWebhookConfiguration", f"{ADMISSION}/validatingwebhookconfigurations"),
                           ("ClusterRole", f"{RBAC}/clusterroles"),
                           ("ClusterRoleBinding", f"{RBAC}/clusterrolebindings"),
                           ("Deployment", f"/apis/apps/v1/namespaces/{SYSTEM}/deployments"),
                           ("Service", f"/api/v1/namespaces/{SYSTEM}/services"),
                           ("ServiceAccount", f"/api/v1/namespaces/{SYSTEM}/serviceaccounts"))
        for item in (await kube.get(path))["items"]
        if item["metadata"]["name"].startswith("sharegpu")
    ]  # fmt: skip
    assert left == [], left
