"""The drift check between the kubelet's device assignments and the API's records: reservation UUIDs
(reported wrong or not yet, and their repair), whole-GPU allocations, device IDs as indexes or
unknown, GPUs the kubelet does not list (with the grace for pods just starting), and the tracker
that reports each mismatch once."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.agent import drift
from sharegpu.agent.drift import Kind, Mismatch
from sharegpu.agent.podresources import Assigned
from sharegpu.api import names, pods, wire
from sharegpu.core import units

GPU = names.NVIDIA_GPU
NIC = "example.com/nic"
SYSTEM = names.HOLDING_NAMESPACE
SPEC = wire.DeviceSpec(
    gpus=[wire.GpuSpec(index=i, uuid=f"GPU-{c}", model="A100", memory_mib=81920) for i, c in enumerate("abcd")]
)
NOW = float(wire.seconds("2025-01-01T00:10:00Z"))
OLD = "2025-01-01T00:00:00Z"
"""Created ten minutes before NOW."""
YOUNG = "2025-01-01T00:09:50Z"
"""Created ten seconds before NOW."""
GRACE = 60.0


def reservation(name: str, uuid: str | None = None, *, phase: str = "Running", created: str = OLD) -> wire.Pod:
    return wire.convert(
        {
            "metadata": {
                "name": name,
                "namespace": SYSTEM,
                "creationTimestamp": created,
                "labels": {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: "n1", names.LABEL_SLOT: "0"},
                "annotations": {names.GPU_UUID: uuid} if uuid is not None else {},
            },
            "spec": {"nodeName": "n1", "containers": [pods.reserve_container("sharegpu:test", 1)]},
            "status": {"phase": phase},
        },
        wire.Pod,
    )


def whole(
    name: str,
    gpus: dict[str, int],
    allocated: dict[str, list[int]] | str | None,
    *,
    phase: str = "Running",
    created: str | None = OLD,
    deleting: bool = False,
) -> wire.Pod:
    """A pod in namespace ml whose containers ask `gpus` whole GPUs each (0: none), with the
    extender's allocation of GPU indexes per container (text: the annotation as it is; None: none)."""
    annotations = {}
    if isinstance(allocated, str):
        annotations[names.ALLOCATION] = allocated
    elif allocated is not None:
        annotations[names.ALLOCATION] = json.dumps(
            {
                "version": 1,
                "node": "n1",
                "exclusive": True,
                "containers": [
                    {
                        "name": container,
                        "devices": [
                            {"index": i, "milli": 1000, "limitMilli": 1000, "memoryMiB": 81920} for i in indexes
                        ],
                    }
                    for container, indexes in allocated.items()
                ],
            }
        )
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "annotations": annotations}
    if created is not None:
        meta["creationTimestamp"] = created
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:09:59Z"
    containers = [{"name": c, "resources": {"limits": {GPU: str(n)} if n else {"cpu": "1"}}} for c, n in gpus.items()]
    return wire.convert(
        {"metadata": meta, "spec": {"nodeName": "n1", "containers": containers}, "status": {"phase": phase}},
        wire.Pod,
    )


def by_key(*found: wire.Pod) -> dict[str, wire.Pod]:
    return {wire.key(p.metadata): p for p in found}


def check(assigned: list[Assigned], *found: wire.Pod, spec: wire.DeviceSpec = SPEC) -> list[Mismatch]:
    return drift.check(assigned, by_key(*found), spec, now=NOW, grace=GRACE)


def reserved(name: str, *ids: str) -> Assigned:
    return Assigned(SYSTEM, name, pods.RESERVE_CONTAINER, GPU, ids)


def key(namespace: str, name: str) -> units.PodKey:
    return units.pod_key(namespace, name)


def test_nothing_when_the_kubelet_and_the_api_agree() -> None:
    assigned = [
        reserved("r-n1-0", "GPU-a"),
        Assigned("ml", "train", "worker", GPU, ("GPU-b", "GPU-c")),
        Assigned("ml", "train", "worker", NIC, ("nic-0",)),
    ]
    found = (reservation("r-n1-0", "GPU-a"), whole("train", {"worker": 2}, {"worker": [2, 1]}))
    assert check(assigned, *found) == []


