"""The idle-share reconciler: pods that hold a GPU share and use none of it, reported and, where their
namespace's `GPUIdlePolicy` says so, evicted (`api.idle` states the rules).

From its informers it keeps every node's GpuUsage (the agents' reports) and every GPUIdlePolicy. Each
report updates, for the pods of the namespaces with a policy in force, when they were first seen
idle (the report's `observedAt`; seen busy, or not measured, clears it); a policy that comes, goes or
changes judges every node's latest report again (agents rewrite steady figures only every few
minutes, and a pod idle before its namespace had a policy is idle all the same). A pass then takes every pod
whose reports show it idle over at least its policy's `idleAfterSeconds`: from the first report that
showed it idle to the latest that still does, both times the agent's own (a single idle report, or
an agent whose clock runs behind the controller's, proves nothing more):

- it is reported once while it stays idle (event `GPUShareIdle`, the gauge, the policy's status);
- with `action: Evict`, it is evicted through the Eviction API, only if it is still the pod with that
  UID and, at that moment, still idle that long under a policy in force that says Evict (a policy
  edited or deleted during the pass is obeyed); a gang's member only together with every other live
  member of its gang, each idle that long (read at the time from the API: a list of the namespace's
  pods), and only once a dry run of every member's eviction has passed its disruption budgets, so
  that a budget refusing one member does not leave the gang split; a refusal (a
  PodDisruptionBudget: 429) is reported and tried again after `retry` seconds (for a gang: none of
  its members before then).

Figures from a report older than `stale` seconds are not acted on (its agent may be gone, the pod
busy since). What it knows lives in memory: a new leader starts counting idleness again from the
reports it reads, so it evicts later, never sooner. The status it writes replaces its copy of a
policy only if no newer version (or the policy's deletion) arrived meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sharegpu.api import events, idle, names, paths, pods, resources, usage, wire
from sharegpu.core import errors, units
from sharegpu.kube import client, reconcile
from sharegpu.kube import errors as kube_errors
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)

STALE = 900.0
"""Seconds after which a node's report is too old to act on (the agent rewrites a steady one every 5 minutes)."""
RETRY = 60.0
"""Seconds before an eviction that was refused is tried again."""
LEAVING_MEMORY = 4096
"""How many evicted pods' UIDs are remembered (until their reports stop showing them)."""
IDLE = "GPUShareIdle"
EVICTED = "GPUShareIdleEvicted"
BLOCKED = "GPUShareIdleEvictionBlocked"


@dataclass(slots=True)
class Tracked:
    namespace: str
    name: str
    node: str
    since: int
    """Idle since (seconds since the epoch), as the reports first showed it."""
    observed: int
    """When the latest report that showed it idle was measured."""
    share_milli: int | None
    told: bool = False


@dataclass(slots=True)
class Counters:
    evictions: dict[str, int] = field(default_factory=dict)
    """Outcome -> evictions tried."""


