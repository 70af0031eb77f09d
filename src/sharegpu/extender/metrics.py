"""The extender's Prometheus metrics, in its own registry (one set per process).

Two kinds. What the extender does (decisions, binds, request durations, scheduling latency,
reservation and hand-off writes) is counted as it happens, in prometheus_client's own counters and
histograms. What the cluster holds (per node and GPU: capacity, allocation, holders; per namespace:
allocation, ResourceQuota limits, pending GPU pods) is read from the cache when Prometheus scrapes,
never maintained per event: `refresh` takes a `View` in the event loop (copies of the fleet arrays
and references to immutable records, cheap), and the families are built from it afterwards,
off the event loop when served (`scrape`), so a scrape of thousands of GPUs does not hold up filter
and bind. docs/metrics.md lists every metric.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sharegpu.api import quotas as api_quotas
from sharegpu.core import allocation, devices, fleet, units
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import quotas as extender_quotas
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import counters, http2

REQUEST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


# The values of the counters' labels, one vocabulary per counter: writers pass these members, and
# `Metrics` exports every value at 0 from the start (`serving.counters`).


class FilterOutcome(enum.StrEnum):
    """What a filter call decided, as the `outcome` label of `sharegpu_extender_decisions_total` counts it."""

    FEASIBLE = "feasible"
    """Nodes fit it (or the node it is bound or assumed on)."""
    UNSCHEDULABLE = "unschedulable"
    """No node fits it and no preemption would make room."""
    PREEMPTING = "preempting"
    """No node fits it now; a preemption nominated for it is making room."""
    QUOTA = "quota"
    """A ResourceQuota on sharegpu's totals refuses it."""
    INVALID = "invalid"
    """Its request is malformed."""
    GANG = "gang"
    """A gang member answered from its gang's plan: refused, or its planned node not among the candidates."""


class BindOutcome(enum.StrEnum):
    """How a bind ended, as the `outcome` label of `sharegpu_extender_binds_total` counts it."""

    BOUND = "bound"
    ERROR = "error"
    """Refused before or by the API: the pod is gone, replaced, bound already, or the write failed."""
    INVALID = "invalid"
    """The pod's request is malformed."""
    UNSCHEDULABLE = "unschedulable"
    """It no longer fits the node (the cluster changed since filter)."""
    CONFLICT = "conflict"
    """Its allocation conflicts with the ledger."""
    UNKNOWN = "unknown"
    """The write's answer was lost; the allocation is held until it is read back."""
    GANG = "gang-waiting"
    """A gang member waited at its bind for the others in vain; its place is held, kube-scheduler tries again."""


class GangOutcome(enum.StrEnum):
    """What became of a gang's plan (`sharegpu_extender_gangs_total`)."""

    PLANNED = "planned"
    RELEASED = "released"
    EXPIRED = "expired"
    REFUSED = "refused"


class ClaimOutcome(enum.StrEnum):
    """What the DRA allocator did with a claim (`sharegpu_extender_dra_claims_total`)."""

    ALLOCATED = "allocated"
    UNGATED = "ungated"
    CLEARED = "cleared"
    TEMPLATE = "template"
    MADE = "made"
    TAKEN_BACK = "taken-back"
    REFUSED = kube_errors.Outcome.REFUSED.value
    UNKNOWN = kube_errors.Outcome.UNKNOWN.value


class PreemptionOutcome(enum.StrEnum):
    """A preemption's nomination, then how it ended (`sharegpu_extender_preemptions_total`)."""

    NOMINATED = "nominated"
    PLACED = "placed"
    FREED = "freed"
    BOUND = "bound"
    GONE = "gone"
    REPLACED = "replaced"
    EXPIRED = "expired"
    STEPPED_DOWN = "stepped-down"
    """This replica stopped leading: the new leader plans the pod afresh."""


class DeletionOutcome(enum.StrEnum):
    """How a preempted pod's deletion went (`sharegpu_extender_preemption_deletions_total`)."""

    DONE = kube_errors.Outcome.DONE.value
    REFUSED = kube_errors.Outcome.REFUSED.value
    UNKNOWN = kube_errors.Outcome.UNKNOWN.value
    UNTOLD = "untold"
    """Not sent: its DisruptionTarget condition or its event could not be written first."""


class RequeueOutcome(enum.StrEnum):
    """`sharegpu_extender_requeues_total`."""

    NUDGED = "nudged"
    FAILED = "failed"


