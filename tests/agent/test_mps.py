"""The MPS supervisor over a fake control daemon that behaves as the real one was seen to (a server
for its first client, left running on SIGTERM, ended by `quit`): one daemon per GPU with its own
directories and environment, restarted with backoff when it dies (its server going with it), stopped
through its control pipe when its GPU leaves, what a previous agent left ended before a start, the
daemons' output relayed as log records, and nothing left running after `stop`."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sharegpu.agent import host, mps
from sharegpu.api import handoff
from sharegpu.core import errors
from tests.agent.conftest import gone
from tests.agent.fake_mps_daemon import connect, servers, settings, started, write_fake_daemon

FAST = mps.Backoff(first=0.05, most=0.4, settled=30.0)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def waits(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The restart delays the supervisor logged (and nothing else warned: no child reaped behind asyncio's back)."""
    assert {r.name for r in caplog.records} <= {mps.__name__}
    caplog.records[:] = [r for r in caplog.records if " in " in r.getMessage()]  # not "ending ... left"
    return [float(r.getMessage().rsplit(" in ", 1)[1].removesuffix(" s")) for r in caplog.records]


def running(supervisor: mps.Supervisor, uuid: str) -> bool:
    status = supervisor.status().get(uuid)
    return status is not None and status.running


def pid(supervisor: mps.Supervisor, uuid: str) -> int:
    value = supervisor.status()[uuid].pid
    assert value is not None
    return value


async def running_pid(supervisor: mps.Supervisor, uuid: str) -> int:
    """The daemon's pid once the supervisor has it (its child may act before the supervisor resumes)."""
    await until(lambda: running(supervisor, uuid))
    return pid(supervisor, uuid)


# ---------------------------------------------------------------- the pure part


def test_the_layout_names_each_gpus_directories() -> None:
    layout = mps.Layout(Path("/run/x"))
    assert layout.pipe("GPU-a1") == Path("/run/x/GPU-a1/pipe")
    assert layout.log("GPU-a1") == Path("/run/x/GPU-a1/log")
    assert layout.gpu("MIG-GPU-1/2/0") == Path("/run/x/MIG-GPU-1_2_0")
    assert layout.daemon_env("GPU-a1") == {
        "CUDA_VISIBLE_DEVICES": "GPU-a1",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/x/GPU-a1/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/run/x/GPU-a1/log",
    }
    assert mps.Layout().tenant("GPU-a1") == Path(handoff.mps_tenant_folder("GPU-a1")), (
        "where the DRA path's CDI spec mounts it from"
    )
    assert mps.Layout().pipe("GPU-a1") == Path("/run/sharegpu/mps/GPU-a1/pipe")


@pytest.mark.parametrize("uuid", ["", "..", "../etc", "GPU-", "0", "all"])
def test_the_layout_refuses_what_is_not_a_uuid(uuid: str) -> None:
    with pytest.raises(errors.InvalidInputError, match="not a GPU or MIG UUID"):
        mps.Layout().pipe(uuid)


