"""The full openb table: every policy x every openb trace, beside the paper's figures and the limit.

Runs the paper's method (tune 1.3, arrivals only, seeds 42..51 by default) through `sharegpu.sim`
and writes a markdown table of our figures beside the paper's (for the traces it published) into
docs/simulation.md (between the `openb-table` markers), plus the raw runs as JSON. With
`--bound-json` (written by `sharegpu bound ... --json`), two more columns: the proven lower bound and
the offline heuristic, over the seeds that file holds. A last row gives, per policy, the mean over
traces of its ratio to fgd.

    python bench/openb_table.py [--openb DIR] [--seeds 42-51] [--policies ...] [--traces ...]
        [--bound-json PATH] [--json PATH] [--no-docs]

With `--peers`, the table users choosing a scheduler need: sharegpu's default policy beside each
peer's default (`core.peers`: HAMi, Koordinator, Volcano, Aliyun gpushare, KAI), each cell with its
ratio to sharegpu's, written between the `peers-table` markers of docs/simulation.md and the README.
Its bound and offline heuristic columns come from `--bound-json`, or else from the openb table
already in the docs (the same traces and seeds).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from sharegpu import cli
from sharegpu.core import policies as core_policies
from sharegpu.core.policies import PAPER_POLICIES
from sharegpu.sim import catalog, peers, report, runner
from sharegpu.sim.trace import NODE_FILE, OPENB_TRACES, pod_file

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "simulation.md"
README = HERE.parent / "README.md"
BEGIN, END = "<!-- openb-table:begin -->", "<!-- openb-table:end -->"
PEERS_BEGIN, PEERS_END = "<!-- peers-table:begin -->", "<!-- peers-table:end -->"

# Unallocated GPU % at arrived = 100% (mean over seeds 42..51), from the paper (openb README).
PAPER = {
    "default": (13.70, 9.38, 8.35, 8.22, 7.14, 4.77),
    "gpushare40": (15.14, 10.70, 10.24, 10.23, 8.56, 6.04),
    "gpushare60": (17.19, 13.18, 13.10, 12.85, 10.94, 8.74),
    "gpushare80": (19.38, 15.86, 15.50, 15.35, 13.34, 10.92),
    "multigpu20": (13.08, 8.15, 6.66, 6.50, 6.27, 4.47),
    "multigpu30": (13.37, 6.89, 5.45, 5.30, 5.43, 3.64),
    "gpuspec10": (13.74, 9.83, 8.04, 7.76, 6.90, 5.34),
    "gpuspec20": (14.10, 11.71, 10.89, 10.72, 11.54, 5.34),
    "cpu050": (10.98, 6.97, 6.48, 6.54, 6.44, 5.00),
    "cpu100": (12.56, 8.27, 7.58, 7.50, 6.74, 4.79),
    "cpu200": (16.97, 12.54, 10.33, 10.02, 7.85, 5.18),
}
TRACES = (
    *PAPER,
    *(t for t in OPENB_TRACES if t not in PAPER),
)  # the first eleven have published figures; the other three (gpushare20, gpuspec05, cpu0) were not tabulated
BOUND_COLUMNS = (("lower_bound_unallocated_pct", "bound"), ("offline_heuristic_unallocated_pct", "offline heuristic"))


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f}±{spread:.2f}"


def documented_bound_cells(text: str) -> dict[str, list[str]]:
    """The bound and offline heuristic cells per trace, as the openb table in the docs shows them."""
    table = text[text.index(BEGIN) : text.index(END)].splitlines()
    header = next(line for line in table if line.startswith("| trace |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    out: dict[str, list[str]] = {}
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(columns) or cells[0] in ("trace", "---") or cells[0].startswith(("*", "-")):
            continue
        row = dict(zip(columns, cells, strict=True))
        if all(title in row for _, title in BOUND_COLUMNS):
            out[row["trace"]] = [row[title] for _, title in BOUND_COLUMNS]
    return out


def documented_bounds(text: str) -> list[dict[str, object]]:
    """The bound and offline heuristic means per trace from the openb table in the docs, as runs."""
    return [
        {
            "trace": trace,
            "seed": 0,
            **{key: float(cell.split("±")[0]) for (key, _), cell in zip(BOUND_COLUMNS, cells, strict=True)},
        }
        for trace, cells in documented_bound_cells(text).items()
    ]


def peers_markdown(
    results: list[runner.RunResult], policies: list[str], traces: list[str], seeds: int, made: str,
    bounds: list[dict[str, object]], bounds_from: str,
) -> str:  # fmt: skip
    """sharegpu's default (the first policy) beside the peers', each cell with its ratio to it."""
    figures: dict[tuple[str, str], list[float]] = {}
    for r in results:
        if r.unallocated_gpu_pct_at_arrived_100 is not None:
            figures.setdefault((r.trace, r.policy), []).append(r.unallocated_gpu_pct_at_arrived_100)
    ours = policies[0]
    gathered: dict[tuple[str, str], list[float]] = {}
    for run in bounds:
        for key, _ in BOUND_COLUMNS:
            gathered.setdefault((str(run["trace"]), key), []).append(float(str(run[key])))
    limits = {where: statistics.fmean(values) for where, values in gathered.items()}
    extra = [title for _, title in BOUND_COLUMNS] if bounds else []
    titles = [f"{p} ({catalog.REGISTRY[p].system})" for p in policies]
    lines = ["| trace | " + " | ".join([*titles, *extra]) + " |", "|---" * (len(policies) + len(extra) + 1) + "|"]
    ratios: dict[str, list[float]] = {p: [] for p in policies}
    for trace in traces:
        base = figures.get((trace, ours))
        cells = []
        for policy in policies:
            found = figures.get((trace, policy), [])
            cell = _cell(found)
            if found and base:
                ratio = statistics.fmean(found) / statistics.fmean(base)
                ratios[policy].append(ratio)
                if policy != ours:
                    cell += f" (×{ratio:.2f})"
            cells.append(cell)
        cells += [f"{limits[(trace, key)]:.2f}" if (trace, key) in limits else "-" for key, _ in BOUND_COLUMNS][
            : len(extra)
        ]
        lines.append(f"| {trace} | " + " | ".join(cells) + " |")
    means = [f"×{statistics.fmean(ratios[p]):.2f}" if ratios[p] else "-" for p in policies]
    lines.append(f"| *mean ratio to {ours}* | " + " | ".join([*means, *([""] * len(extra))]) + " |")
    return (
        f"Unallocated GPU % at arrived = 100%, mean±sd over {seeds} seeds, and in parentheses the ratio to "
        f"sharegpu's default `{ours}` (above 1: more GPUs left idle). {made}. Bound and offline heuristic: "
        f"{bounds_from}.\n\n" + "\n".join(lines)
    )


def markdown(
    results: list[runner.RunResult],
    policies: list[str],
    traces: list[str],
    seeds: int,
    made: str,
    bounds: list[dict[str, object]],
    bound_cells: dict[str, list[str]] | None = None,
) -> str:
    """The openb table; the bound columns from `bounds` (runs of `sharegpu bound --json`) or, failing
    those, as `bound_cells` (per trace, already rendered: the table in the docs) give them."""
    figures: dict[tuple[str, str], list[float]] = {}
    for r in results:
        if r.unallocated_gpu_pct_at_arrived_100 is not None:
            figures.setdefault((r.trace, r.policy), []).append(r.unallocated_gpu_pct_at_arrived_100)
    limits: dict[tuple[str, str], list[float]] = {}
    for run in bounds:
        for key, _ in BOUND_COLUMNS:
            limits.setdefault((str(run["trace"]), key), []).append(float(str(run[key])))
    extra = [title for _, title in BOUND_COLUMNS] if bounds or bound_cells else []
    lines = ["| trace | " + " | ".join([*policies, *extra]) + " |", "|---" * (len(policies) + len(extra) + 1) + "|"]
    for trace in traces:
        cells = []
        for policy in policies:
            ours = _cell(figures.get((trace, policy), []))
            if policy in PAPER_POLICIES and trace in PAPER:
                ours += f" ({PAPER[trace][PAPER_POLICIES.index(policy)]:.2f})"
            cells.append(ours)
        if bounds:
            for key, _ in BOUND_COLUMNS:
                found = limits.get((trace, key), [])
                cells.append(_cell(found) + (f" ({len(found)} seeds)" if len(found) != seeds else ""))
        elif bound_cells:
            cells += bound_cells.get(trace, ["-"] * len(BOUND_COLUMNS))
        lines.append(f"| {trace} | " + " | ".join(cells) + " |")
    if "fgd" in policies:
        ratios = []
        for policy in policies:
            per_trace = [
                statistics.fmean(figures[(t, policy)]) / statistics.fmean(figures[(t, "fgd")])
                for t in traces
                if figures.get((t, policy)) and figures.get((t, "fgd"))
            ]
            ratios.append(f"{statistics.fmean(per_trace):.3f}" if per_trace else "-")
        lines.append("| *mean of per-trace ratios to fgd* | " + " | ".join([*ratios, *([""] * len(extra))]) + " |")
    if bounds:
        made += "; bound and offline heuristic by `sharegpu bound` (see below)"
    elif bound_cells:
        made += "; bound and offline heuristic as the table this one replaced gave them (`sharegpu bound`, see below)"
    return (
        f"Unallocated GPU % at arrived = 100%, ours as mean±sd over {seeds} seeds, the paper's mean in "
        f"parentheses where it published one. {made}.\n\n" + "\n".join(lines)
    )


PATHS = {"--openb": "DIR", "--json": "runs.json", "--from-json": "runs.json", "--bound-json": "bound.json"}
"""Options whose values are paths of the machine that made a table: a reader's own go there."""


