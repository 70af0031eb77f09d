"""The DRA allocator: sharegpu places the ResourceClaims of its DeviceClass, as it places pods.

kube-scheduler's own DRA allocator never allocates a claim of sharegpu's class: the class's selector
matches no device for it (`api.dra.CLASS_SELECTOR`). It honours an allocation written for it
(checking only its node selector), and it sees nothing of a pod that still waits behind the
scheduling gate `names.DRA_GATE` (the webhook adds it). So this reconciler, on the Lease holder
only, is the one writer of those allocations. Each pass, for every pod that is not bound and uses
claims of the class, oldest first:

- **Judges the budgets** of the pod's namespace before it gives its claims GPUs, as the webhook
  judges a GPU pod at admission (a pod whose claims were written by hand never was): a used-up
  Deny budget keeps it gated, a used-up Demote budget unless the pod runs at or below the demotion
  PriorityClass (`extender.budgets`), with the event below saying so.
- **Makes** the claim of sharegpu's the webhook named for the pod (`api.dra.pod_claim`: owned by
  the pod, born with its finalizer) where it is missing, and **waits** for it, or for the claims a
  template makes (kube-controller-manager names them in the pod's status), first making a template
  of sharegpu's shape names (`api.dra.Shape`) when it is missing; a claim sharegpu cannot allocate (several classes,
  allocationMode All, a selector that does not compile here...) keeps the pod gated, with a Warning
  event `ClaimNotAllocated` that says why. A gated pod with no claim of the class is let go at once.
- **Places** each unallocated claim with the configured policy (the same `Placer` the extender
  uses, over the nodes that serve DRA claims only: `ClusterCache.dra_rows`), among the nodes the
  pod's node selector, required node affinity and tolerations admit and whose CPU and memory it
  fits, on the GPUs the claim's CEL selectors and those sharegpu's DeviceClass adds pick
  (`ClusterCache.selection`; a GPU a selector fails on is not picked, and the event names the
  failure). Claims of one pod go to one node. The decision is held in the one ledger at once
  (`ClusterCache.assume_claim`), so the next decision sees it, before anything is written.
- **Writes** the allocation: the finalizer `resource.kubernetes.io/delete-protection` first (so the
  resourceclaim controller frees the claim when its pod goes), then `status.allocation` with its
  `allocationTimestamp`, each conditional on the claim's resourceVersion: a claim that changed
  meanwhile (409) is forgotten and placed again from what the watch shows next. A write whose answer
  was lost keeps its hold until a read settles it: allocated (held until the watch shows it), or
  not and no longer able to land (its resourceVersion has moved on, or `WRITE_DEADLINE` passed:
  forgotten).
- **Lifts the gate** once the watch shows every claim of the class allocated, not as soon as the
  writes are answered: kube-scheduler's own watch is then about as far, and does not take the pod
  for one whose claim is unallocated (it would fail it, and its PostFilter clear the allocation
  that arrived meanwhile; on 1000 nodes that happened to 88 of 2000 pods).

Decisions are made one pod after the other, in one pass; the writes of different pods then go out
together (`writers` at a time), each pod's claims in order; gates are lifted in a later pass. A pod
whose claims cannot all be placed gets none of them. A pod behind another scheduling gate too
(Kueue's, until Kueue admits it) is not considered: nothing is allocated for a pod its queue has not
admitted. A gang (`api.gangs`) is one decision (`_plan_gang`): every waiting member's claims, or none
of them, and nothing while fewer members wait than its minimum needs, each member first on the nodes
the gang already uses, all within one value of its topology label when it names one; its members'
gates go up together once all their claims are shown allocated.
A gang some of whose members' claims are allocated while another member's are not (it cannot be
placed: its write failed and its room was taken; or its writes keep failing) is partial: once it has
been so for the gang's timeout, the allocations of its waiting members are cleared (`_give_back`), and the gang is not
planned again for as long: a gang that cannot complete holds GPUs for at most its timeout at a
time on this path too, then leaves them to others (no member is bound meanwhile: the gates stay down).

Then the takeovers and leftovers:

- **kube-scheduler's PostFilter** clears the allocation of a claim nobody reserved when the pod fits
  no node (for something sharegpu does not model: pod affinity, ports...). The ledger frees it when
  the watch shows it cleared, and the node it was on is avoided for that pod (`avoid`) from then on,
  all nodes again once none is left.
- **A claim left allocated** (of the class, unreserved, that no pod waiting to be bound uses) for
  `orphan_after` seconds has its allocation cleared, conditionally on its resourceVersion.

A new leader waits `fence` seconds before its first write: by then every write the previous leader
had sent has landed or failed, and the watch shows it, so no two leaders' decisions meet on one GPU.
A write held in flight longer than that cannot land at all: the policy `sharegpu-leader` refuses the
extender's changes of claims from any pod but the Lease holder's, when the API server handles them.
Meanwhile it only makes missing templates (a creation cannot clash: the template exists or not), so
the claims are made and ready when the fence ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sharegpu.api import dra, events, names, paths, pods, reasons, wire
from sharegpu.api import gangs as api_gangs
from sharegpu.core import allocation, errors, fit, fleet, units
from sharegpu.core import gangs as core_gangs
from sharegpu.extender import budgets as extender_budgets
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import handle as extender_handle
from sharegpu.extender import metrics as extender_metrics
from sharegpu.kube import client, reconcile
from sharegpu.kube import errors as kube_errors

log = logging.getLogger(__name__)

FENCE = 20.0
"""Seconds a new leader waits before it writes (more than a lease's duration past its renew deadline)."""
SETTLE = 5.0
"""Seconds after a write whose answer was lost before it is read back."""
WRITE_DEADLINE = 60.0
"""Seconds after which a write the API server never answered can no longer land (kube-apiserver's
default --request-timeout)."""
WRITERS = 16
"""Pods whose claims are written at the same time (each pod's claims one after the other)."""
TEMPLATE_RETRY = 10.0
"""Seconds before a claim template, or a pod's claim by name, is made again (one that could not be,
or that went since)."""
ORPHAN_AFTER = 30.0
"""Seconds a claim of the class stays allocated with no pod using or waiting for it before it is cleared."""
STRANDED_AFTER = 30.0
"""Seconds a pod's claims written earlier may pin it to a node where its other claims find no room
before they are cleared and all placed together again (a write of the others refused meanwhile, the
room taken by an older pod's claim)."""


@dataclass(frozen=True, slots=True)
class Unsure:
    """A write whose answer was lost: the claim's resourceVersion it was conditional on, and when."""

    resource_version: str
    at: float
    """When it was last looked at."""
    sent: float
    """When the write was sent."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What one pass decided for one pod: its claims' allocations to write, then its gate to lift."""

    record: pods.Record
    decided: tuple[tuple[dra.ClaimRecord, allocation.Allocation], ...]
    lift: bool
    """Lift the pod's gate (nothing to write: the watch shows every claim of the class allocated)."""


@dataclass(slots=True)
class Pass:
    """What one pass of the allocator works out once and forgets after."""

    room: dict[str, int]
    """Per DRA node that says its pod capacity, how many more pods it takes (less those decided)."""
    admitted: dict[tuple[bytes, int], np.ndarray] = field(default_factory=dict)
    """Per pod constraints and fleet state, the DRA rows they admit (the pods of one controller share
    their constraints: judged once)."""


class ClaimAllocator(extender_handle.Reconciler):
    def __init__(
        self,
        handle: extender_handle.Handle,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        fence: float = FENCE,
        settle: float = SETTLE,
        orphan_after: float = ORPHAN_AFTER,
        writers: int = WRITERS,
        budgets: extender_budgets.BudgetGuard | None = None,
    ) -> None:
        super().__init__(handle)
        self.budgets = budgets
        """The namespaces' GPU-time budgets (a pod the webhook never judged is judged here); None: none."""
        self.writers = writers
        """Pods whose allocations are written at once (decisions are made one after the other)."""
        self.is_leader = is_leader
        self.fence = fence
        self.settle = settle
        self.orphan_after = orphan_after
        self.term_started: float | None = None
        """When this replica's current term as leader began (None: not leading)."""
        self.unsure: dict[units.PodKey, Unsure] = {}
        self.avoid: dict[str, set[str]] = {}
        """Pod UID -> nodes kube-scheduler turned it away from (its claims' allocation there was cleared)."""
        self.placed_on: dict[units.PodKey, tuple[str, str]] = {}
        """Claim -> (pod UID, node) of the last allocation written for it, to learn from a takeover."""
        self.unused_since: dict[units.PodKey, float] = {}
        """Allocated claims of the class that no pod uses or waits for -> since when."""
        self.said: set[tuple[str, str]] = set()
        """(pod UID, message) of the events recorded."""
        self.lifted: dict[str, str] = {}
        """Pod UID -> the resourceVersion it had when its gate was lifted (not lifted again until the
        watch shows it changed)."""
        self.this_pass = Pass(room={})
        """What the pass under way has worked out (a fresh one each pass)."""
        self.tried: dict[str, float] = {}
        """The templates of sharegpu's and the pods' claims by name this allocator tried to make ("<kind>
        <namespace>/<name>") -> when."""
        self._excluding: set[str] = set()
        """While a fresh pod's first claim is placed again: the nodes where its other claims did not fit."""
        self._within: set[str] | None = None
        """The nodes a gang being planned must stay within (one value of its topology label)."""
        self._beside: tuple[dict[str, tuple[int, ...]], int] | None = None
        """While a gang's member is placed: the GPUs the gang holds per node, and how many members
        follow it (its whole GPUs go beside the gang's, `core.gangs.beside`)."""
        self.partial: dict[str, float] = {}
        """Gang key -> since when some of its waiting members' claims are allocated while another
        member's are not (`_give_back`)."""
        self.stranded: dict[str, float] = {}
        """Pod UID (not a gang's) -> since when some of its claims are allocated on a node where the
        rest cannot join them (`_unpin`)."""
        self.resting: dict[str, float] = {}
        """Gang key -> until when a gang given back is not planned again (its room is others' meanwhile)."""
        self.loop = reconcile.Loop("dra-allocator", self.reconcile)

    def wake(self) -> None:
        self.loop.wake()

    async def run(self, tick: float = 1.0, pace: float = 0.05) -> None:
        try:
            await self.loop.run(tick, pace)
        finally:
            self.term_started = None
            self.unused_since.clear()  # another leader may use and free them meanwhile: a new term waits anew

    # ----------------------------------------------------------------- the pass

    async def reconcile(self) -> None:
        now = self.clock()
        if self.term_started is None:
            self.term_started = now
            log.info("DRA allocator: leading; first write in %.0f s (the previous leader's writes settle)", self.fence)
        self._learn()
        if now - self.term_started < self.fence:
            await self._make_templates()  # a creation cannot race the previous leader's: it exists or not
            return
        await self._settle()
        self.this_pass = Pass(room=self._pod_room())
        plans = []
        gangs: dict[str, list[pods.Record]] = {}
        for key in sorted(self.cache.claiming, key=self._age):
            record = self.cache.record(key)
            if record is not None and record.held_elsewhere:
                continue  # another gate first (Kueue's admission): its claims hold nothing before
            if record is not None and not record.node and self.is_leader():
                if record.gang is not None:
                    gangs.setdefault(record.gang.key, []).append(record)
                    continue
                plan = await self._plan(record)
                if plan is not None:
                    plans.append(plan)
        for members in gangs.values():
            plans += await self._plan_gang(members)
        limit = asyncio.Semaphore(self.writers)

        async def carry_out(plan: Plan) -> None:
            async with limit:
                await self._carry_out(plan)

        await asyncio.gather(*(carry_out(p) for p in plans))
        await self._clear_unused()

    def _age(self, key: units.PodKey) -> tuple[str, str]:
        record = self.cache.record(key)
        return (record.created if record is not None else "", key)

    def _learn(self) -> None:
        """A write left unanswered that the watch now shows landed is known; a claim this allocator
        placed that the watch then showed unallocated again was taken back by kube-scheduler: its pod
        avoids that node."""
        for key in list(self.unsure):
            shown = self.cache.claims.records.get(key)
            if shown is not None and shown.allocated and key not in self.cache.claims.assumed:
                del self.unsure[key]  # the watch shows the write that was not answered
        cleared, self.cache.claims.cleared = self.cache.claims.cleared, {}
        for key, node in cleared.items():
            placed = self.placed_on.pop(key, None)
            if placed is not None and placed[1] == node:
                self.avoid.setdefault(placed[0], set()).add(node)
                self.metrics.claims.labels(extender_metrics.ClaimOutcome.TAKEN_BACK).inc()
                log.info("claim %s: kube-scheduler cleared its allocation on %s; its pod avoids that node", key, node)
        for key in [k for k in self.placed_on if k not in self.cache.claims.records]:
            del self.placed_on[key]
        claiming = [r for r in map(self.cache.record, self.cache.claiming) if r is not None]
        waiting = {r.uid for r in claiming if r.gated}
        self.lifted = {uid: version for uid, version in self.lifted.items() if uid in waiting}
        uids = {r.uid for r in claiming}
        self.stranded = {uid: since for uid, since in self.stranded.items() if uid in uids}

    # ----------------------------------------------------------------- one pod

    async def _claims_of(self, record: pods.Record) -> list[dra.ClaimRecord] | None:
        """The pod's claims of the class; None while any of its claims is not made (or not seen) yet (a
        template of sharegpu's, or a pod's claim of sharegpu's by name, that is missing is made here:
        the webhook names it, without writing)."""
        namespace = record.key.split("/", 1)[0]
        found = []
        for ref in record.claims:
            if self._missing(namespace, ref):
                await self._make_for(record, ref)
                return None  # not made yet, or not seen yet: it may be of the class
            claim = self.cache.claims.records.get(dra.claim_key(namespace, ref.claim))
            if claim is None or not claim.ours:
                continue
            shape = dra.template_shape(ref.template) if ref.template else dra.claim_shape(ref.claim)
            if shape is not None and claim.problem is None and not dra.asks_as_named(claim, shape):
                named = f"template {ref.template}" if ref.template else "its name"
                claim = dataclasses.replace(claim, problem=(
                    f"claim {claim.namespace}/{claim.name} asks for other than {named} says ({shape.count} GPU(s) "
                    f"of {shape.milli} milli-GPU): it is not what sharegpu makes for the pod's request (what its "
                    "quota totals count); delete it, sharegpu makes the right one"
                ))  # fmt: skip
            found.append(claim)
        return found

    def _missing(self, namespace: str, ref: pods.ClaimRef) -> bool:
        """The claim `ref` names is not made yet (a template's), or not seen yet (by name)."""
        if not ref.claim:
            return True
        key = dra.claim_key(namespace, ref.claim)
        return key not in self.cache.claims.records and key not in self.cache.claims.foreign

    async def _make_templates(self) -> None:
        """The missing templates of sharegpu's the waiting pods name (so that kube-controller-manager
        makes their claims while a new leader waits out its fence), and their missing claims of
        sharegpu's by name (`api.dra.pod_claim`)."""
        for key in sorted(self.cache.claiming):  # a copy: the watch changes the set while a creation waits
            record = self.cache.record(key)
            if record is None or record.node:
                continue
            for ref in record.claims:
                if self._missing(key.split("/", 1)[0], ref):
                    await self._make_for(record, ref)

    async def _make_for(self, record: pods.Record, ref: pods.ClaimRef) -> None:
        """Make what a missing claim of the pod's comes from, where the name is sharegpu's: the
        template of a shape, or the pod's own claim by name (owned by the pod)."""
        namespace, pod = record.key.split("/", 1)
        if not ref.claim and dra.template_shape(ref.template) is not None:
            body = dra.template(namespace, ref.template)
            await self._create_once(
                extender_metrics.ClaimOutcome.TEMPLATE, dra.template_path(namespace), body, announce=True
            )
        elif ref.claim and dra.claim_shape(ref.claim) is not None:
            body = dra.pod_claim(namespace, ref.claim, pod, record.uid)
            await self._create_once(extender_metrics.ClaimOutcome.MADE, dra.claim_path(namespace), body, announce=False)

    async def _create_once(
        self, outcome: extender_metrics.ClaimOutcome, collection: str, body: dict[str, Any], *, announce: bool
    ) -> None:
        """Create `body` in `collection` (once; again after `TEMPLATE_RETRY` if it is still not seen),
        counted as `outcome`; one that exists already is left as it is."""
        meta = body["metadata"]
        what = f"{body['kind']} {meta['namespace']}/{meta['name']}"
        now = self.clock()
        last = self.tried.get(what)
        if last is not None and now - last < TEMPLATE_RETRY:
            return
        if len(self.tried) > 4096:  # one entry per pod claim: only those that may still be retried are kept
            self.tried = {k: at for k, at in self.tried.items() if now - at < TEMPLATE_RETRY}
        self.tried[what] = now
        try:
            await self.api.create(collection, body)
        except kube_errors.ConflictError as exc:
            if not exc.already_exists:
                log.warning("%s: %s", what, exc)
            return
        except errors.SharegpuError as exc:
            log.warning("%s could not be made (tried again in %.0f s): %s", what, TEMPLATE_RETRY, exc)
            return
        self.metrics.claims.labels(outcome).inc()
        if announce:
            log.info("%s made", what)

    async def _plan(self, record: pods.Record, prefer: Sequence[str] = ()) -> Plan | None:
        """Decide the pod's unallocated claims (held in the ledger at once, so the next pod's decision
        sees them), all on one node or none of them; None when there is nothing to write or lift.
        `prefer`: nodes tried first, in order, for a pod none of whose claims is placed yet (a gang's
        nodes, so the gang spreads over few)."""
        claims = await self._claims_of(record)
        if claims is None:
            return None
        problems = [c.problem for c in claims if c.problem is not None]
        problems += _crowded(record, claims)
        if self.cache.class_problem is not None and any(c.ours for c in claims):
            problems.append(self.cache.class_problem)
        if problems:
            await self._say(record, "; ".join(problems))
            return None
        done = [c for c in claims if c.allocated or c.key in self.cache.claims.assumed]
        todo = [c for c in claims if c not in done]
        if todo and self.budgets is not None:
            held_back = self.budgets.refusal(record.key.split("/", 1)[0], record.priority)
            if held_back is not None:
                await self._say(record, held_back)
                return None
        nodes = {self._node_of(c) for c in done} - {None}
        if todo and record.gang is None and nodes & self.avoid.get(record.uid, set()):
            # kube-scheduler turned the pod away from the node its other claims are on (its PostFilter
            # takes back one claim a cycle): they go too, and all are placed together elsewhere
            await self._unpin(record, done, "kube-scheduler turned it away from the node its other claims are on")
            return None
        fresh = not nodes  # the pod takes a node's pod slot only once, with its first claim there
        decided: list[tuple[dra.ClaimRecord, allocation.Allocation]] = []
        tried: set[str] = set()  # nodes a fresh pod's first claim went to where the rest did not fit
        refusal = ""  # why the rest did not fit the first of those
        pending = list(todo)
        while pending:
            claim = pending.pop(0)
            if len(nodes) > 1:
                placed = Placement(
                    refusal=f"its claims are allocated on several nodes: {sorted(n for n in nodes if n)}"
                )
            elif nodes:
                placed = self._place(record, claim, next(iter(nodes)))
            else:
                placed = self._place_fresh(record, claim, prefer, tried)
            if placed.allocation is None:
                for undone, _ in decided:
                    self.cache.forget_claim(undone.key)
                if fresh and decided:  # the first claim's node had no room for the rest: all of them on another
                    tried.add(decided[0][1].node)
                    refusal = refusal or placed.refusal
                    decided, nodes, pending = [], set(), list(todo)
                    continue
                await self._say(record, refusal or placed.refusal)
                if record.gang is None and not fresh:  # pinned by claims written earlier: let go of them in time
                    since = self.stranded.setdefault(record.uid, self.clock())
                    if self.clock() - since >= STRANDED_AFTER:
                        await self._unpin(record, done, f"its other claims' node has had no room for it for "
                                                        f"{STRANDED_AFTER:.0f} s")  # fmt: skip
                return None
            decided.append((claim, placed.allocation))
            nodes.add(placed.allocation.node)
        if decided and fresh and decided[0][1].node in self.this_pass.room:
            self.this_pass.room[decided[0][1].node] -= 1
        shown = all(c.allocated and c.key not in self.cache.claims.assumed for c in claims)
        lift = not decided and shown and record.gated and self.lifted.get(record.uid) != record.resource_version
        if not decided and not lift:
            return None
        return Plan(record, tuple(decided), lift)

    async def _plan_gang(self, members: list[pods.Record]) -> list[Plan]:
        """A gang's members, all of them or none: each member's claims placed as `_plan` places a pod's
        (and held at once); if any member that needs GPUs is left without them, every claim placed for
        the gang in this pass is let go again. Nothing is placed while fewer members wait than the
        gang's minimum still needs (members running count toward it)."""
        gang = members[0].gang
        assert gang is not None
        everyone = self.cache.live_gang_members(gang.key)
        running = sum(1 for m in everyone if m.node or not (m.claims or m.gpu))
        need = gang.min_count - running
        if len(members) < need:
            for record in members:
                await self._say(record, f"gang {gang.key} waits for its members: {running + len(members)} of "
                                        f"{gang.min_count} needed are here")  # fmt: skip
            return []
        if self.resting.get(gang.key, 0.0) > self.clock():
            return []  # given back at its timeout: others may use the room for as long again
        self.resting.pop(gang.key, None)
        used = self._gang_nodes(everyone)
        domains = self._domains(gang.topology, used) if gang.topology and need > 0 else [None]
        plans: list[Plan] = []
        failed: pods.Record | None = None
        for domain in domains[: core_gangs.MAX_DOMAINS]:
            room = dict(self.this_pass.room)
            self._within = domain
            try:
                plans, failed = await self._try_members(members, need, list(used))
            finally:
                self._within = None
            if failed is None:
                break
            self.this_pass.room = room  # what the failed try took
        if failed is not None or not domains:
            where = f" within one value of {gang.topology}" if gang.topology else ""
            why = (f"member {failed.key} cannot be placed now{where}" if failed is not None
                   else f"no node serving DRA claims has the label {gang.topology}")  # fmt: skip
            for other in members:
                if other is not failed:
                    await self._say(other, f"gang {gang.key}: {why}; none of the gang's claims is allocated")
            await self._give_back(gang, members)
            return []
        if need > 0 and not all(self._held(m, shown=True) for m in members):
            plans = [p for p in plans if not p.lift]  # the gates go up together, once all are allocated
            await self._give_back(gang, members)
        else:
            self.partial.pop(gang.key, None)
        return plans

    async def _try_members(
        self, members: list[pods.Record], need: int, used: list[str]
    ) -> tuple[list[Plan], pods.Record | None]:
        """Every member's claims placed in turn, first on the gang's nodes: the plans, and the member
        left without its claims (then every claim placed here is let go again), or None."""
        plans: list[Plan] = []
        anchor = self._gang_gpus(members)
        for position, record in enumerate(members):
            self._beside = (anchor, len(members) - position - 1) if need > 0 else None
            try:
                plan = await self._plan(record, prefer=used if need > 0 else ())
            finally:
                self._beside = None
            if plan is not None:
                plans.append(plan)
                used += [n for n in {a.node for _, a in plan.decided} if n not in used]
                for _, placed in plan.decided:
                    anchor[placed.node] = (*anchor.get(placed.node, ()), *placed.gpu_indices)
            if need > 0 and not self._held(record):
                for made in plans:
                    for claim, _ in made.decided:
                        self.cache.forget_claim(claim.key)
                return [], record
        return plans, None

    def _domains(self, label: str, used: list[str]) -> list[set[str] | None]:
        """The sets of DRA nodes a gang with topology `label` may use: the nodes of one value of the
        label, the value of the nodes it uses already when it uses some, else every value, the
        tightest first (least free compute); nodes without the label are in none."""
        cache = self.cache
        state = cache.state
        found = cache.by_label(label, np.flatnonzero(cache.dra_rows).tolist())
        held = {v for v, rows in found.items() if any(state.names[r] in used for r in rows)}
        if held:
            found = {v: rows for v, rows in found.items() if v in held}
        free = state.milli_free * state.present * state.healthy
        ranked = sorted(found.items(), key=lambda item: (int(free[item[1]].sum()), item[0]))
        return [{state.names[r] for r in rows} for _, rows in ranked]

    def _holdings(self, record: pods.Record) -> list[allocation.Allocation]:
        """The allocations the pod's claims hold (allocated, or decided in this pass)."""
        return [held for key in _claim_keys(record) if (held := self.cache.claims.holding(key)) is not None]

    def _gang_gpus(self, members: list[pods.Record]) -> dict[str, tuple[int, ...]]:
        """Per node, the GPUs the members' allocated claims hold there."""
        found: dict[str, tuple[int, ...]] = {}
        for record in members:
            for held in self._holdings(record):
                found[held.node] = (*found.get(held.node, ()), *held.gpu_indices)
        return found

    def _gang_nodes(self, members: list[pods.Record]) -> list[str]:
        """The nodes a gang's members hold claims on already (or run on)."""
        found: list[str] = []
        for record in members:
            for node in (record.node, *(held.node for held in self._holdings(record))):
                if node and node not in found:
                    found.append(node)
        return found

    async def _unpin(self, record: pods.Record, done: list[dra.ClaimRecord], why: str) -> None:
        """Clear the allocations of a pod's claims (not a gang's) that pin it to a node where it cannot
        go (those not reserved for a running pod, and not being written), so that all its claims
        are placed together again."""
        held = self._clearable(done)
        cleared = await self._let_go(held)
        if cleared == len(held):
            self.stranded.pop(record.uid, None)
        log.warning("pod %s: %s; %d of its claims' allocation(s) cleared, all placed together again",
                    record.key, why, cleared)  # fmt: skip
        await self._say(record, f"{why}; its claims are placed together again")

    def _clearable(self, claims: list[dra.ClaimRecord]) -> list[dra.ClaimRecord]:
        """Of `claims`, those of the class whose allocation this allocator may clear: allocated, reserved
        for no pod (none runs on it), and not being written."""
        assumed = self.cache.claims.assumed
        return [c for c in claims if c.ours and c.allocated and not c.reserved and c.key not in assumed]

    async def _let_go(self, held: list[dra.ClaimRecord]) -> int:
        """Clear these claims' allocations (conditionally, `_clear`); how many were cleared."""
        for claim in held:
            self.placed_on.pop(claim.key, None)  # cleared by this allocator, not taken back by kube-scheduler
        return sum([await self._clear(claim) for claim in held])

    async def _give_back(self, gang: api_gangs.Gang, members: list[pods.Record]) -> None:
        """A gang not allocated whole (a member cannot be placed, or its write keeps failing): the
        claims its waiting members hold already (written in an earlier pass) are cleared once it has
        been so for the gang's timeout."""
        records = self.cache.claims.records
        held = self._clearable([c for m in members for k in _claim_keys(m) if (c := records.get(k)) is not None])
        if not held:
            self.partial.pop(gang.key, None)
            return
        now = self.clock()
        since = self.partial.setdefault(gang.key, now)
        if now - since < gang.timeout_s:
            return
        cleared = await self._let_go(held)
        if cleared == len(held):
            del self.partial[gang.key]
            self.resting[gang.key] = now + gang.timeout_s
        log.warning("gang %s: not placed whole within its timeout (%d s); %d of its members' claim allocation(s) "
                    "cleared", gang.key, gang.timeout_s, cleared)  # fmt: skip
        for record in members:
            await self._say(record, f"gang {gang.key}: not placed whole within its timeout ({gang.timeout_s} s); "
                                    "the claims its members held are given back")  # fmt: skip

    def _place_fresh(
        self, record: pods.Record, claim: dra.ClaimRecord, prefer: Sequence[str], tried: set[str]
    ) -> Placement:
        """A fresh pod's first claim, on a node other than those `tried` (where its other claims did not
        fit beside it); why it fits nowhere once every node was tried."""
        if not tried:
            return self._place_preferring(record, claim, prefer)
        self._excluding = tried
        try:
            placed = self._place_preferring(record, claim, [n for n in prefer if n not in tried])
        finally:
            self._excluding = set()
        return placed

    def _place_preferring(self, record: pods.Record, claim: dra.ClaimRecord, prefer: Sequence[str]) -> Placement:
        """The claim placed on the first of `prefer` that the pod may use and that fits it, else
        wherever the policy places it."""
        if prefer:
            names_ = self.cache.state.names
            allowed = {names_[r] for r in self._rows(record, None)[0].tolist()}
            for node in prefer:
                if node in allowed and self.this_pass.room.get(node, 1) > 0:
                    placed = self._place(record, claim, node)
                    if placed.allocation is not None:
                        return placed
        return self._place(record, claim, None)

    def _held(self, record: pods.Record, *, shown: bool = False) -> bool:
        """Every claim of the class the pod uses is allocated, or held by a decision of this pass
        (`shown`: allocated as the watch shows it, no decision waiting to be written)."""
        namespace = record.key.split("/", 1)[0]
        for ref in record.claims:
            claim = self.cache.claims.records.get(dra.claim_key(namespace, ref.claim))
            if claim is None:
                return False
            if not claim.ours:
                continue
            assumed = claim.key in self.cache.claims.assumed
            written = claim.allocated and not assumed
            if not (written if shown else claim.allocated or assumed):
                return False
        return True

    async def _carry_out(self, plan: Plan) -> None:
        """Write the plan's allocations, one after the other (a decision left unwritten is let go), or
        lift the gate."""
        record = plan.record
        if plan.lift:
            await self._lift(record)
            return
        written = 0
        try:
            for claim, placed in plan.decided:
                if not await self._write(record, claim, placed):
                    break
                written += 1
        finally:
            for claim, _ in plan.decided[written:]:
                if claim.key not in self.unsure:
                    self.cache.forget_claim(claim.key)

    def _node_of(self, claim: dra.ClaimRecord) -> str | None:
        held = self.cache.claims.holding(claim.key)
        return held.node if held is not None else None

    def _pod_room(self) -> dict[str, int]:
        """Per DRA node that says its pod capacity: how many more pods it takes, counting the pods
        bound there and the waiting pods whose claims are allocated there (they are bound there next).
        kube-scheduler would turn a pod away from a full node and take its claims' allocation back.
        A pod that is not bound next is not counted: behind a gate not sharegpu's, naming a claim that
        does not exist, or one sharegpu never lifts its gate for (a claim's problem, a crowded
        container); else a tenant's pods that never bind, naming one small claim, closed a node."""
        cache = self.cache
        incoming: Counter[str] = Counter()
        for key in cache.claiming:
            record = cache.record(key)
            if record is None or not self._bound_next(record):
                continue
            namespace = key.split("/", 1)[0]
            for ref in record.claims:
                claim = dra.claim_key(namespace, ref.claim) if ref.claim else None
                held = cache.claims.holding(claim) if claim else None
                if held is not None:
                    incoming[held.node] += 1
                    break
        room: dict[str, int] = {}
        for row in np.flatnonzero(cache.dra_rows).tolist():
            name = cache.state.names[row]
            facts = cache.nodes.get(name)
            if facts is not None and facts.pods:
                room[name] = facts.pods - cache.pods_on[name] - incoming[name]
        return room

    def _bound_next(self, record: pods.Record) -> bool:
        """Nothing but claims being placed keeps the pod from being bound: no gate of another's, every
        claim it names made, none that sharegpu refuses to place for it."""
        if record.held_elsewhere:
            return False
        namespace = record.key.split("/", 1)[0]
        claims = []
        for ref in record.claims:
            claim = self.cache.claims.records.get(dra.claim_key(namespace, ref.claim)) if ref.claim else None
            if claim is None:
                return False
            if claim.ours:
                if claim.problem is not None:
                    return False
                claims.append(claim)
        return not _crowded(record, claims)

    def _rows(self, record: pods.Record, node: str | None) -> tuple[np.ndarray, int]:
        """Candidate rows for the pod's claims (nodes serving DRA claims that the pod's own constraints
        admit, not avoided), and how many DRA nodes its constraints turned away."""
        cache = self.cache
        state = cache.state
        if node is not None:
            row = state.row(node)
            return (np.array([row], dtype=np.int64) if row is not None else np.empty(0, np.int64)), 0
        everywhere = np.flatnonzero(cache.dra_rows)
        terms = record.terms
        if terms is None or terms.unconstrained:
            admitted = everywhere
        else:  # the pods of one controller share their constraints: judged once per pass and state
            memo = (terms.key, id(state))
            found = self.this_pass.admitted.get(memo)
            if found is None:
                found = np.array(
                    [r for r in everywhere.tolist() if self.cache.admits(terms, state.names[r])], dtype=np.int64
                )
                self.this_pass.admitted[memo] = found
            admitted = found
        if self._within is not None:
            admitted = np.array([r for r in admitted.tolist() if state.names[r] in self._within], dtype=np.int64)
        if self._excluding:
            admitted = np.array([r for r in admitted.tolist() if state.names[r] not in self._excluding], dtype=np.int64)
        avoided = self.avoid.get(record.uid)
        if avoided:
            kept = np.array([r for r in admitted.tolist() if state.names[r] not in avoided], dtype=np.int64)
            if not len(kept):
                self.avoid.pop(record.uid, None)  # every node tried: all of them again
                kept = admitted
        else:
            kept = admitted
        return kept, len(everywhere) - len(admitted)

    def _place(self, record: pods.Record, claim: dra.ClaimRecord, node: str | None) -> Placement:
        """The claim's allocation, held in the ledger, or why it fits nowhere."""
        cache = self.cache
        chosen = (*cache.class_selectors, *claim.selectors)
        selection = cache.selection(chosen) if chosen else None
        try:
            request = claim.pod_request(record.cpu_milli, record.memory_mib, selection.name if selection else "")
        except errors.InvalidInputError as exc:
            return Placement(refusal=f"claim {claim.namespace}/{claim.name}: {exc}")
        rows, turned_away = self._rows(record, node)
        full = 0
        if node is None and self.this_pass.room:
            names = cache.state.names
            open_rows = [r for r in rows.tolist() if self.this_pass.room.get(names[r], 1) > 0]
            full = len(rows) - len(open_rows)
            rows = np.array(open_rows, dtype=np.int64)
        if not len(rows) and full:
            return Placement(
                refusal=f"claim {claim.namespace}/{claim.name}: the {full} node(s) serving DRA claims that admit "
                "the pod hold as many pods as they take (allocatable pods)"
            )
        if not len(rows):
            if node is not None:
                where = f"claim {claim.namespace}/{claim.name}"
                return Placement(
                    refusal=f"{where} must join its pod's other claims on {node}, which serves no DRA claims"
                )
            dra_nodes = int(cache.dra_rows.sum())
            if not dra_nodes:
                return Placement(refusal="no node serves sharegpu's DRA claims (agents with --dra publish them)")
            return Placement(
                refusal=f"none of the {dra_nodes} node(s) serving DRA claims admits the pod "
                "(node selector, affinity, taints)"
            )
        placer = cache.placer
        groups: list[extender_cache.Selection | None] = [selection]
        if claim.match:
            groups = list(cache.matching(claim.match, selection))
            if not groups:
                return Placement(
                    refusal=f"claim {claim.namespace}/{claim.name}: no GPU serving DRA claims has the attributes "
                    f"its matchAttribute names ({', '.join(claim.match)}) among those its selectors pick"
                )
        decision = None
        with _tolerating(cache.state, cache.tolerated(claim)):
            for group in groups:  # matchAttribute: the GPUs with one value of the attributes, in turn
                if group is not selection:  # the request above names the claim's selection already
                    request = claim.pod_request(record.cpu_milli, record.memory_mib, group.name if group else "")
                decision = placer.decide(request.demand, rows)
                if decision.status.ok:
                    break
        assert decision is not None
        if not decision.status.ok:
            diagnosis = fit.diagnose(cache.state, request.demand, rows)
            failed = reasons.failures([cache.state.names[r] for r in rows.tolist()], diagnosis, request.demand)
            text = failed.message(len(rows))
            if claim.match:
                text = f"with one value of {', '.join(claim.match)} (tried {len(groups)}, the last: {text})"
            if turned_away:
                text += f" ({turned_away} more turned away by the pod's node constraints)"
            text += _untolerated(cache, claim, {cache.state.names[r] for r in rows.tolist()})
            if selection is not None and selection.failures:
                more = f" and {len(selection.failures) - 1} more" if len(selection.failures) > 1 else ""
                text += f"; a device selector failed on {selection.failures[0]}{more}"
            return Placement(refusal=f"claim {claim.namespace}/{claim.name}: {text}")
        if self._beside is not None and request.demand.whole and decision.node is not None:
            anchor, later = self._beside  # a gang's member: its GPUs beside the gang's on the node
            decision = core_gangs.beside(cache.state, request.demand, decision, anchor.get(decision.node, ()), later)
        placed = placer.allocation_for(request, decision)
        # The pod holds its CPU and memory itself once bound: the claim holds only its GPU shares.
        placed = dataclasses.replace(placed, cpu_milli=0, memory_mib=0, device_claim=True)
        if not cache.assume_claim(placed):
            return Placement(refusal=f"claim {claim.namespace}/{claim.name}: the decision did not fit the ledger")
        return Placement(allocation=placed)

    # ----------------------------------------------------------------- writes

    async def _write(self, record: pods.Record, claim: dra.ClaimRecord, placed: allocation.Allocation) -> bool:
        """Write the claim's allocation; True when it is written (or may have been)."""
        path = dra.claim_path(claim.namespace, claim.name)
        version = claim.resource_version
        self.placed_on[claim.key] = (record.uid, placed.node)  # before the write: its takeover may come first
        grants = sum(len(c.devices) for c in placed.containers)
        status = dra.claim_allocation(placed, [str(uuid.uuid4()) for _ in range(grants)], wire.timestamp(time.time()))
        try:
            if not claim.protected and self.is_leader():
                finalizers = [*claim.finalizers, dra.DELETE_PROTECTION]
                patched = await self.api.patch(
                    path, {"metadata": {"resourceVersion": version, "finalizers": finalizers}}
                )
                version = patched["metadata"]["resourceVersion"]
            if not self.is_leader():  # the Lease was lost meanwhile: the next leader decides
                self.cache.forget_claim(claim.key)
                self.placed_on.pop(claim.key, None)
                return False
            body = {"metadata": {"resourceVersion": version}, "status": {"allocation": status}}
            await self.api.patch(f"{path}/status", body)
        except errors.SharegpuError as exc:
            outcome = kube_errors.outcome(exc)
            self.metrics.claims.labels(extender_metrics.ClaimOutcome(outcome.value)).inc()
            if outcome is kube_errors.Outcome.UNKNOWN:
                self.unsure[claim.key] = Unsure(version, self.clock(), self.clock())
                log.warning("claim %s: the answer to writing its allocation was lost; read back in %.0f s",
                            claim.key, self.settle)  # fmt: skip
                return True
            self.cache.forget_claim(claim.key)
            self.placed_on.pop(claim.key, None)
            if not isinstance(exc, kube_errors.ConflictError | kube_errors.NotFoundError):
                log.warning("claim %s: writing its allocation failed: %s", claim.key, exc)
            return False
        self.metrics.claims.labels(extender_metrics.ClaimOutcome.ALLOCATED).inc()
        log.info("claim %s allocated on %s GPU(s) %s for pod %s", claim.key, placed.node,
                 sorted(placed.gpu_usage()), record.key)  # fmt: skip
        return True

    async def _lift(self, record: pods.Record) -> None:
        """Remove the gate, only from this pod (its UID) and only that gate (its name at its position,
        as the watch showed it): a pod changed meanwhile refuses the patch, and the next pass sees it."""
        namespace, name = record.key.split("/", 1)
        patch = [
            {"op": "test", "path": "/metadata/uid", "value": record.uid},
            {"op": "test", "path": f"/spec/schedulingGates/{record.gate}/name", "value": names.DRA_GATE},
            {"op": "remove", "path": f"/spec/schedulingGates/{record.gate}"},
        ]
        try:
            await self.api.patch(paths.pod(namespace, name), patch, client.JSON_PATCH)
        except errors.SharegpuError as exc:
            log.warning("pod %s: lifting its gate failed (tried again next pass): %s", record.key, exc)
            return
        self.lifted[record.uid] = record.resource_version
        self.metrics.claims.labels(extender_metrics.ClaimOutcome.UNGATED).inc()
        log.info("pod %s: its claims are allocated; gate %s lifted", record.key, names.DRA_GATE)

    async def _say(self, record: pods.Record, message: str) -> None:
        if (record.uid, message) in self.said:
            return
        namespace, name = record.key.split("/", 1)
        decision = "dra|" + hashlib.blake2b(message.encode(), digest_size=6).hexdigest()
        try:
            await self.recorder.record(
                events.pod(namespace, name, record.uid), "ClaimNotAllocated", f"sharegpu: {message}",
                decision=decision, kind="Warning",
            )  # fmt: skip
        except errors.SharegpuError as exc:
            log.warning("event on %s: %s", record.key, exc)
            return
        self.said.add((record.uid, message))
        log.info("pod %s: its claims are not allocated: %s", record.key, message)

    # ----------------------------------------------------------------- settling and clearing

    async def _settle(self) -> None:
        """Read back writes whose answer was lost, `settle` seconds on."""
        now = self.clock()
        for key, unsure in list(self.unsure.items()):
            if now - unsure.at < self.settle:
                continue
            named = dra.ClaimName.of(key)
            if named is None:
                del self.unsure[key]
                continue
            try:
                found: dict[str, Any] | None = await self.api.get(dra.claim_path(named.namespace, named.name))
            except kube_errors.NotFoundError:
                found = None
            except errors.SharegpuError as exc:
                log.warning("claim %s: cannot read back its allocation: %s", key, exc)
                continue
            del self.unsure[key]
            if found is not None and (found.get("status") or {}).get("allocation"):
                # it landed: its hold (`ClaimTable.assumed`) stays until the watch shows it
                self.metrics.unknown.labels(
                    extender_metrics.LostWrite.CLAIM_ALLOCATION, extender_metrics.ReadBack.DONE
                ).inc()
                continue
            unchanged = found is not None and found["metadata"].get("resourceVersion") == unsure.resource_version
            if unchanged and now - unsure.sent < WRITE_DEADLINE:
                self.unsure[key] = Unsure(unsure.resource_version, now, unsure.sent)  # it still could land: wait
                continue
            self.cache.forget_claim(key)  # not landed, and it no longer can (the claim moved on, or went)
            self.metrics.unknown.labels(
                extender_metrics.LostWrite.CLAIM_ALLOCATION, extender_metrics.ReadBack.NOT_DONE
            ).inc()

    async def _clear_unused(self) -> None:
        """Clear allocations of the class that no pod uses or waits for (`orphan_after` seconds)."""
        now = self.clock()
        waiting: set[units.PodKey] = set()
        for key in self.cache.claiming:
            record = self.cache.record(key)
            if record is None:
                continue
            waiting.update(_claim_keys(record))
        for key, claim in self.cache.claims.records.items():
            unused = claim.ours and claim.allocated and not claim.reserved and key not in waiting
            if not unused or key in self.cache.claims.assumed:
                self.unused_since.pop(key, None)
                continue
            since = self.unused_since.setdefault(key, now)
            if now - since < self.orphan_after or not self.is_leader():
                continue
            if not await self._clear(claim):
                continue
            self.unused_since.pop(key, None)
            log.warning("claim %s: allocated for %.0f s with no pod using or waiting for it; cleared", key, now - since)

    async def _clear(self, claim: dra.ClaimRecord) -> bool:
        """Clear a claim's allocation, conditionally on the resourceVersion seen; whether it was."""
        body = {"metadata": {"resourceVersion": claim.resource_version}, "status": {"allocation": None}}
        try:
            await self.api.patch(f"{dra.claim_path(claim.namespace, claim.name)}/status", body)
        except errors.SharegpuError as exc:
            log.warning("claim %s: clearing its allocation failed: %s", claim.key, exc)
            return False
        self.metrics.claims.labels(extender_metrics.ClaimOutcome.CLEARED).inc()
        return True


def _claim_keys(record: pods.Record) -> list[units.PodKey]:
    """The ledger keys of the claims the pod names (those of its templates once they are made)."""
    namespace = record.key.split("/", 1)[0]
    return [dra.claim_key(namespace, ref.claim) for ref in record.claims if ref.claim]


@dataclass(frozen=True, slots=True)
class Placement:
    """What placing one claim came to: its allocation (held in the ledger), or why it fits nowhere."""

    allocation: allocation.Allocation | None = None
    refusal: str = ""


@contextlib.contextmanager
def _tolerating(state: fleet.FleetState, gpus: Sequence[tuple[str, int]]) -> Iterator[None]:
    """For one decision, the GPUs a claim's tolerations let it onto count healthy (the fleet counts
    a GPU that a DeviceTaintRule keeps new claims off unhealthy); the nodes' versions move on before
    and after, so placement's per-node caches never keep what was seen meanwhile."""
    marked = [(row, index) for node, index in gpus if (row := state.row(node)) is not None]
    for row, index in marked:
        state.healthy[row, index] = True
        state.version[row] += 1
    try:
        yield
    finally:
        for row, index in marked:
            state.healthy[row, index] = False
            state.version[row] += 1


def _untolerated(cache: extender_cache.ClusterCache, claim: dra.ClaimRecord, nodes: set[str]) -> str:
    """What the candidates' device taints that the claim does not tolerate are (empty: none)."""
    found = [
        f"{node}/{dra.device_name(index)} {taint} (DeviceTaintRule {rule})"
        for (node, index), pairs in sorted(cache.taints.items())
        if node in nodes
        for rule, taint in pairs
        if not claim.tolerates(taint)
    ]
    if not found:
        return ""
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return f"; tainted, not tolerated by the claim's requests: {', '.join(found[:3])}{more}"


def _crowded(record: pods.Record, claims: Sequence[dra.ClaimRecord]) -> list[str]:
    """Why a container of the pod would get more than one of sharegpu's devices: each of a claim's
    requests is one CDI device, and each device sets the container's NVIDIA_VISIBLE_DEVICES, its
    unindexed memory limit and its MPS pipe, of which the runtime keeps the last. One request of
    several GPUs (count: 2) is one device, and gets them all."""
    ours = {c.name: c for c in claims}
    claim_of = {ref.name: ours[ref.claim] for ref in record.claims if ref.claim in ours}
    out = []
    for container, used in record.container_claims:
        asks = [
            f"{claim_of[u.name].name}/{request}"
            for u in used
            if u.name in claim_of
            for request, _ in claim_of[u.name].asks
            if not u.request or u.request == request
        ]
        if len(asks) > 1:
            out.append(
                f"container {container} would get {len(asks)} requests of sharegpu's class ({', '.join(asks)}), "
                "but a container takes one: ask for several GPUs in one request (count), or give each "
                "request its own container"
            )
    return out
