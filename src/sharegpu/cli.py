"""The `sharegpu` command line.

`sharegpu simulate` replays a workload through the placement core (the embedded synthetic one by
default, or openb CSV files) and prints a summary table per trace and policy; the other commands run
the components (one image holds them all: see the Dockerfile). Bad input (missing file, malformed
row, unknown policy, bad seed list, and click's own usage errors: an unknown option, a value that is
not one of an option's choices) prints one line `sharegpu: error: ...` and exits with status 2.

The components log to stderr, one JSON object per line for log collectors, or one plain line per
record for a person (`--log-format`; `auto`, the default, picks text when stderr is a terminal, so a
pod's logs stay JSON). `sharegpu --version` prints the installed version; `--install-completion`
installs shell completion (option names, and the choices of options that have them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import importlib.metadata
import logging
import os
import shlex
import signal
import sys
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, TextIO

import orjson
import typer
import typer.core
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Typer vendors click: its context and usage errors are only reachable here (typer is pinned in pyproject.toml).
from typer._click.core import Context as ClickContext
from typer._click.exceptions import NoArgsIsHelpError
from typer._click.exceptions import UsageError as ClickUsageError

from sharegpu.core import errors, policies
from sharegpu.sim import report, runner

DEFAULT_POLICIES = "random,bestfit,fgd,fgd-balance"
_DEFAULT_POLICY_LIST = [DEFAULT_POLICIES]  # `simulate --policy`'s default: never changed
EXIT_BAD_INPUT = 2


class UsageError(errors.InvalidInputError):
    """A command-line value that cannot be used."""


class Compat(enum.StrEnum):
    """Other systems' resources sharegpu can serve (`--compat`): the keys of `api.resources.COMPAT`,
    spelled here so that the command line loads without the wire vocabulary (a test keeps them equal)."""

    DEVICESHARE = "deviceshare"
    KUBESHARE = "kubeshare"


LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "text"]
ViolationAction = Literal["report", "kill", "evict"]
"""The agent's `--on-violation`: the values of `agent.watchdog.Action` (a test keeps them equal)."""


