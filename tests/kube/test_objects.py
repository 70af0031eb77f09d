from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from sharegpu.core import errors, units
from sharegpu.kube import objects


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
    ],
)
def test_quantities(text: str, value: Decimal) -> None:
    assert objects.quantity(text) == value


def test_bad_quantity_names_the_text() -> None:
    with pytest.raises(errors.InvalidInputError, match="'12x' is not a Kubernetes quantity"):
        objects.quantity("12x")


def _pod(limits: dict[str, str], annotations: dict[str, str] | None = None, init: dict[str, str] | None = None) -> Any:
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": {"limits": limits}}]}
    if init is not None:
        spec["initContainers"] = [{"name": "setup", "resources": {"limits": init}}]
    return {"metadata": {"name": "p", "namespace": "ns", "annotations": annotations or {}}, "spec": spec}


def test_fractional_request_with_rules_and_limits() -> None:
    pod = _pod(
        {objects.GPU: "1", objects.GPU_MILLI: "300", objects.GPU_MEMORY: "4096", "cpu": "2", "memory": "1Gi"},
        {objects.ANNOTATION_LIMIT: "600", objects.ANNOTATION_MODELS: "A100, T4", objects.ANNOTATION_AFFINITY: "team"},
    )
    request = objects.pod_request(pod)
    demand = request.demand
    assert (demand.count, demand.milli, demand.memory_mib) == (1, 300, 4096)
    assert demand.models == frozenset({"A100", "T4"})
    assert (demand.cpu_milli, demand.host_memory_mib) == (2000, 1024)
    assert demand.cotenancy.affinity == "team"
    gpu = request.containers[0].gpu
    assert gpu is not None
    assert gpu.limit == 600
    assert request.key == units.PodKey("ns/p")


def test_whole_gpus_through_the_device_plugin() -> None:
    demand = objects.pod_request(_pod({objects.NVIDIA_GPU: "2"})).demand
    assert (demand.count, demand.whole) == (2, True)
    assert objects.wants_gpu(_pod({objects.NVIDIA_GPU: "2"}))
    assert not objects.wants_gpu(_pod({"cpu": "1"}))


def test_init_containers_count_for_host_resources() -> None:
    pod = _pod({"cpu": "500m", "memory": "64Mi"}, init={"cpu": "2", "memory": "32Mi"})
    assert objects.host_request(pod) == (2000, 64)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({objects.GPU_MILLI: "1500"}, "sharegpu.io/gpu-milli must be an integer in 1..1000"),
        ({objects.GPU: "1.5"}, "sharegpu.io/gpu must be an integer"),
        ({objects.NVIDIA_GPU: "x"}, "not a Kubernetes quantity"),
    ],
)
def test_malformed_pod_requests_name_the_container_and_field(limits: dict[str, str], message: str) -> None:
    with pytest.raises(errors.InvalidRequestError, match=f"pod ns/p, container main: .*{message}"):
        objects.pod_request(_pod(limits))


def test_device_object_round_trips_to_an_inventory() -> None:
    from sharegpu.core import devices

    node = devices.uniform_node(
        "n1", gpu_count=4, model="A100", gpu_memory_mib=81920, cpu_milli=1, memory_mib=1, nvlink_all=True
    )
    back = objects.device_inventory(
        objects.device_object(node), {"status": {"allocatable": {"cpu": "64", "memory": "256Gi"}}}
    )
    assert back.gpus == node.gpus
    assert back.nvlinks == node.nvlinks
    assert (back.cpu_milli, back.memory_mib) == (64000, 256 * 1024)
    with pytest.raises(errors.InvalidInventoryError, match="Device n1: malformed GPU entry"):
        objects.device_inventory({"metadata": {"name": "n1"}, "spec": {"gpus": [{"index": 0}]}}, None)
