"""The CUDA probe over C stand-ins for libcuda and HAMi-core (built by gcc, tests/agent/cudastubs.py):
a limit is proven only where it binds through every way the driver is reached, a library that
exports nothing or a driver that fails is named in the reason, MPS is proven only with a live daemon,
and a child that hangs, dies or prints nothing becomes a ProbeError."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sharegpu.agent.cuda import child as cudachild
from sharegpu.agent.cuda import probe as cudaprobe
from sharegpu.agent.cuda.probe import Finding
from sharegpu.core import errors
from tests.agent import cudastubs
from tests.conftest import eventually

LIMIT = 64
"""The tests' limit (the stubs count no context, so a small one shows every outcome)."""
UUID = "GPU-5e0c7a41-0000-4000-8000-000000000001"


def plain_env() -> dict[str, str]:
    """This process's environment without anything that would steer the driver or the stubs."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_", "STUB_CUDA_")) and k not in ("LD_PRELOAD", "PYTHONPATH")
    }


def hami(stubs: cudastubs.Stubs, tmp_path: Path, library: Path | None = None, **extra: str) -> dict[str, str]:
    env = cudaprobe.hami_env(plain_env(), library or stubs.enforcing, UUID, LIMIT, tmp_path / "cache")
    return env | extra


def finding(lookup: str = "dlsym", **changes: object) -> Finding:
    fields: dict[str, object] = {
        "lookup": lookup,
        "total_mib": LIMIT,
        "free_mib": LIMIT,
        "below_ok": True,
        "attempts": 3,
        "above_succeeded": 0,
        "error": "",
    }
    return Finding(**(fields | changes))  # type: ignore[arg-type]


def with_startup(tmp_path: Path, env: dict[str, str], code: str) -> dict[str, str]:
    """`env` whose Python runs `code` at startup (a sitecustomize module on PYTHONPATH), before the child."""
    folder = tmp_path / "startup"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(code)
    return env | {"PYTHONPATH": str(folder)}


# ---------------------------------------------------------------- the environments


def test_the_hami_environment_preloads_the_library_alone_with_a_private_cache() -> None:
    base = {
        "PATH": "/bin",
        "LD_PRELOAD": "/other.so",
        "CUDA_MPS_PIPE_DIRECTORY": "/run/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "1g",
        "CUDA_DEVICE_SM_LIMIT": "50",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    env = cudaprobe.hami_env(base, Path("/lib/libvgpu.so"), UUID, 64, Path("/tmp/probe.cache"))
    assert env == {
        "PATH": "/bin",
        "LD_PRELOAD": "/lib/libvgpu.so",
        "CUDA_VISIBLE_DEVICES": UUID,
        "CUDA_DEVICE_MEMORY_LIMIT": "64m",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/probe.cache",
    }
    assert base["LD_PRELOAD"] == "/other.so", "the base is left alone"


def test_the_mps_environment_points_at_the_daemon_and_preloads_nothing() -> None:
    base = {
        "HOME": "/root",
        "LD_PRELOAD": "/lib/libvgpu.so",
        "CUDA_DEVICE_MEMORY_LIMIT": "64m",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/c",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20",
    }
    env = cudaprobe.mps_env(base, Path("/run/mps/GPU-a/tenant/pipe"), UUID, 2048)
    assert env == {
        "HOME": "/root",
        "CUDA_VISIBLE_DEVICES": UUID,
        "CUDA_MPS_PIPE_DIRECTORY": "/run/mps/GPU-a/tenant/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M",
    }


def test_the_child_imports_nothing_heavy() -> None:
    """It runs with a foreign library preloaded: the standard library and sharegpu.core.errors only."""
    code = (
        "import json, sys; import sharegpu.agent.cuda.child; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('sharegpu', 'msgspec', 'numpy', 'asyncio')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=plain_env(), check=True, capture_output=True, text=True)
    assert json.loads(out.stdout) == [
        "sharegpu",
        "sharegpu.agent",
        "sharegpu.agent.cuda",
        "sharegpu.agent.cuda.child",
        "sharegpu.core",
        "sharegpu.core.errors",
    ]


# ---------------------------------------------------------------- HAMi-core


async def test_the_driver_alone_limits_nothing(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    env = hami(stubs, tmp_path) | {"LD_PRELOAD": ""}
    findings = await cudaprobe.run(env, limit_mib=LIMIT, libcuda=str(stubs.libcuda))
    assert findings == (
        finding("dlsym", total_mib=81920, free_mib=81920, above_succeeded=3),
        finding("getprocaddress", total_mib=81920, free_mib=81920, above_succeeded=3),
    )
    verdict = cudaprobe.judge_hami(findings, stubs.enforcing, LIMIT)
    assert not verdict.proven and verdict.findings == findings
    assert verdict.reason == (
        f"HAMi-core at {stubs.enforcing} did not enforce a 64 MiB limit: "
        "3 of 3 allocations above it succeeded (through dlsym and getprocaddress)"
    )


async def test_hami_core_that_intercepts_both_lookups_is_proven(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    findings = await cudaprobe.run(hami(stubs, tmp_path), limit_mib=LIMIT, libcuda=str(stubs.libcuda))
    assert [f.lookup for f in findings] == ["dlsym", "getprocaddress"]
    assert all(f.total_mib == LIMIT and f.free_mib == LIMIT for f in findings)
    assert findings == (finding("dlsym"), finding("getprocaddress"))
    assert cudaprobe.judge_hami(findings, stubs.enforcing, LIMIT) == cudaprobe.Verdict(True, "", findings)


async def test_a_limit_given_in_gib_binds_too(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    env = hami(stubs, tmp_path, CUDA_DEVICE_MEMORY_LIMIT="1g")
    findings = await cudaprobe.run(env, limit_mib=1024, libcuda=str(stubs.libcuda), attempts=2)
    assert findings == tuple(
        finding(lookup, total_mib=1024, free_mib=1024, attempts=2) for lookup in ("dlsym", "getprocaddress")
    )


async def test_hami_core_built_with_hidden_symbols_is_caught(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    findings = await cudaprobe.run(hami(stubs, tmp_path, stubs.hidden), limit_mib=LIMIT, libcuda=str(stubs.libcuda))
    assert {f.total_mib for f in findings} == {81920}
    verdict = cudaprobe.judge_hami(findings, stubs.hidden, LIMIT)
    assert not verdict.proven
    assert verdict.reason.startswith(f"HAMi-core at {stubs.hidden} did not enforce a 64 MiB limit: ")
    assert "3 of 3 allocations above it succeeded" in verdict.reason


async def test_a_driver_that_fails_is_named(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    env = hami(stubs, tmp_path, STUB_CUDA_INIT_ERROR="100")
    findings = await cudaprobe.run(env, limit_mib=LIMIT, libcuda=str(stubs.libcuda))
    assert {f.error for f in findings} == {"cuInit returned 100"}
    verdict = cudaprobe.judge_hami(findings, stubs.enforcing, LIMIT)
    assert verdict.reason == (
        f"HAMi-core at {stubs.enforcing}: the probe failed: cuInit returned 100 (through dlsym and getprocaddress)"
    )


async def test_a_driver_without_cugetprocaddress_is_probed_through_dlsym_alone(
    stubs: cudastubs.Stubs, tmp_path: Path
) -> None:
    findings = await cudaprobe.run(hami(stubs, tmp_path), limit_mib=LIMIT, libcuda=str(stubs.legacy))
    assert findings == (finding("dlsym"),)
    assert cudaprobe.judge_hami(findings, stubs.enforcing, LIMIT).proven


async def test_a_driver_that_cannot_be_loaded_is_a_failure_not_an_error(tmp_path: Path) -> None:
    findings = await cudaprobe.run(plain_env(), limit_mib=LIMIT, libcuda=str(tmp_path / "libcuda.so.1"))
    [only] = findings
    assert only.lookup == "dlsym" and only.error.startswith(f"cannot load {tmp_path / 'libcuda.so.1'}: ")
    assert not cudaprobe.judge_hami(findings, Path("/x.so"), LIMIT).proven


# ---------------------------------------------------------------- MPS


@contextlib.contextmanager
def mps_daemon(pipe: Path) -> Iterator[Callable[[], str]]:
    """A daemon as far as a client can tell: `<pipe>/control` is a FIFO someone reads. Yields what was
    written to it so far."""
    pipe.mkdir(parents=True, exist_ok=True)
    control = pipe / "control"
    os.mkfifo(control)
    reader = os.open(control, os.O_RDONLY | os.O_NONBLOCK)
    try:
        yield lambda: os.read(reader, 4096).decode()
    finally:
        os.close(reader)
        control.unlink()


def mps(tmp_path: Path) -> dict[str, str]:
    return cudaprobe.mps_env(plain_env(), tmp_path / "pipe", UUID, LIMIT)


async def test_an_mps_client_of_a_live_daemon_is_limited(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    with mps_daemon(tmp_path / "pipe") as written:
        findings = await cudaprobe.run(mps(tmp_path), limit_mib=LIMIT, libcuda=str(stubs.libcuda))
        lines = written()
    assert re.fullmatch(r"client (\d+)\n", lines), lines
    assert int(lines.split()[1]) != os.getpid()
    assert findings == tuple(finding(lookup, total_mib=81920) for lookup in ("dlsym", "getprocaddress"))
    assert cudaprobe.judge_mps(findings, UUID, LIMIT) == cudaprobe.Verdict(True, "", findings)


@pytest.mark.parametrize("daemon", ["never started", "gone"])
async def test_an_mps_client_without_a_daemon_is_not_limited(
    stubs: cudastubs.Stubs, tmp_path: Path, daemon: str
) -> None:
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    if daemon == "gone":
        os.mkfifo(pipe / "control")  # left behind: nobody reads it
    findings = await cudaprobe.run(mps(tmp_path), limit_mib=LIMIT, libcuda=str(stubs.libcuda))
    verdict = cudaprobe.judge_mps(findings, UUID, LIMIT)
    assert not verdict.proven
    assert verdict.reason == (
        f"MPS on {UUID} did not enforce a 64 MiB limit: "
        "3 of 3 allocations above it succeeded (through dlsym and getprocaddress)"
    )


# ---------------------------------------------------------------- when the child fails


def hanging(stubs: cudastubs.Stubs, tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose child hangs in cuInit, and the file where it writes its pid first."""
    pid_file = tmp_path / "pid"
    env = hami(stubs, tmp_path, STUB_CUDA_INIT_SLEEP_MS="20000")
    startup = f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
    return with_startup(tmp_path, env, startup), pid_file


