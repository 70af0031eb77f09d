"""`kubectl sharegpu snapshot DIR`: the cluster's GPU nodes and its pods' GPU requests written as a
trace in the openb format (`sim.trace`), so that `sharegpu simulate` and `sharegpu bound` say what
each policy would leave idle on this cluster, beside what it holds now.

`read` lists (paged, read rights only) the Nodes, sharegpu's Devices where they are served, the pods,
and the ResourceClaims and their templates where DRA is served (one of these three that RBAC does not
let the user list is read as none, and noted); `take` turns them into rows, with no I/O; `write`
writes the node file, the pod file and `snapshot.json` (what was left out or not read, and why).

- **Nodes.** A GPU node has a Device listing GPUs (sharegpu's agent), or else `nvidia.com/gpu` in its
  allocatable (NVIDIA's device plugin, as a cluster that does not run sharegpu yet has it: the model
  from GPU feature discovery's `nvidia.com/gpu.product` label, the memory from `nvidia.com/gpu.memory`,
  MiB). CPU and memory are its allocatable. openb gives a node one model: a node of several is
  written with the model most of its GPUs have, and the smallest GPU memory among them.
`--selector` keeps the nodes it selects (a node pool) and `--namespace` one namespace's pods; pods
bound to nodes left out are not written.

- **Pods.** Those not finished and not being deleted. A pod's request is read in every format
  sharegpu's webhook reads (`webhook.translate`: sharegpu's own, HAMi, Volcano, Koordinator, Aliyun,
  tkestack, KubeShare, KAI, nvidia.com/gpu), then as the extender reads it (`api.pods.request`), with
  its ResourceClaims of sharegpu's DRA class (`api.dra.gpu_request`). Every GPU pod is written; a
  CPU-only pod only when bound to a GPU node (it takes that node's CPU and memory), or, with
  `pending_cpu_pods`, also while pending. A pod whose request sharegpu refuses is left out, with why.
- **Order and names.** Pods in creation order (then namespace and name), `creation_time` in seconds
  after the first; pods are named `pod-00000`, nodes `node-0000` (in name order) and namespaces are
  not written, unless `names` keeps them (`namespace/name`, the node's name): nothing identifies a
  workload unless asked.
- **What openb cannot say.** GPU memory (per GPU, MiB or per mille) and the node a pod is on go in
  sharegpu's extra columns, which the simulator reads. Co-tenancy rules, shared device groups,
  isolation modes and compute guarantees, burst limits, node selectors, affinity and taints, and
  NVLink topology are not written: `Snapshot.dropped` counts the pods (and nodes) that had each.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharegpu.api import dra, names, paths, quantity, wire
from sharegpu.api import pods as api_pods
from sharegpu.core import errors, requests, units
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from sharegpu.sim import trace
from sharegpu.webhook import translate

Json = dict[str, Any]

PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
TRACE = "snapshot"
"""The pod file's trace name: `openb_pod_list_snapshot.csv`."""


@dataclass(frozen=True, slots=True)
class Listing:
    """What `read` found."""

    nodes: tuple[wire.Node, ...]
    devices: tuple[wire.Device, ...]
    pods: tuple[Json, ...]
    claims: tuple[dra.ResourceClaim, ...] = ()
    templates: tuple[dra.ResourceClaimTemplate, ...] = ()
    notes: tuple[str, ...] = ()
    """What could not be read (a resource this user may not list), and why."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: tuple[trace.TraceNode, ...]
    pods: tuple[trace.TracePod, ...]
    skipped: tuple[str, ...] = ()
    """Pods left out: `namespace/name: why`."""
    dropped: dict[str, int] = field(default_factory=dict)
    """What openb's columns cannot hold -> how many pods (or nodes) had it."""
    notes: tuple[str, ...] = ()
    """What could not be read (`Listing.notes`): the trace is written without it."""


async def _optional(api: client.KubeApi, path: str, kind: type[Any], what: str, notes: list[str]) -> list[Any]:
    try:
        items, _ = await api.list_of(path, kind)
    except kube_errors.NotFoundError:
        return []  # not served here: sharegpu not installed, or no DRA
    except kube_errors.ForbiddenError:
        notes.append(f"cannot list {what}: forbidden (RBAC)")
        return []
    return items


