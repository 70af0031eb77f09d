"""The extender's quota check over the fake API server: a pod is placed only while its namespace's
ResourceQuotas on sharegpu's totals allow it (3 GPUs at 500 milli count 1500), counting the placed
pods only; other namespaces and quotas on other resources are not affected; raising or deleting the
quota lets the pod through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sharegpu.api import extender as api_extender
from sharegpu.api import groups, names, paths, pods, quotas, wire
from sharegpu.core import allocation, requests, units
from tests.extender.conftest import Harness, gpu_pod, settle

Json = dict[str, Any]
QUOTAS = paths.RESOURCE_QUOTAS


def quota(name: str, namespace: str, **hard: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"hard": hard}}


def test_totals_count_every_gpu() -> None:
    three = requests.GpuRequest(count=3, milli=500, memory_mib=2048)
    request = requests.PodRequest(
        units.PodKey("ns/p"),
        (
            requests.ContainerRequest("a", three),
            requests.ContainerRequest("sidecar"),
        ),
    )
    assert quotas.pod_totals(request) == (1500, 6144), "3 GPUs at 500 milli and 2048 MiB each"
    whole = requests.PodRequest(units.PodKey("ns/w"), (requests.ContainerRequest("a", requests.GpuRequest(count=2)),))
    assert quotas.pod_totals(whole) == (2000, 0)
    both = quota("q", "ns", **{"requests.sharegpu.io/gpu-milli-total": "2", "sharegpu.io/gpu-milli-total": "1500"})
    limited = quotas.limit(wire.convert(both, quotas.ResourceQuota))
    assert limited == quotas.Limit("q", 2, None), "the lower of the two spellings"


def test_an_init_container_counts_beside_the_native_sidecars_before_it() -> None:
    """As Kubernetes' quota sums a pod: the sidecar (restartPolicy Always) keeps running through the
    init container after it; the pod's GPU holding in the ledger is the same peak."""
    limits = {names.GPU: "1", names.GPU_MILLI: "300", names.GPU_MEMORY: "8192"}
    pod = gpu_pod("p", milli=400)
    pod["spec"]["initContainers"] = [
        {"name": "sidecar", "restartPolicy": "Always", "resources": {"limits": limits, "requests": limits}},
        {"name": "setup", "resources": {"limits": {**limits, names.GPU_MILLI: "600", names.GPU_MEMORY: "10240"}}},
    ]
    request = pods.request(wire.convert(pod, wire.Pod))
    assert quotas.pod_totals(request)[0] == 900, "300 beside 600 while setup runs (the app container: 400)"
    assert (request.demand.milli, request.demand.memory_mib) == (900, 18432)
    alloc = allocation.build(request, units.NodeName("n0"), [0], [40960])
    assert alloc.gpu_usage() == {0: (900, 18432)}


async def test_a_pod_beyond_its_namespaces_quota_waits_with_the_figures(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2, gpus=4)
    first = await h.create(gpu_pod("a", milli=500, count=3))
    await h.schedule(first)
    h.server.put_object(QUOTAS, quota("gpus", "ns", **{"requests.sharegpu.io/gpu-milli-total": "2000", "pods": "10"}))
    h.server.put_object(QUOTAS, quota("cpu", "other", cpu="1"))
    await settle(h.server)
    second = await h.create(gpu_pod("b", milli=600))
    verdict = h.extender.scheduling.filter(h.args(second))
    assert not verdict.node_names
    message = verdict.failed_nodes["n0"]
    assert message == (
        "namespace ns: ResourceQuota gpus allows 2000 milli-GPU (requests.sharegpu.io/gpu-milli-total); its placed "
        "pods hold 1500 and this pod asks 600: it waits until they free some, or the quota is raised"
    )
    assert set(verdict.failed_nodes) == {"n0", "n1"} and not verdict.failed_and_unresolvable
    fits = await h.create(gpu_pod("c", milli=500))
    assert h.extender.scheduling.filter(h.args(fits)).node_names, "1500 + 500 is within 2000"
    elsewhere = await h.create(gpu_pod("d", milli=900, namespace="other"))
    assert h.extender.scheduling.filter(h.args(elsewhere)).node_names, "another namespace, a quota on CPU only"
    # Raised: the waiting pod goes through.
    raised = quota("gpus", "ns", **{"requests.sharegpu.io/gpu-milli-total": "4000"})
    await h.api.replace(f"{paths.NAMESPACES}/ns/resourcequotas/gpus", raised)
    await settle(h.server)
    assert h.extender.scheduling.filter(h.args(second)).node_names
    assert names.GPU_MILLI_TOTAL in message


