"""The Helm chart, rendered by the pinned helm (scripts/tools) for the Kubernetes versions it supports:
lint clean; the kube-scheduler configuration in the API each version serves, using only fields that
version's types have (tests/data/scheduler-config, from the upstream types); the webhook
configurations as the webhook itself registers them; values checked by the schema."""

from __future__ import annotations

import base64
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from sharegpu.api import dra, names
from sharegpu.devcluster import stack
from sharegpu.webhook import config
from tests.conftest import one, render, run_helm

FIELDS = Path(__file__).parent / "data" / "scheduler-config"
VERSIONS = ("1.32.2", "1.34.0", "1.37.2")
"""The two ends of the range the chart admits (both run in the integration suite), and one between."""
Json = dict[str, Any]


@pytest.mark.parametrize("version", VERSIONS)
def test_lint_is_clean_for_each_version(version: str) -> None:
    done = run_helm("lint", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, "--kube-version", version)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout and "ERROR" not in done.stdout, done.stdout


def _unknown_fields(value: Any, type_name: str, types: dict[str, Any], at: str) -> list[str]:
    """Paths in `value` that `type_name` (from the upstream field lists) does not have."""
    fields = types[type_name]
    out: list[str] = []
    for key, item in value.items():
        where = f"{at}.{key}"
        if key not in fields:
            out.append(where)
            continue
        kind = fields[key]
        if isinstance(kind, list):
            out += [p for i, e in enumerate(item) for p in _unknown_fields(e, kind[0], types, f"{where}[{i}]")]
        elif kind not in ("scalar", "any", "map"):
            out += _unknown_fields(item, kind, types, where)
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_the_scheduler_configuration_is_v1_with_only_its_fields(version: str) -> None:
    docs = render(version)
    configuration = yaml.safe_load(one(docs, "ConfigMap", "sharegpu-scheduler")["data"]["config.yaml"])
    reference = yaml.safe_load((FIELDS / "v1.yaml").read_text())
    assert configuration["apiVersion"] == reference["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert _unknown_fields(configuration, reference["root"], reference["types"], "$") == []
    assert "${" not in yaml.safe_dump(configuration), "every placeholder filled"
    (profile,) = configuration["profiles"]
    assert profile["schedulerName"] == names.SCHEDULER_NAME
    (extender,) = configuration["extenders"]
    assert extender["urlPrefix"] == "https://127.0.0.1:8888" and extender["tlsConfig"]["caFile"].endswith("ca.crt")
    assert configuration["leaderElection"]["resourceNamespace"] == names.SYSTEM_NAMESPACE
    scheduler = one(docs, "Deployment", "sharegpu-scheduler")["spec"]["template"]["spec"]["containers"][0]
    assert scheduler["image"] == f"registry.k8s.io/kube-scheduler:v{version}"


def test_budgets_are_policy_v1_and_an_older_cluster_is_refused() -> None:
    assert {d["apiVersion"] for d in render("1.32.2") if d["kind"] == "PodDisruptionBudget"} == {"policy/v1"}
    eks = render("1.33.2-eks-1234")  # a provider's suffix: the image tag is the plain version
    image = one(eks, "Deployment", "sharegpu-scheduler")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.k8s.io/kube-scheduler:v1.33.2"
    done = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, "--kube-version", "1.31.9")
    assert done.returncode != 0 and "kubeVersion" in done.stderr and ">=1.32.0-0" in done.stderr, done.stderr


