"""What a write that raised did (`kube.errors.outcome`): refused when the server said no or never saw
the request, unknown when it may have been applied; the fake API server's faults that commit and
then lose or replace the answer; and the real transport telling a request that never left from one
whose answer was lost."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sharegpu.api import paths
from sharegpu.kube import client, errors, fake, transport
from tests.builders import MakePod
from tests.kube.conftest import local_credentials


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (errors.ConflictError(409, "Conflict", "changed"), errors.Outcome.REFUSED),
        (errors.BusyError(429, "TooManyRequests", "slow down"), errors.Outcome.REFUSED),
        (errors.ForbiddenError(403, "Forbidden", "no"), errors.Outcome.REFUSED),
        (errors.InvalidError(422, "Invalid", "bad"), errors.Outcome.REFUSED),
        (errors.TransportError("connection refused", sent=False), errors.Outcome.REFUSED),
        (errors.BusyError(500, "InternalError", "etcd"), errors.Outcome.UNKNOWN),
        (errors.BusyError(503, "ServiceUnavailable", "upstream: Server disconnected"), errors.Outcome.UNKNOWN),
        (errors.BusyError(504, "Timeout", "timed out"), errors.Outcome.UNKNOWN),
        (errors.TransportError("reset after sending"), errors.Outcome.UNKNOWN),
        (asyncio.CancelledError(), errors.Outcome.UNKNOWN),
        (RuntimeError("bug"), errors.Outcome.UNKNOWN),
    ],
)
def test_outcome_of_a_failed_write(exc: BaseException, expected: errors.Outcome) -> None:
    assert errors.outcome(exc) is expected


async def test_the_fake_commits_then_loses_the_answer_or_answers_5xx() -> None:
    server = fake.FakeApiServer()
    kube = client.KubeClient(server)
    server.lose(method="POST", path=paths.pods("ns"))
    with pytest.raises(errors.TransportError) as lost:
        await kube.create(paths.pods("ns"), MakePod("a").obj())
    assert errors.outcome(lost.value) is errors.Outcome.UNKNOWN
    assert server.get_object(paths.pod("ns", "a")) is not None, "carried out, then the answer was lost"

    server.lose(method="POST", path=paths.pods("ns"), after_commit=False)
    with pytest.raises(errors.TransportError) as never:
        await kube.create(paths.pods("ns"), MakePod("b").obj())
    assert errors.outcome(never.value) is errors.Outcome.UNKNOWN, "the caller cannot tell: the request was sent"
    assert server.get_object(paths.pod("ns", "b")) is None, "lost on its way in"

    server.fail(503, method="POST", path=paths.pods("ns"), after_commit=True)
    with pytest.raises(errors.BusyError) as busy:
        await kube.create(paths.pods("ns"), MakePod("c").obj())
    assert busy.value.status == 503 and server.get_object(paths.pod("ns", "c")) is not None

    server.fail(503, method="POST", path=paths.pods("ns"))
    with pytest.raises(errors.BusyError):
        await kube.create(paths.pods("ns"), MakePod("d").obj())
    assert server.get_object(paths.pod("ns", "d")) is None, "without after_commit, nothing is carried out"
    server.fail(500, method="DELETE", after_commit=True)
    with pytest.raises(errors.BusyError):
        await kube.delete(paths.pod("ns", "a"))
    assert server.get_object(paths.pod("ns", "a")) is None, "the delete happened under the 500"
    assert not server.faults


async def test_the_fake_loses_a_watch_connection() -> None:
    server = fake.FakeApiServer()
    kube = client.KubeClient(server)
    server.lose(method="WATCH")
    with pytest.raises(errors.TransportError):
        async for _ in kube.watch(paths.PODS, dict, "0"):
            pass


@pytest.fixture
async def hangup_server() -> AsyncIterator[int]:
    """A server that reads a request and closes the connection without answering."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def test_the_real_transport_tells_an_unsent_request_from_a_lost_answer(
    hangup_server: int, tmp_path: Path
) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    request = transport.Request("POST", "/api/v1/namespaces/ns/pods", body=b"{}")
    for port, sent in ((closed, False), (hangup_server, True)):
        link = transport.AiohttpTransport(local_credentials(tmp_path, port))
        try:
            with pytest.raises(errors.TransportError) as caught:
                await link.send(request, timeout=5)
        finally:
            await link.close()
        assert caught.value.sent is sent
        assert errors.outcome(caught.value) is (errors.Outcome.UNKNOWN if sent else errors.Outcome.REFUSED)
