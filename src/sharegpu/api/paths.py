"""REST paths of the objects sharegpu reads and writes (one spelling for every component).

Every path follows one grammar, written once in `Kind`: a kind's collection under its API group
version (`/api/v1` for the core group, `/apis/GROUP/VERSION` for the others), in one namespace or in
all of them, then an object's name and a subresource. The module's names (`pods`, `pod`, `node`...)
are the kinds' bound methods, so a caller writes `paths.pod(namespace, name)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sharegpu.api import names

CORE: Final = "/api/v1"


def group(name: str, version: str) -> str:
    """The base path of a named API group's version."""
    return f"/apis/{name}/{version}"


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind's REST collection: `base` (`CORE`, or `group(...)`) and its plural."""

    base: str
    plural: str

    @property
    def everywhere(self) -> str:
        """The kind's objects in every namespace (or all of them, for a cluster-scoped kind)."""
        return f"{self.base}/{self.plural}"

    def within(self, namespace: str | None = None) -> str:
        """The collection in one namespace; every namespace's when None."""
        return f"{self.base}/namespaces/{namespace}/{self.plural}" if namespace else self.everywhere

    def named(self, name: str) -> str:
        """One object of a cluster-scoped kind."""
        return f"{self.everywhere}/{name}"

    def object(self, namespace: str | None, name: str) -> str:
        """One object, in `namespace` (None: a cluster-scoped kind's)."""
        return f"{self.within(namespace)}/{name}"

    def at(self, namespace: str | None = None, name: str | None = None) -> str:
        """The collection (in one namespace, or all), or one object of it when `name` is given."""
        return self.object(namespace, name) if name else self.within(namespace)

    def sub(self, namespace: str, name: str, subresource: str) -> str:
        """A subresource of one namespaced object (`status`, `binding`, `eviction`)."""
        return f"{self.object(namespace, name)}/{subresource}"


_NAMESPACES: Final = Kind(CORE, "namespaces")
_NODES: Final = Kind(CORE, "nodes")
_PODS: Final = Kind(CORE, "pods")
_CONFIGMAPS: Final = Kind(CORE, "configmaps")
_SHAREGPU: Final = group(names.DOMAIN, names.API_VERSION)
_DEVICES: Final = Kind(_SHAREGPU, names.DEVICE_PLURAL)
_GPU_USAGES: Final = Kind(_SHAREGPU, names.USAGE_PLURAL)
_ADMISSION: Final = group("admissionregistration.k8s.io", "v1")
_ADMISSION_POLICIES: Final = Kind(_ADMISSION, "validatingadmissionpolicies")
_ADMISSION_POLICY_BINDINGS: Final = Kind(_ADMISSION, "validatingadmissionpolicybindings")
_DEFINITIONS: Final = Kind(group("apiextensions.k8s.io", "v1"), "customresourcedefinitions")
_DISRUPTION_BUDGETS: Final = Kind(group("policy", "v1"), "poddisruptionbudgets")
_LEASES: Final = Kind(group("coordination.k8s.io", "v1"), "leases")

NAMESPACES: Final = _NAMESPACES.everywhere
NODES: Final = _NODES.everywhere
PODS: Final = _PODS.everywhere
CONFIGMAPS: Final = _CONFIGMAPS.everywhere
RESOURCE_QUOTAS: Final = Kind(CORE, "resourcequotas").everywhere
DEVICES: Final = _DEVICES.everywhere
GPU_USAGES: Final = _GPU_USAGES.everywhere
PRIORITY_CLASSES: Final = Kind(group("scheduling.k8s.io", "v1"), "priorityclasses").everywhere
ADMISSION_POLICIES: Final = _ADMISSION_POLICIES.everywhere
ADMISSION_POLICY_BINDINGS: Final = _ADMISSION_POLICY_BINDINGS.everywhere
DEFINITIONS: Final = _DEFINITIONS.everywhere

namespace: Final = _NAMESPACES.named
node: Final = _NODES.named
device: Final = _DEVICES.named
gpu_usage: Final = _GPU_USAGES.named
"""A node's GPUUsage (named after the node)."""
admission_policy: Final = _ADMISSION_POLICIES.named
admission_policy_binding: Final = _ADMISSION_POLICY_BINDINGS.named
definition: Final = _DEFINITIONS.named
"""A CustomResourceDefinition (`plural.group`)."""

pods: Final = _PODS.within
pod: Final = _PODS.object
configmaps: Final = _CONFIGMAPS.within
configmap: Final = _CONFIGMAPS.object
events: Final = Kind(CORE, "events").within
secrets: Final = Kind(CORE, "secrets").within
leases: Final = _LEASES.within
lease: Final = _LEASES.object
pod_disruption_budgets: Final = _DISRUPTION_BUDGETS.within
"""PodDisruptionBudgets (policy/v1), of every namespace or one."""
pod_disruption_budget: Final = _DISRUPTION_BUDGETS.object


def pod_status(namespace: str, name: str) -> str:
    return _PODS.sub(namespace, name, "status")


def binding(namespace: str, name: str) -> str:
    return _PODS.sub(namespace, name, "binding")


def eviction(namespace: str, name: str) -> str:
    """The pod's eviction subresource (an Eviction POSTed there honours PodDisruptionBudgets)."""
    return _PODS.sub(namespace, name, "eviction")


def custom(group_name: str, version: str, plural: str, namespace: str | None = None, name: str | None = None) -> str:
    """A custom resource's collection (all namespaces, or one), or one object of it."""
    return Kind(group(group_name, version), plural).at(namespace, name)
