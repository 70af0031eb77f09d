"""Filter: which nodes (and which of their GPUs) can take a demand, and why the others cannot.

`evaluate` is the vectorised answer used on every decision: per node a yes/no, and per GPU whether
it can host one unit of the demand (compute, memory, model, health, co-tenancy). `explain` is the
slow, detailed answer for people: one `status.Reason` per shortfall, GPU by GPU, used for pod
events, `kubectl sharegpu explain` and error messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sharegpu.core import fleet, requests, status, units

GPU_MILLI = "sharegpu.io/gpu-milli"
GPU_MEMORY = "sharegpu.io/gpu-memory-mib"
GPU_COUNT = "sharegpu.io/gpus"
GPU_MODEL = "sharegpu.io/gpu-model"
GPU_HEALTH = "sharegpu.io/gpu-health"
COTENANCY = "sharegpu.io/co-tenancy"
HOST_CPU = "cpu"
HOST_MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class Fit:
    rows: fleet.IntArray
    feasible: fleet.BoolArray
    eligible: fleet.BoolArray
    """(len(rows), width): GPU can host one unit of the demand."""


def model_mask(state: fleet.FleetState, demand: requests.GpuDemand, rows: fleet.IntArray | slice) -> fleet.BoolArray:
    if not demand.models:
        return state.present[rows]
    wanted = state.model_ids_for(demand.models)
    return np.isin(state.model_id[rows], wanted)


def eligible_gpus(state: fleet.FleetState, demand: requests.GpuDemand, rows: fleet.IntArray | slice) -> fleet.BoolArray:
    """(rows, width) bool: the GPU can host one unit (one GPU's worth) of `demand`."""
    ok = state.present[rows] & state.healthy[rows]
    if demand.models:
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
            status.Reason(HOST_CPU, demand.cpu_milli, int(state.cpu_free[row]), int(state.cpu_capacity[row]), name)
        )
    if demand.host_memory_mib > state.mem_free[row]:
        reasons.append(
            status.Reason(
                HOST_MEMORY, demand.host_memory_mib, int(state.mem_free[row]), int(state.mem_capacity[row]), name
            )
        )
    if demand.count == 0:
        return status.unschedulable("insufficient host resources", *reasons) if reasons else status.SUCCESS
    one = np.array([row])
    eligible = eligible_gpus(state, demand, one)[0]
    if int(eligible.sum()) >= demand.count and not reasons:
        return status.SUCCESS
    unresolvable = bool(state.gpu_count[row] < demand.count)
    models = model_mask(state, demand, one)[0]
    rules = state.cotenancy_ok(demand.cotenancy, one)[0]
    need_memory = int(state.memory_need(demand, one)[0].max()) if state.width else 0
    for index in range(int(state.gpu_count[row])):
        if eligible[index]:
            continue
        cap = int(state.milli_capacity[row, index])
        free = int(state.milli_free[row, index])
        if not models[index]:
            model = state.model_names[state.model_id[row, index]]
            reasons.append(
                status.Reason(GPU_MODEL, 1, 0, 1, name, index, detail=f"model {model} not in {sorted(demand.models)}")
            )
            continue
        if not state.healthy[row, index]:
            reasons.append(status.Reason(GPU_HEALTH, 1, 0, 1, name, index, detail="GPU is unhealthy"))
            continue
        wanted = demand.milli if not demand.whole else units.MILLI_PER_GPU
        if free < wanted or (demand.whole and state.tenants[row, index] > 0):
            detail = "a whole GPU must be entirely free" if demand.whole else ""
            reasons.append(status.Reason(GPU_MILLI, wanted, free, cap, name, index, detail=detail))
        gmem_free = int(state.gmem_free[row, index])
        gmem_wanted = int(state.gmem_capacity[row, index]) if demand.whole else need_memory
        if gmem_free < gmem_wanted:
            reasons.append(
                status.Reason(GPU_MEMORY, gmem_wanted, gmem_free, int(state.gmem_capacity[row, index]), name, index)
            )
        if not demand.whole and not rules[index]:
            reasons.append(
                status.Reason(COTENANCY, 1, 0, 1, name, index, detail=_rule_detail(state, demand, row, index))
            )
    if int(eligible.sum()) < demand.count:
        detail = "the node has fewer GPUs than the pod asks for" if unresolvable else "GPUs that can host the pod"
        reasons.append(
            status.Reason(GPU_COUNT, demand.count, int(eligible.sum()), int(state.gpu_count[row]), name, detail=detail)
        )
    code = status.Code.UNSCHEDULABLE_AND_UNRESOLVABLE if unresolvable or not models.any() else status.Code.UNSCHEDULABLE
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
