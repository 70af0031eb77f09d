"""What the agent asks of NVML, behind narrow Protocols, and the implementation on nvidia-ml-py.

Three roles, each its own Protocol, so a reader depends only on what it uses and the fake
(`agent.fakes.nvml`) can stand in for any of them:

- `Discovery`: the GPUs (UUID, index, minor number, model, memory, NUMA node, PCIe switch, MIG mode,
  architecture, CUDA compute capability, driver and CUDA driver versions, PCI bus ID and PCIe root)
  and the links between every pair (NVLink count, same PCIe switch, same NUMA node);
- `Health`: XID events and the GPUs NVML can no longer read;
- `Processes`: the processes running on each GPU, with the memory they use;
- `Utilisation`: how busy each GPU's SMs were lately, as a whole and per process (NVML's
  per-process samples: `nvmlDeviceGetProcessUtilization`, one sample per process that used the SMs
  since the last read; not taken on a GPU in MIG mode, where the call is not supported).

`Nvml` implements all three with nvidia-ml-py (its module is `pynvml`; the package of that name is
a different shim). The library is loaded on `open()`: a node without the driver gets
`NvmlUnavailableError` with a message saying so, never a traceback from ctypes.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sharegpu.core import errors


class NvmlUnavailableError(errors.SharegpuError):
    """No NVML here: no driver, no library, or no GPU."""


class XidWaitError(errors.SharegpuError):
    """NVML cannot wait for XID events now (events not supported here, the event set lost)."""


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str
    minor: int
    model: str
    memory_mib: int
    numa_node: int = 0
    pcie_switch: int | None = None
    """An identifier shared by the GPUs behind one PCIe switch; None if not known."""
    mig: bool = False
    architecture: str = ""
    """Its architecture's name ("Ampere", "Hopper"); empty if NVML cannot say."""
    compute_capability: str = ""
    """CUDA compute capability, "major.minor" ("8.0")."""
    driver_version: str = ""
    """The node's NVIDIA driver version ("550.54.15")."""
    cuda_driver_version: str = ""
    """The CUDA version the driver supports ("12.4")."""
    pci_bus_id: str = ""
    """Its PCI address as sysfs writes it ("0000:3b:00.0")."""
    pcie_root: str = ""
    """The PCIe root complex it hangs under ("pci0000:00"), from sysfs; empty if unknown."""


@dataclass(frozen=True, slots=True)
class Link:
    """How two GPUs (by index, a < b) are connected."""

    a: int
    b: int
    nvlinks: int = 0
    same_switch: bool = False
    same_numa: bool = False


@dataclass(frozen=True, slots=True)
class Xid:
    """An XID event: an error the driver reported for a GPU."""

    uuid: str
    code: int


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    uuid: str
    """The GPU it runs on."""
    used_mib: int


CRITICAL_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120})
"""XIDs after which a GPU is unhealthy until it is reset (double-bit ECC, fallen off the bus, NVLink
and GSP errors, uncontained ECC); others (a program's own fault, e.g. 13, 31, 43, 45) are not the
GPU's fault."""


class Discovery(Protocol):
    def gpus(self) -> list[Gpu]: ...

    def links(self) -> list[Link]: ...


class Health(Protocol):
    def xid_events(self, timeout_ms: int) -> list[Xid]:
        """The XID events since the last call, waiting up to `timeout_ms` for one; `XidWaitError`
        when they cannot be waited for (the caller tries again later)."""
        ...

    def unreadable(self) -> set[str]:
        """UUIDs of GPUs NVML reports errors for (lost, needs reset)."""
        ...


class Processes(Protocol):
    def running(self) -> list[GpuProcess]: ...


@dataclass(frozen=True, slots=True)
class Utilization:
    """One GPU's SM utilisation since the last read: the whole GPU's and each process's."""

    uuid: str
    sm_percent: int | None
    """The whole GPU's (None: NVML cannot say)."""
    processes: tuple[tuple[int, int], ...] | None
    """(pid, SM %) of each process that used the SMs, by pid; a process not named used none. None:
    this GPU takes no per-process samples (MIG mode, or the driver does not support them)."""


class Utilisation(Protocol):
    def utilization(self) -> list[Utilization]:
        """Each GPU's SM utilisation since the previous call (the first: over the driver's buffer)."""
        ...


