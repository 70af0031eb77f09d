"""The chart installed, upgraded and uninstalled with the pinned helm into a real API server of the
suite's version (and the oldest admitted: the module is marked `oldest`), on a control plane of its
own (the chart's webhook configurations would turn the other tests' pods away). No kubelet runs, so
the Deployments stay without pods: the webhook is down, which is what shows the chart's CEL
`matchConditions` evaluated by the API server (from 1.36, where they are on by default: a pod asking
for no GPU is admitted, and the chart's MutatingAdmissionPolicy makes it see none; below, every pod
reaches the webhook and is refused while it is down). Then a webhook answers (the chart's
configuration pointed at it by URL, its conditions kept) and a GPU pod is translated."""

from __future__ import annotations

import asyncio
import base64
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import yaml

from sharegpu.api import names
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import certs
from sharegpu.webhook import server
from tests.conftest import helm, render
from tests.integration.conftest import RunningWebhook, bare_pod, wait_for
from tests.webhook.conftest import ROWS

Json = dict[str, Any]
SYSTEM = names.SYSTEM_NAMESPACE
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    made = controlplane.ControlPlane(tmp_path_factory.mktemp("helm"), controlplane.binaries())
    made.start()
    yield made
    made.stop()


@pytest.fixture(scope="module")
async def kube(plane: controlplane.ControlPlane) -> AsyncIterator[client.KubeClient]:
    made = stack.kube_for(plane, "admin")
    yield made
    await made.close()