class ReservationAction(enum.StrEnum):
    """`sharegpu_extender_reservation_pods_total`: made, or deleted and why."""

    CREATED = "created"
    DELETED_ENDED = "deleted-ended"
    DELETED_DUPLICATE = "deleted-duplicate"
    DELETED_IDLE = "deleted-idle"


class HandoffAction(enum.StrEnum):
    """`sharegpu_extender_handoff_writes_total`."""

    CREATED = "created"
    UPDATED = "updated"
    REPAIRED = "repaired"
    """Found written by someone else, and written again."""


class RepairAction(enum.StrEnum):
    """What a pass of `extender.overcommit` did (`sharegpu_extender_overcommit_repairs_total`)."""

    EVICTED = "evicted"
    CLEARED = "cleared"
    WAITING = "waiting"
    REFUSED = kube_errors.Outcome.REFUSED.value
    UNKNOWN = kube_errors.Outcome.UNKNOWN.value


class LostWrite(enum.StrEnum):
    """Which write's answer was lost (`sharegpu_extender_unknown_writes_total`, label `write`)."""

    CLAIM_ALLOCATION = "claim-allocation"


class ReadBack(enum.StrEnum):
    """What reading a lost write back found (label `found`)."""

    DONE = "done"
    NOT_DONE = "not-done"


SCHEDULING_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        self.decisions = counters.counter(
            r, "sharegpu_extender_decisions", "Filter decisions by outcome", verb=("filter",), outcome=FilterOutcome
        )
        self.latency = prometheus_client.Histogram(
            "sharegpu_extender_request_duration_seconds",
            "Time to answer one filter, prioritize or bind call of kube-scheduler",
            ["verb"],
            registry=r,
            buckets=REQUEST_BUCKETS,
        )
        self.scheduling = prometheus_client.Histogram(
            "sharegpu_extender_scheduling_latency_seconds",
            "From a pod's first filter on this replica to its binding (waiting for room included)",
            registry=r,
            buckets=SCHEDULING_BUCKETS,
        )
        self.connections = counters.counter(
            r,
            "sharegpu_extender_connections",
            "Connections accepted on the scheduler port, by protocol (h2: one per kube-scheduler, kept)",
            protocol=http2.ALPN,
        )
        self.binds = counters.counter(r, "sharegpu_extender_binds", "Bind results", outcome=BindOutcome)
        self.unknown = counters.counter(
            r,
            "sharegpu_extender_unknown_writes",
            "Writes whose answer was lost, once read back: by write and by what the read found",
            write=LostWrite,
            found=ReadBack,
        )
        self.preemptions = counters.counter(
            r,
            "sharegpu_extender_preemptions",
            "Preemption nominations, by what happened (nominated; then placed, freed, bound, gone, replaced, expired)",
            outcome=PreemptionOutcome,
        )
        self.preempted = prometheus_client.Counter(
            "sharegpu_extender_preempted_pods", "Pods chosen as victims of a preemption", registry=r
        )
        self.preempted_deletions = counters.counter(
            r,
            "sharegpu_extender_preemption_deletions",
            "Deletions of preempted pods, by outcome (done, refused, unknown; untold: not sent, its event failed)",
            outcome=DeletionOutcome,
        )
        self.requeues = counters.counter(
            r,
            "sharegpu_extender_requeues",
            "Pods kube-scheduler was asked to try again because room appeared after they were turned away, "
            "by outcome (nudged, failed)",
            outcome=RequeueOutcome,
        )
        self.repairs = counters.counter(
            r,
            "sharegpu_extender_overcommit_repairs",
            "Repair passes over over-committed GPUs, by what they did (evicted, cleared, refused, unknown, waiting)",
            action=RepairAction,
        )
        self.claims = counters.counter(
            r,
            "sharegpu_extender_dra_claims",
            "What the DRA allocator did with claims of sharegpu's class, by outcome (allocated, ungated, "
            "cleared, template, made: a pod's claim by name it made; taken-back: kube-scheduler cleared an "
            "allocation it wrote; refused, unknown: "
            "a write refused, or whose answer was lost)",
            outcome=ClaimOutcome,
        )
        self.gangs = counters.counter(
            r,
            "sharegpu_extender_gangs",
            "Gang plans by outcome (planned: every needed member placed at once; released: all planned "
            "members reached their binding; expired: given back at the gang's timeout; refused: a member "
            "was turned away for its gang)",
            outcome=GangOutcome,
        )
        self.expired = prometheus_client.Counter(
            "sharegpu_extender_assumptions_expired",
            "Assumed placements forgotten because no binding followed",
            registry=r,
        )
        self.reservations = counters.counter(
            r, "sharegpu_extender_reservation_pods", "Reservation pods created and deleted", action=ReservationAction
        )
        self.handoffs = counters.counter(
            r,
            "sharegpu_extender_handoff_writes",
            "Hand-off ConfigMaps written (action: created, updated, or repaired: found written by someone else)",
            action=HandoffAction,
        )
        self.leader = prometheus_client.Gauge(
            "sharegpu_extender_leader", "1 while this replica runs the background reconcilers", registry=r
        )
        self.ready = prometheus_client.Gauge(
            "sharegpu_extender_informer_ready", "1 while an informer is synced and watching", ["informer"], registry=r
        )
        self.cluster = _Cluster()
        self.registry.register(self.cluster)
        self._source: Callable[[], View | None] = lambda: None

    def report(self, source: Callable[[], View | None]) -> None:
        """Report the cluster `source` returns at each scrape (None: nothing yet, e.g. before the
        cache is built)."""
        self._source = source

    def connection(self, protocol: str) -> None:
        """One connection accepted, by the protocol `http2.Connections` chose (one of `http2.ALPN`)."""
        self.connections.labels(protocol).inc()

    def refresh(self) -> None:
        """Take the cluster's figures for the next exposition (in the event loop: the cache is not
        thread-safe)."""
        self.cluster.view = self._source()

    def exposition(self) -> bytes:
        self.refresh()
        return prometheus_client.generate_latest(self.registry)

    async def scrape(self) -> bytes:
        """The exposition, formatted in a worker thread from a view taken here."""
        self.refresh()
        return await asyncio.to_thread(prometheus_client.generate_latest, self.registry)


