"""Informer semantics over the fake API server: relist only on 410, resume after temporary faults,
recreated objects, honest readiness, never dying on handler bugs or undecodable objects."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sharegpu.api import paths, wire
from sharegpu.kube import client, fake, informer
from tests.builders import Clock, MakePod
from tests.conftest import eventually


def pod(name: str, uid_hint: str = "") -> dict[str, Any]:
    """A pod labelled v=<uid_hint> (one made again under the same name differs by it)."""
    return MakePod(name).labels({"v": uid_hint}).obj()


def start(
    server: fake.FakeApiServer, seen: list[tuple[str, str]], **options: Any
) -> tuple[informer.Informer[wire.Pod, wire.Pod], asyncio.Task[None]]:
    kube = client.KubeClient(server)

    def handler(kind: str, obj: wire.Pod) -> None:
        seen.append((kind, obj.metadata.name))

    inf: informer.Informer[wire.Pod, wire.Pod] = informer.Informer(
        kube, paths.PODS, wire.Pod, informer.identity, handler, max_backoff=0.05, **options
    )
    return inf, asyncio.create_task(inf.run())


def following(
    kube: client.KubeClient, handler: Callable[[str, wire.Pod], None]
) -> tuple[informer.Informer[wire.Pod, wire.Pod], asyncio.Task[None]]:
    """An informer of every pod telling `handler`, running."""
    inf: informer.Informer[wire.Pod, wire.Pod] = informer.Informer(
        kube, paths.PODS, wire.Pod, informer.identity, handler, max_backoff=0.05
    )
    return inf, asyncio.create_task(inf.run())


async def test_lists_then_follows_the_watch() -> None:
    server = fake.FakeApiServer()
    server.put_object(paths.pods("ns"), pod("a"))
    seen: list[tuple[str, str]] = []
    inf, task = start(server, seen)
    await inf.synced.wait()
    await client.KubeClient(server).create(paths.pods("ns"), pod("b"))
    await eventually(lambda: ("ADDED", "b") in seen, "b through the watch")
    await client.KubeClient(server).delete(paths.pod("ns", "a"))
    await eventually(lambda: ("DELETED", "a") in seen, "a deleted")
    await informer.cancel([task])
    assert seen == [("ADDED", "a"), ("ADDED", "b"), ("DELETED", "a")]
    assert set(inf.store) == {"ns/b"}
    assert inf.lists == 1


async def test_temporary_faults_resume_the_watch_without_a_relist() -> None:
    server = fake.FakeApiServer()
    kube = client.KubeClient(server)
    seen: list[tuple[str, str]] = []
    inf, task = start(server, seen)
    await inf.synced.wait()
    await eventually(lambda: inf.ready and bool(server.watches), "watching")
    server.cut_watches()
    await kube.create(paths.pods("ns"), pod("during-the-cut"))  # happens while nobody watches
    server.fail(503, method="WATCH")
    server.fail(429, method="WATCH", retry_after=0)
    await eventually(lambda: ("ADDED", "during-the-cut") in seen, "the missed event replayed")
    await informer.cancel([task])
    assert inf.lists == 1, "a cut connection, a 503 and a 429 are resumed from the last version"


async def test_a_watch_gone_silent_is_given_up_after_its_idle_timeout_and_resumed() -> None:
    """A connection the server lost without closing it (half-open): nothing more comes on it. The
    informer gives it up once no byte came for `watch_idle` seconds and resumes from its version."""
    server = fake.FakeApiServer()
    kube = client.KubeClient(server)
    seen: list[tuple[str, str]] = []
    inf, task = start(server, seen, watch_idle=0.3)
    await inf.synced.wait()
    await eventually(lambda: inf.ready and bool(server.watches), "watching")
    assert server.stall_watches() == 1
    await kube.create(paths.pods("ns"), pod("while-silent"))  # the stalled connection never carries it
    await eventually(lambda: ("ADDED", "while-silent") in seen, "the change, through a new watch")
    await informer.cancel([task])
    assert inf.lists == 1, "resumed from its version, not listed again"
    assert inf.resumes == 0 and "no byte" in inf.last_error, "given up as a fault, not ended by the server"


async def test_410_relists_and_reports_what_vanished_or_was_recreated() -> None:
    server = fake.FakeApiServer()
    kube = client.KubeClient(server)
    await kube.create(paths.pods("ns"), pod("stays"))
    await kube.create(paths.pods("ns"), pod("goes"))
    await kube.create(paths.pods("ns"), pod("reborn"))
    seen: list[tuple[str, str]] = []
    inf, task = start(server, seen)
    await inf.synced.wait()
    await eventually(lambda: bool(server.watches), "watching")
    # While the informer cannot see: one goes, one is recreated under the same name, history is compacted.
    server.cut_watches()
    server.fail(503, method="WATCH", times=3)
    await kube.delete(paths.pod("ns", "goes"))
    await kube.delete(paths.pod("ns", "reborn"))
    await kube.create(paths.pods("ns"), pod("reborn", "2"))
    server.expire_watches()
    server.compacted = server.version
    await eventually(lambda: inf.lists == 2, "a relist")
    await informer.cancel([task])
    assert seen[3:] == [("DELETED", "goes"), ("DELETED", "reborn"), ("ADDED", "reborn"), ("MODIFIED", "stays")]


async def test_readiness_follows_auth_failures_and_long_outages() -> None:
    server = fake.FakeApiServer()
    clock = Clock()
    seen: list[tuple[str, str]] = []
    inf, task = start(server, seen, clock=clock, stale_after=30.0)
    assert inf.status()["ready"] is False, "not ready before the first list"
    await inf.synced.wait()
    await eventually(lambda: inf.ready and bool(server.watches), "watching")
    server.tokens = {"nobody-has-this"}
    server.cut_watches()
    await eventually(lambda: inf.unauthorized and not inf.ready, "401 seen and reported")
    server.tokens = None
    await eventually(lambda: inf.ready and not inf.unauthorized, "recovered")
    server.fail(503, method="WATCH", times=10_000)
    server.cut_watches()
    await eventually(lambda: not inf.status()["watching"] and "503" in inf.last_error, "failing")
    assert inf.status()["ready"] is True, "a short outage keeps the informer ready"
    clock.advance(31)
    assert inf.status()["ready"] is False, "an outage longer than stale_after does not"
    server.faults.clear()
    await eventually(lambda: inf.ready, "watching again")
    await informer.cancel([task])


async def test_handler_bugs_and_undecodable_objects_do_not_stop_it() -> None:
    server = fake.FakeApiServer()
    kube = client.KubeClient(server)
    calls: list[str] = []

    def handler(kind: str, obj: wire.Pod) -> None:
        calls.append(obj.metadata.name)
        if obj.metadata.name == "boom":
            raise RuntimeError("handler bug")

    inf, task = following(kube, handler)
    await inf.synced.wait()
    await kube.create(paths.pods("ns"), pod("boom"))
    await kube.create(paths.pods("ns"), pod("after"))
    await eventually(lambda: "after" in calls, "events after the bug")
    server.put_object(paths.pods("ns"), {"metadata": {"name": "bad", "labels": "not-a-map"}})
    await kube.create(paths.pods("ns"), pod("later"))
    await eventually(lambda: "later" in calls, "events after the undecodable one")
    await informer.cancel([task])
    assert inf.undecodable == 1 and inf.handler_errors >= 1
    assert not task.cancelled() or task.done()


async def test_a_list_holding_an_object_it_cannot_read_is_listed_again() -> None:
    server = fake.FakeApiServer()
    server.put_object(paths.pods("ns"), {"metadata": {"name": "bad", "namespace": "ns", "labels": "not-a-map"}})
    seen: list[tuple[str, str]] = []
    inf, task = start(server, seen)
    await eventually(lambda: inf.lists == 0 and "Pod ns/bad" in inf.last_error, "the list refused, and why")
    assert not inf.synced.is_set()
    await client.KubeClient(server).delete(paths.pod("ns", "bad"))
    await inf.synced.wait()
    await informer.cancel([task])


async def test_a_handler_that_fails_on_a_watch_event_is_given_everything_again_by_a_list() -> None:
    """A handler that raised part-way through an update may have left its state half done: the
    informer lists again, delivering every object anew (here the failed one, which then goes through),
    and is not ready meanwhile; one that keeps failing on an object costs one list, not a loop."""
    server = fake.FakeApiServer()
    kube = client.KubeClient(server)
    calls: list[tuple[str, str]] = []
    failures = {"flaky": 1, "broken": 1000}

    def handler(kind: str, obj: wire.Pod) -> None:
        name = obj.metadata.name
        calls.append((kind, name))
        if failures.get(name, 0) > 0:
            failures[name] -= 1
            raise RuntimeError("handler bug")

    inf, task = following(kube, handler)
    await inf.synced.wait()
    await kube.create(paths.pods("ns"), pod("flaky"))
    await eventually(lambda: inf.lists == 2 and inf.ready, "listed again after the failure")
    assert calls[-1] == ("MODIFIED", "flaky"), "the list delivered it again, and this time it went through"
    await kube.create(paths.pods("ns"), pod("broken"))
    await eventually(lambda: inf.lists == 3 and inf.ready, "listed again")
    await kube.create(paths.pods("ns"), pod("after"))
    await eventually(lambda: ("ADDED", "after") in calls, "the watch goes on")
    await informer.cancel([task])
    assert inf.lists == 3 and inf.handler_errors == 3


async def test_a_watch_that_opens_and_breaks_again_and_again_is_not_ready() -> None:
    server = fake.FakeApiServer()
    clock = Clock()
    seen: list[tuple[str, str]] = []
    inf, task = start(server, seen, clock=clock, stale_after=30.0)
    await inf.synced.wait()
    await eventually(lambda: bool(server.watches), "watching")
    for _ in range(5):  # every watch is accepted, then cut before anything arrives
        server.cut_watches()
        await eventually(lambda: bool(server.watches) or not inf.status()["watching"], "reopened or broken")
        await asyncio.sleep(0.05)
    clock.advance(31)
    server.cut_watches()
    await eventually(lambda: not inf.status()["watching"], "broken again")
    assert inf.status()["ready"] is False, "accepted-then-cut watches for longer than stale_after are not health"
    await client.KubeClient(server).create(paths.pods("ns"), pod("proof"))
    await eventually(lambda: inf.status()["ready"] is True, "an event proves the watch works")
    await informer.cancel([task])


async def test_an_object_a_relist_cannot_convert_is_not_reported_deleted() -> None:
    """Reported DELETED, a running pod's GPUs would look free to the extender: what was known of it
    stays, as on the watch path."""
    server = fake.FakeApiServer()
    kube = client.KubeClient(server)
    await kube.create(paths.pods("ns"), pod("flaky"))
    seen: list[tuple[str, str]] = []
    broken = {"now": False}

    def convert(obj: wire.Pod, previous: wire.Pod | None) -> wire.Pod:
        if broken["now"] and obj.metadata.name == "flaky":
            raise RuntimeError("a converter bug")
        return obj

    def handler(kind: str, obj: wire.Pod) -> None:
        seen.append((kind, obj.metadata.name))

    inf: informer.Informer[wire.Pod, wire.Pod] = informer.Informer(
        kube, paths.PODS, wire.Pod, convert, handler, max_backoff=0.05
    )
    task = asyncio.create_task(inf.run())
    await inf.synced.wait()
    await eventually(lambda: bool(server.watches), "watching")
    broken["now"] = True
    server.expire_watches()
    server.compacted = server.version
    await eventually(lambda: inf.lists == 2, "a relist")
    await informer.cancel([task])
    assert ("DELETED", "flaky") not in seen and "ns/flaky" in inf.store
    assert inf.handler_errors == 1
