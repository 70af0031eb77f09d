"""The extender's budget check, for the DRA allocator: a pod that uses claims of sharegpu's class
written by hand was never judged by the admission webhook (it asks for none of the GPU resources the
webhook reads), so before the allocator gives it GPUs it is judged here as the webhook would have
judged it (`api.budgets.held_back`): a used-up Deny budget of its namespace refuses it, a used-up
Demote budget takes it only at or below the demotion PriorityClass. The budgets are the ones the
controller keeps (GPUBudgets, and ClusterGPUBudgets by the namespaces' labels).

Handlers run in the event loop, like the cache's.
"""

from __future__ import annotations

from sharegpu.api import budgets, wire
from sharegpu.kube import informer


class BudgetGuard:
    def __init__(self) -> None:
        self.budgets: dict[str, budgets.GPUBudget] = {}
        self.cluster: dict[str, budgets.ClusterGPUBudget] = {}
        self.labels: dict[str, dict[str, str]] = {}
        """namespace -> its labels (what cluster budgets select by)."""
        self.classes: dict[str, int] = {}
        """PriorityClass -> its value."""

    def on_budget(self, kind: wire.EventType, item: budgets.GPUBudget) -> None:
        informer.remember(self.budgets, kind, item)

    def on_cluster_budget(self, kind: wire.EventType, item: budgets.ClusterGPUBudget) -> None:
        informer.remember(self.cluster, kind, item)

    def on_namespace(self, kind: wire.EventType, namespace: wire.Namespace) -> None:
        informer.remember_labels(self.labels, kind, namespace)

    def on_priority_class(self, kind: wire.EventType, item: wire.PriorityClass) -> None:
        if kind == wire.EventType.DELETED:
            self.classes.pop(item.metadata.name, None)
        else:
            self.classes[item.metadata.name] = item.value

    def refusal(self, namespace: str, priority: int | None) -> str | None:
        """Why a pod of `namespace` at `priority` may not be given GPUs now, or None."""
        own = [b for b in self.budgets.values() if b.metadata.namespace == namespace]
        governing = budgets.governing(namespace, self.labels.get(namespace, {}), own, list(self.cluster.values()))
        return budgets.held_back(governing, priority, self.classes)