def test_backoff_doubles_up_to_its_ceiling() -> None:
    backoff = mps.Backoff(first=1.0, most=60.0)
    assert [backoff.delay(n) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff.delay(10_000) == 60


def test_exits_are_described() -> None:
    assert mps.describe_exit(1) == "exited with status 1"
    assert mps.describe_exit(-9) == "killed by signal 9 (SIGKILL)"


def test_the_binary_is_found_on_path_or_as_an_executable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = write_fake_daemon(tmp_path / "bin")
    assert mps.locate(binary) == str(binary)
    assert mps.Supervisor(binary).available()
    monkeypatch.setenv("PATH", str(binary.parent))
    assert mps.locate(host.MPS_BINARY) == str(binary) and mps.Supervisor().available()
    assert not mps.Supervisor(tmp_path / "absent").available()
    plain = tmp_path / "plain"
    plain.write_text("")
    assert not mps.Supervisor(plain).available()
    assert not mps.Supervisor("sharegpu-no-such-mps-control").available()


# ---------------------------------------------------------------- the supervisor


async def test_one_daemon_per_gpu_with_its_environment_and_directories(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST, clock=lambda: 7.0)
    await supervisor.ensure({"GPU-a", "GPU-b"})
    try:
        await until(lambda: all((layout.pipe(u) / "control").exists() for u in ("GPU-a", "GPU-b")))
        statuses = supervisor.status()
        assert list(statuses) == ["GPU-a", "GPU-b"]
        for uuid, status in statuses.items():
            assert status.running and status.problem == "" and status.restarts == 0
            assert status.last_exit is None and status.since == 7.0
            assert [(s.pid, s.devices) for s in started(layout.log(uuid))] == [(status.pid, uuid)]
            assert stat.S_ISFIFO((layout.pipe(uuid) / "control").stat().st_mode)
            for folder in (layout.gpu(uuid), layout.pipe(uuid), layout.log(uuid)):
                assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        await supervisor.ensure({"GPU-a", "GPU-b"})  # already running: nothing changes
        assert {u: s.pid for u, s in supervisor.status().items()} == {u: s.pid for u, s in statuses.items()}
    finally:
        await supervisor.stop()
    assert supervisor.status() == {}
    for status in statuses.values():
        assert status.pid is not None and gone(status.pid)
        assert not (layout.pipe(status.uuid) / "control").exists()  # it was told to quit, and did


def linked(supervisor: mps.Supervisor, uuid: str) -> bool:
    status = supervisor.status().get(uuid)
    return status is not None and status.linked


def tell(binary: Path, pipe: Path, command: str) -> subprocess.CompletedProcess[str]:
    """Run the control program in client mode on `pipe`, as a tenant or the agent does."""
    env = {**os.environ, handoff.MPS_PIPE: str(pipe)}
    return subprocess.run([str(binary)], input=f"{command}\n", env=env, capture_output=True, text=True, check=False)


async def test_tenants_get_a_folder_of_their_own_holding_the_control_socket_alone(tmp_path: Path) -> None:
    binary = write_fake_daemon(tmp_path / "bin")
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(binary, layout, backoff=FAST)
    await supervisor.ensure({"GPU-a"})
    try:
        await until(lambda: linked(supervisor, "GPU-a"))
        daemon, tenant = layout.pipe("GPU-a"), layout.tenant_pipe("GPU-a")
        assert tenant == layout.gpu("GPU-a") / "tenant" / "pipe"
        assert sorted(p.name for p in tenant.iterdir()) == ["control"], "no control_privileged, no log"
        assert (tenant / "control").stat().st_ino == (daemon / "control").stat().st_ino, "a hard link"
        for folder in (layout.tenant("GPU-a"), tenant):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o755 and folder.stat().st_uid == os.getuid()
        first = pid(supervisor, "GPU-a")
        # A tenant may talk to the daemon (a CUDA client does), but neither quit it nor change its settings.
        for command in ("quit", "set_default_active_thread_percentage 100"):
            assert tell(binary, tenant, command).returncode == 0  # the real client says nothing went wrong either
        connect(tenant)
        await until(lambda: len(servers(layout.log("GPU-a"))) == 1)  # the daemon did hear the tenant
        await asyncio.sleep(0.2)
        assert running(supervisor, "GPU-a") and pid(supervisor, "GPU-a") == first
        assert settings(layout.log("GPU-a")) == []
        assert tell(binary, daemon, "set_default_active_thread_percentage 40").returncode == 0  # the agent's folder may
        await until(lambda: settings(layout.log("GPU-a")) == ["set_default_active_thread_percentage 40"])
    finally:
        await supervisor.stop()
    assert not (layout.tenant_pipe("GPU-a") / "control").exists(), "no link to a daemon that is gone"


async def test_a_daemon_takes_its_gpus_ceiling_before_tenants_reach_it_and_each_change_after(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST)
    supervisor.limit({"GPU-a": mps.Ceiling(25, 2048)})
    await supervisor.ensure({"GPU-a"})
    try:
        await until(lambda: linked(supervisor, "GPU-a"))
        first = ["set_default_active_thread_percentage 25", "set_default_device_pinned_mem_limit 0 2048M"]
        assert settings(layout.log("GPU-a")) == first, "taken before the socket was linked for tenants"
        assert supervisor.status()["GPU-a"].ceiling == mps.Ceiling(25, 2048)
        connect(layout.tenant_pipe("GPU-a"))
        await until(lambda: len(servers(layout.log("GPU-a"))) == 1)
        [server] = servers(layout.log("GPU-a"))
        supervisor.limit({"GPU-a": mps.Ceiling(60, 4096), "GPU-b": mps.Ceiling(10, 100)})  # GPU-b: no daemon, kept
        await until(lambda: supervisor.status()["GPU-a"].ceiling == mps.Ceiling(60, 4096))
        assert settings(layout.log("GPU-a"))[2:] == [
            "set_default_active_thread_percentage 60",
            "set_default_device_pinned_mem_limit 0 4096M",
            f"set_active_thread_percentage {server} 60",
            f"set_device_pinned_mem_limit {server} 0 4096M",
        ], "the defaults for servers to come, and the running server's settings for its new clients"
        supervisor.limit({"GPU-a": mps.Ceiling(60, 4096)})  # unchanged: nothing sent
        await asyncio.sleep(0.2)
        assert len(settings(layout.log("GPU-a"))) == 6
        os.kill(pid(supervisor, "GPU-a"), signal.SIGKILL)  # a restarted daemon takes the ceiling again
        await until(lambda: len(started(layout.log("GPU-a"))) == 2 and linked(supervisor, "GPU-a"))
        assert settings(layout.log("GPU-a"))[6:] == [
            "set_default_active_thread_percentage 60",
            "set_default_device_pinned_mem_limit 0 4096M",
        ]
    finally:
        await supervisor.stop()


def test_a_ceiling_needs_a_percentage_and_some_memory() -> None:
    for percent, memory in ((0, 1), (101, 1), (50, 0)):
        with pytest.raises(errors.InvalidInputError, match="an MPS ceiling needs"):
            mps.Ceiling(percent, memory)


async def test_a_restarted_daemon_s_new_socket_replaces_the_tenants_link(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST)
    await supervisor.ensure({"GPU-a"})
    try:
        await until(lambda: linked(supervisor, "GPU-a"))
        os.link(layout.tenant_pipe("GPU-a") / "control", tmp_path / "old")  # kept: its inode is not reused
        before = (tmp_path / "old").stat().st_ino
        os.kill(pid(supervisor, "GPU-a"), signal.SIGKILL)
        await until(lambda: len(started(layout.log("GPU-a"))) == 2 and linked(supervisor, "GPU-a"))
        after = (layout.tenant_pipe("GPU-a") / "control").stat().st_ino
        assert after != before and after == (layout.pipe("GPU-a") / "control").stat().st_ino
    finally:
        await supervisor.stop()


def test_linking_follows_no_link_and_links_only_a_socket(tmp_path: Path) -> None:
    daemon, tenant, elsewhere = tmp_path / "pipe", tmp_path / "tenant", tmp_path / "elsewhere"
    for folder in (daemon, tenant, elsewhere):
        folder.mkdir()
    (elsewhere / "secret").write_text("x")
    (daemon / "control").symlink_to(elsewhere / "secret")
    with pytest.raises(errors.InvalidInputError, match="is not the daemon's control socket"):
        mps.link_control(daemon, tenant)
    (daemon / "control").unlink()
    with pytest.raises(FileNotFoundError):
        mps.link_control(daemon, tenant)
    os.mkfifo(daemon / "control")
    (tenant / "control").symlink_to(elsewhere / "secret")  # planted where the link goes: replaced, not followed
    mps.link_control(daemon, tenant)
    assert (tenant / "control").lstat().st_ino == (daemon / "control").lstat().st_ino
    assert (elsewhere / "secret").read_text() == "x" and sorted(p.name for p in tenant.iterdir()) == ["control"]
    moved = tmp_path / "moved"
    tenant.rename(moved)
    tenant.symlink_to(moved)  # the tenants' folder itself a link: refused
    with pytest.raises(NotADirectoryError):  # O_NOFOLLOW on a link to a folder
        mps.link_control(daemon, tenant)


async def test_a_killed_daemon_is_restarted(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST)
    await supervisor.ensure({"GPU-a"})
    try:
        await until((layout.pipe("GPU-a") / "control").exists)
        first = await running_pid(supervisor, "GPU-a")
        os.kill(first, signal.SIGKILL)
        await until(lambda: len(started(layout.log("GPU-a"))) == 2 and running(supervisor, "GPU-a"))
        status = supervisor.status()["GPU-a"]
        assert status.pid != first and status.restarts == 1 and status.last_exit == -signal.SIGKILL
        assert gone(first)
    finally:
        await supervisor.stop()
    assert status.pid is not None and gone(status.pid)


async def test_a_daemon_that_keeps_failing_is_restarted_ever_more_slowly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin", exit_code=3), layout, backoff=FAST)
    caplog.set_level(logging.WARNING, logger=mps.__name__)
    await supervisor.ensure({"GPU-a"})
    await asyncio.sleep(0.6)  # waits of 0.05, 0.1, 0.2, 0.4: at most five starts, not dozens
    await until(lambda: not running(supervisor, "GPU-a"))  # between two starts
    status = supervisor.status()["GPU-a"]
    await supervisor.stop()
    starts = len(started(layout.log("GPU-a")))
    assert 2 <= starts <= 5
    assert not status.running and status.pid is None and status.last_exit == 3
    assert status.problem.startswith("exited with status 3; restarting in ")
    delays = waits(caplog)
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.4][: len(delays)] and len(delays) >= 2