class Nvml:
    """nvidia-ml-py behind `Discovery`, `Health`, `Processes` and `Utilisation` (one handle set,
    opened once)."""

    def __init__(self) -> None:
        self.lib: Any = None
        self.handles: list[Any] = []
        self.events: Any = None
        self.seen: dict[int, int] = {}
        """GPU index -> the newest per-process sample's timestamp read (microseconds)."""

    def open(self) -> Nvml:
        try:
            self.lib = importlib.import_module("pynvml")
        except ImportError as exc:
            raise NvmlUnavailableError(f"nvidia-ml-py is not installed ({exc})") from None
        try:
            self.lib.nvmlInit()
        except self.lib.NVMLError as exc:
            raise NvmlUnavailableError(
                f"NVML cannot be loaded here ({exc}): no NVIDIA driver on this node? (--fake-nvml FILE runs "
                "without one)"
            ) from None
        count = self.lib.nvmlDeviceGetCount()
        if count == 0:
            raise NvmlUnavailableError("NVML sees no GPU on this node")
        self.handles = [self.lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        return self

    def refresh(self) -> bool:
        """NVML answers live: nothing to take in between passes."""
        return False

    def close(self) -> None:
        if self.lib is not None:
            with contextlib.suppress(Exception):
                if self.events is not None:
                    self.lib.nvmlEventSetFree(self.events)
                self.lib.nvmlShutdown()

    # ----------------------------------------------------------------- Discovery

    def gpus(self) -> list[Gpu]:
        return [self._gpu(i, h) for i, h in enumerate(self.handles)]

    def _gpu(self, index: int, handle: Any) -> Gpu:
        lib = self.lib
        bus = _text(lib.nvmlDeviceGetPciInfo(handle).busId)
        mig = False
        with contextlib.suppress(lib.NVMLError):  # not supported before Ampere
            mig = lib.nvmlDeviceGetMigMode(handle)[0] == lib.NVML_DEVICE_MIG_ENABLE
        architecture = capability = driver = cuda = ""
        with contextlib.suppress(lib.NVMLError):
            architecture = _architectures(lib).get(int(lib.nvmlDeviceGetArchitecture(handle)), "")
        with contextlib.suppress(lib.NVMLError):
            major, minor = lib.nvmlDeviceGetCudaComputeCapability(handle)
            capability = f"{major}.{minor}"
        with contextlib.suppress(lib.NVMLError):
            driver = _text(lib.nvmlSystemGetDriverVersion())
        with contextlib.suppress(lib.NVMLError):
            version = int(lib.nvmlSystemGetCudaDriverVersion())  # 12040 is CUDA 12.4
            cuda = f"{version // 1000}.{version % 1000 // 10}"
        address = sysfs_address(bus)
        return Gpu(
            index=index,
            uuid=_text(lib.nvmlDeviceGetUUID(handle)),
            minor=int(lib.nvmlDeviceGetMinorNumber(handle)),
            model=_text(lib.nvmlDeviceGetName(handle)),
            memory_mib=int(lib.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20),
            numa_node=_numa_node(bus),
            pcie_switch=None,
            mig=mig,
            architecture=architecture,
            compute_capability=capability,
            driver_version=driver,
            cuda_driver_version=cuda,
            pci_bus_id=address,
            pcie_root=pcie_root(address),
        )

    def links(self) -> list[Link]:
        lib = self.lib
        buses = [_text(lib.nvmlDeviceGetPciInfo(h).busId).lower() for h in self.handles]
        nvlinks = [self._nvlink_peers(h, buses) for h in self.handles]
        out = []
        for a, ha in enumerate(self.handles):
            for b in range(a + 1, len(self.handles)):
                level = None
                with contextlib.suppress(lib.NVMLError):
                    level = lib.nvmlDeviceGetTopologyCommonAncestor(ha, self.handles[b])
                same_switch = level in (
                    lib.NVML_TOPOLOGY_INTERNAL,
                    lib.NVML_TOPOLOGY_SINGLE,
                    lib.NVML_TOPOLOGY_MULTIPLE,
                )
                same_numa = same_switch or level in (lib.NVML_TOPOLOGY_HOSTBRIDGE, lib.NVML_TOPOLOGY_NODE)
                out.append(Link(a, b, nvlinks[a].count(b), same_switch, same_numa))
        return out

    def _nvlink_peers(self, handle: Any, buses: Sequence[str]) -> list[int]:
        """The peer GPU of each active NVLink of a GPU (by index; links to switches or CPUs left out)."""
        lib = self.lib
        peers = []
        for link in range(lib.NVML_NVLINK_MAX_LINKS):
            try:
                if lib.nvmlDeviceGetNvLinkState(handle, link) != lib.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(lib.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower()
            except lib.NVMLError:
                continue
            if remote in buses:
                peers.append(buses.index(remote))
        return peers

    # ----------------------------------------------------------------- Health

    def xid_events(self, timeout_ms: int) -> list[Xid]:
        lib = self.lib
        if self.events is None:
            try:
                self.events = lib.nvmlEventSetCreate()
            except lib.NVMLError as exc:
                raise XidWaitError(f"NVML cannot create an event set: {exc}") from None
            for handle in self.handles:
                with contextlib.suppress(lib.NVMLError):  # not every GPU supports every event
                    lib.nvmlDeviceRegisterEvents(handle, lib.nvmlEventTypeXidCriticalError, self.events)
        found: list[Xid] = []
        wait = timeout_ms
        while True:
            try:
                data = lib.nvmlEventSetWait_v2(self.events, wait)
            except lib.NVMLError_Timeout:
                return found
            except lib.NVMLError as exc:
                if found:
                    return found  # these first; the error comes again at the next call
                with contextlib.suppress(lib.NVMLError):
                    lib.nvmlEventSetFree(self.events)
                self.events = None  # made again at the next call
                raise XidWaitError(f"NVML cannot wait for XID events: {exc}") from None
            wait = 0
            try:
                found.append(Xid(_text(lib.nvmlDeviceGetUUID(data.device)), int(data.eventData)))
            except lib.NVMLError:
                continue  # a GPU whose UUID cannot be read is lost: `unreadable` reports it

    def unreadable(self) -> set[str]:
        lib = self.lib
        lost = set()
        for handle in self.handles:
            try:
                lib.nvmlDeviceGetMemoryInfo(handle)
            except lib.NVMLError:
                with contextlib.suppress(lib.NVMLError):
                    lost.add(_text(lib.nvmlDeviceGetUUID(handle)))
        return lost

    # ----------------------------------------------------------------- Processes

    def running(self) -> list[GpuProcess]:
        lib = self.lib
        out = []
        for handle in self.handles:
            uuid = _text(lib.nvmlDeviceGetUUID(handle))
            with contextlib.suppress(lib.NVMLError):
                for proc in lib.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = proc.usedGpuMemory or 0  # None where the driver cannot say (e.g. in a VM)
                    out.append(GpuProcess(int(proc.pid), uuid, int(used) // (1 << 20)))
        return out

    # ----------------------------------------------------------------- Utilisation

    def utilization(self) -> list[Utilization]:
        lib = self.lib
        out = []
        for index, handle in enumerate(self.handles):
            uuid = _text(lib.nvmlDeviceGetUUID(handle))
            sm: int | None = None
            with contextlib.suppress(lib.NVMLError):
                sm = int(lib.nvmlDeviceGetUtilizationRates(handle).gpu)
            out.append(Utilization(uuid, sm, self._process_samples(index, handle)))
        return out

    def _process_samples(self, index: int, handle: Any) -> tuple[tuple[int, int], ...] | None:
        """Per process, its SM % over the samples since the last read (their mean, should NVML give
        several); None where NVML takes no per-process samples."""
        lib = self.lib
        try:
            samples = lib.nvmlDeviceGetProcessUtilization(handle, self.seen.get(index, 0))
        except lib.NVMLError as exc:
            if getattr(exc, "value", None) == lib.NVML_ERROR_NOT_FOUND:
                return ()  # no process used the SMs since the last read
            return None
        by_pid: dict[int, list[int]] = {}
        for sample in samples:
            by_pid.setdefault(int(sample.pid), []).append(int(sample.smUtil))
            self.seen[index] = max(self.seen.get(index, 0), int(sample.timeStamp))
        return tuple(sorted((pid, round(sum(v) / len(v))) for pid, v in by_pid.items()))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _architectures(lib: Any) -> dict[int, str]:
    """NVML's architecture numbers by name, from the library's own constants (NVML_DEVICE_ARCH_AMPERE...)."""
    prefix = "NVML_DEVICE_ARCH_"
    return {
        int(getattr(lib, name)): name.removeprefix(prefix).title()
        for name in dir(lib)
        if name.startswith(prefix) and name != f"{prefix}UNKNOWN"
    }


def sysfs_address(bus_id: str) -> str:
    """NVML's PCI bus ID ("00000000:3B:00.0") as sysfs and Kubernetes write it ("0000:3b:00.0")."""
    address = bus_id.lower()
    if len(address.split(":")[0]) == 8:  # NVML pads the domain to 8 digits, sysfs to 4
        address = address[4:]
    return address


def pcie_root(address: str, sys: Path = Path("/sys")) -> str:
    """The PCIe root complex of a PCI device ("pci0000:00"): the first step of its sysfs path under
    /sys/devices, as Kubernetes' standard `pcieRoot` attribute names it; empty if unknown."""
    if not address:
        return ""
    try:
        target = (sys / "bus" / "pci" / "devices" / address).resolve(strict=True)
    except OSError:
        return ""
    parts = target.relative_to(sys.resolve()).parts if target.is_relative_to(sys.resolve()) else ()
    if len(parts) < 3 or parts[0] != "devices" or not parts[1].startswith("pci") or parts[-1] != address:
        return ""
    return parts[1]


def _numa_node(bus_id: str) -> int:
    """The NUMA node of a PCI device, from sysfs (NVML's own call needs a newer driver); 0 if unknown."""
    address = sysfs_address(bus_id)
    try:
        value = int(Path(f"/sys/bus/pci/devices/{address}/numa_node").read_text().strip())
    except (OSError, ValueError):
        return 0
    return max(value, 0)
