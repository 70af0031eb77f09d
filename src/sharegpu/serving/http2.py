"""HTTP/2 beside aiohttp's HTTP/1.1 on one TLS listener, for short request/response calls.

Why: kube-scheduler's extender client (Go's net/http, set up by Kubernetes' SetTransportDefaults)
offers `h2` in the TLS handshake. Over HTTP/1.1 it keeps at most two idle connections per host (Go's
default; kube-scheduler sets no other), so whenever a bind is still in flight while the next pod is
filtered it opens another mutual-TLS connection and later closes one: one handshake for every one or
two pods (counted before this module: 700 for 1500 pods), each costing both processes CPU and
adding a round trip to the scheduling cycle. Over HTTP/2 all of a kube-scheduler's calls share one
connection.

aiohttp serves HTTP/1.1 only, so the listener offers `h2` and `http/1.1` by ALPN and, once the
handshake has picked one, hands the connection to `H2Protocol` (framing, HPACK and flow control by
the sans-I/O `h2` library) or to aiohttp (`_Switch`). Without TLS there is no ALPN and every
connection is HTTP/1.1.

Scope: what the extender's verbs need. A request's whole body is read (up to `max_body`, else 413)
before its handler runs; each reply is one body, sent as the peer's flow-control windows allow;
streams run concurrently (a slow bind does not hold up the next filter). No server push, trailers or
streamed bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl as ssl_
import typing
from collections.abc import Awaitable, Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from aiohttp import web

log = logging.getLogger(__name__)

ALPN = ("h2", "http/1.1")
"""What a listener that switches by ALPN (`_Switch`) offers, in order of preference."""

STREAM_WINDOW = 1 << 20
"""How much of a request body a client may send before we acknowledge it (1 MiB: a filter call for
10,000 nodes is about 150 KB, so it arrives without waiting for a window update)."""

CONNECTION_WINDOW = 1 << 24


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"


Handler = Callable[[str, str, bytes], Awaitable[Reply]]
"""(method, path, body) -> the reply; the same function serves HTTP/1.1 and HTTP/2."""


@dataclasses.dataclass(slots=True)
class _Request:
    method: str
    path: str
    body: bytearray = dataclasses.field(default_factory=bytearray)
    refused: bool = False  # answered early (too large): later data is dropped


class H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection: requests in, each answered by `handler` in its own task."""

    def __init__(self, handler: Handler, max_body: int, on_lost: Callable[[H2Protocol], None] | None = None) -> None:
        config = h2.config.H2Configuration(client_side=False)
        self._conn = h2.connection.H2Connection(config)
        self._conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 256,
            },
        )
        self._handler = handler
        self._max_body = max_body
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._requests: dict[int, _Request] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._window = asyncio.Event()  # set whenever the peer opens a flow-control window
        self._flush_due = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = typing.cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._conn.initiate_connection()
        self._conn.increment_flow_control_window(CONNECTION_WINDOW)
        self._flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.warning("HTTP/2 protocol error from a client, closing the connection: %s", exc)
            self._flush()
            self.close()
            return
        for event in events:
            self._on(event)
        self._flush_soon()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._requests.clear()
        self._window.set()
        if self._on_lost is not None:
            self._on_lost(self)

    def close(self) -> None:
        """Say GOAWAY (so the client sends its next request elsewhere instead of seeing a broken
        connection) and close."""
        if self._transport is not None:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._conn.close_connection()
            self._flush()
            self._transport.close()

    # ------------------------------------------------------------------ events

    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            headers = dict(event.headers or ())
            assert event.stream_id is not None
            method, path = headers.get(b":method", b""), headers.get(b":path", b"")
            self._requests[event.stream_id] = _Request(method.decode("latin-1"), path.decode("latin-1"))
        elif isinstance(event, h2.events.DataReceived):
            assert event.stream_id is not None
            self._conn.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id)
            request = self._requests.get(event.stream_id)
            if request is None or request.refused:
                return
            request.body += event.data or b""
            if len(request.body) > self._max_body:
                request.refused = True
                request.body.clear()
                message = f"request body over {self._max_body} bytes".encode()
                self._start(event.stream_id, self._refuse(event.stream_id, Reply(413, message, "text/plain")))
        elif isinstance(event, h2.events.StreamEnded):
            assert event.stream_id is not None
            request = self._requests.pop(event.stream_id, None)
            if request is not None and not request.refused:
                self._start(event.stream_id, self._serve(event.stream_id, request))
        elif isinstance(event, h2.events.StreamReset):
            assert event.stream_id is not None
            self._requests.pop(event.stream_id, None)
            task = self._tasks.pop(event.stream_id, None)
            if task is not None:
                task.cancel()
            self._window.set()
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self._window.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.close()

    def _start(self, stream_id: int, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks[stream_id] = task
        task.add_done_callback(lambda _: self._forget(stream_id, task))

    def _forget(self, stream_id: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(stream_id) is task:
            del self._tasks[stream_id]

    async def _serve(self, stream_id: int, request: _Request) -> None:
        try:
            reply = await self._handler(request.method, request.path, bytes(request.body))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            reply = Reply(500, b"internal error", "text/plain")
        await self._reply(stream_id, reply)

    async def _refuse(self, stream_id: int, reply: Reply) -> None:
        """Answer before the request has ended, then tell the client to stop sending (RFC 9113 8.1)."""
        await self._reply(stream_id, reply)
        if self._transport is not None:
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                self._conn.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
            self._flush_soon()

    async def _reply(self, stream_id: int, reply: Reply) -> None:
        headers = [
            (":status", str(reply.status)),
            ("content-type", reply.content_type),
            ("content-length", str(len(reply.body))),
        ]
        try:
            self._conn.send_headers(stream_id, headers, end_stream=not reply.body)
            self._flush_soon()
            view = memoryview(reply.body)
            while view:
                window = min(self._conn.local_flow_control_window(stream_id), self._conn.max_outbound_frame_size)
                if window <= 0:
                    self._window.clear()
                    await self._window.wait()
                    if self._transport is None:
                        return
                    continue
                chunk, view = view[:window], view[window:]
                self._conn.send_data(stream_id, chunk, end_stream=not view)
                self._flush_soon()
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
            return  # the client reset the stream or went away: nobody is left to answer

    def _flush_soon(self) -> None:
        """Write what is due at the end of this turn of the event loop: the window update for a
        request and the reply that a synchronous handler (filter) produces in the same turn leave
        in one write. On a busy machine every write to a local socket costs the writer the
        reader's wake-up, so fewer, larger writes are cheaper for both sides."""
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        data = self._conn.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)


class _Switch(asyncio.Protocol):
    """Stands in until the TLS handshake is done, then hands the connection to the protocol that
    ALPN chose."""

    def __init__(
        self,
        http1: Callable[[], asyncio.BaseProtocol],
        http2: Callable[[], asyncio.Protocol],
        seen: Callable[[str], None],
    ) -> None:
        self._http1 = http1
        self._http2 = http2
        self._seen = seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        chosen = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        protocol = "h2" if chosen == "h2" else "http/1.1"
        self._seen(protocol)
        inner = self._http2() if protocol == "h2" else self._http1()
        transport.set_protocol(inner)
        inner.connection_made(transport)


class Connections:
    """The HTTP/2 connections a listener has open (so shutdown can close them) and a count of
    connections accepted per protocol."""

    def __init__(self, handler: Handler, max_body: int, seen: Callable[[str], None] | None = None) -> None:
        self._handler = handler
        self._max_body = max_body
        self._seen = seen
        self.open: set[H2Protocol] = set()
        self.accepted: dict[str, int] = {}

    def factory(self, http1: Callable[[], asyncio.BaseProtocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for `loop.create_server`: HTTP/2 here, HTTP/1.1 by `http1`."""
        return lambda: _Switch(http1, self._new, self._count)

    def _count(self, protocol: str) -> None:
        self.accepted[protocol] = self.accepted.get(protocol, 0) + 1
        if self._seen is not None:
            self._seen(protocol)

    def _new(self) -> H2Protocol:
        connection = H2Protocol(self._handler, self._max_body, self.open.discard)
        self.open.add(connection)
        return connection

    def close(self) -> None:
        for connection in list(self.open):
            connection.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Listener:
    """One listening port: HTTP/2 served by `connections`, HTTP/1.1 by an aiohttp runner."""

    server: asyncio.Server
    connections: Connections

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    def close(self) -> None:
        self.server.close()
        self.connections.close()


async def listen(
    runner: web.BaseRunner, connections: Connections, host: str, port: int, ssl: ssl_.SSLContext | None
) -> Listener:
    """Listen on `host`:`port` (TLS when `ssl` is given, offering `ALPN`); `runner` must be set up."""
    assert runner.server is not None, "set the runner up first"
    server = await asyncio.get_running_loop().create_server(connections.factory(runner.server), host, port, ssl=ssl)
    return Listener(server, connections)