async def test_a_daemon_that_stayed_up_a_while_starts_its_backoff_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ticks = itertools.count(step=100.0)  # every run looks long: each exit is the first failure
    layout = mps.Layout(tmp_path / "mps")
    binary = write_fake_daemon(tmp_path / "bin", exit_code=1)
    supervisor = mps.Supervisor(binary, layout, backoff=FAST, clock=lambda: next(ticks))
    caplog.set_level(logging.WARNING, logger=mps.__name__)
    await supervisor.ensure({"GPU-a"})
    await until(lambda: len(started(layout.log("GPU-a"))) >= 3)
    await supervisor.stop()
    assert set(waits(caplog)) == {0.05}


async def test_a_gpu_left_out_has_its_daemon_stopped(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST)
    await supervisor.ensure({"GPU-a", "GPU-b"})
    try:
        await until(lambda: all((layout.pipe(u) / "control").exists() for u in ("GPU-a", "GPU-b")))
        kept, dropped = await running_pid(supervisor, "GPU-a"), await running_pid(supervisor, "GPU-b")
        await supervisor.ensure({"GPU-a"})
        assert list(supervisor.status()) == ["GPU-a"] and pid(supervisor, "GPU-a") == kept
        assert gone(dropped) and not (layout.pipe("GPU-b") / "control").exists()
        await asyncio.sleep(0.2)  # no watcher brings it back
        assert len(started(layout.log("GPU-b"))) == 1
    finally:
        await supervisor.stop()
    assert gone(kept)


