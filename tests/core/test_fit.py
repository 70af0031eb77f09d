"""Filter: per-GPU eligibility, co-tenancy rules and the reasons people read."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.core import devices, fit, requests, status, units
from sharegpu.core import ledger as core_ledger
from tests.builders import MakeAllocation
from tests.conftest import ledger, node, pod

ALL = np.array([0, 1], dtype=np.int64)


def _place(
    b: core_ledger.Ledger,
    key: str,
    row_name: str,
    gpu: int,
    milli: int,
    rules: requests.CoTenancy = requests.NO_RULES,
    memory: int = 0,
) -> None:
    assert b.assume(MakeAllocation(key, row_name).grant(gpu, milli, memory, container="m").cotenancy(rules).obj()).ok


def test_fractional_fit_needs_compute_memory_and_model() -> None:
    b = ledger(node("t4", 2, "T4", memory=16000), node("a100", 2, "A100", memory=80000))
    _place(b, "ns/x", "t4", 0, 700, memory=10000)
    demand = pod("ns/p", count=1, milli=400, memory_mib=8000).demand
    result = fit.evaluate(b.state, demand, ALL)
    assert result.feasible.tolist() == [True, True]
    assert result.eligible[0, :2].tolist() == [False, True]
    wants_a100 = pod("ns/q", count=1, milli=400, models=frozenset({"A100"})).demand
    assert fit.evaluate(b.state, wants_a100, ALL).feasible.tolist() == [False, True]


def test_whole_gpus_need_entirely_free_gpus() -> None:
    b = ledger(node("n", 4))
    _place(b, "ns/x", "n", 1, 1)
    demand = pod("ns/w", count=3).demand
    assert fit.evaluate(b.state, demand, np.array([0])).eligible[0, :4].tolist() == [True, False, True, True]
    assert fit.evaluate(b.state, pod("ns/w4", count=4).demand, np.array([0])).feasible.tolist() == [False]


def test_host_cpu_and_memory_count() -> None:
    b = ledger(node("n", 2, cpu=4000, host_memory=1000))
    assert not fit.evaluate(b.state, pod("ns/c", count=1, milli=100, cpu_milli=5000).demand, np.array([0])).feasible[0]
    assert not fit.evaluate(b.state, pod("ns/m", host_memory_mib=2000).demand, np.array([0])).feasible[0]


@pytest.mark.parametrize(
    ("tenant", "newcomer", "allowed"),
    [
        (requests.CoTenancy(affinity="a"), requests.CoTenancy(affinity="a"), True),
        (requests.CoTenancy(affinity="a"), requests.CoTenancy(affinity="b"), False),
        (requests.CoTenancy(affinity="a"), requests.NO_RULES, False),
        (requests.NO_RULES, requests.CoTenancy(affinity="a"), False),
        (requests.CoTenancy(anti_affinity="z"), requests.CoTenancy(anti_affinity="z"), False),
        (requests.CoTenancy(anti_affinity="z"), requests.CoTenancy(anti_affinity="w"), True),
        (requests.CoTenancy(anti_affinity="z"), requests.NO_RULES, True),
        (requests.CoTenancy(exclusion="e"), requests.CoTenancy(exclusion="e"), True),
        (requests.CoTenancy(exclusion="e"), requests.CoTenancy(exclusion="f"), False),
        (requests.CoTenancy(exclusion="e"), requests.NO_RULES, True),
        (requests.CoTenancy(group="g"), requests.CoTenancy(group="g"), True),
        (requests.CoTenancy(group="g"), requests.NO_RULES, False),
        (requests.NO_RULES, requests.CoTenancy(group="g"), False),
    ],
)
def test_cotenancy_rules_on_a_shared_gpu(
    tenant: requests.CoTenancy, newcomer: requests.CoTenancy, allowed: bool
) -> None:
    b = ledger(node("n", 1))
    _place(b, "ns/tenant", "n", 0, 200, tenant)
    demand = pod("ns/new", count=1, milli=200, cotenancy=newcomer).demand
    assert bool(fit.evaluate(b.state, demand, np.array([0])).feasible[0]) is allowed
    verdict = fit.explain_node(b.state, demand, 0)
    assert verdict.ok is allowed
    if not allowed:
        assert any(r.resource is status.Resource.COTENANCY for r in verdict.reasons)


def test_a_group_stays_on_the_gpu_it_was_bound_to() -> None:
    b = ledger(node("n", 2), node("m", 2))
    group = requests.CoTenancy(group="g")
    demand = pod("ns/a", count=1, milli=100, cotenancy=group).demand
    assert fit.evaluate(b.state, demand, ALL).eligible[:, :2].all()
    _place(b, "ns/a", "m", 1, 100, group)
    eligible = fit.evaluate(b.state, demand, ALL).eligible[:, :2]
    assert eligible.tolist() == [[False, False], [False, True]]


def test_explain_lists_every_shortfall_gpu_by_gpu() -> None:
    b = ledger(node("n", 2, "T4", memory=16000, cpu=4000))
    _place(b, "ns/x", "n", 0, 900)
    _place(b, "ns/y", "n", 1, 600, memory=12000)
    demand = pod("ns/p", count=1, milli=500, memory_mib=8000, cpu_milli=6000).demand
    verdict = fit.explain_node(b.state, demand, 0)
    assert verdict.code is status.Code.UNSCHEDULABLE
    found = {(r.resource, r.gpu, r.requested, r.free, r.capacity) for r in verdict.reasons}
    assert (status.Resource.HOST_CPU, None, 6000, 4000, 4000) in found
    assert (status.Resource.GPU_MILLI, 0, 500, 100, 1000) in found
    assert (status.Resource.GPU_MILLI, 1, 500, 400, 1000) in found
    assert (status.Resource.GPU_MEMORY, 1, 8000, 4000, 16000) in found
    assert "n/gpu0: gpu-milli requested 500, free 100 of 1000" in str(verdict)


def test_explain_marks_impossible_nodes_unresolvable() -> None:
    b = ledger(node("n", 2, "T4"))
    assert fit.explain_node(b.state, pod("ns/p", count=4).demand, 0).code is status.Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    wrong_model = pod("ns/q", count=1, milli=100, models=frozenset({"A100"})).demand
    verdict = fit.explain_node(b.state, wrong_model, 0)
    assert verdict.code is status.Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    assert {r.resource for r in verdict.reasons} >= {status.Resource.GPU_MODEL}


def test_diagnose_names_the_first_shortfall_of_every_node() -> None:
    b = ledger(
        node("small", 1, "T4"),
        node("busy", 2, "T4"),
        node("a100", 2, "A100"),
        node("sick", 2, "T4"),
        node("rules", 2, "T4", memory=16000),
        node("free", 2, "T4"),
    )
    _place(b, "ns/x", "busy", 0, 900)
    _place(b, "ns/y", "busy", 1, 700)
    _place(b, "ns/z", "rules", 0, 100, requests.CoTenancy(anti_affinity="solo"))
    _place(b, "ns/w", "rules", 1, 100, requests.CoTenancy(anti_affinity="solo"))
    b.state.healthy[b.state.row("sick"), :] = False
    demand = pod(
        "ns/p", count=2, milli=500, models=frozenset({"T4"}), cotenancy=requests.CoTenancy(anti_affinity="solo")
    ).demand
    rows = np.arange(len(b.state))
    found = fit.diagnose(b.state, demand, rows)
    kinds = {b.state.names[int(r)]: fit.Shortfall(int(k)) for r, k in zip(rows, found.shortfall, strict=True)}
    assert kinds == {
        "small": fit.Shortfall.TOO_FEW_GPUS,
        "busy": fit.Shortfall.GPU_COMPUTE,
        "a100": fit.Shortfall.MODEL,
        "sick": fit.Shortfall.UNHEALTHY,
        "rules": fit.Shortfall.COTENANCY,
        "free": fit.Shortfall.NONE,
    }
    busy = b.state.row("busy")
    assert found.largest_milli[busy] == 300
    assert not fit.Shortfall.MODEL.resolvable and fit.Shortfall.GPU_COMPUTE.resolvable
    # the classification agrees with evaluate: NONE exactly where the demand fits
    feasible = fit.evaluate(b.state, demand, rows).feasible
    assert ((found.shortfall == fit.Shortfall.NONE) == feasible).all()


def test_a_demanded_isolation_mode_is_found_only_on_nodes_that_offer_it() -> None:
    mps = dataclasses.replace(node("mps", 2), isolation=frozenset({devices.Isolation.MPS}))
    b = ledger(node("plain", 2), mps)
    demand = requests.GpuDemand(count=1, milli=300, isolation=devices.Isolation.MPS)
    assert fit.evaluate(b.state, demand, ALL).feasible.tolist() == [False, True]
    assert fit.evaluate(b.state, dataclasses.replace(demand, isolation=None), ALL).feasible.tolist() == [True, True]
    diagnosis = fit.diagnose(b.state, demand, np.array([0]))
    assert diagnosis.shortfall.tolist() == [fit.Shortfall.ISOLATION]
    assert not fit.Shortfall.ISOLATION.resolvable, "preempting pods never brings an isolation mode"
    verdict = fit.explain_node(b.state, demand, 0)
    assert verdict.code is status.Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    assert [r.resource for r in verdict.reasons] == [status.Resource.ISOLATION]
    assert "isolation mps not offered (offers: none)" in verdict.reasons[0].detail
    assert fit.explain_node(b.state, demand, 1).ok


def test_a_compute_guarantee_needs_the_mode_to_enforce_compute_on_the_node() -> None:
    hami, mps = devices.Isolation.HAMI_CORE, devices.Isolation.MPS
    memory_only = dataclasses.replace(node("memory-only", 2), isolation=frozenset({hami, mps}),
                                      compute_isolation=frozenset({mps}))  # fmt: skip
    measured = dataclasses.replace(
        node("measured", 2), isolation=frozenset({hami}), compute_isolation=frozenset({hami})
    )
    unoffered = dataclasses.replace(node("unoffered", 2), compute_isolation=frozenset({hami}))  # says, but offers not
    b = ledger(memory_only, measured, unoffered)
    demand = requests.GpuDemand(count=1, milli=300, isolation=hami, compute=True)
    three = np.arange(3)
    assert fit.evaluate(b.state, demand, three).feasible.tolist() == [False, True, False]
    assert fit.evaluate(b.state, dataclasses.replace(demand, compute=False), three).feasible.tolist() == [
        True,
        True,
        False,
    ]
    assert fit.evaluate(b.state, dataclasses.replace(demand, isolation=mps), three).feasible.tolist() == [
        True,
        False,
        False,
    ]
    assert fit.diagnose(b.state, demand, np.array([0])).shortfall.tolist() == [fit.Shortfall.ISOLATION]
    verdict = fit.explain_node(b.state, demand, 0)
    assert verdict.code is status.Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    assert verdict.reasons[0].detail == "isolation hami-core does not enforce compute there (enforcing it: mps)"
    assert fit.explain_node(b.state, demand, 2).reasons[0].detail == "isolation hami-core not offered (offers: none)"
    assert not dataclasses.replace(demand, compute=False).needs_at_least(demand)


LABEL = st.sampled_from([None, "x", "y"])
MODELS = st.sampled_from([frozenset(), frozenset({"T4"}), frozenset({"A100"}), frozenset({"T4", "A100"})])


@st.composite
def demands(draw: st.DrawFn) -> requests.GpuDemand:
    count = draw(st.integers(0, 3))
    whole = draw(st.booleans())
    return requests.GpuDemand(
        count=count,
        milli=units.MILLI_PER_GPU if whole else draw(st.integers(1, 999)),
        memory_mib=0 if whole else draw(st.integers(0, 20000)),
        memory_permille=0 if whole else draw(st.sampled_from([0, 100, 500])),
        models=draw(MODELS),
        cpu_milli=draw(st.integers(0, 40000)),
        host_memory_mib=draw(st.integers(0, 140000)),
        cotenancy=requests.CoTenancy(affinity=draw(LABEL), anti_affinity=draw(LABEL), exclusion=draw(LABEL)),
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(1, 1000), LABEL, LABEL), max_size=10),
       demands(), st.integers(0, 999), st.integers(0, 3), st.integers(0, 8000), st.integers(0, 400),
       st.integers(0, 20000), st.integers(0, 50000))  # fmt: skip
def test_a_demand_that_needs_at_least_another_fits_nowhere_the_other_does_not(
    tenants: list[tuple[int, int, int, str | None, str | None]],
    smaller: requests.GpuDemand,
    milli: int,
    count: int,
    memory: int,
    permille: int,
    cpu: int,
    host: int,
) -> None:
    b = ledger(node("t4", 4, "T4", memory=16000), node("a100", 2, "A100", memory=80000), node("one", 1, "T4"))
    names = ["t4", "a100", "one"]
    for i, (row, gpu, used, affinity, exclusion) in enumerate(tenants):
        if gpu < int(b.state.gpu_count[row]) and used <= int(b.state.milli_free[row, gpu]):
            rules = requests.CoTenancy(affinity=affinity, exclusion=exclusion)
            b.assume(MakeAllocation(f"ns/t{i}", names[row]).grant(gpu, used, container="m").cotenancy(rules).obj())
    larger = dataclasses.replace(
        smaller,
        count=smaller.count + count,
        milli=smaller.milli if smaller.whole else min(999, smaller.milli + milli),
        memory_mib=smaller.memory_mib + (0 if smaller.whole else memory),
        memory_permille=smaller.memory_permille + (0 if smaller.whole else permille),
        cpu_milli=smaller.cpu_milli + cpu,
        host_memory_mib=smaller.host_memory_mib + host,
    )
    assert larger.needs_at_least(smaller)
    rows = np.arange(3, dtype=np.int64)
    fits_larger = fit.evaluate(b.state, larger, rows).feasible
    fits_smaller = fit.evaluate(b.state, smaller, rows).feasible
    assert not (fits_larger & ~fits_smaller).any()
    other_kind = dataclasses.replace(larger, milli=500 if larger.whole else units.MILLI_PER_GPU)
    assert not other_kind.needs_at_least(smaller), "a whole-GPU demand and a shared one are not compared"
    assert not dataclasses.replace(larger, models=frozenset({"H100"})).needs_at_least(smaller)


def test_the_model_mask_is_membership_and_padding_is_no_model() -> None:
    b = ledger(node("t4", 4, "T4"), node("a100", 2, "A100"), node("none", 0))
    state = b.state
    for models in (set(), {"T4"}, {"A100"}, {"T4", "A100"}, {"H100"}, {"T4", "H100"}):
        expected = np.isin(state.model_id, state.model_ids_for(models)) & state.present
        np.testing.assert_array_equal(state.model_mask(models, slice(None)), expected)
        rows = np.array([2, 0], dtype=np.int64)
        np.testing.assert_array_equal(state.model_mask(models, rows), expected[rows])


def test_a_demand_naming_a_selection_takes_only_its_gpus_and_says_so_where_it_cannot() -> None:
    b = ledger(node("t4", 2, "T4"), node("a100", 2, "A100"))
    b.state.select("picked", [("t4", 1), ("a100", 0), ("a100", 7), ("nowhere", 0)])  # no such GPU: left out
    assert b.state.selection_mask("picked", ALL)[:, :2].tolist() == [[False, True], [True, False]]
    assert not b.state.selection_mask("unknown", ALL).any(), "an unknown selection picks nothing"
    one = pod("ns/p", count=1, milli=300, selection="picked").demand
    assert fit.evaluate(b.state, one, ALL).eligible[:, :2].tolist() == [[False, True], [True, False]]
    both = pod("ns/q", count=2, milli=300, selection="picked").demand
    assert fit.evaluate(b.state, both, ALL).feasible.tolist() == [False, False]
    verdict = fit.explain_node(b.state, both, 0)
    assert verdict.code is status.Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    assert (status.Resource.SELECTOR, 0) in {(r.resource, r.gpu) for r in verdict.reasons}
    diagnosis = fit.diagnose(b.state, both, ALL)
    assert [fit.Shortfall(int(s)) for s in diagnosis.shortfall] == [fit.Shortfall.UNSELECTED] * 2
    assert not one.needs_at_least(dataclasses.replace(one, selection="")), "another selection is another demand"


def test_a_memory_ratio_is_explained_against_each_gpus_own_memory() -> None:
    """A node of a 40960 MiB and a 1000 MiB GPU: half the memory is 20480 MiB of the first and 500 of
    the second. The second was said to lack 20480 MiB (the largest GPU's need, applied to every GPU)
    when only a co-tenancy rule kept the pod off it."""
    made = node("n", 2, memory=40960)
    small = dataclasses.replace(made.gpus[1], memory_mib=units.MiB(1000))
    b = ledger(dataclasses.replace(made, gpus=(made.gpus[0], small)))
    _place(b, "ns/big", "n", 0, 100, memory=40000)
    _place(b, "ns/tagged", "n", 1, 100, rules=requests.CoTenancy(affinity="ns/team"))
    demand = pod("ns/p", count=1, milli=100, memory_permille=500).demand
    found = {(r.resource, r.gpu): r.requested for r in fit.explain_node(b.state, demand, 0).reasons}
    assert found[(status.Resource.GPU_MEMORY, 0)] == 20480
    assert (status.Resource.GPU_MEMORY, 1) not in found and (status.Resource.COTENANCY, 1) in found
