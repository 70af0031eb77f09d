"""The cluster cache alone, fed records as the informers would: rebuilds, foreign whole-GPU pods,
unreadable allocations, assumptions that survive inventory changes and are forgotten exactly once."""

from __future__ import annotations

import msgspec

from sharegpu.api import devices as api_devices
from sharegpu.api import dra, names, pods, wire
from sharegpu.core import allocation, units
from sharegpu.extender import cache as extender_cache
from tests import builders


def node(name: str, gpus: int = 2, ready: bool = True) -> api_devices.NodeFacts:
    return api_devices.NodeFacts(name, ready, 32000, 131072)


def device(name: str, gpus: int = 2) -> extender_cache.DeviceRecord:
    return extender_cache.device_record(builders.MakeDevice(name).gpus(gpus).wire())


def pod(name: str, limits: dict[str, str], node_name: str = "", annotations: dict[str, str] | None = None,
        phase: str = "Running") -> pods.Record:  # fmt: skip
    made = builders.MakePod(name, "ns").uid(f"uid-{name}").annotations(annotations or {}).node(node_name)
    return pods.record(made.container(limits=limits).phase(phase).wire())


def share(key: str, node_name: str, index: int, milli: int) -> allocation.Allocation:
    return builders.MakeAllocation(key, node_name).grant(index, milli).obj()


def built(*nodes: str) -> extender_cache.ClusterCache:
    view = extender_cache.ClusterCache("bestfit")
    for name in nodes:
        view.on_node(wire.EventType.ADDED, node(name))
        view.on_device(wire.EventType.ADDED, device(name))
    view.rebuild()
    return view


def test_only_ready_nodes_with_a_valid_device_are_placed_on() -> None:
    view = built("a", "b")
    view.on_node(wire.EventType.MODIFIED, node("b", ready=False))
    broken = wire.convert({"metadata": {"name": "c"}, "spec": {"gpus": [{"index": 1, "uuid": "x", "model": "T4",
                                                                          "memoryMiB": 1}]}}, wire.Device)  # fmt: skip
    view.on_node(wire.EventType.ADDED, node("c"))
    view.on_device(wire.EventType.ADDED, extender_cache.device_record(broken))
    assert view.state.names == ("a",)
    assert view.counters.ignored_nodes == ["c"]


def test_foreign_whole_gpu_pods_take_free_gpus_and_unreadable_allocations_are_counted() -> None:
    view = built("a")
    view.on_pod(wire.EventType.ADDED, pod("foreign", {names.NVIDIA_GPU: "1"}, node_name="a"))
    assert int(view.state.exclusive[0].sum()) == 1
    view.on_pod(
        wire.EventType.ADDED, pod("garbled", {names.GPU: "1", names.GPU_MILLI: "300"}, "a", {names.ALLOCATION: "{nope"})
    )
    assert view.counters.invalid == 1
    view.on_pod(wire.EventType.MODIFIED, pod("foreign", {names.NVIDIA_GPU: "1"}, node_name="a", phase="Succeeded"))
    assert int(view.state.exclusive[0].sum()) == 0, "a finished pod releases its GPU"


def test_assumptions_survive_rebuilds_and_are_forgotten_once() -> None:
    view = built("a")
    alloc = share("ns/p", "a", 0, 600)
    assert view.assume(alloc)
    view.on_node(wire.EventType.MODIFIED, api_devices.NodeFacts("a", True, 64000, 131072))  # the inventory changes
    assert int(view.state.milli_free[0, 0]) == 400, "the assumption is re-applied on the new arrays"
    assert view.forget(units.PodKey("ns/p"))
    assert not view.forget(units.PodKey("ns/p")), "exactly once"
    assert int(view.state.milli_free[0, 0]) == 1000


