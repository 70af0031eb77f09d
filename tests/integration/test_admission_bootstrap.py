"""`sharegpu webhook --bootstrap`: makes its CA and certificate and writes the CA bundle into its own
webhook configurations, with only the permissions of deploy/rbac/webhook.yaml; the API server then
reaches it over TLS."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
from pathlib import Path

import pytest

from sharegpu.api import names, quantity
from sharegpu.devcluster import controlplane
from sharegpu.kube import client
from sharegpu.webhook import config as webhook_config


async def test_bootstrap_writes_its_ca_bundle_and_serves(
    admin: client.KubeClient, system: None, control_plane: controlplane.ControlPlane, namespace: str, tmp_path: Path
) -> None:
    port = controlplane.free_port()
    folder = tmp_path / "pki"
    log = tmp_path / "webhook.log"
    with log.open("wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "sharegpu", "webhook", "--bootstrap", str(folder), "--url",
             f"https://127.0.0.1:{port}", "--kubeconfig", str(control_plane.kubeconfig("sharegpu-webhook")),
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
            stdout=handle, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        for _ in range(100):
            if (folder / "ca.crt").exists():
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()
                    break
                except OSError:
                    pass
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"webhook did not start:\n{log.read_text()}")
        mutating = await admin.get(f"{webhook_config.MUTATING_PATH}/{webhook_config.NAME}")
        bundle = base64.b64decode(mutating["webhooks"][0]["clientConfig"]["caBundle"])
        assert bundle == (folder / "ca.crt").read_bytes()
        await asyncio.sleep(1.5)
        pod = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "boot"},
            "spec": {"nodeSelector": {"sharegpu.io/test": "nowhere"},
                     "containers": [{"name": "main", "image": "busybox",
                                     "resources": {"limits": {"aliyun.com/gpu-mem": "1"}}}]},
        }  # fmt: skip
        await admin.create(f"/api/v1/namespaces/{namespace}/pods", pod)
        stored = await admin.get(f"/api/v1/namespaces/{namespace}/pods/boot")
        assert quantity.parse(stored["spec"]["containers"][0]["resources"]["limits"][names.GPU_MEMORY]) == 1024
    finally:
        await webhook_config.uninstall(admin)
        process.terminate()
        process.wait(timeout=10)
