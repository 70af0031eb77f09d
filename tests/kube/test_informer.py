"""Informer semantics against a scripted fake API: relist on 410, resume after a dropped watch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from sharegpu.kube import errors, informer

Json = dict[str, Any]


def pod(name: str, version: str, uid: str = "") -> Json:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": version, "uid": uid or name}}


class FakeApi:
    """Serves scripted lists and watch streams; each watch step is a list of events or an exception."""

    def __init__(self, lists: list[tuple[list[Json], str]], watches: list[Any]) -> None:
        self.lists = lists
        self.watches = watches
        self.watched_from: list[str] = []

    async def list_all(self, path: str, params: Mapping[str, str | int] | None = None) -> tuple[list[Json], str]:
        return self.lists.pop(0)

    async def watch(
        self, path: str, version: str, params: Mapping[str, str | int] | None = None, *, timeout_seconds: int = 0
    ) -> AsyncIterator[tuple[str, Json]]:
        self.watched_from.append(version)
        if not self.watches:
            await asyncio.sleep(3600)
        step = self.watches.pop(0)
        if isinstance(step, Exception):
            raise step
        for event in step:
            yield event


async def test_relists_after_gone_and_reports_what_vanished() -> None:
    seen: list[tuple[str, str]] = []
    api = FakeApi(
        lists=[([pod("a", "1"), pod("b", "2")], "2"), ([pod("b", "5"), pod("c", "6")], "6")],
        watches=[
            [("MODIFIED", pod("a", "3")), ("BOOKMARK", {"metadata": {"resourceVersion": "4"}})],
            errors.GoneError(410, "Expired", "too old"),
        ],
    )
    inf = informer.Informer(api, "/api/v1/pods", lambda kind, obj: seen.append((kind, obj["metadata"]["name"])))  # type: ignore[arg-type]
    task = asyncio.create_task(inf.run())
    for _ in range(100):
        await asyncio.sleep(0.01)
        if inf.relists == 2 and len(api.watched_from) >= 3:
            break
    await informer.cancel([task])
    assert seen == [
        ("ADDED", "a"), ("ADDED", "b"),
        ("MODIFIED", "a"),
        ("DELETED", "a"), ("MODIFIED", "b"), ("ADDED", "c"),
    ]  # fmt: skip
    assert api.watched_from[:3] == ["2", "4", "6"], "resumes from the bookmark, then from the new list"
    assert set(inf.store) == {"ns/b", "ns/c"}


async def test_a_recreated_object_is_deleted_then_added() -> None:
    seen: list[tuple[str, str]] = []
    api = FakeApi(
        lists=[([pod("a", "1", uid="u1")], "1"), ([pod("a", "9", uid="u2")], "9")],
        watches=[errors.GoneError(410, "Expired", "too old")],
    )
    inf = informer.Informer(api, "/p", lambda kind, obj: seen.append((kind, obj["metadata"]["uid"])))  # type: ignore[arg-type]
    task = asyncio.create_task(inf.run())
    for _ in range(100):
        await asyncio.sleep(0.01)
        if inf.relists == 2:
            break
    await informer.cancel([task])
    assert seen == [("ADDED", "u1"), ("DELETED", "u1"), ("ADDED", "u2")]
