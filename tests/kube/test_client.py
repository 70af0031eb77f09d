"""The client over the fake API server: verbs, paging, typed watches, error mapping, 401 handling,
and the line reader that keeps watches alive with objects near (and over) the API's size limit."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sharegpu.api import paths, wire
from sharegpu.kube import client, errors, fake, transport
from tests.builders import MakePod


def api(**kwargs: object) -> tuple[fake.FakeApiServer, client.KubeClient]:
    server = fake.FakeApiServer(**kwargs)  # type: ignore[arg-type]
    return server, client.KubeClient(server)


async def test_create_get_patch_delete_and_conflicts() -> None:
    _, kube = api()
    made = await kube.create(paths.pods("ns"), MakePod("a").obj())
    assert made["metadata"]["uid"] and made["metadata"]["resourceVersion"]
    with pytest.raises(errors.ConflictError) as caught:
        await kube.create(paths.pods("ns"), MakePod("a").obj())
    assert caught.value.already_exists and caught.value.status == 409
    patched = await kube.patch(paths.pod("ns", "a"), {"metadata": {"labels": {"x": "1"}}})
    assert patched["metadata"]["labels"] == {"x": "1"}
    stale = {**made, "metadata": {**made["metadata"], "labels": {"y": "2"}}}
    with pytest.raises(errors.ConflictError) as stale_write:
        await kube.replace(paths.pod("ns", "a"), stale)
    assert not stale_write.value.already_exists
    with pytest.raises(errors.ConflictError, match="the UID in the precondition"):
        await kube.delete(paths.pod("ns", "a"), preconditions={"uid": "someone-else"})
    assert await kube.delete(paths.pod("ns", "a")) is not None
    assert await kube.delete(paths.pod("ns", "a")) is None
    with pytest.raises(errors.NotFoundError):
        await kube.delete(paths.pod("ns", "a"), missing_ok=False)


@pytest.mark.parametrize(
    ("status", "kind", "temporary"),
    [
        (400, errors.InvalidError, False),
        (403, errors.ForbiddenError, False),
        (404, errors.NotFoundError, False),
        (409, errors.ConflictError, False),
        (410, errors.GoneError, False),
        (422, errors.InvalidError, False),
        (429, errors.BusyError, True),
        (500, errors.BusyError, True),
        (503, errors.BusyError, True),
    ],
)
async def test_every_status_maps_to_its_class(status: int, kind: type[errors.ApiError], temporary: bool) -> None:
    server, kube = api()
    server.fail(status, retry_after=7 if status == 429 else None, reason="Because")
    with pytest.raises(kind) as caught:
        await kube.get(paths.pod("ns", "x"))
    error = caught.value
    assert (error.status, error.reason, error.method) == (status, "Because", "GET")
    assert isinstance(error, errors.TemporaryError) is temporary
    if status == 429:
        assert error.retry_after == 7.0


async def test_a_401_rereads_the_credentials_and_retries_once() -> None:
    class Rotating:
        def __init__(self) -> None:
            self.token, self.refreshes = "old", 0

        async def authorization(self) -> str:
            return f"Bearer {self.token}"

        async def refresh(self) -> None:
            self.refreshes += 1
            self.token = "new"

    server = fake.FakeApiServer(tokens={"new"})
    auth = Rotating()
    kube = client.KubeClient(server, auth)
    await kube.create(paths.pods("ns"), MakePod("a").obj())
    assert (auth.refreshes, kube.unauthorized) == (1, 1)
    server.tokens = {"newer"}
    with pytest.raises(errors.UnauthorizedError):
        await kube.get(paths.pod("ns", "a"))
    assert auth.refreshes == 2, "one refresh per refused call, then the error"
    assert kube.refused
    server.tokens = {"new"}
    await kube.get(paths.pod("ns", "a"))
    assert not kube.refused, "the next success clears it"


async def test_lists_are_paged_and_typed() -> None:
    server, kube = api()
    for i in range(7):
        await kube.create(paths.pods("ns"), MakePod(f"p{i}").labels({"team": "a" if i % 2 else "b"}).obj())
    items, version = await kube.list_of(paths.PODS, wire.Pod, page=3)
    assert [p.metadata.name for p in items] == [f"p{i}" for i in range(7)]
    assert version == str(server.version)
    assert sum(1 for m, _ in server.requests if m == "GET") == 3
    selected, _ = await kube.list_of(paths.PODS, wire.Pod, {"labelSelector": "team=a"})
    assert [p.metadata.name for p in selected] == ["p1", "p3", "p5"]


async def test_a_list_holding_an_object_that_cannot_be_read_names_it() -> None:
    server, kube = api()
    await kube.create(paths.pods("ns"), MakePod("a").obj())  # listed first: the culprit is found by index
    server.put_object(paths.pods("ns"), {"metadata": {"name": "bad", "namespace": "ns", "labels": "not-a-map"}})
    with pytest.raises(errors.UndecodableError) as caught:
        await kube.list_of(paths.PODS, wire.Pod)
    assert isinstance(caught.value, errors.TransportError), "retried as a lost answer is"
    assert (caught.value.path, caught.value.culprit) == (paths.PODS, "Pod ns/bad")
    assert "$.items[1].metadata.labels" in caught.value.detail
    assert str(caught.value).startswith(f"LIST {paths.PODS}: undecodable answer: Pod ns/bad: ")


async def test_watch_replays_from_a_version_and_says_when_it_is_too_old() -> None:
    server, kube = api()
    await kube.create(paths.pods("ns"), MakePod("a").obj())
    start = str(server.version)
    await kube.create(paths.pods("ns"), MakePod("b").obj())
    await kube.patch(paths.pod("ns", "a"), {"metadata": {"labels": {"x": "1"}}})
    seen = []
    async for kind, obj, _ in kube.watch(paths.PODS, wire.Pod, start, timeout_seconds=1):
        seen.append((kind, obj.metadata.name if obj else None))
        if len(seen) == 3:
            break
    assert seen == [(client.OPENED, None), ("ADDED", "b"), ("MODIFIED", "a")]
    server.expire_watches()
    with pytest.raises(errors.GoneError):
        async for _ in kube.watch(paths.PODS, wire.Pod, start, timeout_seconds=1):
            pass


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_lines_of_any_size_are_cut_correctly() -> None:
    big = b"x" * (3 * 1024 * 1024)
    got = [
        line async for line in transport.lines(_chunks(b'{"a":1}\n{"b"', b":2}\n\n", big[:10], big[10:], b"\nend\n"))
    ]
    assert got == [b'{"a":1}', b'{"b":2}', big, b"end"]


async def test_a_line_over_the_limit_or_cut_short_is_a_temporary_error() -> None:
    with pytest.raises(errors.TransportError, match="longer than 10 bytes"):
        [line async for line in transport.lines(_chunks(b"0123456789abc"), limit=10)]
    with pytest.raises(errors.TransportError, match="ended in the middle"):
        [line async for line in transport.lines(_chunks(b'{"a":1}\n{"b"'))]


async def test_a_watch_event_over_a_mebibyte_arrives() -> None:
    server, kube = api()
    huge = MakePod("huge").annotations({"blob": "y" * (1200 * 1024)}).obj()
    start = str(server.version)
    await kube.create(paths.pods("ns"), huge)
    async for kind, obj, _ in kube.watch(paths.PODS, wire.Pod, start, timeout_seconds=1):
        if kind == "ADDED":
            assert obj is not None and len(obj.metadata.annotations["blob"]) == 1200 * 1024
            break


async def test_whether_an_api_is_served_is_asked_again_after_faults_and_only_404_means_no() -> None:
    server = fake.FakeApiServer(served=frozenset({"resource.k8s.io/v1"}))
    api = client.KubeClient(server)
    server.fail(503, path="/apis/resource.k8s.io/v1", times=2)
    server.fail(403, path="/apis/resource.k8s.io/v1")  # RBAC not loaded yet after a restart
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    assert await client.serves_when_answered(api, "resource.k8s.io/v1", sleep) is True
    assert waits == [0.5, 1.0, 2.0]
    assert await client.serves_when_answered(api, "resource.k8s.io/v9", sleep) is False
    assert waits == [0.5, 1.0, 2.0], "404 is an answer"
