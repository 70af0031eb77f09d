"""The scheduling service: kube-scheduler's filter, prioritize and bind, as typed messages in and out.

Filter evaluates every candidate node at once in the placement core and, by default, answers only
the node the policy chooses (*narrowing*): kube-scheduler picks at random among equal totals and
scales extender scores to 0..10, which would otherwise undo a fragmentation-aware choice. A pod
that states soft preferences of its own (preferred node or pod affinity, ScheduleAnyway topology
spread) is not narrowed: every node that fits gets through, and prioritize ranks them so that
kube-scheduler can weigh the pod's preferences against sharegpu's choice (docs/extender.md says who
wins and why). When no node fits, each node gets the first thing that keeps the pod off it, worded
the same for every node of a category so the FailedScheduling event stays short (`api.reasons`);
nodes that nothing can help (too few GPUs, wrong model, unhealthy GPUs, no inventory) go in
FailedAndUnresolvableNodes too, so newer schedulers skip pointless preemption.

Bind re-checks the pod on the chosen node (the GPUs its filter reserved, or its gang's plan, still
healthy; else it decides again there), *assumes* the allocation in the ledger (so
concurrent decisions see it at once), readies what the pod needs first (a sharing pod's hand-off ConfigMap:
`prepare`, so no container starts on what someone else wrote there) and writes one pods/binding
whose annotations carry the allocation: the binding and the record are one atomic write. The write
runs shielded: if kube-scheduler gives up on the HTTP call, the binding still completes or fails
for real. Its outcome is one of three
(`kube.errors.outcome`): done (the watch confirms the assumption), refused (a 4xx the API server
stated, or a request that never left: the assumption is forgotten, exactly once), or unknown (the
answer was lost after the request went out, a 5xx came back from anything on the way, or a 409,
which pods/binding also answers for a storage error after its commit: the binding may have
happened). An unknown binding keeps its assumption, so nothing else
is placed in its room, until the truth is read (`settle`): the pod seen bound, by the watch or a
read, confirms it (with the allocation the API shows); the pod seen unbound by a read made at
least `settle_after` seconds after the attempt (a minute: a write can land that late), or gone or
replaced by a pod of its name (the binding carries the pod's UID, so it cannot land on another),
forgets it. Meanwhile filter offers the pod only the node it holds, and its next bind reads the API
first (waiting up to `BIND_WAIT` for the read to be believed; failing, so kube-scheduler tries
again later, when the wait would be longer) and then either reports the pod bound or writes the
binding again.
Assumptions whose confirmation never arrives are checked against the API and resolved after
`assume_ttl` (`expire`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from sharegpu.api import extender as api_extender
from sharegpu.api import names, paths, pods, reasons, wire
from sharegpu.core import allocation, errors, fit, fleet, requests, units
from sharegpu.core import placer as core_placer
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import gangs as extender_gangs
from sharegpu.extender import lookup, preemption
from sharegpu.extender import metrics as extender_metrics
from sharegpu.extender import quotas as extender_quotas
from sharegpu.extender.metrics import BindOutcome, FilterOutcome
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

log = logging.getLogger(__name__)
Prepare = Callable[[pods.Record, allocation.Allocation], Awaitable[str | None]]
"""Readies what a pod needs before it is bound with an allocation; None when ready, else why not."""
FLOOR = api_extender.MAX_SCORE // 2
"""The lowest prioritize score of a node that fits (see `SchedulingService.prioritize`)."""


REQUESTS = 256
"""Parsed requests kept for the pods of the current scheduling cycles."""

FIRST_FILTERS = 8192
"""Pods whose first filter time is kept for the scheduling latency (the oldest go first)."""


@dataclass(frozen=True, slots=True)
class Candidates:
    """A candidate list as kube-scheduler sent it (its JSON text), and as fleet rows."""

    text: bytes
    looked: np.ndarray
    """Per name its fleet row, -1 where the fleet has none (no Device, or not ready)."""
    rows: np.ndarray
    """The rows of the names the fleet has, in order."""

    @classmethod
    def of(cls, text: bytes, looked: np.ndarray) -> Candidates:
        return cls(text, looked, looked[looked >= 0])

    def __len__(self) -> int:
        return len(self.looked)

    def names(self) -> list[str]:
        """The names as sent (decoded on demand: the usual filter needs only the rows)."""
        return api_extender.decode_names(self.text)

    def split(self) -> tuple[list[str], list[str], list[str]]:
        """From one decode: the names as sent, those the fleet has (aligned with `rows`), and the rest."""
        sent = self.names()
        known: list[str] = []
        missing: list[str] = []
        for name, row in zip(sent, self.looked.tolist(), strict=True):
            (known if row >= 0 else missing).append(name)
        return sent, known, missing


QUICK_TRIES = 4
"""Nodes in the policy's order checked against the candidate text before the text is mapped."""


