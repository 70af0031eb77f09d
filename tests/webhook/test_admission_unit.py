from __future__ import annotations

import base64
import copy
import dataclasses
from typing import Any

import jsonpatch
import msgspec
import orjson
import pytest

from sharegpu.api import admission as api_admission
from sharegpu.api import budgets, dra, gangs, groups, names, paths, podgroups, wire
from sharegpu.kube import client, fake
from sharegpu.webhook import admission, server
from tests.builders import MakePod

Json = dict[str, Any]
POLICY = admission.Policy(system_users=frozenset({"sharegpu-extender"}))


def answer_of(answer: api_admission.ReviewResponse) -> Json:
    """The answer as the API server reads it (JSON)."""
    result: Json = orjson.loads(msgspec.json.encode(answer))
    return result


def review(pod: Json, user: str = "alice") -> Json:
    return {"request": {"uid": "u1", "operation": "CREATE", "namespace": "ns", "userInfo": {"username": user},
                        "object": pod}}  # fmt: skip


def applied(pod: Json, answer: api_admission.ReviewResponse) -> Json:
    response = answer_of(answer)["response"]
    assert response["allowed"], response
    if "patch" not in response:
        return pod
    result: Json = jsonpatch.apply_patch(pod, orjson.loads(base64.b64decode(response["patch"])))
    return result


def sharing_pod(annotations: dict[str, str] | None = None) -> Json:
    """A pod asking for 30% of a GPU the Koordinator way (the webhook translates it)."""
    return MakePod("p").annotations(annotations or {}).container(limits={"koordinator.sh/gpu-core": "30"}).obj()


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


def test_a_refusal_names_the_pod_as_the_api_server_will_store_it() -> None:
    """At creation the pod's namespace comes from the request (kubectl run leaves it out of the
    object) and a pod made from generateName has no name yet: the message names both anyway."""
    bad = {"spec": {"containers": [{"name": "c", "resources": {"limits": {names.GPU_MILLI: "1500"}}}]}}
    named = {**bad, "metadata": {"name": "bad"}}
    response = answer_of(admission.mutate(review(named), POLICY))["response"]
    message = response["status"]["message"]
    assert not response["allowed"]
    assert "pod ns/bad, container c: sharegpu.io/gpu-milli must be an integer in 1..1000" in message
    generated = {**bad, "metadata": {"generateName": "web-"}}
    response = answer_of(admission.mutate(review(generated), POLICY))["response"]
    assert "pod ns/web-*, container c:" in response["status"]["message"]
    ok = sharing_pod()
    assert "namespace" not in applied(ok, admission.mutate(review(ok), POLICY))["metadata"], "nothing added"


def visible(container: Json) -> list[Json]:
    return [e for e in container.get("env") or [] if e["name"] == "NVIDIA_VISIBLE_DEVICES"]


VOID = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]


def test_cpu_only_pods_see_no_gpu_and_are_otherwise_left_as_they_are() -> None:
    pod = {"metadata": {"name": "c"}, "spec": {
        "initContainers": [{"name": "init", "env": [{"name": "A", "value": "1"}]}],
        "containers": [{"name": "main", "resources": {"limits": {"cpu": "1"}}}],
    }}  # fmt: skip
    out = applied(pod, admission.mutate(review(pod), POLICY))
    assert out["spec"]["initContainers"][0]["env"] == [{"name": "A", "value": "1"}, *VOID]
    assert visible(out["spec"]["containers"][0]) == VOID
    out["spec"]["initContainers"][0]["env"].pop()
    del out["spec"]["containers"][0]["env"]
    assert out == pod, "nothing else changes, no empty annotations"
    assert admission.validate(review(applied(pod, admission.mutate(review(pod), POLICY))), POLICY).response.allowed
    again = applied(pod, admission.mutate(review(pod), POLICY))
    assert applied(again, admission.mutate(review(again), POLICY)) == again, "reinvocation changes nothing"


