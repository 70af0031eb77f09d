"""The limit of static placement: a proven lower bound on the unallocated GPU %, and an offline heuristic.

The question: for one arrival sequence (the paper's method, `replay.build_workload`), how little GPU
compute could *any* placement leave unallocated at arrived = 100%, even one that knows every arrival
in advance? The relaxation bounded here: a placer that sees the whole sequence, places pods in arrival
order where they will stay, and may reject **any** pod, including one that would fit (the method itself
rejects only pods that fit nowhere, so every policy's run is one of the outcomes considered; CPU-only
pods, which allocate no GPU, are rejected outright). Such a placer's allocation after arrival i is the
GPU compute of the pods it keeps among the first i, and everything it keeps must fit on the cluster at
once, so

    allocated_i <= OPT(end)    for every arrival i of the window (arrived % rounding to 100),

where OPT(end) is the most GPU compute that any set of pods from the sequence up to the window's last
arrival can occupy on the cluster together (pods never leave). The figure's lower bound follows by
the metric's own arithmetic (`replay.window`): 100 - mean(round(min(OPT, arrived_i) / capacity, 2%)).

OPT is a multi-resource packing problem: per node host CPU, host memory and GPUs; a sharing pod
takes part of one GPU (the compute of a GPU's sharing pods at most 1000 milli), a pod of k whole GPUs
takes k untouched GPUs of one node, `gpu_spec` restricts models. It is solved as a *node pattern*
model with pods aggregated by shape (CPU, memory, GPU count, milli, models) and nodes by type (GPU
count, model, CPU, memory): a pattern is a multiset of shapes one node of a type can hold; choose how
many nodes of each type use each pattern, at most the type's node count, using no shape more often
than it arrived, maximising GPU compute.

- **Small instances** (every type's patterns enumerable): all patterns are listed and the integer
  model is solved exactly with HiGHS (`scipy.optimize.milp`): the bound *is* the optimum.
- **Otherwise** (openb): column generation on the LP relaxation. The pricing problem, per node type,
  is a small integer program (shape counts, plus GPU fill patterns: maximal multisets of sharing
  milli values that fit one GPU), solved by HiGHS. At every iteration the Lagrangian bound
  `sum_s n_s pi_s + sum_t N_t max(0, best reduced value_t)` (duals pi of the shape rows, clipped to
  >= 0; the pricing's own dual bound when it stops early) is a valid upper bound on OPT for any
  multipliers, so the figure stays proven even under a time limit; at convergence it equals the LP
  value. Finally the integer model over the generated patterns gives a packing that is achievable.

The offline heuristic brackets the limit from the other side: largest GPU request first, best fit
(the paper's BestFit node score, tightest GPU), rejecting what does not fit; its allocation after
each arrival counts the kept pods that have arrived, as a clairvoyant in-order placer would see it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from scipy import optimize, sparse

from sharegpu.core import devices, errors, fleet, frag, policies, scoring, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from sharegpu.sim import replay, runner, trace

_MILLI = units.MILLI_PER_GPU
ENUMERATION_PODS = 48
"""Instances with at most this many GPU pods are tried for the exact (enumerated) model..."""
ENUMERATION_LIMIT = 20_000
"""...which gives up beyond this many node patterns in all."""


@contextlib.contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    """HiGHS 1.12 (inside scipy 1.17) prints a debug line from C++ straight to file descriptor 1 while
    it solves integer programs; it would land in the middle of the CLI's table or JSON on stdout. The
    descriptor is pointed at /dev/null for the solve (Python's own sys.stdout is flushed first)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _milp(
    objective: np.ndarray,
    constraints: optimize.LinearConstraint,
    bounds: optimize.Bounds,
    time_limit: float,
    gap: float,
) -> optimize.OptimizeResult:
    """Minimise `objective` over integers within `bounds` and `constraints` (HiGHS)."""
    with _native_stdout_silenced():
        return optimize.milp(
            objective,
            constraints=constraints,
            integrality=np.ones(len(objective), dtype=np.int64),
            bounds=bounds,
            options={"time_limit": time_limit, "mip_rel_gap": gap},
        )


