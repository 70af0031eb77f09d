"""Preemption GPU by GPU: which lower-priority tenants of a node must go for a pod to fit there.

kube-scheduler's own preemption cannot see GPU shares (sharegpu's resources are ignoredByScheduler),
so the extender works preemption out with the placement core. On one node (`on_node`): every
tenant that holds a GPU and has a lower priority than the pod is taken off a copy of the node; the
other tenants stay, and so do the node's blocked and held GPUs. If the pod does not fit even then,
preemption cannot help there. Otherwise the tenants are put back one by one, the most important
first (higher priority, then the older), and each one that would keep the pod out is taken off
again: those are the victims. It is kube-scheduler's own reprieve, over GPUs instead of node totals.
Tenants of lower priority already leaving (being deleted) count as gone and cost nothing: a pod
waits for them rather than preempting anything more (a pod of equal or lower priority waits for them
as any pod does, without a plan).

A tenant may bring *companions*: pods that must leave with it (the other running members of its gang,
on any node: a gang is preempted whole, never left partial). It is a candidate only when every
companion has a lower priority than the pod too, and when it becomes a victim its companions become
victims with it (those on the node counted as gone there as well); the plan's cost counts them all,
so taking a gang hurts more than taking a lone pod of the same priority.

PodDisruptionBudgets are weighed as kube-scheduler weighs them: a candidate whose going would take
a budget that selects it, or one of its companions, below zero (`allowed`: per budget, the
disruptions it allows now, walked over the candidates the most important first, each pod counted
once) is *violating*; the violating candidates are put back first, then the others, so a plan
breaks a budget only where nothing else makes room, and it counts the victims that do
(`Plan.violations`, companions included). Budgets slow preemption down, they never stop it.

Across nodes (`best`) the plan that hurts least wins: the fewest budget violations, then the lowest
highest victim priority, then the lowest sum of victim priorities, then the fewest victims, then the
node the policy ranks first.

A gang that fits nowhere (`for_gang`) preempts across nodes at once: its plan (`core.gangs.plan`,
given as a callable over the live fleet) is tried with the tenants of the lowest priority taken off,
then of the next lowest as well, and so on, up to every tenant below the gang's priority (the lowest
priority its members hold): the first level at which the gang fits bounds the most important victim
as low as it can be. Then, the plan's allocations fixed, the tenants taken off are put back the most
important first wherever they still fit beside the gang; the rest are the victims (with their
companions). Tenants already leaving count as gone from the start, so a gang that fits once they
have gone preempts nothing; it waits only for those whose room its places need (a pod stuck
terminating elsewhere in the cluster is no concern of its). The fleet is changed in place for the
trials and left exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sharegpu.core import allocation, fit, fleet, requests, units
from sharegpu.core import gangs as core_gangs


@dataclass(frozen=True, slots=True)
class Companion:
    """A pod that leaves with a tenant: another running member of its gang, on any node."""

    pod: units.PodKey
    priority: int
    budgets: tuple[str, ...] = ()
    """The PodDisruptionBudgets that select it (`namespace/name`)."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """A pod the ledger holds on the node, as preemption sees it."""

    alloc: allocation.Allocation
    priority: int
    created: str = ""
    """Its creation time (RFC 3339, so it sorts as text): the older of two equals is kept."""
    preemptible: bool = True
    """It may be preempted at all (bound, not one of sharegpu's own pods)."""
    leaving: bool = False
    """Being deleted already: counted as gone for a pod of higher priority."""
    companions: tuple[Companion, ...] = ()
    """Pods that leave with it (its gang's other running members)."""
    budgets: tuple[str, ...] = ()
    """The PodDisruptionBudgets that select it (`namespace/name`)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What preempting on one node takes, and where the pod then fits."""

    node: units.NodeName
    row: int
    gpus: tuple[int, ...]
    """GPUs the pod fits on once the victims and the leaving pods are gone."""
    victims: tuple[units.PodKey, ...]
    """Pods to delete, least important first."""
    leaving: tuple[units.PodKey, ...]
    """Pods already being deleted that the pod waits for."""
    priorities: tuple[int, ...]
    """The victims' priorities (aligned with `victims`)."""
    violations: int = 0
    """How many victims go against a PodDisruptionBudget that allows no more disruptions."""

    @property
    def cost(self) -> tuple[int, int, int, int]:
        """What the plan hurts, to compare plans: budgets broken, highest victim priority, their sum,
        their number."""
        if not self.victims:
            return (0, -(2**62), 0, 0)
        return (self.violations, max(self.priorities), sum(self.priorities), len(self.victims))


@dataclass(frozen=True, slots=True)
class GangPlan:
    """What preempting for a gang takes, and where its members then go."""

    allocations: tuple[allocation.Allocation, ...]
    """The members' places once the victims and the leaving pods are gone."""
    victims: tuple[units.PodKey, ...]
    """Pods to delete, least important first."""
    leaving: tuple[units.PodKey, ...]
    """Pods already being deleted that the gang waits for."""
    priorities: tuple[int, ...]
    """The victims' priorities (aligned with `victims`)."""
    violations: int = 0
    """How many victims go against a PodDisruptionBudget that allows no more disruptions."""

    @property
    def nodes(self) -> tuple[units.NodeName, ...]:
        """The nodes the gang goes to."""
        return tuple(sorted({a.node for a in self.allocations}))


def _may_go(tenant: Tenant, priority: int) -> bool:
    """Whether a pod of `priority` may preempt the tenant (and its companions)."""
    return (
        tenant.preemptible
        and not tenant.leaving
        and tenant.priority < priority
        and bool(tenant.alloc.gpu_usage())
        and all(c.priority < priority for c in tenant.companions)
    )


def _fits(state: fleet.FleetState, demand: requests.GpuDemand) -> bool:
    return bool(fit.evaluate(state, demand, np.zeros(1, dtype=np.int64)).feasible[0])


def violating(candidates: Sequence[Tenant], allowed: Mapping[str, int]) -> set[units.PodKey]:
    """The pods whose going would take a budget below zero, `candidates` in the order they would go
    with their companions (kube-scheduler's walk: each pod, the first time it goes, uses up one
    disruption of every budget that selects it; a budget not in `allowed` allows none)."""
    left = dict(allowed)
    out: set[units.PodKey] = set()
    gone: set[units.PodKey] = set()
    for tenant in candidates:
        going = [(tenant.alloc.pod, tenant.budgets), *((c.pod, c.budgets) for c in tenant.companions)]
        for pod, budgets in going:
            if pod in gone:
                continue
            gone.add(pod)
            for budget in budgets:
                left[budget] = left.get(budget, 0) - 1
                if left[budget] < 0:
                    out.add(pod)
    return out


def _put_back_order(candidates: Iterable[Tenant], allowed: Mapping[str, int]) -> tuple[list[Tenant], set[units.PodKey]]:
    """The order candidates are put back in, and the pods whose going would break a budget: the most
    important first (higher priority, then the older), those that would break one (themselves or a
    companion) before the others, so a budget is broken only where nothing else makes room."""
    important_first = sorted(candidates, key=lambda t: (-t.priority, t.created, t.alloc.pod))
    breaking = violating(important_first, allowed)

    def breaks(tenant: Tenant) -> bool:
        return tenant.alloc.pod in breaking or any(c.pod in breaking for c in tenant.companions)

    return sorted(important_first, key=lambda t: not breaks(t)), breaking


def on_node(
    state: fleet.FleetState,
    row: int,
    tenants: Iterable[Tenant],
    demand: requests.GpuDemand,
    priority: int,
    allowed: Mapping[str, int] | None = None,
) -> Plan | None:
    """The fewest victims on node `row` for a pod of `priority` asking `demand`, breaking as few
    disruption budgets as it can (`allowed`: per budget, the disruptions it allows now); None if
    preempting there cannot make it fit (or nothing there may be preempted)."""
    group = demand.cotenancy.group
    if group is not None:
        tag = state.tag_id(group)
        if state.group_bound(tag) and not bool((state.group_tag[row] == tag).any()):
            return None  # its group holds a GPU of another node: the pod goes only there
    scratch = fleet.FleetState([state.inventories[row]])
    width = scratch.width  # the fleet's rows are padded to its widest node
    scratch.blocked[0] = state.blocked[row, :width]
    scratch.held[0] = state.held[row, :width]
    candidates: list[Tenant] = []
    leaving: list[units.PodKey] = []
    for tenant in tenants:
        if tenant.leaving and tenant.priority < priority:
            leaving.append(tenant.alloc.pod)
        elif _may_go(tenant, priority):
            candidates.append(tenant)
        else:
            scratch.apply(tenant.alloc, +1)
    if not candidates and not leaving:
        return None
    if not _fits(scratch, demand):
        return None
    here = {t.alloc.pod: t for t in candidates}
    victims: dict[units.PodKey, int] = {}
    back: set[units.PodKey] = set()
    put_back, breaking = _put_back_order(candidates, allowed or {})
    for tenant in put_back:
        if tenant.alloc.pod in victims:
            continue  # gone with a companion taken before it
        if not scratch.problems(tenant.alloc):
            scratch.apply(tenant.alloc, +1)
            if _fits(scratch, demand):
                back.add(tenant.alloc.pod)
                continue
            scratch.apply(tenant.alloc, -1)
        victims[tenant.alloc.pod] = tenant.priority
        for companion in tenant.companions:
            key = companion.pod
            victims.setdefault(key, companion.priority)
            if key in back:  # put back already: it leaves with its gang all the same
                back.discard(key)
                scratch.apply(here[key].alloc, -1)
    for tenant in put_back:  # a second look: a gang taken later may free the room a lone victim's going made
        key = tenant.alloc.pod
        if key in victims and not tenant.companions and not scratch.problems(tenant.alloc):
            scratch.apply(tenant.alloc, +1)
            if _fits(scratch, demand):
                del victims[key]
                back.add(key)
                continue
            scratch.apply(tenant.alloc, -1)
    last_taken_first = list(victims)[::-1]  # they were taken most important first
    order = sorted(last_taken_first, key=victims.__getitem__)  # least important first; stable for equals
    return Plan(
        node=state.names[row],
        row=row,
        gpus=_gpus(scratch, demand),
        victims=tuple(order),
        leaving=tuple(leaving),
        priorities=tuple(victims[k] for k in order),
        violations=sum(1 for k in order if k in breaking),
    )


def _gpus(scratch: fleet.FleetState, demand: requests.GpuDemand) -> tuple[int, ...]:
    """The GPUs to keep for the pod: of those it fits on, the ones with the least room (the tightest)."""
    eligible = np.flatnonzero(fit.eligible_gpus(scratch, demand, np.zeros(1, dtype=np.int64))[0])
    ordered = sorted(eligible.tolist(), key=lambda i: (int(scratch.milli_free[0, i]), i))
    return tuple(sorted(ordered[: demand.count]))


def best(plans: Sequence[Plan], rank: fleet.IntArray) -> Plan | None:
    """The plan that hurts least (`rank`: per fleet row, lower is preferred among equal costs)."""
    if not plans:
        return None
    return min(plans, key=lambda p: (p.cost, int(rank[p.row]), p.node))


class _Trial:
    """Tenants taken off the live fleet and allocations put on it for a trial, undone by `undo`
    (the co-tenancy labels restored as they were: a label shows its last tenant's)."""

    def __init__(self, state: fleet.FleetState) -> None:
        self.state = state
        self.off: dict[units.PodKey, allocation.Allocation] = {}
        self.on: list[allocation.Allocation] = []
        self._tags = (state.affinity_tag.copy(), state.exclusion_tag.copy(), state.group_tag.copy())

    def take(self, alloc: allocation.Allocation) -> None:
        if alloc.pod not in self.off:
            self.state.apply(alloc, -1)
            self.off[alloc.pod] = alloc

    def put_back(self, alloc: allocation.Allocation) -> None:
        self.state.apply(self.off.pop(alloc.pod), +1)

    def place(self, alloc: allocation.Allocation) -> None:
        self.state.apply(alloc, +1)
        self.on.append(alloc)

    def undo(self) -> None:
        state = self.state
        for alloc in reversed(self.on):
            state.apply(alloc, -1)
        for alloc in self.off.values():
            state.apply(alloc, +1)
        self.on.clear()
        self.off.clear()
        state.affinity_tag[:], state.exclusion_tag[:], state.group_tag[:] = self._tags


def for_gang(
    state: fleet.FleetState,
    tenants: Sequence[Tenant],
    plan: Callable[[], core_gangs.Plan],
    priority: int,
    allowed: Mapping[str, int] | None = None,
) -> GangPlan | None:
    """The victims for a gang of `priority` whose `plan` (over the live `state`) fails now: None if
    taking every tenant below its priority would not make it fit (or there is none). Of those taken
    off, the ones whose going would break a disruption budget (`allowed`, as for `on_node`) are put
    back first."""
    candidates = [t for t in tenants if _may_go(t, priority)]
    leaving = [t for t in tenants if t.leaving and t.priority < priority]
    if not candidates and not leaving:
        return None
    trial = _Trial(state)
    try:
        for tenant in leaving:
            trial.take(tenant.alloc)
        found = plan() if leaving else None
        for level in sorted({t.priority for t in candidates}):
            if found is not None and found.status.ok:
                break
            for tenant in candidates:
                if tenant.priority == level:
                    trial.take(tenant.alloc)
            found = plan()
        if found is None or not found.status.ok:
            return None
        for alloc in found.allocations:
            trial.place(alloc)
        by_key = {t.alloc.pod: t for t in candidates}
        chosen: dict[units.PodKey, int] = {}
        put_back, breaking = _put_back_order((t for t in candidates if t.alloc.pod in trial.off), allowed or {})
        for tenant in put_back:
            if tenant.alloc.pod in chosen:
                continue  # gone with a companion taken before it
            if not state.problems(tenant.alloc):
                trial.put_back(tenant.alloc)
                continue
            chosen[tenant.alloc.pod] = tenant.priority
            for companion in tenant.companions:
                chosen.setdefault(companion.pod, companion.priority)
                mate = by_key.get(companion.pod)
                if mate is not None:
                    trial.take(mate.alloc)  # put back already, or elsewhere: it leaves with its gang
        for tenant in put_back:  # a second look, as in `on_node`: a gang taken later may have made room
            if tenant.alloc.pod in chosen and not tenant.companions and not state.problems(tenant.alloc):
                trial.put_back(tenant.alloc)
                del chosen[tenant.alloc.pod]
        last_taken_first = list(chosen)[::-1]  # they were taken most important first
        order = sorted(last_taken_first, key=chosen.__getitem__)  # least important first; stable for equals
        waited_for = []  # only the leaving pods the gang's places need gone (others may take long to go)
        for tenant in leaving:
            if state.problems(tenant.alloc):
                waited_for.append(tenant.alloc.pod)
            else:
                trial.put_back(tenant.alloc)
        return GangPlan(
            allocations=found.allocations,
            victims=tuple(order),
            leaving=tuple(waited_for),
            priorities=tuple(chosen[k] for k in order),
            violations=sum(1 for k in order if k in breaking),
        )
    finally:
        trial.undo()
