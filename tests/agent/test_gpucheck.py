"""`sharegpu gpu-check` without a GPU: the pure parts (nvidia-smi's CSV, discovery compared, compute
judged both ways, the hand-off's variables mapped to the host, the JSON), the orchestration end to end
on fakes (the real MPS supervisor over the fake daemon), the real children failing cleanly where
there is no driver, and the command line."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer.core
import typer.main
from typer.testing import CliRunner

from sharegpu import cli
from sharegpu.agent import mps, nvml
from sharegpu.agent.cuda import burn as cudaburn
from sharegpu.agent.cuda import child as cudachild
from sharegpu.agent.cuda import probe as cudaprobe
from sharegpu.agent.tools import gpucheck
from sharegpu.agent.tools.gpucheck import Burn, Check, Result
from sharegpu.api import handoff
from tests.agent.fake_mps_daemon import write_fake_daemon

H200 = nvml.Gpu(
    0, "GPU-5b6c1e9a-0d1f-4a8e-9c3b-7e2f1a0b9c8d", 0, "NVIDIA H200", 143771, architecture="Hopper",
    compute_capability="9.0", driver_version="570.86.15", pci_bus_id="0000:18:00.0",
)  # fmt: skip
OTHER = dataclasses.replace(
    H200, index=1, uuid="GPU-0f9e8d7c-6b5a-4938-8271-605f4e3d2c1b", minor=1, pci_bus_id="0000:2a:00.0"
)
SMI = (
    "0, GPU-5b6c1e9a-0d1f-4a8e-9c3b-7e2f1a0b9c8d, NVIDIA H200, 143771, 00000000:18:00.0, 570.86.15, 9.0\n"
    "1, GPU-0f9e8d7c-6b5a-4938-8271-605f4e3d2c1b, NVIDIA H200, 143771, 00000000:2A:00.0, 570.86.15, 9.0\n"
)
FULL = 1341.0
"""The fake GPU's launches per second for one unlimited client."""
HOLDER_PID = 4242
BURN_PID = 5151
HOLDER = nvml.GpuProcess(HOLDER_PID, H200.uuid, 1536)


# ---------------------------------------------------------------- nvidia-smi and discovery


def test_nvidia_smis_csv_is_parsed() -> None:
    rows = gpucheck.parse_smi(SMI + "\n")
    assert [(r.index, r.uuid, r.name, r.memory_mib, r.bus_id, r.driver, r.compute_cap) for r in rows] == [
        (0, H200.uuid, "NVIDIA H200", 143771, "00000000:18:00.0", "570.86.15", "9.0"),
        (1, OTHER.uuid, "NVIDIA H200", 143771, "00000000:2A:00.0", "570.86.15", "9.0"),
    ]
    assert gpucheck.SMI_QUERY == (
        "--query-gpu=index,uuid,name,memory.total,pci.bus_id,driver_version,compute_cap",
        "--format=csv,noheader,nounits",
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0, GPU-a, NVIDIA H200, 143771\n", "4 fields, not 7"),
        ("0, GPU-a, NVIDIA H200, [N/A], 00000000:18:00.0, 570.86.15, 9.0\n", "not a number"),
    ],
)
def test_nvidia_smis_csv_that_is_not_as_asked_is_refused(text: str, message: str) -> None:
    with pytest.raises(gpucheck.ChildError, match=re.escape(message)):
        gpucheck.parse_smi(text)


def test_discovery_passes_when_nvml_and_nvidia_smi_agree() -> None:
    check = gpucheck.discovery_check([H200, OTHER], gpucheck.parse_smi(SMI))
    assert check == Check(
        "discovery",
        Result.PASS,
        {"nvml_gpus": 2, "smi_gpus": 2, "mismatches": 0},
        "NVML and nvidia-smi agree on 2 GPU(s)",
    )


def test_discovery_names_each_mismatch() -> None:
    listed = gpucheck.parse_smi(SMI)
    wrong = [
        listed[0],
        gpucheck.SmiGpu(1, "GPU-other", "NVIDIA H100 80GB HBM3", 81559, "00000000:2B:00.0", "570.86.10", "9.1"),
    ]
    assert gpucheck.compare([H200, OTHER], wrong) == [
        f"GPU 1: UUID '{OTHER.uuid}' (NVML) vs 'GPU-other' (nvidia-smi)",
        "GPU 1: model 'NVIDIA H200' (NVML) vs 'NVIDIA H100 80GB HBM3' (nvidia-smi)",
        "GPU 1: memory MiB 143771 (NVML) vs 81559 (nvidia-smi)",
        "GPU 1: PCI bus ID '0000:2a:00.0' (NVML) vs '0000:2b:00.0' (nvidia-smi)",
        "GPU 1: driver version '570.86.15' (NVML) vs '570.86.10' (nvidia-smi)",
        "GPU 1: compute capability '9.0' (NVML) vs '9.1' (nvidia-smi)",
    ]
    check = gpucheck.discovery_check([H200, OTHER], wrong)
    assert check.result is Result.FAIL and check.figures["mismatches"] == 6
    assert check.detail == f"GPU 1: UUID '{OTHER.uuid}' (NVML) vs 'GPU-other' (nvidia-smi) (and 5 more)"
    assert gpucheck.compare([H200, OTHER], listed[:1]) == [
        "NVML sees 2 GPU(s), nvidia-smi lists 1",
        f"GPU 1 ({OTHER.uuid}): not listed by nvidia-smi",
    ]


