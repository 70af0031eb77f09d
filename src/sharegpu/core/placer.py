"""The placer: one decision = filter, score, pick the node, pick its GPUs.

This is the code path the extender, the controllers and the simulator all share. It answers a
`Decision` value: the node and GPU indices chosen, or a status that says the pod fits nowhere.

Ties: the highest score wins; among equal scores the policy's optional secondary key; then the
node with the lowest `priority` rank. A fixed priority order (rather than a coin flip per pod)
consolidates pods quietly, and the FGD paper's results depend on it (docs/simulation.md).

Per-cycle work is kept small: for policies whose scores depend only on a node's own state, the
filter and score results are cached per request shape and per node version, so a decision
recomputes only the nodes that changed since the same shape was last placed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from sharegpu.core import allocation, fit, fleet, requests, scoring, status, units
from sharegpu.core import ledger as core_ledger

IntArray = fleet.IntArray


@dataclass(frozen=True, slots=True)
class Decision:
    status: status.Status
    row: int = -1
    node: units.NodeName | None = None
    gpus: tuple[int, ...] = ()
    score: int = 0
    feasible_nodes: int = 0


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Per candidate node (`rows`, indices into the fleet): whether the demand fits, the policy's
    score and tiebreak, and the GPUs it would take there (a bit mask)."""

    rows: IntArray
    feasible: fleet.BoolArray
    score: IntArray
    choice: IntArray
    tiebreak: IntArray

    def with_feasible(self, feasible: fleet.BoolArray) -> Evaluation:
        """The same, with some nodes ruled out (a caller trying candidates one after another)."""
        return Evaluation(self.rows, feasible, self.score, self.choice, self.tiebreak)


@dataclass(slots=True)
class _Cached:
    version: IntArray
    feasible: fleet.BoolArray
    score: IntArray
    choice: IntArray
    tiebreak: IntArray


