"""Informers: keep a local copy of a collection with list + watch, and tell a handler what changed.

An informer lists the collection, then watches from the list's resourceVersion. A watch that ends
(server timeout) is resumed from the last version seen; a broken connection is retried with backoff;
a 410 Gone (the version is too old) triggers a fresh list, and objects that disappeared meanwhile are
reported as DELETED. Handlers are synchronous and run in the event loop, so they see events one at
a time and in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from sharegpu.kube import client, errors

Json = dict[str, Any]
Handler = Callable[[str, Json], None]
log = logging.getLogger(__name__)


def object_key(obj: Json) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name', '')}" if namespace else str(meta.get("name", ""))


class Informer:
    def __init__(
        self,
        kube: client.KubeClient,
        path: str,
        handler: Handler,
        *,
        name: str = "",
        watch_timeout: int = 240,
        **selectors: str,
    ) -> None:
        self.kube = kube
        self.path = path
        self.handler = handler
        self.name = name or path
        self.watch_timeout = watch_timeout
        self.selectors = selectors
        self.store: dict[str, Json] = {}
        self.synced = asyncio.Event()
        self.relists = 0
        self.resource_version = ""

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                await self._list()
                backoff = 0.2
                while True:
                    await self._watch()
            except errors.GoneError:
                log.info("informer %s: resource version %s expired; listing again", self.name, self.resource_version)
                continue
            except errors.TemporaryError as exc:
                log.warning("informer %s: %s; retrying in %.1f s", self.name, exc, backoff)
            except errors.ApiError as exc:
                log.error("informer %s: %s; retrying in %.1f s", self.name, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _list(self) -> None:
        items, version = await self.kube.list_all(self.path, self.selectors)
        self.relists += 1
        fresh = {object_key(item): item for item in items}
        for key in list(self.store):
            if key not in fresh:
                self._deliver("DELETED", self.store.pop(key))
        for key, item in fresh.items():
            old = self.store.get(key)
            if old is not None and _uid(old) != _uid(item):
                self._deliver("DELETED", old)
                old = None
            self.store[key] = item
            self._deliver("ADDED" if old is None else "MODIFIED", item)
        self.resource_version = version
        self.synced.set()

    async def _watch(self) -> None:
        async for kind, obj in self.kube.watch(
            self.path, self.resource_version, self.selectors, timeout_seconds=self.watch_timeout
        ):
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.resource_version = str(version)
            if kind == "BOOKMARK":
                continue
            key = object_key(obj)
            if kind == "DELETED":
                self.store.pop(key, None)
            else:
                self.store[key] = obj
            self._deliver(kind, obj)

    def _deliver(self, kind: str, obj: Json) -> None:
        try:
            self.handler(kind, obj)
        except Exception:  # a handler bug must not kill the informer
            log.exception("informer %s: handler failed on %s %s", self.name, kind, object_key(obj))


def _uid(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("uid", ""))


async def cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
