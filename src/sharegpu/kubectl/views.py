"""What the plugin's commands show, assembled from typed API objects without I/O.

The cluster is rebuilt exactly as the extender rebuilds it after a start: Nodes, Devices and pods
go through the extender's own record functions into its `ClusterCache` (fleet arrays, ledger,
placer), ResourceQuotas into its `QuotaGuard`. `inventory` then reads the ledger (who holds what,
GPU by GPU); `explain` asks the filter the extender runs (`core.fit.evaluate`, `diagnose`,
`explain_node`), words the answer with `api.reasons` (the FailedScheduling texts and the GPU-by-GPU
detail of the extender's /debug/pods), checks the quotas of the namespace the pod is charged to
(`api.pods.charged_namespace`: a SharedDeviceGroup's holder counts against its group's) with the
extender's guard, and asks the placer which node and GPUs the extender would choose. A pod whose
GPUs come only through DRA claims of sharegpu's class is not the filter's: `explain` names its
claims and says the DRA allocator places them (`extender.allocator`). A gang member is checked as
its gang: `extender.gangtrial` plans the gang as the extender's filter does when it holds no plan.
So the plugin's answer is the extender's answer for the same cluster state; the only difference is
the state itself (the extender may hold a decision whose binding is still on its way, or a gang's
plan: the pod's PodScheduled message says what the extender answered last).

`top` reads the nodes' GpuUsage objects (`api.usage`, written by the agents): per pod and GPU, what
it uses beside what it was given, or summed per namespace.

Every view is a frozen value; `render` turns them into tables, text or JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sharegpu.api import budgets as api_budgets
from sharegpu.api import dra, idle, names, pods, reasons, usage, wire
from sharegpu.api import groups as api_groups
from sharegpu.api import quotas as api_quotas
from sharegpu.core import allocation, errors, fit, policies, requests, units
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import gangtrial as extender_gangtrial
from sharegpu.extender import quotas as extender_quotas

DETAIL_NODES = 20
"""Nodes explained GPU by GPU by default (the closest to fitting first), as the extender's /debug/pods does."""

NO_INVENTORY = "NO_INVENTORY"
"""The shortfall name of a candidate node the fleet does not hold (no Device, or not ready)."""
DRA_ONLY = "DRA_ONLY"
"""The shortfall name of a candidate node that serves DRA claims only (its Device says `dra: true`):
the extender places no pod there and answers it with its "no GPU inventory" text."""
DRA_ONLY_DETAIL = "the node serves DRA claims only (its Device has dra: true): sharegpu places no pod there"


# ----------------------------------------------------------------- the cluster


@dataclass(frozen=True, slots=True)
class Listing:
    """What the plugin read from the API: one list of each kind the extender watches."""

    nodes: tuple[wire.Node, ...]
    devices: tuple[wire.Device, ...]
    pods: tuple[wire.Pod, ...]
    quotas: tuple[api_quotas.ResourceQuota, ...] = ()
    claims: tuple[dra.ResourceClaim, ...] = ()
    """ResourceClaims (the DRA path's shares: sharegpu's class's count, as in the extender's ledger)."""


@dataclass(frozen=True, slots=True)
class Cluster:
    """The extender's cache and quota guard over a listing, and what the cache does not keep."""

    cache: extender_cache.ClusterCache
    quota: extender_quotas.QuotaGuard
    labels: Mapping[str, Mapping[str, str]]
    """Node name -> its labels."""
    gpu_reasons: Mapping[tuple[str, int], str]
    """(node, GPU index) -> why the Device says the GPU is unhealthy."""


def cluster(listing: Listing, policy: str = policies.DEFAULT) -> Cluster:
    """The extender's view of the listed cluster (its cache rebuilt from the lists, as after a start)."""
    cache = extender_cache.ClusterCache(policy)
    guard = extender_quotas.QuotaGuard(cache)
    for node in listing.nodes:
        cache.on_node(wire.EventType.ADDED, extender_cache.node_record(node))
    for device in listing.devices:
        cache.on_device(wire.EventType.ADDED, extender_cache.device_record(device))
    for pod in listing.pods:
        cache.on_pod(wire.EventType.ADDED, pods.record(pod))
    for claim in listing.claims:
        cache.on_claim(wire.EventType.ADDED, dra.claim_record(claim))
    for quota in listing.quotas:
        guard.on_quota(wire.EventType.ADDED, quota)
    cache.rebuild()
    gpu_reasons = {
        (d.metadata.name, g.index): g.reason for d in listing.devices for g in d.spec.gpus if g.reason and not g.healthy
    }
    labels = {n.metadata.name: dict(n.metadata.labels) for n in listing.nodes}
    return Cluster(cache, guard, labels, gpu_reasons)


