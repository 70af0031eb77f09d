"""End to end through the real kube-apiserver and kube-scheduler, with the extender as its own process."""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client import parser

from sharegpu.api import names, paths
from sharegpu.core import allocation, devices, units
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.integration.conftest import all_bound, consistent, get_or_none, gpu_pod, pods_in, refusal, wait_for

Json = dict[str, Any]


def allocation_of(pod: Json) -> allocation.Allocation:
    text = pod["metadata"]["annotations"][names.ALLOCATION]
    return allocation.Allocation.from_json(
        text, pod=units.pod_key(pod["metadata"]["namespace"], pod["metadata"]["name"])
    )


async def reservation_pods(kube: client.KubeClient, node: str) -> list[Json]:
    items, _ = await kube.list_all(
        f"/api/v1/namespaces/{names.HOLDING_NAMESPACE}/pods", {"labelSelector": f"{names.LABEL_NODE}={node}"}
    )
    return items


async def test_fractional_pods_pack_onto_gpus(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=2)
    for i in range(4):
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod(f"half-{i}", namespace, milli=500))
    bound = await wait_for(lambda: all_bound(admin, namespace, 4), what="4 pods bound")
    per_gpu: dict[int, int] = {}
    for pod in bound:
        alloc = allocation_of(pod)
        assert alloc.node == node
        for index, (milli, _) in alloc.gpu_usage().items():
            per_gpu[index] = per_gpu.get(index, 0) + milli
    assert per_gpu == {0: 1000, 1: 1000}

    async def reservations_report_uuids() -> bool:
        items = await reservation_pods(admin, node)
        uuids = {(p["metadata"].get("annotations") or {}).get(names.GPU_UUID) for p in items}
        return len(items) == 2 and None not in uuids and len(uuids) == 2

    await wait_for(reservations_report_uuids, what="two reservation pods with their GPU UUIDs")
    await consistent(admin)


async def test_a_pod_that_fits_nowhere_gets_a_short_event_and_the_detail_on_debug(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    """Six nodes of four GPUs, each GPU partly used: GPU by GPU the reasons once ran past the API
    server's 1024-character limit on events, and `kubectl describe pod` showed nothing."""
    made = await nodes(6, gpus=4)
    fills = [600, 700, 550, 650]  # more than half a GPU each: one pod per GPU, however the policy packs
    for i, milli in enumerate(fills * 6):
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod(f"fill-{i}", namespace, milli=milli))
    await wait_for(lambda: all_bound(admin, namespace, 24), what="24 pods bound")
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("big", namespace, milli=800))

    async def failed_event() -> str | None:
        events, _ = await admin.list_all(f"/api/v1/namespaces/{namespace}/events")
        for event in events:
            if event.get("reason") == "FailedScheduling" and event["involvedObject"]["name"] == "big":
                return str(event.get("message", ""))
        return None

    message = await wait_for(failed_event, what="a FailedScheduling event")
    assert "6 sharegpu: no GPU with 800 milli-GPU free (largest free: 450)" in message, message
    assert len(message) <= 1024
    pod = await admin.get(f"/api/v1/namespaces/{namespace}/pods/big")
    assert not pod["spec"].get("nodeName")
    explained = await extender.get(f"/debug/pods/{namespace}/big")
    assert explained["lastFilter"]["message"].startswith("0/")
    detail = [line for node in explained["closest"] for line in node["reasons"]]
    for node in made:
        for gpu in range(4):
            assert any(
                line.startswith(f"{node}/gpu{gpu}: sharegpu.io/gpu-milli requested 800, free ") for line in detail
            )
    assert sum(len(line) for line in detail) > 1024, "the GPU-by-GPU text would not have fitted in an event"


REQUEUE_LIMIT = 60.0
"""Seconds a turned-away pod may take to land once its GPU frees. kube-scheduler (1.27 and later)
keeps such a pod until a cluster event it watches, or five minutes; the pod's backoff is at most
10 s. bench/requeue.py measures the delay."""