class IdleReconciler:
    def __init__(
        self,
        api: client.KubeApi,
        recorder: kube_events.Recorder,
        clock: Callable[[], float],
        *,
        stale: float = STALE,
        retry: float = RETRY,
    ) -> None:
        self.api = api
        self.recorder = recorder
        self.clock = clock
        self.stale = stale
        self.retry = retry
        self.policies: dict[tuple[str, str], idle.GPUIdlePolicy] = {}
        self.usages: dict[str, usage.GpuUsage] = {}
        """Node -> its latest report (judged again when a policy comes, goes or changes)."""
        self.reports: dict[str, dict[str, idle.Seen]] = {}
        """Node -> pod UID -> what its latest report showed, judged by the policies in force."""
        self.tracked: dict[str, Tracked] = {}
        """Pod UID -> since when it is idle."""
        self.refused: dict[str, float] = {}
        """Pod UID -> when its eviction was last refused."""
        self.leaving: dict[str, None] = {}
        """UIDs of the pods evicted (the newest LEAVING_MEMORY): reports show them until they have gone,
        and they are neither counted nor listed as idle again."""
        self.evicted: dict[str, int] = {}
        """Namespace -> pods evicted under its policy and not yet counted in its status."""
        self.counters = Counters()
        self.loop = reconcile.Loop("idle-shares", self.reconcile)

    # ----------------------------------------------------------------- informers

    def on_policy(self, kind: wire.EventType, policy: idle.GPUIdlePolicy) -> None:
        key = (policy.metadata.namespace, policy.metadata.name)
        if kind == wire.EventType.DELETED:
            self.policies.pop(key, None)
        else:
            self.policies[key] = policy
        # An agent rewrites steady figures only every few minutes: the reports at hand are judged
        # again by the policies now in force (a pod idle before its namespace had one counts from
        # the report that showed it idle).
        for report in list(self.usages.values()):
            self._judge(report)
        self.loop.wake()

    def ruling(self) -> dict[str, idle.GPUIdlePolicy]:
        """Namespace -> the policy in force there."""
        by_namespace: dict[str, list[idle.GPUIdlePolicy]] = {}
        for (namespace, _), policy in self.policies.items():
            by_namespace.setdefault(namespace, []).append(policy)
        return {ns: found for ns, items in by_namespace.items() if (found := idle.in_force(items)) is not None}

    def on_usage(self, kind: wire.EventType, report: usage.GpuUsage) -> None:
        node = report.metadata.name
        if kind == wire.EventType.DELETED:
            self.usages.pop(node, None)
            gone = self.reports.pop(node, {})
            for uid in gone:
                self._forget(uid, node)
            return
        self.usages[node] = report
        self._judge(report)
        self.loop.wake()

    def _judge(self, report: usage.GpuUsage) -> None:
        """Track (or forget) the pods of one node's report by the policies in force."""
        node = report.metadata.name
        threshold = {ns: p.spec.idle_at_most_percent for ns, p in self.ruling().items()}
        now_seen = idle.seen(report, threshold)
        try:
            observed = wire.seconds(report.status.observed_at)
        except errors.InvalidInputError:
            return
        for uid in self.reports.get(node, {}).keys() - now_seen.keys():
            self._forget(uid, node)  # left the node, or its namespace has no policy now
        self.reports[node] = now_seen
        for uid, found in now_seen.items():
            if not found.idle or uid in self.leaving:
                self._forget(uid, node)
                continue
            tracked = self.tracked.get(uid)
            if tracked is None or tracked.node != node:
                self.tracked[uid] = Tracked(found.namespace, found.name, node, observed, observed, found.share_milli)
            else:
                tracked.observed = max(tracked.observed, observed)

    def _forget(self, uid: str, node: str) -> None:
        tracked = self.tracked.get(uid)
        if tracked is not None and tracked.node == node:
            del self.tracked[uid]
            self.refused.pop(uid, None)

    # ----------------------------------------------------------------- the pass

    def idle_for_long(self) -> dict[str, Tracked]:
        """Pod UID -> its tracking, for the pods idle at least their policy's time, by a report still
        fresh (an agent rewrites steady figures only every few minutes: the latest says it still holds)."""
        ruling = self.ruling()
        return {uid: t for uid, t in self.tracked.items() if self._long(t, ruling.get(t.namespace))}

    def _long(self, tracked: Tracked, policy: idle.GPUIdlePolicy | None) -> bool:
        """Idle at least the policy's time, by its reports alone (first idle to latest idle), the
        latest still fresh."""
        if policy is None or self.clock() - tracked.observed > self.stale:
            return False
        return tracked.observed - tracked.since >= policy.spec.idle_after_seconds

    def _due(self, uid: str) -> bool:
        """The pod is to be evicted now: tracked, idle long enough, under a policy in force that evicts."""
        tracked = self.tracked.get(uid)
        policy = self.ruling().get(tracked.namespace) if tracked is not None else None
        return (
            tracked is not None and policy is not None and policy.spec.action == "Evict" and self._long(tracked, policy)
        )

    async def reconcile(self) -> None:
        await self.recorder.retell()
        ruling = self.ruling()
        long_idle = self.idle_for_long()
        for uid, tracked in sorted(long_idle.items(), key=lambda item: (item[1].namespace, item[1].name)):
            if not tracked.told:
                await self._tell(uid, tracked, ruling[tracked.namespace])
            if self._due(uid):
                await self._evict(uid, tracked)
        await self._write_statuses(ruling, long_idle)

    async def _tell(self, uid: str, tracked: Tracked, policy: idle.GPUIdlePolicy) -> None:
        share = f" its {tracked.share_milli} milli-GPU share" if tracked.share_milli is not None else " its GPU share"
        message = (
            f"has used at most {policy.spec.idle_at_most_percent}% of its GPU's SMs since "
            f"{wire.timestamp(tracked.since)} ({int(self.clock() - tracked.since) // 60} min), holding{share} on "
            f"{tracked.node} (GPUIdlePolicy {policy.metadata.name}: {policy.spec.action})"
        )
        subject = events.pod(tracked.namespace, tracked.name, uid)
        tracked.told = await self.recorder.tell(
            subject, IDLE, message, decision=f"{uid}|{tracked.since}", kind="Warning"
        )

    def _resting(self, uid: str) -> bool:
        """Its eviction was refused less than `retry` seconds ago."""
        refused = self.refused.get(uid)
        return refused is not None and self.clock() - refused < self.retry

    async def _evict(self, uid: str, tracked: Tracked) -> None:
        if self._resting(uid):
            return
        try:
            found = await self.api.get(paths.pod(tracked.namespace, tracked.name))
        except kube_errors.NotFoundError:
            return
        pod = wire.convert(found, wire.Pod)
        if pod.metadata.uid != uid or pod.metadata.deletion_timestamp:
            return
        if pod.spec.node_name != tracked.node:
            return  # a node's agent reports only its own node's pods: another node's report is not believed
        gang = pod.metadata.annotations.get(names.GANG)
        if not gang:
            if self._due(uid):  # the policy may have changed while the pod was read
                await self._evict_one(pod, tracked)
            return
        members = await self._gang(pod, gang)
        if any(self._resting(m.metadata.uid) for m in members):
            return  # a member's eviction was refused a moment ago: the gang waits as long
        if not all(self._due(m.metadata.uid) for m in members):
            return  # a gang goes whole or not at all: not every member is idle that long
        for member in members:  # every member's budgets asked first: a gang is never left split
            if not await self._evict_one(member, self.tracked.get(member.metadata.uid, tracked), dry_run=True):
                for other in members:
                    self.refused[other.metadata.uid] = self.clock()
                return
        for member in members:
            if not self._due(member.metadata.uid):
                return
            if not await self._evict_one(member, self.tracked.get(member.metadata.uid, tracked)):
                return

    async def _gang(self, pod: wire.Pod, gang: str) -> list[wire.Pod]:
        """The live members of `pod`'s gang (its namespace's pods that name the gang)."""
        items, _ = await self.api.list_of(paths.pods(pod.metadata.namespace), wire.Pod)
        return [
            p for p in items
            if p.metadata.annotations.get(names.GANG) == gang and not p.metadata.deletion_timestamp
            and not pods.is_terminal(p)
        ]  # fmt: skip

    async def _evict_one(self, pod: wire.Pod, tracked: Tracked, *, dry_run: bool = False) -> bool:
        """Evict the pod (`dry_run`: only ask its budgets); False if refused (told, and tried again later)."""
        meta = pod.metadata
        key = units.pod_key(meta.namespace, meta.name)
        subject = events.pod(meta.namespace, meta.name, meta.uid)
        try:
            await self.api.create(
                paths.eviction(meta.namespace, meta.name), pods.eviction(key, meta.uid, dry_run=dry_run)
            )
        except kube_errors.NotFoundError:
            return True
        except errors.SharegpuError as exc:
            outcome = kube_errors.outcome(exc).value
            self.counters.evictions[outcome] = self.counters.evictions.get(outcome, 0) + 1
            self.refused[meta.uid] = self.clock()
            message = (
                f"idle, but its eviction was refused ({errors.first_line(exc)}); tried again in {self.retry:.0f} s"
            )
            await self.recorder.tell(subject, BLOCKED, message, decision=f"{meta.uid}|{int(self.clock())}",
                                     kind="Warning")  # fmt: skip
            return False
        if dry_run:
            return True
        self.counters.evictions["done"] = self.counters.evictions.get("done", 0) + 1
        self.evicted[meta.namespace] = self.evicted.get(meta.namespace, 0) + 1
        self.tracked.pop(meta.uid, None)
        self.leaving[meta.uid] = None
        while len(self.leaving) > LEAVING_MEMORY:
            del self.leaving[next(iter(self.leaving))]
        message = f"evicted: its GPU share on {tracked.node} was idle since {wire.timestamp(tracked.since)}"
        await self.recorder.tell(subject, EVICTED, message, decision=meta.uid)
        log.info("%s evicted: idle since %s", key, wire.timestamp(tracked.since))
        return True

    async def _write_statuses(self, ruling: dict[str, idle.GPUIdlePolicy], long_idle: dict[str, Tracked]) -> None:
        """Each policy's status: whether it is in force, the idle pods of its namespace, and its
        evictions (those made since its last status write added to the count it shows)."""
        for (namespace, name), policy in list(self.policies.items()):
            in_force = ruling.get(namespace)
            force = in_force is not None and in_force.metadata.name == name
            listed = [
                idle.IdlePod(name=t.name, since=wire.timestamp(t.since), share_milli=t.share_milli)
                for uid, t in sorted(long_idle.items(), key=lambda item: item[1].name)
                if force and t.namespace == namespace and uid in self.tracked  # not evicted in this pass
            ]
            added = self.evicted.get(namespace, 0) if force else 0
            status = idle.IdleStatus(in_force=force, idle=listed, evictions=policy.status.evictions + added)
            if status == policy.status:
                continue
            path, body = resources.GPU_IDLE_POLICY.status_update(policy.metadata, policy.spec, status)
            try:
                stored = await self.api.replace(path, body)
            except errors.SharegpuError as exc:
                log.warning("GPUIdlePolicy %s/%s: cannot write its status: %s", namespace, name, exc)
                continue
            if added:
                self.evicted[namespace] -= added
            now_known = self.policies.get((namespace, name))
            if now_known is not None and now_known.metadata.resource_version == policy.metadata.resource_version:
                self.policies[(namespace, name)] = wire.convert(stored, idle.GPUIdlePolicy)
            # else: edited or deleted while the status was written: its watch event stands
