"""The plugin's views as rich tables and text for people, and as JSON for programs. Pure.

JSON output is a contract: every document has `kind` and `version` (1), field names are camelCase
as in the Kubernetes API, quantities are integers in the units their names say (milli-GPU, MiB,
milli-CPU, GPU-seconds), and fields are only ever added. Tables are for reading and may change.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any, Final

import orjson
from rich.console import Console, Group, RenderableType
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

from sharegpu.kubectl import views

VERSION: Final = 1
"""The version of every JSON document the plugin prints."""
BAR_WIDTH: Final = 20
STATE_STYLES: Final = {"Within": "green", "Warning": "yellow", "Exhausted": "red"}

Json = dict[str, Any]


def dumps(document: Json) -> str:
    return orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n"


def console(**options: Any) -> Console:
    """A console for the plugin's output: no markup is read in its text (the cluster's strings, a
    pod or model named `[link=https://...]`, are shown as they are, never parsed as styles or links)."""
    return Console(markup=False, highlight=False, **options)


def printable(where: Console, renderable: RenderableType, *, soft_wrap: bool = False) -> Segments:
    """`renderable` rendered for `where` (`soft_wrap`: long lines left whole, as `print` leaves them)
    with every control character in its text replaced: a name a compromised node wrote (`\x1b]0;...`)
    reaches the terminal as text, not as an escape sequence. Only sharegpu's own styles, which the
    console turns into escapes itself, remain."""
    options = where.options.update(no_wrap=True, overflow="ignore") if soft_wrap else where.options
    return Segments(
        segment if segment.control else Segment(_CONTROL.sub("\ufffd", segment.text), segment.style)
        for segment in where.render(renderable, options)
    )


_CONTROL: Final = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 and C1 control characters but tab and newline, and DEL."""


def plain(renderable: RenderableType, width: int = 200) -> str:
    """What `renderable` prints on a terminal of `width` columns, without colour (tests, docs)."""
    buffer = io.StringIO()
    shown = console(file=buffer, width=width, color_system=None, soft_wrap=False)
    shown.print(printable(shown, renderable))
    return "".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines())


def percent(used: int, total: int) -> int:
    return used * 100 // total if total > 0 else 0


