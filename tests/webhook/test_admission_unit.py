from __future__ import annotations

import base64
from typing import Any

import jsonpatch
import msgspec
import orjson

from sharegpu.api import admission as messages
from sharegpu.api import names
from sharegpu.webhook import admission

Json = dict[str, Any]
POLICY = admission.Policy(system_users=frozenset({"sharegpu-extender"}))


def answer_of(answer: messages.ReviewResponse) -> Json:
    """The answer as the API server reads it (JSON)."""
    result: Json = orjson.loads(msgspec.json.encode(answer))
    return result


def review(pod: Json, user: str = "alice") -> Json:
    return {"request": {"uid": "u1", "operation": "CREATE", "namespace": "ns", "userInfo": {"username": user},
                        "object": pod}}  # fmt: skip


def applied(pod: Json, answer: messages.ReviewResponse) -> Json:
    response = answer_of(answer)["response"]
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
    forged = sharing_pod({names.HANDOFF: "sharegpu-handoff-someone-else"})
    out = applied(forged, admission.mutate(review(forged), POLICY))
    name = out["metadata"]["annotations"][names.HANDOFF]
    assert name != "sharegpu-handoff-someone-else"
    assert name.startswith(names.HANDOFF_PREFIX)
    assert admission.validate(review(out), POLICY).response.allowed


def test_cpu_only_pods_are_left_as_they_are() -> None:
    pod = {"metadata": {"name": "c"}, "spec": {"containers": [{"name": "main", "resources": {"limits": {"cpu": "1"}}}]}}
    answer = admission.mutate(review(pod), POLICY)
    assert applied(pod, answer) == pod
