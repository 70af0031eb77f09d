"""The embedded default workload: a synthetic cluster and pod trace generated in code.

`sharegpu simulate` with no files replays this. It is not the openb trace (that is research data
we do not ship); its mix is calibrated on openb's published facts and on what GPU-sharing clusters
run today:

Cluster (64 nodes, 280 GPUs):
  - 12 x 8 A100 (80 GiB, all-to-all NVLink), 96 cores, 1 TiB
  - 20 x 4 V100M32 (32 GiB, NVLink pairs 0-1 and 2-3), 48 cores, 384 GiB
  - 24 x 2 T4 (16 GiB), 32 cores, 192 GiB
  - 8 x 1 A10 (24 GiB), 16 cores, 128 GiB

Pods (2400 by default), by share of pods:
  - 12% CPU-only (2-16 cores)
  - 45% sharing one GPU: compute 100..900 milli (popular: 250, 500, 300, 100, 200, 750)
  - 33% one whole GPU
  - 10% multi-GPU: 2 (6%), 4 (3%), 8 (1%) whole GPUs
  - 15% of GPU pods restricted to one or two GPU models
  Host CPU and memory grow with the GPU share. Arrivals are a Poisson process (one pod every 12 s
  on average, offering about 95% of the GPUs); run times are log-normal (median 40 min, long
  tail), so the dynamic mode sees queueing at peaks.

Deterministic: the same seed gives the same cluster and trace.
"""

from __future__ import annotations

import numpy as np

from sharegpu.core import devices, units
from sharegpu.sim import trace

_SHARES = np.array([100, 200, 250, 300, 400, 500, 600, 750, 900])
_SHARE_WEIGHTS = np.array([0.12, 0.10, 0.22, 0.13, 0.05, 0.22, 0.05, 0.08, 0.03])
_MODELS = ("A100", "V100M32", "T4", "A10")


def cluster() -> list[devices.NodeInventory]:
    nodes: list[devices.NodeInventory] = []
    layout = (
        ("a100", 12, 8, "A100", 80 * 1024, 96_000, 1024 * 1024, "all"),
        ("v100", 20, 4, "V100M32", 32 * 1024, 48_000, 384 * 1024, "pairs"),
        ("t4", 24, 2, "T4", 16 * 1024, 32_000, 192 * 1024, "none"),
        ("a10", 8, 1, "A10", 24 * 1024, 16_000, 128 * 1024, "none"),
    )
    for prefix, count, gpus, model, gmem, cpu, mem, links in layout:
        for i in range(count):
            node = devices.uniform_node(
                f"{prefix}-{i:02d}",
                gpu_count=gpus,
                model=model,
                gpu_memory_mib=gmem,
                cpu_milli=cpu,
                memory_mib=mem,
                nvlink_all=links == "all",
            )
            if links == "pairs":
                node = devices.NodeInventory(
                    name=node.name,
                    cpu_milli=node.cpu_milli,
                    memory_mib=node.memory_mib,
                    gpus=node.gpus,
                    nvlinks=frozenset({(0, 1), (2, 3)}),
                )
            nodes.append(node)
    return nodes


def workload(seed: int = 0, pods: int = 2400) -> trace.Trace:
    rng = np.random.default_rng(seed)
    kinds = rng.choice(6, size=pods, p=[0.12, 0.45, 0.33, 0.06, 0.03, 0.01])
    gaps = rng.exponential(12.0, size=pods)
    created = np.cumsum(gaps).astype(np.int64)
    durations = np.clip(rng.lognormal(np.log(2400.0), 1.0, size=pods), 60, 7 * 24 * 3600).astype(np.int64)
    out: list[trace.TracePod] = []
    for i in range(pods):
        kind = int(kinds[i])
        if kind == 0:
            num_gpu, milli = 0, 0
            cpu = int(rng.choice([2000, 4000, 8000, 16000]))
        elif kind == 1:
            num_gpu, milli = 1, int(rng.choice(_SHARES, p=_SHARE_WEIGHTS))
            cpu = max(1000, milli * 8)
        else:
            num_gpu, milli = (1, 2, 4, 8)[kind - 2], units.MILLI_PER_GPU
            cpu = 8000 * num_gpu
        memory = cpu * 4
        models: frozenset[str] = frozenset()
        if num_gpu and rng.random() < 0.15:
            allowed = [m for m in _MODELS if num_gpu <= {"A100": 8, "V100M32": 4, "T4": 2, "A10": 1}[m]]
            models = frozenset(rng.choice(allowed, size=min(len(allowed), int(rng.integers(1, 3))), replace=False))
        out.append(
            trace.TracePod(
                name=f"synth-{i:05d}",
                cpu_milli=cpu,
                memory_mib=memory,
                num_gpu=num_gpu,
                gpu_milli=milli,
                models=models,
                creation_time=int(created[i]),
                deletion_time=int(created[i] + durations[i]),
            )
        )
    return trace.Trace(name="synthetic", pods=tuple(out))