# ---------------------------------------------------------------- compute judged


def burn(rate: float, sms: int = 132) -> Burn:
    return Burn(launches=round(rate * 6), seconds=6.0, rate=rate, sms=sms)


def test_compute_is_enforced_when_the_quarter_client_gets_about_a_quarter() -> None:
    check = gpucheck.judge_compute(
        "mps-compute", handoff.MPS_THREADS, burn(1340), burn(352, sms=33), burn(330), burn(1000)
    )
    assert check.result is Result.PASS
    assert check.figures == {
        "baseline_rate": 1340.0,
        "alone_rate": 352.0,
        "alone_share": 26,
        "baseline_sms": 132,
        "alone_sms": 33,
        "pair_low_rate": 330.0,
        "pair_low_share": 25,
        "pair_high_rate": 1000.0,
        "pair_high_share": 75,
    }
    assert check.detail.startswith("enforced: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 alone ran at 26% of the unlimited")


def test_compute_is_not_enforced_when_the_limit_changes_nothing() -> None:
    """HAMi-core's SM limit on an H200: alone as fast as unlimited, and an even split in the pair."""
    check = gpucheck.judge_compute("hami-core-compute", handoff.SM_LIMIT, burn(1341), burn(1339), burn(670), burn(671))
    assert check.result is Result.FAIL
    assert check.detail.startswith("not enforced: CUDA_DEVICE_SM_LIMIT=25 alone ran at 100% of the unlimited rate")
    assert "together, 25% got 670/s and 75% 671/s (100%, at most 70% expected)" in check.detail
    assert check.figures["pair_low_rate"] == 670.0 and check.figures["pair_high_rate"] == 671.0


@pytest.mark.parametrize(
    ("alone", "low", "high"),
    [
        (350, 670, 671),  # bound alone, but no split in the pair
        (600, 330, 1000),  # split in the pair, but not bound alone
    ],
)
def test_compute_needs_both_the_alone_and_the_pair_figures(alone: float, low: float, high: float) -> None:
    check = gpucheck.judge_compute("mps-compute", handoff.MPS_THREADS, burn(1340), burn(alone), burn(low), burn(high))
    assert check.result is Result.FAIL and check.detail.startswith("not enforced")


def test_a_client_that_completed_nothing_fails_the_check() -> None:
    check = gpucheck.judge_compute("mps-compute", handoff.MPS_THREADS, burn(1340), burn(0), burn(330), burn(1000))
    assert check.result is Result.FAIL
    assert check.detail == "a client completed no launch in its second half (alone)"


# ---------------------------------------------------------------- the hand-off's variables on the host


def test_an_mps_client_gets_the_hand_offs_limits_and_its_tenant_folder(tmp_path: Path) -> None:
    layout = mps.Layout(tmp_path)
    assert gpucheck.mps_client_env(H200, 250, layout) == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M",
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / H200.uuid / "tenant" / "pipe"),
        "CUDA_VISIBLE_DEVICES": H200.uuid,
    }, "a pod's pipe folder, seen from the host; no log folder (a tenant has none)"
    assert gpucheck.mps_client_env(H200, 250, layout)["CUDA_MPS_PIPE_DIRECTORY"] == str(layout.tenant_pipe(H200.uuid))
    assert gpucheck.mps_client_env(OTHER, 750, layout)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "75"


def test_a_hami_client_preloads_the_hosts_library_with_a_private_cache(tmp_path: Path) -> None:
    library = tmp_path / "libvgpu.so"
    assert gpucheck.hami_client_env(H200, 250, library, tmp_path / "a.cache") == {
        "CUDA_DEVICE_SM_LIMIT": "25",
        "CUDA_DEVICE_MEMORY_LIMIT": "2048m",
        "LD_PRELOAD": str(library),
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "a.cache"),
        "CUDA_VISIBLE_DEVICES": H200.uuid,
    }


