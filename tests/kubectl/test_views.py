"""The plugin's views over a cluster the real extender placed pods in (fake API server): the
inventory matches the allocations the extender wrote, and `explain` gives the extender's own answer
(its filter's FailedNodes, its /debug/pods detail, the node its filter chooses, its quota refusal)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson

from sharegpu.api import dra, names, paths, reasons, resources
from sharegpu.core import allocation, devices, requests, units
from sharegpu.extender import routes
from sharegpu.kubectl import read, render, views
from tests.builders import MakeAllocation, MakeClaim, MakePod
from tests.extender.conftest import Harness, add_node, gpu_pod, settle
from tests.kubectl.conftest import snapshot

Json = dict[str, Any]


def allocations(h: Harness) -> dict[tuple[str, int], set[tuple[str, int, int]]]:
    """(node, GPU) -> {(pod, milli, MiB)} from the allocation annotations the extender wrote."""
    held: dict[tuple[str, int], set[tuple[str, int, int]]] = {}
    for pod in h.server.list_objects(paths.PODS):
        text = (pod["metadata"].get("annotations") or {}).get(names.ALLOCATION)
        if not text:
            continue
        key = units.pod_key(pod["metadata"]["namespace"], pod["metadata"]["name"])
        alloc = allocation.Allocation.from_json(text, pod=key)
        for index, (milli, memory) in alloc.gpu_usage().items():
            held.setdefault((alloc.node, index), set()).add((key, milli, memory))
    return held


def row_of(text: str, node: str, gpu: int) -> str:
    """The table line of GPU `gpu` of `node` (the node's name is printed on its first GPU's line only)."""
    current = ""
    for line in text.splitlines():
        first = line.split()[0] if line.split() else ""
        if first.startswith("n") and first[1:].isdigit():
            current, rest = first, line.split()[1:]
        else:
            rest = line.split()
        if current == node and rest and rest[0] == str(gpu):
            return line
    raise AssertionError(f"no line for {node}/gpu{gpu} in\n{text}")


async def test_inventory_shows_each_gpu_with_the_pods_holding_it_as_their_allocations_say(
    placed: Callable[..., Any],
) -> None:
    h: Harness = await placed(nodes=2, gpus=2)
    for name, milli in (("a", 600), ("b", 300), ("c", 700)):
        await h.schedule(await h.create(gpu_pod(name, milli=milli)))
    await h.schedule(await h.create(gpu_pod("w", nvidia=1)))
    for _ in range(200):  # the reservation reconciler creates the shared GPUs' reservation pods
        if len(h.server.list_objects(paths.pods(names.HOLDING_NAMESPACE))) >= 2:
            break
        await asyncio.sleep(0.01)
    await settle(h.server)

    inventory = views.inventory(await snapshot(h))
    expected = allocations(h)
    assert sum(len(v) for v in expected.values()) == 4
    got = {
        (n.name, g.index): {(x.pod, x.milli, x.memory_mib) for x in g.holders}
        for n in inventory.nodes
        for g in n.gpus
        if g.holders
    }
    assert got == expected
    for node in inventory.nodes:
        assert [g.uuid for g in node.gpus] == [f"GPU-{node.name}-{i}" for i in range(2)]
        for gpu in node.gpus:
            assert gpu.milli_used == sum(x.milli for x in gpu.holders)
            assert gpu.milli_free == 1000 - gpu.milli_used and gpu.model == "T4" and gpu.memory_capacity == 16384
            assert all(x.phase == "Added" for x in gpu.holders)
    totals = inventory.totals()
    assert (totals.gpus, totals.milli_used, totals.milli_capacity, totals.whole_free) == (4, 2600, 4000, 4 - len(got))
    whole = next(g for n in inventory.nodes for g in n.gpus if any(x.pod == "ns/w" for x in g.holders))
    assert (whole.milli_used, whole.memory_used, whole.reservation) == (1000, 16384, None)
    shared = [g for n in inventory.nodes for g in n.gpus if g.holders and g is not whole]
    assert shared
    assert all((g.reservation or "").startswith("sharegpu-gpus/sharegpu-reserve-") for g in shared)

    table = render.plain(render.inventory_table(inventory))
    for (name, index), holders in expected.items():
        line = row_of(table, name, index)
        used = sum(m for _, m, _ in holders)
        assert f"{used}/1000" in line and all(pod in line for pod, _, _ in holders), line
    assert "4 GPUs" in table and "2600/4000 milli-GPU allocated (65%)" in table
    wide = render.plain(render.inventory_table(inventory, wide=True))
    assert "ns/a 600m 0Mi" in wide and "GPU-n0-0" in wide and "UUID not reported yet" in wide

    document = orjson.loads(render.dumps(render.inventory_json(inventory)))
    assert (document["kind"], document["version"]) == ("GPUInventory", 1)
    assert [n["name"] for n in document["nodes"]] == ["n0", "n1"]
    from_json = {
        (n["name"], g["index"]): {(p["pod"], p["milli"], p["memoryMiB"]) for p in g["pods"]}
        for n in document["nodes"]
        for g in n["gpus"]
        if g["pods"]
    }
    assert from_json == expected
    assert document["totals"]["milli"] == {"capacity": 4000, "used": 2600, "free": 1400}


async def test_inventory_counts_the_shares_dra_claims_hold_beside_the_pods(placed: Callable[..., Any]) -> None:
    """A claim of sharegpu's class that its allocator placed holds its share of the GPU in the
    inventory, named as a claim, as the extender's ledger counts it."""
    h: Harness = await placed(nodes=1, gpus=2)
    await h.schedule(await h.create(gpu_pod("a", milli=500)))
    claim = MakeClaim("c", "team").ask(250, "2Gi").obj()
    result = {"request": "gpu", "driver": dra.DRIVER, "pool": "n0", "device": dra.device_name(1),
              "consumedCapacity": {dra.MILLI: "250", dra.MEMORY: "2Gi"}}  # fmt: skip
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    h.server.put_object(dra.claim_path("team"), claim)
    await settle(h.server)

    inventory = views.inventory(await snapshot(h))
    (node,) = inventory.nodes
    holders = {g.index: {(x.pod, x.milli, x.memory_mib) for x in g.holders} for g in node.gpus}
    assert holders[1] == {("claim team/c", 250, 2048)}, holders
    assert inventory.totals().milli_used == 750
    assert "claim team/c" in render.plain(render.inventory_table(inventory))


