"""The simulator's commands: `simulate`, `bound` and `policies`.

`simulate` replays a workload through the placement core (the embedded synthetic one by default, or
openb CSV files) and prints a summary table per trace and policy; `bound` computes the limit no static
placement can beat on the same workloads; `policies` lists the placement policies. The trace options
`simulate` and `bound` share (`Nodes`, `Pods`, `Seeds`, `Jobs`) and their checks (`check_trace_options`,
`read_traces`) are declared once here.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sharegpu.cli.boundary import UsageError, console, reported
from sharegpu.cli.options import complete_policies
from sharegpu.core import errors, policy_names

if TYPE_CHECKING:
    from sharegpu.sim import report, runner
    from sharegpu.sim.bound import BoundRun

DEFAULT_POLICIES = f"random,bestfit,fgd,{policy_names.DEFAULT}"
_DEFAULT_POLICY_LIST = [DEFAULT_POLICIES]  # `simulate --policy`'s default: never changed

Nodes = Annotated[Path | None, typer.Option("--nodes", help="openb node CSV (sn,cpu_milli,memory_mib,gpu,model).")]
Pods = Annotated[
    list[Path] | None, typer.Option("--pods", metavar="<path>", help="openb pod CSV; repeat for several traces.")
]
Seeds = Annotated[str, typer.Option("--seeds", help="Seeds: 42, 42,45 or 42-51.")]
Jobs = Annotated[int, typer.Option("--jobs", "-j", help="Worker processes; 0: one per core.", min=0)]
Dask = Annotated[
    str | None,
    typer.Option(
        "--dask",
        metavar="ADDRESS",
        help="Run on the existing Dask cluster whose scheduler is at ADDRESS (tcp://host:8786) instead of local "
        "processes (needs the dask extra; its workers need this sharegpu, not the trace files).",
    ),
]


def parse_seeds(text: str) -> list[int]:
    """`42`, `42,45`, `42-51` or a mix such as `1-3,10`."""
    seeds: list[int] = []
    for raw in text.split(","):
        part = raw.strip()
        low_text, dash, high_text = part.partition("-")
        if not (low_text.isdigit() and (not dash or high_text.isdigit())):
            raise UsageError(f"--seeds {text!r}: {part!r} is not a number >= 0 or a range like 42-51")
        low = int(low_text)
        high = int(high_text) if dash else low
        if high < low:
            raise UsageError(f"--seeds {text!r}: range {part} goes backwards")
        if high - low > 10_000:
            raise UsageError(f"--seeds {text!r}: range {part} is too long")
        seeds.extend(range(low, high + 1))
    return list(dict.fromkeys(seeds))


def parse_policies(values: list[str]) -> list[str]:
    """The simulator's policies named (sharegpu's and the peers')."""
    from sharegpu.sim import catalog

    chosen = [name.strip() for value in values for name in value.split(",") if name.strip()]
    if not chosen:
        raise UsageError("--policy: give at least one policy")
    return list(dict.fromkeys(catalog.check(name) for name in chosen))


def check_trace_options(
    nodes: Path | None, pods: list[Path] | None, tune: float, jobs: int, *ranges: tuple[bool, str]
) -> None:
    """The checks of the options `simulate` and `bound` share, in the order both report them: --nodes
    goes with --pods, --tune, then the command's own `ranges` (each: whether its value is in range, and
    the message when it is not), then --jobs."""
    if (nodes is None) != (not pods):
        raise UsageError("--nodes and --pods go together (give both, or neither for the synthetic workload)")
    if not 0 < tune <= 10:
        raise UsageError(f"--tune must be in (0, 10], got {tune}")
    for in_range, message in ranges:
        if not in_range:
            raise UsageError(message)


def read_traces(nodes: Path | None, pods: list[Path] | None, seeds: str) -> tuple[list[int], list[runner.Source]]:
    """The seeds, and the traces to replay (the embedded synthetic workload when no files are named),
    every file read once here so that a bad one fails before any worker starts."""
    from sharegpu.sim import runner

    seed_list = parse_seeds(seeds)
    if nodes is None or not pods:
        sources = [runner.Source(runner.SYNTHETIC)]
    else:
        sources = [runner.Source(_label(p), str(nodes), str(p)) for p in pods]
    runner.validate_sources(sources)
    return seed_list, sources


