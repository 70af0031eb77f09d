"""Workload and cluster files: the openb CSV format, read into domain values.

Node files: `sn,cpu_milli,memory_mib,gpu,model[,gpu_memory_mib]`. Pod files: `name,cpu_milli,
memory_mib,num_gpu,gpu_milli[,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time,
gpu_memory_mib,gpu_memory_permille,node]`. Any problem (missing file, missing column, a value that is
not a number or out of range) raises InvalidTraceError with the file, line and column, so the CLI can
print it on one line. `write_nodes` and `write_pods` write the same format (`kubectl sharegpu
snapshot`).

The columns after openb's own are sharegpu's: a node's GPU memory (MiB per GPU), a pod's GPU memory
per GPU (MiB, or per mille of the GPU's), and the node a pod is bound to in a snapshot (what the
cluster holds now; the simulator places every pod itself). openb GPU models carry no memory size;
where a file does not give it, `MODEL_MEMORY_MIB` gives each model a plausible one (only memory
requests, which openb pods do not make, depend on it). The trace has no interconnect topology, so
its nodes get none (PCIe switch per GPU pair, two NUMA halves, no NVLink).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sharegpu.core import devices, errors, frag, requests, units

MODEL_MEMORY_MIB: dict[str, int] = {
    "P100": 16 * 1024,
    "T4": 16 * 1024,
    "V100M16": 16 * 1024,
    "V100M32": 32 * 1024,
    "A10": 24 * 1024,
    "G2": 32 * 1024,
    "G3": 32 * 1024,
    "A100": 80 * 1024,
    "H100": 80 * 1024,
    "L4": 24 * 1024,
}
DEFAULT_GPU_MEMORY_MIB = 16 * 1024

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
OPENB_POD_COLUMNS = (*POD_COLUMNS, "gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")
NODE_EXTRA = ("gpu_memory_mib",)
POD_EXTRA = ("gpu_memory_mib", "gpu_memory_permille", "node")
NODE_FILE = "openb_node_list_gpu_node.csv"
"""The node file's name, as openb names it."""


OPENB_TRACES = (
    "default", "gpushare20", "gpushare40", "gpushare60", "gpushare80", "multigpu20", "multigpu30",
    "gpuspec05", "gpuspec10", "gpuspec20", "cpu0", "cpu050", "cpu100", "cpu200",
)  # fmt: skip
"""openb's fourteen pod lists, by the names `pod_file` takes."""


def pod_file(name: str) -> str:
    """A pod file's name, as openb names them (the trace's name is what follows the prefix)."""
    return f"openb_pod_list_{name}.csv"


@dataclass(frozen=True, slots=True)
class TraceNode:
    """One row of a node file."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str
    gpu_memory_mib: int | None = None
    """MiB per GPU; None: the model's plausible size (`MODEL_MEMORY_MIB`)."""


@dataclass(frozen=True, slots=True)
class TracePod:
    """One row of a pod trace."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    models: frozenset[str] = frozenset()
    creation_time: int | None = None
    deletion_time: int | None = None
    gpu_memory_mib: int = 0
    """GPU memory per GPU, MiB (0: none asked; never with whole GPUs)."""
    gpu_memory_permille: int = 0
    """GPU memory per GPU as per mille of the GPU's (0: none asked)."""
    phase: str = ""
    node: str | None = None
    """The node it is bound to in a snapshot (None: pending, or not said)."""

    @property
    def gpu_milli_total(self) -> int:
        return self.num_gpu * self.gpu_milli if self.num_gpu else 0

    @property
    def shape(self) -> frag.Shape:
        milli = self.gpu_milli if self.num_gpu else 0
        return frag.Shape(self.cpu_milli, milli, self.num_gpu, tuple(sorted(self.models)))

    def request(self, key: str | None = None) -> requests.PodRequest:
        return requests.simple_pod(
            key or self.name,
            count=self.num_gpu,
            milli=self.gpu_milli if self.num_gpu else units.MILLI_PER_GPU,
            models=self.models,
            cpu_milli=self.cpu_milli,
            host_memory_mib=self.memory_mib,
            memory_mib=self.gpu_memory_mib,
            memory_permille=self.gpu_memory_permille,
        )


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    pods: tuple[TracePod, ...]
    snapshot: bool = False
    """Its file has the `node` column: a snapshot of a cluster, saying where each pod is now."""

    @property
    def timed(self) -> bool:
        return all(p.creation_time is not None and p.deletion_time is not None for p in self.pods)

    def typical_shapes(self, coverage: float = 0.95) -> tuple[frag.WeightedShape, ...]:
        return frag.typical_shapes((p.shape for p in self.pods), coverage)


