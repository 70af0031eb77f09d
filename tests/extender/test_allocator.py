"""The DRA allocator over the fake API server: claims of sharegpu's class placed by the policy on the
nodes that serve DRA claims, written with the finalizer and the timestamp, the gate lifted; never
beyond a GPU's capacity, whatever the write answers (409, lost answers); kube-scheduler's takeover
and unused allocations handled; a claim it cannot allocate said so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sharegpu.api import dra, names, paths, pods, quantity, wire
from sharegpu.core import units
from sharegpu.extender import allocator as allocator_module
from sharegpu.kube import client, leader
from tests import builders
from tests.conftest import eventually
from tests.extender.conftest import Harness, gpu_pod, settle

Json = dict[str, Any]
CLAIMS = dra.claim_path("ns")


async def claimed(h: Harness, name: str, milli: int, memory: str = "1Gi", *, gated: bool = True, **pod: Any) -> None:
    """A claim `name` asking `milli` and `memory` of one GPU, and a pod `name` using it."""
    h.server.put_object(CLAIMS, builders.MakeClaim(name).ask(milli, memory).obj())
    made = builders.MakePod(name, "ns").container().claim(name)
    if gated:
        made.gate()
    for key, value in pod.items():
        made.spec(**{key: value})
    h.server.put_object(paths.pods("ns"), made.obj())
    await settle(h.server)


def claim(h: Harness, name: str) -> Json:
    found = h.server.get_object(f"{CLAIMS}/{name}")
    assert found is not None
    return found


def results(h: Harness, name: str) -> list[Json]:
    allocation = (claim(h, name).get("status") or {}).get("allocation") or {}
    found: list[Json] = allocation.get("devices", {}).get("results", [])
    return found


def gates(h: Harness, name: str) -> list[str]:
    pod = h.server.get_object(paths.pod("ns", name))
    assert pod is not None
    return [g["name"] for g in pod["spec"].get("schedulingGates") or []]


def used(h: Harness) -> dict[tuple[str, str], int]:
    """milli-GPU the API server shows allocated, per (node, device)."""
    out: dict[tuple[str, str], int] = {}
    for found in h.server.list_objects(CLAIMS):
        for r in ((found.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", []):
            where = (r["pool"], r["device"])
            out[where] = out.get(where, 0) + int(quantity.parse(r["consumedCapacity"][dra.MILLI]))
    return out


async def run(h: Harness) -> None:
    """A pass of the allocator, and the pass the watch's news of its writes wakes (gates are lifted
    once the watch shows the claims allocated)."""
    allocator = h.extender.allocator
    assert allocator is not None
    for _ in range(2):
        await allocator.reconcile()
        await settle(h.server)


async def test_a_gated_pod_s_claim_is_allocated_on_a_dra_node_and_its_gate_lifted(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, dra=1)
    await claimed(h, "a", 300, "4Gi")
    await run(h)
    (result,) = results(h, "a")
    assert (result["driver"], result["pool"], result["request"]) == (dra.DRIVER, "d0", "gpu"), "never the pod node n0"
    assert {k: quantity.parse(v) for k, v in result["consumedCapacity"].items()} == {
        "milli": 300,
        "memory": quantity.parse("4Gi"),
    }
    assert result["shareID"]
    written = claim(h, "a")
    assert dra.DELETE_PROTECTION in written["metadata"]["finalizers"]
    assert written["status"]["allocation"]["allocationTimestamp"]
    assert written["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["d0"]
    assert gates(h, "a") == []
    key = dra.claim_key("ns", "a")
    entry = h.extender.cache.ledger.get(key)
    assert entry is not None and entry.phase.value == "Added", "the watch confirmed it"
    assert not h.extender.cache.claims.assumed


async def test_claims_share_a_gpu_up_to_its_capacity_and_never_beyond(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    for name in ("a", "b", "c"):
        await claimed(h, name, 400)
    await run(h)
    assert used(h) == {("d0", "gpu-0"): 800}
    assert [bool(results(h, n)) for n in ("a", "b", "c")] == [True, True, False]
    assert gates(h, "c") == [names.DRA_GATE], "still gated: nothing allocated"
    events = [e for e in h.server.list_objects(paths.events("ns")) if e["reason"] == "ClaimNotAllocated"]
    assert len(events) == 1 and events[0]["involvedObject"]["name"] == "c"
    assert "no GPU with 400 milli-GPU free (largest free: 200)" in events[0]["message"], events[0]["message"]
    await run(h)
    assert len([e for e in h.server.list_objects(paths.events("ns")) if e["reason"] == "ClaimNotAllocated"]) == 1

    h.server.remove_object(f"{CLAIMS}/a")  # its pod went, and the resourceclaim controller with it
    await settle(h.server)
    await run(h)
    assert used(h) == {("d0", "gpu-0"): 800} and results(h, "c"), "the freed share went to c"


async def test_the_default_policy_packs_claims_as_it_packs_pods(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=2, dra=2)
    for name, milli in (("a", 600), ("b", 300), ("c", 600), ("d", 100)):
        await claimed(h, name, milli)
        await run(h)
    placed = {n: (results(h, n)[0]["pool"], results(h, n)[0]["device"]) for n in ("a", "b", "c", "d")}
    # The same sequence through the placement core: what the simulator would pick.
    assert all(v <= 1000 for v in used(h).values())
    shared = {(pool, device) for pool, device in placed.values()}
    assert len(shared) == 2, f"packed onto two GPUs, not spread: {placed}"


async def test_a_conflicting_write_is_forgotten_and_placed_again(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    h.server.fail(409, method="PATCH", path=f"{CLAIMS}/a/status")
    await claimed(h, "a", 500)
    await run(h)
    await run(h)
    writes = [r for r in h.server.requests if r == ("PATCH", f"{CLAIMS}/a/status")]
    assert len(writes) == 2 and not h.server.faults, "refused once, then written"
    assert used(h) == {("d0", "gpu-0"): 500} and gates(h, "a") == []
    assert int(h.extender.cache.state.milli_free[0, 0]) == 500, "the refused decision's hold was let go"


async def test_a_lost_answer_whose_write_landed_is_known_from_the_watch(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    allocator = h.extender.allocator
    assert allocator is not None
    h.server.lose(method="PATCH", path=f"{CLAIMS}/a/status", after_commit=True)
    await claimed(h, "a", 700)
    await run(h)
    key = dra.claim_key("ns", "a")
    assert results(h, "a") and key not in allocator.unsure, "the watch showed what the answer did not"
    assert gates(h, "a") == [], "known to be allocated: the gate is lifted"
    await claimed(h, "b", 700)
    await run(h)
    assert not results(h, "b"), "a's share counts"
    assert used(h) == {("d0", "gpu-0"): 700}


async def test_a_lost_request_is_forgotten_once_it_can_no_longer_land(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    allocator = h.extender.allocator
    assert allocator is not None
    h.server.lose(method="PATCH", path=f"{CLAIMS}/a/status", after_commit=False)
    await claimed(h, "a", 700)
    await run(h)
    key = dra.claim_key("ns", "a")
    assert key in allocator.unsure and not results(h, "a")
    h.clock.advance(10)
    await run(h)
    assert key in allocator.unsure, "unchanged and within the deadline: it could still land"
    assert key in h.extender.cache.claims.assumed
    h.clock.advance(61)
    await run(h)
    assert key not in allocator.unsure
    await run(h)
    assert results(h, "a") and used(h) == {("d0", "gpu-0"): 700}, "placed again, once"


async def test_an_event_from_before_the_write_does_not_free_the_hold(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    cache = h.extender.cache
    await claimed(h, "a", 600)
    record = cache.claims.records[dra.claim_key("ns", "a")]
    await run(h)
    assert results(h, "a")
    cache.on_claim(wire.EventType.MODIFIED, record)  # a stale event: the claim as it was before
    assert int(cache.state.milli_free[0, 0]) == 400, "still held"


async def test_a_claim_kube_scheduler_took_back_is_placed_again_elsewhere(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=2)
    await claimed(h, "a", 500)
    await run(h)
    first = results(h, "a")[0]["pool"]
    found = claim(h, "a")
    found["status"] = {}  # PostFilter: the pod fits no node with it there
    await h.api.replace(f"{CLAIMS}/a/status", found)
    await settle(h.server)
    await run(h)
    (again,) = results(h, "a")
    assert again["pool"] != first, "the node kube-scheduler turned it away from is avoided"
    assert int(h.extender.cache.state.milli_free.sum()) == 1500, "the old share freed, the new one held"


async def test_an_allocation_no_pod_uses_or_waits_for_is_cleared(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    await claimed(h, "a", 500)
    await run(h)
    h.server.remove_object(paths.pod("ns", "a"))  # a claim by name outlives its pod
    await settle(h.server)
    await run(h)
    assert results(h, "a"), "not at once"
    h.clock.advance(31)
    await run(h)
    assert not results(h, "a") and int(h.extender.cache.state.milli_free[0, 0]) == 1000


async def test_a_replica_leading_again_gives_an_unused_allocation_its_whole_grace(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen unused in an earlier term: another leader may have used and freed it meanwhile, so the
    grace starts again with the new term rather than clearing it the moment the fence ends."""
    monkeypatch.setattr(leader.Solo, "is_leader", property(lambda self: self.leading.is_set()))
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    allocator = h.extender.allocator
    assert allocator is not None
    await claimed(h, "a", 500)
    await run(h)
    h.server.remove_object(paths.pod("ns", "a"))
    await settle(h.server)
    await run(h)  # unused from now
    elector = h.extender.elector
    elector.leading.clear()  # the Lease lost
    await eventually(lambda: allocator.term_started is None, "the term ended")
    h.clock.advance(100)
    passes = allocator.loop.completed
    elector.leading.set()  # leading again
    await eventually(lambda: allocator.loop.completed > passes, "a pass of the new term")
    await run(h)
    assert results(h, "a"), "not at once"
    h.clock.advance(31)
    await run(h)
    assert not results(h, "a")