async def test_inventory_names_the_nodes_it_leaves_out_and_unhealthy_gpus(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=1, gpus=2)
    device = h.server.get_object(paths.device("n0"))
    assert device is not None
    device["spec"]["gpus"][1].update(healthy=False, reason="XID 79")
    await h.api.replace(paths.device("n0"), device)
    h.server.put_object(paths.DEVICES, {**device, "metadata": {"name": "orphan"}})
    broken = {**device, "metadata": {"name": "n0-broken"}}
    broken["spec"] = {**device["spec"], "isolation": ["teleport"]}
    h.server.put_object(paths.DEVICES, broken)
    node = h.server.get_object(paths.node("n0")) or {}
    h.server.put_object(paths.NODES, {**node, "metadata": {"name": "n0-broken"}})

    inventory = views.inventory(await snapshot(h))
    assert [n.name for n in inventory.nodes] == ["n0"]
    gpu = inventory.nodes[0].gpus[1]
    assert (gpu.healthy, gpu.reason) == (False, "XID 79")
    left = dict(inventory.ignored)
    assert left["orphan"] == "the Device has no Node"
    assert "unknown mode 'teleport'" in left["n0-broken"]
    text = render.plain(render.inventory_table(inventory))
    assert "T4 (unhealthy: XID 79)" in row_of(text, "n0", 1)
    assert "left out: orphan: the Device has no Node" in text


async def fill(h: Harness, millis: list[int]) -> None:
    for i, milli in enumerate(millis):
        await h.schedule(await h.create(gpu_pod(f"fill-{i}", milli=milli)))