def _hooks(doc: Json) -> dict[str, Json]:
    return {h["name"]: h for h in doc["webhooks"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_webhook_configurations_are_the_webhooks_own_plus_the_charts_guards(version: str) -> None:
    docs = render(version)
    service = {"namespace": names.SYSTEM_NAMESPACE, "name": "sharegpu-webhook", "port": 443}
    bundle = base64.b64decode(one(docs, "Secret", "sharegpu-webhook-tls")["data"]["ca.crt"])
    expected = config.configurations(service, bundle)
    for want, kind in zip(expected, ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"), strict=True):
        got = _hooks(one(docs, kind, config.NAME))
        assert set(got) == set(_hooks(want))
        for name, hook in _hooks(want).items():
            rendered = dict(got[name])
            if "evictions" not in name:  # the chart's conditions; the agents' evictions: always the webhook's own
                conditions = rendered.pop("matchConditions", None)
                on = version >= "1.36"  # matchConditions=auto: on where the no-GPU policy is served
                assert (conditions is not None) == (on and "devices" not in name and "groups" not in name)
            selector = rendered.get("namespaceSelector")
            if selector is not None:  # the chart also skips kube-system and its own namespace by name
                by_name = selector["matchExpressions"].pop()
                skipped = ["kube-system", names.SYSTEM_NAMESPACE, names.HOLDING_NAMESPACE]
                assert by_name == {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": skipped}
            assert rendered == hook, name
    args = one(docs, "Deployment", "sharegpu-webhook")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--system-user=system:serviceaccount:{names.SYSTEM_NAMESPACE}:sharegpu-extender" in args


def _conditions(docs: list[Json]) -> list[Json] | None:
    conditions: list[Json] | None = _hooks(one(docs, "MutatingWebhookConfiguration", "sharegpu"))[
        "pods.mutate.sharegpu.io"
    ].get("matchConditions")
    return conditions


def test_the_webhook_does_not_take_the_cluster_down() -> None:
    docs = render("1.37.2")
    assert one(docs, "Deployment", "sharegpu-webhook")["spec"]["replicas"] == 2
    budget = one(docs, "PodDisruptionBudget", "sharegpu-webhook")["spec"]
    assert budget["minAvailable"] == 1
    (condition,) = _conditions(docs) or []
    for word in ("gpu", "vcuda", "NVIDIA_", "envFrom", "sharegpu.io/", "initContainers", "ephemeralContainers",
                 "kubeshare/", "'gpu-'"):  # fmt: skip
        assert word in condition["expression"], word
    assert _conditions(render("1.37.2", "webhook.matchConditions=false")) is None


@pytest.mark.parametrize(("version", "setting", "conditions", "hidden"), [
    ("1.37.2", "auto", True, True), ("1.36.0", "auto", True, True), ("1.35.3", "auto", False, False),
    ("1.32.2", "auto", False, False), ("1.37.2", "false", False, False), ("1.32.2", "true", True, False),
])  # fmt: skip
def test_pods_asking_for_no_gpu_are_hidden_from_gpus_by_the_webhook_or_by_a_policy(
    version: str, setting: str, conditions: bool, hidden: bool
) -> None:
    """Every pod that asks for no GPU gets NVIDIA_VISIBLE_DEVICES=void: where matchConditions keep it
    from the webhook, from the MutatingAdmissionPolicy, whose conditions are the webhook's negated
    (1.36 and later); `auto` turns matchConditions off where that policy is not served. Only an
    operator who forces them on below 1.36 leaves such pods to their image (docs/security.md)."""
    docs = render(version, f"webhook.matchConditions={setting}")
    assert (_conditions(docs) is not None) == conditions
    policies = [d for d in docs if d["kind"] in ("MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")]
    assert len(policies) == (2 if hidden else 0)
    if hidden:
        policy = one(docs, "MutatingAdmissionPolicy", "sharegpu-no-gpu")["spec"]
        (webhook,) = _conditions(docs) or []
        (negated,) = policy["matchConditions"]
        assert "".join(negated["expression"].split()) == "".join(f"!({webhook['expression']})".split())
        hook = _hooks(one(docs, "MutatingWebhookConfiguration", "sharegpu"))["pods.mutate.sharegpu.io"]
        assert policy["matchConstraints"]["namespaceSelector"] == hook["namespaceSelector"]


def _handshake(secret: Json, tmp: Path, server_name: str, mutual: bool) -> str:
    """A TLS handshake between two contexts built from a rendered Secret (the client checking the
    server's name); the name the server's certificate was verified for."""
    for key in ("ca.crt", "tls.crt", "tls.key"):
        (tmp / key).write_bytes(base64.b64decode(secret["data"][key]))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp / "tls.crt", tmp / "tls.key")
    client = ssl.create_default_context(cafile=str(tmp / "ca.crt"))
    if mutual:
        server.load_verify_locations(tmp / "ca.crt")
        server.verify_mode = ssl.CERT_REQUIRED
        client.load_cert_chain(tmp / "tls.crt", tmp / "tls.key")
    left, right = socket.socketpair()
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(left, server_side=True) as tls:
                tls.recv(1)
        except (ssl.SSLError, OSError) as exc:
            failures.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client.wrap_socket(right, server_hostname=server_name) as tls:
            tls.sendall(b"x")
            peer = tls.getpeercert()
    finally:
        thread.join(5)
    assert not failures, failures
    assert peer is not None
    return str(peer["subject"])


def test_the_generated_certificates_are_p256_and_work_by_the_names_their_clients_use(tmp_path: Path) -> None:
    docs = render("1.34.0")
    extender, webhook = one(docs, "Secret", "sharegpu-extender-tls"), one(docs, "Secret", "sharegpu-webhook-tls")
    for secret in (extender, webhook):
        for key in ("ca.crt", "tls.crt"):
            public = x509.load_pem_x509_certificate(base64.b64decode(secret["data"][key])).public_key()
            assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1", key
    # kube-scheduler calls https://127.0.0.1:8888 with the same pair as its client certificate.
    assert "sharegpu-extender" in _handshake(extender, tmp_path, "127.0.0.1", mutual=True)
    # The API server calls the webhook through its Service, by the Service's DNS name.
    assert "sharegpu-webhook" in _handshake(webhook, tmp_path, f"sharegpu-webhook.{names.SYSTEM_NAMESPACE}.svc", False)
    with pytest.raises(ssl.SSLCertVerificationError, match="match"):
        _handshake(webhook, tmp_path, "sharegpu-webhook.elsewhere.svc", mutual=False)


def test_cert_manager_is_used_when_its_api_is_served() -> None:
    done = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, "--api-versions",
                    "cert-manager.io/v1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    certificate = one(docs, "Certificate", "sharegpu-webhook")
    assert "sharegpu-webhook.sharegpu-system.svc" in certificate["spec"]["dnsNames"]
    mutating = one(docs, "MutatingWebhookConfiguration", "sharegpu")
    assert mutating["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "sharegpu-system/sharegpu-webhook"
    assert "caBundle" not in mutating["webhooks"][0]["clientConfig"]
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "sharegpu-webhook-tls"]


def test_every_component_has_its_own_service_account_and_the_shipped_rbac() -> None:
    docs = render("1.32.2")
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    components = ("scheduler", "extender", "webhook", "controller", "agent", "reserve")
    assert accounts == {f"sharegpu-{c}" for c in components}
    assert names.RESERVE_ACCOUNT in accounts, "the account sharegpu's GPU-holding pods run as"
    where = {d["metadata"]["name"]: d["metadata"]["namespace"] for d in docs if d["kind"] == "ServiceAccount"}
    assert {c: where[names.account(c)] for c in components} == {c: names.account_namespace(c) for c in components}
    kinds = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    bootstrap = stack.manifests("files/rbac/webhook-bootstrap.yaml")
    shipped = [*(d for d in stack.manifests("files/rbac/*.yaml") if d not in bootstrap),
               *(d for d in stack.manifests("files/policies/*.yaml") if d["kind"] in kinds)]  # fmt: skip
    rendered = [d for d in docs if d["kind"] in kinds]
    key = lambda d: (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])  # noqa: E731
    assert sorted(rendered, key=key) == sorted(shipped, key=key)
    registering = render("1.32.2", "webhook.certificates.source=bootstrap", "webhook.replicas=1")
    assert sorted((d for d in registering if d["kind"] in kinds), key=key) == sorted([*shipped, *bootstrap], key=key)
    workloads = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["serviceAccountName"]
                 for d in docs if d["kind"] in ("Deployment", "DaemonSet")}  # fmt: skip
    assert workloads == {"sharegpu-scheduler": "sharegpu-scheduler", "sharegpu-webhook": "sharegpu-webhook",
                         "sharegpu-controller": "sharegpu-controller", "sharegpu-agent": "sharegpu-agent"}  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "agent.onViolation=shoot"],
            "at '/agent/onViolation': value must be one of 'report', 'kill', 'evict'",
        ),
        (["--set", "webhook.bogus=1"], "at '/webhook': additional properties 'bogus' not allowed"),
        (["--set", "scheduler.leaderElection.leaseDuration=soon"], "/scheduler/leaderElection/leaseDuration"),
        (["--set", "controller.compat={volcano}"], "/controller/compat/0"),
        (["--set", "scheduler.leaderElection.retryPeriod=2m"], "/scheduler/leaderElection/retryPeriod"),
        (["--set", "agent.paths.kubelet=var/lib/kubelet"], "/agent/paths/kubelet"),
    ],
)
def test_bad_values_are_refused_naming_the_value(args: list[str], message: str) -> None:
    done = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, *args)
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_another_namespace_is_refused_with_the_reason() -> None:
    done = run_helm("template", "s", str(stack.CHART), "-n", "default")
    assert done.returncode != 0
    assert 'install sharegpu into the namespace sharegpu-system (helm install -n sharegpu-system), not "default"' in (
        done.stderr
    )


