"""The MPS supervisor over a fake control daemon: one daemon per GPU with its own directories and
environment, restarted with backoff when it dies, stopped when its GPU leaves, and nothing left
running after `stop`."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sharegpu.agent import mps
from sharegpu.api import handoff
from sharegpu.core import errors
from tests.agent.fake_mps_daemon import started, write_fake_daemon

FAST = mps.Backoff(first=0.05, most=0.4, settled=30.0)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def waits(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The restart delays the supervisor logged (and nothing else warned: no child reaped behind asyncio's back)."""
    assert {r.name for r in caplog.records} <= {mps.__name__}
    return [float(r.getMessage().rsplit(" in ", 1)[1].removesuffix(" s")) for r in caplog.records]


def running(supervisor: mps.Supervisor, uuid: str) -> bool:
    status = supervisor.status().get(uuid)
    return status is not None and status.running


def pid(supervisor: mps.Supervisor, uuid: str) -> int:
    value = supervisor.status()[uuid].pid
    assert value is not None
    return value


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
    assert mps.Layout().pipe("GPU-a1") == Path(handoff.MPS_HOST_ROOT, handoff.mps_directory("GPU-a1"), "pipe"), (
        "where the webhook's subPathExpr mount finds it"
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
    assert mps.locate(mps.BINARY) == str(binary) and mps.Supervisor().available()
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
        assert not (layout.pipe(status.uuid) / "control").exists()  # it quit on SIGTERM


async def test_a_killed_daemon_is_restarted(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path / "mps")
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), layout, backoff=FAST)
    await supervisor.ensure({"GPU-a"})
    try:
        await until((layout.pipe("GPU-a") / "control").exists)
        first = pid(supervisor, "GPU-a")
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
        kept, dropped = pid(supervisor, "GPU-a"), pid(supervisor, "GPU-b")
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
    binary.write_text(
        f"#!{sys.executable}\nimport pathlib, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"pathlib.Path({str(ready)!r}).touch()\nwhile True:\n    time.sleep(1)\n"
    )
    binary.chmod(0o755)
    supervisor = mps.Supervisor(binary, mps.Layout(tmp_path / "mps"), backoff=FAST, grace=0.2)
    await supervisor.ensure({"GPU-a"})
    await until(ready.exists)
    daemon = pid(supervisor, "GPU-a")
    began = time.monotonic()
    await supervisor.stop()
    assert time.monotonic() - began >= 0.2
    assert gone(daemon)


async def test_ensure_refuses_a_bad_uuid_before_changing_anything(tmp_path: Path) -> None:
    supervisor = mps.Supervisor(tmp_path / "absent", mps.Layout(tmp_path / "mps"), backoff=FAST)
    with pytest.raises(errors.InvalidInputError):
        await supervisor.ensure({"GPU-a", "../x"})
    assert supervisor.status() == {}