class _Commands(typer.core.TyperGroup):
    """The command group: click's own usage errors (an unknown option or command, a value that is not
    one of an option's choices, a missing value) are reported as every other bad input is, in one line
    `sharegpu: error: ...` with exit status 2, rather than in a box of several lines."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: ClickContext | None = None, **extra: Any
    ) -> ClickContext:
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: ClickContext) -> Any:
        with _one_line_usage_errors():
            return super().invoke(ctx)


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    try:
        yield
    except NoArgsIsHelpError:
        raise  # `sharegpu` alone prints the help
    except ClickUsageError as exc:
        # Typer validates choices with pydantic, whose messages start with "Value error, ".
        raise _fail(UsageError(exc.format_message().replace(": Value error, ", ": ", 1))) from None


app = typer.Typer(
    name="sharegpu",
    cls=_Commands,
    help="Share NVIDIA GPUs between Kubernetes pods: placement, simulation and inspection.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"sharegpu {importlib.metadata.version('sharegpu')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    pass


def _complete_policy(incomplete: str) -> list[str]:
    return [name for name in [*policies.REGISTRY, *policies.ALIASES] if name.startswith(incomplete)]


def _complete_policies(incomplete: str) -> list[str]:
    """Completes the last name of a comma-separated list."""
    done, comma, last = incomplete.rpartition(",")
    return [done + comma + name for name in _complete_policy(last)]


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
    chosen = [name.strip() for value in values for name in value.split(",") if name.strip()]
    if not chosen:
        raise UsageError("--policy: give at least one policy")
    return list(dict.fromkeys(policies.check(name) for name in chosen))


def _fail(exc: BaseException) -> typer.Exit:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    typer.echo(f"sharegpu: error: {text}", err=True)
    return typer.Exit(EXIT_BAD_INPUT)


@app.command()
def simulate(
    nodes: Annotated[
        Path | None, typer.Option("--nodes", help="openb node CSV (sn,cpu_milli,memory_mib,gpu,model).")
    ] = None,
    pods: Annotated[
        list[Path] | None, typer.Option("--pods", metavar="<path>", help="openb pod CSV; repeat for several traces.")
    ] = None,
    policy: Annotated[
        list[str],
        typer.Option(
            "--policy",
            "-p",
            metavar="<names>",
            help="Policies, comma-separated or repeated (see `sharegpu policies`).",
            autocompletion=_complete_policies,
        ),
    ] = _DEFAULT_POLICY_LIST,
    seeds: Annotated[str, typer.Option("--seeds", help="Seeds: 42, 42,45 or 42-51.")] = "42-51",
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
        ),
    ] = 0,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Worker processes; 0: one per core.")] = 0,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write allocation curves to this PNG.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every run and the summary as JSON.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Replay a workload through the placement policies and report allocation and fragmentation."""
    console = _console()
    try:
        if (nodes is None) != (not pods):
            raise UsageError("--nodes and --pods go together (give both, or neither for the synthetic workload)")
        if not 0 < tune <= 10:
            raise UsageError(f"--tune must be in (0, 10], got {tune}")
        if not 0 < time_scale <= 1e6:
            raise UsageError(f"--time-scale must be in (0, 1000000], got {time_scale}")
        if jobs < 0:
            raise UsageError(f"--jobs must be >= 0, got {jobs}")
        if defrag_budget < 0:
            raise UsageError(f"--defrag-budget must be >= 0, got {defrag_budget}")
        if defrag_budget and mode != "dynamic":
            raise UsageError("--defrag-budget needs --mode dynamic (static arrivals never leave, nothing is recreated)")
        if plot is not None and plot.suffix.lower() != ".png":
            raise UsageError(f"--plot must name a .png file, got {plot}")
        chosen = parse_policies(policy)
        seed_list = parse_seeds(seeds)
        sources = _sources(nodes, pods)
        if mode == "dynamic":
            for source in sources:
                if not runner.load_source(source)[1].timed:
                    raise UsageError(f"{source.pods_path}: dynamic mode needs creation_time and deletion_time columns")
    except errors.SharegpuError as exc:
        raise _fail(exc) from None

    specs = [
        runner.RunSpec(s, p, seed, tune, mode, time_scale, defrag_budget)
        for s in sources
        for p in chosen
        for seed in seed_list
    ]
    with Progress(
        TextColumn("[bold]simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("", total=len(specs))

        def done(result: runner.RunResult) -> None:
            progress.update(task, advance=1, description=f"{result.trace} {result.policy} seed {result.seed}")

        results = runner.run_all(specs, jobs or None, done)

    console.print(_table(report.summarise(results), mode, defrag=defrag_budget > 0))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_bytes(report.to_json(results, shlex.join(["sharegpu", *sys.argv[1:]])))
        console.print(f"wrote {json_path}")
    if plot is not None:
        report.plot(results, plot)
        console.print(f"wrote {plot}")


def _sources(nodes: Path | None, pods: list[Path] | None) -> list[runner.Source]:
    """The traces to replay (the embedded synthetic workload when no files are named), every file
    read once here so that a bad one fails before any worker starts."""
    if nodes is None or not pods:
        sources = [runner.Source(runner.SYNTHETIC)]
    else:
        sources = [runner.Source(_label(p), str(nodes), str(p)) for p in pods]
    runner.validate_sources(sources)
    return sources


def _console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=120)


def _label(path: Path) -> str:
    stem = path.stem
    return stem.removeprefix("openb_pod_list_")


def _table(summaries: list[report.Summary], mode: str, defrag: bool = False) -> Table:
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


@app.command()
def bound(
    nodes: Annotated[
        Path | None, typer.Option("--nodes", help="openb node CSV (sn,cpu_milli,memory_mib,gpu,model).")
    ] = None,
    pods: Annotated[
        list[Path] | None, typer.Option("--pods", metavar="<path>", help="openb pod CSV; repeat for several traces.")
    ] = None,
    seeds: Annotated[str, typer.Option("--seeds", help="Seeds: 42, 42,45 or 42-51.")] = "42",
    tune: Annotated[float, typer.Option("--tune", help="Arrive until this x GPU capacity (as simulate).")] = 1.3,
    time_limit: Annotated[
        float, typer.Option("--time-limit", help="Seconds per run; the bound stays proven (looser) when it is hit.")
    ] = 900.0,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Worker processes; 0: one per core.")] = 1,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every run as JSON.")] = None,
) -> None:
    """The limit of static placement: a proven lower bound on the unallocated GPU % at arrived = 100% that
    no placement can beat (even one that knows every arrival), and an offline heuristic's figure."""
    from sharegpu.sim import bound as limit

    console = _console()
    try:
        if (nodes is None) != (not pods):
            raise UsageError("--nodes and --pods go together (give both, or neither for the synthetic workload)")
        if not 0 < tune <= 10:
            raise UsageError(f"--tune must be in (0, 10], got {tune}")
        if not 0 < time_limit <= 86_400:
            raise UsageError(f"--time-limit must be in (0, 86400] seconds, got {time_limit}")
        if jobs < 0:
            raise UsageError(f"--jobs must be >= 0, got {jobs}")
        seed_list = parse_seeds(seeds)
        sources = _sources(nodes, pods)
        # Seed by seed across the traces, so a table cut short still covers every trace.
        specs = [limit.BoundSpec(source, seed, tune, time_limit) for seed in seed_list for source in sources]
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
    command = shlex.join(["sharegpu", *sys.argv[1:]])

    def save(runs: list[limit.BoundRun]) -> None:
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            document = {"command": command, "runs": [dataclasses.asdict(run) for run in runs]}
            json_path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))

    try:
        with console.status(f"bounding {len(specs)} run(s)"):
            runs = limit.execute_all(specs, jobs or os.cpu_count() or 1, save)
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
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
    console.print(table)
    if json_path is not None:
        console.print(f"wrote {json_path}")


