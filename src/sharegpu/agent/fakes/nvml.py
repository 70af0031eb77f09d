"""A fake NVML, configured from a file and re-read when the file changes: GPUs, topology, processes,
injected faults and XID events, for nodes (and tests) without a GPU. It implements the same roles
as `agent.nvml.Nvml` (`Discovery`, `Health`, `Processes`, `Utilisation`), so the agent runs unchanged
on it. A GPU's SM utilisation is the sum of its processes' (at most 100).

The file (YAML or JSON; docs/agent.md shows a full one):

    gpus:                       # in index order
      - uuid: GPU-0a1b...       # required, unique
        model: NVIDIA A100-SXM4-80GB
        memoryMiB: 81920
        minor: 0                # default: the index
        numaNode: 0
        pcieSwitch: 0           # GPUs with the same value share a PCIe switch; absent: none
        mig: false
        architecture: Ampere    # default: the model's (a table of common models), else none
        computeCapability: "8.0"
        pciBusId: 0000:07:00.0  # default: 0000:<index + 1>:00.0
        pcieRoot: pci0000:00    # default: pci0000:<8 GPUs a root>
    driverVersion: 550.54.15    # the node's driver
    cudaDriverVersion: "12.4"
    nvlinks: [{a: 0, b: 1, count: 12}]
    processes: [{pid: 4242, gpu: 0, usedMiB: 2048, smPercent: 35}]   # smPercent: its SM use, default 0
    faults:
      library: false            # true: NVML cannot be loaded at all (open() fails)
      unreadable: [1]           # indexes of GPUs NVML reports errors for
      noProcessSamples: [2]     # GPUs that take no per-process samples (as a MIG GPU: `mig: true`)
      xidWait: false            # true: XID events cannot be waited for (xid_events raises)
    xids: [{gpu: 1, code: 79}]  # each delivered once, in order; append to inject more

A malformed file is refused with the field that is wrong (`FakeNvmlError`); a change that breaks a
file the agent already runs on keeps the last good configuration and logs why.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import msgspec
import yaml
from msgspec import Meta

from sharegpu.agent import nvml
from sharegpu.core import devices, errors

log = logging.getLogger(__name__)


class FakeNvmlError(errors.InvalidInputError):
    """The fake NVML's file is unreadable or malformed."""


