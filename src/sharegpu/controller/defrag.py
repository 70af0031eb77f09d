"""The defragmenter in the cluster: plan moves for pending GPU pods, and evict through the Eviction API.

What it reads (informers, on every replica): Nodes (allocatable CPU and memory, readiness), Devices
(the GPUs), every pod (`PodFacts`: the `api.pods.Record` placement uses, its controller owner, its
priority, its labels, whether kube-scheduler found it Unschedulable) and PodDisruptionBudgets
(`policy/v1`). From those, each pass rebuilds the
fleet as the extender does after a start (GPU allocations from the pods' allocation annotations,
host CPU and memory of every other bound pod) and asks the planner (`core.defrag.plan`) for moves
that let the pending pods in. The PodDisruptionBudgets give each group's allowance
(`status.disruptionsAllowed`, kept by kube-controller-manager); the hourly budget is counted here.

Safety rules on top of the planner's: only a pod whose controller owner recreates it elsewhere is
ever a victim (not one without an owner, not a DaemonSet's or a Node's, nothing in sharegpu-system);
only pods kube-scheduler marked Unschedulable are planned for, and a pod that had a move is left
alone for `cooldown` seconds (its victims are leaving, the scheduler needs a moment).

Dry run (`evict=False`) reports each plan (a log line, a `DefragPlanned` event on the pending pod,
the gauges on /metrics) and evicts nothing. Evicting (`evict=True`) POSTs an Eviction (`policy/v1`)
per victim: the API server checks the
PodDisruptionBudgets again, and a refusal (429) ends that move; the next pass plans again from what
the informers then show. The defragmenter never deletes a pod itself.

Runs on the controller's Lease holder only. The informers' handlers and the pass's bookkeeping run
in the event loop; the plan itself (rebuilding the fleet and searching for moves: seconds at tens of
thousands of pods) runs in a worker thread over a snapshot of the informers' values, which are
frozen, so meanwhile the loop keeps renewing the Lease, answering /readyz and feeding every
informer. A pass plans only when something it depends on changed since the last plan (an informer
event, the hour's allowance, a cool-down ending, an eviction made or refused): pods that stay
pending because the cluster is full cost nothing after the first plan. Its loop rests
`REST_FACTOR` times as long as a pass took, so a busy cluster that changes all the time gets a
plan at most every so often, not back to back. A new leader recalls the hour's evictions from
their Events (`recall`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sharegpu.api import constraints, events, names, paths, pods, wire
from sharegpu.api import devices as api_devices
from sharegpu.core import allocation, defrag, devices, errors, fleet, ledger, placer, policies, units
from sharegpu.kube import client, informer, reconcile
from sharegpu.kube import errors as kube_errors
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)

NOT_RECREATED_ELSEWHERE = frozenset({"DaemonSet", "Node"})
"""Controller owners whose pods come back on the same node (a DaemonSet's) or not at all (a static
pod's mirror, owned by its Node): moving them frees nothing."""
PLACEMENT_POLICY = "bestfit"
"""The policy the planner places with to prove every victim fits elsewhere (it needs no pod shapes;
the extender decides again, with its own policy, when the victim is recreated)."""
HOUR = 3600.0
EVICTED = "DefragEvicted"
"""The reason of the Event on each evicted pod; the hourly budget is recalled from them."""
EVENTS = "/api/v1/events"
REST_FACTOR = 4.0
"""The defragmenter's loop rests this many times as long as its last pass took (at most a fifth
of a core for planning, however often it is woken)."""


@dataclass(frozen=True, slots=True)
class PodFacts:
    """A pod as the defragmenter needs it (built once per watch event)."""

    record: pods.Record
    owner: str
    """`Kind/name` of its controller owner; "" when it has none."""
    owner_kind: str
    priority: int
    labels: Mapping[str, str]
    unschedulable: bool
    """kube-scheduler's PodScheduled condition is False with reason Unschedulable."""
    terms: constraints.PodTerms
    """Its nodeSelector, required node affinity and tolerations."""

    @property
    def namespace(self) -> str:
        return self.record.key.partition("/")[0]

    @property
    def movable(self) -> bool:
        return (
            bool(self.owner)
            and self.owner_kind not in NOT_RECREATED_ELSEWHERE
            and (self.namespace != names.SYSTEM_NAMESPACE)
        )

    @property
    def pending(self) -> bool:
        r = self.record
        return (
            self.unschedulable and r.request is not None and r.request.demand.count > 0 and not r.node
            and not r.terminal and not r.deleting and r.scheduler == names.SCHEDULER_NAME
        )  # fmt: skip


def facts(pod: wire.Pod, previous: PodFacts | None = None) -> PodFacts:
    owner = next((o for o in pod.metadata.owner_references if o.controller), None)
    unschedulable = any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable" for c in pod.status.conditions
    )
    return PodFacts(
        record=pods.record(pod, previous.record if previous is not None else None),
        owner=f"{owner.kind}/{owner.name}" if owner is not None else "",
        owner_kind=owner.kind if owner is not None else "",
        priority=pod.spec.priority or 0,
        labels=dict(pod.metadata.labels),
        unschedulable=unschedulable,
        terms=constraints.PodTerms.of(pod.spec),
    )