@app.command()
def crds(
    out: Annotated[
        Path | None, typer.Option(help="Write one file per resource into this directory instead of printing.")
    ] = None,
    compat: Annotated[
        list[Compat] | None,
        typer.Option(help="Instead, another system's resources that sharegpu serves (repeat)."),
    ] = None,
) -> None:
    """Print every sharegpu CustomResourceDefinition (YAML: the generated ones and the Device's, which
    the chart holds as written), or write the generated ones into a directory."""
    from sharegpu.api import resources

    chosen: list[resources.CustomResource] = list(resources.GENERATED)
    if compat:
        chosen = [r for name in compat for r in resources.COMPAT[name.value]]
    if out is None:
        texts = [resources.render(r) for r in chosen]
        if not compat:
            from sharegpu.devcluster import stack

            texts.append((stack.CHART / "crds" / "devices.sharegpu.io.yaml").read_text())
        sys.stdout.write("---\n".join(texts))
        return
    if not out.is_dir():
        raise _fail(UsageError(f"--out {out}: not a directory"))
    for resource in chosen:
        (out / resources.file_name(resource)).write_text(resources.render(resource))


@app.command("policies")
def list_policies() -> None:
    """List the placement policies."""
    table = Table(title="Placement policies")
    table.add_column("name")
    table.add_column("what it does")
    for name in policies.REGISTRY:
        table.add_row(name, policies.REGISTRY[name].summary)
    for alias, name in policies.ALIASES.items():
        table.add_row(alias, f"the extender's default policy: {name}")
    _console().print(table)


LeaseDuration = Annotated[float, typer.Option(help="Leader election: seconds a Lease is valid.")]
RenewDeadline = Annotated[float, typer.Option(help="Leader election: seconds to renew before stepping down.")]
RetryPeriod = Annotated[float, typer.Option(help="Leader election: seconds between attempts.")]
Identity = Annotated[
    str, typer.Option(help="Leader election: this replica's name.", show_default="host, pid and a random suffix")
]
Kubeconfig = Annotated[
    str | None, typer.Option(help="kubeconfig file.", show_default="$KUBECONFIG, ~/.kube/config, or in-cluster")
]
LogLevelOption = Annotated[LogLevel, typer.Option(case_sensitive=False, help="The least severe records logged.")]
LogFormatOption = Annotated[
    LogFormat,
    typer.Option(
        help="Logs on stderr: json (one object per line, for log collectors), text (one line for a person), "
        "or auto: text when stderr is a terminal, else json."
    ),
]


def _check_election(lease_duration: float, renew_deadline: float, retry_period: float) -> None:
    if not 0 < retry_period < renew_deadline < lease_duration:
        raise UsageError("leader election needs 0 < --retry-period < --renew-deadline < --lease-duration")


