"""The ledger: every allocation the cluster holds, and the only writer of `FleetState`.

Its life cycle follows kube-scheduler's cache: a decision is *assumed* at once (so the next decision
sees it), then either *added* when the API server confirms the binding, or *forgotten* when binding
fails. Confirmed allocations are *removed* when the pod goes. Every call answers with a
`status.Status`; none of them can over-commit a GPU, whatever the order of calls: an allocation that
would exceed a GPU's free compute or memory, or break its tenants' co-tenancy rules, is refused and
leaves the state untouched.

Assumed entries carry the time they were assumed (from the injected clock) so an owner can expire
ones whose confirmation never came (`assumed_before`).

Not thread-safe, and it need not be: every caller runs on one asyncio event loop (the extender) or
in one thread (the simulator), and no call awaits, so calls never interleave.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sharegpu.core import allocation, fleet, status, units

Clock = Callable[[], float]


class Phase(enum.Enum):
    ASSUMED = "Assumed"
    ADDED = "Added"


@dataclass(frozen=True, slots=True)
class Entry:
    alloc: allocation.Allocation
    phase: Phase
    since: float


class Ledger:
    def __init__(self, state: fleet.FleetState, clock: Clock | None = None) -> None:
        self.state = state
        self._clock: Clock = clock or (lambda: 0.0)
        self._entries: dict[units.PodKey, Entry] = {}

    # ----------------------------------------------------------------- queries

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, pod: object) -> bool:
        return pod in self._entries

    def get(self, pod: units.PodKey) -> Entry | None:
        return self._entries.get(pod)

    def entries(self) -> Iterator[tuple[units.PodKey, Entry]]:
        return iter(list(self._entries.items()))

    def allocations(self) -> list[allocation.Allocation]:
        return [entry.alloc for entry in self._entries.values()]

    # ----------------------------------------------------------------- life cycle

    def assume(self, alloc: allocation.Allocation) -> status.Status:
        """Record a decision before it is bound. Refused if the pod is known or it would over-commit."""
        if alloc.pod in self._entries:
            return status.conflict(f"pod {alloc.pod} is already {self._entries[alloc.pod].phase.value.lower()}")
        return self._insert(alloc, Phase.ASSUMED)

    def forget(self, pod: units.PodKey) -> status.Status:
        """Undo an assumption (binding failed). Only assumed pods can be forgotten, exactly once."""
        entry = self._entries.get(pod)
        if entry is None:
            return status.conflict(f"pod {pod} is not assumed")
        if entry.phase is not Phase.ASSUMED:
            return status.conflict(f"pod {pod} is already confirmed; remove it instead of forgetting it")
        self._drop(pod, entry)
        return status.SUCCESS

    def add(self, alloc: allocation.Allocation) -> status.Status:
        """Confirm an allocation seen on the API server.

        An assumed pod with the same allocation becomes Added. An assumed pod whose allocation differs
        is replaced by the API's version (the API server is the truth). An unknown pod is added if it
        fits; if it does not (the state disagrees with the API), nothing changes and a Conflict says why.
        """
        entry = self._entries.get(alloc.pod)
        if entry is not None:
            if entry.alloc == alloc:
                if entry.phase is Phase.ADDED:
                    return status.SUCCESS
                self._entries[alloc.pod] = Entry(alloc, Phase.ADDED, entry.since)
                return status.SUCCESS
            self._drop(alloc.pod, entry)
            result = self._insert(alloc, Phase.ADDED)
            if not result.ok:  # put the old entry back exactly as it was: a failed call changes nothing
                self.state.apply(entry.alloc, +1)
                self._entries[alloc.pod] = entry
            return result
        return self._insert(alloc, Phase.ADDED)

    def remove(self, pod: units.PodKey) -> status.Status:
        """The pod is gone (deleted or finished): release what it held."""
        entry = self._entries.get(pod)
        if entry is None:
            return status.conflict(f"pod {pod} is not in the ledger")
        self._drop(pod, entry)
        return status.SUCCESS

    def assumed_before(self, ttl_seconds: float) -> list[units.PodKey]:
        """Assumptions at least `ttl_seconds` old that were never confirmed. Only a query: the owner
        decides (the extender first asks the API whether the binding happened after all)."""
        now = self._clock()
        return [pod for pod, e in self._entries.items() if e.phase is Phase.ASSUMED and now - e.since >= ttl_seconds]

    # ----------------------------------------------------------------- internals

    def _insert(self, alloc: allocation.Allocation, phase: Phase) -> status.Status:
        problems = self.state.check(alloc)
        if problems:
            return status.conflict(f"pod {alloc.pod} does not fit on {alloc.node}: " + "; ".join(problems))
        self.state.apply(alloc, +1)
        self._entries[alloc.pod] = Entry(alloc, phase, self._clock())
        return status.SUCCESS

    def _drop(self, pod: units.PodKey, entry: Entry) -> None:
        self.state.apply(entry.alloc, -1)
        del self._entries[pod]