def writable(option: str, path: Path | None) -> None:
    """An output file checked before any run (a sweep can take hours): its folder made, or there, and
    writable, and the path no folder. Nothing is written to it yet."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UsageError(f"{option} {path}: {path.parent} is not a folder") from None
    except OSError as exc:
        raise UsageError(f"{option} {path}: its folder cannot be made: {exc.strerror or exc}") from None
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a folder")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")


def _label(path: Path) -> str:
    stem = path.stem
    return stem.removeprefix("openb_pod_list_")


def simulate(
    nodes: Nodes = None,
    pods: Pods = None,
    policy: Annotated[
        list[str],
        typer.Option(
            "--policy",
            "-p",
            metavar="<names>",
            help="Policies, comma-separated or repeated (see `sharegpu policies`).",
            autocompletion=complete_policies,
        ),
    ] = _DEFAULT_POLICY_LIST,
    seeds: Seeds = "42-51",
    tune: Annotated[float, typer.Option("--tune", help="Static mode: arrive until this x GPU capacity.")] = 1.3,
    mode: Annotated[
        Literal["static", "dynamic"],
        typer.Option("--mode", help="static (the paper's method) or dynamic (arrive and leave)."),
    ] = "static",
    time_scale: Annotated[
        float, typer.Option("--time-scale", help="Dynamic mode: arrivals this many times faster (run times unchanged).")
    ] = 1.0,
    defrag_budget: Annotated[
        int,
        typer.Option(
            "--defrag-budget",
            help="Dynamic mode: defragment, moving at most this many running pods per hour (0: off).",
            min=0,
        ),
    ] = 0,
    jobs: Jobs = 0,
    dask: Dask = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write allocation curves to this PNG.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every run and the summary as JSON.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Replay a workload through the placement policies and report allocation and fragmentation."""
    from sharegpu.sim import report, runner

    shown = console()
    with reported():
        time_scale_in_range = (0 < time_scale <= 1e6, f"--time-scale must be in (0, 1000000], got {time_scale}")
        check_trace_options(nodes, pods, tune, jobs, time_scale_in_range)
        if defrag_budget and mode != "dynamic":
            raise UsageError("--defrag-budget needs --mode dynamic (static arrivals never leave, nothing is recreated)")
        if dask is not None and jobs:
            raise UsageError("--jobs and --dask exclude each other (the Dask cluster's workers make the runs)")
        if plot is not None and plot.suffix.lower() != ".png":
            raise UsageError(f"--plot must name a .png file, got {plot}")
        writable("--plot", plot)
        writable("--json", json_path)
        chosen = parse_policies(policy)
        seed_list, sources = read_traces(nodes, pods, seeds)
        if mode == "dynamic":
            for source in sources:
                if not runner.load_source(source)[1].timed:
                    raise UsageError(f"{source.pods_path}: dynamic mode needs creation_time and deletion_time columns")

    specs = [
        runner.RunSpec(s, p, seed, tune, mode, time_scale, defrag_budget)
        for s in sources
        for p in chosen
        for seed in seed_list
    ]
    with reported(doing="--dask" if dask else ""):
        results = _run_all(specs, jobs, shown, quiet, dask)
    shown.print(_summary_table(report.summarise(results), mode, defrag=defrag_budget > 0))
    now = [found for source in sources if (found := report.cluster_now(source)) is not None]
    for found in now:
        shown.print(found.describe())
    with reported(OSError):
        if json_path is not None:
            json_path.write_bytes(report.to_json(results, shlex.join(["sharegpu", *sys.argv[1:]]), now))
            shown.print(f"wrote {json_path}")
        if plot is not None:
            report.plot(results, plot)
            shown.print(f"wrote {plot}")


