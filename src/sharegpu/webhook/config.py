"""The webhook's own MutatingWebhookConfiguration and ValidatingWebhookConfiguration.

Choices, and why:
- failurePolicy Fail: while the webhook is down no pod in a covered namespace is admitted, so no GPU
  pod can run unaccounted or with a hand-off it set itself. Run two replicas.
- namespaceSelector: namespaces labelled `sharegpu.io/admission: skip` are left alone (the chart labels
  kube-system and sharegpu-system; labelling a namespace takes cluster-level rights a tenant lacks).
  There is deliberately no objectSelector: a pod cannot opt out by a label it controls.
- sideEffects None, timeout 5 s, reinvocationPolicy IfNeeded (other mutators may add containers).
- Pods are reviewed when created (and validated when updated), and so is every container
  `kubectl debug` adds (pods/ephemeralcontainers): it sees no GPU, and sets nothing only the system sets.
- SharedDeviceGroup deletions are reviewed too: refused while the group has live member pods.
- Evictions by a node agent's account (matchConditions: no other eviction waits for the webhook):
  only of pods on the agent's own node (a ValidatingAdmissionPolicy cannot read the evicted pod).
"""

from __future__ import annotations

import base64
from typing import Any

from sharegpu.api import deviceshare, names
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

Json = dict[str, Any]
NAME = "sharegpu"
SKIP_LABEL = names.LABEL_ADMISSION
AGENT = names.account_user("agent")
MUTATING_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
VALIDATING_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


def _client_config(base: str | Json, path: str, ca_bundle: bytes) -> Json:
    bundle = base64.b64encode(ca_bundle).decode()
    if isinstance(base, str):
        return {"url": base.rstrip("/") + path, "caBundle": bundle}
    return {"service": {**base, "path": path}, "caBundle": bundle}


def _hook(name: str, base: str | Json, path: str, ca_bundle: bytes, mutating: bool) -> Json:
    hook: Json = {
        "name": name,
        "clientConfig": _client_config(base, path, ca_bundle),
        "rules": [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"] if not mutating
             else ["CREATE"], "resources": ["pods"], "scope": "Namespaced"},
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
             "resources": ["pods/ephemeralcontainers"], "scope": "Namespaced"},
        ],
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "timeoutSeconds": 5,
        "admissionReviewVersions": ["v1"],
        "namespaceSelector": {"matchExpressions": [{"key": SKIP_LABEL, "operator": "NotIn", "values": ["skip"]}]},
    }  # fmt: skip
    if mutating:
        hook["reinvocationPolicy"] = "IfNeeded"
    return hook


def configurations(base: str | Json, ca_bundle: bytes) -> tuple[Json, Json]:
    """(mutating, validating) for a webhook at `base` (an https URL, or a service reference)."""
    mutating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": NAME},
        "webhooks": [_hook("pods.mutate.sharegpu.io", base, "/mutate/pods", ca_bundle, True)],
    }
    devices = _hook("devices.validate.sharegpu.io", base, "/validate/devices", ca_bundle, False)
    devices["rules"] = [
        {
            "apiGroups": [names.DOMAIN],
            "apiVersions": [names.API_VERSION],
            "operations": ["CREATE", "UPDATE"],
            "resources": [names.DEVICE_PLURAL],
            "scope": "Cluster",
        }
    ]
    devices.pop("namespaceSelector")
    groups = _hook("groups.validate.sharegpu.io", base, "/validate/groups", ca_bundle, False)
    groups["rules"] = [
        {
            "apiGroups": [group],
            "apiVersions": [version],
            "operations": ["UPDATE", "DELETE"],
            "resources": ["shareddevicegroups"],
            "scope": "Namespaced",
        }  # the shared-device-group project's groups (`api.deviceshare`) have the same members as their mirrors
        for group, version in ((names.DOMAIN, names.API_VERSION), (deviceshare.GROUP, deviceshare.VERSION))
    ]
    evictions = _hook("evictions.validate.sharegpu.io", base, "/validate/evictions", ca_bundle, False)
    evictions["rules"] = [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["pods/eviction"], "scope": "Namespaced"}]  # fmt: skip
    evictions.pop("namespaceSelector")
    evictions["matchConditions"] = [
        {"name": "by-a-node-agent", "expression": f"request.userInfo.username == '{AGENT}'"}
    ]
    validating = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": NAME},
        "webhooks": [
            _hook("pods.validate.sharegpu.io", base, "/validate/pods", ca_bundle, False),
            devices,
            groups,
            evictions,
        ],
    }
    return mutating, validating


async def install(kube: client.KubeApi, base: str | Json, ca_bundle: bytes) -> None:
    """Create or replace both configurations."""
    for path, body in zip((MUTATING_PATH, VALIDATING_PATH), configurations(base, ca_bundle), strict=True):
        try:
            await kube.create(path, body)
        except kube_errors.ConflictError:
            current = await kube.get(f"{path}/{NAME}")
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            await kube.replace(f"{path}/{NAME}", body)


async def set_ca_bundle(kube: client.KubeApi, ca_bundle: bytes) -> None:
    """Write the CA bundle into the existing configurations (the bootstrap mode)."""
    bundle = base64.b64encode(ca_bundle).decode()
    for path in (MUTATING_PATH, VALIDATING_PATH):
        current = await kube.get(f"{path}/{NAME}")
        for hook in current.get("webhooks") or []:
            hook.setdefault("clientConfig", {})["caBundle"] = bundle
        await kube.replace(f"{path}/{NAME}", current)


async def uninstall(kube: client.KubeApi) -> None:
    for path in (MUTATING_PATH, VALIDATING_PATH):
        await kube.delete(f"{path}/{NAME}")
