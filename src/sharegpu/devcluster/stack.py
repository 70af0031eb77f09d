"""The whole sharegpu stack on a local control plane, as one object: used by the integration suite,
the benchmarks and `sharegpu devcluster`.

Starts the control plane, installs the project's CRDs and RBAC (bound to each component's own
identity, so RBAC is exercised for real), runs the extender as its own process and kube-scheduler
with the project's scheduler configuration (the chart's files/scheduler, placeholders filled), and optionally
the fake-cluster harness. kube-scheduler reaches the extender over HTTPS with a client certificate,
as in production: the stack makes a small PKI for that link (`ExtenderPki`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml
from prometheus_client import parser

from sharegpu.agent import runtime as agent_runtime
from sharegpu.api import dra, names, paths
from sharegpu.core import devices, errors, policies
from sharegpu.devcluster import agents, controlplane, fakecluster
from sharegpu.kube import client, credentials, transport
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import certs, tls
from sharegpu.webhook import config as webhook_config

Json = dict[str, Any]
DEPLOY = controlplane.data_path("deploy")
CHART = DEPLOY / "helm" / "sharegpu"
"""The Helm chart: its crds/ and files/ (RBAC, PriorityClasses, scheduler configurations) are the one
copy of those manifests; the local stack applies the same files."""

_PATHS = {
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
    "Namespace": "/api/v1/namespaces",
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
    "PriorityClass": paths.PRIORITY_CLASSES,
    "ValidatingAdmissionPolicy": paths.ADMISSION_POLICIES,
    "ValidatingAdmissionPolicyBinding": paths.ADMISSION_POLICY_BINDINGS,
    "CSIDriver": "/apis/storage.k8s.io/v1/csidrivers",
    "MutatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
}
HARNESS_USERS = {
    names.account("agent"): controlplane.NODE_HARNESS,
    names.account("scheduler"): "system:kube-scheduler",
}
"""ServiceAccount of the chart -> the token user that also plays it on the local control plane: the
fake nodes' agents (one identity for many nodes) and the scheduler (kube-scheduler's own user). The
extender, webhook and controller run as their ServiceAccounts' user names, bound as the chart binds."""


async def apply(kube: client.KubeApi, doc: Json) -> None:
    """Create `doc` unless it exists."""
    path = _PATHS[doc["kind"]].format(namespace=doc["metadata"].get("namespace", ""))
    try:
        await kube.create(path, doc)
    except kube_errors.ConflictError as exc:
        if not exc.already_exists:
            raise


def with_harness(doc: Json) -> Json:
    """A chart binding, also bound to the harness user that plays its ServiceAccount locally."""
    subjects = doc.get("subjects") or []
    for subject in list(subjects):
        user = HARNESS_USERS.get(subject.get("name", ""))
        if subject.get("kind") == "ServiceAccount" and user is not None:
            subjects.append({"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"})
    return doc


def kube_for(plane: controlplane.ControlPlane, user: str, connections: int = 64) -> client.KubeClient:
    return kube_with_token(plane, plane.token(user), connections)


def kube_with_token(plane: controlplane.ControlPlane, token: str, connections: int = 64) -> client.KubeClient:
    assert plane.bundle is not None
    creds = credentials.static(plane.url, token=token, ca_file=str(plane.bundle.ca_cert))
    return client.KubeClient(transport.AiohttpTransport(creds, connections=connections), creds)


async def issue_token(kube: client.KubeApi, namespace: str, account: str, pod: Json | None = None) -> str:
    """A token of ServiceAccount `namespace/account` as TokenRequest issues it (the kubelet projects
    the same into a pod): bound to `pod` when given, so that it names the pod and, once the pod is
    on a node, the node (`authentication.kubernetes.io/node-name`), and dies with the pod."""
    spec: Json = {"expirationSeconds": 3600}
    if pod is not None:
        meta = pod["metadata"]
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    issued = await kube.create(f"{paths.namespace(namespace)}/serviceaccounts/{account}/token", request)
    return str(issued["status"]["token"])


def manifests(relative: str, root: Path = CHART) -> list[Json]:
    """The documents of a shipped manifest under the chart (`crds/*.yaml`, `files/rbac/extender.yaml`,
    ...; `root=DEPLOY` for `compat/NAME/*.yaml`), in order."""
    docs: list[Json] = []
    for path in sorted(root.glob(relative)):
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


BOOTSTRAP_RBAC = "files/rbac/webhook-bootstrap.yaml"
"""The webhook's right to register itself (`sharegpu webhook --bootstrap`): applied with the webhook
that needs it (`Stack`), as the chart renders it only in bootstrap mode."""


