"""A real Prometheus beside the devcluster: it scrapes sharegpu's components as a cluster's Prometheus
would (HTTPS, a bearer token of a user allowed to get /metrics, the `component` label the chart's
PodMonitor sets), and answers PromQL over its HTTP API.

Prometheus and promtool are built from the Go module (`scripts/build-prometheus`). The targets are
static (the devcluster's components listen on loopback ports), scraped every `interval`; their
certificates are the components' own self-signed or bootstrap ones, so the scrape does not verify
them (`insecure_skip_verify`), as docs/metrics.md says a Prometheus may when it has not the CA.
Rule files (the chart's alerting rules) are loaded as they are and evaluated every `interval`; the
alerts they raise, pending or firing, are read back over the same API.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from sharegpu.core import errors
from sharegpu.devcluster import controlplane

Json = dict[str, Any]


class PrometheusError(errors.SharegpuError):
    """Prometheus could not be built, started or asked."""


@dataclass(frozen=True, slots=True)
class Target:
    """One component's /metrics: `component` as the chart's PodMonitor labels it."""

    component: str
    address: str
    """host:port of its HTTPS port that serves /metrics."""


def binaries() -> tuple[Path, Path]:
    """Prometheus and promtool (built once, cached)."""
    script = controlplane.data_path("scripts/build-prometheus")
    built = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise PrometheusError(f"scripts/build-prometheus failed:\n{built.stderr[-3000:]}")
    prometheus, promtool = built.stdout.strip().splitlines()[-2:]
    return Path(prometheus), Path(promtool)


def configuration(targets: Sequence[Target], token_file: Path, interval: float, rules: Sequence[Path] = ()) -> Json:
    """The configuration: one scrape job per component, over HTTPS with the token; `rules` loaded."""
    jobs: dict[str, list[str]] = {}
    for target in targets:
        jobs.setdefault(target.component, []).append(target.address)
    return {
        "global": {"scrape_interval": f"{interval:g}s", "evaluation_interval": f"{interval:g}s"},
        "rule_files": [str(path) for path in rules],
        "scrape_configs": [
            {
                "job_name": f"sharegpu-{component}",
                "scheme": "https",
                "honor_labels": True,
                "tls_config": {"insecure_skip_verify": True},
                "authorization": {"credentials_file": str(token_file)},
                "static_configs": [{"targets": addresses, "labels": {"component": component}}],
            }
            for component, addresses in sorted(jobs.items())
        ],
    }


class Prometheus:
    """A Prometheus process scraping `targets` (see the module docstring)."""

    def __init__(
        self,
        workdir: Path,
        targets: Sequence[Target],
        token: str,
        *,
        interval: float = 1.0,
        rules: Sequence[Path] = (),
    ) -> None:
        self.workdir = workdir
        self.targets = tuple(targets)
        self.rule_files = tuple(rules)
        self.token = token
        self.interval = interval
        self.port = controlplane.free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 60.0) -> None:
        binary, _ = await asyncio.to_thread(binaries)
        self.workdir.mkdir(parents=True, exist_ok=True)
        token_file = self.workdir / "token"
        token_file.write_text(self.token)
        config = self.workdir / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(configuration(self.targets, token_file, self.interval, self.rule_files), sort_keys=False)
        )
        argv = [
            str(binary), f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
        ]  # fmt: skip
        with self.log.open("ab") as handle:
            self.process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise PrometheusError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{self.url}/-/ready") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.2)
        raise PrometheusError("prometheus not ready in time")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)

    async def _get(self, path: str, params: dict[str, str] | None = None) -> Json:
        async with aiohttp.ClientSession() as session, session.get(f"{self.url}{path}", params=params) as response:
            body: Json = await response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params or ''}: {body.get('errorType')}: {body.get('error')}")
        return body

    async def query(self, expr: str) -> list[Json]:
        """The instant vector (or a scalar as one sample) `expr` gives now."""
        data = (await self._get("/api/v1/query", {"query": expr}))["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[Json] = data["result"]
        return result

    async def active_targets(self) -> list[Json]:
        """The scrape targets and their health (`health`: up, down, unknown; `lastError`)."""
        found: list[Json] = (await self._get("/api/v1/targets", {"state": "active"}))["data"]["activeTargets"]
        return found

    async def alerts(self) -> list[Json]:
        """The alerts pending or firing now (`labels`, `annotations`, `state`)."""
        found: list[Json] = (await self._get("/api/v1/alerts"))["data"]["alerts"]
        return found

    async def rules(self) -> list[Json]:
        """Every loaded rule with its `health` (ok, err, unknown) and `lastError`."""
        groups: list[Json] = (await self._get("/api/v1/rules"))["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]