def test_every_component_is_annotated_for_scraping_on_the_port_that_serves_its_metrics() -> None:
    docs = render("1.34.0")
    for name, port in (
        ("sharegpu-scheduler", "health"), ("sharegpu-controller", "health"), ("sharegpu-agent", "health"),
        ("sharegpu-webhook", "https"),
    ):  # fmt: skip
        kind = "DaemonSet" if name == "sharegpu-agent" else "Deployment"
        template = one(docs, kind, name)["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics", name
        assert annotations["prometheus.io/port"] == str(ports[port]), name
        assert annotations["prometheus.io/scheme"] == "https", name
    quiet = render("1.34.0", "metrics.podAnnotations=false")
    template = one(quiet, "Deployment", "sharegpu-controller")["spec"]["template"]
    assert "annotations" not in template["metadata"]


def test_a_pod_monitor_only_where_the_prometheus_operator_is_and_asked_for() -> None:
    assert not [d for d in render("1.34.0") if d["kind"] == "PodMonitor"], "off by default"
    args = ["template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, "--set", "metrics.podMonitor.enabled=true"]
    refused = run_helm(*args)
    assert refused.returncode != 0 and "monitoring.coreos.com/v1 PodMonitor" in refused.stderr
    done = run_helm(*args, "--set", "metrics.podMonitor.labels.release=prom",
                    "--api-versions", "monitoring.coreos.com/v1/PodMonitor")  # fmt: skip
    assert done.returncode == 0, done.stderr
    monitor = one([d for d in yaml.safe_load_all(done.stdout) if d], "PodMonitor", "sharegpu")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {"health", "https"}
    assert all(e["honorLabels"] and e["path"] == "/metrics" for e in endpoints.values())
    assert endpoints["https"]["scheme"] == "https"
    assert endpoints["https"]["tlsConfig"]["ca"] == {"secret": {"name": "sharegpu-webhook-tls", "key": "ca.crt"}}
    assert endpoints["health"]["scheme"] == "https", "the health ports serve TLS"
    verified = {"ca": {"secret": {"name": "sharegpu-health-tls", "key": "ca.crt"}},
                "serverName": f"sharegpu-health.{names.SYSTEM_NAMESPACE}.svc"}  # fmt: skip
    assert endpoints["health"]["tlsConfig"] == verified
    bad = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE,
                   "--set", "metrics.podMonitor.interval=often")  # fmt: skip
    assert bad.returncode != 0 and "/metrics/podMonitor/interval" in bad.stderr


def test_the_webhooks_own_bootstrap_is_one_replica_writing_its_ca_into_the_configurations() -> None:
    done = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE,
                    "--set", "webhook.certificates.source=bootstrap")  # fmt: skip
    assert done.returncode != 0 and "set webhook.replicas=1" in done.stderr, done.stderr
    docs = render("1.34.0", "webhook.certificates.source=bootstrap", "webhook.replicas=1")
    spec = one(docs, "Deployment", "sharegpu-webhook")["spec"]["template"]["spec"]
    assert "--bootstrap=/etc/sharegpu/webhook-tls" in spec["containers"][0]["args"]
    assert {"name": "tls", "emptyDir": {}} in spec["volumes"]
    assert not [d for d in docs if d["kind"] in ("Secret", "Certificate") and "webhook" in d["metadata"]["name"]]
    assert all(
        "caBundle" not in h["clientConfig"] for h in one(docs, "ValidatingWebhookConfiguration", "sharegpu")["webhooks"]
    )
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "sharegpu-webhook"]


