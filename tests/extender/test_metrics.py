"""The extender's /metrics over the fake API server: per node and GPU what the pods' allocations say
(capacity, allocated compute and memory, holders), per namespace the use, the ResourceQuota limits
and the GPU pods still pending, and the scheduling latency on the extender's clock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp import test_utils
from prometheus_client import parser

from sharegpu.api import extender as api_extender
from sharegpu.api import names, paths
from sharegpu.core import allocation, units
from sharegpu.extender import metrics as extender_metrics
from sharegpu.extender import routes
from tests.extender.conftest import Harness, gpu_pod, settle

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(h: Harness) -> Samples:
    """Every sample of the extender's registry, by name and labels (a fresh view first)."""
    h.extender.metrics.refresh()
    return {
        (s.name, tuple(s.labels.items())): s.value
        for family in h.extender.metrics.registry.collect()
        for s in family.samples
    }


def family(found: Samples, name: str) -> dict[tuple[str, ...], float]:
    """One family's samples by label values (in label-name order)."""
    return {tuple(v for _, v in labels): value for (n, labels), value in found.items() if n == name}


def with_memory(pod: dict[str, Any], mib: int) -> dict[str, Any]:
    for where in ("limits", "requests"):
        pod["spec"]["containers"][0]["resources"][where][names.GPU_MEMORY] = str(mib)
    return pod


def held(h: Harness) -> list[allocation.Allocation]:
    """The allocations the API server shows on the bound pods."""
    found = []
    for pod in h.server.list_objects(paths.PODS):
        text = pod["metadata"].get("annotations", {}).get(names.ALLOCATION)
        if text:
            key = units.pod_key(pod["metadata"]["namespace"], pod["metadata"]["name"])
            found.append(allocation.Allocation.from_json(text, pod=key))
    return found


async def test_each_gpu_and_namespace_is_reported_as_the_pods_hold_them(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2, gpus=2, policy="binpack")
    await h.schedule(await h.create(gpu_pod("a", milli=300)))
    await h.schedule(await h.create(with_memory(gpu_pod("b", milli=400), 2048)))
    await h.schedule(await h.create(gpu_pod("whole", nvidia=1, namespace="other")))
    await h.create(gpu_pod("too-big", nvidia=3))  # 2 GPUs per node: it stays pending
    await h.create(gpu_pod("waiting", milli=200, namespace="other"))  # not filtered yet
    h.server.put_object(
        paths.RESOURCE_QUOTAS,
        {"metadata": {"name": "gpus", "namespace": "ns"},
         "spec": {"hard": {f"requests.{names.GPU_MILLI_TOTAL}": "4000", names.GPU_MEMORY_TOTAL: "8192"}}},
    )  # fmt: skip
    await settle(h.server)
    found = samples(h)

    allocations = held(h)
    assert len(allocations) == 3
    milli: Counter[tuple[str, str]] = Counter()
    memory: Counter[tuple[str, str]] = Counter()
    holders: Counter[tuple[str, str]] = Counter()
    for alloc in allocations:
        for index, (m, mib) in alloc.gpu_usage().items():
            gpu = (str(alloc.node), str(index))
            milli[gpu] += m
            memory[gpu] += mib
            holders[gpu] += 1
    every = {(f"n{n}", str(g)) for n in range(2) for g in range(2)}
    assert family(found, "sharegpu_gpu_compute_allocated_gpus") == {g: milli[g] / 1000 for g in every}
    assert family(found, "sharegpu_gpu_memory_allocated_bytes") == {g: memory[g] * 2**20 for g in every}
    assert family(found, "sharegpu_gpu_holders") == {g: holders[g] for g in every}
    assert sorted(holders.values()) == [1, 2], "binpack: a and b share one GPU; the whole pod has another"
    assert family(found, "sharegpu_gpu_compute_capacity_gpus") == dict.fromkeys(every, 1)
    assert family(found, "sharegpu_gpu_memory_capacity_bytes") == dict.fromkeys(every, 16 * 2**30)
    assert family(found, "sharegpu_gpu_healthy") == dict.fromkeys(every, 1)
    assert family(found, "sharegpu_gpu_info") == {(n, g, f"GPU-{n}-{g}", "T4"): 1 for n, g in every}

    assert family(found, "sharegpu_namespace_gpu_compute_allocated_gpus") == {("ns",): 0.7, ("other",): 1}
    assert family(found, "sharegpu_namespace_gpu_memory_allocated_bytes") == {
        ("ns",): 2**20
        * sum(a.gpu_usage()[i][1] for a in allocations if a.pod.startswith("ns/") for i in a.gpu_usage()),
        ("other",): 16 * 2**30,
    }
    assert family(found, "sharegpu_namespace_gpu_compute_quota_gpus") == {("ns", "gpus"): 4}
    assert family(found, "sharegpu_namespace_gpu_memory_quota_bytes") == {("ns", "gpus"): 8 * 2**30}
    assert family(found, "sharegpu_pending_gpu_pods") == {("ns",): 1, ("other",): 1}

    # The pending ones go: one deleted, the other bound; a pod that asks for no GPU never counts.
    await h.api.delete(paths.pod("ns", "too-big"))
    await h.schedule(h.server.get_object(paths.pod("other", "waiting")) or {})
    await h.create({"metadata": {"name": "cpu", "namespace": "ns"}, "spec": {"containers": [{"name": "c"}]}})
    assert family(samples(h), "sharegpu_pending_gpu_pods") == {}


