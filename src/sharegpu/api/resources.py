"""sharegpu's custom resources as values, and their CustomResourceDefinitions generated from the
message types the code reads (`api.schema`): one definition for the API server and the code.

`sharegpu crds` prints the definitions; deploy/helm/sharegpu/crds holds the same text (a test keeps them equal),
which the Helm chart and the local stack install. Helm never changes a CRD after the first install, so
an upgraded release may meet older definitions: `lacking` says what an installed definition lacks of
this release's, which the API server would drop from or refuse in this release's writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import yaml

from sharegpu.api import (
    budgets,
    deviceshare,
    events,
    groups,
    idle,
    names,
    paths,
    podgroups,
    schema,
    sharepods,
    usage,
    wire,
)

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Column:
    """A column of `kubectl get` (additionalPrinterColumns)."""

    name: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    json_path: str
    description: str = ""


AGE: Final = Column("Age", "date", ".metadata.creationTimestamp")


@dataclass(frozen=True, slots=True, kw_only=True)
class CustomResource:
    """A custom resource: sharegpu's own (in its API group and version, the defaults) or another project's."""

    kind: str
    plural: str
    scope: Literal["Namespaced", "Cluster"]
    spec: Any
    """The spec's msgspec type (a Struct, or `dict[str, Any]` for a spec kept as written)."""
    status: type | None
    description: str
    short_names: tuple[str, ...] = ()
    columns: tuple[Column, ...] = (AGE,)
    categories: tuple[str, ...] = (names.CATEGORY,)
    open_spec: bool = False
    """The spec keeps fields the type does not name, as written (another project's resource, whose
    fields sharegpu reads only in part)."""
    group: str = names.DOMAIN
    version: str = names.API_VERSION

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def name(self) -> str:
        """The CustomResourceDefinition's name."""
        return f"{self.plural}.{self.group}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        return paths.custom(self.group, self.version, self.plural, namespace, name)

    def status_update(
        self, meta: wire.ObjectMeta, spec: msgspec.Struct | Json, status: msgspec.Struct
    ) -> tuple[str, Json]:
        """The PUT of an object's status subresource: its path and body. The body carries the
        resourceVersion that was read, so a write computed from a stale version gets a 409."""
        body = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": {"name": meta.name, "namespace": meta.namespace, "resourceVersion": meta.resource_version},
            "spec": msgspec.to_builtins(spec),
            "status": wire.encode(status),
        }
        return f"{self.path(meta.namespace or None, meta.name)}/status", body

    def subject(self, meta: wire.ObjectMeta) -> events.Subject:
        """An object of this resource as the subject of an event."""
        return events.Subject(self.api_version, self.kind, meta.namespace, meta.name, meta.uid)

    def manifest(self) -> Json:
        """The CustomResourceDefinition (apiextensions.k8s.io/v1)."""
        properties: Json = {"spec": schema.structural(self.spec)}
        if self.open_spec:
            properties["spec"]["x-kubernetes-preserve-unknown-fields"] = True
        if self.status is not None:
            properties["status"] = schema.structural(self.status)
        version: Json = {
            "name": self.version,
            "served": True,
            "storage": True,
            "schema": {
                "openAPIV3Schema": {
                    "description": self.description,
                    "type": "object",
                    "required": ["spec"],
                    "properties": properties,
                }
            },
            "additionalPrinterColumns": [_column(c) for c in self.columns],
        }
        if self.status is not None:
            version["subresources"] = {"status": {}}
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": self.name},
            "spec": {
                "group": self.group,
                "scope": self.scope,
                "names": {
                    "kind": self.kind,
                    "listKind": f"{self.kind}List",
                    "plural": self.plural,
                    "singular": self.singular,
                    "shortNames": list(self.short_names),
                    "categories": list(self.categories),
                },
                "versions": [version],
            },
        }


def lacking(expected: Json, installed: Json) -> tuple[str, ...]:
    """What the `installed` CustomResourceDefinition lacks of the `expected` one (this release's
    `CustomResource.manifest()`), in words: a version it does not serve, a field its schema does not
    have (the API server prunes it from every object written: this release's statuses, the specs its
    users write), a field of another type or a value outside its enum (the write is refused), a
    field it requires that this release's may leave out or does not know, the status subresource.
    Empty when this release's objects go through it whole; a newer definition that only adds optional
    fields or values lacks nothing."""
    found: list[str] = []
    served = {v.get("name"): v for v in installed.get("spec", {}).get("versions", []) if v.get("served")}
    for version in expected["spec"]["versions"]:
        theirs = served.get(version["name"])
        if theirs is None:
            found.append(f"version {version['name']} is not served")
            continue
        if "status" in version.get("subresources", {}) and "status" not in theirs.get("subresources", {}):
            found.append("the status subresource")
        mine_schema = version["schema"]["openAPIV3Schema"]
        found += _schema_lacking(mine_schema, theirs.get("schema", {}).get("openAPIV3Schema", {}), "")
    return tuple(found)


