"""The API server shows two pods on one GPU that do not fit it together: the ledger counts both and
blocks the GPU, every view says so, both pods get a Warning event, and the repair policy evicts the
newest tenant that has not started and has an owner (or waits when none qualifies)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sharegpu.api import names, paths
from sharegpu.core import units
from sharegpu.extender import metrics as extender_metrics
from tests.builders import MakeAllocation
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
