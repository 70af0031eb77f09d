"""The ledger: every allocation the cluster holds, and the only writer of `FleetState`.

Its life cycle follows kube-scheduler's cache: a decision is *assumed* at once (so the next decision
sees it), then either *added* when the API server confirms the binding, or *forgotten* when binding
fails. Confirmed allocations are *removed* when the pod goes. Every call answers with a
`status.Status`.

A decision never over-commits a GPU, whatever the order of calls: `assume` refuses an allocation
that would exceed a GPU's free compute or memory, break its tenants' co-tenancy rules or land on a
blocked GPU, and leaves the state untouched (unless forced: a decision taken before the inventory
shrank, whose binding may still land, is counted as a fact is). A fact is never refused: `add` and `load` record what
the API server shows, and the API server is the truth. When a bound pod does not fit (a fault let a
second decision through, or another scheduler wrote the binding), it is counted all the same, the
answer is a Conflict that says why, and every GPU of its node whose tenants no longer fit together
is *over-committed*: blocked in the fleet state (no new tenant, so nothing more lands there) and
listed by `overcommitted` until its tenants fit again (one leaves), which each change on the node
re-checks. Leaving the pod out instead would make the books show room the GPU does not have, and
the next decision would fill it.

Assumed entries carry the time they were assumed (from the injected clock, or given: an owner that
builds a new ledger keeps its decisions' ages) so an owner can expire ones whose confirmation never
came (`assumed_before`).

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


@dataclass(frozen=True, slots=True)
class Overcommit:
    """A GPU whose tenants, as the ledger holds them, do not fit on it together."""

    node: units.NodeName
    index: int
    pods: tuple[units.PodKey, ...]
    """Every tenant, in the order the ledger took them in (the last ones are those that did not fit)."""
    milli_used: int
    milli_capacity: int
    memory_used: int
    memory_capacity: int
    problems: tuple[str, ...]
    """What breaks, tenant by tenant as they were taken in."""

    @property
    def where(self) -> str:
        return f"{self.node}/gpu{self.index}"


class Ledger:
    def __init__(self, state: fleet.FleetState, clock: Clock | None = None) -> None:
        self.state = state
        self._clock: Clock = clock or (lambda: 0.0)
        self._entries: dict[units.PodKey, Entry] = {}
        self._flagged: dict[int, set[units.PodKey]] = {}
        """Rows with an over-committed GPU -> the pods on that node (kept only for those rows)."""
        self._problems: dict[tuple[int, int], tuple[str, ...]] = {}
        """(row, GPU index) -> why it is over-committed."""

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

    def assume(self, alloc: allocation.Allocation, *, since: float | None = None, force: bool = False) -> status.Status:
        """Record a decision before it is bound. Refused if the pod is known or it would over-commit,
        unless `force`: a decision taken earlier whose write may land (a rebuild re-applying it after
        the inventory shrank) is counted like a fact as long as its node and GPUs exist, its GPUs
        over-committed if it does not fit. `since`: when the decision was taken (default: now), from
        which it expires (`assumed_before`)."""
        if alloc.pod in self._entries:
            return status.conflict(f"pod {alloc.pod} is already {self._entries[alloc.pod].phase.value.lower()}")
        return self._insert(alloc, Phase.ASSUMED, force=force, since=since)

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
        is replaced by the API's version (the API server is the truth). An unknown pod is added. A pod
        that does not fit is added all the same, with a Conflict that says why; the GPUs its node can
        no longer hold together are over-committed from then on (see the module docstring).
        """
        entry = self._entries.get(alloc.pod)
        if entry is not None:
            if entry.alloc == alloc:
                if entry.phase is Phase.ADDED:
                    return status.SUCCESS
                self._entries[alloc.pod] = Entry(alloc, Phase.ADDED, entry.since)
                return status.SUCCESS
            self._drop(alloc.pod, entry)
        return self._insert(alloc, Phase.ADDED, force=True)

    def load(self, allocs: Sequence[allocation.Allocation]) -> list[status.Status]:
        """Confirm many allocations at once (a rebuild after a restart): the same outcome as `add`
        for each in order, much faster. When they all fit together, the ones without co-tenancy
        rules are applied in one vectorised step and the others added one by one; if anything at
        all does not fit, everything is undone and `add` runs in order, which counts the pods that do
        not fit and flags their GPUs exactly as sequential adds would."""
        if not allocs:
            return []
        state = self.state
        fresh = len({a.pod for a in allocs}) == len(allocs) and not any(a.pod in self._entries for a in allocs)
        # Claims (counted in `claimed` too, which the vectorised step does not touch) go by `add`.
        simple = [a for a in allocs if a.cotenancy.empty and not a.device_claim and a.node in state.row_of]
        if not fresh or not simple or self._flagged:  # over-committed nodes re-check each pod they take in
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
            for row in self._flagged:  # none was flagged before this call
                state.blocked[row] = False
            self._flagged.clear()
            self._problems.clear()
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

    def overcommitted(self) -> list[Overcommit]:
        """Every over-committed GPU, by node and index."""
        state = self.state
        found = []
        for (row, index), problems in sorted(self._problems.items()):
            node = state.names[row]
            tenants = sorted(
                (self._entries[k] for k in self._flagged[row] if index in self._entries[k].alloc.gpu_usage()),
                key=lambda e: (e.since, e.alloc.pod),
            )
            found.append(
                Overcommit(
                    node=node,
                    index=index,
                    pods=tuple(e.alloc.pod for e in tenants),
                    milli_used=int(state.milli_capacity[row, index] - state.milli_free[row, index]),
                    milli_capacity=int(state.milli_capacity[row, index]),
                    memory_used=int(state.gmem_capacity[row, index] - state.gmem_free[row, index]),
                    memory_capacity=int(state.gmem_capacity[row, index]),
                    problems=problems,
                )
            )
        return found

    def assumed_before(self, ttl_seconds: float) -> list[units.PodKey]:
        """Assumptions at least `ttl_seconds` old that were never confirmed. Only a query: the owner
        decides (the extender first asks the API whether the binding happened after all)."""
        now = self._clock()
        return [pod for pod, e in self._entries.items() if e.phase is Phase.ASSUMED and now - e.since >= ttl_seconds]

    # ----------------------------------------------------------------- internals

    def _insert(
        self, alloc: allocation.Allocation, phase: Phase, *, force: bool = False, since: float | None = None
    ) -> status.Status:
        """Take `alloc` in if it fits; with `force` (a fact from the API server) also when it does not,
        as long as its node and GPUs exist, and then re-check which GPUs of the node are over-committed."""
        state = self.state
        problems = state.problems(alloc)
        if problems and (not force or not _countable(state, alloc)):
            return status.conflict(
                f"pod {alloc.pod} does not fit on {alloc.node}: " + "; ".join(text for _, text in problems)
            )
        state.apply(alloc, +1)
        self._entries[alloc.pod] = Entry(alloc, phase, self._clock() if since is None else since)
        row = state.row_of[alloc.node]
        if problems and any(index is not None for index, _ in problems) and row not in self._flagged:
            self._flagged[row] = {k for k, e in self._entries.items() if e.alloc.node == alloc.node}
        elif row in self._flagged:
            self._flagged[row].add(alloc.pod)
        if row in self._flagged:
            self._recheck(row)
        if problems:
            return status.conflict(
                f"pod {alloc.pod} is bound to {alloc.node} but does not fit there; counted all the same: "
                + "; ".join(text for _, text in problems)
            )
        return status.SUCCESS

    def _drop(self, pod: units.PodKey, entry: Entry) -> None:
        self.state.apply(entry.alloc, -1)
        del self._entries[pod]
        row = self.state.row_of[entry.alloc.node]
        if row in self._flagged:
            self._flagged[row].discard(pod)
            self._recheck(row)

    def _recheck(self, row: int) -> None:
        """Which GPUs of node `row` are over-committed: its pods taken in again one by one on an empty
        copy of the node, oldest first; a GPU where one of them does not fit is. Blocks exactly those."""
        state = self.state
        scratch = fleet.FleetState([state.inventories[row]])
        broken: dict[int, list[str]] = {}
        tenants = sorted((self._entries[k] for k in self._flagged[row]), key=lambda e: (e.since, e.alloc.pod))
        for entry in tenants:
            for index, text in scratch.problems(entry.alloc):
                if index is not None:
                    broken.setdefault(index, []).append(f"pod {entry.alloc.pod}: {text}")
            scratch.apply(entry.alloc, +1)
        state.blocked[row] = False
        state.blocked[row, list(broken)] = True
        state.retag(row, (entry.alloc for entry in tenants))  # bumps the node's version
        for index in range(state.width):
            if index in broken:
                self._problems[(row, index)] = tuple(broken[index])
            else:
                self._problems.pop((row, index), None)
        if not broken:
            del self._flagged[row]


def _countable(state: fleet.FleetState, alloc: allocation.Allocation) -> bool:
    """Whether the state can hold `alloc` at all, fitting or not: its node and GPUs exist."""
    row = state.row_of.get(alloc.node)
    return row is not None and all(
        index < state.width and bool(state.present[row, index]) for index in alloc.gpu_usage()
    )
