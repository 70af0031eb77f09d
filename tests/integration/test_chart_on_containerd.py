"""The chart installed for real: `helm install` with the image the repository builds
(scripts/build-image) and kube-scheduler's image made from the binary the suite builds, into a
control plane whose pods reach the API server through its `kubernetes` Service (kube-proxy), on two
nodes side by side whose runtime is containerd and runc under the real kubelet. Every component then runs in a
container as the chart runs it (its user, read-only root, probes, mounts, RBAC, in-cluster
credentials) and must become Ready by its own probes; the extender beside the kube-scheduler that
holds the Lease leads; the API server must reach the webhook through its Service; `helm uninstall`
must leave nothing of sharegpu but its CRDs (and the namespace, which Helm made and leaves).

The nodes' GPUs are fake, given as a real node gives them: character devices, the NVIDIA device
plugin (fake) offering nvidia.com/gpu to the kubelet, and the NVIDIA container runtime (fake:
`devcluster.nvidiaruntime`, in front of runc) that gives a container asking by its environment its
GPUs' device nodes and, for NVML, the node's fake NVML file. So the agent's DaemonSet runs in its
container as the chart runs it (with the DRA driver on: each node's GPUs are also a ResourceSlice),
and a sharing pod, a whole-GPU pod and a pod written for HAMi are placed by the chart's scheduler,
a pod with a claim of sharegpu's class (written as Kubernetes documents DRA, no gate) by sharegpu's
allocator, and all run; what each container sees (its NVIDIA_VISIBLE_DEVICES, its /dev, for the
claim what containerd applied of its CDI devices) is read from inside it and must be what its
allocation says. Then faults with real containers (the agent's pod
deleted, the leading extender's container stopped, containerd and the kubelet killed and restarted)
and a `helm upgrade` with changed values: every component comes back Ready, every placed pod keeps
its allocation and runs on (its container the same), and the oracle finds no GPU over-committed or
held twice."""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sharegpu.api import dra, names, paths, pods, wire
from sharegpu.devcluster import containerd, controlplane, oracle, realcluster
from sharegpu.kube import client, leader
from sharegpu.webhook import translate
from tests import builders
from tests.integration.conftest import lease_holder, wait_for

pytestmark = pytest.mark.runtime

Json = dict[str, Any]
SYSTEM = names.SYSTEM_NAMESPACE
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
RBAC = "/apis/rbac.authorization.k8s.io/v1"
GPUS = {"gpu-node-1": ("GPU-0", "GPU-1", "GPU-2"), "dra-node-1": ("GPU-3", "GPU-4")}
"""Each node's fake GPUs (the i-th is its /dev/nvidia<i>)."""


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[realcluster.RealCluster]:
    """Two nodes with GPUs on this machine, each its own containerd, kubelet and mount namespace: one
    serves the extender path, one (labelled `realcluster.DRA_NODES`) DRA claims."""
    version = tuple(int(part) for part in controlplane.k8s_version().split(".")[:2])
    if version < (1, 37) or not (controlplane.binaries() / "kubelet").is_file():
        pytest.skip("the kubelet and kube-proxy are built with the suite's control plane (1.37)")
    made = realcluster.RealCluster(tmp_path_factory.mktemp("real"), GPUS, frozenset({"dra-node-1"}))
    try:
        await made.start_nodes()
        yield made
    finally:
        await made.stop()


@pytest.fixture(scope="module")
def plane(cluster: realcluster.RealCluster) -> controlplane.ControlPlane:
    assert cluster.plane is not None
    return cluster.plane


@pytest.fixture(scope="module")
def kube(cluster: realcluster.RealCluster) -> client.KubeClient:
    assert cluster.kube is not None
    return cluster.kube


@pytest.fixture(scope="module")
def nodes(cluster: realcluster.RealCluster) -> dict[str, containerd.Node]:
    return cluster.nodes


async def pods_of(kube: client.KubeClient, namespace: str) -> list[Json]:
    listed = await kube.get(paths.pods(namespace))
    found: list[Json] = listed["items"]
    return found