# ----------------------------------------------------------------- inspect


@dataclass(frozen=True, slots=True)
class Holder:
    """One pod's share of one GPU."""

    pod: str
    milli: int
    memory_mib: int
    phase: str
    """The ledger's phase: Added (bound) or Assumed."""


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    uuid: str
    model: str
    healthy: bool
    reason: str
    milli_capacity: int
    milli_free: int
    memory_capacity: int
    memory_free: int
    holders: tuple[Holder, ...]
    reservation: str | None
    """The reservation pod holding the GPU for its sharers (None: none)."""
    reservation_uuid: str | None
    overcommitted: tuple[str, ...] = ()
    """Why the GPU's tenants do not fit on it together (empty: they do)."""

    @property
    def milli_used(self) -> int:
        return self.milli_capacity - self.milli_free

    @property
    def memory_used(self) -> int:
        return self.memory_capacity - self.memory_free


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    cpu_capacity: int
    cpu_free: int
    memory_capacity: int
    memory_free: int
    gpus: tuple[GpuView, ...]


@dataclass(frozen=True, slots=True)
class Totals:
    gpus: int
    milli_capacity: int
    milli_used: int
    memory_capacity: int
    memory_used: int
    whole_free: int
    """GPUs nobody holds any of."""


@dataclass(frozen=True, slots=True)
class Inventory:
    nodes: tuple[NodeView, ...]
    ignored: tuple[tuple[str, str], ...]
    """(node, why) for every Device the fleet leaves out."""
    conflicts: int
    """Bound pods that did not fit the others' allocations when the ledger took them in."""

    def overcommitted(self) -> list[tuple[str, GpuView]]:
        """(node, GPU) of every over-committed GPU."""
        return [(n.name, g) for n in self.nodes for g in n.gpus if g.overcommitted]

    def totals(self) -> Totals:
        gpus = [g for n in self.nodes for g in n.gpus]
        return Totals(
            gpus=len(gpus),
            milli_capacity=sum(g.milli_capacity for g in gpus),
            milli_used=sum(g.milli_used for g in gpus),
            memory_capacity=sum(g.memory_capacity for g in gpus),
            memory_used=sum(g.memory_used for g in gpus),
            whole_free=sum(1 for g in gpus if g.healthy and not g.holders),
        )


