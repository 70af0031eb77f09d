"""The defragmenter's plans in words for people: log lines and `sharegpu defrag`'s text, and its JSON."""

from __future__ import annotations

from typing import Any

from sharegpu.core import allocation, defrag


def victim_text(victim: defrag.Victim) -> str:
    gpus = ",".join(f"gpu{i} {m}m" for i, (m, _) in victim.before.gpu_usage().items())
    owner = f", {victim.owner}" if victim.owner else ""
    return f"{victim.pod} ({victim.before.node} {gpus}{owner})"


def describe(result: defrag.Plan, evictions: int) -> list[str]:
    """The plan in lines: each move, then the pending pods without one, then the totals."""
    lines = []
    for move in result.moves:
        gpus = ",".join(f"gpu{i}" for i in move.placed.gpu_indices)
        lines.append(f"{move.pod}: to {move.placed.node} {gpus} ({move.gain_milli} milli-GPU), evicting:")
        lines.extend(f"  {victim_text(v)} -> fits on {v.after.node}" for v in move.victims)
    lines.extend(f"{s.pod}: no move ({s.why.value}: {s.detail})" for s in result.skipped)
    lines.append(
        f"plan: {result.evictions} eviction(s) of {evictions} allowed, gain {result.gain_milli} milli-GPU "
        f"placed for {len(result.moves)} pending pod(s)"
    )
    return lines


def to_json(result: defrag.Plan, evictions: int) -> dict[str, Any]:
    def alloc(a: allocation.Allocation) -> dict[str, Any]:
        return {"node": a.node, "gpus": [{"index": i, "milli": m} for i, (m, _) in a.gpu_usage().items()]}

    return {
        "moves": [
            {"pod": m.pod, "to": alloc(m.placed), "gainMilli": m.gain_milli,
             "victims": [{"pod": v.pod, "owner": v.owner, "from": alloc(v.before), "fitsOn": v.after.node}
                         for v in m.victims]}
            for m in result.moves
        ],
        "skipped": [{"pod": s.pod, "reason": s.why.value, "detail": s.detail} for s in result.skipped],
        "evictions": result.evictions,
        "evictionsAllowed": evictions,
        "gainMilli": result.gain_milli,
    }  # fmt: skip
