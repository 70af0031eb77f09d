"""The budget reconciler: each budget's usage from the lifetimes of the GPU pods of the namespaces
it covers (a GPUBudget its own; a ClusterGPUBudget those its namespace selector picks, by the labels
the namespace informer keeps), and of the claims of sharegpu's DRA class there: a claim counts once
however many pods use it (`api.lifetimes.claim_lifetime`), from what its users' records say and the
allocation it held (kept after it is cleared, so a claim charged for its last user's time is charged
at the share it had).

It keeps, from its informers, every bound GPU pod's `api.lifetimes.Lifetime`, the pods it saw go
(with the time they went), and each node's GPU memory (a pod's weight counts its memory share). A
pass computes every budget's books (`api.budgets.account`) and writes the status when something a
reader would see changed, or every `write_every` seconds while pods run (so the books a successor
reads are never older than that). Writes carry the resourceVersion they were computed from: a 409
means another writer (a previous leader's last pass) got there first, and the next pass starts from
its books. Crossing into Warning or Exhausted records an event whose name is the decision (budget,
state, period), so the event exists once whoever records it; one that could not be recorded (the
API server restarting) is written again at a later pass (`Recorder.tell`: the status written
meanwhile no longer shows the crossing).

The clock is wall time in seconds (`clock`), injectable: tests advance it instead of sleeping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from sharegpu.api import budgets, dra, lifetimes, resources, wire
from sharegpu.core import allocation, budget, units
from sharegpu.core import errors as core_errors
from sharegpu.kube import client, errors, informer, reconcile
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)

FENCE = 5.0
"""Seconds a new leader's first pass waits (`BudgetReconciler.new_term`)."""
GONE_RETENTION = 3600
"""Seconds a pod that went is remembered at most (normally until every budget of its namespace has
written after it went)."""


@dataclass(frozen=True, slots=True)
class PodBooks:
    """What one pod event tells the budgets: the pod's own holding, and the claims it uses."""

    uid: str
    life: lifetimes.Lifetime | None
    use: lifetimes.ClaimUse | None


def pod_books(pod: lifetimes.TimedPod, previous: PodBooks | None = None) -> PodBooks:
    return PodBooks(pod.metadata.uid, lifetimes.lifetime(pod), lifetimes.claim_use(pod))


@dataclass(frozen=True, slots=True)
class HeldClaim:
    namespace: str
    name: str
    held: allocation.Allocation
    """The allocation it holds, or held last."""
    created: int | None = None
    """When it was made (seconds): uses of an older claim of its name do not count for it."""


def device_memory(device: wire.Device) -> dict[int, int]:
    """GPU index -> memory MiB of a node's Device."""
    return {g.index: g.memory_mib for g in device.spec.gpus}