async def test_a_missing_binary_is_reported_and_retried(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor("sharegpu-no-such-mps-control", layout, backoff=FAST)
    await supervisor.ensure({"GPU-a"})
    await until(lambda: "not found" in supervisor.status()["GPU-a"].problem)
    status = supervisor.status()["GPU-a"]
    assert not status.running and status.pid is None and status.restarts == 0 and status.last_exit is None
    assert status.problem.startswith("binary sharegpu-no-such-mps-control not found on PATH; trying again in ")
    await supervisor.stop()

    absent = mps.Supervisor(tmp_path / "absent", layout, backoff=FAST)
    await absent.ensure({"GPU-a"})
    await until(lambda: "missing" in absent.status()["GPU-a"].problem)
    await absent.stop()
    assert not layout.root.exists()  # nothing was started, so nothing was prepared


async def test_a_daemon_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    binary = tmp_path / "stubborn"
    binary.write_text(  # as a client (no -f) it cannot reach the daemon; as the daemon it ignores SIGTERM
        f"#!{sys.executable}\nimport pathlib, signal, sys, time\nif sys.argv[1:] != ['-f']:\n    sys.exit(1)\n"
        f"signal.signal(signal.SIGTERM, signal.SIG_IGN)\npathlib.Path({str(ready)!r}).touch()\n"
        "while True:\n    time.sleep(1)\n"
    )
    binary.chmod(0o755)
    supervisor = mps.Supervisor(binary, mps.Layout(tmp_path / "mps"), backoff=FAST, grace=0.2)
    await supervisor.ensure({"GPU-a"})
    await until(ready.exists)
    daemon = await running_pid(supervisor, "GPU-a")
    began = time.monotonic()
    await supervisor.stop()
    assert time.monotonic() - began >= 0.2
    assert gone(daemon)


async def test_ensure_refuses_a_bad_uuid_before_changing_anything(tmp_path: Path) -> None:
    supervisor = mps.Supervisor(tmp_path / "absent", mps.Layout(tmp_path / "mps"), backoff=FAST)
    with pytest.raises(errors.InvalidInputError):
        await supervisor.ensure({"GPU-a", "../x"})
    assert supervisor.status() == {}


# ---------------------------------------------------------------- the lifecycle (issue 27)


async def first_client(layout: mps.Layout, uuid: str = "GPU-a") -> int:
    """Be the daemon's first CUDA client: the pid of the server it then starts."""
    connect(layout.pipe(uuid))
    await until(lambda: len(servers(layout.log(uuid))) == 1)
    [server] = servers(layout.log(uuid))
    return server


def previous_agent(binary: Path, layout: mps.Layout, uuid: str) -> int:
    """A daemon as a previous agent left it: started through a parent that is gone (so not this
    test's child), on the GPU's directories; its pid."""
    for folder in (layout.gpu(uuid), layout.pipe(uuid), layout.log(uuid)):
        folder.mkdir(parents=True, exist_ok=True)
    before = len(started(layout.log(uuid)))
    launch = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True, stdout=subprocess.DEVNULL)"
    subprocess.run(
        [sys.executable, "-c", launch, str(binary), "-f"], env={**os.environ, **layout.daemon_env(uuid)}, check=True
    )
    deadline = time.monotonic() + 5
    while len(started(layout.log(uuid))) == before:
        assert time.monotonic() < deadline, "the previous agent's daemon did not start"
        time.sleep(0.01)
    return started(layout.log(uuid))[-1].pid


