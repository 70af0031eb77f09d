"""Prove on this node that an isolation mode enforces a GPU memory limit, before the agent offers it.

A mode that is configured is not yet a mode that works: a HAMi-core library built with hidden
visibility exports no `cu*` symbol, is never reached, and limits nothing, silently; an MPS client
that does not reach its daemon is not limited either. So the agent runs a short child process
(`cuda.child`, stdlib and ctypes only, talking to the driver's libcuda: no CUDA toolkit needed) in the
mode's environment with a small limit, and judges what it saw:

- `hami_env` / `mps_env` build that environment from the agent's own plus the mode's variables;
- `run` starts the child with exactly that environment and returns one `Finding` per way the child
  reached the driver (dlsym on libcuda, and cuGetProcAddress where libcuda has it); it raises
  `ProbeError` when the child hangs, fails, or prints no result;
- `judge_hami` / `judge_mps` turn findings into a `Verdict`: proven only when every lookup that ran
  saw the limit (HAMi-core shows it as the total memory, MPS as the free memory) and no allocation
  above it succeeded, while one below it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sharegpu.agent import host
from sharegpu.agent.cuda import child as cudachild
from sharegpu.agent.mps import VISIBLE_DEVICES, describe_exit
from sharegpu.api import handoff
from sharegpu.core import errors

PROBE_LIMIT_MIB: Final = 1024
"""The limit the probe sets. Not smaller: HAMi-core counts the process's CUDA context against its
limit and MPS its client's (on an H200, a 2048 MiB MPS client saw 1.9 GiB free), and a context takes
a few hundred MiB, so a tiny limit would refuse the allocation below it, or the context itself, even
where the mode works. At most 2 x this is allocated above the limit, and only where nothing enforces."""
PROBE_ROOM_MIB: Final = 4096
"""GPU memory the probe may take at most: a context, the allocation below the limit, and (where
nothing enforces) one of twice the limit above it. The agent probes only a GPU with this much that
no pod was promised."""
SHARED_CACHE: Final = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
"""HAMi-core's shared accounting file (the probe gets a private one, never the pods')."""
HAMI_PREFIX: Final = "CUDA_DEVICE_"
"""HAMi-core's variables (CUDA_DEVICE_MEMORY_LIMIT, its per-device forms, CUDA_DEVICE_SM_LIMIT, ...)."""
MPS_PREFIX: Final = "CUDA_MPS_"
TAIL_CHARS: Final = 500
"""How much of the child's stderr (or stdout) an error quotes, from its end."""


class ProbeError(errors.SharegpuError):
    """The probe could not say anything: its child hung, failed or printed no result."""


@dataclass(frozen=True, slots=True)
class Finding:
    """What the child saw through one way of reaching the driver's functions."""

    lookup: str
    """"dlsym" (names on libcuda's handle) or "getprocaddress" (cuGetProcAddress)."""
    total_mib: int
    free_mib: int
    below_ok: bool
    """An allocation of half the limit succeeded."""
    attempts: int
    """Allocations of twice the limit tried."""
    above_succeeded: int
    """How many of those succeeded (each freed at once)."""
    error: str
    """What failed ("cuInit returned 100"), or "" when every call succeeded."""


@dataclass(frozen=True, slots=True)
class Verdict:
    proven: bool
    reason: str
    """"" when proven; else one sentence naming what failed."""
    findings: tuple[Finding, ...]


def hami_env(base: Mapping[str, str], library: Path, uuid: str, limit_mib: int, cache: Path) -> dict[str, str]:
    """`base` with HAMi-core preloaded and limiting GPU `uuid` to `limit_mib`, keeping its accounting in
    `cache`. Every CUDA_MPS_* and CUDA_DEVICE_* of `base` is dropped (a stale per-device limit such as
    CUDA_DEVICE_MEMORY_LIMIT_0 would take precedence), and LD_PRELOAD is the library alone."""
    env = {k: v for k, v in base.items() if not k.startswith((MPS_PREFIX, HAMI_PREFIX))}
    env[handoff.LD_PRELOAD] = str(library)
    env[VISIBLE_DEVICES] = uuid
    env[handoff.MEMORY_LIMIT] = f"{limit_mib}m"
    env[SHARED_CACHE] = str(cache)
    return env


def mps_env(base: Mapping[str, str], pipe: Path, uuid: str, limit_mib: int) -> dict[str, str]:
    """`base` as a client of GPU `uuid`'s MPS daemon through `pipe` (its tenants' pipe folder, as a pod
    sees it), pinned to `limit_mib` on it. Every CUDA_MPS_* and CUDA_DEVICE_* of `base` and its
    LD_PRELOAD are dropped."""
    env = {k: v for k, v in base.items() if not k.startswith((MPS_PREFIX, HAMI_PREFIX)) and k != handoff.LD_PRELOAD}
    env[VISIBLE_DEVICES] = uuid
    env[handoff.MPS_PIPE] = str(pipe)
    env[handoff.MPS_MEMORY] = f"0={limit_mib}M"
    return env


