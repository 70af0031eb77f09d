"""A proxy between one component and the API server that throws, on demand, the faults real
clusters throw at clients: 429 with Retry-After, 409, 5xx, watch connections cut, watches gone
silent with their connections left open (a half-open connection), watches expired with a 410 ERROR
event, answers lost after the API server carried the request out (the connection closed with no
answer, or a 5xx instead of the answer, as a load balancer or a restarting API server gives), and
requests held in flight until released (a write delayed on the network while its sender stalls,
`hold`). Everything else passes through unchanged (credentials included), so the component talks to
the real API server and meets the faults on its own wire.

The component's kubeconfig points at `FaultProxy.url` (plain HTTP on loopback); the proxy speaks
TLS to the API server. Faults are counted in `injected`. Used by `bench/chaos.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

FORWARDED = ("Authorization", "Content-Type", "Accept")


LOST = 0
"""A fault's status for "no answer": the connection is closed instead."""


@dataclass
class _Fault:
    status: int
    remaining: int
    method: str | None
    path: str | None
    retry_after: int | None
    after_commit: bool = False
    """Forward the request first (the API server carries it out), then answer with the fault."""
    ending: str | None = None
    """Matches only paths that end with this (e.g. "/binding")."""

    def matches(self, method: str, path: str) -> bool:
        return (
            (self.method is None or self.method == method)
            and (self.path is None or path.startswith(self.path))
            and (self.ending is None or path.endswith(self.ending))
        )


@dataclass
class Held:
    """The first request that matches, held before it is forwarded until `release` (`FaultProxy.hold`)."""

    method: str
    path: str
    contains: str
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a request is held."""
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the released request has the API server's answer (or the proxy could not forward it)."""
    request: str = ""
    """The held request's method and path."""
    status: int = 0
    """The API server's answer to it once released (0: a fault answered it first; 503: it could not be
    forwarded)."""
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and path.startswith(self.path) and self.contains in path

    def release(self) -> None:
        """Forward the held request now (or, if none was held yet, hold none)."""
        self._released.set()


