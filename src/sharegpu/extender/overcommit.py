"""The over-commit reconciler: says which GPUs the API server shows over-committed, and repairs them.

The API server is the truth. When it shows bound pods that together do not fit a GPU (a fault let a
second decision through; a pod bound with sharegpu's allocation by something else), the ledger
counts every one of them and blocks the GPU: nothing more is placed there (`core.ledger`). This
reconciler, on the Lease holder only, makes the over-commit visible and ends it:

- **Report.** A Warning event `GPUOvercommitted` on every pod of the GPU (once per pod and GPU),
  a log line (once per set of tenants), and the GPU in `sharegpu_gpu_overcommitted` (the metrics read the ledger),
  in /debug/nodes and in `kubectl sharegpu inspect`.
- **Repair policy.** Only tenants the API server shows bound there count: while one is an assumption
  (its binding on its way, or its outcome unknown) or is leaving, nothing is repaired (the ledger
  checks the GPU again once it is settled); a GPU with a single tenant is reported, never repaired
  (nothing is shared: its inventory changed under it, a driver reporting a little less memory, say).
  Of the tenants that have not started (phase Pending) and whose controller makes them again when
  they go (a ReplicaSet's, a Job's...), the one the ledger took in last (the one that did not fit:
  bound last, as the extender saw them; by creation time among equals) is evicted through the
  Eviction API (its disruption budgets honoured, only if it is still the pod with that UID and
  still as the extender saw it, not started since), with a Warning event `GPUOvercommitEvicted`; its
  owner makes it again and sharegpu places the new pod where it fits. One tenant at a time per GPU:
  the next pass waits until the evicted pod has gone, and evicts again only if the rest still do
  not fit. When no tenant qualifies (all have started, or none has an owner), nothing is evicted: a
  running workload is never killed for a fault, and a pod without an owner would be lost. The GPU
  stays blocked and reported until a tenant leaves by itself.
- **Claims.** A GPU's tenants may be ResourceClaims of sharegpu's driver (an allocation written past
  the allocator: sharegpu's own never over-commit). A claim no pod uses yet (`status.reservedFor`
  empty) is the first to go: its allocation is cleared (conditional on its resourceVersion), as
  kube-scheduler clears one it takes back, and the allocator places it again where it fits; its pod
  has not started, so nothing is lost. Claims in use are never cleared.
- **Outcomes.** An eviction refused (429 from a disruption budget, 409 for a pod made again) or whose
  answer was lost is tried again after `retry` seconds if the pod is still there and still the
  newest candidate; the watch shows an eviction that did happen (the pod being deleted). Events are
  named by their decision, so a lost answer costs one more write, never a second event.
"""

from __future__ import annotations

import logging

from sharegpu.api import dra, events, paths, pods
from sharegpu.core import errors, ledger, units
from sharegpu.extender import handle as extender_handle
from sharegpu.extender import metrics as extender_metrics
from sharegpu.kube import errors as kube_errors
from sharegpu.kube import reconcile

log = logging.getLogger(__name__)

RETRY = 10.0
"""Seconds before an eviction of the same pod is tried again."""

REPAIR = (
    "sharegpu places nothing more on it; repair: the tenant bound last that has not started and has an owner "
    "is evicted, otherwise it waits for a tenant to leave"
)