class BudgetReconciler:
    def __init__(
        self,
        api: client.KubeApi,
        recorder: kube_events.Recorder,
        clock: Callable[[], float],
        *,
        write_every: float = 30.0,
        fence: float = FENCE,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the accounting's wall clock; `monotonic`: the fence's (`new_term`), which waits for
        watches in real time whatever the wall clock does."""
        self.api = api
        self.recorder = recorder
        self.clock = clock
        self.write_every = write_every
        self.fence = fence
        self.monotonic = monotonic
        self.lifetimes: dict[str, lifetimes.Lifetime] = {}
        self.finished: dict[str, int] = {}
        """uid -> when a pod was first seen finished, for finished pods that say no time."""
        self.gone: dict[str, tuple[lifetimes.Lifetime, int]] = {}
        """uid -> (lifetime, when it went) for pods seen deleted."""
        self.memory: dict[str, dict[int, int]] = {}
        self.uses: dict[str, lifetimes.ClaimUse] = {}
        """Pod UID -> the claims it uses, and when (ended for a pod that went, until its claims go)."""
        self.claims: dict[str, HeldClaim] = {}
        """Claim UID -> its namespace, name and allocation, for the claims of sharegpu's class."""
        self.namespaces: dict[str, dict[str, str]] = {}
        """namespace -> its labels (what cluster budgets select by)."""
        self.budgets: dict[str, budgets.AnyBudget] = {}
        """Both kinds, by `wire.key` (`namespace/name` for GPUBudgets, `name` for cluster ones)."""
        self.loop = reconcile.Loop("budgets", self.reconcile)
        self.writes = 0
        self.conflicts = 0
        self.swept = 0
        """When `gone` was last swept of what went long ago."""
        self.term_started: float | None = None
        """When this replica last began to lead (None: told nothing, no fence)."""

    # ----------------------------------------------------------------- informer handlers

    def on_pod(self, kind: wire.EventType, books: PodBooks) -> None:
        now = int(self.clock())
        use = books.use or self.uses.get(books.uid)
        if use is not None:
            gone = kind == wire.EventType.DELETED and use.end is None
            self.uses[books.uid] = dataclasses.replace(use, end=now) if gone else use
            self.loop.wake()
        life = books.life
        if life is None:
            return
        if kind == wire.EventType.DELETED:
            self.lifetimes.pop(life.uid, None)
            went = self.finished.pop(life.uid, now)
            self.gone[life.uid] = (life, life.end if life.end is not None else min(went, now))
            self._expire_gone(now)
        else:
            self.lifetimes[life.uid] = life
            if life.terminal and life.end is None:
                self.finished.setdefault(life.uid, now)
        self.loop.wake()

    def on_claim(self, kind: wire.EventType, claim: dra.ClaimRecord) -> None:
        """A claim of sharegpu's class: its allocation kept while it exists; when it goes, its holding
        moves to the gone ones (settled like a pod that went), and its users' records are let go."""
        if kind == wire.EventType.DELETED:
            found = self.claims.pop(claim.uid, None)
            life = self._claim_life(claim.uid, found) if found is not None else None
            if life is not None:
                self.gone[claim.uid] = (life, life.end if life.end is not None else int(self.clock()))
                self._expire_gone(int(self.clock()))
            named = {(c.namespace, c.name) for c in self.claims.values()}
            for uid, use in list(self.uses.items()):
                if use.end is not None and not any((use.namespace, n) in named for n in use.claims):
                    del self.uses[uid]
            self.loop.wake()
            return
        memory = {(node, index): mib for node, gpus in self.memory.items() for index, mib in gpus.items()}
        try:
            held = dra.held(claim, memory)
        except core_errors.InvalidInputError as exc:
            log.warning("claim %s/%s: %s", claim.namespace, claim.name, exc)
            return
        if held is not None:
            created = None
            with contextlib.suppress(core_errors.InvalidInputError):
                created = wire.seconds(claim.created) if claim.created else None
            self.claims[claim.uid] = HeldClaim(claim.namespace, claim.name, held, created)
            self.loop.wake()

    def _claim_life(self, uid: str, claim: HeldClaim) -> lifetimes.Lifetime | None:
        return lifetimes.claim_lifetime(
            uid, claim.namespace, claim.name, claim.held, self.uses.values(), created=claim.created
        )

    def on_device(self, kind: wire.EventType, device: wire.Device) -> None:
        if kind == wire.EventType.DELETED:
            self.memory.pop(device.metadata.name, None)
        else:
            self.memory[device.metadata.name] = device_memory(device)

    def on_budget(self, kind: wire.EventType, item: budgets.AnyBudget) -> None:
        informer.remember(self.budgets, kind, item)
        self.loop.wake()

    def on_namespace(self, kind: wire.EventType, namespace: wire.Namespace) -> None:
        relabelled = informer.remember_labels(self.namespaces, kind, namespace) and kind != wire.EventType.DELETED
        if relabelled and any(isinstance(b, budgets.ClusterGPUBudget) for b in self.budgets.values()):
            self.loop.wake()

    def governing(self, namespace: str) -> list[budgets.AnyBudget]:
        """The budgets that govern `namespace` as this controller knows them."""
        own = [
            b for b in self.budgets.values() if isinstance(b, budgets.GPUBudget) and b.metadata.namespace == namespace
        ]
        cluster = [b for b in self.budgets.values() if isinstance(b, budgets.ClusterGPUBudget)]
        return budgets.governing(namespace, self.namespaces.get(namespace, {}), own, cluster)

    def covered(self, item: budgets.AnyBudget) -> set[str]:
        """The namespaces whose pods the budget counts."""
        if isinstance(item, budgets.GPUBudget):
            return {item.metadata.namespace}
        return {ns for ns, labels in self.namespaces.items() if budgets.covers(item, ns, labels)}

    # ----------------------------------------------------------------- holdings

    def _holding(self, life: lifetimes.Lifetime, end: int | None) -> budget.Holding:
        if life.allocation is not None:
            weight = budget.weight(life.allocation, self.memory.get(life.node, {}))
        else:
            weight = life.whole_gpus * units.MILLI_PER_GPU
        # Starts are the API server's times, ends where the controller saw them its own: a pod deleted
        # within the two clocks' skew of its binding held nothing, not a negative time.
        return budget.Holding(life.key, weight, life.start, None if end is None else max(end, life.start))

    def held(self, namespaces: set[str]) -> dict[str, tuple[list[budgets.Held], list[budgets.Held]]]:
        """Per namespace of `namespaces`, the (present, gone) holdings of its pods: one walk over the
        pods for every budget of the pass."""
        out: dict[str, tuple[list[budgets.Held], list[budgets.Held]]] = {ns: ([], []) for ns in namespaces}
        for uid, life in self.lifetimes.items():
            if life.namespace in out:
                end = life.end if life.end is not None else self.finished.get(uid)
                out[life.namespace][0].append(budgets.Held(uid, self._holding(life, end)))
        for uid, claim in self.claims.items():
            held = self._claim_life(uid, claim) if claim.namespace in out else None
            if held is not None:
                out[held.namespace][0].append(budgets.Held(uid, self._holding(held, held.end)))
        for uid, (life, end) in self.gone.items():
            if life.namespace in out:
                out[life.namespace][1].append(budgets.Held(uid, self._holding(life, end)))
        return out

    # ----------------------------------------------------------------- the pass

    def new_term(self) -> None:
        """This replica leads (again): its first pass waits `fence` seconds, so that its watches of
        pods and claims catch up with what the previous leader saw before its last write (a pod that
        leader settled, still shown here, would be counted again)."""
        self.term_started = self.monotonic()

    async def reconcile(self) -> None:
        await self.recorder.retell()
        if self.term_started is not None and self.monotonic() - self.term_started < self.fence:
            self.loop.wake()  # the loop's pace brings the next pass, which looks again
            return
        now = int(self.clock())
        covered = {key: self.covered(item) for key, item in self.budgets.items()}
        holdings = self.held(set().union(*covered.values()))
        alive = self.lifetimes.keys() | self.claims.keys()
        for key, item in list(self.budgets.items()):
            if isinstance(item, budgets.ClusterGPUBudget):
                await self._check_selector(item)
            present = [h for ns in sorted(covered[key]) for h in holdings[ns][0]]
            gone = [h for ns in sorted(covered[key]) for h in holdings[ns][1]]
            try:
                budgets.anchor(item)
            except core_errors.InvalidInputError as exc:  # stored before the CRD's pattern refused it
                await self._warn(
                    item, "InvalidSpec", f"spec.periodStart: {exc}; the budget is not accounted until it is fixed"
                )
                continue
            try:
                books = budgets.account(item, present, gone, now, alive)
            except Exception as exc:  # a budget the code cannot account must not stop the others
                log.warning("budget %s: %s", key, exc)
                continue
            for crossing in books.crossings:
                await self._record(item, crossing, books.status)
            if self._worth_writing(item.status, books.status, now):
                try:
                    await self._write(item, books.status)
                except errors.ConflictError:
                    self.conflicts += 1
                    await self._read_again(key, item)
                except errors.NotFoundError:
                    self.budgets.pop(key, None)
                except errors.KubeError as exc:  # one budget that cannot be written must not stop the others
                    log.warning("budget %s: could not write its status: %s", key, exc)
        self._forget(now, covered)

    def _worth_writing(self, old: budgets.BudgetStatus, new: budgets.BudgetStatus, now: int) -> bool:
        if old.period_start != new.period_start or old.state != new.state:
            return True
        if [p.uid for p in old.accounting.pods] != [p.uid for p in new.accounting.pods]:
            return True
        if old.accounting.settled_milli_gpu_seconds != new.accounting.settled_milli_gpu_seconds:
            return True
        if not old.accounting.accounted_at:
            return True
        moving = old.used_gpu_seconds != new.used_gpu_seconds
        return moving and now - wire.seconds(old.accounting.accounted_at) >= self.write_every

    async def _write(self, item: budgets.AnyBudget, status: budgets.BudgetStatus) -> None:
        meta = item.metadata
        stored = await self.api.replace(*resources.budget_resource(item).status_update(meta, item.spec, status))
        self.writes += 1
        # Until the watch brings it, the next pass must start from what was just written.
        self.budgets[wire.key(meta)] = wire.convert(stored, type(item))

    async def _read_again(self, key: str, item: budgets.AnyBudget) -> None:
        """After a 409, the budget as the API server has it: the copy kept may be older than one the
        watch brought while the write was under way (the write's answer replaced it), and no event
        would come to mend it."""
        try:
            found = await self.api.get(
                resources.budget_resource(item).path(item.metadata.namespace, item.metadata.name)
            )
        except errors.NotFoundError:
            self.budgets.pop(key, None)
        except errors.KubeError as exc:
            log.warning("budget %s: could not read it again after a conflict: %s", key, exc)
        else:
            self.budgets[key] = wire.convert(found, type(item))

    async def _check_selector(self, item: budgets.ClusterGPUBudget) -> None:
        """A selector the API would refuse selects nothing: say so once, as a Warning event."""
        problem = wire.selector_problem(item.spec.namespace_selector)
        if problem is None:
            return
        message = f"spec.namespaceSelector: {problem}; the budget covers no namespace until it is fixed"
        await self._warn(item, "InvalidSelector", message)

    async def _warn(self, item: budgets.AnyBudget, reason: str, message: str) -> None:
        """A Warning event on the budget, recorded once for the same message."""
        subject = resources.budget_resource(item).subject(item.metadata)
        try:
            await self.recorder.record(subject, reason, message, decision=message, kind="Warning")
        except errors.KubeError as exc:
            log.warning("budget %s: could not record %s: %s", wire.key(item.metadata), reason, exc)

    async def _record(self, item: budgets.AnyBudget, crossing: budgets.Crossing, status: budgets.BudgetStatus) -> None:
        meta = item.metadata
        subject = resources.budget_resource(item).subject(meta)
        shown = msgspec.structs.replace(item, status=status)
        await self.recorder.tell(
            subject, crossing.reason, f"{crossing.message} ({budgets.summary(shown)})",
            decision=f"{crossing.state}@{status.period_start}", kind="Warning",
        )  # fmt: skip

    def _expire_gone(self, now: int) -> None:
        """Drop the pods that went more than `GONE_RETENTION` ago, at most once a tenth of it: a
        replica that does not lead runs no pass (`_forget`), and would keep every pod it saw go."""
        if now - self.swept < GONE_RETENTION // 10:
            return
        self.swept = now
        for uid, (_, end) in list(self.gone.items()):
            if now - end > GONE_RETENTION:
                del self.gone[uid]

    def _forget(self, now: int, covered: dict[str, set[str]]) -> None:
        """Drop gone pods that every budget covering their namespace has settled (wrote after they
        went, no longer listing them), that no budget covers, or that went long ago."""
        books: dict[str, list[budgets.Accounting]] = {}
        for key, item in self.budgets.items():
            for namespace in covered.get(key, ()):
                books.setdefault(namespace, []).append(item.status.accounting)
        for uid, (life, end) in list(self.gone.items()):
            mine = books.get(life.namespace, [])
            settled = all(
                b.accounted_at and wire.seconds(b.accounted_at) >= end and all(p.uid != uid for p in b.pods)
                for b in mine
            )
            if settled or now - end > GONE_RETENTION:
                del self.gone[uid]