def inventory(view: Cluster, only: Sequence[str] = ()) -> Inventory:
    """Per node and GPU: capacity, what is used and free, and who holds what (the ledger's entries)."""
    cache = view.cache
    state = cache.state
    overcommitted = {(o.node, o.index): o.problems for o in cache.ledger.overcommitted()}
    holders: dict[tuple[str, int], list[Holder]] = {}
    for key, entry in cache.ledger.entries():
        for index, (milli, memory) in entry.alloc.gpu_usage().items():
            claim = dra.ClaimName.of(key)
            holder = f"claim {claim.namespace}/{claim.name}" if claim is not None else str(key)
            holders.setdefault((entry.alloc.node, index), []).append(Holder(holder, milli, memory, entry.phase.value))
    reservations: dict[tuple[str, int], pods.Record] = {}
    for record in cache.live_reservations():
        slot = record.reservation
        assert slot is not None
        known = reservations.get((slot.node, slot.index))
        if known is None or (known.reservation is not None and not known.reservation.uuid and slot.uuid):
            reservations[(slot.node, slot.index)] = record
    wanted = set(only)
    nodes = []
    for row, name in enumerate(state.names):
        if wanted and name not in wanted:
            continue
        inventory_ = state.inventories[row]
        gpus = []
        for gpu in inventory_.gpus:
            i = gpu.index
            held = reservations.get((name, i))
            slot = held.reservation if held is not None else None
            gpus.append(
                GpuView(
                    index=i,
                    uuid=str(gpu.uuid),
                    model=gpu.model,
                    healthy=bool(state.healthy[row, i]),
                    reason=view.gpu_reasons.get((name, i), ""),
                    milli_capacity=int(state.milli_capacity[row, i]),
                    milli_free=int(state.milli_free[row, i]),
                    memory_capacity=int(state.gmem_capacity[row, i]),
                    memory_free=int(state.gmem_free[row, i]),
                    holders=tuple(sorted(holders.get((name, i), []), key=lambda h: h.pod)),
                    reservation=str(held.key) if held is not None else None,
                    reservation_uuid=slot.uuid if slot is not None else None,
                    overcommitted=overcommitted.get((name, i), ()),
                )
            )
        nodes.append(
            NodeView(
                name=name,
                cpu_capacity=int(state.cpu_capacity[row]),
                cpu_free=int(state.cpu_free[row]),
                memory_capacity=int(state.mem_capacity[row]),
                memory_free=int(state.mem_free[row]),
                gpus=tuple(gpus),
            )
        )
    ignored = []
    for device_name, device in sorted(cache.devices.items()):
        if wanted and device_name not in wanted:
            continue
        facts = cache.nodes.get(device_name)
        if device.problem is not None:
            ignored.append((device_name, device.problem))
        elif facts is None:
            ignored.append((device_name, "the Device has no Node"))
        elif not facts.schedulable:
            ignored.append((device_name, "the node is not ready or is cordoned"))
        elif state.row(device_name) is None:
            ignored.append((device_name, "the Device does not describe a usable inventory"))
    return Inventory(tuple(nodes), tuple(ignored), cache.counters.conflicts)


# ----------------------------------------------------------------- explain


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    """One candidate node for a pending pod."""

    node: str
    fits: bool
    shortfall: str
    """A `core.fit.Shortfall` name (NONE where it fits), NO_INVENTORY or DRA_ONLY."""
    reason: str
    """The extender's text for this node in the pod's FailedScheduling event ("" where it fits)."""
    gpus: tuple[str, ...]
    """GPU by GPU, as the extender's /debug/pods words it (only for the closest nodes)."""
    eligible: tuple[int, ...]
    """Where it fits: the GPUs that can host the pod."""


@dataclass(frozen=True, slots=True)
class Choice:
    node: str
    gpus: tuple[int, ...]
    policy: str


@dataclass(frozen=True, slots=True)
class Explanation:
    pod: str
    phase: str
    scheduler_name: str
    node: str
    """The node the pod is bound to ("" while pending)."""
    outcome: str
    """bound, fits, unschedulable, quota, gang (its gang keeps it waiting), invalid, no-gpu, dra,
    reservation or finished."""
    asks: str
    """The request in words ("" when it asks for no GPU or cannot be read)."""
    problem: str
    """Why the request cannot be read, or why the pod may not be placed (quota)."""
    scheduled: tuple[str, str, str] | None
    """The pod's PodScheduled condition: (status, reason, message)."""
    group: str
    """The SharedDeviceGroup the pod joins (namespace/name), if any."""
    selector: Mapping[str, str]
    candidates: int
    left_out: int
    """Nodes the pod's nodeSelector leaves out."""
    message: str
    """What the extender's filter would answer now over the candidates, in kube-scheduler's words
    (where the quota refuses: that it does, and how many nodes have room all the same)."""
    choice: Choice | None
    """The node and GPUs the extender's policy picks now (None where nothing fits or the quota refuses)."""
    nodes: tuple[NodeVerdict, ...]
    allocation: allocation.Allocation | None
    claims: tuple[str, ...] = ()
    """The pod's DRA claims of sharegpu's class, in words (`gpu_claims`): the DRA allocator places them."""
    gang: str = ""
    """The gang the pod is a member of, with its minimum ("" for none): its gang decides where it goes."""