def test_a_reservation_that_reported_another_gpu_is_repaired_with_the_kubelets() -> None:
    mismatches = check([reserved("r-n1-0", "GPU-b")], reservation("r-n1-0", "GPU-a"))
    assert mismatches == [Mismatch(Kind.RESERVATION_UUID, key(SYSTEM, "r-n1-0"), "reserve", ("GPU-a",), ("GPU-b",))]
    assert mismatches[0].message == "reservation pod sharegpu-gpus/r-n1-0 reported GPU-a but the kubelet gave it GPU-b"
    [repair] = drift.repairs(mismatches)
    assert repair.path == "/api/v1/namespaces/sharegpu-gpus/pods/r-n1-0"
    assert repair.body == {"metadata": {"annotations": {"sharegpu.io/gpu-uuid": "GPU-b"}}}


def test_a_reservation_that_has_not_reported_yet_gets_the_kubelets_uuid() -> None:
    mismatches = check([reserved("r-n1-0", "GPU-c")], reservation("r-n1-0", created=YOUNG))
    assert [(m.kind, m.api, m.kubelet) for m in mismatches] == [(Kind.RESERVATION_UUID, (), ("GPU-c",))]
    assert "has not reported its GPU yet" in mismatches[0].message
    assert [r.body for r in drift.repairs(mismatches)] == [{"metadata": {"annotations": {names.GPU_UUID: "GPU-c"}}}]


def test_device_ids_given_as_indexes_are_read_through_the_device() -> None:
    assigned = [reserved("r-n1-1", "1"), Assigned("ml", "train", "worker", GPU, ("0", "3"))]
    assert check(assigned, reservation("r-n1-1", "GPU-b"), whole("train", {"worker": 2}, {"worker": [0, 3]})) == []
    mismatches = check(assigned, reservation("r-n1-1", "GPU-a"))
    assert [r.uuid for r in drift.repairs(mismatches)] == ["GPU-b"]  # the UUID, never the index


def test_an_id_the_device_does_not_know_is_flagged_and_kept_as_it_is() -> None:
    mig = "MIG-4f1c2e1a-0000-0000-0000-000000000000"
    assigned = [reserved("r-n1-0", mig), Assigned("other", "job", "main", GPU, ("GPU-z", "GPU-a"))]
    mismatches = check(assigned, reservation("r-n1-0", mig))  # reported as given: only the ID is news
    assert mismatches == [
        Mismatch(Kind.UNKNOWN_DEVICE, key("other", "job"), "main", (), ("GPU-z",), known=False),
        Mismatch(Kind.UNKNOWN_DEVICE, key(SYSTEM, "r-n1-0"), "reserve", (), (mig,), known=False),
    ]
    assert "the kubelet gave pod other/job container main GPU-z, which the node's Device does not list" in (
        mismatches[0].message
    )
    # A reservation given an unknown device is told, not repaired: the annotation promises a GPU UUID.
    mismatches = check([reserved("r-n1-0", "7")], reservation("r-n1-0", "GPU-a"))
    assert [(m.kind, m.kubelet, m.known) for m in mismatches] == [
        (Kind.RESERVATION_UUID, ("7",), False),
        (Kind.UNKNOWN_DEVICE, ("7",), False),
    ]
    assert mismatches[0].message.endswith("(not repaired: the node's Device does not list it)")
    assert drift.repairs(mismatches) == []


def test_a_whole_gpu_pod_given_other_gpus_than_allocated_is_only_reported() -> None:
    assigned = [Assigned("ml", "train", "worker", GPU, ("GPU-c", "GPU-d"))]
    mismatches = check(assigned, whole("train", {"worker": 2}, {"worker": [0, 1]}))
    assert mismatches == [
        Mismatch(Kind.WHOLE_GPU, key("ml", "train"), "worker", ("GPU-a", "GPU-b"), ("GPU-c", "GPU-d"))
    ]
    assert mismatches[0].message == (
        "pod ml/train container worker: the extender allocated GPU-a, GPU-b but the kubelet gave it GPU-c, GPU-d"
    )
    assert drift.repairs(mismatches) == []
    # Counts differ too; an index the Device lacks is named as such.
    [fewer] = check(
        [Assigned("ml", "train", "worker", GPU, ("GPU-a",))], whole("train", {"worker": 1}, {"worker": [0, 9]})
    )
    assert fewer.api == ("GPU-a", "index 9") and fewer.message.endswith("(2 allocated, 1 given)")