HOLDING_LABELS: Final = {
    names.LABEL_ADMISSION: "skip",
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
"""The GPU-holding pods' namespace's labels (the chart's templates/namespace.yaml)."""


def object_path(doc: Json) -> str:
    """Where a document `apply` makes lives."""
    collection = _PATHS[doc["kind"]].format(namespace=doc["metadata"].get("namespace", ""))
    return f"{collection}/{doc['metadata']['name']}"


def compat_rbac(compat: tuple[str, ...]) -> list[Json]:
    """The RBAC the compatibility resources named add (deploy/compat/NAME/rbac.yaml), harness bound."""
    found = (d for name in compat for d in manifests(f"compat/{name}/*.yaml", DEPLOY))
    return [with_harness(d) for d in found if d["kind"] != "CustomResourceDefinition"]


async def install(kube: client.KubeApi, compat: tuple[str, ...] = (), *, compat_roles: bool = True) -> None:
    """Namespace, ServiceAccounts, CRDs, RBAC, PriorityClasses and admission policies from the chart
    (and the compatibility resources named, from deploy/compat/NAME: with `compat_roles`, their
    RBAC too), then wait until every custom resource is served."""
    await apply(kube, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": names.SYSTEM_NAMESPACE}})
    holding = {"name": names.HOLDING_NAMESPACE, "labels": HOLDING_LABELS}  # as the chart's templates/namespace.yaml
    await apply(kube, {"apiVersion": "v1", "kind": "Namespace", "metadata": holding})
    for component in names.COMPONENTS:  # the chart's templates/rbac.yaml makes them beside the roles
        account = {"name": names.account(component), "namespace": names.account_namespace(component)}
        await apply(kube, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account})
    served = []
    crds = [*manifests("crds/*.yaml"), *(d for name in compat for d in manifests(f"compat/{name}/*.yaml", DEPLOY))]
    for doc in crds:
        if doc["kind"] != "CustomResourceDefinition":
            continue
        await apply(kube, doc)
        spec = doc["spec"]
        served += [paths.custom(spec["group"], v["name"], spec["names"]["plural"]) for v in spec["versions"]]
    bootstrap = manifests(BOOTSTRAP_RBAC)
    chart = [d for d in manifests("files/rbac/*.yaml") if d not in bootstrap]
    for doc in [*chart, *(compat_rbac(compat) if compat_roles else [])]:
        await apply(kube, with_harness(doc))
    for doc in manifests("files/priority/*.yaml"):
        await apply(kube, doc)
    for doc in manifests("files/policies/*.yaml"):
        await apply(kube, doc)
    await wait_served(kube, served)


async def wait_served(kube: client.KubeApi, collections: list[str], timeout: float = 30.0) -> None:
    """Wait until the API server serves every collection (new CRDs take a moment to be established);
    ControlPlaneError naming those it still does not after `timeout` seconds."""
    waiting = list(collections)
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        with contextlib.suppress(kube_errors.KubeError):
            await kube.get(waiting[0])
            waiting.pop(0)
            continue
        await asyncio.sleep(0.2)
    if waiting:
        raise controlplane.ControlPlaneError(f"custom resources not served in time: {', '.join(waiting)}")


@dataclass(frozen=True, slots=True)
class ExtenderPki:
    """The scheduler-to-extender link: the extender's serving pair, the CA that signed it (which the
    scheduler trusts), and the client pair the scheduler presents (signed by the same CA, which the
    extender requires)."""

    ca: Path
    serving_cert: Path
    serving_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, folder: Path) -> ExtenderPki:
        ca_cert, ca_key, ca_path = certs.write_ca(folder, "sharegpu-extender-ca")
        serving = certs.issue_serving(ca_cert, ca_key, "sharegpu-extender", dns_names=("localhost",),
                                      ip_addresses=("127.0.0.1",))  # fmt: skip
        serving_cert, serving_key = certs.write_pair(folder, *serving, stem="extender")
        scheduler = certs.issue_client(ca_cert, ca_key, "sharegpu-scheduler")
        client_cert, client_key = certs.write_pair(folder, *scheduler, stem="scheduler")
        return cls(ca_path, serving_cert, serving_key, client_cert, client_key)


