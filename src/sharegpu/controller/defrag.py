"""The defragmenter in the cluster: plan moves for pending GPU pods, and evict through the Eviction API.

The reconciler (`DefragReconciler`), on every replica, keeps what its informers show: Nodes,
Devices, every pod (as `defrag_inputs.PodFacts`) and PodDisruptionBudgets (`policy/v1`). From those,
each pass builds the planner's inputs (`defrag_inputs.inputs`: the fleet as the extender rebuilds it,
the tenants, the pending pods, each budget's allowance) and asks the planner (`core.defrag.plan`)
for moves that let the pending pods in; the hourly budget is counted here. `defrag_wording` puts
the plans in words.

Safety rules on top of the planner's: only a pod whose controller owner recreates it elsewhere is
ever a victim (not one without an owner, not a DaemonSet's or a Node's, nothing of sharegpu's namespaces:
`PodFacts.movable`); only pods kube-scheduler marked Unschedulable are planned for, and a pod that
had a move is left alone for `cooldown` seconds (its victims are leaving, the scheduler needs a moment),
and the room the move counted on (the pod's, and each victim's new place) is held in the plans of
those seconds (`promised`), so no later move takes it.

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
plan at most every so often, not back to back. A replica that starts leading (first or again)
recalls the hour's evictions from their Events (`recall`), keeping its own that have none. An
event that could not be written (the API server restarting) does not stop a move: the move goes
on, and the event is written at a later pass (`Recorder.tell`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sharegpu.api import events, paths, pods, wire
from sharegpu.controller import defrag_inputs, defrag_wording
from sharegpu.core import allocation, defrag, errors, units
from sharegpu.kube import client, informer, reconcile
from sharegpu.kube import errors as kube_errors
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)

HOUR = 3600.0
EVICTED = "DefragEvicted"
"""The reason of the Event on each evicted pod; the hourly budget is recalled from them."""
EVENTS = "/api/v1/events"
REST_FACTOR = 4.0
"""The defragmenter's loop rests this many times as long as its last pass took (at most a fifth
of a core for planning, however often it is woken)."""


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
        self.nodes: dict[str, defrag_inputs.NodeView] = {}
        self.devices: dict[str, wire.Device] = {}
        self.pods: dict[units.PodKey, defrag_inputs.PodFacts] = {}
        self.budgets: dict[str, wire.PodDisruptionBudget] = {}
        self.evicted_at: deque[float] = deque()
        self.moved_for: dict[units.PodKey, float] = {}
        """Pending pods that had a move, and when."""
        self.promised: dict[units.PodKey, tuple[float, allocation.Allocation]] = {}
        """The room each carried-out move counted on, held for `cooldown` seconds in the plans that
        follow (when it was promised, what): where its pending pod goes, and where each victim's
        replacement fits; that room is taken by no later move while they are on their way."""
        self.counters = Counters()
        self.recalled = False
        """The evictions of the last hour were read back from the API's Events (once a term, before
        its first eviction: a new leader inherits its predecessors' hourly budget, also a replica that
        leads again after another led meanwhile)."""
        self.unrecorded: deque[float] = deque()
        """When this process evicted without an Event known to be written (the answer lost, or the
        event refused so far): a recall cannot see these, so it keeps them."""
        self.last_plan: defrag.Plan | None = None
        self.changes = 0
        """Informer events seen (any of them may change the plan)."""
        self._planned: tuple[object, ...] | None = None
        """What the last plan depended on (`_basis`); the same again: no new plan."""
        self.loop = reconcile.Loop("defrag", self.reconcile, rest_factor=REST_FACTOR)

    def informers(self) -> list[informer.Informer[Any, Any]]:
        """Its own informers: pods (as `defrag_inputs.PodFacts`), Nodes and PodDisruptionBudgets (Devices come
        from the controller's informer, through `on_device`)."""
        return [
            informer.Informer(self.api, paths.PODS, wire.Pod, defrag_inputs.facts, self.on_pod,
                              name="defrag-pods"),
            informer.Informer(self.api, paths.NODES, wire.Node, defrag_inputs.node_view, self.on_node,
                              name="defrag-nodes"),
            informer.Informer(self.api, paths.pod_disruption_budgets(), wire.PodDisruptionBudget,
                              informer.identity, self.on_budget, name="poddisruptionbudgets"),
        ]  # fmt: skip

    def new_term(self) -> None:
        """This replica leads (again): the hour's evictions are recalled before it evicts, as others
        may have evicted while it did not lead."""
        self.recalled = False

    # ----------------------------------------------------------------- informer handlers

    def on_pod(self, kind: wire.EventType, item: defrag_inputs.PodFacts) -> None:
        self.changes += 1
        if kind == wire.EventType.DELETED:
            self.pods.pop(item.record.key, None)
            self.moved_for.pop(item.record.key, None)
        else:
            self.pods[item.record.key] = item
        if item.pending:
            self.loop.wake()

    def on_node(self, kind: wire.EventType, node: defrag_inputs.NodeView) -> None:
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
        while self.unrecorded and self.unrecorded[0] <= now - HOUR:
            self.unrecorded.popleft()
        # Replaced, not merged: this process's own recorded evictions are among the Events read.
        self.evicted_at = deque(sorted([*recalled, *self.unrecorded]))
        self.recalled = True
        if recalled:
            log.info("defrag: %d eviction(s) of the last hour recalled from Events", len(recalled))

    async def reconcile(self) -> None:
        await self.recorder.retell()
        now = self.clock()
        self.moved_for = {k: at for k, at in self.moved_for.items() if now - at < self.cooldown}
        self.promised = {k: (at, held) for k, (at, held) in self.promised.items() if now - at < self.cooldown}
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
        planned_on = {key: (item.record.uid, item.record.node) for key, item in self.pods.items()}
        found, result = await asyncio.to_thread(
            _work_out, list(self.nodes.values()), list(self.devices.values()), list(self.pods.values()),
            list(self.budgets.values()), frozenset(self.moved_for), allowed,
            [held for _, held in self.promised.values()],
        )  # fmt: skip
        self._planned = basis
        self.last_plan = result
        self.counters.pending = len(found.pending)
        self.counters.planned_evictions = result.evictions
        self.counters.planned_gain_milli = result.gain_milli
        if not result.moves:
            return
        for line in defrag_wording.describe(result, allowed):
            log.info("defrag%s: %s", "" if self.evict else " (dry run)", line)
        for move in result.moves:
            if not self.evict:
                await self._report(move)
            elif not await self._carry_out(move, planned_on):
                break  # each move was planned on the ones before it: none after one that stopped

    def _basis(self, allowed: int) -> tuple[object, ...]:
        """Everything a plan depends on (the informer events seen, the evictions allowed now, the
        cool-downs, the evictions made and refused): the same basis, the same plan."""
        return (self.changes, allowed, frozenset(self.moved_for), frozenset(self.promised), self.counters.evictions,
                self.counters.refused)  # fmt: skip

    async def _report(self, move: defrag.Move) -> None:
        item = self.pods.get(move.pod)
        if item is None:
            return
        victims = ", ".join(defrag_wording.victim_text(v) for v in move.victims)
        message = f"dry run: evicting {victims} would let this pod fit on {move.placed.node}"
        decision = "|".join(sorted(v.pod for v in move.victims))
        await self.recorder.tell(_subject(item), "DefragPlanned", message, decision=decision)

    def _still_pending(self, move: defrag.Move, planned_on: Mapping[units.PodKey, tuple[str, str]]) -> bool:
        pending = self.pods.get(move.pod)
        return not (pending is None or pending.record.node or (pending.record.uid, "") != planned_on.get(move.pod))

    async def _carry_out(self, move: defrag.Move, planned_on: Mapping[units.PodKey, tuple[str, str]]) -> bool:
        """Evict the move's victims, one by one; a refusal ends the move (the next pass plans again).
        The plan was worked out over what the watch showed when it began (`planned_on`: each pod's
        UID and node then): a pending pod bound, deleted or made again since (looked at before each
        eviction), or a victim made again or moved since, ends the move before anything more is
        evicted for it. True if every victim was evicted (the moves planned after it may go on)."""
        if not self._still_pending(move, planned_on):
            log.info("defrag: %s changed while its move was planned; planning again", move.pod)
            return False
        done = []
        whole = True
        for victim in move.victims:
            if not self._still_pending(move, planned_on):
                log.info("defrag: %s placed or gone while its move was carried out; planning again", move.pod)
                whole = False
                break
            item = self.pods.get(victim.pod)
            if item is None:
                continue
            now = (item.record.uid, item.record.node)
            if now != planned_on.get(victim.pod) or item.record.node != victim.before.node:
                log.info("defrag: %s changed while the move for %s was planned; planning again", victim.pod, move.pod)
                whole = False
                break
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
                    self.unrecorded.append(self.clock())
                    self.counters.unknown += 1
                    log.warning("defrag: eviction of %s: outcome unknown (%s); planning again", victim.pod, exc)
                whole = False
                break
            self.evicted_at.append(self.clock())
            self.counters.evictions += 1
            self.promised[victim.pod] = (self.clock(), victim.after)
            done.append(victim)
            message = f"evicted to make room for {move.pod} on {move.placed.node}; {victim.owner} recreates it"
            if not await self.recorder.tell(_subject(item), EVICTED, message, decision=move.pod):
                self.unrecorded.append(self.evicted_at[-1])
        if not done:
            return whole
        self.moved_for[move.pod] = self.clock()
        self.promised[move.pod] = (self.clock(), move.placed)
        pending = self.pods.get(move.pod)
        if pending is not None:
            evicted = ", ".join(defrag_wording.victim_text(v) for v in done)
            message = f"evicted {evicted} so that this pod fits on {move.placed.node}"
            await self.recorder.tell(
                _subject(pending), "DefragMoved", message, decision="|".join(sorted(v.pod for v in done))
            )
        return whole


def _work_out(
    nodes: list[defrag_inputs.NodeView],
    devices_: list[wire.Device],
    pod_facts: list[defrag_inputs.PodFacts],
    budgets: list[wire.PodDisruptionBudget],
    skip: frozenset[units.PodKey],
    allowed: int,
    promised: list[allocation.Allocation],
) -> tuple[defrag_inputs.Inputs, defrag.Plan]:
    """The planner's inputs and its plan (in a worker thread: it reads only the frozen values given)."""
    found = defrag_inputs.inputs(nodes, devices_, pod_facts, budgets, skip=skip, promised=promised)
    return found, defrag_inputs.plan(found, allowed)


def _subject(item: defrag_inputs.PodFacts) -> events.Subject:
    namespace, _, name = item.record.key.partition("/")
    return events.pod(namespace, name, item.record.uid)
