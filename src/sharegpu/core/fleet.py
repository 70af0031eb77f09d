"""Vectorised device state of a whole cluster: capacity, free and co-tenancy marks per GPU.

`FleetState` holds numpy arrays indexed by node row and GPU index (padded to the widest node):
what each GPU offers, what is free, and the co-tenancy labels of its current tenants. Free
quantities are maintained by `apply` from allocations only, so they are always derived from the
ledger's contents; `recount` rebuilds them from scratch to check that.

Every change to a node bumps `version[row]`: placement caches per-node results by version, so a
decision touches only the nodes that changed since the same request shape was last seen.

`blocked` marks GPUs that take no new tenant: the ledger sets it on a GPU whose tenants, as the API
server shows them, do not fit on it together (an over-commit some fault let through), until they do.
`held` marks GPUs kept for a pod that preempted their tenants (`hold`): no other pod is placed there
until its owner lets go.

`selections` are named sets of GPUs (`select`): a demand that names one (`GpuDemand.selection`, a
DRA claim's device selectors) takes only its GPUs. They are part of the fleet as built: a new fleet
has none until they are selected again.

Not thread-safe: one owner (the ledger) mutates it; async callers serialise through the owner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from sharegpu.core import allocation, devices, errors, requests, units

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class FleetState:
    """Arrays over nodes (rows) and GPUs (columns); absent GPUs are padding with zero capacity."""

    def __init__(self, nodes: Sequence[devices.NodeInventory]) -> None:
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise errors.InvalidInventoryError("node names must be unique")
        self.inventories: tuple[devices.NodeInventory, ...] = tuple(nodes)
        self.names: tuple[units.NodeName, ...] = tuple(names)
        self.row_of: dict[str, int] = {name: row for row, name in enumerate(names)}
        n = len(nodes)
        g = max((node.gpu_count for node in nodes), default=0) or 1
        self.width = g
        self.cpu_capacity: IntArray = np.array([node.cpu_milli for node in nodes], dtype=np.int64)
        self.mem_capacity: IntArray = np.array([node.memory_mib for node in nodes], dtype=np.int64)
        self.gpu_count: IntArray = np.array([node.gpu_count for node in nodes], dtype=np.int64)
        self.isolation: IntArray = np.array([devices.isolation_bits(node.isolation) for node in nodes], dtype=np.int64)
        """Per node the isolation modes it offers (`devices.Isolation.bit`)."""
        self.compute_isolation: IntArray = np.array(
            [devices.isolation_bits(node.compute_isolation & node.isolation) for node in nodes], dtype=np.int64
        )
        """Per node the offered modes that enforce a pod's compute share there."""
        self.present: BoolArray = np.zeros((n, g), dtype=np.bool_)
        self.healthy: BoolArray = np.zeros((n, g), dtype=np.bool_)
        self.gmem_capacity: IntArray = np.zeros((n, g), dtype=np.int64)
        self.model_id: IntArray = np.full((n, g), -1, dtype=np.int64)
        self.model_names: list[str] = []
        self._model_index: dict[str, int] = {}
        for row, node in enumerate(nodes):
            for gpu in node.gpus:
                self.present[row, gpu.index] = True
                self.healthy[row, gpu.index] = gpu.healthy
                self.gmem_capacity[row, gpu.index] = gpu.memory_mib
                self.model_id[row, gpu.index] = self._intern_model(gpu.model)
        self.milli_capacity: IntArray = np.where(self.present, units.MILLI_PER_GPU, 0).astype(np.int64)
        self.version: IntArray = np.zeros(n, dtype=np.int64)
        self._tag_ids: dict[str, int] = {}
        self._model_tables: dict[frozenset[str], BoolArray] = {}
        self.selections: dict[str, BoolArray] = {}
        self._reset_usage()

    # ----------------------------------------------------------------- construction helpers

    def _intern_model(self, model: str) -> int:
        if model not in self._model_index:
            self._model_index[model] = len(self.model_names)
            self.model_names.append(model)
        return self._model_index[model]

    def _reset_usage(self) -> None:
        n, g = self.present.shape
        self.cpu_free: IntArray = self.cpu_capacity.copy()
        self.mem_free: IntArray = self.mem_capacity.copy()
        self.milli_free: IntArray = self.milli_capacity.copy()
        self.gmem_free: IntArray = self.gmem_capacity.copy()
        self.tenants: IntArray = np.zeros((n, g), dtype=np.int64)
        self.exclusive: IntArray = np.zeros((n, g), dtype=np.int64)
        """Per GPU: pods holding it whole (0 or 1 while the ledger's rules hold)."""
        self.claimed: IntArray = np.zeros((n, g), dtype=np.int64)
        """Per GPU: device claims holding a share of it (`Allocation.device_claim`, not whole): tenants
        that are no pod."""
        self.affinity_tag: IntArray = np.zeros((n, g), dtype=np.int64)
        self.affinity_count: IntArray = np.zeros((n, g), dtype=np.int64)
        self.exclusion_tag: IntArray = np.zeros((n, g), dtype=np.int64)
        self.exclusion_count: IntArray = np.zeros((n, g), dtype=np.int64)
        self.group_tag: IntArray = np.zeros((n, g), dtype=np.int64)
        self.group_count: IntArray = np.zeros((n, g), dtype=np.int64)
        self.anti_affinity: dict[int, IntArray] = {}
        self.node_shapes: list[Counter[tuple[int, int]]] = [Counter() for _ in range(n)]
        """Per node: how many pods of each (per-GPU milli, GPU count) shape it holds."""
        self.blocked: BoolArray = np.zeros((n, g), dtype=np.bool_)
        """Per GPU: over-committed, so it takes no new tenant (set by the ledger)."""
        self.held: IntArray = np.zeros((n, g), dtype=np.int64)
        """Per GPU: how many preempting pods keep it for themselves (`hold`); placement skips it."""

    # ----------------------------------------------------------------- lookups

    def __len__(self) -> int:
        return len(self.names)

    def row(self, node: str) -> int | None:
        return self.row_of.get(node)

    def model_ids_for(self, models: Iterable[str]) -> list[int]:
        """Ids of the named models that exist in this fleet (unknown names match no GPU)."""
        return [self._model_index[m] for m in models if m in self._model_index]

    def model_mask(self, models: Iterable[str], rows: IntArray | slice) -> BoolArray:
        """(rows, width) bool: the GPU is one of `models` (padding never is). A lookup in a table per
        set of models, made once (the fleet's models are fixed): several times faster than np.isin."""
        wanted = frozenset(models)
        table = self._model_tables.get(wanted)
        if table is None:
            table = np.zeros(len(self.model_names) + 1, dtype=np.bool_)  # the last entry: id -1, no GPU
            table[self.model_ids_for(wanted)] = True
            self._model_tables[wanted] = table
        found: BoolArray = table[self.model_id[rows]]
        return found

    def select(self, name: str, gpus: Iterable[tuple[str, int]]) -> None:
        """Name the set of GPUs `gpus` ((node, index) pairs; those the fleet does not have are left out).
        Rows whose part of the set changes get a new `version`: what was decided over the set's old
        contents is not served again from a cache."""
        mask = np.zeros(self.present.shape, dtype=np.bool_)
        for node, index in gpus:
            row = self.row_of.get(node)
            if row is not None and 0 <= index < self.width:
                mask[row, index] = True
        mask &= self.present
        old = self.selections.get(name)
        changed = mask.any(axis=1) if old is None else (mask != old).any(axis=1)
        self.version[changed] += 1
        self.selections[name] = mask

    def selection_mask(self, name: str, rows: IntArray | slice) -> BoolArray:
        """(rows, width) bool: the GPU is in the selection `name` (an unknown name selects none)."""
        found = self.selections.get(name)
        if found is None:
            return np.zeros(self.present[rows].shape, dtype=np.bool_)
        picked: BoolArray = found[rows]
        return picked

    def tag_id(self, label: str | None) -> int:
        """Integer id of a co-tenancy label (0 for none); ids are stable for the fleet's life."""
        if label is None:
            return 0
        tag = self._tag_ids.get(label)
        if tag is None:
            tag = self._tag_ids[label] = len(self._tag_ids) + 1
        return tag

    def label_of(self, tag: int) -> str | None:
        for label, value in self._tag_ids.items():
            if value == tag:
                return label
        return None

    @property
    def total_milli(self) -> int:
        return int(self.milli_capacity.sum())

    @property
    def allocated_milli(self) -> int:
        return int(self.milli_capacity.sum() - self.milli_free.sum())

    def memory_need(self, demand: requests.GpuDemand, rows: IntArray | slice) -> IntArray:
        """GPU memory (MiB) the demand needs on each GPU of `rows`, resolving memory ratios."""
        if demand.memory_permille:
            by_ratio = self.gmem_capacity[rows] * demand.memory_permille // units.PERMILLE
            return np.maximum(by_ratio, demand.memory_mib)
        return np.full(self.gmem_capacity[rows].shape, demand.memory_mib, dtype=np.int64)

    # ----------------------------------------------------------------- co-tenancy

    def cotenancy_ok(self, rules: requests.CoTenancy, rows: IntArray | slice) -> BoolArray:
        """Which GPUs of `rows` a fractional pod with `rules` may join (capacity aside)."""
        tenants = self.tenants[rows]
        empty = tenants == 0
        if rules.group is not None:
            # A group lives on one GPU: once bound, only that GPU; before, only an empty one.
            group = self.tag_id(rules.group)
            ok = self.group_tag[rows] == group if self.group_bound(group) else empty.copy()
        else:
            ok = self.group_tag[rows] == 0
        affinity = self.tag_id(rules.affinity) if rules.affinity is not None else 0
        if affinity:
            ok &= empty | ((self.affinity_tag[rows] == affinity) & (self.affinity_count[rows] == tenants))
        else:
            ok &= self.affinity_count[rows] == 0
        if rules.exclusion is not None:
            exclusion = self.tag_id(rules.exclusion)
            tag = self.exclusion_tag[rows]
            ok &= (tag == 0) | (tag == exclusion)
        if rules.anti_affinity is not None:
            counts = self.anti_affinity.get(self.tag_id(rules.anti_affinity))
            if counts is not None:
                ok &= counts[rows] == 0
        result: BoolArray = ok
        return result

    def group_bound(self, group: int) -> bool:
        return bool((self.group_tag == group).any())

    # ----------------------------------------------------------------- mutation

    def apply(self, alloc: allocation.Allocation, sign: int) -> None:
        """Add (`sign=+1`) or take back (`-1`) an allocation; the caller has checked it fits."""
        row = self.row_of[alloc.node]
        self.cpu_free[row] -= sign * alloc.cpu_milli
        self.mem_free[row] -= sign * alloc.memory_mib
        rules = alloc.cotenancy
        usage = alloc.gpu_usage()
        if usage:
            shape = (max(milli for milli, _ in usage.values()), len(usage))
            self.node_shapes[row][shape] += sign
            if self.node_shapes[row][shape] <= 0:
                del self.node_shapes[row][shape]
        for index, (milli, memory) in usage.items():
            self.milli_free[row, index] -= sign * milli
            self.gmem_free[row, index] -= sign * memory
            self.tenants[row, index] += sign
            if alloc.exclusive:
                self.exclusive[row, index] += sign
            elif alloc.device_claim:
                self.claimed[row, index] += sign
            self._mark(self.affinity_tag, self.affinity_count, row, index, rules.affinity, sign)
            self._mark(self.exclusion_tag, self.exclusion_count, row, index, rules.exclusion, sign)
            self._mark(self.group_tag, self.group_count, row, index, rules.group, sign)
            if rules.anti_affinity is not None:
                tag = self.tag_id(rules.anti_affinity)
                counts = self.anti_affinity.get(tag)
                if counts is None:
                    counts = self.anti_affinity[tag] = np.zeros(self.present.shape, dtype=np.int64)
                counts[row, index] += sign
        self.version[row] += 1

    def hold(self, row: int, indices: Iterable[int], sign: int) -> None:
        """Keep GPUs `indices` of node `row` from placement (+1), or let them go (-1)."""
        chosen = list(indices)
        self.held[row, chosen] += sign
        assert (self.held[row, chosen] >= 0).all(), f"{self.names[row]}: GPUs {chosen} were not held"
        self.version[row] += 1

    def retag(self, row: int, allocs: Iterable[allocation.Allocation]) -> None:
        """Set the co-tenancy labels of node `row`'s GPUs from its tenants `allocs` (the counts stay:
        they are sums). Needed after an over-commit: a GPU whose tenants carried different labels
        keeps the label of whichever changed last, which may be one that has left since."""
        marks = (self.affinity_tag, self.exclusion_tag, self.group_tag)
        for tags in marks:
            tags[row] = 0
        for alloc in allocs:
            rules = alloc.cotenancy
            for index in alloc.gpu_usage():
                for tags, label in zip(marks, (rules.affinity, rules.exclusion, rules.group), strict=True):
                    if label is not None:
                        tags[row, index] = self.tag_id(label)
        self.version[row] += 1

    def _mark(self, tags: IntArray, counts: IntArray, row: int, index: int, label: str | None, sign: int) -> None:
        if label is None:
            return
        counts[row, index] += sign
        tags[row, index] = self.tag_id(label) if counts[row, index] > 0 else 0

    def check(self, alloc: allocation.Allocation) -> list[str]:
        """Why `alloc` cannot be added on top of the current state (empty when it can)."""
        return [text for _, text in self.problems(alloc)]

    def problems(self, alloc: allocation.Allocation) -> list[tuple[int | None, str]]:
        """Why `alloc` cannot be added on top of the current state, each with the GPU index it is
        about (None: the node as a whole). Empty when it can."""
        row = self.row_of.get(alloc.node)
        if row is None:
            return [(None, f"node {alloc.node} is not in the inventory")]
        problems: list[tuple[int | None, str]] = []
        if alloc.cpu_milli > self.cpu_free[row]:
            problems.append((None, f"cpu: requested {alloc.cpu_milli}m, free {self.cpu_free[row]}m"))
        if alloc.memory_mib > self.mem_free[row]:
            problems.append((None, f"memory: requested {alloc.memory_mib} MiB, free {self.mem_free[row]} MiB"))
        usage = alloc.gpu_usage()
        if alloc.cotenancy.group is not None and (alloc.exclusive or len(usage) > 1):
            text = f"GPU group {alloc.cotenancy.group!r} shares one GPU; whole or several GPUs cannot join it"
            problems.append((None, text))
        rules_ok = self.cotenancy_ok(alloc.cotenancy, np.array([row]))[0]
        for index, (milli, memory) in usage.items():
            where = f"{alloc.node}/gpu{index}"
            if index >= self.width or not self.present[row, index]:
                problems.append((index, f"{where} does not exist"))
                continue
            if self.blocked[row, index]:
                problems.append((index, f"{where} is over-committed: it takes no new tenant until its tenants fit"))
            if milli > self.milli_free[row, index]:
                problems.append((index, f"{where}: compute requested {milli}, free {self.milli_free[row, index]}"))
            if memory > self.gmem_free[row, index]:
                text = f"{where}: memory requested {memory} MiB, free {self.gmem_free[row, index]} MiB"
                problems.append((index, text))
            if alloc.exclusive and self.tenants[row, index] > 0:
                problems.append((index, f"{where}: a whole GPU was asked for but it has tenants"))
            if not alloc.exclusive and not rules_ok[index]:
                problems.append((index, f"{where}: co-tenancy rules of its tenants forbid this pod"))
        return problems

    def recount(self, allocations: Iterable[allocation.Allocation]) -> FleetState:
        """A fresh state with `allocations` applied, to compare with this one (used by checks)."""
        fresh = FleetState.__new__(FleetState)
        fresh.__dict__.update(self.__dict__)
        fresh._tag_ids = dict(self._tag_ids)
        fresh.version = self.version.copy()
        fresh._reset_usage()
        for alloc in allocations:
            fresh.apply(alloc, +1)
        return fresh

    def same_usage(self, other: FleetState) -> bool:
        """Whether both hold the same usage. The labels of a blocked GPU are left out: its tenants
        may carry several, and which one the single mark shows depends on the order they came in."""
        pairs = [
            (self.cpu_free, other.cpu_free),
            (self.mem_free, other.mem_free),
            (self.milli_free, other.milli_free),
            (self.gmem_free, other.gmem_free),
            (self.tenants, other.tenants),
            (self.exclusive, other.exclusive),
            (self.claimed, other.claimed),
        ]
        clear = ~(self.blocked | other.blocked)
        labelled = [
            (self.affinity_tag, other.affinity_tag),
            (self.exclusion_tag, other.exclusion_tag),
            (self.group_tag, other.group_tag),
        ]
        same = all(np.array_equal(a, b) for a, b in pairs)
        return same and all(np.array_equal(a[clear], b[clear]) for a, b in labelled)
