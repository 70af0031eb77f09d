"""Gang placement: the members of a group placed together, all or nothing, by the one placer.

`plan` answers where every waiting member of a gang goes, or that the gang does not fit now. It tries
the members on a copy of nothing: it assumes them in the ledger one by one (so each sees the ones
before it) and forgets them all again before it returns, so the ledger is as it was; the caller
assumes the plan's allocations for real (they fit: nothing changed in between).

Order and shape:
- members largest first (GPUs x compute, then memory), so the hardest fit is tried while the room
  is widest;
- each member goes first to the nodes the gang already uses in this plan (the placer's policy
  chooses among them); when none has room, a new node is opened: among the nodes of the domain that
  fit it, one with room for the most of the members still to place (the policy chooses among those).
  A gang so spreads over few nodes, which keeps its collective traffic inside a node where it can;
- within a node, a member of whole GPUs takes the GPUs best linked to the gang's GPUs already there
  (NVLink, then one PCIe switch, then one NUMA node), the first one on a node those with the most
  NVLink companions free for the members still to come (`beside`, which the DRA allocator uses
  too); the policy's own choice stands unless another is strictly better connected;
- a *domain* is a set of nodes the whole gang must stay within (the nodes with one value of the
  gang's topology label: a rack, a zone). Domains are tried tightest first (least free compute that
  can still hold the gang), the first where every member fits wins; else the one where most fit.

Members that must keep apart (kube-scheduler's required pod anti-affinity between pods of one
template: one worker per node, per rack) are never planned into one value of the topology they name
(`Apart`), nor into a value where such a member of the gang runs already: kube-scheduler would turn
the second one away at its filter, and the same plan would be made again at every try.

The plan succeeds when at least `need` members fit; the members that did not fit (beyond the
minimum) are named in `left` and hold nothing.

`largest_first` and `pack` off give the all-or-nothing of the gang schedulers the simulator compares
(Volcano's and KAI's gang plugins: members in their own order, each placed by the per-pod policy alone).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sharegpu.core import allocation, devices, fit, fleet, requests, status, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer

MAX_DOMAINS = 32
"""Domains tried per plan (tightest first): a bound on a plan's cost on a cluster of many racks."""
MAX_GPU_SETS = 512
"""GPU sets weighed for one member within a node (beyond it, the policy's choice stands)."""


@dataclass(frozen=True, slots=True)
class Domain:
    """Nodes a gang must stay within: one value of its topology label ("" for the whole cluster)."""

    name: str
    rows: fleet.IntArray


@dataclass(frozen=True, slots=True)
class Apart:
    """Which members keep apart from each other, and where: `keys` names, per member, the topologies
    (node label keys) in which no two of them may share a value; `values` gives each topology's value
    id per row (a row without the label has an id of its own); `taken` the ids where members that
    keep apart in it run already."""

    keys: Mapping[units.PodKey, tuple[str, ...]]
    values: Mapping[str, fleet.IntArray]
    taken: Mapping[str, frozenset[int]] = dataclasses.field(default_factory=dict)

    def allowed(self, member: units.PodKey, rows: fleet.IntArray, used: Mapping[str, set[int]]) -> fleet.IntArray:
        """`rows` with those dropped where the member would share a topology value with another
        member that keeps apart in it (`used`: the ids this plan has given such members)."""
        for key in self.keys.get(member, ()):
            blocked = used.get(key, set()) | self.taken.get(key, frozenset())
            if blocked:
                rows = rows[~np.isin(self.values[key][rows], np.fromiter(blocked, dtype=np.int64))]
        return rows

    def mark(self, member: units.PodKey, row: int, used: dict[str, set[int]]) -> None:
        for key in self.keys.get(member, ()):
            used.setdefault(key, set()).add(int(self.values[key][row]))


NOBODY_APART = Apart({}, {})


@dataclass(frozen=True, slots=True)
class Plan:
    status: status.Status
    allocations: tuple[allocation.Allocation, ...] = ()
    domain: str = ""
    left: tuple[units.PodKey, ...] = ()
    """Members that did not fit (the plan succeeded with the others)."""

    @property
    def nodes(self) -> int:
        """How many nodes the plan spreads the gang over."""
        return len({a.node for a in self.allocations})


def _size(member: requests.PodRequest) -> tuple[int, int, str]:
    demand = member.demand
    return (-demand.count * demand.milli, -demand.count * demand.memory_mib, member.key)


def plan(
    ledger: core_ledger.Ledger,
    placer: core_placer.Placer,
    members: Sequence[requests.PodRequest],
    need: int,
    domains: Sequence[Domain] | None = None,
    *,
    largest_first: bool = True,
    pack: bool = True,
    apart: Apart = NOBODY_APART,
) -> Plan:
    """Where `members` go together (at least `need` of them), within one of `domains` (default: all
    nodes), those named in `apart` kept apart. The ledger is left as it was."""
    if need > len(members):
        return Plan(status.unschedulable(f"{len(members)} member(s) wait, the gang needs {need} placed together"))
    state = ledger.state
    ordered = sorted(members, key=_size) if largest_first else list(members)
    candidates = _tightest(state, list(domains) if domains is not None else [Domain("", np.arange(len(state)))],
                           sorted(members, key=_size)[-need:] if need else [])  # fmt: skip
    best: Plan | None = None
    for domain in candidates[:MAX_DOMAINS]:
        found = _try(ledger, placer, ordered, domain, pack, apart)
        if len(found.allocations) >= need and (best is None or len(found.allocations) > len(best.allocations)):
            best = found
            if not found.left:
                break
    if best is None:
        named = domains is not None and any(d.name for d in domains)
        where = f"any of {len(candidates)} domain(s)" if named else "the nodes they may use"
        return Plan(status.unschedulable(f"fewer than {need} of {len(members)} member(s) fit together in {where}"))
    return best