def test_a_child_inherits_no_limit_from_this_process() -> None:
    base = {
        "PATH": "/usr/bin",
        "LD_PRELOAD": "/old.so",
        "CUDA_VISIBLE_DEVICES": "1",
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "1m",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/cudevshr.cache",
        "CUDA_CACHE_PATH": "/cache",
    }
    assert gpucheck.child_env(base, {"CUDA_VISIBLE_DEVICES": H200.uuid}) == {
        "PATH": "/usr/bin",
        "CUDA_CACHE_PATH": "/cache",
        "CUDA_VISIBLE_DEVICES": H200.uuid,
    }


# ---------------------------------------------------------------- the orchestration on fakes


@dataclass
class FakeInventory:
    found: list[nvml.Gpu]
    processes: list[nvml.GpuProcess] = field(default_factory=list)
    closed: bool = False
    burning: bool = False
    """A compute child runs: the next samples show it (BURN_PID at 97% of the SMs)."""
    sampled: bool = True
    """False: NVML takes no per-process samples (as on a MIG GPU)."""

    def gpus(self) -> list[nvml.Gpu]:
        return list(self.found)

    def running(self) -> list[nvml.GpuProcess]:
        return list(self.processes)

    def utilization(self) -> list[nvml.Utilization]:
        shown = ((BURN_PID, 97),) if self.burning else ()
        self.burning = False  # samples since the last read
        return [nvml.Utilization(g.uuid, 97 if shown else 0, shown if self.sampled else None) for g in self.found]

    def close(self) -> None:
        self.closed = True


def _reaches_daemon(env: Mapping[str, str]) -> bool:
    pipe = env.get(handoff.MPS_PIPE)
    return pipe is not None and Path(pipe, "control").exists()


def _preloads(env: Mapping[str, str]) -> bool:
    return Path(env.get(handoff.LD_PRELOAD, "/absent")).is_file()


@dataclass
class FakeGpu:
    """The GPU the fakes share: MPS binds whoever reaches its daemon; HAMi-core binds memory, and
    compute only when `hami_compute`; the processes check sees the holder in `listed_as`."""

    inventory: FakeInventory
    hami_compute: bool = True
    listed_as: nvml.GpuProcess | None = HOLDER
    burns: list[list[dict[str, str]]] = field(default_factory=list)
    probes: list[dict[str, str]] = field(default_factory=list)
    held: list[dict[str, str]] = field(default_factory=list)
    daemons: list[int] = field(default_factory=list)
    supervisors: list[mps.Supervisor] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def hold(self, env: Mapping[str, str], mib: int) -> AsyncIterator[int]:
        assert mib == gpucheck.HOLD_MIB
        self.held.append(dict(env))
        if self.listed_as is not None:
            self.inventory.processes.append(self.listed_as)
        try:
            yield HOLDER_PID
        finally:
            self.inventory.processes.clear()

    def _ceiling(self) -> mps.Ceiling:
        """What the daemon took (a client's own variables only lower it: seen on an H200, driver 580)."""
        [status] = self.supervisors[-1].status().values()
        return status.ceiling or mps.Ceiling(100, H200.memory_mib)

    def _limit(self, env: Mapping[str, str]) -> int | None:
        if _reaches_daemon(env):
            return min(int(env.get(handoff.MPS_THREADS, 100)), self._ceiling().percent)
        if _preloads(env) and self.hami_compute:
            return int(env[handoff.SM_LIMIT])
        return None

    async def burn(self, envs: Sequence[Mapping[str, str]], seconds: int) -> list[Burn]:
        assert seconds == 5
        self.burns.append([dict(env) for env in envs])
        self.inventory.burning = True
        limits = [self._limit(env) for env in envs]
        if all(limit is not None for limit in limits):
            rates = [FULL * (limit or 0) / 100 for limit in limits]
        elif len(envs) == 1:
            rates = [FULL]
        else:
            rates = [670.0, 671.0]
        return [Burn(round(rate * seconds), float(seconds), rate) for rate in rates]

    async def probe(self, env: Mapping[str, str], *, limit_mib: int) -> tuple[cudaprobe.Finding, ...]:
        self.probes.append(dict(env))
        total, free = H200.memory_mib, H200.memory_mib - 600
        if _reaches_daemon(env):
            [status] = self.supervisors[-1].status().values()
            assert status.pid is not None
            self.daemons.append(status.pid)
            own = (
                int(env[handoff.MPS_MEMORY].removeprefix("0=").removesuffix("M")) if handoff.MPS_MEMORY in env else None
            )
            free = min(own or H200.memory_mib, self._ceiling().memory_mib)
        elif _preloads(env):
            assert env[handoff.MEMORY_LIMIT] == f"{limit_mib}m"
            total = free = limit_mib
        bound = free <= limit_mib
        finding = cudaprobe.Finding("dlsym", total, free, True, 3, 0 if bound else 3, "")
        return (finding,)

    def supervisor(self, daemon: Path) -> Callable[[Path], mps.Supervisor]:
        def make(root: Path) -> mps.Supervisor:
            made = mps.Supervisor(daemon, mps.Layout(root), grace=2.0)
            self.supervisors.append(made)
            return made

        return make


