"""Playing the attacker on the real API server, with the attacker's own credentials: a tenant holding
Kubernetes' `edit` role in its namespace (a ServiceAccount token TokenRequest issues), and
sharegpu's own components' accounts, each trying what it must not (docs/security.md)."""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sharegpu.api import gangs, groups, handoff, names, paths
from sharegpu.devcluster import controlplane, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from tests.conftest import render
from tests.integration.conftest import all_bound, events, get_or_none, gpu_pod, wait_for

Json = dict[str, Any]
POLICY = "sharegpu-handoff"


@pytest.fixture
async def tenant(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, namespace: str, system: None
) -> AsyncIterator[client.KubeClient]:
    """The namespace's tenant: Kubernetes' `edit` ClusterRole, bound in its namespace only."""
    await admin.create(f"{paths.namespace(namespace)}/serviceaccounts",
                       {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant"}})  # fmt: skip
    await admin.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "tenant-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": namespace}],
    })  # fmt: skip
    kube = stack.kube_with_token(control_plane, await stack.issue_token(admin, namespace, "tenant"))
    await wait_for(lambda: _may(kube, f"{paths.namespace(namespace)}/configmaps"), what="the tenant's RoleBinding")
    yield kube
    await kube.close()


async def _may(kube: client.KubeClient, path: str) -> bool:
    with contextlib.suppress(kube_errors.ApiError):
        await kube.get(path)
        return True
    return False


def configmap(name: str, data: dict[str, str]) -> Json:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


async def refused(write: Callable[[], Any]) -> str:
    """The message of a write the API server refuses as forbidden (it fails if it is allowed)."""
    with pytest.raises(kube_errors.ApiError) as caught:
        await write()
    assert caught.value.status == 403, caught.value
    return caught.value.message


async def policy_in_force(kube: client.KubeClient, namespace: str) -> None:
    """Until the API server enforces the hand-off policy (it loads policies asynchronously)."""
    probe = f"sharegpu-handoff-probe-{uuid.uuid4().hex[:6]}"

    async def refuses() -> bool:
        try:
            await kube.create(paths.configmaps(namespace), configmap(probe, {}))
        except kube_errors.ApiError as exc:
            return "is a sharegpu GPU hand-off" in exc.message
        try:
            await kube.delete(paths.configmap(namespace, probe))  # not yet: try again (as the tenant, it may)
        except kube_errors.ApiError as exc:  # loaded between the two: in force now (the probe goes with its namespace)
            return "is a sharegpu GPU hand-off" in exc.message
        return False

    await wait_for(refuses, timeout=30, every=0.3, what="the hand-off policy in force")


