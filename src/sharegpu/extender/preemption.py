"""Preemption for GPU pods: a pod that fits nowhere takes the GPUs of lower-priority pods.

kube-scheduler's preemption cannot see GPU shares, so the sharegpu profile turns it off and the
extender preempts instead, from its filter (docs/extender.md, "Preemption"):

- **Plan.** When a pod fits on no candidate node, may preempt (its preemption policy is not `Never`,
  and it is none of sharegpu's own pods: a group's holder waits for room) and asks for GPUs,
  `core.victims` works out per candidate node the fewest lower-priority GPU pods whose leaving makes
  it fit, GPU by GPU, and picks the plan that hurts least. Only nodes kube-scheduler offered are
  considered (they passed its own checks: taints, affinity, CPU).
- **Disruption budgets.** The PodDisruptionBudgets (`Budgets`, kept by an informer) weigh as
  kube-scheduler weighs them: victims that would break one (a gang member's companions' included)
  are spared first, and the plan that breaks the fewest wins; they slow preemption, never stop it.
- **Nominate and hold.** The pod is *nominated* on that node: the GPUs it will take are held for it
  (`ClusterCache.hold`), so no other pod is placed there while the victims leave, and its status
  names the node (`nominatedNodeName`). Filter answers the pod "waiting for N preempted pods"
  meanwhile; it preempts nothing more.
- **Victims.** Each gets the `DisruptionTarget` condition (reason `PreemptionByScheduler`), then an
  event `Preempted` (written before the deletion, which waits for it: a victim is never gone
  unexplained), and is deleted with its own grace period, only if it is still the pod with that
  UID. A deletion refused or whose answer was lost, or not sent because the condition or the event
  could not be written (as kube-scheduler, which deletes no victim it could not mark), is tried
  again after `retry` seconds while the pod is still there and not being deleted. The preemptor's
  nominated node and event, when either could not be written, are written again at the next pass.
- **Placed.** Once every victim has gone, the hold ends and the GPUs are assumed for the pod at
  once, in the same step, so nothing else takes them before its next filter. The assumption is the
  ordinary one of filter: its bind confirms it, or it expires. The pod's nominated node is then
  cleared: a change to the pod makes kube-scheduler try it again at once, even when the victims'
  deletions reached kube-scheduler before this cache and its last try was still told to wait. A
  change that could not be written is tried again every `retry` seconds while the pod waits unbound,
  also when the room could not be assumed for it (its node gone) and is only freed for its next try;
  a gang's member too, also once the gang's nomination has ended (its first member planned it).
- **Gangs, whole.** A member of a gang (`api.gangs`) is preempted only with every other running
  member of its gang, wherever they run (`victims.Tenant.companions`), and only when all of them have
  a lower priority than the pod and none of the gang is being placed: a gang is never left partial.
- **Gangs preempting.** A gang whose plan fits nowhere (`consider_gang`, from `extender.gangs`)
  preempts for all its planned members at once, across nodes (`victims.for_gang`): every member's
  room is held, every victim goes, and once all have gone the holds end at the next member's filter,
  which plans the gang into the room in the same step. Its members wait meanwhile ("its gang waits
  for N preempted pods"); a member gone or replaced, or bound some other way, ends the nomination.
  A gang tries at most once every `retry` seconds (its members are filtered one after another).
- **Ends.** A nomination also ends when the pod is gone, bound or replaced, or after `patience`
  seconds (victims that never leave): the hold is released and the pod may plan again. All end when
  this replica stops leading (its kube-scheduler lost the Lease): no victim more is deleted here.

Nominations live in this process only. After a restart (or on a new leader) the victims are already
being deleted: the plan counts lower-priority pods being deleted as gone, so the pod waits for them
again instead of preempting more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sharegpu.api import events, names, paths, pods, wire
from sharegpu.core import errors, fit, requests, units, victims
from sharegpu.core import gangs as core_gangs
from sharegpu.extender import handle as extender_handle
from sharegpu.extender import metrics as extender_metrics
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

log = logging.getLogger(__name__)

RETRY = 3.0
"""Seconds before a victim's deletion is sent again (refused, or its answer lost)."""

PATIENCE = 300.0
"""Seconds a nomination waits for its victims to leave before it is given up."""
GANG_TRIES = 1024
"""How many gangs' last tries to preempt `Preemptor` remembers (to try at most once per `retry`)."""


