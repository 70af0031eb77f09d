"""The aiohttp transport over a real local server: a streamed answer always ends, also when its
connection is closed from our side (as when the certificates change and the pool is replaced)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from sharegpu.kube import errors, transport
from tests.kube.conftest import local_credentials


async def test_a_stream_whose_connection_is_closed_under_it_ends_with_an_error(tmp_path: Path) -> None:
    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        while True:  # an endless watch: one event every 20 ms
            await response.write(b'{"type":"MODIFIED","object":{}}\n')
            await asyncio.sleep(0.02)

    app = web.Application()
    app.router.add_get("/api/v1/pods", events)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    creds = local_credentials(tmp_path, port)
    moving = transport.AiohttpTransport(creds, stream_check=0.05)
    received = 0
    try:
        async with moving.stream(transport.Request("GET", "/api/v1/pods"), idle_timeout=300) as stream:
            closing: list[asyncio.Task[None]] = []

            async def read() -> None:
                nonlocal received
                async for _ in transport.lines(stream.chunks()):
                    received += 1
                    if received == 3:  # closed while the reader waits: aiohttp forgets it without a word
                        closing.append(asyncio.create_task(moving.close()))

            with pytest.raises(errors.TransportError, match="connection closed before the stream ended"):
                await asyncio.wait_for(read(), 5)  # (the server never ends the stream by itself)
    finally:
        await moving.close()
        await runner.cleanup()
    assert received >= 3
