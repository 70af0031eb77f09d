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
- HAMi: its scheduler extender v2.10.0 (built by scripts/build-peers from a clone of HAMi's repository
  named by HAMI_SRC, since the module proxy serves no version of it; its dependencies through the proxy)
  behind a kube-scheduler configured as HAMi's chart configures it (filter and bind by the extender,
  its resources ignored by kube-scheduler); each node gets the registration annotation HAMi's device
  plugin writes (8 GPUs, each split 10 ways) and advertises `nvidia.com/gpu` 80; pods ask one
  `nvidia.com/gpu` with `nvidia.com/gpucores` and `nvidia.com/gpumem-percentage` (the share, in
  percent). HAMi binds a pod only while it holds a lock on the node, which its device plugin releases
  when the kubelet asks it for the pod's devices; no kubelet runs here, so the benchmark does that
  device plugin's part at once (phase `success`, lock released), the fastest a node could. HAMi's chart
  leaves its API client at client-go's 5 requests/s (burst 10); it is given kube-scheduler's 500
  (burst 1000) instead, else, at about nine requests per pod, it could bind about half a pod a second.
  Without HAMI_SRC it is not run (`not_run` says why).

Per system: pods/s from the first creation to the last binding, p50 and p99 time from a pod's creation
to its binding, the CPU milliseconds per pod of the scheduling processes (kube-scheduler, and the
extender or koord-scheduler), and the fragmentation it leaves: of the GPUs its pods use, the share of
their capacity left unallocated (`unallocated_gpu_pct`; lower packs tighter), and how many GPUs.

    HAMI_SRC=/path/to/HAMi python bench/peers.py --nodes 1000 --pods 2000 [--json PATH]

Writes {"runs": [{"system", "pods_per_second", "p50_ms", "p99_ms", "cpu_ms_per_pod",
"unallocated_gpu_pct", "gpus_in_use"}], "not_run": {system: why}}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

import e2e_throughput as e2e
from sharegpu.api import paths, pods, quantity, wire
from sharegpu.core import devices, units
from sharegpu.devcluster import stack
from sharegpu.devcluster.controlplane import free_port
from sharegpu.kube import client, informer
from sharegpu.kube import errors as kube_errors

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
HAMI = "hami-scheduler"
HAMI_VERSION = "v2.10.0"
HAMI_GPU, HAMI_CORES, HAMI_MEMORY_PCT = "nvidia.com/gpu", "nvidia.com/gpucores", "nvidia.com/gpumem-percentage"
HAMI_RESOURCES = (HAMI_GPU, "nvidia.com/gpumem", HAMI_CORES, HAMI_MEMORY_PCT, "nvidia.com/priority")
HAMI_REGISTER = "hami.io/node-nvidia-register"
"""The node annotation HAMi's device plugin writes: a JSON list of the node's GPUs."""
HAMI_ALLOCATED = "hami.io/vgpu-devices-allocated"
"""What HAMi's extender writes on a pod: per container `UUID,type,MiB,cores:` per GPU, containers `;`."""
HAMI_PHASE, HAMI_LOCK = "hami.io/bind-phase", "hami.io/mutex.lock"
HAMI_SPLIT = 10
"""deviceSplitCount in HAMi's chart: at most 10 pods on one GPU."""
HAMI_NOT_BUILT = (
    "HAMI_SRC names no clone of HAMi v2.10.0 (git clone --branch v2.10.0 https://github.com/Project-HAMi/HAMi): "
    "the Go module proxy serves no version of github.com/Project-HAMi/HAMi (403 'not available' for @latest, "
    "@v2.10.0, @v2.10.0+incompatible, /v2@v2.10.0, and the commits of v2.10.0 and v2.9.0 as pseudo-versions)"
)
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


