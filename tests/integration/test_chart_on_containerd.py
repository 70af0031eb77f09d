"""The chart installed for real: `helm install` with the image the repository builds
(scripts/build-image) and kube-scheduler's image made from the binary the suite builds, into a
control plane whose pods reach the API server through its `kubernetes` Service (kube-proxy), on a
node whose runtime is containerd and runc under the real kubelet. Every component then runs in a
container as the chart runs it (its user, read-only root, probes, mounts, RBAC, in-cluster
credentials) and must become Ready by its own probes; the extender beside the kube-scheduler that
holds the Lease leads; the API server must reach the webhook through its Service; `helm uninstall`
must leave nothing of sharegpu but its CRDs (and the namespace, which Helm made and leaves).

The node's GPUs are fake, given as a real node gives them: character devices, the NVIDIA device
plugin (fake) offering nvidia.com/gpu to the kubelet, and the NVIDIA container runtime (fake:
`devcluster.nvidiaruntime`, in front of runc) that gives a container asking by its environment its
GPUs' device nodes and, for NVML, the node's fake NVML file. So the agent's DaemonSet runs in its
container as the chart runs it, and a sharing pod, a whole-GPU pod and a pod written for HAMi are
placed by the chart's scheduler and run; what each container sees (its NVIDIA_VISIBLE_DEVICES, its /dev) is read from
inside it and must be what its allocation says. Then faults with real containers (the agent's pod
deleted, the leading extender's container stopped, containerd and the kubelet killed and restarted)
and a `helm upgrade` with changed values: every component comes back Ready, every placed pod keeps
its allocation and runs on (its container the same), and the oracle finds no GPU over-committed or
held twice."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import os
import random
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from sharegpu.api import names, paths, pods, wire
from sharegpu.devcluster import containerd, controlplane, oracle, stack
from sharegpu.kube import client
from sharegpu.webhook import translate
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
UUIDS = ("GPU-0", "GPU-1", "GPU-2")
"""The node's fake GPUs."""
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
    made = containerd.Node.make("gpu-node-1", bin_dir, random.randrange(1, 250), UUIDS)
    try:
        images = [
            containerd.sandbox_archive(bin_dir, made.folder),
            containerd.busybox_archive(made.folder),
            containerd.scheduler_archive(plane.bin_dir, plane.version, made.folder),
            await asyncio.to_thread(image_archive),
        ]
        await made.start(plane, kube, images, {"nvidia.com/gpu.present": "true"})
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


def busybox(name: str, namespace: str, limits: dict[str, str]) -> Json:
    """A pod that prints its environment and its devices, then sleeps (the image is never pulled)."""
    body = builders.MakePod(name, namespace).grace(0).container(image=containerd.BUSYBOX_IMAGE).obj()
    body["spec"]["containers"][0].update({
        "command": ["sh", "-c", "sleep 3600"], "imagePullPolicy": "Never", "resources": {"limits": limits},
    })  # fmt: skip
    body["spec"]["automountServiceAccountToken"] = False
    return body