async def test_scheduling_latency_runs_from_the_first_filter_to_the_binding(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    pod = await h.create(gpu_pod("late", milli=600))
    assert h.extender.scheduling.filter(h.args(pod)).node_names == ["n0"]
    h.clock.advance(2.0)
    h.extender.scheduling.filter(h.args(pod))  # filtered again: the first filter still counts
    h.clock.advance(1.5)
    meta = (h.server.get_object(paths.pod("ns", "late")) or {})["metadata"]
    bound = await h.extender.scheduling.bind(
        api_extender.BindingArgs(pod_name="late", pod_namespace="ns", pod_uid=meta["uid"], node="n0")
    )
    assert bound.error == ""
    registry = h.extender.metrics.registry
    assert registry.get_sample_value("sharegpu_extender_scheduling_latency_seconds_count") == 1
    assert registry.get_sample_value("sharegpu_extender_scheduling_latency_seconds_sum") == 3.5
    assert registry.get_sample_value("sharegpu_extender_scheduling_latency_seconds_bucket", {"le": "2.5"}) == 0
    assert registry.get_sample_value("sharegpu_extender_scheduling_latency_seconds_bucket", {"le": "5.0"}) == 1
    assert "ns/late" not in h.extender.scheduling.first_filtered

    # A pod that is filtered and then deleted is forgotten once the assumption TTL has passed.
    gone = await h.create(gpu_pod("gone", milli=100))
    h.extender.scheduling.filter(h.args(gone))
    await h.api.delete(paths.pod("ns", "gone"))
    await settle(h.server)
    await h.extender.scheduling.expire()
    assert "ns/gone" in h.extender.scheduling.first_filtered, "not before the TTL"
    h.clock.advance(31)
    await h.extender.scheduling.expire()
    assert "ns/gone" not in h.extender.scheduling.first_filtered


async def test_the_metrics_endpoint_serves_every_family_and_nothing_of_the_cluster_before_the_cache_is_built(
    harness: Callable[..., Any],
) -> None:
    bare = extender_metrics.Metrics()
    text = bare.exposition().decode()
    assert "# TYPE sharegpu_gpu_compute_allocated_gpus gauge" in text
    assert "\nsharegpu_gpu_compute_allocated_gpus{" not in text
    h: Harness = await harness(nodes=1, gpus=2)
    await h.schedule(await h.create(gpu_pod("a", milli=250)))
    async with test_utils.TestClient(test_utils.TestServer(routes.operations(h.extender))) as http:
        response = await http.get("/metrics")
        text = await response.text()
    assert response.status == 200
    parsed = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert {s.value for s in parsed["sharegpu_gpu_compute_allocated_gpus"].samples} == {0.25, 0.0}
    assert parsed["sharegpu_extender_binds"].type == "counter"


def counted(metrics: extender_metrics.Metrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Per labelled counter (its `_total` samples), each series' labels and value."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in metrics.registry.collect():
        if family.type != "counter":
            continue
        for s in family.samples:
            if s.name.endswith("_total") and s.labels:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_every_labelled_counter_starts_with_each_of_its_values_at_zero() -> None:
    """A counter's labelled series that appears at 1 shows no increase() to Prometheus: the first
    repair of an extender's life would not raise SharegpuOvercommitRepaired, the first preemption
    would not show in a rate. Every labelled counter lists its values from the start, at 0."""
    fresh = extender_metrics.Metrics()
    silent = [f.name for f in fresh.registry.collect() if f.type == "counter" and not f.samples]
    assert silent == [], "a labelled counter without its series"  # unlabelled ones always show 0
    made = counted(fresh)
    assert all(value == 0.0 for series in made.values() for value in series.values())
    repairs = {dict(labels)["action"] for labels in made["sharegpu_extender_overcommit_repairs_total"]}
    assert repairs == {"evicted", "cleared", "waiting", "refused", "unknown"}
    preemptions = {dict(labels)["outcome"] for labels in made["sharegpu_extender_preemptions_total"]}
    assert preemptions == {"nominated", "placed", "freed", "bound", "gone", "replaced", "expired", "stepped-down"}
    decisions = made["sharegpu_extender_decisions_total"]
    assert len(decisions) == len(extender_metrics.FilterOutcome)
    unknown = made["sharegpu_extender_unknown_writes_total"]
    assert {tuple(sorted(dict(labels).values())) for labels in unknown} == {
        ("claim-allocation", "done"),
        ("claim-allocation", "not-done"),
    }
    connections = {dict(labels)["protocol"] for labels in made["sharegpu_extender_connections_total"]}
    assert connections == {"h2", "http/1.1"}


async def test_what_the_extender_counts_is_within_the_values_listed_from_the_start(
    harness: Callable[..., Any],
) -> None:
    """Writers pass the vocabularies' members: a filter, a bind, a refusal and a reservation's life
    add no series that was not there at 0 (a misspelt value would be a new series, and the listed one
    would stay at 0 for ever)."""
    h: Harness = await harness(nodes=1, gpus=1)
    before = counted(h.extender.metrics)
    pod = await h.create(gpu_pod("a", milli=600))
    assert h.extender.scheduling.filter(h.args(pod)).node_names == ["n0"]
    meta = (h.server.get_object(paths.pod("ns", "a")) or {})["metadata"]
    bound = await h.extender.scheduling.bind(
        api_extender.BindingArgs(pod_name="a", pod_namespace="ns", pod_uid=meta["uid"], node="n0")
    )
    assert bound.error == ""
    big = await h.create(gpu_pod("big", milli=600))
    assert h.extender.scheduling.filter(h.args(big)).node_names == []
    after = counted(h.extender.metrics)
    assert {name: set(series) for name, series in after.items()} == {
        name: set(series) for name, series in before.items()
    }
    decisions = after["sharegpu_extender_decisions_total"]
    assert decisions[(("outcome", "feasible"), ("verb", "filter"))] == 1
    assert decisions[(("outcome", "unschedulable"), ("verb", "filter"))] == 1
    assert after["sharegpu_extender_binds_total"][(("outcome", "bound"),)] == 1
