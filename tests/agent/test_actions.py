"""The Enforcer's kill: only processes that belong to the pod, each pinned by a pidfd before its owner
is read, so that a process that ends between the check and the signal (its pid free for another) is
not hit."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from sharegpu.agent import actions, cgroups, notices
from sharegpu.kube import client, events, fake
from tests.builders import pod_process

UID = "0e4b8a1c-1111-2222-3333-444455556666"


def enforcer(proc: Path) -> actions.Enforcer:
    api = client.KubeClient(fake.FakeApiServer())
    return actions.Enforcer(api, notices.Notices(events.Recorder(api, "t", "t", lambda: 0.0)), proc)


def test_only_the_pods_own_processes_are_killed(tmp_path: Path) -> None:
    mine, other = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        pod_process(tmp_path, mine.pid, UID)
        pod_process(tmp_path, other.pid, "another-pod")
        assert enforcer(tmp_path).kill((mine.pid, other.pid, 2**22 + 7), UID) == [mine.pid]
        assert mine.wait(5) == -signal.SIGKILL
        assert other.poll() is None, "another pod's process lives"
    finally:
        other.kill()
        other.wait()


def test_a_process_that_ends_between_the_check_and_the_signal_is_not_hit_nor_its_pids_next_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner is read while the pidfd pins the process; it ends right then (and is reaped, its pid
    free): the signal goes through the pidfd to the ended process, so to nobody."""
    victim = subprocess.Popen(["sleep", "60"])
    pod_process(tmp_path, victim.pid, UID)
    read = cgroups.read_owner

    def ends_while_read(pid: int, proc: Path = Path("/proc")) -> cgroups.Owner | None:
        found = read(pid, proc)
        victim.terminate()
        victim.wait()
        return found

    monkeypatch.setattr(cgroups, "read_owner", ends_while_read)
    assert enforcer(tmp_path).kill((victim.pid,), UID) == []
    assert victim.returncode == -signal.SIGTERM, "ended by its own signal, not the kill"
