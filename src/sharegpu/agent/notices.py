"""The agent's Warning events: recorded once per decision (`kube.events.Recorder`), and never a
reason for a pass to fail (an event the API refuses is logged and dropped)."""

from __future__ import annotations

import logging

from sharegpu.api import events
from sharegpu.core import errors
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)


class Notices:
    """Warning events on pods and on the node, from every part of the agent."""

    def __init__(self, recorder: kube_events.Recorder) -> None:
        self.recorder = recorder

    async def warn(self, subject: events.Subject, reason: str, message: str, decision: str) -> None:
        try:
            await self.recorder.record(subject, reason, message, decision=decision, kind="Warning")
        except errors.SharegpuError as exc:
            log.warning("event %s on %s/%s not recorded: %s", reason, subject.namespace, subject.name, exc)