async def test_stop_ends_the_server_the_daemon_started_for_its_first_client(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST, proc=Path("/proc"))
    await supervisor.ensure({"GPU-a"})
    try:
        await until((layout.pipe("GPU-a") / "control").exists)
        daemon = await running_pid(supervisor, "GPU-a")
        server = await first_client(layout)
        await until(lambda: mps.tied(Path("/proc"), layout, "GPU-a") == sorted([daemon, server]))
    finally:
        began = time.monotonic()
        await supervisor.stop()
    assert time.monotonic() - began < supervisor.grace, "quit ended both: nothing had to be killed"
    assert gone(daemon)
    await until(lambda: gone(server), timeout=2.0)
    assert mps.tied(Path("/proc"), layout, "GPU-a") == []


async def test_sigterm_alone_would_leave_the_server_running(tmp_path: Path) -> None:
    """What the fake does, as the real daemon did on the H200: the reason stop sends `quit`."""
    layout = mps.Layout(tmp_path / "mps")
    daemon = previous_agent(write_fake_daemon(tmp_path / "bin"), layout, "GPU-a")
    try:
        await until((layout.pipe("GPU-a") / "control").exists)
        server = await first_client(layout)
        os.kill(daemon, signal.SIGTERM)
        await until(lambda: mps.tied(Path("/proc"), layout, "GPU-a") == [server])
        assert not gone(server)
    finally:
        for each in mps.tied(Path("/proc"), layout, "GPU-a"):
            os.kill(each, signal.SIGKILL)


