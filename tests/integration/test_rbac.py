"""Each component's ServiceAccount, bound as the chart binds it, can do what the component needs and
is refused what it does not (SubjectAccessReviews through the real API server's RBAC authorizer)."""

from __future__ import annotations

import copy
import uuid
from collections.abc import AsyncIterator

import pytest

from sharegpu.api import names
from sharegpu.devcluster import controlplane
from sharegpu.kube import client
from tests.conftest import render

SYSTEM = names.SYSTEM_NAMESPACE
RBAC = "/apis/rbac.authorization.k8s.io/v1"
Check = tuple[str, str, str, str, str, str]
"""(verb, group, resource, namespace, name, subresource)"""

ALLOWED: dict[str, list[Check]] = {
    "scheduler": [("create", "", "pods", "team", "", "binding"), ("list", "", "nodes", "", "", ""),
                  ("update", "coordination.k8s.io", "leases", SYSTEM, "sharegpu-scheduler", "")],
    "extender": [("create", "", "pods", "team", "", "binding"), ("list", "sharegpu.io", "devices", "", "", ""),
                 ("create", "", "pods", SYSTEM, "", ""), ("patch", "", "configmaps", "team", "", ""),
                 ("update", "coordination.k8s.io", "leases", SYSTEM, "sharegpu-extender", ""),
                 ("delete", "", "pods", "team", "p", ""), ("patch", "", "pods", "team", "p", "status"),
                 ("patch", "", "pods", "team", "p", ""),  # the DRA allocator lifts its scheduling gate
                 ("patch", "resource.k8s.io", "resourceclaims", "team", "c", ""),
                 ("patch", "resource.k8s.io", "resourceclaims", "team", "c", "status"),
                 ("update", "resource.k8s.io", "resourceclaims", "team", "c", "binding"),
                 ("watch", "sharegpu.io", "gpubudgets", "", "", ""), ("watch", "", "namespaces", "", "", ""),
                 ("watch", "scheduling.k8s.io", "priorityclasses", "", "", "")],
    "webhook": [("list", "sharegpu.io", "devices", "", "", ""), ("get", "", "pods", SYSTEM, "agent-x", ""),
                ("get", "", "pods", "team", "p", "")],
    "controller": [("update", "sharegpu.io", "gpubudgets", "team", "", "status"),
                   ("create", "", "configmaps", "team", "", ""), ("patch", "", "nodes", "", "n1", ""),
                   ("list", "", "nodes", "", "", ""), ("create", "", "pods", "team", "p", "eviction"),
                   ("watch", "policy", "poddisruptionbudgets", "", "", ""), ("list", "", "events", "", "", ""),
                   ("watch", "resource.k8s.io", "resourceclaims", "", "", "")],
    "agent": [("create", "sharegpu.io", "devices", "", "", ""), ("update", "sharegpu.io", "devices", "", "n1", ""),
              ("patch", "", "nodes", "", "n1", ""), ("create", "", "pods", "team", "p", "eviction"),
              ("patch", "", "pods", SYSTEM, "sharegpu-reserve-n1-0", "")],
    "reserve": [("patch", "", "pods", SYSTEM, "sharegpu-reserve-n1-0", ""), ("get", "", "pods", SYSTEM, "r", "")],
}  # fmt: skip
REFUSED: dict[str, list[Check]] = {
    "scheduler": [("get", "", "secrets", SYSTEM, "", ""), ("update", "coordination.k8s.io", "leases", SYSTEM,
                  "sharegpu-extender", "")],
    "extender": [("get", "", "secrets", SYSTEM, "", ""), ("list", "", "secrets", "", "", ""),
                 ("create", "", "pods", "team", "", ""), ("delete", "sharegpu.io", "devices", "", "n1", ""),
                 ("update", "", "pods", "team", "p", "status"),
                 ("delete", "resource.k8s.io", "resourceclaims", "team", "c", ""),
                 ("create", "resource.k8s.io", "resourceclaims", "team", "", "")],
    "webhook": [("create", "", "pods", "team", "", "binding"), ("patch", "", "pods", "team", "p", ""),
                ("update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "other", ""),
                ("update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "sharegpu", ""),
                ("get", "", "secrets", SYSTEM, "", "")],
    "controller": [("create", "", "pods", "team", "", "binding"), ("get", "", "secrets", SYSTEM, "", ""),
                   ("update", "sharegpu.io", "gpubudgets", "team", "", ""), ("delete", "", "pods", "team", "p", ""),
                   ("update", "policy", "poddisruptionbudgets", "team", "b", "")],
    "agent": [("delete", "sharegpu.io", "devices", "", "n1", ""), ("create", "", "pods", "team", "", "binding"),
              ("get", "", "secrets", SYSTEM, "", ""), ("delete", "", "pods", "team", "p", ""),
              ("update", "", "nodes", "", "n1", ""), ("patch", "", "pods", "team", "p", "")],
    "reserve": [("patch", "", "pods", "team", "p", ""), ("delete", "", "pods", SYSTEM, "r", ""),
                ("get", "", "secrets", SYSTEM, "", ""), ("list", "", "pods", "", "", "")],
}  # fmt: skip


@pytest.fixture(scope="module")
async def bound(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None
) -> AsyncIterator[None]:
    """The chart's bindings, under their own names, to the chart's ServiceAccounts (the local stack
    binds the same roles to token users; the roles are the chart's)."""
    suffix = uuid.uuid4().hex[:6]
    made: list[str] = []
    for doc in render(control_plane.version):
        if doc["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        body = copy.deepcopy(doc)
        body["metadata"]["name"] = f"{body['metadata']['name']}-{suffix}"
        namespace = body["metadata"].get("namespace")
        plural = "clusterrolebindings" if namespace is None else f"namespaces/{namespace}/rolebindings"
        await admin.create(f"{RBAC}/{plural}", body)
        made.append(f"{RBAC}/{plural}/{body['metadata']['name']}")
    yield
    for path in made:
        await admin.delete(path)


async def allowed(admin: client.KubeClient, component: str, check: Check) -> bool:
    verb, group, resource, namespace, name, subresource = check
    review = await admin.create("/apis/authorization.k8s.io/v1/subjectaccessreviews", {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": f"system:serviceaccount:{SYSTEM}:sharegpu-{component}",
                 "groups": ["system:serviceaccounts", f"system:serviceaccounts:{SYSTEM}", "system:authenticated"],
                 "resourceAttributes": {"verb": verb, "group": group, "resource": resource, "namespace": namespace,
                                        "name": name, "subresource": subresource}},
    })  # fmt: skip
    return bool(review["status"].get("allowed"))


@pytest.mark.parametrize("component", sorted(ALLOWED))
async def test_each_component_can_do_what_it_needs_and_nothing_it_does_not(
    admin: client.KubeClient, bound: None, component: str
) -> None:
    cannot = [c for c in ALLOWED[component] if not await allowed(admin, component, c)]
    assert cannot == [], f"sharegpu-{component} lacks what it needs"
    can = [c for c in REFUSED[component] if await allowed(admin, component, c)]
    assert can == [], f"sharegpu-{component} may do more than it needs"
