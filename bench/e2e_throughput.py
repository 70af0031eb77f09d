"""Scheduling throughput through the real kube-scheduler, with and without the sharegpu extender.

Starts the local control plane (scripts/build-controlplane), the extender and kube-scheduler with the
project's configuration, creates N fake nodes with 8 GPUs each, then schedules the same number of
pods three times on them: plain pods (no GPU: kube-scheduler alone), token pods (kube-scheduler
alone, each pod asking for one unit of an extended resource that every node advertises and the
extender does not manage: what any pod with an extended resource costs kube-scheduler, an
`nvidia.com/gpu` pod under a stock scheduler included) and sharing pods (fractional GPUs: filter,
prioritize and bind through the extender, reservation pods included). Prints pods/s for each, the
issue's ratio (sharing to plain) and sharing to token pods (what sharegpu adds beyond having an
extended resource at all), and where the CPU went: per process (kube-scheduler, kube-apiserver, etcd,
the extender, this process with its fake kubelets) its CPU milliseconds per pod in each phase (read
from /proc: on a machine with few cores every process competes for the same CPU, so these
say what the ratio is made of), and how many connections kube-scheduler opened to the extender.

    python bench/e2e_throughput.py --nodes 1000 --pods 2000 [--runs 3] [--json PATH]

With `--dra`, the nodes serve sharegpu's DRA claims instead (their agents run with --dra: a Device
that says so and a ResourceSlice), and the sharing phase is DRA pods: each uses a claim of sharegpu's
class made from a template for its share (as the webhook writes such a pod: gated until sharegpu's
allocator has allocated the claim), bound by kube-scheduler's DRA plugin. Before it, the same pods
against a DeviceClass whose claims kube-scheduler's own DRA allocator places (first fit): what DRA
costs here without sharegpu. Every phase also reports
the p50 and p99 time from a pod's creation to its binding, and the API requests kube-apiserver
served per pod in it, by verb and resource (its `apiserver_request_total`, every client's: the
requests a path costs, whoever sends them; watches and the bench's own creations included).

With `--both`, one stack serves both paths: half the nodes serve DRA claims, the other half pods of
the extender path, and the phases are plain, token, sharing pods (extender path) and DRA pods
(sharegpu's allocator), so that the two paths are measured back to back on one stack (the first-fit
phase is left out). `--runs 3` then gives the median of each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sharegpu.api import dra, names, paths, wire
from sharegpu.core import devices
from sharegpu.devcluster import stack
from sharegpu.kube import client, informer
from sharegpu.kube import errors as kube_errors

Json = dict[str, Any]


def plain_pod(name: str, namespace: str) -> Json:
    limits = {"cpu": "100m", "memory": "64Mi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedulerName": names.SCHEDULER_NAME,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": limits}}],
        },
    }


def sharing_pod(name: str, namespace: str, milli: int, handoff: bool = False) -> Json:
    """A pod asking for `milli` of one GPU; with `handoff`, named a hand-off ConfigMap as the webhook
    names one (the extender then writes it: claimed before the bind, filled once its GPU is known)."""
    body = plain_pod(name, namespace)
    limits = body["spec"]["containers"][0]["resources"]["limits"]
    limits.update({names.GPU_MILLI: str(milli)})
    body["spec"]["containers"][0]["resources"]["requests"] = dict(limits)
    if handoff:
        body["metadata"].setdefault("annotations", {})[names.HANDOFF] = f"{names.HANDOFF_PREFIX}{name}"
    return body


TOKEN = "bench.sharegpu.io/token"
"""The extended resource of the token pods: advertised by every node, unknown to the extender."""


def token_pod(name: str, namespace: str) -> Json:
    body = plain_pod(name, namespace)
    resources = body["spec"]["containers"][0]["resources"]
    resources["limits"] = {**resources["limits"], TOKEN: "1"}
    resources["requests"] = dict(resources["limits"])
    return body


def dra_pod(name: str, namespace: str, milli: int, *, gated: bool = True) -> Json:
    """A pod of the DRA path, as the webhook writes it: a claim of its own by name, which sharegpu's
    allocator makes, gated until the allocator has allocated it; `gated` False: a claim from the
    namespace's template for its share (for kube-scheduler's own allocator)."""
    body = plain_pod(name, namespace)
    shape = dra.Shape(1, milli)
    entry = {"name": dra.POD_CLAIM}
    if gated:
        entry["resourceClaimName"] = shape.claim_name(os.urandom(dra.POD_CLAIM_TOKEN_BYTES))
    else:
        entry["resourceClaimTemplateName"] = shape.name
    body["spec"]["resourceClaims"] = [entry]
    body["spec"]["containers"][0]["resources"]["claims"] = [{"name": dra.POD_CLAIM}]
    if gated:
        body["spec"]["schedulingGates"] = [{"name": names.DRA_GATE}]
    return body


FIRST_FIT = "bench-first-fit.sharegpu.io"
"""A DeviceClass whose selector the devices satisfy: kube-scheduler's own DRA allocator places its
claims (first fit), for the baseline of what DRA costs without sharegpu's allocator."""


