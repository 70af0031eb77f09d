"""The command line: output formats, the kubeconfig's namespace, and one-line errors with the right
exit status (2: the command line; 1: the cluster's answer)."""

from __future__ import annotations

import importlib.metadata
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from typer.testing import CliRunner

from sharegpu.api import paths, resources, usage, wire
from sharegpu.kube import client, credentials, fake
from sharegpu.kubectl import app
from tests.extender.conftest import add_node, gpu_pod
from tests.kubectl.conftest import bound

runner = CliRunner()
Json = dict[str, Any]


@pytest.fixture
def server() -> fake.FakeApiServer:
    made = fake.FakeApiServer()
    add_node(made, "n0", gpus=2)
    made.put_object(paths.pods("ns"), bound("a", "n0", 0, 600))
    made.put_object(paths.pods("ns"), bound("b", "n0", 1, 700))
    pending = gpu_pod("big", milli=500)
    pending["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 ..."}],
    }
    made.put_object(paths.pods("ns"), pending)
    made.put_object(paths.pods("team"), gpu_pod("small", milli=200, namespace="team"))
    return made


def on(server: fake.FakeApiServer) -> Any:
    """The command line talking to `server`; records how it was asked to connect."""
    asked: list[tuple[str | None, str | None, float]] = []

    def connect(kubeconfig: str | None, context: str | None, timeout: float) -> client.KubeClient:
        asked.append((kubeconfig, context, timeout))
        return client.KubeClient(server)

    command = app.make_app(connect)
    command.asked = asked  # type: ignore[attr-defined]
    return command


def test_inspect_prints_a_table_and_stable_json(server: fake.FakeApiServer) -> None:
    command = on(server)
    result = runner.invoke(command, ["inspect"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "MODEL", "COMPUTE", "(m)", "FREE", "MEMORY", "(MiB)", "FREE", "PODS"]
    assert lines[1].split() == ["n0", "0", "T4", "600/1000", "400", "0/16384", "16384", "ns/a"]
    assert lines[2].split() == ["1", "T4", "700/1000", "300", "0/16384", "16384", "ns/b"]
    assert "1300/2000 milli-GPU allocated (65%)" in result.stdout

    result = runner.invoke(command, ["inspect", "-o", "json", "--request-timeout", "3", "--context", "c"])
    assert result.exit_code == 0, result.output
    document = orjson.loads(result.stdout)
    assert document["kind"] == "GPUInventory" and document["version"] == 1
    gpus = document["nodes"][0]["gpus"]
    assert [(g["index"], [p["pod"] for p in g["pods"]], g["milli"]["free"]) for g in gpus] == [
        (0, ["ns/a"], 400),
        (1, ["ns/b"], 300),
    ]
    assert command.asked[-1] == (None, "c", 3.0)

    wide = runner.invoke(command, ["inspect", "n0", "-o", "wide"])
    assert wide.exit_code == 0 and "ns/a 600m 0Mi" in wide.stdout and "GPU-n0-1" in wide.stdout
    assert runner.invoke(command, ["inspect", "-l", "zone=b"]).stdout.startswith("No GPU nodes")


def test_explain_reads_the_pod_in_the_namespace_asked_for(server: fake.FakeApiServer, tmp_path: Path) -> None:
    command = on(server)
    result = runner.invoke(command, ["explain", "big", "-n", "ns"])
    assert result.exit_code == 0, result.output
    assert "Pod ns/big: Pending" in result.stdout
    assert "PodScheduled=False Unschedulable: 0/1 ..." in result.stdout
    assert "0/1 nodes are available: 1 sharegpu: no GPU with 500 milli-GPU free (largest free: 400)." in result.stdout
    assert "n0/gpu0: sharegpu.io/gpu-milli requested 500, free 400 of 1000" in result.stdout

    result = runner.invoke(command, ["explain", "team/small", "-o", "json"])
    document = orjson.loads(result.stdout)
    assert (document["pod"], document["outcome"], document["choice"]["node"]) == ("team/small", "fits", "n0")

    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        yaml.safe_dump({"current-context": "t", "contexts": [{"name": "t", "context": {"namespace": "team"}}]})
    )
    result = runner.invoke(command, ["explain", "small", "--kubeconfig", str(kubeconfig)])
    assert result.exit_code == 0 and "Pod team/small" in result.stdout, result.output
    assert command.asked[-1][0] == str(kubeconfig)


