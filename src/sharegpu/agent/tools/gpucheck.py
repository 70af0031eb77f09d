"""`sharegpu gpu-check`: check on one GPU of this machine what sharegpu's node side relies on.

Each check is PASS, FAIL or SKIP, with figures and a one-line detail (`Check`):

- discovery: NVML (`agent.nvml`) and nvidia-smi agree on each GPU's index, UUID, model, memory, PCI
  bus ID, driver version and compute capability (the last three are what DRA selectors read);
- processes: a child holding `HOLD_MIB` on the GPU is listed by NVML with that memory at least;
- mps-memory: a client given exactly the environment the hand-off writes for a `LOW_MILLI`,
  `LIMIT_MIB` grant (`api.handoff.values`), pointed at an MPS daemon the supervisor (`agent.mps`)
  started, is held to `LIMIT_MIB` (`agent.cuda.probe`);
- mps-compute: that client, burning FMAs (`agent.cuda.burn`), runs at most `ALONE_MOST_PERCENT` of the
  rate the GPU gives an unlimited one, and next to a `HIGH_MILLI` client it gets clearly less
  (`judge_compute`);
- mps-tenancy: the daemon runs under a ceiling (`mps.Ceiling`, LOW_MILLI and LIMIT_MIB, taken while
  its server runs); a tenant, through its own pipe folder, tries to raise the daemon's defaults and
  to quit it (`TENANT_ATTEMPTS`), and the daemon must still run; then a client that dropped the
  hand-off's limit variables is held to the ceiling: its memory to LIMIT_MIB, its rate to at most
  ALONE_MOST_PERCENT of the unlimited one;
- hami-core-memory and hami-core-compute: the same with HAMi-core's limits, preloading the operator's
  own library (`--hami-core-library`; skipped without it).

The hardware sits behind small seams (`Parts`: the NVML inventory, nvidia-smi, the children that
hold memory or burn compute, the memory probe and its judges, the MPS supervisor), so that `check`,
the orchestration, runs on fakes in tests; `real_parts` builds the real ones. Comparing discovery,
judging compute shares and rendering the report are pure functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import enum
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

from sharegpu.agent import mps, nvml
from sharegpu.agent.cuda import burn as cudaburn
from sharegpu.agent.cuda import probe as cudaprobe
from sharegpu.api import handoff
from sharegpu.core import allocation, errors, units

DISCOVERY: Final = "discovery"
PROCESSES: Final = "processes"
SAMPLES: Final = "process-samples"
MPS_MEMORY: Final = "mps-memory"
MPS_COMPUTE: Final = "mps-compute"
MPS_TENANCY: Final = "mps-tenancy"
HAMI_MEMORY: Final = "hami-core-memory"
HAMI_COMPUTE: Final = "hami-core-compute"
ORDER: Final = (DISCOVERY, PROCESSES, SAMPLES, MPS_MEMORY, MPS_COMPUTE, MPS_TENANCY, HAMI_MEMORY, HAMI_COMPUTE)
MPS_CHECKS: Final = (MPS_MEMORY, MPS_COMPUTE, MPS_TENANCY)

HOLD_MIB: Final = 1024
"""What the processes check's child holds on the GPU."""
LIMIT_MIB: Final = 2048
"""The memory of the grants whose hand-off environment the isolation checks use."""
LOW_MILLI: Final = 250
HIGH_MILLI: Final = 750
"""The grants' compute: alone at LOW_MILLI, then a pair at LOW_MILLI and HIGH_MILLI."""
ALONE_MOST_PERCENT: Final = 40
"""The most a LOW_MILLI client alone may run at, in percent of the unlimited baseline's rate, for its
compute limit to count as enforced (an enforced 25% gives about 25%; an ignored one about 100%)."""
PAIR_MOST_PERCENT: Final = 70
"""The most the LOW_MILLI client of the pair may run at, in percent of the HIGH_MILLI client's rate
(an enforced 25/75 split gives about a third; two clients the limit does not bind get about the same,
as HAMi-core's did on an H200: 670 and 671)."""
MIN_SECONDS: Final = 5
"""The shortest compute measurement (its second half is what counts)."""
READY_SECONDS: Final = 120.0
"""How long a child has to load (the driver compiles the kernel; an MPS client connects)."""
SMI_FIELDS: Final = ("index", "uuid", "name", "memory.total", "pci.bus_id", "driver_version", "compute_cap")
SMI_QUERY: Final = (f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits")
SHARED_CACHE: Final = cudaprobe.SHARED_CACHE
CONTROLLED_PREFIXES: Final = ("CUDA_MPS_", "CUDA_DEVICE_")
CONTROLLED: Final = frozenset({mps.VISIBLE_DEVICES, handoff.LD_PRELOAD, SHARED_CACHE})
"""What a child inherits from this process only through a check (set there, or not at all)."""
UNKNOWN: Final = "unknown"
TENANT_ATTEMPTS: Final = (
    "set_default_active_thread_percentage 100",
    "set_default_device_pinned_mem_limit 0 1000000M",
    mps.QUIT,
)
"""What the mps-tenancy check's tenant sends the daemon through its own pipe folder."""

T = TypeVar("T")


class GpuCheckError(errors.SharegpuError):
    """The check cannot run as asked (a GPU that is not there, a library that is not a file)."""


class ChildError(errors.SharegpuError):
    """A child process (nvidia-smi, or one of cudaburn's) failed; the message says how."""


class Result(enum.StrEnum):
    """A check's outcome."""

    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


Figure = int | float | str | bool
"""A measured value (rates in launches per second, shares in percent, memory in MiB)."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    result: Result
    figures: Mapping[str, Figure]
    detail: str


@dataclass(frozen=True, slots=True)
class Identity:
    """The GPU under test."""

    index: int
    uuid: str
    model: str
    driver: str
    """The driver version nvidia-smi reports ("unknown" when it could not)."""
    cuda: str
    """The CUDA version the driver supports, from cuDriverGetVersion (e.g. "12.8"; or "unknown")."""


@dataclass(frozen=True, slots=True)
class Report:
    gpu: Identity
    checks: tuple[Check, ...]

    def failed(self) -> bool:
        return any(check.result == Result.FAIL for check in self.checks)

    def exit_status(self) -> int:
        """0 when nothing failed (skips included), 1 otherwise."""
        return 1 if self.failed() else 0


@dataclass(frozen=True, slots=True)
class Options:
    gpu: int = 0
    """The index of the GPU under test (NVML's, which nvidia-smi shows)."""
    seconds: int = 6
    """How long each compute measurement runs (at least MIN_SECONDS)."""
    hami_core_library: Path | None = None
    """HAMi-core's library to check (the operator's own); None: its checks are skipped."""
    patience: float = 15.0
    """Seconds NVML has to list the holding child, and an MPS daemon to come up."""


@dataclass(frozen=True, slots=True)
class SmiGpu:
    """One GPU as nvidia-smi lists it."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    bus_id: str
    driver: str
    compute_cap: str = ""


@dataclass(frozen=True, slots=True)
class Burn:
    """What one compute child printed."""

    launches: int
    seconds: float
    rate: float
    """Launches per second over the second half of its run."""
    sms: int = 0
    """The multiprocessor count the driver told it (MPS may tell a limited client fewer)."""


# ---------------------------------------------------------------------------------- the seams


class Inventory(Protocol):
    """NVML's answers the checks use (`agent.nvml.Nvml`)."""

    def gpus(self) -> list[nvml.Gpu]: ...

    def running(self) -> list[nvml.GpuProcess]: ...

    def utilization(self) -> list[nvml.Utilization]: ...


class Holder(Protocol):
    def __call__(self, env: Mapping[str, str], mib: int) -> AbstractAsyncContextManager[int]:
        """A child holding `mib` MiB on device 0 of `env` while the context lasts; yields its pid."""
        ...


class Burner(Protocol):
    async def __call__(self, envs: Sequence[Mapping[str, str]], seconds: int) -> list[Burn]:
        """One compute child per environment, started together, each burning for `seconds`."""
        ...


class Probe(Protocol):
    async def __call__(self, env: Mapping[str, str], *, limit_mib: int) -> tuple[cudaprobe.Finding, ...]:
        """`cudaprobe.run` with exactly `env`."""
        ...


def _quiet(_text: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class Parts:
    """The hardware behind the checks (`real_parts`: the real ones)."""

    inventory: Inventory
    smi: Callable[[Sequence[str]], Awaitable[str]]
    """Run nvidia-smi with these arguments; its stdout."""
    cuda_version: Callable[[], int]
    """cuDriverGetVersion's answer (e.g. 12080)."""
    hold: Holder
    burn: Burner
    probe: Probe
    judge_mps: Callable[[Iterable[cudaprobe.Finding], str, int], cudaprobe.Verdict]
    judge_hami: Callable[[Iterable[cudaprobe.Finding], Path, int], cudaprobe.Verdict]
    supervisor: Callable[[Path], mps.Supervisor]
    """An MPS supervisor whose daemons' directories live under this root."""
    base_env: Mapping[str, str]
    """The environment children start from (this process's), less `CONTROLLED`."""
    progress: Callable[[str], None] = _quiet
    """Told what runs next, for a person waiting."""


# ---------------------------------------------------------------------------------- pure parts


def parse_smi(text: str) -> list[SmiGpu]:
    """nvidia-smi's CSV answer to `SMI_QUERY` (no header, no units)."""
    out = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row:
            continue
        if len(row) != len(SMI_FIELDS):
            raise ChildError(f"nvidia-smi printed {len(row)} fields, not {len(SMI_FIELDS)}: {', '.join(row)!r}")
        index, uuid, name, memory, bus, driver, capability = (field.strip() for field in row)
        try:
            out.append(SmiGpu(int(index), uuid, name, int(memory), bus, driver, capability))
        except ValueError:
            raise ChildError(
                f"nvidia-smi printed an index or memory that is not a number: {', '.join(row)!r}"
            ) from None
    return out


def compare(found: Sequence[nvml.Gpu], listed: Sequence[SmiGpu]) -> list[str]:
    """Where NVML and nvidia-smi disagree, one sentence each (none: they agree)."""
    problems = []
    if len(found) != len(listed):
        problems.append(f"NVML sees {len(found)} GPU(s), nvidia-smi lists {len(listed)}")
    rows = {row.index: row for row in listed}
    for gpu in found:
        row = rows.get(gpu.index)
        if row is None:
            problems.append(f"GPU {gpu.index} ({gpu.uuid}): not listed by nvidia-smi")
            continue
        pairs: tuple[tuple[str, object, object], ...] = (
            ("UUID", gpu.uuid, row.uuid),
            ("model", gpu.model, row.name),
            ("memory MiB", gpu.memory_mib, row.memory_mib),
            ("PCI bus ID", gpu.pci_bus_id, nvml.sysfs_address(row.bus_id)),
            ("driver version", gpu.driver_version, row.driver),
            ("compute capability", gpu.compute_capability, row.compute_cap),
        )
        problems += [
            f"GPU {gpu.index}: {what} {ours!r} (NVML) vs {theirs!r} (nvidia-smi)"
            for what, ours, theirs in pairs
            if ours != theirs
        ]
    return problems


def discovery_check(found: Sequence[nvml.Gpu], listed: Sequence[SmiGpu]) -> Check:
    problems = compare(found, listed)
    figures: dict[str, Figure] = {"nvml_gpus": len(found), "smi_gpus": len(listed), "mismatches": len(problems)}
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Check(DISCOVERY, Result.FAIL, figures, problems[0] + more)
    return Check(DISCOVERY, Result.PASS, figures, f"NVML and nvidia-smi agree on {len(found)} GPU(s)")


def percent(part: float, whole: float) -> int:
    return round(100 * part / whole) if whole > 0 else 0


def judge_compute(name: str, variable: str, baseline: Burn, alone: Burn, low: Burn, high: Burn) -> Check:
    """Whether a compute limit (set through `variable`) binds: `alone` ran at LOW_MILLI by itself,
    `low` and `high` at LOW_MILLI and HIGH_MILLI together, `baseline` without limits."""
    low_percent, high_percent = LOW_MILLI * 100 // units.MILLI_PER_GPU, HIGH_MILLI * 100 // units.MILLI_PER_GPU
    figures: dict[str, Figure] = {
        "baseline_rate": round(baseline.rate, 1),
        "alone_rate": round(alone.rate, 1),
        "alone_share": percent(alone.rate, baseline.rate),
        "baseline_sms": baseline.sms,
        "alone_sms": alone.sms,
        "pair_low_rate": round(low.rate, 1),
        "pair_low_share": percent(low.rate, baseline.rate),
        "pair_high_rate": round(high.rate, 1),
        "pair_high_share": percent(high.rate, baseline.rate),
    }
    idle = [what for what, burn in (("the baseline", baseline), ("alone", alone), ("the pair", low), ("the pair", high))
            if burn.rate <= 0]  # fmt: skip
    if idle:
        return Check(name, Result.FAIL, figures, f"a client completed no launch in its second half ({idle[0]})")
    alone_bound = alone.rate * 100 <= ALONE_MOST_PERCENT * baseline.rate
    pair_bound = low.rate * 100 <= PAIR_MOST_PERCENT * high.rate
    said = (
        f"{variable}={low_percent} alone ran at {figures['alone_share']}% of the unlimited rate "
        f"(at most {ALONE_MOST_PERCENT}% expected); together, {low_percent}% got {low.rate:.0f}/s and "
        f"{high_percent}% {high.rate:.0f}/s ({percent(low.rate, high.rate)}%, at most {PAIR_MOST_PERCENT}% expected)"
    )
    if alone_bound and pair_bound:
        return Check(name, Result.PASS, figures, f"enforced: {said}")
    return Check(name, Result.FAIL, figures, f"not enforced: {said}")


def memory_check(name: str, verdict: cudaprobe.Verdict, limit_mib: int) -> Check:
    """A memory probe's verdict as a check, with what each lookup saw."""
    figures: dict[str, Figure] = {"limit_mib": limit_mib}
    for finding in verdict.findings:
        figures[f"{finding.lookup}_total_mib"] = finding.total_mib
        figures[f"{finding.lookup}_free_mib"] = finding.free_mib
        figures[f"{finding.lookup}_above_ok"] = f"{finding.above_succeeded}/{finding.attempts}"
        figures[f"{finding.lookup}_below_ok"] = finding.below_ok
    if not verdict.proven:
        return Check(name, Result.FAIL, figures, verdict.reason)
    through = " and ".join(finding.lookup for finding in verdict.findings)
    return Check(
        name,
        Result.PASS,
        figures,
        f"held to {limit_mib} MiB through {through}: no allocation of {2 * limit_mib} MiB succeeded, "
        f"one of {limit_mib // 2} MiB did",
    )


def grant(gpu: nvml.Gpu, milli: int) -> allocation.DeviceGrant:
    """A grant of `milli` and LIMIT_MIB on `gpu`, as the extender records one."""
    return allocation.DeviceGrant(index=gpu.index, milli=milli, memory_mib=LIMIT_MIB, limit_milli=milli, uuid=gpu.uuid)


def handed(gpu: nvml.Gpu, milli: int, enforce: handoff.Enforcement) -> dict[str, str]:
    """The hand-off's variables for a container given `grant(gpu, milli)` on a node enforcing `enforce`."""
    return handoff.values([grant(gpu, milli)], {gpu.index: gpu.uuid}, enforce)


def mps_client_env(gpu: nvml.Gpu, milli: int, layout: mps.Layout) -> dict[str, str]:
    """The hand-off's MPS variables as a process on the host sees them: the container's pipe directory
    (in the mount of its GPU's tenant folder, which the agent's volume plugin binds) mapped to that
    folder, no log directory (a tenant has none), and the GPU made visible by UUID (the container
    runtime's part)."""
    values = handed(gpu, milli, handoff.Enforcement(mps=True))
    env = {key: value for key, value in values.items() if key.startswith("CUDA_")}
    env[handoff.MPS_PIPE] = str(layout.tenant_pipe(gpu.uuid))
    env[mps.VISIBLE_DEVICES] = gpu.uuid
    return env


def hami_client_env(gpu: nvml.Gpu, milli: int, library: Path, cache: Path) -> dict[str, str]:
    """The hand-off's HAMi-core variables as a process on the host sees them: LD_PRELOAD names the
    host's `library` where the container preloads SHAREGPU_PRELOAD (the library's path in it), with a
    private accounting file `cache` (a container has its own /tmp) and the GPU made visible by UUID."""
    values = handed(gpu, milli, handoff.Enforcement(hami_core=True))
    if values.get(handoff.PRELOAD) != handoff.HAMI_LIBRARY:
        raise GpuCheckError(f"the hand-off preloads {values.get(handoff.PRELOAD)!r}, not {handoff.HAMI_LIBRARY}")
    env = {key: value for key, value in values.items() if key.startswith("CUDA_")}
    env[handoff.LD_PRELOAD] = str(library)
    env[SHARED_CACHE] = str(cache)
    env[mps.VISIBLE_DEVICES] = gpu.uuid
    return env


def child_env(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """`base` less what only a check sets (`CONTROLLED`, CUDA_MPS_*, CUDA_DEVICE_*), plus `extra`."""
    env = {k: v for k, v in base.items() if k not in CONTROLLED and not k.startswith(CONTROLLED_PREFIXES)}
    return {**env, **extra}


def to_json(report: Report) -> dict[str, Any]:
    gpu = report.gpu
    return {
        "gpu": {"index": gpu.index, "uuid": gpu.uuid, "model": gpu.model, "driver": gpu.driver, "cuda": gpu.cuda},
        "checks": [
            {"name": check.name, "result": check.result.value, "figures": dict(check.figures), "detail": check.detail}
            for check in report.checks
        ],
    }


def figures_text(figures: Mapping[str, Figure]) -> str:
    return ", ".join(f"{key}={_figure(value)}" for key, value in figures.items())


def _figure(value: Figure) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def rows(report: Report) -> list[tuple[str, str, str, str, str]]:
    """The table's rows: check, GPU, result, figures, detail."""
    mine = f"{report.gpu.index}"
    return [
        (
            check.name,
            "all" if check.name == DISCOVERY else mine,
            check.result.value,
            figures_text(check.figures),
            check.detail,
        )
        for check in report.checks
    ]


def _failure(name: str, error: BaseException) -> Check:
    return Check(name, Result.FAIL, {}, errors.first_line(error))


# ---------------------------------------------------------------------------------- the orchestration


async def check(parts: Parts, options: Options) -> Report:
    """Run every check on GPU `options.gpu`; raises GpuCheckError when it cannot run as asked."""
    if options.seconds < MIN_SECONDS:
        raise GpuCheckError(f"compute runs need at least {MIN_SECONDS} seconds, not {options.seconds}")
    library = options.hami_core_library
    if library is not None and not library.is_file():
        raise GpuCheckError(f"--hami-core-library {library} is not a file")
    gpus = parts.inventory.gpus()
    gpu = next((g for g in gpus if g.index == options.gpu), None)
    if gpu is None:
        raise GpuCheckError(f"no GPU {options.gpu} here: NVML sees {', '.join(str(g.index) for g in gpus)}")
    checks: dict[str, Check] = {}

    parts.progress("discovery: NVML against nvidia-smi")
    listed: list[SmiGpu] = []
    try:
        listed = parse_smi(await parts.smi(SMI_QUERY))
        checks[DISCOVERY] = discovery_check(gpus, listed)
    except Exception as error:
        checks[DISCOVERY] = _failure(DISCOVERY, error)
    driver = next((row.driver for row in listed if row.index == gpu.index), UNKNOWN)
    try:
        cuda = cudaburn.version_text(parts.cuda_version())
    except Exception:
        cuda = UNKNOWN
    identity = Identity(gpu.index, gpu.uuid, gpu.model, driver, cuda)

    parts.progress(f"processes: a child holds {HOLD_MIB} MiB")
    checks[PROCESSES] = await _guarded(PROCESSES, _processes(parts, options, gpu))

    parts.progress(f"compute: the unlimited baseline ({options.seconds} s), NVML's per-process samples meanwhile")
    baseline: Burn | BaseException
    sampler = _Sampler(parts.inventory, gpu.uuid)
    sampler.read()  # the samples after this one are the burn's
    polling = asyncio.create_task(sampler.poll())
    try:
        [baseline] = await parts.burn([child_env(parts.base_env, {mps.VISIBLE_DEVICES: gpu.uuid})], options.seconds)
    except Exception as error:
        baseline = error
    finally:
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
    sampler.read()
    checks[SAMPLES] = samples_check(gpu, sampler, baseline)

    # A short path: the MPS daemon's sockets live below it (a socket's path has at most 107 bytes).
    with tempfile.TemporaryDirectory(prefix="sgc-", ignore_cleanup_errors=True) as folder:
        checks.update(await _mps(parts, options, gpu, baseline, Path(folder) / "mps"))
        if library is None:
            why = "no --hami-core-library given"
            checks[HAMI_MEMORY] = Check(HAMI_MEMORY, Result.SKIP, {}, why)
            checks[HAMI_COMPUTE] = Check(HAMI_COMPUTE, Result.SKIP, {}, why)
        else:
            checks.update(await _hami(parts, options, gpu, baseline, library, Path(folder)))
    return Report(identity, tuple(checks[name] for name in ORDER))


class _Sampler:
    """NVML's per-process SM samples of one GPU, read now and then: the most any process showed."""

    def __init__(self, inventory: Inventory, uuid: str) -> None:
        self.inventory = inventory
        self.uuid = uuid
        self.reads = 0
        self.unsampled = 0
        """Reads where the GPU took no per-process samples."""
        self.most: tuple[int, int] | None = None
        """(SM %, pid) of the busiest process seen."""
        self.gpu_most = 0

    def read(self) -> None:
        found = next((u for u in self.inventory.utilization() if u.uuid == self.uuid), None)
        if found is None:
            return
        self.reads += 1
        self.gpu_most = max(self.gpu_most, found.sm_percent or 0)
        if found.processes is None:
            self.unsampled += 1
            return
        for pid, sm in found.processes:
            if self.most is None or sm > self.most[0]:
                self.most = (sm, pid)

    async def poll(self, every: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every)
            await asyncio.to_thread(self.read)


def samples_check(gpu: nvml.Gpu, sampler: _Sampler, baseline: Burn | BaseException) -> Check:
    """Whether NVML's per-process samples showed the baseline burn's SM use (what the agent attributes
    to pods: docs/metrics.md, "Usage per share")."""
    if gpu.mig:
        return Check(SAMPLES, Result.SKIP, {}, "a MIG GPU takes no per-process samples")
    if isinstance(baseline, BaseException):
        return Check(SAMPLES, Result.FAIL, {}, f"no baseline burn to sample: {errors.first_line(baseline)}")
    figures: dict[str, Figure] = {"reads": sampler.reads, "gpu_sm_percent": sampler.gpu_most}
    if sampler.reads and sampler.unsampled == sampler.reads:
        return Check(SAMPLES, Result.FAIL, figures, "NVML gives no per-process samples on this GPU")
    if sampler.most is None or sampler.most[0] == 0:
        return Check(SAMPLES, Result.FAIL, figures, "no process showed SM use while the baseline burned")
    sm, pid = sampler.most
    figures |= {"pid": pid, "process_sm_percent": sm}
    return Check(SAMPLES, Result.PASS, figures, f"pid {pid} showed {sm}% of the SMs while it burned")


async def _guarded(name: str, work: Awaitable[Check]) -> Check:
    """The check `work` makes; a FAIL with the error's first line if it raises."""
    try:
        return await work
    except Exception as error:
        return _failure(name, error)


async def _processes(parts: Parts, options: Options, gpu: nvml.Gpu) -> Check:
    async with parts.hold(child_env(parts.base_env, {mps.VISIBLE_DEVICES: gpu.uuid}), HOLD_MIB) as pid:
        deadline = time.monotonic() + options.patience
        while True:
            seen = [p for p in parts.inventory.running() if p.pid == pid]
            here = next((p for p in seen if p.uuid == gpu.uuid), None)
            if here is not None and here.used_mib >= HOLD_MIB:
                figures: dict[str, Figure] = {"pid": pid, "held_mib": HOLD_MIB, "used_mib": here.used_mib}
                return Check(PROCESSES, Result.PASS, figures, f"NVML lists pid {pid} with {here.used_mib} MiB")
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
    figures = {"pid": pid, "held_mib": HOLD_MIB, "used_mib": here.used_mib if here is not None else 0}
    if here is not None:
        detail = f"NVML lists pid {pid} with {here.used_mib} MiB, not the {HOLD_MIB} MiB it holds"
    elif seen:
        detail = f"NVML lists pid {pid} on {', '.join(p.uuid for p in seen)}, not on {gpu.uuid}"
    else:
        detail = f"NVML does not list pid {pid} after {options.patience:g} s (another PID namespace?)"
    return Check(PROCESSES, Result.FAIL, figures, detail)


async def _mps(
    parts: Parts, options: Options, gpu: nvml.Gpu, baseline: Burn | BaseException, root: Path
) -> dict[str, Check]:
    supervisor = parts.supervisor(root)
    if not supervisor.available():
        why = f"{supervisor.binary} not found: this node cannot offer mps"
        return {
            **{name: Check(name, Result.SKIP, {}, why) for name in MPS_CHECKS},
        }
    parts.progress(f"mps: starting a control daemon under {root}")
    try:
        # The ceiling lets the compute check's HIGH_MILLI client and the memory check's grant through.
        supervisor.limit({gpu.uuid: mps.Ceiling(HIGH_MILLI * 100 // units.MILLI_PER_GPU, 2 * LIMIT_MIB)})
        await supervisor.ensure({gpu.uuid})
        problem = await _daemon_up(supervisor, gpu.uuid, options.patience)
        if problem:
            failed = Check(MPS_MEMORY, Result.FAIL, {}, f"the MPS daemon did not come up: {problem}")
            return {name: Check(name, Result.FAIL, {}, failed.detail) for name in MPS_CHECKS}
        layout = supervisor.layout
        parts.progress(f"mps-memory: a client of a {LOW_MILLI}m, {LIMIT_MIB} MiB grant probes its memory")
        memory = await _guarded(MPS_MEMORY, _mps_memory(parts, gpu, layout))
        parts.progress(f"mps-compute: a client at {LOW_MILLI}m alone, then with one at {HIGH_MILLI}m")
        compute = await _guarded(
            MPS_COMPUTE,
            _compute(parts, options, baseline, MPS_COMPUTE, handoff.MPS_THREADS,
                     lambda milli: mps_client_env(gpu, milli, layout)),
        )  # fmt: skip
        parts.progress("mps-tenancy: a tenant tries to quit the daemon; a client without limits under its ceiling")
        tenancy = await _guarded(MPS_TENANCY, _mps_tenancy(parts, options, gpu, supervisor, baseline))
        return {MPS_MEMORY: memory, MPS_COMPUTE: compute, MPS_TENANCY: tenancy}
    except Exception as error:
        return {name: _failure(name, error) for name in MPS_CHECKS}
    finally:
        parts.progress("mps: stopping the daemon")
        await supervisor.stop()


async def _daemon_up(supervisor: mps.Supervisor, uuid: str, patience: float) -> str:
    """Wait until the GPU's daemon runs and its control socket is linked into the tenants' pipe folder
    (a client that finds no socket runs without MPS, unlimited); "" then, else why not."""
    control = supervisor.layout.tenant_pipe(uuid) / mps.CONTROL
    deadline = time.monotonic() + patience
    while True:
        status = supervisor.status().get(uuid)
        if status is not None and status.linked and control.exists():
            return ""
        if time.monotonic() >= deadline:
            if status is not None and not status.running:
                return status.problem or "not running"
            return f"no control socket {control} after {patience:g} s"
        await asyncio.sleep(0.05)


async def _mps_tenancy(
    parts: Parts, options: Options, gpu: nvml.Gpu, supervisor: mps.Supervisor, baseline: Burn | BaseException
) -> Check:
    """The daemon outlives a tenant's attempts (`TENANT_ATTEMPTS`), and a client that dropped the
    hand-off's limits is held to the daemon's ceiling (module docstring)."""
    ceiling = mps.Ceiling(LOW_MILLI * 100 // units.MILLI_PER_GPU, LIMIT_MIB)
    supervisor.limit({gpu.uuid: ceiling})
    deadline = time.monotonic() + options.patience
    while supervisor.status()[gpu.uuid].ceiling != ceiling:
        if time.monotonic() >= deadline:
            return Check(
                MPS_TENANCY,
                Result.FAIL,
                {},
                f"the daemon did not take the ceiling {ceiling} (the agent's log says why)",
            )
        await asyncio.sleep(0.05)
    before = supervisor.status()[gpu.uuid].pid
    said = await supervisor.ask(gpu.uuid, TENANT_ATTEMPTS, tenant=True)
    await asyncio.sleep(1.0)
    after = supervisor.status()[gpu.uuid]
    answer = " ".join((said or "nothing").split())
    figures: dict[str, Figure] = {"ceiling_percent": ceiling.percent, "ceiling_mib": ceiling.memory_mib,
                                  "daemon_kept": after.pid == before and after.running}  # fmt: skip
    if not figures["daemon_kept"]:
        return Check(MPS_TENANCY, Result.FAIL, figures, f"a tenant's quit ended the daemon (it answered: {answer})")
    limits = (handoff.MPS_THREADS, handoff.MPS_MEMORY)
    bare = {k: v for k, v in mps_client_env(gpu, LOW_MILLI, supervisor.layout).items() if k not in limits}
    memory = parts.judge_mps(
        await parts.probe(child_env(parts.base_env, bare), limit_mib=LIMIT_MIB), gpu.uuid, LIMIT_MIB
    )
    for finding in memory.findings:
        figures[f"{finding.lookup}_free_mib"] = finding.free_mib
        figures[f"{finding.lookup}_above_ok"] = f"{finding.above_succeeded}/{finding.attempts}"
    if isinstance(baseline, BaseException):
        return Check(
            MPS_TENANCY, Result.FAIL, figures, f"no unlimited baseline: {_failure(MPS_TENANCY, baseline).detail}"
        )
    [alone] = await parts.burn([child_env(parts.base_env, bare)], options.seconds)
    share = round(100 * alone.rate / baseline.rate) if baseline.rate > 0 else 100
    figures |= {"bare_rate": round(alone.rate, 1), "bare_share": share}
    held = memory.proven and share <= ALONE_MOST_PERCENT
    detail = (
        f"the daemon outlived a tenant's attempts (it answered: {answer}); a client without limit variables "
        f"was {'held' if memory.proven else 'NOT held'} to {LIMIT_MIB} MiB and ran at {share}% "
        f"(ceiling {ceiling.percent}%, at most {ALONE_MOST_PERCENT}% expected)"
    )
    return Check(MPS_TENANCY, Result.PASS if held else Result.FAIL, figures, detail)


async def _mps_memory(parts: Parts, gpu: nvml.Gpu, layout: mps.Layout) -> Check:
    env = child_env(parts.base_env, mps_client_env(gpu, LOW_MILLI, layout))
    findings = await parts.probe(env, limit_mib=LIMIT_MIB)
    return memory_check(MPS_MEMORY, parts.judge_mps(findings, gpu.uuid, LIMIT_MIB), LIMIT_MIB)


async def _compute(
    parts: Parts,
    options: Options,
    baseline: Burn | BaseException,
    name: str,
    variable: str,
    env_of: Callable[[int], dict[str, str]],
) -> Check:
    """A compute check: a LOW_MILLI client alone, then next to a HIGH_MILLI one (`env_of(milli)`)."""
    if isinstance(baseline, BaseException):
        return Check(name, Result.FAIL, {}, f"no unlimited baseline: {_failure(name, baseline).detail}")
    [alone] = await parts.burn([child_env(parts.base_env, env_of(LOW_MILLI))], options.seconds)
    low, high = await parts.burn(
        [child_env(parts.base_env, env_of(LOW_MILLI)), child_env(parts.base_env, env_of(HIGH_MILLI))], options.seconds
    )
    return judge_compute(name, variable, baseline, alone, low, high)


async def _hami(
    parts: Parts, options: Options, gpu: nvml.Gpu, baseline: Burn | BaseException, library: Path, folder: Path
) -> dict[str, Check]:
    caches = (folder / f"hami-{n}.cache" for n in itertools.count())

    def env_of(milli: int) -> dict[str, str]:
        return hami_client_env(gpu, milli, library, next(caches))

    async def memory() -> Check:
        findings = await parts.probe(child_env(parts.base_env, env_of(LOW_MILLI)), limit_mib=LIMIT_MIB)
        return memory_check(HAMI_MEMORY, parts.judge_hami(findings, library, LIMIT_MIB), LIMIT_MIB)

    parts.progress(f"hami-core-memory: a client of a {LOW_MILLI}m, {LIMIT_MIB} MiB grant preloads {library}")
    checked = {HAMI_MEMORY: await _guarded(HAMI_MEMORY, memory())}
    parts.progress(f"hami-core-compute: a client at {LOW_MILLI}m alone, then with one at {HIGH_MILLI}m")
    checked[HAMI_COMPUTE] = await _guarded(
        HAMI_COMPUTE, _compute(parts, options, baseline, HAMI_COMPUTE, handoff.SM_LIMIT, env_of)
    )
    return checked


# ---------------------------------------------------------------------------------- the real parts


def real_parts(
    inventory: Inventory, *, libcuda: str, mps_control: str, progress: Callable[[str], None] = _quiet
) -> Parts:
    """The parts on this machine: NVML (`inventory`, opened), nvidia-smi, cudaburn children over
    `libcuda`, cudaprobe, and an MPS supervisor running `mps_control`."""

    async def probe(env: Mapping[str, str], *, limit_mib: int) -> tuple[cudaprobe.Finding, ...]:
        return await cudaprobe.run(env, limit_mib=limit_mib, libcuda=libcuda)

    return Parts(
        inventory=inventory,
        smi=nvidia_smi,
        cuda_version=lambda: cudaburn.driver_version(libcuda),
        hold=ChildHolder(libcuda),
        burn=ChildBurner(libcuda),
        probe=probe,
        judge_mps=cudaprobe.judge_mps,
        judge_hami=cudaprobe.judge_hami,
        supervisor=lambda root: mps.Supervisor(mps_control, mps.Layout(root)),
        base_env=dict(os.environ),
        progress=progress,
    )


async def nvidia_smi(arguments: Sequence[str], timeout: float = 30.0) -> str:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        raise ChildError("nvidia-smi not found on PATH")
    process = await asyncio.create_subprocess_exec(
        binary, *arguments, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    if process.returncode != 0:
        said = (err or out).decode(errors="replace").strip().splitlines()
        raise ChildError(f"nvidia-smi {mps.describe_exit(process.returncode or 0)}: {said[-1] if said else ''}")
    return out.decode(errors="replace")


class _Child:
    """One cudaburn process in its own session: JSON lines on stdout, the tail of its stderr kept."""

    TAIL: Final = 400

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.stderr = b""
        self.draining = asyncio.create_task(self._drain())

    @classmethod
    async def start(cls, libcuda: str, arguments: Sequence[str], env: Mapping[str, str]) -> _Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", cudaburn.__name__, "--libcuda", libcuda, *arguments,
            env=dict(env), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        return cls(process)

    async def _drain(self) -> None:
        assert self.process.stderr is not None
        while chunk := await self.process.stderr.read(4096):
            self.stderr = (self.stderr + chunk)[-self.TAIL :]

    async def expect(self, key: str, timeout: float) -> dict[str, Any]:
        """The next line on stdout that is a JSON object with `key` (a preloaded library may print
        lines of its own); raises ChildError when the child ends first or takes over `timeout` s."""
        assert self.process.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                while line := await self.process.stdout.readline():
                    with contextlib.suppress(ValueError):
                        value = json.loads(line)
                        if isinstance(value, dict) and key in value:
                            return value
                code = await self.process.wait()
                await self.draining
        except TimeoutError:
            raise ChildError(f"cudaburn printed no {key!r} within {timeout:g} s{self._said()}") from None
        raise ChildError(f"cudaburn {mps.describe_exit(code)} before printing {key!r}{self._said()}")

    def _said(self) -> str:
        text = self.stderr.decode(errors="replace").strip()
        return f": {text.splitlines()[-1]}" if text else ""

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode())

    async def end(self) -> None:
        """Kill its process group (if it still runs) and reap it."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()
        self.draining.cancel()
        await asyncio.gather(self.draining, return_exceptions=True)
        if self.process.stdin is not None:
            self.process.stdin.close()


class ChildHolder:
    """`Holder` through `python -m sharegpu.agent.cuda.burn --hold-mib`."""

    def __init__(self, libcuda: str) -> None:
        self.libcuda = libcuda

    @contextlib.asynccontextmanager
    async def __call__(self, env: Mapping[str, str], mib: int) -> AsyncIterator[int]:
        child = await _Child.start(self.libcuda, ["--hold-mib", str(mib)], env)
        try:
            await child.expect("held_mib", READY_SECONDS)
            yield child.process.pid
        finally:
            await child.end()


class ChildBurner:
    """`Burner` through `python -m sharegpu.agent.cuda.burn --seconds S --wait`: every child loads and
    says it is ready, then all are told to start at once."""

    def __init__(self, libcuda: str) -> None:
        self.libcuda = libcuda

    async def __call__(self, envs: Sequence[Mapping[str, str]], seconds: int) -> list[Burn]:
        children: list[_Child] = []
        try:
            for env in envs:
                children.append(await _Child.start(self.libcuda, ["--seconds", str(seconds), "--wait"], env))
            await _together(child.expect("ready", READY_SECONDS) for child in children)
            for child in children:
                child.send("go\n")
            results = await _together(child.expect("rate", seconds + READY_SECONDS) for child in children)
        finally:
            await asyncio.gather(*(child.end() for child in children))
        return [Burn(int(r["launches"]), float(r["seconds"]), float(r["rate"]), int(r.get("sms", 0))) for r in results]


async def _together(work: Iterable[Awaitable[T]]) -> list[T]:
    """Await all; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = task.exception() if task.done() and not task.cancelled() else None
            if error is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
