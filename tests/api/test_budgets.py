"""A budget's books (`api.budgets.account`) and pod lifetimes (`api.lifetimes`): pure, no API."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.api import budgets, lifetimes, names, wire
from sharegpu.core import budget, units
from tests.builders import MakeAllocation, MakePod

T0 = wire.seconds("2026-11-01T00:00:00Z")
HOUR = 3600


def make(gpu_hours: int = 10, status: budgets.BudgetStatus | None = None, **spec: Any) -> budgets.GPUBudget:
    return budgets.GPUBudget(
        metadata=wire.ObjectMeta(name="b", namespace="ns", uid="u-b", creation_timestamp=wire.timestamp(T0)),
        spec=budgets.BudgetSpec(gpu_hours=gpu_hours, **spec),
        status=status or budgets.BudgetStatus(),
    )


def held(uid: str, weight: int, start: int, end: int | None = None) -> budgets.Held:
    return budgets.Held(uid, budget.Holding(units.pod_key("ns", uid), weight, start, end))


def after(item: budgets.GPUBudget, books: budgets.Books) -> budgets.GPUBudget:
    return budgets.GPUBudget(metadata=item.metadata, spec=item.spec, status=books.status)


def test_use_is_weight_times_time_and_the_status_says_it_all() -> None:
    item = make(gpu_hours=10)
    books = budgets.account(item, [held("a", 1500, T0), held("b", 250, T0 + HOUR)], [], T0 + 2 * HOUR)
    status = books.status
    assert status.used_gpu_seconds == 1500 * 2 * HOUR // 1000 + 250 * HOUR // 1000
    assert status.limit_gpu_seconds == 10 * HOUR
    assert status.remaining_gpu_seconds == 10 * HOUR - status.used_gpu_seconds
    assert status.period_start == "2026-11-01T00:00:00Z"
    assert status.period_end == "2026-12-01T00:00:00Z"
    assert [c.pod for c in status.top_consumers] == ["ns/a", "ns/b"]
    assert status.state == "Within" and not books.crossings
    assert {p.uid: p.milli_gpu_seconds for p in status.accounting.pods} == {"a": 1500 * 2 * HOUR, "b": 250 * HOUR}


def test_a_pod_seen_gone_is_settled_once_and_stops_counting() -> None:
    item = make()
    first = budgets.account(item, [held("a", 1000, T0)], [], T0 + HOUR)
    item = after(item, first)
    # a went at T0 + 1.5 h; the controller saw it.
    second = budgets.account(item, [], [held("a", 1000, T0, T0 + HOUR + HOUR // 2)], T0 + 2 * HOUR)
    assert second.status.accounting.settled_milli_gpu_seconds == 1000 * (HOUR + HOUR // 2)
    assert second.status.accounting.pods == []
    item = after(item, second)
    # Still remembered as gone at the next pass: not settled again.
    third = budgets.account(item, [], [held("a", 1000, T0, T0 + HOUR + HOUR // 2)], T0 + 3 * HOUR)
    assert third.status.used_gpu_seconds == HOUR + HOUR // 2


def test_a_pod_that_went_while_no_controller_watched_keeps_its_last_written_use() -> None:
    item = after(make(), budgets.account(make(), [held("a", 1000, T0)], [], T0 + HOUR))
    # A fresh controller knows nothing of a: it only finds it in the books.
    books = budgets.account(item, [], [], T0 + 5 * HOUR)
    assert books.status.used_gpu_seconds == HOUR


def test_a_pod_bound_and_gone_between_two_writes_is_settled_and_an_older_one_is_not_again() -> None:
    item = after(make(), budgets.account(make(), [], [], T0 + HOUR))
    short = held("s", 1000, T0 + HOUR + 10, T0 + HOUR + 70)
    books = budgets.account(item, [], [short], T0 + 2 * HOUR)
    assert books.status.used_gpu_seconds == 60
    item = after(item, books)
    # The next write's books are later than s's start: s is not settled a second time.
    assert budgets.account(item, [], [short], T0 + 3 * HOUR).status.used_gpu_seconds == 60


def test_states_cross_once_per_period_and_a_new_period_starts_afresh() -> None:
    item = make(gpu_hours=1, warn_at_percent=50, when_exhausted="Deny")
    warned = budgets.account(item, [held("a", 1000, T0)], [], T0 + HOUR // 2)
    assert warned.status.state == "Warning"
    assert [c.reason for c in warned.crossings] == ["BudgetWarning"]
    item = after(item, warned)
    assert budgets.account(item, [held("a", 1000, T0)], [], T0 + HOUR // 2 + 60).crossings == ()
    spent = budgets.account(item, [held("a", 1000, T0)], [], T0 + HOUR)
    assert spent.status.state == "Exhausted"
    assert [c.reason for c in spent.crossings] == ["BudgetExhausted"]
    assert "refused" in spent.crossings[0].message
    conditions = {c.type: c.status for c in spent.status.conditions}
    assert conditions == {"Warning": "True", "Exhausted": "True"}
    item = after(item, spent)
    assert "1.00 of 1 GPU-hours" in budgets.summary(item)
    # 30 days later: a new period; only what a still holds within it counts.
    later = T0 + 30 * 86_400 + 60
    fresh = budgets.account(item, [held("a", 1000, T0)], [], later)
    assert fresh.status.period_start == "2026-12-01T00:00:00Z"
    assert fresh.status.used_gpu_seconds == 60
    assert fresh.status.accounting.settled_milli_gpu_seconds == 0
    assert fresh.status.state == "Within"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5 * HOUR), st.integers(1, 5 * HOUR), st.integers(1, 2000)), max_size=6),
    st.lists(st.integers(1, 10 * HOUR), min_size=1, max_size=6),
)
def test_written_often_or_once_the_books_agree_with_the_lifetimes(
    pods: list[tuple[int, int, int]], checkpoints: list[int]
) -> None:
    """Whatever the pass times, a watching controller's books equal the sum of every pod's held time."""
    stops = sorted(set(checkpoints))
    end_of_all = stops[-1]
    item = make(gpu_hours=1000)
    for now in stops:
        present: list[budgets.Held] = []
        gone: list[budgets.Held] = []
        for i, (start, length, weight) in enumerate(pods):
            if start > now:
                continue
            end = start + length
            target = gone if end <= now else present
            target.append(held(f"p{i}", weight, T0 + start, T0 + end if end <= now else None))
        item = after(item, budgets.account(item, present, gone, T0 + now))
    expected = sum(w * (min(s + n, end_of_all) - s) for s, n, w in pods if s <= end_of_all)
    books = item.status.accounting
    assert books.settled_milli_gpu_seconds + sum(p.milli_gpu_seconds for p in books.pods) == expected


# ----------------------------------------------------------------- lifetimes


def pod(**status: Any) -> lifetimes.TimedPod:
    grant = MakeAllocation(units.pod_key("ns", "p"), "n1").grant(0, 500).obj()
    made = MakePod("p", "ns").uid("u1").created("2026-11-01T00:00:00Z").allocation(grant).node("n1").container()
    return wire.convert(made.status(**status).obj(), lifetimes.TimedPod)


def test_a_pod_holds_from_its_binding_until_its_last_container_finished() -> None:
    bound = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-01T00:00:10Z"}
    life = lifetimes.lifetime(pod(phase="Running", conditions=[bound]))
    assert life is not None and life.start == T0 + 10 and life.end is None and life.allocation is not None
    done = lifetimes.lifetime(
        pod(
            phase="Succeeded",
            conditions=[bound],
            containerStatuses=[
                {"state": {"terminated": {"finishedAt": "2026-11-01T01:00:00Z"}}},
                {"state": {"terminated": {"finishedAt": "2026-11-01T00:30:00Z"}}},
            ],
        )
    )
    assert done is not None and done.terminal and done.end == T0 + HOUR
    # No PodScheduled condition: the kubelet's startTime, then the creation time.
    assert lifetimes.lifetime(pod(startTime="2026-11-01T00:00:20Z")).start == T0 + 20  # type: ignore[union-attr]
    assert lifetimes.lifetime(pod()).start == T0  # type: ignore[union-attr]


def test_a_pod_that_failed_with_no_containers_end_ends_at_its_conditions_last_change() -> None:
    """Refused at admission by the kubelet (no container ever ran: no finishedAt): it held its GPUs
    until its conditions last changed, not until whoever reads it first saw it failed (a review found
    48 GPU-hours charged after a restart two days later)."""
    bound = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-01T00:00:10Z"}
    ended = {"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-01T00:00:12Z"}
    failed = lifetimes.lifetime(pod(phase="Failed", conditions=[bound, ended]))
    assert failed is not None and failed.terminal and failed.end == T0 + 12
    bare = lifetimes.lifetime(pod(phase="Failed", conditions=[bound]))
    assert bare is not None and bare.end == T0 + 10, "nothing says more: it held nothing past its binding"


def test_a_claim_made_again_under_its_name_is_not_charged_for_the_old_claims_users() -> None:
    """Pods name claims, not their UIDs: a user that ended before the claim was made used an older
    claim of that name."""
    held = MakeAllocation("ns/shared#claim", "n0").grant(0, 1000, 0).obj()
    old = lifetimes.ClaimUse(uid="job1", namespace="ns", claims=("shared",), start=T0, end=T0 + HOUR)
    new = lifetimes.ClaimUse(uid="job2", namespace="ns", claims=("shared",), start=T0 + 25 * HOUR, end=None)
    life = lifetimes.claim_lifetime("c-2", "ns", "shared", held, [old, new], created=T0 + 24 * HOUR)
    assert life is not None and life.start == T0 + 25 * HOUR and life.end is None
    assert lifetimes.claim_lifetime("c-2", "ns", "shared", held, [old], created=T0 + 24 * HOUR) is None
    assert lifetimes.claim_lifetime("c-1", "ns", "shared", held, [old, new]).start == T0  # type: ignore[union-attr]


def test_pods_that_hold_no_gpu_have_no_lifetime() -> None:
    unbound = wire.convert({"metadata": {"name": "x", "namespace": "ns"}}, lifetimes.TimedPod)
    assert lifetimes.lifetime(unbound) is None
    cpu_only = wire.convert(
        {"metadata": {"name": "x", "namespace": "ns"}, "spec": {"nodeName": "n", "containers": [{"name": "c"}]}},
        lifetimes.TimedPod,
    )
    assert lifetimes.lifetime(cpu_only) is None
    reservation = wire.convert(
        {"metadata": {"name": "r", "namespace": "s", "labels": {names.LABEL_ROLE: names.ROLE_RESERVATION}},
         "spec": {"nodeName": "n", "containers": [{"name": "c", "resources": {"limits": {names.NVIDIA_GPU: "1"}}}]}},
        lifetimes.TimedPod,
    )  # fmt: skip
    assert lifetimes.lifetime(reservation) is None
    whole = wire.convert(
        {"metadata": {"name": "w", "namespace": "s", "creationTimestamp": "2026-11-01T00:00:00Z"},
         "spec": {"nodeName": "n", "containers": [{"name": "c", "resources": {"limits": {names.NVIDIA_GPU: "2"}}}]}},
        lifetimes.TimedPod,
    )  # fmt: skip
    life = lifetimes.lifetime(whole)
    assert life is not None and life.whole_gpus == 2 and life.allocation is None


def test_a_groups_holder_is_charged_to_the_groups_namespace() -> None:
    holder = wire.convert(
        {"metadata": {"name": "h", "namespace": names.HOLDING_NAMESPACE, "creationTimestamp": "2026-11-01T00:00:00Z",
                      "labels": {names.LABEL_ROLE: names.ROLE_GROUP_HOLDER, names.LABEL_GROUP_NAMESPACE: "team",
                                 names.LABEL_GROUP_NAME: "g"}},
         "spec": {"nodeName": "n", "containers": [{"name": "c", "resources": {"limits": {names.NVIDIA_GPU: "2"}}}]}},
        lifetimes.TimedPod,
    )  # fmt: skip
    life = lifetimes.lifetime(holder)
    assert life is not None and life.namespace == "team" and life.whole_gpus == 2


# ----------------------------------------------------------------- cluster budgets: which namespaces


def selector(labels: dict[str, str] | None = None, *expressions: tuple[str, str, list[str]]) -> wire.LabelSelector:
    return wire.LabelSelector(
        match_labels=labels or {},
        match_expressions=[wire.SelectorRequirement(key=k, operator=op, values=v) for k, op, v in expressions],  # type: ignore[arg-type]
    )


def test_a_label_selector_reads_as_kubernetes_reads_it() -> None:
    team = {"team": "vision", "tier": "prod"}
    assert wire.selects(selector(), {})  # empty: everything
    assert wire.selects(selector({"team": "vision"}), team)
    assert not wire.selects(selector({"team": "speech"}), team)
    assert wire.selects(selector(None, ("tier", "In", ["prod", "dev"])), team)
    assert not wire.selects(selector(None, ("tier", "In", ["dev"])), team)
    assert not wire.selects(selector(None, ("tier", "In", ["prod"])), {})
    assert wire.selects(selector(None, ("tier", "NotIn", ["dev"])), team)
    assert wire.selects(selector(None, ("tier", "NotIn", ["dev"])), {})  # absent: not in
    assert not wire.selects(selector(None, ("tier", "NotIn", ["prod"])), team)
    assert wire.selects(selector(None, ("team", "Exists", [])), team)
    assert not wire.selects(selector(None, ("team", "DoesNotExist", [])), team)
    assert not wire.selects(selector({"team": "vision"}, ("tier", "DoesNotExist", [])), team)  # all must hold


def test_a_malformed_selector_is_named_and_selects_nothing() -> None:
    empty_in = selector(None, ("tier", "In", []))
    assert wire.selector_problem(empty_in) == "matchExpressions[0] (tier In) needs values"
    assert not wire.selects(empty_in, {"tier": "x"})
    exists_with = selector(None, ("tier", "NotIn", ["a"]), ("team", "Exists", ["x"]))
    assert wire.selector_problem(exists_with) == "matchExpressions[1] (team Exists) takes no values"
    assert not wire.selects(exists_with, {"team": "x"})
    assert wire.selector_problem(selector({"a": "b"}, ("c", "Exists", []))) is None


def test_a_cluster_budget_covers_the_namespaces_it_selects_and_names_itself() -> None:
    cluster = budgets.ClusterGPUBudget(
        metadata=wire.ObjectMeta(name="research"),
        spec=budgets.ClusterBudgetSpec(
            gpu_hours=5, period_start=wire.timestamp(T0), namespace_selector=selector({"org": "research"})
        ),
        status=budgets.BudgetStatus(used_gpu_seconds=9000, period_start="s", period_end="e"),
    )
    assert budgets.covers(cluster, "a", {"org": "research"})
    assert not budgets.covers(cluster, "b", {"org": "sales"})
    own = make()
    assert budgets.covers(own, "ns", {}) and not budgets.covers(own, "other", {"org": "research"})
    assert budgets.summary(cluster) == "ClusterGPUBudget research: 2.50 of 5 GPU-hours used in the period s to e"
    assert budgets.summary(own).startswith("GPUBudget ns/b: ")
    # Its books are kept as a namespaced budget's are: one pool over the pods given.
    books = budgets.account(cluster, [held("a", 1000, T0), held("b", 500, T0)], [], T0 + HOUR)
    assert books.status.used_gpu_seconds == 1500 * HOUR // 1000