@dataclass(slots=True, kw_only=True)
class Making:
    """What a nomination (a pod's, or a gang's) keeps of the room it is making: its victims and what
    was done about each."""

    priority: int
    victims: dict[units.PodKey, str]
    """Victims (and pods already leaving) -> their UIDs, until they have gone."""
    since: float
    sent: dict[units.PodKey, float] = field(default_factory=dict)
    """Victims whose deletion was sent -> when."""
    told: set[units.PodKey] = field(default_factory=set)
    """Victims told by an event."""
    announced: bool = False


@dataclass(slots=True, kw_only=True)
class Nomination(Making):
    pod: units.PodKey
    uid: str
    request: requests.PodRequest
    plan: victims.Plan


@dataclass(slots=True, kw_only=True)
class GangNomination(Making):
    gang: str
    uids: dict[units.PodKey, str]
    """The planned members -> their UIDs."""
    plan: victims.GangPlan
    nudged: bool = False

    @property
    def where(self) -> str:
        return ", ".join(self.plan.nodes)


class Budgets:
    """The cluster's PodDisruptionBudgets as preemption weighs them (kept by an informer): which
    select a pod, and how many disruptions each allows now (`status.disruptionsAllowed`, kept by
    kube-controller-manager's disruption controller)."""

    def __init__(self) -> None:
        self.by_namespace: dict[str, dict[str, wire.PodDisruptionBudget]] = {}

    def on_budget(self, kind: wire.EventType, budget: wire.PodDisruptionBudget) -> None:
        meta = budget.metadata
        here = self.by_namespace.setdefault(meta.namespace, {})
        if kind == wire.EventType.DELETED:
            here.pop(meta.name, None)
        else:
            here[meta.name] = budget
        if not here:
            del self.by_namespace[meta.namespace]

    def covering(self, record: pods.Record) -> tuple[str, ...]:
        """The budgets (`namespace/name`) that select the pod (`wire.budget_selects`)."""
        namespace = record.key.split("/", 1)[0]
        here = self.by_namespace.get(namespace)
        if not here:
            return ()
        labels = dict(record.labels)
        return tuple(
            f"{namespace}/{name}" for name, budget in sorted(here.items()) if wire.budget_selects(budget, labels)
        )

    def allowed(self) -> dict[str, int]:
        """Per budget, the disruptions it allows now."""
        return {
            f"{namespace}/{name}": budget.status.disruptions_allowed
            for namespace, here in self.by_namespace.items()
            for name, budget in here.items()
        }