async def test_a_claim_sharegpu_cannot_allocate_keeps_its_pod_gated_and_says_why(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, dra=1)
    unknown = {"cel": {"expression": '"gpu".find("g") == "g"'}}  # Kubernetes' regex library: not loaded here
    body = builders.MakeClaim("sel").ask(300, "1Gi", selectors=[unknown]).obj()
    h.server.put_object(CLAIMS, body)
    h.server.put_object(paths.pods("ns"), builders.MakePod("sel", "ns").container().claim("sel").gate().obj())
    await settle(h.server)
    await run(h)
    assert not results(h, "sel") and gates(h, "sel") == [names.DRA_GATE]
    (event,) = [e for e in h.server.list_objects(paths.events("ns")) if e["reason"] == "ClaimNotAllocated"]
    assert "claim request 'gpu': selector #0 does not compile here" in event["message"]
    assert "undeclared reference to 'find'" in event["message"]


def selected(expression: str) -> list[Json]:
    return [{"cel": {"expression": expression}}]


GPU = f'device.attributes["{dra.DRIVER}"]'


async def test_a_claims_selectors_pick_the_gpus_it_may_get(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=2, dra=2)
    picks = selected(f'{GPU}.index == 1 && device.capacity["{dra.DRIVER}"].memory.compareTo(quantity("16Gi")) == 0')
    h.server.put_object(CLAIMS, builders.MakeClaim("one").ask(300, "1Gi", selectors=picks).obj())
    on_d1 = selected(f'{GPU}.uuid.startsWith("GPU-d1-") && {GPU}.productName == "T4"')
    h.server.put_object(CLAIMS, builders.MakeClaim("d1").ask(300, "1Gi", selectors=on_d1).obj())
    for name in ("one", "d1"):
        h.server.put_object(paths.pods("ns"), builders.MakePod(name, "ns").container().claim(name).gate().obj())
    await settle(h.server)
    await run(h)
    assert [r["device"] for r in results(h, "one")] == ["gpu-1"]
    assert {r["pool"] for r in results(h, "d1")} == {"d1"}


