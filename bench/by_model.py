"""Where a policy leaves GPUs idle, by GPU model: the paper's replay of an openb trace (tune 1.3,
arrivals only), stopped when the arrived GPU request first reaches the cluster's capacity; then per
model its GPUs, how many of them are free (in GPUs of compute), and how many GPUs' worth of pods that
name no model were put there; and the pods that failed by then, those naming models apart.

A policy that spends a scarce model on pods that could run anywhere leaves the pods that can run only
there without a GPU while other models sit idle; this shows it (docs/simulation.md reads KAI's result
on gpuspec20 with it).

    python bench/by_model.py --trace gpuspec20 --policies kai-binpack,fgd-balance [--seeds 42,43]
        [--openb DIR] [--json PATH]

Writes {"runs": [{"trace", "policy", "seed", "free_pct", "failed": {"restricted", "any"},
"models": {model: {"gpus", "free_gpus", "unrestricted_gpus"}}}]}.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from sharegpu.core import devices, fleet, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from sharegpu.sim import catalog, replay, trace

HERE = Path(__file__).resolve().parent
Json = dict[str, Any]


def one(nodes: list[devices.NodeInventory], pods: trace.Trace, name: str, policy: str, seed: int) -> Json:
    state = fleet.FleetState(nodes)
    workload = replay.build_workload(pods.pods, state.total_milli, len(nodes), 1.3, seed)
    ledger = core_ledger.Ledger(state)
    chooser = core_placer.Placer(
        state, catalog.make(policy, pods.typical_shapes()), priority=workload.node_priority, seed=seed
    )
    arrived = 0
    failed: Counter[str] = Counter()
    unrestricted: Counter[str] = Counter()
    for i, pod in enumerate(workload.pods):
        arrived += pod.gpu_milli_total
        decision = chooser.place(ledger, pod.request(f"{pod.name}#{i}"))
        if pod.num_gpu and not decision.status.ok:
            failed["restricted" if pod.models else "any"] += 1
        elif pod.num_gpu and not pod.models and decision.node is not None:
            row = state.row_of[str(decision.node)]
            for index in decision.gpus:
                unrestricted[state.model_names[int(state.model_id[row, index])]] += pod.gpu_milli
        if arrived >= state.total_milli:
            break
    models: Json = {}
    for model_id, model in enumerate(state.model_names):
        mask = state.present & (state.model_id == model_id)
        models[model] = {
            "gpus": int(mask.sum()),
            "free_gpus": round(int(state.milli_free[mask].sum()) / units.MILLI_PER_GPU, 1),
            "unrestricted_gpus": round(unrestricted[model] / units.MILLI_PER_GPU, 1),
        }
    free = int(state.milli_free[state.present].sum())
    return {
        "trace": name,
        "policy": policy,
        "seed": seed,
        "free_pct": round(100 * free / state.total_milli, 2),
        "failed": {"restricted": failed["restricted"], "any": failed["any"]},
        "models": dict(sorted(models.items(), key=lambda kv: -kv[1]["free_gpus"])),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openb", type=Path, default=HERE.parent.parent / "shared" / "traces" / "openb")
    parser.add_argument("--trace", default="gpuspec20", help="openb pod trace: openb_pod_list_<TRACE>.csv")
    parser.add_argument("--policies", default="kai-binpack,fgd-balance")
    parser.add_argument("--seeds", default="42,43", help="comma-separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    nodes = trace.load_nodes(args.openb / "openb_node_list_gpu_node.csv")
    pods = trace.load_pods(args.openb / f"openb_pod_list_{args.trace}.csv")
    runs = []
    for policy in args.policies.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            run = one(nodes, pods, args.trace, catalog.check(policy), seed)
            runs.append(run)
            failed = run["failed"]
            print(f"{args.trace} {run['policy']} seed {seed}: {run['free_pct']:.2f}% of the GPUs free; failed pods: "
                  f"{failed['restricted']} naming models, {failed['any']} not")  # fmt: skip
            for model, row in run["models"].items():
                print(f"  {model:>8}: {row['gpus']:5d} GPUs, {row['free_gpus']:7.1f} free "
                      f"({100 * row['free_gpus'] / max(row['gpus'], 1):4.1f}%), "
                      f"{row['unrestricted_gpus']:7.1f} given to pods naming no model")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