def _under(at: str, name: str) -> str:
    """The path of field `name` of the object at `at` ("" for the top)."""
    return f"{at}.{name}" if at else name


def _schema_lacking(mine: Json, theirs: Json, at: str) -> list[str]:
    if theirs.get("x-kubernetes-preserve-unknown-fields") and "properties" not in theirs:
        return []  # kept as written, whatever it holds
    where = at or "the object"
    found: list[str] = []
    if "type" in mine and "type" in theirs and mine["type"] != theirs["type"]:
        found.append(f"{where}: type {theirs['type']} (this release writes {mine['type']})")
        return found
    if "enum" in theirs:
        missing = [v for v in mine.get("enum", ()) if v not in theirs["enum"]]
        if missing:
            found.append(f"{where}: value{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} not allowed")
    theirs_properties = theirs.get("properties", {})
    for name, sub in mine.get("properties", {}).items():
        if name not in theirs_properties:
            found.append(f"{_under(at, name)}: no such field")
        else:
            found += _schema_lacking(sub, theirs_properties[name], _under(at, name))
    always = set(mine.get("required", ()))  # a field it requires that this release may leave out (or not know)
    found += [f"{_under(at, n)}: required" for n in theirs.get("required", ()) if n not in always]
    if isinstance(mine.get("items"), dict):
        found += _schema_lacking(mine["items"], theirs.get("items") or {}, f"{at}[]")
    if isinstance(mine.get("additionalProperties"), dict) and isinstance(theirs.get("additionalProperties"), dict):
        found += _schema_lacking(mine["additionalProperties"], theirs["additionalProperties"], f"{at}.*")
    return found


def _column(column: Column) -> Json:
    out: Json = {"name": column.name, "type": column.type, "jsonPath": column.json_path}
    if column.description:
        out["description"] = column.description
    return out


SHARED_DEVICE_GROUP: Final = CustomResource(
    kind="SharedDeviceGroup",
    plural="shareddevicegroups",
    scope="Namespaced",
    spec=groups.GroupSpec,
    status=groups.GroupStatus,
    description=(
        "A set of GPUs on one node that many pods join: every member sees the same devices. Pods join "
        f"with the annotation {names.DEVICE_GROUP_ANNOTATION}."
    ),
    short_names=("sdg",),
    columns=(
        Column("Phase", "string", ".status.phase"),
        Column("Node", "string", ".status.nodeName"),
        AGE,
    ),
)
"""sharegpu's group; the shared-device-group project's (`DEVICESHARE_GROUP`) has the same columns."""

GPU_BUDGET: Final = CustomResource(
    kind="GPUBudget",
    plural="gpubudgets",
    scope="Namespaced",
    spec=budgets.BudgetSpec,
    status=budgets.BudgetStatus,
    description="GPU time the namespace may use per period, weighted by the share held, and what happens beyond it.",
    short_names=("gpub",),
    columns=(
        Column("Budget", "integer", ".spec.gpuHours", "GPU-hours per period"),
        Column("Used", "integer", ".status.usedGPUSeconds", "GPU-seconds used this period"),
        Column("State", "string", ".status.state"),
        AGE,
    ),
)

CLUSTER_GPU_BUDGET: Final = CustomResource(
    kind="ClusterGPUBudget",
    plural="clustergpubudgets",
    scope="Cluster",
    spec=budgets.ClusterBudgetSpec,
    status=budgets.BudgetStatus,
    description=(
        "GPU time that the namespaces a selector picks may use together per period, weighted by the share held, "
        "and what happens beyond it."
    ),
    short_names=("cgpub",),
    columns=GPU_BUDGET.columns,
)

GPU_USAGE: Final = CustomResource(
    kind=names.USAGE_KIND,
    plural=names.USAGE_PLURAL,
    scope="Cluster",
    spec=usage.UsageSpec,
    status=usage.UsageStatus,
    description=(
        "What a node's pods use of its GPUs (memory, SM utilisation) beside the share each was given, written by "
        "the node's agent now and then; named after the node."
    ),
    short_names=("sgusage",),
    columns=(Column("Observed", "date", ".status.observedAt", "When the agent measured these figures"), AGE),
)

GPU_IDLE_POLICY: Final = CustomResource(
    kind="GPUIdlePolicy",
    plural="gpuidlepolicies",
    scope="Namespaced",
    spec=idle.IdleSpec,
    status=idle.IdleStatus,
    description=(
        "When a GPU share of the namespace counts as idle (its SM use at or below a percentage for a time), and "
        "whether an idle share is only reported or also evicted."
    ),
    short_names=("gpuidle",),
    columns=(
        Column("After", "integer", ".spec.idleAfterSeconds", "Seconds idle before a share is reported"),
        Column("Action", "string", ".spec.action"),
        Column("In force", "boolean", ".status.inForce"),
        Column("Evictions", "integer", ".status.evictions"),
        AGE,
    ),
)