async def test_helm_install_runs_every_component_in_containerd_and_places_and_runs_gpu_pods(
    plane: controlplane.ControlPlane, kube: client.KubeClient, node: containerd.Node, tmp_path: Path
) -> None:
    values = {
        "image": {"repository": "localhost/sharegpu", "tag": VERSION, "pullPolicy": "Never"},
        # The node's kubelet and CDI folders are its own (chart values, mounted at the same paths).
        "agent": {"paths": {"kubelet": str(node.root), "cdi": str(node.runtime.cdi_dir)}},
    }
    (tmp_path / "values.json").write_text(json.dumps(values))
    await run_helm(plane, "install", "sharegpu", str(stack.CHART), "-n", SYSTEM, "--create-namespace",
                   "-f", str(tmp_path / "values.json"))  # fmt: skip

    async def all_ready() -> bool:
        found = await pods_of(kube, SYSTEM)
        return len(found) >= 7 and all(ready(p) for p in found)

    try:
        await wait_for(all_ready, timeout=240, what="every component's pod Ready")
    except AssertionError as exc:
        found = await pods_of(kube, SYSTEM)
        logs = [
            node.logs(p["metadata"]["name"], c["name"]) for p in found if not ready(p) for c in p["spec"]["containers"]
        ]
        raise AssertionError(f"{exc}\n{describe(found)}\n" + "\n".join(logs)) from None
    kinds = sorted(p["metadata"]["labels"].get("app.kubernetes.io/component", "") for p in await pods_of(kube, SYSTEM))
    assert kinds == ["agent", "controller", "controller", "scheduler", "scheduler", "webhook", "webhook"], kinds

    # The agent, in its container, read the node's GPUs through the (fake) NVIDIA runtime.
    device = await kube.get(paths.device(node.name))
    assert [g["uuid"] for g in device["spec"]["gpus"]] == list(UUIDS)

    # The scheduling pods lead together: kube-scheduler holds the Lease, the extender beside it follows.
    lease = await kube.get(paths.lease(SYSTEM, names.EXTENDER_LEASE))
    holder = lease["spec"]["holderIdentity"].split("_", 1)[0]
    assert holder.startswith("sharegpu-scheduler-"), lease["spec"]
    assert "leading" in node.logs(holder, "extender", lines=200), node.logs(holder, "extender")

    # GPU pods, sent to sharegpu by the webhook (the API server calls it through its Service), placed
    # by the chart's scheduler and run: what each container sees is what its allocation says.
    await kube.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    share = await kube.create(paths.pods("team"), busybox("share", "team", {names.GPU: "1", names.GPU_MILLI: "300"}))
    assert share["spec"]["schedulerName"] == names.SCHEDULER_NAME
    await kube.create(paths.pods("team"), busybox("whole", "team", {names.NVIDIA_GPU: "1"}))
    # Written for HAMi (a quarter of a GPU's cores, 2 GiB of its memory): translated by the webhook.
    hami = {names.NVIDIA_GPU: "1", translate.HAMI_CORES: "25", translate.HAMI_MEMORY: "2048"}
    await kube.create(paths.pods("team"), busybox("hami", "team", hami))

    running = functools.partial(node.running, kube, "team")

    seen: dict[str, tuple[dict[str, str], set[str]]] = {}
    for pod in ("share", "whole", "hami"):
        try:
            container = await wait_for(functools.partial(running, pod), timeout=120, what=f"pod {pod} running")
        except AssertionError as exc:
            found = await pods_of(kube, "team") + await pods_of(kube, names.HOLDING_NAMESPACE)
            raise AssertionError(f"{exc}\n{describe(found)}") from None
        env = dict(line.split("=", 1) for line in node.inside(container, "env").splitlines() if "=" in line)
        dev = {
            line.split()[-1] for line in node.inside(container, "ls", "-l", "/dev").splitlines() if line.startswith("c")
        }
        seen[pod] = (env, {d for d in dev if d.startswith("nvidia") and d[6:].isdigit()})
    # A shared GPU is the one its slot's reservation pod holds (the kubelet picks it from the device
    # plugin's, and the reservation reports it): a sharing container sees exactly that one.
    held: dict[int, str] = {}
    for reservation in await pods_of(kube, names.HOLDING_NAMESPACE):
        slot = pods.record(wire.convert(reservation, wire.Pod)).reservation
        if slot is not None and slot.node == node.name and slot.uuid:
            held[slot.index] = slot.uuid

    def sees_its_slot(pod: str, milli: int, memory_mib: int | None = None) -> str:
        allocation = pods.allocation_of(wire.convert(placed[pod], wire.Pod))
        assert allocation is not None and not allocation.exclusive and len(allocation.gpu_indices) == 1
        (index,) = allocation.gpu_indices
        used = allocation.gpu_usage()[index]
        assert used[0] == milli and memory_mib in (None, used[1]), allocation.gpu_usage()
        env, gpus = seen[pod]
        uuid = held[index]
        assert env["NVIDIA_VISIBLE_DEVICES"] == uuid and gpus == {f"nvidia{UUIDS.index(uuid)}"}, (pod, seen[pod])
        return uuid

    placed = {pod: await kube.get(paths.pod("team", pod)) for pod in ("share", "hami")}
    shared = {sees_its_slot("share", 300), sees_its_slot("hami", 250, 2048)}
    env, gpus = seen["whole"]
    (whole,) = gpus
    assert env["NVIDIA_VISIBLE_DEVICES"] == UUIDS[int(whole[6:])] not in shared, (seen["whole"], shared)

    # Faults with real containers, then an upgrade: every placed pod keeps its allocation and runs on.
    agent = next(
        p for p in await pods_of(kube, SYSTEM) if p["metadata"]["labels"].get("app.kubernetes.io/component") == "agent"
    )
    await kube.delete(paths.pod(SYSTEM, agent["metadata"]["name"]))  # the DaemonSet makes another
    lease = await kube.get(paths.lease(SYSTEM, names.EXTENDER_LEASE))
    leader = lease["spec"]["holderIdentity"].split("_", 1)[0]
    node.runtime.crictl("stop", "--timeout", "0", node.container(leader, "extender"))  # the kubelet restarts it
    before = {pod: await running(pod) for pod in ("share", "whole", "hami")}
    await asyncio.to_thread(node.runtime.restart)  # containerd crashes and comes back: containers run on
    await asyncio.to_thread(plane.restart, node.kubelet, down_for=1.0)  # so does the kubelet
    await wait_for(all_ready, timeout=180, what="every component Ready again after the faults")
    assert {pod: await running(pod) for pod in ("share", "whole", "hami")} == before, "the GPU pods' containers ran on"
    values["extender"] = {"logLevel": "DEBUG"}
    (tmp_path / "values.json").write_text(json.dumps(values))
    await run_helm(plane, "upgrade", "sharegpu", str(stack.CHART), "-n", SYSTEM, "-f", str(tmp_path / "values.json"))

    async def upgraded() -> bool:
        found = await pods_of(kube, SYSTEM)
        args = [c.get("args", []) for p in found for c in p["spec"]["containers"] if c["name"] == "extender"]
        return len(found) == 7 and all(ready(p) for p in found) and all("--log-level=DEBUG" in a for a in args)

    await wait_for(upgraded, timeout=240, what="the upgraded release Ready")
    after = await kube.get(paths.pod("team", "share"))
    assert after["metadata"]["annotations"] == placed["share"]["metadata"]["annotations"], "the allocation kept"
    assert [await running(pod) != "" for pod in ("share", "whole", "hami")] == [True, True, True]
    judged = await oracle.inspect(kube)
    assert (judged.overcommits, judged.double_allocations, judged.unheld) == ([], [], []), judged

    for pod in ("share", "whole", "hami"):
        await kube.delete(paths.pod("team", pod), grace_period=0)

    async def reservations_gone() -> bool:
        return not await pods_of(kube, names.HOLDING_NAMESPACE)

    await wait_for(reservations_gone, timeout=90, what="the GPU's reservation gone with its sharer")
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
                           ("DaemonSet", f"/apis/apps/v1/namespaces/{SYSTEM}/daemonsets"),
                           ("Service", f"/api/v1/namespaces/{SYSTEM}/services"),
                           ("ServiceAccount", f"/api/v1/namespaces/{SYSTEM}/serviceaccounts"))
        for item in (await kube.get(path))["items"]
        if item["metadata"]["name"].startswith("sharegpu")
    ]  # fmt: skip
    assert left == [], left
