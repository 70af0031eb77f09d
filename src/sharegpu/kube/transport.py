"""How bytes reach the API server: the `Transport` seam, and the real one over aiohttp.

The client (`kube.client`) builds requests and interprets answers; a transport only moves them.
Two implementations: `AiohttpTransport` (TLS from `Credentials`, a new connection pool whenever the
certificates change) and `kube.fake.FakeApiServer`, an API server in memory that tests and
benchmarks use in its place, as httpx's MockTransport stands in for the network.

Watch streams are read as raw chunks and cut into lines here (`lines`), with no limit but
`MAX_LINE`: aiohttp's own line reader refuses lines over its buffer (512 KiB), and one pod with a
large env value, well inside the API server's 1.5 MiB object limit, used to kill a watch that way.
And a streamed answer whose connection goes away always ends (see `_AiohttpStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import aiohttp

from sharegpu.kube import credentials, errors

LARGE_BODY: Final = 512 * 1024
STREAM_CHECK: Final = 1.0
"""Seconds between checks that a streamed answer still has its connection (`_AiohttpStream`)."""
MAX_LINE: Final = 64 * 1024 * 1024
"""Longest watch line accepted: far above any object the API server stores (etcd's limit is 1.5 MiB)."""


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    params: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    content_type: str = "application/json"
    authorization: str | None = None
    accept: str = "application/json"


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


class Stream(Protocol):
    """An open streaming answer (a watch)."""

    status: int
    headers: Mapping[str, str]

    async def read(self) -> bytes:
        """The whole body (for an error status)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Bytes as they arrive, until the server ends the stream."""
        ...


class Transport(Protocol):
    async def send(self, request: Request, timeout: float) -> Response:
        """One request, one answer; TransportError when no answer came."""
        ...

    def stream(self, request: Request, idle_timeout: float) -> contextlib.AbstractAsyncContextManager[Stream]:
        """A streaming request; `idle_timeout`: seconds without a byte before giving up."""
        ...

    async def close(self) -> None: ...


async def lines(chunks: AsyncIterator[bytes], limit: int = MAX_LINE) -> AsyncIterator[bytes]:
    """Cut a byte stream into newline-terminated lines of any length up to `limit` (blank lines
    skipped); TransportError when a line is longer, or the stream ends inside one."""
    buffer = bytearray()
    async for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                buffer += chunk[start:]
                if len(buffer) > limit:
                    raise errors.TransportError(f"a watch line is longer than {limit} bytes")
                break
            if buffer:
                buffer += chunk[start:end]
                line = bytes(buffer)
                buffer.clear()
            else:
                line = chunk[start:end]
            start = end + 1
            if line.strip():
                yield line
    if buffer.strip():
        raise errors.TransportError("the watch stream ended in the middle of an event")


def _payload(body: bytes | None) -> bytes | io.BytesIO | None:
    """Large bodies (objects near the API's 1.5 MiB limit) as a stream, so the event loop is not held."""
    return io.BytesIO(body) if body is not None and len(body) > LARGE_BODY else body


class _AiohttpStream:
    """A streamed answer, watched over: aiohttp can lose the end of a streamed body. When a
    connection is closed from our side (the connection pool closed because the certificates
    changed, or anything else that calls the protocol's close), the protocol forgets the response's
    reader without telling it, and the read waits for ever (its sock_read timeout goes with the
    connection). A watch that waits for ever is a cache that goes stale while /readyz says ok, so
    a guard checks every `check_every` seconds that the connection is still there and ends the
    read with an error when it is not (the informer then resumes from the last version it saw)."""

    def __init__(self, response: aiohttp.ClientResponse, check_every: float) -> None:
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers
        self._response = response
        self._check_every = check_every

    async def read(self) -> bytes:
        return await self._response.read()

    async def chunks(self) -> AsyncIterator[bytes]:
        guard = asyncio.create_task(self._guard(), name="stream-guard")
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError) as exc:
            # RuntimeError: aiohttp's "Connection closed." when the connection went between two reads
            raise errors.TransportError(f"watch stream broke: {type(exc).__name__}: {exc}") from exc
        finally:
            guard.cancel()

    async def _guard(self) -> None:
        content = self._response.content
        while True:
            await asyncio.sleep(self._check_every)
            if content.is_eof() or content.exception() is not None:
                return  # ended, or already failed: the reader has been told
            connection = self._response.connection
            if connection is None or connection.transport is None:
                content.set_exception(aiohttp.ClientConnectionError("the connection closed before the stream ended"))
                return