def test_an_author_s_gpu_visibility_on_a_container_given_no_gpu_is_replaced_and_said() -> None:
    pod = {"metadata": {"name": "c"}, "spec": {"containers": [
        {"name": "main", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
    ]}}  # fmt: skip
    out = applied(pod, admission.mutate(review(pod), POLICY))
    assert visible(out["spec"]["containers"][0]) == VOID
    assert "container main: NVIDIA_VISIBLE_DEVICES all -> void" in out["metadata"]["annotations"][names.TRANSLATED]
    assert not admission.validate(review(pod), POLICY).response.allowed, "unmutated, 'all' is still refused"


def test_a_sharing_pod_s_sidecar_sees_no_gpu_and_a_whole_gpu_container_keeps_the_device_plugin_s() -> None:
    pod = sharing_pod()
    pod["spec"]["containers"].append({"name": "sidecar"})
    out = applied(pod, admission.mutate(review(pod), POLICY))
    main, sidecar = out["spec"]["containers"]
    assert [e["valueFrom"]["configMapKeyRef"]["key"] for e in visible(main)] == ["main.NVIDIA_VISIBLE_DEVICES"]
    assert visible(sidecar) == VOID
    assert admission.validate(review(out), POLICY).response.allowed
    whole = {"metadata": {"name": "w"}, "spec": {"containers": [
        {"name": "train", "resources": {"limits": {"nvidia.com/gpu": "1"}}}, {"name": "log"},
    ]}}  # fmt: skip
    train, log = applied(whole, admission.mutate(review(whole), POLICY))["spec"]["containers"]
    assert visible(train) == [] and visible(log) == VOID
    mig = {"metadata": {"name": "mig"}, "spec": {"containers": [
        {"name": "infer", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}, {"name": "log"},
    ]}}  # fmt: skip
    infer, log = applied(mig, admission.mutate(review(mig), POLICY))["spec"]["containers"]
    assert visible(infer) == [] and visible(log) == VOID, "a MIG device is the device plugin's to show"
    for where in ("containers", "initContainers"):  # 0 of a MIG resource: the device plugin gives nothing
        spec: Json = {"containers": [{"name": "c"}]}
        spec[where] = [{"name": "z", "resources": {"limits": {"nvidia.com/mig-anything": "0"}}}]
        zero: Json = {"metadata": {"name": "z"}, "spec": spec}
        out = applied(zero, admission.mutate(review(zero), POLICY))
        assert visible(out["spec"][where][0]) == VOID, f"{where}: the image's `all` would stand"
    mirror: Json = {"metadata": {"name": "m", "annotations": {admission.MIRROR: "x"}}}
    mirror["spec"] = {"containers": [{"name": "a"}]}
    assert visible(applied(mirror, admission.mutate(review(mirror), POLICY))["spec"]["containers"][0]) == []


def test_a_sharing_container_preloads_hami_core_before_its_authors_library() -> None:
    pod = sharing_pod({names.ISOLATION: "hami-core"})
    pod["spec"]["containers"][0]["env"] = [{"name": "LD_PRELOAD", "value": "/lib/libjemalloc.so"}]
    pod["spec"]["containers"].append({"name": "sidecar", "env": [{"name": "LD_PRELOAD", "value": "/lib/x.so"}]})
    out = applied(pod, admission.mutate(review(pod), POLICY))
    main, sidecar = out["spec"]["containers"]
    names_ = [e["name"] for e in main["env"]]
    assert main["env"][-1] == {"name": "LD_PRELOAD", "value": "$(SHAREGPU_PRELOAD) /lib/libjemalloc.so"}
    assert names_.index("SHAREGPU_PRELOAD") < names_.index("LD_PRELOAD"), "defined before LD_PRELOAD reads it"
    cm = out["metadata"]["annotations"][names.HANDOFF]
    assert (
        main["env"][names_.index("SHAREGPU_PRELOAD")]["valueFrom"]["configMapKeyRef"]["key"] == "main.SHAREGPU_PRELOAD"
    )
    assert cm == main["env"][names_.index("SHAREGPU_PRELOAD")]["valueFrom"]["configMapKeyRef"]["name"]
    assert {"name": "LD_PRELOAD", "value": "/lib/x.so"} in sidecar["env"], "a container given no GPU keeps its own"
    assert "volumeMounts" not in sidecar
    assert (
        "LD_PRELOAD /lib/libjemalloc.so preloaded after HAMi-core" in out["metadata"]["annotations"][names.TRANSLATED]
    )
    assert admission.validate(review(out), POLICY).response.allowed
    forged = sharing_pod()
    forged["spec"]["containers"][0]["env"] = [{"name": "SHAREGPU_PRELOAD", "value": ""}]
    wired = applied(forged, admission.mutate(review(forged), POLICY))
    assert [e["name"] for e in wired["spec"]["containers"][0]["env"]].count("SHAREGPU_PRELOAD") == 1
    refused = admission.validate(review(forged), POLICY).response
    assert (
        not refused.allowed
        and refused.status is not None
        and "SHAREGPU_PRELOAD is set by sharegpu only" in (refused.status.message)
    )


def gpu_pod(spec: Json | None = None) -> Json:
    body = sharing_pod()
    body["spec"].update(spec or {})
    return body


def test_gpu_pods_for_the_schedulers_sharegpu_replaces_are_taken_over_and_say_so() -> None:
    for named in ("koord-scheduler", "kai-scheduler", "volcano", "deviceshare-scheduler"):
        response = admission.mutate(review(gpu_pod({"schedulerName": named})), POLICY)
        out = applied(gpu_pod({"schedulerName": named}), response)
        assert out["spec"]["schedulerName"] == names.SCHEDULER_NAME
        assert f"schedulerName {named} -> {names.SCHEDULER_NAME}" in out["metadata"]["annotations"][names.TRANSLATED]
        assert f"schedulerName {named}" in (response.response.audit_annotations or {})["translated"]
    mine = gpu_pod({"schedulerName": "my-own-scheduler"})
    assert applied(mine, admission.mutate(review(mine), POLICY))["spec"]["schedulerName"] == "my-own-scheduler"
    narrower = admission.Policy(system_users=POLICY.system_users, take_over=frozenset({"default-scheduler"}))
    koord = gpu_pod({"schedulerName": "koord-scheduler"})
    assert applied(koord, admission.mutate(review(koord), narrower))["spec"]["schedulerName"] == "koord-scheduler"


def test_a_gpu_pod_bound_to_a_node_by_its_author_is_placed_by_sharegpu_on_that_node() -> None:
    zone = [{"key": "zone", "operator": "In", "values": ["a"]}]
    terms: list[Json] = [{"matchExpressions": zone}, {"matchFields": []}]
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
    body = gpu_pod({"nodeName": "gpu-7", "affinity": {"nodeAffinity": required}})
    out = applied(body, admission.mutate(review(body), POLICY))
    assert "nodeName" not in out["spec"]
    found = out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    pin = {"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}
    assert [t["matchFields"] for t in found] == [[pin], [pin]], "each alternative keeps its own rules and the node"
    assert found[0]["matchExpressions"] == zone
    assert "spec.nodeName gpu-7" in out["metadata"]["annotations"][names.TRANSLATED]
    again = applied(out, admission.mutate(review(out), POLICY))
    assert again["spec"]["affinity"] == out["spec"]["affinity"], "reinvocation adds nothing"
    plain = gpu_pod({"nodeName": "gpu-7"})
    pinned = applied(plain, admission.mutate(review(plain), POLICY))["spec"]["affinity"]
    only = pinned["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert only == {"nodeSelectorTerms": [{"matchFields": [pin]}]}


def test_mirror_pods_and_cpu_pods_keep_their_node() -> None:
    mirror = gpu_pod({"nodeName": "gpu-7"})
    mirror["metadata"]["annotations"][admission.MIRROR] = "abc"
    assert applied(mirror, admission.mutate(review(mirror), POLICY))["spec"]["nodeName"] == "gpu-7"
    cpu = {"metadata": {"name": "c"}, "spec": {"nodeName": "n1", "containers": [{"name": "main"}]}}
    assert applied(cpu, admission.mutate(review(cpu), POLICY))["spec"]["nodeName"] == "n1"


def limits_of(pod: Json, position: int = 0) -> dict[str, str]:
    limits: dict[str, str] = pod["spec"]["containers"][position]["resources"]["limits"]
    return limits


def test_every_gpu_container_carries_its_whole_use_for_quotas() -> None:
    """A ResourceQuota counts a resource once per container: 3 GPUs at 500 milli must count 1500."""
    three = gpu_pod()
    three["spec"]["containers"][0]["resources"]["limits"] = {
        names.GPU: "3", names.GPU_MILLI: "500", names.GPU_MEMORY: "2048", names.GPU_MILLI_TOTAL: "1"
    }  # fmt: skip
    three["spec"]["containers"].append({"name": "cpu", "resources": {"limits": {"cpu": "1"}}})
    out = applied(three, admission.mutate(review(three), POLICY))
    assert limits_of(out)[names.GPU_MILLI_TOTAL] == "1500", "a forged total is replaced"
    assert limits_of(out)[names.GPU_MEMORY_TOTAL] == "6144"
    assert out["spec"]["containers"][0]["resources"]["requests"][names.GPU_MILLI_TOTAL] == "1500"
    assert names.GPU_MILLI_TOTAL not in limits_of(out, 1)
    whole = gpu_pod()
    whole["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "2"}
    made = applied(whole, admission.mutate(review(whole), POLICY))
    assert limits_of(made)[names.GPU_MILLI_TOTAL] == "2000" and names.GPU_MEMORY_TOTAL not in limits_of(made)
    assert admission.validate(review(out), POLICY).response.allowed
    out["spec"]["containers"][0]["resources"]["limits"][names.GPU_MILLI_TOTAL] = "500"
    refused = admission.validate(review(out), POLICY).response
    assert not refused.allowed and refused.status is not None and "expected" in refused.status.message


def exhausted(action: str, namespace: str = "ns", state: str = "Exhausted") -> budgets.GPUBudget:
    return budgets.GPUBudget(
        metadata=wire.ObjectMeta(name="team-budget", namespace=namespace),
        spec=budgets.BudgetSpec(gpu_hours=20, when_exhausted=action),  # type: ignore[arg-type]
        status=budgets.BudgetStatus(
            state=state,  # type: ignore[arg-type]
            used_gpu_seconds=72_000,
            period_start="2026-11-01T00:00:00Z",
            period_end="2026-12-01T00:00:00Z",
        ),
    )


def with_budgets(*items: budgets.GPUBudget, classes: dict[str, int] | None = None) -> admission.Policy:
    grouped: dict[str, tuple[budgets.GPUBudget, ...]] = {}
    for item in items:
        grouped[item.metadata.namespace] = (*grouped.get(item.metadata.namespace, ()), item)
    known = {name: admission.PriorityClass(value, "Never") for name, value in (classes or {}).items()}
    return dataclasses.replace(POLICY, budgets=grouped, priority_classes=known)


def test_an_exhausted_deny_budget_refuses_new_gpu_pods_with_its_figures_and_the_fix() -> None:
    policy = with_budgets(exhausted("Deny"))
    response = answer_of(admission.mutate(review(gpu_pod()), policy))["response"]
    assert not response["allowed"]
    message = response["status"]["message"]
    assert "GPUBudget ns/team-budget: 20.00 of 20 GPU-hours used" in message
    assert "until 2026-12-01T00:00:00Z" in message and "raise spec.gpuHours" in message
    # CPU pods, other namespaces and budgets not yet used up are not concerned.
    assert answer_of(admission.mutate(review({"metadata": {"name": "c"}, "spec": {"containers": [{"name": "m"}]}}),
                                      policy))["response"]["allowed"]  # fmt: skip
    assert answer_of(admission.mutate(review(gpu_pod()), with_budgets(exhausted("Deny", "other"))))["response"][
        "allowed"
    ]
    assert answer_of(admission.mutate(review(gpu_pod()), with_budgets(exhausted("Deny", state="Warning"))))["response"][
        "allowed"
    ]


def test_an_exhausted_demote_budget_moves_new_gpu_pods_to_its_priority_class() -> None:
    policy = with_budgets(exhausted("Demote"), classes={"sharegpu-over-budget": -1000})
    pod = gpu_pod({"priority": 0, "priorityClassName": ""})
    out = applied(pod, admission.mutate(review(pod), policy))
    assert out["spec"]["priorityClassName"] == "sharegpu-over-budget"
    assert out["spec"]["priority"] == -1000
    assert out["spec"]["preemptionPolicy"] == "Never"
    assert "GPUBudget ns/team-budget" in out["metadata"]["annotations"][names.DEMOTED]
    assert "demoted to PriorityClass sharegpu-over-budget" in out["metadata"]["annotations"][names.TRANSLATED]
    # Already lower: left alone. The class missing: refused, naming it.
    low = gpu_pod({"priority": -5000, "priorityClassName": "batch-low"})
    assert applied(low, admission.mutate(review(low), policy))["spec"]["priorityClassName"] == "batch-low"
    missing = answer_of(admission.mutate(review(gpu_pod()), with_budgets(exhausted("Demote"))))["response"]
    assert (
        not missing["allowed"]
        and "PriorityClass sharegpu-over-budget, which does not exist" in missing["status"]["message"]
    )


def test_an_allow_budget_only_reports() -> None:
    out = applied(gpu_pod(), admission.mutate(review(gpu_pod()), with_budgets(exhausted("Allow"))))
    assert "priorityClassName" not in out["spec"]


def cluster_exhausted(action: str, org: str = "research") -> budgets.ClusterGPUBudget:
    return budgets.ClusterGPUBudget(
        metadata=wire.ObjectMeta(name="research"),
        spec=budgets.ClusterBudgetSpec(
            gpu_hours=20, when_exhausted=action,  # type: ignore[arg-type]
            namespace_selector=wire.LabelSelector(match_labels={"org": org}),
        ),
        status=exhausted(action).status,
    )  # fmt: skip


def namespace(name: str, **labels: str) -> wire.Namespace:
    return wire.Namespace(metadata=wire.ObjectMeta(name=name, labels=labels))


async def test_a_cluster_budget_governs_the_namespaces_its_selector_picks_as_their_labels_change() -> None:
    hook = server.Webhook(POLICY)
    hook.on_namespace(wire.EventType.ADDED, namespace("ns", org="research"))
    hook.on_namespace(wire.EventType.ADDED, namespace("other", org="sales"))
    hook.on_cluster_budget(wire.EventType.ADDED, cluster_exhausted("Deny"))

    def allowed(ns: str) -> bool:
        body = review(gpu_pod())
        body["request"]["namespace"] = ns
        return bool(answer_of(server.handle_review("mutate", body, hook.policy))["response"]["allowed"])

    refused = answer_of(server.handle_review("mutate", review(gpu_pod()), hook.policy))["response"]
    assert "ClusterGPUBudget research: 20.00 of 20 GPU-hours used" in refused["status"]["message"]
    assert allowed("other")
    hook.on_namespace(wire.EventType.MODIFIED, namespace("ns", org="sales"))
    assert allowed("ns")
    hook.on_namespace(wire.EventType.MODIFIED, namespace("other", org="research"))
    assert not allowed("other")
    hook.on_cluster_budget(wire.EventType.DELETED, cluster_exhausted("Deny"))
    assert allowed("other") and hook.policy.namespace_labels == {}  # labels kept only while needed


async def test_a_pod_of_a_namespace_not_seen_yet_is_judged_with_its_labels_read_from_the_api() -> None:
    api = fake.FakeApiServer()
    api.put_object(paths.NAMESPACES, {"metadata": {"name": "new", "labels": {"org": "research"}}})
    hook = server.Webhook(POLICY)
    hook.kube = client.KubeClient(api)
    hook.on_cluster_budget(wire.EventType.ADDED, cluster_exhausted("Deny"))
    body = review(gpu_pod())
    body["request"]["namespace"] = "new"
    await hook._learn_namespace(body)
    assert not answer_of(server.handle_review("mutate", body, hook.policy))["response"]["allowed"]
    # A namespace the API does not know (or cannot say): judged without labels, not crashed.
    body["request"]["namespace"] = "missing"
    await hook._learn_namespace(body)
    assert answer_of(server.handle_review("mutate", body, hook.policy))["response"]["allowed"]
    await hook.kube.close()


def group(namespace: str = "ns", name: str = "g", allowed: tuple[str, ...] = ()) -> groups.SharedDeviceGroup:
    return groups.SharedDeviceGroup(
        metadata=wire.ObjectMeta(name=name, namespace=namespace),
        spec=groups.GroupSpec(gpus=2, members=groups.Members(namespaces=list(allowed))),
    )


def member_pod(value: str, extra: Json | None = None) -> Json:
    return {
        "metadata": {"name": "m", "namespace": "ns", "annotations": {names.DEVICE_GROUP_ANNOTATION: value}},
        "spec": {"containers": [{"name": "main", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                                 **(extra or {})}], "initContainers": [{"name": "init"}]},
    }  # fmt: skip


def test_a_shared_device_group_projects_pod_joins_the_mirror_and_leaves_its_scheduler() -> None:
    policy = dataclasses.replace(POLICY, groups={"ns/g": group()})
    pod = member_pod("ignored")
    pod["metadata"]["annotations"] = {"deviceshare.io/group": "g"}
    pod["spec"]["schedulerName"] = "deviceshare-scheduler"
    answer = admission.mutate(review(pod), policy)
    out = applied(pod, answer)
    assert out["metadata"]["labels"] == {names.LABEL_GROUP_NAMESPACE: "ns", names.LABEL_GROUP_NAME: "g"}
    assert out["spec"]["nodeSelector"] == {groups.node_label("ns", "g"): "true"}
    assert out["spec"]["schedulerName"] == names.SCHEDULER_NAME
    assert "deviceshare-scheduler -> sharegpu-scheduler" in out["metadata"]["annotations"][names.TRANSLATED]
    assert admission.validate(review(out), policy).response.allowed
    # Two annotations naming two groups: refused, naming both.
    pod["metadata"]["annotations"][names.DEVICE_GROUP_ANNOTATION] = "h"
    refused = admission.mutate(review(pod), policy).response
    assert not refused.allowed and refused.status is not None
    assert "name different groups" in refused.status.message


def test_a_member_selects_its_groups_node_and_reads_its_devices_from_the_groups_configmap() -> None:
    policy = dataclasses.replace(POLICY, groups={"ns/g": group()})
    pod = member_pod("g")
    out = applied(pod, admission.mutate(review(pod), policy))
    assert out["metadata"]["labels"] == {names.LABEL_GROUP_NAMESPACE: "ns", names.LABEL_GROUP_NAME: "g"}
    assert out["spec"]["nodeSelector"] == {groups.node_label("ns", "g"): "true"}
    assert out["spec"]["schedulerName"] == names.SCHEDULER_NAME
    source = groups.handoff_name("ns", "g")
    reference = {"configMapKeyRef": {"name": source, "key": "NVIDIA_VISIBLE_DEVICES"}}
    limits = [
        {"name": v, "valueFrom": {"configMapKeyRef": {"name": source, "key": v, "optional": True}}}
        for v in ("CUDA_DEVICE_SM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_DEVICE_MEMORY_LIMIT",
                  "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    ]  # fmt: skip
    for container in out["spec"]["containers"] + out["spec"]["initContainers"]:
        # The devices are required (the container waits for them); a share group's limits optional.
        assert container["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": reference}, *limits]
    assert admission.validate(review(out), policy).response.allowed
    # A limit of the author's own in place of the group's is refused.
    lifted = {**out, "spec": {**out["spec"], "containers": [dict(out["spec"]["containers"][0])]}}
    lifted["spec"]["containers"][0]["env"] = [
        *out["spec"]["containers"][0]["env"][:1],
        {"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"},
    ]
    refused = admission.validate(review(lifted), policy).response
    assert not refused.allowed and refused.status is not None and "CUDA_DEVICE_SM_LIMIT" in refused.status.message
    # Forging the labels, or reading another group's devices, is refused.
    forged = {**out, "metadata": {**out["metadata"], "annotations": {}}}
    assert not admission.validate(review(forged), policy).response.allowed
    other = member_pod("ns/other")
    stolen = applied(other, admission.mutate(review(other), policy))
    stolen["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": reference}]
    assert not admission.validate(review(stolen), policy).response.allowed


def test_who_may_join_and_what_a_member_may_not_ask_for() -> None:
    policy = dataclasses.replace(POLICY, groups={"team/g": group("team", allowed=("friends",))})
    refused = answer_of(admission.mutate(review(member_pod("team/g")), policy))["response"]
    assert (
        not refused["allowed"] and "namespace ns may not join SharedDeviceGroup team/g" in refused["status"]["message"]
    )
    greedy = member_pod("g", {"resources": {"limits": {names.GPU: "1", names.GPU_MILLI: "500"}}})
    answer = answer_of(admission.mutate(review(greedy), dataclasses.replace(POLICY, groups={"ns/g": group()})))
    assert not answer["response"]["allowed"] and "remove its GPU resources" in answer["response"]["status"]["message"]
    malformed = answer_of(admission.mutate(review(member_pod("a/b/c")), POLICY))["response"]
    assert not malformed["allowed"] and "namespace/name" in malformed["status"]["message"]
    # A group the webhook has not seen yet: admitted, and the pod waits for it.
    waiting = applied(member_pod("later"), admission.mutate(review(member_pod("later")), POLICY))
    assert "not found yet" in waiting["metadata"]["annotations"][names.TRANSLATED]


def test_a_group_with_live_members_cannot_be_deleted() -> None:
    body = {"request": {"uid": "u", "operation": "DELETE", "namespace": "ns", "name": "g"}}
    refused = answer_of(admission.validate_group(body, ["ns/m0", "ns/m1"]))["response"]
    assert not refused["allowed"]
    assert refused["status"]["message"] == (
        "sharegpu: SharedDeviceGroup ns/g still has 2 member pod(s): ns/m0, ns/m1; delete them first"
    )
    assert admission.validate_group(body, []).response.allowed


def _group_update(old_spec: Json, new_spec: Json, node: str = "", api: str = "sharegpu.io/v1alpha1") -> Json:
    status = {"phase": "Bound", "nodeName": node} if node else {}
    old = {"apiVersion": api, "kind": "SharedDeviceGroup", "metadata": {"name": "g", "namespace": "ns"},
           "spec": old_spec, "status": status}  # fmt: skip
    new = {**old, "spec": new_spec}
    return {"request": {"uid": "u", "operation": "UPDATE", "namespace": "ns", "name": "g",
                        "object": new, "oldObject": old}}  # fmt: skip


def test_a_bound_group_s_placement_cannot_change_and_the_rest_can() -> None:
    spec = {"gpus": 2, "share": {"milli": 500, "memoryMiB": 4096}, "members": {"namespaces": ["a"]}}
    for changed, field in (
        ({**spec, "gpus": 3}, "gpus"),
        ({k: v for k, v in spec.items() if k != "share"}, "share"),
        ({**spec, "share": {"milli": 600, "memoryMiB": 4096}}, "share"),
        ({**spec, "nodeSelector": {"pool": "b"}}, "nodeSelector"),
        ({**spec, "models": ["A100"]}, "models"),
        ({**spec, "schedulingStrategy": "spread"}, "schedulingStrategy"),
    ):
        refused = answer_of(admission.validate_group(_group_update(spec, changed, node="n1"), []))["response"]
        assert not refused["allowed"], field
        assert refused["status"]["message"] == (
            f"sharegpu: SharedDeviceGroup ns/g is bound to node n1; spec {field} cannot change while it is bound "
            "(its holder pod and members run with them): delete the group and create it anew"
        )
        # Not bound yet: the controller replaces the holder made for the old spec.
        assert admission.validate_group(_group_update(spec, changed), []).response.allowed
    loose = {**spec, "members": {"namespaces": ["a", "b"]}, "bindEagerly": True}
    assert admission.validate_group(_group_update(spec, loose, node="n1"), []).response.allowed
    # The shared-device-group project's kind: its spec is all placement.
    compat = _group_update({"resources": {"nvidia.com/gpu": 1}}, {"resources": {"nvidia.com/gpu": 2}}, node="n1",
                           api="deviceshare.io/v1alpha1")  # fmt: skip
    message = answer_of(admission.validate_group(compat, []))["response"]["status"]["message"]
    assert "is bound to node n1; spec resources cannot change" in message


def test_a_namespace_leaves_a_group_only_without_live_members_there() -> None:
    body = _group_update({"gpus": 1, "members": {"namespaces": ["a", "b", "ns"]}},
                         {"gpus": 1, "members": {"namespaces": ["b"]}}, node="n1")  # fmt: skip
    request = api_admission.review(body).request
    assert admission.leaving_namespaces(request) == ["a"]  # the group's own namespace never leaves
    refused = answer_of(admission.validate_group(body, ["a/m0"]))["response"]
    assert not refused["allowed"]
    assert refused["status"]["message"] == (
        "sharegpu: SharedDeviceGroup ns/g: namespace(s) a cannot leave spec.members.namespaces while pods there "
        "are its members: 1 in namespace a; delete them first"
    ), "another namespace's pods are counted, not named"
    assert admission.validate_group(body, []).response.allowed


def test_a_pod_demanding_mps_is_wired_to_its_gpu_s_mps_directory() -> None:
    pod = sharing_pod({names.ISOLATION: "mps"})
    out = applied(pod, admission.mutate(review(pod), POLICY))
    assert out["metadata"]["annotations"][names.HANDOFF].startswith(names.HANDOFF_PREFIX)
    main = out["spec"]["containers"][0]
    env = {e["name"]: e for e in main["env"]}
    assert "SHAREGPU_MPS_GPU" not in env, "the GPU's folder is chosen node-side, not by a variable"
    assert env["CUDA_MPS_PIPE_DIRECTORY"]["value"] == "/run/sharegpu/mps/pipe"
    assert main["volumeMounts"] == [
        {"name": "sharegpu-mps-0", "mountPath": "/run/sharegpu/mps", "readOnly": True}
    ], "the GPU's tenant folder (a link to the daemon's control socket alone), read-only"  # fmt: skip
    assert "CUDA_MPS_LOG_DIRECTORY" not in env
    assert out["spec"]["volumes"] == [
        {"name": "sharegpu-mps-0", "csi": {"driver": "volumes.sharegpu.io", "readOnly": True,
                                           "volumeAttributes": {"folder": "mps", "container": "main"}}}
    ], "an inline volume the agent binds from the node: no hostPath, so PodSecurity restricted admits it"  # fmt: skip
    assert admission.validate(review(out), POLICY).response.allowed
    assert applied(out, admission.mutate(review(out), POLICY)) == out, "reinvocation changes nothing"
    plain = applied(sharing_pod(), admission.mutate(review(sharing_pod()), POLICY))
    assert "volumes" not in plain["spec"], "no node folder for pods that do not demand MPS"


def test_an_unknown_or_misplaced_isolation_demand_is_refused_naming_it() -> None:
    for pod_annotations, message in [
        ({names.ISOLATION: "mpss"}, "unknown isolation mode 'mpss' (known: none, hami-core, mps, mig)"),
        ({names.COMPUTE_GUARANTEE: "true"}, "a compute guarantee needs an isolation mode that enforces compute"),
        (
            {names.COMPUTE_GUARANTEE: "yes", names.ISOLATION: "mps"},
            "annotation sharegpu.io/compute-guarantee: 'yes' is neither true nor false",
        ),
    ]:
        answer = answer_of(admission.mutate(review(sharing_pod(pod_annotations)), POLICY))["response"]
        assert not answer["allowed"] and message in answer["status"]["message"]
    cpu = {"metadata": {"name": "c", "annotations": {names.ISOLATION: "mps"}}, "spec": {"containers": [{"name": "m"}]}}
    answer = answer_of(admission.mutate(review(cpu), POLICY))["response"]
    assert not answer["allowed"] and "demands isolation mps but asks for no GPU" in answer["status"]["message"]


def device_review(node: str, user: Json) -> Json:
    device = {"apiVersion": "sharegpu.io/v1alpha1", "kind": "Device", "metadata": {"name": node}, "spec": {"gpus": []}}
    return {"request": {"uid": "d1", "operation": "UPDATE", "name": node, "userInfo": user, "object": device}}


AGENT = "system:serviceaccount:sharegpu-system:sharegpu-agent"


def test_a_node_agent_writes_only_its_own_nodes_device() -> None:
    extra = {"authentication.kubernetes.io/pod-name": ["sharegpu-agent-x7"]}
    bound: Json = {"username": AGENT, "extra": extra}
    request = api_admission.review(device_review("n1", bound)).request
    writer = admission.DeviceWriter
    assert admission.device_writer(request, POLICY) == writer(True, pod=("sharegpu-system", "sharegpu-agent-x7"))
    newer: Json = {**bound, "extra": {**extra, "authentication.kubernetes.io/node-name": ["n1"]}}
    assert admission.device_writer(api_admission.review(device_review("n1", newer)).request, POLICY) == writer(
        True, "n1"
    )
    bare = api_admission.review(device_review("n1", {"username": AGENT})).request
    assert admission.device_writer(bare, POLICY) == writer(True), "an agent whose token names neither"
    other = api_admission.review(device_review("n1", {"username": "alice"})).request
    assert admission.device_writer(other, POLICY) == writer(False), "not an agent: RBAC decides"

    assert admission.validate_device(device_review("n1", bound), POLICY, "n1").response.allowed
    refused = admission.validate_device(device_review("n2", bound), POLICY, "n1").response
    assert not refused.allowed and refused.status is not None and refused.status.code == 403
    assert refused.status.message == "sharegpu: the node agent on n1 may write only Device n1, not n2"
    unbound = admission.validate_device(device_review("n1", {"username": AGENT}), POLICY, "").response
    assert not unbound.allowed and unbound.status is not None and "names no pod or node" in unbound.status.message
    assert admission.validate_device(device_review("n2", {"username": "alice"}), POLICY).response.allowed


TWO_MODELS = frozenset({"T4", "NVIDIA A10"})


def test_a_pod_that_goes_the_dra_way_asks_by_a_claim_of_its_shape_and_waits_behind_the_gate() -> None:
    for limits, asked, template in (
        ({names.GPU: "1", names.GPU_MILLI: "300", names.GPU_MEMORY: "4096"}, {}, "sharegpu-1x300m-4096mi"),
        ({"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"}, {}, "sharegpu-1x500m-500pm"),
        ({"nvidia.com/gpu": "2"}, {}, "sharegpu-2x1000m-0mi"),
        ({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}, {},
         "sharegpu-1x300m-3000mi"),
        ({}, {"gpu-fraction": "0.5"}, "sharegpu-1x500m-500pm"),
        ({names.GPU_MILLI: "300"}, {names.MODELS: "T4,NVIDIA A10"}, dra.Shape(1, 300, models=TWO_MODELS).name),
        ({"nvidia.com/gpu": "1"}, {names.MODELS: "A100"}, dra.Shape(1, 1000, models=frozenset({"A100"})).name),
    ):  # fmt: skip
        pod = MakePod("p").annotations({names.PATH: names.PATH_DRA, **asked}).container(limits=limits).obj()
        out = applied(pod, admission.mutate(review(pod), POLICY))
        container = out["spec"]["containers"][0]
        assert not any(
            r in (container.get("resources") or {}).get(part, {})
            for part in ("limits", "requests")
            for r in (*names.GPU_RESOURCES, *names.QUOTA_RESOURCES, *limits)
        ), container
        assert container["resources"]["claims"] == [{"name": "sharegpu-gpu"}]
        shape = dra.template_shape(template)
        assert shape is not None
        for part in ("limits", "requests"):  # what a ResourceQuota, or Kueue, counts: the whole use
            assert int(container["resources"][part][names.DRA_GPU_MILLI_TOTAL]) == shape.count * shape.milli
        (entry,) = out["spec"]["resourceClaims"]
        claim = entry.pop("resourceClaimName")
        assert (
            entry == {"name": "sharegpu-gpu"} and claim.startswith(f"{template}-c") and len(claim) == len(template) + 18
        )
        assert dra.claim_shape(claim) == dra.template_shape(template), "the claim's name says its shape"
        entry["resourceClaimName"] = claim
        assert out["spec"]["schedulingGates"] == [{"name": names.DRA_GATE}]
        assert names.HANDOFF not in out["metadata"]["annotations"], "the DRA path needs no hand-off"
        assert claim in out["metadata"]["annotations"][names.TRANSLATED]
        other = applied(pod, admission.mutate(review(pod), POLICY))
        assert other["spec"]["resourceClaims"][0]["resourceClaimName"] != claim, "each pod a claim of its own"
        again = applied(out, admission.mutate(review(out), POLICY))
        assert again == out, "reinvocation changes nothing"
        assert answer_of(admission.validate(review(out), POLICY))["response"]["allowed"]


def test_the_namespace_label_or_the_default_chooses_the_path_and_the_pod_s_annotation_wins() -> None:
    pod = MakePod("p").container(limits={names.GPU_MILLI: "300"}).obj()
    labelled = dataclasses.replace(POLICY, namespace_paths={"ns": names.PATH_DRA})
    assert "resourceClaims" in applied(pod, admission.mutate(review(pod), labelled))["spec"]
    assert "resourceClaims" not in applied(pod, admission.mutate(review(pod), POLICY))["spec"]
    by_default = dataclasses.replace(POLICY, default_path=names.PATH_DRA)
    assert "resourceClaims" in applied(pod, admission.mutate(review(pod), by_default))["spec"]
    opting_out = MakePod("p").annotations({names.PATH: names.PATH_EXTENDER}).container(limits={names.GPU_MILLI: "300"})
    kept = opting_out.obj()
    assert "resourceClaims" not in applied(kept, admission.mutate(review(kept), labelled))["spec"]


def test_what_a_claim_cannot_carry_is_refused_naming_it() -> None:
    dra_path = {names.PATH: names.PATH_DRA}
    for pod, message in (
        (MakePod("p").annotations({**dra_path, names.ANTI_AFFINITY: "x"}).container(limits={names.GPU_MILLI: "300"}),
         "co-tenancy rules are not available on the DRA path"),
        (MakePod("p").annotations({**dra_path, names.MODELS: ",".join(f"Model {i:03d} " * 4 for i in range(12))})
         .container(limits={names.GPU_MILLI: "300"}), "are too long to name a claim template after"),
        (MakePod("p").annotations(dra_path).container(limits={names.GPU_MILLI: "300"})
         .container("b", limits={names.GPU_MILLI: "300"}), "the DRA path gives GPUs to one app container"),
        (MakePod("p").annotations({names.PATH: "sideways"}).container(limits={names.GPU_MILLI: "300"}),
         "sharegpu.io/path must be one of extender, dra, got 'sideways'"),
    ):  # fmt: skip
        response = answer_of(admission.mutate(review(pod.obj()), POLICY))["response"]
        assert not response["allowed"] and message in response["status"]["message"], response


def _review(pod: Json, operation: str = "CREATE", old: Json | None = None, sub: str = "") -> Json:
    request: Json = {"uid": "u", "operation": operation, "namespace": "ns", "name": pod["metadata"]["name"],
                     "userInfo": {"username": "alice"}, "object": pod, "subResource": sub}  # fmt: skip
    if old is not None:
        request["oldObject"] = old
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def _refusal(answer: api_admission.ReviewResponse) -> str:
    assert not answer.response.allowed
    assert answer.response.status is not None
    return answer.response.status.message


def _admitted(pod: Json) -> api_admission.ReviewResponse:
    """The validating answer for the pod as the mutating webhook made it."""
    return admission.validate(_review(applied(pod, admission.mutate(_review(pod), POLICY))), POLICY)


@pytest.mark.parametrize(
    ("variable", "allowed"),
    [("NVIDIA_IMEX_CHANNELS", False), ("NVIDIA_MIG_CONFIG_DEVICES", False), ("NVIDIA_GDRCOPY", False),
     ("NVIDIA_REQUIRE_CUDA", True), ("NVIDIA_DISABLE_REQUIRE", True), ("CUDA_DEVICE_MEMORY_LIMIT_3", False),
     ("APP_NVIDIA_X", True)],
)  # fmt: skip
def test_nvidia_variables_are_the_systems_but_the_requirements(variable: str, allowed: bool) -> None:
    pod = MakePod("p", "ns").container(image="x", limits={names.NVIDIA_GPU: "1"}).obj()
    pod["spec"]["containers"][0]["env"] = [{"name": variable, "value": "1"}]
    answer = _admitted(pod)
    assert answer.response.allowed is allowed
    if not allowed:
        assert f"{variable} is set by sharegpu only" in _refusal(answer)


@pytest.mark.parametrize(
    ("prefix", "safe"),
    [("", False), ("APP_", True), ("N", False), ("NVIDIA_", False), ("NVIDIA_X_", False), ("CUDA_", False),
     ("CUDA_DEVICE_MEMORY_LIMIT_", False), ("SHAREGPU_", False), ("LD_", True), ("X", True)],
)  # fmt: skip
def test_envfrom_in_a_container_that_may_see_a_gpu_needs_a_prefix_that_forms_no_protected_name(
    prefix: str, safe: bool
) -> None:
    for limits in ({names.NVIDIA_GPU: "1"}, {names.GPU: "1", names.GPU_MILLI: "300"}):
        pod = MakePod("p", "ns").container(image="x", limits=limits).obj()
        pod["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "cfg"}, "prefix": prefix}]
        answer = _admitted(pod)
        assert answer.response.allowed is safe, (limits, prefix)
        if not safe:
            assert "envFrom ConfigMap cfg needs a prefix" in _refusal(answer)


def test_a_container_added_by_kubectl_debug_sees_no_gpu_and_the_others_are_left_as_they_are() -> None:
    pod = MakePod("p", "ns").container(image="x").obj()
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    old = copy.deepcopy(pod)
    old["spec"]["ephemeralContainers"] = [{"name": "first", "image": "y"}]
    second = {"name": "second", "image": "cuda", "env": [{"name": "HOME", "value": "/"}]}
    pod["spec"]["ephemeralContainers"] = [{"name": "first", "image": "y"}, second]
    answer = admission.mutate(_review(pod, "UPDATE", old, "ephemeralcontainers"), POLICY)
    patched = applied(pod, answer)
    first, added = patched["spec"]["ephemeralContainers"]
    assert "env" not in first, "a container already there cannot be changed"
    assert added["env"] == [{"name": "HOME", "value": "/"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    added["env"].append({"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"})
    refused = admission.validate(_review(patched, "UPDATE", old, "ephemeralcontainers"), POLICY)
    assert "container second: NVIDIA_MIG_MONITOR_DEVICES is set by sharegpu only" in _refusal(refused)


def test_a_gpu_pod_for_a_scheduler_sharegpu_does_not_take_over_is_refused_and_one_it_does_is_taken() -> None:
    """Another scheduler would place the pod outside sharegpu's books; a taken-over one is rewritten."""
    for scheduler, refused in (("my-scheduler", True), ("koord-scheduler", False), ("", False)):
        made = MakePod("p", "ns").container(image="x", limits={names.NVIDIA_GPU: "1"}).obj()
        if scheduler:
            made["spec"]["schedulerName"] = scheduler
        answer = _admitted(made)
        assert answer.response.allowed is not refused, scheduler
        if refused:
            assert "names scheduler 'my-scheduler', which would place it outside sharegpu's books" in _refusal(answer)
    cpu = MakePod("p", "ns").container(image="x").obj()
    cpu["spec"]["schedulerName"] = "my-scheduler"
    assert _admitted(cpu).response.allowed, "a pod asking for no GPU goes where it likes"


def test_a_pods_gpu_request_annotations_cannot_change_after_creation_but_others_can() -> None:
    """The node reads a placed pod's isolation demand (which MPS folder it may mount, which ceiling it
    raises): a tenant who changed it after placement would reach what it was not placed for."""
    pod = sharing_pod({names.ISOLATION: "hami-core"})
    made = applied(pod, admission.mutate(review(pod), POLICY))
    for key, value in ((names.ISOLATION, "mps"), (names.LIMIT_MILLI, "1000"), (names.ISOLATION, None)):
        changed = copy.deepcopy(made)
        if value is None:
            del changed["metadata"]["annotations"][key]
        else:
            changed["metadata"]["annotations"][key] = value
        refused = admission.validate(_review(changed, "UPDATE", made), POLICY)
        assert f"annotation {key} is part of the pod's GPU request and cannot change after creation" in _refusal(
            refused
        )
        system = _review(changed, "UPDATE", made)
        system["request"]["userInfo"]["username"] = next(iter(POLICY.system_users))
        assert admission.validate(system, POLICY).response.allowed, "sharegpu's own accounts are not judged"
    labelled = copy.deepcopy(made)
    labelled["metadata"]["annotations"]["team"] = "a"
    assert admission.validate(_review(labelled, "UPDATE", made), POLICY).response.allowed


def claiming_pod(*entries: tuple[str, str]) -> Json:
    """A pod written as Kubernetes documents DRA: (entry, template) claims, no gate, no GPU resource."""
    pod = MakePod("p").container(image="x").obj()
    pod["spec"]["resourceClaims"] = [{"name": e, "resourceClaimTemplateName": t} for e, t in entries]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": e} for e, _ in entries]}
    return pod


@pytest.mark.parametrize(
    ("seen", "gated"),
    [(None, True), ({"gpu": True}, True), ({"gpu": None}, True), ({"gpu": False}, False),
     ({"gpu": False, "nic": None}, True), ({"gpu": False, "nic": False}, False)],
)  # fmt: skip
def test_a_pod_whose_claims_may_be_sharegpus_is_gated_and_one_of_another_class_is_not(
    seen: dict[str, bool | None] | None, gated: bool
) -> None:
    pod = claiming_pod(("gpu", "t1"), ("nic", "t2")) if seen and "nic" in seen else claiming_pod(("gpu", "t1"))
    out = applied(pod, admission.mutate(review(pod), POLICY, seen))
    gates = [g["name"] for g in out["spec"].get("schedulingGates", [])]
    assert gates == ([names.DRA_GATE] if gated else [])
    assert (out["spec"].get("schedulerName") == names.SCHEDULER_NAME) is gated, "sharegpu's scheduler takes it"
    if gated:
        assert (
            "gated (sharegpu.io/dra-allocation) until sharegpu allocates them"
            in (out["metadata"]["annotations"][names.TRANSLATED])
        )
        assert applied(out, admission.mutate(review(out), POLICY, seen)) == out, "reinvoked: one gate"
    system = applied(pod, admission.mutate(review(pod, user=next(iter(POLICY.system_users))), POLICY, seen))
    assert not system["spec"].get("schedulingGates"), "sharegpu's own pods are not held"


async def test_the_webhook_reads_a_new_pods_claims_and_templates_to_tell_whose_they_are() -> None:
    api = fake.FakeApiServer()
    ours = {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": dra.CLASS}}]}}
    either = [{"name": "a", "deviceClassName": "gpu.example.com"}, {"name": "b", "deviceClassName": dra.CLASS}]
    alternative = {"devices": {"requests": [{"name": "g", "firstAvailable": either}]}}
    theirs = {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu.example.com"}}]}}
    api.put_object(dra.template_path("ns"), {"metadata": {"name": "ours", "namespace": "ns"}, "spec": {"spec": ours}})
    api.put_object(
        dra.template_path("ns"), {"metadata": {"name": "alt", "namespace": "ns"}, "spec": {"spec": alternative}}
    )
    api.put_object(dra.claim_path("ns"), {"metadata": {"name": "theirs", "namespace": "ns"}, "spec": theirs})
    hook = server.Webhook(POLICY)
    hook.kube = client.KubeClient(api)
    pod = claiming_pod(("a", "ours"), ("b", "alt"), ("c", "missing"))
    pod["spec"]["resourceClaims"].append({"name": "d", "resourceClaimName": "theirs"})
    # The fake serves no discovery document: as an API server without resource.k8s.io/v1, no claim is ours.
    assert await hook._learn_claims(review(pod)) == {"a": False, "b": False, "c": False, "d": False}
    hook._served = True
    assert await hook._learn_claims(review(pod)) == {"a": True, "b": True, "c": None, "d": False}
    assert await hook._learn_claims(review(MakePod("plain").container(image="x").obj())) is None
    await hook.kube.close()


def test_kueue_pod_groups_become_gangs_and_malformed_gangs_are_refused_by_name() -> None:
    pod = (
        MakePod("w0")
        .labels({gangs.KUEUE_GROUP_LABEL: "train"})
        .annotations({gangs.KUEUE_TOTAL_ANNOTATION: "4"})
        .container(limits={"nvidia.com/gpu": "1"})
        .obj()
    )
    out = applied(pod, admission.mutate(review(pod), POLICY))
    annotations = out["metadata"]["annotations"]
    assert (annotations[names.GANG], annotations[names.GANG_MIN]) == ("train", "4")
    assert "pod group train" in annotations[names.TRANSLATED]
    assert applied(out, admission.mutate(review(out), POLICY)) == out, "reinvocation changes nothing"
    assert answer_of(admission.validate(review(out), POLICY))["response"]["allowed"]
    bad = MakePod("w1").annotations({names.GANG: "train"}).container(limits={"nvidia.com/gpu": "1"}).obj()
    response = answer_of(admission.validate(review(bad), POLICY))["response"]
    assert not response["allowed"] and f"{names.GANG_MIN} is required" in response["status"]["message"]
    missing = MakePod("w2").labels({gangs.KUEUE_GROUP_LABEL: "t"}).container(limits={"nvidia.com/gpu": "1"}).obj()
    response = answer_of(admission.mutate(review(missing), POLICY))["response"]
    assert not response["allowed"] and gangs.KUEUE_TOTAL_ANNOTATION in response["status"]["message"]


def test_a_gang_on_the_dra_path_keeps_its_gang_beside_its_claim() -> None:
    pod = (
        MakePod("w0")
        .annotations({names.GANG: "j", names.GANG_MIN: "2", names.PATH: names.PATH_DRA})
        .container(limits={"nvidia.com/gpu": "1"})
        .obj()
    )
    out = applied(pod, admission.mutate(review(pod), POLICY))
    assert out["metadata"]["annotations"][names.GANG] == "j" and out["spec"]["resourceClaims"]


def test_a_pod_naming_a_volcano_group_gets_the_groups_gang_or_is_refused_when_the_group_is_missing() -> None:
    pod = (
        MakePod("w0")
        .annotations({"scheduling.k8s.io/group-name": "train"})
        .container(limits={"nvidia.com/gpu": "1"})
        .obj()
    )
    ref = podgroups.GroupRef(podgroups.VOLCANO, "ns", "train")
    read = admission.GroupRead(ref, {"spec": {"minMember": 4, "queue": "research"}})
    answer = admission.mutate(review(pod), POLICY, group=read)
    out = applied(pod, answer)
    assert (out["metadata"]["annotations"][names.GANG], out["metadata"]["annotations"][names.GANG_MIN]) == (
        "train",
        "4",
    )
    assert any("spec.queue" in w for w in answer_of(answer)["response"]["warnings"])
    assert applied(out, admission.mutate(review(out), POLICY)) == out, "reinvoked, the gang is already written"
    reads: tuple[tuple[admission.GroupRead | None, str], ...] = (
        (admission.GroupRead(ref, None), "does not exist: create the group before its pods"),
        (admission.GroupRead(ref, None, "timed out"), "could not be read: timed out"),
        (None, "could not be read"),
    )
    for read_back, words in reads:
        response = answer_of(admission.mutate(review(pod), POLICY, group=read_back))["response"]
        assert not response["allowed"] and words in response["status"]["message"]


def test_the_dra_totals_are_refused_on_a_container_without_claims() -> None:
    """A tenant writing the DRA path's totals on a container of the other path (Kueue, mapping them onto
    the same quota, would count its GPUs twice) is refused by name."""
    pod = MakePod("p").container(limits={names.GPU_MILLI: "300", names.DRA_GPU_MILLI_TOTAL: "300"}).obj()
    out = applied(pod, admission.mutate(review(pod), POLICY))
    assert names.DRA_GPU_MILLI_TOTAL not in out["spec"]["containers"][0]["resources"]["limits"], "replaced"
    plain = MakePod("p").container(limits={"cpu": "1", names.DRA_GPU_MILLI_TOTAL: "300"}).obj()
    answer = answer_of(admission.validate(review(plain), POLICY))["response"]
    assert not answer["allowed"] and "whose GPUs come from DRA claims only" in answer["status"]["message"]


# ----------------------------------------------------------------- found by a review (stop 64)


def test_a_container_using_a_claim_of_another_class_still_sees_no_gpu() -> None:
    """A CPU-only pod whose container uses any ResourceClaim that is not sharegpu's (here one with no
    requests at all, which kube-scheduler allocates at once, no driver needed) keeps its CUDA image's
    NVIDIA_VISIBLE_DEVICES=all: _hide_gpus skips every container with resources.claims."""
    pod = {
        "metadata": {"name": "p"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"},
            "resourceClaims": [{"name": "nothing", "resourceClaimName": "empty"}],
            "containers": [
                {
                    "name": "c",
                    "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
                    "resources": {"claims": [{"name": "nothing"}]},
                }
            ],
        },
    }
    seen = {"nothing": False}  # what the server's _learn_claims reads for a claim of no (or another) class
    out = applied(pod, admission.mutate(review(pod), POLICY, seen))
    assert admission.validate(review(out), POLICY).response.allowed
    shown = [e for e in out["spec"]["containers"][0].get("env") or [] if e["name"] == "NVIDIA_VISIBLE_DEVICES"]
    assert shown == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}], (
        f"container keeps its image's NVIDIA_VISIBLE_DEVICES (env after admission: {shown})"
    )


def test_a_claim_container_cannot_read_protected_variables_from_a_configmap_it_names_itself() -> None:
    """Same door, no CUDA image needed: the pod names its own ConfigMap as its 'hand-off' (any name;
    a CPU-only pod's annotation is never dropped) and reads NVIDIA_VISIBLE_DEVICES=all from it."""
    pod = {
        "metadata": {"name": "p", "annotations": {names.HANDOFF: "mine"}},
        "spec": {
            "resourceClaims": [{"name": "nothing", "resourceClaimName": "empty"}],
            "containers": [
                {
                    "name": "c",
                    "image": "ubuntu",
                    "resources": {"claims": [{"name": "nothing"}]},
                    "env": [
                        {
                            "name": "NVIDIA_VISIBLE_DEVICES",
                            "valueFrom": {"configMapKeyRef": {"name": "mine", "key": "c.NVIDIA_VISIBLE_DEVICES"}},
                        }
                    ],
                }
            ],
        },
    }
    out = applied(pod, admission.mutate(review(pod), POLICY, {"nothing": False}))
    answer = admission.validate(review(out), POLICY)
    shown = [e for e in out["spec"]["containers"][0].get("env") or [] if e["name"] == "NVIDIA_VISIBLE_DEVICES"]
    assert not answer.response.allowed or shown == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}], shown


def test_a_sharing_container_that_says_void_may_not_load_variables_wholesale() -> None:
    """The guard lets envFrom without a prefix into a container that sets NVIDIA_VISIBLE_DEVICES=void
    ('it sees no GPU'), but in a sharing container the webhook appends the hand-off reference after
    the author's void (the last one wins): the container sees its GPU and loads, from the tenant's
    ConfigMap, every protected variable the env does not set (CUDA_DEVICE_MEMORY_LIMIT_0 outranks
    HAMi-core's CUDA_DEVICE_MEMORY_LIMIT, NVIDIA_IMEX_CHANNELS, NVIDIA_DRIVER_CAPABILITIES, ...)."""
    pod = {
        "metadata": {"name": "p"},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "cuda",
                    "resources": {"limits": {"koordinator.sh/gpu-core": "30", "koordinator.sh/gpu-memory": "4Gi"}},
                    "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                    "envFrom": [{"configMapRef": {"name": "tenant-vars"}}],
                }
            ]
        },
    }
    out = applied(pod, admission.mutate(review(pod), POLICY))
    names_in_order = [e["name"] for e in out["spec"]["containers"][0]["env"]]
    last = [e for e in out["spec"]["containers"][0]["env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES"][-1]
    assert "valueFrom" in last, "the hand-off reference is the NVIDIA_VISIBLE_DEVICES the container gets"
    answer = admission.validate(review(out), POLICY)
    assert not answer.response.allowed, f"allowed: unprefixed envFrom into a GPU container (env {names_in_order})"


def test_a_dra_path_pod_cannot_set_limit_variables_from_a_configmap_it_names_itself() -> None:
    """On the DRA path the webhook neither drops the author's hand-off annotation nor adds one, and the
    guard counts a reference to whatever ConfigMap the annotation names as sharegpu's own."""
    pod = {
        "metadata": {"name": "p", "annotations": {names.PATH: names.PATH_DRA, names.HANDOFF: "mine"}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "cuda",
                    "resources": {"limits": {names.GPU_MILLI: "300", names.GPU_MEMORY: "4096"}},
                    "env": [
                        {"name": v, "valueFrom": {"configMapKeyRef": {"name": "mine", "key": f"c.{v}"}}}
                        for v in ("CUDA_DEVICE_MEMORY_LIMIT_0", "NVIDIA_IMEX_CHANNELS", "NVIDIA_DRIVER_CAPABILITIES")
                    ],
                }
            ]
        },
    }
    out = applied(pod, admission.mutate(review(pod), POLICY))
    assert out["spec"]["containers"][0]["resources"].get("claims"), "on the DRA path"
    answer = admission.validate(review(out), POLICY)
    assert not answer.response.allowed, (
        "a tenant's own ConfigMap set CUDA_DEVICE_MEMORY_LIMIT_0 and NVIDIA_IMEX_CHANNELS"
    )


def test_a_whole_gpu_pod_cannot_read_another_pods_handoff_by_naming_it_its_own() -> None:
    """A whole-GPU pod wired to a hand-off it names (another sharing pod's of the namespace) keeps the
    annotation (_handoff_wired) and passes the guard (the reference is to 'its own'); the extender's
    prepare() skips exclusive allocations, so it is bound and its container reads the victim's GPU
    UUID after the device plugin's value (the pod's env wins)."""
    victim = "sharegpu-handoff-0123456789abcdef"
    pod = {
        "metadata": {"name": "w", "annotations": {names.HANDOFF: victim}},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "env": [
                        {
                            "name": "NVIDIA_VISIBLE_DEVICES",
                            "valueFrom": {"configMapKeyRef": {"name": victim, "key": "main.NVIDIA_VISIBLE_DEVICES"}},
                        }
                    ],
                }
            ]
        },
    }
    out = applied(pod, admission.mutate(review(pod), POLICY))
    kept = out["metadata"]["annotations"].get(names.HANDOFF)
    answer = admission.validate(review(out), POLICY)
    assert not answer.response.allowed, f"allowed, hand-off annotation kept as {kept!r}"
