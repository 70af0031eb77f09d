"""Filter: which nodes (and which of their GPUs) can take a demand, and why the others cannot.

Three answers, from cheapest to most detailed:

- `evaluate`, used on every decision: per node a yes/no, and per GPU whether it can host one unit
  of the demand (compute, memory, model, health, co-tenancy). Vectorised over nodes and GPUs.
- `diagnose`, used when a pod fits nowhere: per node the *first* thing that keeps the demand off it
  (`Shortfall`), with the figures an aggregated message needs. Also vectorised, so a pending pod
  costs the same on 5,000 nodes as a feasible one, and its message stays short at any cluster size.
- `explain_node`, for people: one `status.Reason` per shortfall, GPU by GPU (the debug endpoint,
  `kubectl sharegpu explain`, a refused bind).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from sharegpu.core import fleet, requests, status, units

R = status.Resource


@dataclass(frozen=True, slots=True)
class Fit:
    rows: fleet.IntArray
    feasible: fleet.BoolArray
    eligible: fleet.BoolArray
    """(len(rows), width): GPU can host one unit of the demand."""


def model_mask(state: fleet.FleetState, demand: requests.GpuDemand, rows: fleet.IntArray | slice) -> fleet.BoolArray:
    """(rows, width) bool: the GPU is of a model the demand allows and in the selection it names."""
    found = state.present[rows] if not demand.models else state.model_mask(demand.models, rows)
    if demand.selection:
        found = found & state.selection_mask(demand.selection, rows)
    return found


def isolation_mask(
    state: fleet.FleetState, demand: requests.GpuDemand, rows: fleet.IntArray | slice
) -> fleet.BoolArray:
    """(rows,) bool: the node offers the isolation mode the demand asks for, enforcing compute there
    when the demand has a compute guarantee (every node when it demands none)."""
    offered = state.compute_isolation[rows] if demand.compute else state.isolation[rows]
    if demand.isolation is None:
        return np.ones(offered.shape, dtype=np.bool_)
    found: fleet.BoolArray = (offered & demand.isolation.bit) != 0
    return found


def eligible_gpus(state: fleet.FleetState, demand: requests.GpuDemand, rows: fleet.IntArray | slice) -> fleet.BoolArray:
    """(rows, width) bool: the GPU can host one unit (one GPU's worth) of `demand`."""
    free: fleet.BoolArray = state.held[rows] == 0
    ok = state.present[rows] & state.healthy[rows] & ~state.blocked[rows] & free
    if demand.isolation is not None:
        ok &= isolation_mask(state, demand, rows)[:, None]
    if demand.models or demand.selection:
        ok &= model_mask(state, demand, rows)
    if demand.whole:
        ok &= (state.milli_free[rows] == state.milli_capacity[rows]) & (state.tenants[rows] == 0)
        return ok
    ok &= state.milli_free[rows] >= demand.milli
    if demand.memory_mib or demand.memory_permille:
        ok &= state.gmem_free[rows] >= state.memory_need(demand, rows)
    ok &= state.cotenancy_ok(demand.cotenancy, rows)
    return ok


def evaluate(state: fleet.FleetState, demand: requests.GpuDemand, rows: fleet.IntArray) -> Fit:
    feasible = (state.cpu_free[rows] >= demand.cpu_milli) & (state.mem_free[rows] >= demand.host_memory_mib)
    if demand.count == 0:
        return Fit(rows, feasible, np.zeros((len(rows), state.width), dtype=np.bool_))
    eligible = eligible_gpus(state, demand, rows)
    feasible &= eligible.sum(axis=1) >= demand.count
    return Fit(rows, feasible, eligible)


def explain_node(state: fleet.FleetState, demand: requests.GpuDemand, row: int) -> status.Status:
    """Everything that keeps `demand` off node `row`, GPU by GPU; SUCCESS if it fits."""
    name = state.names[row]
    reasons: list[status.Reason] = []
    if demand.cpu_milli > state.cpu_free[row]:
        reasons.append(
            status.Reason(R.HOST_CPU, demand.cpu_milli, int(state.cpu_free[row]), int(state.cpu_capacity[row]), name)
        )
    if demand.host_memory_mib > state.mem_free[row]:
        reasons.append(
            status.Reason(
                R.HOST_MEMORY, demand.host_memory_mib, int(state.mem_free[row]), int(state.mem_capacity[row]), name
            )
        )
    if demand.count == 0:
        return status.unschedulable("insufficient host resources", *reasons) if reasons else status.SUCCESS
    one = np.array([row])
    eligible = eligible_gpus(state, demand, one)[0]
    if int(eligible.sum()) >= demand.count and not reasons:
        return status.SUCCESS
    unresolvable = bool(state.gpu_count[row] < demand.count)
    if demand.isolation is not None and not isolation_mask(state, demand, one)[0]:
        node = state.inventories[row]
        offered = ", ".join(sorted(m.value for m in node.isolation)) or "none"
        detail = f"isolation {demand.isolation.value} not offered (offers: {offered})"
        if demand.compute and demand.isolation in node.isolation:
            enforcing = ", ".join(sorted(m.value for m in node.compute_isolation & node.isolation)) or "none"
            detail = f"isolation {demand.isolation.value} does not enforce compute there (enforcing it: {enforcing})"
        reasons.append(status.Reason(R.ISOLATION, 1, 0, 0, name, detail=detail))
        return status.Status(status.Code.UNSCHEDULABLE_AND_UNRESOLVABLE, f"pod does not fit on {name}", tuple(reasons))
    models = model_mask(state, demand, one)[0]
    rules = state.cotenancy_ok(demand.cotenancy, one)[0]
    need_memory = state.memory_need(demand, one)[0]  # per GPU: a ratio is of that GPU's own memory
    for index in range(int(state.gpu_count[row])):
        if eligible[index]:
            continue
        cap = int(state.milli_capacity[row, index])
        free = int(state.milli_free[row, index])
        if not models[index]:
            model = state.model_names[state.model_id[row, index]]
            if demand.models and model not in demand.models:
                detail = f"model {model} not in {sorted(demand.models)}"
                reasons.append(status.Reason(R.GPU_MODEL, 1, 0, 1, name, index, detail=detail))
            else:
                detail = "not picked by the device selectors"
                reasons.append(status.Reason(R.SELECTOR, 1, 0, 1, name, index, detail=detail))
            continue
        if not state.healthy[row, index]:
            reasons.append(status.Reason(R.GPU_HEALTH, 1, 0, 1, name, index, detail="GPU is unhealthy"))
            continue
        if state.blocked[row, index]:
            detail = "its tenants do not fit on it together; it takes no new pod until they do"
            reasons.append(status.Reason(R.OVERCOMMITTED, 1, 0, 1, name, index, detail=detail))
            continue
        if state.held[row, index]:
            detail = "kept for a pod that preempted its tenants, until that pod is placed"
            reasons.append(status.Reason(R.HELD, 1, 0, 1, name, index, detail=detail))
            continue
        wanted = demand.milli if not demand.whole else units.MILLI_PER_GPU
        if free < wanted or (demand.whole and state.tenants[row, index] > 0):
            detail = "a whole GPU must be entirely free" if demand.whole else ""
            reasons.append(status.Reason(R.GPU_MILLI, wanted, free, cap, name, index, detail=detail))
        gmem_free = int(state.gmem_free[row, index])
        gmem_wanted = int(state.gmem_capacity[row, index]) if demand.whole else int(need_memory[index])
        if gmem_free < gmem_wanted:
            reasons.append(
                status.Reason(R.GPU_MEMORY, gmem_wanted, gmem_free, int(state.gmem_capacity[row, index]), name, index)
            )
        if not demand.whole and not rules[index]:
            reasons.append(
                status.Reason(R.COTENANCY, 1, 0, 1, name, index, detail=_rule_detail(state, demand, row, index))
            )
    if int(eligible.sum()) < demand.count:
        detail = "the node has fewer GPUs than the pod asks for" if unresolvable else "GPUs that can host the pod"
        reasons.append(
            status.Reason(
                R.GPU_COUNT, demand.count, int(eligible.sum()), int(state.gpu_count[row]), name, detail=detail
            )
        )
    too_few = int(models.sum()) < demand.count  # of an allowed model and selected: fixed as the node is built
    code = status.Code.UNSCHEDULABLE_AND_UNRESOLVABLE if unresolvable or too_few else status.Code.UNSCHEDULABLE
    return status.Status(code, f"pod does not fit on {name}", tuple(reasons))


def _rule_detail(state: fleet.FleetState, demand: requests.GpuDemand, row: int, index: int) -> str:
    rules = demand.cotenancy
    if state.group_tag[row, index] and state.group_tag[row, index] != state.tag_id(rules.group):
        return f"GPU belongs to group {state.label_of(int(state.group_tag[row, index]))!r}"
    if rules.group is not None and state.group_tag[row, index] == 0:
        return f"group {rules.group!r} needs a GPU of its own; this one has other tenants"
    if state.affinity_count[row, index] and state.affinity_tag[row, index] != state.tag_id(rules.affinity):
        return f"tenants require affinity {state.label_of(int(state.affinity_tag[row, index]))!r}"
    if rules.affinity is not None and state.affinity_count[row, index] != state.tenants[row, index]:
        return f"affinity {rules.affinity!r} shares only with the same label; GPU has other tenants"
    if rules.exclusion is not None and state.exclusion_tag[row, index] not in (0, state.tag_id(rules.exclusion)):
        return f"GPU carries exclusion label {state.label_of(int(state.exclusion_tag[row, index]))!r}"
    if rules.anti_affinity is not None:
        return f"a tenant has anti-affinity label {rules.anti_affinity!r}"
    return "co-tenancy rules forbid sharing"


class Shortfall(enum.IntEnum):
    """The first thing that keeps a demand off a node, in the order a person would check them."""

    NONE = 0
    TOO_FEW_GPUS = 1
    """The node has fewer GPUs than the pod asks for."""
    MODEL = 2
    """Too few GPUs of an allowed model."""
    UNHEALTHY = 3
    """Enough GPUs of an allowed model, but too few of them healthy."""
    HOST_CPU = 4
    HOST_MEMORY = 5
    GPU_COMPUTE = 6
    """Too few GPUs with enough free compute (for whole GPUs: entirely free)."""
    GPU_MEMORY = 7
    """Enough compute, too little free GPU memory."""
    COTENANCY = 8
    """Room on enough GPUs, but the co-tenancy rules of the pod or of their tenants forbid sharing."""
    ISOLATION = 9
    """The node does not offer the isolation mode the pod demands."""
    OVERCOMMITTED = 10
    """Enough healthy GPUs of an allowed model, but too few of them free of over-commit (the
    ledger blocks a GPU whose tenants do not fit on it together until they do)."""
    HELD = 11
    """Enough GPUs otherwise, but too few of them not kept for a pod that preempted their tenants."""
    UNSELECTED = 12
    """Enough GPUs of an allowed model, but too few of them picked by the request's device selectors."""

    @property
    def resolvable(self) -> bool:
        """Whether freeing something on the node (preemption) could ever help."""
        return self not in (
            Shortfall.TOO_FEW_GPUS,
            Shortfall.ISOLATION,
            Shortfall.MODEL,
            Shortfall.UNSELECTED,
            Shortfall.UNHEALTHY,
            Shortfall.HELD,
        )


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Per candidate node (aligned with `rows`): the first shortfall and the figures behind it."""

    rows: fleet.IntArray
    shortfall: fleet.IntArray
    """A `Shortfall` value per node."""
    usable: fleet.IntArray
    """GPUs that pass every check before the failing one (e.g. entirely free GPUs for GPU_COMPUTE)."""
    largest_milli: fleet.IntArray
    """Most free compute on one healthy GPU of an allowed model (-1: none)."""
    largest_memory: fleet.IntArray
    """Most free memory on one GPU that also has the compute (-1: none)."""


def diagnose(state: fleet.FleetState, demand: requests.GpuDemand, rows: fleet.IntArray) -> Diagnosis:
    """Classify every node in `rows` by its first shortfall, vectorised (NONE where the demand fits)."""
    n = len(rows)
    shortfall = np.zeros(n, dtype=np.int64)
    usable = np.zeros(n, dtype=np.int64)
    largest_milli = np.full(n, -1, dtype=np.int64)
    largest_memory = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return Diagnosis(rows, shortfall, usable, largest_milli, largest_memory)

    def mark(kind: Shortfall, failing: fleet.BoolArray, count: fleet.IntArray | None = None) -> None:
        new = failing & (shortfall == Shortfall.NONE)
        shortfall[new] = kind
        if count is not None:
            usable[new] = count[new]

    need = demand.count
    if need:
        present = state.present[rows]
        mark(Shortfall.TOO_FEW_GPUS, state.gpu_count[rows] < need, state.gpu_count[rows])
        offered = isolation_mask(state, demand, rows)
        mark(Shortfall.ISOLATION, ~offered)
        allowed = state.model_mask(demand.models, rows) if demand.models else present
        modelled = present & allowed & offered[:, None]
        mark(Shortfall.MODEL, modelled.sum(axis=1) < need, modelled.sum(axis=1))
        if demand.selection:
            modelled &= state.selection_mask(demand.selection, rows)
            mark(Shortfall.UNSELECTED, modelled.sum(axis=1) < need, modelled.sum(axis=1))
        healthy = modelled & state.healthy[rows]
        mark(Shortfall.UNHEALTHY, healthy.sum(axis=1) < need, healthy.sum(axis=1))
        healthy &= ~state.blocked[rows]
        mark(Shortfall.OVERCOMMITTED, healthy.sum(axis=1) < need, healthy.sum(axis=1))
        healthy &= state.held[rows] == 0
        mark(Shortfall.HELD, healthy.sum(axis=1) < need, healthy.sum(axis=1))
    mark(Shortfall.HOST_CPU, state.cpu_free[rows] < demand.cpu_milli)
    mark(Shortfall.HOST_MEMORY, state.mem_free[rows] < demand.host_memory_mib)
    if need:
        free = state.milli_free[rows]
        largest_milli[:] = np.where(healthy, free, -1).max(axis=1)
        if demand.whole:
            computed = healthy & (free == state.milli_capacity[rows]) & (state.tenants[rows] == 0)
        else:
            computed = healthy & (free >= demand.milli)
        mark(Shortfall.GPU_COMPUTE, computed.sum(axis=1) < need, computed.sum(axis=1))
        memory_free = state.gmem_free[rows]
        largest_memory[:] = np.where(computed, memory_free, -1).max(axis=1)
        if not demand.whole and (demand.memory_mib or demand.memory_permille):
            computed &= memory_free >= state.memory_need(demand, rows)
        mark(Shortfall.GPU_MEMORY, computed.sum(axis=1) < need, computed.sum(axis=1))
        if not demand.whole:
            computed &= state.cotenancy_ok(demand.cotenancy, rows)
        mark(Shortfall.COTENANCY, computed.sum(axis=1) < need, computed.sum(axis=1))
    return Diagnosis(rows, shortfall, usable, largest_milli, largest_memory)
