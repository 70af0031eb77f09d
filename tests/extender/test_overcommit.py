"""The API server shows two pods on one GPU that do not fit it together: the ledger counts both and
blocks the GPU, every view says so, both pods get a Warning event, and the repair policy evicts the
newest tenant that has not started and has an owner (or waits when none qualifies)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sharegpu.api import dra, names, paths
from sharegpu.core import units
from sharegpu.extender import metrics as extender_metrics
from tests.builders import MakeAllocation, MakeClaim
from tests.extender.conftest import Harness, gpu_pod, settle

Json = dict[str, Any]
OWNER = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "rs-uid", "controller": True}


async def bound(h: Harness, name: str, milli: int, *, phase: str, owned: bool) -> None:
    """A pod the API server shows bound to n0/gpu0 with sharegpu's allocation (written past the extender)."""
    body = gpu_pod(name, milli=milli)
    if owned:
        body["metadata"]["ownerReferences"] = [OWNER]
    alloc = MakeAllocation(f"ns/{name}", "n0").grant(0, milli).host(100, 64)
    body["metadata"]["annotations"][names.ALLOCATION] = alloc.json()
    body["spec"]["nodeName"] = "n0"
    body["status"] = {"phase": phase}
    h.server.put_object(paths.pods("ns"), body)
    await settle(h.server)


def events(h: Harness, reason: str) -> list[str]:
    return sorted(
        e["involvedObject"]["name"] for e in h.server.list_objects(paths.events("ns")) if e["reason"] == reason
    )