async def test_a_claim_no_gpu_passes_or_whose_selector_fails_says_so(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=2, dra=1)
    none = selected(f'{GPU}.productName == "NVIDIA H100 80GB HBM3"')
    failing = selected(f'{GPU}.architecture == "Turing"')  # this node's agent did not say: no such attribute
    for name, picks in (("none", none), ("failing", failing)):
        h.server.put_object(CLAIMS, builders.MakeClaim(name).ask(300, "1Gi", selectors=picks).obj())
        h.server.put_object(paths.pods("ns"), builders.MakePod(name, "ns").container().claim(name).gate().obj())
    await settle(h.server)
    await run(h)
    assert not results(h, "none") and not results(h, "failing")
    said = {e["involvedObject"]["name"]: e["message"] for e in h.server.list_objects(paths.events("ns"))
            if e["reason"] == "ClaimNotAllocated"}  # fmt: skip
    assert "0/1 nodes are available: 1 sharegpu: no GPU the device selectors pick" in said["none"]
    assert (
        "a device selector failed on d0/gpu-0:" in said["failing"]
        and 'not found in map : "architecture"' in (said["failing"])
    )


async def test_selectors_an_administrator_adds_to_sharegpus_class_narrow_every_claim(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=0, gpus=2, dra=1)
    narrowed = dra.device_class(expression=dra.CLASS_SELECTOR)
    narrowed["spec"]["selectors"].append({"cel": {"expression": f"{GPU}.index == 0"}})
    h.server.put_object(dra.DEVICE_CLASSES, narrowed)
    await settle(h.server)
    await claimed(h, "a", 600)
    await claimed(h, "b", 600)
    await run(h)
    assert [r["device"] for r in results(h, "a")] == ["gpu-0"], "the class's own selector is not applied"
    assert not results(h, "b"), "gpu-1 is outside the class"
    narrowed["spec"]["selectors"][1] = {"cel": {"expression": '"x".find("x") == "x"'}}
    h.server.remove_object(f"{dra.DEVICE_CLASSES}/{dra.CLASS}")
    h.server.put_object(dra.DEVICE_CLASSES, narrowed)
    await settle(h.server)
    await run(h)
    said = [e["message"] for e in h.server.list_objects(paths.events("ns")) if e["reason"] == "ClaimNotAllocated"]
    assert any(f"DeviceClass {dra.CLASS}: selector #0 does not compile here" in m for m in said)


async def test_a_container_that_would_get_several_of_sharegpus_devices_keeps_its_pod_gated(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=0, gpus=2, dra=1)
    two = builders.MakeClaim("two").ask(300, "1Gi", request="a").ask(300, "1Gi", request="b").obj()
    for claim in (two, builders.MakeClaim("x").ask(300, "1Gi").obj(), builders.MakeClaim("y").ask(300, "1Gi").obj()):
        h.server.put_object(CLAIMS, claim)
    # One container using two claims; one using a claim of two requests; each refused with why.
    both = builders.MakePod("both", "ns").container().claim("x", "gx").claim("y", "gy").gate()
    h.server.put_object(paths.pods("ns"), both.obj())
    h.server.put_object(paths.pods("ns"), builders.MakePod("pair", "ns").container().claim("two").gate().obj())
    await settle(h.server)
    await run(h)
    said = {e["involvedObject"]["name"]: e["message"] for e in h.server.list_objects(paths.events("ns"))
            if e["reason"] == "ClaimNotAllocated"}  # fmt: skip
    assert said["both"].endswith(
        "container main would get 2 requests of sharegpu's class (x/gpu, y/gpu), but a container takes one: "
        "ask for several GPUs in one request (count), or give each request its own container"
    ), said["both"]
    assert "container main would get 2 requests of sharegpu's class (two/a, two/b)" in said["pair"]
    assert not results(h, "x") and not results(h, "two") and gates(h, "both") == [names.DRA_GATE]
    # Each request its own container (the container names one request): placed.
    split = builders.MakePod("split", "ns").container("a").container("b").claim("two", "g")
    body = split.gate().obj()
    for container, request in zip(body["spec"]["containers"], ("a", "b"), strict=True):
        container["resources"] = {"claims": [{"name": "g", "request": request}]}
    h.server.remove_object(paths.pod("ns", "pair"))
    h.server.put_object(paths.pods("ns"), body)
    await settle(h.server)
    await run(h)
    assert len(results(h, "two")) == 2 and gates(h, "split") == []
    # One request of two GPUs is one device: placed.
    h.server.put_object(CLAIMS, builders.MakeClaim("wide").ask(300, "1Gi", count=2).obj())
    h.server.put_object(paths.pods("ns"), builders.MakePod("wide", "ns").container().claim("wide").gate().obj())
    await settle(h.server)
    await run(h)
    assert len(results(h, "wide")) == 2 and gates(h, "wide") == []


async def test_a_pod_s_node_selector_and_taints_choose_among_the_dra_nodes(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, dra=2)
    await claimed(h, "a", 300, nodeSelector={"kubernetes.io/hostname": "d1"})
    await run(h)
    assert results(h, "a")[0]["pool"] == "d1"
    await claimed(h, "b", 300, nodeSelector={"kubernetes.io/hostname": "nowhere"})
    await run(h)
    (event,) = [e for e in h.server.list_objects(paths.events("ns")) if e["reason"] == "ClaimNotAllocated"]
    assert "none of the 2 node(s) serving DRA claims admits the pod" in event["message"]


async def test_a_pod_is_never_placed_on_a_node_that_serves_dra_claims(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1, dra=1)
    made = await h.create(gpu_pod("p", milli=300))
    verdict = h.extender.scheduling.filter(h.args(made, ["n0", "d0"]))
    assert verdict.node_names == ["n0"]
    h.extender.cache.assumed.clear()
    big = await h.create(gpu_pod("big", milli=None, count=2))
    verdict = h.extender.scheduling.filter(h.args(big, ["n0", "d0"]))
    assert verdict.node_names == [] and "serves DRA claims only" in verdict.failed_nodes["d0"]