async def test_inventory_marks_an_overcommitted_gpu_and_explain_says_it_takes_no_pod(
    placed: Callable[..., Any],
) -> None:
    """Two pods the API shows bound to one GPU that cannot hold both (written past the extender):
    the plugin, rebuilding the extender's ledger, counts both and names the GPU over-committed."""
    h: Harness = await placed(nodes=1, gpus=2)
    for name in ("x", "y"):
        body = gpu_pod(name, milli=700)
        body["metadata"]["annotations"][names.ALLOCATION] = MakeAllocation(f"ns/{name}", "n0").grant(1, 700).json()
        body["spec"]["nodeName"] = "n0"
        h.server.put_object(paths.pods("ns"), body)
    await h.create(gpu_pod("probe", milli=100))
    cluster = await snapshot(h)
    inventory = views.inventory(cluster)
    ((node, gpu),) = inventory.overcommitted()
    assert (node, gpu.index, gpu.milli_used) == ("n0", 1, 1400)
    assert {x.pod for x in gpu.holders} == {"ns/x", "ns/y"}, "both are counted"
    assert "compute requested 700, free 300" in " ".join(gpu.overcommitted)
    table = render.plain(render.inventory_table(inventory))
    assert "1400/1000 OVER-COMMITTED" in row_of(table, "n0", 1)
    assert "over-committed: n0/gpu1" in table
    document = orjson.loads(render.dumps(render.inventory_json(inventory)))
    assert document["nodes"][0]["gpus"][1]["overcommitted"] and not document["nodes"][0]["gpus"][0]["overcommitted"]
    found, selector = await read.pod(h.api, "ns", "probe")
    explained = views.explain(cluster, found, selector)
    assert explained.choice is not None and explained.choice.gpus == (0,), "never the over-committed GPU"


async def test_explain_gives_the_extenders_own_reasons_for_a_pod_that_fits_nowhere(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=2, gpus=2)
    await fill(h, [600, 700, 550, 650])
    pod = await h.create(gpu_pod("big", milli=800))
    found, selector = await read.pod(h.api, "ns", "big")
    explained = views.explain(await snapshot(h), found, selector)

    verdict = h.extender.scheduling.filter(h.args(pod))  # what the extender answers kube-scheduler
    key = units.pod_key("ns", "big")
    assert explained.outcome == "unschedulable" and explained.choice is None and not verdict.node_names
    assert {v.node: v.reason for v in explained.nodes} == verdict.failed_nodes
    assert explained.message == h.extender.scheduling.outcomes[key].message
    assert explained.message == (
        "0/2 nodes are available: 2 sharegpu: no GPU with 800 milli-GPU free (largest free: 450)."
    )
    debug = routes.explain(h.extender, key)  # the extender's /debug/pods
    detail = {line for v in explained.nodes for line in v.gpus}
    assert {line for n in debug["closest"] for line in n["reasons"]} == detail
    assert {v.shortfall for v in explained.nodes} == {"GPU_COMPUTE"}

    text = render.plain(render.explanation_text(explained))
    assert "Pod ns/big: Pending (scheduler sharegpu-scheduler)" in text
    assert "1 GPU x 800 milli-GPU; host cpu 100m, memory 64 MiB" in text
    for node in ("n0", "n1"):
        assert f"{node}: sharegpu: no GPU with 800 milli-GPU free (largest free: 450)" in text
        for gpu in range(2):
            assert f"    {node}/gpu{gpu}: sharegpu.io/gpu-milli requested 800, free " in text
    document = orjson.loads(render.dumps(render.explanation_json(explained)))
    assert (document["kind"], document["outcome"], document["candidates"]) == ("PodExplanation", "unschedulable", 2)
    assert document["nodes"][0]["gpus"] and document["choice"] is None

    short = views.explain(await snapshot(h), found, selector, detail=1)
    assert [bool(v.gpus) for v in short.nodes] == [True, False], "GPU by GPU for the closest node only"