async def smi(arguments: Sequence[str]) -> str:
    assert tuple(arguments) == gpucheck.SMI_QUERY
    return SMI


def parts(gpu: FakeGpu, daemon: Path) -> gpucheck.Parts:
    return gpucheck.Parts(
        inventory=gpu.inventory,
        smi=smi,
        cuda_version=lambda: 12080,
        hold=gpu.hold,
        burn=gpu.burn,
        probe=gpu.probe,
        judge_mps=cudaprobe.judge_mps,
        judge_hami=cudaprobe.judge_hami,
        supervisor=gpu.supervisor(daemon),
        base_env={"PATH": os.environ.get("PATH", ""), "LD_PRELOAD": "/inherited.so"},
    )


@pytest.fixture
def gpu() -> FakeGpu:
    return FakeGpu(FakeInventory([H200, OTHER]))


@pytest.fixture
def daemon(tmp_path: Path) -> Path:
    return write_fake_daemon(tmp_path / "bin")


@pytest.fixture
def library(tmp_path: Path) -> Path:
    path = tmp_path / "operator" / "libvgpu.so"
    path.parent.mkdir()
    path.write_bytes(b"\x7fELF")
    return path


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_every_check_passes_on_a_gpu_that_enforces_everything(gpu: FakeGpu, daemon: Path, library: Path) -> None:
    report = await gpucheck.check(parts(gpu, daemon), gpucheck.Options(seconds=5, hami_core_library=library))
    assert [(c.name, c.result) for c in report.checks] == [(name, Result.PASS) for name in gpucheck.ORDER], report
    assert report.exit_status() == 0
    assert report.gpu == gpucheck.Identity(0, H200.uuid, "NVIDIA H200", "570.86.15", "12.8")
    by_name = {c.name: c for c in report.checks}
    assert by_name["processes"].figures == {"pid": HOLDER_PID, "held_mib": 1024, "used_mib": 1536}
    assert by_name["process-samples"].figures == {
        "reads": 2,
        "gpu_sm_percent": 97,
        "pid": BURN_PID,
        "process_sm_percent": 97,
    }
    assert by_name["mps-compute"].figures["alone_share"] == 25
    assert by_name["mps-memory"].figures["dlsym_free_mib"] == 2048
    assert by_name["hami-core-memory"].figures["dlsym_total_mib"] == 2048

    # The children: the holder and the baseline see the GPU and nothing inherited; MPS clients then
    # the HAMi-core ones, alone and in pairs.
    plain = {"PATH": os.environ.get("PATH", ""), "CUDA_VISIBLE_DEVICES": H200.uuid}
    assert gpu.held == [plain]
    assert gpu.burns[0] == [plain]
    mps_alone, mps_pair, [bare], hami_alone, hami_pair = gpu.burns[1:]
    assert [env[handoff.MPS_THREADS] for env in [*mps_alone, *mps_pair]] == ["25", "25", "75"]
    assert handoff.MPS_THREADS not in bare and handoff.MPS_MEMORY not in gpu.probes[1], "the tenancy check's client"
    assert by_name["mps-tenancy"].figures == {
        "ceiling_percent": 25, "ceiling_mib": 2048, "daemon_kept": True, "dlsym_free_mib": 2048,
        "dlsym_above_ok": "0/3", "bare_rate": round(FULL / 4, 1), "bare_share": 25,
    }  # fmt: skip
    assert [env[handoff.SM_LIMIT] for env in [*hami_alone, *hami_pair]] == ["25", "25", "75"]
    caches = {env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] for env in [*hami_alone, *hami_pair, gpu.probes[2]]}
    assert len(caches) == 4, "each HAMi-core client has its own accounting"
    assert all(env["LD_PRELOAD"] == str(library) for env in [*hami_alone, *hami_pair, gpu.probes[2]])

    # The daemon ran under a private root, and is gone with it.
    [supervisor] = gpu.supervisors
    assert supervisor.status() == {}
    assert gpu.daemons and all(gone(pid) for pid in gpu.daemons)
    assert not supervisor.layout.root.exists()
    assert len(str(supervisor.layout.pipe(H200.uuid) / "control_privileged")) < 108, "a socket path's limit"
    assert len(str(supervisor.layout.tenant_pipe(H200.uuid) / "control")) < 108


