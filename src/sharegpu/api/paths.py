"""REST paths of the objects sharegpu reads and writes (one spelling for every component)."""

from __future__ import annotations

from typing import Final

from sharegpu.api import names

NAMESPACES: Final = "/api/v1/namespaces"
NODES: Final = "/api/v1/nodes"
PODS: Final = "/api/v1/pods"
CONFIGMAPS: Final = "/api/v1/configmaps"
RESOURCE_QUOTAS: Final = "/api/v1/resourcequotas"
DEVICES: Final = f"/apis/{names.DEVICE_GROUP}/{names.DEVICE_VERSION}/{names.DEVICE_PLURAL}"
GPU_USAGES: Final = f"/apis/{names.DEVICE_GROUP}/{names.DEVICE_VERSION}/{names.USAGE_PLURAL}"
PRIORITY_CLASSES: Final = "/apis/scheduling.k8s.io/v1/priorityclasses"
ADMISSION_POLICIES: Final = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
ADMISSION_POLICY_BINDINGS: Final = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
DEFINITIONS: Final = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def admission_policy(name: str) -> str:
    return f"{ADMISSION_POLICIES}/{name}"


def admission_policy_binding(name: str) -> str:
    return f"{ADMISSION_POLICY_BINDINGS}/{name}"


def definition(name: str) -> str:
    """A CustomResourceDefinition (`plural.group`)."""
    return f"{DEFINITIONS}/{name}"


def node(name: str) -> str:
    return f"{NODES}/{name}"


def device(name: str) -> str:
    return f"{DEVICES}/{name}"


def gpu_usage(node: str) -> str:
    return f"{GPU_USAGES}/{node}"


def namespace(name: str) -> str:
    return f"{NAMESPACES}/{name}"


def pods(namespace: str) -> str:
    return f"{NAMESPACES}/{namespace}/pods"


def pod(namespace: str, name: str) -> str:
    return f"{NAMESPACES}/{namespace}/pods/{name}"


def pod_status(namespace: str, name: str) -> str:
    return f"{pod(namespace, name)}/status"


def eviction(namespace: str, name: str) -> str:
    """The pod's eviction subresource (an Eviction POSTed there honours PodDisruptionBudgets)."""
    return f"{pod(namespace, name)}/eviction"


def pod_disruption_budgets(namespace: str | None = None) -> str:
    """PodDisruptionBudgets (policy/v1), of every namespace or one."""
    base = "/apis/policy/v1"
    return f"{base}/namespaces/{namespace}/poddisruptionbudgets" if namespace else f"{base}/poddisruptionbudgets"


def binding(namespace: str, name: str) -> str:
    return f"{pod(namespace, name)}/binding"


def configmaps(namespace: str) -> str:
    return f"{NAMESPACES}/{namespace}/configmaps"


def configmap(namespace: str, name: str) -> str:
    return f"{configmaps(namespace)}/{name}"


def events(namespace: str) -> str:
    return f"{NAMESPACES}/{namespace}/events"


def secrets(namespace: str) -> str:
    return f"{NAMESPACES}/{namespace}/secrets"


def leases(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


def lease(namespace: str, name: str) -> str:
    return f"{leases(namespace)}/{name}"


def custom(group: str, version: str, plural: str, namespace: str | None = None, name: str | None = None) -> str:
    """A custom resource's collection (all namespaces, or one), or one object of it."""
    base = f"/apis/{group}/{version}"
    collection = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
    return f"{collection}/{name}" if name else collection
