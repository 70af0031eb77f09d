"""The chaos fault proxy in front of a TLS upstream: a held request reaches the upstream only once
released, with its answer recorded; other requests pass meanwhile; a hold released before any
request came holds nothing."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp import web

from sharegpu.devcluster import faults


@pytest.fixture
async def proxied(tmp_path: Path) -> AsyncIterator[tuple[faults.FaultProxy, list[str]]]:
    """A proxy in front of an upstream that answers 403 to PATCH and 200 otherwise, logging what came."""
    ca = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(served)
    came: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        came.append(f"{request.method} {request.path}")
        return web.json_response({}, status=403 if request.method == "PATCH" else 200)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=served)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    proxy = faults.FaultProxy(f"https://127.0.0.1:{port}", str(tmp_path / "ca.crt"))
    await proxy.start()
    yield proxy, came
    await proxy.stop()
    await runner.cleanup()


async def test_a_held_request_reaches_the_upstream_only_once_released(
    proxied: tuple[faults.FaultProxy, list[str]],
) -> None:
    proxy, came = proxied
    held = proxy.hold("PATCH", "/apis/resource.k8s.io/", contains="/resourceclaims/")
    async with aiohttp.ClientSession() as session:
        patch = asyncio.create_task(session.patch(f"{proxy.url}/apis/resource.k8s.io/v1/namespaces/a/resourceclaims/c"))
        await asyncio.wait_for(held.arrived.wait(), timeout=5)
        async with session.get(f"{proxy.url}/api/v1/pods") as other:
            assert other.status == 200, "other requests pass while one is held"
        await asyncio.sleep(0.2)
        assert came == ["GET /api/v1/pods"] and not patch.done(), "the held request waits in the proxy"
        held.release()
        response = await asyncio.wait_for(patch, timeout=5)
        assert response.status == 403
        response.release()
    await held.answered.wait()
    assert held.status == 403 and held.request == "PATCH /apis/resource.k8s.io/v1/namespaces/a/resourceclaims/c"
    assert came[-1] == "PATCH /apis/resource.k8s.io/v1/namespaces/a/resourceclaims/c"


async def test_a_hold_released_before_anything_came_holds_nothing(
    proxied: tuple[faults.FaultProxy, list[str]],
) -> None:
    proxy, came = proxied
    held = proxy.hold("PATCH", "/apis/")
    held.release()
    async with aiohttp.ClientSession() as session, session.patch(f"{proxy.url}/apis/x") as response:
        assert response.status == 403
    assert came == ["PATCH /apis/x"] and not held.arrived.is_set()