def gpu_claims(pod: wire.Pod, known: Mapping[units.PodKey, dra.ClaimRecord]) -> tuple[str, ...]:
    """The pod's `spec.resourceClaims` entries that ask for sharegpu's DeviceClass, in words, as the
    DRA allocator finds them: a listed claim of the class (`known`: claim key -> record, sharegpu's
    claims only), or one not made yet whose name, or template's, has sharegpu's shape (the webhook's
    and the allocator's own: `api.dra.claim_shape`, `template_shape`)."""
    out = []
    namespace = pod.metadata.namespace
    for ref in pods.claim_refs(pod):
        found = known.get(dra.claim_key(namespace, ref.claim)) if ref.claim else None
        if found is not None and found.ours:
            state = "allocated" if found.allocated else "not allocated yet"
            out.append(f"{ref.name} (claim {ref.claim}, {state})")
        elif ref.claim and dra.claim_shape(ref.claim) is not None:
            out.append(f"{ref.name} (claim {ref.claim}, not made yet)")
        elif not ref.claim and ref.template and dra.template_shape(ref.template) is not None:
            out.append(f"{ref.name} (from template {ref.template}, its claim not made yet)")
    return tuple(out)


def _listed_claims(listing: Listing) -> dict[units.PodKey, dra.ClaimRecord]:
    records = (dra.claim_record(c) for c in listing.claims)
    return {r.key: r for r in records if r.ours}


def describe(request: requests.PodRequest) -> str:
    """A pod's GPU request in words (what placement works with: the pod-level demand)."""
    d = request.demand
    if d.count == 0:
        gpu = "no GPU"
    elif d.whole:
        gpu = f"{d.count} whole GPU{'s' if d.count > 1 else ''}"
    else:
        gpu = f"{d.count} GPU{'s' if d.count > 1 else ''} x {d.milli} milli-GPU"
    parts = [gpu]
    if d.memory_mib and not d.whole:
        parts.append(f"{d.memory_mib} MiB GPU memory each")
    if d.memory_permille and not d.whole:
        parts.append(f"{d.memory_permille / 10:g}% of each GPU's memory")
    if d.models:
        parts.append("model " + "/".join(sorted(d.models)))
    rules = d.cotenancy
    for label, value in (
        ("affinity", rules.affinity),
        ("anti-affinity", rules.anti_affinity),
        ("exclusion", rules.exclusion),
        ("group", rules.group),
    ):
        if value is not None:
            parts.append(f"{label} {value!r}")
    if d.isolation is not None:
        parts.append(f"isolation {d.isolation.value}" + (" enforcing compute" if d.compute else ""))
    if d.cpu_milli or d.host_memory_mib:
        parts.append(f"host cpu {d.cpu_milli}m, memory {d.host_memory_mib} MiB")
    return "; ".join(parts)


def _scheduled(pod: wire.Pod) -> tuple[str, str, str] | None:
    for condition in pod.status.conditions:
        if condition.type == "PodScheduled":
            return condition.status, condition.reason, condition.message
    return None


def _group(pod: wire.Pod) -> str:
    try:
        joined = api_groups.membership(pod.metadata.annotations, pod.metadata.namespace)
    except errors.InvalidInputError:
        return ""
    return f"{joined[0]}/{joined[1]}" if joined else ""


