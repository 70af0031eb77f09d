"""Who may read a component's /metrics and /debug: delegated authentication and authorisation, as
kube-scheduler's secure port does. A request there carries a bearer token; the API server says whose
it is (a TokenReview) and whether that user may `get` the path (a SubjectAccessReview on the
non-resource URL, so RBAC's `nonResourceURLs` rules decide: the chart's ClusterRole
`sharegpu-metrics-reader` grants /metrics). Answers are kept `ttl` seconds (tokens by digest), so a
scrape every few seconds costs the API server nothing after the first.

/healthz, /readyz and /livez stay open (the kubelet's probes carry no token), and so does anything
else the application serves (the webhook's admission paths, which the API server calls). At most
`concurrent` guarded requests are served at once; more are answered 429 at once, so a flood of
/debug requests cannot hold the event loop the component's real work runs on.

`api.access.Reviewer` is the narrow protocol to the API server (`kube.reviews.ApiReviewer`);
`StaticReviewer` is its shipped fake, held against the real one by tests/integration/test_reviews.py.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar

from aiohttp import web

from sharegpu.api import access

log = logging.getLogger(__name__)

OPEN: Final = frozenset({"/healthz", "/readyz", "/livez"})
GUARDED: Final = ("/metrics", "/debug")
"""Paths (and what is under them) that need a caller allowed to `get` them."""


@dataclass
class StaticReviewer:
    """An `api.access.Reviewer` from fixed answers (the tests' API server)."""

    tokens: Mapping[str, access.Caller] = field(default_factory=dict)
    allowed: frozenset[tuple[str, str]] = frozenset()
    """(user, path) pairs allowed to `get`."""
    asked: int = 0

    async def authenticate(self, token: str) -> access.Caller | None:
        self.asked += 1
        return self.tokens.get(token)

    async def authorize(self, caller: access.Caller, path: str, verb: str) -> bool:
        self.asked += 1
        return verb == "get" and (caller.user, path) in self.allowed


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
K = TypeVar("K")
V = TypeVar("V")


class Gate:
    """The aiohttp middleware that guards `GUARDED` paths (module docstring)."""

    def __init__(
        self,
        reviewer: access.Reviewer,
        *,
        clock: Callable[[], float] = time.monotonic,
        ttl: float = 10.0,
        concurrent: int = 4,
        remember: int = 1024,
    ) -> None:
        self.reviewer = reviewer
        self.clock = clock
        self.ttl = ttl
        self.concurrent = concurrent
        self.remember = remember
        self.busy = 0
        self._who: dict[bytes, tuple[access.Caller | None, float]] = {}
        self._may: dict[tuple[access.Caller, str], tuple[bool, float]] = {}

    @staticmethod
    def guards(path: str) -> bool:
        return path not in OPEN and any(path == p or path.startswith(f"{p}/") for p in GUARDED)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.guards(request.path):
            return await handler(request)
        if self.busy >= self.concurrent:
            return web.json_response({"error": "too many requests at once; try again"}, status=429,
                                     headers={"Retry-After": "1"})  # fmt: skip
        self.busy += 1
        try:
            refused = await self._refusal(request)
            if refused is not None:
                return refused
            return await handler(request)
        finally:
            self.busy -= 1

    async def _refusal(self, request: web.Request) -> web.Response | None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _answer(401, f"{request.path} needs a bearer token (a ServiceAccount's, allowed to get it)")
        try:
            caller = await self._caller(token.strip())
            if caller is None:
                return _answer(401, "the token is not accepted by the API server")
            if not await self._allowed(caller, request.path):
                return _answer(403, f"{caller.user} may not get {request.path}")
        except Exception as exc:  # the API server cannot be asked now: say so, and let nobody in
            log.warning("cannot review the caller of %s: %s", request.path, exc)
            return _answer(503, "the caller cannot be checked now (the API server does not answer)")
        return None

    async def _caller(self, token: str) -> access.Caller | None:
        digest = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        found = self._who.get(digest)
        if found is not None and found[1] > now:
            return found[0]
        caller = await self.reviewer.authenticate(token)
        self._keep(self._who, digest, (caller, now + self.ttl))
        return caller

    async def _allowed(self, caller: access.Caller, path: str) -> bool:
        now = self.clock()
        found = self._may.get((caller, path))
        if found is not None and found[1] > now:
            return found[0]
        allowed = await self.reviewer.authorize(caller, path, "get")
        self._keep(self._may, (caller, path), (allowed, now + self.ttl))
        return allowed

    def _keep(self, store: dict[K, V], key: K, value: V) -> None:
        if len(store) >= self.remember:
            store.clear()  # simpler than an LRU, and a cache this size fills only under attack
        store[key] = value


def _answer(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="sharegpu"'} if status == 401 else None
    return web.json_response({"error": message}, status=status, headers=headers)
