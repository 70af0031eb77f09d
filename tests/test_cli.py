"""The command line as a user runs it: the main job, outputs, one-line errors with exit code 2, help
that shows every default and choice, the version, shell completion, and the two log formats."""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest
import typer
import typer.core
import typer.main
from typer.testing import CliRunner

import sharegpu
from sharegpu import cli
from sharegpu.cli import components, logs, options
from sharegpu.cli import webhook as webhook_cli
from sharegpu.core import policies
from sharegpu.kube import terms
from sharegpu.sim import peers

runner = CliRunner()
REPO = Path(__file__).resolve().parent.parent
COMMANDS = (
    "simulate", "crds", "policies", "extender", "controller", "reserve", "agent", "webhook", "devcluster", "defrag",
)  # fmt: skip


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
    for policy in ("random", "bestfit", "fgd", "fgd-lp"):
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
        (["--mode", "sideways"], "Invalid value for '--mode': 'sideways' is not one of 'static', 'dynamic'."),
        (["--tune", "0"], "--tune must be in (0, 10]"),
        (["--pods", "p.csv"], "--nodes and --pods go together"),
        (["--plot", "out.svg"], "--plot must name a .png file"),
        (["--bogus"], "No such option: --bogus"),
        (["--seeds"], "Option '--seeds' requires an argument."),
        (["--defrag-budget", "5"], "--defrag-budget needs --mode dynamic"),
        (
            ["--mode", "dynamic", "--defrag-budget", "-1"],
            "'--defrag-budget': Input should be greater than or equal to 0",
        ),
        (["--jobs", "-1"], "'--jobs' / '-j': Input should be greater than or equal to 0"),
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


@pytest.mark.parametrize("command", ["simulate", "bound"])
def test_pods_none_of_which_asks_for_a_gpu_are_refused_not_replayed_for_ever(tmp_path: Path, command: str) -> None:
    """Static arrivals draw pods until their GPU requests fill the GPUs: from pods that ask for none
    the draw never ended (the commands hung, memory growing)."""
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,1000,1000,2,T4\n")
    pods = tmp_path / "cpu.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,10,10,0,0\n")
    result = runner.invoke(cli.app, [command, "--nodes", str(nodes), "--pods", str(pods), "--seeds", "1", "-j", "1"])
    assert result.exit_code == 2
    assert f"sharegpu: error: {pods}: no pod asks for a GPU: nothing to replay" in result.output