class Placer:
    def __init__(
        self,
        state: fleet.FleetState,
        policy: scoring.Policy,
        *,
        priority: IntArray | None = None,
        seed: int = 0,
        cache_shapes: int = 1024,
    ) -> None:
        self.state = state
        self.policy = policy
        policy.prepare(state)
        n = len(state)
        self.priority: IntArray = np.arange(n, dtype=np.int64) if priority is None else np.asarray(priority, np.int64)
        if self.priority.shape != (n,):
            raise ValueError(f"priority must have one rank per node ({n}), got shape {self.priority.shape}")
        self.rng = np.random.default_rng(seed)
        self._cache: OrderedDict[requests.GpuDemand, _Cached] = OrderedDict()
        self._cache_shapes = cache_shapes
        self._all_rows: IntArray = np.arange(n, dtype=np.int64)

    # ----------------------------------------------------------------- scoring

    def evaluate(self, demand: requests.GpuDemand, rows: IntArray | None = None) -> Evaluation:
        """For `rows` (default: all nodes): feasible, score, GPU choice mask and tiebreak per node.

        For all nodes the arrays may be the placer's own cache: read them, do not modify them, and
        do not keep them past the next call."""
        everyone = rows is None
        rows = self._all_rows if rows is None else rows
        if not self.policy.cacheable or demand.cotenancy.group is not None:
            return self._compute(demand, rows)
        entry = self._cache.get(demand)
        if entry is None:
            n = len(self.state)
            entry = _Cached(
                version=np.full(n, -1, dtype=np.int64),
                feasible=np.zeros(n, dtype=np.bool_),
                score=np.zeros(n, dtype=np.int64),
                choice=np.zeros(n, dtype=np.int64),
                tiebreak=np.zeros(n, dtype=np.int64),
            )
            self._cache[demand] = entry
            if len(self._cache) > self._cache_shapes:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(demand)
        if everyone:
            stale = np.flatnonzero(entry.version != self.state.version)
        else:
            stale = rows[entry.version[rows] != self.state.version[rows]]
        if len(stale):
            fresh = self._compute(demand, stale)
            entry.feasible[stale] = fresh.feasible
            entry.score[stale] = fresh.score
            entry.choice[stale] = fresh.choice
            entry.tiebreak[stale] = fresh.tiebreak
            entry.version[stale] = self.state.version[stale]
        if everyone:
            return Evaluation(rows, entry.feasible, entry.score, entry.choice, entry.tiebreak)
        return Evaluation(rows, entry.feasible[rows], entry.score[rows], entry.choice[rows], entry.tiebreak[rows])

    def _compute(self, demand: requests.GpuDemand, rows: IntArray) -> Evaluation:
        result = fit.evaluate(self.state, demand, rows)
        n = len(rows)
        score = np.zeros(n, dtype=np.int64)
        choice = np.zeros(n, dtype=np.int64)
        tiebreak = np.zeros(n, dtype=np.int64)
        feasible, eligible = result.feasible, result.eligible
        ok = np.flatnonzero(feasible)
        if len(ok) and demand.count:
            narrowed = self.policy.narrow(self.state, demand, rows[ok], eligible[ok])
            if narrowed is not None:  # the policy's own limits: a node left with too few GPUs does not fit
                enough = narrowed.sum(axis=1) >= demand.count
                feasible, eligible = feasible.copy(), eligible.copy()
                feasible[ok[~enough]] = False
                eligible[ok] = narrowed
                ok = ok[enough]
        if len(ok):
            scores = self.policy.score(scoring.Batch(self.state, demand, rows[ok], eligible[ok], self.rng))
            score[ok] = scores.score
            choice[ok] = scores.choice
            if scores.tiebreak is not None:
                tiebreak[ok] = scores.tiebreak
        return Evaluation(rows, feasible, score, choice, tiebreak)

    # ----------------------------------------------------------------- deciding

    def decide(self, demand: requests.GpuDemand, rows: IntArray | None = None) -> Decision:
        return self.choose(demand, self.evaluate(demand, rows))

    def choose(self, demand: requests.GpuDemand, evaluation: Evaluation) -> Decision:
        """The decision from an `evaluate` result (callers that also need the scores evaluate once)."""
        rows, feasible, score, choice, tiebreak = (
            evaluation.rows, evaluation.feasible, evaluation.score, evaluation.choice, evaluation.tiebreak
        )  # fmt: skip
        ok = np.flatnonzero(feasible)
        if not len(ok):
            return Decision(status.unschedulable(f"no node fits among {len(rows)} candidate(s)"))
        best_score = score[ok].max()
        ok = ok[score[ok] == best_score]
        if len(ok) > 1:
            best_tie = tiebreak[ok].max()
            ok = ok[tiebreak[ok] == best_tie]
        winner = ok[np.argmin(self.priority[rows[ok]])] if len(ok) > 1 else ok[0]
        row = int(rows[winner])
        gpus = scoring.mask_to_indices(int(choice[winner]))
        if self.policy.topology_refine and demand.count > 1 and demand.whole:
            eligible = fit.eligible_gpus(self.state, demand, np.array([row]))[0]
            gpus, _ = scoring.best_connected(
                self.state.inventories[row], np.flatnonzero(eligible).tolist(), demand.count
            )
        return Decision(
            status.SUCCESS,
            row=row,
            node=self.state.names[row],
            gpus=tuple(gpus),
            score=int(best_score),
            feasible_nodes=int(feasible.sum()),
        )

    def allocation_for(self, pod: requests.PodRequest, decision: Decision) -> allocation.Allocation:
        assert decision.node is not None, "allocation_for needs a successful decision"
        return self.allocation_on(pod, decision.row, decision.gpus)

    def allocation_on(self, pod: requests.PodRequest, row: int, gpus: tuple[int, ...]) -> allocation.Allocation:
        """The pod's allocation on GPUs `gpus` of node `row` (chosen here, or by a preemption plan)."""
        node = self.state.inventories[row]
        return allocation.build(
            pod,
            node.name,
            gpus,
            [gpu.memory_mib for gpu in node.gpus],
            [gpu.uuid for gpu in node.gpus] if node.gpus else None,
        )

    def place(self, ledger: core_ledger.Ledger, pod: requests.PodRequest, rows: IntArray | None = None) -> Decision:
        """Decide and assume in one step (the ledger must own this placer's state)."""
        decision = self.decide(pod.demand, rows)
        if not decision.status.ok:
            return decision
        result = ledger.assume(self.allocation_for(pod, decision))
        if not result.ok:  # a placer bug if it ever happens: the decision did not fit the ledger
            return Decision(result)
        return decision
