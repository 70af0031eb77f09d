"""The peers' schedulers on the same cluster as sharegpu, one after the other in one run: the same fake
nodes (8 GPUs each) on the real control plane (1.37), the same sharing workload (pods of 100 to 500
milli-GPU), each system given what its own node component would have written.

- kube-scheduler alone: the same number of plain pods (no GPU), the baseline of what scheduling costs;
- sharegpu: kube-scheduler with the extender, sharing pods (reservation pods and hand-offs included);
- Koordinator: koord-scheduler v1.8.0 (built by scripts/build-peers from its Go module) with its
  DeviceShare plugin; each node gets the Device object koordlet would write and the node resources
  it would advertise (`koordinator.sh/gpu-core`, `gpu-memory`, `gpu-memory-ratio`); pods ask
  `koordinator.sh/gpu-core` and `koordinator.sh/gpu-memory-ratio` (the share, in percent); its CRDs
  are applied from the module, as its chart would;
- HAMi: not run: the module proxy serves no version of github.com/Project-HAMi/HAMi (`NOT_RUN`).

Per system: pods/s from the first creation to the last binding, p50 and p99 time from a pod's creation
to its binding, the CPU milliseconds per pod of the scheduling processes (kube-scheduler, and the
extender or koord-scheduler), and the fragmentation it leaves: of the GPUs its pods use, the share of
their capacity left unallocated (`unallocated_gpu_pct`; lower packs tighter), and how many GPUs.

    python bench/peers.py --nodes 1000 --pods 2000 [--json PATH]

Writes {"runs": [{"system", "pods_per_second", "p50_ms", "p99_ms", "cpu_ms_per_pod",
"unallocated_gpu_pct", "gpus_in_use"}], "not_run": {system: why}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

import e2e_throughput as e2e
from sharegpu.api import paths, pods, quantity, wire
from sharegpu.core import devices, units
from sharegpu.devcluster import stack
from sharegpu.kube import client

Json = dict[str, Any]
HERE = Path(__file__).resolve().parent
KOORD = "koord-scheduler"
KOORD_VERSION = "v1.8.0"
KOORD_CORE, KOORD_MEMORY, KOORD_RATIO = (
    "koordinator.sh/gpu-core",
    "koordinator.sh/gpu-memory",
    "koordinator.sh/gpu-memory-ratio",
)
KOORD_ALLOCATED = "scheduling.koordinator.sh/device-allocated"
"""The annotation koord-scheduler writes on a pod: the devices (by minor) and resources it got."""
NOT_RUN = {
    "hami": "the Go module proxy serves no version of github.com/Project-HAMi/HAMi: 403 'not available' for "
    "@latest, @v2.10.0, @v2.10.0+incompatible, /v2@v2.10.0, and the commits of v2.10.0 and v2.9.0 as pseudo-versions",
}
SHARES = [100, 200, 250, 300, 500]
GPUS, GPU_MEMORY_MIB = 8, 81920


def koord_pod(name: str, namespace: str, milli: int) -> Json:
    body = e2e.plain_pod(name, namespace)
    body["spec"]["schedulerName"] = KOORD
    percent = str(milli * 100 // units.MILLI_PER_GPU)
    limits = body["spec"]["containers"][0]["resources"]["limits"]
    limits.update({KOORD_CORE: percent, KOORD_RATIO: percent})
    body["spec"]["containers"][0]["resources"]["requests"] = dict(limits)
    return body


def koordinator_bin() -> Path:
    done = subprocess.run(
        ["bash", str(HERE.parent / "scripts" / "build-peers")], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"scripts/build-peers failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1]) / f"koordinator-{KOORD_VERSION}" / KOORD


def koordinator_crds() -> list[Json]:
    """Koordinator's CRDs, from its module in the Go module cache (as its chart installs them)."""
    cache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    folder = Path(cache) / "github.com" / "koordinator-sh" / f"koordinator@{KOORD_VERSION}" / "config" / "crd" / "bases"
    return [doc for path in sorted(folder.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


async def koordinator_nodes(kube: client.KubeClient, nodes: list[str], parallel: int = 32) -> None:
    """What koordlet writes for each node: its Device object and the GPU resources the node advertises."""
    limit = asyncio.Semaphore(parallel)
    per_gpu = {KOORD_CORE: "100", KOORD_MEMORY: f"{GPU_MEMORY_MIB}Mi", KOORD_RATIO: "100"}
    advertised = {KOORD_CORE: str(100 * GPUS), KOORD_MEMORY: f"{GPU_MEMORY_MIB * GPUS}Mi", KOORD_RATIO: str(100 * GPUS)}

    async def one(node: str) -> None:
        async with limit:
            spec = [{"type": "gpu", "minor": i, "id": f"GPU-{node}-{i}", "health": True, "resources": per_gpu}
                    for i in range(GPUS)]  # fmt: skip
            body = {"apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
                    "metadata": {"name": node}, "spec": {"devices": spec}}  # fmt: skip
            await kube.create("/apis/scheduling.koordinator.sh/v1alpha1/devices", body)
            status = {"status": {"capacity": advertised, "allocatable": advertised}}
            await kube.patch(f"{paths.node(node)}/status", status)

    await asyncio.gather(*(one(n) for n in nodes))


def koord_config(whole: stack.Stack) -> Path:
    """koord-scheduler's configuration: one profile with its DeviceShare plugin, and the Reservation
    plugin it relies on (DeviceShare asks it for reservations nominated for the pod), at the extension
    points Koordinator's own scheduler configuration enables them (config/manager/scheduler-config.yaml
    of its module); no leader election."""
    both = [{"name": "Reservation"}, {"name": "DeviceShare"}]
    plugins: dict[str, Json] = {
        "preFilter": {"enabled": both},
        "filter": {"enabled": both},
        "postFilter": {
            "disabled": [{"name": "*"}],
            "enabled": [{"name": "Reservation"}, {"name": "DefaultPreemption"}],
        },
        "preScore": {"enabled": [{"name": "Reservation"}]},
        "score": {"enabled": [{"name": "DeviceShare", "weight": 1}, {"name": "Reservation", "weight": 5000}]},
        "reserve": {"enabled": [{"name": "DeviceShare"}]},
        "preBind": {"enabled": [{"name": "DeviceShare"}, {"name": "Reservation"}]},
        "bind": {"disabled": [{"name": "*"}], "enabled": [{"name": "Reservation"}, {"name": "DefaultBinder"}]},
    }
    config = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(whole.plane.kubeconfig("admin")), "qps": 1000, "burst": 2000},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": KOORD, "plugins": plugins}],
    }
    path = whole.plane.workdir / "koord-scheduler-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def usage(kube: client.KubeClient, namespace: str, system: str) -> dict[tuple[str, int], int]:
    """milli-GPU allocated per (node, GPU) to the namespace's pods, as each system records it."""
    found, _ = await kube.list_of(paths.pods(namespace), wire.Pod)
    used: dict[tuple[str, int], int] = defaultdict(int)
    for pod in found:
        node = pod.spec.node_name
        if not node:
            continue
        if system == "sharegpu":
            record = pods.record(pod)
            if record.allocation is not None:
                for index, (milli, _) in record.allocation.gpu_usage().items():
                    used[(node, index)] += milli
        else:
            for entry in json.loads(pod.metadata.annotations.get(KOORD_ALLOCATED, "{}")).get("gpu", []):
                core = int(quantity.parse(str(entry["resources"].get(KOORD_CORE, "0"))))
                used[(node, int(entry["minor"]))] += core * units.MILLI_PER_GPU // 100
    return used