@dataclass(frozen=True, slots=True)
class View:
    """The cluster as one scrape reports it: nothing in it changes after it is taken."""

    inventories: tuple[devices.NodeInventory, ...]
    """The nodes sharegpu places on (Ready, schedulable, with a valid Device), in fleet row order."""
    milli_used: fleet.IntArray
    memory_used: fleet.IntArray
    holders: fleet.IntArray
    """Per fleet row and GPU index: pods holding a share or the whole GPU (assumed ones included)."""
    allocations: tuple[allocation.Allocation, ...]
    pending: tuple[str, ...]
    """The namespace of each pod that asks for a GPU and is not bound yet."""
    quotas: tuple[tuple[str, api_quotas.Limit], ...]
    """(namespace, limit) of each ResourceQuota that limits sharegpu's totals."""
    overcommitted: tuple[tuple[str, int, int], ...] = ()
    """(node, GPU index, tenants) of each over-committed GPU."""


def view(cache: extender_cache.ClusterCache, quota: extender_quotas.QuotaGuard | None) -> View:
    """What the cache holds now (rebuilding the fleet first if the inventory changed, as a filter would)."""
    state = cache.state
    limits = quota.limits if quota is not None else {}
    return View(
        inventories=state.inventories,
        milli_used=state.milli_capacity - state.milli_free,
        memory_used=state.gmem_capacity - state.gmem_free,
        holders=state.tenants.copy(),
        allocations=tuple(cache.ledger.allocations()),
        pending=tuple(str(key).split("/", 1)[0] for key in cache.pending),
        quotas=tuple((ns, item) for ns, found in sorted(limits.items()) for _, item in sorted(found.items())),
        overcommitted=tuple((g.node, g.index, len(g.pods)) for g in cache.ledger.overcommitted()),
    )


