"""Custom resource definitions generated from the message types: structural, and what deploy/ holds."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest

from sharegpu.api import budgets, groups, resources, schema
from sharegpu.devcluster import controlplane

Json = dict[str, Any]


def walk(node: Any, where: str = "") -> list[tuple[str, Json]]:
    if not isinstance(node, dict):
        return []
    found = [(where, node)]
    for key, value in node.get("properties", {}).items():
        found += walk(value, f"{where}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            found += walk(node[key], f"{where}[]")
    return found


EVERY = [*resources.GENERATED, *(r for items in resources.COMPAT.values() for r in items)]


@pytest.mark.parametrize("resource", EVERY, ids=lambda r: r.name)
def test_every_generated_schema_is_structural(resource: resources.CustomResource) -> None:
    """Kubernetes refuses a CRD whose schema has a node without a type, a $ref, a union or 2020-12
    keywords; and it would write defaults into stored objects (the readers apply them)."""
    version = resource.manifest()["spec"]["versions"][0]
    for where, node in walk(version["schema"]["openAPIV3Schema"]):
        assert "type" in node or node.get("x-kubernetes-int-or-string") is True, where
        assert not {"$ref", "$defs", "anyOf", "oneOf", "prefixItems", "title", "default"} & node.keys(), where
        assert not ("properties" in node and "additionalProperties" in node), where
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_a_group_and_a_budget_read_back_what_a_user_writes() -> None:
    group = msgspec.convert(
        {"spec": {"gpus": 2, "schedulingStrategy": "spread", "share": {"milli": 500}}}, groups.SharedDeviceGroup
    )
    assert group.spec.gpus == 2 and group.spec.share is not None and group.spec.share.memory_mib == 0
    assert group.status.phase == groups.PHASE_PENDING
    budget = msgspec.convert({"spec": {"gpuHours": 20}}, budgets.GPUBudget)
    assert budget.spec.period_days == 30 and budget.spec.when_exhausted == "Demote"
    with pytest.raises(msgspec.ValidationError, match=r"spec\.gpus"):
        msgspec.convert({"spec": {"gpus": 0}}, groups.SharedDeviceGroup)


def test_the_group_schema_says_what_the_type_says() -> None:
    spec = resources.SHARED_DEVICE_GROUP.manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    properties = spec["properties"]["spec"]["properties"]
    assert properties["gpus"] == {
        "description": "How many GPUs of one node the group holds.", "type": "integer", "minimum": 1, "maximum": 64
    }  # fmt: skip
    assert properties["schedulingStrategy"]["enum"] == ["binpack", "spread"]
    assert properties["schedulingStrategy"]["type"] == "string"
    assert properties["share"]["nullable"] is True and properties["share"]["required"] == ["milli"]
    assert spec["properties"]["spec"]["required"] == ["gpus"]


class _Pair(msgspec.Struct):
    a: int


class _Other(msgspec.Struct):
    b: str


class _Mixed(msgspec.Struct):
    pair: tuple[int, str]


class _Union(msgspec.Struct):
    either: int | bool


class _Structs(msgspec.Struct):
    either: _Pair | _Other


class _Enum(msgspec.Struct):
    value: Literal["a", 1]


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (_Mixed, r"\.pair: a tuple of mixed item types"),
        (_Union, r"\.either: a union of 2 types"),
        (_Enum, r"\.value: an enum of mixed or unknown types"),
        (_Structs, r"_Structs: .*must be tagged"),
    ],
)
def test_types_with_no_structural_form_are_refused_by_name(kind: type, message: str) -> None:
    with pytest.raises(schema.SchemaError, match=message):
        schema.structural(kind)


def test_fixed_pairs_become_arrays_of_two() -> None:
    class Links(msgspec.Struct):
        pairs: list[tuple[int, int]]

    found = schema.structural(Links)["properties"]["pairs"]["items"]
    assert found == {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer"}}


SHIPPED = [("helm/sharegpu/crds", r) for r in resources.GENERATED] + [
    (f"compat/{name}", r) for name, items in resources.COMPAT.items() for r in items
]


@pytest.mark.parametrize(("folder", "resource"), SHIPPED, ids=lambda v: v if isinstance(v, str) else v.name)
def test_deploy_holds_the_generated_definitions(folder: str, resource: resources.CustomResource) -> None:
    """The chart and the local stack install the chart's crds/ (and deploy/compat/NAME): it must be what the
    code generates (`sharegpu crds [--compat NAME] --out DIR` rewrites it)."""
    shipped = Path(controlplane.data_path("deploy")) / folder / resources.file_name(resource)
    assert shipped.read_text() == resources.render(resource)


def test_the_chart_holds_the_devices_definition_the_package_ships() -> None:
    """The Device's definition is written by hand once, in the package (the controller holds the
    installed one against it); the chart's crds/ holds the same text."""
    shipped = Path(controlplane.data_path("deploy")) / "helm/sharegpu/crds" / resources.DEVICE_DEFINITION.name
    assert shipped.read_text() == resources.DEVICE_DEFINITION.read_text()
    assert list(resources.definitions()) == [*(r.name for r in resources.GENERATED), "devices.sharegpu.io"]