class _Message(msgspec.Struct, rename="camel", kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class FakeGpu(_Message, kw_only=True, frozen=True):
    uuid: Annotated[str, Meta(min_length=1)]
    model: Annotated[str, Meta(min_length=1)] = "NVIDIA A100-SXM4-80GB"
    memory_mib: Annotated[int, Meta(ge=1)] = msgspec.field(default=81920, name="memoryMiB")
    minor: Annotated[int, Meta(ge=0)] | None = None
    numa_node: Annotated[int, Meta(ge=0)] = 0
    pcie_switch: Annotated[int, Meta(ge=0)] | None = None
    mig: bool = False
    architecture: str | None = None
    compute_capability: Annotated[str, Meta(pattern=r"^[0-9]+\.[0-9]+$")] | None = None
    pci_bus_id: Annotated[str, Meta(pattern=r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")] | None = None
    pcie_root: Annotated[str, Meta(pattern=r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")] | None = None


_MODELS: dict[str, tuple[str, str]] = {
    "B200": ("Blackwell", "10.0"), "H200": ("Hopper", "9.0"), "H100": ("Hopper", "9.0"), "H800": ("Hopper", "9.0"),
    "H20": ("Hopper", "9.0"), "L40": ("Ada", "8.9"), "L4": ("Ada", "8.9"), "A100": ("Ampere", "8.0"),
    "A800": ("Ampere", "8.0"), "A30": ("Ampere", "8.0"), "A10": ("Ampere", "8.6"), "T4": ("Turing", "7.5"),
    "V100": ("Volta", "7.0"), "P100": ("Pascal", "6.0"),
}  # fmt: skip
"""What a fake GPU of a model reports when its file does not say (the first name found in the model)."""


def _known(model: str) -> tuple[str, str]:
    return next((found for name, found in _MODELS.items() if name in model), ("", ""))


class FakeLink(_Message, kw_only=True, frozen=True):
    a: Annotated[int, Meta(ge=0)]
    b: Annotated[int, Meta(ge=0)]
    count: Annotated[int, Meta(ge=1, le=18)] = 1


class FakeProcess(_Message, kw_only=True, frozen=True):
    pid: Annotated[int, Meta(ge=1)]
    gpu: Annotated[int, Meta(ge=0)]
    used_mib: Annotated[int, Meta(ge=0)] = msgspec.field(default=0, name="usedMiB")
    sm_percent: Annotated[int, Meta(ge=0, le=100)] = 0


class Faults(_Message, kw_only=True, frozen=True):
    library: bool = False
    unreadable: list[int] = []
    no_process_samples: list[int] = []
    xid_wait: bool = False


class FakeXid(_Message, kw_only=True, frozen=True):
    gpu: Annotated[int, Meta(ge=0)]
    code: Annotated[int, Meta(ge=1)]


class FakeConfig(_Message, kw_only=True, frozen=True):
    driver_version: str = "550.54.15"
    cuda_driver_version: str = "12.4"
    gpus: list[FakeGpu] = []
    nvlinks: list[FakeLink] = []
    processes: list[FakeProcess] = []
    faults: Faults = msgspec.field(default_factory=Faults)
    xids: list[FakeXid] = []


def describe(node: devices.NodeInventory) -> str:
    """The fake NVML file of a node's inventory (its GPUs in index order, its NVLinks): what
    `sharegpu devcluster` gives each fake node's agent."""
    text: str = yaml.safe_dump(msgspec.to_builtins(configured(node)), sort_keys=False)
    return text


def configured(node: devices.NodeInventory) -> FakeConfig:
    """`describe`'s configuration, unwritten."""
    return FakeConfig(
        gpus=[
            FakeGpu(uuid=g.uuid, model=g.model, memory_mib=g.memory_mib, numa_node=g.numa_node,
                    pcie_switch=g.pcie_switch)
            for g in node.gpus
        ],
        nvlinks=[FakeLink(a=a, b=b, count=1) for a, b in sorted(node.nvlinks)],
    )  # fmt: skip


def parse(text: str, source: str = "the fake NVML file") -> FakeConfig:
    """The configuration in `text`; FakeNvmlError naming what is wrong."""
    try:
        raw = yaml.safe_load(text) or {}
        config = msgspec.convert(raw, FakeConfig)
    except yaml.YAMLError as exc:
        raise FakeNvmlError(f"{source}: not YAML: {exc}") from None
    except msgspec.ValidationError as exc:
        raise FakeNvmlError(f"{source}: {exc}") from None
    count = len(config.gpus)
    uuids = [g.uuid for g in config.gpus]
    if len(set(uuids)) != count:
        raise FakeNvmlError(f"{source}: GPU UUIDs must be unique")
    checks = [
        *((f"nvlinks[{i}]", (link.a, link.b)) for i, link in enumerate(config.nvlinks)),
        *((f"processes[{i}]", (p.gpu,)) for i, p in enumerate(config.processes)),
        *((f"xids[{i}]", (x.gpu,)) for i, x in enumerate(config.xids)),
        *((f"faults.unreadable[{i}]", (g,)) for i, g in enumerate(config.faults.unreadable)),
        *((f"faults.noProcessSamples[{i}]", (g,)) for i, g in enumerate(config.faults.no_process_samples)),
    ]
    for where, indexes in checks:
        wrong = [i for i in indexes if i >= count]
        if wrong:
            raise FakeNvmlError(f"{source}: {where} names GPU {wrong[0]}, but there are {count} GPU(s)")
    for i, link in enumerate(config.nvlinks):
        if link.a == link.b:
            raise FakeNvmlError(f"{source}: nvlinks[{i}] links GPU {link.a} to itself")
    return config


def reported(config: FakeConfig) -> list[nvml.Gpu]:
    """The GPUs a fake NVML with `config` reports (what the file says, the rest from its defaults)."""
    out = []
    for i, g in enumerate(config.gpus):
        architecture, capability = _known(g.model)
        out.append(
            nvml.Gpu(
                index=i, uuid=g.uuid, minor=g.minor if g.minor is not None else i, model=g.model,
                memory_mib=g.memory_mib, numa_node=g.numa_node, pcie_switch=g.pcie_switch, mig=g.mig,
                architecture=g.architecture if g.architecture is not None else architecture,
                compute_capability=g.compute_capability if g.compute_capability is not None else capability,
                driver_version=config.driver_version, cuda_driver_version=config.cuda_driver_version,
                pci_bus_id=g.pci_bus_id or f"0000:{i + 1:02x}:00.0",
                pcie_root=g.pcie_root or f"pci0000:{i // 8:02x}",
            )
        )  # fmt: skip
    return out


class FakeNvml:
    """`Discovery`, `Health`, `Processes` and `Utilisation` from a file, re-read when its modification
    time changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = FakeConfig()
        self.stamp: float | None = None
        self.delivered = 0
        """How many of the file's XIDs were handed out."""

    def open(self) -> FakeNvml:
        self.config = self._read()
        if self.config.faults.library:
            raise nvml.NvmlUnavailableError(f"NVML cannot be loaded here (fault injected by {self.path})")
        if not self.config.gpus:
            raise nvml.NvmlUnavailableError(f"NVML sees no GPU on this node ({self.path} lists none)")
        return self

    def close(self) -> None:
        """Nothing to release."""

    def _read(self) -> FakeConfig:
        try:
            stamp = self.path.stat().st_mtime_ns
            text = self.path.read_text()
        except OSError as exc:
            raise FakeNvmlError(f"cannot read the fake NVML file {self.path}: {exc.strerror}") from None
        self.stamp = stamp
        return parse(text, str(self.path))

    def refresh(self) -> bool:
        """Re-read the file if it changed; True if the configuration changed. A broken change keeps
        the last good configuration."""
        try:
            stamp = self.path.stat().st_mtime_ns
        except OSError:
            return False
        if stamp == self.stamp:
            return False
        try:
            fresh = self._read()
        except FakeNvmlError as exc:
            log.warning("%s; keeping the previous configuration", exc)
            return False
        changed = fresh != self.config
        self.delivered = min(self.delivered, len(fresh.xids))  # a shorter list: new entries from its end
        self.config = fresh
        return changed

    # ----------------------------------------------------------------- Discovery

    def gpus(self) -> list[nvml.Gpu]:
        return reported(self.config)

    def links(self) -> list[nvml.Link]:
        gpus = self.config.gpus
        counts: dict[tuple[int, int], int] = {}
        for link in self.config.nvlinks:
            pair = (min(link.a, link.b), max(link.a, link.b))
            counts[pair] = counts.get(pair, 0) + link.count
        out = []
        for a in range(len(gpus)):
            for b in range(a + 1, len(gpus)):
                switch = gpus[a].pcie_switch
                same_switch = switch is not None and switch == gpus[b].pcie_switch
                same_numa = gpus[a].numa_node == gpus[b].numa_node
                out.append(nvml.Link(a, b, counts.get((a, b), 0), same_switch, same_numa))
        return out

    # ----------------------------------------------------------------- Health

    def xid_events(self, timeout_ms: int) -> list[nvml.Xid]:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            self.refresh()
            if self.config.faults.xid_wait:
                raise nvml.XidWaitError(f"XID events cannot be waited for (fault injected by {self.path})")
            pending = self.config.xids[self.delivered :]
            if pending or time.monotonic() >= deadline:
                self.delivered += len(pending)
                return [nvml.Xid(self.config.gpus[x.gpu].uuid, x.code) for x in pending]
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def unreadable(self) -> set[str]:
        return {self.config.gpus[i].uuid for i in self.config.faults.unreadable}

    # ----------------------------------------------------------------- Processes

    def running(self) -> list[nvml.GpuProcess]:
        return [nvml.GpuProcess(p.pid, self.config.gpus[p.gpu].uuid, p.used_mib) for p in self.config.processes]

    # ----------------------------------------------------------------- Utilisation

    def utilization(self) -> list[nvml.Utilization]:
        config = self.config
        out = []
        for index, gpu in enumerate(config.gpus):
            mine = sorted((p.pid, p.sm_percent) for p in config.processes if p.gpu == index)
            sampled = not gpu.mig and index not in config.faults.no_process_samples
            per_process = tuple((pid, sm) for pid, sm in mine if sm > 0) if sampled else None
            out.append(nvml.Utilization(gpu.uuid, min(100, sum(sm for _, sm in mine)), per_process))
        return out
