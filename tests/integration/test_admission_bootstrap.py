"""`sharegpu webhook --bootstrap`: makes its CA and a certificate for the names it is reached by,
writes the CA bundle into its own webhook configurations with only the permissions of
deploy/helm/sharegpu/files/rbac/webhook.yaml, and the API server then calls it by DNS name and verifies that name."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from sharegpu.api import names, paths, quantity
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import certs
from sharegpu.webhook import config as webhook_config
from tests.integration.conftest import bare_pod

ALIYUN = {"aliyun.com/gpu-mem": "1"}
"""A GPU share the Aliyun way: only the webhook makes it schedulable."""


async def wait_listening(port: int, log: Path, process: subprocess.Popen[bytes]) -> None:
    for _ in range(150):
        if process.poll() is not None:
            pytest.fail(f"webhook exited:\n{log.read_text()}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    pytest.fail(f"webhook did not start:\n{log.read_text()}")


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "sharegpu", "webhook", *argv], stdout=handle, stderr=subprocess.STDOUT
        )


async def test_bootstrap_serves_the_dns_name_the_api_server_calls(
    admin: client.KubeClient, system: None, control_plane: controlplane.ControlPlane, namespace: str, tmp_path: Path
) -> None:
    port = controlplane.free_port()
    folder = tmp_path / "pki"
    log = tmp_path / "webhook.log"
    for doc in stack.manifests(stack.BOOTSTRAP_RBAC):  # the chart renders it in bootstrap mode
        await stack.apply(admin, doc)
    process = start(
        ["--bootstrap", str(folder), "--url", f"https://localhost:{port}", "--dns-name", "localhost",
         "--kubeconfig", str(control_plane.kubeconfig("sharegpu-webhook")), "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "WARNING"],
        log,
    )  # fmt: skip
    try:
        await wait_listening(port, log, process)
        served = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
        san = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == ["localhost"]
        assert san.get_values_for_type(x509.IPAddress) == [], "only the names asked for"
        mutating = await admin.get(f"{webhook_config.MUTATING_PATH}/{webhook_config.NAME}")
        assert mutating["webhooks"][0]["clientConfig"]["url"].startswith("https://localhost:")
        bundle = base64.b64decode(mutating["webhooks"][0]["clientConfig"]["caBundle"])
        assert bundle == (folder / "ca.crt").read_bytes()
        await asyncio.sleep(1.5)  # the API server picks up new webhook configurations asynchronously
        await admin.create(paths.pods(namespace), bare_pod("boot", ALIYUN))
        stored = await admin.get(paths.pod(namespace, "boot"))
        limits = stored["spec"]["containers"][0]["resources"]["limits"]
        assert quantity.parse(limits[names.GPU_MEMORY]) == 1024, "translated by the webhook, reached by name"
    finally:
        await webhook_config.uninstall(admin)
        process.terminate()
        process.wait(timeout=10)
        for doc in stack.manifests(stack.BOOTSTRAP_RBAC):
            await admin.delete(stack.object_path(doc))


async def test_a_certificate_without_the_called_name_is_refused_by_the_api_server(
    admin: client.KubeClient, system: None, control_plane: controlplane.ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """What the bootstrap used to do (a certificate for other names): with failurePolicy Fail, pod
    creation is refused, which is why the names matter."""
    ca_cert, ca_key, _ = certs.write_ca(tmp_path, "other-ca")
    cert, key = certs.write_serving_pair(tmp_path, ca_cert, ca_key, dns_names=("sharegpu-webhook.sharegpu-system.svc",))
    port = controlplane.free_port()
    log = tmp_path / "webhook.log"
    process = start(
        ["--cert", str(cert), "--key", str(key), "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
        log,
    )
    try:
        await wait_listening(port, log, process)
        await webhook_config.install(admin, f"https://localhost:{port}", certs.pem(ca_cert))
        await asyncio.sleep(1.5)
        with pytest.raises(kube_errors.ApiError, match="x509: certificate is valid for sharegpu-webhook"):
            await admin.create(paths.pods(namespace), bare_pod("refused", ALIYUN))
    finally:
        await webhook_config.uninstall(admin)
        process.terminate()
        process.wait(timeout=10)