CANDIDATE_LISTS = 8
"""Candidate texts remembered (the same text comes again for a pod's prioritize, and for pods
kube-scheduler sends in the same order)."""


@dataclass(frozen=True, slots=True)
class _Seen:
    state: object
    candidates: Candidates


@dataclass(frozen=True, slots=True)
class Outcome:
    """The last filter verdict for a pod (the debug endpoint and the explain tool read it)."""

    pod: units.PodKey
    at: float
    feasible: int
    """Nodes that fit: among the candidates, or among all nodes when filter chose without mapping
    the candidates (the chosen node was one of them)."""
    chosen: str | None
    message: str
    candidates: tuple[str, ...] = ()
    """The nodes kube-scheduler offered, kept when none fitted (the explain tool looks at those)."""
    short: bool = False
    """Turned away for want of GPU room (not a malformed request, a quota, a binding being read
    back or a preemption under way): room appearing later may let it in (`requeue`)."""


SETTLE_AFTER = 60.0
"""Seconds after a binding whose answer was lost before a read showing the pod unbound is believed:
the API server carries a request out for up to its request timeout (60 s by default) after the
client gave up, and an etcd proposal that timed out may still commit, so a binding can land well
after its answer was lost (as the DRA allocator's writes can: `allocator.WRITE_DEADLINE`)."""
BIND_WAIT = 3.0
"""The most a bind waits for the read-back of its pod's unknown binding to be believed; longer,
the bind fails at once and kube-scheduler tries the pod again later."""


@dataclass(frozen=True, slots=True)
class UnsureBinding:
    """A binding whose answer was lost: when the attempt ended, and the UID of the pod it was for
    (the binding carries it, so it can never land on a pod of that name made since)."""

    at: float
    uid: str


UNSURE_MESSAGE = "sharegpu: the outcome of this pod's last binding is being read back"


