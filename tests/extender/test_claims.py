"""The extender's claim tables (`extender.claims`): what one watch event files where, and what it
tells the ledger to do."""

from __future__ import annotations

from typing import Any

from sharegpu.api import dra, wire
from sharegpu.extender import claims

ADDED, MODIFIED, DELETED = wire.EventType.ADDED, wire.EventType.MODIFIED, wire.EventType.DELETED
OURS = {"name": "gpu", "exactly": {"deviceClassName": dra.CLASS,
                                   "capacity": {"requests": {dra.MILLI: "300", dra.MEMORY: "4Gi"}}}}  # fmt: skip
RESULT = {"request": "gpu", "driver": dra.DRIVER, "pool": "n0", "device": "gpu-1", "shareID": "s1",
          "consumedCapacity": {dra.MILLI: "300", dra.MEMORY: "4Gi"}}  # fmt: skip


def record(name: str = "c", *, allocated: bool = False, request: dict[str, Any] | None = None) -> dra.ClaimRecord:
    body: dict[str, Any] = {"metadata": {"name": name, "namespace": "ns"},
                            "spec": {"devices": {"requests": [request or OURS]}}}  # fmt: skip
    if allocated:
        body["status"] = {"allocation": {"devices": {"results": [RESULT]}}}
    return dra.claim_record(wire.convert(body, dra.ResourceClaim))


def test_a_claim_of_the_class_is_kept_and_what_it_holds_counted_then_cleared_and_gone() -> None:
    table = claims.ClaimTable()
    key = dra.claim_key("ns", "c")
    seen = table.observe(ADDED, record(), {})
    assert (seen.old, seen.new) == (None, None) and key in table.records and not table.held
    seen = table.observe(MODIFIED, record(allocated=True), {})
    assert seen.new is not None and seen.new.gpu_usage() == {1: (300, 4096)} and table.held[key] == seen.new
    seen = table.observe(MODIFIED, record(), {})  # its allocation taken back
    assert seen.old is not None and seen.new is None and table.cleared == {key: "n0"}
    seen = table.observe(DELETED, record(), {})
    assert key not in table.records and key not in table.cleared


def test_another_drivers_claim_is_only_known_by_its_key() -> None:
    table = claims.ClaimTable()
    theirs = {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}
    table.observe(ADDED, record("x", request=theirs), {})
    assert table.foreign == {dra.claim_key("ns", "x")} and not table.records
    table.observe(DELETED, record("x", request=theirs), {})
    assert not table.foreign


def test_a_claim_being_written_stays_held_as_decided_until_the_watch_shows_it() -> None:
    table = claims.ClaimTable()
    key = dra.claim_key("ns", "c")
    decided = table.observe(MODIFIED, record(allocated=True), {}).new
    assert decided is not None
    table.held.clear()
    table.assumed[key] = decided
    stale = table.observe(MODIFIED, record(), {})  # an event from before the write landed
    assert stale.as_decided and table.assumed == {key: decided}
    shown = table.observe(MODIFIED, record(allocated=True), {})
    assert not shown.as_decided and not table.assumed and table.holding(key) == shown.new
    table.assumed[key] = decided
    gone = table.observe(DELETED, record(), {})
    assert gone.forget, "deleted while written: the assumption goes"