def explain(
    view: Cluster, pod: wire.Pod, node_selector: Mapping[str, str] | None = None, *, detail: int = DETAIL_NODES
) -> Explanation:
    """Why `pod` is pending (or where it is), node by node and GPU by GPU, from the extender's filter.

    The candidates are the nodes kube-scheduler would offer the extender as far as the pod's
    nodeSelector goes (its other filters, taints and required affinity, are kube-scheduler's and
    not repeated here); among them, the nodes the fleet does not hold, and those that serve DRA
    claims only (`ClusterCache.dra_rows`: the extender's filter drops them), get the extender's "no
    GPU inventory" text, as in a filter answer."""
    record = pods.record(pod)
    selector = dict(node_selector or {})
    scheduled = _scheduled(pod)

    base = Explanation(
        pod=str(record.key), phase=record.phase or "Pending", scheduler_name=record.scheduler, node=record.node,
        outcome="", asks=describe(record.request) if record.request else "", problem="", scheduled=scheduled,
        group=_group(pod), selector=selector, candidates=0, left_out=0, message="", choice=None, nodes=(),
        allocation=record.allocation,
    )  # fmt: skip
    if record.reservation is not None:
        slot = record.reservation
        return dataclasses.replace(
            base, outcome="reservation", problem=f"sharegpu's reservation pod for GPU {slot.index} of {slot.node}"
        )
    if record.terminal:
        return dataclasses.replace(base, outcome="finished")
    if record.node:
        return dataclasses.replace(base, outcome="bound")
    if not record.gpu:
        claims = gpu_claims(pod, view.cache.claims.records)
        if claims:  # its GPUs come through DRA: the DRA allocator places its claims, not the filter
            return dataclasses.replace(base, outcome="dra", asks="DRA claims " + ", ".join(claims), claims=claims)
        return dataclasses.replace(base, outcome="no-gpu")
    if record.request is None:
        text = reasons.invalid(["-"], record.problem or "unreadable")
        return dataclasses.replace(base, outcome="invalid", problem=text.unresolvable["-"])
    request = record.request
    demand = request.demand
    cache = view.cache
    state = cache.state
    names_ = sorted(n for n in cache.nodes if all(view.labels.get(n, {}).get(k) == v for k, v in selector.items()))
    left_out = len(cache.nodes) - len(names_)
    dra_only = {n for n in names_ if (row := state.row(n)) is not None and bool(cache.dra_rows[row])}
    known = [n for n in names_ if state.row(n) is not None and n not in dra_only]
    missing = [n for n in names_ if state.row(n) is None or n in dra_only]
    rows = np.array([state.row(n) for n in known], dtype=np.int64)
    feasible = fit.evaluate(state, demand, rows).feasible
    diagnosis = fit.diagnose(state, demand, rows)
    failed = reasons.failures(known, diagnosis, demand, missing)
    texts = {**failed.resolvable, **failed.unresolvable}
    charged = pods.charged_namespace(pod.metadata.namespace, pod.metadata.labels)  # a group holder: its group's
    refusal = view.quota.refusal(record.key, request, charged)
    choice = None
    if refusal is not None:  # the extender's filter refuses before any node: nothing is chosen
        room = f"{int(feasible.sum())} of {len(names_)} nodes have room for it" if feasible.any() else "no node fits"
        message = f"held back by its namespace's quota before any node ({room})"
    elif feasible.any():
        placer = cache.placer_for(pod.metadata.annotations.get(names.PLACEMENT))
        decision = placer.decide(demand, rows)
        if decision.node is not None:
            choice = Choice(decision.node, tuple(decision.gpus), placer.policy.name)
        message = f"{int(feasible.sum())} of {len(names_)} nodes fit"
    else:
        message = failed.message(len(names_)) if names_ else "no node matches the pod's nodeSelector"
    shortfall, usable = diagnosis.shortfall.tolist(), diagnosis.usable.tolist()
    order = sorted(range(len(known)), key=lambda i: (shortfall[i] != 0, -shortfall[i], -usable[i], known[i]))
    verdicts = []
    for rank, position in enumerate(order):
        row = int(rows[position])
        fits = bool(feasible[position])
        lines: tuple[str, ...] = ()
        eligible: tuple[int, ...] = ()
        if fits:
            mask = fit.eligible_gpus(state, demand, rows[position : position + 1])[0]
            eligible = tuple(int(i) for i in np.flatnonzero(mask))
        elif rank < detail:
            lines = tuple(reasons.detail(fit.explain_node(state, demand, row)))
        kind = fit.Shortfall(shortfall[position]).name
        verdicts.append(NodeVerdict(known[position], fits, kind, texts.get(known[position], ""), lines, eligible))
    verdicts += [
        NodeVerdict(n, False, DRA_ONLY, texts[n], (DRA_ONLY_DETAIL,), ())
        if n in dra_only
        else NodeVerdict(n, False, NO_INVENTORY, texts[n], (), ())
        for n in missing
    ]
    outcome = "quota" if refusal is not None else ("fits" if feasible.any() else "unschedulable")
    found = dataclasses.replace(
        base, outcome=outcome, problem=refusal or "", candidates=len(names_), left_out=left_out, message=message,
        choice=choice, nodes=tuple(verdicts),
    )  # fmt: skip
    return _gang(view, record, found) if record.gang is not None and refusal is None else found


