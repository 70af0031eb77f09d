"""The admission webhook registered on the real kube-apiserver (clientConfig.url on 127.0.0.1, real TLS)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import parser

from sharegpu.api import names, paths, pods, quantity, wire
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client, credentials, transport
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import certs
from sharegpu.webhook import admission
from tests.builders import MakeDevice, MakeNode, MakePod
from tests.integration.conftest import RunningWebhook, bare_pod, get_or_none, gpu_pod, wait_for
from tests.webhook.conftest import ROWS

Json = dict[str, Any]


@pytest.mark.parametrize(
    ("fmt", "limits", "annotations", "canonical", "canonical_annotations"), ROWS, ids=[r[0] for r in ROWS]
)
async def test_every_format_is_stored_in_canonical_form(
    admin: client.KubeClient, webhook: RunningWebhook, namespace: str, fmt: str, limits: dict[str, str],
    annotations: dict[str, str], canonical: dict[str, str], canonical_annotations: dict[str, str],
) -> None:  # fmt: skip
    name = f"fmt-{uuid.uuid4().hex[:6]}"
    stored = await admin.create(f"/api/v1/namespaces/{namespace}/pods", bare_pod(name, limits, annotations))
    stored = await admin.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    container = stored["spec"]["containers"][0]
    limits = container["resources"]["limits"]
    gpu_limits = {k: v for k, v in limits.items() if k not in ("cpu", "memory", *names.QUOTA_RESOURCES)}
    expected_total = admission.quota_totals(pods.request(wire.convert(stored, wire.Pod)).containers[0])
    assert {k: str(quantity.parse(v)) for k, v in limits.items() if k in names.QUOTA_RESOURCES} == expected_total
    # The API server normalises quantities ("3000" is stored as "3k"): compare values.
    assert {k: quantity.parse(v) for k, v in gpu_limits.items()} == {k: quantity.parse(v) for k, v in canonical.items()}
    stored_annotations = stored["metadata"].get("annotations") or {}
    for key, value in canonical_annotations.items():
        assert stored_annotations[key] == value
    assert stored["spec"]["schedulerName"] == names.SCHEDULER_NAME
    if fmt not in ("sharegpu", "nvidia whole"):
        assert names.TRANSLATED in stored_annotations
    sharing = pods.request(wire.convert(stored, wire.Pod)).demand.sharing
    handoff = stored_annotations.get(names.HANDOFF)
    assert bool(handoff) == sharing
    if sharing:
        refs = {e["name"]: e["valueFrom"]["configMapKeyRef"] for e in container.get("env", [])}
        assert refs["NVIDIA_VISIBLE_DEVICES"] == {
            "name": handoff,
            "key": "main.NVIDIA_VISIBLE_DEVICES",
            "optional": False,
        }
        assert "CUDA_DEVICE_SM_LIMIT" in refs


@pytest.mark.parametrize(
    ("limits", "annotations", "message"),
    [
        ({names.GPU: "1", names.GPU_MILLI: "1500"}, {}, "sharegpu.io/gpu-milli must be an integer in 1..1000"),
        ({"koordinator.sh/gpu-core": "150"}, {}, "above 100 must be a multiple of 100"),
        ({names.GPU: "1", names.GPU_MILLI: "500"}, {names.LIMIT_MILLI: "300"}, "request (500) <= limit"),
        ({"tencent.com/vcuda-core": "50", "aliyun.com/gpu-mem": "2"}, {}, "mixes GPU request formats"),
        ({names.GPU: "2", names.GPU_MILLI: "1000", names.GPU_MEMORY: "100"}, {}, "whole-GPU request gets all"),
        ({"nvidia.com/gpu": "2", names.GPU_MILLI: "500"}, {}, "cannot be combined with a share"),
        ({names.GPU: "1", names.GPU_MILLI: "500"}, {names.AFFINITY: ""}, "co-tenancy affinity label"),
    ],
)  # fmt: skip
async def test_malformed_requests_are_refused_with_the_webhook_message(
    admin: client.KubeClient, webhook: RunningWebhook, namespace: str, limits: dict[str, str],
    annotations: dict[str, str], message: str,
) -> None:  # fmt: skip
    with pytest.raises(kube_errors.ApiError) as refused:
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", bare_pod("bad", limits, annotations))
    assert message in refused.value.message


async def test_memory_larger_than_any_gpu_in_the_inventory_is_refused(
    admin: client.KubeClient, webhook: RunningWebhook, nodes: Any, namespace: str
) -> None:
    await nodes(1, gpus=1, model="L4", memory=24576)
    for _ in range(50):  # the webhook follows the Device inventory through a watch
        if webhook.policy.largest_gpu_memory_mib:
            break
        await asyncio.sleep(0.1)
    largest = webhook.policy.largest_gpu_memory_mib
    assert largest is not None
    limits = {names.GPU: "1", names.GPU_MILLI: "500", names.GPU_MEMORY: str(largest + 1)}
    with pytest.raises(kube_errors.ApiError) as refused:
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", bare_pod("too-big", limits))
    assert f"the largest GPU in the cluster has {largest} MiB" in refused.value.message


async def _as_tenant(control_plane: controlplane.ControlPlane, admin: client.KubeClient, namespace: str,
                     user: str) -> client.KubeClient:  # fmt: skip
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": f"pods-{user}", "namespace": namespace},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "update", "patch", "get"]}],
    }
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": f"pods-{user}", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"pods-{user}"},
               "subjects": [{"kind": "User", "name": control_plane.identity(user).user,
                             "apiGroup": "rbac.authorization.k8s.io"}]}  # fmt: skip
    await stack.apply(admin, role)
    await stack.apply(admin, binding)
    await asyncio.sleep(0.5)
    return stack.kube_for(control_plane, user)


SHARE = {names.GPU: "1", names.GPU_MILLI: "250"}


def _with_env(pod: Json, env: list[Json]) -> Json:
    pod["spec"]["containers"][0]["env"] = env
    return pod


@pytest.mark.parametrize(
    ("case", "manifest", "message"),
    [
        ("allocation annotation", bare_pod("g1", SHARE, {names.ALLOCATION: '{"version": 1}'}),
         "annotation sharegpu.io/allocation is set by sharegpu only"),
        ("visible devices", _with_env(bare_pod("g2", SHARE), [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
         "NVIDIA_VISIBLE_DEVICES is set by sharegpu only"),
        ("isolation limit", _with_env(bare_pod("g3", {"cpu": "1"}), [{"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"}]),
         "CUDA_DEVICE_SM_LIMIT is set by sharegpu only"),
        ("another pod's hand-off", _with_env(bare_pod("g4", SHARE), [{"name": "X", "valueFrom": {"configMapKeyRef": {
            "name": "sharegpu-handoff-0123456789abcdef", "key": "main.NVIDIA_VISIBLE_DEVICES"}}}]),
         "is another pod's GPU hand-off"),
    ],
)  # fmt: skip
async def test_plain_users_cannot_set_what_only_the_system_sets(
    admin: client.KubeClient, webhook: RunningWebhook, control_plane: controlplane.ControlPlane, namespace: str,
    case: str, manifest: Json, message: str,
) -> None:  # fmt: skip
    alice = await _as_tenant(control_plane, admin, namespace, "alice")
    try:
        with pytest.raises(kube_errors.ApiError) as refused:
            await alice.create(f"/api/v1/namespaces/{namespace}/pods", manifest)
        assert message in refused.value.message
    finally:
        await alice.close()


async def test_guards_on_update_and_no_opt_out_and_the_system_is_allowed(
    admin: client.KubeClient, webhook: RunningWebhook, control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    alice = await _as_tenant(control_plane, admin, namespace, "alice")
    system = stack.kube_for(control_plane, "sharegpu-harness")
    try:
        # A label the user controls does not opt out: the request is still translated.
        pod = bare_pod("labelled", {"aliyun.com/gpu-mem": "2"})
        pod["metadata"]["labels"] = {"sharegpu.io/admission": "skip", "sharegpu.io/webhook": "ignore"}
        await alice.create(f"/api/v1/namespaces/{namespace}/pods", pod)
        stored = await alice.get(f"/api/v1/namespaces/{namespace}/pods/labelled")
        assert quantity.parse(stored["spec"]["containers"][0]["resources"]["limits"][names.GPU_MEMORY]) == 2048
        # Updating the allocation annotation is refused for a user...
        with pytest.raises(kube_errors.ApiError) as refused:
            await alice.patch(
                f"/api/v1/namespaces/{namespace}/pods/labelled",
                {"metadata": {"annotations": {names.ALLOCATION: "{}"}}},
            )
        assert "cannot be changed" in refused.value.message
        # ... and so is pointing the pod at another hand-off ConfigMap.
        with pytest.raises(kube_errors.ApiError):
            await alice.patch(
                f"/api/v1/namespaces/{namespace}/pods/labelled",
                {"metadata": {"annotations": {names.HANDOFF: "sharegpu-handoff-other"}}},
            )
        # A system identity (--system-user) may set it.
        await system.create(
            f"/api/v1/namespaces/{namespace}/pods",
            bare_pod("system-made", SHARE, {names.ALLOCATION: '{"version": 1}'}),
        )
    finally:
        await alice.close()
        await system.close()


async def test_skipped_namespaces_are_left_alone(admin: client.KubeClient, webhook: RunningWebhook) -> None:
    name = f"left-alone-{uuid.uuid4().hex[:6]}"
    await admin.create(f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/pods",
                       bare_pod(name, {"aliyun.com/gpu-mem": "2"}))  # fmt: skip
    stored = await admin.get(f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/pods/{name}")
    assert stored["spec"]["containers"][0]["resources"]["limits"] == {"aliyun.com/gpu-mem": "2"}
    await admin.delete(f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/pods/{name}", grace_period=0)


async def test_certificate_rotation_without_restart(
    admin: client.KubeClient, webhook: RunningWebhook, namespace: str
) -> None:
    from cryptography import x509

    before = await webhook.served_certificate()
    await asyncio.sleep(0.05)  # a distinct modification time for the new files
    certs.write_serving_pair(webhook.folder, webhook.ca_cert, webhook.ca_key, ip_addresses=("127.0.0.1",))
    after = await webhook.served_certificate()
    assert after != before, "the next connection is served the new certificate"
    on_disk = x509.load_pem_x509_certificate(Path(webhook.cert).read_bytes())
    assert x509.load_der_x509_certificate(after).serial_number == on_disk.serial_number
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", bare_pod("after-rotation", {"aliyun.com/gpu-mem": "1"}))


async def test_inconsistent_device_resources_are_refused(admin: client.KubeClient, webhook: RunningWebhook) -> None:
    bad = {
        "apiVersion": "sharegpu.io/v1alpha1",
        "kind": "Device",
        "metadata": {"name": f"bad-{uuid.uuid4().hex[:6]}"},
        "spec": {"gpus": [{"index": 0, "uuid": "GPU-a", "model": "T4", "memoryMiB": 16384},
                          {"index": 0, "uuid": "GPU-b", "model": "T4", "memoryMiB": 16384}]},
    }  # fmt: skip
    with pytest.raises(kube_errors.ApiError) as refused:
        await admin.create(paths.DEVICES, bad)
    assert "indices must be 0..n-1" in refused.value.message


async def test_a_node_agent_writes_only_its_own_nodes_device(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, webhook: RunningWebhook
) -> None:
    """The agent's ServiceAccount with the agent's ClusterRole, and a token bound to its pod on node A
    (TokenRequest, as a projected token is): it may write Device A, and is refused Device B with the
    reason, though RBAC lets it write Devices."""
    suffix = uuid.uuid4().hex[:6]
    here, there = f"agent-a-{suffix}", f"agent-b-{suffix}"
    for node in (here, there):
        await admin.create(paths.NODES, MakeNode(node).obj())
    account = "sharegpu-agent"
    with contextlib.suppress(kube_errors.ConflictError):
        await admin.create(f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/serviceaccounts",
                           {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}})  # fmt: skip
    binding = f"{account}-bound-{suffix}"
    await admin.create("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": binding},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": names.SYSTEM_NAMESPACE}],
    })  # fmt: skip
    agent_pod = MakePod(f"agent-{suffix}").node(here).spec(serviceAccountName=account).container("agent", image="x")
    pod = await admin.create(paths.pods(names.SYSTEM_NAMESPACE), agent_pod.obj())
    issued = await admin.create(
        f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 600,
         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                            "uid": pod["metadata"]["uid"]}}},
    )  # fmt: skip
    assert control_plane.bundle is not None
    creds = credentials.static(
        control_plane.url, token=issued["status"]["token"], ca_file=str(control_plane.bundle.ca_cert)
    )
    agent = client.KubeClient(transport.AiohttpTransport(creds), creds)

    def device(node: str) -> Json:
        return MakeDevice(node).obj()

    try:
        await agent.create(paths.DEVICES, device(here))
        with pytest.raises(kube_errors.ApiError) as refused:
            await agent.create(paths.DEVICES, device(there))
        assert refused.value.status == 403
        assert f"the node agent on {here} may write only Device {here}, not {there}" in refused.value.message
        await admin.create(paths.DEVICES, device(there))  # anyone else: RBAC decides
    finally:
        await agent.close()
        for node in (here, there):
            with contextlib.suppress(kube_errors.NotFoundError):
                await admin.delete(paths.device(node))
            await admin.delete(paths.node(node))
        await admin.delete(paths.pod(names.SYSTEM_NAMESPACE, pod["metadata"]["name"]), grace_period=0)
        await admin.delete(f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{binding}")


def _visible(container: Json) -> list[Json]:
    return [e for e in container.get("env") or [] if e["name"] == "NVIDIA_VISIBLE_DEVICES"]


async def test_containers_given_no_gpu_see_none(
    admin: client.KubeClient, webhook: RunningWebhook, namespace: str
) -> None:
    """CUDA images set NVIDIA_VISIBLE_DEVICES=all: the container runtime would show every GPU of the node to
    a container that asked for none. Stored pods: every such container (init too) reads void; a sharing
    container its hand-off; a whole-GPU container nothing (the device plugin's value must win)."""
    cpu = bare_pod("cpu-only", {"cpu": "100m"})
    cpu["spec"]["initContainers"] = [{"name": "setup", "image": "busybox"}]
    cpu["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    sharing = bare_pod("sharing", {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-milli": "300"})
    sharing["spec"]["containers"].append({"name": "sidecar", "image": "busybox"})
    whole = bare_pod("whole", {"nvidia.com/gpu": "1"})
    whole["spec"]["containers"].append({"name": "logs", "image": "busybox"})
    for manifest in (cpu, sharing, whole):
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", manifest)
    void = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    stored = await admin.get(f"/api/v1/namespaces/{namespace}/pods/cpu-only")
    assert [_visible(c) for c in stored["spec"]["initContainers"] + stored["spec"]["containers"]] == [void, void]
    assert "NVIDIA_VISIBLE_DEVICES all -> void" in stored["metadata"]["annotations"][names.TRANSLATED]
    stored = await admin.get(f"/api/v1/namespaces/{namespace}/pods/sharing")
    main, sidecar = stored["spec"]["containers"]
    assert _visible(main)[0]["valueFrom"]["configMapKeyRef"]["name"] == stored["metadata"]["annotations"][names.HANDOFF]
    assert _visible(sidecar) == void
    stored = await admin.get(f"/api/v1/namespaces/{namespace}/pods/whole")
    train, logs = stored["spec"]["containers"]
    assert _visible(train) == [] and _visible(logs) == void
    left = bare_pod("left-alone-cpu", {"cpu": "100m"})
    await admin.create(f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/pods", left)
    stored = await admin.get(f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/pods/left-alone-cpu")
    assert _visible(stored["spec"]["containers"][0]) == [], "skipped namespaces are not touched"
    await admin.delete(f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/pods/left-alone-cpu", grace_period=0)


async def test_a_pod_demanding_hami_core_preloads_it_and_the_api_server_stores_the_wiring(
    admin: client.KubeClient, webhook: RunningWebhook, namespace: str
) -> None:
    """The stored pod reads SHAREGPU_PRELOAD from its hand-off before LD_PRELOAD composes it with the
    author's library, and mounts the node's HAMi-core folder read-only (an inline CSI volume the API accepts)."""
    manifest = bare_pod("hami", {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-milli": "300"})
    manifest["metadata"]["annotations"] = {names.ISOLATION: "hami-core"}
    manifest["spec"]["containers"][0]["env"] = [{"name": "LD_PRELOAD", "value": "/lib/libjemalloc.so"}]
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", manifest)
    stored = await admin.get(f"/api/v1/namespaces/{namespace}/pods/hami")
    (main,) = stored["spec"]["containers"]
    order = [e["name"] for e in main["env"]]
    assert order[-1] == "LD_PRELOAD" and order.index("SHAREGPU_PRELOAD") < order.index("LD_PRELOAD")
    assert main["env"][-1]["value"] == "$(SHAREGPU_PRELOAD) /lib/libjemalloc.so"
    assert main["volumeMounts"][-1] == {"name": "sharegpu-hami-core", "mountPath": "/run/sharegpu/hami-core",
                                        "readOnly": True}  # fmt: skip
    assert {"name": "sharegpu-hami-core", "csi": {"driver": names.VOLUMES_DRIVER, "readOnly": True,
                                                 "volumeAttributes": {"folder": "hami-core"}}} in (
        stored["spec"]["volumes"]
    ), "an inline volume the agent binds from the node"  # fmt: skip


async def test_multi_container_pods_get_a_hand_off_per_gpu_container(
    admin: client.KubeClient, webhook: RunningWebhook, namespace: str
) -> None:
    manifest = bare_pod("multi", {"koordinator.sh/gpu-core": "20", "koordinator.sh/gpu-memory": "1Gi"})
    manifest["spec"]["containers"].append(
        {"name": "sidecar", "image": "busybox", "resources": {"limits": {"tencent.com/vcuda-core": "10"}}}
    )
    manifest["spec"]["initContainers"] = [
        {
            "name": "warmup",
            "image": "busybox",
            "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "50"}},
        }
    ]
    await admin.create(f"/api/v1/namespaces/{namespace}/pods", manifest)
    stored = await admin.get(f"/api/v1/namespaces/{namespace}/pods/multi")
    demand = pods.request(wire.convert(stored, wire.Pod)).demand
    assert (demand.count, demand.milli, demand.memory_mib) == (1, 500, 1024), "max(20+10 app, 50 init) and app memory"
    handoff = stored["metadata"]["annotations"][names.HANDOFF]
    for container in stored["spec"]["initContainers"] + stored["spec"]["containers"]:
        refs = {e["name"]: e["valueFrom"]["configMapKeyRef"] for e in container["env"]}
        assert refs["NVIDIA_VISIBLE_DEVICES"]["name"] == handoff
        assert refs["NVIDIA_VISIBLE_DEVICES"]["key"] == f"{container['name']}.NVIDIA_VISIBLE_DEVICES"


async def test_gpu_pods_for_a_replaced_scheduler_or_bound_to_a_node_are_placed_by_sharegpu(
    admin: client.KubeClient, webhook: RunningWebhook, extender: Any, nodes: Any, namespace: str
) -> None:
    """A Koordinator pod still addressed to koord-scheduler, and a pod its author bound to a node (as
    KubeShare's GPUID example does), would stay Pending or run without a share: both are placed by
    sharegpu, get their allocation and their hand-off, and the second lands on the node it named."""
    made = await nodes(2, gpus=2)
    koord = gpu_pod("koord", namespace)
    koord["spec"]["schedulerName"] = "koord-scheduler"
    koord["spec"]["containers"][0]["resources"] = {"limits": {"koordinator.sh/gpu-core": "40", "cpu": "100m"}}
    pinned = gpu_pod("pinned", namespace, milli=300)
    pinned["spec"].pop("schedulerName")
    pinned["spec"]["nodeName"] = made[1]
    for body in (koord, pinned):
        await admin.create(paths.pods(namespace), body)

    async def placed(name: str) -> Json | None:
        found = await admin.get(paths.pod(namespace, name))
        annotations = found["metadata"].get("annotations") or {}
        if not found["spec"].get("nodeName") or names.ALLOCATION not in annotations:
            return None
        data = await get_or_none(admin, paths.configmap(namespace, annotations[names.HANDOFF]))
        return found if data and data.get("data", {}).get("main.NVIDIA_VISIBLE_DEVICES") else None

    first = await wait_for(lambda: placed("koord"), what="the koord-scheduler pod placed with its hand-off")
    assert first["spec"]["schedulerName"] == names.SCHEDULER_NAME
    assert "schedulerName koord-scheduler" in first["metadata"]["annotations"][names.TRANSLATED]
    second = await wait_for(lambda: placed("pinned"), what="the node-bound pod placed with its hand-off")
    assert second["spec"]["nodeName"] == made[1]
    assert "spec.nodeName" in second["metadata"]["annotations"][names.TRANSLATED]


async def test_hamis_model_selector_becomes_the_inventorys_model_names(
    admin: client.KubeClient, webhook: RunningWebhook, nodes: Any, namespace: str
) -> None:
    await nodes(1, gpus=1, model="Tesla-T4")

    async def seen() -> bool:
        return "Tesla-T4" in webhook.policy.models

    await wait_for(seen, what="the webhook sees the new model")
    body = bare_pod("typed", {"nvidia.com/gpu": "1"}, {"nvidia.com/use-gputype": "t4"})
    await admin.create(paths.pods(namespace), body)
    stored = await admin.get(paths.pod(namespace, "typed"))
    chosen = stored["metadata"]["annotations"][names.MODELS].split(",")
    assert "Tesla-T4" in chosen and all("T4" in m.upper() for m in chosen)
    refused = bare_pod("nothing", {"nvidia.com/gpu": "1"}, {"nvidia.com/use-gputype": "no-such-gpu"})
    with pytest.raises(kube_errors.InvalidError, match="leaves no GPU model of the cluster"):
        await admin.create(paths.pods(namespace), refused)


async def test_a_resource_quota_counts_every_gpu_of_a_share(
    admin: client.KubeClient, webhook: RunningWebhook, namespace: str
) -> None:
    """Kubernetes' own ResourceQuota, on the total the webhook writes: 3 GPUs at 500 milli count 1500
    (a quota on the per-GPU resource would count 500: HAMi #893)."""
    hard = {f"requests.{names.GPU_MILLI_TOTAL}": "2000", f"requests.{names.GPU_MEMORY_TOTAL}": "8192"}
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus"}, "spec": {"hard": hard}}
    await admin.create(f"/api/v1/namespaces/{namespace}/resourcequotas", quota)

    async def counted() -> bool:
        found = await admin.get(f"/api/v1/namespaces/{namespace}/resourcequotas/gpus")
        return bool(found.get("status", {}).get("hard"))

    await wait_for(counted, what="the quota controller to take up the quota")
    hami = {"nvidia.com/gpu": "3", "nvidia.com/gpucores": "50", "nvidia.com/gpumem": "2000"}
    await admin.create(paths.pods(namespace), bare_pod("three-halves", hami))
    with pytest.raises(kube_errors.ForbiddenError, match=r"exceeded quota: gpus.*gpu-milli-total=600"):
        await admin.create(paths.pods(namespace), bare_pod("too-much", {names.GPU_MILLI: "600"}))
    await admin.create(paths.pods(namespace), bare_pod("fits", {names.GPU_MILLI: "500", names.GPU_MEMORY: "2000"}))
    with pytest.raises(kube_errors.ForbiddenError, match=r"exceeded quota: gpus"):
        await admin.create(paths.pods(namespace), bare_pod("one-more", {names.GPU_MILLI: "1"}))


async def test_admissions_through_the_api_server_are_counted_on_metrics(
    admin: client.KubeClient, webhook: RunningWebhook, namespace: str, control_plane: controlplane.ControlPlane
) -> None:
    context = ssl.create_default_context(cadata=certs.pem(webhook.ca_cert).decode())
    for token, status in ((None, 401), ("alice-token", 403)):  # a token the API server vouches for, not allowed
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            aiohttp.ClientSession(headers=headers) as session,
            session.get(f"{webhook.url}/metrics", ssl=context) as refused,
        ):
            assert refused.status == status

    async def counted() -> dict[tuple[str, str], float]:
        reader = {"Authorization": f"Bearer {control_plane.token('admin')}"}
        async with (
            aiohttp.ClientSession(headers=reader) as session,
            session.get(f"{webhook.url}/metrics", ssl=context) as got,
        ):
            assert got.status == 200
            text = await got.text()
        return {
            (s.labels["kind"], s.labels["outcome"]): s.value
            for family in parser.text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "sharegpu_webhook_admissions_total"
        }

    before = await counted()
    await admin.create(paths.pods(namespace), bare_pod("counted", {"aliyun.com/gpu-mem": "1"}))
    with pytest.raises(kube_errors.ApiError):
        await admin.create(paths.pods(namespace), bare_pod("refused", {names.GPU: "1", names.GPU_MILLI: "1001"}))
    after = await counted()

    def more(kind: str, outcome: str) -> float:
        return after.get((kind, outcome), 0) - before.get((kind, outcome), 0)

    assert more("mutate", "allowed") >= 1 and more("validate", "allowed") >= 1, (before, after)
    assert more("mutate", "denied") + more("validate", "denied") >= 1, (before, after)


async def test_a_debug_container_sees_no_gpu_and_sets_nothing_only_sharegpu_sets(
    admin: client.KubeClient, webhook: RunningWebhook, control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """`kubectl debug` adds a container through pods/ephemeralcontainers, which a tenant may be granted
    to debug its pods: what it adds is reviewed like a new pod's containers."""
    alice = await _as_tenant(control_plane, admin, namespace, "alice")
    group = "rbac.authorization.k8s.io"
    rule = {"apiGroups": [""], "resources": ["pods/ephemeralcontainers"], "verbs": ["patch", "update"]}
    meta = {"name": "debug", "namespace": namespace}
    await stack.apply(admin, {"apiVersion": f"{group}/v1", "kind": "Role", "metadata": meta, "rules": [rule]})
    await stack.apply(admin, {"apiVersion": f"{group}/v1", "kind": "RoleBinding", "metadata": meta,
                              "roleRef": {"apiGroup": group, "kind": "Role", "name": "debug"},
                              "subjects": [{"kind": "User", "name": "alice", "apiGroup": group}]})  # fmt: skip
    await asyncio.sleep(0.5)
    target = f"/api/v1/namespaces/{namespace}/pods/target"
    try:
        await alice.create(f"/api/v1/namespaces/{namespace}/pods", bare_pod("target", {"cpu": "100m"}))
        added: list[Json] = []

        async def debug(container: Json) -> Json:
            return await alice.patch(f"{target}/ephemeralcontainers",
                                     {"spec": {"ephemeralContainers": [*added, container]}})  # fmt: skip

        with pytest.raises(kube_errors.ApiError) as refused:
            await debug(
                {"name": "sneaky", "image": "cuda-debug", "env": [{"name": "NVIDIA_IMEX_CHANNELS", "value": "0"}]}
            )
        assert "NVIDIA_IMEX_CHANNELS is set by sharegpu only" in refused.value.message
        assert "a pod may set only NVIDIA_REQUIRE_*" in refused.value.message
        stored = await debug({"name": "debug", "image": "cuda-debug",
                              "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})  # fmt: skip
        added = stored["spec"]["ephemeralContainers"]
        assert _visible(added[0]) == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}], "all replaced by void"
        stored = await debug({"name": "debug2", "image": "cuda-debug", "envFrom": [{"configMapRef": {"name": "x"}}]})
        assert [_visible(c) for c in stored["spec"]["ephemeralContainers"]] == [
            [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]] * 2, "what it sets loses to void"  # fmt: skip
    finally:
        await alice.close()


async def test_a_gpu_container_loads_variables_wholesale_only_under_a_prefix(
    admin: client.KubeClient, webhook: RunningWebhook, control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    """envFrom could set NVIDIA_VISIBLE_DEVICES (or another variable only sharegpu sets) in a container
    that gets a GPU, where the device plugin's value does not win over it; under a prefix it cannot.
    A container given no GPU may: its NVIDIA_VISIBLE_DEVICES=void wins over what it loads."""
    alice = await _as_tenant(control_plane, admin, namespace, "alice")
    loads = [{"configMapRef": {"name": "settings"}}]
    try:
        for limits in ({names.NVIDIA_GPU: "1"}, SHARE):
            pod = bare_pod(f"g-{uuid.uuid4().hex[:5]}", limits)
            pod["spec"]["containers"][0]["envFrom"] = loads
            with pytest.raises(kube_errors.ApiError) as refused:
                await alice.create(f"/api/v1/namespaces/{namespace}/pods", pod)
            assert "envFrom ConfigMap settings needs a prefix" in refused.value.message
            pod["spec"]["containers"][0]["envFrom"] = [{**loads[0], "prefix": "APP_"}]
            await alice.create(f"/api/v1/namespaces/{namespace}/pods", pod)
            pod["metadata"]["name"] += "n"
            pod["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "keys"}, "prefix": "NVIDIA_"}]
            with pytest.raises(kube_errors.ApiError) as refused:
                await alice.create(f"/api/v1/namespaces/{namespace}/pods", pod)
            assert "envFrom Secret keys needs a prefix" in refused.value.message
        cpu = bare_pod("cpu", {"cpu": "100m"})
        cpu["spec"]["containers"][0]["envFrom"] = loads
        stored = await alice.create(f"/api/v1/namespaces/{namespace}/pods", cpu)
        assert _visible(stored["spec"]["containers"][0]) == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    finally:
        await alice.close()