# ----------------------------------------------------------------- the planner's inputs, from API objects


@dataclass(frozen=True, slots=True)
class NodeView:
    """A Node as the planner needs it: room and readiness, and what pods' constraints look at."""

    facts: api_devices.NodeFacts
    terms: constraints.NodeTerms


def node_view(node: wire.Node, previous: NodeView | None = None) -> NodeView:
    return NodeView(api_devices.node_facts(node), constraints.NodeTerms.of(node))


class _Reach:
    """The nodes pods' constraints let them run on: None (any) when a pod has none and no node is
    tainted; otherwise worked out once per distinct set of constraints, not once per pod."""

    def __init__(self, nodes: Mapping[str, NodeView]) -> None:
        self.nodes = nodes
        self.tainted = any(n.terms.taints for n in nodes.values())
        self.known: dict[bytes, frozenset[str]] = {}

    def __call__(self, terms: constraints.PodTerms) -> frozenset[str] | None:
        if terms.unconstrained and not self.tainted:
            return None
        key = terms.key
        found = self.known.get(key)
        if found is None:
            found = self.known[key] = frozenset(name for name, n in self.nodes.items() if terms.allows(n.terms))
        return found


@dataclass(frozen=True, slots=True)
class Inputs:
    book: ledger.Ledger
    chooser: placer.Placer
    tenants: Mapping[units.PodKey, defrag.Tenant]
    pending: tuple[defrag.Pending, ...]
    allowances: Mapping[str, int]
    """Per PodDisruptionBudget (`namespace/name`), the disruptions it allows now."""


def inputs(
    nodes: Iterable[NodeView],
    devices_: Iterable[wire.Device],
    pod_facts: Iterable[PodFacts],
    budgets: Iterable[wire.PodDisruptionBudget],
    *,
    skip: frozenset[units.PodKey] = frozenset(),
) -> Inputs:
    """The fleet and the planner's inputs from what the API holds; pods in `skip` are not planned for."""
    ready = {n.facts.name: n for n in nodes if n.facts.schedulable}
    reach = _Reach(ready)
    inventories: list[devices.NodeInventory] = []
    for device in sorted(devices_, key=lambda d: d.metadata.name):
        view = ready.get(device.metadata.name)
        if view is None:
            continue
        try:
            inventories.append(api_devices.inventory(device, view.facts))
        except errors.InvalidInputError as exc:
            log.warning("defrag: ignoring node %s: %s", device.metadata.name, exc)
    state = fleet.FleetState(inventories)
    book = ledger.Ledger(state)
    chooser = placer.Placer(state, policies.make(PLACEMENT_POLICY))
    groups = {wire.key(b.metadata): b for b in budgets}
    allocations: list[allocation.Allocation] = []
    tenants: dict[units.PodKey, defrag.Tenant] = {}
    pending: list[defrag.Pending] = []
    for item in pod_facts:
        r = item.record
        if item.pending and r.key not in skip and r.request is not None:
            pending.append(defrag.Pending(r.request, item.priority, reach(item.terms)))
        if not r.live or state.row(r.node) is None:
            continue
        alloc = r.allocation if r.allocation is not None and r.allocation.node == r.node else None
        if alloc is None:  # host CPU and memory only (GPUs of other schedulers are not counted)
            alloc = allocation.Allocation(r.key, units.NodeName(r.node), cpu_milli=r.cpu_milli, memory_mib=r.memory_mib)
        allocations.append(alloc)
        if r.request is not None and alloc.gpu_usage():
            covering = tuple(
                key for key, b in groups.items()
                if b.metadata.namespace == item.namespace and _selects(b, item.labels)
            )  # fmt: skip
            allowed = reach(item.terms)
            tenants[r.key] = defrag.Tenant(r.request, item.movable, item.priority, covering, item.owner, allowed)
    for alloc, result in zip(allocations, book.load(allocations), strict=True):
        if not result.ok:
            log.warning("defrag: pod %s does not fit the ledger: %s", alloc.pod, result.message)
    allowances = {key: b.status.disruptions_allowed for key, b in groups.items()}
    return Inputs(book, chooser, tenants, tuple(pending), allowances)