async def test_an_overcommitted_gpu_is_counted_blocked_reported_and_repaired(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await bound(h, "running", 700, phase="Running", owned=True)
    await bound(h, "orphan", 200, phase="Pending", owned=False)
    await bound(h, "late", 500, phase="Pending", owned=True)
    cache = h.extender.cache
    (gpu,) = cache.ledger.overcommitted()
    assert gpu.where == "n0/gpu0" and gpu.milli_used == 1400 and set(gpu.pods) == {"ns/running", "ns/orphan", "ns/late"}
    assert all(units.PodKey(f"ns/{n}") in cache.ledger for n in ("running", "orphan", "late")), "never left out"
    small = await h.create(gpu_pod("small", milli=10))
    verdict = h.extender.scheduling.filter(h.args(small))
    assert verdict.node_names == []
    assert "over-commit" in verdict.failed_nodes["n0"]
    (node,) = cache.summary()
    gpus = node["gpus"]
    assert isinstance(gpus, list) and gpus[0]["overcommitted"] and gpus[0]["milli"]["used"] == 1400
    view = extender_metrics.view(cache, None)
    assert view.overcommitted == (("n0", 0, 3),)

    await h.extender.overcommit.reconcile()
    assert events(h, "GPUOvercommitted") == ["late", "orphan", "running"], "a Warning on every tenant"
    late = h.server.get_object(paths.pod("ns", "late"))
    assert late is not None and late["metadata"].get("deletionTimestamp"), "the newest owned pod not started is evicted"
    assert events(h, "GPUOvercommitEvicted") == ["late"]
    orphan = h.server.get_object(paths.pod("ns", "orphan"))
    assert orphan is not None and not orphan["metadata"].get("deletionTimestamp"), "a pod without owner is kept"
    await h.extender.overcommit.reconcile()
    assert events(h, "GPUOvercommitted") == ["late", "orphan", "running"], "said once"

    h.server.finish_deletions()  # the kubelet stops the evicted pod
    await settle(h.server)
    assert cache.ledger.overcommitted() == []
    assert int(cache.state.milli_free[0, 0]) == 100 and not cache.state.blocked.any()
    assert h.extender.scheduling.filter(h.args(small)).node_names == ["n0"], "open again once the tenants fit"


async def test_with_no_tenant_that_may_go_the_repair_waits(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await bound(h, "a", 600, phase="Running", owned=True)
    await bound(h, "b", 600, phase="Running", owned=True)
    await bound(h, "c", 100, phase="Pending", owned=False)
    await h.extender.overcommit.reconcile()
    assert not any(
        (h.server.get_object(paths.pod("ns", n)) or {})["metadata"].get("deletionTimestamp") for n in "abc"
    ), "running pods and pods without an owner are never evicted"
    assert events(h, "GPUOvercommitted") == ["a", "b", "c"]
    waited = h.extender.metrics.repairs.labels("waiting")._value.get()
    assert waited >= 1
    await h.extender.overcommit.reconcile()
    assert h.extender.metrics.repairs.labels("waiting")._value.get() == waited, "said once per set of tenants"
    h.server.remove_object(paths.pod("ns", "b"))  # one leaves by itself
    await settle(h.server)
    assert h.extender.cache.ledger.overcommitted() == []


async def test_a_refused_eviction_is_tried_again_later(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await bound(h, "a", 600, phase="Running", owned=True)
    h.server.fail(429, method="POST", path=paths.eviction("ns", "b"))  # a disruption budget says no
    await bound(h, "b", 600, phase="Pending", owned=True)
    repair = h.extender.overcommit

    def evicted() -> bool:
        return bool((h.server.get_object(paths.pod("ns", "b")) or {})["metadata"].get("deletionTimestamp"))

    async def until(done: Callable[[], bool]) -> None:
        for _ in range(200):
            if done():
                return
            repair.wake()
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    await until(lambda: not h.server.faults)  # the eviction was tried, and refused
    passes = repair.loop.completed
    await until(lambda: repair.loop.completed >= passes + 3)
    assert not evicted(), "not tried again at once"
    h.clock.advance(repair.retry)
    await until(evicted)


def allocated_claim(name: str, milli: int, *, reserved_by: str | None = None) -> Json:
    """A claim of sharegpu's class the API server shows allocated on d0/gpu0 (written past the allocator)."""
    body = MakeClaim(name, "ns").ask(milli, "1Gi").obj()
    placed = MakeAllocation(f"ns/{name}#claim", "d0").grant(0, milli, 1024, container="gpu").obj()
    body["status"] = {"allocation": dra.claim_allocation(placed, [f"share-{name}"], "2026-01-01T00:00:00Z")}
    if reserved_by:
        body["status"]["reservedFor"] = [{"resource": "pods", "name": reserved_by, "uid": f"uid-{reserved_by}"}]
    return body


async def test_a_claim_no_pod_uses_yet_is_cleared_to_repair_and_one_in_use_never(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=0, gpus=1, dra=1)
    h.server.put_object(dra.claim_path("ns"), allocated_claim("used", 700, reserved_by="p"))
    h.server.put_object(dra.claim_path("ns"), allocated_claim("early", 200))
    h.server.put_object(dra.claim_path("ns"), allocated_claim("late", 300))
    cache = h.extender.cache

    def cleared() -> bool:
        late = h.server.get_object(dra.claim_path("ns", "late"))
        return late is not None and "allocation" not in late.get("status", {})

    await settle(h.server)  # the ledger sees 1200 of 1000 on d0/gpu0, and the reconciler, woken, repairs
    for _ in range(200):
        if cleared():
            break
        h.extender.overcommit.wake()
        await asyncio.sleep(0.01)
    assert cleared(), "the newest claim no pod uses is cleared"
    for name in ("used", "early"):
        kept = h.server.get_object(dra.claim_path("ns", name))
        assert kept is not None and kept["status"].get("allocation"), f"{name} kept"
    assert h.extender.metrics.repairs.labels("cleared")._value.get() == 1
    await settle(h.server)
    assert cache.ledger.overcommitted() == [], "900 of 1000 once it is cleared"

    # In use: never cleared, whatever the over-commit; the repair waits for one to leave.
    h.server.put_object(dra.claim_path("ns"), allocated_claim("other", 500, reserved_by="q"))
    await settle(h.server)
    assert cache.ledger.overcommitted()
    h.server.remove_object(dra.claim_path("ns", "early"))
    await settle(h.server)
    await h.extender.overcommit.reconcile()
    for name in ("used", "other"):
        kept = h.server.get_object(dra.claim_path("ns", name))
        assert kept is not None and kept["status"].get("allocation"), f"{name} in use, kept"


def _deleting(h: Harness, name: str) -> bool:
    found = h.server.get_object(paths.pod("ns", name))
    return found is None or bool(found["metadata"].get("deletionTimestamp"))


async def test_the_tenant_whose_binding_broke_the_fit_goes_not_the_older_one(harness: Callable[..., Any]) -> None:
    """`late` was created first but its binding landed last (held up, its answer lost); `legit`, bound
    in between, fitted. The repair ends `late`, though `legit` was created after it."""
    h: Harness = await harness(nodes=1, gpus=1)
    late = gpu_pod("late", milli=600)
    late["metadata"]["ownerReferences"] = [OWNER]
    late["status"] = {"phase": "Pending"}
    h.server.put_object(paths.pods("ns"), late)
    await settle(h.server)
    h.clock.advance(5)
    await bound(h, "legit", 600, phase="Pending", owned=True)
    h.clock.advance(5)
    stored = h.server.get_object(paths.pod("ns", "late"))
    assert stored is not None
    alloc = MakeAllocation("ns/late", "n0").grant(0, 600).host(100, 64).json()
    binding = {"apiVersion": "v1", "kind": "Binding", "target": {"kind": "Node", "name": "n0"},
               "metadata": {"name": "late", "namespace": "ns", "uid": stored["metadata"]["uid"],
                            "annotations": {names.ALLOCATION: alloc}}}  # fmt: skip
    await h.api.create(paths.binding("ns", "late"), binding)
    await settle(h.server)
    (gpu,) = h.extender.cache.ledger.overcommitted()
    assert gpu.pods[-1] == "ns/late"
    await h.extender.overcommit.reconcile()
    await settle(h.server)
    assert _deleting(h, "late") and not _deleting(h, "legit")


async def test_an_assumption_or_a_lone_tenant_is_no_overcommit_to_repair(harness: Callable[..., Any]) -> None:
    """A pod assumed on a GPU whose binding is lost, beside a pod bound there by something else that
    fits alone: nothing is evicted while the assumption settles. A lone whole-GPU tenant whose GPU's
    reported memory shrank by 1 MiB: reported, never evicted."""
    h: Harness = await harness(nodes=1, gpus=2)
    a = await h.create(gpu_pod("a", milli=600))
    assert h.extender.scheduling.filter(h.args(a)).node_names == ["n0"]
    assert h.extender.cache.counts_assumed(units.PodKey("ns/a"))
    gpu_index = h.extender.cache.assumed[units.PodKey("ns/a")].gpu_indices[0]
    q = gpu_pod("q", milli=600)
    q["metadata"]["ownerReferences"] = [OWNER]
    q["metadata"]["annotations"][names.ALLOCATION] = MakeAllocation("ns/q", "n0").grant(gpu_index, 600).json()
    q["spec"]["nodeName"] = "n0"
    q["status"] = {"phase": "Pending"}
    h.server.put_object(paths.pods("ns"), q)
    await settle(h.server)
    assert h.extender.cache.ledger.overcommitted(), "the ledger counts the assumption"
    await h.extender.overcommit.reconcile()
    await settle(h.server)
    assert not _deleting(h, "q"), "the API shows q alone on its GPU"
    h.extender.cache.forget(units.PodKey("ns/a"))
    whole = gpu_pod("w", milli=None, count=1)
    whole["metadata"]["ownerReferences"] = [OWNER]
    await h.schedule(await h.create(whole))
    await h.api.patch(paths.pod_status("ns", "w"), {"status": {"phase": "Pending"}})  # pulling its image
    device = h.server.get_object(paths.device("n0"))
    assert device is not None
    for gpu in device["spec"]["gpus"]:
        gpu["memoryMiB"] -= 1  # a driver upgrade, ECC turned on
    await h.api.replace(paths.device("n0"), device)
    await settle(h.server)
    assert any(o.pods == ("ns/w",) for o in h.extender.cache.ledger.overcommitted())
    await h.extender.overcommit.reconcile()
    await settle(h.server)
    assert not _deleting(h, "w"), "a lone tenant shares with no one"


async def test_a_tenant_that_started_since_the_extender_last_saw_it_is_not_evicted(
    harness: Callable[..., Any],
) -> None:
    h: Harness = await harness(nodes=1, gpus=1)
    await bound(h, "a", 600, phase="Running", owned=True)

    # The test runs the repair's passes itself: its loop, running on its own, could evict b (rightly,
    # while b is still Pending) before b starts below.
    async def resting() -> None:
        pass

    h.extender.overcommit.loop.reconcile = resting
    await bound(h, "b", 600, phase="Pending", owned=True)
    h.server.stall_watches()  # the extender's watch lags...
    await h.api.patch(paths.pod_status("ns", "b"), {"status": {"phase": "Running"}})  # ...b has started
    h.clock.advance(h.extender.overcommit.retry)
    await h.extender.overcommit.reconcile()
    await settle(h.server)
    assert not _deleting(h, "b"), "a running workload is never killed: its eviction must be refused (409)"
