"""The extender's HTTP surface: routes and metrics only, no decisions.

Two applications on two listeners:

- `Verbs`: POST /filter, /prioritize, /bind for kube-scheduler. Served over TLS that requires a
  client certificate from the scheduler's CA when the extender is given one (the production
  setting): nobody else in the cluster can then ask it to bind a pod. Over TLS the listener speaks
  HTTP/2 as well as HTTP/1.1 (ALPN), so kube-scheduler sends every call over one connection.
- `operations`: GET /healthz, /readyz (every informer synced and watching, the API accepting our
  credentials), /metrics (Prometheus), /debug/nodes (per node and GPU: capacity, used, free, who
  holds what; the pods nominated by preemption and what they wait for),
  /debug/pods/{namespace}/{name} (the last filter verdict for a pod and, GPU by GPU, why it does not
  fit now), /debug/informers.

Bodies are decoded into the typed messages of `api.extender`; a malformed body gets a 400 naming
the problem and never reaches the scheduling service.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import numpy as np
from aiohttp import web

from sharegpu.api import extender as api_extender
from sharegpu.api import pods, reasons, wire
from sharegpu.core import errors, fit, units
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import metrics as extender_metrics
from sharegpu.extender import scheduling
from sharegpu.serving import access, http2

MAX_BODY = 64 * 1024 * 1024
DETAIL_NODES = 20
"""How many nodes /debug/pods explains GPU by GPU (the closest to fitting first)."""


class Runtime(Protocol):
    """What the operations endpoints read from the running extender."""

    cache: extender_cache.ClusterCache
    scheduling: scheduling.SchedulingService
    metrics: extender_metrics.Metrics

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...

    def holder(self, node: str, slot: int) -> pods.Record | None: ...


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


class Verbs:
    """POST /filter, /prioritize and /bind: a body in, a reply out, the same over HTTP/1.1 (`app`,
    aiohttp) and HTTP/2 (`serving.http2`, which kube-scheduler uses where TLS offers it)."""

    def __init__(self, service: scheduling.SchedulingService, metrics: extender_metrics.Metrics) -> None:
        async def filter_(args: api_extender.Args) -> api_extender.FilterResult:
            return service.filter(args)

        async def prioritize(args: api_extender.Args) -> list[api_extender.HostPriority]:
            return service.prioritize(args)

        self._metrics = metrics
        self._routes: dict[str, tuple[str, type[Any], Callable[[Any], Awaitable[Any]]]] = {
            "/filter": ("filter", api_extender.Args, filter_),
            "/prioritize": ("prioritize", api_extender.Args, prioritize),
            "/bind": ("bind", api_extender.BindingArgs, service.bind),
        }

    async def __call__(self, method: str, path: str, body: bytes) -> http2.Reply:
        route = self._routes.get(path.partition("?")[0])
        if route is None:
            return _reply({"Error": f"no such verb: {path}"}, status=404)
        if method != "POST":
            return _reply({"Error": f"{path} takes POST, not {method}"}, status=405)
        verb, kind, handle = route
        started = time.perf_counter()
        try:
            args = wire.decode(body, kind)
        except errors.InvalidInputError as exc:
            return _reply({"Error": str(exc)}, status=400)
        answer = await handle(args)
        self._metrics.latency.labels(verb).observe(time.perf_counter() - started)
        return http2.Reply(200, api_extender.ENCODER.encode(answer))

    def app(self) -> web.Application:
        """The verbs as an aiohttp application (HTTP/1.1)."""
        app = web.Application(client_max_size=MAX_BODY)

        async def serve(request: web.Request) -> web.Response:
            reply = await self(request.method, request.path, await request.read())
            return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)

        for path in self._routes:
            app.router.add_post(path, serve)
        return app


def _reply(body: Any, status: int) -> http2.Reply:
    return http2.Reply(status, msgspec.json.encode(body))


def operations(runtime: Runtime, gate: access.Gate | None = None) -> web.Application:
    """/healthz and /readyz, and behind `gate` (`serving.access`: a token allowed to get the path)
    /metrics and /debug."""
    app = web.Application(middlewares=[gate.middleware] if gate is not None else [])

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        ready, detail = runtime.readiness()
        if ready:
            return web.Response(text="ok")
        return _json({"ready": False, **detail}, status=503)

    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=await runtime.metrics.scrape(), content_type="text/plain", charset="utf-8")

    async def debug_nodes(_: web.Request) -> web.Response:
        counters = dataclasses.asdict(runtime.cache.counters)
        preemptor = runtime.scheduling.preemptor
        nominations = preemptor.describe() if preemptor is not None else []
        return _json({"nodes": runtime.cache.summary(runtime.holder), "counters": counters, "nominations": nominations})

    async def debug_informers(_: web.Request) -> web.Response:
        return _json(runtime.readiness()[1])

    async def debug_pod(request: web.Request) -> web.Response:
        key = units.pod_key(request.match_info["namespace"], request.match_info["name"])
        return _json(explain(runtime, key))

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/debug/nodes", debug_nodes)
    app.router.add_get("/debug/informers", debug_informers)
    app.router.add_get("/debug/pods/{namespace}/{name}", debug_pod)
    return app


def explain(runtime: Runtime, key: units.PodKey) -> dict[str, Any]:
    """Why a pod fits or not, now: per node its first shortfall, and GPU by GPU for the closest nodes
    (among the nodes kube-scheduler offered when the pod last fitted nowhere, else all of them)."""
    outcome = runtime.scheduling.outcomes.get(key)
    body: dict[str, Any] = {"pod": key, "lastFilter": None}
    if outcome is not None:
        body["lastFilter"] = {k: v for k, v in dataclasses.asdict(outcome).items() if k != "candidates"}
    record = runtime.cache.record(key)
    if record is None:
        body["error"] = "the extender has not seen this pod"
        return body
    if record.problem is not None:
        body["error"] = record.problem
        return body
    if record.request is None:
        body["error"] = "the pod asks for no GPU"
        return body
    state = runtime.cache.state
    demand = record.request.demand
    if outcome is not None and outcome.candidates:  # the nodes kube-scheduler offered last time
        rows = np.array([r for r in (state.row(n) for n in outcome.candidates) if r is not None], dtype=np.int64)
    else:
        rows = np.arange(len(state), dtype=np.int64)
    diagnosis = fit.diagnose(state, demand, rows)
    shortfall, usable = diagnosis.shortfall.tolist(), diagnosis.usable.tolist()
    closest = sorted(range(len(rows)), key=lambda i: (shortfall[i] != 0, -shortfall[i], -usable[i], i))
    nodes = []
    for position in closest[:DETAIL_NODES]:
        row = int(rows[position])
        verdict = fit.explain_node(state, demand, row)
        nodes.append(
            {
                "node": state.names[row],
                "fits": verdict.ok,
                "shortfall": fit.Shortfall(int(diagnosis.shortfall[position])).name,
                "reasons": reasons.detail(verdict),
            }
        )
    counts: dict[str, int] = {}
    for value in diagnosis.shortfall.tolist():
        name = fit.Shortfall(value).name
        counts[name] = counts.get(name, 0) + 1
    body.update({"boundTo": record.node or None, "nodesByShortfall": counts, "closest": nodes})
    return body