class Preemptor(extender_handle.Reconciler):
    def __init__(
        self,
        handle: extender_handle.Handle,
        *,
        retry: float = RETRY,
        patience: float = PATIENCE,
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        """`is_leader`: whether this replica leads; one that does not deletes no victim and lets go of
        its nominations (its kube-scheduler lost the Lease: the new leader's plans are the ones)."""
        super().__init__(handle)
        self.is_leader = is_leader
        self.budgets = Budgets()
        """Fed by the extender's PodDisruptionBudget informer."""
        self.retry = retry
        self.patience = patience
        self.nominations: dict[units.PodKey, Nomination] = {}
        self.gangs: dict[str, GangNomination] = {}
        self.gang_of: dict[units.PodKey, str] = {}
        """A nominated gang's planned member -> its gang's key."""
        self._gang_tried: dict[str, float] = {}
        """Gang key -> when it last tried to preempt (`consider_gang`), the newest GANG_TRIES."""
        self._unnudged: dict[units.PodKey, tuple[str, float]] = {}
        """Pods whose victims have gone and whose nudge could not be written -> (UID, when it was last
        tried): tried again every `retry` seconds while they wait unbound."""
        self._wake = asyncio.Event()
        self._passing = asyncio.Lock()
        """One pass at a time (the loop's and a caller's)."""

    # ----------------------------------------------------------------- from filter (no I/O)

    def waiting(self, key: units.PodKey, uid: str) -> str | None:
        """For a pod's filter: what it waits for while its victims leave, or None (no nomination, or
        its victims have gone: then the hold is released and the pod is placed as usual)."""
        gang = self.gang_of.get(key)
        if gang is not None:
            return self._waiting_gang(self.gangs[gang], key, uid)
        nomination = self.nominations.get(key)
        if nomination is None:
            return None
        if nomination.uid != uid:
            self._end(nomination, extender_metrics.PreemptionOutcome.REPLACED)
            return None
        left = self._remaining(nomination.victims)
        if left:
            return f"sharegpu: waiting for {len(left)} preempted {_pods(len(left))} to leave {nomination.plan.node}"
        self._end(nomination, extender_metrics.PreemptionOutcome.PLACED)
        return None

    def consider(
        self, pod: wire.Pod, request: requests.PodRequest, rows: np.ndarray, diagnosis: fit.Diagnosis
    ) -> victims.Plan | None:
        """A pod that fits on none of `rows` (fleet rows, aligned with `diagnosis`): nominate it where
        preempting hurts least, if anywhere. The writes follow in `run`."""
        demand = request.demand
        key = pods.key(pod)
        priority = pod.spec.priority or 0
        # sharegpu's own pods preempt no one: a tenant's group holder runs at system-cluster-critical (so
        # that nothing preempts it from under its members), a priority no tenant may take others' GPUs at.
        if demand.count == 0 or pod.spec.preemption_policy == pods.NEVER or not pod.metadata.uid or pods.role(pod):
            return None
        resolvable = [
            int(row)
            for row, kind in zip(rows.tolist(), diagnosis.shortfall.tolist(), strict=True)
            if fit.Shortfall(kind).resolvable
        ]
        if not resolvable:
            return None
        state = self.cache.state
        tenants = self._tenants(set(resolvable), priority)
        allowed = self.budgets.allowed()
        plans = [
            plan
            for row in resolvable
            if any(t.leaving or (t.preemptible and t.priority < priority) for t in tenants.get(row, ()))
            and (plan := victims.on_node(state, row, tenants[row], demand, priority, allowed)) is not None
        ]
        chosen = victims.best(plans, self.cache.placer.priority)
        if chosen is None:
            return None
        leave = {k: self._uid(k) for k in (*chosen.victims, *chosen.leaving)}
        nomination = Nomination(
            pod=key,
            uid=pod.metadata.uid,
            priority=priority,
            request=request,
            plan=chosen,
            victims=leave,
            since=self.clock(),
        )
        self.nominations[key] = nomination
        self.cache.hold(key, chosen.node, chosen.gpus)
        self.metrics.preemptions.labels(extender_metrics.PreemptionOutcome.NOMINATED).inc()
        self.metrics.preempted.inc(len(chosen.victims))
        log.info(
            "pod %s (priority %d) nominated on %s GPUs %s: preempting %s%s%s",
            key, priority, chosen.node, list(chosen.gpus), ", ".join(chosen.victims) or "nothing",
            f" ({chosen.violations} against a disruption budget: nothing else makes room)" if chosen.violations else "",
            f"; waiting for {', '.join(chosen.leaving)}" if chosen.leaving else "",
        )  # fmt: skip
        self._wake.set()
        return chosen

    def _waiting_gang(self, nomination: GangNomination, key: units.PodKey, uid: str) -> str | None:
        if nomination.uids[key] != uid:
            self._end_gang(nomination, extender_metrics.PreemptionOutcome.REPLACED)
            return None
        left = self._remaining(nomination.victims)
        if left:
            return (
                f"sharegpu: its gang {nomination.gang} waits for {len(left)} preempted {_pods(len(left))} "
                f"to leave {nomination.where}"
            )
        # The gang is planned into the room in this same filter.
        self._end_gang(nomination, extender_metrics.PreemptionOutcome.PLACED)
        return None

    def consider_gang(
        self, gang: str, members: Sequence[pods.Record], plan: Callable[[], core_gangs.Plan]
    ) -> victims.GangPlan | None:
        """A gang whose `plan` (over the live ledger) fits nowhere now: nominate its `members` where
        preempting hurts least, if anywhere (at most once every `retry` seconds). The writes follow in
        `run`."""
        found = self.gangs.get(gang)
        if found is not None:
            return found.plan
        if not members or any(not m.preempts or not m.uid for m in members):
            return None
        now = self.clock()
        if now - self._gang_tried.get(gang, -self.retry) < self.retry:
            return None
        self._gang_tried.pop(gang, None)
        self._gang_tried[gang] = now
        while len(self._gang_tried) > GANG_TRIES:
            del self._gang_tried[next(iter(self._gang_tried))]
        priority = min(m.priority for m in members)
        tenants = [t for row in self._tenants(None, priority).values() for t in row]
        if not any(t.leaving or (t.preemptible and t.priority < priority) for t in tenants):
            return None
        chosen = victims.for_gang(self.cache.state, tenants, plan, priority, self.budgets.allowed())
        if chosen is None:
            return None
        uids = {m.key: m.uid for m in members}
        leave = {k: self._uid(k) for k in (*chosen.victims, *chosen.leaving)}
        nomination = GangNomination(
            gang=gang,
            priority=priority,
            uids={a.pod: uids[a.pod] for a in chosen.allocations},
            plan=chosen,
            victims=leave,
            since=now,
        )
        self.gangs[gang] = nomination
        for alloc in chosen.allocations:
            self.gang_of[alloc.pod] = gang
            self.cache.hold(alloc.pod, alloc.node, tuple(sorted(alloc.gpu_usage())))
        self.metrics.preemptions.labels(extender_metrics.PreemptionOutcome.NOMINATED).inc()
        self.metrics.preempted.inc(len(chosen.victims))
        log.info(
            "gang %s (priority %d) nominated on %s: preempting %s%s",
            gang, priority, nomination.where, ", ".join(chosen.victims) or "nothing",
            f"; waiting for {', '.join(chosen.leaving)}" if chosen.leaving else "",
        )  # fmt: skip
        self._wake.set()
        return chosen

    def _end_gang(self, nomination: GangNomination, why: extender_metrics.PreemptionOutcome) -> None:
        self.gangs.pop(nomination.gang, None)
        for key in nomination.uids:
            if self.gang_of.get(key) == nomination.gang:
                del self.gang_of[key]
            self.cache.release(key)
        self.metrics.preemptions.labels(why).inc()
        log.info("nomination of gang %s on %s ended: %s", nomination.gang, nomination.where, why)

    def _uid(self, key: units.PodKey) -> str:
        record = self.cache.record(key)
        return record.uid if record is not None else ""

    def _tenants(self, rows: set[int] | None, priority: int) -> dict[int, list[victims.Tenant]]:
        """The ledger's pods on those rows (None: on every node) as preemption by a pod of `priority`
        sees them (the budgets that select a pod are looked up only for those below it)."""
        state = self.cache.state
        found: dict[int, list[victims.Tenant]] = {}
        for key, entry in self.cache.ledger.entries():
            row = state.row(entry.alloc.node)
            if row is None or (rows is not None and row not in rows):
                continue
            record = self.cache.record(key)
            bound = record is not None and record.node == entry.alloc.node
            companions = self._gang_of(record, priority) if record is not None and record.gang is not None else ()
            found.setdefault(row, []).append(
                victims.Tenant(
                    alloc=entry.alloc,
                    priority=record.priority if record is not None else 0,
                    created=record.created if record is not None else "",
                    preemptible=bound
                    and not key.startswith(f"{names.HOLDING_NAMESPACE}/")  # sharegpu's own: a group's holder
                    and key not in self.nominations
                    and key not in self.gang_of
                    and companions is not None,
                    leaving=bound and record is not None and record.deleting,
                    companions=companions or (),
                    budgets=self.budgets.covering(record) if record is not None and record.priority < priority else (),
                )
            )
        return found

    def _gang_of(self, record: pods.Record, priority: int) -> tuple[victims.Companion, ...] | None:
        """The other running members of a gang member's gang, which leave with it (a gang is preempted
        whole), with the budgets that select them when they are below `priority`; None while the gang
        is being placed (a member holds an assumption it is not bound with yet): then none of it is
        preempted."""
        assert record.gang is not None
        companions = []
        for member in self.cache.gang_members(record.gang.key):
            if member.key == record.key or member.terminal or member.deleting:
                continue
            if member.key in self.cache.assumed or member.key in self.nominations or member.key in self.gang_of:
                return None
            if member.node:
                budgets = self.budgets.covering(member) if member.priority < priority else ()
                companions.append(victims.Companion(member.key, member.priority, budgets))
        return tuple(companions)

    def _remaining(self, leave: dict[units.PodKey, str]) -> list[units.PodKey]:
        """Of a nomination's victims (and pods it waits for), those still holding their GPUs (the
        ledger counts a pod until it has gone)."""
        left = []
        for key, uid in leave.items():
            record = self.cache.record(key)
            if record is not None and record.uid == uid and not record.terminal and key in self.cache.ledger:
                left.append(key)
        return left

    def _end(self, nomination: Nomination, why: extender_metrics.PreemptionOutcome) -> None:
        self.nominations.pop(nomination.pod, None)
        self.cache.release(nomination.pod)
        self.metrics.preemptions.labels(why).inc()
        log.info("nomination of %s on %s ended: %s", nomination.pod, nomination.plan.node, why)

    # ----------------------------------------------------------------- the writes

    def wake(self) -> None:
        self._wake.set()

    async def run(self, tick: float = 1.0) -> None:
        """Carry out nominations: woken by a new one, and every `tick` seconds for the rest."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            self._wake.clear()
            try:
                await self.reconcile()
            except Exception:  # the task must not end: nominations end only in a pass
                log.exception("preemption pass failed; the next pass tries again")

    async def reconcile(self) -> None:
        """One pass over every nomination: announce new ones, delete victims, end finished ones."""
        async with self._passing:
            await self._pass()

    async def _pass(self) -> None:
        now = self.clock()
        if not self.is_leader():
            # Victims chosen for a pod that the new leader's kube-scheduler places afresh: deleting them
            # now would be a second preemption beside the new leader's own (those already being deleted
            # count as gone in its plans).
            for nomination in list(self.nominations.values()):
                self._end(nomination, extender_metrics.PreemptionOutcome.STEPPED_DOWN)
            for gang in list(self.gangs.values()):
                self._end_gang(gang, extender_metrics.PreemptionOutcome.STEPPED_DOWN)
            return
        for nomination in list(self.nominations.values()):
            if self.nominations.get(nomination.pod) is not nomination:
                continue  # ended by the pod's filter while this pass awaited a write
            record = self.cache.record(nomination.pod)
            if record is None or record.uid != nomination.uid or record.deleting or record.terminal:
                self._end(nomination, extender_metrics.PreemptionOutcome.GONE)
                continue
            if record.node:
                self._end(nomination, extender_metrics.PreemptionOutcome.BOUND)
                continue
            left = self._remaining(nomination.victims)
            if not left:
                self._place(nomination)
                if not await self._nudge(nomination.pod):
                    self._unnudged[nomination.pod] = (nomination.uid, now)
                continue
            if now - nomination.since >= self.patience:
                log.warning("pod %s: %s still on %s after %.0f s; the nomination is given up",
                            nomination.pod, ", ".join(left), nomination.plan.node, self.patience)  # fmt: skip
                self._end(nomination, extender_metrics.PreemptionOutcome.EXPIRED)
                continue
            if not nomination.announced:
                nomination.announced = await self._announce(nomination)
            await self._evict(nomination, left, now)
        for gang in list(self.gangs.values()):
            if self.gangs.get(gang.gang) is gang:  # not ended by a member's filter meanwhile
                await self._pass_gang(gang, now)
        await self._nudge_again(now)

    async def _nudge_again(self, now: float) -> None:
        """Nudges that could not be written, again, while their pods wait unbound (kube-scheduler may
        have parked the pod for up to five minutes otherwise), whether the room was assumed for them
        or freed for their next try."""
        for key, (uid, tried) in list(self._unnudged.items()):
            record = self.cache.record(key)
            if record is None or record.uid != uid or record.node or record.deleting or record.terminal:
                del self._unnudged[key]  # gone, replaced, bound or ended
            elif now - tried >= self.retry:
                if await self._nudge(key):
                    del self._unnudged[key]
                else:
                    self._unnudged[key] = (uid, now)

    async def _evict(self, nomination: Nomination | GangNomination, left: list[units.PodKey], now: float) -> None:
        """Delete the victims still there (again after `retry` seconds while one is not leaving)."""
        for key in left:
            victim = self.cache.record(key)
            if victim is None or victim.deleting or key not in nomination.plan.victims:
                continue
            if victim.uid != nomination.victims.get(key):
                continue  # another pod under the victim's name (the victim ended, its owner made it again)
            sent = nomination.sent.get(key)
            if sent is None or now - sent >= self.retry:
                nomination.sent[key] = now
                await self._delete(nomination, victim)

    async def _pass_gang(self, nomination: GangNomination, now: float) -> None:
        records = {k: self.cache.record(k) for k in nomination.uids}
        for key, record in records.items():
            if record is None or record.uid != nomination.uids[key] or record.deleting or record.terminal:
                self._end_gang(nomination, extender_metrics.PreemptionOutcome.GONE)
                return
            if record.node:
                self._end_gang(nomination, extender_metrics.PreemptionOutcome.BOUND)
                return
        left = self._remaining(nomination.victims)
        if now - nomination.since >= self.patience:
            log.warning("gang %s: %s still there after %.0f s; the nomination is given up", nomination.gang,
                        ", ".join(left) or "its members not filtered again", self.patience)  # fmt: skip
            self._end_gang(nomination, extender_metrics.PreemptionOutcome.EXPIRED)
            return
        if not left:
            if not nomination.nudged:  # the holds end at the next member's filter, which plans the gang
                nomination.nudged = True
                for key, uid in nomination.uids.items():
                    if not await self._nudge(key):
                        self._unnudged[key] = (uid, now)  # told again while it waits, past the nomination's end
            return
        if not nomination.announced:
            nomination.announced = await self._announce_gang(nomination)
        await self._evict(nomination, left, now)

    def _place(self, nomination: Nomination) -> None:
        """The victims have gone: the held GPUs become the pod's assumption in one step."""
        self.nominations.pop(nomination.pod, None)
        self.cache.release(nomination.pod)
        plan = nomination.plan
        row = self.cache.state.row(plan.node)
        placed = False
        if row is not None:
            alloc = self.cache.placer.allocation_on(nomination.request, row, plan.gpus)
            placed = nomination.pod not in self.cache.ledger and self.cache.assume(alloc, nomination.uid)
        self.metrics.preemptions.labels(
            extender_metrics.PreemptionOutcome.PLACED if placed else extender_metrics.PreemptionOutcome.FREED
        ).inc()
        log.info("pod %s: its victims on %s have gone; %s", nomination.pod, plan.node,
                 "its GPUs are assumed for it" if placed else "the room is free for its next try")  # fmt: skip

    async def _nudge(self, key: units.PodKey) -> bool:
        """Make kube-scheduler try the pod now: any change to a pod it turned away requeues it, and
        the victims' deletions may have reached it before they reached this cache (its last try then
        found the room still taken, and nothing else would wake it for up to five minutes). The
        change: its nominated node is cleared, the room now being held for it as an assumption (or
        its gang's plan). False: the change could not be written."""
        return await self._nominate(key, None)

    async def _nominate(self, key: units.PodKey, node: str | None) -> bool:
        """Name the pod's nominated node in its status (None: clear it); False if that failed."""
        namespace, _, name = key.partition("/")
        try:
            await self.api.patch(paths.pod_status(namespace, name), pods.nominated(node))
        except errors.SharegpuError as exc:
            log.warning("pod %s: cannot %s its nominated node: %s", key, "name" if node else "clear", exc)
            return False
        return True

    async def _announce_gang(self, nomination: GangNomination) -> bool:
        """Each planned member's nominated node, and an event on each saying what its gang preempts."""
        plan = nomination.plan
        home = nomination.gang.split("/", 1)[0]
        message = f"its gang {nomination.gang} preempts {_in_words(plan.victims, home)} on {nomination.where}"
        if plan.leaving:
            message += f" (also waiting for {_in_words(plan.leaving, home)}, already leaving)"
        told = True
        for alloc in plan.allocations:
            if not await self._nominate(alloc.pod, alloc.node):
                told = False
            namespace, _, name = alloc.pod.partition("/")
            subject = events.pod(namespace, name, nomination.uids[alloc.pod])
            try:
                await self.recorder.record(subject, "Preempting", message, decision=f"preempt|{nomination.where}")
            except errors.SharegpuError as exc:
                log.warning("event Preempting on %s: %s", alloc.pod, exc)
                told = False
        return told

    async def _announce(self, nomination: Nomination) -> bool:
        """The pod's nominated node in its status, and an event saying what it preempts."""
        namespace, _, name = nomination.pod.partition("/")
        plan = nomination.plan
        nominated = await self._nominate(nomination.pod, plan.node)
        message = f"preempting {_in_words(plan.victims, namespace)} on {plan.node} for GPUs {list(plan.gpus)}"
        if plan.leaving:
            message += f" (also waiting for {_in_words(plan.leaving, namespace)}, already leaving)"
        subject = events.pod(namespace, name, nomination.uid)
        try:
            await self.recorder.record(subject, "Preempting", message, decision=f"preempt|{plan.node}")
        except errors.SharegpuError as exc:
            log.warning("event Preempting on %s: %s", nomination.pod, exc)
            return False
        return nominated

    @staticmethod
    def _why(nomination: Nomination | GangNomination, victim: pods.Record) -> str:
        """What a victim is told: its preemptor by name in its own namespace, by UID from another's
        (as kube-scheduler does: another tenant's pod names are not the victim's to read)."""
        home = victim.key.split("/", 1)[0]
        if isinstance(nomination, GangNomination):
            by = (
                f"gang {nomination.gang}" if nomination.gang.split("/", 1)[0] == home else "a gang of another namespace"
            )
            where = nomination.where
            here = victim.node in nomination.plan.nodes
        else:
            by = nomination.pod if nomination.pod.split("/", 1)[0] == home else f"pod {nomination.uid}"
            where = nomination.plan.node
            here = victim.node == where
        if here:
            return (
                f"sharegpu-scheduler: preempted by {by} (priority {nomination.priority}) to free its GPU share on "
                f"{where}"
            )
        return (
            f"sharegpu-scheduler: preempted with its gang {victim.gang.key if victim.gang else ''} by {by} (priority "
            f"{nomination.priority}), which takes a member's GPUs on {where}"
        )

    async def _delete(self, nomination: Nomination | GangNomination, victim: pods.Record) -> None:
        """Mark the victim (condition, then event, once), then delete it if it is still that pod. No
        condition or no event, no deletion (as kube-scheduler does): the next try writes it first."""
        namespace, _, name = victim.key.partition("/")
        message = self._why(nomination, victim)
        by = nomination.gang if isinstance(nomination, GangNomination) else nomination.uid
        now = wire.timestamp(self.recorder.clock())
        try:
            await self.api.patch(
                paths.pod_status(namespace, name), pods.preempted(message, now), content_type=client.STRATEGIC_PATCH
            )
        except kube_errors.NotFoundError:
            return
        except errors.SharegpuError as exc:
            self.metrics.preempted_deletions.labels(extender_metrics.DeletionOutcome.UNTOLD).inc()
            log.warning("pod %s: cannot mark it preempted: %s (not deleted; tried again in %.0f s)", victim.key, exc,
                        self.retry)  # fmt: skip
            return
        if victim.key not in nomination.told:
            subject = events.pod(namespace, name, victim.uid)
            try:
                await self.recorder.record(subject, "Preempted", message, decision=f"preempted|{by}")
                nomination.told.add(victim.key)
            except errors.SharegpuError as exc:
                self.metrics.preempted_deletions.labels(extender_metrics.DeletionOutcome.UNTOLD).inc()
                log.warning("event Preempted on %s: %s (not deleted; tried again in %.0f s)", victim.key, exc,
                            self.retry)  # fmt: skip
                return
        try:
            await self.api.delete(paths.pod(namespace, name), preconditions={"uid": victim.uid})
        except errors.SharegpuError as exc:
            outcome = kube_errors.outcome(exc)
            self.metrics.preempted_deletions.labels(extender_metrics.DeletionOutcome(outcome.value)).inc()
            log.warning("preempting %s: %s (%s; sent again in %.0f s if it is still there)",
                        victim.key, exc, outcome.value, self.retry)  # fmt: skip
            return
        self.metrics.preempted_deletions.labels(extender_metrics.DeletionOutcome.DONE).inc()
        log.info("preempted %s on %s: %s", victim.key, victim.node, message)

    def describe(self) -> list[dict[str, object]]:
        """The nominations now (for /debug)."""
        return [
            {
                "pod": n.pod,
                "node": n.plan.node,
                "gpus": list(n.plan.gpus),
                "victims": list(n.plan.victims),
                "budgets_broken": n.plan.violations,
                "waiting_for": self._remaining(n.victims),
                "age_seconds": round(self.clock() - n.since, 1),
            }
            for n in self.nominations.values()
        ] + [
            {
                "gang": n.gang,
                "members": {a.pod: a.node for a in n.plan.allocations},
                "victims": list(n.plan.victims),
                "budgets_broken": n.plan.violations,
                "waiting_for": self._remaining(n.victims),
                "age_seconds": round(self.clock() - n.since, 1),
            }
            for n in self.gangs.values()
        ]


def _pods(n: int) -> str:
    return "pod" if n == 1 else "pods"


def _in_words(keys: Iterable[str], home: str) -> str:
    """Pods for an event of namespace `home`: named there, counted from other namespaces."""
    listed = list(keys)
    own = [key for key in listed if key.split("/", 1)[0] == home]
    others = len(listed) - len(own)
    return ", ".join([*own, *([f"{others} pod(s) of other namespaces"] if others else [])]) or "nothing more"