def test_the_defragmenter_is_off_unless_asked_and_then_gets_its_flags() -> None:
    def args(*settings: str) -> list[str]:
        template = one(render("1.32.2", *settings), "Deployment", "sharegpu-controller")["spec"]["template"]
        found: list[str] = template["spec"]["containers"][0]["args"]
        return [a for a in found if a.startswith("--defrag")]

    assert args() == []
    assert args("controller.defrag.enabled=true") == ["--defrag", "--defrag-budget-per-hour=10"]
    assert args("controller.defrag.dryRun=true", "controller.defrag.budgetPerHour=3") == [
        "--defrag-dry-run",
        "--defrag-budget-per-hour=3",
    ]


def test_the_extender_preempts_unless_told_not_to() -> None:
    def args(*settings: str) -> list[str]:
        template = one(render("1.37.2", *settings), "Deployment", "sharegpu-scheduler")["spec"]["template"]
        (extender,) = [c for c in template["spec"]["containers"] if c["name"] == "extender"]
        found: list[str] = extender["args"]
        return [a for a in found if "preemption" in a]

    assert args() == []
    assert args("extender.preemption=false") == ["--no-preemption"]
    done = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, "--set", "extender.preemption=1")
    assert done.returncode != 0 and "/extender/preemption" in done.stderr, done.stderr


