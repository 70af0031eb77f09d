"""Health for a component that serves nothing else (the node agent): /healthz (the process
answers), /readyz (the component's own check: 200 "ok", or 503 with what is not ready as JSON) and
/metrics (a Prometheus registry), /metrics behind `serving.access`'s gate when given one; over TLS
when given a context (`serving.tls.HealthTls`).
The servers with an API of their own (extender, webhook, controller) add these routes to their own
applications instead. `Endpoint` is the health port's settings, as every component takes them whole:
where it listens, its TLS, and whether /metrics and /debug ask who is calling."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import prometheus_client
from aiohttp import web

from sharegpu.serving import access, tls

Readiness = Callable[[], tuple[bool, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A component's health port: /healthz, /readyz, /metrics (and /debug where it has one)."""

    port: int
    host: str = "0.0.0.0"
    tls: tls.HealthTls = tls.SELF_SIGNED
    """How the port is served (`serving.tls.HealthTls`: TLS, self-signed unless given a pair)."""
    metrics_auth: bool = True
    """/metrics and /debug only for a token the API server allows to get them (`serving.access`)."""

    def site(self, runner: web.AppRunner) -> web.TCPSite:
        """Where `runner` serves this port."""
        return web.TCPSite(runner, self.host, self.port, ssl_context=self.tls.context())

    def __str__(self) -> str:
        return f"{self.host}:{self.port} ({self.tls.scheme})"


class HealthServer:
    def __init__(
        self,
        readiness: Readiness,
        registry: prometheus_client.CollectorRegistry,
        gate: access.Gate | None = None,
    ) -> None:
        self.readiness = readiness
        self.registry = registry
        self.gate = gate
        """Who may read /metrics (and a component's /debug): `serving.access`; None: anyone."""
        self.runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.gate.middleware] if self.gate is not None else [])

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def readyz(_: web.Request) -> web.Response:
            ready, detail = self.readiness()
            return web.Response(text="ok") if ready else web.json_response({"ready": False, **detail}, status=503)

        async def metrics(_: web.Request) -> web.Response:
            body = prometheus_client.generate_latest(self.registry)
            return web.Response(body=body, content_type="text/plain", charset="utf-8")

        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", metrics)
        return app

    async def start(self, endpoint: Endpoint) -> None:
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        await endpoint.site(self.runner).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
