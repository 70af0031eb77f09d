"""Queues through Kueue (built from its Go module, run against the real control plane): Kueue admits,
sharegpu places. ClusterQueues hold quotas in sharegpu's GPU totals (milli-GPU, so a quarter of a GPU
counts as a quarter); a pod Kueue has not admitted waits behind Kueue's gate and holds nothing; an
admitted pod group is a gang, placed whole; a cohort lends unused quota and takes it back by
preemption; with fair sharing a cohort's borrowable quota goes to its queues by their weights; pods
of the DRA path count in the same quota and hold no GPU before Kueue admits them. docs/queues.md
explains the setup."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from sharegpu.api import dra, gangs, names
from sharegpu.devcluster import controlplane, kueue
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.integration.conftest import RunningWebhook, consistent, get_or_none, gpu_pod, pods_in, wait_for

Json = dict[str, Any]
API = "/apis/kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
COVERED = ["cpu", "memory", names.GPU, names.GPU_MILLI, names.NVIDIA_GPU, names.GPU_MILLI_TOTAL]
"""Every resource a GPU pod asks for, once the webhook has written it (a whole GPU as nvidia.com/gpu):
Kueue admits no pod asking for a resource its ClusterQueue does not cover."""
CONFIG: Json = {
    "fairSharing": {"preemptionStrategies": ["LessThanOrEqualToFinalShare", "LessThanInitialShare"]},
    "resources": {"transformations": [
        {"input": names.DRA_GPU_MILLI_TOTAL, "strategy": "Replace", "outputs": {names.GPU_MILLI_TOTAL: "1"}},
        {"input": names.DRA_GPU_MEMORY_TOTAL, "strategy": "Replace", "outputs": {names.GPU_MEMORY_TOTAL: "1"}},
    ]},
}  # fmt: skip
"""Kueue's configuration for the module: fair sharing on (a cohort's borrowable quota goes to its
ClusterQueues by weight), and the DRA path's totals counted as the extender path's (docs/queues.md)."""


@pytest.fixture(scope="module")
async def queues(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    webhook: RunningWebhook,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[kueue.Kueue]:
    why = kueue.runnable()
    if why is not None:
        pytest.skip(why)
    binary, module = await asyncio.to_thread(kueue.build)
    running = kueue.Kueue(control_plane, binary, module, Path(tmp_path_factory.mktemp("kueue")), config=CONFIG)
    await running.start(admin)
    await admin.create(f"{API}/resourceflavors", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                                                   "metadata": {"name": "default"}})  # fmt: skip
    yield running
    await running.stop(admin)


def cluster_queue(
    name: str, milli: int, *, cohort: str | None = None, borrow: bool = False, weight: str | None = None
) -> Json:
    plenty = {"memory": "1Ti"}  # everything but sharegpu's compute total is plentiful here
    quotas = [
        {"name": r, "nominalQuota": str(milli) if r == names.GPU_MILLI_TOTAL else plenty.get(r, "100000")}
        for r in COVERED
    ]
    spec: Json = {
        "namespaceSelector": {},
        "resourceGroups": [{"coveredResources": COVERED, "flavors": [{"name": "default", "resources": quotas}]}],
    }
    if cohort is not None:
        spec["cohortName"] = cohort
        spec["preemption"] = {"reclaimWithinCohort": "Any", "withinClusterQueue": "Never"}
    if weight is not None:
        spec["fairSharing"] = {"weight": weight}
    if not borrow:
        for quota in quotas:
            if quota["name"] == names.GPU_MILLI_TOTAL and cohort is not None:
                quota["borrowingLimit"] = "0"
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}


async def local_queue(kube: client.KubeClient, namespace: str, name: str, cluster: str) -> None:
    body = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"clusterQueue": cluster}}  # fmt: skip
    await kube.create(f"{API}/namespaces/{namespace}/localqueues", body)


def queued(name: str, namespace: str, queue: str, milli: int, *, path: str | None = None, **labels: str) -> Json:
    pod = gpu_pod(name, namespace, milli=milli, annotations={names.PATH: path} if path else None)
    pod["metadata"].setdefault("labels", {}).update({QUEUE_LABEL: queue, **labels})
    return pod


async def state(kube: client.KubeClient, namespace: str, prefix: str) -> dict[str, str]:
    """Pod -> its node, "gated" behind Kueue's gate, or "" while pending ungated (pods being deleted,
    preempted ones among them, are left out)."""
    out = {}
    for pod in await pods_in(kube, namespace):
        if pod["metadata"]["name"].startswith(prefix) and not pod["metadata"].get("deletionTimestamp"):
            gates = [g["name"] for g in (pod["spec"].get("schedulingGates") or [])]
            out[pod["metadata"]["name"]] = pod["spec"].get("nodeName") or ("gated" if ADMISSION_GATE in gates else "")
    return out


async def placed_and_one_gated(
    kube: client.KubeClient, namespace: str, prefix: str, placed: int, *, timeout: float = 60, what: str
) -> dict[str, str]:
    """Waits until `placed` of the pods whose names start with `prefix` are on a node and one waits
    behind Kueue's gate; returns where each is (`state`)."""

    async def seen() -> dict[str, str] | None:
        found = await state(kube, namespace, prefix)
        on_nodes = [n for n in found.values() if n not in ("", "gated")]
        return found if len(on_nodes) == placed and list(found.values()).count("gated") == 1 else None

    found: dict[str, str] = await wait_for(seen, timeout=timeout, what=what)
    return found


