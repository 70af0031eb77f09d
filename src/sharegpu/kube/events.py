"""Recording events: create the Event `api.events` builds; one that exists already was recorded
by an earlier attempt (or by the previous leader) and is not written again.

`record` raises what the API answered, for callers whose next step waits for the event (a victim
is not deleted unexplained). `tell` is for events that are the only trace of something done or
found once (an eviction made, a warning said once per decision): one the API refuses (the API
server restarting) is logged and kept, and `retell`, which the components call at each pass,
writes the kept ones again; an event's name is its decision's, so none is in the API twice."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

from sharegpu.api import events, paths, wire
from sharegpu.kube import client, errors

log = logging.getLogger(__name__)

KEPT: Final = 256
"""Events refused that a recorder keeps to write again, the newest."""

Untold = tuple[events.Subject, str, str]
"""An event `tell` keeps: its subject, reason and decision (what names it)."""


class Recorder:
    def __init__(self, api: client.KubeApi, component: str, instance: str, clock: Callable[[], float]) -> None:
        self.api = api
        self.component = component
        self.instance = instance
        self.clock = clock
        self.recorded = 0
        self.repeated = 0
        self.untold: dict[Untold, tuple[str, events.Kind]] = {}
        """Events `tell` could not write, oldest first -> (message, kind). One event told again while
        it is kept (a caller retrying its decision) is kept once."""

    async def record(
        self, subject: events.Subject, reason: str, message: str, *, decision: str, kind: events.Kind = "Normal"
    ) -> bool:
        """True if this call recorded the event; False if it was recorded before."""
        body = events.event(
            subject, reason, message, decision=decision, kind=kind, component=self.component,
            instance=self.instance, now=wire.timestamp(self.clock()),
        )  # fmt: skip
        try:
            await self.api.create(paths.events(events.namespace_of(subject)), body)
        except errors.ConflictError as exc:
            if not exc.already_exists:
                raise
            self.repeated += 1
            return False
        self.recorded += 1
        log.info("event %s on %s/%s: %s", reason, subject.namespace, subject.name, message)
        return True

    async def tell(
        self, subject: events.Subject, reason: str, message: str, *, decision: str, kind: events.Kind = "Normal"
    ) -> bool:
        """Record the event, now or before; False if the API refused it (it is kept for `retell`)."""
        try:
            await self.record(subject, reason, message, decision=decision, kind=kind)
        except errors.KubeError as exc:
            log.warning("event %s on %s/%s not recorded (written again later): %s", reason, subject.namespace,
                        subject.name, exc)  # fmt: skip
            self.untold.setdefault((subject, reason, decision), (message, kind))
            while len(self.untold) > KEPT:
                del self.untold[next(iter(self.untold))]
            return False
        self.untold.pop((subject, reason, decision), None)  # a caller's own retry got there first
        return True

    async def retell(self) -> None:
        """The events `tell` kept, again, oldest first; at the first refused again the rest waits too.
        Passes of several reconcilers may retell at once: each takes what is left."""
        for key in list(self.untold):
            kept = self.untold.pop(key, None)
            if kept is None:
                continue  # written meanwhile by another pass's retell
            (subject, reason, decision), (message, kind) = key, kept
            if not await self.tell(subject, reason, message, decision=decision, kind=kind):
                return
