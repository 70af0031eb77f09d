"""Replaying a workload through the placement core.

Static mode is the FGD paper's experiment: pods only arrive, one at a time, in a shuffled and
resampled order (`build_workload`); a pod that fits nowhere fails for good. After every arrival we
record the GPU compute that has arrived and the compute allocated; the headline figure is the
unallocated GPU % where the arrived request equals 100% of capacity.

Dynamic mode uses the trace's creation and deletion times on a virtual clock: pods arrive, wait in
a FIFO queue when nothing fits (retried whenever something leaves), run for their recorded duration
and leave; a time scale compresses arrivals to raise the load. It reports allocation over time and
waiting times, which is what a real cluster sees.

Dynamic mode can also defragment (`defrag_budget_per_hour`): when pods wait, the defragmenter's
planner (`core.defrag`, the code the controller runs) moves running pods out of their way, within a
number of evictions per hour of virtual time; every simulated pod counts as movable (a controller
would recreate it) and all have the same priority.

Both modes drive the real `Placer` and `Ledger`: the very code the extender runs.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from sharegpu.core import defrag, devices, fleet, frag, requests, scoring, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from sharegpu.sim import trace

DEFRAG_LOOKAHEAD = 8
"""Dynamic mode with defragmentation: waiting pods (in queue order) the planner is asked about at once."""
DEFRAG_EVERY = 60.0
"""Virtual seconds between two planning passes (the controller also plans on a period, not per event)."""


@dataclass(frozen=True, slots=True)
class Workload:
    pods: tuple[trace.TracePod, ...]
    node_priority: fleet.IntArray


def build_workload(
    pods: tuple[trace.TracePod, ...], capacity_milli: int, node_count: int, tune: float, seed: int
) -> Workload:
    """The paper's arrival sequence for one seed.

    The trace's pods, shuffled, come first; then pods drawn with replacement, until the next draw
    would push the total GPU request past `tune` x capacity. A node priority order (a random
    permutation, fixed for the run) breaks score ties.
    """
    if tune <= 0:
        raise ValueError(f"tune must be > 0, got {tune}")
    if not any(pod.gpu_milli_total for pod in pods):
        raise ValueError("no pod asks for a GPU: drawing more would never reach the capacity")
    rng = np.random.default_rng(seed)
    node_priority = rng.permutation(node_count).astype(np.int64)
    target = tune * capacity_milli
    order = rng.permutation(len(pods))
    chosen: list[trace.TracePod] = []
    total = 0
    for index in order.tolist():
        pod = pods[index]
        if total + pod.gpu_milli_total > target:
            break
        chosen.append(pod)
        total += pod.gpu_milli_total
    else:
        while True:
            pod = pods[int(rng.integers(len(pods)))]
            if total + pod.gpu_milli_total > target:
                break
            chosen.append(pod)
            total += pod.gpu_milli_total
    return Workload(tuple(chosen), node_priority)


@dataclass(frozen=True, slots=True)
class StaticResult:
    unallocated_pct_at_100: float
    """100 - mean allocation % over arrivals whose arrived % rounds to 100 (if none does, the first
    arrival past 100%; NaN if the workload never reaches capacity)."""
    arrived_pct: np.ndarray
    allocated_pct: np.ndarray
    frag_pct_at_100: float
    """Fragmented GPU compute as % of capacity at the first arrival reaching 100% arrived."""
    pods: int
    placed: int
    failed: int
    wall_seconds: float


def replay_static(
    nodes: list[devices.NodeInventory],
    workload: Workload,
    policy: scoring.Policy,
    shapes: tuple[frag.WeightedShape, ...],
    seed: int,
    at_100: Callable[[core_ledger.Ledger], None] | None = None,
) -> StaticResult:
    """Place the workload's pods in order; `at_100`, if given, sees the ledger once, at the first
    arrival whose arrived % rounds to 100 (the moment `frag_pct_at_100` is measured)."""
    started = time.perf_counter()
    state = fleet.FleetState(nodes)
    ledger = core_ledger.Ledger(state)
    placer = core_placer.Placer(state, policy, priority=workload.node_priority, seed=seed)
    capacity = state.total_milli
    n = len(workload.pods)
    arrived = np.zeros(n, dtype=np.int64)
    allocated = np.zeros(n, dtype=np.int64)
    total_arrived = 0
    total_allocated = 0
    placed = 0
    frag_at_100 = float("nan")
    frag_model = frag.FragModel(state, shapes)
    all_rows = np.arange(len(state), dtype=np.int64)
    for i, pod in enumerate(workload.pods):
        request = pod.request(f"{pod.name}#{i}")
        total_arrived += pod.gpu_milli_total
        decision = placer.place(ledger, request)
        if decision.status.ok:
            placed += 1
            total_allocated += pod.gpu_milli_total
        arrived[i] = total_arrived
        allocated[i] = total_allocated
        if np.isnan(frag_at_100) and round(total_arrived / capacity * 100) >= 100:
            amount = frag_model.frag(all_rows, state.cpu_free, state.milli_free).sum()
            frag_at_100 = float(amount / capacity * 100)
            if at_100 is not None:
                at_100(ledger)
    return StaticResult(
        unallocated_pct_at_100=unallocated_at_100(arrived, allocated, capacity),
        arrived_pct=arrived / capacity * 100,
        allocated_pct=allocated / capacity * 100,
        frag_pct_at_100=frag_at_100,
        pods=n,
        placed=placed,
        failed=n - placed,
        wall_seconds=time.perf_counter() - started,
    )


def window(arrived: np.ndarray, capacity: int) -> np.ndarray:
    """Indices of the arrivals the headline figure averages over: arrived % rounds to 100.

    Small clusters: one big pod can jump over the whole [99.5, 100.5) window; then the first arrival
    at or past 100% is used. Empty if the workload never reaches capacity.
    """
    picks = np.flatnonzero(np.round(arrived / capacity * 100) == 100)
    if not len(picks):
        picks = np.flatnonzero(arrived >= capacity)[:1]
    return picks


def unallocated_at_100(arrived: np.ndarray, allocated: np.ndarray, capacity: int) -> float:
    """100 - mean allocated % (rounded to 0.01) over the `window` arrivals (the paper's figure); NaN if
    the workload never reaches capacity."""
    picks = window(arrived, capacity)
    if not len(picks):
        return float("nan")
    return float(100 - np.round(allocated[picks] / capacity * 100, 2).mean())


class VirtualClock:
    """Time that moves only when the simulator says so (seconds)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, moment: float) -> None:
        if moment < self.now:
            raise ValueError(f"time cannot go back from {self.now} to {moment}")
        self.now = moment