async def admitted_once_one_leaves(
    kube: client.KubeClient, namespace: str, found: dict[str, str], *, timeout: float = 60, what: str
) -> None:
    """Deletes one placed pod of `found` (`placed_and_one_gated`); waits until the gated one is placed."""
    waiting = next(name for name, where in found.items() if where == "gated")
    done = next(name for name, where in found.items() if where not in ("gated", ""))
    await kube.delete(f"/api/v1/namespaces/{namespace}/pods/{done}", grace_period=0)

    async def placed() -> bool:
        return (await state(kube, namespace, waiting)).get(waiting, "") not in ("", "gated")

    await wait_for(placed, timeout=timeout, what=what)


async def test_kueue_admits_within_a_quota_in_milli_gpus_and_sharegpu_places_what_it_admits(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    queues: kueue.Kueue,
    nodes: Callable[..., Any],
    namespace: str,
) -> None:
    await nodes(2, gpus=2)
    await admin.create(f"{API}/clusterqueues", cluster_queue(f"{namespace}-cq", 1000))
    await local_queue(admin, namespace, "q", f"{namespace}-cq")
    pods = f"/api/v1/namespaces/{namespace}/pods"
    for i in range(5):  # five quarters of a GPU against a quota of one GPU
        await admin.create(pods, queued(f"quarter-{i}", namespace, "q", 250))

    found = await placed_and_one_gated(admin, namespace, "quarter-", 4, what="four quarters placed, the fifth gated")
    await admitted_once_one_leaves(admin, namespace, found, what="the fifth admitted once a quarter left, then placed")
    await consistent(admin)


async def test_an_admitted_pod_group_is_placed_as_one_gang(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    queues: kueue.Kueue,
    nodes: Callable[..., Any],
    namespace: str,
) -> None:
    await nodes(2, gpus=1)
    await admin.create(f"{API}/clusterqueues", cluster_queue(f"{namespace}-cq", 4000))
    await local_queue(admin, namespace, "q", f"{namespace}-cq")
    pods = f"/api/v1/namespaces/{namespace}/pods"
    for i in range(2):
        body = queued(f"w-{i}", namespace, "q", 600, **{gangs.KUEUE_GROUP_LABEL: "train"})
        body["metadata"]["annotations"][gangs.KUEUE_TOTAL_ANNOTATION] = "2"
        made = await admin.create(pods, body)
        assert made["metadata"]["annotations"][names.GANG] == "train"

    async def whole() -> dict[str, str] | None:
        found = await state(admin, namespace, "w-")
        return found if len(found) == 2 and all(v not in ("", "gated") for v in found.values()) else None

    placed = await wait_for(whole, what="the admitted group placed whole")
    assert len(set(placed.values())) == 2
    await consistent(admin)


async def test_a_cohort_lends_unused_quota_and_takes_it_back_by_preemption(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    queues: kueue.Kueue,
    nodes: Callable[..., Any],
    namespace: str,
) -> None:
    await nodes(2, gpus=2)
    cohort = f"{namespace}-cohort"
    await admin.create(f"{API}/clusterqueues", cluster_queue(f"{namespace}-a", 2000, cohort=cohort, borrow=True))
    await admin.create(f"{API}/clusterqueues", cluster_queue(f"{namespace}-b", 2000, cohort=cohort))
    await local_queue(admin, namespace, "qa", f"{namespace}-a")
    await local_queue(admin, namespace, "qb", f"{namespace}-b")
    pods = f"/api/v1/namespaces/{namespace}/pods"
    for i in range(4):  # team a: four whole-GPU shares, twice its quota, borrowing team b's
        await admin.create(pods, queued(f"a-{i}", namespace, "qa", 1000))

    async def a_borrows() -> dict[str, str] | None:
        found = await state(admin, namespace, "a-")
        return found if len(found) == 4 and all(v not in ("", "gated") for v in found.values()) else None

    await wait_for(a_borrows, what="team a placed on its own quota and team b's unused one")
    for i in range(2):
        await admin.create(pods, queued(f"b-{i}", namespace, "qb", 1000))

    async def b_reclaims() -> bool:
        b = await state(admin, namespace, "b-")
        a = await state(admin, namespace, "a-")
        running_a = [v for v in a.values() if v not in ("", "gated")]
        return len(b) == 2 and all(v not in ("", "gated") for v in b.values()) and len(running_a) == 2

    await wait_for(b_reclaims, timeout=120, what="team b's quota taken back: two of a's preempted, b placed")
    await consistent(admin)