async def test_a_new_leader_writes_nothing_before_its_fence(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, dra=1, dra_fence=20.0)
    await claimed(h, "a", 300)
    await run(h)
    assert not results(h, "a")
    h.clock.advance(21)
    await run(h)
    assert results(h, "a")
    assert units.PodKey("ns/a") not in h.extender.cache.claiming or gates(h, "a") == []


async def test_a_new_leader_makes_missing_templates_during_its_fence(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, dra=1, dra_fence=20.0)
    shape = dra.Shape(1, 500, memory_mib=2048)
    body = builders.MakePod("p", "ns").container().gate().obj()
    body["spec"]["resourceClaims"] = [{"name": dra.POD_CLAIM, "resourceClaimTemplateName": shape.name}]
    h.server.put_object(paths.pods("ns"), body)
    await claimed(h, "a", 300)
    await run(h)
    assert h.server.get_object(dra.template_path("ns", shape.name)) is not None, "made at once"
    assert not results(h, "a"), "but nothing allocated before the fence ends"


async def test_pods_that_arrive_while_a_template_is_made_are_seen_next_pass(harness: Callable[..., Any]) -> None:
    """The template creations await the API server; pods the watch brings meanwhile must not break the
    pass (it read the waiting pods as they changed: "Set changed size during iteration"). A new leader
    makes templates during its fence."""
    h: Harness = await harness(nodes=0, dra=1, dra_fence=20.0)
    allocator = h.extender.allocator
    assert allocator is not None
    create = allocator.api.create
    shapes = [dra.Shape(1, milli, memory_mib=2048) for milli in (100, 200, 300, 400)]

    def waiting(name: str, shape: dra.Shape) -> Json:
        body = builders.MakePod(name, "ns").container().gate().obj()
        body["spec"]["resourceClaims"] = [{"name": dra.POD_CLAIM, "resourceClaimTemplateName": shape.name}]
        return body

    async def create_while_pods_arrive(path: str, body: Json) -> Any:
        made = await create(path, body)
        if path == dra.template_path("ns"):
            arrived = len(h.server.list_objects(paths.pods("ns")))
            if arrived < len(shapes):
                h.server.put_object(paths.pods("ns"), waiting(f"p{arrived}", shapes[arrived]))
                await settle(h.server)
        return made

    allocator.api.create = create_while_pods_arrive  # type: ignore[method-assign]
    h.server.put_object(paths.pods("ns"), waiting("p0", shapes[0]))
    await settle(h.server)
    for _ in range(len(shapes)):
        await allocator.reconcile()
        await settle(h.server)
    for shape in shapes:
        assert h.server.get_object(dra.template_path("ns", shape.name)) is not None, shape.name


async def test_the_template_the_webhook_named_is_made_where_missing(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, dra=1)
    shape = dra.Shape(1, 500, memory_permille=250)
    body = builders.MakePod("p", "ns").container().gate().obj()
    body["spec"]["resourceClaims"] = [{"name": dra.POD_CLAIM, "resourceClaimTemplateName": shape.name}]
    h.server.put_object(paths.pods("ns"), body)
    await settle(h.server)
    await run(h)
    made = h.server.get_object(dra.template_path("ns", shape.name))
    assert made is not None and made == {**made, **dra.template("ns", shape.name), "metadata": made["metadata"]}
    assert gates(h, "p") == [names.DRA_GATE], "no claim yet: still gated"
    # kube-controller-manager makes the pod's claim from it (played here) and names it in the status
    claim = builders.MakeClaim("p-sharegpu-gpu-x").obj()
    claim["spec"] = made["spec"]["spec"]
    h.server.put_object(CLAIMS, claim)
    status = {"resourceClaimStatuses": [{"name": dra.POD_CLAIM, "resourceClaimName": "p-sharegpu-gpu-x"}]}
    await h.api.patch(paths.pod("ns", "p") + "/status", {"status": status})
    await settle(h.server)
    await run(h)
    (result,) = results(h, "p-sharegpu-gpu-x")
    assert quantity.parse(result["consumedCapacity"]["memory"]) == quantity.parse("4096Mi"), "250 per mille of 16 GiB"
    assert gates(h, "p") == []


async def test_a_gated_pod_with_no_claim_of_the_class_is_let_go(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, dra=1)
    h.server.put_object(paths.pods("ns"), builders.MakePod("p", "ns").container().gate().obj())
    await settle(h.server)
    await run(h)
    assert gates(h, "p") == []


async def test_a_pod_s_claims_go_to_one_node_all_of_them_or_none(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=2)
    for name in ("x", "y", "z"):
        h.server.put_object(CLAIMS, builders.MakeClaim(name).ask(600, "1Gi").obj())
    both = builders.MakePod("both", "ns").container().container("other").claim("x", "first")
    h.server.put_object(paths.pods("ns"), both.claim("y", "second", container=1).gate().obj())
    await settle(h.server)
    await run(h)
    assert not results(h, "x") and not results(h, "y"), "two 600-milli shares fit no one-GPU node together"
    assert not h.extender.cache.claims.assumed and int(h.extender.cache.state.milli_free.sum()) == 2000
    (event,) = [e for e in h.server.list_objects(paths.events("ns")) if e["reason"] == "ClaimNotAllocated"]
    assert "no GPU with 600 milli-GPU free" in event["message"]
    h.server.put_object(paths.pods("ns"), builders.MakePod("pair", "ns").container().claim("z", "a").gate().obj())
    await settle(h.server)
    await run(h)
    assert results(h, "z") and gates(h, "pair") == []