async def test_hami_core_is_skipped_without_its_library(gpu: FakeGpu, daemon: Path) -> None:
    report = await gpucheck.check(parts(gpu, daemon), gpucheck.Options(seconds=5))
    assert [(c.name, c.result) for c in report.checks[-2:]] == [
        ("hami-core-memory", Result.SKIP),
        ("hami-core-compute", Result.SKIP),
    ]
    assert report.checks[-1].detail == "no --hami-core-library given"
    assert report.exit_status() == 0, "a skip is no failure"
    assert len(gpu.burns) == 4


async def test_hami_cores_ignored_compute_limit_is_reported_not_raised(
    gpu: FakeGpu, daemon: Path, library: Path
) -> None:
    gpu.hami_compute = False
    report = await gpucheck.check(parts(gpu, daemon), gpucheck.Options(seconds=5, hami_core_library=library))
    results = {c.name: c.result for c in report.checks}
    assert results == {**dict.fromkeys(gpucheck.ORDER, Result.PASS), "hami-core-compute": Result.FAIL}
    failed = report.checks[-1]
    assert failed.detail.startswith("not enforced: CUDA_DEVICE_SM_LIMIT=25 alone ran at 100%")
    assert failed.figures["pair_low_rate"] == 670.0
    assert report.exit_status() == 1


async def test_a_holder_nvml_does_not_list_fails_the_processes_check(gpu: FakeGpu, daemon: Path) -> None:
    gpu.listed_as = None
    options = gpucheck.Options(seconds=5, patience=0.3)
    report = await gpucheck.check(parts(gpu, daemon), options)
    [processes] = [c for c in report.checks if c.name == "processes"]
    assert processes.result is Result.FAIL
    assert processes.detail == f"NVML does not list pid {HOLDER_PID} after 0.3 s (another PID namespace?)"
    gpu.listed_as = nvml.GpuProcess(HOLDER_PID, H200.uuid, 512)
    [processes] = [c for c in (await gpucheck.check(parts(gpu, daemon), options)).checks if c.name == "processes"]
    assert processes.detail == f"NVML lists pid {HOLDER_PID} with 512 MiB, not the 1024 MiB it holds"


async def test_mps_is_skipped_where_its_daemon_is_not_installed(gpu: FakeGpu, tmp_path: Path) -> None:
    report = await gpucheck.check(parts(gpu, tmp_path / "absent"), gpucheck.Options(seconds=5))
    mps_checks = [c for c in report.checks if c.name.startswith("mps")]
    assert [c.result for c in mps_checks] == [Result.SKIP] * 3
    assert mps_checks[0].detail == f"{tmp_path / 'absent'} not found: this node cannot offer mps"


async def test_a_daemon_that_does_not_stay_up_fails_the_mps_checks(gpu: FakeGpu, tmp_path: Path) -> None:
    daemon = write_fake_daemon(tmp_path / "bin", exit_code=3)
    report = await gpucheck.check(parts(gpu, daemon), gpucheck.Options(seconds=5, patience=0.5))
    mps_checks = [c for c in report.checks if c.name.startswith("mps")]
    assert [c.result for c in mps_checks] == [Result.FAIL] * 3
    assert mps_checks[0].detail.startswith("the MPS daemon did not come up: exited with status 3")
    assert gpu.supervisors[0].status() == {}


async def test_children_that_fail_make_failed_checks(gpu: FakeGpu, daemon: Path) -> None:
    async def broken(envs: Sequence[Mapping[str, str]], seconds: int) -> list[Burn]:
        raise gpucheck.ChildError("cudaburn exited with status 1 before printing 'ready': cuInit returned 100")

    async def no_smi(arguments: Sequence[str]) -> str:
        raise gpucheck.ChildError("nvidia-smi not found on PATH")

    def no_cuda() -> int:
        raise cudachild.DriverError("cannot load libcuda.so.1")

    failing = dataclasses.replace(parts(gpu, daemon), smi=no_smi, cuda_version=no_cuda, burn=broken)
    report = await gpucheck.check(failing, gpucheck.Options(seconds=5))
    assert report.gpu.driver == "unknown" and report.gpu.cuda == "unknown"
    details = {c.name: (c.result, c.detail) for c in report.checks}
    assert details["discovery"] == (Result.FAIL, "nvidia-smi not found on PATH")
    assert details["mps-memory"][0] is Result.PASS
    assert details["mps-compute"] == (
        Result.FAIL,
        "no unlimited baseline: cudaburn exited with status 1 before printing 'ready': cuInit returned 100",
    )
    assert report.exit_status() == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (gpucheck.Options(gpu=7, seconds=5), "no GPU 7 here: NVML sees 0, 1"),
        (gpucheck.Options(seconds=4), "compute runs need at least 5 seconds, not 4"),
        (gpucheck.Options(seconds=5, hami_core_library=Path("/absent/libvgpu.so")), "is not a file"),
    ],
)
async def test_what_cannot_be_checked_as_asked_is_refused(
    gpu: FakeGpu, daemon: Path, options: gpucheck.Options, message: str
) -> None:
    with pytest.raises(gpucheck.GpuCheckError, match=re.escape(message)):
        await gpucheck.check(parts(gpu, daemon), options)
    assert gpu.burns == [] and gpu.supervisors == []


