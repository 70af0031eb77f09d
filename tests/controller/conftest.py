"""What the controller's tests share (their fake API server and nodes come from tests/extender/conftest.py)."""

from __future__ import annotations

from sharegpu.api import wire

T0 = wire.seconds("2026-11-23T08:00:00Z")
"""The controller tests' epoch: their clocks (tests.builders.Clock) start here."""