async def test_a_pod_turned_away_lands_once_a_gpu_frees_not_after_the_five_minute_flush(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    """The extender's refusal carries no queueing hint: the pod waits for any event kube-scheduler
    watches. A bound GPU pod deleted is one (an assigned pod's deletion), so the waiting pod lands."""
    (node,) = await nodes(1, gpus=1)
    await admin.create(paths.pods(namespace), gpu_pod("holder", namespace, milli=700))
    await wait_for(lambda: _bound(admin, namespace, "holder"), what="the holder bound")
    await admin.create(paths.pods(namespace), gpu_pod("waiting", namespace, milli=700))

    await wait_for(lambda: refusal(admin, namespace, "waiting"), what="the second pod turned away")
    await asyncio.sleep(12)  # past its backoff: it sits among the unschedulable pods, waiting for an event
    freed = time.monotonic()
    await admin.delete(paths.pod(namespace, "holder"), grace_period=0)
    await wait_for(lambda: _bound(admin, namespace, "waiting"), timeout=REQUEUE_LIMIT, what="the waiting pod bound")
    assert time.monotonic() - freed < REQUEUE_LIMIT
    pod = await admin.get(paths.pod(namespace, "waiting"))
    assert pod["spec"]["nodeName"] == node


async def test_deleting_pods_frees_shares_and_reservation_pods(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=2)
    for i in range(2):
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod(f"p-{i}", namespace, milli=700))
    await wait_for(lambda: all_bound(admin, namespace, 2), what="2 pods bound")

    reservations = functools.partial(reservation_pods, admin, node)

    assert len(await wait_for(reservations, what="reservation pods")) >= 1
    for i in range(2):
        await admin.delete(f"/api/v1/namespaces/{namespace}/pods/p-{i}")

    async def released() -> bool:
        summary = {n["node"]: n for n in await extender.debug_nodes()}
        gpus = summary[node]["gpus"]
        return all(g["milli"]["free"] == 1000 and not g["holders"] for g in gpus) and not await reservations()

    await wait_for(released, what="shares and reservation pods released")
    # The freed GPUs take new pods again.
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("again", namespace, milli=1000, count=2))
    await wait_for(lambda: all_bound(admin, namespace, 1), what="a 2-GPU pod bound")
    await consistent(admin)


async def test_whole_multi_gpu_and_model_constraints(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (t4,) = await nodes(1, gpus=2, model="T4")
    (a100,) = await nodes(1, gpus=4, model="A100", memory=81920)
    # One at a time, so the outcome does not depend on the scheduler's queue order.
    await admin.create(
        f"/api/v1/namespaces/{namespace}/pods",
        gpu_pod("wants-a100", namespace, milli=300, annotations={names.MODELS: "A100"}),
    )
    await wait_for(lambda: all_bound(admin, namespace, 1), what="the A100 pod bound")
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("four", namespace, nvidia=3))
    await wait_for(lambda: all_bound(admin, namespace, 2), what="the 3-GPU pod bound")
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("two", namespace, count=2))
    bound = {p["metadata"]["name"]: p for p in await wait_for(lambda: all_bound(admin, namespace, 3), what="3 bound")}
    assert bound["wants-a100"]["spec"]["nodeName"] == a100
    assert bound["four"]["spec"]["nodeName"] == a100, "3 whole GPUs fit only the 4-GPU node"
    assert bound["two"]["spec"]["nodeName"] == t4
    three = allocation_of(bound["four"])
    assert three.exclusive
    assert len(three.gpu_indices) == 3
    assert not set(three.gpu_indices) & set(allocation_of(bound["wants-a100"]).gpu_indices)
    await consistent(admin)


