"""Policies and the placer: scores, device choice, tie-breaking, and that caching changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.core import devices, errors, fleet, frag, policies, requests, scoring, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from tests.builders import MakeAllocation
from tests.conftest import ledger, node, pod

SHAPES = (
    frag.WeightedShape(frag.Shape(0, 500, 1), 0.5),
    frag.WeightedShape(frag.Shape(0, 1000, 2), 0.3),
    frag.WeightedShape(frag.Shape(4000, 0, 0), 0.2),
)


def _set_free(state: fleet.FleetState, row: int, free: list[int]) -> None:
    state.milli_free[row, : len(free)] = free
    state.version[row] += 1


def test_frag_counts_too_small_gpus_and_unfit_shapes() -> None:
    state = fleet.FleetState([node("n", 4)])
    _set_free(state, 0, [1000, 300, 1000, 0])
    model = frag.FragModel(state, SHAPES)
    rows = np.array([0])
    # 500-milli shape fits: the 300 left on gpu1 is fragment; 2x1000 shape fits: 300 again (0 GPU adds 0);
    # CPU-only shape: all 2300 free counts.
    expected = 0.5 * 300 + 0.3 * 300 + 0.2 * 2300
    assert model.frag(rows, state.cpu_free[rows], state.milli_free[rows])[0] == pytest.approx(expected)
    _set_free(state, 0, [1000, 300, 400, 0])  # the 2-GPU shape no longer fits: all 1700 free counts for it
    expected = 0.5 * 700 + 0.3 * 1700 + 0.2 * 1700
    assert model.frag(rows, state.cpu_free[rows], state.milli_free[rows])[0] == pytest.approx(expected)


@settings(max_examples=60, deadline=None)
@given(
    free=st.lists(st.lists(st.integers(0, 1000), min_size=4, max_size=4), min_size=1, max_size=5),
    milli=st.integers(1, 1000),
    cpu=st.integers(0, 40000),
    takes=st.integers(1, 3),
    rho=st.sampled_from([0.0, 4.0, 11.0]),
)
def test_frag_after_matches_recomputing_the_node(
    free: list[list[int]], milli: int, cpu: int, takes: int, rho: float
) -> None:
    state = fleet.FleetState([node(f"n{i}", 4) for i in range(len(free))])
    for row, values in enumerate(free):
        _set_free(state, row, values)
    model = frag.FragModel(state, SHAPES, cpu_per_milli=rho)
    rows = np.arange(len(free), dtype=np.int64)
    model.current(rows)
    cpu_after = state.cpu_free[rows] - cpu
    # One take per hypothesis: the pod on each GPU with room.
    node_of, gpu_of = np.nonzero(state.milli_free[rows] >= milli)
    fast = model.frag_after(rows, cpu_after, milli, node_of, node_of, gpu_of)
    for h, (row, gpu) in enumerate(zip(node_of.tolist(), gpu_of.tolist(), strict=True)):
        changed = state.milli_free[[row]].copy()
        changed[0, gpu] -= milli
        assert fast[h] == pytest.approx(model.frag(np.array([row]), cpu_after[[row]], changed)[0])
    # Several takes per hypothesis: the first `takes` GPUs with room on each node.
    room = state.milli_free[rows] >= milli
    chosen = room & (np.cumsum(room, axis=1) <= takes)
    take_node, take_gpu = np.nonzero(chosen)
    fast_multi = model.frag_after(rows, cpu_after, milli, rows, take_node, take_gpu, take_node)
    expected = model.frag(rows, cpu_after, state.milli_free[rows] - chosen * milli)
    np.testing.assert_allclose(fast_multi, expected)


def test_typical_shapes_cover_95_percent_by_popularity() -> None:
    shapes = [frag.Shape(0, 500, 1)] * 60 + [frag.Shape(0, 1000, 1)] * 36 + [frag.Shape(0, 100, 1)] * 4
    typical = frag.typical_shapes(shapes)
    assert [t.shape.milli for t in typical] == [500, 1000]
    assert sum(t.weight for t in typical) == pytest.approx(1.0)
    assert typical[0].weight == pytest.approx(60 / 96)


def _decide(name: str, b: core_ledger.Ledger, p: requests.PodRequest) -> core_placer.Decision:
    return core_placer.Placer(b.state, policies.make(name, SHAPES)).decide(p.demand)


def test_bestfit_picks_the_tightest_node_and_gpu() -> None:
    b = ledger(node("roomy", 2), node("tight", 2))
    _occupy(b, "tight", 0, 600)
    decision = _decide("bestfit", b, pod("ns/p", count=1, milli=300))
    assert (decision.node, decision.gpus) == ("tight", (0,))


def test_spread_and_binpack_disagree() -> None:
    b = ledger(node("busy", 2), node("idle", 2))
    _occupy(b, "busy", 0, 500)
    small = pod("ns/p", count=1, milli=200)
    assert _decide("binpack", b, small).node == "busy"
    assert _decide("binpack", b, small).gpus == (0,)
    assert _decide("spread", b, small).node == "idle"
    assert _decide("binpack-spread", b, small).gpus == (1,)


def test_fgd_keeps_whole_gpus_whole() -> None:
    # A 500-milli pod should go next to the existing 500: breaking a free GPU would leave no room
    # for the popular 2-whole-GPU shape.
    b = ledger(node("n", 3))
    _occupy(b, "n", 2, 500)
    decision = _decide("fgd", b, pod("ns/p", count=1, milli=500))
    assert decision.gpus == (2,)


def test_packing_prefers_shared_gpus_then_used_nodes() -> None:
    b = ledger(node("empty", 2), node("used", 2), node("shared", 2))
    _occupy(b, "used", 0, 1000)
    _occupy(b, "shared", 0, 600)
    assert _decide("packing", b, pod("ns/p", count=1, milli=300)).node == "shared"
    assert _decide("packing", b, pod("ns/q", count=1, milli=500)).node == "used"


def test_ties_go_to_the_fixed_node_priority() -> None:
    b = ledger(node("a", 2), node("b", 2), node("c", 2))
    placer = core_placer.Placer(b.state, policies.make("bestfit"), priority=np.array([2, 0, 1]))
    assert placer.decide(pod("ns/p", count=1, milli=300).demand).node == "b"


def test_unschedulable_decision_is_a_value() -> None:
    b = ledger(node("a", 1))
    decision = _decide("fgd", b, pod("ns/p", count=2))
    assert not decision.status.ok
    assert decision.node is None
    assert "no node fits" in decision.status.message


def test_topology_prefers_nvlinked_gpus() -> None:
    nvlinked = devices.NodeInventory(
        name=units.NodeName("nv"),
        cpu_milli=units.MilliCpu(64000),
        memory_mib=units.MiB(1 << 20),
        gpus=node("x", 4).gpus,
        nvlinks=frozenset({(1, 3)}),
    )
    plain = node("plain", 4)
    b = ledger(plain, nvlinked)
    decision = _decide("topology", b, pod("ns/p", count=2))
    assert (decision.node, decision.gpus) == ("nv", (1, 3))
    chosen, (weakest, _) = scoring.best_connected(nvlinked, [0, 1, 2, 3], 2)
    assert chosen == (1, 3)
    assert weakest is devices.Link.NVLINK


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(errors.UnknownPolicyError, match="unknown policy 'nope'; choose from: random"):
        policies.make("nope")
    with pytest.raises(errors.InvalidInputError, match="typical pod shapes"):
        policies.make("fgd", ())


def _occupy(b: core_ledger.Ledger, name: str, gpu: int, milli: int) -> None:
    assert b.add(MakeAllocation(f"ns/occupy-{name}-{gpu}-{len(b)}", name).grant(gpu, milli, container="m").obj()).ok


SHAPES_DRAWN = st.sampled_from(
    [
        {"count": 1, "milli": 250, "cpu_milli": 2000},
        {"count": 1, "milli": 500, "cpu_milli": 4000},
        {"count": 1, "milli": 700},
        {"count": 1},
        {"count": 2},
        {"count": 0, "cpu_milli": 8000},
        {"count": 1, "milli": 300, "models": frozenset({"V100"})},
    ]
)


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(
        [
            "bestfit",
            "fgd",
            "fgd-used",
            "fgd-balance",
            "fgd-fill",
            "fgd-lp",
            "packing",
            "clustering",
            "dotprod",
            "binpack",
            "spread",
        ]
    ),
    steps=st.lists(st.tuples(SHAPES_DRAWN, st.booleans()), min_size=5, max_size=40),
)
def test_cached_decisions_equal_fresh_decisions(name: str, steps: list[tuple[dict[str, object], bool]]) -> None:
    nodes = [node(f"t{i}", 2, "T4", cpu=16000) for i in range(3)] + [node(f"v{i}", 4, "V100") for i in range(2)]
    state = fleet.FleetState(nodes)
    b = core_ledger.Ledger(state)
    cached = core_placer.Placer(state, policies.make(name, SHAPES), priority=np.array([4, 3, 2, 1, 0]))
    placed: list[units.PodKey] = []
    for i, (shape, remove_one) in enumerate(steps):
        request = pod(f"ns/p{i}", **shape)
        fresh = core_placer.Placer(state, policies.make(name, SHAPES), priority=np.array([4, 3, 2, 1, 0]))
        expected = fresh.decide(request.demand)
        got = cached.decide(request.demand)
        assert (got.node, got.gpus, got.score) == (expected.node, expected.gpus, expected.score)
        if got.status.ok:
            assert b.assume(cached.allocation_for(request, got)).ok
            placed.append(request.key)
        if remove_one and placed:
            assert b.remove(placed.pop(0)).ok


def test_fgd_used_breaks_ties_toward_nodes_already_in_use() -> None:
    b = ledger(node("empty", 4, cpu=32000), node("used", 4, cpu=32000))
    _occupy(b, "used", 0, 1000)
    cpu_pod = pod("ns/cpu", cpu_milli=1000)
    assert _decide("fgd", b, cpu_pod).node == "empty", "plain FGD ties go to the node priority"
    assert _decide("fgd-used", b, cpu_pod).node == "used"


def test_default_names_the_extenders_policy_wherever_a_policy_is_named() -> None:
    assert policies.check("default") == policies.DEFAULT
    assert type(policies.make("default", (frag.WeightedShape(frag.Shape(0, 500, 1), 1.0),))).name == policies.DEFAULT
    with pytest.raises(errors.UnknownPolicyError, match=r"choose from: .*, default"):
        policies.check("defaults")


def test_the_cpu_term_counts_gpu_compute_the_nodes_cpu_cannot_feed() -> None:
    state = fleet.FleetState([node("n", 4, cpu=8000)])
    _set_free(state, 0, [1000, 1000, 0, 0])
    rows = np.array([0])
    plain = frag.FragModel(state, SHAPES).frag(rows, state.cpu_free[rows], state.milli_free[rows])[0]
    balanced = frag.FragModel(state, SHAPES, cpu_per_milli=10.0)
    # 2000 milli free, 8000 CPU free feeds 800 of it at 10 CPU-milli per GPU-milli: 1200 stranded.
    assert balanced.frag(rows, state.cpu_free[rows], state.milli_free[rows])[0] == pytest.approx(plain + 1200)
    assert frag.cpu_per_gpu_milli(
        (frag.WeightedShape(frag.Shape(4000, 500, 1), 0.5), frag.WeightedShape(frag.Shape(8000, 1000, 2), 0.5))
    ) == pytest.approx((0.5 * 4000 + 0.5 * 8000) / (0.5 * 500 + 0.5 * 2000))


def test_fgd_balance_sends_cpu_heavy_pods_to_cpu_rich_nodes() -> None:
    shapes = (frag.WeightedShape(frag.Shape(4000, 1000, 1), 1.0),)  # 4 cores per GPU
    # Same GPUs; "lean" has 4 cores per GPU, "rich" 16. The lean node comes first in node priority.
    b = ledger(node("lean", 4, cpu=16000), node("rich", 4, cpu=64000))
    # 12 cores for one GPU: on "lean" the typical shape still fits once more (FGD sees no difference),
    # but two of its three GPUs left would have no CPU to run on.
    heavy = pod("ns/heavy", count=1, milli=1000, cpu_milli=12000)

    def decide(name: str) -> core_placer.Decision:
        return core_placer.Placer(b.state, policies.make(name, shapes), priority=np.array([0, 1])).decide(heavy.demand)

    assert decide("fgd").node == "lean", "FGD alone does not see the CPU it strands"
    assert decide("fgd-balance").node == "rich"


def test_fgd_balance_leaves_scarce_models_to_the_pods_restricted_to_them() -> None:
    shapes = (
        frag.WeightedShape(frag.Shape(0, 1000, 1), 0.4),
        frag.WeightedShape(frag.Shape(0, 1000, 1, ("V100",)), 0.3),
        frag.WeightedShape(frag.Shape(0, 1000, 1, ("T4",)), 0.3),
    )
    b = ledger(node("v", 2, "V100"), node("t", 6, "T4"))
    state = b.state
    pressure = policies.model_pressure(state, shapes)
    v100 = state.model_ids_for(frozenset({"V100"}))[0]
    t4 = state.model_ids_for(frozenset({"T4"}))[0]
    # 30% of the volume may use only V100 (a quarter of the GPUs), 30% only T4 (three quarters).
    assert pressure[v100] == pytest.approx(0.3 / 0.25)
    assert pressure[t4] == pytest.approx(0.3 / 0.75)
    anywhere = pod("ns/any", count=1, milli=1000)

    def decide(name: str) -> core_placer.Decision:
        return core_placer.Placer(state, policies.make(name, shapes), priority=np.array([0, 1])).decide(anywhere.demand)

    assert decide("fgd").node == "v"
    assert decide("fgd-balance").node == "t"


FILL_SHAPES = (
    frag.WeightedShape(frag.Shape(0, 470, 1), 0.5),
    frag.WeightedShape(frag.Shape(1000, 810, 1), 0.2),
    frag.WeightedShape(frag.Shape(4000, 810, 1), 0.1),
    frag.WeightedShape(frag.Shape(0, 160, 1), 0.005),
    frag.WeightedShape(frag.Shape(0, 1000, 1), 0.195),
)


def test_unfillable_is_what_no_sum_of_common_share_sizes_fills() -> None:
    gaps = frag.unfillable(FILL_SHAPES, min_weight=0.01)
    # Common sizes: 470 and 810 (its two shapes weigh 0.3 together); 160 is rare, 1000 no share.
    assert gaps[[0, 60, 190, 340, 470, 530, 810, 940, 999, 1000]].tolist() == [0, 60, 190, 340, 0, 60, 0, 0, 59, 0]
    with_rare = frag.unfillable(FILL_SHAPES, min_weight=0.001)
    assert with_rare[190] == 30 and with_rare[320] == 0 and with_rare[160] == 0
    assert frag.unfillable(FILL_SHAPES, min_weight=0.9)[500] == 500, "no common size: every gap is waste"


def test_fgd_fill_keeps_a_gap_an_exact_share_closes_rather_than_leave_one_nothing_closes() -> None:
    b = ledger(node("n", 2))
    _occupy(b, "n", 1, 190)  # GPU 1 has 810 free: exactly what the second most common share asks
    share = pod("ns/p", count=1, milli=470)

    def decide(name: str) -> core_placer.Decision:
        return core_placer.Placer(b.state, policies.make(name, FILL_SHAPES)).decide(share.demand)

    # On GPU 1 the 470 would leave 340, which no common share fills (at every level but the lowest,
    # where the rare 160 counts); on GPU 0 it leaves 530 (470 fits again) and the 810 stays for an 810 pod.
    assert decide("fgd-balance").gpus == (1,)
    assert decide("fgd-fill").gpus == (0,)