async def test_a_daemon_that_dies_takes_its_server_with_it_before_the_restart(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST)
    await supervisor.ensure({"GPU-a"})
    try:
        await until((layout.pipe("GPU-a") / "control").exists)
        first = await running_pid(supervisor, "GPU-a")
        server = await first_client(layout)
        os.kill(first, signal.SIGTERM)  # it exits and leaves the server, as the real one does
        await until(lambda: len(started(layout.log("GPU-a"))) == 2 and running(supervisor, "GPU-a"))
        assert gone(server), "the orphaned server was ended before the new daemon started"
        assert mps.tied(Path("/proc"), layout, "GPU-a") == [pid(supervisor, "GPU-a")]
    finally:
        await supervisor.stop()
    assert mps.tied(Path("/proc"), layout, "GPU-a") == []


async def test_what_a_previous_agent_left_is_ended_before_a_new_daemon_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = mps.Layout(tmp_path / "mps")
    binary = write_fake_daemon(tmp_path / "bin")
    old = previous_agent(binary, layout, "GPU-a")
    await until((layout.pipe("GPU-a") / "control").exists)
    old_server = await first_client(layout)
    caplog.set_level(logging.WARNING, logger=mps.__name__)
    supervisor = mps.Supervisor(binary, layout, backoff=FAST)
    await supervisor.ensure({"GPU-a"})
    try:
        await until(lambda: len(started(layout.log("GPU-a"))) == 2 and running(supervisor, "GPU-a"))
        new = pid(supervisor, "GPU-a")
        assert new != old
        await until(lambda: mps.tied(Path("/proc"), layout, "GPU-a") == [new])
        assert not mps.tied(Path("/proc"), layout, "GPU-a").count(old_server)
        [ended] = [r.getMessage() for r in caplog.records if "previous agent" in r.getMessage()]
        pids = ", ".join(map(str, sorted([old, old_server])))
        assert ended == f"MPS on GPU-a: ending 2 process(es) a previous agent left: {pids}"
    finally:
        await supervisor.stop()
    assert mps.tied(Path("/proc"), layout, "GPU-a") == []


async def test_a_server_left_without_its_daemon_is_killed_before_a_start(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    binary = write_fake_daemon(tmp_path / "bin")
    old = previous_agent(binary, layout, "GPU-a")
    await until((layout.pipe("GPU-a") / "control").exists)
    old_server = await first_client(layout)
    os.kill(old, signal.SIGTERM)  # an old agent stopped it with SIGTERM: the server stays, nobody listens
    await until(lambda: mps.tied(Path("/proc"), layout, "GPU-a") == [old_server])
    supervisor = mps.Supervisor(binary, layout, backoff=FAST, grace=0.3)
    await supervisor.ensure({"GPU-a"})
    try:
        await until(lambda: running(supervisor, "GPU-a"))
        assert old_server not in mps.tied(Path("/proc"), layout, "GPU-a"), "killed before the start"
        # The new daemon is tied once it has exec'd (its name and pipe set): only it, then.
        await until(lambda: mps.tied(Path("/proc"), layout, "GPU-a") == [pid(supervisor, "GPU-a")])
    finally:
        await supervisor.stop()


async def test_the_daemons_output_is_relayed_as_log_records_naming_the_gpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=mps.daemon_log.name)
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST)
    await supervisor.ensure({"GPU-a"})
    try:
        await until((layout.pipe("GPU-a") / "control").exists)
        await first_client(layout)
    finally:
        await supervisor.stop()
    relayed = [(r.getMessage(), getattr(r, "gpu", None)) for r in caplog.records if r.name == mps.daemon_log.name]
    assert relayed == [
        ("[fake] control daemon started for GPU-a", "GPU-a"),
        ("[fake] starting a server for the first client", "GPU-a"),
        ("[fake] quitting", "GPU-a"),
    ]