def describe(pods: list[Json]) -> str:
    """Each pod's phase, why (the kubelet's reason and message: a pod it refused has no containers) and
    its containers' states; pods that failed alike (a controller's pods refused over and over) once, counted."""
    lines, failed = [], collections.Counter[str]()
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") == "Failed" and not status.get("containerStatuses"):
            failed[f"{status.get('reason')}: {status.get('message')}"] += 1
            continue
        states = {s["name"]: (s.get("state"), s.get("restartCount")) for s in status.get("containerStatuses") or []}
        lines.append(f"{pod['metadata']['name']}: {status.get('phase')} {status.get('reason') or ''} {states}")
    lines += [f"{count} pods Failed with no container ({why})" for why, count in failed.items()]
    return "\n".join(lines)


def busybox(name: str, namespace: str, limits: dict[str, str], claim: str = "") -> Json:
    """A pod that sleeps in the busybox image, with `limits` or the ResourceClaim `claim`."""
    made = builders.MakePod(name, namespace).grace(0).container(limits=limits)
    return (made.claim(claim) if claim else made).busybox().obj()


def on(nodes: dict[str, containerd.Node], pod: Json) -> containerd.Node:
    """The node a pod was bound to."""
    return nodes[pod["spec"]["nodeName"]]


async def seen_from_inside(node: containerd.Node, container: str) -> tuple[dict[str, str], set[str]]:
    """A container's environment and the GPU device nodes in its /dev."""
    env = dict(line.split("=", 1) for line in node.inside(container, "env").splitlines() if "=" in line)
    dev = {line.split()[-1] for line in node.inside(container, "ls", "-l", "/dev").splitlines() if line.startswith("c")}
    return env, {d for d in dev if d.startswith("nvidia") and d[6:].isdigit()}