@dataclass(frozen=True, slots=True)
class HealthPki:
    """The health ports' pair of the stack's component processes (TLS, as the chart serves them),
    signed by a CA of its own that the stack's clients verify it with."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def of(cls, plane: controlplane.ControlPlane) -> HealthPki:
        """The control plane's, made on first use."""
        folder = plane.workdir / "health-pki"
        made = cls(folder / "ca.crt", folder / "tls.crt", folder / "tls.key")
        if not all(path.is_file() for path in (made.ca, made.cert, made.key)):
            ca_cert, ca_key, _ = certs.write_ca(folder, "sharegpu-health-ca")
            dns, ips = tls.SELF_SIGNED_NAMES
            certs.write_pair(folder, *certs.issue_serving(ca_cert, ca_key, "sharegpu-health", dns_names=dns,
                                                          ip_addresses=ips))  # fmt: skip
        return made

    def args(self) -> list[str]:
        return ["--health-cert", str(self.cert), "--health-key", str(self.key)]

    def client(self) -> ssl.SSLContext:
        """A client context that trusts only this CA."""
        return ssl.create_default_context(cafile=self.ca)


class _ComponentProcess:
    """A sharegpu component as a real process in its own session (so it can be SIGKILLed, group
    and all), logging into the control plane's log folder; its health port served over TLS
    (`health_ssl` verifies it)."""

    name = ""
    process: subprocess.Popen[bytes] | None = None
    log: Path
    health_pki: HealthPki
    health_port: int

    @property
    def health_url(self) -> str:
        return f"https://127.0.0.1:{self.health_port}"

    @functools.cached_property
    def health_ssl(self) -> ssl.SSLContext:
        """What a client of the health port verifies it with."""
        return self.health_pki.client()

    def _spawn(self, argv: list[str]) -> None:
        with self.log.open("ab") as handle:
            self.process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)

    def _check_alive(self) -> None:
        """ControlPlaneError with the log's tail if the process has exited."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise controlplane.ControlPlaneError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=15)

    def pause(self) -> None:
        """Stop the process where it is (SIGSTOP), as a long stall would; `resume` lets it go on."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)

    async def _wait_ready(self, readyz: str, timeout: float) -> None:
        """Until `readyz` answers 200 (ControlPlaneError if the process exits or time runs out)."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(readyz, ssl=self.health_ssl) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise controlplane.ControlPlaneError(f"{self.name} not ready in time")


class ExtenderProcess(_ComponentProcess):
    """`sharegpu extender` as a real process, with its own credentials."""

    name = "extender"

    def __init__(
        self,
        plane: controlplane.ControlPlane,
        policy: str = policies.DEFAULT,
        *extra: str,
        pki: ExtenderPki | None = None,
        kubeconfig: Path | None = None,
    ) -> None:
        self.plane = plane
        self.port = controlplane.free_port()
        self.health_port = controlplane.free_port()
        self.policy = policy
        self.extra = extra
        self.pki = pki or ExtenderPki.make(plane.workdir / f"extender-pki-{self.port}")
        self.health_pki = HealthPki.of(plane)
        self.kubeconfig = kubeconfig or plane.kubeconfig("sharegpu-extender")
        self.log = plane.workdir / "logs" / f"extender-{self.port}.log"

    @property
    def url(self) -> str:
        """Where kube-scheduler calls filter, prioritize and bind (mutual TLS)."""
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "sharegpu", "extender",
            "--kubeconfig", str(self.kubeconfig),
            "--host", "127.0.0.1", "--port", str(self.port), "--health-port", str(self.health_port),
            "--tls-cert", str(self.pki.serving_cert), "--tls-key", str(self.pki.serving_key),
            "--client-ca", str(self.pki.ca), *self.health_pki.args(),
            "--policy", self.policy, "--log-level", "WARNING", *self.extra,
        ]  # fmt: skip
        self._spawn(argv)

    async def wait_ready(self, timeout: float = 60) -> None:
        await self._wait_ready(f"{self.health_url}/readyz", timeout)

    @property
    def headers(self) -> dict[str, str]:
        """What /metrics and /debug ask of a caller (`serving.access`): the cluster admin's token."""
        return {"Authorization": f"Bearer {self.plane.token('admin')}"}

    async def get(self, path: str) -> Any:
        async with (
            aiohttp.ClientSession(headers=self.headers) as session,
            session.get(f"{self.health_url}{path}", ssl=self.health_ssl) as response,
        ):
            return await response.json()

    async def connections(self) -> dict[str, int]:
        """Connections accepted on the scheduler port so far, by protocol (from /metrics)."""
        return await self.counted("sharegpu_extender_connections_total", "protocol")

    async def counted(self, sample_name: str, label: str) -> dict[str, int]:
        """A counter of /metrics, by one of its labels."""
        url = f"{self.health_url}/metrics"
        async with (
            aiohttp.ClientSession(headers=self.headers) as session,
            session.get(url, ssl=self.health_ssl) as response,
        ):
            text = await response.text()
        return {
            sample.labels[label]: int(sample.value)
            for family in parser.text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == sample_name
        }

    async def debug_nodes(self) -> list[Json]:
        body = await self.get("/debug/nodes")
        return list(body["nodes"])