def test_tied_finds_daemons_and_servers_by_their_directories_and_never_a_client(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    layout = mps.Layout(tmp_path / "mps")

    def process(pid: int, comm: str, env: dict[str, str], files: tuple[str, ...] = ()) -> None:
        entry = proc / str(pid)
        (entry / "fd").mkdir(parents=True)
        (entry / "comm").write_text(comm + "\n")
        (entry / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
        for n, target in enumerate(files):
            (entry / "fd" / str(n)).symlink_to(target)

    pipe = {"CUDA_MPS_PIPE_DIRECTORY": str(layout.pipe("GPU-a"))}
    process(10, "nvidia-cuda-mps", pipe)  # a daemon of GPU-a
    process(11, "nvidia-cuda-mps", {}, (str(layout.log("GPU-a") / "server.log"),))  # its server, env cleared
    process(12, "python3", pipe)  # a client with the same variable: never
    process(13, "nvidia-cuda-mps", {"CUDA_MPS_PIPE_DIRECTORY": str(layout.pipe("GPU-b"))})  # another GPU
    process(14, "nvidia-cuda-mps", {}, (str(tmp_path / "mps" / "GPU-ab" / "log"),))  # a prefix, not the folder
    (proc / "self").mkdir()
    assert mps.tied(proc, layout, "GPU-a") == [10, 11]
    assert mps.tied(proc, layout, "GPU-b") == [13]
    assert mps.tied(tmp_path / "absent", layout, "GPU-a") == []


def test_a_link_a_tenant_planted_in_its_gpus_folder_is_removed_never_followed(tmp_path: Path) -> None:
    """Tenants mount their GPU's folder: one replaces pipe/ by a link to a folder of the host's and log
    by a file. The root agent preparing the folders removes both instead of creating or chmodding
    through them."""
    root, victim = tmp_path / "mps", tmp_path / "host-folder"
    victim.mkdir(mode=0o700)
    layout = mps.Layout(root)
    uuid = "GPU-aaaa"
    gpu = layout.gpu(uuid)
    gpu.mkdir(parents=True)
    layout.pipe(uuid).symlink_to(victim)
    layout.log(uuid).write_text("not a folder")
    supervisor = mps.Supervisor("nvidia-cuda-mps-control", layout)
    supervisor._prepare(uuid)
    for path in (layout.pipe(uuid), layout.log(uuid)):
        assert path.is_dir() and not path.is_symlink()
        assert oct(path.stat().st_mode & 0o777) == oct(mps.MODE)
    assert oct(victim.stat().st_mode & 0o777) == "0o700", "the link's target untouched"
    supervisor._prepare(uuid)  # again: what is right stays
    assert layout.pipe(uuid).is_dir()


def test_the_daemons_answers_to_settings_tell_taken_from_refused() -> None:
    assert not mps.refused("") and not mps.refused("75.0\n") and not mps.refused("25.0\n25.0\n")
    assert mps.refused("Insufficient privileges for UID 4242. Control deamon settings can only be modified by ...")
    assert mps.refused("75.0\nNot enough privilege to execute quit command\n")