@dataclass(frozen=True, slots=True)
class DynamicResult:
    times: np.ndarray
    """Event times (seconds since the first arrival)."""
    allocated_pct: np.ndarray
    queued: np.ndarray
    mean_allocated_pct: float
    """Time-weighted mean allocation % between the first and the last arrival."""
    waits: np.ndarray
    """Waiting seconds of every pod that was placed."""
    never_placed: int
    """Pods still waiting when the last placed pod had left (they fit nowhere, even on an idle node)."""
    pods: int
    wall_seconds: float
    evictions: int = 0
    """Running pods the defragmenter moved (0 when it is off)."""
    eviction_times: tuple[float, ...] = ()
    """When each of them was moved (seconds since the first arrival)."""

    @property
    def wait_p50(self) -> float:
        return float(np.percentile(self.waits, 50)) if len(self.waits) else 0.0

    @property
    def wait_p99(self) -> float:
        return float(np.percentile(self.waits, 99)) if len(self.waits) else 0.0


class _Movable(Mapping[units.PodKey, defrag.Tenant]):
    """Every running simulated pod as the planner sees it: movable, priority 0 (built when asked)."""

    def __init__(self, ledger: core_ledger.Ledger, timed: list[trace.TracePod]) -> None:
        self.ledger = ledger
        self.timed = timed
        self.known: dict[units.PodKey, defrag.Tenant] = {}

    def __getitem__(self, key: units.PodKey) -> defrag.Tenant:
        found = self.known.get(key)
        if found is None:
            if key not in self.ledger:
                raise KeyError(key)
            request = self.timed[int(key.rpartition("#")[2])].request(key)
            found = self.known[key] = defrag.Tenant(request, movable=True)
        return found

    def __iter__(self) -> Iterator[units.PodKey]:
        return (key for key, _ in self.ledger.entries())

    def __len__(self) -> int:
        return len(self.ledger)


