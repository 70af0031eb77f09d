"""An oracle that reads only the API server and says what is wrong with the GPUs of a cluster.

Used by the integration suite and by `bench/chaos.py`. It trusts nothing a component keeps in
memory: from the Devices, the bound pods and their allocation annotations, and the reservation pods
it checks that no GPU is over-committed (compute or memory), that no GPU held whole is also held by
anyone else, that every bound GPU pod of the sharegpu scheduler (or carrying its allocation,
whoever bound it) carries one allocation naming its node, that every shared GPU is held by exactly
one live reservation pod, and that no reservation holds a GPU nobody shares.

With `claims`, the ResourceClaims of sharegpu's driver count in the same ledger (what their
allocations consume of each GPU, beside the pods' shares: no GPU may be over-committed by both
together), and it checks that every bound pod's claims are allocated on its node and that no claim
stays allocated with no live pod using it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from sharegpu.api import dra, names, paths, pods, wire
from sharegpu.core import allocation, errors, units
from sharegpu.kube import client

Gpu = tuple[str, int]


@dataclass
class Findings:
    bound: int = 0
    """Bound GPU pods of the sharegpu scheduler."""
    gpus_in_use: int = 0
    overcommits: list[str] = field(default_factory=list)
    double_allocations: list[str] = field(default_factory=list)
    missing_allocations: list[str] = field(default_factory=list)
    unheld: list[str] = field(default_factory=list)
    """Shared GPUs without a live reservation pod."""
    leaked_reservations: list[str] = field(default_factory=list)
    """Live reservation pods for GPUs nobody shares."""
    duplicate_reservations: list[str] = field(default_factory=list)
    claims_bound: int = 0
    """Bound pods whose GPUs are claims of sharegpu's driver."""
    orphan_allocations: list[str] = field(default_factory=list)
    """Claims allocated on sharegpu's GPUs that no live pod uses."""

    def problems(self) -> list[str]:
        return [
            *(f"over-committed: {x}" for x in self.overcommits),
            *(f"double allocation: {x}" for x in self.double_allocations),
            *(f"no valid allocation: {x}" for x in self.missing_allocations),
            *(f"shared but unheld: {x}" for x in self.unheld),
            *(f"leaked reservation: {x}" for x in self.leaked_reservations),
            *(f"duplicate reservations: {x}" for x in self.duplicate_reservations),
            *(f"allocated, no pod uses it: {x}" for x in self.orphan_allocations),
        ]