def test_the_report_as_json_and_as_rows() -> None:
    report = gpucheck.Report(
        gpucheck.Identity(0, H200.uuid, "NVIDIA H200", "570.86.15", "12.8"),
        (
            Check("discovery", Result.PASS, {"nvml_gpus": 2}, "agree"),
            Check("mps-compute", Result.FAIL, {"alone_rate": 1339.0, "alone_share": 100, "x": True}, "not enforced"),
            Check("hami-core-memory", Result.SKIP, {}, "no --hami-core-library given"),
        ),
    )
    body = json.loads(json.dumps(gpucheck.to_json(report)))
    assert body == {
        "gpu": {"index": 0, "uuid": H200.uuid, "model": "NVIDIA H200", "driver": "570.86.15", "cuda": "12.8"},
        "checks": [
            {"name": "discovery", "result": "PASS", "figures": {"nvml_gpus": 2}, "detail": "agree"},
            {
                "name": "mps-compute",
                "result": "FAIL",
                "figures": {"alone_rate": 1339.0, "alone_share": 100, "x": True},
                "detail": "not enforced",
            },
            {"name": "hami-core-memory", "result": "SKIP", "figures": {}, "detail": "no --hami-core-library given"},
        ],
    }
    assert gpucheck.rows(report) == [
        ("discovery", "all", "PASS", "nvml_gpus=2", "agree"),
        ("mps-compute", "0", "FAIL", "alone_rate=1339.0, alone_share=100, x=yes", "not enforced"),
        ("hami-core-memory", "0", "SKIP", "", "no --hami-core-library given"),
    ]
    assert report.exit_status() == 1


# ---------------------------------------------------------------- the real children, without a driver


async def test_a_burner_without_a_driver_fails_with_its_reason(tmp_path: Path) -> None:
    burner = gpucheck.ChildBurner(str(tmp_path / "libcuda.so.1"))
    with pytest.raises(gpucheck.ChildError) as caught:
        await burner([dict(os.environ), dict(os.environ)], 5)
    assert re.fullmatch(
        r"cudaburn exited with status 1 before printing 'ready': cudaburn: cannot load .*libcuda\.so\.1: .*",
        str(caught.value),
    )


async def test_a_holder_without_a_driver_fails_with_its_reason(tmp_path: Path) -> None:
    holder = gpucheck.ChildHolder(str(tmp_path / "libcuda.so.1"))
    with pytest.raises(gpucheck.ChildError, match="before printing 'held_mib': cudaburn: cannot load"):
        async with holder(dict(os.environ), 1024):
            pytest.fail("held without a driver")


async def test_the_first_failure_stops_the_others() -> None:
    slow = asyncio.Event()

    async def fails() -> int:
        raise gpucheck.ChildError("broken")

    async def waits() -> int:
        await slow.wait()
        return 1

    async with asyncio.timeout(5):
        with pytest.raises(gpucheck.ChildError, match="broken"):
            await gpucheck._together([waits(), fails()])


