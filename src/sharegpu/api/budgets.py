"""The GPU-time budgets: GPU time namespaces may use per period, and what happens beyond it.

A GPUBudget lives in the namespace it governs; a ClusterGPUBudget (cluster-scoped) governs every
namespace its `namespaceSelector` selects, together: their pods draw on one pool. Usage is
GPU-seconds weighted by the share held: a pod holding 500 milli-GPU (or half a GPU's memory,
whichever is larger) on each of 2 GPUs for an hour uses 3,600 GPU-seconds. The controller computes it from pod
lifetimes in the API and writes the status; the webhook reads the status to demote or refuse new GPU
pods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from sharegpu.api import groups, wire
from sharegpu.core import budget

WITHIN: Final = budget.WITHIN
WARNING: Final = budget.WARNING
EXHAUSTED: Final = budget.EXHAUSTED

PERIOD_START: Final = r"^$|^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})$"
"""What the API server lets `periodStart` be (the CRD's pattern): an RFC 3339 timestamp, or empty. A
date alone, or a time with no zone, is refused there instead of leaving the budget unaccounted."""

Action = Literal["Demote", "Deny", "Allow"]
State = Literal["Within", "Warning", "Exhausted"]


class BudgetSpec(wire.Message, kw_only=True, frozen=True):
    """How much GPU time per period, and what happens when it is used up."""

    gpu_hours: Annotated[int, Meta(ge=1, description="GPU-hours per period (a whole GPU for an hour is one).")]
    period_days: Annotated[int, Meta(ge=1, le=366, description="The period's length in days.")] = 30
    period_start: Annotated[
        str,
        Meta(
            description="Where periods are counted from (RFC 3339, with a time and its zone); empty: creation.",
            extra_json_schema={"pattern": PERIOD_START},
        ),
    ] = ""
    when_exhausted: Annotated[
        Action,
        Meta(
            description="Demote: new GPU pods get the demotion PriorityClass; Deny: they are refused at "
            "admission; Allow: only events and metrics."
        ),
    ] = "Demote"
    warn_at_percent: Annotated[int, Meta(ge=1, le=100, description="An event when usage passes this share.")] = 80
    demote_priority_class: Annotated[str, Meta(description="The PriorityClass of demoted pods.")] = (
        "sharegpu-over-budget"
    )


class ClusterBudgetSpec(BudgetSpec, kw_only=True, frozen=True):
    """A budget shared by every namespace the selector selects (their use adds up)."""

    namespace_selector: Annotated[
        wire.LabelSelector,
        Meta(description="The namespaces whose GPU pods draw on this budget, by their labels; {}: every namespace."),
    ]


class Consumer(wire.Message, kw_only=True, frozen=True):
    pod: Annotated[str, Meta(description="namespace/name")]
    gpu_seconds: Annotated[int, Meta(ge=0)] = msgspec.field(default=0, name="gpuSeconds")


class PodUsage(wire.Message, kw_only=True, frozen=True):
    """What a pod still in the API had used this period when the controller last wrote."""

    uid: str
    pod: Annotated[str, Meta(description="namespace/name")]
    milli_gpu_seconds: Annotated[int, Meta(ge=0)] = msgspec.field(default=0, name="milliGPUSeconds")
    counted_from: Annotated[
        str, Meta(description="Counted only from this time (RFC 3339): it came back into the budget's cover then.")
    ] = ""


class Accounting(wire.Message, kw_only=True, frozen=True):
    """The controller's books, kept in the status so that usage survives restarts and leader changes:
    pods that are gone are settled (their use added once to `settled`, as they leave `pods`)."""

    settled_milli_gpu_seconds: Annotated[int, Meta(ge=0)] = msgspec.field(default=0, name="settledMilliGPUSeconds")
    pods: list[PodUsage] = msgspec.field(default_factory=list)
    accounted_at: Annotated[str, Meta(description="When the controller last wrote (RFC 3339).")] = ""
    uncovered: Annotated[
        list[PodUsage],
        Meta(description="Pods still in the API whose namespace left the budget's cover, their use settled."),
    ] = msgspec.field(default_factory=list)


class BudgetStatus(wire.Message, kw_only=True, frozen=True):
    state: State = "Within"
    used_gpu_seconds: Annotated[int, Meta(ge=0)] = msgspec.field(default=0, name="usedGPUSeconds")
    remaining_gpu_seconds: int = msgspec.field(default=0, name="remainingGPUSeconds")
    limit_gpu_seconds: int = msgspec.field(default=0, name="limitGPUSeconds")
    period_start: str = ""
    period_end: str = ""
    top_consumers: list[Consumer] = msgspec.field(default_factory=list)
    accounting: Accounting = msgspec.field(default_factory=Accounting)
    conditions: list[groups.Condition] = msgspec.field(default_factory=list)
    observed_generation: int = 0


class GPUBudget(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: BudgetSpec
    status: BudgetStatus = msgspec.field(default_factory=BudgetStatus)


class ClusterGPUBudget(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: ClusterBudgetSpec
    status: BudgetStatus = msgspec.field(default_factory=BudgetStatus)


AnyBudget = GPUBudget | ClusterGPUBudget


def covers(item: AnyBudget, namespace: str, labels: Mapping[str, str]) -> bool:
    """Whether the budget governs the namespace (`labels`: the namespace's labels)."""
    if isinstance(item, GPUBudget):
        return item.metadata.namespace == namespace
    return wire.selects(item.spec.namespace_selector, labels)


def title(item: AnyBudget) -> str:
    """How messages name the budget: `GPUBudget team-a/quarterly`, `ClusterGPUBudget research`."""
    if isinstance(item, GPUBudget):
        return f"GPUBudget {item.metadata.namespace}/{item.metadata.name}"
    return f"ClusterGPUBudget {item.metadata.name}"


LIMIT_TOP: Final = 10
"""How many consumers the status lists."""


@dataclass(frozen=True, slots=True)
class Held:
    """A pod's holding as the controller knows it: a still-present pod, or one it saw go."""

    uid: str
    holding: budget.Holding


@dataclass(frozen=True, slots=True)
class Crossing:
    """The budget entered a state worth an event (Warning or Exhausted) this period."""

    state: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Books:
    status: BudgetStatus
    crossings: tuple[Crossing, ...]


def limit_seconds(spec: BudgetSpec) -> int:
    return spec.gpu_hours * 3600


def anchor(item: AnyBudget) -> int:
    """Where the budget's periods are counted from: spec.periodStart, else its creation."""
    return wire.seconds(item.spec.period_start or item.metadata.creation_timestamp or "")


def governing(
    namespace: str,
    labels: Mapping[str, str],
    own: Sequence[GPUBudget],
    cluster: Sequence[ClusterGPUBudget],
) -> list[AnyBudget]:
    """The budgets that govern a namespace: its own (`own`), and the cluster budgets whose selector
    picks it by its labels."""
    return [*own, *(b for b in cluster if covers(b, namespace, labels))]


def held_back(budgets: Sequence[AnyBudget], priority: int | None, demoted_to: Mapping[str, int]) -> str | None:
    """Why a pod that was not judged at admission (a DRA claim written by hand) may not be given GPUs
    now, as the webhook would have judged it: a used-up Deny budget refuses it; a used-up Demote budget
    takes it only at or below its demotion PriorityClass's value (`demoted_to`: PriorityClass ->
    value), since a pod's priority cannot change once it exists. None when nothing holds it back."""
    for item in budgets:
        if item.status.state != EXHAUSTED:
            continue
        if item.spec.when_exhausted == "Deny":
            return f"{summary(item)}: the budget is used up and refuses new GPU pods until {item.status.period_end}"
        if item.spec.when_exhausted == "Demote":
            floor = demoted_to.get(item.spec.demote_priority_class)
            if floor is None or (priority or 0) > floor:
                return (
                    f"{summary(item)}: the budget is used up and gives GPUs only to pods at PriorityClass "
                    f"{item.spec.demote_priority_class} or below; this pod runs at priority {priority or 0} "
                    "(create it again: the webhook demotes it)"
                )
    return None


def holds_back_holder(budgets: Sequence[AnyBudget]) -> str | None:
    """Why a SharedDeviceGroup may not take its GPUs now: its holder pod is made by the controller at
    `system-cluster-critical` (no webhook sees it, and it is above any demotion class), so a used-up
    Deny or Demote budget of the group's namespace refuses it. None when nothing holds it back."""
    for item in budgets:
        if item.status.state == EXHAUSTED and item.spec.when_exhausted in ("Deny", "Demote"):
            return f"{summary(item)}: the budget is used up; the group takes no GPUs until {item.status.period_end}"
    return None


def summary(item: AnyBudget) -> str:
    """The budget's standing in one line, for events and admission refusals."""
    status, spec = item.status, item.spec
    used_hours = status.used_gpu_seconds / 3600
    return (
        f"{title(item)}: {used_hours:.2f} of {spec.gpu_hours} GPU-hours "
        f"used in the period {status.period_start} to {status.period_end}"
    )


def _use(held: Held, listed: Mapping[str, PodUsage], written_at: int | None, period: budget.Window, now: int) -> int:
    """A present holding's use in the period: as its record says (from `counted_from` where the last
    write set one), and never less than what the last write listed for it plus its holding since (a
    controller that restarted may know less of its past than the one that wrote: a claim's earlier
    users, gone before it listed them)."""
    before = listed.get(held.uid)
    holding = held.holding
    if before is not None and before.counted_from:
        holding = dataclasses.replace(holding, start=max(holding.start, wire.seconds(before.counted_from)))
    found = budget.held_in(holding, period, now)
    if before is None or written_at is None:
        return found
    start = max(holding.start, written_at)
    end = holding.end
    since = (
        0
        if end is not None and end <= start
        else budget.held_in(dataclasses.replace(holding, start=start), period, now)
    )
    return max(found, before.milli_gpu_seconds + since)


def account(item: AnyBudget, present: list[Held], gone: list[Held], now: int, alive: Collection[str] = ()) -> Books:
    """The budget's status at `now` from its previous status (its books) and the pods of the
    namespaces it covers.

    `alive`: the UIDs of every pod and claim in the API, whatever its namespace: a listed pod missing
    from `present` but alive left the budget's cover (its namespace's labels changed). Its use is
    settled as any pod's that went, and it is remembered (`uncovered`): should it be covered again it
    counts only from then (`counted_from`), not a second time from its start.

    `present`: pods in the API now; `gone`: pods the controller saw deleted. A pod's use is added to
    `settled` exactly once, when it leaves the status's pod list: with its use up to its end if the
    controller saw it go (counted as a present one's: from `counted_from`, and no less than the books
    listed plus its holding since), else (it went while no controller watched) with the use last written. A
    gone pod that was never written (bound and deleted between two writes) is settled if it started
    after the last write; one that started before it was settled by that write.
    """
    spec, previous = item.spec, item.status
    period = budget.window(anchor(item), spec.period_days, now)
    start_text = wire.timestamp(period.start)
    same = previous.period_start == start_text
    books = previous.accounting if same else Accounting()
    written_at = wire.seconds(books.accounted_at) if books.accounted_at else None
    listed = {p.uid: p for p in books.pods}
    settled = books.settled_milli_gpu_seconds
    live = {h.uid for h in present}
    went = {h.uid for h in gone}
    for held in gone:
        if held.uid in live:
            continue
        if held.uid in listed:  # by the rule of a present one: from `counted_from`, never below what was listed
            settled += _use(held, listed, written_at, period, now)
        elif written_at is None or held.holding.start > written_at:
            settled += budget.held_in(held.holding, period, now)
    uncovered = {p.uid: p for p in books.uncovered if p.uid in alive}
    for uid, usage in listed.items():
        if uid not in live and uid not in went:
            settled += usage.milli_gpu_seconds
            if uid in alive:
                uncovered[uid] = PodUsage(uid=uid, pod=usage.pod, milli_gpu_seconds=usage.milli_gpu_seconds)
    stamp = wire.timestamp(now)
    returned = {uid: PodUsage(uid=uid, pod=u.pod, counted_from=stamp) for uid, u in uncovered.items() if uid in live}
    counted = {**returned, **listed}
    usage_now = [
        PodUsage(uid=h.uid, pod=h.holding.pod, milli_gpu_seconds=_use(h, counted, written_at, period, now),
                 counted_from=counted[h.uid].counted_from if h.uid in counted else "")
        for h in present
    ]  # fmt: skip
    usage_now.sort(key=lambda u: (u.pod, u.uid))
    still_out = sorted((u for uid, u in uncovered.items() if uid not in live), key=lambda u: (u.pod, u.uid))
    used_milli = settled + sum(u.milli_gpu_seconds for u in usage_now)
    used = budget.gpu_seconds(used_milli)
    limit = limit_seconds(spec)
    state = budget.state(used, limit, spec.warn_at_percent)
    consumers = {c.pod: c.gpu_seconds for c in previous.top_consumers} if same else {}
    for u in usage_now:
        consumers[u.pod] = max(consumers.get(u.pod, 0), budget.gpu_seconds(u.milli_gpu_seconds))
    top = sorted(((s, p) for p, s in consumers.items() if s), key=lambda sp: (-sp[0], sp[1]))[:LIMIT_TOP]
    status = BudgetStatus(
        state=state,  # type: ignore[arg-type]  # core.budget.state returns one of State's values
        used_gpu_seconds=used,
        remaining_gpu_seconds=max(0, limit - used),
        limit_gpu_seconds=limit,
        period_start=start_text,
        period_end=wire.timestamp(period.end),
        top_consumers=[Consumer(pod=p, gpu_seconds=s) for s, p in top],
        accounting=Accounting(
            settled_milli_gpu_seconds=settled, pods=usage_now, accounted_at=stamp, uncovered=still_out
        ),
        conditions=_conditions(previous.conditions, state, stamp, item.metadata.generation),
        observed_generation=item.metadata.generation,
    )
    before = previous.state if same else WITHIN
    crossings = []
    order = {WITHIN: 0, WARNING: 1, EXHAUSTED: 2}
    if order[state] > order[before]:
        share = used * 100 // limit if limit else 100
        if state == WARNING:
            crossings.append(Crossing(state, "BudgetWarning", f"{share}% of the GPU-time budget used"))
        else:
            crossings.append(Crossing(state, "BudgetExhausted", f"GPU-time budget used up; {_consequence(spec)}"))
    return Books(status, tuple(crossings))


def _consequence(spec: BudgetSpec) -> str:
    if spec.when_exhausted == "Deny":
        return "new GPU pods are refused"
    if spec.when_exhausted == "Demote":
        return f"new GPU pods get PriorityClass {spec.demote_priority_class}"
    return "new GPU pods are still admitted"


def _conditions(previous: list[groups.Condition], state: str, now: str, generation: int) -> list[groups.Condition]:
    """Warning and Exhausted conditions; a condition keeps its transition time while its status stays."""
    old = {c.type: c for c in previous}
    out = []
    for kind, on in (("Warning", state in (WARNING, EXHAUSTED)), ("Exhausted", state == EXHAUSTED)):
        value: Literal["True", "False"] = "True" if on else "False"
        before = old.get(kind)
        since = before.last_transition_time if before is not None and before.status == value else now
        reason = {"Warning": "PastWarningShare", "Exhausted": "BudgetUsedUp"}[kind] if on else "WithinBudget"
        out.append(
            groups.Condition(type=kind, status=value, reason=reason, last_transition_time=since,
                             observed_generation=generation)
        )  # fmt: skip
    return out
