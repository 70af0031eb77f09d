"""What the extender's reconcilers share, handed to each whole, as kube-scheduler hands every plugin
its `framework.Handle`: the cluster cache, the API, the event recorder, the metrics and the clock.
`Reconciler` gives a reconciler its handle's parts by name (`self.cache`, `self.api`, ...), so none
copies them by hand. A reconciler's own state (what it tried, when) stays its own."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sharegpu.extender import cache as extender_cache
from sharegpu.extender import metrics as extender_metrics
from sharegpu.kube import client
from sharegpu.kube import events as kube_events


@dataclass(frozen=True, slots=True)
class Handle:
    cache: extender_cache.ClusterCache
    api: client.KubeApi
    recorder: kube_events.Recorder
    metrics: extender_metrics.Metrics
    clock: Callable[[], float] = field(default=time.monotonic)


class Reconciler:
    """A reconciler of the extender, on its `Handle`."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    @property
    def cache(self) -> extender_cache.ClusterCache:
        return self.handle.cache

    @property
    def api(self) -> client.KubeApi:
        return self.handle.api

    @property
    def recorder(self) -> kube_events.Recorder:
        return self.handle.recorder

    @property
    def metrics(self) -> extender_metrics.Metrics:
        return self.handle.metrics

    @property
    def clock(self) -> Callable[[], float]:
        return self.handle.clock