async def test_claims_need_no_reservation_pod_but_a_pod_still_on_a_node_turned_dra_keeps_its_own(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=0, gpus=2, dra=1)
    for name in ("a", "b"):
        await claimed(h, name, 300)
    await run(h)
    assert {(r["pool"], r["device"]) for n in ("a", "b") for r in results(h, n)} == {("d0", "gpu-0")}
    # A sharing pod of the extender path, bound to d0/gpu1 before the node turned to DRA.
    body = gpu_pod("old", milli=200)
    alloc = builders.MakeAllocation("ns/old", "d0").grant(1, 200).host(100, 64)
    body["metadata"]["annotations"][names.ALLOCATION] = alloc.json()
    body["spec"]["nodeName"] = "d0"
    body["status"] = {"phase": "Running"}
    h.server.put_object(paths.pods("ns"), body)
    await settle(h.server)
    assert h.extender.cache.shared_slots() == {("d0", 1)}, "the claims' GPU needs none, the pod's GPU one"

    def made() -> list[tuple[str, str]]:
        found = [wire.convert(p, wire.Pod) for p in h.server.list_objects(paths.pods(names.HOLDING_NAMESPACE))]
        return [(p.spec.node_name, p.metadata.labels[names.LABEL_SLOT]) for p in found if pods.is_reservation(p)]

    for _ in range(100):
        h.extender.reservations.wake()
        await settle(h.server)
        if made():
            break
    assert made() == [("d0", "1")]


async def test_a_node_holding_as_many_pods_as_it_takes_gets_no_claim(harness: Callable[..., Any]) -> None:
    """kube-scheduler would turn the pod away from a node at its pod capacity and take the claim's
    allocation back; the allocator counts the pods bound there and those on their way."""
    h: Harness = await harness(nodes=0, gpus=1, dra=2)
    for name in ("d0", "d1"):
        allocatable = {"cpu": "32", "memory": "128Gi", "pods": "2"}
        await h.api.patch(f"{paths.node(name)}/status", {"status": {"allocatable": allocatable}})
    h.server.put_object(paths.pods("ns"), builders.MakePod("busy", "ns").container().node("d0").obj())
    await settle(h.server)
    for name in ("a", "b", "c"):
        await claimed(h, name, 100)
        await run(h)
    placed = [results(h, n)[0]["pool"] if results(h, n) else None for n in ("a", "b", "c")]
    # d0 has room for one more pod (busy is there), d1 for two: three claims, never a fourth pod on d0.
    assert sorted(p for p in placed if p) == ["d0", "d1", "d1"], placed
    await claimed(h, "d", 100)
    await run(h)
    assert not results(h, "d"), "both nodes hold as many pods as they take"
    said = [e for e in h.server.list_objects(paths.events("ns")) if e["involvedObject"]["name"] == "d"]
    assert said and "hold as many pods as they take (allocatable pods)" in said[-1]["message"], said


def used_up(when: str, name: str = "b") -> Json:
    """A GPUBudget of ns whose status the controller wrote Exhausted."""
    return {"apiVersion": "sharegpu.io/v1alpha1", "kind": "GPUBudget", "metadata": {"name": name, "namespace": "ns"},
            "spec": {"gpuHours": 1, "whenExhausted": when, "demotePriorityClass": "low"},
            "status": {"state": "Exhausted", "periodEnd": "2026-12-01T00:00:00Z"}}  # fmt: skip


async def test_a_pod_whose_claims_were_written_by_hand_is_held_to_its_namespaces_budgets(
    harness: Callable[..., Any],
) -> None:
    """The webhook never judged it (it asks for no GPU resource): the allocator judges it as the
    webhook would, at allocation: a used-up Deny budget keeps it gated; a used-up Demote budget takes
    it only at or below the demotion PriorityClass."""
    h: Harness = await harness(nodes=0, dra=1)
    h.server.put_object(paths.PRIORITY_CLASSES, {"metadata": {"name": "low"}, "value": 10})
    h.server.put_object("/apis/sharegpu.io/v1alpha1/namespaces/ns/gpubudgets", used_up("Deny"))
    await claimed(h, "denied", 300)
    await run(h)
    assert not results(h, "denied") and gates(h, "denied") == [names.DRA_GATE]

    def said() -> list[str]:
        return [e["message"] for e in h.server.list_objects(paths.events("ns")) if e["reason"] == "ClaimNotAllocated"]

    assert any("GPUBudget ns/b" in m and "refuses new GPU pods" in m for m in said()), said()
    h.server.remove_object("/apis/sharegpu.io/v1alpha1/namespaces/ns/gpubudgets/b")
    h.server.put_object("/apis/sharegpu.io/v1alpha1/namespaces/ns/gpubudgets", used_up("Demote"))
    await claimed(h, "above", 300, priority=100)
    await claimed(h, "at-floor", 300, priority=10)
    await run(h)
    assert not results(h, "above") and results(h, "at-floor"), "only a pod at the demotion class's value"
    assert any("runs at priority 100" in m and "PriorityClass low" in m for m in said()), said()
    h.server.remove_object("/apis/sharegpu.io/v1alpha1/namespaces/ns/gpubudgets/b")
    await settle(h.server)
    await run(h)
    assert results(h, "denied") and results(h, "above"), "the budget gone, nothing holds them back"


async def test_match_attribute_gives_a_claim_gpus_with_one_value_of_it(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=4, dra=1)  # PCIe switches: GPUs 0 and 1, 2 and 3
    h.server.put_object(CLAIMS, builders.MakeClaim("pin").ask(1000, selectors=selected(f"{GPU}.index == 1")).obj())
    h.server.put_object(paths.pods("ns"), builders.MakePod("pin", "ns").container().claim("pin").gate().obj())
    await settle(h.server)
    await run(h)
    assert [r["device"] for r in results(h, "pin")] == ["gpu-1"]
    switch = f"{dra.DRIVER}/pcieSwitch"
    for name, count in (("pair", 2), ("three", 3), ("unknown", 1)):
        made = builders.MakeClaim(name).ask(1000, count=count)
        made.constraint(matchAttribute=f"{dra.DRIVER}/colour" if name == "unknown" else switch)
        h.server.put_object(CLAIMS, made.obj())
        h.server.put_object(paths.pods("ns"), builders.MakePod(name, "ns").container().claim(name).gate().obj())
    await settle(h.server)
    await run(h)
    assert sorted(r["device"] for r in results(h, "pair")) == ["gpu-2", "gpu-3"], "gpu-0 and a free GPU differ"
    assert not results(h, "three") and not results(h, "unknown")
    said = {e["involvedObject"]["name"]: e["message"] for e in h.server.list_objects(paths.events("ns"))
            if e["reason"] == "ClaimNotAllocated"}  # fmt: skip
    assert f"with one value of {switch} (tried 2, the last: 0/1 nodes are available" in said["three"]
    assert (
        f"no GPU serving DRA claims has the attributes its matchAttribute names ({dra.DRIVER}/colour)"
        in (said["unknown"])
    )