@dataclass(frozen=True, slots=True, order=True)
class PodShape:
    cpu_milli: int
    memory_mib: int
    count: int
    milli: int
    models: tuple[str, ...] = ()

    @property
    def value(self) -> int:
        return self.count * self.milli

    @property
    def sharing(self) -> bool:
        return self.milli < _MILLI


@dataclass(frozen=True, slots=True, order=True)
class NodeType:
    gpu_count: int
    model: str
    cpu_milli: int
    memory_mib: int

    def admits(self, shape: PodShape) -> bool:
        return (
            shape.count <= self.gpu_count
            and shape.cpu_milli <= self.cpu_milli
            and shape.memory_mib <= self.memory_mib
            and (not shape.models or self.model in shape.models)
        )


@dataclass(frozen=True, slots=True)
class Instance:
    """Pods aggregated by shape, nodes by type."""

    shapes: tuple[PodShape, ...]
    demand: tuple[int, ...]
    """Pods of each shape."""
    types: tuple[NodeType, ...]
    supply: tuple[int, ...]
    """Nodes of each type."""

    @classmethod
    def of(cls, nodes: Sequence[devices.NodeInventory], pods: Sequence[trace.TracePod]) -> Instance:
        type_count: Counter[NodeType] = Counter()
        for node in nodes:
            if not node.gpus:
                continue
            models = {gpu.model for gpu in node.gpus}
            if len(models) != 1:
                raise errors.InvalidInputError(f"bound: node {node.name} mixes GPU models {sorted(models)}")
            type_count[NodeType(node.gpu_count, models.pop(), node.cpu_milli, node.memory_mib)] += 1
        shape_count: Counter[PodShape] = Counter(_shape_of(p) for p in pods if p.num_gpu)
        types = tuple(sorted(type_count))
        usable = sorted(s for s in shape_count if any(t.admits(s) for t in types))
        return cls(tuple(usable), tuple(shape_count[s] for s in usable), types, tuple(type_count[t] for t in types))

    def restricted(self, pods: Sequence[trace.TracePod]) -> Instance:
        """The same shapes and nodes with the demand of `pods` (a prefix of the pods this was made of),
        so patterns found for one stay valid columns for the other."""
        count = Counter(_shape_of(p) for p in pods if p.num_gpu)
        return Instance(self.shapes, tuple(count[s] for s in self.shapes), self.types, self.supply)


def _shape_of(pod: trace.TracePod) -> PodShape:
    return PodShape(pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, tuple(sorted(pod.models)))


def node_holds(node: NodeType, shapes: Sequence[PodShape]) -> bool:
    """Whether one node of type `node` can hold all of `shapes` at once (exact, for small sets)."""
    if not all(node.admits(s) for s in shapes):
        return False
    if sum(s.cpu_milli for s in shapes) > node.cpu_milli or sum(s.memory_mib for s in shapes) > node.memory_mib:
        return False
    bins = node.gpu_count - sum(s.count for s in shapes if not s.sharing)
    if bins < 0:
        return False
    items = sorted((s.milli for s in shapes if s.sharing), reverse=True)
    if sum(items) > bins * _MILLI:
        return False
    return _pack(items, [0] * bins)


def _pack(items: list[int], loads: list[int]) -> bool:
    if not items:
        return True
    first, rest = items[0], items[1:]
    tried: set[int] = set()
    for i, load in enumerate(loads):
        if load in tried or load + first > _MILLI:
            continue
        tried.add(load)
        loads[i] += first
        if _pack(rest, loads):
            loads[i] -= first
            return True
        loads[i] -= first
    return False