def _selects(budget: wire.PodDisruptionBudget, labels: Mapping[str, str]) -> bool:
    """Whether the budget covers a pod with `labels`. No selector: none; an empty one: every pod of
    the namespace (policy/v1's reading, the stricter one)."""
    selector = budget.spec.selector
    return selector is not None and wire.selects(selector, labels)


def plan(found: Inputs, evictions: int) -> defrag.Plan:
    return defrag.plan(
        found.book, found.chooser, found.tenants, found.pending, defrag.Limits(evictions, found.allowances)
    )


# ----------------------------------------------------------------- words for people


def victim_text(victim: defrag.Victim) -> str:
    gpus = ",".join(f"gpu{i} {m}m" for i, (m, _) in victim.before.gpu_usage().items())
    owner = f", {victim.owner}" if victim.owner else ""
    return f"{victim.pod} ({victim.before.node} {gpus}{owner})"


def describe(result: defrag.Plan, evictions: int) -> list[str]:
    """The plan in lines: each move, then the pending pods without one, then the totals."""
    lines = []
    for move in result.moves:
        gpus = ",".join(f"gpu{i}" for i in move.placed.gpu_indices)
        lines.append(f"{move.pod}: to {move.placed.node} {gpus} ({move.gain_milli} milli-GPU), evicting:")
        lines.extend(f"  {victim_text(v)} -> fits on {v.after.node}" for v in move.victims)
    lines.extend(f"{s.pod}: no move ({s.why.value}: {s.detail})" for s in result.skipped)
    lines.append(
        f"plan: {result.evictions} eviction(s) of {evictions} allowed, gain {result.gain_milli} milli-GPU "
        f"placed for {len(result.moves)} pending pod(s)"
    )
    return lines


def to_json(result: defrag.Plan, evictions: int) -> dict[str, Any]:
    def alloc(a: allocation.Allocation) -> dict[str, Any]:
        return {"node": a.node, "gpus": [{"index": i, "milli": m} for i, (m, _) in a.gpu_usage().items()]}

    return {
        "moves": [
            {"pod": m.pod, "to": alloc(m.placed), "gainMilli": m.gain_milli,
             "victims": [{"pod": v.pod, "owner": v.owner, "from": alloc(v.before), "fitsOn": v.after.node}
                         for v in m.victims]}
            for m in result.moves
        ],
        "skipped": [{"pod": s.pod, "reason": s.why.value, "detail": s.detail} for s in result.skipped],
        "evictions": result.evictions,
        "evictionsAllowed": evictions,
        "gainMilli": result.gain_milli,
    }  # fmt: skip


# ----------------------------------------------------------------- reading the cluster once (the CLI)


async def snapshot(api: client.KubeApi, *, skip: frozenset[units.PodKey] = frozenset()) -> Inputs:
    """Nodes, Devices, pods and PodDisruptionBudgets, listed once, as the planner's inputs."""
    (nodes, _), (found, _), (listed, _), (budgets, _) = await asyncio.gather(
        api.list_of(paths.NODES, wire.Node),
        api.list_of(paths.DEVICES, wire.Device),
        api.list_of(paths.PODS, wire.Pod),
        api.list_of(paths.pod_disruption_budgets(), wire.PodDisruptionBudget),
    )
    return inputs([node_view(n) for n in nodes], found, [facts(p) for p in listed], budgets, skip=skip)


# ----------------------------------------------------------------- the reconciler


@dataclass
class Counters:
    passes: int = 0
    planned_evictions: int = 0
    """Evictions of the last plan."""
    planned_gain_milli: int = 0
    pending: int = 0
    """Pending pods the last pass planned for."""
    evictions: int = 0
    """Evictions the API server accepted."""
    refused: int = 0
    """Evictions the API server refused (a disruption budget: 429)."""
    unknown: int = 0
    """Evictions whose answer was lost (counted against the hour's allowance: they may have happened)."""