def test_the_agent_probes_its_isolation_modes_unless_told_not_to() -> None:
    def agent(*settings: str) -> tuple[list[str], str]:
        template = one(render("1.37.2", *settings), "DaemonSet", "sharegpu-agent")["spec"]["template"]
        (container,) = template["spec"]["containers"]
        flags = [a for a in container["args"] if "probe" in a or "compute" in a]
        [capabilities] = [e["value"] for e in container["env"] if e["name"] == "NVIDIA_DRIVER_CAPABILITIES"]
        return flags, capabilities

    assert agent() == ([], "compute,utility"), "the probe loads libcuda: the runtime must mount it"
    assert agent("agent.isolationProbe=false") == (["--no-isolation-probe"], "utility")
    assert agent("agent.hamiCoreLibrary=", "agent.mps=false") == ([], "utility"), "nothing to probe"
    assert agent("agent.hamiCoreEnforcesCompute=true")[0] == ["--hami-core-enforces-compute"]
    assert agent("agent.isolationProbe=false", "agent.mps=true")[1] == "compute,utility"


def test_the_dra_device_class_is_rendered_only_where_dra_is_on_and_served() -> None:
    def classes(*args: str) -> list[Json]:
        done = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, *args)
        assert done.returncode == 0, done.stderr
        return [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "DeviceClass"]

    served = ("--kube-version", "1.37.2", "--api-versions", "resource.k8s.io/v1/DeviceClass")
    [made] = classes(*served, "--set", "agent.dra=true")
    assert made["apiVersion"] == "resource.k8s.io/v1" and made["metadata"]["name"] == dra.DRIVER
    assert made["spec"]["selectors"] == [{"cel": {"expression": dra.CLASS_SELECTOR}}], "one definition, chart and code"
    assert classes(*served) == [], "off unless agent.dra"
    assert len(classes(*served, "--set", "agent.draNodeSelector.a=b")) == 1, "or some nodes serve DRA"
    assert classes("--kube-version", "1.32.2", "--set", "agent.dra=true") == [], "not served on 1.32"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_admission_policies_are_the_files_the_stack_applies_and_name_what_sharegpu_names(version: str) -> None:
    """The chart ships files/policies as they are (the local stack applies the same files), and the
    hand-off policy names the prefixes and accounts the components use (`api.names`)."""
    docs = render(version)
    kinds = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    shipped = [d for d in stack.manifests("files/policies/*.yaml") if d["kind"] in kinds]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted((d for d in docs if d["kind"] in kinds), key=key) == sorted(shipped, key=key)
    policy = one(shipped, "ValidatingAdmissionPolicy", names.HANDOFF_POLICY)
    assert one(shipped, "ValidatingAdmissionPolicyBinding", names.HANDOFF_POLICY)["spec"] == {
        "policyName": names.HANDOFF_POLICY, "validationActions": ["Deny"]}  # fmt: skip
    text = yaml.safe_dump(policy["spec"], width=10_000)
    for name in (f"'{names.HANDOFF_PREFIX}'", f"'{names.GROUP_PREFIX}'", names.account_user("extender"),
                 names.account_user("controller")):  # fmt: skip
        assert name in text, name
    assert policy["spec"]["failurePolicy"] == "Fail"