def test_the_kubeconfig_context_names_the_default_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config"
    path.write_text(
        yaml.safe_dump(
            {
                "current-context": "a",
                "contexts": [{"name": "a", "context": {"namespace": "team-a"}}, {"name": "b", "context": {}}],
            }
        )
    )
    assert app.default_namespace(str(path), None) == "team-a"
    assert app.default_namespace(str(path), "b") == "default"
    monkeypatch.setenv("KUBECONFIG", str(path))
    assert app.default_namespace(None, None) == "team-a"
    with pytest.raises(credentials.CredentialsError, match="missing: No such file"):
        app.default_namespace(str(tmp_path / "missing"), None)  # as the credentials would say
    # $KUBECONFIG's files merged, as kubectl merges them: the first that defines a context wins.
    other = tmp_path / "other"
    contexts = [{"name": "a", "context": {"namespace": "not-this"}}, {"name": "c", "context": {"namespace": "team-c"}}]
    other.write_text(yaml.safe_dump({"current-context": "c", "contexts": contexts}))
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{path}:{other}")
    assert (app.default_namespace(None, None), app.default_namespace(None, "c")) == ("team-a", "team-c")


def one_line_error(result: Any, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kubectl sharegpu: error: "), result.stderr
    return str(lines[0].removeprefix("kubectl sharegpu: error: "))


def test_errors_are_one_line_with_the_right_exit_status(server: fake.FakeApiServer, tmp_path: Path) -> None:
    command = on(server)
    assert one_line_error(runner.invoke(command, ["explain", "nope", "-n", "ns"]), 1) == "pod ns/nope not found"
    assert one_line_error(runner.invoke(command, ["inspect", "-o", "yaml"]), 2) == (
        "-o yaml: unknown output format; use wide or json (default: a table)"
    )
    assert one_line_error(runner.invoke(command, ["explain", "big", "-o", "wide"]), 2).startswith("-o wide:")
    assert one_line_error(runner.invoke(command, ["explain", "a/b/c"]), 2).startswith("'a/b/c': give the pod as")
    assert one_line_error(runner.invoke(command, ["explain", "big", "--policy", "best"]), 2).startswith(
        "unknown policy"
    )
    assert one_line_error(runner.invoke(command, ["inspect", "n7"]), 1) == "no GPU node named n7"

    server.fail(404, path=resources.SHARED_DEVICE_GROUP.path())
    assert one_line_error(runner.invoke(command, ["groups"]), 1) == (
        "the API server does not serve shareddevicegroups.sharegpu.io (is sharegpu installed in this cluster?)"
    )
    server.fail(403, path=paths.NODES, reason="Forbidden")
    assert one_line_error(runner.invoke(command, ["inspect"]), 1) == "403 Forbidden: injected 403"
    locked = fake.FakeApiServer(tokens={"secret"})
    assert one_line_error(runner.invoke(on(locked), ["budgets"]), 1) == (
        "the API server refused the credentials (401 Unauthorized)"
    )


def test_an_object_sharegpu_cannot_read_is_named_not_taken_for_a_connection_failure(
    server: fake.FakeApiServer,
) -> None:
    path = resources.GPU_BUDGET.path("team")
    server.put_object(path, {"kind": "GPUBudget", "metadata": {"name": "b", "namespace": "team"},
                             "spec": {"gpuHours": "lots"}})  # fmt: skip
    text = one_line_error(runner.invoke(on(server), ["budgets"]), 1)
    assert text.startswith(
        f"the API server's {resources.GPU_BUDGET.path()} answer holds an object sharegpu cannot read: "
        "GPUBudget team/b: Expected `int`, got `str` - at `$.items[0].spec.gpuHours`"
    ), text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "--bogus"], "No such option: --bogus"),
        (["top", "--request-timeout", "0"], "Invalid value for '--request-timeout': Input should be greater than"),
        (["nope"], "No such command 'nope'."),
        (["explain"], "Missing argument 'pod'."),
    ],
)
def test_the_command_lines_own_usage_errors_are_one_line_too(
    server: fake.FakeApiServer, args: list[str], message: str
) -> None:
    assert one_line_error(runner.invoke(on(server), args), 2).startswith(message)


