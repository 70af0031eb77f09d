"""Placement outcomes in words: what kube-scheduler puts in a pod's FailedScheduling event, and the
GPU-by-GPU detail behind it.

kube-scheduler builds the event as "0/N nodes are available: " followed by a histogram of the
per-node reasons ("3 <reason>, 1 <other reason>"), and the API server refuses an event message
longer than 1024 characters, in which case `kubectl describe pod` shows nothing at all. So the
extender gives every node of one category the *same* text, with the figures aggregated over the
category (the largest free share on any such node, for instance): the histogram then has one line
per category, however many nodes there are. `failures` also keeps the whole text within `BUDGET`,
dropping figures and then merging categories if a cluster is failing in many ways at once. The
GPU-by-GPU detail (`detail`) goes to the debug endpoint and the explain tool instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from sharegpu.api import names
from sharegpu.core import fit, requests, status, units

BUDGET: Final = 600
"""Characters the extender's part of a FailedScheduling message may take (the rest is kube-scheduler's)."""
PREFIX: Final = "sharegpu: "
NO_INVENTORY: Final = PREFIX + "node has no GPU inventory (Device resource), is not ready, or serves DRA claims only"
MAX_PROBLEM: Final = 300

RESOURCE_NAMES: Final = {
    status.Resource.HOST_CPU: "cpu",
    status.Resource.HOST_MEMORY: "memory",
    status.Resource.GPU_MILLI: names.GPU_MILLI,
    status.Resource.GPU_MEMORY: names.GPU_MEMORY,
    status.Resource.GPU_COUNT: names.GPU,
    status.Resource.GPU_MODEL: names.MODELS,
    status.Resource.GPU_HEALTH: "gpu health",
    status.Resource.COTENANCY: "co-tenancy",
    status.Resource.ISOLATION: names.ISOLATION,
    status.Resource.OVERCOMMITTED: "over-commit",
    status.Resource.HELD: "preemption",
    status.Resource.SELECTOR: "device selectors",
}
"""The name a user knows each `core.status.Resource` by."""


@dataclass(frozen=True, slots=True)
class Failures:
    """FailedNodes and FailedAndUnresolvableNodes of a filter answer."""

    resolvable: dict[str, str]
    unresolvable: dict[str, str]

    def message(self, total: int) -> str:
        """The histogram kube-scheduler would write for these nodes (used by tests and the debug API)."""
        counts: dict[str, int] = {}
        for text in (*self.resolvable.values(), *self.unresolvable.values()):
            counts[text] = counts.get(text, 0) + 1
        return f"0/{total} nodes are available: " + ", ".join(sorted(f"{n} {t}" for t, n in counts.items())) + "."


def invalid(nodes: Sequence[str], problem: str) -> Failures:
    """Every node refuses a malformed request, for the same reason."""
    text = PREFIX + "invalid GPU request: " + _clip(problem, MAX_PROBLEM)
    return Failures({}, dict.fromkeys(nodes, text))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plural(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


def _memory_need(demand: requests.GpuDemand) -> str:
    parts = []
    if demand.memory_mib:
        parts.append(f"{demand.memory_mib} MiB")
    if demand.memory_permille:
        parts.append(f"{demand.memory_permille / 10:g}% of the GPU's memory")
    return " and at least ".join(parts)


def _rules(rules: requests.CoTenancy) -> str:
    found = [
        f"{label} {value!r}"
        for label, value in (
            ("affinity", rules.affinity),
            ("anti-affinity", rules.anti_affinity),
            ("exclusion", rules.exclusion),
            ("group", rules.group),
        )
        if value is not None
    ]
    return ", ".join(found) if found else "the tenants' own rules"


def _text(kind: fit.Shortfall, demand: requests.GpuDemand, rows: np.ndarray, d: fit.Diagnosis, short: bool) -> str:
    """One category's text, with figures aggregated over the nodes `rows` (indices into `d`)."""
    n = demand.count
    most = int(d.usable[rows].max()) if len(rows) else 0
    models = "/".join(sorted(demand.models))
    if kind is fit.Shortfall.TOO_FEW_GPUS:
        return f"node has fewer than {n} GPUs"
    if kind is fit.Shortfall.ISOLATION:
        mode = demand.isolation.value if demand.isolation else ""
        if demand.compute:
            return f"isolation {mode} enforcing compute not offered on the node"
        return f"isolation {mode} not offered on the node"
    if kind is fit.Shortfall.MODEL:
        return f"no GPU of model {models}" if n == 1 else f"fewer than {n} GPUs of model {models}"
    if kind is fit.Shortfall.UNSELECTED:
        return "no GPU the device selectors pick" if n == 1 else f"fewer than {n} GPUs the device selectors pick"
    if kind is fit.Shortfall.UNHEALTHY:
        return "no healthy GPU" if n == 1 else f"fewer than {n} healthy GPUs"
    if kind is fit.Shortfall.OVERCOMMITTED:
        what = "GPU" if n == 1 else f"{n} GPUs"
        return f"no {what} free of over-commit (an over-committed GPU takes no new pod until repaired)"
    if kind is fit.Shortfall.HELD:
        what = "GPU" if n == 1 else f"{n} GPUs"
        return f"no {what} free of preemption (GPUs kept for a higher-priority pod that preempted their tenants)"
    if kind is fit.Shortfall.HOST_CPU:
        return f"insufficient cpu ({demand.cpu_milli}m requested)"
    if kind is fit.Shortfall.HOST_MEMORY:
        return f"insufficient memory ({demand.host_memory_mib} MiB requested)"
    if kind is fit.Shortfall.GPU_COMPUTE:
        if demand.whole:
            text = "no entirely free GPU" if n == 1 else f"fewer than {n} entirely free GPUs"
            return text if short or n == 1 else f"{text} (at most {most} on one node)"
        if n == 1:
            largest = int(d.largest_milli[rows].max())
            return (
                f"no GPU with {demand.milli} milli-GPU free"
                if short
                else f"no GPU with {demand.milli} milli-GPU free (largest free: {max(largest, 0)})"
            )
        text = f"fewer than {n} GPUs with {demand.milli} milli-GPU free"
        return text if short else f"{text} (at most {most} on one node)"
    if kind is fit.Shortfall.GPU_MEMORY:
        need = _memory_need(demand)
        text = (
            f"no GPU with {demand.milli} milli-GPU and {need} free"
            if n == 1
            else f"fewer than {n} GPUs with {demand.milli} milli-GPU and {need} free"
        )
        largest = int(d.largest_memory[rows].max())
        return text if short else f"{text} (most memory free on such a GPU: {max(largest, 0)} MiB)"
    return f"co-tenancy rules exclude the GPUs with room ({_rules(demand.cotenancy)})"


