"""sharegpu's custom resources as values, and their CustomResourceDefinitions generated from the
message types the code reads (`api.schema`): one definition for the API server and the code.

`sharegpu crds` prints the definitions; deploy/crds holds the same text (a test keeps them equal),
which the Helm chart and the local stack install.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
import yaml

from sharegpu.api import budgets, events, groups, names, paths, schema, wire

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Column:
    """A column of `kubectl get` (additionalPrinterColumns)."""

    name: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    json_path: str
    description: str = ""


AGE: Final = Column("Age", "date", ".metadata.creationTimestamp")


@dataclass(frozen=True, slots=True)
class CustomResource:
    group: str
    version: str
    kind: str
    plural: str
    singular: str
    scope: Literal["Namespaced", "Cluster"]
    spec: type
    status: type | None
    description: str
    short_names: tuple[str, ...] = ()
    columns: tuple[Column, ...] = (AGE,)

    @property
    def name(self) -> str:
        """The CustomResourceDefinition's name."""
        return f"{self.plural}.{self.group}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        return paths.custom(self.group, self.version, self.plural, namespace, name)

    def status_update(self, meta: wire.ObjectMeta, spec: msgspec.Struct, status: msgspec.Struct) -> tuple[str, Json]:
        """The PUT of an object's status subresource: its path and body. The body carries the
        resourceVersion that was read, so a write computed from a stale version gets a 409."""
        body = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": {"name": meta.name, "namespace": meta.namespace, "resourceVersion": meta.resource_version},
            "spec": wire.encode(spec),
            "status": wire.encode(status),
        }
        return f"{self.path(meta.namespace or None, meta.name)}/status", body

    def subject(self, meta: wire.ObjectMeta) -> events.Subject:
        """An object of this resource as the subject of an event."""
        return events.Subject(self.api_version, self.kind, meta.namespace, meta.name, meta.uid)

    def manifest(self) -> Json:
        """The CustomResourceDefinition (apiextensions.k8s.io/v1)."""
        properties: Json = {"spec": schema.structural(self.spec)}
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
                    "categories": [names.CATEGORY],
                },
                "versions": [version],
            },
        }


def _column(column: Column) -> Json:
    out: Json = {"name": column.name, "type": column.type, "jsonPath": column.json_path}
    if column.description:
        out["description"] = column.description
    return out


SHARED_DEVICE_GROUP: Final = CustomResource(
    group=names.DOMAIN,
    version=names.API_VERSION,
    kind="SharedDeviceGroup",
    plural="shareddevicegroups",
    singular="shareddevicegroup",
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

GPU_BUDGET: Final = CustomResource(
    group=names.DOMAIN,
    version=names.API_VERSION,
    kind="GPUBudget",
    plural="gpubudgets",
    singular="gpubudget",
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

GENERATED: Final = (SHARED_DEVICE_GROUP, GPU_BUDGET)
"""The resources whose definitions are generated here (the Device resource's is still written by
hand in deploy/crds)."""


def render(resource: CustomResource) -> str:
    """The definition as the YAML file deploy/crds holds."""
    head = f"# {resource.kind}: generated by `sharegpu crds` from {resource.spec.__module__}; do not edit.\n"
    return head + yaml.safe_dump(resource.manifest(), sort_keys=False, width=100)


def file_name(resource: CustomResource) -> str:
    return f"{resource.name}.yaml"