async def test_explain_chooses_the_node_and_gpus_the_extenders_filter_chooses(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=3, gpus=2)
    await fill(h, [300, 500, 1000, 250])
    pod = await h.create(gpu_pod("next", milli=400))
    found, selector = await read.pod(h.api, "ns", "next")
    explained = views.explain(await snapshot(h), found, selector)
    assert explained.outcome == "fits" and explained.choice is not None
    assert explained.message == f"{sum(v.fits for v in explained.nodes)} of 3 nodes fit"

    verdict = h.extender.scheduling.filter(h.args(pod))
    assumed = h.extender.cache.assumed[units.pod_key("ns", "next")]  # the extender reserved its choice
    assert verdict.node_names == [explained.choice.node]
    assert assumed.gpu_indices == explained.choice.gpus and explained.choice.policy == "fgd-used"
    for v in explained.nodes:
        assert v.fits == bool(v.eligible) == (v.reason == "") == (v.shortfall == "NONE")
    text = render.plain(render.explanation_text(explained))
    assert (
        f"{'choice':<12}{explained.choice.node}, GPU {explained.choice.gpus[0]} (what policy fgd-used picks now)"
        in text
    )


async def test_explain_looks_only_at_the_nodes_the_pods_node_selector_allows(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=2, gpus=1)
    await h.api.patch(paths.node("n1"), {"metadata": {"labels": {"pool": "x"}}})
    h.server.put_object(paths.NODES, {"metadata": {"name": "n9", "labels": {"pool": "x"}}})  # no Device: no GPUs
    pod = gpu_pod("picky", nvidia=2, spec={"nodeSelector": {"pool": "x"}})
    await h.create(pod)
    found, selector = await read.pod(h.api, "ns", "picky")
    explained = views.explain(await snapshot(h), found, selector)
    assert selector == {"pool": "x"} and (explained.candidates, explained.left_out) == (2, 1)
    assert [(v.node, v.shortfall, v.reason) for v in explained.nodes] == [
        ("n1", "TOO_FEW_GPUS", "sharegpu: node has fewer than 2 GPUs"),
        ("n9", views.NO_INVENTORY, reasons.NO_INVENTORY),
    ]
    assert explained.message == (
        "0/2 nodes are available: 1 sharegpu: node has fewer than 2 GPUs, 1 " + reasons.NO_INVENTORY + "."
    )
    text = render.plain(render.explanation_text(explained))
    assert "2 nodes (1 more left out by the nodeSelector pool=x)" in text
    assert "    n1: sharegpu.io/gpu requested 2, free 1 of 1 (the node has fewer GPUs than the pod asks for)" in text


async def test_explain_counts_no_node_that_serves_dra_claims_only(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=1, gpus=1)
    add_node(h.server, "n9", 4, dra=True)  # room enough, but for DRA claims only
    await settle(h.server)
    pod = await h.create(gpu_pod("pair", nvidia=2))
    found, selector = await read.pod(h.api, "ns", "pair")
    explained = views.explain(await snapshot(h), found, selector)

    verdict = h.extender.scheduling.filter(h.args(pod))
    assert not verdict.node_names and explained.outcome == "unschedulable" and explained.choice is None
    assert {v.node: v.reason for v in explained.nodes} == verdict.failed_nodes
    assert explained.message == h.extender.scheduling.outcomes[units.pod_key("ns", "pair")].message
    dra_node = next(v for v in explained.nodes if v.node == "n9")
    assert (dra_node.fits, dra_node.shortfall, dra_node.reason) == (False, views.DRA_ONLY, reasons.NO_INVENTORY)
    text = render.plain(render.explanation_text(explained))
    assert f"    {views.DRA_ONLY_DETAIL}" in text and "fits" not in text