class Waiting:
    """The pods that fit nowhere, first come first served, kept per demand: a retry tries each
    demand's first pod in turn (in arrival order across demands) and drops a demand once it cannot
    fit, so its cost follows the number of distinct demands waiting, not the number of pods."""

    def __init__(self, demand_of: Callable[[int], requests.GpuDemand]) -> None:
        self.demand_of = demand_of
        self.by_demand: dict[requests.GpuDemand, deque[tuple[int, int]]] = {}
        """Demand -> its waiting pods as (position in the queue, pod index), in order."""
        self.size = 0
        self.next_position = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        """The waiting pods in the order they joined."""
        return (index for _, index in heapq.merge(*self.by_demand.values()))

    def append(self, index: int) -> None:
        self.by_demand.setdefault(self.demand_of(index), deque()).append((self.next_position, index))
        self.next_position += 1
        self.size += 1

    def discard(self, done: set[int]) -> None:
        """Forget the pods of `done` (placed by other means)."""
        for index in done:
            demand = self.demand_of(index)
            pods = self.by_demand[demand]
            pods.remove(next(p for p in pods if p[1] == index))
            if not pods:
                del self.by_demand[demand]
            self.size -= 1

    def retry(self, place: Callable[[int], bool]) -> None:
        """Offer the pods in order to `place`, passing over those that need at least as much as one
        that did not fit (a placement only takes room away)."""
        heads = [(pods[0][0], demand) for demand, pods in self.by_demand.items()]
        heapq.heapify(heads)  # positions are unique: demands are never compared
        no_room: list[requests.GpuDemand] = []
        while heads:
            _, demand = heapq.heappop(heads)
            if any(demand.needs_at_least(other) for other in no_room):
                continue
            pods = self.by_demand[demand]
            if not place(pods[0][1]):
                no_room.append(demand)
                continue
            pods.popleft()
            self.size -= 1
            if pods:
                heapq.heappush(heads, (pods[0][0], demand))
            else:
                del self.by_demand[demand]


@dataclass(order=True)
class _Event:
    at: float
    kind: int  # 0 = departure (frees first), 1 = arrival
    seq: int
    index: int = field(compare=False)