async def test_the_claim_the_webhook_named_is_made_for_its_pod_and_allocated_without_a_finalizer_write(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=0, dra=1, dra_fence=0.0)
    name = dra.Shape(1, 500, memory_mib=2048).claim_name(bytes(range(10)))
    body = builders.MakePod("p", "ns").container().gate().obj()
    body["spec"]["resourceClaims"] = [{"name": dra.POD_CLAIM, "resourceClaimName": name}]
    h.server.put_object(paths.pods("ns"), body)
    await settle(h.server)
    writes: list[tuple[str, str]] = []
    allocator = h.extender.allocator
    assert allocator is not None
    patch = allocator.api.patch

    async def counted(path: str, patched: Any, content_type: str = client.MERGE_PATCH) -> Any:
        writes.append(("PATCH", path))
        return await patch(path, patched, content_type)

    allocator.api.patch = counted  # type: ignore[method-assign,assignment]
    await run(h)
    made = h.server.get_object(dra.claim_path("ns", name))
    pod = h.server.get_object(paths.pod("ns", "p"))
    assert made is not None and pod is not None
    (owner,) = made["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", "p", pod["metadata"]["uid"]), "it goes with its pod"
    assert made["metadata"]["finalizers"] == [dra.DELETE_PROTECTION]
    assert made["metadata"]["labels"] == {names.LABEL_ROLE: names.ROLE_POD_CLAIM}
    await settle(h.server)
    await run(h)
    assert [r["device"] for r in results(h, name)] == ["gpu-0"]
    await run(h)
    assert gates(h, "p") == []
    assert ("PATCH", dra.claim_path("ns", name)) not in writes, "born with its finalizer: none written"
    other = builders.MakePod("q", "ns").container().gate().obj()
    other["spec"]["resourceClaims"] = [{"name": dra.POD_CLAIM, "resourceClaimName": "sharegpu-not-a-shape"}]
    h.server.put_object(paths.pods("ns"), other)
    await settle(h.server)
    await run(h)
    assert h.server.get_object(dra.claim_path("ns", "sharegpu-not-a-shape")) is None, "only names of sharegpu's form"


async def gang_member(h: Harness, name: str, milli: int, size: int) -> None:
    h.server.put_object(CLAIMS, builders.MakeClaim(name).ask(milli, "1Gi").obj())
    made = builders.MakePod(name, "ns").annotations({names.GANG: "job", names.GANG_MIN: str(size)})
    h.server.put_object(paths.pods("ns"), made.container().claim(name).gate().obj())
    await settle(h.server)


async def test_a_gang_left_partial_by_failed_writes_gives_back_its_claims_at_its_timeout(
    harness: Callable[..., Any],
) -> None:
    """One member's claim writes refused: the members allocated already hold their GPUs (gated, none
    bound) only until the gang's timeout; then the gang is allocated whole when it can be."""
    h: Harness = await harness(nodes=0, dra=1, gpus=3)
    h.server.fail(403, method="PATCH", path=f"{CLAIMS}/g2/status", times=1000)
    for name in ("g0", "g1", "g2"):
        await gang_member(h, name, 700, 3)
    await run(h)
    assert results(h, "g0") and results(h, "g1") and not results(h, "g2"), "g2's write is refused"
    assert gates(h, "g0") == [names.DRA_GATE], "no member of a partial gang is let go to be bound"
    h.clock.advance(30)
    await run(h)
    assert results(h, "g0") and results(h, "g1"), "held until the gang's timeout (60 s)"
    h.clock.advance(31)
    await run(h)
    assert not results(h, "g0") and not results(h, "g1"), "then given back"
    said = [e["message"] for e in h.server.list_objects(paths.events("ns")) if e["involvedObject"]["name"] == "g0"]
    assert any("not placed whole within its timeout (60 s)" in m for m in said), said
    assert h.extender.allocator is not None and not h.extender.allocator.avoid, "its own clearing is no takeover"
    h.server.faults.clear()
    h.clock.advance(30)
    await run(h)
    assert not results(h, "g0"), "not planned again for its timeout: the room is others' meanwhile"
    h.clock.advance(31)
    await run(h)
    await run(h)
    assert all(results(h, n) for n in ("g0", "g1", "g2")) and all(gates(h, n) == [] for n in ("g0", "g1", "g2"))


async def test_a_gang_s_claims_are_allocated_all_of_them_or_none(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, dra=1, gpus=2)
    for name in ("g0", "g1"):
        await gang_member(h, name, 700, 3)
    await run(h)
    assert not results(h, "g0") and gates(h, "g0") == [names.DRA_GATE], "two of three: nothing allocated"
    await gang_member(h, "g2", 700, 3)  # three of 700 on two GPUs: the gang cannot fit
    await run(h)
    assert not any(results(h, n) for n in ("g0", "g1", "g2")) and not h.extender.cache.claims.assumed
    assert used(h) == {}, "no member holds a GPU while the gang cannot complete"
    await h.api.delete(paths.pod("ns", "g2"))  # the third asks less now: the gang fits
    await h.api.delete(f"{CLAIMS}/g2")
    await gang_member(h, "g2b", 200, 3)
    await run(h)
    await run(h)
    assert all(results(h, n) for n in ("g0", "g1", "g2b")), "now it fits: all allocated"
    assert all(gates(h, n) == [] for n in ("g0", "g1", "g2b")), "and the gates lifted"