def _run_all(
    specs: list[runner.RunSpec], jobs: int, shown: Console, quiet: bool, dask: str | None = None
) -> list[runner.RunResult]:
    """Every run, on `jobs` worker processes (0: one per core) or the Dask cluster at `dask`, under a
    progress bar unless `quiet`."""
    from sharegpu.sim import cluster, runner

    with Progress(
        TextColumn("[bold]simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=shown,
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("", total=len(specs))

        def done(result: runner.RunResult) -> None:
            progress.update(task, advance=1, description=f"{result.trace} {result.policy} seed {result.seed}")

        if dask is not None:
            return cluster.run_on_dask(specs, dask, done)
        return runner.run_all(specs, jobs or None, done)


def _summary_table(summaries: list[report.Summary], mode: str, defrag: bool = False) -> Table:
    if mode == "dynamic":
        table = Table(
            title="Dynamic replay (mean±sd over seeds)",
            caption="alloc %: time-weighted allocated GPU % while pods arrive; waits in seconds"
            + ("; evictions: running pods the defragmenter moved" if defrag else ""),
        )
        columns = ["trace", "policy", "seeds", "alloc %", "wait p50", "wait p99", "never placed"]
        columns += ["evictions", "s/run"] if defrag else ["s/run"]
        for c in columns:
            table.add_column(c, justify="left" if c in ("trace", "policy") else "right")
        for s in summaries:
            cells = [s.trace, s.policy, str(s.seeds), str(s.mean_allocated), str(s.wait_p50), str(s.wait_p99)]
            cells.append(str(s.failed))
            if defrag:
                cells.append(str(s.evictions))
            table.add_row(*cells, str(s.wall))
        return table
    table = Table(
        title="Static arrivals (mean±sd over seeds)",
        caption="unalloc %: unallocated GPU % when the arrived GPU request is 100% of capacity (lower is better); "
        "frag %: fragmented GPU % at that point",
    )
    columns = ["trace", "policy", "seeds", "unalloc %", "frag %", "failed pods", "s/run"]
    for c in columns:
        table.add_column(c, justify="left" if c in ("trace", "policy") else "right")
    for s in summaries:
        table.add_row(s.trace, s.policy, str(s.seeds), str(s.unallocated), str(s.frag), str(s.failed), str(s.wall))
    return table


def bound(
    nodes: Nodes = None,
    pods: Pods = None,
    seeds: Seeds = "42",
    tune: Annotated[float, typer.Option("--tune", help="Arrive until this x GPU capacity (as simulate).")] = 1.3,
    time_limit: Annotated[
        float, typer.Option("--time-limit", help="Seconds per run; the bound stays proven (looser) when it is hit.")
    ] = 900.0,
    jobs: Jobs = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every run as JSON.")] = None,
) -> None:
    """The limit of static placement: a proven lower bound on the unallocated GPU % at arrived = 100% that
    no placement can beat (even one that knows every arrival), and an offline heuristic's figure."""
    from sharegpu.sim import bound as limit
    from sharegpu.sim import report

    shown = console()
    with reported():
        time_limit_in_range = (
            0 < time_limit <= 86_400,
            f"--time-limit must be in (0, 86400] seconds, got {time_limit}",
        )
        check_trace_options(nodes, pods, tune, jobs, time_limit_in_range)
        writable("--json", json_path)
        seed_list, sources = read_traces(nodes, pods, seeds)
        # Seed by seed across the traces, so a table cut short still covers every trace.
        specs = [limit.BoundSpec(source, seed, tune, time_limit) for seed in seed_list for source in sources]
    command = shlex.join(["sharegpu", *sys.argv[1:]])

    def save(runs: list[limit.BoundRun]) -> None:
        if json_path is not None:
            document = {"command": command, "runs": [dataclasses.asdict(run) for run in runs]}
            json_path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))

    with reported(errors.SharegpuError, OSError), shown.status(f"bounding {len(specs)} run(s)"):
        runs = limit.execute_all(specs, jobs or os.cpu_count() or 1, save)
    shown.print(_bound_table(runs))
    for found in (report.cluster_now(source) for source in sources):
        if found is not None:
            shown.print(found.describe())
    if json_path is not None:
        shown.print(f"wrote {json_path}")


def _bound_table(runs: list[BoundRun]) -> Table:
    table = Table(
        title="The limit at arrived = 100%",
        caption="bound: no placement leaves less unallocated; heuristic: achieved by a placer that knows the future",
    )
    for column in ("trace", "seed", "bound %", "heuristic %", "largest-first best fit %", "exact", "seconds"):
        table.add_column(column, justify="left" if column == "trace" else "right")
    for run in runs:
        table.add_row(
            run.trace,
            str(run.seed),
            f"{run.lower_bound_unallocated_pct:.2f}",
            f"{run.offline_heuristic_unallocated_pct:.2f}",
            f"{run.best_fit_unallocated_pct:.2f}",
            "yes" if run.exact else "no",
            f"{run.solve_seconds:.1f}",
        )
    return table


def list_policies() -> None:
    """List the placement policies (the components take sharegpu's; the simulator also the peers')."""
    from sharegpu.core import policies
    from sharegpu.sim import catalog

    table = Table(title="Placement policies")
    table.add_column("name")
    table.add_column("what it does")
    table.add_column("whose, following")
    for name, cls in catalog.REGISTRY.items():
        whose = cls.system if not cls.source else f"{cls.system}: {cls.source}"
        table.add_row(name, cls.summary, whose)
    for alias, name in policies.ALIASES.items():
        table.add_row(alias, f"the extender's default policy: {name}", "sharegpu")
    console().print(table)
