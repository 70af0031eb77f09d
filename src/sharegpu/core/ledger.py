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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

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

    def load(self, allocs: Sequence[allocation.Allocation]) -> list[status.Status]:
        """Confirm many allocations at once (a rebuild after a restart): the same outcome as `add`
        for each in order, much faster. When they all fit together, the ones without co-tenancy
        rules are applied in one vectorised step and the others added one by one; if anything at
        all does not fit, everything is undone and `add` runs in order, which refuses exactly what
        sequential adds would."""
        if not allocs:
            return []
        state = self.state
        fresh = len({a.pod for a in allocs}) == len(allocs) and not any(a.pod in self._entries for a in allocs)
        simple = [a for a in allocs if a.cotenancy.empty and a.node in state.row_of]
        if not fresh or not simple:
            return [self.add(a) for a in allocs]
        before = self._snapshot()
        grants = self._bulk(simple, +1)
        if grants is not None and self._bulk_fits(*grants):
            now = self._clock()
            for alloc in simple:
                self._entries[alloc.pod] = Entry(alloc, Phase.ADDED, now)
            chosen = {a.pod for a in simple}
            rest = [self.add(a) for a in allocs if a.pod not in chosen]
            if all(r.ok for r in rest):
                return [status.SUCCESS] * len(allocs)
            for alloc in allocs:  # something did not fit: undo it all, then decide in order
                entry = self._entries.pop(alloc.pod, None)
                if entry is not None and alloc.pod not in chosen:
                    state.apply(entry.alloc, -1)
            self._bulk(simple, -1)
        elif grants is not None:
            self._bulk(simple, -1)
        self._restore(before)
        return [self.add(a) for a in allocs]

    def _snapshot(self) -> tuple[fleet.IntArray, list[dict[tuple[int, int], int]]]:
        return self.state.version.copy(), [dict(c) for c in self.state.node_shapes]

    def _restore(self, snapshot: tuple[fleet.IntArray, list[dict[tuple[int, int], int]]]) -> None:
        """Versions and shape counts as they were (a bulk step and its undo leave everything else equal)."""
        version, shapes = snapshot
        self.state.version[:] = version
        for counter, saved in zip(self.state.node_shapes, shapes, strict=True):
            counter.clear()
            counter.update(saved)

    def _bulk(self, allocs: Sequence[allocation.Allocation], sign: int) -> tuple[fleet.IntArray, ...] | None:
        """Apply rule-less allocations in one step; None (and nothing applied) if one names a GPU the
        fleet does not have. Returns the rows and GPU indices touched."""
        state = self.state
        rows, cpu, mem, grow, gidx, gmilli, gmem, gexcl = [], [], [], [], [], [], [], []
        for alloc in allocs:
            row = state.row_of[alloc.node]
            rows.append(row)
            cpu.append(alloc.cpu_milli)
            mem.append(alloc.memory_mib)
            usage = alloc.gpu_usage()
            if usage:
                shape = (max(m for m, _ in usage.values()), len(usage))
                counter = state.node_shapes[row]
                counter[shape] += sign
                if counter[shape] <= 0:
                    del counter[shape]
            for index, (milli, memory) in usage.items():
                grow.append(row)
                gidx.append(index)
                gmilli.append(milli)
                gmem.append(memory)
                gexcl.append(1 if alloc.exclusive else 0)
        r, i = np.array(grow, dtype=np.int64), np.array(gidx, dtype=np.int64)
        if len(i) and (i.max() >= state.width or not state.present[r, i].all()):
            return None
        at = np.array(rows, dtype=np.int64)
        np.subtract.at(state.cpu_free, at, sign * np.array(cpu, dtype=np.int64))
        np.subtract.at(state.mem_free, at, sign * np.array(mem, dtype=np.int64))
        np.add.at(state.version, at, 1)
        np.subtract.at(state.milli_free, (r, i), sign * np.array(gmilli, dtype=np.int64))
        np.subtract.at(state.gmem_free, (r, i), sign * np.array(gmem, dtype=np.int64))
        np.add.at(state.tenants, (r, i), sign)
        np.add.at(state.exclusive, (r, i), sign * np.array(gexcl, dtype=np.int64))
        return at, r, i

    def _bulk_fits(self, rows: fleet.IntArray, grow: fleet.IntArray, gidx: fleet.IntArray) -> bool:
        """Whether the state after a bulk step breaks nothing `add` would have refused."""
        s = self.state
        return bool(
            (s.cpu_free[rows] >= 0).all()
            and (s.mem_free[rows] >= 0).all()
            and (s.milli_free[grow, gidx] >= 0).all()
            and (s.gmem_free[grow, gidx] >= 0).all()
            and ((s.exclusive[grow, gidx] == 0) | (s.tenants[grow, gidx] == 1)).all()
            and (s.affinity_count[grow, gidx] == 0).all()
            and (s.group_tag[grow, gidx] == 0).all()
        )

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
