"""Malformed and adversarial AdmissionReview bodies, and the invariants the webhook must keep on them.

`case(rng)` draws one body: a pod with GPU requests in every supported format, values of wrong types,
huge or negative numbers, unicode, missing or mistyped fields, system-only annotations and env, or a
body that is not a review at all. `violations(kind, body, response)` lists what the response gets
wrong: not a well-formed AdmissionReview, or an allowed pod whose resulting request is invalid.
Used by the Hypothesis suite and by bench/fuzz_admission.py.
"""

from __future__ import annotations

import base64
import copy
import random
from typing import Any

import jsonpatch
import msgspec
import orjson

from sharegpu.api import handoff, names, pods, wire
from sharegpu.core import errors
from sharegpu.webhook import translate

Json = dict[str, Any]

RESOURCE_KEYS = [
    *names.MANAGED_RESOURCES, names.NVIDIA_GPU, *translate.KOORD_CORE, *translate.KOORD_RATIO,
    *translate.KOORD_MEMORY, *translate.KOORD_SHARED, *translate.KOORD_GPU, translate.ALIYUN_MEMORY, translate.TKE_CORE,
    translate.TKE_MEMORY, translate.HAMI_MEMORY, translate.HAMI_MEMORY_PERCENT, translate.HAMI_CORES, "cpu", "memory",
    "example.com/foo",
]  # fmt: skip
ANNOTATION_KEYS = [
    *translate.KUBESHARE_KEYS, *translate.KUBESHARE_RULES, names.LIMIT_MILLI, names.MODELS,
    names.MEMORY_PERMILLE, names.AFFINITY, names.ANTI_AFFINITY,
    names.EXCLUSION, names.GROUP, *names.SYSTEM_ONLY_ANNOTATIONS, "note",
]  # fmt: skip
ENV_NAMES = [*sorted(handoff.PROTECTED), "CUDA_DEVICE_MEMORY_LIMIT_1", "PATH", "HOME"]


def _value(rng: random.Random) -> Any:
    choice = rng.random()
    if choice < 0.45:
        return str(
            rng.choice([0, 1, 2, 3, 4, 8, 10, 25, 30, 50, 99, 100, 150, 200, 250, 300, 500, 999, 1000, 1001, 4096])
        )
    if choice < 0.55:
        return rng.choice(["0.5", "1.0", "0.25", "1.5", "-1", "1e3", "8Gi", "500m", "2Ki", "1e400", "NaN", "inf"])
    if choice < 0.65:
        return str(rng.randint(-(10**30), 10**30))
    if choice < 0.75:
        return rng.choice([None, True, 3, 2.5, [], {}, {"a": 1}, ["1"]])
    if choice < 0.9:
        return "".join(rng.choice("0123456789.-+eEKiMGx ") for _ in range(rng.randint(0, 8)))
    return rng.choice(["🚀", "ｇｐｕ", "\x00", "a" * 300, "１００", "٣"])


def _container(rng: random.Random, name: str) -> Any:
    if rng.random() < 0.03:
        return rng.choice([None, "x", 5, []])
    limits = {rng.choice(RESOURCE_KEYS): _value(rng) for _ in range(rng.randint(0, 4))}
    container: Json = {"name": name, "image": "busybox", "resources": {"limits": limits}}
    if rng.random() < 0.2:
        container["resources"]["requests"] = {rng.choice(RESOURCE_KEYS): _value(rng)}
    if rng.random() < 0.05:
        container["resources"] = rng.choice([None, "x", [], {"limits": "x"}])
    if rng.random() < 0.2:
        env: list[Any] = []
        for _ in range(rng.randint(1, 3)):
            variable = rng.choice(ENV_NAMES)
            if rng.random() < 0.5:
                env.append({"name": variable, "value": str(_value(rng))})
            else:
                ref = {"name": rng.choice(["sharegpu-handoff-" + "0" * 16, "cm", None]), "key": f"{name}.{variable}"}
                env.append({"name": variable, "valueFrom": {"configMapKeyRef": ref}})
        container["env"] = rng.choice([env, env, "x"])
    return container