def _rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    if not path.is_file():
        raise errors.InvalidTraceError(f"{path}: no such file")
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise errors.InvalidTraceError(f"{path}: cannot open ({exc.strerror})") from None
    with handle:
        try:
            reader = csv.DictReader(handle)
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise errors.InvalidTraceError(
                    f"{path}: missing column(s) {', '.join(missing)} (header: {','.join(header)})"
                )
            for line, row in enumerate(reader, start=2):
                if None in row or any(v is None for v in row.values()):
                    raise errors.InvalidTraceError(f"{path}:{line}: wrong number of fields")
                yield line, row
        except UnicodeDecodeError:
            raise errors.InvalidTraceError(f"{path}: not UTF-8 text") from None
        except csv.Error as exc:
            raise errors.InvalidTraceError(f"{path}: malformed CSV ({exc})") from None


def _int(path: Path, line: int, row: dict[str, str], column: str, low: int, high: int) -> int:
    text = row[column].strip()
    try:
        value = int(text)
    except ValueError:
        raise errors.InvalidTraceError(f"{path}:{line}: column {column} must be an integer, got {text!r}") from None
    if not low <= value <= high:
        raise errors.InvalidTraceError(f"{path}:{line}: column {column} must be in {low}..{high}, got {value}")
    return value


def _optional_int(path: Path, line: int, row: dict[str, str], column: str) -> int | None:
    if column not in row or not row[column].strip():
        return None
    return _int(path, line, row, column, 0, 1 << 62)


def load_nodes(path: Path, *, gpu_only: bool = True) -> list[devices.NodeInventory]:
    """Nodes of an openb node file; CPU-only nodes are dropped unless `gpu_only` is False."""
    nodes = []
    seen: set[str] = set()
    for line, row in _rows(path, NODE_COLUMNS):
        name = row["sn"].strip()
        if not name:
            raise errors.InvalidTraceError(f"{path}:{line}: column sn (node name) is empty")
        if name in seen:
            raise errors.InvalidTraceError(f"{path}:{line}: node {name} appears twice")
        seen.add(name)
        cpu = _int(path, line, row, "cpu_milli", 0, 1 << 40)
        memory = _int(path, line, row, "memory_mib", 0, 1 << 40)
        gpus = _int(path, line, row, "gpu", 0, units.MAX_GPUS_PER_NODE)
        gpu_memory = _optional_int(path, line, row, "gpu_memory_mib")
        model = row["model"].strip()
        if gpus and not model:
            raise errors.InvalidTraceError(f"{path}:{line}: node {name} has {gpus} GPU(s) but no model")
        if not gpus and gpu_only:
            continue
        nodes.append(
            devices.uniform_node(
                name,
                gpu_count=gpus,
                model=model or "none",
                gpu_memory_mib=gpu_memory or MODEL_MEMORY_MIB.get(model, DEFAULT_GPU_MEMORY_MIB),
                cpu_milli=cpu,
                memory_mib=memory,
            )
        )
    if not nodes:
        raise errors.InvalidTraceError(f"{path}: no GPU nodes in the file")
    return nodes