async def test_explain_and_pending_name_the_dra_claims_a_pod_asks_its_gpus_through(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=1, gpus=1)
    add_node(h.server, "n9", 2, dra=True)
    h.server.put_object(dra.claim_path("ns"), MakeClaim("c1", "ns").ask(250, "2Gi").obj())
    h.server.put_object(dra.claim_path("ns"), MakeClaim("other", "ns").ask(device_class="example.com").obj())
    made = MakePod("trainer", "ns").scheduler().container().claim("c1").claim("other", "net").gate()
    made.status(conditions=[{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}])
    await h.create(made.obj())
    found, selector = await read.pod(h.api, "ns", "trainer")
    explained = views.explain(await snapshot(h), found, selector)

    assert explained.outcome == "dra" and explained.claims == ("gpu (claim c1, not allocated yet)",)
    assert explained.choice is None and explained.nodes == ()
    text = render.plain(render.explanation_text(explained))
    assert "asks for no GPU" not in text and "through DRA claims (gpu (claim c1, not allocated yet))" in text
    assert "sharegpu's DRA allocator places them" in text
    document = orjson.loads(render.dumps(render.explanation_json(explained)))
    assert (document["outcome"], document["claims"]) == ("dra", ["gpu (claim c1, not allocated yet)"])

    waiting = views.pending(await read.cluster(h.api))
    assert [(p.name, p.asks, p.reason) for p in waiting] == [
        ("trainer", "DRA claims gpu (claim c1, not allocated yet)", "SchedulingGated")
    ]


async def test_explain_answers_for_a_gang_member_what_its_gangs_filter_answers(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=1, gpus=2)
    await h.schedule(await h.create(gpu_pod("a", nvidia=1)))
    gang = {names.GANG: "g", names.GANG_MIN: "2"}
    member = await h.create(gpu_pod("w0", nvidia=1, annotations=gang))
    await h.create(gpu_pod("w1", nvidia=1, annotations=gang))
    found, selector = await read.pod(h.api, "ns", "w0")
    explained = views.explain(await snapshot(h), found, selector)

    verdict = h.extender.scheduling.filter(h.args(member))  # one GPU is free: room for one member, not two
    assert not verdict.node_names and set(verdict.failed_nodes.values()) == {explained.message}
    assert explained.outcome == "gang" and explained.choice is None and explained.gang == "ns/g, minimum 2"
    assert [v.fits for v in explained.nodes] == [True], "the pod alone would fit"
    text = render.plain(render.explanation_text(explained))
    assert f"{'gang':<12}member of gang ns/g, minimum 2: placed with its gang, all or nothing" in text
    assert "choice" not in text and "n0: room for this pod alone (GPU" in text
    document = orjson.loads(render.dumps(render.explanation_json(explained)))
    assert (document["outcome"], document["choice"], document["gang"]) == ("gang", None, "ns/g, minimum 2")

    shares = {names.GANG: "s", names.GANG_MIN: "2"}  # two shares of the free GPU: the gang fits
    member = await h.create(gpu_pod("s0", milli=300, annotations=shares))
    await h.create(gpu_pod("s1", milli=300, annotations=shares))
    found, selector = await read.pod(h.api, "ns", "s0")
    cluster = await snapshot(h)
    held = list(cluster.cache.ledger.entries())
    explained = views.explain(cluster, found, selector)
    assert explained.outcome == "fits" and explained.choice is not None, explained.message
    assert explained.message == "its gang's plan places 2 member(s) on 1 node(s)"
    assert list(cluster.cache.ledger.entries()) == held, "the plan was tried, not held"
    verdict = h.extender.scheduling.filter(h.args(member))
    assert verdict.node_names == [explained.choice.node]
    assert h.extender.cache.assumed[units.pod_key("ns", "s0")].gpu_indices == explained.choice.gpus


