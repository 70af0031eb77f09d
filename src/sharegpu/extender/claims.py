"""The DRA claims as the extender keeps them, apart from the pods: one table per kind of fact, all
keyed by the claim's ledger key (`api.dra.claim_key`; `api.dra.ClaimName` reads one back).

- `records`: the claims of sharegpu's class, or holding its driver's devices, as the watch shows
  them (what the allocator places and the over-commit repair reads);
- `foreign`: the keys of every other claim (a pod gated for a claim that turned out to be another
  driver's is let go, not kept waiting for it to be made);
- `held`: what each claim holding the driver's GPUs holds, as an allocation of its node (what the
  one ledger counts beside the pods);
- `assumed`: what the allocator decided and is writing, until the watch shows it allocated;
- `cleared`: claims the watch showed allocated and then not (kube-scheduler's PostFilter took the
  allocation back, or it was freed), with the node they were on.

`observe` files one watch event into the tables and says, as a value (`Observed`), what the ledger
must do about it; the cache (`extender.cache.ClusterCache.on_claim`) does it. Nothing here touches the
ledger, and nothing awaits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sharegpu.api import dra, wire
from sharegpu.core import allocation, errors, units


@dataclass(frozen=True, slots=True)
class Observed:
    """What one claim event means for the ledger."""

    key: units.PodKey
    old: allocation.Allocation | None
    """What the claim held before the event (as counted)."""
    new: allocation.Allocation | None
    """What it holds now (None: nothing of the driver's)."""
    forget: bool = False
    """It was deleted while the allocator was writing it: its assumption goes."""
    as_decided: bool = False
    """The event is from before the allocator's write landed: the decision stays held as it is."""
    invalid: str | None = None
    """Why what it holds cannot be counted (an allocation sharegpu cannot read)."""


@dataclass
class ClaimTable:
    """The extender's claim tables (see the module docstring)."""

    records: dict[units.PodKey, dra.ClaimRecord] = field(default_factory=dict)
    foreign: set[units.PodKey] = field(default_factory=set)
    held: dict[units.PodKey, allocation.Allocation] = field(default_factory=dict)
    assumed: dict[units.PodKey, allocation.Allocation] = field(default_factory=dict)
    cleared: dict[units.PodKey, str] = field(default_factory=dict)

    def holding(self, key: units.PodKey) -> allocation.Allocation | None:
        """What a claim holds, as the watch shows it or as the allocator is writing it."""
        return self.held.get(key) or self.assumed.get(key)

    def observe(
        self, kind: wire.EventType, record: dra.ClaimRecord, memory_of: Mapping[tuple[str, int], int]
    ) -> Observed:
        """File one watch event of a claim (`memory_of`: (node, GPU index) -> MiB, to read what it holds)."""
        key = record.key
        new = None
        invalid = None
        if kind == wire.EventType.DELETED:
            self.records.pop(key, None)
            self.foreign.discard(key)
            self.cleared.pop(key, None)  # kept only for claims that exist (a replica not leading never takes them)
        else:
            if record.ours or record.holds_ours():
                self.records[key] = record
                self.foreign.discard(key)
            else:
                self.records.pop(key, None)
                self.foreign.add(key)
            try:
                new = dra.held(record, memory_of)
            except errors.InvalidInputError as exc:
                invalid = str(exc)
        old = self.held.pop(key, None)
        if new is not None:
            self.held[key] = new
        elif old is not None and kind != wire.EventType.DELETED:
            self.cleared[key] = old.node
        writing = key in self.assumed
        if kind == wire.EventType.DELETED and writing:
            return Observed(key, old, new, forget=True, invalid=invalid)
        if new is not None and writing:
            del self.assumed[key]  # the watch shows it: the ledger's entry becomes the API's
        elif new is None and writing:
            return Observed(key, old, new, as_decided=True, invalid=invalid)
        return Observed(key, old, new, invalid=invalid)
