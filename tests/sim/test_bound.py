"""The limit of static placement: the bound against brute force, and against every policy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sharegpu import cli
from sharegpu.core import devices, frag
from sharegpu.sim import bound, catalog, replay, trace
from tests.builders import write_trace

MODELS = ("T4", "V100M32")
SHARES = (150, 250, 400, 500, 600, 810, 1000)


def small_cluster(rng: np.random.Generator, nodes: int) -> list[devices.NodeInventory]:
    return [
        devices.uniform_node(
            f"n{i}",
            gpu_count=int(rng.choice([1, 2, 4])),
            model=str(rng.choice(MODELS)),
            gpu_memory_mib=16 * 1024,
            cpu_milli=int(rng.choice([4000, 8000, 16000])),
            memory_mib=int(rng.choice([8192, 32768])),
        )
        for i in range(nodes)
    ]


def small_pods(rng: np.random.Generator, count: int) -> list[trace.TracePod]:
    pods = []
    for i in range(count):
        milli = int(rng.choice(SHARES))
        gpus = int(rng.choice([1, 1, 1, 2])) if milli == 1000 else 1
        models = frozenset([str(rng.choice(MODELS))]) if rng.random() < 0.2 else frozenset()
        if rng.random() < 0.1:
            gpus, milli = 0, 0  # CPU only
        pods.append(
            trace.TracePod(
                f"p{i}",
                cpu_milli=int(rng.choice([500, 2000, 6000])),
                memory_mib=int(rng.choice([1024, 8192])),
                num_gpu=gpus,
                gpu_milli=milli,
                models=models,
            )
        )
    return pods


def brute_force(nodes: list[devices.NodeInventory], pods: list[trace.TracePod]) -> int:
    """The most GPU milli any in-order placer that may reject any pod can hold: every choice tried."""
    free = [[1000] * n.gpu_count for n in nodes]
    cpu = [int(n.cpu_milli) for n in nodes]
    mem = [int(n.memory_mib) for n in nodes]
    best = 0

    def visit(i: int, held: int) -> None:
        nonlocal best
        remaining = sum(p.gpu_milli_total for p in pods[i:])
        if held + remaining <= best:
            return
        if i == len(pods):
            best = max(best, held)
            return
        pod = pods[i]
        if pod.num_gpu:
            for n, node in enumerate(nodes):
                if pod.cpu_milli > cpu[n] or pod.memory_mib > mem[n]:
                    continue
                if pod.models and node.gpus[0].model not in pod.models:
                    continue
                if pod.gpu_milli == 1000:
                    untouched = [g for g, f in enumerate(free[n]) if f == 1000]
                    options = [tuple(untouched[: pod.num_gpu])] if len(untouched) >= pod.num_gpu else []
                else:
                    seen: set[int] = set()
                    options = []
                    for g, f in enumerate(free[n]):
                        if f >= pod.gpu_milli and f not in seen:
                            seen.add(f)
                            options.append((g,))
                for gpus in options:
                    take = pod.gpu_milli
                    cpu[n] -= pod.cpu_milli
                    mem[n] -= pod.memory_mib
                    for g in gpus:
                        free[n][g] -= take
                    visit(i + 1, held + pod.gpu_milli_total)
                    for g in gpus:
                        free[n][g] += take
                    cpu[n] += pod.cpu_milli
                    mem[n] += pod.memory_mib
        visit(i + 1, held)

    visit(0, 0)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_exact_bound_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    nodes = small_cluster(rng, int(rng.integers(1, 4)))
    pods = small_pods(rng, int(rng.integers(3, 9)))
    solution = bound.solve(bound.Instance.of(nodes, pods))
    assert solution.exact
    assert solution.bound_milli == solution.found_milli == brute_force(nodes, pods)


@pytest.mark.parametrize("seed", range(6))
def test_column_generation_bound_is_valid_and_its_packing_achievable(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(100 + seed)
    nodes = small_cluster(rng, 3)
    pods = small_pods(rng, 8)
    optimum = brute_force(nodes, pods)
    monkeypatch.setattr(bound, "ENUMERATION_PODS", 0)  # force the large-instance path
    solution = bound.solve(bound.Instance.of(nodes, pods))
    assert not solution.exact
    assert solution.found_milli <= optimum <= solution.bound_milli
    kept = dict(zip(bound.Instance.of(nodes, pods).shapes, solution.kept, strict=True))
    assert sum(shape.value * count for shape, count in kept.items()) == solution.found_milli


def test_node_holds_packs_shares_onto_gpus() -> None:
    node = bound.NodeType(gpu_count=2, model="T4", cpu_milli=8000, memory_mib=8192)

    def share(milli: int, count: int = 1) -> bound.PodShape:
        return bound.PodShape(1000, 1024, count, milli)

    assert bound.node_holds(node, [share(600), share(400), share(500), share(500)])
    assert not bound.node_holds(node, [share(600), share(600), share(600)])  # 1800 milli, but no two share a GPU
    assert not bound.node_holds(node, [share(1000), share(600), share(500)])  # a whole GPU leaves one for shares
    assert not bound.node_holds(node, [share(100)] * 9)  # 9 x 1000m CPU on an 8-core node
    assert not bound.node_holds(node, [bound.PodShape(0, 0, 1, 500, ("V100M32",))])


def test_gpu_fills_are_maximal_and_fit() -> None:
    values = (150, 250, 400, 810)
    fills = bound.gpu_fills(values)
    assert fills
    for fill in fills:
        used = sum(c * v for c, v in zip(fill, values, strict=True))
        assert used <= 1000
        assert all(used + v > 1000 for v in values)
    assert (0, 0, 0, 1) not in fills  # 810 + 150 still fits
    assert (1, 0, 0, 1) in fills
    assert len(set(fills)) == len(fills)


def test_no_policy_beats_the_bound_and_the_heuristic_brackets_it() -> None:
    rng = np.random.default_rng(7)
    nodes = small_cluster(rng, 4)
    pool = tuple(small_pods(rng, 40))
    capacity = sum(n.gpu_count for n in nodes) * 1000
    shapes = frag.typical_shapes(p.shape for p in pool)
    for seed in (1, 2, 3):
        workload = replay.build_workload(pool, capacity, len(nodes), 1.3, seed)
        run = bound.bound_run(nodes, workload, "small", seed)
        assert run.lower_bound_unallocated_pct <= run.offline_heuristic_unallocated_pct <= run.best_fit_unallocated_pct
        for name in catalog.REGISTRY:  # sharegpu's and the peers'
            result = replay.replay_static(nodes, workload, catalog.make(name, shapes), shapes, seed)
            assert result.unallocated_pct_at_100 >= run.lower_bound_unallocated_pct - 1e-9, (name, seed)


def test_window_matches_the_headline_figure() -> None:
    arrived = np.array([300, 996, 1000, 1004, 1300])
    allocated = np.array([300, 900, 950, 960, 960])
    assert replay.window(arrived, 1000).tolist() == [1, 2, 3]
    assert replay.unallocated_at_100(arrived, allocated, 1000) == pytest.approx(100 - (90 + 95 + 96) / 3)
    assert replay.window(np.array([500, 1500]), 1000).tolist() == [1]  # jumped over the window
    assert replay.window(np.array([500, 900]), 1000).tolist() == []


def test_cli_writes_the_runs(tmp_path: Path) -> None:
    nodes, pods = write_trace(tmp_path, np.random.default_rng(3))
    out = tmp_path / "bound.json"
    result = CliRunner().invoke(
        cli.app, ["bound", "--nodes", str(nodes), "--pods", str(pods), "--seeds", "42,43", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["trace"], r["seed"]) for r in runs] == [("tiny", 42), ("tiny", 43)]
    for run in runs:
        assert {"lower_bound_unallocated_pct", "offline_heuristic_unallocated_pct", "solve_seconds"} <= set(run)
        assert 0 <= run["lower_bound_unallocated_pct"] <= run["offline_heuristic_unallocated_pct"] <= 100
    assert "tiny" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tune", "0"], "--tune must be in (0, 10]"),
        (["--time-limit", "-1"], "--time-limit must be in (0, 86400]"),
        (["--seeds", "x"], "seed"),
    ],
)
def test_cli_refuses_bad_input(tmp_path: Path, args: list[str], message: str) -> None:
    nodes, pods = write_trace(tmp_path, np.random.default_rng(3))
    result = CliRunner().invoke(cli.app, ["bound", "--nodes", str(nodes), "--pods", str(pods), *args])
    assert result.exit_code != 0
    assert message in result.output


def test_cli_names_a_missing_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.app, ["bound", "--nodes", str(tmp_path / "no.csv"), "--pods", "x.csv"])
    assert result.exit_code != 0
    assert "no.csv: no such file" in result.output