async def test_explain_says_where_a_bound_pod_is_and_why_others_are_not_placed(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=1, gpus=2)
    pod = await h.create(gpu_pod("a", milli=300))
    node = await h.schedule(pod)
    cluster = await snapshot(h)
    found, _ = await read.pod(h.api, "ns", "a")
    explained = views.explain(cluster, found)
    assert (explained.outcome, explained.node) == ("bound", node)
    stored = h.server.get_object(paths.pod("ns", "a")) or {}
    assert explained.allocation is not None
    assert explained.allocation.to_json() == stored["metadata"]["annotations"][names.ALLOCATION]
    text = render.plain(render.explanation_text(explained))
    assert f"bound to {node}" in text and f"{'holds':<12}main: gpu" in text and "300 milli-GPU" in text

    h.server.put_object(paths.pods("ns"), gpu_pod("bad", milli=None, annotations={names.MODELS: "A100"}))
    unreadable = {"name": "main", "resources": {"limits": {names.GPU_MILLI: "x"}}}
    h.server.put_object(paths.pods("ns"), {**gpu_pod("broken"), "spec": {"containers": [unreadable]}})
    h.server.put_object(paths.pods("ns"), {**gpu_pod("cpu"), "spec": {"containers": [{"name": "main"}]}})
    found, _ = await read.pod(h.api, "ns", "broken")
    invalid = views.explain(cluster, found)
    assert invalid.outcome == "invalid"
    assert invalid.problem.startswith("sharegpu: invalid GPU request: pod ns/broken, container main:")
    found, _ = await read.pod(h.api, "ns", "cpu")
    assert views.explain(cluster, found).outcome == "no-gpu"
    assert "asks for no GPU" in render.plain(render.explanation_text(views.explain(cluster, found)))
    found, _ = await read.pod(h.api, "ns", "bad")
    wrong_model = views.explain(cluster, found)
    assert wrong_model.outcome == "unschedulable" and wrong_model.nodes[0].shortfall == "MODEL"
    assert wrong_model.nodes[0].gpus[0] == (
        "n0/gpu0: sharegpu.io/gpu-models requested 1, free 0 of 1 (model T4 not in ['A100'])"
    )


async def test_explain_and_budgets_show_the_quota_the_extender_holds_a_pod_back_by(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=1, gpus=2)
    await h.schedule(await h.create(gpu_pod("a", milli=600)))
    h.server.put_object(
        "/api/v1/namespaces/ns/resourcequotas",
        {"metadata": {"name": "gpus"}, "spec": {"hard": {f"requests.{names.GPU_MILLI_TOTAL}": "1000"}}},
    )
    await settle(h.server)
    pod = await h.create(gpu_pod("b", milli=500))
    found, selector = await read.pod(h.api, "ns", "b")
    cluster = await snapshot(h)
    explained = views.explain(cluster, found, selector)
    verdict = h.extender.scheduling.filter(h.args(pod))
    assert explained.outcome == "quota" and set(verdict.failed_nodes.values()) == {explained.problem}
    assert "ResourceQuota gpus allows 1000 milli-GPU" in explained.problem
    assert "its placed pods hold 600" in explained.problem
    assert explained.choice is None, "the filter refuses before any node: nothing is chosen"
    assert explained.message == "held back by its namespace's quota before any node (1 of 1 nodes have room for it)"
    assert [v.fits for v in explained.nodes] == [True], "the GPUs have room: only the quota holds it back"
    text = render.plain(render.explanation_text(explained))
    assert f"{'quota':<12}namespace ns: ResourceQuota gpus" in text
    assert "choice" not in text and "n0: room, held back by the quota (GPU" in text and " fits" not in text
    document = orjson.loads(render.dumps(render.explanation_json(explained)))
    assert (document["outcome"], document["choice"]) == ("quota", None)

    quotas = views.quota_views(cluster)
    assert [(q.namespace, q.name, q.resource, q.held, q.hard) for q in quotas] == [
        ("ns", "gpus", names.GPU_MILLI_TOTAL, 600, 1000)
    ]
    assert views.quota_views(cluster, "other") == []
    text = render.plain(render.budgets_tables([], quotas))
    assert "No GPU-time budgets" in text and "600 / 1000" in text and render.bar(600, 1000) in text


