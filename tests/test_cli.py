"""The command line as a user runs it: the main job, outputs, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sharegpu import cli

runner = CliRunner()


def test_simulate_with_no_arguments_runs_the_embedded_workload() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sharegpu", "simulate", "--seeds", "42-43"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Static arrivals" in done.stdout
    for policy in ("random", "bestfit", "fgd", "fgd-used"):
        assert f"│ {policy} " in done.stdout


def test_json_and_plot_outputs(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    png = tmp_path / "curves.png"
    result = runner.invoke(
        cli.app,
        ["simulate", "-q", "-p", "bestfit,fgd", "--seeds", "1-2", "-j", "1", "--json", str(out), "--plot", str(png)],
    )
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())
    assert len(body["runs"]) == 4
    for run in body["runs"]:
        for key in ("trace", "policy", "seed", "unallocated_gpu_pct_at_arrived_100", "wall_seconds"):
            assert key in run
        assert 0 <= run["unallocated_gpu_pct_at_arrived_100"] <= 100
    assert {s["policy"] for s in body["summary"]} == {"bestfit", "fgd"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dynamic_mode_reports_waits() -> None:
    result = runner.invoke(cli.app, ["simulate", "-q", "--mode", "dynamic", "-p", "bestfit", "--seeds", "1", "-j", "1"])
    assert result.exit_code == 0, result.output
    assert "wait p99" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "/absent/nodes.csv", "--pods", "/absent/pods.csv"], "/absent/nodes.csv: no such file"),
        (["-p", "nope"], "unknown policy 'nope'"),
        (["--seeds", "9-3"], "range 9-3 goes backwards"),
        (["--seeds", "x"], "'x' is not a number"),
        (["--mode", "sideways"], "--mode must be static or dynamic"),
        (["--tune", "0"], "--tune must be in (0, 10]"),
        (["--pods", "p.csv"], "--nodes and --pods go together"),
        (["--plot", "out.svg"], "--plot must name a .png file"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], message: str) -> None:
    result = runner.invoke(cli.app, ["simulate", "-q", *args])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("sharegpu: error: ")
    assert message in lines[0]


def test_malformed_row_is_reported_with_its_line(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,1000,1000,2,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,10,10,1,500\np2,10,ten,1,500\n")
    result = runner.invoke(cli.app, ["simulate", "--nodes", str(nodes), "--pods", str(pods)])
    assert result.exit_code == 2
    assert f"sharegpu: error: {pods}:3: column memory_mib must be an integer, got 'ten'" in result.output


def test_policies_lists_every_policy() -> None:
    result = runner.invoke(cli.app, ["policies"])
    assert result.exit_code == 0
    for name in ("random", "dotprod", "clustering", "packing", "bestfit", "fgd", "binpack", "spread", "topology"):
        assert name in result.output


def test_logs_are_json_lines() -> None:
    import io
    import logging

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(cli.JsonFormatter())
    log = logging.getLogger("sharegpu.test-json")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning('a "quoted" message with\\nnewline')
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]
    assert lines[0]["message"] == 'a "quoted" message with\\nnewline'
    assert lines[0]["level"] == "WARNING"
    assert "ValueError: boom" in lines[1]["error"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["extender", "--policy", "nope"], "unknown policy 'nope'"),
        (["extender", "--tls-cert", "/absent.crt"], "--tls-cert and --tls-key go together"),
        (["extender", "--client-ca", "/absent.crt"], "--client-ca needs --tls-cert and --tls-key"),
        (["extender", "--tls-cert", "/a.crt", "--tls-key", "/a.key"], "/a.crt: no such file"),
        (["extender", "--lease-duration", "5", "--renew-deadline", "6"], "leader election needs"),
        (["extender", "--log-level", "LOUD"], "--log-level must be DEBUG, INFO, WARNING or ERROR"),
        (["webhook"], "give --cert and --key, or --bootstrap FOLDER"),
        (
            ["webhook", "--cert", "c", "--key", "k", "--dns-name", "x"],
            "--dns-name and --ip-address go with --bootstrap",
        ),
        (["webhook", "--bootstrap", "/tmp/b", "--url", "http://x:1"], "--url must be an https URL"),
        (
            ["webhook", "--bootstrap", "/tmp/b", "--url", "https://127.0.0.1:8443"],
            "--url host '127.0.0.1' is not among the certificate's names",
        ),
        (["webhook", "--bootstrap", "/tmp/b", "--ip-address", "not-an-ip"], "'not-an-ip' is not an IP address"),
        (["devcluster", "--policy", "nope"], "unknown policy 'nope'"),
        (["devcluster", "--compat", "volcano"], "--compat volcano: known: deviceshare, kubeshare"),
        (["controller", "--compat", "volcano"], "--compat volcano: known: deviceshare, kubeshare"),
        (["crds", "--compat", "volcano"], "--compat volcano: known: deviceshare, kubeshare"),
    ],
)
def test_component_options_are_checked_before_anything_starts(args: list[str], message: str) -> None:
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sharegpu: error: "), result.output
    assert message in lines[0]


def test_crds_prints_the_compatibility_definitions_only_when_asked() -> None:
    plain = runner.invoke(cli.app, ["crds"])
    assert plain.exit_code == 0 and "name: shareddevicegroups.sharegpu.io" in plain.output
    assert "deviceshare.io" not in plain.output.replace("deviceshare.io/group", "")
    both = runner.invoke(cli.app, ["crds", "--compat", "deviceshare", "--compat", "kubeshare"])
    assert both.exit_code == 0, both.output
    names = [line.split(": ")[1] for line in both.output.splitlines() if line.startswith("  name: ")]
    assert names == ["shareddevicegroups.deviceshare.io", "sharepods.kubeshare.nthu"]