async def inspect(kube: client.KubeApi, *, nodes: set[str] | None = None, claims: bool = False) -> Findings:
    """The findings for the whole cluster (or only `nodes`); with `claims`, sharegpu's claims too."""
    found = Findings()
    pod_list, _ = await kube.list_of(paths.PODS, wire.Pod)
    device_list, _ = await kube.list_of(paths.DEVICES, wire.Device)
    capacity = {(d.metadata.name, g.index): g.memory_mib for d in device_list for g in d.spec.gpus}
    used: dict[Gpu, list[int]] = defaultdict(lambda: [0, 0])
    holders: dict[Gpu, list[str]] = defaultdict(list)
    whole: dict[Gpu, list[str]] = defaultdict(list)
    reservations: dict[Gpu, list[str]] = defaultdict(list)
    for pod in pod_list:
        node = pod.spec.node_name
        if not node or (nodes is not None and node not in nodes):
            continue
        key = pods.key(pod)
        if pods.is_reservation(pod):
            record = pods.record(pod)
            if record.reservation is not None and record.live:
                reservations[(record.reservation.node, record.reservation.index)].append(key)
            continue
        ours = pod.spec.scheduler_name == names.SCHEDULER_NAME or names.ALLOCATION in pod.metadata.annotations
        if pods.is_terminal(pod) or not ours or not pods.wants_gpu(pod):
            continue
        found.bound += 1
        text = pod.metadata.annotations.get(names.ALLOCATION)
        try:
            alloc = allocation.Allocation.from_json(text or "", pod=units.PodKey(key))
        except errors.InvalidInputError as exc:
            found.missing_allocations.append(f"{key}: {exc}")
            continue
        if alloc.node != node:
            found.missing_allocations.append(f"{key}: allocation names {alloc.node}, bound to {node}")
            continue
        for index, (milli, memory) in alloc.gpu_usage().items():
            where = (node, index)
            used[where][0] += milli
            used[where][1] += memory
            holders[where].append(key)
            if alloc.exclusive:
                whole[where].append(key)
    shared = {where for where in used if not whole[where]}
    if claims:
        await _claims(kube, nodes, pod_list, capacity, found, used, holders, whole)
    found.gpus_in_use = len(used)
    for where, (milli, memory) in sorted(used.items()):
        label = f"{where[0]}/gpu{where[1]}"
        if where not in capacity:
            found.overcommits.append(f"{label}: no such GPU in the inventory ({', '.join(holders[where])})")
            continue
        if milli > units.MILLI_PER_GPU or memory > capacity[where]:
            found.overcommits.append(f"{label}: {milli} milli and {memory} MiB allocated of 1000 and {capacity[where]}")
        if whole[where] and len(holders[where]) > 1:
            found.double_allocations.append(f"{label}: held whole by {whole[where]} and also by {holders[where]}")
    for where in sorted(shared):
        if not reservations.get(where):
            found.unheld.append(f"{where[0]}/gpu{where[1]} ({', '.join(holders[where])})")
    for where, keys in sorted(reservations.items()):
        if len(keys) > 1:
            found.duplicate_reservations.append(f"{where[0]}/gpu{where[1]}: {', '.join(sorted(keys))}")
        if where not in shared:
            found.leaked_reservations.append(f"{where[0]}/gpu{where[1]}: {', '.join(sorted(keys))}")
    return found


async def _claims(
    kube: client.KubeApi,
    nodes: set[str] | None,
    pod_list: list[wire.Pod],
    memory_of: dict[Gpu, int],
    found: Findings,
    used: dict[Gpu, list[int]],
    holders: dict[Gpu, list[str]],
    whole: dict[Gpu, list[str]],
) -> None:
    """Adds what sharegpu's claims hold to the ledger and checks them against the pods using them."""
    claim_list, _ = await kube.list_of(dra.CLAIMS, dra.ResourceClaim)
    users: dict[tuple[str, str], list[wire.Pod]] = defaultdict(list)
    for pod in pod_list:
        if not pods.is_terminal(pod):
            for ref in pods.record(pod).claims:
                if ref.claim:
                    users[(pod.metadata.namespace, ref.claim)].append(pod)
    placed: dict[tuple[str, str], str] = {}
    ours: set[tuple[str, str]] = set()
    for claim in claim_list:
        record = dra.claim_record(claim)
        if record.ours:
            ours.add((record.namespace, record.name))
        label = f"{record.namespace}/{record.name}"
        try:
            alloc = dra.held(record, memory_of)
        except errors.InvalidInputError as exc:
            found.missing_allocations.append(str(exc))
            continue
        if alloc is None or (nodes is not None and alloc.node not in nodes):
            continue
        placed[(record.namespace, record.name)] = alloc.node
        if not users.get((record.namespace, record.name)):
            found.orphan_allocations.append(f"{label} on {alloc.node}")
        for index, (milli, memory) in alloc.gpu_usage().items():
            where = (alloc.node, index)
            used[where][0] += milli
            used[where][1] += memory
            holders[where].append(f"claim {label}")
            if alloc.exclusive:
                whole[where].append(f"claim {label}")
    for (namespace, name), using in users.items():
        for pod in using:
            node = pod.spec.node_name
            if not node or (nodes is not None and node not in nodes):
                continue
            key = pods.key(pod)
            if (namespace, name) not in placed:
                if (namespace, name) in ours:
                    found.missing_allocations.append(f"{key}: bound to {node}, its claim {name} holds no GPU")
                continue
            found.claims_bound += 1
            if placed[(namespace, name)] != node:
                found.missing_allocations.append(
                    f"{key}: bound to {node}, its claim {name} allocated on {placed[(namespace, name)]}"
                )
