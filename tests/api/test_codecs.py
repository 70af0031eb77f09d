"""Quantities, pods and Devices to domain values and back (the wire codecs every component shares)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import msgspec
import pytest

from sharegpu.api import devices as api_devices
from sharegpu.api import names, pods, quantity, wire
from sharegpu.core import devices, errors, units
from tests import builders


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        ("1Gi", Decimal(2**30)),
        ("1.5", Decimal("1.5")),
        ("3k", Decimal(3000)),
        ("100Mi", Decimal(100 * 2**20)),
        ("1e3", Decimal(1000)),
        (4, Decimal(4)),
    ],
)
def test_quantities(text: str | int, value: Decimal) -> None:
    assert quantity.parse(text) == value


@pytest.mark.parametrize("bad", ["12x", "", "1e400", True, None, [1]])
def test_bad_quantities_name_the_text(bad: object) -> None:
    with pytest.raises(errors.InvalidInputError, match="quantity"):
        quantity.parse(bad)


def test_integer_names_the_field_and_range() -> None:
    assert quantity.integer("3", "x", 1, 5) == 3
    with pytest.raises(errors.InvalidRequestError, match=r"x must be an integer in 1\.\.5, got '1\.5'"):
        quantity.integer("1.5", "x", 1, 5)


def _pod(
    limits: dict[str, str], annotations: dict[str, str] | None = None, init: dict[str, str] | None = None
) -> wire.Pod:
    pod = builders.MakePod("p", "ns").uid("u1").annotations(annotations or {}).container(limits=limits)
    if init is not None:
        pod.init_container("setup", limits=init)
    return pod.wire()


def test_fractional_request_with_rules_and_limits() -> None:
    pod = _pod(
        {names.GPU: "1", names.GPU_MILLI: "300", names.GPU_MEMORY: "4096", "cpu": "2", "memory": "1Gi"},
        {names.LIMIT_MILLI: "600", names.MODELS: "A100, T4", names.AFFINITY: "team"},
    )
    request = pods.request(pod)
    demand = request.demand
    assert (demand.count, demand.milli, demand.memory_mib) == (1, 300, 4096)
    assert demand.models == frozenset({"A100", "T4"})
    assert (demand.cpu_milli, demand.host_memory_mib) == (2000, 1024)
    assert demand.cotenancy.affinity == "ns/team", "a label is its namespace's own"
    gpu = request.containers[0].gpu
    assert gpu is not None
    assert gpu.limit == 600
    assert request.key == units.PodKey("ns/p")


def test_whole_gpus_through_the_device_plugin() -> None:
    demand = pods.request(_pod({names.NVIDIA_GPU: "2"})).demand
    assert (demand.count, demand.whole) == (2, True)
    assert pods.wants_gpu(_pod({names.NVIDIA_GPU: "2"}))
    assert not pods.wants_gpu(_pod({"cpu": "1"}))


def test_init_containers_count_for_host_resources() -> None:
    pod = _pod({"cpu": "500m", "memory": "64Mi"}, init={"cpu": "2", "memory": "32Mi"})
    assert pods.host_request(pod) == (2000, 64)


def _container(name: str, limits: dict[str, str], restart: str = "") -> dict[str, Any]:
    made: dict[str, Any] = {"name": name, "resources": {"limits": limits, "requests": limits}}
    return {**made, "restartPolicy": restart} if restart else made


def test_native_sidecars_add_to_the_app_containers_and_run_beside_later_init_containers() -> None:
    """A sidecar (an init container with restartPolicy Always) runs beside the app containers: its CPU,
    memory and GPU share add to theirs. A regular init container after it runs beside it."""
    spec = {
        "initContainers": [
            _container("log", {"cpu": "1", "memory": "100Mi", names.GPU_MILLI: "200"}, "Always"),
            _container("setup", {"cpu": "3", "memory": "50Mi"}),
        ],
        "containers": [_container("main", {"cpu": "500m", "memory": "64Mi", names.GPU_MILLI: "300"})],
    }
    pod = wire.convert({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec}, wire.Pod)
    # running: 1 + 0.5 CPU, 164 MiB; the setup container beside the sidecar: 3 + 1 CPU, 150 MiB.
    assert pods.host_request(pod) == (4000, 164)
    demand = pods.request(pod).demand
    assert (demand.count, demand.milli) == (1, 500), "the sidecar's share adds to the app container's"
    plain = {**spec, "initContainers": [_container("log", {"cpu": "1", names.GPU_MILLI: "200"})]}
    before = pods.request(wire.convert({"metadata": {"name": "p", "namespace": "ns"}, "spec": plain}, wire.Pod))
    assert before.demand.milli == 300, "a regular init container's share is done before the app's starts"


def test_pod_level_resources_replace_the_containers_total() -> None:
    spec = {"resources": {"requests": {"cpu": "8", "memory": "1Gi"}},
            "containers": [_container("main", {"cpu": "500m", "memory": "64Mi"})]}  # fmt: skip
    pod = wire.convert({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec}, wire.Pod)
    assert pods.host_request(pod) == (8000, 1024)


def test_a_resize_counts_the_larger_of_the_spec_and_what_the_kubelet_holds() -> None:
    def resized(spec_cpu: str, allocated: str) -> wire.Pod:
        body = {
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [_container("main", {"cpu": spec_cpu, "memory": "64Mi"})]},
            "status": {"containerStatuses": [{"name": "main", "allocatedResources": {"cpu": allocated},
                                              "resources": {"requests": {"cpu": allocated}}}]},
        }  # fmt: skip
        return wire.convert(body, wire.Pod)

    assert pods.host_request(resized("2", "1")) == (2000, 64), "growing counts at once"
    assert pods.host_request(resized("1", "2")) == (2000, 64), "shrinking counts once the kubelet has done it"
    assert pods.host_request(resized("1", "1")) == (1000, 64)
    first = pods.record(resized("1", "2"))
    again = pods.record(resized("1", "1"), first)
    assert (first.cpu_milli, again.cpu_milli) == (2000, 1000), "a record follows the resize"

    def bound(pod: wire.Pod) -> wire.Pod:
        grant = '{"version":1,"node":"n0","containers":[{"name":"main","devices":[]}]}'
        meta = msgspec.structs.replace(pod.metadata, annotations={names.ALLOCATION: grant})
        return msgspec.structs.replace(pod, metadata=meta, spec=msgspec.structs.replace(pod.spec, node_name="n0"))

    held = pods.record(bound(resized("1", "2")))
    after = pods.record(bound(resized("1", "1")), held)
    assert held.allocation is not None and after.allocation is not None
    assert (held.allocation.cpu_milli, after.allocation.cpu_milli) == (2000, 1000), "the ledger's CPU follows"


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({names.GPU_MILLI: "1500"}, "sharegpu.io/gpu-milli must be an integer in 1..1000"),
        ({names.GPU: "1.5"}, "sharegpu.io/gpu must be an integer"),
        ({names.NVIDIA_GPU: "x"}, "not a Kubernetes quantity"),
        ({names.NVIDIA_GPU: "1", names.GPU_MILLI: "300"}, "cannot be combined with a share"),
    ],
)
def test_malformed_pod_requests_name_the_container_and_field(limits: dict[str, str], message: str) -> None:
    with pytest.raises(errors.InvalidRequestError, match=f"pod ns/p, container main: .*{message}"):
        pods.request(_pod(limits))


def test_a_mistyped_pod_is_refused_with_the_path_to_the_field() -> None:
    with pytest.raises(errors.InvalidInputError, match=r"at `\$\.spec\.containers\[0\]\.resources\.limits"):
        wire.convert({"spec": {"containers": [{"name": "c", "resources": {"limits": ["x"]}}]}}, wire.Pod)


def test_records_keep_what_placement_needs_and_parse_allocations_once() -> None:
    alloc_text = (
        '{"version":1,"node":"n1","exclusive":false,"containers":[{"name":"main","init":false,'
        '"devices":[{"index":0,"uuid":null,"milli":300,"limitMilli":300,"memoryMiB":0}]}]}'
    )
    body: dict[str, Any] = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u1",
            "resourceVersion": "7",
            "annotations": {names.ALLOCATION: alloc_text, names.HANDOFF: "sharegpu-handoff-1", "big": "x" * 1000},
        },
        "spec": {
            "nodeName": "n1",
            "schedulerName": names.SCHEDULER_NAME,
            "containers": [{"name": "main", "resources": {"limits": {names.GPU: "1", names.GPU_MILLI: "300"}}}],
        },
        "status": {"phase": "Running"},
    }
    first = pods.record(wire.convert(body, wire.Pod))
    assert (first.node, first.live, first.handoff, first.gpu) == ("n1", True, "sharegpu-handoff-1", True)
    assert first.request is not None and first.request.demand.milli == 300
    assert first.allocation is not None and first.allocation.gpu_indices == (0,)
    body["status"]["phase"] = "Succeeded"
    second = pods.record(wire.convert(body, wire.Pod), first)
    assert second.allocation is first.allocation, "an unchanged annotation is not parsed again"
    assert second.terminal and not second.live


def test_a_request_is_parsed_once_per_pod_unless_what_it_depends_on_changes() -> None:
    """Resources never change on a pod, so later watch events reuse the request; a request annotation
    that changes, or another pod of the same name (another uid), is parsed anew."""
    body: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "1", "annotations": {}},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {names.GPU_MILLI: "300"}}}]},
    }
    first = pods.record(wire.convert(body, wire.Pod))
    body["metadata"]["resourceVersion"] = "2"
    body["spec"]["nodeName"] = "n1"
    bound = pods.record(wire.convert(body, wire.Pod), first)
    assert bound.request is first.request is not None and bound.node == "n1"
    body["metadata"]["annotations"] = {names.LIMIT_MILLI: "900", "unrelated": "x"}
    limited = pods.record(wire.convert(body, wire.Pod), bound)
    assert limited.request is not None and limited.request is not first.request
    assert limited.request.containers[0].gpu is not None and limited.request.containers[0].gpu.limit_milli == 900
    body["metadata"]["annotations"]["unrelated"] = "y"
    assert pods.record(wire.convert(body, wire.Pod), limited).request is limited.request
    body["metadata"]["uid"] = "u2"
    body["spec"]["containers"][0]["resources"]["limits"][names.GPU_MILLI] = "700"
    other = pods.record(wire.convert(body, wire.Pod), limited)
    assert other.request is not None and other.request.demand.milli == 700


def test_reservation_records_carry_their_slot_and_uuid() -> None:
    body = {
        "metadata": {
            "name": "r",
            "namespace": names.HOLDING_NAMESPACE,
            "labels": {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: "n1", names.LABEL_SLOT: "3"},
            "annotations": {names.GPU_UUID: "GPU-1"},
        }
    }
    record = pods.record(wire.convert(body, wire.Pod))
    assert record.reservation == pods.Slot("n1", 3, "GPU-1")
    assert not record.gpu


def test_soft_preferences_are_recognised() -> None:
    def spec(extra: dict[str, Any]) -> wire.Pod:
        return wire.convert({"spec": {"containers": [], **extra}}, wire.Pod)

    preferred = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}}
    assert pods.has_soft_preferences(spec({"affinity": preferred}))
    assert pods.has_soft_preferences(spec({"topologySpreadConstraints": [{"whenUnsatisfiable": "ScheduleAnyway"}]}))
    assert not pods.has_soft_preferences(spec({"topologySpreadConstraints": [{"whenUnsatisfiable": "DoNotSchedule"}]}))
    assert not pods.has_soft_preferences(spec({}))


def test_device_round_trips_to_an_inventory() -> None:
    node = devices.uniform_node(
        "n1", gpu_count=4, model="A100", gpu_memory_mib=81920, cpu_milli=1, memory_mib=1, nvlink_all=True
    )
    written = wire.encode(api_devices.device(node))
    facts = api_devices.node_facts(
        wire.convert(
            {
                "metadata": {"name": "n1"},
                "status": {
                    "allocatable": {"cpu": "64", "memory": "256Gi"},
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            },
            wire.Node,
        )
    )
    back = api_devices.inventory(wire.convert(written, wire.Device), facts)
    assert back.gpus == node.gpus
    assert back.nvlinks == node.nvlinks
    assert (back.cpu_milli, back.memory_mib) == (64000, 256 * 1024)
    assert facts.schedulable


def test_a_node_s_pod_capacity_is_read_and_a_bad_one_makes_it_unschedulable() -> None:
    def facts(allocatable: dict[str, str]) -> api_devices.NodeFacts:
        ready = [{"type": "Ready", "status": "True"}]
        body = {"metadata": {"name": "n1"}, "status": {"allocatable": allocatable, "conditions": ready}}
        return api_devices.node_facts(wire.convert(body, wire.Node))

    assert facts({"cpu": "8", "memory": "1Gi", "pods": "110"}).pods == 110
    assert facts({"cpu": "8", "memory": "1Gi"}).pods == 0, "not said: no limit known"
    bad = facts({"cpu": "8", "memory": "1Gi", "pods": "1.5"})
    assert not bad.schedulable and bad.pods == 0


def test_a_malformed_device_names_the_device_and_the_field() -> None:
    with pytest.raises(
        errors.InvalidInputError, match=r"Object missing required field `uuid` - at `\$\.spec\.gpus\[0\]`"
    ):
        wire.convert({"metadata": {"name": "n1"}, "spec": {"gpus": [{"index": 0}]}}, wire.Device)
    bad = wire.convert(
        {"metadata": {"name": "n1"}, "spec": {"gpus": [{"index": 0, "uuid": "", "model": "T4", "memoryMiB": 1}]}},
        wire.Device,
    )
    with pytest.raises(errors.InvalidInventoryError, match="Device n1: GPU 0 has an empty UUID"):
        api_devices.gpus(bad)