def replay_dynamic(
    nodes: list[devices.NodeInventory],
    pods: tuple[trace.TracePod, ...],
    policy: scoring.Policy,
    seed: int,
    time_scale: float = 1.0,
    *,
    defrag_budget_per_hour: int = 0,
) -> DynamicResult:
    """Arrivals and departures on virtual time, with a FIFO queue for pods that do not fit.

    A pod arrives at its creation time (relative to the first, divided by `time_scale`, which raises
    the offered load without changing run times), runs for its recorded duration (deletion minus
    creation time) once placed, and leaves. A pod that fits nowhere waits; the queue is retried
    whenever a pod leaves. Pods still waiting when the last pod has left were never placed.

    With `defrag_budget_per_hour` > 0, after every event at which pods wait the planner is asked
    for moves that let the first `DEFRAG_LOOKAHEAD` of them in; a move evicts its victims (each
    placed again at once where the plan put it, its run time going on) and places the waiting pod,
    and at most that many evictions happen in any hour of virtual time.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if defrag_budget_per_hour < 0:
        raise ValueError(f"defrag_budget_per_hour must be >= 0, got {defrag_budget_per_hour}")
    started = time.perf_counter()
    timed = [p for p in pods if p.creation_time is not None and p.deletion_time is not None]
    if not timed:
        raise ValueError("dynamic mode needs creation_time and deletion_time in the pod trace")
    first = float(min(p.creation_time or 0 for p in timed))
    arrival = [(float(p.creation_time or 0) - first) / time_scale for p in timed]
    duration = [max(0.0, float((p.deletion_time or 0) - (p.creation_time or 0))) for p in timed]
    state = fleet.FleetState(nodes)
    priority = np.random.default_rng(seed).permutation(len(state)).astype(np.int64)
    placer = core_placer.Placer(state, policy, priority=priority, seed=seed)
    replay = DynamicReplay(state, placer, timed, arrival, duration, defrag_budget_per_hour)
    return replay.run(started)


class DynamicReplay:
    """One dynamic replay (`replay_dynamic` sets it up): the virtual clock, the fleet's ledger, the
    events to come, the waiting pods, and what is measured on the way. `run` plays it out, once."""

    def __init__(
        self,
        state: fleet.FleetState,
        placer: core_placer.Placer,
        timed: list[trace.TracePod],
        arrival: list[float],
        duration: list[float],
        defrag_budget_per_hour: int,
    ) -> None:
        self.state = state
        self.placer = placer
        self.timed = timed
        self.arrival = arrival
        """Virtual arrival time of each pod (seconds since the first arrival)."""
        self.duration = duration
        """How long each pod runs once placed (seconds)."""
        self.defrag_budget_per_hour = defrag_budget_per_hour
        self.clock = VirtualClock(0.0)
        self.ledger = core_ledger.Ledger(state, clock=self.clock)
        self.capacity = state.total_milli
        self.events = [_Event(arrival[i], 1, i, i) for i in range(len(timed))]
        heapq.heapify(self.events)
        self.seq = len(self.events)
        """The next event's tie-breaker (events at one moment come out in the order they were made)."""
        self.made: dict[int, requests.PodRequest] = {}
        """The requests of the pods that arrived and have not left (made once: a waiting pod is tried often)."""
        self.queue = Waiting(self._demand_of)
        self.placed_at: dict[int, float] = {}
        """Running pods: when each was placed."""
        self.allocated_milli = 0
        self.waits: list[float] = []
        self.times: list[float] = []
        self.allocated: list[float] = []
        self.queued: list[int] = []
        # Defragmentation
        self.tenants = _Movable(self.ledger, timed)
        self.evicted_at: deque[float] = deque()
        """Virtual times of the evictions of the last hour."""
        self.eviction_times: list[float] = []
        self.planned_at = -DEFRAG_EVERY

    def request_of(self, index: int) -> requests.PodRequest:
        found = self.made.get(index)
        if found is None:
            found = self.made[index] = self.timed[index].request(f"{self.timed[index].name}#{index}")
        return found

    def _demand_of(self, index: int) -> requests.GpuDemand:
        return self.request_of(index).demand

    def run(self, started: float) -> DynamicResult:
        """Every event in time order: an arrival is placed or waits, a departure frees its room for
        the waiting pods; then the defragmenter may move pods, and the allocation is recorded.
        `started`: `time.perf_counter()` when the replay was asked for (its wall time counts from there)."""
        while self.events:
            event = heapq.heappop(self.events)
            self.clock.advance_to(event.at)
            if event.kind == 1:
                if not self.try_place(event.index):
                    self.queue.append(event.index)
            elif event.index in self.placed_at:
                self.depart(event.index)
            if self.defrag_budget_per_hour and self.queue:
                self.defragment(self.queue)
            self.times.append(self.clock.now)
            self.allocated.append(self.allocated_milli / self.capacity * 100)
            self.queued.append(len(self.queue))
        return self.result(time.perf_counter() - started)

    def try_place(self, index: int, rows: fleet.IntArray | None = None) -> bool:
        """Place the pod (on `rows` only, when given) and start it; False when it fits nowhere."""
        request = self.request_of(index)
        decision = self.placer.place(self.ledger, request, rows)
        if not decision.status.ok:
            return False
        self.ledger.add(self.ledger.get(request.key).alloc)  # type: ignore[union-attr]  # confirm: bound at once
        self._start(index)
        return True

    def _start(self, index: int) -> None:
        """The pod just placed runs from now for its recorded duration."""
        now = self.clock.now
        self.placed_at[index] = now
        self.waits.append(now - self.arrival[index])
        self.allocated_milli += self.timed[index].gpu_milli_total
        heapq.heappush(self.events, _Event(now + self.duration[index], 0, self.seq, index))
        self.seq += 1

    def depart(self, index: int) -> None:
        """The pod leaves; the waiting pods are tried on the node it freed."""
        pod = self.timed[index]
        key = units.PodKey(f"{pod.name}#{index}")
        entry = self.ledger.get(key)
        assert entry is not None
        freed = np.array([self.state.row_of[entry.alloc.node]], dtype=np.int64)
        self.ledger.remove(key)
        self.allocated_milli -= pod.gpu_milli_total
        del self.placed_at[index]
        del self.made[index]
        # Only the freed node gained room, and every queued pod fitted nowhere when last tried:
        # retry them in FIFO order on that node alone.
        self.queue.retry(functools.partial(self.try_place, rows=freed))

    def defragment(self, waiting: Waiting) -> None:
        """Plan for the first waiting pods and apply the moves (the pods moved in leave `waiting`)."""
        now = self.clock.now
        if now < self.planned_at + DEFRAG_EVERY:
            return
        while self.evicted_at and self.evicted_at[0] <= now - 3600.0:
            self.evicted_at.popleft()
        allowance = self.defrag_budget_per_hour - len(self.evicted_at)
        if allowance <= 0:
            return
        self.planned_at = now
        heads = list(itertools.islice(waiting, DEFRAG_LOOKAHEAD))
        pending = [defrag.Pending(self.request_of(i)) for i in heads]
        plan = defrag.plan(self.ledger, self.placer, self.tenants, pending, defrag.Limits(allowance))
        done: set[int] = set()
        for move in plan.moves:
            done.add(self._apply(move))
        waiting.discard(done)

    def _apply(self, move: defrag.Move) -> int:
        """Evict the move's victims, place them again where the plan put them, and start the waiting
        pod it was for (returned: its index)."""
        for victim in move.victims:
            self.ledger.remove(victim.pod)
            self.evicted_at.append(self.clock.now)
            self.eviction_times.append(self.clock.now)
        index = int(move.pod.rpartition("#")[2])
        result = self.ledger.add(move.placed)
        assert result.ok, result
        for victim in move.victims:
            result = self.ledger.add(victim.after)
            assert result.ok, result
        self._start(index)
        return index

    def result(self, wall_seconds: float) -> DynamicResult:
        """What the replay measured; the mean allocation is weighted by time up to the last arrival."""
        t = np.array(self.times)
        a = np.array(self.allocated)
        arriving = t <= max(self.arrival)
        tw, aw = t[arriving], a[arriving]
        span = tw[-1] - tw[0] if len(tw) > 1 else 0.0
        mean_alloc = float(np.sum(aw[:-1] * np.diff(tw)) / span) if span > 0 else float(aw.mean() if len(aw) else 0.0)
        return DynamicResult(
            times=t,
            allocated_pct=a,
            queued=np.array(self.queued),
            mean_allocated_pct=mean_alloc,
            waits=np.array(self.waits),
            never_placed=len(self.timed) - len(self.waits),
            pods=len(self.timed),
            wall_seconds=wall_seconds,
            evictions=len(self.eviction_times),
            eviction_times=tuple(self.eviction_times),
        )