def gone(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_child_that_hangs_is_killed(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    env, pid_file = hanging(stubs, tmp_path)
    began = time.monotonic()
    with pytest.raises(cudaprobe.ProbeError, match=r"^the CUDA probe did not finish within 0\.5 s \(no stderr\)$"):
        await cudaprobe.run(env, limit_mib=LIMIT, libcuda=str(stubs.libcuda), timeout=0.5)
    assert time.monotonic() - began < 1.5
    assert gone(pid_file)


async def test_a_probe_cancelled_leaves_no_child(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    env, pid_file = hanging(stubs, tmp_path)
    task = asyncio.create_task(cudaprobe.run(env, limit_mib=LIMIT, libcuda=str(stubs.libcuda)))
    await eventually(lambda: pid_file.exists() and pid_file.read_text() != "", "the child to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone(pid_file)


@pytest.mark.parametrize(
    ("startup", "message"),
    [
        (
            "import os, sys; sys.stderr.write('E' * 900 + 'the end'); sys.stderr.flush(); os._exit(3)",
            r"exited with status 3; stderr: …E+the end$",
        ),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", r"killed by signal 9 \(SIGKILL\) \(no stderr\)$"),
        (
            "import os; print('not json', flush=True); os._exit(0)",
            r"printed no result; stdout: not json \(no stderr\)$",
        ),
        ("import os; print('{\"results\": 1}', flush=True); os._exit(0)", r"printed results that are not a list: "),
        (
            'import os; print(\'{"results": [{"lookup": "dlsym"}]}\', flush=True); os._exit(0)',
            r"printed total_mib=None, not of type int: ",
        ),
    ],
)
async def test_a_child_that_fails_or_prints_no_result_is_an_error(
    stubs: cudastubs.Stubs, tmp_path: Path, startup: str, message: str
) -> None:
    env = with_startup(tmp_path, hami(stubs, tmp_path), startup)
    with pytest.raises(cudaprobe.ProbeError, match=message) as caught:
        await cudaprobe.run(env, limit_mib=LIMIT, libcuda=str(stubs.libcuda))
    assert str(caught.value).startswith("the CUDA probe ")
    assert isinstance(caught.value, errors.SharegpuError)
    assert len(str(caught.value)) < 700, "the stderr is quoted from its end, at most 500 characters"


async def test_lines_a_preloaded_library_prints_are_skipped(stubs: cudastubs.Stubs, tmp_path: Path) -> None:
    env = with_startup(tmp_path, hami(stubs, tmp_path), "print('[HAMI-core Msg] hello', flush=True)\n")
    findings = await cudaprobe.run(env, limit_mib=LIMIT, libcuda=str(stubs.libcuda))
    assert cudaprobe.judge_hami(findings, stubs.enforcing, LIMIT).proven


@pytest.mark.parametrize(("limit", "attempts"), [(1, 3), (64, 0)])
async def test_a_probe_that_could_prove_nothing_is_refused(limit: int, attempts: int) -> None:
    with pytest.raises(errors.InvalidInputError):
        await cudaprobe.run(plain_env(), limit_mib=limit, attempts=attempts)


def test_the_child_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cudachild.main(["--libcuda", "libcuda.so.1", "--limit-mib", "one"])
    assert caught.value.code == 2
    assert "--limit-mib: 'one' is not a whole number" in capsys.readouterr().err


# ---------------------------------------------------------------- the judges' wording

LIB = Path("/usr/local/vgpu/libvgpu.so")


@pytest.mark.parametrize(
    ("findings", "reason"),
    [
        ((), f"HAMi-core at {LIB}: the probe reached the driver through no lookup"),
        (
            (finding("dlsym", above_succeeded=2), finding("getprocaddress")),
            f"HAMi-core at {LIB} did not enforce a 64 MiB limit: 2 of 3 allocations above it succeeded (through dlsym)",
        ),
        (
            (finding("dlsym"), finding("getprocaddress", total_mib=81920)),
            f"HAMi-core at {LIB} did not enforce a 64 MiB limit: the process saw 81920 MiB in all, not 64 "
            "(through getprocaddress)",
        ),
        (
            (finding("dlsym", error="cuInit returned 100"),),
            f"HAMi-core at {LIB}: the probe failed: cuInit returned 100 (through dlsym)",
        ),
        (
            (finding("dlsym", below_ok=False), finding("getprocaddress", below_ok=False)),
            f"HAMi-core at {LIB} with a 64 MiB limit: an allocation of 32 MiB, below it, failed "
            "(through dlsym and getprocaddress)",
        ),
        (
            (finding("dlsym", attempts=0),),
            f"HAMi-core at {LIB}: the probe tried no allocation above the 64 MiB limit (through dlsym)",
        ),
        (
            (finding("dlsym", total_mib=81920), finding("getprocaddress", above_succeeded=1)),
            f"HAMi-core at {LIB} did not enforce a 64 MiB limit: the process saw 81920 MiB in all, not 64 "
            "(through dlsym)",
        ),
    ],
)
def test_hami_reasons(findings: tuple[Finding, ...], reason: str) -> None:
    verdict = cudaprobe.judge_hami(findings, LIB, 64)
    assert verdict == cudaprobe.Verdict(False, reason, findings)


def test_hami_is_judged_on_the_total_and_mps_on_the_free_memory() -> None:
    hami_like = (finding("dlsym", total_mib=64, free_mib=60),)
    mps_like = (finding("dlsym", total_mib=143771, free_mib=1900),)
    assert cudaprobe.judge_hami(hami_like, LIB, 64).proven
    assert cudaprobe.judge_mps(mps_like, "GPU-x", 2048).proven
    assert cudaprobe.judge_hami(mps_like, LIB, 2048).reason == (
        f"HAMi-core at {LIB} did not enforce a 2048 MiB limit: the process saw 143771 MiB in all, not 2048 "
        "(through dlsym)"
    )
    assert cudaprobe.judge_mps((finding("getprocaddress", free_mib=81920),), "GPU-x", 64).reason == (
        "MPS on GPU-x did not enforce a 64 MiB limit: the process saw 81920 MiB free, not 64 or less "
        "(through getprocaddress)"
    )
    assert cudaprobe.judge_mps((finding(error="cuDeviceGet returned 101"),), "GPU-x", 64).reason == (
        "MPS on GPU-x: the probe failed: cuDeviceGet returned 101 (through dlsym)"
    )
