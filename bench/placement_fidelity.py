"""Placement fidelity: the simulator vs the real kube-scheduler + extender on the same arrivals.

Takes a seeded sample of N openb GPU nodes and the openb default arrival sequence (the paper's
method, tune 1.3) scaled to that sample, and replays it (a) in the simulator and (b) through the
real kube-scheduler and the sharegpu extender on fake nodes, creating pods one at a time and waiting
for each to be bound or found unschedulable (unschedulable pods are deleted: arrivals only, no
retry, as in the paper). Both sides use the extender's default policy, the trace's typical shapes
and the extender's fixed node priority. Prints the unallocated GPU % at arrived = 100% of both and
the fraction of pods placed on the same node.

    python bench/placement_fidelity.py --nodes 100 [--openb DIR] [--seed 42] [--json PATH] [--dra]

With `--dra`, the real side is the DRA path: the nodes serve sharegpu's DRA claims, every pod asks
its GPUs by a claim of sharegpu's class (from the template for its shape, gated, as the webhook
writes it), sharegpu's allocator places the claims and kube-scheduler binds the pods; a pod the
allocator cannot place says so by a ClaimNotAllocated event. A pod's GPU models go into its
template's CEL selector (`productName in [...]`, as the webhook writes them). A pod with no GPU goes
to kube-scheduler alone, so on both sides the arrivals are then the GPU pods only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from sharegpu.api import dra, names, paths, wire
from sharegpu.core import policies
from sharegpu.devcluster import stack
from sharegpu.extender import cache
from sharegpu.kube import informer
from sharegpu.sim import replay, trace

Json = dict[str, Any]
HERE = Path(__file__).resolve().parent
POLICY = policies.DEFAULT


def manifest(pod: trace.TracePod, name: str, namespace: str) -> Json:
    limits: dict[str, str] = {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi"}
    if pod.num_gpu == 0:
        limits[names.GPU] = "0"  # no GPU, but a managed resource: the extender places it too
    elif pod.gpu_milli < 1000:
        limits.update({names.GPU: "1", names.GPU_MILLI: str(pod.gpu_milli)})
    else:
        limits[names.NVIDIA_GPU] = str(pod.num_gpu)
    annotations = {names.MODELS: ",".join(sorted(pod.models))} if pod.models else {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {"schedulerName": names.SCHEDULER_NAME, "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "main", "image": "busybox",
                                 "resources": {"limits": limits, "requests": dict(limits)}}]},
    }  # fmt: skip


class Involved(wire.Message, kw_only=True, frozen=True):
    name: str = ""


class Event(wire.Message, kw_only=True, frozen=True):
    """What the bench reads of an Event: why, and about which pod."""

    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    reason: str = ""
    involved_object: Involved = msgspec.field(default_factory=Involved)


def dra_manifest(pod: trace.TracePod, name: str, namespace: str) -> Json:
    """The pod as the webhook writes it on the DRA path: its GPUs by a claim from its shape's template."""
    body = manifest(pod, name, namespace)
    resources = body["spec"]["containers"][0]["resources"]
    limits = {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi"}
    resources.update(limits=limits, requests=dict(limits), claims=[{"name": dra.POD_CLAIM}])
    body["metadata"]["annotations"] = {}
    template = shape_of(pod).name
    body["spec"]["resourceClaims"] = [{"name": dra.POD_CLAIM, "resourceClaimTemplateName": template}]
    body["spec"]["schedulingGates"] = [{"name": names.DRA_GATE}]
    return body


def shape_of(pod: trace.TracePod) -> dra.Shape:
    return dra.Shape(pod.num_gpu, min(pod.gpu_milli, 1000), models=frozenset(pod.models))


async def through_kubernetes(
    nodes: list[Any], workload: replay.Workload, shapes_file: Path, *, dra_path: bool = False
) -> list[str | None]:
    """Node of each pod as the real scheduler placed it (None: unschedulable)."""
    with tempfile.TemporaryDirectory(prefix="sharegpu-fidelity-") as tmp:
        extra = ("--dra-fence", "0") if dra_path else ()
        whole = stack.Stack(Path(tmp), POLICY, ("--shapes-from", str(shapes_file), *extra))
        await whole.start(harness=False)
        try:
            assert whole.harness is not None and whole.admin is not None
            kube = whole.admin
            await whole.harness.add_nodes(nodes, dra=dra_path)
            await asyncio.sleep(3)
            namespace = "fidelity"
            await kube.create(
                "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            )
            if dra_path:
                await kube.create(dra.DEVICE_CLASSES, dra.device_class())
                for shape in {shape_of(p) for p in workload.pods}:
                    await kube.create(dra.template_path(namespace), dra.template(namespace, shape.name))
            outcome: dict[str, asyncio.Future[str | None]] = {}

            def seen(kind: str, pod: wire.Pod) -> None:
                future = outcome.get(pod.metadata.name)
                if future is None or future.done() or kind == "DELETED":
                    return
                if pod.spec.node_name:
                    future.set_result(pod.spec.node_name)
                for condition in pod.status.conditions:
                    if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                        future.set_result(None)

            watcher: informer.Informer[wire.Pod, wire.Pod] = informer.Informer(
                kube, paths.pods(namespace), wire.Pod, informer.identity, seen, name="fidelity"
            )
            task = asyncio.create_task(watcher.run())
            await watcher.synced.wait()

            def refused(kind: str, event: Event) -> None:
                future = outcome.get(event.involved_object.name)
                if event.reason == "ClaimNotAllocated" and future is not None and not future.done():
                    future.set_result(None)

            refusals: informer.Informer[Event, Event] = informer.Informer(
                kube, paths.events(namespace), Event, informer.identity, refused, name="fidelity-events"
            )
            tasks = [task, asyncio.create_task(refusals.run())]
            await refusals.synced.wait()
            make = dra_manifest if dra_path else manifest
            placed: list[str | None] = []
            started = time.perf_counter()
            for i, pod in enumerate(workload.pods):
                name = f"p{i:05d}"
                outcome[name] = asyncio.get_running_loop().create_future()
                await kube.create(f"/api/v1/namespaces/{namespace}/pods", make(pod, name, namespace))
                node = await asyncio.wait_for(outcome[name], 60)
                if node is None:
                    await kube.delete(f"/api/v1/namespaces/{namespace}/pods/{name}", grace_period=0)
                placed.append(node)
                if (i + 1) % 200 == 0:
                    print(
                        f"  {i + 1}/{len(workload.pods)} pods through kube-scheduler "
                        f"({time.perf_counter() - started:.0f} s)",
                        flush=True,
                    )
            await informer.cancel(tasks)
            return placed
        finally:
            await whole.stop()


def in_simulator(nodes: list[Any], workload: replay.Workload, pods: trace.Trace) -> tuple[list[str | None], float]:
    from sharegpu.core import fleet
    from sharegpu.core import ledger as core_ledger
    from sharegpu.core import placer as core_placer

    shapes = pods.typical_shapes()
    state = fleet.FleetState(nodes)
    ledger = core_ledger.Ledger(state)
    placer = core_placer.Placer(state, policies.make(POLICY, shapes), priority=workload.node_priority)
    placed: list[str | None] = []
    for i, pod in enumerate(workload.pods):
        decision = placer.place(ledger, pod.request(f"p{i:05d}"))
        placed.append(decision.node if decision.status.ok else None)
    return placed, figure(workload, placed, state.total_milli)


def figure(workload: replay.Workload, placed: list[str | None], capacity: int) -> float:
    requests = np.array([p.gpu_milli_total for p in workload.pods], dtype=np.int64)
    allocated = np.cumsum(np.where([n is not None for n in placed], requests, 0))
    return replay.unallocated_at_100(np.cumsum(requests), allocated, capacity)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openb", type=Path, default=HERE.parent.parent / "shared" / "traces" / "openb")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dra", action="store_true", help="the real side is the DRA path (see above)")
    args = parser.parse_args()
    pods_file = args.openb / "openb_pod_list_default.csv"
    every = trace.load_nodes(args.openb / "openb_node_list_gpu_node.csv")
    sample = sorted(random.Random(args.seed).sample(every, args.nodes), key=lambda n: n.name)
    pods = trace.load_pods(pods_file)
    names = tuple(n.name for n in sample)
    capacity = sum(n.gpu_count for n in sample) * 1000
    base = replay.build_workload(pods.pods, capacity, len(sample), 1.3, args.seed)
    arrivals = base.pods
    if args.dra:  # GPU pods only: a pod without one goes to kube-scheduler alone
        arrivals = tuple(p for p in arrivals if p.num_gpu)
    workload = replay.Workload(arrivals, cache.stable_priority(names))
    print(f"{args.nodes} openb nodes ({capacity // 1000} GPUs), {len(workload.pods)} arrivals, policy {POLICY}")
    simulated, sim_figure = in_simulator(sample, workload, pods)
    print(f"simulator: unallocated GPU % at arrived 100%: {sim_figure:.2f}")
    real = asyncio.run(through_kubernetes(sample, workload, pods_file, dra_path=args.dra))
    e2e_figure = figure(workload, real, capacity)
    placed_sim = [i for i, n in enumerate(simulated) if n is not None]
    same = sum(1 for i, n in enumerate(simulated) if n == real[i]) / len(simulated)
    side = "sharegpu's DRA allocator + kube-scheduler" if args.dra else "kube-scheduler + extender"
    print(f"{side}: unallocated GPU % at arrived 100%: {e2e_figure:.2f}")
    print(f"pods on the same node in both: {same:.3f} ({len(placed_sim)} placed by the simulator)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "path": "dra" if args.dra else "extender",
                    "simulator_unallocated_pct": round(sim_figure, 4),
                    "e2e_unallocated_pct": round(e2e_figure, 4),
                    "same_node_fraction": round(same, 4),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