@pytest.mark.parametrize(
    ("option", "name", "says"),
    [
        ("--json", "/proc/nope/x.json", "its folder cannot be made"),
        ("--json", "a-file/x.json", "a-file is not a folder"),
        ("--json", ".", "is a folder"),
        ("--plot", "a-file/x.png", "a-file is not a folder"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_any_run(
    tmp_path: Path, option: str, name: str, says: str
) -> None:
    (tmp_path / "a-file").write_text("")
    args = ["simulate", "-q", "-p", "bestfit", "--seeds", "1", "-j", "1", option, str(tmp_path / name)]
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 2 and says in result.output, result.output
    assert "bestfit" not in result.output, "no run made, no table printed"


def test_policies_lists_every_policy() -> None:
    result = runner.invoke(cli.app, ["policies"])
    assert result.exit_code == 0
    for name in ("random", "dotprod", "clustering", "packing", "bestfit", "fgd", "binpack", "spread", "topology"):
        assert name in result.output
    assert f"the extender's default policy: {policies.DEFAULT}" in result.output
    flat = " ".join(result.output.replace("│", " ").split())
    for cls in peers.PEERS:  # each peer's, with the system and version it follows
        assert cls.name in result.output
    for system in ("HAMi v2.10.0", "Koordinator v1.8.0", "Volcano v1.15.1", "KAI Scheduler v0.13.0"):
        assert system in flat, system


def test_simulate_takes_default_as_the_extenders_policy(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,8000,8000,2,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np1,10,10,1,500\np2,10,10,1,700\np3,10,10,1,1000\n")
    out = tmp_path / "runs.json"
    args = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "-p", "fgd,default", "--seeds", "1", "-j", "1"]
    result = runner.invoke(cli.app, [*args, "--json", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert sorted({run["policy"] for run in json.loads(out.read_text())["runs"]}) == sorted({"fgd", policies.DEFAULT})


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, with the handlers and level it had put back afterwards (logs.configure replaces them)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def _log_through(stream: io.StringIO, log_format: logs.LogFormat) -> None:
    logs.configure("info", log_format, stream)
    log = logging.getLogger("test-cli.logs")
    log.debug("below the level")
    log.warning('a "quoted" message with\nnewline')
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")


@pytest.mark.parametrize(("log_format", "stream"), [("json", _Terminal()), ("auto", io.StringIO())])
def test_logs_are_json_lines(root_logger: logging.Logger, log_format: logs.LogFormat, stream: io.StringIO) -> None:
    """JSON when asked, and by default when stderr is no terminal (a pod's log, a file, a pipe)."""
    _log_through(stream, log_format)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is one object
    assert [line["message"] for line in lines] == ['a "quoted" message with\nnewline', "failed"]
    assert lines[0]["level"] == "WARNING" and lines[0]["logger"] == "test-cli.logs"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", lines[0]["time"])
    assert "ValueError: boom" in lines[1]["error"]


def test_a_record_about_a_gpu_says_which_in_json(root_logger: logging.Logger) -> None:
    """The MPS daemons' lines, relayed by the agent, carry their GPU's UUID as a field of their own."""
    stream = io.StringIO()
    logs.configure("info", "json", stream)
    logging.getLogger("sharegpu.agent.mps.daemon").info("Server started", extra={"gpu": "GPU-a1"})
    logging.getLogger("test-cli.logs").info("about no GPU")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (first["message"], first["gpu"], first["logger"]) == (
        "Server started",
        "GPU-a1",
        "sharegpu.agent.mps.daemon",
    )
    assert "gpu" not in second


@pytest.mark.parametrize(("log_format", "stream"), [("text", io.StringIO()), ("auto", _Terminal())])
def test_logs_are_plain_lines_for_a_person(
    root_logger: logging.Logger, log_format: logs.LogFormat, stream: io.StringIO
) -> None:
    """Text when asked, and by default when stderr is a terminal."""
    _log_through(stream, log_format)
    first, continued, second, *traceback = stream.getvalue().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(stamp + r' WARNING test-cli\.logs: a "quoted" message with', first)
    assert continued == "newline"
    assert re.fullmatch(stamp + r" ERROR   test-cli\.logs: failed", second)
    assert traceback[0] == "Traceback (most recent call last):" and traceback[-1] == "ValueError: boom"


def test_every_component_offers_both_log_formats() -> None:
    for command in ("extender", "controller", "webhook", "agent", "reserve"):
        text = _help(command)
        assert "--log-format <auto|json|text>" in text and "[default: auto]" in text, command
        assert "--log-level <debug|info|warning|error>" in text and "[default: info]" in text, command


def _help(*args: str) -> str:
    """The help of a command, drawn wide, with the table's borders and line breaks taken out."""
    result = runner.invoke(cli.app, [*args, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


def test_simulate_help_shows_the_policy_default() -> None:
    text = _help("simulate")
    policy = "--policy -p <names> Policies, comma-separated or repeated (see `sharegpu policies`)."
    assert f"{policy} [default: random,bestfit,fgd,fgd-lp]" in text
    assert "repeated ." not in text


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_option_text_and_default(command: str) -> None:
    """Every option's help text comes through whole (none is eaten as rich markup, as `[a,b]` was), and
    every default shows in the one place people look, `[default: ...]`, never in the prose."""
    group = typer.main.get_command(cli.app)
    assert isinstance(group, typer.core.TyperGroup)
    text = _help(command)
    for param in group.commands[command].params:
        help_text = getattr(param, "help", None)
        if not help_text or param.name == "help":
            continue
        assert " ".join(help_text.split()) in text, param.name
        assert "default:" not in help_text.lower(), f"{param.name}: give the default with show_default"
        show_default = getattr(param, "show_default", None)
        if isinstance(show_default, str):
            assert f"[default: ({show_default})]" in text, param.name
        elif isinstance(param.default, list):
            assert f"[default: {', '.join(map(str, param.default))}]" in text, param.name
        elif param.default not in (None, "", False) and not isinstance(param.default, bool):
            assert f"[default: {param.default}]" in text, param.name


def test_choices_show_in_help() -> None:
    assert "--mode <static|dynamic>" in _help("simulate")
    assert "--on-violation <report|kill|evict>" in _help("agent")
    for command in ("controller", "devcluster", "crds"):
        assert "--compat <list[deviceshare|kubeshare|coscheduling|volcano|kai]>" in _help(command)


def test_choices_spelled_in_the_cli_match_their_definitions() -> None:
    """The CLI spells some choices itself so that it loads without the modules that define them."""
    from sharegpu.agent import watchdog
    from sharegpu.api import resources

    assert [c.value for c in options.Compat] == list(resources.COMPAT)
    assert list(get_args(components.ViolationAction)) == [a.value for a in watchdog.Action]


def test_version_is_the_installed_packages() -> None:
    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0
    installed = importlib.metadata.version("sharegpu")
    assert result.output == f"sharegpu {installed}\n"
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert installed == declared == sharegpu.__version__


def test_help_offers_completion_and_the_version() -> None:
    text = _help()
    for option in ("--version", "--install-completion", "--show-completion"):
        assert option in text


@pytest.mark.parametrize(
    ("shell", "registers"),
    [
        ("bash", "complete -o default -F _sharegpu_completion sharegpu"),
        ("zsh", "compdef _sharegpu_completion sharegpu"),
        ("fish", "complete --command sharegpu"),
    ],
)
def test_show_completion_prints_the_shells_script(monkeypatch: pytest.MonkeyPatch, shell: str, registers: str) -> None:
    # Typer's own switch: the shell is given rather than detected from the process tree.
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    result = runner.invoke(cli.app, ["--show-completion", shell])
    assert result.exit_code == 0, result.output
    assert registers in result.output
    assert "_SHAREGPU_COMPLETE=complete_" in result.output


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ("sharegpu ext", ["extender"]),
        ("sharegpu simulate --mode ", ["static", "dynamic"]),
        (
            "sharegpu simulate -p random,f",
            ["random,fgd", "random,fgd-used", "random,fgd-balance", "random,fgd-fill", "random,fgd-lp"],
        ),
        ("sharegpu extender --log-level ", ["debug", "info", "warning", "error"]),
        ("sharegpu extender --policy fgd", ["fgd", "fgd-used", "fgd-balance", "fgd-fill", "fgd-lp"]),
        ("sharegpu agent --on-violation ", ["report", "kill", "evict"]),
        ("sharegpu crds --compat ", ["deviceshare", "kubeshare", "coscheduling", "volcano", "kai"]),
    ],
)
def test_completion_offers_commands_and_choices(words: str, expected: list[str]) -> None:
    env = {"_SHAREGPU_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(len(words.split(" ")) - 1)}
    result = runner.invoke(cli.app, [], env=env)
    assert result.exit_code == 0, result.output
    assert result.output.split() == expected


def test_bash_completes_with_the_installed_script(tmp_path: Path) -> None:
    """The script `--show-completion bash` prints, sourced into a real bash, completes a choice."""
    bash = shutil.which("bash")
    script = Path(sys.executable).parent / "sharegpu"
    if bash is None or not script.is_file():
        pytest.skip("needs bash and the installed `sharegpu` script")
    env = {**os.environ, "PATH": f"{script.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION"] = "1"
    completion = tmp_path / "sharegpu.bash"
    shown = subprocess.run(
        [str(script), "--show-completion", "bash"], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    completion.write_text(shown.stdout)
    probe = (
        f"source {completion}\n"
        'COMP_WORDS=(sharegpu simulate --mode ""); COMP_CWORD=3\n'
        "_sharegpu_completion sharegpu\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        [bash, "--norc", "-c", probe], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["static", "dynamic"]


COMPAT_REFUSED = (
    "Invalid value for '--compat': 'yunikorn' is not one of "
    "'deviceshare', 'kubeshare', 'coscheduling', 'volcano', 'kai'."
)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["extender", "--policy", "nope"], "unknown policy 'nope'"),
        (["extender", "--policy", "kai-binpack"], "unknown policy 'kai-binpack'"),  # the peers': the simulator's only
        (["devcluster", "--policy", "hami-binpack-spread"], "unknown policy 'hami-binpack-spread'"),
        (["extender", "--tls-cert", "/absent.crt"], "--tls-cert and --tls-key go together"),
        (["extender", "--client-ca", "/absent.crt"], "--client-ca needs --tls-cert and --tls-key"),
        (["extender", "--tls-cert", "/a.crt", "--tls-key", "/a.key"], "/a.crt: no such file"),
        (["extender", "--lease-duration", "5", "--renew-deadline", "6"], "leader election needs"),
        (["extender", "--dra-fence", "-1"], "'--dra-fence': Input should be greater than or equal to 0"),
        (["extender", "--assume-ttl", "0"], "--assume-ttl must be > 0, got 0"),
        (["agent", "--health-port", "70000"], "'--health-port': Input should be less than or equal to 65535"),
        (["devcluster", "--nodes", "0"], "'--nodes': Input should be greater than or equal to 1"),
        (["extender", "--health-cert", "/etc/hostname"], "--health-cert and --health-key go together"),
        (["controller", "--health-cert", "/a.crt", "--health-key", "/a.key"], "/a.crt: no such file"),
        (
            [
                "agent",
                "--node",
                "n",
                "--plain-health",
                "--health-cert",
                "/etc/hostname",
                "--health-key",
                "/etc/hostname",
            ],
            "--plain-health serves no certificate: drop --health-cert and --health-key",
        ),
        (
            ["extender", "--log-level", "LOUD"],
            "Invalid value for '--log-level': 'LOUD' is not one of 'debug', 'info', 'warning', 'error'.",
        ),
        (["extender", "--log-format", "xml"], "Invalid value for '--log-format': 'xml' is not one of 'auto',"),
        (["extender", "--log-level", "WARNING", "--policy", "nope"], "unknown policy 'nope'"),  # any case
        (["webhook"], "give --cert and --key, or --bootstrap FOLDER"),
        (["webhook", "--default-path", "nowhere"], "--default-path must be one of extender, dra, got 'nowhere'"),
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
        (["devcluster", "--compat", "yunikorn"], COMPAT_REFUSED),
        (["devcluster", "--feature-gates", "GenericWorkload"], "--feature-gates: 'GenericWorkload' is not KEY=VALUE"),
        (
            ["devcluster", "--runtime", "containerd", "--nodes", "9"],
            "with --runtime containerd, --nodes and --gpus must be 1..8",
        ),
        (
            ["devcluster", "--runtime", "containerd", "--no-controller"],
            "with --runtime containerd the chart installs sharegpu: --compat, --no-webhook",
        ),
        (["devcluster", "--runtime", "docker"], "Invalid value for '--runtime': 'docker' is not one of 'fake',"),
        (["controller", "--compat", "yunikorn"], COMPAT_REFUSED),
        (
            ["controller", "--definitions-every", "0"],
            "'--definitions-every': Input should be greater than or equal to 1",
        ),
        (["crds", "--compat", "yunikorn"], COMPAT_REFUSED),
        (
            ["agent", "--node", "n", "--on-violation", "shoot"],
            "Invalid value for '--on-violation': 'shoot' is not one of 'report', 'kill', 'evict'.",
        ),
        (["agent"], "Missing option '--node'."),
        (["nope"], "No such command 'nope'."),
        (["--bogus"], "No such option: --bogus"),
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
    every = [line.split(": ")[1] for line in plain.output.splitlines() if line.startswith("  name: ")]
    chart = ["clustergpubudgets.sharegpu.io", "devices.sharegpu.io", "gpubudgets.sharegpu.io",
             "gpuidlepolicies.sharegpu.io", "gpuusages.sharegpu.io", "shareddevicegroups.sharegpu.io"]  # fmt: skip
    assert sorted(every) == chart, "every definition the chart installs"
    assert "deviceshare.io" not in plain.output.replace("deviceshare.io/group", "")
    both = runner.invoke(cli.app, ["crds", "--compat", "deviceshare", "--compat", "kubeshare"])
    assert both.exit_code == 0, both.output
    names = [line.split(": ")[1] for line in both.output.splitlines() if line.startswith("  name: ")]
    assert names == ["shareddevicegroups.deviceshare.io", "sharepods.kubeshare.nthu"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-dry-run"], "sharegpu defrag only plans (--dry-run); run the controller with --defrag to evict"),
        (["--budget", "-1"], "'--budget': Input should be greater than or equal to 0"),
        (["--kubeconfig", "/nonexistent/kubeconfig"], "/nonexistent/kubeconfig"),
        (["--output", "yaml"], "'yaml' is not one of 'text', 'json'"),
    ],
)
def test_defrag_refuses_bad_input_in_one_line(args: list[str], message: str) -> None:
    result = runner.invoke(cli.app, ["defrag", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sharegpu: error: ") and message in lines[0], lines


@pytest.mark.parametrize(
    ("cluster", "user", "message"),
    [
        ({"certificate-authority": "missing-ca.crt"}, {"token": "t"}, "certificate-authority {folder}/missing-ca.crt"),
        ({}, {"exec": {"command": "/nonexistent/get-token"}}, "exec credential plugin '/nonexistent/get-token'"),
    ],
)
def test_defrag_reports_credentials_that_fail_on_first_use_in_one_line(
    tmp_path: Path, cluster: dict[str, str], user: dict[str, object], message: str
) -> None:
    config = tmp_path / "config"
    config.write_text(json.dumps({
        "current-context": "here",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "here", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    result = runner.invoke(cli.app, ["defrag", "--kubeconfig", str(config)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sharegpu: error: "), lines
    assert message.format(folder=tmp_path) in lines[0], lines


def test_controller_refuses_defrag_and_its_dry_run_together() -> None:
    result = runner.invoke(cli.app, ["controller", "--defrag", "--defrag-dry-run"])
    assert result.exit_code == 2
    assert "--defrag evicts and --defrag-dry-run only reports: give one of them" in result.output


# ---------------------------------------------------------------- the helpers the commands share


@pytest.mark.parametrize(
    ("url", "dns_names", "ips"),
    [
        ("https://sharegpu-webhook.sharegpu-system.svc:443/mutate", webhook_cli.DEFAULT_WEBHOOK_NAMES, ()),
        ("https://10.0.0.1:8443", (), ("10.0.0.1",)),
        ("https://[::1]:8443", (), ("0:0::1",)),  # compared as addresses, not as text
        ("https://hook.example", ("hook.example",), ("10.0.0.1",)),
    ],
)
def test_the_webhook_url_check_accepts_a_host_the_certificate_names(
    url: str, dns_names: tuple[str, ...], ips: tuple[str, ...]
) -> None:
    webhook_cli.check_url(url, dns_names, ips)


@pytest.mark.parametrize(
    ("url", "dns_names", "ips", "message"),
    [
        ("http://hook.example", ("hook.example",), (), "--url must be an https URL, got 'http://hook.example'"),
        ("https://", ("hook.example",), (), "--url must be an https URL"),
        ("https://other.example", ("hook.example",), (), "--url host 'other.example' is not among the certificate's"),
        ("https://10.0.0.2", ("10.0.0.2.example",), ("10.0.0.1",), "names (10.0.0.2.example, 10.0.0.1)"),
        ("https://10.0.0.1", ("10.0.0.1",), (), "--url host '10.0.0.1' is not among"),  # an IP needs --ip-address
    ],
)
def test_the_webhook_url_check_refuses_what_the_api_server_would_refuse(
    url: str, dns_names: tuple[str, ...], ips: tuple[str, ...], message: str
) -> None:
    with pytest.raises(cli.boundary.UsageError) as caught:
        webhook_cli.check_url(url, dns_names, ips)
    assert message in str(caught.value)


def test_reported_turns_sharegpu_errors_into_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as caught, cli.boundary.reported():
        raise cli.boundary.UsageError("first line\nsecond line")
    assert caught.value.exit_code == 2
    assert capsys.readouterr().err == "sharegpu: error: first line\n"
    with pytest.raises(typer.Exit) as caught, cli.boundary.reported(OSError, status=1, doing="writing"):
        raise FileNotFoundError("")
    assert caught.value.exit_code == 1
    assert capsys.readouterr().err == "sharegpu: error: writing: FileNotFoundError\n"
    with pytest.raises(ValueError, match="not ours"), cli.boundary.reported():
        raise ValueError("not ours")  # any other error goes on as it is


def test_leader_election_options_arrive_as_one_checked_value() -> None:
    """The four options are declared once (`cli.options`), shown with the defaults the runtimes take
    (`kube.terms.DEFAULT`), and given to the runtime whole; timings that do not nest are one line."""
    for command in ("extender", "controller"):
        text = _help(command)
        for option, default in (("--lease-duration", 15.0), ("--renew-deadline", 10.0), ("--retry-period", 2.0)):
            assert f"{option}" in text and f"[default: {default}]" in text
    made = options.election(30.0, 10.0, 2.0, "me")
    assert made == terms.Election(terms.Terms(30.0, 10.0, 2.0), "me")
    assert options.ELECTION == terms.DEFAULT == terms.Election()
    result = runner.invoke(cli.app, ["controller", "--lease-duration", "5", "--renew-deadline", "6"])
    assert result.exit_code == 2
    assert (
        "leader election needs 0 < --retry-period < --renew-deadline < --lease-duration, got 2, 6, 5" in result.output
    )


@pytest.mark.parametrize(
    ("error", "line"),
    [(ValueError("one\ntwo"), "one"), (ValueError("\n  padded  \n"), "padded"), (KeyError(), "KeyError")],
)
def test_first_line(error: BaseException, line: str) -> None:
    from sharegpu.core import errors

    assert errors.first_line(error) == line


def test_health_port_options_arrive_as_one_endpoint() -> None:
    """--host, --health-port, the three TLS options and --metrics-auth become one
    `serving.health.Endpoint`, whose defaults are the runtimes' own."""
    from sharegpu.controller import runtime as controller_runtime
    from sharegpu.extender import runtime as extender_runtime
    from sharegpu.serving import health, tls

    group = typer.main.get_command(cli.app)
    assert isinstance(group, typer.core.TyperGroup)
    for command, default in (
        ("extender", extender_runtime.HEALTH_PORT),
        ("controller", controller_runtime.HEALTH_PORT),
    ):
        shown = {p.name: p.default for p in group.commands[command].params}
        assert (shown["host"], shown["health_port"], shown["metrics_auth"]) == (
            default.host, default.port, default.metrics_auth
        )  # fmt: skip
        assert default.tls == tls.SELF_SIGNED and not shown["plain_health"] and shown["health_cert"] is None
    made = options.health_endpoint("127.0.0.1", 9000, None, None, True, False)
    assert made == health.Endpoint(9000, "127.0.0.1", tls.HealthTls(None, None, True), False)
    assert str(made) == "127.0.0.1:9000 (http)"
