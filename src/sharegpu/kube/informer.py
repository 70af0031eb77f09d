"""Informers: a local copy of a collection, kept current by list + watch, and told to a handler.

An informer lists the collection (decoding each object as its wire type and keeping only the record
`convert` makes of it), then watches from the list's resourceVersion. What happens on each fault:

- the server ends the watch (its timeout), or a bookmark arrives: resume from the last version;
- the watch goes silent, no byte for `watch_idle` seconds (`client.WATCH_IDLE`; a connection the
  server's side lost without closing it): the connection is given up, a temporary fault (below);
- a temporary fault (connection refused or cut, timeout, 429, 5xx): wait (the server's Retry-After
  if it gave one, else an exponential backoff) and *resume the watch* from the last version, with no
  relist: a restarted API server still has that history;
- 410 Gone (the version is too old, e.g. after etcd compaction): list again; objects that vanished
  meanwhile are reported DELETED, objects recreated under the same name DELETED then ADDED;
- 401/403: the client has already re-read its credentials once; the informer reports itself
  unauthorised (not ready) and keeps retrying with backoff until they work again;
- a bug in a handler on a watch event: logged and counted, and the informer lists again (not ready
  meanwhile), so that whatever the handler left half done is mended by the list's deliveries; one
  during a list is logged and counted, the list goes on (it is that delivery);
- anything else, an object that cannot be decoded among them: logged and counted; the informer
  carries on (an unexpected error relists). `run` returns only when cancelled.

`ready` tells the truth for /readyz: listed, not waiting for a relist, not refused by the API, and
either watching or failing for less than `stale_after` seconds.

Handlers are synchronous and run in the event loop, so they see events one at a time, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, Protocol, TypeVar

from sharegpu.api import wire
from sharegpu.kube import client, errors

log = logging.getLogger(__name__)


class HasMeta(Protocol):
    @property
    def metadata(self) -> wire.ObjectMeta: ...


W = TypeVar("W", bound=HasMeta)
T = TypeVar("T")
Handler = Callable[[wire.EventType, T], None]
Convert = Callable[[W, T | None], T]


def remember(store: dict[str, W], kind: wire.EventType, obj: W) -> None:
    """Apply one event to a copy keyed by `wire.key`: DELETED removes the object, any other stores it."""
    key = wire.key(obj.metadata)
    if kind == wire.EventType.DELETED:
        store.pop(key, None)
    else:
        store[key] = obj


def remember_labels(store: dict[str, dict[str, str]], kind: wire.EventType, obj: W) -> bool:
    """Apply one event to a map of each object's labels, keyed by `wire.key`; True if it changed
    (what a reader that selects objects by their labels, as of namespaces, needs to know)."""
    key = wire.key(obj.metadata)
    if kind == wire.EventType.DELETED:
        return store.pop(key, None) is not None
    if store.get(key) == obj.metadata.labels:
        return False
    store[key] = dict(obj.metadata.labels)
    return True


def identity(obj: W, previous: object | None) -> W:
    """`convert` for informers that keep the wire object itself."""
    return obj


class Informer(Generic[W, T]):
    def __init__(
        self,
        api: client.KubeApi,
        path: str,
        kind: type[W],
        convert: Callable[[W, T | None], T],
        handler: Handler[T],
        *,
        name: str = "",
        params: Mapping[str, str] | None = None,
        watch_timeout: int = 240,
        watch_idle: float = client.WATCH_IDLE,
        stale_after: float = 30.0,
        max_backoff: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.path = path
        self.kind = kind
        self.convert = convert
        self.handler = handler
        self.name = name or path
        self.params = dict(params or {})
        self.watch_timeout = watch_timeout
        self.watch_idle = watch_idle
        self.stale_after = stale_after
        self.max_backoff = max_backoff
        self.clock = clock
        self.store: dict[str, T] = {}
        self._uids: dict[str, str] = {}
        self.synced = asyncio.Event()
        self.resource_version = ""
        self.lists = 0
        self.resumes = 0
        self.undecodable = 0
        self.handler_errors = 0
        self.unauthorized = False
        self._needs_list = True
        self._watching = False
        self._failing_since: float | None = None
        self.last_error = ""
        self._handler_failed = False
        """The handler raised on a watch event: the watch ends, and a list delivers everything again."""
        self.listed_at: float | None = None
        """When the last list's final page arrived (clock time)."""

    # ----------------------------------------------------------------- health

    @property
    def ready(self) -> bool:
        if not self.synced.is_set() or self._needs_list or self.unauthorized:
            return False
        return self._watching or self._failing_since is None or self.clock() - self._failing_since < self.stale_after

    def status(self) -> dict[str, object]:
        return {
            "ready": self.ready,
            "listed": self.synced.is_set(),
            "watching": self._watching,
            "unauthorized": self.unauthorized,
            "resourceVersion": self.resource_version,
            "lists": self.lists,
            "resumes": self.resumes,
            "undecodable": self.undecodable,
            "handlerErrors": self.handler_errors,
            "lastError": self.last_error,
        }

    # ----------------------------------------------------------------- the loop

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                if self._needs_list:
                    await self._list()
                await self._watch()
                backoff = 0.2
                continue
            except asyncio.CancelledError:
                raise
            except errors.GoneError:
                log.info("informer %s: resource version %s expired; listing again", self.name, self.resource_version)
                self._needs_list = True
                self._failed("410 Gone")
                continue
            except (errors.UnauthorizedError, errors.ForbiddenError) as exc:
                self.unauthorized = True
                self._failed(str(exc))
                log.error("informer %s: %s; retrying in %.1f s", self.name, exc, backoff)
                wait = backoff
            except errors.TemporaryError as exc:
                self._failed(str(exc))
                wait = max(backoff, exc.retry_after or 0.0)
                log.warning("informer %s: %s; resuming in %.1f s", self.name, exc, wait)
            except errors.ApiError as exc:
                self._needs_list = True
                self._failed(str(exc))
                wait = backoff
                log.error("informer %s: %s; listing again in %.1f s", self.name, exc, wait)
            except _HandlerFailedError as exc:
                self._needs_list = True
                self._failed(str(exc))
                wait = backoff
                log.warning("informer %s: %s; listing again in %.1f s", self.name, exc, wait)
            except Exception as exc:  # never die: a bug here must not leave the cache silently stale
                self._needs_list = True
                self._failed(f"{type(exc).__name__}: {exc}")
                wait = backoff
                log.exception("informer %s: unexpected failure; listing again in %.1f s", self.name, wait)
            self._watching = False
            await asyncio.sleep(wait * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, self.max_backoff)

    def _failed(self, message: str) -> None:
        self._watching = False
        self.last_error = message
        if self._failing_since is None:
            self._failing_since = self.clock()

    def _healthy(self) -> None:
        self.unauthorized = False
        self._failing_since = None

    async def _list(self) -> None:
        """List, converting each page as it arrives (while the server makes the next one), then tell
        the handler what changed."""
        fresh: dict[str, tuple[str, T]] = {}
        version = ""
        async for items, last in self.api.list_pages(self.path, self.kind, self.params):
            version = last
            for item in items:
                key, uid = wire.key(item.metadata), item.metadata.uid
                previous = self.store.get(key) if self._uids.get(key) == uid else None
                try:
                    fresh[key] = (uid, self.convert(item, previous))
                except Exception:
                    self.handler_errors += 1
                    log.exception("informer %s: could not convert %s", self.name, key)
                    if previous is not None:  # it exists: what was known of it stays, as on the watch path
                        fresh[key] = (uid, previous)
        self.listed_at = self.clock()
        self.lists += 1
        for key in [k for k in self.store if k not in fresh]:
            self._deliver(wire.EventType.DELETED, key, None, self.store.pop(key))
        for key, (uid, record) in fresh.items():
            old = self.store.get(key)
            if old is not None and self._uids.get(key) != uid:
                self._deliver(wire.EventType.DELETED, key, None, self.store.pop(key))
                old = None
            self.store[key] = record
            self._uids[key] = uid
            self._deliver(wire.EventType.ADDED if old is None else wire.EventType.MODIFIED, key, None, record)
        self.resource_version = version
        self._needs_list = False
        self._handler_failed = False  # the list delivered everything: nothing to mend by another
        self._healthy()
        self.synced.set()

    async def _watch(self) -> None:
        events = self.api.watch(
            self.path, self.kind, self.resource_version, self.params,
            timeout_seconds=self.watch_timeout, idle_timeout=self.watch_idle,
        )  # fmt: skip
        try:
            async for kind, obj, version in events:
                if kind == client.OPENED:
                    # Accepted, but not yet proof of health: a watch that opens and breaks at once,
                    # again and again, must not look healthy. The first event (or a normal end) is.
                    self._watching = True
                    self.unauthorized = False
                    continue
                self._failing_since = None
                if version:
                    self.resource_version = version
                if kind == wire.EventType.BOOKMARK:
                    continue
                if obj is None:
                    self.undecodable += 1
                    log.error("informer %s: an object in a %s event could not be decoded; skipped", self.name, kind)
                    continue
                key = wire.key(obj.metadata)
                if kind == wire.EventType.DELETED:
                    old = self.store.pop(key, None)
                    self._uids.pop(key, None)
                    if old is not None:
                        self._deliver(wire.EventType.DELETED, key, None, old)
                else:
                    self._apply(wire.EventType(kind), key, obj)
                if self._handler_failed:  # what it left half done is mended by the list's deliveries
                    self._handler_failed = False
                    raise _HandlerFailedError(f"the handler failed on {kind} {key}")
        finally:
            self._watching = False
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
        self._failing_since = None  # the server ended the watch normally (its timeout)
        self.resumes += 1

    def _apply(self, kind: wire.EventType, key: str, obj: W) -> None:
        try:
            record = self.convert(obj, self.store.get(key))
        except Exception:
            self.handler_errors += 1
            log.exception("informer %s: could not convert %s", self.name, key)
            return
        self.store[key] = record
        self._uids[key] = obj.metadata.uid
        self._deliver(kind, key, obj, record)

    def _deliver(self, kind: wire.EventType, key: str, obj: W | None, record: T) -> None:
        if kind == wire.EventType.DELETED:
            self._uids.pop(key, None)
        try:
            self.handler(kind, record)
        except Exception:  # a handler bug must not kill the informer
            self.handler_errors += 1
            self._handler_failed = True
            log.exception("informer %s: handler failed on %s %s", self.name, kind, key)


class _HandlerFailedError(Exception):
    """The handler raised on a watch event (logged where it did): the informer lists again."""


async def cancel(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel tasks and wait for them, whatever they ended with (shutdown must not fail on a task's error)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