def _unsent(exc: BaseException) -> bool:
    """Whether the request certainly never reached the server: the connection could not be made
    (refused, unreachable, TLS handshake failed, connect timeout). A request written to a kept
    connection that then turned out dead counts as sent: the server may have read it."""
    return isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)


CLEANUP_CLOSED = bool(getattr(aiohttp.connector, "NEEDS_CLEANUP_CLOSED", False))
"""Track TLS connections aiohttp has closed (idle ones, those the server asked to close) until
their shutdown ends, and abort them when it has not after two seconds or when the client closes.
Otherwise, on Pythons before 3.12.8 (every 3.11; CPython PR 118960), a connection still shutting
down when the client is closed is forgotten with its socket open: found as an unclosed-socket
warning after a third of the runs of tests/integration/test_admission.py alone, none of 8 with
this. aiohttp warns when asked on a Python that no longer needs it, so it is asked only where it
says it is needed."""


class AiohttpTransport:
    """Requests over aiohttp, with TLS from `creds` (new connections whenever the certificates change)."""

    def __init__(
        self, creds: credentials.Credentials, *, connections: int = 64, stream_check: float = STREAM_CHECK
    ) -> None:
        self.credentials = creds
        self._connections = connections
        self._stream_check = stream_check
        self._session: aiohttp.ClientSession | None = None
        self._generation = -1
        self._server_name: str | None = None

    async def _session_for_now(self) -> aiohttp.ClientSession:
        tls = await self.credentials.tls()
        if self._session is None or self._session.closed or tls.generation != self._generation:
            old = self._session
            connector = aiohttp.TCPConnector(
                ssl=tls.context if tls.context is not None else False,
                limit=self._connections,
                enable_cleanup_closed=CLEANUP_CLOSED,
            )
            self._session = aiohttp.ClientSession(
                base_url=self.credentials.server + "/",
                connector=connector,
                auto_decompress=True,
                read_bufsize=1 << 20,
            )
            self._generation = tls.generation
            self._server_name = tls.server_name
            if old is not None:
                await old.close()
        return self._session

    def _headers(self, request: Request) -> dict[str, str]:
        headers = {"Accept": request.accept}
        if request.body is not None:
            headers["Content-Type"] = request.content_type
        if request.authorization:
            headers["Authorization"] = request.authorization
        return headers

    def _request(
        self, session: aiohttp.ClientSession, request: Request, timeout: aiohttp.ClientTimeout, body: bool
    ) -> Any:
        return session.request(
            request.method,
            request.path.lstrip("/"),
            params=dict(request.params) or None,
            data=_payload(request.body) if body else None,
            headers=self._headers(request),
            timeout=timeout,
            server_hostname=self._server_name,
        )

    async def send(self, request: Request, timeout: float) -> Response:
        session = await self._session_for_now()
        try:
            async with self._request(session, request, aiohttp.ClientTimeout(total=timeout), body=True) as response:
                return Response(response.status, await response.read(), response.headers)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise errors.TransportError(
                f"{request.method} {request.path}: {type(exc).__name__}: {exc}", sent=not _unsent(exc)
            ) from exc

    @contextlib.asynccontextmanager
    async def stream(self, request: Request, idle_timeout: float) -> AsyncIterator[Stream]:
        session = await self._session_for_now()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=idle_timeout)
        try:
            async with self._request(session, request, timeout, body=False) as response:
                yield _AiohttpStream(response, self._stream_check)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise errors.TransportError(f"WATCH {request.path}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