async def test_explain_checks_a_group_holder_against_its_groups_namespace_quota(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=1, gpus=2)
    await h.schedule(await h.create(gpu_pod("a", milli=600, namespace="team")))
    h.server.put_object(
        "/api/v1/namespaces/team/resourcequotas",
        {"metadata": {"name": "gpus"}, "spec": {"hard": {f"requests.{names.GPU_MILLI_TOTAL}": "1000"}}},
    )
    await settle(h.server)
    holder = gpu_pod("holder", milli=500, namespace=names.HOLDING_NAMESPACE)
    holder["metadata"]["labels"] = {
        names.LABEL_ROLE: names.ROLE_GROUP_HOLDER,
        names.LABEL_GROUP_NAMESPACE: "team",
    }
    pod = await h.create(holder)
    found, selector = await read.pod(h.api, names.HOLDING_NAMESPACE, "holder")
    explained = views.explain(await snapshot(h), found, selector)

    verdict = h.extender.scheduling.filter(h.args(pod))
    assert not verdict.node_names and set(verdict.failed_nodes.values()) == {explained.problem}
    assert explained.outcome == "quota" and explained.problem.startswith("namespace team: ResourceQuota gpus")


def budget(name: str, namespace: str, used: int, state: str = "Within", hours: int = 20) -> Json:
    return {
        "apiVersion": resources.GPU_BUDGET.api_version,
        "kind": "GPUBudget",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"gpuHours": hours, "whenExhausted": "Deny"},
        "status": {
            "state": state, "usedGPUSeconds": used, "limitGPUSeconds": hours * 3600,
            "periodStart": "2026-11-01T00:00:00Z", "periodEnd": "2026-12-01T00:00:00Z",
            "topConsumers": [{"pod": f"{namespace}/train", "gpuSeconds": used}],
        },
    }  # fmt: skip


async def test_budgets_show_each_budget_with_its_usage_and_the_namespaces_it_governs(
    placed: Callable[..., Any],
) -> None:
    h: Harness = await placed(nodes=1, gpus=1)
    for space, marks in (("team-a", {}), ("r1", {"org": "research"}), ("r2", {"org": "research"})):
        h.server.put_object(paths.NAMESPACES, {"metadata": {"name": space, "labels": marks}})
    h.server.put_object(resources.GPU_BUDGET.path("team-a"), budget("team-a", "team-a", 54000, "Warning"))
    h.server.put_object(
        resources.CLUSTER_GPU_BUDGET.path(),
        {
            "apiVersion": resources.CLUSTER_GPU_BUDGET.api_version,
            "kind": "ClusterGPUBudget",
            "metadata": {"name": "research"},
            "spec": {"gpuHours": 200, "namespaceSelector": {"matchLabels": {"org": "research"}}},
        },
    )
    items, labels = await read.budgets(h.api, None)
    shown = views.budget_views(items, labels)
    assert [(b.kind, b.namespace, b.name, b.covers, b.state) for b in shown] == [
        ("GPUBudget", "team-a", "team-a", ("team-a",), "Warning"),
        ("ClusterGPUBudget", "", "research", ("r1", "r2"), "Within"),
    ]
    assert (shown[0].used_seconds, shown[0].limit_seconds) == (54000, 72000)
    assert shown[1].limit_seconds == 200 * 3600, "the spec's limit until the controller writes one"
    text = render.plain(render.budgets_tables(shown, [], wide=True))
    assert "15.00 / 20.00" in text and "███████████████░░░░░  75%" in text and "2026-12-01" in text
    assert "research (cluster)" in text and "r1, r2" in text and "team-a/train 15.00" in text
    assert "No ResourceQuota limits" in text
    only, _ = await read.budgets(h.api, "r1")
    assert [b.metadata.name for b in only] == ["research"]
    document = orjson.loads(render.dumps(render.budgets_json(shown, [])))
    assert document["budgets"][0]["usedPercent"] == 75 and document["budgets"][1]["namespace"] is None