def test_connection_errors_name_the_kubeconfig_or_the_api_server(tmp_path: Path) -> None:
    command = app.make_app()  # the real credentials and transport
    missing = tmp_path / "nope.yaml"
    assert one_line_error(runner.invoke(command, ["inspect", "--kubeconfig", str(missing)]), 2) == (
        f"kubeconfig {missing}: No such file or directory"
    )
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "config"
    config.write_text(
        yaml.safe_dump(
            {
                "current-context": "here",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "here", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    text = one_line_error(runner.invoke(command, ["inspect", "--kubeconfig", str(config)]), 1)
    assert text.startswith(f"cannot reach the API server at http://127.0.0.1:{port}: GET /api/v1/"), text
    text = one_line_error(runner.invoke(command, ["groups", "--kubeconfig", str(config), "--context", "there"]), 2)
    assert text == f"{config}: no context named 'there'"


def test_a_malformed_kubeconfig_is_one_line_naming_the_field_and_the_file(tmp_path: Path) -> None:
    command = app.make_app()  # the real credentials
    config = tmp_path / "config"

    def written(**changes: object) -> str:
        doc = {
            "current-context": "here",
            "clusters": [{"name": "c", "cluster": {"server": changes.pop("server", "https://127.0.0.1:6443")}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "here", "context": {"cluster": "c", "user": "u", **changes}}],
        }
        config.write_text(yaml.safe_dump(doc))
        return str(config)

    config.write_text(yaml.safe_dump({"current-context": "here", "contexts": 5}))
    assert one_line_error(runner.invoke(command, ["inspect", "--kubeconfig", str(config)]), 2) == (
        f"kubeconfig {config}: contexts is not a list"
    )
    assert one_line_error(runner.invoke(command, ["groups", "--kubeconfig", written(server="127.0.0.1:6443")]), 2) == (
        f"kubeconfig {config}: cluster 'c': server '127.0.0.1:6443' is not an http(s) URL (https://HOST[:PORT])"
    )
    assert one_line_error(runner.invoke(command, ["explain", "p", "--kubeconfig", written(namespace=["a"])]), 2) == (
        f"kubeconfig {config}: context 'here': namespace ['a'] is not a string"
    )
    # and explain, too, names what is wrong with the file (it reads the context's namespace first)
    config.write_text(yaml.safe_dump({"current-context": "here", "contexts": 5}))
    assert one_line_error(runner.invoke(command, ["explain", "p", "--kubeconfig", str(config)]), 2) == (
        f"kubeconfig {config}: contexts is not a list"
    )


def test_a_dashboard_port_in_use_is_one_line_naming_it(server: fake.FakeApiServer) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        text = one_line_error(runner.invoke(on(server), ["dashboard", "--port", str(port)]), 2)
    assert text == f"--port {port}: cannot serve on 127.0.0.1:{port}: Address already in use", text


def test_the_console_script_and_help() -> None:
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="kubectl-sharegpu")
    assert script.value == "sharegpu.kubectl.app:main"
    result = runner.invoke(app.app, ["--help"])
    assert result.exit_code == 0
    for command in ("inspect", "explain", "groups", "budgets", "top"):
        assert command in result.stdout


def usage_report(node: str, pods: list[tuple[str, str, int, int, int | None, int | None]], at: str) -> Json:
    """A node's GpuUsage: (namespace, pod, GPU index, used MiB, SM %, share milli) per pod."""
    made = usage.report(
        node, None, at, 10,
        [usage.GpuUse(uuid=f"GPU-{node}-{i}", index=i, memory_mib=16384, used_mib=0) for i in range(2)],
        [
            usage.PodUse(namespace=ns, name=name, uid=f"uid-{name}", uuid=f"GPU-{node}-{i}", used_mib=mib,
                         sm_percent=sm, share_milli=share, allocated_mib=4096)
            for ns, name, i, mib, sm, share in pods
        ],
    )  # fmt: skip
    return wire.encode(made)


def test_top_shows_what_each_share_uses_sorted_and_per_namespace(server: fake.FakeApiServer) -> None:
    now = wire.timestamp(time.time() - 30)
    server.put_object(
        paths.GPU_USAGES,
        usage_report("n0", [("ns", "a", 0, 3000, 55, 600), ("ns", "b", 1, 200, 0, 700), ("team", "t", 1, 900, 9, 300)],
                     now),
    )  # fmt: skip
    command = on(server)
    result = runner.invoke(command, ["top"])
    assert result.exit_code == 0, result.output
    lines = [line.split() for line in result.stdout.splitlines()]
    head = ["NAMESPACE", "POD", "NODE", "GPU", "SHARE", "MEMORY", "GIVEN", "MEMORY", "USED", "SM", "SM/SHARE", "AGE"]
    assert lines[0] == head
    assert [line[:2] for line in lines[1:]] == [["ns", "a"], ["team", "t"], ["ns", "b"]], "most memory used first"
    assert lines[1][4:11] == ["600m", "4096", "MiB", "3000", "MiB", "55%", "91%"]
    assert 29 <= int(lines[1][11].rstrip("s")) <= 40

    idle = runner.invoke(command, ["top", "--sort", "idle", "-o", "json"])
    document = orjson.loads(idle.stdout)
    assert document["kind"] == "GpuUsageReport" and document["by"] == "pod"
    assert [(r["pod"], r["shareUsedPercent"]) for r in document["rows"]] == [("b", 0), ("t", 30), ("a", 91)]

    spaces = orjson.loads(runner.invoke(command, ["top", "--by", "namespace", "-o", "json"]).stdout)["rows"]
    assert [(r["namespace"], r["pods"], r["usedMiB"], r["shareMilli"], r["smPercent"]) for r in spaces] == [
        ("ns", 2, 3200, 1300, 55), ("team", 1, 900, 300, 9)
    ]  # fmt: skip
    only = runner.invoke(command, ["top", "-n", "team"])
    assert "team" in only.stdout and " a " not in only.stdout
    assert runner.invoke(command, ["top", "-n", "empty"]).stdout == "No GPU use reported in namespace empty.\n"
    wrong = runner.invoke(command, ["top", "--sort", "fastest"])
    assert wrong.exit_code == 2 and "--sort: unknown order 'fastest'" in wrong.stderr


def test_top_shows_a_node_written_pod_name_as_text(server: fake.FakeApiServer) -> None:
    """A compromised node names pods in its GpuUsage as it likes: read as markup, `x[/]` failed the
    command (every row hidden) and `[link=...]` made a link; a control character reached the terminal."""
    now = wire.timestamp(time.time() - 30)
    hostile: list[tuple[str, str, int, int, int | None, int | None]] = [
        ("ns", "x[/]", 0, 100, 1, 500),
        ("ns", "[link=https://evil.example]t[/link]\x1b]0;pwned", 1, 50, 1, 500),
    ]
    server.put_object(paths.GPU_USAGES, usage_report("n0", hostile, now))
    result = runner.invoke(on(server), ["top"])
    assert result.exit_code == 0, result.output
    assert "x[/]" in result.stdout and "[link=https://evil.example]t[/link]" in result.stdout
    assert "\x1b" not in result.stdout