def peers_folder() -> Path:
    """Where scripts/build-peers left the peers' schedulers (it builds what is missing)."""
    done = subprocess.run(
        ["bash", str(HERE.parent / "scripts" / "build-peers")], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"scripts/build-peers failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


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


def hami_pod(name: str, namespace: str, milli: int) -> Json:
    body = e2e.plain_pod(name, namespace)
    body["spec"]["schedulerName"] = HAMI
    percent = str(milli * 100 // units.MILLI_PER_GPU)
    body["spec"]["containers"][0]["resources"]["limits"].update(
        {HAMI_GPU: "1", HAMI_CORES: percent, HAMI_MEMORY_PCT: percent}
    )
    return body


def hami_uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


async def hami_nodes(kube: client.KubeClient, nodes: list[str], parallel: int = 32) -> None:
    """What HAMi's device plugin writes for each node: the registration annotation (ids, 10 slots,
    memory, 100 cores, model, health) and `nvidia.com/gpu` advertised as GPUs x slots."""
    limit = asyncio.Semaphore(parallel)

    async def one(node: str) -> None:
        gpus = [{"id": hami_uuid(node, i), "index": i, "count": HAMI_SPLIT, "devmem": GPU_MEMORY_MIB, "devcore": 100,
                 "type": "NVIDIA-A100-SXM4-80GB", "numa": 0, "mode": "hami-core", "health": True}
                for i in range(GPUS)]  # fmt: skip
        async with limit:
            await kube.patch(paths.node(node), {"metadata": {"annotations": {HAMI_REGISTER: json.dumps(gpus)}}})
            slots = {HAMI_GPU: str(GPUS * HAMI_SPLIT)}
            await kube.patch(f"{paths.node(node)}/status", {"status": {"capacity": slots, "allocatable": slots}})

    await asyncio.gather(*(one(n) for n in nodes))


def hami_config(whole: stack.Stack, port: int) -> Path:
    """kube-scheduler's configuration as HAMi's chart writes it (templates/scheduler/configmap.yaml):
    one profile, HAMi's extender for filter and bind over plain HTTP (the chart's choice without its
    admission webhook), its resources ignored by kube-scheduler; no leader election."""
    config = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(whole.plane.kubeconfig("admin")), "qps": 500, "burst": 1000},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": HAMI}],
        "extenders": [{
            "urlPrefix": f"http://127.0.0.1:{port}", "enableHTTPS": False, "filterVerb": "filter", "bindVerb": "bind",
            "nodeCacheCapable": True, "weight": 1, "httpTimeout": "30s",
            "managedResources": [{"name": name, "ignoredByScheduler": True} for name in HAMI_RESOURCES],
        }],
    }  # fmt: skip
    path = whole.plane.workdir / "hami-kube-scheduler-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def hami_device_config(whole: stack.Stack) -> Path:
    """HAMi's device configuration, its chart's defaults for NVIDIA (templates/scheduler/device-configmap.yaml)."""
    nvidia = {
        "resourceCountName": HAMI_GPU, "resourceMemoryName": "nvidia.com/gpumem",
        "resourceMemoryPercentageName": HAMI_MEMORY_PCT, "resourceCoreName": HAMI_CORES,
        "resourcePriorityName": "nvidia.com/priority", "overwriteEnv": False, "defaultMemory": 0, "defaultCores": 0,
        "defaultGPUNum": 1, "memoryFactor": 1, "deviceSplitCount": HAMI_SPLIT, "deviceMemoryScaling": 1,
        "deviceCoreScaling": 1, "gpuCorePolicy": "default",
    }  # fmt: skip
    path = whole.plane.workdir / "hami-device-config.yaml"
    path.write_text(yaml.safe_dump({"nvidia": nvidia}))
    return path


async def start_hami(whole: stack.Stack, binary: Path) -> None:
    """HAMi's extender (its chart's default policies: nodes binpack, GPUs spread) and the kube-scheduler
    in front of it; returns once the extender says it is ready (it has read every node)."""
    port, metrics = free_port(), free_port()
    whole.plane.start_peer(HAMI, [
        str(binary), f"--http_bind=127.0.0.1:{port}", f"--metrics-bind-address=127.0.0.1:{metrics}",
        f"--scheduler-name={HAMI}", "--node-scheduler-policy=binpack", "--gpu-scheduler-policy=spread",
        f"--device-config-file={hami_device_config(whole)}", "--leader-elect=false",
        "--kube-qps=500", "--kube-burst=1000",
    ])  # fmt: skip
    whole.plane.start_scheduler(hami_config(whole, port), name=f"kube-scheduler-{HAMI}")
    deadline = time.monotonic() + 120
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{port}/readyz") as answer:
                    if answer.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise SystemExit(f"HAMi's extender not ready in 120 s; its log ends:\n{whole.plane.log(HAMI)[-3000:]}")


