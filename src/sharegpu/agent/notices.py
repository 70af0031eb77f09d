"""The agent's Warning events: recorded once per decision, and never a reason for a pass to fail.
One the API refuses (the API server restarting) is kept and written at the start of the agent's
next pass (`kube.events.Recorder.tell` and `retell`): its callers record each decision once, so it
would be lost otherwise."""

from __future__ import annotations

from sharegpu.api import events
from sharegpu.kube import events as kube_events


class Notices:
    """Warning events on pods and on the node, from every part of the agent."""

    def __init__(self, recorder: kube_events.Recorder) -> None:
        self.recorder = recorder

    async def warn(self, subject: events.Subject, reason: str, message: str, decision: str) -> bool:
        """Record the event; False if it could not be written now (it is kept for `retell`)."""
        return await self.recorder.tell(subject, reason, message, decision=decision, kind="Warning")

    async def retell(self) -> None:
        """The warnings the API refused, again."""
        await self.recorder.retell()
