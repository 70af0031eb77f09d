"""Reconcile loops: run a pass soon after anything changed, and at least every `tick` seconds.

Changes arrive in bursts (one bind brings several watch events); `wake()` only sets a flag, and a
pass runs at most once per `pace` seconds, so a burst costs one pass. A failed pass is logged and
the next one tries again: a reconciler compares what should be with what is, every time, so
nothing is lost by skipping a pass. A loop with heavy passes (the defragmenter's plan over the
whole cluster) rests `rest_factor` times as long as its last pass took, so however often it is
woken it takes at most 1 / (1 + rest_factor) of the time. The loop ends only when cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Loop:
    def __init__(self, name: str, reconcile: Callable[[], Awaitable[None]], *, rest_factor: float = 0.0) -> None:
        self.name = name
        self.reconcile = reconcile
        self.rest_factor = rest_factor
        self._wake = asyncio.Event()
        self.passes = 0
        """Passes begun."""
        self.completed = 0
        """Passes ended (failed ones included)."""
        self.failures = 0

    def wake(self) -> None:
        self._wake.set()

    async def run(self, tick: float = 0.5, pace: float = 0.25) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):  # not wait_for: on 3.11 it can lose a cancellation
                    await self._wake.wait()
            self._wake.clear()
            self.passes += 1
            started = time.monotonic()
            try:
                await self.reconcile()
            except Exception:
                self.failures += 1
                log.exception("%s: reconcile failed; the next pass tries again", self.name)
            finally:
                self.completed += 1
            await asyncio.sleep(max(pace, self.rest_factor * (time.monotonic() - started)))