def test_the_watch_confirms_an_assumption_and_a_deletion_releases_it() -> None:
    view = built("a")
    alloc = share("ns/p", "a", 1, 250)
    assert view.assume(alloc)
    confirmed = pod("p", {names.GPU: "1", names.GPU_MILLI: "250"}, "a", {names.ALLOCATION: alloc.to_json()})
    view.on_pod(wire.EventType.MODIFIED, confirmed)
    entry = view.ledger.get(units.PodKey("ns/p"))
    assert entry is not None and entry.phase.value == "Added" and not view.assumed
    assert view.shared_slots() == {("a", 1)}
    view.on_pod(wire.EventType.DELETED, confirmed)
    assert units.PodKey("ns/p") not in view.ledger and view.shared_slots() == set()


def test_an_assumed_pod_deleted_before_its_binding_is_forgotten() -> None:
    view = built("a")
    assert view.assume(share("ns/p", "a", 0, 500))
    view.on_pod(wire.EventType.DELETED, pod("p", {names.GPU: "1", names.GPU_MILLI: "500"}))
    assert not view.assumed and int(view.state.milli_free[0, 0]) == 1000


def held_claim(name: str, node_name: str, index: int, milli: int) -> dra.ClaimRecord:
    result = {"request": "gpu", "driver": dra.DRIVER, "pool": node_name, "device": dra.device_name(index),
              "consumedCapacity": {dra.MILLI: str(milli), dra.MEMORY: "1Gi"}}  # fmt: skip
    body = {"metadata": {"name": name, "namespace": "ns"}, "status": {"allocation": {"devices": {"results": [result]}}}}
    return dra.claim_record(wire.convert(body, dra.ResourceClaim))


def test_a_dra_claim_holds_its_share_in_the_ledger_until_it_goes_and_across_a_rebuild() -> None:
    view = built("a")
    view.on_claim(wire.EventType.ADDED, held_claim("c", "a", 0, 700))
    assert int(view.state.milli_free[0, 0]) == 300 and int(view.state.gmem_free[0, 0]) == 16384 - 1024
    view.on_claim(wire.EventType.MODIFIED, held_claim("c", "a", 0, 700))
    assert int(view.state.milli_free[0, 0]) == 300, "the same claim again: counted once"
    view.rebuild()
    assert int(view.state.milli_free[0, 0]) == 300, "a rebuild counts the claims again"
    view.on_claim(wire.EventType.MODIFIED, held_claim("c", "a", 1, 200))
    assert [int(v) for v in view.state.milli_free[0]] == [1000, 800], "moved: the old share freed"
    view.on_claim(wire.EventType.DELETED, held_claim("c", "a", 1, 200))
    assert [int(v) for v in view.state.milli_free[0]] == [1000, 1000]
    view.on_claim(wire.EventType.ADDED, held_claim("bad", "a", 0, 5000))
    assert view.counters.invalid == 1 and [int(v) for v in view.state.milli_free[0]] == [1000, 1000]


def test_a_node_that_serves_dra_claims_takes_no_pod() -> None:
    view = built("a", "b")
    served = builders.MakeDevice("b").gpus(2).wire()
    served = msgspec.structs.replace(served, spec=msgspec.structs.replace(served.spec, dra=True))
    view.on_device(wire.EventType.MODIFIED, extender_cache.device_record(served))
    view.rebuild()
    assert view.state.names == ("a", "b") and view.dra_rows.tolist() == [False, True], "one path per node"
    rows = view.name_index().rows(b'["a","b"]')
    assert rows is not None and rows.tolist() == [0, -1], "b is no candidate for a pod"


def test_a_claim_being_written_stays_counted_when_a_rebuild_finds_it_no_longer_fits() -> None:
    """Its write may land: a smaller GPU (the agent reports 1 MiB less) leaves it counted, the GPU
    over-committed so that nothing more is placed there, instead of giving its room away."""
    view = built("a")
    claim = builders.MakeAllocation("ns/c", "a").grant(0, 500, memory=16384).obj()
    assert view.assume_claim(claim)
    smaller = extender_cache.device_record(builders.MakeDevice("a").gpus(2, memory=16383).wire())
    view.on_device(wire.EventType.MODIFIED, smaller)
    assert units.PodKey("ns/c") in view.ledger and bool(view.state.blocked[0, 0])
    assert int(view.state.milli_free[0, 0]) == 500
    assert view.forget_claim(units.PodKey("ns/c")) and not bool(view.state.blocked[0, 0])
