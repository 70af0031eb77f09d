"""Admission decisions for Pods: mutate (translate, schedule with sharegpu, add the hand-off) and
validate (a well-formed canonical request that some GPU can hold; nothing only the system may set).

Pure: a review in, a response out. `Policy` carries what the decisions depend on (who the system
is, which namespaces are left alone, the largest GPU memory in the inventory).
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
import orjson

from sharegpu.core import errors
from sharegpu.kube import objects
from sharegpu.webhook import translate

Json = dict[str, Any]

ANNOTATION_TRANSLATED = f"{objects.DOMAIN}/translated"
HANDOFF_PREFIX = "sharegpu-handoff-"
SYSTEM_ONLY_ANNOTATIONS = (objects.ANNOTATION_ALLOCATION, objects.ANNOTATION_GPU_UUID, objects.ANNOTATION_HANDOFF)
ISOLATION_VARIABLES = (
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)


@dataclass
class Policy:
    system_users: frozenset[str] = frozenset({"system:serviceaccount:sharegpu-system:sharegpu-extender"})
    skip_namespaces: frozenset[str] = frozenset({"kube-system", objects.SYSTEM_NAMESPACE})
    largest_gpu_memory_mib: int | None = None
    """The largest GPU memory in the cluster's inventory; None until the inventory is known."""
    largest_gpu_model: str = ""
    models: frozenset[str] = field(default_factory=frozenset)


def _is_isolation(name: str) -> bool:
    return name in ISOLATION_VARIABLES or name.startswith("CUDA_DEVICE_MEMORY_LIMIT_")


def _response(uid: str, allowed: bool, message: str = "", patch: list[Json] | None = None,
              audit: dict[str, str] | None = None, code: int = 403) -> Json:  # fmt: skip
    response: Json = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": code, "message": message, "reason": "Forbidden" if code == 403 else "Invalid"}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(orjson.dumps(patch)).decode()
    if audit:
        response["auditAnnotations"] = audit
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def _request(review: Any) -> Json:
    if not isinstance(review, dict) or not isinstance(review.get("request"), dict):
        raise errors.InvalidInputError("not an AdmissionReview: no request object")
    request: Json = review["request"]
    if not isinstance(request.get("uid"), str):
        raise errors.InvalidInputError("AdmissionReview request has no uid")
    return request


def _pod(request: Json, key: str = "object") -> Json:
    pod = request.get(key)
    if not isinstance(pod, dict):
        raise errors.InvalidRequestError(f"the review carries no pod in {key!r}")
    for part in ("metadata", "spec"):
        if part in pod and not isinstance(pod[part], dict):
            raise errors.InvalidRequestError(f"pod {part} must be an object")
    spec = pod.get("spec") or {}
    for group in ("containers", "initContainers"):
        items = spec.get(group) or []
        if not isinstance(items, list) or not all(isinstance(c, dict) for c in items):
            raise errors.InvalidRequestError(f"pod spec.{group} must be a list of objects")
        for container in items:
            resources = container.get("resources") or {}
            if not isinstance(resources, dict) or not all(
                isinstance(resources.get(k) or {}, dict) for k in ("limits", "requests")
            ):
                raise errors.InvalidRequestError(f"container {container.get('name')!r}: resources must be objects")
            if not isinstance(container.get("env") or [], list):
                raise errors.InvalidRequestError(f"container {container.get('name')!r}: env must be a list")
    notes = (pod.get("metadata") or {}).get("annotations") or {}
    if not isinstance(notes, dict) or not all(isinstance(v, str) for v in notes.values()):
        raise errors.InvalidRequestError("pod annotations must map strings to strings")
    return pod


def _skipped(request: Json, policy: Policy) -> bool:
    return request.get("namespace") in policy.skip_namespaces


def _is_system(request: Json, policy: Policy) -> bool:
    user = request.get("userInfo") or {}
    return user.get("username") in policy.system_users


def _gpu_containers(pod: Json) -> list[Json]:
    spec = pod.get("spec") or {}
    return [
        c
        for c in (spec.get("initContainers") or []) + (spec.get("containers") or [])
        if any(k in translate.merged_resources(c) for k in objects.MANAGED_RESOURCES)
    ]