def scheduler_config(
    plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    *,
    name: str = "kube-scheduler",
    leader_elect: bool = False,
    lease: tuple[float, float, float] = (15.0, 10.0, 2.0),
) -> Path:
    """The chart's files/scheduler/scheduler-config.yaml with its placeholders filled in."""
    text = (CHART / "files" / "scheduler" / "scheduler-config.yaml").read_text()
    for key, value in {
        "${KUBECONFIG}": str(plane.kubeconfig("system:kube-scheduler")),
        "${EXTENDER_URL}": extender.url,
        "${EXTENDER_CLIENT_CERT}": str(extender.pki.client_cert),
        "${EXTENDER_CLIENT_KEY}": str(extender.pki.client_key),
        "${EXTENDER_CA}": str(extender.pki.ca),
        "${LEADER_ELECT}": "true" if leader_elect else "false",
        "${LEASE_NAME}": "sharegpu-scheduler",  # its own: the local stack's extenders elect on theirs
        "${LEASE_DURATION}": f"{lease[0]:g}s",
        "${RENEW_DEADLINE}": f"{lease[1]:g}s",
        "${RETRY_PERIOD}": f"{lease[2]:g}s",
    }.items():
        text = text.replace(key, value)
    path = plane.workdir / f"{name}-config.yaml"
    path.write_text(text)
    return path


class WebhookProcess(_ComponentProcess):
    """`sharegpu webhook` as a real process: it makes its own CA and serving certificate (bootstrap)
    and registers both webhook configurations at its https://127.0.0.1 address."""

    name = "webhook"

    def __init__(self, plane: controlplane.ControlPlane, extra: tuple[str, ...] = ()) -> None:
        self.plane = plane
        self.extra = extra
        """More arguments (`--default-path dra`)."""
        self.port = controlplane.free_port()
        self.folder = plane.workdir / f"webhook-{self.port}"
        self.log = plane.workdir / "logs" / f"webhook-{self.port}.log"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "sharegpu", "webhook",
            "--bootstrap", str(self.folder), "--url", self.url, "--ip-address", "127.0.0.1",
            "--kubeconfig", str(self.plane.kubeconfig("sharegpu-webhook")),
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "WARNING", *self.extra,
        ]  # fmt: skip
        self._spawn(argv)

    async def wait_ready(self, kube: client.KubeApi, timeout: float = 60) -> None:
        """Until it answers /readyz (it has listed the Devices) and its configurations are registered."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(aiohttp.ClientError, kube_errors.KubeError):
                    async with session.get(f"{self.url}/readyz", ssl=False) as response:
                        await kube.get(f"{webhook_config.MUTATING_PATH}/{webhook_config.NAME}")
                        if response.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise controlplane.ControlPlaneError("webhook not ready in time")


class ControllerProcess(_ComponentProcess):
    """`sharegpu controller` as a real process, with its own credentials and health port."""

    name = "controller"

    @property
    def headers(self) -> dict[str, str]:
        """What /metrics and /debug ask of a caller (`serving.access`): the cluster admin's token."""
        return {"Authorization": f"Bearer {self.plane.token('admin')}"}

    def __init__(self, plane: controlplane.ControlPlane, *extra: str, kubeconfig: Path | None = None) -> None:
        self.plane = plane
        self.health_port = controlplane.free_port()
        self.health_pki = HealthPki.of(plane)
        self.extra = extra
        self.kubeconfig = kubeconfig or plane.kubeconfig("sharegpu-controller")
        """Its credentials: the controller's own unless a test gives others."""
        self.log = plane.workdir / "logs" / f"controller-{self.health_port}.log"

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "sharegpu", "controller",
            "--kubeconfig", str(self.kubeconfig),
            "--host", "127.0.0.1", "--health-port", str(self.health_port), *self.health_pki.args(),
            "--log-level", "WARNING", *self.extra,
        ]  # fmt: skip
        self._spawn(argv)

    async def wait_ready(self, timeout: float = 60) -> None:
        await self._wait_ready(f"{self.health_url}/readyz", timeout)


