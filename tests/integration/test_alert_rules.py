"""sharegpu's alerting rules under the real promtool (built by scripts/build-prometheus from the
Prometheus Go module): they load (`promtool check rules`), each one fires on the series that should
raise it and not before its `for` (`promtool test rules` on tests/alerts), each has such a test and a
section in docs/metrics.md saying what to do, and the chart's PrometheusRule carries the same rules."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import yaml

from sharegpu.devcluster import prometheus
from tests.conftest import REPO, run_helm

RULES = REPO / "deploy" / "helm" / "sharegpu" / "files" / "alerts" / "sharegpu.rules.yaml"
TESTS = REPO / "tests" / "alerts" / "sharegpu.rules.test.yaml"


@functools.cache
def promtool() -> Path:
    return prometheus.binaries()[1]


def alerts() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_rules_load_and_every_alert_passes_its_unit_tests() -> None:
    checked = subprocess.run([promtool(), "check", "rules", RULES], check=False, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in checked.stdout
    tested = subprocess.run(
        [promtool(), "test", "rules", TESTS.name], check=False, cwd=TESTS.parent, capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_unit_test_and_a_runbook() -> None:
    cases = yaml.safe_load(TESTS.read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    docs = (REPO / "docs" / "metrics.md").read_text()
    for alert in alerts():
        assert alert in tested, f"{alert}: no promtool test sees it fire"
        assert f"### {alert}\n" in docs, f"{alert}: no section in docs/metrics.md"


def test_the_charts_prometheus_rule_carries_the_same_rules(tmp_path: Path) -> None:
    rendered = run_helm(
        "template", "x", str(REPO / "deploy" / "helm" / "sharegpu"), "-n", "sharegpu-system",
        "--set", "metrics.prometheusRule.enabled=true", "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    (rule,) = [d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    refused = run_helm("template", "x", str(REPO / "deploy" / "helm" / "sharegpu"), "-n", "sharegpu-system",
                       "--set", "metrics.prometheusRule.enabled=true")  # fmt: skip
    assert refused.returncode != 0 and "needs the Prometheus Operator's" in refused.stderr