def _add_handoff(pod: Json) -> str:
    """Give a sharing pod its hand-off ConfigMap (a fresh name: no pod name or UID exists yet) and the
    env references its GPU containers read; returns the ConfigMap name."""
    name = HANDOFF_PREFIX + secrets.token_hex(8)
    pod["metadata"].setdefault("annotations", {})[objects.ANNOTATION_HANDOFF] = name
    for container in _gpu_containers(pod):
        res = translate.merged_resources(container)
        count = int(objects.quantity(res.get(objects.GPU, "1")))
        notes = pod["metadata"]["annotations"]
        memory = objects.GPU_MEMORY in res or objects.ANNOTATION_MEMORY_PERMILLE in notes
        variables = ["NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_SM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
        if memory:
            variables += (
                ["CUDA_DEVICE_MEMORY_LIMIT"] if count == 1 else [f"CUDA_DEVICE_MEMORY_LIMIT_{i}" for i in range(count)]
            )
            variables.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        env = container.setdefault("env", [])
        for variable in variables:
            env.append(
                {
                    "name": variable,
                    "valueFrom": {
                        "configMapKeyRef": {
                            "name": name,
                            "key": f"{container.get('name')}.{variable}",
                            # The GPU itself is required (the container waits for it); limits are optional.
                            "optional": variable != "NVIDIA_VISIBLE_DEVICES",
                        }
                    },
                }
            )
    return name


def _handoff_wired(pod: Json) -> bool:
    """Every GPU container already reads NVIDIA_VISIBLE_DEVICES from the pod's annotated hand-off."""
    name = ((pod.get("metadata") or {}).get("annotations") or {}).get(objects.ANNOTATION_HANDOFF)
    containers = _gpu_containers(pod)
    if not name or not containers:
        return False
    for container in containers:
        refs = [
            ((e.get("valueFrom") or {}).get("configMapKeyRef") or {})
            for e in container.get("env") or []
            if isinstance(e, dict) and e.get("name") == "NVIDIA_VISIBLE_DEVICES"
        ]
        if not any(r.get("name") == name for r in refs):
            return False
    return True


def mutate(review: Any, policy: Policy) -> Json:
    """The mutating decision for a Pod review."""
    uid = ""
    try:
        request = _request(review)
        uid = request["uid"]
        if request.get("operation") != "CREATE" or _skipped(request, policy):
            return _response(uid, True)
        pod = _pod(request)
        out, audit = translate.translate(pod)
        request_value = objects.pod_request(out)
        demand = request_value.demand
        if demand.count == 0:
            return _response(uid, True, patch=_patch(pod, out) if audit else None)
        meta = out.setdefault("metadata", {})
        notes = meta.setdefault("annotations", {})
        if not _is_system(request, policy) and not _handoff_wired(out):
            # Users never choose the hand-off ConfigMap: a fresh one is set below for sharing pods. (A pod
            # already wired to its annotation comes from an earlier invocation of this webhook; a forged
            # one gains nothing: the extender fills a ConfigMap for one claimant only.)
            notes.pop(objects.ANNOTATION_HANDOFF, None)
        spec = out.setdefault("spec", {})
        if spec.get("schedulerName") in (None, "", "default-scheduler"):
            spec["schedulerName"] = objects.SCHEDULER_NAME
        if demand.sharing and objects.ANNOTATION_HANDOFF not in notes:
            _add_handoff(out)
        if audit:
            notes[ANNOTATION_TRANSLATED] = "; ".join(audit)
        return _response(uid, True, patch=_patch(pod, out), audit={"translated": "; ".join(audit)} if audit else None)
    except errors.SharegpuError as exc:
        return _response(uid, False, f"sharegpu: {exc}", code=400)


def _patch(before: Json, after: Json) -> list[Json]:
    ops: list[Json] = jsonpatch.make_patch(before, after).patch
    return ops


def validate(review: Any, policy: Policy) -> Json:
    """The validating decision for a Pod review (runs after every mutation)."""
    uid = ""
    try:
        request = _request(review)
        uid = request["uid"]
        if _skipped(request, policy) or request.get("operation") not in ("CREATE", "UPDATE"):
            return _response(uid, True)
        pod = _pod(request)
        if not _is_system(request, policy):
            problem = _guard(request, pod)
            if problem:
                return _response(uid, False, f"sharegpu: {problem}", code=403)
        leftover = [
            (c.get("name"), k)
            for c in (pod.get("spec") or {}).get("containers") or []
            for k in translate.merged_resources(c)
            if any(k in keys for name, keys in translate.FORMATS.items() if name != "sharegpu")
        ]
        if leftover:
            name, key = leftover[0]
            return _response(uid, False, f"sharegpu: container {name}: {key} was not translated", code=400)
        request_value = objects.pod_request(pod)
        demand = request_value.demand
        largest = policy.largest_gpu_memory_mib
        if largest is not None and demand.memory_mib > largest:
            return _response(
                uid,
                False,
                f"sharegpu: the pod asks for {demand.memory_mib} MiB of GPU memory per GPU; the largest GPU in the "
                f"cluster has {largest} MiB ({policy.largest_gpu_model})",
                code=400,
            )
        if demand.models and policy.models and not demand.models & policy.models:
            return _response(
                uid,
                False,
                f"sharegpu: no GPU of model {', '.join(sorted(demand.models))} in the cluster "
                f"(models: {', '.join(sorted(policy.models))})",
                code=400,
            )
        return _response(uid, True)
    except errors.SharegpuError as exc:
        return _response(uid, False, f"sharegpu: {exc}", code=400)


def _guard(request: Json, pod: Json) -> str | None:
    """What a pod of an ordinary user may not do; None when it does none of it."""
    notes = (pod.get("metadata") or {}).get("annotations") or {}
    old = _pod(request, "oldObject") if request.get("operation") == "UPDATE" else None
    old_notes = ((old or {}).get("metadata") or {}).get("annotations") or {}
    for key in SYSTEM_ONLY_ANNOTATIONS:
        if request.get("operation") == "UPDATE":
            if notes.get(key) != old_notes.get(key):
                return f"annotation {key} is set by sharegpu only and cannot be changed"
        elif key in notes and key != objects.ANNOTATION_HANDOFF:
            return f"annotation {key} is set by sharegpu only"
    own = notes.get(objects.ANNOTATION_HANDOFF)
    spec = pod.get("spec") or {}
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        name = container.get("name")
        for env in container.get("env") or []:
            if not isinstance(env, dict):
                continue
            variable = str(env.get("name", ""))
            ref = ((env.get("valueFrom") or {}).get("configMapKeyRef")) or {}
            ours = own is not None and ref.get("name") == own and ref.get("key") == f"{name}.{variable}"
            if _is_isolation(variable) and not ours:
                return f"container {name}: {variable} is set by sharegpu only"
            if str(ref.get("name", "")).startswith(HANDOFF_PREFIX) and ref.get("name") != own:
                return f"container {name}: ConfigMap {ref.get('name')} is another pod's GPU hand-off"
        for source in container.get("envFrom") or []:
            target = ((source or {}).get("configMapRef") or {}).get("name", "")
            if str(target).startswith(HANDOFF_PREFIX):
                return f"container {name}: envFrom may not load a GPU hand-off ConfigMap ({target})"
    for volume in spec.get("volumes") or []:
        target = ((volume or {}).get("configMap") or {}).get("name", "")
        if str(target).startswith(HANDOFF_PREFIX):
            return f"volume {volume.get('name')}: may not mount a GPU hand-off ConfigMap ({target})"
    return None


def validate_device(review: Any, policy: Policy) -> Json:
    """Device resources (the node agent writes them) must describe a consistent inventory."""
    uid = ""
    try:
        request = _request(review)
        uid = request["uid"]
        if request.get("operation") not in ("CREATE", "UPDATE"):
            return _response(uid, True)
        device = request.get("object")
        if not isinstance(device, dict) or not isinstance(device.get("metadata"), dict):
            raise errors.InvalidInputError("the review carries no Device")
        inventory = objects.device_inventory(device, None)
        del inventory
        return _response(uid, True)
    except errors.SharegpuError as exc:
        return _response(uid, False, f"sharegpu: {exc}", code=400)


def review(kind: str, body: Any, policy: Policy) -> Json:
    if kind == "devices":
        return validate_device(body, policy)
    return mutate(body, policy) if kind == "mutate" else validate(body, policy)


__all__ = ["Policy", "mutate", "review", "validate"]
