"""The defragmenter's planner: the fewest safe moves that let pending GPU pods fit.

A pod can wait although the cluster has room for it in total: its share is spread over GPUs that
each have too little left (fragmentation, not shortage). Moving a few running pods elsewhere frees
a contiguous share. This module decides *which* pods, and nothing else: no I/O, no Kubernetes. The
controller (`controller.defrag`) evicts what it plans, through the Eviction API; the simulator
(`sim.replay`) applies it on virtual time.

A plan is **safe**, by construction and re-checked by a trial in the ledger:

- a victim is *movable* (something recreates it: in Kubernetes a controller owner; a pod without
  one is never planned), of a priority no higher than the pending pod's, confirmed in the ledger
  (not a decision still waiting for its binding), and moved at most once per plan;
- every disruption group a victim belongs to (a PodDisruptionBudget) allows one more disruption,
  and the plan as a whole stays within the evictions allowed (the hourly budget);
- the trial removes the victims, places the pending pod on the chosen node, then re-places every
  victim with the placer on what is left; if any victim has nowhere to go, the move is not planned
  (otherwise defragmenting would be preemption);
- a pod is planned for only when the free GPU compute of the models it may use adds up to its demand
  (otherwise no move can help: that is shortage), and no node takes it as things stand.

Minimal: for each node, the cheapest way to make enough of its GPUs eligible (a whole GPU: all of
its tenants; a share: the smallest set of its tenants whose shares free enough, fewest pods first,
then the least compute moved); across nodes, the fewest evictions, then the least compute moved,
then the placer's node priority. Pending pods are taken highest priority first, and each move is
kept in the ledger while the next pod is planned, so later moves see earlier ones.

`plan` works in the caller's ledger and placer and leaves the ledger as it found it: every trial
change is undone, in reverse order, so the same allocations are there in the same phases (a victim
tried and put back carries the clock's time as its `since`). Like the ledger it is not thread-safe.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from sharegpu.core import allocation, fit, fleet, requests, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer

MAX_VICTIMS_PER_GPU = 4
"""Most tenants of one GPU considered together to make room on it (tenants beyond the smallest
`MAX_TENANTS_PER_GPU` are not tried)."""
MAX_TENANTS_PER_GPU = 8
MAX_TRIALS = 16
"""Candidate moves tried in the ledger per pending pod, cheapest first."""

Usable = Callable[[units.PodKey, core_ledger.Entry], bool]
"""Whether a running pod may be a victim for the pod being planned."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """What the planner knows of a running pod besides its allocation."""

    request: requests.PodRequest
    """Its request, to place it again elsewhere."""
    movable: bool
    """Something recreates it when it is evicted (a controller owner). False: never a victim."""
    priority: int = 0
    groups: tuple[str, ...] = ()
    """The disruption groups (PodDisruptionBudgets) that cover it."""
    owner: str = ""
    """Who recreates it, for people (e.g. `ReplicaSet/web-5d8`)."""
    nodes: frozenset[str] | None = None
    """The nodes its own constraints (nodeSelector, node affinity, taints) let it run on; None: any."""


@dataclass(frozen=True, slots=True)
class Pending:
    request: requests.PodRequest
    priority: int = 0
    nodes: frozenset[str] | None = None
    """The nodes its own constraints (nodeSelector, node affinity, taints) let it run on; None: any."""


@dataclass(frozen=True, slots=True)
class Limits:
    evictions: int
    """Evictions allowed now (what is left of the hourly budget)."""
    disruptions: Mapping[str, int] = field(default_factory=dict)
    """Per disruption group, the disruptions it allows now; a group not listed allows none."""


@dataclass(frozen=True, slots=True)
class Victim:
    pod: units.PodKey
    before: allocation.Allocation
    after: allocation.Allocation
    """Where the trial re-placed it (the real scheduler decides again when it is recreated)."""
    owner: str = ""

    @property
    def milli(self) -> int:
        return self.before.gpu_milli_total


@dataclass(frozen=True, slots=True)
class Move:
    """One pending pod made to fit: where it goes, and who moves out of its way."""

    pod: units.PodKey
    placed: allocation.Allocation
    victims: tuple[Victim, ...]

    @property
    def gain_milli(self) -> int:
        return self.placed.gpu_milli_total


class Why(enum.Enum):
    """Why no move was planned for a pending pod."""

    FITS = "fits"
    """It fits as things stand; the scheduler will place it."""
    SHORTAGE = "shortage"
    """The free compute of the GPUs it may use adds up to less than it asks: no move can help."""
    BUDGET = "budget"
    """The evictions allowed now are used up."""
    NO_SAFE_MOVE = "no-safe-move"
    """No allowed set of victims frees room on any node with every victim placed again."""


@dataclass(frozen=True, slots=True)
class Skip:
    pod: units.PodKey
    why: Why
    detail: str


@dataclass(frozen=True, slots=True)
class Plan:
    moves: tuple[Move, ...] = ()
    skipped: tuple[Skip, ...] = ()

    @property
    def evictions(self) -> int:
        return sum(len(m.victims) for m in self.moves)

    @property
    def gain_milli(self) -> int:
        """GPU compute of the pending pods the moves let in."""
        return sum(m.gain_milli for m in self.moves)


@dataclass(frozen=True, slots=True)
class _Candidate:
    cost: tuple[int, int, int]
    """(victims, compute moved, node priority rank)."""
    row: int
    victims: tuple[units.PodKey, ...]


_Memo = dict[tuple[requests.GpuDemand, int, int], tuple[int, "_Candidate | None"]]
"""(demand, pending pod's priority, row) -> (the row's version, its candidate) within one plan: a
node that did not change is not searched again for the next pending pod of the same demand."""


class _Trial:
    """The ledger changes of a plan, undone in reverse order at the end, and which pods are on each
    node meanwhile (indexed once per plan, then kept up to date by the changes themselves)."""

    def __init__(self, ledger: core_ledger.Ledger) -> None:
        self.ledger = ledger
        self.undo: list[tuple[str, allocation.Allocation]] = []
        self.on_row: dict[int, dict[units.PodKey, None]] = {}
        """Row -> its pods, in the ledger's order (a dict, not a set: ties between victims are broken
        the same way on every run)."""
        for key, entry in ledger.entries():
            self._index(entry.alloc, key, add=True)

    def _index(self, alloc: allocation.Allocation, key: units.PodKey, add: bool) -> None:
        row = self.ledger.state.row_of.get(alloc.node)
        if row is None:
            return
        if add:
            self.on_row.setdefault(row, {})[key] = None
        else:
            self.on_row[row].pop(key, None)

    def remove(self, alloc: allocation.Allocation) -> None:
        result = self.ledger.remove(alloc.pod)
        assert result.ok, result
        self._index(alloc, alloc.pod, add=False)
        self.undo.append(("removed", alloc))

    def assume(self, alloc: allocation.Allocation) -> bool:
        if not self.ledger.assume(alloc).ok:
            return False
        self._index(alloc, alloc.pod, add=True)
        self.undo.append(("assumed", alloc))
        return True

    def mark(self) -> int:
        return len(self.undo)

    def rollback(self, to: int = 0) -> None:
        while len(self.undo) > to:
            what, alloc = self.undo.pop()
            if what == "assumed":
                result = self.ledger.forget(alloc.pod)
                assert result.ok, result
            else:  # put back as it was: on a GPU over-committed already it comes back with a Conflict
                self.ledger.add(alloc)
            self._index(alloc, alloc.pod, add=what == "removed")

    def tenants(self, row: int) -> dict[int, list[core_ledger.Entry]]:
        """GPU index -> the ledger entries of the pods using it, on node `row`."""
        on: dict[int, list[core_ledger.Entry]] = {}
        for key in self.on_row.get(row, ()):
            entry = self.ledger.get(key)
            assert entry is not None, key
            for index in entry.alloc.gpu_usage():
                on.setdefault(index, []).append(entry)
        return on


def plan(
    ledger: core_ledger.Ledger,
    placer: core_placer.Placer,
    tenants: Mapping[units.PodKey, Tenant],
    pending: Sequence[Pending],
    limits: Limits,
) -> Plan:
    """The moves that let `pending` pods fit (see the module docstring). `placer` must place on
    `ledger`'s state; the ledger is left as it was found."""
    trial = _Trial(ledger)
    budget = limits.evictions
    allowed = Counter({group: max(0, n) for group, n in limits.disruptions.items()})
    moved: set[units.PodKey] = set()
    moves: list[Move] = []
    skipped: list[Skip] = []
    memo: _Memo = {}
    try:
        for item in sorted(pending, key=lambda p: -p.priority):
            request = item.request
            demand = request.demand
            rows = _rows(ledger.state, item.nodes)
            decision = placer.decide(demand, None if item.nodes is None else rows)
            if decision.status.ok:
                # The scheduler will place it here; later pods are planned around it.
                trial.assume(placer.allocation_for(request, decision))
                skipped.append(Skip(request.key, Why.FITS, f"fits on {decision.node} as things stand"))
                continue
            short = _shortage(ledger.state, demand, rows)
            if short is not None:
                skipped.append(Skip(request.key, Why.SHORTAGE, short))
                continue
            if budget <= 0:
                skipped.append(Skip(request.key, Why.BUDGET, "the evictions allowed now are used up"))
                continue

            def usable(key: units.PodKey, entry: core_ledger.Entry, priority: int = item.priority) -> bool:
                tenant = tenants.get(key)
                return (
                    tenant is not None
                    and tenant.movable
                    and tenant.priority <= priority
                    and entry.phase is core_ledger.Phase.ADDED
                    and key not in moved
                    and all(allowed[g] > 0 for g in tenant.groups)
                    and bool(entry.alloc.gpu_usage())
                )

            candidates = _candidates(trial, placer, demand, usable, rows, MAX_TRIALS, memo, item.priority)
            move = None
            for candidate in candidates:
                victims = [tenants[k] for k in candidate.victims]
                needs = Counter(g for t in victims for g in t.groups)
                if len(victims) > budget or any(allowed[g] < n for g, n in needs.items()):
                    continue
                move = _try(ledger, placer, trial, request, candidate, tenants)
                if move is not None:
                    budget -= len(victims)
                    allowed.subtract(needs)
                    if needs:  # tenants of these groups anywhere may no longer be victims
                        memo.clear()
                    moved.update(candidate.victims)
                    moved.add(request.key)
                    break
            if move is None:
                detail = (
                    f"no node can be cleared for it by moving at most {MAX_VICTIMS_PER_GPU} movable pod(s) per GPU "
                    f"that may be disrupted and fit elsewhere ({len(candidates)} candidate move(s) tried)"
                )
                skipped.append(Skip(request.key, Why.NO_SAFE_MOVE, detail))
                continue
            moves.append(move)
    finally:
        trial.rollback()
    return Plan(tuple(moves), tuple(skipped))