@app.command()
def extender(
    kubeconfig: Kubeconfig = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="Port of filter/prioritize/bind (kube-scheduler calls it).")] = 8888,
    health_port: Annotated[int, typer.Option(help="Port of /healthz, /readyz, /metrics and /debug.")] = 8889,
    policy: Annotated[
        str, typer.Option(help="Placement policy (see `sharegpu policies`).", autocompletion=_complete_policy)
    ] = policies.DEFAULT,
    image: Annotated[
        str, typer.Option(help="Image of reservation pods (runs `sharegpu reserve`).")
    ] = "sharegpu:latest",
    narrow: Annotated[bool, typer.Option(help="Filter answers only the chosen node.")] = True,
    preemption: Annotated[
        bool, typer.Option(help="A GPU pod that fits nowhere preempts GPU pods of lower priority.")
    ] = True,
    shapes_from: Annotated[
        Path | None,
        typer.Option(
            help="openb pod CSV whose popular shapes FGD assumes.", show_default="learned from the cluster's pods"
        ),
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="Serving certificate for the scheduler port (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Serving key (PEM).")] = None,
    client_ca: Annotated[
        Path | None, typer.Option(help="Accept filter/prioritize/bind only with a client certificate from this CA.")
    ] = None,
    leader_elect: Annotated[
        bool, typer.Option(help="Run the background reconcilers only while holding the sharegpu-extender Lease.")
    ] = True,
    lease_duration: LeaseDuration = 15.0,
    renew_deadline: RenewDeadline = 10.0,
    retry_period: RetryPeriod = 2.0,
    identity: Identity = "",
    reservation_idle: Annotated[
        float, typer.Option(help="Seconds a reservation pod with no sharers is kept before it is deleted.")
    ] = 3.0,
    assume_ttl: Annotated[
        float, typer.Option(help="Seconds before an assumed placement whose binding never shows up is checked.")
    ] = 30.0,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run the kube-scheduler extender (filter, prioritize, bind) and its reconcilers."""
    from sharegpu.extender import runtime
    from sharegpu.sim import trace

    _logging(log_level, log_format)
    try:
        policies.check(policy)
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together")
        if client_ca is not None and tls_cert is None:
            raise UsageError("--client-ca needs --tls-cert and --tls-key")
        _check_election(lease_duration, renew_deadline, retry_period)
        if reservation_idle < 0 or assume_ttl <= 0:
            raise UsageError("--reservation-idle must be >= 0 and --assume-ttl > 0")
        for path in (tls_cert, tls_key, client_ca):
            if path is not None and not path.is_file():
                raise UsageError(f"{path}: no such file")
        shapes = trace.load_pods(shapes_from).typical_shapes() if shapes_from else None
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
    options = runtime.Options(
        kubeconfig=kubeconfig, host=host, port=port, health_port=health_port, policy=policy, image=image,
        narrow=narrow, shapes=shapes, tls_cert=tls_cert, tls_key=tls_key, client_ca=client_ca,
        leader_elect=leader_elect, lease_duration=lease_duration, renew_deadline=renew_deadline,
        retry_period=retry_period, reservation_idle=reservation_idle, assume_ttl=assume_ttl, identity=identity,
        preemption=preemption,
    )  # fmt: skip
    try:
        _serve(runtime.serve(options))
    except errors.SharegpuError as exc:
        raise _fail(exc) from None


@app.command()
def controller(
    kubeconfig: Kubeconfig = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    health_port: Annotated[int, typer.Option(help="Port of /healthz, /readyz, /metrics and /debug.")] = 8890,
    leader_elect: Annotated[
        bool, typer.Option(help="Reconcile only while holding the sharegpu-controller Lease.")
    ] = True,
    lease_duration: LeaseDuration = 15.0,
    renew_deadline: RenewDeadline = 10.0,
    retry_period: RetryPeriod = 2.0,
    identity: Identity = "",
    write_every: Annotated[
        float, typer.Option(help="Seconds between status writes of a budget whose usage moves.")
    ] = 30.0,
    image: Annotated[str, typer.Option(help="Image of the group holder pods (it runs `sharegpu reserve`).")] = (
        "sharegpu:latest"
    ),
    compat: Annotated[
        list[Compat] | None,
        typer.Option(help="Serve another system's resources too (their CRDs installed; repeat)."),
    ] = None,
    defrag: Annotated[
        bool,
        typer.Option(
            "--defrag",
            help="Defragment: evict (Eviction API) the fewest pods that a controller recreates elsewhere so that "
            "pending GPU pods fit (docs/defrag.md).",
        ),
    ] = False,
    defrag_dry_run: Annotated[
        bool,
        typer.Option("--defrag-dry-run", help="Run the defragmenter but only report its plans (log, events, metrics)."),
    ] = False,
    defrag_budget_per_hour: Annotated[
        int, typer.Option("--defrag-budget-per-hour", help="The most evictions the defragmenter makes in any hour.")
    ] = 10,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run the controller: GPU-time budgets, shared device groups, other systems' resources (--compat), and the
    defragmenter (--defrag)."""
    from sharegpu.controller import runtime

    _logging(log_level, log_format)
    try:
        _check_election(lease_duration, renew_deadline, retry_period)
        if write_every <= 0:
            raise UsageError(f"--write-every must be > 0, got {write_every}")
        if defrag_budget_per_hour < 0:
            raise UsageError(f"--defrag-budget-per-hour must be >= 0, got {defrag_budget_per_hour}")
        if defrag and defrag_dry_run:
            raise UsageError("--defrag evicts and --defrag-dry-run only reports: give one of them")
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
    options = runtime.Options(
        kubeconfig=kubeconfig, host=host, health_port=health_port, leader_elect=leader_elect,
        lease_duration=lease_duration, renew_deadline=renew_deadline, retry_period=retry_period,
        identity=identity, write_every=write_every, image=image, compat=frozenset(c.value for c in compat or ()),
        defrag=defrag, defrag_dry_run=defrag_dry_run, defrag_budget_per_hour=defrag_budget_per_hour,
    )  # fmt: skip
    try:
        _serve(runtime.serve(options))
    except errors.SharegpuError as exc:
        raise _fail(exc) from None


