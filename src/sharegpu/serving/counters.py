"""Prometheus counters whose labelled series exist from the start, at 0.

A labelled series prometheus_client makes on its first `inc()` appears at 1, and `increase()` and
`rate()` do not see that first event (the first repair, preemption or refused review of a replica's
life). A counter made here is given the values each of its labels can take (an enum, a tuple) and
exports every combination at 0 at once; its writers pass those values."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import prometheus_client


def counter(
    registry: prometheus_client.CollectorRegistry, name: str, documentation: str, **labels: Iterable[str]
) -> prometheus_client.Counter:
    """A counter with a label per keyword, each combination of their values exported at 0 from the start."""
    made = prometheus_client.Counter(name, documentation, list(labels), registry=registry)
    for values in itertools.product(*labels.values()):
        made.labels(*values)
    return made