async def test_helm_install_runs_every_component_in_containerd_and_places_and_runs_gpu_pods(
    cluster: realcluster.RealCluster,
    plane: controlplane.ControlPlane,
    kube: client.KubeClient,
    nodes: dict[str, containerd.Node],
) -> None:
    # The chart's default node paths (/var/lib/kubelet, /var/run/cdi) are each node's own.
    values = cluster.values()
    assert values["agent"] == {"draNodeSelector": realcluster.DRA_NODES}
    await cluster.release("install", values)
    components = ["agent", "agent-dra", "controller", "controller", "scheduler", "scheduler", "webhook", "webhook"]

    async def all_ready() -> bool:
        found = await pods_of(kube, SYSTEM)
        return len(found) >= len(components) and all(realcluster.ready(p) for p in found)

    try:
        await wait_for(all_ready, timeout=240, what="every component's pod Ready")
    except AssertionError as exc:
        found = await pods_of(kube, SYSTEM)
        logs = [
            on(nodes, p).logs(p["metadata"]["name"], c["name"])
            for p in found
            if not realcluster.ready(p) and p["spec"].get("nodeName")
            for c in p["spec"]["containers"]
        ]
        raise AssertionError(f"{exc}\n{describe(found)}\n" + "\n".join(logs)) from None
    kinds = sorted(p["metadata"]["labels"].get("app.kubernetes.io/component", "") for p in await pods_of(kube, SYSTEM))
    assert kinds == components, kinds

    # Each agent, in its container, read its node's GPUs through the (fake) NVIDIA runtime; the DRA
    # node's published them as its ResourceSlice too, and says it serves DRA claims only.
    for name, uuids in GPUS.items():
        device = await kube.get(paths.device(name))
        assert [g["uuid"] for g in device["spec"]["gpus"]] == list(uuids)
        assert bool(device["spec"].get("dra")) == name.startswith("dra"), device["spec"]
    published = (await kube.get(dra.SLICES))["items"]
    assert [(s["spec"]["nodeName"], len(s["spec"]["devices"])) for s in published] == [("dra-node-1", 2)]

    # The scheduling pods lead together: kube-scheduler holds the Lease, the extender beside it follows.
    # (A pod is ready before it leads: standbys must be ready too. The Lease comes a moment later.)
    async def leading_pod() -> str:
        return (await lease_holder(kube, names.EXTENDER_LEASE)).split(leader.SEPARATOR, 1)[0]

    holder = await wait_for(leading_pod, timeout=60, what="the extender's Lease held")
    assert isinstance(holder, str) and holder.startswith("sharegpu-scheduler-"), holder
    leading = on(nodes, await kube.get(paths.pod(SYSTEM, holder)))

    async def follows() -> bool:
        return "leading" in leading.logs(holder, "extender", lines=200)

    await wait_for(follows, timeout=30, what=f"the extender in {holder} leading")

    # GPU pods, sent to sharegpu by the webhook (the API server calls it through its Service), placed
    # by the chart's scheduler (or, for the claim, sharegpu's allocator) and run: what each container
    # sees is what its allocation says.
    await kube.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    share = await kube.create(paths.pods("team"), busybox("share", "team", {names.GPU: "1", names.GPU_MILLI: "300"}))
    assert share["spec"]["schedulerName"] == names.SCHEDULER_NAME
    await kube.create(paths.pods("team"), busybox("whole", "team", {names.NVIDIA_GPU: "1"}))
    # Written for HAMi (a quarter of a GPU's cores, 2 GiB of its memory): translated by the webhook.
    hami = {names.NVIDIA_GPU: "1", translate.HAMI_CORES: "25", translate.HAMI_MEMORY: "2048"}
    await kube.create(paths.pods("team"), busybox("hami", "team", hami))
    # Written as Kubernetes documents DRA (a claim of sharegpu's class, no scheduling gate).
    await kube.create(dra.claim_path("team"), builders.MakeClaim("c", "team").ask(300, "4Gi").obj())
    dra_pod = await kube.create(paths.pods("team"), busybox("dra", "team", {}, claim="c"))
    assert {"name": names.DRA_GATE} in dra_pod["spec"].get("schedulingGates", []), "the webhook gates it"
    everyone = ("share", "whole", "hami", "dra")

    async def running(pod: str) -> str:
        found = await kube.get(paths.pod("team", pod))
        return await on(nodes, found).running(kube, "team", pod) if found["spec"].get("nodeName") else ""

    seen: dict[str, tuple[dict[str, str], set[str]]] = {}
    placed: dict[str, Json] = {}
    for pod in everyone:
        try:
            container = await wait_for(functools.partial(running, pod), timeout=120, what=f"pod {pod} running")
        except AssertionError as exc:
            found = await pods_of(kube, "team") + await pods_of(kube, names.HOLDING_NAMESPACE)
            events = [f"{e['involvedObject']['name']}: {e['reason']} {e['message']}"
                      for e in (await kube.get("/api/v1/namespaces/team/events"))["items"]]  # fmt: skip
            logs = [leading.logs(holder, c, lines=40) for c in ("kube-scheduler", "extender")]
            raise AssertionError("\n".join([str(exc), describe(found), *events, *logs])) from None
        placed[pod] = await kube.get(paths.pod("team", pod))
        seen[pod] = await seen_from_inside(on(nodes, placed[pod]), container)

    def gpu_of(pod: str, uuid: str) -> str:
        """The device node of `uuid` on `pod`'s node."""
        return f"nvidia{on(nodes, placed[pod]).gpus.index(uuid)}"

    # A shared GPU is the one its slot's reservation pod holds (the kubelet picks it from the device
    # plugin's, and the reservation reports it): a sharing container sees exactly that one.
    held: dict[tuple[str, int], str] = {}
    for reservation in await pods_of(kube, names.HOLDING_NAMESPACE):
        slot = pods.record(wire.convert(reservation, wire.Pod)).reservation
        if slot is not None and slot.uuid:
            held[slot.node, slot.index] = slot.uuid

    def sees_its_slot(pod: str, milli: int, memory_mib: int | None = None) -> str:
        allocation = pods.allocation_of(wire.convert(placed[pod], wire.Pod))
        assert allocation is not None and not allocation.exclusive and len(allocation.gpu_indices) == 1
        (index,) = allocation.gpu_indices
        used = allocation.gpu_usage()[index]
        assert used[0] == milli and memory_mib in (None, used[1]), allocation.gpu_usage()
        env, gpus = seen[pod]
        uuid = held[placed[pod]["spec"]["nodeName"], index]
        assert env["NVIDIA_VISIBLE_DEVICES"] == uuid and gpus == {gpu_of(pod, uuid)}, (pod, seen[pod])
        return uuid

    shared = {sees_its_slot("share", 300), sees_its_slot("hami", 250, 2048)}
    env, gpus = seen["whole"]
    assert len(gpus) == 1 and env["NVIDIA_VISIBLE_DEVICES"] not in shared, (seen["whole"], shared)
    assert gpus == {gpu_of("whole", env["NVIDIA_VISIBLE_DEVICES"])}, seen["whole"]
    # The claim's GPU, as containerd applied the CDI device the agent's kubelet plugin wrote.
    claim = await kube.get(dra.claim_path("team", "c"))
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["pool"] == placed["dra"]["spec"]["nodeName"] == "dra-node-1", (result, placed["dra"]["spec"])
    index = int(result["device"].removeprefix("gpu-"))
    env, gpus = seen["dra"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == on(nodes, placed["dra"]).gpus[index] and gpus == {f"nvidia{index}"}, env

    # Faults with real containers, then an upgrade: every placed pod keeps its allocation and runs on.
    for agent in await pods_of(kube, SYSTEM):
        if agent["metadata"]["labels"].get("app.kubernetes.io/component") == "agent":
            await kube.delete(paths.pod(SYSTEM, agent["metadata"]["name"]))  # the DaemonSet makes another
    extender = (await lease_holder(kube, names.EXTENDER_LEASE)).split(leader.SEPARATOR, 1)[0]
    leading = on(nodes, await kube.get(paths.pod(SYSTEM, extender)))
    leading.runtime.crictl("stop", "--timeout", "0", leading.container(extender, "extender"))  # the kubelet restarts it
    before = {pod: await running(pod) for pod in everyone}
    for node in nodes.values():
        await asyncio.to_thread(node.runtime.restart)  # containerd crashes and comes back: containers run on
        await asyncio.to_thread(plane.restart, node.kubelet, down_for=1.0)  # so does the kubelet
    await wait_for(all_ready, timeout=180, what="every component Ready again after the faults")
    assert {pod: await running(pod) for pod in everyone} == before, "the GPU pods' containers ran on"
    values["extender"] = {"logLevel": "DEBUG"}
    await cluster.release("upgrade", values)

    async def upgraded() -> bool:
        found = await pods_of(kube, SYSTEM)
        args = [c.get("args", []) for p in found for c in p["spec"]["containers"] if c["name"] == "extender"]
        return (
            len(found) == len(components)
            and all(realcluster.ready(p) for p in found)
            and all("--log-level=DEBUG" in a for a in args)
        )

    await wait_for(upgraded, timeout=240, what="the upgraded release Ready")
    after = await kube.get(paths.pod("team", "share"))
    assert after["metadata"]["annotations"] == placed["share"]["metadata"]["annotations"], "the allocation kept"
    assert (await kube.get(dra.claim_path("team", "c")))["status"]["allocation"] == claim["status"]["allocation"]
    assert [await running(pod) != "" for pod in everyone] == [True] * len(everyone)
    judged = await oracle.inspect(kube)
    assert (judged.overcommits, judged.double_allocations, judged.unheld) == ([], [], []), judged

    for pod in everyone:
        await kube.delete(paths.pod("team", pod), grace_period=0)

    async def reservations_gone() -> bool:
        return not await pods_of(kube, names.HOLDING_NAMESPACE)

    await wait_for(reservations_gone, timeout=90, what="the GPU's reservation gone with its sharer")
    await cluster.helm("uninstall", "sharegpu", "-n", SYSTEM, "--wait")

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
                           ("ServiceAccount", f"/api/v1/namespaces/{SYSTEM}/serviceaccounts"),
                           ("DeviceClass", dra.DEVICE_CLASSES))
        for item in (await kube.get(path))["items"]
        if item["metadata"]["name"].startswith("sharegpu") or item["metadata"]["name"] == dra.CLASS
    ]  # fmt: skip
    assert left == [], left

    # The kubelets take the driver's ResourceSlices down once its plugin is gone.
    async def slices_gone() -> bool:
        found = (await kube.get(dra.SLICES))["items"]
        return not [s for s in found if s["spec"]["driver"] == dra.DRIVER]

    await wait_for(slices_gone, timeout=120, what="the driver's ResourceSlices gone")