async def test_groups_show_phase_node_devices_and_members(placed: Callable[..., Any]) -> None:
    h: Harness = await placed(nodes=1, gpus=1)
    path = resources.SHARED_DEVICE_GROUP.path
    h.server.put_object(path("ml"), {
        "apiVersion": resources.SHARED_DEVICE_GROUP.api_version, "kind": "SharedDeviceGroup",
        "metadata": {"name": "trainers", "namespace": "ml"},
        "spec": {"gpus": 2, "share": {"milli": 500}},
        "status": {"phase": "Bound", "nodeName": "n0", "devices": [{"index": 0, "uuid": "GPU-a"},
                   {"index": 1, "uuid": "GPU-b"}], "memberPods": ["ml/m1", "ml/m0"]},
    })  # fmt: skip
    h.server.put_object(path("ml"), {
        "apiVersion": resources.SHARED_DEVICE_GROUP.api_version, "kind": "SharedDeviceGroup",
        "metadata": {"name": "waiting", "namespace": "ml"}, "spec": {"gpus": 8},
        "status": {"conditions": [{"type": "Bound", "status": "False", "reason": "NoRoom",
                                   "message": "no node has 8 free GPUs"}]},
    })  # fmt: skip
    shown = views.group_views(await read.groups(h.api, None))
    assert [(g.name, g.phase, g.node, g.devices, g.members) for g in shown] == [
        ("trainers", "Bound", "n0", ((0, "GPU-a"), (1, "GPU-b")), ("ml/m0", "ml/m1")),
        ("waiting", "Pending", "", (), ()),
    ]
    assert shown[0].share == "500 milli-GPU, 50% memory" and shown[1].message == "no node has 8 free GPUs"
    table = render.plain(render.groups_table(shown))
    assert "trainers" in table and "Bound" in table and "0, 1" in table
    wide = render.plain(render.groups_table(shown, wide=True))
    assert "0 GPU-a, 1 GPU-b" in wide and "ml/m0" in wide and "no node has 8 free GPUs" in wide
    assert render.plain(render.groups_table([])).strip() == "No SharedDeviceGroups."
    assert await read.groups(h.api, "elsewhere") == []
    assert orjson.loads(render.dumps(render.groups_json(shown)))["groups"][1]["node"] is None


def test_usage_bars() -> None:
    assert render.bar(0, 10) == "░" * 20 + "   0%"
    assert render.bar(5, 10) == "█" * 10 + "░" * 10 + "  50%"
    assert render.bar(15, 10) == "█" * 20 + " 150%"
    assert render.bar(1, 0) == "░" * 20 + "   0%"
    assert render.bar(1, 3, width=3) == "█░░  33%"


def test_a_request_in_words() -> None:
    describe = views.describe
    assert describe(requests.simple_pod("a", count=2)) == "2 whole GPUs"
    shared = requests.simple_pod(
        "b", count=1, milli=250, memory_mib=4096, models=frozenset({"T4", "A100"}), cpu_milli=500,
        host_memory_mib=1024, cotenancy=requests.CoTenancy(affinity="team", exclusion="x"),
    )  # fmt: skip
    assert describe(shared) == (
        "1 GPU x 250 milli-GPU; 4096 MiB GPU memory each; model A100/T4; affinity 'team'; exclusion 'x'; "
        "host cpu 500m, memory 1024 MiB"
    )
    assert describe(requests.simple_pod("c", count=3, milli=100, memory_permille=125)) == (
        "3 GPUs x 100 milli-GPU; 12.5% of each GPU's memory"
    )
    assert describe(requests.simple_pod("d")) == "no GPU"


def test_a_request_in_words_names_its_isolation_and_compute_guarantee() -> None:
    gpu = (requests.ContainerRequest("main", requests.GpuRequest(count=1, milli=300, memory_mib=2048)),)
    key = units.PodKey("ns/p")
    assert views.describe(requests.PodRequest(key, gpu, isolation=devices.Isolation.MPS, compute=True)) == (
        "1 GPU x 300 milli-GPU; 2048 MiB GPU memory each; isolation mps enforcing compute"
    )
    assert views.describe(requests.PodRequest(key, gpu, isolation=devices.Isolation.HAMI_CORE)) == (
        "1 GPU x 300 milli-GPU; 2048 MiB GPU memory each; isolation hami-core"
    )
