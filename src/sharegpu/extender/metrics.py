"""The extender's Prometheus metrics, in its own registry (one set per process)."""

from __future__ import annotations

import prometheus_client


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

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