async def test_fair_sharing_splits_a_cohorts_quota_by_weight_in_milli_gpus(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    queues: kueue.Kueue,
    nodes: Callable[..., Any],
    namespace: str,
) -> None:
    """Teams a (weight 2) and b (weight 1) own no quota; a lender in their cohort owns three GPUs' worth.
    Team a's six half-GPU pods take all of it; then team b's six arrive, and Kueue's fair sharing
    preempts a's down to its weighted share: four of a's run, two of b's (each team then at a third of
    the cohort per unit of weight; with equal weights it would be three and three)."""
    await nodes(2, gpus=2)
    cohort = f"{namespace}-fair"
    await admin.create(f"{API}/clusterqueues", cluster_queue(f"{namespace}-lender", 3000, cohort=cohort, borrow=True))
    for team, weight in (("a", "2"), ("b", "1")):
        body = cluster_queue(f"{namespace}-{team}", 0, cohort=cohort, borrow=True, weight=weight)
        await admin.create(f"{API}/clusterqueues", body)
        await local_queue(admin, namespace, f"q{team}", f"{namespace}-{team}")
    pods = f"/api/v1/namespaces/{namespace}/pods"

    async def running() -> dict[str, int]:
        found = await state(admin, namespace, "")
        return {
            team: sum(1 for n, v in found.items() if n.startswith(team) and v not in ("", "gated")) for team in "ab"
        }

    async def split(wanted: dict[str, int]) -> bool:
        return await running() == wanted

    for i in range(6):
        await admin.create(pods, queued(f"a-{i}", namespace, "qa", 500))
    await wait_for(functools.partial(split, {"a": 6, "b": 0}), what="team a borrowing the whole cohort")
    for i in range(6):
        await admin.create(pods, queued(f"b-{i}", namespace, "qb", 500))

    async def settled() -> dict[str, int] | None:
        """The queues' weighted shares (Kueue's status), once they are equal with four of a's and two
        of b's running (a passing four and two on the way to three and three does not count)."""
        shares = {}
        for team in "ab":
            status = (await admin.get(f"{API}/clusterqueues/{namespace}-{team}")).get("status") or {}
            shares[team] = int((status.get("fairSharing") or {}).get("weightedShare") or 0)
        fair = shares["a"] == shares["b"] and shares["a"]
        return shares if fair and await running() == {"a": 4, "b": 2} else None

    shown = await wait_for(settled, timeout=120, what="a preempted down to its weighted share, b placed")
    assert shown["a"] in (333, 334), f"a third of the cohort's 3000 milli per unit of weight (rounded up): {shown}"
    await consistent(admin)


async def test_dra_path_pods_count_in_the_same_quota_and_hold_nothing_before_admission(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    queues: kueue.Kueue,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    """Three half-GPU pods of the DRA path (their GPUs come from claims) against a quota of one GPU:
    the webhook writes their totals under the DRA path's names, Kueue counts them as milli-GPU (its
    transformation), admits two, and sharegpu's allocator allocates their claims and kube-scheduler
    binds them; the third waits behind Kueue's gate with its claim unallocated, until one of the two
    leaves."""
    (node,) = await nodes(1, gpus=2, dra=True)
    await admin.create(f"{API}/clusterqueues", cluster_queue(f"{namespace}-cq", 1000))
    await local_queue(admin, namespace, "q", f"{namespace}-cq")
    pods = f"/api/v1/namespaces/{namespace}/pods"
    for i in range(3):
        made = await admin.create(pods, queued(f"d-{i}", namespace, "q", 500, path=names.PATH_DRA))
        (container,) = made["spec"]["containers"]
        assert container["resources"]["requests"][names.DRA_GPU_MILLI_TOTAL] == "500"
        assert made["spec"]["resourceClaims"], "the DRA path: a claim of its own"

    found = await placed_and_one_gated(admin, namespace, "d-", 2, timeout=90, what="two bound, the third gated")
    assert {v for v in found.values() if v != "gated"} == {node}
    waiting = next(name for name, where in found.items() if where == "gated")
    pod = await admin.get(f"{pods}/{waiting}")
    claim = await get_or_none(admin, dra.claim_path(namespace, pod["spec"]["resourceClaims"][0]["resourceClaimName"]))
    assert claim is None or not (claim.get("status") or {}).get("allocation"), "unadmitted, it holds no GPU"
    await admitted_once_one_leaves(admin, namespace, found, timeout=90, what="the third admitted once one left")
    await consistent(admin)
