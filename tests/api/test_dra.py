"""The ResourceSlice a node publishes as a DRA driver: one shareable device per GPU with its
attributes and capacities in sharegpu's units, an unhealthy GPU tainted, owned by its Node."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sharegpu.api import devices as api_devices
from sharegpu.api import dra, selectors, wire
from sharegpu.core import errors, requests
from tests.builders import MakeAllocation, MakeClaim


def spec() -> wire.DeviceSpec:
    return wire.DeviceSpec(
        gpus=[
            wire.GpuSpec(index=0, uuid="GPU-a", model="NVIDIA H100", memory_mib=81920, pcie_switch=0),
            wire.GpuSpec(index=1, uuid="GPU-b", model="NVIDIA H100", memory_mib=81920, numa_node=1),
            wire.GpuSpec(index=2, uuid="GPU-c", model="NVIDIA H100", memory_mib=81920, healthy=False,
                         reason="XID 79: fell off the bus"),
        ],
        nvlinks=[(0, 1), (1, 2)],
    )  # fmt: skip


def test_each_gpu_is_a_shareable_device_with_its_attributes_and_capacities() -> None:
    made = dra.resource_slice("n0", "uid-n0", spec())
    assert made["apiVersion"] == "resource.k8s.io/v1" and made["metadata"]["name"] == "n0-gpu.sharegpu.io"
    assert made["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "n0", "uid": "uid-n0"}]
    assert made["spec"]["driver"] == "gpu.sharegpu.io" and made["spec"]["nodeName"] == "n0"
    assert made["spec"]["pool"] == {"name": "n0", "generation": 1, "resourceSliceCount": 1}
    first, second, third = made["spec"]["devices"]
    assert [d["name"] for d in (first, second, third)] == ["gpu-0", "gpu-1", "gpu-2"]
    assert first["allowMultipleAllocations"] is True
    attributes = first["attributes"]
    assert attributes["gpu.sharegpu.io/uuid"] == {"string": "GPU-a"}
    assert attributes["gpu.sharegpu.io/index"] == {"int": 0}
    assert attributes["gpu.sharegpu.io/pcieSwitch"] == {"int": 0}
    assert attributes["gpu.sharegpu.io/mig"] == {"bool": False}
    assert attributes["gpu.sharegpu.io/nvlinkPeers"] == {"string": "1"}
    assert second["attributes"]["gpu.sharegpu.io/nvlinkPeers"] == {"string": "0,2"}
    assert "gpu.sharegpu.io/pcieSwitch" not in second["attributes"], "unknown: left out, not guessed"
    assert first["capacity"]["memory"]["value"] == "81920Mi"
    assert first["capacity"]["milli"]["value"] == "1000"
    assert first["capacity"]["milli"]["requestPolicy"]["validRange"] == {"min": "1", "max": "1000", "step": "1"}
    assert "taints" not in first


def test_an_unhealthy_gpu_is_tainted_with_its_reason_as_a_label_value_graded_by_how_long_it_lasts() -> None:
    third = dra.resource_slice("n0", "u", spec())["spec"]["devices"][2]
    assert third["taints"] == [
        {"key": "gpu.sharegpu.io/unhealthy", "value": "XID-79--fell-off-the-bus", "effect": "NoExecute"}
    ], "an XID lasts until a reset: its pods cannot go on"
    long = wire.GpuSpec(index=0, uuid="GPU-x", model="m", memory_mib=1, healthy=False, reason="x" * 100)
    [taint] = dra.device(long, [])["taints"]
    assert len(taint["value"]) == 63 and taint["effect"] == "NoSchedule"
    for reason, effect in [(api_devices.xid(48), "NoExecute"), (api_devices.GONE, "NoExecute"),
                           (api_devices.UNREADABLE, "NoSchedule")]:  # fmt: skip
        gpu = msgspec.structs.replace(long, reason=reason)
        assert [t["effect"] for t in dra.device(gpu, [])["taints"]] == [effect], reason


@pytest.mark.parametrize(
    ("toleration", "taint", "takes"),
    [
        ({"key": "maint", "operator": "Exists"}, ("maint", "", "NoSchedule"), True),
        ({"key": "maint", "value": "yes"}, ("maint", "yes", "NoExecute"), True),
        ({"key": "maint", "value": "no"}, ("maint", "yes", "NoExecute"), False),
        ({"key": "maint", "operator": "Exists", "effect": "NoSchedule"}, ("maint", "", "NoExecute"), False),
        ({"operator": "Exists"}, ("anything", "x", "NoExecute"), True),
        ({"key": "other", "operator": "Exists"}, ("maint", "", "NoSchedule"), False),
        ({"value": "x"}, ("maint", "x", "NoSchedule"), False),
    ],
)  # fmt: skip
def test_tolerations_take_taints_as_kubernetes_matches_them(
    toleration: dict[str, str], taint: tuple[str, str, str], takes: bool
) -> None:
    key, value, effect = taint
    found = wire.convert(toleration, dra.DeviceToleration)
    assert dra.tolerates([found], dra.DeviceTaint(key=key, value=value, effect=effect)) is takes


def test_a_taint_rule_selects_by_driver_pool_and_device_and_without_a_selector_nothing() -> None:
    def rule(selector: dict[str, str] | None) -> dra.TaintRule:
        spec: dict[str, Any] = {"taint": {"key": "k", "effect": "NoSchedule"}}
        if selector is not None:
            spec["deviceSelector"] = selector
        return wire.convert({"metadata": {"name": "r"}, "spec": spec}, dra.TaintRule)

    assert rule({}).selects("n0", 3), "the empty selector: every device"
    assert not rule(None).selects("n0", 3), "no selector: none"
    assert rule({"driver": dra.DRIVER, "pool": "n0", "device": "gpu-3"}).selects("n0", 3)
    assert not rule({"driver": "gpu.nvidia.com"}).selects("n0", 3)
    assert not rule({"pool": "n1"}).selects("n0", 3)
    assert not rule({"device": "gpu-1"}).selects("n0", 3)


def test_a_claim_tolerates_a_taint_when_every_request_of_the_class_does() -> None:
    def request(name: str, tolerations: list[dict[str, str]]) -> dict[str, Any]:
        return {"name": name, "exactly": {"deviceClassName": dra.CLASS, "tolerations": tolerations,
                                          "capacity": {"requests": {dra.MILLI: "100", dra.MEMORY: "1Gi"}}}}  # fmt: skip

    def record(*requests_: dict[str, Any]) -> dra.ClaimRecord:
        body = {"metadata": {"name": "c", "namespace": "ns"}, "spec": {"devices": {"requests": list(requests_)}}}
        return dra.claim_record(wire.convert(body, dra.ResourceClaim))

    maint = dra.DeviceTaint(key="maint", effect="NoSchedule")
    exists = {"key": "maint", "operator": "Exists"}
    assert record(request("a", [exists])).tolerates(maint)
    assert not record(request("a", [exists]), request("b", [])).tolerates(maint)
    assert not record(request("a", [])).tolerates(maint)


def claim(results: list[Any], name: str = "c") -> dra.ClaimRecord:
    body = {"metadata": {"name": name, "namespace": "ns"}, "status": {"allocation": {"devices": {"results": results}}}}
    return dra.claim_record(wire.convert(body, dra.ResourceClaim))


def test_an_allocated_claim_holds_its_consumed_capacity_as_an_allocation_of_its_node() -> None:
    shared = {"request": "gpu", "driver": dra.DRIVER, "pool": "n0", "device": "gpu-1", "shareID": "s1",
              "consumedCapacity": {"milli": "300", "memory": "4Gi"}}  # fmt: skip
    held = dra.held(claim([shared]), {})
    assert held is not None and held.pod == "ns/c#claim" and held.node == "n0" and not held.exclusive
    assert held.gpu_usage() == {1: (300, 4096)}
    whole = {**shared, "consumedCapacity": {}}
    taken = dra.held(claim([whole]), {("n0", 1): 81920})
    assert taken is not None and taken.exclusive and taken.gpu_usage() == {1: (1000, 81920)}
    other = {**shared, "driver": "gpu.nvidia.com"}
    assert dra.held(claim([other]), {}) is None, "another driver's devices are not sharegpu's to count"
    assert dra.held(dra.claim_record(wire.convert({"metadata": {"name": "c"}}, dra.ResourceClaim)), {}) is None, (
        "not allocated"
    )


def test_a_claim_sharegpu_cannot_read_is_refused_naming_it() -> None:
    base = {"request": "gpu", "driver": dra.DRIVER, "pool": "n0", "device": "gpu-0", "consumedCapacity": {"milli": "1"}}
    with pytest.raises(errors.InvalidInputError, match=r"'mystery' is not a device gpu\.sharegpu\.io publishes"):
        dra.held(claim([{**base, "device": "mystery"}]), {})
    with pytest.raises(errors.InvalidInputError, match="several pools"):
        dra.held(claim([base, {**base, "pool": "n1"}]), {})
    with pytest.raises(errors.InvalidInputError, match="milli"):
        dra.held(claim([{**base, "consumedCapacity": {"milli": "2000"}}]), {})


def test_the_allocation_sharegpu_writes_for_a_claim_reads_back_as_the_same_share() -> None:
    placed = MakeAllocation("ns/c#claim", "n0").grant(1, 300, 4096, container="gpu").obj()
    status = dra.claim_allocation(placed, ["6f1c2e7a-0000-4000-8000-000000000001"], "2026-11-26T10:00:00Z")
    assert status["allocationTimestamp"] == "2026-11-26T10:00:00Z", "kube-scheduler binds only with it"
    assert status["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n0"]
    [result] = status["devices"]["results"]
    assert result["shareID"] and result["consumedCapacity"] == {"milli": "300", "memory": "4096Mi"}
    back = dra.held(claim([result], name="c"), {})
    assert back is not None and back.gpu_usage() == placed.gpu_usage() and back.node == "n0"
    with pytest.raises(errors.InvalidInputError, match="1 GPU"):
        dra.claim_allocation(placed, [], "2026-11-26T10:00:00Z")


def asked(**exactly: Any) -> dra.DeviceRequest:
    return wire.convert({"name": "gpu", "exactly": {"deviceClassName": dra.DRIVER, **exactly}}, dra.DeviceRequest)


def test_a_claims_request_is_read_in_sharegpus_units_as_the_request_policies_round_it() -> None:
    share = dra.gpu_request(asked(capacity={"requests": {"milli": "300", "memory": "7500Mi"}}))
    assert share is not None and (share.count, share.milli, share.memory_mib) == (1, 300, 7500)
    whole = dra.gpu_request(asked(capacity={"requests": {"milli": "1k", "memory": "4Gi"}}))
    assert whole == requests.GpuRequest(count=1), "all of its compute: the whole GPU, its memory with it"
    default = dra.gpu_request(asked())
    assert default is not None and (default.milli, default.memory_mib) == (1, 0), (
        "compute's policy default; no memory asked: no fixed amount, as on the extender path (its 1Mi default is "
        "what the allocation consumes, not a limit)"
    )
    two = dra.gpu_request(asked(count=2, capacity={"requests": {"milli": "250"}}))
    assert two is not None and (two.count, two.milli) == (2, 250), "a count of 2: a share of each of two GPUs"
    other = wire.convert({"name": "x", "exactly": {"deviceClassName": "gpu.nvidia.com"}}, dra.DeviceRequest)
    assert dra.gpu_request(other) is None, "not of sharegpu's class"


def test_a_request_sharegpu_cannot_place_is_refused_naming_it() -> None:
    with pytest.raises(errors.InvalidRequestError, match="claim request 'gpu': allocationMode All is not supported"):
        dra.gpu_request(asked(allocationMode="All"))
    with pytest.raises(errors.InvalidRequestError, match=r"milli must be 1\.\.1000, got 1500"):
        dra.gpu_request(asked(capacity={"requests": {"milli": "1500"}}))
    with pytest.raises(errors.InvalidRequestError, match="claim request 'gpu'"):
        dra.gpu_request(asked(capacity={"requests": {"memory": "lots"}}))


def test_a_gpu_pods_of_the_extender_path_hold_is_tainted_for_claims() -> None:
    made = dra.resource_slice("n0", "u", spec(), held=frozenset({"GPU-a"}))
    first, second, third = made["spec"]["devices"]
    assert first["taints"] == [{"key": dra.HELD, "value": "extender-path", "effect": "NoSchedule"}]
    assert "taints" not in second
    assert [t["key"] for t in third["taints"]] == [dra.UNHEALTHY], "unhealthy and not held"


def test_a_template_name_says_its_shape_and_reads_back() -> None:
    for shape in (dra.Shape(1, 300, 4096), dra.Shape(2, 500, memory_permille=250), dra.Shape(1, 1000)):
        assert dra.template_shape(shape.name) == shape
    assert dra.Shape(2, 500, memory_permille=250).name == "sharegpu-2x500m-250pm"
    for other in ("sharegpu-0x300m-0mi", "sharegpu-1x2000m-0mi", "sharegpu-1x300m-2000pm", "gpu-share", ""):
        assert dra.template_shape(other) is None, other
    with pytest.raises(errors.InvalidInputError, match="not a sharegpu claim template name"):
        dra.template("ns", "gpu-share")


def test_a_template_asks_what_its_shape_says_and_reads_back_as_that_request() -> None:
    for shape, expected in (
        (dra.Shape(1, 300, 4096), requests.GpuRequest(milli=300, memory_mib=4096)),
        (dra.Shape(2, 500, memory_permille=250), requests.GpuRequest(count=2, milli=500, memory_permille=250)),
        (dra.Shape(3, 1000), requests.GpuRequest(count=3)),
        (dra.Shape(1, 200), requests.GpuRequest(milli=200)),
    ):
        body = dra.template("ns", shape.name)
        assert body["metadata"]["namespace"] == "ns"
        (request,) = body["spec"]["spec"]["devices"]["requests"]
        parsed = dra.gpu_request(wire.convert(request, dra.DeviceRequest))
        assert parsed == expected, shape


def test_memory_is_asked_in_mib_or_as_a_share_not_both() -> None:
    both = {"name": "gpu", "exactly": {"deviceClassName": dra.CLASS,
            "capacity": {"requests": {"memory": "1Gi", "memoryPermille": "100"}}}}  # fmt: skip
    with pytest.raises(errors.InvalidRequestError, match="memory or memoryPermille, not both"):
        dra.gpu_request(wire.convert(both, dra.DeviceRequest))


def test_a_device_publishes_what_nvidias_driver_does_by_its_names_and_kubernetes_standard_ones() -> None:
    known = wire.GpuSpec(
        index=0, uuid="GPU-a", model="NVIDIA A100-SXM4-40GB", memory_mib=40960, architecture="Ampere",
        compute_capability="8.0", driver_version="535.104.05", cuda_driver_version="12.2",
        pci_bus_id="0000:07:00.0", pcie_root="pci0000:00",
    )  # fmt: skip
    attributes = dra.device(known, [])["attributes"]
    ours = {k.removeprefix(f"{dra.DRIVER}/"): v for k, v in attributes.items() if k.startswith(dra.DRIVER)}
    assert {k: ours[k] for k in ("type", "productName", "architecture", "pcieBusID")} == {
        "type": {"string": "gpu"},
        "productName": {"string": "NVIDIA A100-SXM4-40GB"},
        "architecture": {"string": "Ampere"},
        "pcieBusID": {"string": "0000:07:00.0"},
    }
    assert (ours["cudaComputeCapability"], ours["driverVersion"], ours["cudaDriverVersion"]) == (
        {"version": "8.0.0"}, {"version": "535.104.5"}, {"version": "12.2.0"}  # strict semver, as the API wants
    )  # fmt: skip
    assert attributes["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:07:00.0"}
    unknown = dra.device(wire.GpuSpec(index=1, uuid="GPU-b", model="X", memory_mib=1, driver_version="r5xx"), [])
    names_published = set(unknown["attributes"])
    assert not names_published & {f"{dra.DRIVER}/{n}" for n in ("architecture", "driverVersion", "pcieBusID")}
    assert not any(n.startswith("resource.kubernetes.io/") for n in names_published)
    assert len(attributes) + len(dra.device(known, [])["capacity"]) <= 32  # the API's limit per device


def test_a_shape_with_gpu_models_names_its_template_and_the_template_selects_them() -> None:
    models = frozenset({"NVIDIA A100-SXM4-80GB", 'odd "quoted" model'})
    shape = dra.Shape(2, 300, memory_mib=4096, models=models)
    assert shape.name.startswith("sharegpu-2x300m-4096mi-m") and shape.name == shape.name.lower()
    assert dra.template_shape(shape.name) == shape
    assert dra.template_shape("sharegpu-1x300m-4096mi-m1") is None, "not base32"
    (request,) = dra.template("ns", shape.name)["spec"]["spec"]["devices"]["requests"]
    (selector,) = request["exactly"]["selectors"]
    compiled = selectors.compile_selector(selector["cel"]["expression"])
    assert isinstance(compiled, selectors.Selector)
    for model, picked in (("NVIDIA A100-SXM4-80GB", True), ('odd "quoted" model', True), ("T4", False)):
        spec = wire.GpuSpec(index=0, uuid="GPU-a", model=model, memory_mib=81920)
        assert compiled.judge(selectors.Device.of(dra.DRIVER, dra.device(spec, []))).matches is picked
    body = {"metadata": {"name": "c", "namespace": "ns"}, "spec": dra.template("ns", shape.name)["spec"]["spec"]}
    record = dra.claim_record(wire.convert(body, dra.ResourceClaim))
    assert record.problem is None and [s.expression for s in record.selectors] == [selector["cel"]["expression"]]
    with pytest.raises(errors.InvalidRequestError, match="too long to name a claim template after"):
        dra.Shape(1, 300, models=frozenset(f"model number {i}" for i in range(20))).check()


@pytest.mark.parametrize(
    ("made", "field"),
    [
        (MakeClaim().ask(300, "1Gi", allocationMode="All"), "allocationMode All is not supported"),
        (MakeClaim().ask(300, "1Gi", adminAccess=True), "adminAccess is not supported"),
        (MakeClaim().ask(300, "1Gi").constraint(distinctAttribute="gpu.sharegpu.io/uuid"), "distinctAttribute"),
        (MakeClaim().ask(300, "1Gi").constraint(matchAttribute="pcieRoot"), "must name its domain"),
        (MakeClaim().ask(300, "1Gi").config(parameters={"isolation": "mps"}), "config[0].opaque: driver"),
    ],
)
def test_what_sharegpu_cannot_honour_in_a_claim_is_refused_naming_the_field_and_what_to_write(
    made: MakeClaim, field: str
) -> None:
    record = dra.claim_record(wire.convert(made.obj(), dra.ResourceClaim))
    assert record.problem is not None and field in record.problem and not record.asks
    assert any(hint in record.problem for hint in ("write", "ask", "remove", "watch", "must"))


def test_match_attribute_and_another_drivers_config_are_taken() -> None:
    made = MakeClaim().ask(300, "1Gi", count=2).constraint(matchAttribute="resource.kubernetes.io/pcieRoot")
    made.config(driver="nic.example.com")
    record = dra.claim_record(wire.convert(made.obj(), dra.ResourceClaim))
    assert record.problem is None and record.match == ("resource.kubernetes.io/pcieRoot",)
