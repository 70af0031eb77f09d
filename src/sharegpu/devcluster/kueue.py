"""Kueue beside the local control plane: the ecosystem's queueing system, built from its Go module.

sharegpu has no queue of its own: Kueue admits, sharegpu places (docs/queues.md). For the tests and
devcluster, `Kueue` runs Kueue's manager (`scripts/build-kueue` builds it once) against a
`ControlPlane`: it installs Kueue's CRDs from the module, writes a Configuration (the plain-pod
integration, no internal certificate management, no leader election, probes and metrics on loopback
ports), serves Kueue's webhooks on loopback with a certificate of its own, registers the webhooks
Kueue's pod integration and its own resources need by URL (there is no Service network here), and
starts the manager as the cluster's admin, in a mount namespace of its own (root: `runnable`) where
its fixed metrics certificate path exists. Kueue's webhooks skip sharegpu's namespaces and
kube-system, as the upstream install skips its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sharegpu.api import names
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import certs

Json = dict[str, Any]
VERSION = "0.17.0"
WEBHOOKS = "sharegpu-devcluster-kueue"
"""The names of the webhook configurations registered here."""
SKIPPED = ("kube-system", names.SYSTEM_NAMESPACE, names.HOLDING_NAMESPACE)
KEPT_PATHS = ("-v1-pod", "kueue-x-k8s-io")
"""The webhooks kept from Kueue's manifests: the pod integration's and those of Kueue's own resources."""


class KueueError(RuntimeError):
    """Kueue could not be built or started."""


def runnable() -> str | None:
    """Why Kueue cannot run here (None: it can): it needs root, for the mount namespace `start` gives it."""
    return None if os.geteuid() == 0 else "Kueue runs in a mount namespace of its own here, which needs root"


def build(version: str = VERSION) -> tuple[Path, Path]:
    """Kueue's manager binary and its module's folder, building it if needed (minutes, once)."""
    script = controlplane.data_path("scripts/build-kueue")
    done = subprocess.run(["bash", str(script), version], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise KueueError(f"building Kueue failed:\n{done.stderr[-3000:]}")
    binary, module = done.stdout.strip().splitlines()[-2:]
    return Path(binary), Path(module)


def _documents(path: Path) -> list[Json]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


@dataclass
class Kueue:
    plane: controlplane.ControlPlane
    binary: Path
    module: Path
    workdir: Path
    config: Json = field(default_factory=dict)
    """Merged over the Configuration written here (e.g. {"fairSharing": {...}})."""
    webhook_port: int = 0
    health_port: int = 0

    async def start(self, kube: client.KubeClient) -> None:
        """CRDs, webhooks and the manager; returns once Kueue answers ready and serves its resources."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for path in sorted((self.module / "config/components/crd/bases").glob("*.yaml")):
            for doc in _documents(path):
                await stack.apply(kube, doc)
        await stack.wait_served(kube, ["/apis/kueue.x-k8s.io/v1beta2/workloads"])
        self.webhook_port, self.health_port = controlplane.free_port(), controlplane.free_port()
        ca_cert, ca_key = certs.new_ca("kueue-devcluster-ca", days=30)
        serving, serving_key = certs.issue_serving(
            ca_cert, ca_key, "kueue-webhook", ip_addresses=("127.0.0.1",), days=30
        )
        tls = self.workdir / "certs"
        certs.write_pair(tls, serving, serving_key)  # tls.crt and tls.key, where Kueue looks
        metrics = self.workdir / "metrics-certs"
        certs.write_pair(metrics, serving, serving_key)
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": "kueue-system",
            "manageJobsWithoutQueueName": False,
            "internalCertManagement": {"enable": False},
            "leaderElection": {"leaderElect": False},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{controlplane.free_port()}"},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": str(tls)},
            "integrations": {"frameworks": ["pod"]},
            # its on-demand visibility API server wants a certificate at /visibility and an APIService
            "featureGates": {"VisibilityOnDemand": False},
            **self.config,
        }
        path = self.workdir / "kueue-config.yaml"
        path.write_text(json.dumps(config))
        await stack.apply(kube, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}})
        # Without its own certificate management Kueue reads its metrics certificate from a fixed path,
        # /etc/kueue/metrics/certs: it runs in a mount namespace of its own where /etc is a fresh tmpfs
        # holding only that (it needs nothing else there: a static binary that dials an IP address).
        place = (
            'mount -t tmpfs none /etc && mkdir -p /etc/kueue/metrics/certs && cp "$0"/tls.* /etc/kueue/metrics/certs/'
        )
        argv = [str(self.binary), f"--config={path}", "--zap-log-level=info"]
        self.plane.start_peer(
            "kueue",
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                f'{place} && exec "$@"',
                str(metrics),
                *argv,
            ],
        )
        await self._wait_ready()
        await self._register(kube, base64.b64encode(certs.pem(ca_cert)).decode())

    async def _register(self, kube: client.KubeClient, ca_bundle: str) -> None:
        manifests = _documents(self.module / "config/components/webhook/manifests.yaml")
        for doc in manifests:
            kind = doc["kind"]
            hooks = [
                h for h in doc.get("webhooks", []) if any(k in h["clientConfig"]["service"]["path"] for k in KEPT_PATHS)
            ]
            for hook in hooks:
                service = hook["clientConfig"].pop("service")
                hook["clientConfig"] = {
                    "url": f"https://127.0.0.1:{self.webhook_port}{service['path']}",
                    "caBundle": ca_bundle,
                }
                hook["namespaceSelector"] = {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": list(SKIPPED)}
                    ]
                }
            body = {"apiVersion": doc["apiVersion"], "kind": kind, "metadata": {"name": WEBHOOKS}, "webhooks": hooks}
            await stack.apply(kube, body)
        await asyncio.sleep(1.5)  # the API server picks up new webhook configurations asynchronously

    async def _wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        while time.monotonic() < deadline:
            process = self.plane.processes.get("kueue")
            if process is not None and process.poll() is not None:
                raise KueueError(f"Kueue exited:\n{self.plane.log('kueue')[-3000:]}")
            try:
                ready = await asyncio.to_thread(_get, url)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                ready = False
            if ready:
                return
            await asyncio.sleep(0.3)
        raise KueueError(f"Kueue not ready after {timeout:.0f} s:\n{self.plane.log('kueue')[-3000:]}")

    async def stop(self, kube: client.KubeClient) -> None:
        for plural in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            with contextlib.suppress(kube_errors.NotFoundError):
                await kube.delete(f"/apis/admissionregistration.k8s.io/v1/{plural}/{WEBHOOKS}")
        self.plane.stop_process("kueue")


def _get(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return bool(response.status == 200)