async def read(api: client.KubeApi, node_selector: str = "", namespace: str | None = None) -> Listing:
    """Every Node (those `node_selector` selects), Device, pod (of `namespace`, if given),
    ResourceClaim and template, paged (a resource not served: none)."""
    node_params = {"labelSelector": node_selector} if node_selector else None
    notes: list[str] = []
    (nodes, _), devices, (pods, _), claims, templates = await asyncio.gather(
        api.list_of(paths.NODES, wire.Node, node_params),
        _optional(api, paths.DEVICES, wire.Device, "devices.sharegpu.io", notes),
        api.list_of(paths.pods(namespace), dict),
        _optional(api, dra.claim_path(namespace), dra.ResourceClaim, "resourceclaims.resource.k8s.io", notes),
        _optional(api, dra.template_path(namespace), dra.ResourceClaimTemplate,
                  "resourceclaimtemplates.resource.k8s.io", notes),
    )  # fmt: skip
    chosen = {n.metadata.name for n in nodes}
    devices = [d for d in devices if d.metadata.name in chosen]
    return Listing(tuple(nodes), tuple(devices), tuple(pods), tuple(claims), tuple(templates), tuple(sorted(notes)))


def take(found: Listing, *, names_kept: bool = False, pending_cpu_pods: bool = False) -> Snapshot:
    """The trace rows of a listing (see the module docstring)."""
    dropped: collections.Counter[str] = collections.Counter()
    devices = {d.metadata.name: d for d in found.devices}
    rows: dict[str, trace.TraceNode] = {}
    for listed in sorted(found.nodes, key=lambda n: n.metadata.name):
        row = _node_row(listed, devices.get(listed.metadata.name), dropped)
        if row is not None:
            rows[listed.metadata.name] = row
    aliases = {name: name if names_kept else f"node-{i:04d}" for i, name in enumerate(rows)}
    claims = {(c.metadata.namespace, c.metadata.name): c for c in found.claims}
    templates = {(t.metadata.namespace, t.metadata.name): t for t in found.templates}
    skipped: list[str] = []
    kept: list[tuple[str, str, trace.TracePod]] = []
    for raw in found.pods:
        meta = raw.get("metadata") or {}
        where = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        try:
            pod = wire.convert(raw, wire.Pod)
            if api_pods.is_terminal(pod) or pod.metadata.deletion_timestamp or api_pods.is_reservation(pod):
                continue
            asked = _request(raw, pod, claims, templates)
        except errors.InvalidInputError as exc:
            skipped.append(f"{where}: {errors.first_line(exc)}")
            continue
        node = pod.spec.node_name or None
        demand = asked.demand
        if node is not None and node not in rows:
            continue  # on a node left out (not a GPU node, or not selected)
        if not demand.count and node is None and not pending_cpu_pods:
            continue
        _count_dropped(pod, asked, dropped)
        kept.append((
            pod.metadata.creation_timestamp or "", where,
            trace.TracePod(
                name=where, cpu_milli=demand.cpu_milli, memory_mib=demand.host_memory_mib, num_gpu=demand.count,
                gpu_milli=demand.milli if demand.count else 0, models=demand.models,
                gpu_memory_mib=demand.memory_mib if demand.count and not demand.whole else 0,
                gpu_memory_permille=demand.memory_permille if demand.count and not demand.whole else 0,
                phase=pod.status.phase or "Pending", node=aliases.get(node) if node else None,
            ),
        ))  # fmt: skip
    kept.sort(key=lambda item: (item[0], item[1]))
    first = _seconds(kept[0][0]) if kept else 0
    pods = tuple(
        dataclasses.replace(
            row, name=where if names_kept else f"pod-{i:05d}", creation_time=max(0, _seconds(created) - first)
        )
        for i, (created, where, row) in enumerate(kept)
    )
    nodes = tuple(dataclasses.replace(row, name=aliases[name]) for name, row in rows.items())
    return Snapshot(nodes, pods, tuple(skipped), dict(sorted(dropped.items())), found.notes)


def write(snapshot: Snapshot, directory: Path, command: str = "") -> tuple[Path, Path]:
    """The node and pod files, and `snapshot.json` (the command, counts, what was dropped and left out)."""
    directory.mkdir(parents=True, exist_ok=True)
    node_file, pod_file = directory / trace.NODE_FILE, directory / trace.pod_file(TRACE)
    trace.write_nodes(node_file, snapshot.nodes)
    trace.write_pods(pod_file, snapshot.pods)
    summary = {
        "command": command,
        "nodes": len(snapshot.nodes),
        "gpus": sum(n.gpus for n in snapshot.nodes),
        "pods": len(snapshot.pods),
        "gpu_pods": sum(1 for p in snapshot.pods if p.num_gpu),
        "bound_gpu_pods": sum(1 for p in snapshot.pods if p.num_gpu and p.node),
        "not_written": snapshot.dropped,
        "left_out": list(snapshot.skipped),
        "not_read": list(snapshot.notes),
    }
    (directory / "snapshot.json").write_text(json.dumps(summary, indent=2) + "\n")
    return node_file, pod_file