def _gang(view: Cluster, record: pods.Record, alone: Explanation) -> Explanation:
    """A gang member's explanation: what its gang's filter says (`extender.gangtrial`, as the
    extender's `GangBook` plans a gang it holds no plan for). The pod alone fitting says nothing:
    its gang is placed together or not at all; where its gang has its minimum running, it is placed
    as any pod. The extender may hold a plan already (the pod's PodScheduled message says)."""
    gang = record.gang
    assert gang is not None
    named = dataclasses.replace(alone, gang=f"{gang.key}, minimum {gang.min_count}")
    tried = extender_gangtrial.consider(view.cache, view.quota, record)
    if isinstance(tried, extender_gangtrial.Free):
        return named
    if isinstance(tried, extender_gangtrial.Waits):
        return dataclasses.replace(named, outcome="gang", message=tried.why, choice=None)
    if not tried.plan.status.ok:
        return dataclasses.replace(
            named, outcome="gang", message=f"gang {gang.key}: {tried.plan.status.message}", choice=None
        )
    mine = next((a for a in tried.plan.allocations if a.pod == record.key), None)
    if mine is None:
        why = f"gang {gang.key}: planned without this pod (no room for it now); it follows them"
        return dataclasses.replace(named, outcome="gang", message=why, choice=None)
    planned = f"its gang's plan places {len(tried.plan.allocations)} member(s) on {tried.plan.nodes} node(s)"
    choice = Choice(mine.node, tuple(mine.gpu_indices), view.cache.placer.policy.name)
    return dataclasses.replace(named, outcome="fits", message=planned, choice=choice)


# ----------------------------------------------------------------- groups


@dataclass(frozen=True, slots=True)
class GroupView:
    namespace: str
    name: str
    phase: str
    node: str
    gpus: int
    share: str
    """"whole GPUs", or the share of each GPU."""
    strategy: str
    devices: tuple[tuple[int, str], ...]
    """(index, UUID) of each GPU the group holds."""
    members: tuple[str, ...]
    message: str
    """The latest condition's message that is not True (why a group is not bound), else ""."""


def group_views(items: Sequence[api_groups.SharedDeviceGroup]) -> list[GroupView]:
    out = []
    for item in sorted(items, key=lambda g: (g.metadata.namespace, g.metadata.name)):
        spec, status = item.spec, item.status
        if spec.share is None:
            share = "whole GPUs"
        else:
            memory = f"{spec.share.memory_mib} MiB" if spec.share.memory_mib else f"{spec.share.milli / 10:g}% memory"
            share = f"{spec.share.milli} milli-GPU, {memory}"
        troubled = [c.message or c.reason for c in status.conditions if c.status != "True" and (c.message or c.reason)]
        out.append(
            GroupView(
                namespace=item.metadata.namespace,
                name=item.metadata.name,
                phase=status.phase,
                node=status.node_name,
                gpus=spec.gpus,
                share=share,
                strategy=spec.scheduling_strategy,
                devices=tuple((d.index, d.uuid) for d in status.devices),
                members=tuple(sorted(status.member_pods)),
                message=troubled[-1] if troubled else "",
            )
        )
    return out


# ----------------------------------------------------------------- budgets and quotas


@dataclass(frozen=True, slots=True)
class BudgetView:
    kind: str
    namespace: str
    """The GPUBudget's namespace ("" for a ClusterGPUBudget)."""
    name: str
    covers: tuple[str, ...]
    """The namespaces a ClusterGPUBudget selects now (a GPUBudget: its own)."""
    state: str
    used_seconds: int
    limit_seconds: int
    period_start: str
    period_end: str
    when_exhausted: str
    top: tuple[tuple[str, int], ...]
    """(pod, GPU-seconds) of the largest consumers."""


@dataclass(frozen=True, slots=True)
class QuotaView:
    namespace: str
    name: str
    resource: str
    held: int
    """What the namespace's placed pods hold, as the extender counts it at placement."""
    hard: int