async def test_a_pod_behind_another_gate_too_holds_nothing_until_that_gate_is_lifted(
    harness: Callable[..., Any],
) -> None:
    """Kueue's admission gate first: a DRA pod its queue has not admitted gets no GPU share."""
    h: Harness = await harness(nodes=0, dra=1, gpus=1)
    kueue = {"name": "kueue.x-k8s.io/admission"}
    await claimed(h, "queued", 500, schedulingGates=[kueue, {"name": names.DRA_GATE}])
    await run(h)
    assert not results(h, "queued") and used(h) == {}, "not admitted by its queue: nothing allocated"
    gates_left = {"spec": {"schedulingGates": [{"name": names.DRA_GATE}]}}  # Kueue admits it
    await h.api.patch(paths.pod("ns", "queued"), gates_left, client.STRATEGIC_PATCH)
    await settle(h.server)
    await run(h)
    await run(h)
    assert results(h, "queued") and gates(h, "queued") == [], "admitted: allocated, then its gate lifted"


async def test_a_gangs_claims_go_to_the_nodes_the_gang_already_uses(harness: Callable[..., Any]) -> None:
    """Under spread each pod alone takes a node of its own; a gang's members share one while it has
    room (its traffic stays inside a node)."""
    alone: Harness = await harness(nodes=0, dra=2, gpus=2, policy="spread")
    for name in ("s0", "s1"):
        await claimed(alone, name, 1000)
    await run(alone)
    assert {r["pool"] for n in ("s0", "s1") for r in results(alone, n)} == {"d0", "d1"}, "spread, alone"
    h: Harness = await harness(nodes=0, dra=2, gpus=2, policy="spread")
    for name in ("g0", "g1"):
        await gang_member(h, name, 1000, 2)
    await run(h)
    pools = {r["pool"] for n in ("g0", "g1") for r in results(h, n)}
    assert len(pools) == 1 and all(results(h, n) for n in ("g0", "g1")), f"one node for the gang: {pools}"


async def test_a_dra_gang_with_a_topology_stays_within_one_value_of_its_label(harness: Callable[..., Any]) -> None:
    """Rack r1 is one node of two GPUs, rack r2 two nodes of two: a gang of three whole GPUs with
    `gang-topology: rack` cannot be held by r1 (tried first, the tightest), so all three go to r2."""
    h: Harness = await harness(nodes=0, dra=3, gpus=2)
    for name, rack in (("d0", "r1"), ("d1", "r2"), ("d2", "r2")):
        await h.api.patch(paths.node(name), {"metadata": {"labels": {"rack": rack}}})
    await settle(h.server)
    for name in ("g0", "g1", "g2"):
        h.server.put_object(CLAIMS, builders.MakeClaim(name).ask(1000, "1Gi").obj())
        gang = {names.GANG: "job", names.GANG_MIN: "3", names.GANG_TOPOLOGY: "rack"}
        h.server.put_object(
            paths.pods("ns"), builders.MakePod(name, "ns").annotations(gang).container().claim(name).gate().obj()
        )
    await settle(h.server)
    await run(h)
    pools = sorted(r["pool"] for n in ("g0", "g1", "g2") for r in results(h, n))
    assert len(pools) == 3 and set(pools) <= {"d1", "d2"}, f"all in rack r2: {pools}"
    h.server.put_object(CLAIMS, builders.MakeClaim("x0").ask(1000, "1Gi").obj())
    other = {names.GANG: "other", names.GANG_MIN: "1", names.GANG_TOPOLOGY: "row"}
    h.server.put_object(
        paths.pods("ns"), builders.MakePod("x0", "ns").annotations(other).container().claim("x0").gate().obj()
    )
    await settle(h.server)
    await run(h)
    said = [e["message"] for e in h.server.list_objects(paths.events("ns"))]
    assert not results(h, "x0") and any("no node serving DRA claims has the label row" in m for m in said), said


async def test_a_dra_gangs_whole_gpus_share_an_nvlink_island(harness: Callable[..., Any]) -> None:
    """One node of eight GPUs in two NVLink islands (0-3, 4-7); three lone whole-GPU pods take three
    GPUs of the first. A gang of three whole-GPU members goes to the second island, not to the lone
    free GPU of the first and two of the second."""
    h: Harness = await harness(nodes=0, dra=1, gpus=8)
    links = [[a, b] for half in (range(4), range(4, 8)) for a in half for b in half if a < b]
    await h.api.patch(f"{paths.DEVICES}/d0", {"spec": {"nvlinks": links}})
    await settle(h.server)
    for name in ("l0", "l1", "l2"):
        await claimed(h, name, 1000)
    await run(h)
    lone = {r["device"] for n in ("l0", "l1", "l2") for r in results(h, n)}
    assert lone == {"gpu-0", "gpu-1", "gpu-2"}, lone
    for name in ("g0", "g1", "g2"):
        await gang_member(h, name, 1000, 3)
    await run(h)
    gang = sorted(r["device"] for n in ("g0", "g1", "g2") for r in results(h, n))
    assert len(gang) == 3 and all(d in {"gpu-4", "gpu-5", "gpu-6", "gpu-7"} for d in gang), gang


# ----------------------------------------------------------------- found by a review (stop 64)


async def two_claims(h: Harness, pod: str, milli: int) -> None:
    """A gated pod `pod` with two claims of `milli` each, one per container."""
    for name in (f"{pod}-a", f"{pod}-b"):
        h.server.put_object(CLAIMS, builders.MakeClaim(name).ask(milli, "1Gi").obj())
    made = builders.MakePod(pod, "ns").container("a").container("b")
    made.claim(f"{pod}-a", "ga", container=0).claim(f"{pod}-b", "gb", container=1).gate()
    h.server.put_object(paths.pods("ns"), made.obj())
    await settle(h.server)


async def test_a_pod_turned_away_takes_all_its_claims_to_another_node(harness: Callable[..., Any]) -> None:
    """kube-scheduler's PostFilter takes back one claim a cycle: the other, still on the node the pod
    was turned away from, goes too, and both are placed on another node (before: the first was put
    straight back beside the second, the pod pinned to that node for ever)."""
    h: Harness = await harness(nodes=0, gpus=1, dra=2)
    await two_claims(h, "p", 300)
    await run(h)
    (node,) = {results(h, "p-a")[0]["pool"], results(h, "p-b")[0]["pool"]}
    taken = claim(h, "p-a")
    taken["status"] = {}
    await h.api.replace(f"{CLAIMS}/p-a/status", taken)
    await settle(h.server)
    await run(h)
    await run(h)
    moved = {results(h, "p-a")[0]["pool"], results(h, "p-b")[0]["pool"]}
    assert len(moved) == 1 and node not in moved