def gpu_fills(values: Sequence[int]) -> list[tuple[int, ...]]:
    """Maximal multisets of the sharing milli `values` that fit one GPU, as counts per value."""
    ordered = sorted(set(values))
    fills: list[tuple[int, ...]] = []
    counts = [0] * len(ordered)

    def extend(start: int, room: int) -> None:
        grew = False
        for j in range(start, len(ordered)):
            if ordered[j] <= room:
                grew = True
                counts[j] += 1
                extend(j, room - ordered[j])
                counts[j] -= 1
        if not grew and not any(v <= room for v in ordered):
            fills.append(tuple(counts))

    extend(0, _MILLI)
    return [tuple(f[ordered.index(v)] for v in sorted(set(values))) for f in fills]


@dataclass(frozen=True, slots=True)
class Solution:
    bound_milli: int
    """Proven: no set of these pods that fits together occupies more GPU compute."""
    found_milli: int
    """Achieved by a packing found (the integer model over the patterns known)."""
    kept: tuple[int, ...]
    """Pods of each shape the found packing keeps."""
    exact: bool
    """All patterns enumerated and the integer model solved to optimality."""
    iterations: int
    seconds: float
    columns: tuple[tuple[int, np.ndarray], ...] = ()
    """The node patterns known at the end (type index, pods per shape): seeds for a related instance."""


