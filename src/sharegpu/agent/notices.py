"""The agent's Warning events: recorded once per decision (`kube.events.Recorder`), and never a
reason for a pass to fail. An event the API refuses (the API server restarting) is logged and kept;
`retell`, at the start of each agent pass, writes the kept ones again (an event's name is its
decision's, so none is written twice). The callers record a warning once per decision, so without
that a refused one would never be written."""

from __future__ import annotations

import logging
from collections import deque
from typing import Final

from sharegpu.api import events
from sharegpu.core import errors
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)

KEPT: Final = 128
"""Events not written yet that are kept to write again, the newest."""


class Notices:
    """Warning events on pods and on the node, from every part of the agent."""

    def __init__(self, recorder: kube_events.Recorder) -> None:
        self.recorder = recorder
        self.untold: deque[tuple[events.Subject, str, str, str]] = deque(maxlen=KEPT)
        """Events (subject, reason, message, decision) the API refused, to write again."""

    async def warn(self, subject: events.Subject, reason: str, message: str, decision: str) -> bool:
        """Record the event; False if it could not be written now (it is kept for `retell`)."""
        try:
            await self.recorder.record(subject, reason, message, decision=decision, kind="Warning")
        except errors.SharegpuError as exc:
            log.warning("event %s on %s/%s not recorded (again at the next pass): %s", reason, subject.namespace,
                        subject.name, exc)  # fmt: skip
            self.untold.append((subject, reason, message, decision))
            return False
        return True

    async def retell(self) -> None:
        """The kept events, again, oldest first; at the first refused again the rest waits too."""
        for _ in range(len(self.untold)):
            if not await self.warn(*self.untold.popleft()):
                return
