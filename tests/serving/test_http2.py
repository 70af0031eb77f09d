"""HTTP/2 beside HTTP/1.1 on one TLS listener: ALPN picks the protocol, streams run concurrently,
flow control holds both ways, oversized or failing requests are answered and the connection lives on,
a reset stream cancels its handler, and shutdown closes what is open (asyncio and uvloop alike)."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import uvloop
from aiohttp import web

from sharegpu.serving import certs, http2, tls

Handler = Callable[[str, str, bytes], Awaitable[http2.Reply]]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key, ca_path = certs.write_ca(folder / "ca", "h2-test")
    cert, key = certs.write_pair(folder, *certs.issue_serving(ca_cert, ca_key, "server", ip_addresses=("127.0.0.1",)))
    return {"ca": ca_path, "cert": cert, "key": key}


def client_context(pki: dict[str, Path], alpn: list[str]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.set_alpn_protocols(alpn)
    return context


async def echo(method: str, path: str, body: bytes) -> http2.Reply:
    if path == "/boom":
        raise RuntimeError("the handler failed")
    if path.startswith("/big/"):
        return http2.Reply(200, b"x" * int(path.rsplit("/", 1)[1]), "text/plain")
    return http2.Reply(200, f"{method} {path} {len(body)}".encode(), "text/plain")


class Listener:
    """The served port and its HTTP/1.1 runner (closed together)."""

    def __init__(self, served: http2.Listener, runner: web.AppRunner) -> None:
        self.connections = served.connections
        self.served = served
        self.runner = runner
        self.port = served.port

    async def close(self) -> None:
        self.served.close()
        await self.runner.cleanup()


async def listen(pki: dict[str, Path], handler: Handler, max_body: int = 4 << 20) -> Listener:
    """The extender's arrangement: aiohttp for HTTP/1.1, `http2` for h2, one TLS port."""
    app = web.Application()

    async def serve(request: web.Request) -> web.Response:
        reply = await handler(request.method, request.path, await request.read())
        return web.Response(body=reply.body, status=reply.status, content_type=reply.content_type)

    app.router.add_route("*", "/{tail:.*}", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    context = tls.ReloadingTls(pki["cert"], pki["key"], alpn=http2.ALPN).context
    served = await http2.listen(runner, http2.Connections(handler, max_body), "127.0.0.1", 0, context)
    return Listener(served, runner)


@pytest.fixture
async def listener(pki: dict[str, Path]) -> AsyncIterator[Listener]:
    made = await listen(pki, echo)
    yield made
    await made.close()


class H2Client:
    """A minimal HTTP/2 client over asyncio streams (h2 on the client side)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, window: int | None) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.bodies: dict[int, bytearray] = {}
        self.status: dict[int, int] = {}
        self.ended: dict[int, asyncio.Event] = {}
        self.reset: set[int] = set()
        self.senders: list[asyncio.Task[None]] = []
        self.goaway = False
        self.pump = asyncio.create_task(self._read())
        writer.write(self.conn.data_to_send())

    @classmethod
    async def connect(cls, port: int, context: ssl.SSLContext, window: int | None = None) -> H2Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        ssl_object = writer.get_extra_info("ssl_object")
        assert ssl_object.selected_alpn_protocol() == "h2"
        return cls(reader, writer, window)

    def start(self, method: str, path: str, body: bytes = b"") -> int:
        stream = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":path", path), (":scheme", "https"), (":authority", "127.0.0.1")]
        self.conn.send_headers(stream, headers, end_stream=not body)
        self.ended[stream] = asyncio.Event()
        self.bodies[stream] = bytearray()
        self.writer.write(self.conn.data_to_send())
        if body:
            self.senders.append(asyncio.create_task(self._send_body(stream, body)))
        return stream

    async def _send_body(self, stream: int, body: bytes) -> None:
        view = memoryview(body)
        while view:
            window = min(self.conn.local_flow_control_window(stream), self.conn.max_outbound_frame_size)
            if window <= 0:
                await asyncio.sleep(0.005)
                continue
            chunk, view = view[:window], view[window:]
            self.conn.send_data(stream, chunk, end_stream=not view)
            self.writer.write(self.conn.data_to_send())
            await self.writer.drain()

    async def _read(self) -> None:
        while data := await self.reader.read(65536):
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    assert event.stream_id is not None and event.headers is not None
                    self.status[event.stream_id] = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    assert event.stream_id is not None and event.data is not None
                    self.bodies[event.stream_id] += event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    assert event.stream_id is not None
                    self.ended[event.stream_id].set()
                elif isinstance(event, h2.events.ConnectionTerminated):
                    self.goaway = True
                elif isinstance(event, h2.events.StreamReset):
                    assert event.stream_id is not None
                    self.reset.add(event.stream_id)
                    self.ended[event.stream_id].set()
            self.writer.write(self.conn.data_to_send())

    async def result(self, stream: int) -> tuple[int, bytes]:
        await asyncio.wait_for(self.ended[stream].wait(), 10)
        return self.status.get(stream, 0), bytes(self.bodies[stream])

    async def call(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        return await self.result(self.start(method, path, body))

    def cancel(self, stream: int) -> None:
        self.conn.reset_stream(stream, h2.errors.ErrorCodes.CANCEL)
        self.writer.write(self.conn.data_to_send())

    async def close(self) -> None:
        self.pump.cancel()
        self.writer.close()


async def test_alpn_picks_h2_or_http1_on_the_same_port(listener: Listener, pki: dict[str, Path]) -> None:
    client = await H2Client.connect(listener.port, client_context(pki, ["h2", "http/1.1"]))
    try:
        assert await client.call("POST", "/filter", b"{}") == (200, b"POST /filter 2")
        assert await client.call("POST", "/bind", b"[1]") == (200, b"POST /bind 3"), "the connection is kept"
    finally:
        await client.close()
    async with aiohttp.ClientSession() as session:
        ssl_context = client_context(pki, ["http/1.1"])
        async with session.post(f"https://127.0.0.1:{listener.port}/filter", data=b"{}", ssl=ssl_context) as response:
            assert await response.text() == "POST /filter 2"
    assert listener.connections.accepted == {"h2": 1, "http/1.1": 1}


async def test_streams_are_answered_concurrently(pki: dict[str, Path]) -> None:
    """A bind waiting on the API server must not hold up the next filter on the same connection."""
    release = asyncio.Event()

    async def handler(method: str, path: str, body: bytes) -> http2.Reply:
        if path == "/bind":
            await release.wait()
        return http2.Reply(200, path.encode())

    served = await listen(pki, handler)
    client = await H2Client.connect(served.port, client_context(pki, ["h2"]))
    try:
        slow = client.start("POST", "/bind")
        assert await client.call("POST", "/filter") == (200, b"/filter")
        assert not client.ended[slow].is_set()
        release.set()
        assert await client.result(slow) == (200, b"/bind")
    finally:
        await client.close()
        await served.close()


async def test_flow_control_both_ways(listener: Listener, pki: dict[str, Path]) -> None:
    """A request body larger than the window we grant arrives whole (we acknowledge what we read),
    and a reply larger than the client's window waits for its window updates."""
    client = await H2Client.connect(listener.port, client_context(pki, ["h2"]), window=1000)
    try:
        body = bytes(3 * http2.STREAM_WINDOW)
        assert await client.call("POST", "/filter", body) == (200, f"POST /filter {len(body)}".encode())
        status, reply = await client.call("POST", "/big/200000")
        assert status == 200 and reply == b"x" * 200000
    finally:
        await client.close()


async def test_too_large_bodies_and_failing_handlers_are_answered_and_the_connection_lives_on(
    pki: dict[str, Path],
) -> None:
    served = await listen(pki, echo, max_body=100_000)
    client = await H2Client.connect(served.port, client_context(pki, ["h2"]))
    try:
        status, reply = await client.call("POST", "/filter", bytes(300_000))
        assert status == 413 and reply == b"request body over 100000 bytes"
        assert await client.call("POST", "/boom") == (500, b"internal error")
        assert await client.call("POST", "/filter", b"ok") == (200, b"POST /filter 2")
    finally:
        await client.close()
        await served.close()


async def test_a_reset_stream_cancels_its_handler(pki: dict[str, Path]) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handler(method: str, path: str, body: bytes) -> http2.Reply:
        if path == "/slow":
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return http2.Reply(200, b"fine")

    served = await listen(pki, handler)
    client = await H2Client.connect(served.port, client_context(pki, ["h2"]))
    try:
        stream = client.start("POST", "/slow")
        await asyncio.wait_for(started.wait(), 5)
        client.cancel(stream)
        await asyncio.wait_for(cancelled.wait(), 5)
        assert await client.call("POST", "/next") == (200, b"fine")
    finally:
        await client.close()
        await served.close()


async def test_garbage_closes_the_connection_and_close_ends_open_ones(listener: Listener, pki: dict[str, Path]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", listener.port, ssl=client_context(pki, ["h2"]))
    writer.write(b"GET / HTTP/1.1\r\n\r\n")  # not the HTTP/2 preface
    assert await asyncio.wait_for(reader.read(), 5) is not None  # the server's settings, then EOF
    assert reader.at_eof()
    writer.close()
    client = await H2Client.connect(listener.port, client_context(pki, ["h2"]))
    assert await client.call("POST", "/x") == (200, b"POST /x 0")
    assert len(listener.connections.open) == 1
    listener.connections.close()
    await asyncio.wait_for(client.pump, 5)  # the server closed: the client reads EOF
    assert client.goaway, "the server said GOAWAY before closing"
    await client.close()
    for _ in range(100):
        if not listener.connections.open:
            break
        await asyncio.sleep(0.02)
    assert not listener.connections.open, "a closed connection is forgotten"


def test_the_switch_works_under_uvloop(pki: dict[str, Path]) -> None:
    """The extender runs on uvloop, whose TLS transport is its own: hand-over and replies there too."""
    outcome: list[object] = []

    async def scenario() -> None:
        served = await listen(pki, echo)
        client = await H2Client.connect(served.port, client_context(pki, ["h2"]))
        try:
            outcome.append(await client.call("POST", "/big/100000"))
        finally:
            await client.close()
            await served.close()
        outcome.append(served.connections.accepted)

    thread = threading.Thread(target=lambda: uvloop.run(scenario()))
    thread.start()
    thread.join(30)
    assert outcome == [(200, b"x" * 100000), {"h2": 1}]


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


async def test_a_request_and_its_reply_cost_one_write() -> None:
    """Each write to a local socket wakes the reader (on a busy machine that costs the writer more
    than the bytes do): the window update for a request and a reply produced in the same turn of the
    event loop leave together."""
    server = http2.H2Protocol(echo, max_body=1 << 20)
    transport = RecordingTransport()
    server.connection_made(transport)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.receive_data(b"".join(transport.writes))  # the server's settings
    transport.writes.clear()
    stream = client.get_next_available_stream_id()
    client.send_headers(stream, [(":method", "POST"), (":path", "/filter"), (":scheme", "https"), (":authority", "x")])
    for part in range(3):  # 40,000 bytes in frames of at most 16 KiB
        client.send_data(stream, bytes(16_000 if part < 2 else 8_000), end_stream=part == 2)
    server.data_received(client.data_to_send())
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(transport.writes) == 1
    events = client.receive_data(transport.writes[0])
    kinds = [type(e).__name__ for e in events]
    assert "ResponseReceived" in kinds and "StreamEnded" in kinds
    body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived) and e.data is not None)
    assert body == b"POST /filter 40000"