async def test_a_tenant_can_neither_make_nor_change_nor_delete_a_gpu_handoff(
    admin: client.KubeClient, tenant: client.KubeClient, extender: ExtenderProcess,
    nodes: Callable[..., Any], namespace: str,
) -> None:  # fmt: skip
    """With `edit` the tenant writes ConfigMaps in its namespace, but none named as sharegpu's
    hand-offs: not first (to choose its GPU), not after (to change it), not away."""
    await policy_in_force(tenant, namespace)
    name = f"{names.HANDOFF_PREFIX}{uuid.uuid4().hex[:16]}"
    message = await refused(lambda: tenant.create(paths.configmaps(namespace), configmap(name, {"x": "all"})))
    account = f"system:serviceaccount:{namespace}:tenant"
    assert f"ConfigMap {namespace}/{name} is a sharegpu GPU hand-off" in message
    assert f"({account} may not CREATE it)" in message
    group = groups.handoff_name(namespace, "g")
    await refused(
        lambda: tenant.create(paths.configmaps(namespace), configmap(group, {"NVIDIA_VISIBLE_DEVICES": "all"}))
    )
    plan = gangs.plan_name(f"{namespace}/job")  # a gang plan: where the rest of a gang binds after a restart
    for where in (namespace, names.SYSTEM_NAMESPACE):  # its own namespace: the policy; sharegpu's: RBAC too
        await refused(
            functools.partial(tenant.create, paths.configmaps(where), configmap(plan, {gangs.PLAN_KEY: "{}"}))
        )
    await tenant.create(paths.configmaps(namespace), configmap("app-settings", {"k": "v"}))  # its own: allowed

    await nodes(1, gpus=1)
    await admin.create(
        paths.pods(namespace), gpu_pod("shared", namespace, milli=300, annotations={names.HANDOFF: name})
    )
    await wait_for(lambda: all_bound(admin, namespace, 1), what="the sharing pod bound")
    path = paths.configmap(namespace, name)
    written = await wait_for(lambda: _filled(admin, path), what="its hand-off filled")
    for write in (
        lambda: tenant.patch(path, {"data": {"main.NVIDIA_VISIBLE_DEVICES": "all"}}),
        lambda: tenant.replace(path, {**configmap(name, {"main.NVIDIA_VISIBLE_DEVICES": "all"}), "metadata": {
            "name": name, "resourceVersion": written["metadata"]["resourceVersion"]}}),
        lambda: tenant.delete(path),
    ):  # fmt: skip
        assert "is a sharegpu GPU hand-off" in await refused(write)
    with contextlib.suppress(kube_errors.ApiError):  # a collection's deletion goes item by item
        await tenant.request("DELETE", paths.configmaps(namespace))
    after = await admin.get(path)
    assert after["data"] == written["data"], "what the pod reads is what sharegpu wrote"
    assert await get_or_none(admin, paths.configmap(namespace, "app-settings")) is None, "the tenant's own went"


async def _filled(kube: client.KubeClient, path: str) -> Json | None:
    found = await get_or_none(kube, path)
    return found if found is not None and found.get("data") else None


async def test_the_extender_and_controller_accounts_write_only_their_own_handoffs(
    control_plane: controlplane.ControlPlane, tenant: client.KubeClient, namespace: str
) -> None:
    """RBAC lets both write ConfigMaps cluster-wide; the policy keeps each to its own hand-offs."""
    await policy_in_force(tenant, namespace)
    extender = stack.kube_for(control_plane, names.account("extender"))
    controller = stack.kube_for(control_plane, names.account("controller"))
    try:
        for kube, where in ((extender, "kube-system"), (extender, namespace), (controller, namespace)):
            message = await refused(functools.partial(kube.create, paths.configmaps(where), configmap("settings", {})))
            assert "writes only" in message and f"not {where}/settings" in message
        group = groups.handoff_name(namespace, "g")
        message = await refused(lambda: extender.create(paths.configmaps(namespace), configmap(group, {})))
        assert f"{names.account_user('extender')} may not CREATE it" in message
        pod_handoff = f"{names.HANDOFF_PREFIX}{uuid.uuid4().hex[:16]}"
        message = await refused(lambda: controller.create(paths.configmaps(namespace), configmap(pod_handoff, {})))
        assert f"{names.account_user('controller')} may not CREATE it" in message
        plan = gangs.plan_name(f"{namespace}/job")
        message = await refused(lambda: extender.create(paths.configmaps(namespace), configmap(plan, {})))
        assert f"{names.account_user('extender')} may not CREATE it" in message, "its gang plans: sharegpu-system only"
        message = await refused(
            lambda: controller.create(paths.configmaps(names.SYSTEM_NAMESPACE), configmap(plan, {}))
        )
        assert f"{names.account_user('controller')} may not CREATE it" in message
        await extender.create(paths.configmaps(namespace), configmap(pod_handoff, {}))  # its own: allowed
        await extender.create(paths.configmaps(names.SYSTEM_NAMESPACE), configmap(plan, {}))
        await extender.delete(paths.configmap(names.SYSTEM_NAMESPACE, plan))
        await controller.create(paths.configmaps(namespace), configmap(group, {}))
    finally:
        await extender.close()
        await controller.close()