class _Patterns:
    """Columns of the master problem: (type index, counts per shape)."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.types: list[int] = []
        self.counts: list[np.ndarray] = []
        self.seen: set[tuple[int, bytes]] = set()
        self.values = np.array([s.value for s in instance.shapes], dtype=np.int64)

    def add(self, type_index: int, counts: np.ndarray) -> bool:
        key = (type_index, counts.astype(np.int64).tobytes())
        if key in self.seen or not counts.any():
            return False
        self.seen.add(key)
        self.types.append(type_index)
        self.counts.append(counts.astype(np.int64))
        return True

    def columns(self) -> tuple[tuple[int, np.ndarray], ...]:
        return tuple(zip(self.types, self.counts, strict=True))

    def matrix(self) -> tuple[np.ndarray, sparse.csr_array]:
        """Objective values and the constraint rows (types first, then shapes) of every column."""
        n_types = len(self.instance.types)
        columns = len(self.counts)
        values = np.array([int(c @ self.values) for c in self.counts], dtype=np.float64)
        type_rows = sparse.csr_array(
            (np.ones(columns), (np.array(self.types), np.arange(columns))), shape=(n_types, columns)
        )
        shape_rows = sparse.csr_array(np.stack(self.counts, axis=1).astype(np.float64)) if columns else None
        stacked = sparse.vstack([type_rows, shape_rows]) if shape_rows is not None else type_rows
        return values, sparse.csr_array(stacked)


def _enumerate(instance: Instance, limit: int) -> list[tuple[int, np.ndarray]] | None:
    """Every non-empty pattern of every type, or None when there are more than `limit`."""
    found: list[tuple[int, np.ndarray]] = []
    for t, node in enumerate(instance.types):
        admitted = [i for i, s in enumerate(instance.shapes) if node.admits(s)]
        counts = np.zeros(len(instance.shapes), dtype=np.int64)
        # Depth-first over multisets (shapes in index order), pruning as soon as a node cannot hold one.
        stack: list[tuple[int, list[PodShape]]] = [(0, [])]
        while stack:
            position, chosen = stack.pop()
            counts[:] = 0
            for shape in chosen:
                counts[instance.shapes.index(shape)] += 1
            for k in range(position, len(admitted)):
                i = admitted[k]
                if counts[i] >= instance.demand[i]:
                    continue
                candidate = [*chosen, instance.shapes[i]]
                if node_holds(node, candidate):
                    grown = counts.copy()
                    grown[i] += 1
                    found.append((t, grown))
                    if len(found) > limit:
                        return None
                    stack.append((k, candidate))
    return found


def solve(
    instance: Instance,
    *,
    time_limit: float = 900.0,
    seed_columns: Sequence[tuple[int, np.ndarray]] = (),
    pack: bool = True,
) -> Solution:
    """The most GPU compute these pods can occupy together: a proven bound and (with `pack`, or when
    exact) a packing found."""
    started = time.perf_counter()
    n_shapes = len(instance.shapes)
    demand = np.array(instance.demand, dtype=np.float64)
    supply = np.array(instance.supply, dtype=np.float64)
    if not n_shapes:
        return Solution(0, 0, (), True, 0, time.perf_counter() - started)
    patterns = _Patterns(instance)
    listed = _enumerate(instance, ENUMERATION_LIMIT) if sum(instance.demand) <= ENUMERATION_PODS else None
    if listed is not None:
        for t, column in listed:
            patterns.add(t, column)
        found, kept, optimal = _integer_master(patterns, instance, time_limit)
        return Solution(found, found, kept, optimal, 0, time.perf_counter() - started, patterns.columns())
    for t, column in seed_columns:
        patterns.add(t, column)
    for t, node in enumerate(instance.types):  # one pattern per admitted shape, so every row has a column
        for i, shape in enumerate(instance.shapes):
            if node.admits(shape):
                single = np.zeros(n_shapes, dtype=np.int64)
                single[i] = 1
                patterns.add(t, single)
    best_bound = math.inf
    center: np.ndarray | None = None  # the shape prices of the best Lagrangian bound so far
    iterations = 0
    pricers = [_Pricer(instance, t) for t in range(len(instance.types))]
    while time.perf_counter() - started < time_limit:
        iterations += 1
        values, rows = patterns.matrix()
        lp = optimize.linprog(
            -values, A_ub=rows.toarray(), b_ub=np.concatenate([supply, demand]), bounds=(0, None), method="highs"
        )
        if lp.status != 0:
            raise errors.SharegpuError(f"bound: the LP master failed ({lp.message})")
        duals = -np.asarray(lp.ineqlin.marginals)
        node_price = np.maximum(duals[: len(supply)], 0.0)
        lp_price = np.maximum(duals[len(supply) :], 0.0)
        lp_value = -float(lp.fun or 0.0)
        added = 0
        # Stabilised pricing (Wentges): price halfway between the LP duals and the best multipliers
        # so far, which damps the duals' oscillation; when that finds nothing the LP duals are tried.
        tries = [lp_price] if center is None else [0.5 * (center + lp_price), lp_price]
        for shape_price in tries:
            remaining = time_limit - (time.perf_counter() - started)
            lagrangian = float(demand @ shape_price)
            for t, pricer in enumerate(pricers):
                counts, _, ceiling = pricer.price(shape_price, max(remaining / len(pricers), 1.0))
                lagrangian += supply[t] * max(ceiling, 0.0)
                if counts is None:
                    continue
                reduced = float(counts @ (pricer.values - lp_price)) - node_price[t]
                if reduced > 1e-6 * max(1.0, lp_value / max(supply.sum(), 1.0)) and patterns.add(t, counts):
                    added += 1
            if lagrangian < best_bound:
                best_bound, center = lagrangian, shape_price
            if added:
                break
        if not added:  # the LP duals price out: the LP optimum is the bound
            best_bound = min(best_bound, lp_value)
            break
        if best_bound - lp_value < 0.5:
            break
    found, kept = 0, tuple(0 for _ in instance.shapes)
    if pack:
        left = min(max(time_limit - (time.perf_counter() - started), 10.0), 60.0)
        found, kept, _ = _integer_master(patterns, instance, left)
    bound = math.floor(best_bound * (1 + 1e-9) + 1e-6)
    seconds = time.perf_counter() - started
    return Solution(max(bound, found), found, kept, False, iterations, seconds, patterns.columns())


class _Pricer:
    """The pricing problem of one node type: the pattern with the best total reduced value."""

    def __init__(self, instance: Instance, t: int) -> None:
        self.node = instance.types[t]
        self.shapes = instance.shapes
        self.admitted = np.array([self.node.admits(s) for s in instance.shapes], dtype=np.bool_)
        self.demand = np.array(instance.demand, dtype=np.int64)
        self.values = np.array([s.value for s in instance.shapes], dtype=np.float64)
        self._fills: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def fills(self, values: tuple[int, ...]) -> list[tuple[int, ...]]:
        if values not in self._fills:
            self._fills[values] = gpu_fills(values)
        return self._fills[values]

    def price(self, shape_price: np.ndarray, time_limit: float) -> tuple[np.ndarray | None, float, float]:
        """(counts per shape or None, best value found, proven ceiling of the best value)."""
        gain = self.values - shape_price
        chosen = np.flatnonzero(self.admitted & (gain > 1e-9))
        if not len(chosen):
            return None, 0.0, 0.0
        node = self.node
        shapes = [self.shapes[i] for i in chosen]
        milli_values = tuple(sorted({s.milli for s in shapes if s.sharing}))
        fills = self.fills(milli_values) if milli_values else []
        n, q = len(shapes), len(fills)
        c = np.concatenate([-gain[chosen], np.zeros(q)])
        rows = [
            np.concatenate([[s.cpu_milli for s in shapes], np.zeros(q)]),
            np.concatenate([[s.memory_mib for s in shapes], np.zeros(q)]),
            np.concatenate([[0 if s.sharing else s.count for s in shapes], np.ones(q)]),
        ]
        upper = [node.cpu_milli, node.memory_mib, node.gpu_count]
        for j, value in enumerate(milli_values):
            rows.append(
                np.concatenate(
                    [[1.0 if s.sharing and s.milli == value else 0.0 for s in shapes], [-f[j] for f in fills]]
                )
            )
            upper.append(0)
        per_node = [
            min(
                int(self.demand[i]),
                node.gpu_count // s.count if not s.sharing else node.gpu_count * (_MILLI // s.milli),
                node.cpu_milli // s.cpu_milli if s.cpu_milli else 1 << 30,
                node.memory_mib // s.memory_mib if s.memory_mib else 1 << 30,
            )
            for i, s in zip(chosen, shapes, strict=True)
        ]
        result = _milp(
            c,
            optimize.LinearConstraint(np.array(rows), -np.inf, np.array(upper, dtype=np.float64)),
            optimize.Bounds(np.zeros(n + q), np.array(per_node + [node.gpu_count] * q, dtype=np.float64)),
            time_limit,
            1e-9,
        )
        if result.x is None:
            raise errors.SharegpuError(f"bound: pricing for {node} failed ({result.message})")
        counts = np.zeros(len(self.shapes), dtype=np.int64)
        counts[chosen] = np.round(result.x[:n]).astype(np.int64)
        best = -float(result.fun)
        dual = getattr(result, "mip_dual_bound", None)
        ceiling = -float(dual) if dual is not None and np.isfinite(dual) else best
        return counts, best, max(best, ceiling)


def _integer_master(patterns: _Patterns, instance: Instance, time_limit: float) -> tuple[int, tuple[int, ...], bool]:
    """The best integer choice of the known patterns: (GPU milli, pods kept per shape, proven optimal)."""
    values, rows = patterns.matrix()
    upper = np.concatenate([np.array(instance.supply, float), np.array(instance.demand, float)])
    result = _milp(
        -values,
        optimize.LinearConstraint(rows, -np.inf, upper),
        optimize.Bounds(np.zeros(len(values)), np.full(len(values), np.inf)),
        time_limit,
        0.0,
    )
    if result.x is None:
        return 0, tuple(0 for _ in instance.shapes), False
    use = np.round(result.x).astype(np.int64)
    kept = np.zeros(len(instance.shapes), dtype=np.int64)
    for count, column in zip(use.tolist(), patterns.counts, strict=True):
        if count:
            kept += count * column
    return int(kept @ patterns.values), tuple(int(k) for k in kept), bool(result.status == 0)


# --------------------------------------------------------------------------- the figure for a run


@dataclass(frozen=True, slots=True)
class BoundRun:
    trace: str
    seed: int
    lower_bound_unallocated_pct: float
    """Proven: no placement of this arrival sequence leaves less unallocated at arrived = 100%."""
    offline_heuristic_unallocated_pct: float
    """Achieved by a placer that knows the future: the better of the integer packing over the patterns
    column generation found and largest-first best fit."""
    best_fit_unallocated_pct: float
    """Largest-first best fit alone."""
    exact: bool
    """The bound is the optimum itself (all node patterns enumerated, integer model solved)."""
    solve_seconds: float


def offline_heuristic(
    nodes: Sequence[devices.NodeInventory], pods: Sequence[trace.TracePod], instance: Instance | None = None
) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """Largest GPU request first, best fit: which pods it keeps, and each node's content as a pattern.

    Returns the kept mask (aligned with `pods`) and, per GPU node, (type index, counts per shape)
    for `instance` (default: `Instance.of(nodes, pods)`).
    """
    order = sorted(
        (i for i, p in enumerate(pods) if p.num_gpu),
        key=lambda i: (-pods[i].gpu_milli_total, -pods[i].cpu_milli, -pods[i].memory_mib, i),
    )
    return _placed(instance or Instance.of(nodes, pods), nodes, pods, order, policies.make("bestfit"))


def _placed(
    instance: Instance,
    nodes: Sequence[devices.NodeInventory],
    pods: Sequence[trace.TracePod],
    order: Sequence[int],
    policy: scoring.Policy,
) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """Place `pods` in `order` with `policy`: the kept mask and each used node's content as a pattern
    of `instance` (made of these nodes and pods)."""
    shape_index = {s: i for i, s in enumerate(instance.shapes)}
    type_index = {t: i for i, t in enumerate(instance.types)}
    state = fleet.FleetState(list(nodes))
    ledger = core_ledger.Ledger(state)
    placer = core_placer.Placer(state, policy)
    kept = np.zeros(len(pods), dtype=np.bool_)
    content: dict[int, np.ndarray] = {}
    for i in order:
        pod = pods[i]
        decision = placer.place(ledger, pod.request(f"{pod.name}#{i}"))
        if not decision.status.ok or not pod.num_gpu:
            continue
        kept[i] = True
        counts = content.setdefault(decision.row, np.zeros(len(instance.shapes), dtype=np.int64))
        counts[shape_index[_shape_of(pod)]] += 1
    columns = []
    for row, counts in content.items():
        inv = nodes[row]
        columns.append((type_index[NodeType(inv.gpu_count, inv.gpus[0].model, inv.cpu_milli, inv.memory_mib)], counts))
    return kept, columns


def _earliest(pods: Sequence[trace.TracePod], instance: Instance, kept: Sequence[int]) -> np.ndarray:
    """Keep, of each shape, the pods that arrive first (as many as `kept` says)."""
    left = dict(zip(instance.shapes, kept, strict=True))
    mask = np.zeros(len(pods), dtype=np.bool_)
    for i, p in enumerate(pods):
        if not p.num_gpu:
            continue
        shape = _shape_of(p)
        if left.get(shape, 0) > 0:
            left[shape] -= 1
            mask[i] = True
    return mask


WINDOW_POINTS = 5
"""Prefixes inside the window solved for their own bound (each window arrival uses the nearest one
at or after it); more points tighten the figure by at most 1 / points of the window's width."""