async def run_helm(plane: controlplane.ControlPlane, *args: str) -> str:
    env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig("admin"))}
    process = await asyncio.create_subprocess_exec(
        helm(), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    text = out.decode() + err.decode()
    assert process.returncode == 0, f"helm {' '.join(args)}: {text}"
    return text


def path_of(doc: Json) -> str:
    """The REST path of a rendered object (the kinds the chart renders)."""
    group_version = doc["apiVersion"]
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    plural = {
        "ServiceAccount": "serviceaccounts", "Secret": "secrets", "ConfigMap": "configmaps", "Service": "services",
        "Deployment": "deployments", "DaemonSet": "daemonsets", "PodDisruptionBudget": "poddisruptionbudgets",
        "ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings", "Role": "roles",
        "RoleBinding": "rolebindings", "PriorityClass": "priorityclasses",
        "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
        "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
        "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
        "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
        "MutatingAdmissionPolicy": "mutatingadmissionpolicies",
        "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings",
        "NetworkPolicy": "networkpolicies", "Namespace": "namespaces", "CSIDriver": "csidrivers",
    }[doc["kind"]]  # fmt: skip
    namespace = doc["metadata"].get("namespace")
    where = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
    return f"{where}/{doc['metadata']['name']}"


async def exists(kube: client.KubeClient, path: str) -> bool:
    try:
        await kube.get(path)
    except kube_errors.NotFoundError:
        return False
    return True


async def test_install_upgrade_and_uninstall_with_the_charts_conditions_evaluated(
    plane: controlplane.ControlPlane, kube: client.KubeClient, tmp_path_factory: pytest.TempPathFactory
) -> None:
    chart = str(stack.CHART)
    await run_helm(plane, "install", "sharegpu", chart, "-n", SYSTEM, "--create-namespace")
    docs = render(plane.version)
    for doc in docs:  # every object the chart renders was accepted and stored
        assert await exists(kube, path_of(doc)), f"{doc['kind']} {doc['metadata']['name']} not stored"
    crds = [yaml.safe_load(p.read_text()) for p in sorted((stack.CHART / "crds").glob("*.yaml"))]

    async def established() -> bool:
        for crd in crds:
            found = await kube.get(f"{CRDS}/{crd['metadata']['name']}")
            conditions = {c["type"]: c["status"] for c in (found.get("status") or {}).get("conditions") or []}
            if conditions.get("Established") != "True":
                return False
        return True

    await wait_for(established, what="the chart's CRDs established")
    mutating = await kube.get(f"{ADMISSION}/mutatingwebhookconfigurations/sharegpu")
    (hook,) = mutating["webhooks"]
    policies = tuple(int(p) for p in plane.version.split(".")[:2]) >= (1, 36)
    if policies:  # matchConditions=auto: on where a MutatingAdmissionPolicy hides GPUs from the rest
        assert [c["name"] for c in hook["matchConditions"]] == ["concerns-gpus"], "the API server kept the CEL"
    else:
        assert "matchConditions" not in hook, "below 1.36 every pod reaches the webhook, which hides GPUs"

    # Every webhook replica is down (no kubelet runs its pods) and the failure policy is Fail: the
    # API server evaluates the conditions and sends only pods that concern GPUs, and those fail.
    namespace = f"t-{uuid.uuid4().hex[:6]}"
    await kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    await asyncio.sleep(1.5)  # the API server picks up new webhook configurations asynchronously
    plain = bare_pod("plain", {"cpu": "100m"})
    plain["spec"]["initContainers"] = [{"name": "setup", "image": "cuda-based"}]
    if policies:  # the pod asking for no GPU is created, and sees none (its image may say `all`)
        stored = await kube.create(f"/api/v1/namespaces/{namespace}/pods", plain)
        spec = stored["spec"]
        for container in spec["containers"] + spec["initContainers"]:
            assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in container["env"], container
    else:
        with pytest.raises(kube_errors.ApiError) as refused:
            await kube.create(f"/api/v1/namespaces/{namespace}/pods", plain)
        assert "webhook" in str(refused.value)
    for fmt, limits, pod_annotations, _, _ in ROWS:
        name = f"gpu-{uuid.uuid4().hex[:6]}"
        with pytest.raises(kube_errors.ApiError) as refused:
            await kube.create(f"/api/v1/namespaces/{namespace}/pods", bare_pod(name, limits, pod_annotations))
        assert "sharegpu" in str(refused.value) and "webhook" in str(refused.value), (fmt, str(refused.value))
    # A MIG device of the device plugin (mig-strategy mixed) concerns GPUs: the webhook, not the no-GPU
    # policy, decides (which leaves the device plugin's value standing).
    with pytest.raises(kube_errors.ApiError) as refused:
        await kube.create(f"/api/v1/namespaces/{namespace}/pods", bare_pod("mig", {"nvidia.com/mig-1g.10gb": "1"}))
    assert "sharegpu" in str(refused.value) and "webhook" in str(refused.value), str(refused.value)
    # A pod written as Kubernetes documents DRA (a claim, no GPU resource) reaches it too: it may need the gate.
    claiming = bare_pod("claiming", {"cpu": "100m"})
    claiming["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "any"}]
    with pytest.raises(kube_errors.ApiError) as refused:
        await kube.create(f"/api/v1/namespaces/{namespace}/pods", claiming)
    assert "sharegpu" in str(refused.value) and "webhook" in str(refused.value), str(refused.value)

    # A webhook answers at a URL, the chart's conditions kept: a GPU pod is translated.
    running = RunningWebhook(tmp_path_factory.mktemp("hook"))
    ready = asyncio.Event()
    task = asyncio.create_task(server.serve("127.0.0.1", running.port, running.cert, running.key, running.hook,
                                            str(plane.kubeconfig("admin")), ready))  # fmt: skip
    configurations = {kind: f"{ADMISSION}/{kind}webhookconfigurations/sharegpu" for kind in ("mutating", "validating")}
    originals = {kind: await kube.get(url) for kind, url in configurations.items()}
    try:
        await ready.wait()
        bundle = certs.pem(running.ca_cert)
        for kind, path in (("mutating", "/mutate/pods"), ("validating", "/validate/pods")):
            url = configurations[kind]
            found = await kube.get(url)
            for item in found["webhooks"]:
                if item["name"].startswith("pods."):
                    item["clientConfig"] = {"url": f"{running.url}{path}", "caBundle": _b64(bundle)}
            await kube.replace(url, found)
        await asyncio.sleep(1.5)

        async def translated() -> Json | None:
            name = f"koord-{uuid.uuid4().hex[:6]}"
            try:
                return await kube.create(
                    f"/api/v1/namespaces/{namespace}/pods", bare_pod(name, {"koordinator.sh/gpu-core": "30"})
                )
            except kube_errors.ApiError:
                return None  # the API server has not picked up the new URL yet

        stored = await wait_for(translated, timeout=30, what="a GPU pod admitted once the webhook answers")
        limits = stored["spec"]["containers"][0]["resources"]["limits"]
        assert limits[names.GPU_MILLI] == "300" and "koordinator.sh/gpu-core" not in limits
        assert "koordinator.sh/gpu-core" in stored["metadata"]["annotations"][names.TRANSLATED]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for kind, url in configurations.items():  # as the chart wrote them (helm applies server-side: a
            current = await kube.get(url)  # field another manager set to another value is a conflict)
            await kube.replace(url, {**originals[kind], "metadata": current["metadata"]})

    # Upgrade: a changed value lands; the chart's certificates are kept (it reads the Secret back).
    secret = f"/api/v1/namespaces/{SYSTEM}/secrets/sharegpu-webhook-tls"
    before = (await kube.get(secret))["data"]
    await run_helm(plane, "upgrade", "sharegpu", chart, "-n", SYSTEM, "--set", "extender.policy=binpack")
    assert (await kube.get(secret))["data"] == before, "the webhook's certificate survives an upgrade"
    deployment = await kube.get(f"/apis/apps/v1/namespaces/{SYSTEM}/deployments/sharegpu-scheduler")
    args = deployment["spec"]["template"]["spec"]["containers"][1]["args"]
    assert "--policy=binpack" in args, args
    # Near their expiry (the Secret's annotation says when), the chart's certificates are made again by
    # the next upgrade; the old CA stays in the bundle beside the new one, and the pods roll.
    rolled = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/tls"]
    soon = str(int(time.time()) + 10 * 86_400)
    for name in ("sharegpu-webhook-tls", "sharegpu-extender-tls"):
        await kube.patch(f"/api/v1/namespaces/{SYSTEM}/secrets/{name}",
                         {"metadata": {"annotations": {"sharegpu.io/not-after": soon}}})  # fmt: skip
    # The test's own writes (this annotation, the configurations it pointed at its webhook) are another
    # field manager's: the upgrade takes them over.
    await run_helm(plane, "upgrade", "sharegpu", chart, "-n", SYSTEM, "--set", "extender.policy=binpack",
                   "--force-conflicts")  # fmt: skip
    renewed = await kube.get(secret)
    assert renewed["data"]["tls.crt"] != before["tls.crt"]
    bundle = base64.b64decode(renewed["data"]["ca.crt"])
    assert bundle.count(b"BEGIN CERTIFICATE") == 2 and base64.b64decode(before["ca.crt"]) in bundle
    assert int(renewed["metadata"]["annotations"]["sharegpu.io/not-after"]) > int(soon) + 300 * 86_400
    mutating = await kube.get(f"{ADMISSION}/mutatingwebhookconfigurations/sharegpu")
    assert base64.b64decode(mutating["webhooks"][0]["clientConfig"]["caBundle"]) == bundle
    deployment = await kube.get(f"/apis/apps/v1/namespaces/{SYSTEM}/deployments/sharegpu-scheduler")
    assert deployment["spec"]["template"]["metadata"]["annotations"]["checksum/tls"] != rolled

    # Uninstall: everything goes but the CRDs (helm never deletes what crds/ installed), as documented.
    await run_helm(plane, "uninstall", "sharegpu", "-n", SYSTEM)
    for crd in crds:
        assert await exists(kube, f"{CRDS}/{crd['metadata']['name']}"), crd["metadata"]["name"]

    async def gone() -> bool:
        kept = [d for d in docs if d["kind"] != "Namespace" and await exists(kube, path_of(d))]
        return not kept

    await wait_for(gone, timeout=60, what="every rendered object removed")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