def failures(
    node_names: Sequence[str], diagnosis: fit.Diagnosis, demand: requests.GpuDemand, missing: Sequence[str] = ()
) -> Failures:
    """Texts for every failing node of a filter call (`node_names` aligned with `diagnosis.rows`;
    `missing`: candidates sharegpu has no inventory for). Nodes where the demand fits get none."""
    kinds = diagnosis.shortfall
    present = sorted({int(k) for k in np.unique(kinds)} - {int(fit.Shortfall.NONE)})
    groups = {k: np.flatnonzero(kinds == k) for k in present}

    def render(short: bool, merged: set[int]) -> dict[int, str]:
        texts = {}
        for k in present:
            if k in merged:
                texts[k] = "GPUs do not fit (kubectl sharegpu explain has the details)"
            else:
                texts[k] = _text(fit.Shortfall(k), demand, groups[k], diagnosis, short)
            texts[k] = PREFIX + _clip(texts[k], 160)
        return texts

    def size(texts: dict[int, str]) -> int:
        extra = len(NO_INVENTORY) + 8 if missing else 0
        return sum(len(t) + 8 for t in set(texts.values())) + extra

    merged: set[int] = set()
    texts = render(False, merged)
    if size(texts) > BUDGET:
        texts = render(True, merged)
    # Merge the smallest categories until the message fits (unresolvable ones keep their own text).
    for k in sorted(present, key=lambda k: len(groups[k])):
        if size(texts) <= BUDGET:
            break
        if fit.Shortfall(k).resolvable:
            merged.add(k)
            texts = render(True, merged)
    resolvable: dict[str, str] = {}
    unresolvable: dict[str, str] = dict.fromkeys(missing, NO_INVENTORY)
    for k in present:
        target = resolvable if fit.Shortfall(k).resolvable else unresolvable
        text = texts[k]
        for position in groups[k].tolist():
            target[node_names[position]] = text
    return Failures(resolvable, unresolvable)


def preempting(failed: Failures, node: str, victims: int, leaving: int) -> Failures:
    """The same failures, with the node a pod preempts on saying so."""
    parts = []
    if victims:
        parts.append(f"preempting {victims} lower-priority {_plural(victims, 'pod', 'pods')} here")
    if leaving:
        parts.append(f"waiting for {leaving} {_plural(leaving, 'pod', 'pods')} leaving")
    resolvable = {**failed.resolvable, node: PREFIX + " and ".join(parts)}
    unresolvable = {name: text for name, text in failed.unresolvable.items() if name != node}
    return Failures(resolvable, unresolvable)


def detail(verdict: status.Status) -> list[str]:
    """A node's verdict GPU by GPU, in the resource names users write (for people, not events)."""
    lines = []
    for reason in verdict.reasons:
        where = reason.node or ""
        if reason.gpu is not None:
            where += f"/gpu{reason.gpu}"
        text = (
            f"{where}: {RESOURCE_NAMES[reason.resource]} requested {reason.requested}, "
            f"free {reason.free} of {reason.capacity}"
        )
        lines.append(f"{text} ({reason.detail})" if reason.detail else text)
    return lines


def refused_bind(pod: units.PodKey, node: str, verdict: status.Status) -> str:
    """The Error of a bind whose pod no longer fits the node kube-scheduler chose."""
    return _clip(f"pod {pod} no longer fits on {node}: " + "; ".join(detail(verdict)), 1000)
