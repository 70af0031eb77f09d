"""docs/metrics.md lists, for each labelled counter of the extender and the webhook, the values its
labels take: every one of them is served at 0 from the start, so the table is held to the code here."""

from __future__ import annotations

import re
from pathlib import Path

import prometheus_client

from sharegpu.extender import metrics as extender_metrics
from sharegpu.webhook import admission, server

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(sharegpu_[a-z_]+_total)` \| counter \| ([^|]*) \|", re.MULTILINE)
LABEL = re.compile(r"`(\w+)` \(([^)]*)\)")


def documented() -> dict[str, dict[str, set[str]]]:
    """Per counter row of the doc: each label named with its values in parentheses, and those values."""
    return {
        name: {label: set(re.findall(r"`([^`]+)`", values)) for label, values in LABEL.findall(cell)}
        for name, cell in ROW.findall(DOC.read_text())
    }


def served(registry: prometheus_client.CollectorRegistry) -> dict[str, dict[str, set[str]]]:
    """Per labelled counter of a fresh registry: each label and the values its series carry."""
    out: dict[str, dict[str, set[str]]] = {}
    for family in registry.collect():
        for s in family.samples:
            if family.type == "counter" and s.name.endswith("_total") and s.labels:
                for label, value in s.labels.items():
                    out.setdefault(s.name, {}).setdefault(label, set()).add(value)
    return out


def test_the_doc_lists_exactly_the_values_each_counter_serves() -> None:
    rows = documented()
    found = served(extender_metrics.Metrics().registry) | served(
        server.Webhook(admission.Policy(system_users=frozenset())).metrics.registry
    )
    assert len(found) == 13, sorted(found)  # 12 of the extender, 1 of the webhook
    for name, labels in found.items():
        assert name in rows, f"{name}: no row in docs/metrics.md"
        assert rows[name] == labels, f"{name}: docs/metrics.md lists {rows[name]}, the code serves {labels}"