def _tightest(state: fleet.FleetState, domains: list[Domain], smallest: Sequence[requests.PodRequest]) -> list[Domain]:
    """Domains that can hold the `smallest` members' compute, least free compute first."""
    needed = sum(m.demand.count * m.demand.milli for m in smallest)
    free = state.milli_free * state.present * state.healthy
    ranked = []
    for domain in domains:
        room = int(free[domain.rows].sum()) if len(domain.rows) else 0
        if room >= needed:
            ranked.append((room, domain.name, domain))
    ranked.sort(key=lambda item: (item[0], item[1]))
    return [domain for _, _, domain in ranked]


def _roomiest(
    placer: core_placer.Placer, demand: requests.GpuDemand, rows: fleet.IntArray, wanted: int
) -> fleet.IntArray:
    """The rows that fit `demand` with room for the most of `wanted` such members (all of `rows` when
    none fits: the placer then says why)."""
    feasible = rows[placer.evaluate(demand, rows).feasible]
    if not len(feasible) or not demand.count:
        return feasible if len(feasible) else rows
    state = placer.state
    usable = state.present[feasible] & state.healthy[feasible] & ~state.blocked[feasible] & (state.held[feasible] == 0)
    slots = state.milli_free[feasible] // max(1, demand.milli)
    need = state.memory_need(demand, feasible)
    slots = np.where(need > 0, np.minimum(slots, state.gmem_free[feasible] // np.maximum(need, 1)), slots)
    room = np.minimum((np.where(usable, slots, 0).sum(axis=1)) // demand.count, wanted)
    best: fleet.IntArray = feasible[room == room.max()]
    return best


def _try(
    ledger: core_ledger.Ledger,
    placer: core_placer.Placer,
    ordered: Sequence[requests.PodRequest],
    domain: Domain,
    pack: bool = True,
    apart: Apart = NOBODY_APART,
) -> Plan:
    """Every member that fits within `domain`, assumed one after another, then all forgotten again."""
    placed: list[allocation.Allocation] = []
    left: list[units.PodKey] = []
    used: list[int] = []
    held: dict[int, tuple[int, ...]] = {}
    """Row -> the GPUs the gang holds there in this plan."""
    kept_apart: dict[str, set[int]] = {}
    try:
        for position, member in enumerate(ordered):
            near = apart.allowed(member.key, np.array(used, dtype=np.int64), kept_apart)
            decision = placer.decide(member.demand, near) if len(near) and pack else None
            if decision is None or not decision.status.ok:
                rows = apart.allowed(member.key, domain.rows, kept_apart)
                if not len(rows):
                    left.append(member.key)
                    continue
                rows = _roomiest(placer, member.demand, rows, len(ordered) - position) if pack else rows
                decision = placer.decide(member.demand, rows)
            if not decision.status.ok:
                left.append(member.key)
                continue
            if pack and member.demand.whole:
                later = len(ordered) - position - 1
                decision = beside(placer.state, member.demand, decision, held.get(decision.row, ()), later)
            alloc = placer.allocation_for(member, decision)
            if not ledger.assume(alloc).ok:
                left.append(member.key)
                continue
            placed.append(alloc)
            apart.mark(member.key, decision.row, kept_apart)
            held[decision.row] = (*held.get(decision.row, ()), *decision.gpus)
            if decision.row not in used:
                used.append(decision.row)
    finally:
        for alloc in placed:
            ledger.forget(alloc.pod)
    return Plan(status.SUCCESS, tuple(placed), domain.name, tuple(left))


def beside(
    state: fleet.FleetState, demand: requests.GpuDemand, decision: core_placer.Decision, anchor: tuple[int, ...],
    later: int,
) -> core_placer.Decision:  # fmt: skip
    """The decision with the GPUs of its node best linked to the gang's `anchor` GPUs there (the
    weakest link, then the sum of links), then with the most NVLink companions free for the `later`
    members; the policy's choice unless another set is strictly better."""
    node = state.inventories[decision.row]
    if len(node.gpus) < 2 or (not anchor and not later):
        return decision
    candidates = np.flatnonzero(fit.eligible_gpus(state, demand, np.array([decision.row]))[0]).tolist()
    k = len(decision.gpus)
    if len(candidates) <= k or math.comb(len(candidates), k) > MAX_GPU_SETS:
        return decision

    def quality(chosen: tuple[int, ...]) -> tuple[int, int, int]:
        links = [node.link(a, b) for a in chosen for b in anchor] + [
            node.link(a, b) for a, b in itertools.combinations(chosen, 2)
        ]
        companions = (
            sum(
                1 for g in candidates if g not in chosen and all(node.link(g, c) is devices.Link.NVLINK for c in chosen)
            )
            if later
            else 0
        )
        return (min(links) if links else devices.Link.NVLINK, sum(links), min(companions, later))

    mine = tuple(sorted(decision.gpus))
    best = max(itertools.combinations(candidates, k), key=quality)
    if quality(best) <= quality(mine):
        return decision
    return dataclasses.replace(decision, gpus=best)