async def test_cotenancy_rules(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    await nodes(1, gpus=3)
    rules = [
        ("aff-a1", {names.AFFINITY: "a"}),
        ("aff-a2", {names.AFFINITY: "a"}),
        ("anti-1", {names.ANTI_AFFINITY: "z"}),
        ("anti-2", {names.ANTI_AFFINITY: "z"}),
        ("excl-e", {names.EXCLUSION: "e"}),
        ("excl-f", {names.EXCLUSION: "f"}),
    ]
    for name, pod_annotations in rules:
        await admin.create(
            f"/api/v1/namespaces/{namespace}/pods", gpu_pod(name, namespace, milli=100, annotations=pod_annotations)
        )
        await wait_for(functools.partial(_bound, admin, namespace, name), what=f"{name} bound")
    pods = {p["metadata"]["name"]: allocation_of(p) for p in await pods_in(admin, namespace)}
    gpu = {name: pods[name].gpu_indices[0] for name in pods}
    assert gpu["aff-a1"] == gpu["aff-a2"], "same affinity label shares a GPU"
    assert gpu["anti-1"] != gpu["anti-2"], "same anti-affinity label never shares"
    assert gpu["excl-e"] != gpu["excl-f"], "one exclusion label per GPU"
    assert gpu["anti-1"] != gpu["aff-a1"], "unlabelled-for-affinity pods never join an affinity GPU"
    await consistent(admin)


async def _bound(kube: client.KubeClient, namespace: str, name: str) -> bool:
    pod = await kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    return bool(pod["spec"].get("nodeName"))


async def test_handoff_configmap_gets_the_reserved_gpu_uuid(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=1)
    pod = gpu_pod(
        "shared",
        namespace,
        milli=250,
        memory=2048,
        annotations={names.HANDOFF: "sharegpu-handoff-x1", names.LIMIT_MILLI: "500"},
    )
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    await wait_for(lambda: all_bound(admin, namespace, 1), what="pod bound")

    async def configmap() -> Json | None:
        found = await get_or_none(admin, f"/api/v1/namespaces/{namespace}/configmaps/sharegpu-handoff-x1")
        return found if found is not None and found.get("data") else None

    data = (await wait_for(configmap, what="hand-off ConfigMap filled"))["data"]
    items, _ = await admin.list_all(
        f"/api/v1/namespaces/{names.HOLDING_NAMESPACE}/pods", {"labelSelector": f"{names.LABEL_NODE}={node}"}
    )
    (reservation,) = items
    assert data["main.NVIDIA_VISIBLE_DEVICES"] == reservation["metadata"]["annotations"][names.GPU_UUID]
    assert data["main.NVIDIA_VISIBLE_DEVICES"].startswith(f"GPU-{node}-")
    assert data["main.CUDA_DEVICE_SM_LIMIT"] == "50"
    assert data["main.CUDA_DEVICE_MEMORY_LIMIT"] == "2048m"


async def test_whole_gpu_pods_of_other_schedulers_are_counted(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=2)
    foreign = gpu_pod("foreign", namespace, nvidia=2)
    foreign["spec"]["nodeName"] = node  # placed without any scheduler, as a kubelet-level pod would be
    foreign["spec"].pop("schedulerName")
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", foreign)

    async def counted() -> bool:
        summary = {n["node"]: n for n in await extender.debug_nodes()}
        return all(g["milli"]["free"] == 0 for g in summary[node]["gpus"])

    await wait_for(counted, what="the foreign pod's GPUs counted as used")
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("late", namespace, milli=100))

    async def unschedulable() -> bool:
        pod = await admin.get(f"/api/v1/namespaces/{namespace}/pods/late")
        return any(
            c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in (pod.get("status") or {}).get("conditions") or []
        )

    await wait_for(unschedulable, what="the sharing pod to find no room")


