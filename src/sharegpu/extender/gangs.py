"""Gangs on the extender path: a gang's members planned at once, held as one unit, bound together.

kube-scheduler hands the extender one pod at a time. When the first member of a gang (`api.gangs`)
is filtered, the book plans every waiting member at once (`core.gangs.plan`, at least the gang's
minimum less the members already running; `extender.gangtrial` checks and plans, without I/O, as
`kubectl sharegpu explain` does too) and assumes every planned allocation in the ledger, so no
other pod takes the gang's room while its members come through kube-scheduler one after another;
each member's filter then answers the node planned for it. A member's bind waits (`arrive`) until
every planned member has reached its bind, up to `barrier_wait` seconds (less than kube-scheduler's
HTTP timeout for the extender); a member that waited in vain answers an error and kube-scheduler
tries it again, its place still held. Once all have arrived the gang is *released*: every member
binds, those still waiting at once, the others at their next try.

A plan lasts the gang's timeout. A plan not released by then is given back whole (`settle`): every
planned member not bound loses its assumption, so a gang that cannot complete holds nothing longer
than its timeout. A released plan keeps its room until every member is bound (a member whose bind
failed, its hand-off not written yet or its binding refused, keeps its place for the next try), unless
a member is gone or replaced: the bound members of a gang are never left without the room planned
for the rest. Members that disagree about the gang (its minimum, timeout, topology) are refused
with the disagreement named until they agree.

A plan is kept in memory until it is released; releasing it first writes it to the API (a ConfigMap
in the system namespace, `api.gangs.plan_configmap`), and a member binds only once that write has
succeeded. An extender that starts (restarted, or beside a new kube-scheduler leader) holds the room
of every kept plan's unbound members before it serves anything (`restore`, also on each `settle`
for plans it learns of later), so a gang bound in part is completed where it was planned, not
planned again into room others have taken meanwhile. A plan not yet released is not kept: none of
its members is bound, and it is planned again whole. A plan that ended (complete, or given back) is
deleted (`flush`, by its UID).

A plan is made only within the namespace's ResourceQuotas on sharegpu's totals, counted for every
member it holds at once (a member's own filter counts itself alone). A gang member that reaches its
bind with no plan holding it (the plan given back at its timeout, or never made by this extender)
binds only where its gang has its minimum running already; otherwise it is refused and planned again
with the rest at its next filter, so a member never binds alone into a gang that cannot complete.
A member whose binding was written counts as bound from that moment (the watch may show it later),
so no plan gives its room back. Members planned for a gang that has members running already (one
replaced, or the rest of a plan given back) stay within the topology value those members run in.
Members that keep apart from each other (required pod anti-affinity selecting themselves,
`api.constraints.apart_from_itself`) are planned into a value of that topology each
(`core.gangs.Apart`), off those where such members run.

A gang that fits nowhere may preempt lower-priority pods for all its members at once
(`preemption.Preemptor.consider_gang`): their room is held while the victims leave, and the gang is
planned into it at the first member's filter after they have gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sharegpu.api import gangs as api_gangs
from sharegpu.api import names, paths, pods, wire
from sharegpu.core import allocation, errors, units
from sharegpu.core import gangs as core_gangs
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import gangtrial, preemption
from sharegpu.extender import metrics as extender_metrics
from sharegpu.extender import quotas as extender_quotas
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

log = logging.getLogger(__name__)

RELEASED_GRACE = 10
"""A released plan (every member reached its bind once) keeps its room this many timeouts past its
deadline at the most, while its members are bound (`GangBook.settle`)."""
DELETED_MEMORY = 1024
"""How many deleted plan ConfigMaps `GangBook.deleted` remembers."""
BARRIER_WAIT = 4.0
"""Seconds a member's bind waits for the others (kube-scheduler gives the extender 5 s an HTTP call)."""