class _Cluster(Collector):
    """Families over the latest `View` (present, without samples, before the first one)."""

    def __init__(self) -> None:
        self.view: View | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gpu = ["node", "gpu"]
        info = GaugeMetricFamily(
            "sharegpu_gpu_info", "1 per GPU sharegpu places on, with its UUID and model", labels=[*gpu, "uuid", "model"]
        )
        healthy = GaugeMetricFamily("sharegpu_gpu_healthy", "1 while the GPU is healthy (its Device says)", labels=gpu)
        milli_capacity = GaugeMetricFamily(
            "sharegpu_gpu_compute_capacity_gpus", "GPU compute, in GPUs (1 per GPU)", labels=gpu
        )
        milli_used = GaugeMetricFamily(
            "sharegpu_gpu_compute_allocated_gpus",
            "GPU compute allocated to pods (bound or assumed), in GPUs (0.3: 30% of it)",
            labels=gpu,
        )
        memory_capacity = GaugeMetricFamily("sharegpu_gpu_memory_capacity_bytes", "GPU memory", labels=gpu)
        memory_used = GaugeMetricFamily(
            "sharegpu_gpu_memory_allocated_bytes", "GPU memory allocated to pods (bound or assumed)", labels=gpu
        )
        holders = GaugeMetricFamily(
            "sharegpu_gpu_holders", "Pods holding a share or the whole of the GPU (bound or assumed)", labels=gpu
        )
        ns = ["namespace"]
        ns_milli = GaugeMetricFamily(
            "sharegpu_namespace_gpu_compute_allocated_gpus",
            "GPU compute the namespace's pods hold (bound or assumed), in GPUs over every GPU",
            labels=ns,
        )
        ns_memory = GaugeMetricFamily(
            "sharegpu_namespace_gpu_memory_allocated_bytes",
            "GPU memory the namespace's pods hold (bound or assumed) over every GPU",
            labels=ns,
        )
        quota_milli = GaugeMetricFamily(
            "sharegpu_namespace_gpu_compute_quota_gpus",
            "A ResourceQuota's limit on the namespace's GPU compute total, in GPUs",
            labels=[*ns, "quota"],
        )
        quota_memory = GaugeMetricFamily(
            "sharegpu_namespace_gpu_memory_quota_bytes",
            "A ResourceQuota's limit on the namespace's GPU memory total",
            labels=[*ns, "quota"],
        )
        pending = GaugeMetricFamily(
            "sharegpu_pending_gpu_pods", "Pods that ask for a GPU and are not bound to a node yet", labels=ns
        )
        overcommitted = GaugeMetricFamily(
            "sharegpu_gpu_overcommitted",
            "Tenants of a GPU whose tenants do not fit on it together (present only for such GPUs; nothing more "
            "is placed there until it is repaired)",
            labels=gpu,
        )
        found = self.view
        if found is not None:
            for node, index, count in found.overcommitted:
                overcommitted.add_metric([node, str(index)], count)
            _per_gpu(found, info, healthy, milli_capacity, milli_used, memory_capacity, memory_used, holders)
            totals: dict[str, list[int]] = {}
            for alloc in found.allocations:
                summed = totals.setdefault(str(alloc.pod).split("/", 1)[0], [0, 0])
                for milli, memory in alloc.gpu_usage().values():
                    summed[0] += milli
                    summed[1] += memory
            for namespace, (milli, memory) in sorted(totals.items()):
                ns_milli.add_metric([namespace], milli / units.MILLI_PER_GPU)
                ns_memory.add_metric([namespace], memory * units.BYTES_PER_MIB)
            for namespace, limit in found.quotas:
                if limit.milli is not None:
                    quota_milli.add_metric([namespace, limit.name], limit.milli / units.MILLI_PER_GPU)
                if limit.memory_mib is not None:
                    quota_memory.add_metric([namespace, limit.name], limit.memory_mib * units.BYTES_PER_MIB)
            for namespace, count in sorted(Counter(found.pending).items()):
                pending.add_metric([namespace], count)
        yield from (info, healthy, milli_capacity, milli_used, memory_capacity, memory_used, holders, overcommitted)
        yield from (ns_milli, ns_memory, quota_milli, quota_memory, pending)


def _per_gpu(
    found: View,
    info: GaugeMetricFamily,
    healthy: GaugeMetricFamily,
    milli_capacity: GaugeMetricFamily,
    milli_used: GaugeMetricFamily,
    memory_capacity: GaugeMetricFamily,
    memory_used: GaugeMetricFamily,
    holders: GaugeMetricFamily,
) -> None:
    for row, node in enumerate(found.inventories):
        if not node.gpus:
            continue
        width = len(node.gpus)
        used = found.milli_used[row, :width].tolist()
        memory = found.memory_used[row, :width].tolist()
        tenants = found.holders[row, :width].tolist()
        for gpu in node.gpus:
            labels = [str(node.name), str(gpu.index)]
            info.add_metric([*labels, str(gpu.uuid), gpu.model], 1)
            healthy.add_metric(labels, 1 if gpu.healthy else 0)
            milli_capacity.add_metric(labels, 1)
            milli_used.add_metric(labels, used[gpu.index] / units.MILLI_PER_GPU)
            memory_capacity.add_metric(labels, gpu.memory_mib * units.BYTES_PER_MIB)
            memory_used.add_metric(labels, memory[gpu.index] * units.BYTES_PER_MIB)
            holders.add_metric(labels, tenants[gpu.index])