def test_int_or_string_and_free_form_objects_have_their_structural_forms() -> None:
    class Loose(msgspec.Struct):
        count: int | str
        maybe: int | str | None
        spec: dict[str, Any]

    found = schema.structural(Loose)["properties"]
    assert found["count"] == {"x-kubernetes-int-or-string": True}
    assert found["maybe"] == {"x-kubernetes-int-or-string": True, "nullable": True}
    assert found["spec"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def schema_of(definition: Json) -> Json:
    found: Json = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return found


DEFINITIONS = {r.name: r.manifest() for r in EVERY} | resources.definitions()
"""Every definition sharegpu ships: its own (the Device's included) and the compatibility ones."""


@pytest.mark.parametrize("name", sorted(DEFINITIONS))
def test_a_definition_lacks_nothing_of_itself_nor_of_an_older_one(name: str) -> None:
    current = DEFINITIONS[name]
    assert resources.lacking(current, current) == ()
    # A newer definition that adds a field (and a value to an enum) lacks nothing of this release's.
    newer = copy.deepcopy(current)
    schema_of(newer)["properties"]["spec"].setdefault("properties", {})["later"] = {"type": "string"}
    for _, node in walk(schema_of(newer)):
        if "enum" in node:
            node["enum"] = [*node["enum"], "Later"]
    assert resources.lacking(current, newer) == ()


def test_an_older_definition_lacks_what_the_api_server_would_drop_or_refuse() -> None:
    current = resources.GPU_BUDGET.manifest()
    older = copy.deepcopy(current)
    version = older["spec"]["versions"][0]
    schema = schema_of(older)
    del schema["properties"]["status"]["properties"]["conditions"]  # pruned from every status written
    when = schema["properties"]["spec"]["properties"]["whenExhausted"]
    when["enum"] = [v for v in when["enum"] if v != "Demote"]  # refused
    schema["properties"]["spec"]["properties"]["gpuHours"]["type"] = "string"
    schema["properties"]["spec"]["required"] = [*schema["properties"]["spec"].get("required", []), "warnAtPercent"]
    del version["subresources"]
    assert resources.lacking(current, older) == (
        "the status subresource",
        "spec.gpuHours: type string (this release writes integer)",
        "spec.whenExhausted: value Demote not allowed",
        "spec.warnAtPercent: required",
        "status.conditions: no such field",
    )
    newer = copy.deepcopy(current)  # a field this release does not know, required: its writes are refused
    schema_of(newer)["properties"]["spec"]["required"] = ["gpuHours", "later"]
    assert resources.lacking(current, newer) == ("spec.later: required",)
    version["served"] = False
    assert resources.lacking(current, older) == ("version v1alpha1 is not served",)


def test_a_field_kept_as_written_lacks_nothing_below_it() -> None:
    current = resources.GPU_BUDGET.manifest()
    open_status = copy.deepcopy(current)
    schema_of(open_status)["properties"]["status"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert resources.lacking(current, open_status) == ()