@app.command("defrag")
def defrag_plan(
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run/--no-dry-run",
            help="Print the plan and evict nothing (the only mode here: the controller evicts, with --defrag).",
        ),
    ] = True,
    budget: Annotated[
        int, typer.Option("--budget", help="Evictions the plan may use (as the controller's hourly budget).")
    ] = 10,
    output: Annotated[Literal["text", "json"], typer.Option("--output", "-o", help="text or json.")] = "text",
    kubeconfig: Kubeconfig = None,
    request_timeout: Annotated[float, typer.Option("--request-timeout", help="Seconds per API request.")] = 30.0,
) -> None:
    """Plan the fewest evictions that let pending GPU pods fit, and print the plan and its gain (evicts nothing)."""
    from sharegpu.controller import defrag as defrag_mod
    from sharegpu.kube import client, credentials, transport
    from sharegpu.kube import errors as kube_errors

    try:
        if not dry_run:
            raise UsageError("sharegpu defrag only plans (--dry-run); run the controller with --defrag to evict")
        if budget < 0:
            raise UsageError(f"--budget must be >= 0, got {budget}")
        if request_timeout <= 0:
            raise UsageError(f"--request-timeout must be > 0, got {request_timeout}")
        creds = credentials.load(kubeconfig)
    except errors.SharegpuError as exc:
        raise _fail(exc) from None

    async def work() -> dict[str, Any]:
        api = client.KubeClient(transport.AiohttpTransport(creds, connections=4), creds, timeout=request_timeout)
        try:
            found = await defrag_mod.snapshot(api)
        finally:
            await api.close()
        result = defrag_mod.plan(found, budget)
        return {"lines": defrag_mod.describe(result, budget), "json": defrag_mod.to_json(result, budget)}

    try:
        shown = asyncio.run(work())
    except kube_errors.KubeError as exc:
        typer.echo(
            f"sharegpu: error: reading the cluster: {_first_line(exc)}",
            err=True,
        )
        raise typer.Exit(1) from None
    if output == "json":
        typer.echo(orjson.dumps(shown["json"], option=orjson.OPT_INDENT_2).decode())
    else:
        typer.echo("\n".join(shown["lines"]))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@app.command()