def test_a_whole_gpu_pod_without_an_allocation_is_not_sharegpus_to_judge() -> None:
    assigned = [Assigned("ml", "plain", "main", GPU, ("GPU-d",))]
    assert check(assigned, whole("plain", {"main": 1}, None)) == []
    assert check([], whole("plain", {"main": 1}, None)) == []  # nor missing
    assert check([Assigned("ml", "broken", "main", GPU, ("GPU-d",))], whole("broken", {"main": 1}, "{not json")) == []


def test_missing_needs_a_running_pod_and_evidence_past_a_start() -> None:
    old = reservation("r-old", "GPU-a")
    assert check([], old) == [Mismatch(Kind.MISSING, key(SYSTEM, "r-old"), "reserve", ("GPU-a",), ())]
    assert check([], old)[0].message == (
        "pod sharegpu-gpus/r-old container reserve holds GPU-a according to the API,"
        " but the kubelet lists no nvidia.com/gpu for the pod"
    )
    young = reservation("r-young", created=YOUNG)
    assert check([], young) == []  # it may have begun after the kubelet answered
    # The kubelet lists the young pod with other devices: it knows the pod, and gave it no GPU.
    assert [m.kind for m in check([Assigned(SYSTEM, "r-young", "reserve", NIC, ("nic-0",))], young)] == [Kind.MISSING]
    assert check([], reservation("r-pending", phase="Pending")) == []
    assert check([], reservation("r-done", "GPU-a", phase="Succeeded")) == []
    assert check([], whole("leaving", {"main": 1}, {"main": [0]}, deleting=True)) == []
    assert check([], whole("unknown-age", {"main": 1}, {"main": [0]}, created=None)) == []
    assert check([], whole("bad-age", {"main": 1}, {"main": [0]}, created="yesterday")) == []
    # A whole-GPU pod: every container that asks for GPUs, with what its allocation gives it.
    two = whole("train", {"a": 1, "b": 1, "log": 0}, {"a": [0], "b": [1]})
    assert [(m.kind, m.container, m.api) for m in check([], two)] == [
        (Kind.MISSING, "a", ("GPU-a",)),
        (Kind.MISSING, "b", ("GPU-b",)),
    ]
    # With a grace of 0 even the youngest pod is old enough.
    assert len(drift.check([], by_key(young), SPEC, now=NOW, grace=0)) == 1


def test_other_resources_are_ignored() -> None:
    assigned = [
        Assigned("ml", "train", "worker", NIC, ("nic-9",)),
        Assigned("ml", "train", "worker", GPU, ("GPU-a",)),
        Assigned("web", "serve", "main", NIC, ("unknown-thing",)),
    ]
    assert check(assigned, whole("train", {"worker": 1}, {"worker": [0]})) == []


def test_several_containers_are_compared_one_by_one() -> None:
    assigned = [
        Assigned("ml", "train", "a", GPU, ("GPU-a",)),
        Assigned("ml", "train", "b", GPU, ("GPU-d",)),
        Assigned("ml", "train", "sidecar", GPU, ("GPU-c",)),  # asks for none, allocated none
    ]
    found = check(
        assigned, whole("train", {"a": 1, "b": 1, "c": 1, "log": 0, "sidecar": 0}, {"a": [0], "b": [1], "c": [2]})
    )
    assert [(m.container, m.api, m.kubelet) for m in found] == [
        ("b", ("GPU-b",), ("GPU-d",)),
        ("c", ("GPU-c",), ()),
        ("sidecar", (), ("GPU-c",)),
    ]
    assert {m.kind for m in found} == {Kind.WHOLE_GPU}
    assert "the extender allocated no GPU but the kubelet gave it GPU-c (0 allocated, 1 given)" in found[2].message


