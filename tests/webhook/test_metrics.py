"""The webhook's /metrics: every review answered is counted by kind and outcome (allowed, denied, and
error for a body that is no review or a review that could not be judged), and timed."""

from __future__ import annotations

import itertools
from typing import Any

from aiohttp import test_utils
from prometheus_client import parser

from sharegpu.api import admission as api_admission
from sharegpu.kube import client, fake
from sharegpu.webhook import admission, server

Json = dict[str, Any]
POLICY = admission.Policy(system_users=frozenset({"sharegpu-extender"}))


def review(obj: Json, operation: str = "CREATE", **extra: Any) -> Json:
    request = {"uid": "u1", "operation": operation, "namespace": "ns", "userInfo": {"username": "alice"}}
    return {"request": {**request, "object": obj, **extra}}


def koordinator_pod() -> Json:
    """A pod in another system's format: the mutating webhook translates it; unmutated, validation refuses it."""
    return {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {"koordinator.sh/gpu-core": "30"}}}]},
    }


def test_an_answer_is_allowed_denied_or_an_error() -> None:
    assert server.outcome(api_admission.allow("u")) == "allowed"
    assert server.outcome(api_admission.deny("u", "no", code=403)) == "denied"
    assert server.outcome(api_admission.deny("u", "malformed", code=400)) == "denied"
    assert server.outcome(api_admission.deny("u", "internal error", code=500)) == "error"


async def test_admissions_are_counted_by_kind_and_outcome() -> None:
    hook = server.Webhook(POLICY)
    async with test_utils.TestClient(test_utils.TestServer(hook.app())) as http:
        for _ in range(2):
            answer = await (await http.post("/mutate/pods", json=review(koordinator_pod()))).json()
            assert answer["response"]["allowed"] is True
        answer = await (await http.post("/validate/pods", json=review(koordinator_pod()))).json()
        assert answer["response"]["allowed"] is False and answer["response"]["status"]["code"] == 400
        assert (await http.post("/mutate/pods", data=b"{not json")).status == 400
        group = {"apiVersion": "sharegpu.io/v1alpha1", "kind": "SharedDeviceGroup", "metadata": {"name": "g"}}
        answer = await (
            await http.post("/validate/groups", json=review({}, "DELETE", name="g", oldObject=group))
        ).json()
        assert answer["response"]["status"]["code"] == 500, "no kubeconfig: the members cannot be listed"
        response = await http.get("/metrics")
        text = await response.text()
    assert response.status == 200
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    counted = {
        (s.labels["kind"], s.labels["outcome"]): s.value
        for s in families["sharegpu_webhook_admissions"].samples
        if s.name == "sharegpu_webhook_admissions_total"
    }
    # Every kind and outcome is listed from the start, at 0 (a series born at 1 shows no increase()).
    zeros: dict[tuple[str, str], float] = dict.fromkeys(itertools.product(server.Review, server.Verdict), 0.0)
    assert counted == {
        **zeros,
        ("mutate", "allowed"): 2,
        ("validate", "denied"): 1,
        ("mutate", "error"): 1,
        ("groups", "error"): 1,
    }
    assert len(counted) == 15
    durations = {
        s.labels["kind"]: s.value
        for s in families["sharegpu_webhook_admission_duration_seconds"].samples
        if s.name == "sharegpu_webhook_admission_duration_seconds_count"
    }
    assert durations == {"mutate": 3, "validate": 1, "groups": 1}


async def test_informer_readiness_is_on_metrics() -> None:
    hook = server.Webhook(POLICY)
    api = client.KubeClient(fake.FakeApiServer())
    hook.follow(api)  # not started: no informer has listed
    registry = hook.metrics.registry
    assert registry.get_sample_value("sharegpu_webhook_informer_ready", {"informer": "webhook-devices"}) == 0
    await api.close()