async def test_without_the_policy_a_handoff_the_tenant_made_first_is_taken_back_before_the_pod_binds(
    admin: client.KubeClient, tenant: client.KubeClient, extender: ExtenderProcess,
    nodes: Callable[..., Any], namespace: str,
) -> None:  # fmt: skip
    """The attack of the security review, with the policy's binding removed (an operator who deleted
    it): the tenant writes the ConfigMap its pod will read, every GPU in it, immutable, before the pod
    is scheduled. The extender finds it at the bind, replaces it whole with what the allocation gives
    (nothing yet: the container waits for its GPU), says so on the pod, and only then binds."""
    binding = paths.admission_policy_binding(POLICY)
    saved = await admin.get(binding)
    await admin.delete(binding)
    try:
        name = f"{names.HANDOFF_PREFIX}{uuid.uuid4().hex[:16]}"
        forged = {**configmap(name, {"main.NVIDIA_VISIBLE_DEVICES": "all"}), "immutable": True}

        async def planted() -> bool:
            try:
                await tenant.create(paths.configmaps(namespace), forged)
            except kube_errors.ApiError:
                return False  # the API server has not dropped the binding yet
            return True

        await wait_for(planted, timeout=30, every=0.3, what="the tenant's ConfigMap written")
        (node,) = await nodes(1, gpus=1)
        await admin.create(
            paths.pods(namespace), gpu_pod("victim", namespace, milli=300, annotations={names.HANDOFF: name})
        )
        await wait_for(lambda: all_bound(admin, namespace, 1), what="the pod bound")
        path = paths.configmap(namespace, name)
        taken = await admin.get(path)
        assert taken["metadata"]["labels"] == {names.LABEL_ROLE: names.ROLE_HANDOFF}
        assert not taken.get("immutable")
        assert taken.get("data", {}).get("main.NVIDIA_VISIBLE_DEVICES", "") != "all"
        filled = await wait_for(lambda: _filled(admin, path), what="the hand-off filled")
        assert filled["data"]["main.NVIDIA_VISIBLE_DEVICES"].startswith(f"GPU-{node}-")
        (alarm,) = await wait_for(lambda: events(admin, namespace, handoff.FORGED_REASON), what="the alarm")
        assert alarm["type"] == "Warning" and alarm["involvedObject"]["name"] == "victim"
        assert "written by someone other than sharegpu" in alarm["message"]
        repaired = await extender.counted("sharegpu_extender_handoff_writes_total", "action")
        assert repaired.get("repaired", 0) >= 1
    finally:
        saved["metadata"] = {"name": POLICY}
        await admin.create(paths.ADMISSION_POLICY_BINDINGS, saved)
        await policy_in_force(tenant, namespace)