def bound_run(
    nodes: Sequence[devices.NodeInventory],
    workload: replay.Workload,
    trace_name: str,
    seed: int,
    *,
    time_limit: float = 900.0,
) -> BoundRun:
    """The bound and the offline heuristic for one arrival sequence, in the metric's own terms.

    Arrival i of the window can hold at most OPT(prefix up to i), and OPT only grows with the prefix;
    so a few prefixes inside the window are solved (the last one first; each later solve starts
    from every pattern found so far) and each window arrival is bounded by the first solved prefix
    at or after it (and by what has arrived)."""
    capacity = sum(node.gpu_count for node in nodes) * _MILLI
    requested = np.array([p.gpu_milli_total for p in workload.pods], dtype=np.int64)
    arrived = np.cumsum(requested)
    picks = replay.window(arrived, capacity)
    if not len(picks):
        raise errors.InvalidInputError(f"bound: the {trace_name} workload never reaches the cluster's capacity")
    end = int(picks.max())
    prefix = list(workload.pods[: end + 1])
    n = len(prefix)
    started = time.perf_counter()
    instance = Instance.of(nodes, prefix)
    heuristic_kept, columns = offline_heuristic(nodes, prefix, instance)
    # The extender's default policy in arrival order gives the column generation a good start.
    shapes = frag.typical_shapes(p.shape for p in prefix)
    _, online = _placed(instance, nodes, prefix, range(len(prefix)), policies.make(policies.DEFAULT, shapes))
    solution = solve(instance, time_limit=time_limit, seed_columns=[*columns, *online])
    points = sorted({int(picks[int(k)]) for k in np.linspace(0, len(picks) - 1, WINDOW_POINTS).round()})
    ceiling_at = {end: solution.bound_milli}
    known = list(solution.columns)
    for point in reversed(points[:-1]):
        left = max(time_limit - (time.perf_counter() - started), 10.0)
        partial = solve(instance.restricted(prefix[: point + 1]), time_limit=left, seed_columns=known, pack=False)
        ceiling_at[point] = partial.bound_milli
        known = list(partial.columns)
    ceiling = np.minimum(arrived[:n], solution.bound_milli)
    for i in picks.tolist():
        ceiling[i] = min(int(arrived[i]), ceiling_at[min(p for p in ceiling_at if p >= i)])
    seconds = time.perf_counter() - started
    heuristic = np.cumsum(np.where(heuristic_kept, requested[:n], 0))
    found = np.cumsum(np.where(_earliest(prefix, instance, solution.kept), requested[:n], 0))
    best_fit = replay.unallocated_at_100(arrived[:n], heuristic, capacity)
    packed = replay.unallocated_at_100(arrived[:n], found, capacity)
    return BoundRun(
        trace=trace_name,
        seed=seed,
        lower_bound_unallocated_pct=round(replay.unallocated_at_100(arrived[:n], ceiling, capacity), 4),
        offline_heuristic_unallocated_pct=round(min(best_fit, packed), 4),
        best_fit_unallocated_pct=round(best_fit, 4),
        exact=solution.exact,
        solve_seconds=round(seconds, 2),
    )


