"""A gang member's filter, as far as it goes without I/O: the gang checked and planned over the cache.

`GangBook.consider` (`extender.gangs`) first looks for a plan it holds already; where it holds none,
this module does the rest, and so does `kubectl sharegpu explain` (which holds no plans and must not
speak to the API from its views). `consider` says whether the member is placed as any pod (its gang
has its minimum running), why it waits (its members disagree, are too few, or its smallest members
would overrun the namespace's quota), or gives the `Trial`: the plan `core.gangs.plan` makes over
the ledger for the waiting members the namespace's quota admits together (smallest first, at least
the minimum; the ledger is left as it was), with what a preemptor needs to try again. Any plan of
them is within the quota (a plan of more members than it admits at once was refused for good, and
preemption freed room for it).

Pure and synchronous over one `ClusterCache`: nothing here is shared between calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sharegpu.api import gangs as api_gangs
from sharegpu.api import pods
from sharegpu.api import quotas as api_quotas
from sharegpu.core import gangs as core_gangs
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import quotas as extender_quotas


@dataclass(frozen=True, slots=True)
class Free:
    """The member is placed as any pod (no gang, or its gang has its minimum running)."""


@dataclass(frozen=True, slots=True)
class Waits:
    """The member waits, and why (the text its filter answers every node)."""

    why: str


@dataclass(frozen=True, slots=True)
class Trial:
    """The gang planned over the ledger (`plan.status` says whether it fits)."""

    waiting: tuple[pods.Record, ...]
    plan: core_gangs.Plan
    again: Callable[[], core_gangs.Plan]
    """Plans it again over the ledger as it is then (a preemptor tries it with victims gone)."""


FREE = Free()


def short(gang: api_gangs.Gang, live: list[pods.Record]) -> int:
    """How many more members the gang needs placed to reach its minimum (members bound, and members
    that ask no GPU, which the extender does not place, count as running)."""
    return gang.min_count - sum(1 for m in live if m.node or not m.gpu)


def consider(
    cache: extender_cache.ClusterCache, quota: extender_quotas.QuotaGuard | None, record: pods.Record
) -> Free | Waits | Trial:
    """Where a gang member stands when no plan holds its gang (see the module docstring)."""
    gang = record.gang
    if gang is None:
        return FREE
    members = cache.gang_members(gang.key)
    for other in members:
        if other.gang is not None and not other.terminal and not other.gang.agrees(gang):
            return Waits(
                f"gang {gang.key}: its members disagree (pod {other.key} states minimum {other.gang.min_count}, "
                f"timeout {other.gang.timeout_s}s, topology {other.gang.topology or 'none'}; this pod minimum "
                f"{gang.min_count}, timeout {gang.timeout_s}s, topology {gang.topology or 'none'})"
            )
    live = [m for m in members if not m.terminal and not m.deleting]
    need = short(gang, live)
    if need <= 0:
        return FREE  # the gang has its minimum: later members are placed as any pod
    waiting = [  # gated members (Kueue's gate until it admits them) are not here yet
        m for m in live if not m.node and not m.gates and m.gpu and m.request is not None and m.problem is None
    ]
    if record.key not in {m.key for m in waiting} and record.request is not None:
        waiting.append(record)  # filtered before the watch showed it
    if len(waiting) < need:
        return Waits(
            f"gang {gang.key} waits for its members: {gang.min_count - need + len(waiting)} of "
            f"{gang.min_count} needed are here, and none is placed before they all fit"
        )
    asking = {m.key: m.request for m in waiting if m.request is not None}
    ordered = sorted(asking.items(), key=lambda kv: api_quotas.pod_totals(kv[1]))
    requests_ = dict(ordered[:need])
    over = quota.refusal_of(requests_) if quota is not None else None
    if over is not None:  # not even its smallest members fit the quota together: nothing is held
        return Waits(f"gang {gang.key}: {need} member(s) at once: {over}")
    if quota is not None:  # only as many members as the quota admits together are planned (or preempted for)
        for key, request in ordered[need:]:
            if quota.refusal_of({**requests_, key: request}) is None:
                requests_[key] = request
    else:
        requests_ = asking
    again = functools.partial(
        core_gangs.plan,
        cache.ledger,
        cache.placer,
        list(requests_.values()),
        need,
        domains(cache, gang.topology, admitted(cache, waiting), [m.node for m in live if m.node]),
        apart=apart(cache, waiting, live),
    )
    return Trial(tuple(waiting), again(), again)  # a plan holds some of `requests_`: within the quota


def admitted(cache: extender_cache.ClusterCache, members: list[pods.Record]) -> np.ndarray:
    """The rows of nodes for pods that every member's own constraints admit (node selector, node
    affinity, taints: the members of a gang come from one template, so this is usually one set)."""
    state = cache.state
    rows = np.flatnonzero(cache.pod_rows)
    for terms in {m.terms.key: m.terms for m in members if m.terms is not None}.values():
        if terms.unconstrained:
            continue
        rows = np.array([r for r in rows.tolist() if cache.admits(terms, state.names[r])], dtype=np.int64)
    return rows


def apart(cache: extender_cache.ClusterCache, waiting: list[pods.Record], live: list[pods.Record]) -> core_gangs.Apart:
    """The waiting members that keep apart from their kind (required pod anti-affinity selecting
    themselves), each topology's value ids over the fleet's rows, and the values where members
    keeping apart in it run already."""
    keys = {m.key: m.terms.apart for m in waiting if m.terms is not None and m.terms.apart}
    if not keys:
        return core_gangs.NOBODY_APART
    state = cache.state
    values: dict[str, np.ndarray] = {}
    taken: dict[str, frozenset[int]] = {}
    for key in sorted({k for ks in keys.values() for k in ks}):
        ids = -1 - np.arange(len(state), dtype=np.int64)  # no label: a value of its own
        for number, rows in enumerate(cache.by_label(key, list(range(len(state)))).values()):
            ids[rows] = number
        values[key] = ids
        running = (state.row(m.node) for m in live if m.node and m.terms is not None and key in m.terms.apart)
        taken[key] = frozenset(int(ids[r]) for r in running if r is not None)
    return core_gangs.Apart(keys, values, taken)


def domains(
    cache: extender_cache.ClusterCache, label: str | None, rows: np.ndarray, running: list[str]
) -> list[core_gangs.Domain]:
    """`rows` under each value of `label` (nodes without it are in none); one unnamed domain of
    them all without a label. Where members run already (on the nodes `running`), only the
    values of their nodes: the whole gang stays within one."""
    if label is None:
        return [core_gangs.Domain("", rows)]
    found = cache.by_label(label, rows.tolist())
    state = cache.state
    taken = [r for r in (state.row(n) for n in running) if r is not None]
    if taken:
        theirs = cache.by_label(label, taken).keys()
        found = {v: r for v, r in found.items() if v in theirs}
    return [core_gangs.Domain(v, np.array(r, dtype=np.int64)) for v, r in sorted(found.items())]
