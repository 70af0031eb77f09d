"""Sweeps on a Dask cluster (`sim.cluster`) against a local one of Dask's own (two worker processes):
the same runs give the same figures as local processes, the workers need no trace files, and a
cluster that cannot be reached, or whose workers run another sharegpu, is told in one line. The
cluster starts once for the module (about a second here); the whole module takes a few seconds."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from distributed import LocalCluster
from typer.testing import CliRunner

from sharegpu import cli
from sharegpu.sim import cluster, runner
from tests.builders import write_trace


@pytest.fixture(scope="module")
def scheduler() -> Iterator[str]:
    made = LocalCluster(  # type: ignore[no-untyped-call]  # distributed's constructors are not annotated
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    )
    with made:
        yield str(made.scheduler_address)


def sweep(tmp_path: Path) -> list[runner.RunSpec]:
    nodes, pods = write_trace(tmp_path, np.random.default_rng(5))
    sources = [runner.Source("tiny", str(nodes), str(pods)), runner.Source(runner.SYNTHETIC)]
    return [runner.RunSpec(s, p, seed) for s in sources for p in ("fgd-balance", "fgd", "random") for seed in (42, 43)]


def figures(results: list[runner.RunResult]) -> list[runner.RunResult]:
    return [dataclasses.replace(r, wall_seconds=0.0) for r in results]


def test_a_sweep_on_dask_gives_the_figures_of_local_processes(scheduler: str, tmp_path: Path) -> None:
    specs = sweep(tmp_path)
    told: list[runner.RunResult] = []
    remote = cluster.run_on_dask(specs, scheduler, told.append)
    local = runner.run_all(specs, jobs=2)
    assert figures(remote) == figures(local)
    assert [(r.trace, r.policy, r.seed) for r in remote] == [(s.source.label, s.policy, s.seed) for s in specs]
    assert sorted(told, key=specs_order(specs)) == remote, "each run told once, as it finished"
    assert len({r.unallocated_gpu_pct_at_arrived_100 for r in remote}) > 3, "the runs differ: nothing is constant"


def specs_order(specs: list[runner.RunSpec]) -> Callable[[runner.RunResult], int]:
    index = {(s.source.label, s.policy, s.seed): i for i, s in enumerate(specs)}
    return lambda r: index[(r.trace, r.policy, r.seed)]


def test_a_run_reads_no_file_once_its_inputs_are_loaded(tmp_path: Path) -> None:
    (spec, *_) = sweep(tmp_path)
    loaded = runner.load_source(spec.source)
    expected = runner.execute(spec)
    gone = dataclasses.replace(spec, source=runner.Source("tiny", str(tmp_path / "gone.csv"), str(tmp_path / "x.csv")))
    found = runner.execute_loaded(gone, loaded)
    assert dataclasses.replace(found, wall_seconds=0.0) == dataclasses.replace(expected, wall_seconds=0.0)


def test_an_unreachable_scheduler_and_a_mismatched_worker_are_told(
    scheduler: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = sweep(tmp_path)[:1]
    with pytest.raises(cluster.ClusterError, match=r"cannot reach the Dask scheduler at tcp://127\.0\.0\.1:9"):
        cluster.run_on_dask(specs, "tcp://127.0.0.1:9", timeout="2s")
    # This client claims another Python; the workers (other processes) report their own.
    monkeypatch.setattr(platform, "python_version_tuple", lambda: ("3", "99", "0"))
    with pytest.raises(cluster.ClusterError, match=r"run another sharegpu or Python than this client .*Python 3\.99"):
        cluster.run_on_dask(specs, scheduler)


def test_simulate_on_dask_from_the_command_line(scheduler: str) -> None:
    ran = CliRunner().invoke(cli.app, ["simulate", "--dask", scheduler, "-p", "fgd-balance", "--seeds", "42", "-q"])
    assert ran.exit_code == 0, ran.output
    assert "fgd-balance" in ran.output and "synthetic" in ran.output
    both = CliRunner().invoke(cli.app, ["simulate", "--dask", scheduler, "--jobs", "2"])
    assert both.exit_code == 2 and "--jobs and --dask exclude each other" in both.output