GENERATED: Final = (SHARED_DEVICE_GROUP, GPU_BUDGET, CLUSTER_GPU_BUDGET, GPU_USAGE, GPU_IDLE_POLICY)
"""The resources whose definitions are generated here (the Device's is written by hand:
`DEVICE_DEFINITION`)."""

DEVICE_DEFINITION: Final = Path(__file__).with_name("devices.sharegpu.io.yaml")
"""The Device's definition, written by hand (its bounds, which the message types do not state); the
chart's crds/ holds the same text."""


def definitions() -> dict[str, Json]:
    """Every CustomResourceDefinition of sharegpu's own resources (the chart's crds/), by name."""
    found: dict[str, Json] = {r.name: r.manifest() for r in GENERATED}
    device: Json = yaml.safe_load(DEVICE_DEFINITION.read_text())
    found[device["metadata"]["name"]] = device
    return found


# ----------------------------------------------------------------- other systems' resources (optional)

DEVICESHARE_GROUP: Final = CustomResource(
    group=deviceshare.GROUP,
    version=deviceshare.VERSION,
    kind="SharedDeviceGroup",
    plural="shareddevicegroups",
    scope="Namespaced",
    spec=deviceshare.Spec,
    status=deviceshare.Status,
    description=(
        "The shared-device-group project's group, served by sharegpu for compatibility: the controller mirrors "
        f"it into a {names.DOMAIN} SharedDeviceGroup of the same name. Pods join with {deviceshare.ANNOTATION}."
    ),
    columns=SHARED_DEVICE_GROUP.columns,
    categories=(),
)

SHAREPOD: Final = CustomResource(
    group=sharepods.GROUP,
    version=sharepods.VERSION,
    kind="SharePod",
    plural="sharepods",
    scope="Namespaced",
    spec=sharepods.PodSpec,
    status=sharepods.Status,
    description=(
        "KubeShare's SharePod, served by sharegpu for compatibility: the controller creates the Pod it describes "
        "(same namespace and name, owned by it), which sharegpu schedules, and mirrors the Pod's status."
    ),
    short_names=("shp",),
    columns=(
        Column("Phase", "string", ".status.PodStatus.phase"),
        Column("GPU", "string", ".status.BoundDeviceID", "The GPUs the Pod was given (UUIDs)"),
        AGE,
    ),
    categories=(),
)


def _pod_group(fmt: podgroups.Format, spec: type, project: str, named_by: str) -> CustomResource:
    return CustomResource(
        group=fmt.group,
        version=fmt.version,
        kind="PodGroup",
        plural=fmt.plural,
        scope="Namespaced",
        spec=spec,
        status=None,
        description=(
            f"{project}'s PodGroup, served by sharegpu for compatibility: pods that name it ({named_by}) are placed "
            "as one gang by sharegpu (docs/gangs.md says which fields are honoured)."
        ),
        columns=(Column("MinMember", "integer", ".spec.minMember"), AGE),
        categories=(),
        open_spec=True,
    )


COSCHEDULING_GROUP: Final = _pod_group(
    podgroups.COSCHEDULING,
    podgroups.CoschedulingSpec,
    "scheduler-plugins coscheduling",
    f"label {podgroups.COSCHEDULING_LABEL}",
)
VOLCANO_GROUP: Final = _pod_group(
    podgroups.VOLCANO, podgroups.VolcanoSpec, "Volcano", f"annotation {podgroups.VOLCANO_ANNOTATION}"
)
KAI_GROUP: Final = _pod_group(podgroups.KAI, podgroups.KaiSpec, "KAI", f"annotation {podgroups.KAI_ANNOTATION}")

COMPAT: Final = {
    "deviceshare": (DEVICESHARE_GROUP,),
    "kubeshare": (SHAREPOD,),
    "coscheduling": (COSCHEDULING_GROUP,),
    "volcano": (VOLCANO_GROUP,),
    "kai": (KAI_GROUP,),
}
"""Other systems' resources that sharegpu can serve (`sharegpu crds --compat NAME`; the controller's
`--compat NAME` reconciles them). Optional: a cluster installs only those its users need."""


def budget_resource(item: budgets.AnyBudget) -> CustomResource:
    """The resource a budget is an object of."""
    return GPU_BUDGET if isinstance(item, budgets.GPUBudget) else CLUSTER_GPU_BUDGET


def render(resource: CustomResource) -> str:
    """The definition as the YAML file deploy/helm/sharegpu/crds holds."""
    source = (resource.status or resource.spec).__module__
    head = f"# {resource.kind}: generated by `sharegpu crds` from {source}; do not edit.\n"
    return head + yaml.safe_dump(resource.manifest(), sort_keys=False, width=100)


def file_name(resource: CustomResource) -> str:
    return f"{resource.name}.yaml"