class HamiDevicePlugin:
    """HAMi's device plugin's part once the kubelet asks it for a bound pod's devices: the pod's phase
    becomes `success` and the node's lock, held by the pod since its binding, is released (conditional
    on the node's resourceVersion, as HAMi does). Played at once for every bound pod."""

    def __init__(self, kube: client.KubeClient, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.done: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.limit = asyncio.Semaphore(32)
        self.failed: list[str] = []
        """Pods whose part failed (each leaves its node locked until HAMi's lock expires)."""

    def seen(self, kind: str, pod: wire.Pod) -> None:
        name = pod.metadata.name
        if kind == "DELETED" or not pod.spec.node_name or name in self.done:
            return
        if pod.metadata.annotations.get(HAMI_PHASE) != "allocating":
            return
        self.done.add(name)
        task = asyncio.create_task(self.allocate(name, pod.spec.node_name))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def allocate(self, pod: str, node: str) -> None:
        async with self.limit:
            try:
                await self._allocate(pod, node)
            except kube_errors.KubeError as exc:  # the node's lock then waits out HAMi's 5 minutes
                self.failed.append(f"{pod} on {node}: {exc}")

    async def _allocate(self, pod: str, node: str) -> None:
        phase = {"metadata": {"annotations": {HAMI_PHASE: "success"}}}
        await self.kube.patch(paths.pod(self.namespace, pod), phase)
        owner = f",{self.namespace},{pod}"
        for _ in range(20):
            found = await self.kube.get(paths.node(node))
            meta = found["metadata"]
            if not str(meta.get("annotations", {}).get(HAMI_LOCK, "")).endswith(owner):
                return
            unlock = {"metadata": {"annotations": {HAMI_LOCK: None}, "resourceVersion": meta["resourceVersion"]}}
            try:
                await self.kube.patch(paths.node(node), unlock)
                return
            except kube_errors.ConflictError:
                continue
        self.failed.append(f"{pod} on {node}: releasing the node's lock conflicted 20 times")

    async def run(self) -> None:
        watcher: informer.Informer[wire.Pod, wire.Pod] = informer.Informer(
            self.kube, paths.pods(self.namespace), wire.Pod, informer.identity, self.seen, name="hami-device-plugin"
        )
        await watcher.run()


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
        elif system == "hami":
            for container in pod.metadata.annotations.get(HAMI_ALLOCATED, "").split(";"):
                for gpu in filter(None, container.split(":")):
                    uuid, _, _, cores = gpu.split(",")
                    index = int(uuid.rsplit("-", 1)[1])
                    used[(node, index)] += int(cores) * units.MILLI_PER_GPU // 100
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
    folder = peers_folder()
    koord_binary = folder / f"koordinator-{KOORD_VERSION}" / KOORD
    hami_binary = folder / f"hami-{HAMI_VERSION}" / HAMI
    not_run = {} if hami_binary.is_file() else {"hami": HAMI_NOT_BUILT}
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
            runs.append(await sharing_phase(whole, args, plan, "sharegpu", "sharegpu (sharing pods):      ",
                                            e2e.sharing_pod, ("kube-scheduler", "extender")))  # fmt: skip
            runs.append(await sharing_phase(whole, args, plan, "koordinator", "koord-scheduler (DeviceShare):",
                                            koord_pod, (KOORD,), f"koordinator {KOORD_VERSION}"))  # fmt: skip
            if not not_run:
                runs.append(await hami_phase(whole, args, nodes, plan, hami_binary))
        finally:
            await whole.stop()
    return {"runs": runs, "not_run": not_run}


async def hami_phase(
    whole: stack.Stack, args: argparse.Namespace, nodes: list[str], plan: list[int], binary: Path
) -> Json:
    """HAMi last: its nodes advertise `nvidia.com/gpu` as slots, which the phases before must not see."""
    assert whole.admin is not None
    await hami_nodes(whole.admin, nodes)
    await start_hami(whole, binary)
    await asyncio.sleep(5)  # kube-scheduler's cache sees the nodes' new resources
    plugin = HamiDevicePlugin(whole.admin, "bench-hami")
    playing = asyncio.create_task(plugin.run())
    try:
        row = await sharing_phase(whole, args, plan, "hami", "HAMi (extender):              ", hami_pod,
                                  (f"kube-scheduler-{HAMI}", HAMI), f"hami {HAMI_VERSION}")  # fmt: skip
    finally:
        await informer.cancel([playing])
    for failure in plugin.failed:
        print(f"  HAMi's device plugin part failed: {failure}")
    said: dict[str, int] = defaultdict(int)
    for message, count in (await e2e.why_not_scheduled(whole.admin, "bench-hami")).items():
        said[re.sub(r"peer-\d+", "<node>", message)] += count
    for message, count in sorted(said.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  HAMi, binding attempts that failed ({count}x): {message[:300]}")
    return row


async def sharing_phase(
    whole: stack.Stack,
    args: argparse.Namespace,
    plan: list[int],
    kind: str,
    title: str,
    make: Callable[[str, str, int], Json],
    processes: tuple[str, ...],
    system: str = "",
) -> Json:
    """One system's run of the sharing workload (`plan`: each pod's share, the same for every system,
    its pods made by `make` in namespace bench-`kind`): its figures, with the CPU of `processes`, and
    the fragmentation it leaves. When not every pod is bound in time, the end of the last process's log."""
    assert whole.admin is not None
    shares = iter(plan)
    try:
        found = await e2e.phase(whole, args, title, kind, lambda n, ns: make(n, ns, next(shares)))
    except SystemExit:
        if processes[-1] in whole.plane.processes:
            print(f"{processes[-1]}'s log ends:\n{whole.plane.log(processes[-1])[-5000:]}", file=sys.stderr)
        raise
    left, gpus = fragmentation(await usage(whole.admin, f"bench-{kind}", kind))
    return {"system": system or kind, **figures(found, processes), "unallocated_gpu_pct": left, "gpus_in_use": gpus}


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
    parser.add_argument("--timeout", type=float, default=2400, help="seconds each phase may take")
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