def reserve(
    kubeconfig: Annotated[str | None, typer.Option(help="kubeconfig file.", show_default="in-cluster")] = None,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run inside a reservation pod: report the GPU the device plugin gave it, then hold it."""
    from sharegpu.agent import reserve as reserve_mod

    _logging(log_level, log_format)
    try:
        asyncio.run(reserve_mod.main(kubeconfig))
    except errors.InvalidInputError as exc:
        raise _fail(exc) from None


@app.command()
def agent(
    node: Annotated[str, typer.Option(help="This node's name (in a DaemonSet: the downward API's spec.nodeName).")],
    fake_nvml: Annotated[
        Path | None, typer.Option(help="Read GPUs from this file instead of NVML (docs/agent.md: its format).")
    ] = None,
    kubeconfig: Kubeconfig = None,
    interval: Annotated[float, typer.Option(help="Seconds between inventory passes.", min=0.5)] = 10.0,
    mps: Annotated[
        bool, typer.Option("--mps", help="Run and supervise an MPS control daemon per GPU (isolation mode mps).")
    ] = False,
    mps_binary: Annotated[str, typer.Option(help="The MPS control daemon to run (a name on PATH or a path).")] = (
        "nvidia-cuda-mps-control"
    ),
    mps_root: Annotated[
        Path, typer.Option(help="Host folder of the daemons' pipe and log folders (pods mount it).")
    ] = Path("/run/sharegpu/mps"),
    hami_core_library: Annotated[
        str, typer.Option(help="HAMi-core's library: the node offers hami-core while it exists ('': never).")
    ] = "/usr/local/vgpu/libvgpu.so",
    hami_core_dir: Annotated[
        Path, typer.Option(help="Host folder the library is installed in for containers (the webhook mounts it).")
    ] = Path("/run/sharegpu/hami-core"),
    hami_core_enforces_compute: Annotated[
        bool,
        typer.Option(
            "--hami-core-enforces-compute",
            help="Say that this node's HAMi-core enforces compute shares (only where scripts/gpu-check measured it).",
        ),
    ] = False,
    isolation_probe: Annotated[
        bool,
        typer.Option(
            help="Offer hami-core and mps only after a probe proved here that they enforce a memory limit "
            "(off, or with --fake-nvml: offered unproven, and the Device says so)."
        ),
    ] = True,
    probe_libcuda: Annotated[
        str, typer.Option(help="The driver library the probe loads (a name the loader finds, or a path).")
    ] = "libcuda.so.1",
    probe_dir: Annotated[
        Path, typer.Option(help="A writable folder of the probe's own (its HAMi-core accounting file).")
    ] = Path("/run/sharegpu/probe"),
    on_violation: Annotated[
        ViolationAction,
        typer.Option(
            case_sensitive=False,
            help="When a pod uses more GPU memory than allocated, or a GPU it was not given: "
            "report (an event), kill (its processes) or evict (the pod).",
        ),
    ] = "report",
    slack_mib: Annotated[
        int, typer.Option(help="MiB a pod may exceed its GPU memory by before it violates.", min=0)
    ] = 0,
    proc: Annotated[Path, typer.Option(help="The node's /proc (the agent needs the host's PID namespace).")] = Path(
        "/proc"
    ),
    kubelet_socket: Annotated[
        str, typer.Option(help="The kubelet's PodResources socket, for drift repair ('': not checked).")
    ] = "/var/lib/kubelet/pod-resources/kubelet.sock",
    host: Annotated[str, typer.Option(help="Address of /healthz, /readyz and /metrics.")] = "0.0.0.0",
    health_port: Annotated[int, typer.Option(help="Port of /healthz, /readyz and /metrics (0: none).")] = 9403,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run the node agent: publish this node's GPUs and the isolation it offers as its Device resource.

    The GPUs come from NVML, or from the file --fake-nvml names; with --mps the agent runs an MPS
    control daemon per GPU."""
    from sharegpu.agent import fakenvml, nvml, podresources, proof, watchdog
    from sharegpu.agent import mps as agent_mps
    from sharegpu.agent import runtime as agent_runtime

    _logging(log_level, log_format)
    if not 0 <= health_port <= 65535:
        raise _fail(UsageError(f"--health-port must be 0..65535, got {health_port}"))
    source: agent_runtime.Source
    try:
        action = watchdog.Action.parse(on_violation)
        source = fakenvml.FakeNvml(fake_nvml).open() if fake_nvml is not None else nvml.Nvml().open()
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
    options = agent_runtime.Options(
        interval=interval, hami_core_library=Path(hami_core_library) if hami_core_library else None,
        hami_core_dir=hami_core_dir, on_violation=action, proc=proc, slack_mib=slack_mib,
        hami_core_compute=hami_core_enforces_compute,
    )  # fmt: skip
    supervisor = agent_mps.Supervisor(mps_binary, agent_mps.Layout(mps_root), proc=proc) if mps else None
    # A fake NVML has no GPU to probe: its modes are offered unproven.
    prover = proof.Prover(probe_dir, libcuda=probe_libcuda) if isolation_probe and fake_nvml is None else None
    kubelet = podresources.KubeletPodResources(Path(kubelet_socket), 5.0) if kubelet_socket else None
    address = (host, health_port) if health_port else None
    try:
        _serve(agent_runtime.serve(kubeconfig, node, source, options, supervisor=supervisor, kubelet=kubelet,
                                   prover=prover, health_address=address))  # fmt: skip
    except KeyboardInterrupt:
        pass
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
    finally:
        source.close()


@app.command("gpu-check")
def gpu_check(
    gpu: Annotated[int, typer.Option(help="Index of the GPU to check (as nvidia-smi numbers them).", min=0)] = 0,
    hami_core_library: Annotated[
        Path | None,
        typer.Option(help="Also check HAMi-core's limits with this library (the operator's own libvgpu.so)."),
    ] = None,
    mps_control: Annotated[str, typer.Option(help="The MPS control daemon to run (a name on PATH or a path).")] = (
        "nvidia-cuda-mps-control"
    ),
    seconds: Annotated[int, typer.Option(help="Seconds each compute measurement runs.", min=5)] = 6,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")] = None,
    libcuda: Annotated[str, typer.Option(help="The driver's CUDA library (a path or a soname).")] = "libcuda.so.1",
) -> None:
    """Check on this GPU machine what sharegpu's node side relies on: NVML, MPS's limits, HAMi-core's.

    Needs the driver and nvidia-smi, no CUDA toolkit; about a minute. Exit status 1 when a check FAILed.
    """
    from rich.markup import escape

    from sharegpu.agent import gpucheck, nvml

    try:
        inventory = nvml.Nvml().open()
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
    options = gpucheck.Options(gpu=gpu, seconds=seconds, hami_core_library=hami_core_library)
    parts = gpucheck.real_parts(
        inventory, libcuda=libcuda, mps_control=mps_control, progress=lambda text: typer.echo(f"... {text}", err=True)
    )
    try:
        report = asyncio.run(gpucheck.check(parts, options))
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        inventory.close()
    shown = report.gpu
    title = (
        f"sharegpu gpu-check: GPU {shown.index} {shown.model} {shown.uuid}, driver {shown.driver}, CUDA {shown.cuda}"
    )
    table = Table(title=escape(title))
    for column in ("check", "GPU", "result", "figures", "detail"):
        table.add_column(column, overflow="fold")
    colour = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}
    for name, where, result, figures, detail in gpucheck.rows(report):
        table.add_row(name, where, f"[{colour[result]}]{result}[/]", escape(figures), escape(detail))
    console = _console()
    console.print(table)
    if json_path is not None:
        try:
            json_path.write_bytes(orjson.dumps(gpucheck.to_json(report), option=orjson.OPT_INDENT_2))
        except OSError as exc:
            raise _fail(exc) from None
        console.print(f"wrote {json_path}")
    raise typer.Exit(report.exit_status())


DEFAULT_WEBHOOK_NAMES = (
    "sharegpu-webhook",
    "sharegpu-webhook.sharegpu-system",
    "sharegpu-webhook.sharegpu-system.svc",
    "sharegpu-webhook.sharegpu-system.svc.cluster.local",
)