def test_the_tracker_reports_each_mismatch_once_while_it_lasts() -> None:
    tracker = drift.DriftTracker()
    wrong = check([reserved("r-n1-0", "GPU-b")], reservation("r-n1-0", "GPU-a"))
    unknown = check([Assigned("ml", "job", "main", GPU, ("GPU-z",))])
    assert tracker.observe(wrong + unknown) == drift.Changes(new=(*wrong, *unknown), cleared=())
    assert tracker.counts() == {Kind.RESERVATION_UUID: 1, Kind.WHOLE_GPU: 0, Kind.UNKNOWN_DEVICE: 1, Kind.MISSING: 0}
    assert tracker.observe(unknown + wrong) == drift.Changes(new=(), cleared=())  # still there: not news
    tracker.repaired(drift.repairs(wrong))
    assert tracker.repairs_done == 1
    assert tracker.observe(unknown) == drift.Changes(new=(), cleared=tuple(wrong))
    assert tracker.counts()[Kind.RESERVATION_UUID] == 0
    assert tracker.observe(wrong + unknown).new == tuple(wrong)  # back again: news again
    other = check([reserved("r-n1-0", "GPU-c")], reservation("r-n1-0", "GPU-a"))
    changes = tracker.observe(other + unknown)  # the kubelet's side changed: a different mismatch
    assert changes == drift.Changes(new=tuple(other), cleared=tuple(wrong))


# ----------------------------------------------------------------- properties


@st.composite
def node(draw: st.DrawFn) -> tuple[wire.DeviceSpec, list[tuple[str, list[int]]], bool]:
    """A Device, its GPUs handed out to reservations ("r…", one GPU) and whole-GPU containers
    ("w…", several), each GPU to at most one, and whether the device plugin names GPUs by index."""
    count = draw(st.integers(1, 8))
    uuids = draw(st.lists(st.uuids().map(lambda u: f"GPU-{u}"), min_size=count, max_size=count, unique=True))
    spec = wire.DeviceSpec(
        gpus=[wire.GpuSpec(index=i, uuid=u, model="T4", memory_mib=16384) for i, u in enumerate(uuids)]
    )
    order = draw(st.permutations(range(count)))
    holders: list[tuple[str, list[int]]] = []
    at = 0
    while at < count and draw(st.booleans()):
        size = 1 if draw(st.booleans()) else draw(st.integers(1, count - at))
        holders.append(
            (f"{'r' if size == 1 and draw(st.booleans()) else 'w'}{len(holders)}", list(order[at : at + size]))
        )
        at += size
    return spec, holders, draw(st.booleans())


def device_id(spec: wire.DeviceSpec, index: int, by_index: bool) -> str:
    return str(index) if by_index else spec.gpus[index].uuid


@settings(max_examples=200)
@given(node())
def test_records_built_from_the_kubelets_truth_never_mismatch(
    drawn: tuple[wire.DeviceSpec, list[tuple[str, list[int]]], bool],
) -> None:
    spec, holders, by_index = drawn
    assigned: list[Assigned] = []
    found: list[wire.Pod] = []
    for name, indexes in holders:
        ids = tuple(sorted(device_id(spec, i, by_index) for i in indexes))
        if name.startswith("r"):
            assigned.append(reserved(name, *ids))
            found.append(reservation(name, spec.gpus[indexes[0]].uuid))
        else:
            assigned.append(Assigned("ml", name, "main", GPU, ids))
            found.append(whole(name, {"main": len(indexes)}, {"main": indexes}))
    assert check(assigned, *found, spec=spec) == []


@settings(max_examples=200)
@given(node(), st.data())
def test_a_repair_always_writes_a_uuid_the_kubelet_gave(
    drawn: tuple[wire.DeviceSpec, list[tuple[str, list[int]]], bool], data: st.DataObject
) -> None:
    spec, holders, by_index = drawn
    known = [g.uuid for g in spec.gpus]
    truth: dict[str, str] = {}
    assigned: list[Assigned] = []
    found: list[wire.Pod] = []
    for name, indexes in holders:
        index = indexes[0]
        given_id = data.draw(st.sampled_from([device_id(spec, index, by_index), "MIG-x", "99"]))
        assigned.append(reserved(name, given_id))
        truth[name] = spec.gpus[index].uuid
        reported = data.draw(st.none() | st.sampled_from([*known, "GPU-stale"]))
        found.append(reservation(name, reported))
    for repair in drift.repairs(check(assigned, *found, spec=spec)):
        name = repair.pod.split("/", 1)[1]
        assert repair.uuid == truth[name] and repair.uuid in known
        assert repair.body == {"metadata": {"annotations": {names.GPU_UUID: truth[name]}}}
