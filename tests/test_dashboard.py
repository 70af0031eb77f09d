"""The Grafana dashboard in the chart (deploy/helm/sharegpu/dashboards/sharegpu.json).

Every query is checked as PromQL as far as a tokenizer can tell (only PromQL's tokens, brackets that
pair up, only the dashboard's own variables and Grafana's built-in ones) and may name only metrics the
components export. What they export is read from the components themselves, each built over the
shipped fakes (the fake API server, the fake NVML), by collecting their registries: a family's type
says which sample names it is exposed under (a counter `x` as `x_total`, a histogram as `x_bucket`,
`x_sum`, `x_count`). The chart must render the dashboard into the ConfigMap Grafana's sidecar reads."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from prometheus_client.metrics_core import Metric

from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.controller import runtime as controller_runtime
from sharegpu.devcluster import stack
from sharegpu.extender import runtime as extender_runtime
from sharegpu.kube import client, fake
from sharegpu.webhook import admission, server
from tests.builders import NVML_FILE, write_nvml
from tests.conftest import one, render

DASHBOARD = stack.CHART / "dashboards" / "sharegpu.json"
Json = dict[str, Any]

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range", "__all"}
TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<variable>\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*))
  | (?P<duration>(?:[0-9]+(?:ms|[smhdwy]))+)
  | (?P<number>[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)
  | (?P<identifier>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<operator>=~|!~|!=|==|<=|>=|[-+*/%^<>=,])
  | (?P<bracket>[(){}\[\]])
    """,
    re.VERBOSE,
)
PAIRS = {")": "(", "]": "[", "}": "{"}
SHOWN = (
    "sharegpu_gpu_compute_allocated_gpus",
    "sharegpu_gpu_memory_allocated_bytes",
    "sharegpu_gpu_holders",
    "sharegpu_pending_gpu_pods",
    "sharegpu_extender_scheduling_latency_seconds_bucket",
    "sharegpu_webhook_admissions_total",
    "sharegpu_namespace_gpu_compute_allocated_gpus",
    "sharegpu_namespace_gpu_compute_quota_gpus",
    "sharegpu_budget_used_gpu_seconds",
    "sharegpu_agent_violations",
    "sharegpu_agent_mps_daemon_up",
)
"""What the issue asks the dashboard to show, at the least."""


def dashboard() -> Json:
    loaded: Json = json.loads(DASHBOARD.read_text())
    return loaded


def panels(items: list[Json]) -> Iterator[Json]:
    for item in items:
        yield item
        yield from panels(item.get("panels", []))


def queries(board: Json) -> list[str]:
    """Every PromQL text of the dashboard: the panels' targets and the variables' queries."""
    found = [t["expr"] for p in panels(board["panels"]) for t in p.get("targets", []) if "expr" in t]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


def tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) of each token; AssertionError on text that is not PromQL or brackets that do not pair."""
    out: list[tuple[str, str]] = []
    position = 0
    opened: list[str] = []
    while position < len(expr):
        match = TOKEN.match(expr, position)
        assert match is not None, f"not PromQL at {position}: {expr[position : position + 30]!r} in {expr!r}"
        kind = match.lastgroup
        assert kind is not None
        if kind in ("braced", "bare"):
            kind = "variable"
        text = match.group(0)
        if kind == "bracket":
            if text in PAIRS:
                assert opened and opened.pop() == PAIRS[text], f"unpaired {text!r} in {expr!r}"
            else:
                opened.append(text)
        if kind != "space":
            out.append((kind, text))
        position = match.end()
    assert not opened, f"unclosed {opened} in {expr!r}"
    return out


def metric_names(expr: str) -> set[str]:
    """The sharegpu metrics a query selects (identifiers; label values and strings are not names)."""
    return {text for kind, text in tokens(expr) if kind == "identifier" and text.startswith("sharegpu_")}


def exposed(family: Metric) -> set[str]:
    """The sample names a family is exposed under (whether or not it has samples now)."""
    names = {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names | {s.name for s in family.samples}


@pytest.fixture
async def exported(tmp_path: Path) -> AsyncIterator[set[str]]:
    """The sample names every component's registry exposes, each component built over the fakes."""
    api = client.KubeClient(fake.FakeApiServer())
    nvml = tmp_path / "nvml.yaml"
    write_nvml(nvml, NVML_FILE)
    registries: list[prometheus_client.CollectorRegistry] = [
        extender_runtime.Extender(api, extender_runtime.Options(leader_elect=False)).metrics.registry,
        controller_runtime.Controller(api, controller_runtime.Options(leader_elect=False)).metrics.registry,
        server.Webhook(admission.Policy()).metrics.registry,
        agent_runtime.Agent(api, "n0", fakenvml.FakeNvml(nvml).open(), agent_runtime.Options()).metrics.registry,
    ]
    names: set[str] = set()
    for registry in registries:
        text = prometheus_client.generate_latest(registry).decode()
        for family in registry.collect():
            assert f"# TYPE {family.name}" in text
            names |= exposed(family)
    yield names
    await api.close()


def test_every_query_is_promql_with_only_the_dashboards_variables() -> None:
    board = dashboard()
    defined = {v["name"] for v in board["templating"]["list"]} | BUILTIN_VARIABLES
    texts = queries(board)
    assert len(texts) > 40
    for expr in texts:
        used = {re.sub(r"^\$\{?|\}$", "", text) for kind, text in tokens(expr) if kind == "variable"}
        assert used <= defined, (expr, used - defined)


async def test_every_query_names_only_metrics_the_components_export(exported: set[str]) -> None:
    named: dict[str, set[str]] = {}
    for expr in queries(dashboard()):
        for name in metric_names(expr):
            named.setdefault(name, set()).add(expr)
    unknown = {name: sorted(where)[0] for name, where in named.items() if name not in exported}
    assert unknown == {}, f"queries name metrics nobody exports: {unknown}"
    assert set(SHOWN) <= set(named), set(SHOWN) - set(named)


def test_the_tokenizer_refuses_what_is_not_promql_and_names_no_label_value() -> None:
    assert metric_names('sum by (node) (rate(sharegpu_a_total{kind="sharegpu_b"}[$__rate_interval]))') == {
        "sharegpu_a_total"
    }
    for bad in ("sum(sharegpu_a", 'sharegpu_a{x="1")', "sharegpu_a @@ 1", 'sharegpu_a{x="1}'):
        with pytest.raises(AssertionError):
            tokens(bad)


def test_the_dashboard_reads_its_data_source_from_a_variable() -> None:
    board = dashboard()
    assert board["uid"] == "sharegpu-overview" and board["schemaVersion"] >= 36
    (source,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    ids = [p["id"] for p in panels(board["panels"])]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(board["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": f"${{{source['name']}}}"}, panel["title"]
            assert all(t["datasource"] == panel["datasource"] for t in panel["targets"]), panel["title"]


def test_the_chart_ships_the_dashboard_for_grafanas_sidecar() -> None:
    for version in ("1.32.2", "1.37.2"):
        configmap = one(render(version), "ConfigMap", "sharegpu-dashboard")
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert configmap["metadata"]["namespace"] == "sharegpu-system"
        assert json.loads(configmap["data"]["sharegpu.json"]) == dashboard()
    moved = render("1.34.0", "dashboards.namespace=monitoring", "dashboards.annotations.grafana_folder=GPUs")
    configmap = one(moved, "ConfigMap", "sharegpu-dashboard")
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "GPUs"}
    off = render("1.34.0", "dashboards.enabled=false")
    assert not [d for d in off if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "sharegpu-dashboard"]