def budget_views(
    items: Sequence[api_budgets.AnyBudget], namespaces: Mapping[str, Mapping[str, str]]
) -> list[BudgetView]:
    """Every budget with its standing; `namespaces`: name -> labels (for what a cluster budget selects)."""
    out = []
    for item in items:
        status, spec = item.status, item.spec
        covers = tuple(sorted(n for n, labels in namespaces.items() if api_budgets.covers(item, n, labels)))
        if isinstance(item, api_budgets.GPUBudget):
            covers = (item.metadata.namespace,)
        out.append(
            BudgetView(
                kind=type(item).__name__,
                namespace=item.metadata.namespace if isinstance(item, api_budgets.GPUBudget) else "",
                name=item.metadata.name,
                covers=covers,
                state=status.state,
                used_seconds=status.used_gpu_seconds,
                limit_seconds=status.limit_gpu_seconds or api_budgets.limit_seconds(spec),
                period_start=status.period_start,
                period_end=status.period_end,
                when_exhausted=spec.when_exhausted,
                top=tuple((c.pod, c.gpu_seconds) for c in status.top_consumers),
            )
        )
    out.sort(key=lambda b: (b.namespace == "", b.namespace, b.name))
    return out


def quota_views(view: Cluster, namespace: str | None = None) -> list[QuotaView]:
    """Every ResourceQuota that limits sharegpu's totals, with what the extender counts against it."""
    out = []
    for ns, limits in sorted(view.quota.limits.items()):
        if namespace is not None and ns != namespace:
            continue
        milli, memory = view.quota.held(ns, ())
        for name, limit in sorted(limits.items()):
            if limit.milli is not None:
                out.append(QuotaView(ns, name, names.GPU_MILLI_TOTAL, milli, limit.milli))
            if limit.memory_mib is not None:
                out.append(QuotaView(ns, name, names.GPU_MEMORY_TOTAL, memory, limit.memory_mib))
    return out


# ----------------------------------------------------------------- usage (top)

TOP_SORTS = ("used", "sm", "share", "idle", "name")
"""`top`'s orders: most memory used, most SM used, largest share, idlest share first, by name."""


@dataclass(frozen=True, slots=True)
class UsageRow:
    """What one pod (or, in `by_namespace`, one namespace) uses of the GPUs, beside what it was given."""

    namespace: str
    pod: str
    """"" in a namespace's row."""
    node: str
    gpu: str
    """The GPU's index on its node (or its UUID where the node does not list it); "" in a namespace's row."""
    share_milli: int | None
    allocated_mib: int | None
    used_mib: int
    sm_percent: int | None
    """Of the whole GPU (summed over a namespace's GPUs); None: not sampled there."""
    age_seconds: int | None
    """How old the figures are (the oldest of a namespace's)."""
    pods: int = 1

    @property
    def share_used_percent(self) -> int | None:
        """How much of its compute share it uses (SM % of the GPU over the share's %)."""
        if self.sm_percent is None or not self.share_milli:
            return None
        return self.sm_percent * 1000 // self.share_milli


def usage_rows(items: Sequence[usage.GpuUsage], namespace: str | None, now: float) -> list[UsageRow]:
    """One row per pod and GPU it uses, of `namespace` (None: every one)."""
    rows = []
    for item in items:
        status = item.status
        try:
            age: int | None = max(0, int(now) - wire.seconds(status.observed_at))
        except errors.InvalidInputError:
            age = None
        index = {g.uuid: g.index for g in status.gpus}
        for use in status.pods:
            if namespace is not None and use.namespace != namespace:
                continue
            where = index.get(use.uuid)
            rows.append(
                UsageRow(
                    namespace=use.namespace, pod=use.name, node=item.metadata.name,
                    gpu=str(where) if where is not None else use.uuid, share_milli=use.share_milli,
                    allocated_mib=use.allocated_mib, used_mib=use.used_mib, sm_percent=use.sm_percent, age_seconds=age,
                )
            )  # fmt: skip
    return rows