async def test_nvidia_smi_is_run_from_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(gpucheck.ChildError, match="nvidia-smi not found on PATH"):
        await gpucheck.nvidia_smi(gpucheck.SMI_QUERY)
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint(' '.join(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert await gpucheck.nvidia_smi(["-L"]) == "-L\n"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('NVIDIA-SMI has failed')\n")
    with pytest.raises(gpucheck.ChildError, match="nvidia-smi exited with status 1: NVIDIA-SMI has failed"):
        await gpucheck.nvidia_smi(["-L"])


# ---------------------------------------------------------------- the real children on a stand-in driver

_DRIVER = r"""
/* A stand-in libcuda for cudaburn: checks what each call is given as the real driver would need it,
   and takes STUB_MICROS microseconds per launch (the launch rate a test expects). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
static long setting(const char *name, long fallback) {
    const char *value = getenv(name);
    return value ? atol(value) : fallback;
}
static int context, module, function;
static long launches;

CUresult cuInit(unsigned flags) { return flags ? 1 : (CUresult)setting("STUB_INIT", 0); }
CUresult cuDriverGetVersion(int *version) { *version = 12080; return 0; }
CUresult cuDeviceGet(int *device, int ordinal) { *device = ordinal; return ordinal ? 101 : 0; }
CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
    if (attribute != 16 || device) return 1;
    *value = (int)setting("STUB_SMS", 132);
    return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = &context; return device ? 101 : 0; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == &context ? 0 : 201; }
CUresult cuMemAlloc_v2(uint64_t *pointer, size_t size) {
    void *memory = malloc(size);
    if (!memory) return 2;
    *pointer = (uint64_t)(uintptr_t)memory;
    return 0;
}
CUresult cuModuleLoadData(void **loaded, const void *image) {
    if (strncmp((const char *)image, ".version 7.0\n.target sm_70\n", 27)) return 218;
    *loaded = &module;
    return 0;
}
CUresult cuModuleGetFunction(void **found, void *loaded, const char *name) {
    if (loaded != &module || strcmp(name, "burn")) return 500;
    *found = &function;
    return 0;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **parameters, void **extra) {
    if (f != &function || gy != 1 || gz != 1 || by != 1 || bz != 1 || shared || stream || extra) return 1;
    if (gx != 16384 || bx != 256 || *(unsigned *)parameters[1] != 4096) return 1;
    float *out = (float *)(uintptr_t)*(uint64_t *)parameters[0];
    out[gx * bx - 1] = 1.0f; /* a float for each thread */
    if (++launches > setting("STUB_FAIL_AFTER", 1L << 40)) return 700;
    struct timespec pause = {0, setting("STUB_MICROS", 1000) * 1000L};
    nanosleep(&pause, 0);
    return 0;
}
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuGetErrorString(CUresult code, const char **text) {
    *text = code == 700 ? "an illegal memory access was encountered" : "unknown error";
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in libcuda, built with the machine's gcc."""
    folder = tmp_path_factory.mktemp("driver")
    source, library = folder / "libcuda_burn.c", folder / "libcuda.so.1"
    source.write_text(_DRIVER)
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("cudaburn's tests build a stand-in libcuda with gcc, and gcc is not on PATH")
    built = subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-o", str(library), str(source)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return library


def stub_env(**settings: int) -> dict[str, str]:
    return {**os.environ, **{f"STUB_{name.upper()}": str(value) for name, value in settings.items()}}


async def test_children_started_together_report_their_own_rates(driver: Path) -> None:
    slow, fast = stub_env(micros=4000, sms=33), stub_env(micros=1000)
    low, high = await gpucheck.ChildBurner(str(driver))([slow, fast], 1)
    assert (low.sms, high.sms) == (33, 132)
    assert 100 < low.rate <= 250 and 400 < high.rate <= 1000 and low.rate < high.rate / 2, (low, high)
    assert low.seconds >= 1.0 and low.launches > 100


async def test_a_child_whose_launch_fails_says_why(driver: Path) -> None:
    with pytest.raises(gpucheck.ChildError) as caught:
        await gpucheck.ChildBurner(str(driver))([stub_env(fail_after=3)], 1)
    assert str(caught.value) == (
        "cudaburn exited with status 1 before printing 'rate': "
        "cudaburn: cuLaunchKernel returned 700 (an illegal memory access was encountered)"
    )
    with pytest.raises(gpucheck.ChildError, match="before printing 'ready': cudaburn: cuInit returned 100"):
        await gpucheck.ChildBurner(str(driver))([stub_env(init=100)], 1)


async def test_a_holder_runs_while_held_and_not_after(driver: Path) -> None:
    async with gpucheck.ChildHolder(str(driver))(stub_env(), 1) as pid:
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-3:-1] == [b"--hold-mib", b"1"]
    assert gone(pid)


def test_the_driver_version_needs_no_device(driver: Path) -> None:
    assert cudaburn.driver_version(str(driver)) == 12080


# ---------------------------------------------------------------- the compute child's own parts


def test_the_kernel_is_ptx_the_driver_compiles_for_any_gpu_since_volta() -> None:
    lines = cudaburn.PTX.splitlines()
    assert lines[:3] == [".version 7.0", ".target sm_70", ".address_size 64"]
    assert f".visible .entry {cudaburn.KERNEL}(" in cudaburn.PTX
    assert cudaburn.PTX.count("fma.rn.f32") == 4
    assert "mov.f32 %f7, 0f38D1B717;" in cudaburn.PTX, "1e-4 as PTX writes a float"


def test_the_rate_is_over_the_second_half() -> None:
    assert cudaburn.rate(0.0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == 1.0
    assert cudaburn.rate(10.0, [10.5, 11.0, 14.0, 15.0, 16.0]) == pytest.approx(3 / 5)
    assert cudaburn.rate(0.0, []) == 0.0
    assert cudaburn.version_text(12080) == "12.8" and cudaburn.version_text(13000) == "13.0"


def test_the_compute_child_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cudaburn.main(["--seconds", "0"])
    assert exited.value.code == 2
    assert "0 is not positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cudaburn.main(["--seconds", "5", "--hold-mib", "10"])


def test_the_compute_child_without_a_driver_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cudaburn.main(["--seconds", "5", "--libcuda", str(tmp_path / "libcuda.so.1")]) == 1
    assert capsys.readouterr().err.startswith(f"cudaburn: cannot load {tmp_path / 'libcuda.so.1'}: ")


# ---------------------------------------------------------------- the command line

runner = CliRunner()


def test_the_command_fails_in_one_line_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver(self: nvml.Nvml) -> nvml.Nvml:
        raise nvml.NvmlUnavailableError("NVML cannot be loaded here (NVML Shared Library Not Found)")

    monkeypatch.setattr(nvml.Nvml, "open", no_driver)
    result = runner.invoke(cli.app, ["gpu-check"])
    assert result.exit_code == 2
    assert result.output == "sharegpu: error: NVML cannot be loaded here (NVML Shared Library Not Found)\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seconds", "4"], "Invalid value for '--seconds': Input should be greater than or equal to 5"),
        (["--gpu", "-1"], "Invalid value for '--gpu': Input should be greater than or equal to 0"),
    ],
)
def test_the_command_refuses_bad_options_in_one_line(args: list[str], message: str) -> None:
    result = runner.invoke(cli.app, ["gpu-check", *args])
    assert result.exit_code == 2
    assert result.output == f"sharegpu: error: {message}\n"


