"""The gate on /metrics and /debug: a token the API server accepts, of a user it allows to get the
path; probes and other paths open; answers kept a while; a flood answered 429 at once."""

from __future__ import annotations

import asyncio

from aiohttp import test_utils, web

from sharegpu.api.access import Caller
from sharegpu.serving import access
from tests.builders import Clock

PROMETHEUS = Caller("system:serviceaccount:monitoring:prometheus", ("system:serviceaccounts",))
TENANT = Caller("alice", ("tenants",))


def app(gate: access.Gate, slow: asyncio.Event | None = None) -> web.Application:
    made = web.Application(middlewares=[gate.middleware])

    async def ok(request: web.Request) -> web.Response:
        if slow is not None and request.path == "/metrics":
            await slow.wait()
        return web.Response(text="ok")

    for path in ("/healthz", "/readyz", "/metrics", "/debug/nodes", "/mutate/pods", "/metricsx"):
        made.router.add_get(path, ok)
    return made


def reviewer() -> access.StaticReviewer:
    return access.StaticReviewer(
        tokens={"prom": PROMETHEUS, "alice": TENANT},
        allowed=frozenset({(PROMETHEUS.user, "/metrics")}),
    )


async def test_metrics_and_debug_need_an_allowed_token_and_the_rest_stays_open() -> None:
    gate = access.Gate(reviewer())
    async with test_utils.TestClient(test_utils.TestServer(app(gate))) as http:
        for path in ("/healthz", "/readyz", "/mutate/pods", "/metricsx"):
            assert (await http.get(path)).status == 200, path
        anonymous = await http.get("/metrics")
        assert anonymous.status == 401 and anonymous.headers["WWW-Authenticate"].startswith("Bearer")
        assert "needs a bearer token" in (await anonymous.json())["error"]
        assert (await http.get("/metrics", headers={"Authorization": "Bearer forged"})).status == 401
        refused = await http.get("/metrics", headers={"Authorization": "Bearer alice"})
        assert refused.status == 403 and (await refused.json())["error"] == "alice may not get /metrics"
        assert (await http.get("/metrics", headers={"Authorization": "Bearer prom"})).status == 200
        debug = await http.get("/debug/nodes", headers={"Authorization": "Bearer prom"})
        assert debug.status == 403, "reading metrics is not reading the debug API"


async def test_answers_are_kept_for_a_while_then_asked_again() -> None:
    clock = Clock(0.0)
    asked = reviewer()
    gate = access.Gate(asked, clock=clock, ttl=10.0)
    async with test_utils.TestClient(test_utils.TestServer(app(gate))) as http:
        for _ in range(5):
            assert (await http.get("/metrics", headers={"Authorization": "Bearer prom"})).status == 200
        assert asked.asked == 2, "one TokenReview and one SubjectAccessReview for five scrapes"
        clock.now = 11.0
        assert (await http.get("/metrics", headers={"Authorization": "Bearer prom"})).status == 200
        assert asked.asked == 4


async def test_a_flood_is_answered_429_at_once_and_a_reviewer_that_fails_lets_nobody_in() -> None:
    release = asyncio.Event()
    gate = access.Gate(reviewer(), concurrent=2)
    async with test_utils.TestClient(test_utils.TestServer(app(gate, slow=release))) as http:
        held = [asyncio.create_task(http.get("/metrics", headers={"Authorization": "Bearer prom"})) for _ in range(2)]
        while gate.busy < 2:
            await asyncio.sleep(0.01)
        flooded = await http.get("/metrics", headers={"Authorization": "Bearer prom"})
        assert flooded.status == 429 and flooded.headers["Retry-After"] == "1"
        assert (await http.get("/healthz")).status == 200, "probes are not held up"
        release.set()
        assert [r.status for r in await asyncio.gather(*held)] == [200, 200]

    class Down(access.StaticReviewer):
        async def authenticate(self, token: str) -> Caller | None:
            raise ConnectionError("refused")

    async with test_utils.TestClient(test_utils.TestServer(app(access.Gate(Down())))) as http:
        down = await http.get("/metrics", headers={"Authorization": "Bearer prom"})
        assert down.status == 503 and "cannot be checked now" in (await down.json())["error"]
