"""Each component's ServiceAccount, bound as the chart binds it, can do what the component needs and
is refused what it does not (SubjectAccessReviews through the real API server's RBAC authorizer)."""

from __future__ import annotations

import copy
import uuid
from collections.abc import AsyncIterator

import pytest

from sharegpu.api import names, resources
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from tests.conftest import render

SYSTEM = names.SYSTEM_NAMESPACE
HOLDING = names.HOLDING_NAMESPACE
RBAC = "/apis/rbac.authorization.k8s.io/v1"
Check = tuple[str, str, str, str, str, str]
"""(verb, group, resource, namespace, name, subresource)"""

ALLOWED: dict[str, list[Check]] = {
    "scheduler": [("create", "", "pods", "team", "", "binding"), ("list", "", "nodes", "", "", ""),
                  ("update", "coordination.k8s.io", "leases", SYSTEM, "sharegpu-scheduler", ""),
                  # the chart runs the extender in kube-scheduler's pod: its roles are bound to this account too
                  ("update", "coordination.k8s.io", "leases", SYSTEM, "sharegpu-extender", ""),
                  ("patch", "resource.k8s.io", "resourceclaims", "team", "c", "status")],
    "extender": [("create", "", "pods", "team", "", "binding"), ("list", "sharegpu.io", "devices", "", "", ""),
                 ("watch", "policy", "poddisruptionbudgets", "", "", ""),
                 ("create", "", "pods", HOLDING, "", ""), ("patch", "", "configmaps", "team", "", ""),
                 ("update", "coordination.k8s.io", "leases", SYSTEM, "sharegpu-extender", ""),
                 ("delete", "", "pods", "team", "p", ""), ("patch", "", "pods", "team", "p", "status"),
                 ("patch", "", "pods", "team", "p", ""),  # the DRA allocator lifts its scheduling gate
                 ("patch", "resource.k8s.io", "resourceclaims", "team", "c", ""),
                 ("patch", "resource.k8s.io", "resourceclaims", "team", "c", "status"),
                 ("update", "resource.k8s.io", "resourceclaims", "team", "c", "binding"),
                 # the DRA allocator makes the claim by name the webhook gave a pod; reads the DeviceClass
                 ("create", "resource.k8s.io", "resourceclaims", "team", "", ""),
                 ("watch", "resource.k8s.io", "deviceclasses", "", "", ""),
                 ("watch", "sharegpu.io", "gpubudgets", "", "", ""), ("watch", "", "namespaces", "", "", ""),
                 ("watch", "scheduling.k8s.io", "priorityclasses", "", "", "")],
    "webhook": [("list", "sharegpu.io", "devices", "", "", ""), ("get", "", "pods", SYSTEM, "agent-x", ""),
                ("get", "", "pods", "team", "p", ""), ("get", "scheduling.volcano.sh", "podgroups", "team", "g", "")],
    "controller": [("update", "sharegpu.io", "gpubudgets", "team", "", "status"),
                   ("create", "", "configmaps", "team", "", ""), ("patch", "", "nodes", "", "n1", ""),
                   ("list", "", "nodes", "", "", ""), ("create", "", "pods", "team", "p", "eviction"),
                   ("watch", "policy", "poddisruptionbudgets", "", "", ""), ("list", "", "events", "", "", ""),
                   ("watch", "resource.k8s.io", "resourceclaims", "", "", ""),
                   ("get", "apiextensions.k8s.io", "customresourcedefinitions", "", "gpubudgets.sharegpu.io", "")],
    "agent": [("create", "sharegpu.io", "devices", "", "", ""), ("update", "sharegpu.io", "devices", "", "n1", ""),
              ("patch", "", "nodes", "", "n1", ""), ("create", "", "pods", "team", "p", "eviction"),
              ("patch", "", "pods", HOLDING, "sharegpu-reserve-n1-0", "")],
    "reserve": [("patch", "", "pods", HOLDING, "sharegpu-reserve-n1-0", ""), ("get", "", "pods", HOLDING, "r", "")],
}  # fmt: skip
REFUSED: dict[str, list[Check]] = {
    "scheduler": [("get", "", "secrets", SYSTEM, "", ""), ("create", "", "pods", "team", "", ""),
                  ("delete", "sharegpu.io", "devices", "", "n1", "")],
    "extender": [("get", "", "secrets", SYSTEM, "", ""), ("list", "", "secrets", "", "", ""),
                 ("create", "", "pods", "team", "", ""), ("create", "", "pods", SYSTEM, "", ""),
                 ("delete", "sharegpu.io", "devices", "", "n1", ""),
                 ("update", "", "pods", "team", "p", "status"),
                 ("delete", "resource.k8s.io", "resourceclaims", "team", "c", ""),
                 ("update", "resource.k8s.io", "deviceclasses", "", "gpu.sharegpu.io", ""),
                 ("update", "policy", "poddisruptionbudgets", "team", "b", "")],  # read only
    "webhook": [("create", "", "pods", "team", "", "binding"), ("patch", "", "pods", "team", "p", ""),
                ("update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "other", ""),
                ("update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "sharegpu", ""),
                ("get", "", "secrets", SYSTEM, "", "")],
    "controller": [("create", "", "pods", "team", "", "binding"), ("get", "", "secrets", SYSTEM, "", ""),
                   ("update", "sharegpu.io", "gpubudgets", "team", "", ""), ("delete", "", "pods", "team", "p", ""),
                   ("update", "policy", "poddisruptionbudgets", "team", "b", ""),
                   ("list", "apiextensions.k8s.io", "customresourcedefinitions", "", "", ""),
                   ("get", "apiextensions.k8s.io", "customresourcedefinitions", "", "sharepods.kubeshare.nthu", ""),
                   ("update", "apiextensions.k8s.io", "customresourcedefinitions", "", "gpubudgets.sharegpu.io", "")],
    "agent": [("delete", "sharegpu.io", "devices", "", "n1", ""), ("create", "", "pods", "team", "", "binding"),
              ("get", "", "secrets", SYSTEM, "", ""), ("delete", "", "pods", "team", "p", ""),
              ("update", "", "nodes", "", "n1", ""), ("patch", "", "pods", "team", "p", ""),
              ("patch", "", "pods", SYSTEM, "sharegpu-agent-x", "")],
    "reserve": [("patch", "", "pods", "team", "p", ""), ("delete", "", "pods", HOLDING, "r", ""),
                ("patch", "", "pods", SYSTEM, "sharegpu-agent-x", ""),
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
        "spec": {"user": names.account_user(component),
                 "groups": [*names.account_groups(component), "system:authenticated"],
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


RIGHTS: dict[str, dict[str, dict[str, str]]] = {
    "extender": {
        "any namespace": {
            "/configmaps": "create delete get list patch update watch", "/events": "create patch",
            "/namespaces": "get list watch", "/nodes": "get list watch", "/pods": "delete get list patch watch",
            "/pods/binding": "create", "/pods/eviction": "create", "/pods/status": "patch",
            "/resourcequotas": "get list watch", "authentication.k8s.io/tokenreviews": "create",
            "authorization.k8s.io/subjectaccessreviews": "create", "events.k8s.io/events": "create patch",
            "policy/poddisruptionbudgets": "get list watch",  # preemption weighs them
            "resource.k8s.io/resourceclaims": "create get list patch watch",
            "resource.k8s.io/resourceclaims/binding": "patch update",
            "resource.k8s.io/resourceclaims/status": "patch update",
            "resource.k8s.io/resourceclaimtemplates": "create", "scheduling.k8s.io/priorityclasses": "get list watch",
            "resource.k8s.io/devicetaintrules": "list watch", "resource.k8s.io/deviceclasses": "list watch",
            "sharegpu.io/clustergpubudgets": "get list watch", "sharegpu.io/devices": "get list watch",
            "sharegpu.io/gpubudgets": "get list watch",
        },
        "sharegpu-system": {"coordination.k8s.io/leases": "create",
                            "coordination.k8s.io/leases[sharegpu-extender]": "get update"},
        "sharegpu-gpus": {"/pods": "create"},
    },
    "webhook": {
        "any namespace": {
            "/namespaces": "get list watch", "/pods": "get list", "authentication.k8s.io/tokenreviews": "create",
            "authorization.k8s.io/subjectaccessreviews": "create",
            "scheduling.k8s.io/priorityclasses": "get list watch",
            "sharegpu.io/clustergpubudgets": "get list watch", "sharegpu.io/devices": "get list watch",
            "sharegpu.io/gpubudgets": "get list watch", "sharegpu.io/shareddevicegroups": "get list watch",
            "resource.k8s.io/resourceclaims": "get", "resource.k8s.io/resourceclaimtemplates": "get",
            "scheduling.k8s.io/podgroups": "get", "scheduling.x-k8s.io/podgroups": "get",
            "scheduling.sigs.k8s.io/podgroups": "get", "scheduling.volcano.sh/podgroups": "get",
            "scheduling.run.ai/podgroups": "get",
        },
        "sharegpu-system": {},
        "sharegpu-gpus": {},
    },
    "controller": {
        "any namespace": {
            "/configmaps": "create delete get list patch update watch", "/events": "create list",
            "/namespaces": "get list watch", "/nodes": "get list patch watch", "/pods": "get list watch",
            "/pods/eviction": "create", "authentication.k8s.io/tokenreviews": "create",
            "authorization.k8s.io/subjectaccessreviews": "create", "policy/poddisruptionbudgets": "get list watch",
            "resource.k8s.io/resourceclaims": "get list watch", "sharegpu.io/clustergpubudgets": "get list watch",
            "sharegpu.io/clustergpubudgets/status": "patch update", "sharegpu.io/devices": "get list watch",
            "sharegpu.io/gpubudgets": "get list watch", "sharegpu.io/gpubudgets/status": "patch update",
            "sharegpu.io/shareddevicegroups": "get list patch watch",
            "sharegpu.io/shareddevicegroups/status": "patch update",
            "sharegpu.io/gpuusages": "get list watch", "sharegpu.io/gpuidlepolicies": "get list watch",
            "sharegpu.io/gpuidlepolicies/status": "patch update",
            **{f"apiextensions.k8s.io/customresourcedefinitions[{name}]": "get" for name in resources.definitions()},
        },
        "sharegpu-system": {"coordination.k8s.io/leases": "create",
                            "coordination.k8s.io/leases[sharegpu-controller]": "get update"},
        "sharegpu-gpus": {"/pods": "create delete", "policy/poddisruptionbudgets": "create delete"},
    },
    "agent": {
        "any namespace": {
            "/events": "create", "/nodes": "get patch", "/pods": "list watch", "/pods/eviction": "create",
            "authentication.k8s.io/tokenreviews": "create", "authorization.k8s.io/subjectaccessreviews": "create",
            "resource.k8s.io/resourceclaims": "get", "resource.k8s.io/resourceslices": "create delete get update",
            "sharegpu.io/devices": "create get update", "sharegpu.io/shareddevicegroups": "get list watch",
            "sharegpu.io/gpuusages": "create get update", "sharegpu.io/gpuusages/status": "update",
        },
        "sharegpu-system": {},
        "sharegpu-gpus": {"/pods": "patch"},
    },
    "reserve": {"any namespace": {}, "sharegpu-system": {}, "sharegpu-gpus": {"/pods": "get patch"}},
}  # fmt: skip
"""Every right of each account (beyond what any ServiceAccount has), as SelfSubjectRulesReviews list
them: in a tenant's namespace (cluster-wide rights show there too), in sharegpu-system only (the
components' leases) and in sharegpu-gpus only (the GPU-holding pods). The
ones RBAC cannot scope are narrowed by the admission policies (docs/security.md, tested by
test_attacks.py and test_node_attacks.py). The scheduler's are Kubernetes' own role's."""


async def rights_of(kube: client.KubeClient, namespace: str) -> set[tuple[str, str, str]]:
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview", "spec": {"namespace": namespace}}
    review = await kube.create("/apis/authorization.k8s.io/v1/selfsubjectrulesreviews", body)
    found = set()
    for rule in review["status"].get("resourceRules") or []:
        for group in rule.get("apiGroups") or [""]:
            for resource in rule.get("resources") or []:
                for name in rule.get("resourceNames") or [""]:
                    key = f"{group}/{resource}" + (f"[{name}]" if name else "")
                    found |= {(key, verb, name) for verb in rule.get("verbs") or []}
    return found


async def test_each_accounts_rights_are_exactly_the_ones_it_needs(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None
) -> None:
    """Listed on the real API server with each account's own token, against `RIGHTS`: a right the
    chart adds, or one it drops, fails here until the list (and its review) says so."""
    team = f"t-{uuid.uuid4().hex[:8]}"
    await admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": team}})
    await admin.create(f"/api/v1/namespaces/{team}/serviceaccounts",
                       {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody"}})  # fmt: skip
    try:
        nobody = stack.kube_with_token(control_plane, await stack.issue_token(admin, team, "nobody"))
        scopes = {"any namespace": team, SYSTEM: SYSTEM, HOLDING: HOLDING}
        baseline = {scope: await rights_of(nobody, ns) for scope, ns in scopes.items()}
        await nobody.close()
        for component, expected in RIGHTS.items():
            token = await stack.issue_token(admin, names.account_namespace(component), names.account(component))
            kube = stack.kube_with_token(control_plane, token)
            found = {scope: await rights_of(kube, ns) - baseline[scope] for scope, ns in scopes.items()}
            await kube.close()
            anywhere = found.pop("any namespace")
            listed = {"any namespace": _grouped(anywhere)} | {s: _grouped(r - anywhere) for s, r in found.items()}
            assert listed == expected, component
    finally:
        await admin.delete(f"/api/v1/namespaces/{team}")


def _grouped(rights: set[tuple[str, str, str]]) -> dict[str, str]:
    verbs: dict[str, set[str]] = {}
    for key, verb, _ in rights:
        verbs.setdefault(key, set()).add(verb)
    return {key: " ".join(sorted(found)) for key, found in sorted(verbs.items())}