def load_pods(path: Path) -> Trace:
    pods = []
    snapshot = False
    for line, row in _rows(path, POD_COLUMNS):
        snapshot = "node" in row
        name = row["name"].strip() or f"line-{line}"
        num_gpu = _int(path, line, row, "num_gpu", 0, units.MAX_GPUS_PER_NODE)
        milli = _int(path, line, row, "gpu_milli", 0, units.MILLI_PER_GPU)
        if num_gpu and milli == 0:
            raise errors.InvalidTraceError(f"{path}:{line}: num_gpu is {num_gpu} but gpu_milli is 0")
        if num_gpu > 1 and milli < units.MILLI_PER_GPU:
            raise errors.InvalidTraceError(
                f"{path}:{line}: a pod with {num_gpu} GPUs must take whole GPUs (gpu_milli 1000), got {milli}"
            )
        spec = (row.get("gpu_spec") or "").strip()
        models = frozenset(m for m in spec.split("|") if m) if spec else frozenset()
        memory = _optional_int(path, line, row, "gpu_memory_mib") or 0
        permille = _optional_int(path, line, row, "gpu_memory_permille") or 0
        if permille > units.PERMILLE:
            raise errors.InvalidTraceError(
                f"{path}:{line}: column gpu_memory_permille must be in 0..1000, got {permille}"
            )
        if (memory or permille) and (not num_gpu or milli == units.MILLI_PER_GPU):
            raise errors.InvalidTraceError(
                f"{path}:{line}: GPU memory is asked only with a share of a GPU (whole GPUs get all of theirs)"
            )
        if memory and permille:
            raise errors.InvalidTraceError(f"{path}:{line}: give gpu_memory_mib or gpu_memory_permille, not both")
        pods.append(
            TracePod(
                name=name,
                cpu_milli=_int(path, line, row, "cpu_milli", 0, 1 << 40),
                memory_mib=_int(path, line, row, "memory_mib", 0, 1 << 40),
                num_gpu=num_gpu,
                gpu_milli=milli if num_gpu else 0,
                models=models,
                creation_time=_optional_int(path, line, row, "creation_time"),
                deletion_time=_optional_int(path, line, row, "deletion_time"),
                gpu_memory_mib=memory,
                gpu_memory_permille=permille,
                phase=(row.get("pod_phase") or "").strip(),
                node=(row.get("node") or "").strip() or None,
            )
        )
    if not pods:
        raise errors.InvalidTraceError(f"{path}: no pods in the file")
    return Trace(name=_trace_name(path), pods=tuple(pods), snapshot=snapshot)


def _trace_name(path: Path) -> str:
    stem = path.stem
    return stem.removeprefix("openb_pod_list_") if stem.startswith("openb_pod_list_") else stem


def write_nodes(path: Path, nodes: Sequence[TraceNode]) -> None:
    """A node file `load_nodes` reads (openb's columns, then sharegpu's)."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        out = csv.writer(handle, lineterminator="\n")
        out.writerow((*NODE_COLUMNS, *NODE_EXTRA))
        for node in nodes:
            memory = "" if node.gpu_memory_mib is None else node.gpu_memory_mib
            out.writerow((node.name, node.cpu_milli, node.memory_mib, node.gpus, node.model, memory))


def write_pods(path: Path, pods: Sequence[TracePod]) -> None:
    """A pod file `load_pods` reads (openb's columns, then sharegpu's)."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        out = csv.writer(handle, lineterminator="\n")
        out.writerow((*OPENB_POD_COLUMNS, *POD_EXTRA))
        for pod in pods:
            out.writerow((
                pod.name, pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, "|".join(sorted(pod.models)),
                "", pod.phase, _blank(pod.creation_time), _blank(pod.deletion_time), "",
                pod.gpu_memory_mib or "", pod.gpu_memory_permille or "", pod.node or "",
            ))  # fmt: skip


def _blank(value: int | None) -> str | int:
    return "" if value is None else value