class DefragReconciler:
    def __init__(
        self,
        api: client.KubeApi,
        recorder: kube_events.Recorder,
        clock: Callable[[], float] = time.time,
        *,
        evict: bool = False,
        budget_per_hour: int = 10,
        cooldown: float = 60.0,
    ) -> None:
        if budget_per_hour < 0:
            raise errors.InvalidInputError(
                f"the defragmenter's budget must be >= 0 evictions per hour, got {budget_per_hour}"
            )
        self.api = api
        self.recorder = recorder
        self.clock = clock
        self.evict = evict
        self.budget_per_hour = budget_per_hour
        self.cooldown = cooldown
        self.nodes: dict[str, NodeView] = {}
        self.devices: dict[str, wire.Device] = {}
        self.pods: dict[units.PodKey, PodFacts] = {}
        self.budgets: dict[str, wire.PodDisruptionBudget] = {}
        self.evicted_at: deque[float] = deque()
        self.moved_for: dict[units.PodKey, float] = {}
        """Pending pods that had a move, and when."""
        self.counters = Counters()
        self.recalled = False
        """The evictions of the last hour were read back from the API's Events (once, before the
        first eviction this process makes: a new leader inherits its predecessor's hourly budget)."""
        self.last_plan: defrag.Plan | None = None
        self.changes = 0
        """Informer events seen (any of them may change the plan)."""
        self._planned: tuple[object, ...] | None = None
        """What the last plan depended on (`_basis`); the same again: no new plan."""
        self.loop = reconcile.Loop("defrag", self.reconcile, rest_factor=REST_FACTOR)

    def informers(self) -> list[informer.Informer[Any, Any]]:
        """Its own informers: pods (as `PodFacts`), Nodes and PodDisruptionBudgets (Devices come
        from the controller's informer, through `on_device`)."""
        return [
            informer.Informer(self.api, paths.PODS, wire.Pod, facts, self.on_pod, name="defrag-pods"),
            informer.Informer(self.api, paths.NODES, wire.Node, node_view, self.on_node, name="defrag-nodes"),
            informer.Informer(self.api, paths.pod_disruption_budgets(), wire.PodDisruptionBudget,
                              informer.identity, self.on_budget, name="poddisruptionbudgets"),
        ]  # fmt: skip

    # ----------------------------------------------------------------- informer handlers

    def on_pod(self, kind: wire.EventType, item: PodFacts) -> None:
        self.changes += 1
        if kind == wire.EventType.DELETED:
            self.pods.pop(item.record.key, None)
            self.moved_for.pop(item.record.key, None)
        else:
            self.pods[item.record.key] = item
        if item.pending:
            self.loop.wake()

    def on_node(self, kind: wire.EventType, node: NodeView) -> None:
        self.changes += 1
        if kind == wire.EventType.DELETED:
            self.nodes.pop(node.facts.name, None)
        else:
            self.nodes[node.facts.name] = node

    def on_device(self, kind: wire.EventType, device: wire.Device) -> None:
        self.changes += 1
        if kind == wire.EventType.DELETED:
            self.devices.pop(device.metadata.name, None)
        else:
            self.devices[device.metadata.name] = device

    def on_budget(self, kind: wire.EventType, budget: wire.PodDisruptionBudget) -> None:
        self.changes += 1
        informer.remember(self.budgets, kind, budget)

    # ----------------------------------------------------------------- a pass

    def allowance(self) -> int:
        """Evictions left in the last hour's budget."""
        now = self.clock()
        while self.evicted_at and self.evicted_at[0] <= now - HOUR:
            self.evicted_at.popleft()
        return max(0, self.budget_per_hour - len(self.evicted_at))

    async def recall(self) -> None:
        """Count the evictions sharegpu made in the last hour from their `DefragEvicted` Events (the
        API server keeps Events for an hour by default, the budget's window), so that a restarted or
        newly elected controller does not start with a full budget. Unreadable events count as none
        recalled and are tried again on the next pass."""
        listing = await self.api.get(EVENTS, fieldSelector=f"reason={EVICTED}")
        now = self.clock()
        recalled = []
        for item in listing.get("items") or []:
            if (item.get("source") or {}).get("component") != self.recorder.component:
                continue
            try:
                at = float(wire.seconds(str(item.get("lastTimestamp") or item.get("eventTime") or "")))
            except errors.InvalidInputError:
                continue
            if now - HOUR < at <= now:
                recalled += [at] * max(1, int(item.get("count") or 1))
        merged = sorted([*self.evicted_at, *recalled])
        self.evicted_at = deque(merged)
        self.recalled = True
        if recalled:
            log.info("defrag: %d eviction(s) of the last hour recalled from Events", len(recalled))

    async def reconcile(self) -> None:
        now = self.clock()
        self.moved_for = {k: at for k, at in self.moved_for.items() if now - at < self.cooldown}
        if not any(p.pending and p.record.key not in self.moved_for for p in self.pods.values()):
            self.counters.pending = 0
            return
        if self.evict and not self.recalled:
            try:
                await self.recall()
            except kube_errors.KubeError as exc:
                log.warning("defrag: cannot read the last hour's evictions (%s); not evicting this pass", exc)
                return
        allowed = self.allowance()
        basis = self._basis(allowed)
        if basis == self._planned:
            return  # nothing the plan depends on changed: it would be the same plan
        self.counters.passes += 1
        found, result = await asyncio.to_thread(
            _work_out, list(self.nodes.values()), list(self.devices.values()), list(self.pods.values()),
            list(self.budgets.values()), frozenset(self.moved_for), allowed,
        )  # fmt: skip
        self._planned = basis
        self.last_plan = result
        self.counters.pending = len(found.pending)
        self.counters.planned_evictions = result.evictions
        self.counters.planned_gain_milli = result.gain_milli
        if not result.moves:
            return
        for line in describe(result, allowed):
            log.info("defrag%s: %s", "" if self.evict else " (dry run)", line)
        for move in result.moves:
            if self.evict:
                await self._carry_out(move)
            else:
                await self._report(move)

    def _basis(self, allowed: int) -> tuple[object, ...]:
        """Everything a plan depends on (the informer events seen, the evictions allowed now, the
        cool-downs, the evictions made and refused): the same basis, the same plan."""
        return (self.changes, allowed, frozenset(self.moved_for), self.counters.evictions, self.counters.refused)

    async def _report(self, move: defrag.Move) -> None:
        item = self.pods.get(move.pod)
        if item is None:
            return
        victims = ", ".join(victim_text(v) for v in move.victims)
        message = f"dry run: evicting {victims} would let this pod fit on {move.placed.node}"
        decision = "|".join(sorted(v.pod for v in move.victims))
        await self.recorder.record(_subject(item), "DefragPlanned", message, decision=decision)

    async def _carry_out(self, move: defrag.Move) -> None:
        """Evict the move's victims, one by one; a refusal ends the move (the next pass plans again)."""
        done = []
        for victim in move.victims:
            item = self.pods.get(victim.pod)
            if item is None:
                continue
            namespace, _, name = victim.pod.partition("/")
            body = pods.eviction(victim.pod, item.record.uid)
            try:
                await self.api.create(paths.eviction(namespace, name), body)
            except kube_errors.NotFoundError:
                continue  # gone meanwhile: its room is free anyway
            except errors.SharegpuError as exc:
                if kube_errors.outcome(exc) is kube_errors.Outcome.REFUSED:
                    self.counters.refused += 1
                    log.warning("defrag: eviction of %s refused (%s); planning again", victim.pod, exc)
                else:  # it may have happened: it counts against the hour; the watch shows whether the pod goes
                    self.evicted_at.append(self.clock())
                    self.counters.unknown += 1
                    log.warning("defrag: eviction of %s: outcome unknown (%s); planning again", victim.pod, exc)
                break
            self.evicted_at.append(self.clock())
            self.counters.evictions += 1
            done.append(victim)
            message = f"evicted to make room for {move.pod} on {move.placed.node}; {victim.owner} recreates it"
            await self.recorder.record(_subject(item), EVICTED, message, decision=move.pod)
        if not done:
            return
        self.moved_for[move.pod] = self.clock()
        pending = self.pods.get(move.pod)
        if pending is not None:
            message = f"evicted {', '.join(victim_text(v) for v in done)} so that this pod fits on {move.placed.node}"
            await self.recorder.record(_subject(pending), "DefragMoved", message,
                                       decision="|".join(sorted(v.pod for v in done)))  # fmt: skip


def _work_out(
    nodes: list[NodeView],
    devices_: list[wire.Device],
    pod_facts: list[PodFacts],
    budgets: list[wire.PodDisruptionBudget],
    skip: frozenset[units.PodKey],
    allowed: int,
) -> tuple[Inputs, defrag.Plan]:
    """The planner's inputs and its plan (in a worker thread: it reads only the frozen values given)."""
    found = inputs(nodes, devices_, pod_facts, budgets, skip=skip)
    return found, plan(found, allowed)


def _subject(item: PodFacts) -> events.Subject:
    namespace, _, name = item.record.key.partition("/")
    return events.pod(namespace, name, item.record.uid)