def bar(used: int, total: int, width: int = BAR_WIDTH) -> str:
    """A usage bar: `████████░░░░░░░░░░░░  40%` (full, with the real share, when over)."""
    filled = min(width, (used * width + total // 2) // total) if total > 0 else 0
    return "█" * filled + "░" * (width - filled) + f" {percent(used, total):>3}%"


def _share_style(used: int, total: int) -> str:
    share = percent(used, total)
    return "red" if share >= 100 else "yellow" if share >= 80 else "green"


# ----------------------------------------------------------------- inspect


def inventory_json(inventory: views.Inventory) -> Json:
    totals = inventory.totals()
    return {
        "kind": "GPUInventory",
        "version": VERSION,
        "nodes": [
            {
                "name": node.name,
                "cpuMilli": {"capacity": node.cpu_capacity, "free": node.cpu_free},
                "memoryMiB": {"capacity": node.memory_capacity, "free": node.memory_free},
                "gpus": [
                    {
                        "index": gpu.index,
                        "uuid": gpu.uuid,
                        "model": gpu.model,
                        "healthy": gpu.healthy,
                        "reason": gpu.reason,
                        "milli": {"capacity": gpu.milli_capacity, "used": gpu.milli_used, "free": gpu.milli_free},
                        "memoryMiB": {
                            "capacity": gpu.memory_capacity,
                            "used": gpu.memory_used,
                            "free": gpu.memory_free,
                        },
                        "pods": [
                            {"pod": h.pod, "milli": h.milli, "memoryMiB": h.memory_mib, "phase": h.phase}
                            for h in gpu.holders
                        ],
                        "reservation": None
                        if gpu.reservation is None
                        else {"pod": gpu.reservation, "uuid": gpu.reservation_uuid},
                        "overcommitted": list(gpu.overcommitted),
                    }
                    for gpu in node.gpus
                ],
            }
            for node in inventory.nodes
        ],
        "totals": {
            "gpus": totals.gpus,
            "entirelyFree": totals.whole_free,
            "milli": {
                "capacity": totals.milli_capacity,
                "used": totals.milli_used,
                "free": totals.milli_capacity - totals.milli_used,
            },
            "memoryMiB": {
                "capacity": totals.memory_capacity,
                "used": totals.memory_used,
                "free": totals.memory_capacity - totals.memory_used,
            },
        },
        "ignoredNodes": [{"name": name, "reason": why} for name, why in inventory.ignored],
        "conflicts": inventory.conflicts,
    }


def _holder(h: views.Holder) -> str:
    text = f"{h.pod} {h.milli}m {h.memory_mib}Mi"
    return text if h.phase == "Added" else f"{text} ({h.phase.lower()})"


def inventory_table(inventory: views.Inventory, wide: bool = False) -> RenderableType:
    """One row per GPU: model, compute and memory used of total and free, and who holds it."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NODE", "GPU", "MODEL", "COMPUTE (m)", "FREE", "MEMORY (MiB)", "FREE", "PODS"):
        table.add_column(column, justify="right" if column in ("GPU", "FREE") else "left", no_wrap=column != "PODS")
    if wide:
        table.add_column("UUID", no_wrap=True)
        table.add_column("RESERVATION")
    for node in inventory.nodes:
        for position, gpu in enumerate(node.gpus):
            model = gpu.model if gpu.healthy else f"{gpu.model} (unhealthy{': ' + gpu.reason if gpu.reason else ''})"
            pods = "\n".join(_holder(h) for h in gpu.holders) if wide else ", ".join(h.pod for h in gpu.holders)
            row: list[RenderableType] = [
                node.name if position == 0 else "",
                str(gpu.index),
                Text(model, style="" if gpu.healthy else "red"),
                Text(
                    f"{gpu.milli_used}/{gpu.milli_capacity}" + (" OVER-COMMITTED" if gpu.overcommitted else ""),
                    style="bold red" if gpu.overcommitted else _share_style(gpu.milli_used, gpu.milli_capacity),
                ),
                str(gpu.milli_free),
                f"{gpu.memory_used}/{gpu.memory_capacity}",
                str(gpu.memory_free),
                pods or "-",
            ]
            if wide:
                reservation = "-"
                if gpu.reservation is not None:
                    reservation = f"{gpu.reservation} ({gpu.reservation_uuid or 'UUID not reported yet'})"
                row += [gpu.uuid, reservation]
            table.add_row(*row)
    return Group(table, *inventory_notes(inventory))


def inventory_notes(inventory: views.Inventory) -> list[Text]:
    totals = inventory.totals()
    lines = [
        Text(
            f"{len(inventory.nodes)} node{'s' if len(inventory.nodes) != 1 else ''}, {totals.gpus} GPUs "
            f"({totals.whole_free} entirely free): {totals.milli_used}/{totals.milli_capacity} milli-GPU allocated "
            f"({percent(totals.milli_used, totals.milli_capacity)}%), {totals.memory_used}/{totals.memory_capacity} "
            f"MiB of GPU memory ({percent(totals.memory_used, totals.memory_capacity)}%)"
        )
    ]
    lines += [Text(f"left out: {name}: {why}", style="yellow") for name, why in inventory.ignored]
    for node, gpu in inventory.overcommitted():
        lines.append(
            Text(
                f"over-committed: {node}/gpu{gpu.index} ({'; '.join(gpu.overcommitted)}): sharegpu places nothing "
                "more on it until its tenants fit (docs/extender.md: repair)",
                style="bold red",
            )
        )
    return lines


# ----------------------------------------------------------------- explain


def explanation_json(e: views.Explanation) -> Json:
    return {
        "kind": "PodExplanation",
        "version": VERSION,
        "pod": e.pod,
        "phase": e.phase,
        "schedulerName": e.scheduler_name,
        "node": e.node or None,
        "outcome": e.outcome,
        "asks": e.asks,
        "problem": e.problem or None,
        "group": e.group or None,
        "podScheduled": None
        if e.scheduled is None
        else {"status": e.scheduled[0], "reason": e.scheduled[1], "message": e.scheduled[2]},
        "nodeSelector": dict(e.selector),
        "candidates": e.candidates,
        "leftOutBySelector": e.left_out,
        "message": e.message,
        "choice": None
        if e.choice is None
        else {"node": e.choice.node, "gpus": list(e.choice.gpus), "policy": e.choice.policy},
        "nodes": [
            {
                "node": v.node,
                "fits": v.fits,
                "shortfall": v.shortfall,
                "reason": v.reason,
                "gpus": list(v.gpus),
                "eligibleGpus": list(v.eligible),
            }
            for v in e.nodes
        ],
        "allocation": orjson.loads(e.allocation.to_json()) if e.allocation is not None else None,
        "claims": list(e.claims),
        "gang": e.gang or None,
    }


def _line(label: str, value: str, style: str = "") -> Text:
    return Text.assemble((f"  {label:<12}", "bold"), (value, style))


def _gpus(indices: Sequence[int]) -> str:
    return ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(str(i) for i in indices)


def explanation_text(e: views.Explanation) -> RenderableType:
    """The pod's standing, then node by node (closest to fitting first) and GPU by GPU."""
    where = f", bound to {e.node}" if e.node else ""
    head = Text.assemble(("Pod ", "bold"), (e.pod, "bold cyan"), f": {e.phase}{where}")
    if e.scheduler_name:
        head.append(f" (scheduler {e.scheduler_name})")
    lines: list[RenderableType] = [head]
    if e.asks:
        lines.append(_line("asks", e.asks))
    if e.group:
        lines.append(_line("group", f"joins SharedDeviceGroup {e.group} (its members run where it is bound)"))
    if e.gang:
        lines.append(_line("gang", f"member of gang {e.gang}: placed with its gang, all or nothing"))
    if e.outcome == "no-gpu":
        lines.append(_line("sharegpu", "the pod asks for no GPU: kube-scheduler places it alone"))
    elif e.outcome == "dra":
        lines.append(
            _line(
                "sharegpu",
                f"the pod asks for GPUs through DRA claims ({', '.join(e.claims)}): sharegpu's DRA allocator "
                "places them (on the nodes that serve DRA claims), and kube-scheduler the pod where they are",
            )
        )
    elif e.outcome == "invalid":
        lines.append(_line("sharegpu", e.problem, "red"))
    elif e.outcome in ("reservation", "finished"):
        lines.append(_line("sharegpu", e.problem or "the pod has finished: it holds nothing"))
    if e.scheduled is not None and e.outcome not in ("bound", "finished"):
        status, reason, message = e.scheduled
        said = f"PodScheduled={status}" + (f" {reason}" if reason else "") + (f": {message}" if message else "")
        lines.append(_line("scheduler", said))
    if e.allocation is not None:
        for container in e.allocation.containers:
            for grant in container.devices:
                limit = f" (limit {grant.limit_milli})" if grant.limit_milli != grant.milli else ""
                uuid = f" {grant.uuid}" if grant.uuid else ""
                lines.append(
                    _line(
                        "holds",
                        f"{container.name}{' (init)' if container.init else ''}: gpu{grant.index} "
                        f"{grant.milli} milli-GPU{limit}, {grant.memory_mib} MiB{uuid}",
                    )
                )
    if e.outcome in ("fits", "unschedulable", "quota", "gang"):
        selector = ",".join(f"{k}={v}" for k, v in sorted(e.selector.items()))
        left = f" ({e.left_out} more left out by the nodeSelector {selector})" if e.left_out else ""
        lines.append(_line("candidates", f"{e.candidates} node{'s' if e.candidates != 1 else ''}{left}"))
        if e.problem:  # the extender checks the namespace's quota before any node
            lines.append(_line("quota", e.problem, "red"))
        lines.append(_line("sharegpu", e.message, "red" if e.choice is None else "green"))
        if e.choice is not None:
            lines.append(
                _line("choice", f"{e.choice.node}, {_gpus(e.choice.gpus)} (what policy {e.choice.policy} picks now)")
            )
        if e.nodes:
            lines.append(Text(""))
        for verdict in e.nodes:
            if verdict.fits:
                room = {"quota": ": room, held back by the quota (", "gang": ": room for this pod alone ("}.get(
                    e.outcome, ": fits ("
                )
                lines.append(Text.assemble((verdict.node, "bold"), room, _gpus(verdict.eligible), " can host it)"))
                continue
            lines.append(Text.assemble((verdict.node, "bold"), ": ", (verdict.reason, "red")))
            lines += [Text(f"    {detail}") for detail in verdict.gpus]
    return Group(*lines)


# ----------------------------------------------------------------- groups


def groups_json(items: Sequence[views.GroupView]) -> Json:
    return {
        "kind": "SharedDeviceGroupList",
        "version": VERSION,
        "groups": [
            {
                "namespace": g.namespace,
                "name": g.name,
                "phase": g.phase,
                "node": g.node or None,
                "gpus": g.gpus,
                "share": g.share,
                "strategy": g.strategy,
                "devices": [{"index": index, "uuid": uuid} for index, uuid in g.devices],
                "members": list(g.members),
                "message": g.message or None,
            }
            for g in items
        ],
    }


PHASE_STYLES: Final = {"Bound": "green", "Pending": "yellow", "Failed": "red"}


def groups_table(items: Sequence[views.GroupView], wide: bool = False) -> RenderableType:
    if not items:
        return Text("No SharedDeviceGroups.")
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAMESPACE", "NAME", "PHASE", "NODE", "GPUS", "DEVICES", "MEMBERS"):
        table.add_column(column, justify="right" if column in ("GPUS", "MEMBERS") else "left")
    if wide:
        for column in ("SHARE", "STRATEGY", "MEMBER PODS", "MESSAGE"):
            table.add_column(column)
    for g in items:
        devices = ", ".join(f"{i} {u}" if wide and u else str(i) for i, u in g.devices)
        row: list[RenderableType] = [
            g.namespace, g.name, Text(g.phase, style=PHASE_STYLES.get(g.phase, "")), g.node or "-", str(g.gpus),
            devices or "-", str(len(g.members)),
        ]  # fmt: skip
        if wide:
            row += [g.share, g.strategy, "\n".join(g.members) or "-", g.message or "-"]
        table.add_row(*row)
    return table


# ----------------------------------------------------------------- budgets


def _hours(seconds: int) -> str:
    return f"{seconds / 3600:.2f}"


def budgets_json(budgets: Sequence[views.BudgetView], quotas: Sequence[views.QuotaView]) -> Json:
    return {
        "kind": "GPUBudgetReport",
        "version": VERSION,
        "budgets": [
            {
                "kind": b.kind,
                "namespace": b.namespace or None,
                "name": b.name,
                "namespaces": list(b.covers),
                "state": b.state,
                "usedGPUSeconds": b.used_seconds,
                "limitGPUSeconds": b.limit_seconds,
                "usedPercent": percent(b.used_seconds, b.limit_seconds),
                "periodStart": b.period_start or None,
                "periodEnd": b.period_end or None,
                "whenExhausted": b.when_exhausted,
                "topConsumers": [{"pod": pod, "gpuSeconds": s} for pod, s in b.top],
            }
            for b in budgets
        ],
        "quotas": [
            {
                "namespace": q.namespace,
                "name": q.name,
                "resource": q.resource,
                "held": q.held,
                "hard": q.hard,
                "usedPercent": percent(q.held, q.hard),
            }
            for q in quotas
        ],
    }


def budgets_tables(
    budgets: Sequence[views.BudgetView], quotas: Sequence[views.QuotaView], wide: bool = False
) -> RenderableType:
    """GPU-time budgets with usage bars, then the ResourceQuotas on sharegpu's GPU totals."""
    parts: list[RenderableType] = []
    if budgets:
        table = Table(title="GPU-time budgets", title_justify="left", box=None, pad_edge=False, header_style="bold")
        for column in ("NAMESPACE", "BUDGET", "STATE", "USED / LIMIT (GPU-h)", "USAGE", "PERIOD ENDS", "WHEN USED UP"):
            table.add_column(column, no_wrap=column in ("USAGE", "USED / LIMIT (GPU-h)"))
        if wide:
            table.add_column("TOP CONSUMERS (GPU-h)")
        for b in budgets:
            style = STATE_STYLES.get(b.state, "")
            where = b.namespace or ", ".join(b.covers) or "(none selected)"
            name = b.name if b.kind == "GPUBudget" else f"{b.name} (cluster)"
            row: list[RenderableType] = [
                where, name, Text(b.state, style=style), f"{_hours(b.used_seconds)} / {_hours(b.limit_seconds)}",
                Text(bar(b.used_seconds, b.limit_seconds), style=style), b.period_end[:10] or "-", b.when_exhausted,
            ]  # fmt: skip
            if wide:
                row.append("\n".join(f"{pod} {_hours(s)}" for pod, s in b.top) or "-")
            table.add_row(*row)
        parts.append(table)
    else:
        parts.append(Text("No GPU-time budgets (GPUBudget, ClusterGPUBudget)."))
    parts.append(Text(""))
    if quotas:
        table = Table(
            title="GPU quotas (ResourceQuota on sharegpu's totals; held: what placed pods hold)",
            title_justify="left", box=None, pad_edge=False, header_style="bold",
        )  # fmt: skip
        for column in ("NAMESPACE", "QUOTA", "RESOURCE", "HELD / HARD", "USAGE"):
            table.add_column(column, no_wrap=True)
        for q in quotas:
            style = _share_style(q.held, q.hard)
            table.add_row(
                q.namespace, q.name, q.resource, f"{q.held} / {q.hard}", Text(bar(q.held, q.hard), style=style)
            )
        parts.append(table)
    else:
        parts.append(Text("No ResourceQuota limits sharegpu's GPU totals."))
    return Group(*parts)


def _or_dash(value: int | None, unit: str = "") -> str:
    return "-" if value is None else f"{value}{unit}"


def top_table(rows: Sequence[views.UsageRow], namespaces: bool = False) -> RenderableType:
    """`top`: per pod and GPU (or per namespace) what it was given beside what it uses. SM/SHARE: how
    much of its compute share it uses (over 100%: it uses more than its share, which time-slicing
    allows where no limit is enforced)."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    head = ("NAMESPACE", "PODS") if namespaces else ("NAMESPACE", "POD", "NODE", "GPU")
    for column in (*head, "SHARE", "MEMORY GIVEN", "MEMORY USED", "SM", "SM/SHARE", "AGE"):
        table.add_column(column, no_wrap=True, justify="left" if column in head else "right")
    for r in rows:
        where = (r.namespace, str(r.pods)) if namespaces else (r.namespace, r.pod, r.node, r.gpu)
        share = r.share_used_percent
        style = "" if share is None else "red" if share > 100 else "yellow" if share < 10 else ""
        table.add_row(
            *where, _or_dash(r.share_milli, "m"), _or_dash(r.allocated_mib, " MiB"), f"{r.used_mib} MiB",
            _or_dash(r.sm_percent, "%"), Text(_or_dash(share, "%"), style=style), _or_dash(r.age_seconds, "s"),
        )  # fmt: skip
    return table


def top_json(rows: Sequence[views.UsageRow], namespaces: bool = False) -> Json:
    return {
        "kind": "GpuUsageReport",
        "version": VERSION,
        "by": "namespace" if namespaces else "pod",
        "rows": [
            {
                "namespace": r.namespace,
                **({"pods": r.pods} if namespaces else {"pod": r.pod, "node": r.node, "gpu": r.gpu}),
                "shareMilli": r.share_milli,
                "allocatedMiB": r.allocated_mib,
                "usedMiB": r.used_mib,
                "smPercent": r.sm_percent,
                "shareUsedPercent": r.share_used_percent,
                "ageSeconds": r.age_seconds,
            }
            for r in rows
        ],
    }


def map_json(
    inventory: views.Inventory,
    usage_rows: Sequence[views.UsageRow],
    waiting: Sequence[views.PendingView],
    budgets: Sequence[views.BudgetView],
    quotas: Sequence[views.QuotaView],
    idle: Sequence[views.IdleView],
    notes: Sequence[str],
) -> Json:
    """What the GPU map page draws: the inventory (`inventory_json`), what each share uses (`top_json`),
    the pending GPU pods and why, budgets and quotas (`budgets_json`), idle shares, and what could not
    be read (`notes`)."""
    return {
        "kind": "GPUMap",
        "version": VERSION,
        "inventory": inventory_json(inventory),
        "usage": top_json(usage_rows)["rows"],
        "pending": [
            {"namespace": p.namespace, "pod": p.name, "asks": p.asks, "reason": p.reason, "message": p.message}
            for p in waiting
        ],
        "budgets": budgets_json(budgets, quotas),
        "idle": [
            {
                "namespace": i.namespace,
                "pod": i.pod,
                "since": i.since,
                "shareMilli": i.share_milli,
                "policy": i.policy,
                "action": i.action,
            }
            for i in idle
        ],
        "notes": list(notes),
    }