async def test_whoever_may_label_namespaces_cannot_turn_sharegpus_admission_off(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, namespace: str, system: None
) -> None:
    """A namespace admin who may patch its own Namespace (resourceNames) tries the opt-out label;
    only the verb skip-admission (ClusterRole sharegpu-admission-skip) lets anyone set it."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    role = f"ns-admin-{namespace}"
    await admin.create(f"{rbac}/clusterroles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": role},
        "rules": [{"apiGroups": [""], "resources": ["namespaces"], "resourceNames": [namespace],
                   "verbs": ["get", "patch", "update"]}]})  # fmt: skip
    made = [f"{rbac}/clusterroles/{role}"]
    for binding, target in ((role, role), (f"{role}-skip", "sharegpu-admission-skip")):
        await admin.create(f"{rbac}/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": binding},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": target},
            "subjects": [{"kind": "User", "name": "alice" if binding == role else "bob",
                          "apiGroup": "rbac.authorization.k8s.io"}]})  # fmt: skip
        made.append(f"{rbac}/clusterrolebindings/{binding}")
    await admin.create(f"{rbac}/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": f"{role}-b"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "User", "name": "bob", "apiGroup": "rbac.authorization.k8s.io"}]})  # fmt: skip
    made.append(f"{rbac}/clusterrolebindings/{role}-b")
    alice, bob = stack.kube_for(control_plane, "alice"), stack.kube_for(control_plane, "bob")
    path = paths.namespace(namespace)
    skip = {"metadata": {"labels": {names.LABEL_ADMISSION: "skip"}}}
    try:
        await wait_for(lambda: _may(alice, path), what="alice's ClusterRoleBinding")
        await alice.patch(path, {"metadata": {"labels": {"team": "a"}}})  # other labels: hers to set
        message = await refused(lambda: alice.patch(path, skip))
        assert f"turns sharegpu's admission checks off in namespace {namespace}" in message
        assert "alice may not set, change or remove it" in message
        await wait_for(lambda: _may(bob, path), what="bob's ClusterRoleBindings")
        await bob.patch(path, skip)  # granted skip-admission
        assert "may not set, change or remove it" in await refused(
            lambda: alice.patch(path, {"metadata": {"labels": {names.LABEL_ADMISSION: None}}})
        )
        await admin.patch(path, {"metadata": {"labels": {names.LABEL_ADMISSION: None}}})  # cluster admin
    finally:
        await alice.close()
        await bob.close()
        for where in made:
            await admin.delete(where)


async def test_a_pod_that_asks_for_no_gpu_sees_none_though_the_webhook_never_sees_it(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, namespace: str, system: None
) -> None:
    """From Kubernetes 1.36 the chart's webhook sees only pods that concern GPUs, and its
    MutatingAdmissionPolicy (the chart's, rendered for this version) hides every GPU from the others
    (a CUDA image says NVIDIA_VISIBLE_DEVICES=all); a pod that concerns GPUs is left to the webhook."""
    if tuple(int(p) for p in control_plane.version.split(".")[:2]) < (1, 36):
        pytest.skip(
            "MutatingAdmissionPolicy is served from Kubernetes 1.36 (below, the chart sends every pod to the webhook)"
        )
    kinds = {"MutatingAdmissionPolicy": "mutatingadmissionpolicies",
             "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings"}  # fmt: skip
    docs = [d for d in render(control_plane.version) if d["kind"] in kinds]
    assert len(docs) == 2
    made = []
    for doc in docs:
        await admin.create(f"/apis/admissionregistration.k8s.io/v1/{kinds[doc['kind']]}", doc)
        made.append(f"/apis/admissionregistration.k8s.io/v1/{kinds[doc['kind']]}/{doc['metadata']['name']}")
    try:
        plain: Json = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"}, "spec": {
            "initContainers": [{"name": "setup", "image": "cuda"}],
            "containers": [{"name": "app", "image": "cuda", "env": [{"name": "HOME", "value": "/"}]},
                           {"name": "side", "image": "busybox"}]}}  # fmt: skip

        async def hidden() -> Json | None:
            plain["metadata"]["name"] = f"plain-{uuid.uuid4().hex[:5]}"
            stored = await admin.create(paths.pods(namespace), plain)
            spec = stored["spec"]
            return stored if all(_void(c) for c in spec["containers"] + spec["initContainers"]) else None

        stored = await wait_for(hidden, timeout=30, every=0.5, what="the policy in force")
        assert {"name": "HOME", "value": "/"} in stored["spec"]["containers"][0]["env"], "the author's kept"
        gpu = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "whole"}, "spec": {"containers": [
            {"name": "train", "image": "cuda", "resources": {"limits": {names.NVIDIA_GPU: "1"}}}]}}  # fmt: skip
        stored = await admin.create(paths.pods(namespace), gpu)
        assert not _void(stored["spec"]["containers"][0]), "a GPU pod is the webhook's (its device plugin's value)"
    finally:
        for where in made:
            await admin.delete(where)


def _void(container: Json) -> bool:
    return {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in (container.get("env") or [])