@pytest.mark.parametrize("enforced", [True, False])
def test_the_command_prints_the_table_writes_json_and_exits_by_the_results(
    gpu: FakeGpu,
    daemon: Path,
    library: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    enforced: bool,
) -> None:
    gpu.hami_compute = enforced
    wired: list[tuple[str, str]] = []

    def real_parts(
        inventory: gpucheck.Inventory, *, libcuda: str, mps_control: str, progress: Callable[[str], None]
    ) -> gpucheck.Parts:
        assert inventory is gpu.inventory
        wired.append((libcuda, mps_control))
        return parts(gpu, Path(mps_control))

    class Opened:
        def open(self) -> FakeInventory:
            return gpu.inventory

    monkeypatch.setattr(nvml, "Nvml", Opened)
    monkeypatch.setattr(gpucheck, "real_parts", real_parts)
    out = tmp_path / "check.json"
    args = ["gpu-check", "--seconds", "5", "--hami-core-library", str(library), "--mps-control", str(daemon)]
    result = runner.invoke(
        cli.app, [*args, "--json", str(out), "--libcuda", "/lib/libcuda.so.1"], env={"COLUMNS": "300"}
    )
    assert result.exit_code == (0 if enforced else 1), result.output
    assert wired == [("/lib/libcuda.so.1", str(daemon))] and gpu.inventory.closed
    assert f"sharegpu gpu-check: GPU 0 NVIDIA H200 {H200.uuid}, driver 570.86.15, CUDA 12.8" in result.output
    for name in gpucheck.ORDER:
        assert re.search(rf"│ {name} +│ (all|0) +│ (PASS|FAIL) ", result.output), name
    body = json.loads(out.read_text())
    assert [c["result"] for c in body["checks"]] == ["PASS"] * 7 + ["PASS" if enforced else "FAIL"]
    assert body["gpu"]["cuda"] == "12.8"


def test_the_commands_help_shows_each_option() -> None:
    result = runner.invoke(cli.app, ["gpu-check", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())
    group = typer.main.get_command(cli.app)
    assert isinstance(group, typer.core.TyperGroup)
    for param in group.commands["gpu-check"].params:
        help_text = getattr(param, "help", None)
        if help_text and param.name != "help":
            assert " ".join(help_text.split()) in text, param.name
    for default in ("[default: 0]", "[default: nvidia-cuda-mps-control]", "[default: 6]", "[default: libcuda.so.1]"):
        assert default in text


def test_the_script_runs_the_command_from_the_repositorys_environment() -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert 'sharegpu" gpu-check "$@"' in text and "scripts/install" in text


async def test_a_gpu_without_per_process_samples_fails_that_check(gpu: FakeGpu, daemon: Path) -> None:
    gpu.inventory.sampled = False
    report = await gpucheck.check(parts(gpu, daemon), gpucheck.Options(seconds=5))
    (samples,) = [c for c in report.checks if c.name == gpucheck.SAMPLES]
    assert samples.result is Result.FAIL and samples.detail == "NVML gives no per-process samples on this GPU"