def _rows(state: fleet.FleetState, nodes: frozenset[str] | None) -> fleet.IntArray:
    """The rows of `nodes` (every row for None), in row order."""
    if nodes is None:
        return np.arange(len(state), dtype=np.int64)
    found = sorted(row for name in nodes if (row := state.row(name)) is not None)
    return np.array(found, dtype=np.int64)


def _shortage(state: fleet.FleetState, demand: requests.GpuDemand, rows: fleet.IntArray) -> str | None:
    """Why no move can help, or None: no node the pod may run on (`rows`), or less free compute in
    total on the GPUs it may use (on any node: victims may move anywhere) than it asks."""
    if demand.count == 0:
        return "it asks for no GPU"
    if not len(rows):
        return "no node its nodeSelector, node affinity and tolerations allow has GPUs sharegpu manages"
    every = np.arange(len(state), dtype=np.int64)
    usable = state.present & state.healthy & fit.model_mask(state, demand, every)
    usable &= fit.isolation_mask(state, demand, every)[:, None]
    big_enough = state.gpu_count >= demand.count
    free = int(state.milli_free[usable & big_enough[:, None]].sum())
    need = demand.gpu_milli_total
    if free < need:
        return f"{free} milli-GPU free in total on the GPUs it may use, it asks for {need}"
    return None