async def test_a_fresh_pods_claims_go_where_all_of_them_fit_not_where_the_first_fits_best(
    harness: Callable[..., Any],
) -> None:
    """The first claim's best node (d0, the fuller) has no room for the second: both go to d1 (before:
    the pod waited for ever, its first claim placed on d0 again at every pass)."""
    h: Harness = await harness(nodes=0, gpus=1, dra=2)
    await claimed(h, "q", 600)
    await run(h)
    (full,) = {r["pool"] for r in results(h, "q")}
    await two_claims(h, "p", 300)
    await run(h)
    placed = {results(h, "p-a")[0]["pool"], results(h, "p-b")[0]["pool"]}
    assert len(placed) == 1 and full not in placed and gates(h, "p") == []


async def test_a_pod_whose_claims_were_written_in_part_is_placed_whole_elsewhere_in_time(
    harness: Callable[..., Any],
) -> None:
    """p's second claim's writes are refused for a while; meanwhile an older pod's claim takes the
    room beside p's first. After `STRANDED_AFTER` the first is let go and both go where both fit
    (before: p gated for ever, its first claim holding room on d0)."""
    h: Harness = await harness(nodes=0, gpus=1, dra=2)
    older = builders.MakePod("q", "ns").container().claim("q").gate().obj()
    older["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z"  # placed before p from now on
    h.server.put_object(paths.pods("ns"), older)
    await settle(h.server)
    h.server.fail(409, method="PATCH", path=f"{CLAIMS}/p-b/status", times=1000)
    await two_claims(h, "p", 400)
    await run(h)
    assert results(h, "p-a") and not results(h, "p-b")
    node = results(h, "p-a")[0]["pool"]
    h.server.put_object(CLAIMS, builders.MakeClaim("q").ask(600, "1Gi").obj())
    await settle(h.server)
    await run(h)
    assert results(h, "q")[0]["pool"] == node, "q packed beside p-a"
    h.server.faults.clear()
    for _ in range(5):
        await run(h)
        h.clock.advance(allocator_module.STRANDED_AFTER + 1)
    await run(h)
    placed = {results(h, "p-a")[0]["pool"], results(h, "p-b")[0]["pool"]}
    assert len(placed) == 1 and node not in placed and gates(h, "p") == []


async def test_a_claim_of_a_sharegpu_name_that_asks_for_more_than_its_name_is_not_allocated(
    harness: Callable[..., Any],
) -> None:
    """A tenant makes the claim its pod names (of sharegpu's form: 1 GPU of 500 milli) before sharegpu
    does, asking for 2 whole GPUs: its quota totals count 500 milli. sharegpu allocates nothing and
    says why."""
    h: Harness = await harness(nodes=0, dra=1, dra_fence=0.0)
    name = dra.Shape(1, 500, memory_mib=2048).claim_name(bytes(range(10)))
    h.server.put_object(CLAIMS, builders.MakeClaim(name).ask(1000, "1Gi", count=2).obj())
    body = builders.MakePod("p", "ns").container().gate().obj()
    body["spec"]["resourceClaims"] = [{"name": dra.POD_CLAIM, "resourceClaimName": name}]
    h.server.put_object(paths.pods("ns"), body)
    await settle(h.server)
    for _ in range(2):
        await run(h)
    assert results(h, name) == [] and gates(h, "p") == [names.DRA_GATE]
    said = [e["message"] for e in h.server.list_objects(paths.events("ns")) if e["involvedObject"]["name"] == "p"]
    assert any("asks for other than its name says (1 GPU(s) of 500 milli-GPU)" in m for m in said), said


def results_in(h: Harness, namespace: str, name: str) -> list[Json]:
    found = h.server.get_object(f"{dra.claim_path(namespace)}/{name}") or {}
    allocated: list[Json] = ((found.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
    return allocated


@pytest.mark.parametrize(
    "holding",
    ["none", "own gate", "missing claim"],
)
async def test_pods_that_are_never_bound_take_no_pod_slot_of_a_dra_node(
    harness: Callable[..., Any], holding: str
) -> None:
    """A tenant's pods naming one tiny claim of its own, each held forever (behind a gate of the
    tenant's, or naming a claim that never exists), counted as bound next filled a node's pod slots
    in the allocator's view: no other tenant's claim was placed there, 999 milli free."""
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    await h.api.patch(f"{paths.node('d0')}/status", {"status": {"allocatable": {"cpu": "32", "memory": "128Gi",
                                                                                "pods": "10"}}})  # fmt: skip
    h.server.put_object(dra.claim_path("evil"), builders.MakeClaim("tiny", "evil").ask(1, "1Mi").obj())
    h.server.put_object(paths.pods("evil"), builders.MakePod("p0", "evil").container().claim("tiny").gate().obj())
    await settle(h.server)
    await run(h)
    assert results_in(h, "evil", "tiny"), "the tenant's tiny claim is allocated on d0"
    for i in range(0 if holding == "none" else 10):
        pod = builders.MakePod(f"hold{i}", "evil").container().claim("tiny").gate()
        if holding == "own gate":
            pod.gate("tenant.example/never")
        else:
            pod.claim("never-made")
        h.server.put_object(paths.pods("evil"), pod.obj())
    h.server.put_object(dra.claim_path("victim"), builders.MakeClaim("v", "victim").ask(100, "1Gi").obj())
    h.server.put_object(paths.pods("victim"), builders.MakePod("v", "victim").container().claim("v").gate().obj())
    await settle(h.server)
    await run(h)
    assert results_in(h, "victim", "v"), [e["message"] for e in h.server.list_objects(paths.events("victim"))]
