"""Reviews sent by anyone on the pod network (the webhook's port is open to the API server, which
calls from anywhere): what the webhook reads with its own credentials to judge one must not come back
as another tenant's pod names or nodes."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import test_utils

from sharegpu.api import groups, paths, wire
from sharegpu.kube import client, fake
from sharegpu.webhook import admission, server
from tests.builders import MakePod

Json = dict[str, Any]
AGENT = "system:serviceaccount:sharegpu-system:sharegpu-agent"


def review(operation: str, namespace: str, name: str, **extra: Any) -> Json:
    request = {"uid": "u1", "operation": operation, "namespace": namespace, "name": name,
               "userInfo": {"username": "mallory"}, **extra}  # fmt: skip
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


async def test_a_forged_group_deletion_lists_no_member_of_a_namespace_the_group_does_not_admit() -> None:
    """The review's oldObject says the group admits `secret`; the stored group admits none: its
    labelled pods there are no members, and their names are not told."""
    api = fake.FakeApiServer()
    api.put_object(paths.pods("secret"), MakePod("training", "secret").labels(groups.group_labels("team", "g")).obj())
    hook = server.Webhook(admission.Policy())
    hook.kube = client.KubeClient(api)
    stored = {"apiVersion": "sharegpu.io/v1alpha1", "kind": "SharedDeviceGroup",
              "metadata": {"name": "g", "namespace": "team"}, "spec": {"gpus": 1}}  # fmt: skip
    hook.on_group(wire.EventType.ADDED, msgspec.convert(stored, groups.SharedDeviceGroup, str_keys=True))
    forged = {**stored, "spec": {"gpus": 1, "members": {"namespaces": ["secret"]}}}
    async with test_utils.TestClient(test_utils.TestServer(hook.app())) as http:
        answer = await (
            await http.post("/validate/groups", json=review("DELETE", "team", "g", oldObject=forged))
        ).json()
    assert answer["response"]["allowed"] is True, answer


async def test_a_forged_eviction_review_does_not_say_where_a_pod_runs() -> None:
    api = fake.FakeApiServer()
    api.put_object(paths.pods("secret"), MakePod("training", "secret").node("gpu-node-7").obj())
    hook = server.Webhook(admission.Policy(agent_users=frozenset({AGENT})))
    hook.kube = client.KubeClient(api)
    forged = review("CREATE", "secret", "training")
    forged["request"]["userInfo"] = {"username": AGENT,
                                     "extra": {"authentication.kubernetes.io/node-name": ["gpu-node-1"]}}  # fmt: skip
    async with test_utils.TestClient(test_utils.TestServer(hook.app())) as http:
        answer = await (await http.post("/validate/evictions", json=forged)).json()
    message = answer["response"]["status"]["message"]
    assert answer["response"]["allowed"] is False and "gpu-node-7" not in message, message
