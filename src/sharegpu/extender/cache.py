"""The extender's view of the cluster, rebuilt from the API server and kept current by informers.

Inventory: one Device resource per node (its GPUs) and the Node object (allocatable CPU and memory,
readiness). Usage: every pod bound to a node, in the `Ledger` (GPU allocations from the pods'
allocation annotations; whole-GPU pods of other schedulers on free GPUs; host CPU and memory of all
pods). Decisions still waiting for their binding are *assumed* entries; they survive inventory
rebuilds and are confirmed when the bound pod comes back through the watch.

Reservation pods (one per shared physical GPU) are tracked per (node, GPU index); a reservation being
deleted is *retiring* and is never handed to a new sharer.

Everything here runs in one event loop; handlers and decisions never interleave.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sharegpu.core import allocation, devices, errors, fleet, frag, ledger, placer, policies, units
from sharegpu.kube import objects

Json = dict[str, Any]
log = logging.getLogger(__name__)

# Shapes FGD assumes until the cluster has shown enough of its own pods (1/4, 1/2 and whole GPUs).
DEFAULT_SHAPES = (
    frag.WeightedShape(frag.Shape(0, 250, 1), 0.2),
    frag.WeightedShape(frag.Shape(0, 500, 1), 0.3),
    frag.WeightedShape(frag.Shape(0, 1000, 1), 0.35),
    frag.WeightedShape(frag.Shape(0, 1000, 2), 0.1),
    frag.WeightedShape(frag.Shape(0, 1000, 8), 0.05),
)


@dataclass
class Reservation:
    name: str
    node: str
    slot: int
    uuid: str | None = None
    retiring: bool = False


@dataclass
class Counters:
    conflicts: int = 0
    invalid: int = 0
    rebuilds: int = 0


class ClusterCache:
    def __init__(
        self,
        policy: str = "fgd-used",
        clock: Callable[[], float] = time.monotonic,
        shapes: tuple[frag.WeightedShape, ...] | None = None,
    ) -> None:
        policies.make(policy, DEFAULT_SHAPES)  # fail early on an unknown name
        self.policy_name = policy
        self.fixed_shapes = shapes
        """Typical pod shapes for fragmentation-aware policies; None: learn them from the cluster's pods."""
        self.clock = clock
        self.nodes: dict[str, Json] = {}
        self.devices: dict[str, Json] = {}
        self.pods: dict[units.PodKey, Json] = {}
        self.reservations: dict[tuple[str, int], Reservation] = {}
        self.assumed: dict[units.PodKey, allocation.Allocation] = {}
        self.finished_reservations: set[str] = set()
        """Reservation pods that ended (e.g. the device plugin could not give them a GPU): to delete."""
        self.handoff_pods: set[units.PodKey] = set()
        """Pods that name a hand-off ConfigMap (the only ones the hand-off loop looks at)."""
        self.counters = Counters()
        self._dirty = True
        self._state: fleet.FleetState | None = None
        self._ledger: ledger.Ledger | None = None
        self._placer: placer.Placer | None = None

    # ----------------------------------------------------------------- the fleet, rebuilt on demand

    def _inventory(self) -> list[devices.NodeInventory]:
        out = []
        for name, device in sorted(self.devices.items()):
            node = self.nodes.get(name)
            if node is None or not _schedulable(node):
                continue
            try:
                out.append(objects.device_inventory(device, node))
            except errors.InvalidInputError as exc:
                log.error("ignoring node %s: %s", name, exc)
        return out

    def rebuild(self) -> None:
        """New fleet arrays from the inventory, then every bound pod and assumed decision re-applied."""
        inventory = self._inventory()
        state = fleet.FleetState(inventory)
        self._state = state
        self._ledger = ledger.Ledger(state, clock=self.clock)
        shapes = self._shapes()
        priority = stable_priority(state.names)
        self._placer = placer.Placer(state, policies.make(self.policy_name, shapes), priority=priority)
        self._dirty = False
        self.counters.rebuilds += 1
        for pod in self.pods.values():
            self._account(pod)
        for key, alloc in list(self.assumed.items()):
            if key in self._ledger:
                continue
            if not self._ledger.assume(alloc).ok:
                log.warning("assumed pod %s no longer fits after the inventory changed", key)

    def _shapes(self) -> tuple[frag.WeightedShape, ...]:
        if self.fixed_shapes:
            return self.fixed_shapes
        shapes = []
        for pod in self.pods.values():
            if objects.is_reservation(pod) or not objects.wants_gpu(pod):
                continue
            try:
                demand = objects.pod_request(pod).demand
            except errors.InvalidInputError:
                continue
            shapes.append(frag.Shape(demand.cpu_milli, demand.milli, demand.count, tuple(sorted(demand.models))))
        if len(shapes) < 50:
            return DEFAULT_SHAPES
        return frag.typical_shapes(shapes)

    @property
    def state(self) -> fleet.FleetState:
        if self._dirty or self._state is None:
            self.rebuild()
        assert self._state is not None
        return self._state

    @property
    def ledger(self) -> ledger.Ledger:
        self.state  # noqa: B018 - rebuild if needed
        assert self._ledger is not None
        return self._ledger

    @property
    def placer(self) -> placer.Placer:
        self.state  # noqa: B018
        assert self._placer is not None
        return self._placer

    # ----------------------------------------------------------------- informer handlers

    def on_node(self, kind: str, node: Json) -> None:
        name = node["metadata"]["name"]
        old = self.nodes.get(name)
        if kind == "DELETED":
            self.nodes.pop(name, None)
            self._dirty = True
            return
        self.nodes[name] = node
        if old is None or _node_fingerprint(old) != _node_fingerprint(node):
            self._dirty = True

    def on_device(self, kind: str, device: Json) -> None:
        name = device["metadata"]["name"]
        if kind == "DELETED":
            self.devices.pop(name, None)
        else:
            if self.devices.get(name, {}).get("spec") == device.get("spec"):
                self.devices[name] = device
                return
            self.devices[name] = device
        self._dirty = True

    def on_pod(self, kind: str, pod: Json) -> None:
        key = objects.pod_key(pod)
        if objects.is_reservation(pod):
            self._track_reservation(kind, pod)
            return
        if kind == "DELETED":
            self.pods.pop(key, None)
            self.assumed.pop(key, None)
            self.handoff_pods.discard(key)
            if not self._dirty and self._ledger is not None and key in self._ledger:
                self._ledger.remove(key)
            return
        self.pods[key] = pod
        if ((pod.get("metadata") or {}).get("annotations") or {}).get(objects.ANNOTATION_HANDOFF):
            self.handoff_pods.add(key)
        if not self._dirty:
            self._account(pod)

    def _account(self, pod: Json) -> None:
        """Bring the ledger in line with one pod as the API server shows it."""
        assert self._ledger is not None and self._state is not None
        key = objects.pod_key(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        book = self._ledger
        if not node or objects.is_terminal(pod) or self._state.row(node) is None:
            if node and objects.is_terminal(pod):
                self.assumed.pop(key, None)
            if key in book and (node or key not in self.assumed):
                book.remove(key)
            return
        try:
            alloc = objects.pod_allocation(pod)
        except errors.InvalidInputError as exc:
            self.counters.invalid += 1
            log.error("pod %s has an unreadable allocation: %s", key, exc)
            alloc = None
        if alloc is None:
            alloc = self._derived_allocation(pod, node)
            if alloc is None:
                return
        entry = book.get(key)
        if entry is not None and entry.alloc == alloc and entry.phase is ledger.Phase.ADDED:
            return
        result = book.add(alloc)
        self.assumed.pop(key, None)
        if not result.ok:
            self.counters.conflicts += 1
            log.error("pod %s on %s conflicts with the ledger: %s", key, node, result.message)

    def _derived_allocation(self, pod: Json, node: str) -> allocation.Allocation | None:
        """What a bound pod without an allocation annotation holds: host resources, and whole GPUs
        (nvidia.com/gpu from another scheduler) on the first entirely free GPUs of its node."""
        key = objects.pod_key(pod)
        cpu, mem = objects.host_request(pod)
        try:
            request = objects.pod_request(pod)
        except errors.InvalidInputError:
            request = None
        state = self._state
        assert state is not None and self._ledger is not None
        entry = self._ledger.get(key)
        if entry is not None and entry.alloc.node == node:
            return entry.alloc  # keep the slots already chosen for it
        if request is None or request.demand.count == 0 or not request.demand.whole:
            return allocation.Allocation(pod=key, node=units.NodeName(node), cpu_milli=cpu, memory_mib=mem)
        row = state.row(node)
        assert row is not None
        free = np.flatnonzero((state.milli_free[row] == state.milli_capacity[row]) & state.present[row])
        chosen = free[: request.demand.count].tolist()
        if len(chosen) < request.demand.count:
            self.counters.conflicts += 1
            log.error(
                "pod %s holds %d whole GPU(s) on %s but only %d are free", key, request.demand.count, node, len(chosen)
            )
            return allocation.Allocation(pod=key, node=units.NodeName(node), cpu_milli=cpu, memory_mib=mem)
        memory = [int(m) for m in state.gmem_capacity[row]]
        return allocation.build(request, units.NodeName(node), chosen, memory)

    def _track_reservation(self, kind: str, pod: Json) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        try:
            slot = int(labels.get(objects.LABEL_SLOT, "-1"))
        except ValueError:
            return
        node = labels.get(objects.LABEL_NODE, "")
        name = pod["metadata"]["name"]
        current = self.reservations.get((node, slot))
        if kind == "DELETED" or (pod.get("metadata") or {}).get("deletionTimestamp") or objects.is_terminal(pod):
            if current is not None and current.name == name:
                del self.reservations[(node, slot)]
            if kind == "DELETED" or (pod.get("metadata") or {}).get("deletionTimestamp"):
                self.finished_reservations.discard(name)
            else:
                self.finished_reservations.add(name)  # failed or ended: to be deleted, and replaced if needed
            return
        if current is not None and current.name != name and not current.retiring:
            return  # another live reservation already holds this slot
        uuid = ((pod.get("metadata") or {}).get("annotations") or {}).get(objects.ANNOTATION_GPU_UUID)
        if current is None or current.name != name:
            self.reservations[(node, slot)] = Reservation(name, node, slot, uuid)
        else:
            current.uuid = uuid

    # ----------------------------------------------------------------- decisions

    def assume(self, alloc: allocation.Allocation) -> bool:
        result = self.ledger.assume(alloc)
        if result.ok:
            self.assumed[alloc.pod] = alloc
        return result.ok

    def forget(self, key: units.PodKey) -> None:
        if self.assumed.pop(key, None) is not None:
            self.ledger.forget(key)

    def sharers(self, node: str, slot: int) -> int:
        """Pods holding a share (not a whole GPU) of (node, slot), assumed ones included."""
        state = self.state
        row = state.row(node)
        if row is None or slot >= state.width:
            return 0
        return int(state.tenants[row, slot] - state.exclusive[row, slot])

    def summary(self) -> list[Json]:
        """Per node and GPU: capacity, used, free, and who holds what (the debug endpoint)."""
        state = self.state
        holders: dict[tuple[str, int], list[Json]] = {}
        for key, entry in self.ledger.entries():
            for index, (milli, memory) in entry.alloc.gpu_usage().items():
                holders.setdefault((entry.alloc.node, index), []).append(
                    {"pod": key, "milli": milli, "memoryMiB": memory, "phase": entry.phase.value}
                )
        out = []
        for row, name in enumerate(state.names):
            gpus = []
            for index in range(int(state.gpu_count[row])):
                reservation = self.reservations.get((name, index))
                gpus.append(
                    {
                        "index": index,
                        "model": state.model_names[state.model_id[row, index]],
                        "milli": {
                            "capacity": 1000,
                            "used": 1000 - int(state.milli_free[row, index]),
                            "free": int(state.milli_free[row, index]),
                        },
                        "memoryMiB": {
                            "capacity": int(state.gmem_capacity[row, index]),
                            "used": int(state.gmem_capacity[row, index] - state.gmem_free[row, index]),
                            "free": int(state.gmem_free[row, index]),
                        },
                        "holders": holders.get((name, index), []),
                        "reservation": None
                        if reservation is None
                        else {"pod": reservation.name, "uuid": reservation.uuid, "retiring": reservation.retiring},
                    }
                )
            out.append(
                {
                    "node": name,
                    "cpu": {"capacity": int(state.cpu_capacity[row]), "free": int(state.cpu_free[row])},
                    "memoryMiB": {"capacity": int(state.mem_capacity[row]), "free": int(state.mem_free[row])},
                    "gpus": gpus,
                }
            )
        return out


def _schedulable(node: Json) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def _node_fingerprint(node: Json) -> tuple[Any, ...]:
    status = node.get("status") or {}
    return (_schedulable(node), tuple(sorted((status.get("allocatable") or {}).items())))


def stable_priority(names: tuple[units.NodeName, ...]) -> fleet.IntArray:
    """A fixed tie-break order that does not depend on when nodes joined: by a hash of the name."""
    keys = [hashlib.blake2b(n.encode(), digest_size=8).digest() for n in names]
    order = sorted(range(len(names)), key=lambda i: keys[i])
    ranks = np.empty(len(names), dtype=np.int64)
    ranks[order] = np.arange(len(names), dtype=np.int64)
    return ranks
