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

Across nodes (`best`) the plan that hurts least wins: the lowest highest victim priority, then the
lowest sum of victim priorities, then the fewest victims, then the node the policy ranks first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from sharegpu.core import allocation, fit, fleet, requests, units


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
    companions: tuple[tuple[units.PodKey, int], ...] = ()
    """Pods that leave with it (its gang's other running members), with their priorities."""


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

    @property
    def cost(self) -> tuple[int, int, int]:
        """What the plan hurts, to compare plans: highest victim priority, their sum, their number."""
        if not self.victims:
            return (-(2**62), 0, 0)
        return (max(self.priorities), sum(self.priorities), len(self.victims))


def _fits(state: fleet.FleetState, demand: requests.GpuDemand) -> bool:
    return bool(fit.evaluate(state, demand, np.zeros(1, dtype=np.int64)).feasible[0])


def on_node(
    state: fleet.FleetState, row: int, tenants: Iterable[Tenant], demand: requests.GpuDemand, priority: int
) -> Plan | None:
    """The fewest victims on node `row` for a pod of `priority` asking `demand`; None if preempting
    there cannot make it fit (or nothing there may be preempted)."""
    scratch = fleet.FleetState([state.inventories[row]])
    width = scratch.width  # the fleet's rows are padded to its widest node
    scratch.blocked[0] = state.blocked[row, :width]
    scratch.held[0] = state.held[row, :width]
    candidates: list[Tenant] = []
    leaving: list[units.PodKey] = []
    for tenant in tenants:
        if tenant.leaving and tenant.priority < priority:
            leaving.append(tenant.alloc.pod)
        elif (
            tenant.preemptible
            and tenant.priority < priority
            and tenant.alloc.gpu_usage()
            and all(p < priority for _, p in tenant.companions)
        ):
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
    for tenant in sorted(candidates, key=lambda t: (-t.priority, t.created, t.alloc.pod)):
        if tenant.alloc.pod in victims:
            continue  # gone with a companion taken before it
        if not scratch.problems(tenant.alloc):
            scratch.apply(tenant.alloc, +1)
            if _fits(scratch, demand):
                back.add(tenant.alloc.pod)
                continue
            scratch.apply(tenant.alloc, -1)
        victims[tenant.alloc.pod] = tenant.priority
        for key, companion_priority in tenant.companions:
            victims.setdefault(key, companion_priority)
            if key in back:  # put back already: it leaves with its gang all the same
                back.discard(key)
                scratch.apply(here[key].alloc, -1)
    last_taken_first = list(victims)[::-1]  # they were taken most important first
    order = sorted(last_taken_first, key=victims.__getitem__)  # least important first; stable for equals
    return Plan(
        node=state.names[row],
        row=row,
        gpus=_gpus(scratch, demand),
        victims=tuple(order),
        leaving=tuple(leaving),
        priorities=tuple(victims[k] for k in order),
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