class FaultProxy:
    def __init__(self, upstream: str, ca_file: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=ca_file)
        self._faults: list[_Fault] = []
        self._holds: list[Held] = []
        self._watches: dict[int, tuple[web.Request, web.StreamResponse]] = {}
        self._stalled: set[int] = set()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.injected: dict[str, int] = {}
        self.requests = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=128))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.cut_watches(count=False)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ----------------------------------------------------------------- faults

    def _count(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def fail(
        self,
        status: int,
        times: int = 1,
        *,
        method: str | None = None,
        path: str | None = None,
        retry_after: int | None = None,
        after_commit: bool = False,
        ending: str | None = None,
    ) -> None:
        """Answer the next `times` matching requests (method "WATCH" for watches) with `status`:
        instead of forwarding them, or after forwarding them with `after_commit`."""
        self._faults.append(_Fault(status, times, method, path, retry_after, after_commit, ending))
        self._count(f"http-{status}" + ("-after-commit" if after_commit else ""))

    def lose(
        self, times: int = 1, *, method: str | None = None, path: str | None = None, ending: str | None = None
    ) -> None:
        """Forward the next `times` matching requests, then close their connections without an answer."""
        self._faults.append(_Fault(LOST, times, method, path, None, after_commit=True, ending=ending))
        self._count("answer-lost-after-commit")

    def hold(self, method: str, path: str, contains: str = "") -> Held:
        """Hold the next `method` request under `path` (with `contains` in it) before forwarding it,
        until the returned `Held` is released."""
        held = Held(method, path, contains)
        self._holds.append(held)
        self._count("held")
        return held

    def clear(self) -> None:
        """Drop every fault not yet thrown."""
        self._faults.clear()

    def cut_watches(self, count: bool = True) -> int:
        """Drop every open watch connection, as a network fault or a restarting server would."""
        open_ = list(self._watches.values())
        for request, _ in open_:
            if request.transport is not None:
                request.transport.close()
        self._watches.clear()
        if count and open_:
            self._count("watch-cut")
        return len(open_)

    def stall_watches(self) -> int:
        """Every open watch goes silent, its connection left open: what the API server sends it is
        dropped, its end included (a half-open connection: the server's host gone without a FIN, a
        partition, a load balancer that lost it). The client alone can notice, by its idle timeout."""
        self._stalled.update(self._watches)
        if self._watches:
            self._count("watch-stalled")
        return len(self._watches)

    async def expire_watches(self) -> int:
        """End every open watch with a 410 Gone ERROR event (its resourceVersion is too old)."""
        gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired"}
        event = {"type": "ERROR", "object": {**gone, "message": "too old resource version (chaos)"}}
        open_ = list(self._watches.values())
        for request, response in open_:
            with contextlib.suppress(Exception):
                await response.write(orjson.dumps(event) + b"\n")
            if request.transport is not None:
                request.transport.close()
        self._watches.clear()
        if open_:
            self._count("watch-expired")
        return len(open_)

    def _matching_fault(self, method: str, path: str) -> _Fault | None:
        for fault in self._faults:
            if fault.matches(method, path):
                fault.remaining -= 1
                if fault.remaining <= 0:
                    self._faults.remove(fault)
                return fault
        return None

    # ----------------------------------------------------------------- forwarding

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        self.requests += 1
        watch = request.query.get("watch") in ("1", "true")
        self._holds = [h for h in self._holds if not h._released.is_set()]  # released before any came
        held = next((h for h in self._holds if not watch and h.matches(request.method, request.path)), None)
        if held is not None:
            self._holds.remove(held)
            held.request = f"{request.method} {request.path}"
            held.arrived.set()
            await held._released.wait()
        try:
            response = await self._forward(request, watch, held)
        finally:
            if held is not None:
                held.answered.set()
        return response

    async def _forward(self, request: web.Request, watch: bool, held: Held | None) -> web.StreamResponse:
        assert self._session is not None
        fault = self._matching_fault("WATCH" if watch else request.method, request.path)
        if fault is not None and not fault.after_commit:
            return self._answer(request, fault)
        headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
        data = await request.read() if request.can_read_body else None
        url = f"{self.upstream}{request.path_qs}"
        try:
            upstream = await self._session.request(
                request.method, url, data=data, headers=headers,
                timeout=aiohttp.ClientTimeout(total=None if watch else 60, sock_read=None if watch else 60),
            )  # fmt: skip
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            body = {"kind": "Status", "code": 503, "reason": "ServiceUnavailable", "message": f"upstream: {exc}"}
            if held is not None:
                held.status = 503
            return web.Response(status=503, body=orjson.dumps(body), content_type="application/json")
        if held is not None:
            held.status = upstream.status
        async with upstream:
            if fault is not None:
                await upstream.read()  # carried out: now the answer goes astray
                return self._answer(request, fault)
            if not watch or upstream.status >= 400:
                return web.Response(status=upstream.status, body=await upstream.read(),
                                    content_type=upstream.content_type or "application/json")  # fmt: skip
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type or "application/json"
            await response.prepare(request)
            key = id(response)
            self._watches[key] = (request, response)
            try:
                async for chunk in upstream.content.iter_any():
                    if key not in self._stalled:
                        await response.write(chunk)
                if key in self._stalled:
                    await asyncio.Event().wait()  # never ends: until the client gives up (the handler is cancelled)
            except (aiohttp.ClientError, ConnectionError, OSError):
                pass
            finally:
                self._watches.pop(key, None)
                self._stalled.discard(key)
            return response

    @staticmethod
    def _answer(request: web.Request, fault: _Fault) -> web.StreamResponse:
        if fault.status == LOST:
            if request.transport is not None:
                request.transport.close()
            raise asyncio.CancelledError  # aiohttp ends the handler quietly; the client sees the connection go
        reason = "TooManyRequests" if fault.status == 429 else "Chaos"
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": fault.status,
                                "reason": reason, "message": "injected by chaos"}  # fmt: skip
        headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
        if fault.retry_after is not None:
            body["details"] = {"retryAfterSeconds": fault.retry_after}
        return web.Response(
            status=fault.status, body=orjson.dumps(body), content_type="application/json", headers=headers
        )


async def until(predicate: Any, timeout: float, every: float = 0.5) -> bool:
    """Poll an async predicate until it holds (True) or `timeout` seconds pass (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(every)
    return False