def _node_row(node: wire.Node, device: wire.Device | None, dropped: collections.Counter[str]) -> trace.TraceNode | None:
    allocatable = node.status.allocatable
    try:
        cpu = quantity.milli_cpu(allocatable.get("cpu", 0))
        memory = quantity.mebibytes(allocatable.get("memory", 0))
    except errors.InvalidInputError:
        return None  # a Node whose allocatable cannot be read takes no pod
    labels = node.metadata.labels
    if device is not None and device.spec.gpus:
        models = collections.Counter(g.model for g in device.spec.gpus)
        model = max(models, key=lambda m: (models[m], m))
        gpus, gpu_memory = len(device.spec.gpus), min(g.memory_mib for g in device.spec.gpus)
        if device.spec.nvlinks:
            dropped["nodes with NVLink topology"] += 1
        if len(models) > 1:
            dropped["nodes of several GPU models (written with the most common)"] += 1
    else:
        try:
            gpus = quantity.integer(allocatable.get(names.NVIDIA_GPU, 0), names.NVIDIA_GPU, 0, units.MAX_GPUS_PER_NODE)
        except errors.InvalidInputError:
            return None
        if not gpus:
            return None
        model = labels.get(PRODUCT_LABEL, "") or "unknown"
        said = labels.get(MEMORY_LABEL, "")
        gpu_memory = int(said) if said.isdigit() and int(said) > 0 else trace.DEFAULT_GPU_MEMORY_MIB
    if node.spec.taints:
        dropped["nodes with taints"] += 1
    return trace.TraceNode(node.metadata.name, cpu, memory, gpus, model, gpu_memory)


def _request(
    raw: Json,
    pod: wire.Pod,
    claims: dict[tuple[str, str], dra.ResourceClaim],
    templates: dict[tuple[str, str], dra.ResourceClaimTemplate],
) -> requests.PodRequest:
    """The pod's request as sharegpu would read it once admitted (formats translated), claims included."""
    canonical, _ = translate.translate(raw)
    asked = api_pods.request(wire.convert(canonical, wire.Pod))
    from_claims: list[requests.ContainerRequest] = []
    for ref in api_pods.claim_refs(pod):
        spec = _claim_spec(pod.metadata.namespace, ref, claims, templates)
        for request in spec.devices.requests if spec is not None else ():
            gpu = dra.gpu_request(request)
            if gpu is not None:
                from_claims.append(requests.ContainerRequest(f"claim:{ref.name}/{request.name}", gpu))
    if not from_claims:
        return asked
    return requests.PodRequest(
        key=asked.key, containers=(*asked.containers, *from_claims), cpu_milli=asked.cpu_milli,
        memory_mib=asked.memory_mib, cotenancy=asked.cotenancy, isolation=asked.isolation, compute=asked.compute,
    )  # fmt: skip


def _claim_spec(
    namespace: str,
    ref: api_pods.ClaimRef,
    claims: dict[tuple[str, str], dra.ResourceClaim],
    templates: dict[tuple[str, str], dra.ResourceClaimTemplate],
) -> dra.ClaimSpec | None:
    if ref.claim and (namespace, ref.claim) in claims:
        return claims[(namespace, ref.claim)].spec
    if ref.template and (namespace, ref.template) in templates:
        return templates[(namespace, ref.template)].spec.spec
    return None


def _count_dropped(pod: wire.Pod, asked: requests.PodRequest, dropped: collections.Counter[str]) -> None:
    rules = asked.cotenancy
    if rules.group:
        dropped["pods in a shared device group"] += 1
    if rules.affinity or rules.anti_affinity or rules.exclusion:
        dropped["pods with co-tenancy rules"] += 1
    if asked.isolation is not None or asked.compute:
        dropped["pods demanding an isolation mode or a compute guarantee"] += 1
    if any(c.gpu is not None and c.gpu.limit_milli is not None for c in asked.containers):
        dropped["pods with a burst limit"] += 1
    if pod.spec.node_selector or pod.spec.affinity is not None or pod.spec.tolerations:
        dropped["pods with node selectors, affinity or tolerations"] += 1


def _seconds(stamp: str) -> int:
    try:
        return int(wire.seconds(stamp)) if stamp else 0
    except errors.InvalidInputError:
        return 0