async def test_a_pod_bound_while_the_watch_lags_or_being_deleted_still_counts(harness: Callable[..., Any]) -> None:
    """Quota 1000: `a` (600) is bound, and the watch shows it late; `b` (600) must wait all the same.
    Then `a` is being deleted (its GPU held through its grace period): `b` still waits."""
    h: Harness = await harness(nodes=1, gpus=2)
    h.server.put_object(QUOTAS, quota("gpus", "ns", **{"requests.sharegpu.io/gpu-milli-total": "1000"}))
    a = await h.create(gpu_pod("a", milli=600))
    b = await h.create(gpu_pod("b", milli=600))
    h.server.stall_watches()  # the bind's pod update never reaches the extender's watch
    await h.schedule(a)
    assert h.extender.cache.pods[units.PodKey("ns/a")].node == "", "the watch still shows it unbound"
    assert not h.extender.scheduling.filter(h.args(b)).node_names, "a's 600 counted: 1200 is over 1000"
    # What the watch would have shown: `a` bound, then being deleted.
    found = h.server.get_object(paths.pod("ns", "a"))
    assert found is not None
    found["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    h.extender.cache.on_pod(wire.EventType.MODIFIED, pods.record(wire.convert(found, wire.Pod)))
    assert not h.extender.scheduling.filter(h.args(b)).node_names, "deleting, still holding its GPU"


async def test_two_pods_filtered_together_are_bound_only_within_the_quota(harness: Callable[..., Any]) -> None:
    """Quota 1000, two nodes: `a` and `b` (600 each, with a soft node preference, so their filters
    leave every node that fits and hold nothing) both pass their filters before either is bound; the
    second bind is refused with the figures."""
    h: Harness = await harness(nodes=2, gpus=2)
    h.server.put_object(QUOTAS, quota("gpus", "ns", **{"requests.sharegpu.io/gpu-milli-total": "1000"}))
    zone = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["x"]}]}
    soft = {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": zone}]}}}  # fmt: skip
    a = await h.create(gpu_pod("a", milli=600, spec=soft))  # a soft preference: kube-scheduler ranks the nodes
    b = await h.create(gpu_pod("b", milli=600, spec=soft))
    await settle(h.server)
    verdicts = [h.extender.scheduling.filter(h.args(p)) for p in (a, b)]
    assert all(len(v.node_names) == 2 for v in verdicts), "both fit, on either node"
    results = []
    for p in (a, b):
        meta = p["metadata"]
        args = api_extender.BindingArgs(pod_name=meta["name"], pod_namespace="ns", pod_uid=meta["uid"], node="n0")
        results.append(await h.extender.scheduling.bind(args))
        await settle(h.server)
    assert results[0].error == ""
    assert "ResourceQuota gpus allows 1000 milli-GPU" in results[1].error, results[1].error


async def test_a_groups_holder_counts_against_its_groups_namespace(harness: Callable[..., Any]) -> None:
    """The holder lives in sharegpu-gpus, out of reach of the tenant's ResourceQuota: sharegpu counts
    it against the group's namespace, and places it only within that namespace's quota."""
    h: Harness = await harness(nodes=1, gpus=4)
    h.server.put_object(QUOTAS, quota("gpus", "team", **{"requests.sharegpu.io/gpu-milli-total": "1500"}))
    labels = {names.LABEL_ROLE: names.ROLE_GROUP_HOLDER, **groups.group_labels("team", "g")}

    def holder(name: str) -> Json:
        made = gpu_pod(name, milli=None, count=1, namespace=names.HOLDING_NAMESPACE)
        made["metadata"]["labels"] = labels
        return made

    await h.schedule(await h.create(holder("first")))
    refused = h.extender.scheduling.filter(h.args(await h.create(gpu_pod("p", milli=600, namespace="team"))))
    assert not refused.node_names and "its placed pods hold 1000" in next(iter(refused.failed_nodes.values()))
    second = h.extender.scheduling.filter(h.args(await h.create(holder("second"))))
    assert not second.node_names, "1000 more for team's group: over its 1500"
    assert "namespace team: ResourceQuota gpus" in next(iter(second.failed_nodes.values()))