class SchedulingService:
    def __init__(
        self,
        cache: extender_cache.ClusterCache,
        api: client.KubeApi,
        metrics: extender_metrics.Metrics,
        *,
        narrow: bool = True,
        assume_ttl: float = 30.0,
        settle_after: float = SETTLE_AFTER,
        clock: Callable[[], float] = time.monotonic,
        remember: int = 512,
        quota: extender_quotas.QuotaGuard | None = None,
        preemptor: preemption.Preemptor | None = None,
        prepare: Prepare | None = None,
    ) -> None:
        self.cache = cache
        self.gangs = extender_gangs.GangBook(cache, api, metrics, clock=clock, preemptor=preemptor, quota=quota)
        """Gangs planned at once and bound together (`extender.gangs`)."""
        self.prepare = prepare
        """Readies a sharing pod's hand-off before its binding (`extender.handoff`); None: nothing to ready."""
        self.preemptor = preemptor
        """Preempts lower-priority pods for a pod that fits nowhere; None: no preemption."""
        self.quota = quota
        """Checks the namespace's ResourceQuotas on sharegpu's totals; None: not checked."""
        self.api = api
        self.metrics = metrics
        self.narrow = narrow
        self.assume_ttl = assume_ttl
        self.clock = clock
        self.settle_after = settle_after
        self.binding: set[units.PodKey] = set()
        """Pods whose binding is being written right now."""
        self.unsure: dict[units.PodKey, UnsureBinding] = {}
        """Pods whose binding may or may not have happened (its answer was lost). Their assumption
        is held until `settle` reads the truth."""
        self.outcomes: OrderedDict[units.PodKey, Outcome] = OrderedDict()
        self._remember = remember
        self._requests: OrderedDict[tuple[str, tuple[str | None, ...]], requests.PodRequest] = OrderedDict()
        """Requests parsed here, by uid and `pods.request_annotations` (what a request depends on)."""
        self._lists: list[_Seen] = []
        """Candidate lists seen lately, newest first."""
        self.reserved: dict[units.PodKey, str] = {}
        """Pods whose filter reserved the node it chose (pod -> UID), until their bind."""
        self.first_filtered: OrderedDict[units.PodKey, tuple[str, float]] = OrderedDict()
        """Pod -> (UID, when this replica first filtered it), until its bind: the scheduling latency."""

    # ----------------------------------------------------------------- filter

    def _request(self, pod: wire.Pod) -> requests.PodRequest:
        """The pod's request: the one the cache parsed from its watch events when it is the same pod
        with the same request annotations, else parsed once per pod and request annotations (filter,
        then prioritize, reuse it)."""
        meta = pod.metadata
        known = self.cache.record(pods.key(pod))
        annotations = pods.request_annotations(meta.annotations)
        if known is not None and known.request is not None and known.same_request(meta.uid, annotations):
            return known.request
        key = (meta.uid, annotations)
        found = self._requests.get(key) if meta.uid else None
        if found is None:
            found = pods.request(pod)  # raises for a malformed request: nothing is cached then
            if meta.uid:
                self._requests[key] = found
                if len(self._requests) > REQUESTS:
                    self._requests.popitem(last=False)
        return found

    def _candidates(self, args: api_extender.Args) -> Candidates:
        """The candidate nodes as fleet rows.

        kube-scheduler sends much the same list pod after pod, in a different order each time: it
        starts filtering at a different node every cycle, and its filter goroutines append the nodes
        that pass in whatever order they finish. A repeat of a recent text is found by one
        comparison; any other text is mapped to rows straight from its bytes (`lookup.NameIndex`,
        exact), or decoded and looked up name by name when it is not a plain list of names."""
        state = self.cache.state
        text = args.names_text()
        for seen in self._lists:
            if seen.state is state and seen.candidates.text == text:
                return seen.candidates
        looked = self.cache.name_index().rows(text)
        if looked is None:
            row_of = state.row_of
            looked = np.array([row_of.get(n, -1) for n in api_extender.decode_names(text)], dtype=np.int64)
            dra_only = self.cache.dra_rows
            if dra_only.any():  # nodes that serve DRA claims only are no candidates for a pod
                looked[(looked >= 0) & dra_only[np.maximum(looked, 0)]] = -1
        made = Candidates.of(text, looked)
        self._lists.insert(0, _Seen(state, made))
        del self._lists[CANDIDATE_LISTS:]
        return made

    def filter(self, args: api_extender.Args) -> api_extender.FilterResult:
        key = pods.key(args.pod)
        self._first_filter(key, args.pod.metadata.uid)
        if key in self.unsure:
            return self._filter_unsure(key, args)
        if key not in self.binding and not self.gangs.holds(key):
            self.cache.forget(key)  # filtered again: an earlier reservation of this pod is void
        waiting = self.preemptor.waiting(key, args.pod.metadata.uid) if self.preemptor is not None else None
        if waiting is not None:
            self.metrics.decisions.labels("filter", FilterOutcome.PREEMPTING).inc()
            sent = self._candidates(args).names()
            self._remember_outcome(key, 0, None, waiting, tuple(sent))
            return api_extender.FilterResult(failed_nodes=dict.fromkeys(sent, waiting))
        try:
            request = self._request(args.pod)
        except errors.InvalidInputError as exc:
            self.metrics.decisions.labels("filter", FilterOutcome.INVALID).inc()
            offered = self._candidates(args)
            failed = reasons.invalid(offered.names(), str(exc))
            self._remember_outcome(key, 0, None, failed.message(len(offered)))
            return api_extender.FilterResult(
                failed_nodes=failed.unresolvable, failed_and_unresolvable=failed.unresolvable
            )
        charged = pods.charged_namespace(args.pod.metadata.namespace, args.pod.metadata.labels)
        refused = self.quota.refusal(key, request, charged) if self.quota is not None else None
        if refused is not None:
            self.metrics.decisions.labels("filter", FilterOutcome.QUOTA).inc()
            offered = self._candidates(args)
            sent = offered.names()
            self._remember_outcome(key, 0, None, refused, tuple(sent))
            return api_extender.FilterResult(failed_nodes=dict.fromkeys(sent, refused))
        if names.GANG in args.pod.metadata.annotations:
            held = self._filter_gang(key, args)
            if held is not None:
                return held
        demand = request.demand
        placer = self._placer(args.pod)
        narrow = self.narrow and not pods.has_soft_preferences(args.pod)
        quick = self._choose_among_all(placer, demand, args.names_text()) if narrow else None
        if quick is not None:
            decision, feasible_count = quick
            return self._chosen(key, args.pod, request, decision, feasible_count)
        offered = self._candidates(args)
        rows = offered.rows
        evaluation = placer.evaluate(demand, rows)
        feasible = evaluation.feasible
        if not feasible.any():
            diagnosis = fit.diagnose(self.cache.state, demand, rows)
            sent, known, missing = offered.split()
            failed = reasons.failures(known, diagnosis, demand, missing)
            plan = self.preemptor.consider(args.pod, request, rows, diagnosis) if self.preemptor is not None else None
            if plan is not None:
                failed = reasons.preempting(failed, plan.node, len(plan.victims), len(plan.leaving))
            self.metrics.decisions.labels(
                "filter", FilterOutcome.UNSCHEDULABLE if plan is None else FilterOutcome.PREEMPTING
            ).inc()
            self._remember_outcome(key, 0, None, failed.message(len(offered)), tuple(sent), short=plan is None)
            return api_extender.FilterResult(
                failed_nodes={**failed.resolvable, **failed.unresolvable},
                failed_and_unresolvable=failed.unresolvable,
            )
        if narrow:
            decision = placer.choose(demand, evaluation)
            return self._chosen(key, args.pod, request, decision, int(feasible.sum()))
        self.metrics.decisions.labels("filter", FilterOutcome.FEASIBLE).inc()
        names_ = self.cache.state.names
        fits = [names_[r] for r in rows[feasible].tolist()]
        self._remember_outcome(key, len(fits), None, "")
        return api_extender.FilterResult(node_names=fits)

    def _filter_unsure(self, key: units.PodKey, args: api_extender.Args) -> api_extender.FilterResult:
        """A pod whose last binding may have happened: only the node its held allocation is on (the
        bind that follows reads the API before it writes anything), or no node while that one is not
        a candidate."""
        held = self.cache.assumed.get(key)
        sent = self._candidates(args).names()
        if held is not None and held.node in sent:
            self._remember_outcome(key, 1, held.node, "")
            return api_extender.FilterResult(node_names=[held.node])
        self._remember_outcome(key, 0, None, UNSURE_MESSAGE, tuple(sent))
        return api_extender.FilterResult(failed_nodes=dict.fromkeys(sent, UNSURE_MESSAGE))

    def _filter_gang(self, key: units.PodKey, args: api_extender.Args) -> api_extender.FilterResult | None:
        """A gang member: the node its gang's plan holds for it, or why it waits; None: it is placed as
        any pod (its gang has its minimum running)."""
        known = self.cache.record(key)
        record = known if known is not None and known.uid == args.pod.metadata.uid else pods.record(args.pod)
        verdict = self.gangs.consider(record)
        if verdict.node is None and verdict.refusal is None:
            return None
        sent = self._candidates(args).names()
        if verdict.node is not None and verdict.node in sent:
            self.metrics.decisions.labels("filter", FilterOutcome.FEASIBLE).inc()
            self._remember_outcome(key, 1, verdict.node, "")
            return api_extender.FilterResult(node_names=[verdict.node])
        message = verdict.refusal or (
            f"sharegpu: its gang's plan holds node {verdict.node} for it, which is not among the candidates"
        )
        self.metrics.decisions.labels("filter", FilterOutcome.GANG).inc()
        self._remember_outcome(key, 0, None, message, tuple(sent))
        return api_extender.FilterResult(failed_nodes=dict.fromkeys(sent, message))

    def _first_filter(self, key: units.PodKey, uid: str) -> None:
        seen = self.first_filtered.get(key)
        if seen is not None and seen[0] == uid:
            return
        self.first_filtered[key] = (uid, self.clock())
        self.first_filtered.move_to_end(key)
        while len(self.first_filtered) > FIRST_FILTERS:
            self.first_filtered.popitem(last=False)

    def _placer(self, pod: wire.Pod) -> core_placer.Placer:
        annotations: dict[str, str] = pod.metadata.annotations
        return self.cache.placer_for(annotations.get(names.PLACEMENT))

    def _choose_among_all(
        self, placer: core_placer.Placer, demand: requests.GpuDemand, text: bytes
    ) -> tuple[core_placer.Decision, int] | None:
        """The policy's choice among all nodes and how many fit, when that node is a candidate.

        The choice among the candidates is the best candidate by the policy's order; when the best
        node of all is a candidate, it is that node, found without mapping thousands of candidate
        names to rows: one search of the text for the chosen name. The next few nodes in the
        policy's order are tried the same way (kube-scheduler may have filtered the best out, for
        CPU, taints or affinity); None when none of them is a candidate, when no node fits (the
        full path words the reasons) or when the text is not a plain list of names."""
        if not lookup.plain_names(text):
            return None
        evaluation = placer.evaluate(demand)
        count = int(evaluation.feasible.sum())
        if not count:
            return None
        feasible = evaluation.feasible & self.cache.pod_rows  # a copy; nodes that serve DRA claims only are out
        count = int(feasible.sum())
        if not count:
            return None
        trying = evaluation.with_feasible(feasible)
        for _ in range(min(QUICK_TRIES, count)):
            decision = placer.choose(demand, trying)
            assert decision.node is not None and decision.row is not None
            if lookup.mentions(text, decision.node):
                return decision, count
            feasible[decision.row] = False  # all rows, in order: a row is its own index
        return None

    def _chosen(
        self,
        key: units.PodKey,
        pod: wire.Pod,
        request: requests.PodRequest,
        decision: core_placer.Decision,
        feasible: int,
    ) -> api_extender.FilterResult:
        """Narrowed to the chosen node, whose allocation is reserved now, as kube-scheduler's Reserve
        does: it filters the next pod while this one's bind is still on its way, and that pod must
        see this one's share."""
        assert decision.node is not None
        self.metrics.decisions.labels("filter", FilterOutcome.FEASIBLE).inc()
        if pod.metadata.uid and self.cache.assume(
            self._placer(pod).allocation_for(request, decision), pod.metadata.uid
        ):
            self.reserved[key] = pod.metadata.uid
        self._remember_outcome(key, feasible, decision.node, "")
        return api_extender.FilterResult(node_names=[decision.node])

    def _remember_outcome(
        self,
        key: units.PodKey,
        feasible: int,
        chosen: str | None,
        message: str,
        candidates: tuple[str, ...] = (),
        *,
        short: bool = False,
    ) -> None:
        self.outcomes[key] = Outcome(key, self.clock(), feasible, chosen, message, candidates, short)
        self.outcomes.move_to_end(key)
        while len(self.outcomes) > self._remember:
            self.outcomes.popitem(last=False)

    # ----------------------------------------------------------------- prioritize

    def prioritize(self, args: api_extender.Args) -> list[api_extender.HostPriority]:
        """The chosen node MAX_SCORE; the other feasible nodes by the policy's own score, scaled into
        FLOOR..MAX_SCORE-1; nodes that do not fit 0. Feasible nodes differ by at most half the range,
        so kube-scheduler's own soft scoring (a pod's preferences) decides between nodes it rates
        clearly apart, and sharegpu's choice decides between nodes it rates alike (docs/extender.md)."""
        offered = self._candidates(args)
        candidates, known, _ = offered.split()
        try:
            request = self._request(args.pod)
        except errors.InvalidInputError:
            return [api_extender.HostPriority(host=n, score=0) for n in candidates]
        rows = offered.rows
        placer = self._placer(args.pod)
        evaluation = placer.evaluate(request.demand, rows)
        feasible, score = evaluation.feasible, evaluation.score
        decision = placer.choose(request.demand, evaluation) if feasible.any() else None
        top = api_extender.MAX_SCORE
        span = top - 1 - FLOOR
        scores = {
            name: top if decision is not None and name == decision.node else FLOOR + min(span, int(s) * span // 100)
            for name, ok, s in zip(known, feasible.tolist(), score.tolist(), strict=True)
            if ok
        }
        return [api_extender.HostPriority(host=n, score=scores.get(n, 0)) for n in candidates]

    # ----------------------------------------------------------------- bind

    async def bind(self, args: api_extender.BindingArgs) -> api_extender.BindingResult:
        """Bind the pod to `args.node` with its allocation; shielded from the caller going away."""
        return await asyncio.shield(self._bind(args))

    async def _bind(self, args: api_extender.BindingArgs) -> api_extender.BindingResult:
        key = units.pod_key(args.pod_namespace, args.pod_name)
        if key in self.unsure and key not in self.binding:
            settled = await self.settle(key, wait=True)
            if settled is None:
                return self._bind_failed(
                    BindOutcome.ERROR, f"pod {key}: the outcome of its last binding cannot be read yet"
                )
            if settled:
                bound = self.cache.record(key)
                return self._bind_failed(
                    BindOutcome.ERROR, f"pod {key} is already bound to {bound.node if bound else 'a node'}"
                )
        record = self.cache.record(key)
        if record is None or (args.pod_uid and record.uid != args.pod_uid):
            try:
                found = await self.api.get(paths.pod(args.pod_namespace, args.pod_name))
                record = pods.record(wire.convert(found, wire.Pod))
            except errors.SharegpuError as exc:
                return self._bind_failed(BindOutcome.ERROR, f"cannot read pod {key}: {exc}")
            if args.pod_uid and record.uid != args.pod_uid:
                return self._bind_failed(
                    BindOutcome.ERROR, f"pod {key} was replaced (uid {record.uid}, expected {args.pod_uid})"
                )
        if record.node:
            return self._bind_failed(BindOutcome.ERROR, f"pod {key} is already bound to {record.node}")
        if record.problem is not None:
            return self._bind_failed(BindOutcome.INVALID, record.problem)
        request = record.request or requests.PodRequest(
            key=key, cpu_milli=record.cpu_milli, memory_mib=record.memory_mib
        )
        uninventoried = f"node {args.node} has no sharegpu inventory"
        if self.cache.state.row(args.node) is None:  # said before any wait at the gang's barrier
            return self._bind_failed(BindOutcome.ERROR, uninventoried)
        if key in self.binding:
            return self._bind_failed(BindOutcome.ERROR, f"pod {key} is being bound")
        waiting = await self.gangs.arrive(record)
        if waiting is not None:
            return self._bind_failed(BindOutcome.GANG, waiting)
        state = self.cache.state  # read after the wait: the fleet may have been rebuilt, moving rows
        row = state.row(args.node)
        if row is None:
            return self._bind_failed(BindOutcome.ERROR, uninventoried)
        gang_held = self.gangs.holds(key)
        reserved = self.reserved.pop(key, None) == record.uid
        held = self.cache.assumed.get(key) if reserved or gang_held else None
        if held is not None and held.node == args.node and self.cache.counts_assumed(key) and _usable(state, row, held):
            alloc = held  # reserved by this pod's filter: the ledger holds it already
        else:
            self.cache.forget(key)  # a reservation for another node (or another pod of that name) is void
            if key in self.cache.ledger:
                return self._bind_failed(BindOutcome.ERROR, f"pod {key} is already placed")
            # Its filter held nothing (several nodes fitted): others of its namespace may have been
            # bound since, so its quota is judged again before its room is taken.
            charged = pods.charged_namespace(args.pod_namespace, dict(record.labels))
            over = self.quota.refusal(key, request, charged) if self.quota is not None and not gang_held else None
            if over is not None:
                return self._bind_failed(BindOutcome.UNSCHEDULABLE, over)
            demand = request.demand
            decision = self.cache.placer.decide(demand, np.array([row], dtype=np.int64))
            if not decision.status.ok:
                verdict = fit.explain_node(state, demand, row)
                return self._bind_failed(BindOutcome.UNSCHEDULABLE, reasons.refused_bind(key, args.node, verdict))
            alloc = self.cache.placer.allocation_for(request, decision)
            if not self.cache.assume(alloc, record.uid):
                return self._bind_failed(BindOutcome.CONFLICT, f"pod {key}: the allocation conflicts with the ledger")
        self.binding.add(key)
        try:
            refused = await self.prepare(record, alloc) if self.prepare is not None else None
            if refused is not None:
                self._let_go(key)
                return self._bind_failed(BindOutcome.ERROR, f"pod {key}: {refused}")
            body = _binding(args, record.uid, alloc)
            await self.api.create(paths.binding(args.pod_namespace, args.pod_name), body)
            self.gangs.bound(key)
            self.cache.confirm(alloc)  # bound: held as such until the watch shows it (a filter again forgets nothing)
        except BaseException as exc:
            # pods/binding answers 409 for any error of its storage write too, one after the commit
            # among them (an etcd connection reset: "Operation cannot be fulfilled on pods/binding ...:
            # rpc error: code = Unavailable"), so its 409 is no refusal: it is read back like a 5xx.
            storage = isinstance(exc, kube_errors.ConflictError)
            if kube_errors.outcome(exc) is kube_errors.Outcome.REFUSED and not storage:
                self._let_go(key)
                return self._bind_failed(BindOutcome.ERROR, f"binding {key} to {args.node} failed: {exc}")
            self.unsure[key] = UnsureBinding(self.clock(), record.uid)  # it may have happened: its room is held
            log.warning("binding %s to %s: outcome unknown (%s); holding its allocation until it is read back",
                        key, args.node, exc)  # fmt: skip
            if isinstance(exc, errors.SharegpuError | OSError):
                return self._bind_failed(BindOutcome.UNKNOWN, f"binding {key} to {args.node}: outcome unknown: {exc}")
            raise
        finally:
            self.binding.discard(key)
        self.metrics.binds.labels(BindOutcome.BOUND).inc()
        log.info("pod %s bound to %s, GPUs %s", key, args.node, list(alloc.gpu_usage()))
        first = self.first_filtered.pop(key, None)
        if first is not None and first[0] == record.uid:
            self.metrics.scheduling.observe(max(0.0, self.clock() - first[1]))
        return api_extender.BindingResult()

    def _let_go(self, key: units.PodKey) -> None:
        """A bind that failed gives its room back, exactly once; a gang member's stays held while its
        gang's plan lives (the next try binds it there: the rest of the gang may be bound already)."""
        if not self.gangs.holds(key):
            self.cache.forget(key)

    def _bind_failed(self, outcome: BindOutcome, message: str) -> api_extender.BindingResult:
        self.metrics.binds.labels(outcome).inc()
        return api_extender.BindingResult(error=message)

    # ----------------------------------------------------------------- unknown outcomes

    async def settle(self, key: units.PodKey, *, wait: bool = False) -> bool | None:
        """Read back a binding whose outcome is unknown. True: the pod is bound (the ledger now holds
        the allocation the API shows); False: it is not, and will not be (the assumption is forgotten);
        None: cannot say yet (too soon after the attempt, or the API cannot be read). With `wait`,
        waits out the rest of `settle_after` when at most `BIND_WAIT` is left, instead of answering
        None for being too soon."""
        unsure = self.unsure.get(key)
        if unsure is None:
            return None
        attempted = unsure.at
        waited = False
        while True:
            if key not in self.unsure or key not in self.cache.assumed:  # settled meanwhile, or the watch
                record = self.cache.record(key)  # confirmed it, or the pod went
                bound = record is not None and bool(record.node)
                if self.unsure.pop(key, None) is not None:
                    self.metrics.unknown.labels("binding", "done" if bound else "not-done").inc()
                return bound
            namespace, name = key.split("/", 1)
            try:
                found = await self.api.get(paths.pod(namespace, name))
                pod = wire.convert(found, wire.Pod)
            except kube_errors.NotFoundError:
                pod = None
            except errors.SharegpuError as exc:
                log.warning("cannot read back the binding of %s: %s", key, exc)
                return None
            if key not in self.unsure or key not in self.cache.assumed:
                continue  # settled meanwhile (by the watch, or another caller)
            if pod is not None and unsure.uid and pod.metadata.uid != unsure.uid:
                pod = None  # replaced: the binding named the pod that went, so it cannot land on this one
            if pod is not None and pod.spec.node_name:
                del self.unsure[key]
                shown = pods.allocation_of(pod)
                if shown is not None and shown.node == pod.spec.node_name:
                    self.cache.confirm(shown)  # the API's allocation, whatever the ledger assumed
                else:
                    self.cache.forget(key)  # bound without sharegpu's record: the watch accounts for it
                self.metrics.unknown.labels("binding", "done").inc()
                log.warning("pod %s: the binding whose answer was lost happened (on %s)", key, pod.spec.node_name)
                return True
            if pod is None or waited or self.clock() - attempted >= self.settle_after:
                del self.unsure[key]
                if pod is None:
                    self.cache.forget(key)
                else:
                    self._let_go(key)  # a gang member keeps its place for its next try
                self.metrics.unknown.labels("binding", "not-done").inc()
                kept = "its gang keeps its place" if self.gangs.holds(key) else "its room is free again"
                log.warning("pod %s: the binding whose answer was lost did not happen; %s", key, kept)
                return False
            left = self.settle_after - (self.clock() - attempted)
            if not wait or left > BIND_WAIT:
                return None
            await asyncio.sleep(max(0.0, left))
            waited = True

    async def settle_all(self) -> None:
        """Read back every binding whose outcome is still unknown (and not being written again)."""
        for key in list(self.unsure):
            if key in self.unsure and key not in self.binding:
                await self.settle(key)

    # ----------------------------------------------------------------- stale assumptions

    async def expire(self) -> int:
        """Resolve assumptions older than `assume_ttl` that no bind is writing: confirmed if the API
        shows the pod bound with that allocation (the watch is late), forgotten otherwise. Returns
        how many were forgotten. Unknown bindings are left to `settle`."""
        forgotten = 0
        for key in [k for k in self.reserved if k not in self.cache.assumed]:
            del self.reserved[key]  # the reservation was resolved (bound, forgotten, pod gone)
        self._forget_first_filters()
        self.gangs.restore()
        self.gangs.settle(lambda k: k in self.binding or k in self.unsure)
        await self.gangs.flush()
        for key in self.cache.stale_assumptions(self.assume_ttl):
            if self._in_flight(key):
                continue
            namespace, name = key.split("/", 1)
            alloc = self.cache.assumed.get(key)
            try:
                found = await self.api.get(paths.pod(namespace, name))
                pod = wire.convert(found, wire.Pod)
                shown = pods.allocation_of(pod) if pod.spec.node_name else None
            except kube_errors.NotFoundError:
                shown = None
            except errors.SharegpuError as exc:
                log.warning("cannot check the stale assumption of %s: %s", key, exc)
                continue
            if key not in self.cache.assumed or self.cache.assumed.get(key) is not alloc:
                continue  # resolved by the watch meanwhile
            if self._in_flight(key):
                continue  # a bind of it began during the read: what the read showed is already old
            if shown is not None and alloc is not None and _same_gpus(shown, alloc):
                self.cache.confirm(alloc)
                log.warning("pod %s: binding confirmed from the API (the watch had not shown it)", key)
            elif self.cache.forget(key):
                forgotten += 1
                self.cache.counters.expired += 1
                self.metrics.expired.inc()
                log.warning("pod %s: assumed %.0f s ago and never bound; forgotten", key, self.assume_ttl)
        await self._check_confirmed()
        return forgotten

    async def _check_confirmed(self) -> None:
        """Pods held as bound (their binding written or read back) that the watch has not shown bound
        for `assume_ttl` seconds are read: gone, replaced or not bound there, their room is let go (a
        pod deleted while the watch was away and relisted after it went is never shown at all)."""
        for key, alloc in self.cache.unseen_confirmations(self.assume_ttl):
            if self._in_flight(key):
                continue
            namespace, name = key.split("/", 1)
            try:
                found = wire.convert(await self.api.get(paths.pod(namespace, name)), wire.Pod)
            except kube_errors.NotFoundError:
                found = None
            except errors.SharegpuError as exc:
                log.warning("cannot check pod %s, held as bound: %s", key, exc)
                continue
            if self.cache.confirmed.get(key) is not alloc:
                continue  # the watch showed it meanwhile
            if found is None or found.spec.node_name != alloc.node or pods.is_terminal(found):
                self.cache.drop_confirmation(key)
                log.warning("pod %s, held as bound on %s, is not there: its room is let go", key, alloc.node)

    def _in_flight(self, key: units.PodKey) -> bool:
        """A bind of the pod is being written, its outcome is unknown, or its gang holds its place."""
        return key in self.binding or key in self.unsure or self.gangs.holds(key)

    def _forget_first_filters(self) -> None:
        """Drop the first filter times of pods that went, were replaced or were bound elsewhere (after
        `assume_ttl`: a pod filtered before its watch event arrived is not gone)."""
        now = self.clock()
        for key, (uid, at) in list(self.first_filtered.items()):
            record = self.cache.record(key)
            gone = record is None or record.uid != uid or bool(record.node) or record.terminal
            if gone and now - at > self.assume_ttl:
                del self.first_filtered[key]

    async def run_expiry(self, every: float = 5.0, settle_every: float = 1.0) -> None:
        """Read back unknown bindings every `settle_every` seconds, and expire stale assumptions
        every `every` seconds."""
        waited = 0.0
        while True:
            await asyncio.sleep(settle_every)
            waited += settle_every
            try:
                await self.settle_all()
                if waited >= every:
                    waited = 0.0
                    await self.expire()
            except Exception:
                log.exception("resolving assumptions failed")


def _usable(state: fleet.FleetState, row: int, alloc: allocation.Allocation) -> bool:
    """The GPUs a reservation took are still healthy (one that failed since the filter chose it voids
    the reservation: bind decides again). Preemption holds are not looked at: a gang's nomination
    holds the very room its members' plans are on (bench/chaos.py seed 40 found it)."""
    return all(bool(state.healthy[row, gpu]) for gpu in alloc.gpu_usage())


def _same_gpus(a: allocation.Allocation, b: allocation.Allocation) -> bool:
    return a.node == b.node and a.containers == b.containers


def _binding(args: api_extender.BindingArgs, uid: str, alloc: allocation.Allocation) -> dict[str, object]:
    """The pods/binding body; with the pod's UID, which the API server holds the pod to (a pod of the
    same name made since the bind began is refused, as kube-scheduler's own binder asks)."""
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {
            "name": args.pod_name,
            "namespace": args.pod_namespace,
            "annotations": {names.ALLOCATION: alloc.to_json()},
            **({"uid": uid} if uid else {}),
        },
        "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
    }