async def dra_classes(kube: client.KubeClient) -> None:
    """sharegpu's DeviceClass, as the chart renders it, and the first-fit one."""
    for name, expression in ((dra.CLASS, dra.CLASS_SELECTOR), (FIRST_FIT, f'device.driver == "{dra.DRIVER}"')):
        await kube.create(dra.DEVICE_CLASSES, dra.device_class(name, expression))


async def templates(kube: client.KubeClient, namespace: str, shares: list[int], device_class: str) -> None:
    """The namespace (made here) and a claim template per share, of `device_class`."""
    await kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    for milli in shares:
        template = dra.template(namespace, dra.Shape(1, milli).name)
        template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = device_class
        await kube.create(dra.template_path(namespace), template)


async def advertise_tokens(kube: client.KubeClient, nodes: list[str], parallel: int = 32) -> None:
    """Every node advertises 1000 tokens (what a device plugin does for its resource)."""
    limit = asyncio.Semaphore(parallel)
    tokens = {TOKEN: "1000"}

    async def one(node: str) -> None:
        async with limit:
            await kube.patch(f"{paths.node(node)}/status", {"status": {"capacity": tokens, "allocatable": tokens}})

    await asyncio.gather(*(one(n) for n in nodes))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of a process so far (Linux /proc), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes(whole: stack.Stack) -> dict[str, int]:
    found = {name: p.pid for name, p in whole.plane.processes.items()}
    if whole.extender is not None and whole.extender.process is not None:
        found["extender"] = whole.extender.process.pid
    found["bench+kubelets"] = os.getpid()
    return found