def portable(argv: list[str]) -> str:
    """The command as a reader would run it: paths of this machine given as placeholders."""
    out: list[str] = []
    seen: dict[str, int] = {}

    def placeholder(option: str) -> str:
        seen[option] = seen.get(option, 0) + 1
        stem, dot, suffix = PATHS[option].rpartition(".")
        return PATHS[option] if seen[option] == 1 or not dot else f"{stem}-{seen[option]}.{suffix}"

    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if i and argv[i - 1] in PATHS:
            out.append(placeholder(argv[i - 1]))
        elif "=" in arg and name in PATHS:
            out.append(f"{name}={placeholder(name)}")
        else:
            out.append(arg)
    return ("python bench/openb_table.py " + shlex.join(out)).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openb", type=Path, default=HERE.parent.parent / "shared" / "traces" / "openb")
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--policies", help="default: the paper's, fgd-used, fgd-balance, fgd-fill and fgd-lp; "
                        "with --peers, sharegpu's default and each peer's")  # fmt: skip
    parser.add_argument("--peers", action="store_true", help="sharegpu's default beside the peers' (module docstring)")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument(
        "--bound-json", type=Path, action="append", help="runs of `sharegpu bound --json` to add as columns (repeat)"
    )
    parser.add_argument("--jobs", type=int, default=0, help="worker processes (0: one per core)")
    parser.add_argument(
        "--dask", metavar="ADDRESS", help="run on the Dask cluster whose scheduler is at ADDRESS (sim.cluster)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-docs", action="store_true", help="print the table only; leave docs/ alone")
    parser.add_argument(
        "--from-json", type=Path, help="make the table from the runs an earlier --json wrote instead of running"
    )
    args = parser.parse_args()
    seeds = cli.parse_seeds(args.seeds)
    chosen = args.policies or ",".join(
        (core_policies.DEFAULT, *peers.DEFAULTS)
        if args.peers
        else (*PAPER_POLICIES, "fgd-used", "fgd-balance", "fgd-fill", "fgd-lp")
    )
    policies = cli.parse_policies([chosen])
    nodes = args.openb / NODE_FILE
    if not nodes.is_file():
        print(f"bench/openb_table.py: error: {nodes} not found (use --openb DIR)", file=sys.stderr)
        return 2
    traces = args.traces.split(",")
    sources = [runner.Source(t, str(nodes), str(args.openb / pod_file(t))) for t in traces]
    # One run per (trace, seed), however many files hold it.
    found = {(r["trace"], r["seed"]): r for path in args.bound_json or [] for r in json.loads(path.read_text())["runs"]}
    bounds = list(found.values())
    specs = [runner.RunSpec(s, p, seed) for s in sources for p in policies for seed in seeds]
    started = time.perf_counter()
    done = 0

    def progress(result: runner.RunResult) -> None:
        nonlocal done
        done += 1
        print(
            f"[{done}/{len(specs)}] {result.trace} {result.policy} seed {result.seed}: "
            f"{result.unallocated_gpu_pct_at_arrived_100} ({result.wall_seconds:.1f} s)",
            flush=True,
        )

    command = portable(sys.argv[1:])
    if args.from_json:
        earlier = json.loads(args.from_json.read_text())
        results = [runner.RunResult(**run) for run in earlier["runs"]]
        minutes = sum(r.wall_seconds for r in results) / 60
        earlier_command = portable(shlex.split(earlier["command"])[2:])
        made = f"Runs made by `{earlier_command}` ({minutes:.0f} minutes of runs), rendered by `{command}`"
    else:
        if args.dask:
            from sharegpu.sim import cluster

            results = cluster.run_on_dask(specs, args.dask, progress)
        else:
            results = runner.run_all(specs, args.jobs or None, progress)
        where = f"the Dask cluster at {args.dask}" if args.dask else "this machine's cores"
        made = f"Made by `{command}` in {(time.perf_counter() - started) / 60:.1f} minutes on {where}"
    begin, end = (PEERS_BEGIN, PEERS_END) if args.peers else (BEGIN, END)
    if args.peers:
        bounds_from = "`sharegpu bound`, the runs in " + ", ".join(str(p) for p in args.bound_json or [])
        if not bounds:
            bounds, bounds_from = documented_bounds(DOC.read_text()), "as in the openb table above (the same runs)"
        table = peers_markdown(results, policies, traces, len(seeds), made, bounds, bounds_from)
    else:
        kept = None if bounds else documented_bound_cells(DOC.read_text())
        table = markdown(results, policies, traces, len(seeds), made, bounds, kept)
    print(table)
    if args.json:
        args.json.write_bytes(report.to_json(results, command))
    if not args.no_docs:
        for doc in (DOC, README) if args.peers else (DOC,):  # the README carries the peers' table too
            text = doc.read_text()
            start, stop = text.index(begin) + len(begin), text.index(end)
            doc.write_text(text[:start] + "\n" + table + "\n" + text[stop:])
            print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