def _candidates(
    trial: _Trial,
    placer: core_placer.Placer,
    demand: requests.GpuDemand,
    usable: Usable,
    allowed: fleet.IntArray,
    limit: int,
    memo: _Memo,
    priority_of_pod: int,
) -> list[_Candidate]:
    """The `limit` cheapest candidates: per node of `allowed` rows the cheapest victims that make it
    fit (capacity only; the trial checks the rest), cheapest node first (then the lower row).

    Finding a node's victims is work per tenant, so nodes are visited from the lowest bound on their
    cost, computed for every node at once: the compute its `count` GPUs lacking least lack must be
    moved. Once the next node's bound is above the `limit`-th cheapest found, no node left can be
    among them. (One victim may span several GPUs, so the bound on victims is only "one, if any GPU
    lacks room".)"""
    state = trial.ledger.state
    rows = np.arange(len(state), dtype=np.int64)
    static = state.present & state.healthy & fit.model_mask(state, demand, rows)
    static &= fit.isolation_mask(state, demand, rows)[:, None]
    need_memory = state.memory_need(demand, rows)
    permitted = np.zeros(len(state), dtype=np.bool_)
    permitted[allowed] = True
    visit = np.flatnonzero((static.sum(axis=1) >= demand.count) & permitted)
    if demand.whole:
        lacking = state.milli_capacity[visit] - state.milli_free[visit]
    else:
        lacking = np.maximum(demand.milli - state.milli_free[visit], 0)
    lacking = np.where(static[visit], lacking, np.iinfo(np.int64).max // (state.width + 1))
    cheapest: fleet.IntArray = np.sort(np.asarray(lacking, dtype=np.int64), axis=1)[:, : demand.count]
    bound_victims = np.asarray((cheapest > 0).any(axis=1), dtype=np.int64)
    bound_moved: fleet.IntArray = np.sum(cheapest, axis=1, dtype=np.int64)
    priority = placer.priority[visit]
    order = np.lexsort((visit, priority, bound_moved, bound_victims))
    found: list[_Candidate] = []
    for at in order.tolist():
        row = int(visit[at])
        if len(found) >= limit:
            bound = ((int(bound_victims[at]), int(bound_moved[at]), int(priority[at])), row)
            if bound > _rank(found[limit - 1]):
                break
        version = int(state.version[row])
        known = memo.get((demand, priority_of_pod, row))
        if known is not None and known[0] == version:
            candidate = known[1]
        else:
            candidate = _node_candidate(trial, placer, demand, usable, row, static[row], need_memory[row])
            memo[demand, priority_of_pod, row] = (version, candidate)
        if candidate is not None:
            bisect.insort(found, candidate, key=_rank)
    return found[:limit]


def _rank(candidate: _Candidate) -> tuple[tuple[int, int, int], int]:
    """The order candidates are tried in: cheapest first, then the lower row."""
    return candidate.cost, candidate.row


def _node_candidate(
    trial: _Trial,
    placer: core_placer.Placer,
    demand: requests.GpuDemand,
    usable: Usable,
    row: int,
    static: fleet.BoolArray,
    need_memory: fleet.IntArray,
) -> _Candidate | None:
    """The cheapest victims on node `row` that make it fit the demand, or None if none can."""
    state = trial.ledger.state
    on = trial.tenants(row)
    options: list[tuple[int, int, tuple[core_ledger.Entry, ...]]] = []
    for index in np.flatnonzero(static).tolist():
        chosen = _clear(state, demand, row, index, on.get(index, []), int(need_memory[index]), usable)
        if chosen is not None:
            options.append((len(chosen), sum(e.alloc.gpu_milli_total for e in chosen), chosen))
    if len(options) < demand.count:
        return None
    options.sort(key=lambda o: (o[0], o[1]))
    victims: dict[units.PodKey, core_ledger.Entry] = {}
    for _, _, chosen in options[: demand.count]:
        victims.update((e.alloc.pod, e) for e in chosen)
    if not victims:
        return None  # it fits by capacity already; something else (co-tenancy) keeps it off
    cpu = int(state.cpu_free[row]) + sum(e.alloc.cpu_milli for e in victims.values())
    mem = int(state.mem_free[row]) + sum(e.alloc.memory_mib for e in victims.values())
    if cpu < demand.cpu_milli or mem < demand.host_memory_mib:
        return None
    moved = sum(e.alloc.gpu_milli_total for e in victims.values())
    return _Candidate((len(victims), moved, int(placer.priority[row])), row, tuple(sorted(victims)))


def _clear(
    state: fleet.FleetState,
    demand: requests.GpuDemand,
    row: int,
    index: int,
    entries: list[core_ledger.Entry],
    need_memory: int,
    usable: Usable,
) -> tuple[core_ledger.Entry, ...] | None:
    """The fewest tenants of one GPU (then the least compute) whose leaving makes it able to host
    one unit of `demand`; () if it can already; None if no allowed set can."""
    free = int(state.milli_free[row, index])
    gmem = int(state.gmem_free[row, index])
    if demand.whole:
        if not entries:
            return () if free == state.milli_capacity[row, index] else None
        if len(entries) > MAX_VICTIMS_PER_GPU or not all(usable(e.alloc.pod, e) for e in entries):
            return None
        return tuple(entries)
    if free >= demand.milli and gmem >= need_memory:
        return ()
    movable = sorted((e for e in entries if usable(e.alloc.pod, e)), key=lambda e: e.alloc.gpu_usage()[index][0])
    movable = movable[:MAX_TENANTS_PER_GPU]
    for size in range(1, min(MAX_VICTIMS_PER_GPU, len(movable)) + 1):
        best: tuple[int, tuple[core_ledger.Entry, ...]] | None = None
        for combo in itertools.combinations(movable, size):
            milli = sum(e.alloc.gpu_usage()[index][0] for e in combo)
            memory = sum(e.alloc.gpu_usage()[index][1] for e in combo)
            if free + milli >= demand.milli and gmem + memory >= need_memory and (best is None or milli < best[0]):
                best = (milli, combo)
        if best is not None:
            return best[1]
    return None


def _try(
    ledger: core_ledger.Ledger,
    placer: core_placer.Placer,
    trial: _Trial,
    request: requests.PodRequest,
    candidate: _Candidate,
    tenants: Mapping[units.PodKey, Tenant],
) -> Move | None:
    """Remove the victims, place the pod on the candidate's node, place every victim again; the
    move if all of that works (kept in the ledger), else None (undone)."""
    start = trial.mark()
    before = []
    for key in candidate.victims:
        entry = ledger.get(key)
        assert entry is not None
        before.append(entry.alloc)
        trial.remove(entry.alloc)
    decision = placer.decide(request.demand, np.array([candidate.row], dtype=np.int64))
    placed = placer.allocation_for(request, decision) if decision.status.ok else None
    if placed is None or not trial.assume(placed):
        trial.rollback(start)
        return None
    victims = []
    for alloc in sorted(before, key=lambda a: (-a.gpu_milli_total, a.pod)):
        tenant = tenants[alloc.pod]
        again = placer.decide(
            tenant.request.demand, None if tenant.nodes is None else _rows(ledger.state, tenant.nodes)
        )
        after = placer.allocation_for(tenant.request, again) if again.status.ok else None
        if after is None or not trial.assume(after):
            trial.rollback(start)
            return None
        victims.append(Victim(alloc.pod, alloc, after, tenant.owner))
    return Move(request.key, placed, tuple(victims))