_REQUEST = re.compile(r"^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


async def api_requests(kube: client.KubeClient) -> dict[str, float]:
    """kube-apiserver's requests so far, by "VERB resource[/subresource]" (its own metrics)."""
    text = (await kube.send("GET", "/metrics")).decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        matched = _REQUEST.match(line)
        if matched is None:
            continue
        labels = dict(_LABEL.findall(matched.group(1)))
        what = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        key = f"{labels.get('verb', '?')} {what}"
        found[key] = found.get(key, 0.0) + float(matched.group(2))
    return found


@dataclass(frozen=True)
class Phase:
    rate: float
    """Pods per second, from the first creation to the last binding."""
    p50_ms: float
    p99_ms: float
    """Time from a pod's creation to its binding (seen by a watch)."""
    cpu: dict[str, float]
    requests: dict[str, float]
    """API requests per pod, by "VERB resource[/subresource]" (those at 0.01 or more)."""

    @property
    def writes(self) -> float:
        """Writes per pod (POST, PUT, PATCH, DELETE)."""
        return round(sum(n for k, n in self.requests.items() if k.split()[0] in WRITES), 2)


WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


async def measured(whole: stack.Stack, namespace: str, pods: list[Json], timeout: float) -> Phase:
    """The phase's figures, with per process its CPU milliseconds per pod."""
    assert whole.admin is not None
    pids = processes(whole)
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    asked = await api_requests(whole.admin)
    rate, latencies = await schedule(whole.admin, namespace, pods, timeout)
    await asyncio.sleep(2)  # the writes that follow a binding (a pod's status, a claim's) land
    spent = {name: (cpu_seconds(pid) - before[name]) * 1000 / len(pods) for name, pid in pids.items()}
    cpu = {name: round(ms, 2) for name, ms in sorted(spent.items(), key=lambda kv: -kv[1])}
    after = await api_requests(whole.admin)
    per_pod = {k: round((n - asked.get(k, 0.0)) / len(pods), 2) for k, n in after.items()}
    requests = {k: n for k, n in sorted(per_pod.items(), key=lambda kv: -kv[1]) if n >= 0.01}
    return Phase(rate, percentile(latencies, 50), percentile(latencies, 99), cpu, requests)


def percentile(values: list[float], which: int) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, len(ordered) * which // 100)] * 1000, 1)


async def phase(
    whole: stack.Stack, args: argparse.Namespace, title: str, kind: str, make: Callable[[str, str], Json]
) -> Phase:
    """Schedule `args.pods` pods made by `make` in namespace bench-`kind`; print and return the figures."""
    namespace = f"bench-{kind}"
    pods = [make(f"{kind}-{i}", namespace) for i in range(args.pods)]
    found = await measured(whole, namespace, pods, args.timeout)
    show(title, found)
    return found


def show(title: str, found: Phase) -> None:
    parts = ", ".join(f"{name} {ms:.1f}" for name, ms in found.cpu.items() if ms >= 0.05)
    print(f"{title} {found.rate:7.1f} pods/s, creation to binding p50 {found.p50_ms:.0f} ms, "
          f"p99 {found.p99_ms:.0f} ms; CPU ms per pod: {parts} (total {sum(found.cpu.values()):.1f})")  # fmt: skip
    writes = ", ".join(f"{k} {n:g}" for k, n in found.requests.items() if k.split()[0] in WRITES)
    print(f"    API writes per pod: {found.writes:g} ({writes})")


async def schedule(
    kube: client.KubeClient, namespace: str, pods: list[Json], timeout: float
) -> tuple[float, list[float]]:
    """Create `pods` (64 at a time); pods/s from the first create to the last binding, and each pod's
    seconds from its creation to its binding."""
    created, bound, elapsed = await place(kube, namespace, pods, timeout)
    return len(pods) / elapsed, [bound[name] - created[name] for name in bound]


async def place(
    kube: client.KubeClient, namespace: str, pods: list[Json], timeout: float
) -> tuple[dict[str, float], dict[str, float], float]:
    """Create `pods` in order (64 at a time) and wait until all are bound: each pod's creation and
    binding times (perf_counter, by name) and the seconds from the first creation to the last binding."""
    try:
        made = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
        await kube.create("/api/v1/namespaces", made)
    except kube_errors.ConflictError as exc:
        if not exc.already_exists:
            raise
    bound: dict[str, float] = {}
    created: dict[str, float] = {}
    done = asyncio.Event()

    def seen(kind: str, pod: wire.Pod) -> None:
        name = pod.metadata.name
        if kind != "DELETED" and pod.spec.node_name and name not in bound:
            bound[name] = time.perf_counter()
            if len(bound) == len(pods):
                done.set()

    watcher: informer.Informer[wire.Pod, wire.Pod] = informer.Informer(
        kube, paths.pods(namespace), wire.Pod, informer.identity, seen, name=namespace
    )
    task = asyncio.create_task(watcher.run())
    await watcher.synced.wait()
    limit = asyncio.Semaphore(64)

    async def create(body: Json) -> None:
        async with limit:
            created[body["metadata"]["name"]] = time.perf_counter()
            await kube.create(f"/api/v1/namespaces/{namespace}/pods", body)

    started = time.perf_counter()
    await asyncio.gather(*(create(p) for p in pods))
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        raise SystemExit(
            f"only {len(bound)} of {len(pods)} pods in {namespace} were bound in {timeout:.0f} s"
        ) from None
    elapsed = time.perf_counter() - started
    await informer.cancel([task])
    return created, bound, elapsed


async def why_not_scheduled(kube: client.KubeClient, namespace: str) -> dict[str, int]:
    """kube-scheduler's FailedScheduling messages in the namespace, counted (each pod's count of
    attempts added): why it did not bind a pod at once, or took an allocation back."""
    found, _ = await kube.list_all(paths.events(namespace), {"fieldSelector": "reason=FailedScheduling"})
    said: dict[str, int] = {}
    for event in found:
        message = str(event.get("message", ""))
        said[message] = said.get(message, 0) + int(event.get("count") or 1)
    return dict(sorted(said.items(), key=lambda kv: -kv[1]))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sharegpu-bench-") as tmp:
        # The DRA allocator writes at once (a new leader's fence guards against a previous one: none here).
        dra_nodes = args.dra or args.both
        gates = (f"--feature-gates={args.scheduler_gates}",) if args.scheduler_gates else ()
        whole = stack.Stack(Path(tmp), extender_args=("--dra-fence", "0") if dra_nodes else (), scheduler_args=gates)
        await whole.start(harness=False)
        try:
            assert whole.harness is not None and whole.admin is not None
            started = time.perf_counter()
            nodes = [f"bench-{i:04d}" for i in range(args.nodes)]
            made = [
                devices.uniform_node(
                    name, gpu_count=8, model="A100", gpu_memory_mib=81920, cpu_milli=128000, memory_mib=1 << 20,
                    nvlink_all=True,
                )
                for name in nodes
            ]  # fmt: skip
            half = len(made) // 2 if args.both else 0  # --both: the first half serve the extender path
            if half:
                await whole.harness.add_nodes(made[:half], parallel=32)
            await whole.harness.add_nodes(made[half:], parallel=32, dra=dra_nodes)
            if dra_nodes:
                await dra_classes(whole.admin)
            await advertise_tokens(whole.admin, nodes)
            print(f"{args.nodes} fake nodes with 8 GPUs each ready in {time.perf_counter() - started:.1f} s")
            await asyncio.sleep(3)  # let kube-scheduler's and the extender's caches see every node
            plain = await phase(whole, args, "plain pods (kube-scheduler alone):  ", "plain", plain_pod)
            token = await phase(whole, args, "token pods (kube-scheduler alone):  ", "token", token_pod)
            rng = random.Random(3)
            shares = [100, 200, 250, 300, 500]
            first_fit: Phase | None = None
            extender: Phase | None = None
            if args.both:

                def shared_both(name: str, namespace: str) -> Json:
                    return sharing_pod(name, namespace, rng.choice(shares), args.handoffs)

                extender = await phase(whole, args, "sharing pods (through the extender):", "sharing", shared_both)

                def claimed_both(name: str, namespace: str) -> Json:
                    return dra_pod(name, namespace, rng.choice(shares))

                sharing = await phase(whole, args, "DRA pods (sharegpu's allocator):   ", "dra", claimed_both)
            elif args.dra:
                await templates(whole.admin, "bench-firstfit", shares, FIRST_FIT)

                def by_scheduler(name: str, namespace: str) -> Json:
                    return dra_pod(name, namespace, rng.choice(shares), gated=False)

                first_fit = await phase(whole, args, "DRA pods (kube-scheduler's own):    ", "firstfit", by_scheduler)

                def claimed(name: str, namespace: str) -> Json:
                    return dra_pod(name, namespace, rng.choice(shares))

                sharing = await phase(whole, args, "DRA pods (sharegpu's allocator):   ", "dra", claimed)
            else:

                def shared(name: str, namespace: str) -> Json:
                    return sharing_pod(name, namespace, rng.choice(shares), args.handoffs)

                sharing = await phase(whole, args, "sharing pods (through the extender):", "sharing", shared)
            assert whole.extender is not None
            connections = await whole.extender.connections()
            print(f"connections the extender accepted from kube-scheduler, by protocol: {connections}")
            allocator = await whole.extender.counted("sharegpu_extender_dra_claims_total", "outcome")
            if dra_nodes:
                print(f"what the DRA allocator did, by outcome: {allocator}")
                said = await why_not_scheduled(whole.admin, "bench-dra")
                print(f"kube-scheduler's FailedScheduling events on DRA pods, by message: {said}")
        finally:
            await whole.stop()
    path = "dra" if dra_nodes else "extender"
    found: dict[str, Any] = {
        "path": path,
        "plain_pods_per_second": round(plain.rate, 2),
        "token_pods_per_second": round(token.rate, 2),
        f"{path}_pods_per_second": round(sharing.rate, 2),
        "ratio": round(sharing.rate / plain.rate, 3),
        "ratio_to_token": round(sharing.rate / token.rate, 3),
        "p50_ms": {"plain": plain.p50_ms, "token": token.p50_ms, path: sharing.p50_ms},
        "p99_ms": {"plain": plain.p99_ms, "token": token.p99_ms, path: sharing.p99_ms},
        "cpu_ms_per_pod": {"plain": plain.cpu, "token": token.cpu, path: sharing.cpu},
        "api_requests_per_pod": {"plain": plain.requests, "token": token.requests, path: sharing.requests},
        "api_writes_per_pod": {"plain": plain.writes, "token": token.writes, path: sharing.writes},
        "extender_connections": connections,
        "allocator": allocator,
    }
    if extender is not None:
        found["extender_pods_per_second"] = round(extender.rate, 2)
        found["dra_to_extender"] = round(sharing.rate / extender.rate, 3)
        found["p50_ms"]["extender"] = extender.p50_ms
        found["p99_ms"]["extender"] = extender.p99_ms
        found["cpu_ms_per_pod"]["extender"] = extender.cpu
        found["api_requests_per_pod"]["extender"] = extender.requests
        found["api_writes_per_pod"]["extender"] = extender.writes
    if first_fit is not None:
        found["first_fit_pods_per_second"] = round(first_fit.rate, 2)
        found["first_fit"] = {"p50_ms": first_fit.p50_ms, "p99_ms": first_fit.p99_ms, "cpu_ms_per_pod": first_fit.cpu}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--runs", type=int, default=1, help="repeat on a fresh stack; report the median run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dra", action="store_true", help="the nodes serve DRA claims; the third phase is DRA pods")
    parser.add_argument(
        "--handoffs", action="store_true", help="sharing pods name a hand-off ConfigMap, as the webhook's do"
    )
    parser.add_argument("--both", action="store_true", help="both paths on one stack, back to back (see above)")
    parser.add_argument(
        "--scheduler-gates",
        default="",
        help="feature gates of sharegpu's kube-scheduler (K=V,...), e.g. "
        "NominatedNodeNameForExpectation=false: no nominatedNodeName write before a DRA pod's PreBind",
    )
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        if args.runs > 1:
            print(f"-- run {i + 1} of {args.runs}")
        runs.append(asyncio.run(run(args)))
        path = runs[-1]["path"]
        print(f"ratio {path}/plain: {runs[-1]['ratio']:.3f}; {path}/token: {runs[-1]['ratio_to_token']:.3f}")
        if "dra_to_extender" in runs[-1]:
            print(f"ratio dra/extender: {runs[-1]['dra_to_extender']:.3f}")
    result = sorted(runs, key=lambda r: float(r["ratio"]))[len(runs) // 2]
    if args.both and args.runs > 1:
        result = {
            **result,
            "median": {
                key: sorted(float(r[key]) for r in runs)[len(runs) // 2]
                for key in ("extender_pods_per_second", "dra_pods_per_second", "dra_to_extender")
            }
            | {f"p99_ms_{p}": sorted(float(r["p99_ms"][p]) for r in runs)[len(runs) // 2] for p in ("extender", "dra")},
        }
        print(f"medians of {args.runs} runs: {result['median']}")
    if args.runs > 1:
        result = {**result, "runs": runs}
        print(f"median ratio of {args.runs} runs: {result['ratio']:.3f} ({', '.join(str(r['ratio']) for r in runs)})")
        to_token = sorted(float(r["ratio_to_token"]) for r in runs)[len(runs) // 2]
        print(f"median extender/token ratio: {to_token:.3f} ({', '.join(str(r['ratio_to_token']) for r in runs)})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