class Stack:
    def __init__(
        self,
        workdir: Path,
        policy: str = policies.DEFAULT,
        extender_args: tuple[str, ...] = (),
        *,
        webhook: bool = False,
        controller: bool = False,
        compat: tuple[str, ...] = (),
        dra: bool = False,
        scheduler_args: tuple[str, ...] = (),
        feature_gates: tuple[str, ...] = (),
        runtime_config: tuple[str, ...] = (),
    ) -> None:
        self.plane = controlplane.ControlPlane(
            workdir, controlplane.binaries(), feature_gates=feature_gates, runtime_config=runtime_config
        )
        self.scheduler_args = scheduler_args
        """More arguments for sharegpu's kube-scheduler (`--feature-gates=...`)."""
        self.compat = compat
        self.dra = dra
        """The GPU nodes serve DRA claims (their agents publish ResourceSlices), sharegpu's DeviceClass
        is made, and the webhook sends GPU pods the DRA way (`--default-path dra`)."""
        self.policy = policy
        self.extender_args = extender_args
        self.with_webhook = webhook
        self.with_controller = controller
        self.webhook: WebhookProcess | None = None
        self.controller: ControllerProcess | None = None
        self.extender: ExtenderProcess | None = None
        self.admin: client.KubeClient | None = None
        self.harness: fakecluster.FakeCluster | None = None
        self.agents: agents.NodeAgents | None = None
        self.agent_api: client.KubeClient | None = None

    async def add_gpu_nodes(self, nodes: list[devices.NodeInventory]) -> Path:
        """Fake nodes whose Devices their own agents write (one per node, on a fake NVML file in the
        folder this returns). The nodes offer HAMi-core (a stand-in library file)."""
        assert self.harness is not None, "start() first"
        folder = self.plane.workdir / "nvml"
        if self.agents is None:
            library = self.plane.workdir / "hami-core" / "libvgpu.so"
            library.parent.mkdir(parents=True, exist_ok=True)
            library.write_bytes(b"")  # a stand-in: no GPU here to limit
            self.agent_api = kube_for(self.plane, "sharegpu-agent", connections=32)
            interval = max(10.0, len(nodes) / 20)
            options = agent_runtime.Options(
                interval=interval, hami_core_library=library, hami_core_dir=self.plane.workdir / "hami-core-installed",
                dra=self.dra,
            )  # fmt: skip
            self.agents = agents.NodeAgents(self.agent_api, folder, options)
        await self.harness.add_nodes(nodes, publish=False)
        await self.agents.add(nodes)
        return folder

    async def start(self, harness: bool = True) -> None:
        try:
            await self._start(harness)
        except BaseException:
            await self.stop()  # leave no process behind when a part fails to start
            raise

    async def _start(self, harness: bool) -> None:
        if self.dra and tuple(int(p) for p in self.plane.version.split(".")[:2]) < (1, 36):
            raise errors.SharegpuError(
                f"DRA needs Kubernetes 1.36 or later (consumable capacity), this control plane is {self.plane.version}"
            )
        self.plane.start()
        self.admin = kube_for(self.plane, "admin", connections=128)
        await install(self.admin, self.compat)
        if self.dra:
            with contextlib.suppress(kube_errors.ConflictError):
                await self.admin.create(dra.DEVICE_CLASSES, dra.device_class())
        self.extender = ExtenderProcess(self.plane, self.policy, *self.extender_args)
        self.extender.start()
        await self.extender.wait_ready()
        self.plane.start_scheduler(scheduler_config(self.plane, self.extender), extra=self.scheduler_args)
        if self.with_webhook:
            for doc in manifests(BOOTSTRAP_RBAC):
                await apply(self.admin, doc)
            self.webhook = WebhookProcess(self.plane, ("--default-path", names.PATH_DRA) if self.dra else ())
            self.webhook.start()
            await self.webhook.wait_ready(self.admin)
        if self.with_controller:
            self.controller = ControllerProcess(self.plane, *(f"--compat={name}" for name in self.compat))
            self.controller.start()
            await self.controller.wait_ready()
        self.harness = fakecluster.FakeCluster(self.admin)
        if harness:
            await self.harness.start()

    async def stop(self) -> None:
        """Stop everything, whatever state each part is in (a part that failed must not keep the
        others running)."""
        with contextlib.suppress(Exception):
            if self.agents is not None:
                await self.agents.stop()
        with contextlib.suppress(Exception):
            if self.agent_api is not None:
                await self.agent_api.close()
        with contextlib.suppress(Exception):
            if self.harness is not None:
                await self.harness.stop()
        with contextlib.suppress(Exception):
            if self.controller is not None:
                self.controller.kill(signal.SIGTERM)
        with contextlib.suppress(Exception):
            if self.webhook is not None:
                self.webhook.kill(signal.SIGTERM)
        with contextlib.suppress(Exception):
            if self.extender is not None:
                self.extender.kill(signal.SIGTERM)
        with contextlib.suppress(Exception):
            if self.admin is not None:
                await self.admin.close()
        self.plane.stop()
