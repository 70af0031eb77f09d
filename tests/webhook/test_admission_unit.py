from __future__ import annotations

import base64
from typing import Any

import jsonpatch
import orjson

from sharegpu.kube import objects
from sharegpu.webhook import admission

Json = dict[str, Any]
POLICY = admission.Policy(system_users=frozenset({"sharegpu-extender"}))


def review(pod: Json, user: str = "alice") -> Json:
    return {"request": {"uid": "u1", "operation": "CREATE", "namespace": "ns", "userInfo": {"username": user},
                        "object": pod}}  # fmt: skip


def applied(pod: Json, answer: Json) -> Json:
    response = answer["response"]
    assert response["allowed"], response
    if "patch" not in response:
        return pod
    result: Json = jsonpatch.apply_patch(pod, orjson.loads(base64.b64decode(response["patch"])))
    return result


def sharing_pod(annotations: dict[str, str] | None = None) -> Json:
    return {
        "metadata": {"name": "p", "annotations": dict(annotations or {})},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {"koordinator.sh/gpu-core": "30"}}}]},
    }


def test_reinvocation_is_idempotent() -> None:
    once = applied(sharing_pod(), admission.mutate(review(sharing_pod()), POLICY))
    twice = applied(once, admission.mutate(review(once), POLICY))
    assert twice == once
    env = twice["spec"]["containers"][0]["env"]
    assert [e["name"] for e in env].count("NVIDIA_VISIBLE_DEVICES") == 1


def test_a_user_cannot_choose_the_hand_off_configmap() -> None:
    forged = sharing_pod({objects.ANNOTATION_HANDOFF: "sharegpu-handoff-someone-else"})
    out = applied(forged, admission.mutate(review(forged), POLICY))
    name = out["metadata"]["annotations"][objects.ANNOTATION_HANDOFF]
    assert name != "sharegpu-handoff-someone-else"
    assert name.startswith(admission.HANDOFF_PREFIX)
    assert admission.validate(review(out), POLICY)["response"]["allowed"]


def test_cpu_only_pods_are_left_as_they_are() -> None:
    pod = {"metadata": {"name": "c"}, "spec": {"containers": [{"name": "main", "resources": {"limits": {"cpu": "1"}}}]}}
    answer = admission.mutate(review(pod), POLICY)
    assert applied(pod, answer) == pod