@dataclass(slots=True)
class Plan:
    gang: api_gangs.Gang
    members: dict[units.PodKey, tuple[str, allocation.Allocation]]
    """Planned member -> (its UID, its allocation)."""
    deadline: float
    arrived: set[units.PodKey] = field(default_factory=set)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    keeping: bool = False
    """Its release is being written to the API (`GangBook._keep`)."""
    bound: set[units.PodKey] = field(default_factory=set)
    """Members whose binding was written (before the watch shows it, perhaps)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """A gang member's filter: the node planned for it, or why it waits (both None: not held by a gang,
    placed as any pod)."""

    node: str | None = None
    refusal: str | None = None


FREE = Verdict()


class GangBook:
    def __init__(
        self,
        cache: extender_cache.ClusterCache,
        api: client.KubeApi,
        metrics: extender_metrics.Metrics,
        *,
        clock: Callable[[], float],
        barrier_wait: float = BARRIER_WAIT,
        preemptor: preemption.Preemptor | None = None,
        quota: extender_quotas.QuotaGuard | None = None,
    ) -> None:
        self.cache = cache
        self.api = api
        self.metrics = metrics
        self.preemptor = preemptor
        """Preempts lower-priority pods for a gang that fits nowhere; None: no preemption."""
        self.quota = quota
        """Checks a plan against the namespace's ResourceQuotas on sharegpu's totals; None: not checked."""
        self.clock = clock
        self.barrier_wait = barrier_wait
        self.plans: dict[str, Plan] = {}
        self.member_of: dict[units.PodKey, str] = {}
        """Planned member -> its gang's key."""
        self.kept: dict[str, api_gangs.KeptPlan] = {}
        """Gang key -> its released plan as the API keeps it (the plan ConfigMaps' informer)."""
        self.dropping: dict[str, str] = {}
        """Plan ConfigMap name -> UID, of plans that ended: deleted by `flush`."""
        self.deleted: dict[str, None] = {}
        """UIDs of the plan ConfigMaps `flush` deleted (the newest DELETED_MEMORY): a watch event that
        shows one late does not bring its plan back."""

    # ----------------------------------------------------------------- filter

    def consider(self, record: pods.Record) -> Verdict:
        """Where a gang member goes now, planning its gang if it must."""
        gang = record.gang
        if gang is None:
            return FREE
        plan = self.plans.get(gang.key)
        if plan is not None:
            held = plan.members.get(record.key)
            if held is not None and held[0] == record.uid:
                return Verdict(node=held[1].node)
            if not plan.released.is_set():
                return self._refuse(f"gang {gang.key}: its planned members are being bound; this pod follows them")
            return FREE
        tried = gangtrial.consider(self.cache, self.quota, record)
        if isinstance(tried, gangtrial.Free):
            return FREE
        if isinstance(tried, gangtrial.Waits):
            return self._refuse(tried.why)
        found, waiting = tried.plan, list(tried.waiting)
        if not found.status.ok:
            preempting = (
                self.preemptor.consider_gang(gang.key, waiting, tried.again) if self.preemptor is not None else None
            )
            if preempting is not None:
                return self._refuse(
                    f"gang {gang.key}: {found.status.message}; preempting {len(preempting.victims)} lower-priority "
                    f"pod(s) on {', '.join(preempting.nodes)} for it"
                )
            return self._refuse(f"gang {gang.key}: {found.status.message}")
        return self._hold(gang, {m.key: m.uid for m in waiting}, found, record.key)

    def _hold(
        self, gang: api_gangs.Gang, uids: dict[units.PodKey, str], found: core_gangs.Plan, asking: units.PodKey
    ) -> Verdict:
        held: dict[units.PodKey, tuple[str, allocation.Allocation]] = {}
        for alloc in found.allocations:
            if not self.cache.assume(alloc, uids[alloc.pod]):
                for key in held:
                    self.cache.forget(key)
                return self._refuse(f"gang {gang.key}: its plan conflicts with the ledger; planned again next time")
            held[alloc.pod] = (uids[alloc.pod], alloc)
        self.plans[gang.key] = Plan(gang, held, self.clock() + gang.timeout_s)
        for key in held:
            self.member_of[key] = gang.key
        self.metrics.gangs.labels(extender_metrics.GangOutcome.PLANNED).inc()
        log.info("gang %s: %d member(s) planned on %d node(s)%s", gang.key, len(held), found.nodes,
                 f" in {gang.topology}={found.domain}" if gang.topology else "")  # fmt: skip
        mine = held.get(asking)
        if mine is None:
            return self._refuse(f"gang {gang.key}: planned without this pod (no room for it now); it follows them")
        return Verdict(node=mine[1].node)

    def _refuse(self, why: str) -> Verdict:
        self.metrics.gangs.labels(extender_metrics.GangOutcome.REFUSED).inc()
        return Verdict(refusal=why)

    # ----------------------------------------------------------------- bind

    async def arrive(self, record: pods.Record) -> str | None:
        """A pod reached its bind: a planned member waits for the others. None: bind now (released,
        not a gang member, or a member of a gang that has its minimum running); else why not yet."""
        key, uid = record.key, record.uid
        gang_key = self.member_of.get(key)
        plan = self.plans.get(gang_key) if gang_key is not None else None
        if plan is None or plan.members[key][0] != uid:
            gang = record.gang
            if gang is None:
                return None
            ours = self.plans.get(gang.key)
            if ours is not None:  # planned without this pod: it follows a released plan as any pod does
                return None if ours.released.is_set() else f"gang {gang.key}: its planned members bind first"
            others = [m for m in self.cache.live_gang_members(gang.key) if m.key != key]
            if gangtrial.short(gang, others) <= 0:
                return None  # the gang has its minimum without this pod: it is placed as any pod
            return (
                f"gang {gang.key}: no plan holds this member (given back at its timeout, or not made here); "
                "it is planned again with the rest at its next filter"
            )
        plan.arrived.add(key)
        if not plan.released.is_set() and not plan.keeping and plan.arrived >= plan.members.keys():
            refused = await self._keep(plan)
            if refused is not None:
                return refused
            if self.plans.get(plan.gang.key) is not plan:  # given back while it was being written
                self._drop_kept(plan.gang.key)
                return f"gang {plan.gang.key}: its plan was given back at its timeout; it is planned again"
            plan.released.set()
            self.metrics.gangs.labels(extender_metrics.GangOutcome.RELEASED).inc()
        if plan.released.is_set():
            return None
        try:
            await asyncio.wait_for(plan.released.wait(), self.barrier_wait)
        except TimeoutError:
            return (
                f"gang {plan.gang.key}: {len(plan.arrived)} of {len(plan.members)} planned members have reached "
                "their binding; this one binds with the rest"
            )
        return None

    async def _keep(self, plan: Plan) -> str | None:
        """Write a plan about to be released to the API (a plan of one member needs none: it cannot be
        left partial). None: kept; else why not (the member's bind fails and is tried again)."""
        if len(plan.members) < 2:
            return None
        gang_key = plan.gang.key
        body = api_gangs.plan_configmap(gang_key, plan.members)
        name = body["metadata"]["name"]
        plan.keeping = True
        try:
            try:
                made = await self.api.create(paths.configmaps(names.SYSTEM_NAMESPACE), body)
            except kube_errors.ConflictError as exc:
                if not exc.already_exists:
                    raise
                # an older plan of the gang not deleted yet, or this one, its answer lost the first time
                made = await self.api.replace(paths.configmap(names.SYSTEM_NAMESPACE, name), body)
        except errors.SharegpuError as exc:
            log.warning("gang %s: cannot keep its plan in the API (%s); not released yet", gang_key, exc)
            return (
                f"gang {gang_key}: its plan cannot be written to the API yet ({exc}); this member binds with the rest"
            )
        finally:
            plan.keeping = False
        self.dropping.pop(name, None)
        uid = str((made.get("metadata") or {}).get("uid") or "")
        self.kept[gang_key] = api_gangs.KeptPlan(gang_key, name, uid, dict(plan.members))
        return None

    # ----------------------------------------------------------------- the plans the API keeps

    def on_configmap(self, kind: wire.EventType, obj: wire.ConfigMap) -> None:
        """The plan ConfigMaps' informer: what the API keeps, restored by `restore`."""
        if kind == wire.EventType.DELETED:  # by UID: a newer plan of the gang may have the name already
            for gang_key, kept in list(self.kept.items()):
                if kept.name == obj.metadata.name and kept.uid in ("", obj.metadata.uid):
                    del self.kept[gang_key]
            if self.dropping.get(obj.metadata.name) in ("", obj.metadata.uid):
                del self.dropping[obj.metadata.name]
            return
        if obj.metadata.uid in self.deleted:
            return
        try:
            kept = api_gangs.read_plan(obj)
        except errors.InvalidInputError as exc:
            log.error("%s; ignored", exc)
            return
        self.kept[kept.gang] = kept

    def restore(self) -> int:
        """Hold the room of kept plans this extender does not have in memory: each plan's members not
        bound yet (live, the same pods) get their planned allocation back in the ledger, and the plan
        lives on as released. A kept plan with no such member left ended: it is deleted. Returns how
        many plans were restored."""
        restored = 0
        for gang_key, kept in list(self.kept.items()):
            if gang_key in self.plans or kept.name in self.dropping:
                continue
            waiting: dict[units.PodKey, tuple[str, allocation.Allocation]] = {}
            gang: api_gangs.Gang | None = None
            for key, (uid, alloc) in kept.members.items():
                record = self.cache.record(key)
                if record is None or record.uid != uid or record.terminal or record.deleting:
                    continue
                if record.gang is None or record.gang.key != gang_key:
                    continue
                gang = record.gang
                if not record.node:
                    waiting[key] = (uid, alloc)
            if gang is None or not waiting:
                self.dropping[kept.name] = kept.uid
                continue
            held: dict[units.PodKey, tuple[str, allocation.Allocation]] = {}
            for key, (uid, alloc) in waiting.items():
                if self.cache.assumed.get(key) == alloc or self.cache.assume(alloc, uid):
                    held[key] = (uid, alloc)
                else:
                    log.error("gang %s: member %s's planned room on %s is taken; it is placed as any pod",
                              gang_key, key, alloc.node)  # fmt: skip
            plan = Plan(gang, {**kept.members, **held}, self.clock() + gang.timeout_s)
            for key in waiting.keys() - held.keys():
                del plan.members[key]
            plan.arrived.update(plan.members)
            plan.released.set()
            self.plans[gang_key] = plan
            for key in plan.members:
                self.member_of[key] = gang_key
            restored += 1
            log.warning("gang %s: its released plan restored from the API; %d member(s) not bound yet hold their room",
                        gang_key, len(held))  # fmt: skip
        return restored

    def _drop_kept(self, gang_key: str) -> None:
        kept = self.kept.pop(gang_key, None)
        if kept is not None:
            self.dropping[kept.name] = kept.uid

    async def flush(self) -> None:
        """Delete the kept plans that ended (by UID: a newer plan of the gang is never deleted)."""
        for name, uid in list(self.dropping.items()):
            try:
                await self.api.delete(
                    paths.configmap(names.SYSTEM_NAMESPACE, name), preconditions={"uid": uid} if uid else None
                )
            except (kube_errors.NotFoundError, kube_errors.ConflictError):
                pass  # gone already, or a newer plan under the name
            except errors.SharegpuError as exc:
                log.warning("cannot delete the ended gang plan %s (%s); tried again", name, exc)
                continue
            if self.dropping.get(name) == uid:
                del self.dropping[name]
            self.deleted[uid] = None
            while len(self.deleted) > DELETED_MEMORY:
                del self.deleted[next(iter(self.deleted))]

    # ----------------------------------------------------------------- life cycle

    def bound(self, key: units.PodKey) -> None:
        """The member's binding was written: its plan counts it bound from now on."""
        gang_key = self.member_of.get(key)
        plan = self.plans.get(gang_key) if gang_key is not None else None
        if plan is not None:
            plan.bound.add(key)

    def holds(self, key: units.PodKey) -> bool:
        """Whether a live plan holds this pod's assumption (its life is the plan's, not `assume_ttl`'s)."""
        return key in self.member_of

    def settle(self, busy: Callable[[units.PodKey], bool]) -> int:
        """End plans whose members are all bound (complete), and give back what a plan still holds
        when it can no longer complete as planned: a plan not released by its deadline (its members
        did not all reach their binding in time), or a released one with a member gone or replaced
        (or, at the latest, ten timeouts after its deadline). A released plan otherwise keeps its
        room: some of its members may be bound already, and giving the others' room away would
        leave the gang partial. Members being bound (`busy`) are waited for. Returns how many plans
        were given back."""
        now = self.clock()
        given_back = 0
        for gang_key, plan in list(self.plans.items()):
            records = {k: self.cache.record(k) for k in plan.members}
            bound = [k for k, r in records.items() if k in plan.bound or (r is not None and r.node)]
            if len(bound) == len(plan.members):
                self._end(gang_key, plan)
                continue
            if plan.released.is_set():
                gone = any(
                    r is None or r.uid != plan.members[k][0] or r.terminal or r.deleting
                    for k, r in records.items()
                    if k not in bound
                )
                if not gone and now < plan.deadline + RELEASED_GRACE * plan.gang.timeout_s:
                    continue
            elif now < plan.deadline:
                continue
            if any(busy(k) for k in plan.members):
                continue
            for key in plan.members:
                if key not in bound:
                    self.cache.forget(key)
            self._end(gang_key, plan)
            given_back += 1
            self.metrics.gangs.labels(extender_metrics.GangOutcome.EXPIRED).inc()
            log.warning("gang %s: %d of %d planned member(s) bound; the rest given back (%s)", gang_key,
                        len(bound), len(plan.members), "a member is gone" if plan.released.is_set() else
                        f"not all reached their binding within {plan.gang.timeout_s} s")  # fmt: skip
        return given_back

    def _end(self, gang_key: str, plan: Plan) -> None:
        del self.plans[gang_key]
        self._drop_kept(gang_key)
        for key in plan.members:
            if self.member_of.get(key) == gang_key:
                del self.member_of[key]
