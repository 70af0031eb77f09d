"""The extender's quota check: a GPU pod is placed only while its namespace's ResourceQuotas on
sharegpu's totals (`api.quotas`) allow it, counting what the namespace's placed pods hold (bound,
being deleted, assumed, or bound while the watch lags).

Kubernetes' quota admission already counts every pod at creation; this second check is for the pods
admitted before a quota was created or lowered, which Kubernetes never evicts: they wait in the
scheduling queue (an ordinary Unschedulable outcome with the quota's figures) until the namespace
frees GPU time or the quota is raised. Namespaces without such a quota cost one dictionary lookup;
with one, a filter walks the cached pods once (quota'd namespaces are few, and the walk is a sum
over records already parsed).

Handlers run in the event loop, like the cache's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sharegpu.api import names, pods, quotas, wire
from sharegpu.core import requests, units
from sharegpu.extender import cache as extender_cache


class QuotaGuard:
    def __init__(self, cache: extender_cache.ClusterCache) -> None:
        self.cache = cache
        self.limits: dict[str, dict[str, quotas.Limit]] = {}
        """namespace -> ResourceQuota name -> its limits on the totals (only quotas that set some)."""

    def on_quota(self, kind: wire.EventType, quota: quotas.ResourceQuota) -> None:
        meta = quota.metadata
        found = quotas.limit(quota) if kind != wire.EventType.DELETED else None
        in_namespace = self.limits.setdefault(meta.namespace, {})
        if found is None:
            in_namespace.pop(meta.name, None)
        else:
            in_namespace[meta.name] = found
        if not in_namespace:
            del self.limits[meta.namespace]

    def held(self, namespace: str, but: Collection[units.PodKey]) -> tuple[int, int]:
        """What the namespace's placed pods hold, those in `but` excepted: bound and not finished (being
        deleted too: its GPU is held until it has gone, and Kubernetes' quota counts it through its
        grace period), assumed, or bound by this extender while the watch does not show it yet."""
        milli = memory = 0
        prefix, holding = f"{namespace}/", f"{names.HOLDING_NAMESPACE}/"
        assumed, confirmed = self.cache.assumed, self.cache.confirmed
        for key, record in self.cache.pods.items():
            if key in but or record.request is None:
                continue
            if not key.startswith(prefix) and not (
                key.startswith(holding)
                and pods.charged_namespace(names.HOLDING_NAMESPACE, dict(record.labels)) == namespace
            ):  # a group's holder counts against its group's namespace
                continue
            if (record.node and not record.terminal) or key in assumed or key in confirmed:
                more = quotas.pod_totals(record.request)
                milli, memory = milli + more[0], memory + more[1]
        return milli, memory

    def refusal(self, key: units.PodKey, request: requests.PodRequest, charged: str = "") -> str | None:
        """Why the pod may not be placed now, or None; `charged`: the namespace it counts against
        (`api.pods.charged_namespace`; its own when not given)."""
        return self.refusal_of({key: request}, charged)

    def refusal_of(self, placing: Mapping[units.PodKey, requests.PodRequest], charged: str = "") -> str | None:
        """Why these pods of one namespace may not be placed together now (a gang's plan holds them
        all at once), or None."""
        if not placing:
            return None
        namespace = charged or str(next(iter(placing))).split("/", 1)[0]
        limits = self.limits.get(namespace)
        if not limits:
            return None
        totals = [quotas.pod_totals(r) for r in placing.values()]
        asks = (sum(t[0] for t in totals), sum(t[1] for t in totals))
        if asks == (0, 0):
            return None
        return quotas.refusal(namespace, sorted(limits.values(), key=lambda x: x.name),
                              self.held(namespace, placing.keys()), asks)  # fmt: skip