def by_namespace(rows: Sequence[UsageRow]) -> list[UsageRow]:
    """The rows summed per namespace (a figure unknown for any row of it is unknown for the sum; the
    age is the oldest)."""
    grouped: dict[str, list[UsageRow]] = {}
    for row in rows:
        grouped.setdefault(row.namespace, []).append(row)

    def known(values: Sequence[int | None]) -> list[int] | None:
        found = [v for v in values if v is not None]
        return found if len(found) == len(values) else None

    out = []
    for space, mine in grouped.items():
        shares, allocated = known([r.share_milli for r in mine]), known([r.allocated_mib for r in mine])
        sm, ages = known([r.sm_percent for r in mine]), known([r.age_seconds for r in mine])
        out.append(
            UsageRow(
                namespace=space, pod="", node="", gpu="", share_milli=None if shares is None else sum(shares),
                allocated_mib=None if allocated is None else sum(allocated), used_mib=sum(r.used_mib for r in mine),
                sm_percent=None if sm is None else sum(sm), age_seconds=None if ages is None else max(ages),
                pods=len({r.pod for r in mine}),
            )
        )  # fmt: skip
    return out


def check_sort(by: str) -> str:
    """`by` if it is one of `TOP_SORTS`; InvalidInputError naming them if not."""
    if by not in TOP_SORTS:
        raise errors.InvalidInputError(f"--sort: unknown order {by!r} (valid: {', '.join(TOP_SORTS)})")
    return by


def sort_rows(rows: Sequence[UsageRow], by: str) -> list[UsageRow]:
    """`rows` in one of `TOP_SORTS`' orders (ties by namespace, pod, node, GPU)."""
    check_sort(by)
    name = [(r.namespace, r.pod, r.node, r.gpu) for r in rows]
    keys = {
        "used": lambda i: (-rows[i].used_mib, name[i]),
        "sm": lambda i: (-(rows[i].sm_percent or 0), name[i]),
        "share": lambda i: (-(rows[i].share_milli or 0), name[i]),
        "idle": lambda i: (rows[i].share_used_percent if rows[i].share_used_percent is not None else 10**9, name[i]),
        "name": lambda i: (name[i],),
    }
    return [rows[i] for i in sorted(range(len(rows)), key=keys[by])]


# ----------------------------------------------------------------- the GPU map (dashboard)


@dataclass(frozen=True, slots=True)
class PendingView:
    """A GPU pod not placed yet, and why, in sharegpu's words (its PodScheduled condition)."""

    namespace: str
    name: str
    asks: str
    """What it asks for (`describe`)."""
    reason: str
    message: str


def pending(listing: Listing) -> list[PendingView]:
    """The GPU pods that wait for a node (not bound, not ending), oldest first: those that ask for
    sharegpu's resources and those whose GPUs come through DRA claims of its class (`gpu_claims`)."""
    out = []
    waiting = [
        p for p in listing.pods
        if not p.spec.node_name and not p.metadata.deletion_timestamp and not pods.is_terminal(p)
    ]  # fmt: skip
    order = sorted(waiting, key=lambda p: (p.metadata.creation_timestamp or "", p.metadata.namespace, p.metadata.name))
    known = _listed_claims(listing)
    for pod in order:
        if not pods.wants_gpu(pod):
            claims = gpu_claims(pod, known)
            if claims:  # its GPUs come through DRA claims
                scheduled = _scheduled(pod)
                reason, message = (scheduled[1], scheduled[2]) if scheduled is not None else ("", "not tried yet")
                asks = "DRA claims " + ", ".join(claims)
                out.append(PendingView(pod.metadata.namespace, pod.metadata.name, asks, reason, message))
            continue
        try:
            request = pods.request(pod)
        except errors.InvalidInputError as exc:
            out.append(PendingView(pod.metadata.namespace, pod.metadata.name, "", "Invalid", str(exc)))
            continue
        scheduled = _scheduled(pod)
        reason, message = (scheduled[1], scheduled[2]) if scheduled is not None else ("", "not tried yet")
        out.append(PendingView(pod.metadata.namespace, pod.metadata.name, describe(request), reason, message))
    return out


@dataclass(frozen=True, slots=True)
class IdleView:
    """A pod a GPUIdlePolicy found idle."""

    namespace: str
    pod: str
    since: str
    share_milli: int | None
    policy: str
    action: str


def idle_views(policies: Sequence[idle.GPUIdlePolicy]) -> list[IdleView]:
    return [
        IdleView(p.metadata.namespace, found.name, found.since, found.share_milli, p.metadata.name, p.spec.action)
        for p in policies
        if p.status.in_force
        for found in p.status.idle
    ]
