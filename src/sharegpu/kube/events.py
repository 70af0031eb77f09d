"""Recording events: create the Event `api.events` builds; one that exists already was recorded
by an earlier attempt (or by the previous leader) and is not written again."""

from __future__ import annotations

import logging
from collections.abc import Callable

from sharegpu.api import events, paths, wire
from sharegpu.kube import client, errors

log = logging.getLogger(__name__)


class Recorder:
    def __init__(self, api: client.KubeApi, component: str, instance: str, clock: Callable[[], float]) -> None:
        self.api = api
        self.component = component
        self.instance = instance
        self.clock = clock
        self.recorded = 0
        self.repeated = 0

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