def test_the_agent_runs_under_the_runtimes_seccomp_filter_and_mounts_only_its_own_plugin_folders() -> None:
    agent = one(render("1.37.2", "agent.dra=true"), "DaemonSet", "sharegpu-agent")["spec"]["template"]["spec"]
    (container,) = agent["containers"]
    assert container["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    paths_ = {v["hostPath"]["path"] for v in agent["volumes"] if "hostPath" in v}
    assert {f"/var/lib/kubelet/plugins/{dra.DRIVER}", f"/var/lib/kubelet/plugins/{names.VOLUMES_DRIVER}"} <= paths_
    assert "/var/lib/kubelet/plugins" not in paths_, "other drivers' sockets are not the agent's"


def test_the_agent_mounts_and_names_the_nodes_folders_where_the_values_say_at_the_same_paths() -> None:
    """A distribution that moves the kubelet's root (k0s) and the runtime's CDI folder: every host path
    of the agent is under the values, mounted at the same path, and the agent is told each."""
    docs = render("1.37.2", "agent.dra=true", "agent.paths.kubelet=/var/lib/k0s/kubelet/", "agent.paths.cdi=/etc/cdi")
    agent = one(docs, "DaemonSet", "sharegpu-agent")["spec"]["template"]["spec"]
    (container,) = agent["containers"]
    hosts = {v["name"]: v["hostPath"]["path"] for v in agent["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    kubelet = {n: p for n, p in hosts.items() if "kubelet" in p}
    assert set(kubelet) == {"pod-resources", "kubelet-registry", "kubelet-plugin", "volumes-plugin", "kubelet-pods"}
    assert all(p.startswith("/var/lib/k0s/kubelet/") and mounts[n] == p for n, p in kubelet.items()), hosts
    assert hosts["cdi"] == mounts["cdi"] == "/etc/cdi"
    args = container["args"]
    for flag in ("--kubelet-socket=/var/lib/k0s/kubelet/pod-resources/kubelet.sock",
                 "--kubelet-plugins-dir=/var/lib/k0s/kubelet/plugins",
                 "--kubelet-registry-dir=/var/lib/k0s/kubelet/plugins_registry", "--cdi-dir=/etc/cdi"):  # fmt: skip
        assert flag in args, args


def test_a_dra_node_selector_splits_the_agents_so_that_each_node_serves_one_path() -> None:
    """With agent.draNodeSelector, the nodes it picks get the agent with --dra, every other node the
    agent without it: the two DaemonSets' node affinities are each other's complement, their pods'
    selectors do not overlap, and the DeviceClass is rendered; setting agent.dra as well is refused."""
    docs = render("1.37.2", r"agent.draNodeSelector.sharegpu\.io/dra=yes", "agent.draNodeSelector.rack=r1")
    plain, dra_ = (one(docs, "DaemonSet", n)["spec"] for n in ("sharegpu-agent", "sharegpu-agent-dra"))
    assert plain["selector"] != dra_["selector"]
    for spec in (plain, dra_):
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert "--dra" not in plain["template"]["spec"]["containers"][0]["args"]
    assert "--dra" in dra_["template"]["spec"]["containers"][0]["args"]

    def terms(spec: Json) -> list[list[Json]]:
        affinity = spec["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        return [t["matchExpressions"] for t in affinity["nodeSelectorTerms"]]

    wanted = [{"key": "rack", "values": ["r1"]}, {"key": "sharegpu.io/dra", "values": ["yes"]}]
    assert terms(dra_) == [[{**w, "operator": "In"} for w in wanted]], "all the labels"
    assert terms(plain) == [[{**w, "operator": "NotIn"}] for w in wanted], "any label missing"
    done = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, "--set", "agent.dra=true",
                    "--set", "agent.draNodeSelector.a=b")  # fmt: skip
    assert done.returncode != 0 and "agent.dra and agent.draNodeSelector: set one" in done.stderr, done.stderr
    single = [d["metadata"]["name"] for d in render("1.37.2", "agent.dra=true") if d["kind"] == "DaemonSet"]
    assert single == ["sharegpu-agent"]


def test_the_extender_follows_the_lease_kube_scheduler_elects_on_with_the_same_terms() -> None:
    docs = render("1.37.2", "scheduler.leaderElection.leaseDuration=20s")
    pod = one(docs, "Deployment", "sharegpu-scheduler")["spec"]["template"]["spec"]
    extender = next(c for c in pod["containers"] if c["name"] == "extender")
    assert "--follow-scheduler" in extender["args"] and "--lease-duration=20" in extender["args"]
    assert "--leader-elect" not in extender["args"]
    config = yaml.safe_load(one(docs, "ConfigMap", "sharegpu-scheduler")["data"]["config.yaml"])
    assert config["leaderElection"]["resourceName"] == names.EXTENDER_LEASE
    assert config["leaderElection"]["leaseDuration"] == "20s"


def test_the_volume_plugin_is_the_codes_driver_and_only_it_makes_the_agent_privileged() -> None:
    docs = render("1.37.2")
    driver = one(docs, "CSIDriver", names.VOLUMES_DRIVER)
    assert [driver] == stack.manifests("files/volumes/csidriver.yaml"), "the file the tests apply"
    assert driver["spec"] == {"attachRequired": False, "podInfoOnMount": True, "fsGroupPolicy": "None",
                              "volumeLifecycleModes": ["Ephemeral"]}, "each mount names its pod"  # fmt: skip
    agent = one(docs, "DaemonSet", "sharegpu-agent")["spec"]["template"]["spec"]
    (container,) = agent["containers"]
    assert container["securityContext"]["privileged"] is True
    assert {"name": "kubelet-pods", "mountPath": "/var/lib/kubelet/pods", "mountPropagation": "Bidirectional"} in (
        container["volumeMounts"]
    ), "its binds reach the host"
    assert "--no-volumes" not in container["args"]

    docs = render("1.37.2", "agent.volumes=false")
    assert [d for d in docs if d["kind"] == "CSIDriver"] == []
    (container,) = one(docs, "DaemonSet", "sharegpu-agent")["spec"]["template"]["spec"]["containers"]
    context = container["securityContext"]
    assert "privileged" not in context and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "DAC_READ_SEARCH"]}
    assert "--no-volumes" in container["args"]
    assert all(m["name"] not in ("kubelet-pods", "kubelet-registry") for m in container["volumeMounts"])


def test_network_policies_let_in_only_the_webhooks_callers_and_the_scrapes_and_are_off_on_request() -> None:
    docs = render("1.37.2")
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["sharegpu-default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    holding = one(docs, "NetworkPolicy", "sharegpu-holding-default-deny")
    assert holding["metadata"]["namespace"] == names.HOLDING_NAMESPACE, "the GPU-holding pods take nothing"
    assert holding["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    webhook = policies["sharegpu-webhook"]
    assert webhook["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "webhook"
    assert webhook["ingress"] == [{"ports": [{"port": 8443, "protocol": "TCP"}]}], "the API server: any address"
    ports = {"scheduler": 8889, "controller": 8890, "agent": 9403}
    for component, port in ports.items():
        spec = policies[f"sharegpu-{component}-metrics"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert spec["ingress"] == [{"from": [{"namespaceSelector": {}}], "ports": [{"port": port, "protocol": "TCP"}]}]
    narrowed = render("1.37.2", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring")
    spec = one(narrowed, "NetworkPolicy", "sharegpu-agent-metrics")["spec"]
    assert spec["ingress"][0]["from"] == [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]
    assert not [d for d in render("1.37.2", "networkPolicy.enabled=false") if d["kind"] == "NetworkPolicy"]


def test_the_charts_certificates_last_a_year_and_the_scheduler_has_a_client_pair_of_its_own() -> None:
    from cryptography.x509.oid import ExtendedKeyUsageOID

    docs = render("1.37.2")
    pki = one(docs, "Secret", "sharegpu-extender-tls")
    pairs = {
        stem: x509.load_pem_x509_certificate(base64.b64decode(pki["data"][f"{stem}.crt"])) for stem in ("tls", "client")
    }
    assert pairs["tls"].subject != pairs["client"].subject and pairs["tls"].public_key() != pairs["client"].public_key()
    assert (
        ExtendedKeyUsageOID.CLIENT_AUTH
        in pairs["client"].extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )
    for secret in (pki, one(docs, "Secret", "sharegpu-webhook-tls"), one(docs, "Secret", "sharegpu-health-tls")):
        leaf = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
        assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days == 365
        assert (
            abs(int(secret["metadata"]["annotations"]["sharegpu.io/not-after"]) - leaf.not_valid_after_utc.timestamp())
            < 600
        )
    spec = one(docs, "Deployment", "sharegpu-scheduler")["spec"]["template"]["spec"]
    mounted = {v["name"]: [i["key"] for i in v["secret"]["items"]] for v in spec["volumes"] if "secret" in v}
    assert mounted == {
        "extender-tls": ["ca.crt", "tls.crt", "tls.key"],
        "scheduler-tls": ["ca.crt", "client.crt", "client.key"],
        "health-tls": ["tls.crt", "tls.key"],
    }
    config = yaml.safe_load(one(docs, "ConfigMap", "sharegpu-scheduler")["data"]["config.yaml"])
    (extender,) = config["extenders"]
    assert extender["tlsConfig"]["certFile"].endswith("/client.crt")


def test_the_gpu_holding_pods_have_a_namespace_of_their_own_at_podsecurity_restricted() -> None:
    """Apart from the privileged agent and the components' tokens; sharegpu's admission skips it."""
    holding = one(render("1.37.2"), "Namespace", names.HOLDING_NAMESPACE)
    labels = holding["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted" and labels[names.LABEL_ADMISSION] == "skip"
    assert stack.HOLDING_LABELS.items() <= labels.items(), "the local stack labels it as the chart does"
    roles = [d for d in stack.manifests("files/rbac/*.yaml") if d["kind"] == "Role"]
    pod_roles = {d["metadata"]["name"]: d["metadata"]["namespace"] for d in roles
                 if any("pods" in rule.get("resources", []) for rule in d["rules"])}  # fmt: skip
    assert pod_roles and set(pod_roles.values()) == {names.HOLDING_NAMESPACE}, pod_roles


def test_every_health_port_serves_tls_with_the_charts_health_certificate() -> None:
    """The bearer tokens /metrics and /debug ask for cross the pod network only inside TLS (the
    PodMonitor verifies the name: test_a_pod_monitor_only_where_the_prometheus_operator_is_and_asked_for)."""
    docs = render("1.37.2")
    secret = one(docs, "Secret", "sharegpu-health-tls")["data"]
    ca, leaf = (x509.load_pem_x509_certificate(base64.b64decode(secret[key])) for key in ("ca.crt", "tls.crt"))
    leaf.verify_directly_issued_by(ca)
    server_name = f"sharegpu-health.{names.SYSTEM_NAMESPACE}.svc"
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    ) == [server_name]
    for kind, name, index in (("Deployment", "sharegpu-scheduler", 1), ("Deployment", "sharegpu-controller", 0),
                              ("DaemonSet", "sharegpu-agent", 0)):  # fmt: skip
        spec = one(docs, kind, name)["spec"]["template"]["spec"]
        container = spec["containers"][index]
        mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "health-tls")
        assert f"--health-cert={mount}/tls.crt" in container["args"], name
        assert f"--health-key={mount}/tls.key" in container["args"], name
        assert "--plain-health" not in container["args"], name
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["scheme"] == "HTTPS", (name, probe)
        (volume,) = [v for v in spec["volumes"] if v["name"] == "health-tls"]
        assert volume["secret"]["secretName"] == "sharegpu-health-tls"


def test_the_schedulers_feature_gates_are_rendered_as_its_flag_and_checked() -> None:
    """scheduler.featureGates becomes one --feature-gates flag of sharegpu's kube-scheduler (none by
    default); a gate's name or value of the wrong form is refused by the schema."""

    def command(*values: str) -> list[str]:
        deployment = one(render("1.37.2", *values), "Deployment", "sharegpu-scheduler")
        found: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        return found

    assert not any(a.startswith("--feature-gates") for a in command())
    gates = command("scheduler.featureGates.NominatedNodeNameForExpectation=false",
                    "scheduler.featureGates.OpportunisticBatching=true")  # fmt: skip
    assert gates[-1] == "--feature-gates=NominatedNodeNameForExpectation=false,OpportunisticBatching=true"
    for wrong, said in (("scheduler.featureGates.not-a-gate=false", "'not-a-gate' does not match pattern"),
                        ("scheduler.featureGates.SomeGate=maybe", "want boolean")):  # fmt: skip
        done = run_helm("template", "s", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, "--set", wrong)
        assert done.returncode != 0 and said in done.stderr, (wrong, done.stderr)