def fragmentation(used: dict[tuple[str, int], int]) -> tuple[float, int]:
    """Of the GPUs in use, the % of their capacity unallocated; and how many they are."""
    if not used:
        return 0.0, 0
    capacity = len(used) * units.MILLI_PER_GPU
    return round(100 * (capacity - sum(used.values())) / capacity, 2), len(used)


def scheduling_cpu(cpu: dict[str, float], *processes: str) -> float:
    return round(sum(cpu.get(p, 0.0) for p in processes), 2)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    koord_binary = koordinator_bin()
    with tempfile.TemporaryDirectory(prefix="sharegpu-peers-") as tmp:
        whole = stack.Stack(Path(tmp))
        await whole.start(harness=False)
        runs: list[Json] = []
        try:
            assert whole.harness is not None and whole.admin is not None
            nodes = [f"peer-{i:04d}" for i in range(args.nodes)]
            await whole.harness.add_nodes(
                [
                    devices.uniform_node(name, gpu_count=GPUS, model="A100", gpu_memory_mib=GPU_MEMORY_MIB,
                                         cpu_milli=128000, memory_mib=1 << 20, nvlink_all=True)
                    for name in nodes
                ],
                parallel=32,
            )  # fmt: skip
            for crd in koordinator_crds():
                await stack.apply(whole.admin, crd)
            await koordinator_nodes(whole.admin, nodes)
            whole.plane.start_scheduler(koord_config(whole), name=KOORD, binary=koord_binary)
            await asyncio.sleep(5)  # let every scheduler's and the extender's caches see every node
            rng = random.Random(3)
            plan = [rng.choice(SHARES) for _ in range(args.pods)]

            plain = await e2e.phase(whole, args, "kube-scheduler (plain pods):  ", "plain", e2e.plain_pod)
            runs.append({"system": "kube-scheduler", **figures(plain, ("kube-scheduler",)), "unallocated_gpu_pct": None,
                         "gpus_in_use": 0})  # fmt: skip
            shares = iter(plan)
            ours = await e2e.phase(whole, args, "sharegpu (sharing pods):      ", "sharegpu",
                                   lambda n, ns: e2e.sharing_pod(n, ns, next(shares)))  # fmt: skip
            left, gpus = fragmentation(await usage(whole.admin, "bench-sharegpu", "sharegpu"))
            runs.append({"system": "sharegpu", **figures(ours, ("kube-scheduler", "extender")),
                         "unallocated_gpu_pct": left, "gpus_in_use": gpus})  # fmt: skip
            shares = iter(plan)
            try:
                koord = await e2e.phase(whole, args, "koord-scheduler (DeviceShare):", "koordinator",
                                        lambda n, ns: koord_pod(n, ns, next(shares)))  # fmt: skip
            except SystemExit:
                print(f"koord-scheduler's log ends:\n{whole.plane.log(KOORD)[-5000:]}", file=sys.stderr)
                raise
            left, gpus = fragmentation(await usage(whole.admin, "bench-koordinator", "koordinator"))
            runs.append({"system": f"koordinator {KOORD_VERSION}", **figures(koord, (KOORD,)),
                         "unallocated_gpu_pct": left, "gpus_in_use": gpus})  # fmt: skip
        finally:
            await whole.stop()
    return {"runs": runs, "not_run": NOT_RUN}


def figures(found: e2e.Phase, processes: tuple[str, ...]) -> Json:
    return {
        "pods_per_second": round(found.rate, 2),
        "p50_ms": found.p50_ms,
        "p99_ms": found.p99_ms,
        "cpu_ms_per_pod": scheduling_cpu(found.cpu, *processes),
        "cpu_ms_per_pod_by_process": found.cpu,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.perf_counter()
    result = asyncio.run(run(args))
    print(f"{'system':<22} {'pods/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/pod':>11} {'unalloc %':>10} {'GPUs':>6}")
    for r in result["runs"]:
        left = "-" if r["unallocated_gpu_pct"] is None else f"{r['unallocated_gpu_pct']:.2f}"
        print(f"{r['system']:<22} {r['pods_per_second']:>8.1f} {r['p50_ms']:>8.0f} {r['p99_ms']:>8.0f} "
              f"{r['cpu_ms_per_pod']:>11.1f} {left:>10} {r['gpus_in_use']:>6}")  # fmt: skip
    for system, why in result["not_run"].items():
        print(f"{system}: not run: {why}")
    print(f"done in {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
