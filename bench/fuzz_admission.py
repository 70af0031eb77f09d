"""Admission fuzzing at volume: malformed reviews and pods through the webhook's handler.

Every case must get a well-formed AdmissionReview response, never a crash, and never an allow for
an invalid GPU request (sharegpu.devcluster.fuzz says what counts). Prints cases/s and failures.

    python bench/fuzz_admission.py --n 20000 [--seed 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

from sharegpu.webhook import admission, fuzz, server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    policy = admission.Policy(system_users=frozenset({"sharegpu-extender"}), largest_gpu_memory_mib=81920)
    rng = random.Random(args.seed)
    failures: list[str] = []
    outcomes: Counter[str] = Counter()
    started = time.perf_counter()
    for _ in range(args.n):
        kind, body = fuzz.case(rng)
        response = server.handle_review(kind, body, policy)
        problems = fuzz.violations(kind, body, response)
        allowed = isinstance(response, dict) and (response.get("response") or {}).get("allowed")
        outcomes[f"{kind} {'allowed' if allowed else 'refused'}"] += 1
        if problems:
            failures.append(f"{kind}: {problems[0]}")
    elapsed = time.perf_counter() - started
    rate = args.n / elapsed
    print(f"{args.n} cases in {elapsed:.1f} s: {rate:.0f} cases/s, {len(failures)} failures")
    print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))
    for line in failures[:10]:
        print(f"  FAIL {line}")
    if args.json:
        args.json.write_text(
            json.dumps({"cases": args.n, "failures": len(failures), "cases_per_second": round(rate, 1)})
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
