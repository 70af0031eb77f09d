"""Gangs in the simulator: jobs of single pods and of gangs arriving over time, placed by a gang
policy, and the figures a training user cares about.

The openb traces have no gangs, so the workload is generated (`workload`, docs/simulation.md states
the distribution): jobs arrive as a Poisson process and run for a log-normal time; a share of them
are gangs of 2 to 16 members, each member one whole GPU, two whole GPUs or half a GPU; the others
are single pods drawn like the synthetic workload's. Every member of a gang arrives with it.

Gang policies (`POLICIES`), all over the same fit and ledger:
- `sharegpu`: `core.gangs.plan` with sharegpu's default placement: all or nothing, largest member
  first, packed onto few nodes.
- `volcano`, `kai`: all or nothing, members in their own order, each placed by the peer's own
  per-pod policy (`sim.peers`): what Volcano's and KAI's gang plugins do with their placement.
- `none`: no gang scheduling (kube-scheduler alone, or a GPU-sharing scheduler without gangs):
  each member is placed alone as soon as it fits and holds its GPUs until the whole gang runs.

Waiting jobs are tried in arrival order whenever a job arrives or leaves (a job that does not fit
lets later ones start: backfill, as Volcano and KAI do). A gang runs once all its members are placed,
for its duration, then all leave.

Figures (`GangResult`): time gangs wait (p50, p99), GPU-hours held by gangs not yet running (members
placed while others wait: 0 with gang scheduling), mean allocated GPU %, mean fragmentation (FGD's
measure) while jobs wait, nodes per gang.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from sharegpu.core import devices, fleet, frag, gangs, policies, requests, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from sharegpu.sim import catalog, synthetic

POLICIES = {"sharegpu": policies.DEFAULT, "volcano": "volcano", "kai": "kai-binpack", "none": policies.DEFAULT}
"""Gang policy -> the per-pod placement policy it places members with."""
SIZES = (2, 4, 8, 16)
SIZE_WEIGHTS = (0.35, 0.35, 0.2, 0.1)
MEMBERS = ((1, 1000), (2, 1000), (1, 500))
"""Member shapes: (GPUs, milli-GPU per GPU)."""
MEMBER_WEIGHTS = (0.6, 0.15, 0.25)
TRIES = 64
"""Waiting jobs tried per event (the oldest first)."""


@dataclass(frozen=True, slots=True)
class Job:
    arrival: float
    duration: float
    members: tuple[requests.PodRequest, ...]

    @property
    def gang(self) -> bool:
        return len(self.members) > 1


def workload(seed: int = 0, jobs: int = 1500, gang_share: float = 0.2, mean_gap: float = 20.0) -> list[Job]:
    """Jobs arriving on average every `mean_gap` seconds, a `gang_share` of them gangs."""
    rng = np.random.default_rng(seed)
    singles = synthetic.workload(seed, pods=jobs)
    arrivals = np.cumsum(rng.exponential(mean_gap, size=jobs))
    durations = np.clip(rng.lognormal(np.log(1800.0), 0.8, size=jobs), 60, 7 * 24 * 3600)
    out: list[Job] = []
    for i in range(jobs):
        if rng.random() < gang_share:
            size = int(rng.choice(SIZES, p=SIZE_WEIGHTS))
            count, milli = MEMBERS[int(rng.choice(len(MEMBERS), p=MEMBER_WEIGHTS))]
            members = tuple(
                requests.simple_pod(f"job{i}-w{m}", count=count, milli=milli, cpu_milli=4000 * count)
                for m in range(size)
            )
        else:
            pod = singles.pods[i]
            if not pod.num_gpu:
                continue
            members = (pod.request(f"job{i}"),)
        out.append(Job(float(arrivals[i]), float(durations[i]), members))
    return out


@dataclass(frozen=True, slots=True)
class GangResult:
    policy: str
    seed: int
    jobs: int
    gangs: int
    gangs_run: int
    gang_wait_p50_s: float
    gang_wait_p99_s: float
    single_wait_p50_s: float
    partial_gpu_hours: float
    """GPU-hours held by members of gangs that were not running yet."""
    mean_allocated_gpu_pct: float
    mean_frag_gpu_pct: float
    nodes_per_gang: float
    stuck: int
    """Jobs still waiting when nothing was left running (a deadlock of partial gangs, or no room at all)."""
    wall_seconds: float


class GangReplay:
    """One run: the cluster, the jobs, a gang policy."""

    def __init__(self, nodes: list[devices.NodeInventory], jobs: list[Job], policy: str, seed: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown gang policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy = policy
        self.seed = seed
        self.jobs = jobs
        self.state = fleet.FleetState(nodes)
        self.ledger = core_ledger.Ledger(self.state)
        shapes = frag.typical_shapes([frag.Shape(0, m.demand.milli, m.demand.count) for j in jobs for m in j.members])
        self.placer = core_placer.Placer(self.state, catalog.make(POLICIES[policy], shapes), seed=seed)
        self.frag = frag.FragModel(self.state, shapes)
        self.capacity = int(self.state.milli_capacity.sum())
        self.rows = np.arange(len(self.state), dtype=np.int64)
        self.placed: dict[int, set[str]] = {}
        """Job -> its members placed so far (policy `none` places them one by one)."""
        self.started: dict[int, float] = {}
        self.waiting: list[int] = []
        self.events: list[tuple[float, int, int, int]] = []
        """(time, kind: 0 leave / 1 arrive, order, job): at one moment leaving comes first."""
        self.now = 0.0
        self.partial_milli = 0
        self.partial = 0.0
        self.allocated = 0.0
        self.fragmented = 0.0
        self.busy = 0.0
        self.nodes_used: list[int] = []

    def run(self) -> GangResult:
        began = time.perf_counter()
        for index, job in enumerate(self.jobs):
            heapq.heappush(self.events, (job.arrival, 1, index, index))
        order = len(self.jobs)
        while self.events:
            moment, kind, _, index = heapq.heappop(self.events)
            self._advance(moment)
            if kind == 1:
                self.waiting.append(index)
            else:
                self._leave(index)
            for started in self._try_waiting():
                heapq.heappush(self.events, (self.now + self.jobs[started].duration, 0, order, started))
                order += 1
            if not self.events and self.waiting:
                break  # nothing runs, nothing comes: what still waits never starts
        return self._result(time.perf_counter() - began)

    def _advance(self, moment: float) -> None:
        span = moment - self.now
        if span > 0:
            used = int((self.state.milli_capacity - self.state.milli_free).sum())
            self.partial += span * self.partial_milli
            self.allocated += span * used
            if self.waiting:
                self.fragmented += span * float(self.frag.current(self.rows).sum())
                self.busy += span
        self.now = moment

    def _try_waiting(self) -> list[int]:
        started: list[int] = []
        for index in list(self.waiting[:TRIES]):
            if self._attempt(index):
                self.waiting.remove(index)
                self.started[index] = self.now
                started.append(index)
        return started

    def _attempt(self, index: int) -> bool:
        job = self.jobs[index]
        if self.policy == "none":
            return self._one_by_one(index, job)
        need = len(job.members)
        plan = gangs.plan(
            self.ledger,
            self.placer,
            job.members,
            need,
            largest_first=self.policy == "sharegpu",
            pack=self.policy == "sharegpu",
        )
        if not plan.status.ok:
            return False
        for alloc in plan.allocations:
            assert self.ledger.assume(alloc).ok
        if job.gang:
            self.nodes_used.append(plan.nodes)
        return True

    def _one_by_one(self, index: int, job: Job) -> bool:
        done = self.placed.setdefault(index, set())
        for member in job.members:
            if member.key in done:
                continue
            if self.placer.place(self.ledger, member).status.ok:
                done.add(member.key)
                self.partial_milli += member.demand.gpu_milli_total
        if len(done) < len(job.members):
            return False
        self.partial_milli -= sum(m.demand.gpu_milli_total for m in job.members)
        if job.gang:
            self.nodes_used.append(len({self.ledger.get(m.key).alloc.node for m in job.members}))  # type: ignore[union-attr]
        del self.placed[index]
        return True

    def _leave(self, index: int) -> None:
        for member in self.jobs[index].members:
            self.ledger.forget(member.key)

    def _result(self, wall: float) -> GangResult:
        gang_waits = [self.started[i] - j.arrival for i, j in enumerate(self.jobs) if j.gang and i in self.started]
        single_waits = [
            self.started[i] - j.arrival for i, j in enumerate(self.jobs) if not j.gang and i in self.started
        ]
        horizon = max(self.now, 1e-9)
        return GangResult(
            policy=self.policy,
            seed=self.seed,
            jobs=len(self.jobs),
            gangs=sum(1 for j in self.jobs if j.gang),
            gangs_run=len(gang_waits),
            gang_wait_p50_s=_pct(gang_waits, 50),
            gang_wait_p99_s=_pct(gang_waits, 99),
            single_wait_p50_s=_pct(single_waits, 50),
            partial_gpu_hours=self.partial / units.MILLI_PER_GPU / 3600,
            mean_allocated_gpu_pct=100 * self.allocated / horizon / self.capacity,
            mean_frag_gpu_pct=100 * self.fragmented / self.busy / self.capacity if self.busy else 0.0,
            nodes_per_gang=float(np.mean(self.nodes_used)) if self.nodes_used else 0.0,
            stuck=len(self.waiting),
            wall_seconds=wall,
        )


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def run(policy: str, seed: int = 0, jobs: int = 1500, gang_share: float = 0.2, mean_gap: float = 20.0) -> GangResult:
    """One run on the synthetic cluster."""
    return GangReplay(synthetic.cluster(), workload(seed, jobs, gang_share, mean_gap), policy, seed).run()
