"""Gangs in the simulator: sharegpu's gang placement beside Volcano's, KAI's and none at all.

Runs `sharegpu.sim.gangs` (jobs of single pods and gangs on the synthetic cluster, docs/simulation.md
states the workload) for every gang policy and seed, prints the means, and writes the runs as JSON
and the table into docs/simulation.md between the `gang-table` markers.

    python bench/gang_sim.py [--seeds 1-5] [--jobs 1500] [--gap 10] [--gang-share 0.2] [--json PATH] [--no-docs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from sharegpu.sim import gangs

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "simulation.md"
BEGIN, END = "<!-- gang-table:begin -->", "<!-- gang-table:end -->"
COLUMNS = (
    ("gang_wait_p50_s", "gang wait p50 (s)", 0),
    ("gang_wait_p99_s", "gang wait p99 (s)", 0),
    ("single_wait_p50_s", "single pod wait p50 (s)", 0),
    ("partial_gpu_hours", "GPU-hours held by incomplete gangs", 1),
    ("mean_allocated_gpu_pct", "allocated GPU %", 1),
    ("mean_frag_gpu_pct", "fragmented GPU % while jobs wait", 2),
    ("nodes_per_gang", "nodes per gang", 2),
    ("stuck", "jobs never started", 1),
)


def seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def table(means: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    head = "| gang policy | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|---|" + "---:|" * len(COLUMNS)
    rows = [
        f"| {policy} | " + " | ".join(f"{means[policy][key]:.{digits}f}" for key, _, digits in COLUMNS) + " |"
        for policy in means
    ]
    command = (f"python bench/gang_sim.py --seeds {args.seeds} --jobs {args.jobs} --gap {args.gap} "
               f"--gang-share {args.gang_share}")  # fmt: skip
    return "\n".join([head, rule, *rows, "", f"Means over seeds {args.seeds}; made by `{command}`."])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1-5")
    parser.add_argument("--jobs", type=int, default=1500)
    parser.add_argument("--gap", type=float, default=10.0, help="mean seconds between job arrivals")
    parser.add_argument("--gang-share", type=float, default=0.2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    runs = []
    means: dict[str, dict[str, float]] = {}
    for policy in gangs.POLICIES:
        mine = [gangs.run(policy, seed, args.jobs, args.gang_share, args.gap) for seed in seeds(args.seeds)]
        runs += mine
        means[policy] = {key: statistics.fmean(getattr(r, key) for r in mine) for key, _, _ in COLUMNS}
        print(policy, {k: round(v, 2) for k, v in means[policy].items()}, flush=True)
    text = table(means, args)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": [dataclasses.asdict(r) for r in runs], "means": means}, indent=1))
    if not args.no_docs:
        doc = DOC.read_text()
        if BEGIN not in doc:
            print(f"{DOC} has no {BEGIN} marker", file=sys.stderr)
            return 1
        head, rest = doc.split(BEGIN, 1)
        DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