@app.command()
def webhook(
    cert: Annotated[Path | None, typer.Option(help="Serving certificate (PEM); re-read when it changes.")] = None,
    key: Annotated[Path | None, typer.Option(help="Serving key (PEM).")] = None,
    bootstrap: Annotated[
        Path | None,
        typer.Option(
            help="Folder: make a CA and serving certificate there and write the CA bundle "
            "into the webhook configurations."
        ),
    ] = None,
    url: Annotated[str | None, typer.Option(help="With --bootstrap: register the webhooks at this https URL.")] = None,
    dns_name: Annotated[
        list[str] | None,
        typer.Option(
            help="With --bootstrap: a DNS name the API server reaches the webhook by (repeat).",
            show_default="the sharegpu-webhook Service's names, unless --ip-address is given",
        ),
    ] = None,
    ip_address: Annotated[
        list[str] | None, typer.Option(help="With --bootstrap: an IP address the API server reaches it by (repeat).")
    ] = None,
    kubeconfig: Annotated[
        str | None,
        typer.Option(
            help="kubeconfig (Device inventory, bootstrap).",
            show_default="$KUBECONFIG, ~/.kube/config, or in-cluster",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8443,
    system_user: Annotated[
        list[str] | None, typer.Option(help="Users allowed to set what only sharegpu may set (repeat).")
    ] = None,
    skip_namespace: Annotated[list[str] | None, typer.Option(help="Namespaces left alone (repeat).")] = None,
    agent_user: Annotated[
        list[str] | None,
        typer.Option(
            help="Node agents' users: each may write only its own node's Device (repeat).",
            show_default="system:serviceaccount:sharegpu-system:sharegpu-agent",
        ),
    ] = None,
    take_over: Annotated[
        list[str] | None,
        typer.Option(
            help="Schedulers whose GPU pods sharegpu schedules instead (repeat).",
            show_default="default-scheduler and the GPU schedulers sharegpu replaces: docs/admission.md",
        ),
    ] = None,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run the admission webhook: translate GPU requests, add the hand-off, validate, guard."""
    import ipaddress
    import urllib.parse

    from sharegpu.kube import client as kube_client
    from sharegpu.serving import certs
    from sharegpu.webhook import admission
    from sharegpu.webhook import config as webhook_config
    from sharegpu.webhook import server as webhook_server

    _logging(log_level, log_format)
    policy = admission.Policy()
    if system_user:
        policy = dataclasses.replace(policy, system_users=frozenset(system_user))
    if skip_namespace:
        policy = dataclasses.replace(policy, skip_namespaces=frozenset(skip_namespace))
    if agent_user:
        policy = dataclasses.replace(policy, agent_users=frozenset(agent_user))
    if take_over:
        policy = dataclasses.replace(policy, take_over=frozenset(take_over))
    dns_names = tuple(dns_name or (() if ip_address else DEFAULT_WEBHOOK_NAMES))
    ips = tuple(ip_address or ())
    try:
        if bootstrap is None and (cert is None or key is None):
            raise UsageError("give --cert and --key, or --bootstrap FOLDER")
        if bootstrap is None and (url or dns_name or ip_address):
            raise UsageError("--url, --dns-name and --ip-address go with --bootstrap")
        if url:
            parsed = urllib.parse.urlsplit(url)
            if parsed.scheme != "https" or not parsed.hostname:
                raise UsageError(f"--url must be an https URL, got {url!r}")
            target = parsed.hostname
            try:
                covered = str(ipaddress.ip_address(target)) in {str(ipaddress.ip_address(a)) for a in ips}
            except ValueError:
                covered = target in dns_names
            if not covered:
                raise UsageError(
                    f"--url host {target!r} is not among the certificate's names ({', '.join(dns_names + ips)}): "
                    "the API server would refuse the certificate; add it with --dns-name or --ip-address"
                )
        certs.subject_names(dns_names, ips)
    except errors.SharegpuError as exc:
        raise _fail(exc) from None

    async def run() -> None:
        nonlocal cert, key
        if bootstrap is not None:
            ca_cert, ca_key, _ = certs.write_ca(bootstrap, "sharegpu-webhook-ca")
            cert, key = certs.write_serving_pair(bootstrap, ca_cert, ca_key, dns_names=dns_names, ip_addresses=ips)
            async with kube_client.KubeClient.connect(kubeconfig) as kube:
                if url:
                    await webhook_config.install(kube, url, certs.pem(ca_cert))
                else:
                    await webhook_config.set_ca_bundle(kube, certs.pem(ca_cert))
        assert cert is not None and key is not None
        await webhook_server.serve(host, port, cert, key, webhook_server.Webhook(policy), kubeconfig)

    try:
        _serve(run())
    except errors.SharegpuError as exc:
        raise _fail(exc) from None


@app.command()
def devcluster(
    nodes: Annotated[int, typer.Option(help="Fake GPU nodes to create.")] = 4,
    gpus: Annotated[int, typer.Option(help="GPUs per node.")] = 4,
    model: Annotated[str, typer.Option(help="GPU model of every node.")] = "A100",
    gpu_memory: Annotated[int, typer.Option(help="GPU memory in MiB.")] = 81920,
    policy: Annotated[
        str, typer.Option(help="Placement policy of the extender.", autocompletion=_complete_policy)
    ] = policies.DEFAULT,
    workdir: Annotated[
        Path | None, typer.Option(help="Where to keep state and logs.", show_default="a new temporary folder")
    ] = None,
    webhook: Annotated[
        bool, typer.Option(help="Run the admission webhook too (translates other systems' GPU requests).")
    ] = True,
    controller: Annotated[bool, typer.Option(help="Run the controller too (GPU-time budgets).")] = True,
    compat: Annotated[
        list[Compat] | None,
        typer.Option(help="Serve another system's resources too (CRDs installed, controller told; repeat)."),
    ] = None,
) -> None:
    """Run the whole stack on this machine until Ctrl-C, and print the kubeconfig to use with kubectl.

    The stack: a real control plane, the extender, kube-scheduler, the admission webhook, the
    controller, and fake GPU nodes with an agent each."""
    import tempfile

    from sharegpu.core import devices
    from sharegpu.devcluster import stack

    _logging("warning")
    if not 1 <= nodes <= 5000 or not 1 <= gpus <= 63:
        raise _fail(UsageError("--nodes must be 1..5000 and --gpus 1..63"))
    try:
        policies.check(policy)
    except errors.SharegpuError as exc:
        raise _fail(exc) from None
    folder = workdir or Path(tempfile.mkdtemp(prefix="sharegpu-devcluster-"))

    async def bring_up(whole: stack.Stack) -> None:
        await whole.start(harness=True)
        assert whole.harness is not None and whole.extender is not None
        fleet = [
            devices.uniform_node(
                f"gpu-node-{i}",
                gpu_count=gpus,
                model=model,
                gpu_memory_mib=gpu_memory,
                cpu_milli=64000,
                memory_mib=512 * 1024,
                nvlink_all=gpus <= 8,
            )
            for i in range(nodes)
        ]
        nvml_files = await whole.add_gpu_nodes(fleet)
        console = _console()
        console.print(f"[bold]sharegpu devcluster[/bold]: {nodes} nodes x {gpus} {model}")
        console.print(f"  agents: one per node; edit its fake NVML file in {nvml_files} (docs/agent.md)")
        console.print(f"  export KUBECONFIG={whole.plane.kubeconfig('admin')}")
        console.print(f"  extender: {whole.extender.health_url}/debug/nodes   logs: {folder / 'logs'}")
        if whole.controller is not None:
            console.print(f"  controller: {whole.controller.health_url}/debug/budgets")
        if whole.webhook is not None:
            console.print(f"  webhook: {whole.webhook.url} (GPU pods in any format are scheduled by sharegpu)")
            console.print("  Ctrl-C stops everything", highlight=False)
        else:
            console.print("  pods use schedulerName: sharegpu-scheduler; Ctrl-C stops everything", highlight=False)
        console.file.flush()

    async def run() -> None:
        # Signals are handled from the first moment: Ctrl-C while the control plane starts stops
        # what has started, and never leaves a process behind.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        whole = stack.Stack(
            folder, policy, webhook=webhook, controller=controller, compat=tuple(c.value for c in compat or ())
        )
        starting = asyncio.create_task(bring_up(whole))
        waiting = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # a start-up failure is reported, after everything is stopped
                await waiting
        finally:
            for task in (starting, waiting):
                task.cancel()
            await asyncio.gather(starting, waiting, return_exceptions=True)
            await whole.stop()

    try:
        asyncio.run(run())
    except (errors.SharegpuError, RuntimeError) as exc:
        raise _fail(exc) from None


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the GPU a record is about when it names
    one (`extra={"gpu": uuid}`, as the MPS daemons' relayed lines do), and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        gpu = getattr(record, "gpu", None)
        if isinstance(gpu, str):
            entry["gpu"] = gpu
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


class TextFormatter(logging.Formatter):
    """One plain line per record for a person at a terminal: time, level, logger, message (and the
    traceback below it when there is one)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")


def _logging(level: LogLevel, log_format: LogFormat = "auto", stream: TextIO | None = None) -> None:
    """Logs on `stream` (stderr), replacing any handler set before (a test may call it repeatedly)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    text = log_format == "text" or (log_format == "auto" and _is_terminal(handler.stream))
    handler.setFormatter(TextFormatter() if text else JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _serve(main: Coroutine[Any, Any, None]) -> None:
    """Run a long-lived server on uvloop: its event loop and TLS handling cost a fraction of
    asyncio's, which is most of what the extender spends per pod (bench/e2e_throughput.py)."""
    import uvloop

    uvloop.run(main)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