async def run(
    env: Mapping[str, str],
    *,
    limit_mib: int,
    libcuda: str = host.LIBCUDA,
    timeout: float = 60.0,
    attempts: int = 3,
) -> tuple[Finding, ...]:
    """Run the child with exactly `env` and return what it found, one `Finding` per lookup that ran.
    Raises ProbeError when it runs past `timeout` seconds (its process group is killed), exits
    non-zero, or prints no result; InvalidInputError for a limit under 2 MiB or no attempt."""
    if limit_mib < 2 or attempts < 1:
        raise errors.InvalidInputError(
            f"a probe needs a limit of 2 MiB or more and an attempt ({limit_mib}, {attempts})"
        )
    command = [
        sys.executable, "-m", cudachild.__name__,
        "--libcuda", libcuda, "--limit-mib", str(limit_mib), "--attempts", str(attempts),
    ]  # fmt: skip
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as error:
        raise ProbeError(f"cannot start the CUDA probe: {error}") from error
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    except TimeoutError:
        _kill(process)
        out, err = await process.communicate()
        raise ProbeError(f"the CUDA probe did not finish within {timeout:g} s{_quote('stderr', err)}") from None
    finally:
        if process.returncode is None:  # cancelled from outside: leave nothing running
            _kill(process)
            await process.wait()
    code = process.returncode
    if code:
        raise ProbeError(f"the CUDA probe {describe_exit(code)}{_quote('stderr', err)}")
    return _findings(out, err)


def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _quote(stream: str, data: bytes) -> str:
    text = data.decode(errors="replace").strip()
    if not text:
        return f" (no {stream})"
    tail = text if len(text) <= TAIL_CHARS else "…" + text[-TAIL_CHARS:]
    return f"; {stream}: {tail}"


def _findings(out: bytes, err: bytes) -> tuple[Finding, ...]:
    """The result the child printed: the last line of stdout that is a JSON object with "results" (a
    preloaded library may print lines of its own)."""
    for line in reversed(out.decode(errors="replace").splitlines()):
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and "results" in report:
            break
    else:
        raise ProbeError(f"the CUDA probe printed no result{_quote('stdout', out)}{_quote('stderr', err)}")
    results = report["results"]
    if not isinstance(results, list):
        raise ProbeError(f"the CUDA probe printed results that are not a list: {line[:TAIL_CHARS]}")
    return tuple(_finding(result, line) for result in results)


_FIELDS: Final[dict[str, type]] = {
    "lookup": str,
    "total_mib": int,
    "free_mib": int,
    "below_ok": bool,
    "attempts": int,
    "above_succeeded": int,
    "error": str,
}


def _finding(result: Any, line: str) -> Finding:
    if not isinstance(result, dict):
        raise ProbeError(f"the CUDA probe printed a result that is not an object: {line[:TAIL_CHARS]}")
    for field, kind in _FIELDS.items():
        value = result.get(field)
        if type(value) is not kind:  # exact: a bool is not an int here, nor an int a bool
            raise ProbeError(
                f"the CUDA probe printed {field}={value!r}, not of type {kind.__name__}: {line[:TAIL_CHARS]}"
            )
    return Finding(**{field: result[field] for field in _FIELDS})


def judge_hami(findings: Iterable[Finding], library: Path, limit_mib: int) -> Verdict:
    """Whether HAMi-core at `library` enforced `limit_mib`: each lookup saw it as the total memory."""
    return _judge(tuple(findings), f"HAMi-core at {library}", limit_mib, lambda f: f.total_mib, "in all", "")


def judge_mps(findings: Iterable[Finding], uuid: str, limit_mib: int) -> Verdict:
    """Whether MPS on GPU `uuid` enforced `limit_mib`: each lookup saw at most it as free memory (MPS
    leaves the total as the GPU's)."""
    return _judge(tuple(findings), f"MPS on {uuid}", limit_mib, lambda f: f.free_mib, "free", " or less")


def _judge(
    findings: tuple[Finding, ...],
    subject: str,
    limit_mib: int,
    seen: Callable[[Finding], int],
    what: str,
    bound: str,
) -> Verdict:
    if not findings:
        return Verdict(False, f"{subject}: the probe reached the driver through no lookup", findings)
    failed = f"{subject} did not enforce a {limit_mib} MiB limit"

    def problem(finding: Finding) -> str:
        if finding.error:
            return f"{subject}: the probe failed: {finding.error}"
        if finding.attempts < 1:
            return f"{subject}: the probe tried no allocation above the {limit_mib} MiB limit"
        if finding.above_succeeded:
            return f"{failed}: {finding.above_succeeded} of {finding.attempts} allocations above it succeeded"
        if seen(finding) > limit_mib:
            return f"{failed}: the process saw {seen(finding)} MiB {what}, not {limit_mib}{bound}"
        if not finding.below_ok:
            return f"{subject} with a {limit_mib} MiB limit: an allocation of {limit_mib // 2} MiB, below it, failed"
        return ""

    problems = [(finding.lookup, problem(finding)) for finding in findings]
    first = next((text for _lookup, text in problems if text), "")
    if not first:
        return Verdict(True, "", findings)
    through = " and ".join(lookup for lookup, text in problems if text == first)
    return Verdict(False, f"{first} (through {through})", findings)