class OvercommitReconciler(extender_handle.Reconciler):
    def __init__(self, handle: extender_handle.Handle, *, retry: float = RETRY) -> None:
        super().__init__(handle)
        self.retry = retry
        self.tried: dict[units.PodKey, float] = {}
        """Pods an eviction was sent for -> when (until they are gone)."""
        self.said: set[tuple[str, str]] = set()
        """(pod UID, GPU) of the GPUOvercommitted events recorded."""
        self.logged: set[str] = set()
        """Episodes (`_episode`) logged."""
        self.waiting: set[str] = set()
        """Episodes none of whose tenants may be evicted (said once)."""
        self.loop = reconcile.Loop("overcommit", self.reconcile)

    def wake(self) -> None:
        self.loop.wake()

    async def run(self, tick: float = 2.0, pace: float = 0.25) -> None:
        await self.loop.run(tick, pace)

    async def reconcile(self) -> None:
        await self.recorder.retell()
        found = self.cache.ledger.overcommitted()
        for gpu in found:
            await self._report(gpu)
            await self._repair(gpu)
        for key in [k for k in self.tried if self.cache.record(k) is None and k not in self.cache.claims.records]:
            del self.tried[key]
        # What was said of GPUs that are fine again is forgotten (said again, should they not be).
        current = {gpu.where for gpu in found}
        self.said = {(uid, where) for uid, where in self.said if where in current}
        episodes = {_episode(gpu) for gpu in found}
        self.logged &= episodes
        self.waiting &= episodes

    def describe(self, gpu: ledger.Overcommit) -> str:
        return (
            f"{gpu.where} is over-committed: {gpu.milli_used} of {gpu.milli_capacity} milli-GPU and "
            f"{gpu.memory_used} of {gpu.memory_capacity} MiB allocated to {', '.join(gpu.pods)}"
        )

    async def _report(self, gpu: ledger.Overcommit) -> None:
        if _episode(gpu) not in self.logged:
            self.logged.add(_episode(gpu))
            log.error("%s (%s)", self.describe(gpu), "; ".join(gpu.problems))
        decision = gpu.where  # one event per pod and GPU, whoever joins later
        message = f"{self.describe(gpu)}; {REPAIR}"
        for key in gpu.pods:
            record = self.cache.record(key)
            if record is None or (record.uid, decision) in self.said:
                continue
            if await self._event(record, "GPUOvercommitted", message, decision):
                self.said.add((record.uid, decision))

    async def _event(self, record: pods.Record, reason: str, message: str, decision: str) -> bool:
        namespace, _, name = record.key.partition("/")
        subject = events.pod(namespace, name, record.uid)
        return await self.recorder.tell(subject, reason, message, decision=decision, kind="Warning")

    async def _repair(self, gpu: ledger.Overcommit) -> None:
        claim_keys = [k for k in gpu.pods if dra.is_claim_key(k)]
        claims = [self.cache.claims.records.get(k) for k in claim_keys]
        tenants = [self.cache.record(key) for key in gpu.pods if key not in claim_keys]
        if any(r is None or r.deleting or r.terminal for r in tenants) or any(c is None or c.deleting for c in claims):
            return  # one is leaving: the ledger checks the GPU again when it has gone
        if any(r is not None and r.node != gpu.node for r in tenants):
            return  # one is an assumption: its binding settles (lands, or is given up) first
        if len(gpu.pods) < 2:
            return  # one tenant shares with no one: its GPU's inventory changed, there is nothing to repair
        unused = [
            c for c in claims
            if c is not None and c.allocated and not c.reserved and c.key not in self.cache.claims.assumed
        ]  # fmt: skip
        if unused:
            await self._clear(gpu, max(unused, key=lambda c: (c.created, c.key)))
            return
        candidates = [
            r for r in tenants
            if r is not None and r.node == gpu.node and r.owned and r.phase == "Pending"
        ]  # fmt: skip
        if not candidates:
            if _episode(gpu) not in self.waiting:
                self.waiting.add(_episode(gpu))
                self.metrics.repairs.labels(extender_metrics.RepairAction.WAITING).inc()
                log.warning("repairing %s: no tenant may be evicted (all started, or without an owner): waiting "
                            "for one to leave", gpu.where)  # fmt: skip
            return
        taken_in = {key: position for position, key in enumerate(gpu.pods)}  # the last did not fit
        victim = max(candidates, key=lambda r: (taken_in[r.key], r.created, r.key))
        now = self.clock()
        last = self.tried.get(victim.key)
        if last is not None and now - last < self.retry:
            return
        self.tried[victim.key] = now
        namespace, _, name = victim.key.partition("/")
        try:
            body = pods.eviction(victim.key, victim.uid, resource_version=victim.resource_version)
            await self.api.create(paths.eviction(namespace, name), body)
        except kube_errors.NotFoundError:
            return  # gone meanwhile
        except errors.SharegpuError as exc:
            outcome = kube_errors.outcome(exc)
            self.metrics.repairs.labels(extender_metrics.RepairAction(outcome.value)).inc()
            log.warning("repairing %s: evicting %s: %s (%s; tried again in %.0f s)",
                        gpu.where, victim.key, exc, outcome.value, self.retry)  # fmt: skip
            return
        self.metrics.repairs.labels(extender_metrics.RepairAction.EVICTED).inc()
        log.warning("repairing %s: evicted %s (the tenant bound last that has not started)", gpu.where, victim.key)
        message = f"evicted to repair: {self.describe(gpu)}; its owner makes it again and sharegpu places it"
        await self._event(victim, "GPUOvercommitEvicted", message, f"{gpu.where}|evict")

    async def _clear(self, gpu: ledger.Overcommit, claim: dra.ClaimRecord) -> None:
        """Clear the allocation of a claim no pod uses yet (tried again after `retry` seconds)."""
        now = self.clock()
        last = self.tried.get(claim.key)
        if last is not None and now - last < self.retry:
            return
        self.tried[claim.key] = now
        body = {"metadata": {"resourceVersion": claim.resource_version}, "status": {"allocation": None}}
        try:
            await self.api.patch(f"{dra.claim_path(claim.namespace, claim.name)}/status", body)
        except kube_errors.NotFoundError:
            return  # gone meanwhile
        except errors.SharegpuError as exc:  # 409: it moved on; the watch shows how, the next pass decides
            outcome = kube_errors.outcome(exc)
            self.metrics.repairs.labels(extender_metrics.RepairAction(outcome.value)).inc()
            log.warning("repairing %s: clearing claim %s: %s (%s)", gpu.where, claim.key, exc, outcome.value)
            return
        self.metrics.repairs.labels(extender_metrics.RepairAction.CLEARED).inc()
        log.warning("repairing %s: cleared the allocation of claim %s (no pod uses it yet); the allocator "
                    "places it again", gpu.where, claim.key)  # fmt: skip


def _episode(gpu: ledger.Overcommit) -> str:
    """One over-commit as it stands: the GPU and its tenants (a tenant more or less is another)."""
    return f"{gpu.where}|{'|'.join(sorted(gpu.pods))}"