async def test_metrics_and_health_endpoints(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=1)
    conflicts = (await extender.get("/debug/nodes"))["counters"]["conflicts"]  # other tests make some on purpose
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("measured", namespace, milli=400))
    await wait_for(lambda: all_bound(admin, namespace, 1), what="the pod bound")
    async with aiohttp.ClientSession(headers=extender.headers) as session:
        async with session.get(f"{extender.health_url}/healthz", ssl=extender.health_ssl) as response:
            assert response.status == 200
        async with session.get(f"{extender.health_url}/readyz", ssl=extender.health_ssl) as response:
            assert response.status == 200
        async with session.get(f"{extender.health_url}/metrics", ssl=extender.health_ssl) as response:
            text = await response.text()
        assert "sharegpu_extender_request_duration_seconds_bucket" in text
        assert 'sharegpu_extender_binds_total{outcome="bound"}' in text
        assert "sharegpu_extender_scheduling_latency_seconds_count" in text
        samples = {
            (s.name, s.labels.get("node"), s.labels.get("gpu")): s.value
            for family in parser.text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples["sharegpu_gpu_compute_allocated_gpus", node, "0"] == 0.4
        assert samples["sharegpu_gpu_holders", node, "0"] == 1
        assert "# TYPE sharegpu_pending_gpu_pods gauge" in text
        before = await extender.connections()
        assert before.get("h2", 0) >= 1, f"kube-scheduler calls the extender over HTTP/2: {before}"
        for i in range(5):
            await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod(f"more-{i}", namespace, milli=100))
        await wait_for(lambda: all_bound(admin, namespace, 6), what="five more pods bound")
        after = await extender.connections()
        assert after.get("h2") == before.get("h2"), f"one kept connection, no handshake per call: {after}"
        async with session.get(f"{extender.health_url}/debug/nodes", ssl=extender.health_ssl) as response:
            counters = (await response.json())["counters"]
        assert counters["rebuilds"] >= 1
        assert counters["conflicts"] == conflicts, "the ledger did not disagree with the API server meanwhile"
        async with session.post(f"{extender.health_url}/bind", json={}, ssl=extender.health_ssl) as response:
            assert response.status == 404, "the health port serves no scheduling verbs"
    # /metrics and /debug answer only a token the API server vouches for, of a user allowed to get them.
    for headers, status in (({}, 401), ({"Authorization": "Bearer forged"}, 401),
                            ({"Authorization": "Bearer alice-token"}, 403)):  # fmt: skip
        async with aiohttp.ClientSession(headers=headers) as session:
            for path in ("/metrics", "/debug/nodes"):
                async with session.get(f"{extender.health_url}{path}", ssl=extender.health_ssl) as response:
                    assert response.status == status, (headers, path)
            async with session.get(f"{extender.health_url}/readyz", ssl=extender.health_ssl) as response:
                assert response.status == 200, "the kubelet's probes carry no token"


async def test_only_kube_schedulers_certificate_may_call_bind(extender: ExtenderProcess) -> None:
    """No pod in the cluster can bind pods through the extender: the verbs need kube-scheduler's
    client certificate (kube-scheduler itself presents it: every scheduling test here goes through it)."""
    body = {"PodName": "x", "PodNamespace": "y", "PodUID": "z", "Node": "n"}
    trusting = ssl.create_default_context(cafile=str(extender.pki.ca))
    scheduler = ssl.create_default_context(cafile=str(extender.pki.ca))
    scheduler.load_cert_chain(extender.pki.client_cert, extender.pki.client_key)
    plain = extender.url.replace("https://", "http://")
    async with aiohttp.ClientSession() as session:
        for url, context in ((f"{plain}/bind", None), (f"{extender.url}/bind", trusting)):
            with pytest.raises(aiohttp.ClientError):
                async with session.post(url, json=body, ssl=context if context else False) as response:
                    await response.read()
        async with session.post(f"{extender.url}/bind", json=body, ssl=scheduler) as response:
            answer = await response.json()
    assert "cannot read pod y/x" in answer["Error"], "with the certificate the request is served (and judged)"


async def test_a_lost_reservation_pod_is_replaced_and_the_hand_off_follows(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=2)
    pod = gpu_pod("sharer", namespace, milli=300, annotations={names.HANDOFF: "sharegpu-handoff-lost-1"})
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    await wait_for(lambda: all_bound(admin, namespace, 1), what="pod bound")

    async def reservations() -> list[Json]:
        items = await reservation_pods(admin, node)
        return [p for p in items if (p["metadata"].get("annotations") or {}).get(names.GPU_UUID)]

    (first,) = await wait_for(reservations, what="a reservation with its UUID")
    await admin.delete(f"/api/v1/namespaces/{names.HOLDING_NAMESPACE}/pods/{first['metadata']['name']}", grace_period=0)

    async def replaced() -> Json | None:
        live = [p for p in await reservations() if p["metadata"]["name"] != first["metadata"]["name"]]
        return live[0] if live else None

    second = await wait_for(replaced, what="a new reservation pod")
    uuid = second["metadata"]["annotations"][names.GPU_UUID]

    async def handoff_follows() -> bool:
        found = await get_or_none(admin, f"/api/v1/namespaces/{namespace}/configmaps/sharegpu-handoff-lost-1")
        data = (found or {}).get("data") or {}
        return bool(data.get("main.NVIDIA_VISIBLE_DEVICES") == uuid)

    await wait_for(handoff_follows, what="the hand-off ConfigMap to name the new GPU")
    await consistent(admin)