def pod(rng: random.Random) -> Any:
    if rng.random() < 0.03:
        return rng.choice([None, [], "pod", 7])
    containers = [_container(rng, f"c{i}") for i in range(rng.randint(0, 3))]
    spec: Any = {"containers": containers}
    if rng.random() < 0.2:
        spec["initContainers"] = [_container(rng, "init")]
    if rng.random() < 0.05:
        spec = rng.choice([None, "x", [], {"containers": "x"}])
    annotations: Any = {rng.choice(ANNOTATION_KEYS): _value(rng) for _ in range(rng.randint(0, 3))}
    if rng.random() < 0.5:
        annotations = {k: str(v) for k, v in annotations.items()}
    meta: Any = {"name": "p", "namespace": "ns", "annotations": annotations}
    if rng.random() < 0.05:
        meta = rng.choice([None, "x", {"annotations": "x"}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def case(rng: random.Random) -> tuple[str, Any]:
    """(kind, body): kind is "mutate" or "validate"."""
    kind = rng.choice(["mutate", "validate"])
    if rng.random() < 0.05:
        return kind, rng.choice([None, [], "review", 1, {"request": None}, {"request": {"uid": 5}}, {}])
    obj = pod(rng)
    request: Json = {
        "uid": rng.choice([f"uid-{rng.randint(0, 10**6)}", "", "ü"]),
        "operation": rng.choice(["CREATE", "CREATE", "CREATE", "UPDATE", "DELETE", None]),
        "namespace": rng.choice(["ns", "ns", "kube-system", None]),
        "userInfo": {"username": rng.choice(["alice", "sharegpu-extender", None])},
        "object": obj,
    }
    if request["operation"] == "UPDATE":
        request["oldObject"] = copy.deepcopy(obj) if rng.random() < 0.7 else pod(rng)
    if rng.random() < 0.05:
        del request[rng.choice(list(request))]
    return kind, {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def violations(kind: str, body: Any, answer_message: Any) -> list[str]:
    """What is wrong with the answer to `body` (a ReviewResponse, or its JSON); empty when the webhook behaved."""
    problems: list[str] = []
    response = orjson.loads(msgspec.json.encode(answer_message))
    if not isinstance(response, dict) or response.get("kind") != "AdmissionReview":
        return ["not an AdmissionReview"]
    answer = response.get("response")
    if (
        not isinstance(answer, dict)
        or not isinstance(answer.get("allowed"), bool)
        or not isinstance(answer.get("uid"), str)
    ):
        return ["response lacks uid or allowed"]
    try:
        orjson.dumps(response)
    except TypeError as exc:
        return [f"response is not JSON: {exc}"]
    request = body.get("request") if isinstance(body, dict) else None
    if not answer["allowed"]:
        message = str((answer.get("status") or {}).get("message") or "")
        if not message:
            problems.append("a refusal without a message")
        if "internal error" in message:
            problems.append(f"the handler failed: {message}")
        return problems
    if not isinstance(request, dict) or request.get("namespace") in ("kube-system",):
        return problems
    if request.get("operation") not in ("CREATE", "UPDATE") or not isinstance(request.get("object"), dict):
        return problems
    result = request["object"]
    if "patch" in answer:
        try:
            ops = orjson.loads(base64.b64decode(answer["patch"]))
            result = jsonpatch.apply_patch(request["object"], ops)
        except Exception as exc:
            return [f"the patch does not apply: {exc}"]
    elif kind == "mutate" and request.get("operation") != "CREATE":
        return problems
    try:
        parsed = pods.request(wire.convert(result, wire.Pod))
    except errors.SharegpuError as exc:
        problems.append(f"allowed an invalid GPU request: {exc}")
        return problems
    except Exception as exc:
        problems.append(f"allowed a pod sharegpu cannot read: {type(exc).__name__}: {exc}")
        return problems
    typed = wire.convert(result, wire.Pod)
    for _, container in pods.containers(typed):
        leftover = [k for k in container.resources.merged() if k in translate.FOREIGN]
        if kind == "mutate" and leftover:
            problems.append(f"allowed untranslated resources {leftover}")
    del parsed
    return problems