@dataclass(frozen=True, slots=True)
class BoundSpec:
    source: runner.Source
    seed: int
    tune: float = 1.3
    time_limit: float = 900.0


def execute(spec: BoundSpec) -> BoundRun:
    """One (trace, seed): the workload the simulator would replay, bounded."""
    nodes, pods = runner.load_source(spec.source)
    capacity = sum(node.gpu_count for node in nodes) * _MILLI
    workload = replay.build_workload(pods.pods, capacity, len(nodes), spec.tune, spec.seed)
    return bound_run(nodes, workload, spec.source.label, spec.seed, time_limit=spec.time_limit)


def execute_all(
    specs: Sequence[BoundSpec], jobs: int = 1, on_done: Callable[[list[BoundRun]], None] | None = None
) -> list[BoundRun]:
    """Every spec, in worker processes when `jobs` > 1; results in the order of `specs`. `on_done` sees
    the runs finished so far (in order) after each one, so a long table can be saved as it grows."""
    finished: list[BoundRun] = []
    if jobs <= 1 or len(specs) <= 1:
        for spec in specs:
            finished.append(execute(spec))
            if on_done:
                on_done(finished)
        return finished
    with ProcessPoolExecutor(max_workers=min(jobs, len(specs))) as pool:
        for run in pool.map(execute, specs):
            finished.append(run)
            if on_done:
                on_done(finished)
    return finished