async def test_a_failed_reservation_pod_is_cleaned_up_and_replaced(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    (node,) = await nodes(1, gpus=1)
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("sharer", namespace, milli=400))
    await wait_for(lambda: all_bound(admin, namespace, 1), what="pod bound")

    reservations = functools.partial(reservation_pods, admin, node)

    async def started() -> list[Json] | None:
        # The fake kubelet reports the UUID, then Running: a Failed written before that would be
        # overwritten by its Running (a race in the test, not in the extender).
        items = await reservations()
        return items if [(p.get("status") or {}).get("phase") for p in items] == ["Running"] else None

    (first,) = await wait_for(started, what="a reservation pod running")
    name = first["metadata"]["name"]
    # What a kubelet does when the device plugin cannot give the pod its GPU.
    await admin.patch(f"/api/v1/namespaces/{names.HOLDING_NAMESPACE}/pods/{name}/status",
                      {"status": {"phase": "Failed", "reason": "UnexpectedAdmissionError"}})  # fmt: skip

    async def replaced() -> bool:
        items = await reservations()
        names = [p["metadata"]["name"] for p in items]
        running = [p for p in items if (p.get("status") or {}).get("phase") == "Running"]
        return name not in names and len(running) == 1

    await wait_for(replaced, what="the failed reservation deleted and a new one running")


async def test_a_hand_off_configmap_claimed_twice_serves_only_its_first_pod_and_binds_no_other(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    await nodes(1, gpus=2)
    first = await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod(
        "first", namespace, milli=200, annotations={names.HANDOFF: "sharegpu-handoff-claimed"}))  # fmt: skip
    await wait_for(lambda: all_bound(admin, namespace, 1), what="first bound")

    async def configmap() -> Json | None:
        return await get_or_none(admin, f"/api/v1/namespaces/{namespace}/configmaps/sharegpu-handoff-claimed")

    await wait_for(configmap, what="the hand-off of the first pod")
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod(
        "copycat", namespace, milli=200, annotations={names.HANDOFF: "sharegpu-handoff-claimed"}))  # fmt: skip

    async def refused() -> str:
        pod = await admin.get(f"/api/v1/namespaces/{namespace}/pods/copycat")
        assert not pod["spec"].get("nodeName"), "a pod is not bound to read another pod's GPU"
        return " ".join(str(c.get("message") or "") for c in pod["status"].get("conditions") or [])

    said = await wait_for(lambda: _contains(refused, f"belongs to pod {namespace}/first"), what="copycat refused")
    assert "this pod would see its GPU" in said
    owners = (await configmap() or {})["metadata"]["ownerReferences"]
    assert [o["uid"] for o in owners] == [first["metadata"]["uid"]]


async def _contains(read: Callable[[], Any], text: str) -> str | None:
    found = str(await read())
    return found if text in found else None


async def test_a_quota_lowered_after_admission_still_holds_at_placement(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    """Kubernetes checks a ResourceQuota at creation only; a pod admitted before the quota existed
    waits at placement while its namespace's placed pods hold the quota (the extender's check), and
    goes through once the quota is raised."""
    (node,) = await nodes(1, gpus=4)
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", gpu_pod("three-halves", namespace, milli=500, count=3))
    waiting = gpu_pod("waits", namespace, milli=600)
    waiting["spec"]["nodeSelector"]["later"] = "yes"  # not schedulable until the node gets this label
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", waiting)
    await wait_for(functools.partial(all_bound, admin, namespace, 1), what="the first pod bound")
    hard = {f"requests.{names.GPU_MILLI_TOTAL}": "2000"}
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"}, "spec": {"hard": hard}}
    await admin.create(f"/api/v1/namespaces/{namespace}/resourcequotas", quota)
    await asyncio.sleep(1)  # the extender's informer takes the quota up
    await admin.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {"later": "yes"}}})

    async def refused() -> str:
        pod = await admin.get(f"/api/v1/namespaces/{namespace}/pods/waits")
        conditions: list[Json] = pod["status"].get("conditions") or []
        text = " ".join(str(c.get("message") or "") for c in conditions if c["type"] == "PodScheduled")
        return text if "ResourceQuota" in text else ""

    message = await wait_for(refused, what="the quota's refusal on the pod")
    assert f"namespace {namespace}: ResourceQuota gpus allows 2000 milli-GPU" in message
    assert "its placed pods hold 1500 and this pod asks 600" in message
    hard[f"requests.{names.GPU_MILLI_TOTAL}"] = "4000"
    current = await admin.get(f"/api/v1/namespaces/{namespace}/resourcequotas/gpus")
    current["spec"]["hard"] = hard
    await admin.replace(f"/api/v1/namespaces/{namespace}/resourcequotas/gpus", current)
    await asyncio.sleep(1)
    await admin.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {"later": "again"}}})
    await admin.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {"later": "yes"}}})  # a node event requeues it
    await wait_for(functools.partial(all_bound, admin, namespace, 2), what="the waiting pod bound")


