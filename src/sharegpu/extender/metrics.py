"""The extender's Prometheus metrics, in its own registry (one set per process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sharegpu.core import allocation


class Metrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        self.decisions = prometheus_client.Counter(
            "sharegpu_extender_decisions", "Filter decisions by outcome", ["verb", "outcome"], registry=r
        )
        self.latency = prometheus_client.Histogram(
            "sharegpu_extender_latency_seconds",
            "Handler latency",
            ["verb"],
            registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        self.binds = prometheus_client.Counter("sharegpu_extender_binds", "Bind results", ["outcome"], registry=r)
        self.expired = prometheus_client.Counter(
            "sharegpu_extender_assumptions_expired",
            "Assumed placements forgotten because no binding followed",
            registry=r,
        )
        self.reservations = prometheus_client.Counter(
            "sharegpu_reservation_pods", "Reservation pods created and deleted", ["action"], registry=r
        )
        self.handoffs = prometheus_client.Counter(
            "sharegpu_handoff_writes", "Hand-off ConfigMaps written", ["action"], registry=r
        )
        self.leader = prometheus_client.Gauge(
            "sharegpu_extender_leader", "1 while this replica runs the background reconcilers", registry=r
        )
        self.ready = prometheus_client.Gauge(
            "sharegpu_extender_informer_ready", "1 while an informer is synced and watching", ["informer"], registry=r
        )

    def count_usage(self, source: Callable[[], Iterable[allocation.Allocation]]) -> None:
        """Per namespace, the GPU compute and memory its pods hold (or are reserved), read from
        `source` at each scrape: a pod of 3 GPUs at 500 milli counts 1500."""
        self.registry.register(_NamespaceUsage(source))

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class _NamespaceUsage(Collector):
    def __init__(self, source: Callable[[], Iterable[allocation.Allocation]]) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        milli = GaugeMetricFamily(
            "sharegpu_namespace_gpu_milli",
            "GPU compute held per namespace (milli-GPU, every GPU)",
            labels=["namespace"],
        )
        memory = GaugeMetricFamily(
            "sharegpu_namespace_gpu_memory_mib", "GPU memory held per namespace (MiB, every GPU)", labels=["namespace"]
        )
        totals: dict[str, list[int]] = {}
        for alloc in self.source():
            found = totals.setdefault(str(alloc.pod).split("/", 1)[0], [0, 0])
            for used_milli, used_memory in alloc.gpu_usage().values():
                found[0] += used_milli
                found[1] += used_memory
        for namespace, (used_milli, used_memory) in sorted(totals.items()):
            milli.add_metric([namespace], used_milli)
            memory.add_metric([namespace], used_memory)
        yield milli
        yield memory