async def test_isolation_demands_place_only_where_offered_and_hand_offs_match_the_node(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    """A pod demanding MPS lands on the node that runs MPS daemons, and its hand-off carries MPS's limits and
    its GPU's daemon; one demanding HAMi-core lands where the library is and is told to preload it; a pod
    on a node that enforces nothing gets its GPU and no limit variable at all (and nothing to preload)."""
    (plain,) = await nodes(1, gpus=1, isolation=frozenset())
    (mps,) = await nodes(1, gpus=1, isolation=frozenset({devices.Isolation.MPS}))
    (hami,) = await nodes(1, gpus=1, isolation=frozenset({devices.Isolation.HAMI_CORE}))
    demanding = gpu_pod("mps", namespace, milli=300, memory=1024,
                        annotations={names.HANDOFF: "sharegpu-handoff-mps", names.ISOLATION: "mps"})  # fmt: skip
    preloading = gpu_pod("hami", namespace, milli=300, memory=1024,
                         annotations={names.HANDOFF: "sharegpu-handoff-hami",
                                      names.ISOLATION: "hami-core"})  # fmt: skip
    pinned = gpu_pod("plain", namespace, milli=300, memory=1024, annotations={names.HANDOFF: "sharegpu-handoff-plain"})
    pinned["spec"]["nodeSelector"] = {"kubernetes.io/hostname": plain}
    for pod in (demanding, preloading, pinned):
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    await wait_for(lambda: all_bound(admin, namespace, 3), what="pods bound")
    assert (await admin.get(f"/api/v1/namespaces/{namespace}/pods/mps"))["spec"]["nodeName"] == mps
    assert (await admin.get(f"/api/v1/namespaces/{namespace}/pods/hami"))["spec"]["nodeName"] == hami

    async def data(name: str) -> dict[str, str] | None:
        found = await get_or_none(admin, f"/api/v1/namespaces/{namespace}/configmaps/{name}")
        return dict(found["data"]) if found is not None and found.get("data") else None

    wired = await wait_for(lambda: data("sharegpu-handoff-mps"), what="MPS pod's hand-off")
    uuid = wired["main.NVIDIA_VISIBLE_DEVICES"]
    assert wired == {
        "main.NVIDIA_VISIBLE_DEVICES": uuid, "main.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "main.CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M",
        "main.SHAREGPU_PRELOAD": "",
    }  # fmt: skip
    preloaded = await wait_for(lambda: data("sharegpu-handoff-hami"), what="HAMi-core pod's hand-off")
    assert preloaded == {
        "main.NVIDIA_VISIBLE_DEVICES": preloaded["main.NVIDIA_VISIBLE_DEVICES"], "main.CUDA_DEVICE_SM_LIMIT": "30",
        "main.CUDA_DEVICE_MEMORY_LIMIT": "1024m", "main.SHAREGPU_PRELOAD": "/run/sharegpu/hami-core/libvgpu.so",
    }  # fmt: skip
    bare = await wait_for(lambda: data("sharegpu-handoff-plain"), what="plain pod's hand-off")
    assert bare == {"main.NVIDIA_VISIBLE_DEVICES": bare["main.NVIDIA_VISIBLE_DEVICES"], "main.SHAREGPU_PRELOAD": ""}
