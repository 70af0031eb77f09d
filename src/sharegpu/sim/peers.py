"""The placement other GPU-sharing schedulers ship, as policies of the simulator: what a platform team
runs today, replayed on the same traces as sharegpu's own policies.

Each is written from its system's documentation and from facts read in its sources (the file each
follows is in its `source`; no code of theirs is here) and named after its system and option:
node-level choice, then the GPUs inside the node, in sharegpu's units (a GPU's compute in milli-GPU:
HAMi's and Volcano's core percent is milli / 10; memory in MiB).

Common ground, so that only the choices differ:

- What fits is sharegpu's fit (`core.fit`): compute and memory, health, models; narrowed by a peer's
  own limits (`Policy.narrow`): HAMi's and Volcano's at most 10 pods per GPU (`deviceSplitCount`,
  their default), HAMi's `mutex`. The peers that count memory only (Aliyun, KAI) still get no GPU whose
  compute is spent.
- Memory a request asks, for peers that score memory: its MiB, or its share of the GPU's memory
  (`memory_permille`), or, when it names none (the openb traces ask compute only), the same share of
  the memory as of the compute (what a user of a memory-based system asks for half a GPU). A GPU's
  memory in use is likewise the larger of the MiB its pods hold and its compute share in use.
- Where a system leaves the node to kube-scheduler's own scoring (Aliyun's extender only filters),
  that scoring is NodeResourcesFit's default, LeastAllocated over CPU and memory. Where a system's
  GPU score is one input of kube-scheduler's weighted sum (Koordinator), it is taken alone.
- Ties a system breaks at random (Volcano's node choice, KAI's shared GPUs in map order) are broken
  at random or by lowest index here, as each class says.
"""

from __future__ import annotations

import abc
import itertools
import math
from typing import ClassVar

import numpy as np

from sharegpu.core import fleet, requests, units
from sharegpu.core.scoring import Batch, Policy, Scores, best_connected, first_k, ordered_k, trunc, variants

IntArray = fleet.IntArray
BoolArray = fleet.BoolArray
FloatArray = np.ndarray[tuple[int, ...], np.dtype[np.float64]]
SCALE = 1_000_000
"""Fixed-point scale for fractional scores turned into integer keys."""


def memory_used(batch: Batch) -> FloatArray:
    """(n, g) MiB in use per GPU of the batch's rows: the larger of what pods hold and the compute
    share in use read as the same share of the memory."""
    state, rows = batch.state, batch.rows
    cap = state.gmem_capacity[rows].astype(np.float64)
    held = cap - state.gmem_free[rows]
    share = (units.MILLI_PER_GPU - state.milli_free[rows]) * cap / units.MILLI_PER_GPU
    used: FloatArray = np.where(state.present[rows], np.maximum(held, share), 0.0)
    return used


def memory_asked(batch: Batch) -> FloatArray:
    """(n, g) MiB the request asks of each GPU of the batch's rows (module docstring)."""
    state, demand, rows = batch.state, batch.demand, batch.rows
    cap = state.gmem_capacity[rows].astype(np.float64)
    if demand.memory_mib:
        return np.full(cap.shape, float(demand.memory_mib))
    permille = demand.memory_permille or demand.milli * 1000 // units.MILLI_PER_GPU
    asked: FloatArray = cap * permille / 1000
    return asked


def _fraction(used: FloatArray | IntArray, total: FloatArray | IntArray) -> FloatArray:
    out: FloatArray = np.where(total > 0, used / np.maximum(total, 1), 0.0)
    return out


def _index_key(width: int, n: int, *, highest_first: bool) -> IntArray:
    """(n, g) the GPU index as the last key of an ordering (smaller keys come first)."""
    index = np.broadcast_to(np.arange(width, dtype=np.int64), (n, width))
    key: IntArray = (width - 1 - index) if highest_first else index.copy()
    return key


def _keyed(primary: FloatArray, width: int, *, highest_index_first: bool) -> IntArray:
    """Integer keys ordering GPUs by `primary` (ascending, smaller first), then by index."""
    n = primary.shape[0]
    fixed = np.round(primary * SCALE).astype(np.int64)
    key: IntArray = fixed * width + _index_key(width, n, highest_first=highest_index_first)
    return key


class _Slotted(Policy):
    """A peer whose device plugin splits each GPU into `split` slots, one per pod on it: a GPU whose
    slots are all taken is not offered (HAMi: pkg/device/nvidia/device.go, Fit; Volcano: vgpu/utils.go,
    a GPU whose UsedNum reached Number)."""

    split: ClassVar[int] = 10
    """deviceSplitCount (HAMi's chart) or --device-split-count (Volcano's device plugin): their default."""

    def narrow(
        self, state: fleet.FleetState, demand: requests.GpuDemand, rows: IntArray, eligible: BoolArray
    ) -> BoolArray:
        open_slots: BoolArray = eligible & (state.tenants[rows] < self.split)
        return open_slots


# ----------------------------------------------------------------------------------------------- HAMi


class _Hami(_Slotted):
    """HAMi's scheduler extender (node policy, then GPU policy; one node answered)."""

    system: ClassVar[str] = "HAMi v2.10.0"
    source: ClassVar[str] = (
        "Project-HAMi/HAMi pkg/scheduler/policy/node_policy.go and gpu_policy.go (scores, order), "
        "pkg/scheduler/score.go (fitting walk), pkg/device/nvidia/device.go (Fit)"
    )
    node_pack: ClassVar[bool]
    device_pack: ClassVar[bool]

    def score(self, batch: Batch) -> Scores:
        state, demand, rows, eligible = batch.state, batch.demand, batch.rows, batch.eligible
        present = state.present[rows]
        mem_cap = np.where(present, state.gmem_capacity[rows], 0).astype(np.float64)
        milli_used = np.where(present, units.MILLI_PER_GPU - state.milli_free[rows], 0)
        used = memory_used(batch)
        # Node: its usage before the pod, slots + compute + memory, 0..30.
        slots = _fraction(state.tenants[rows].sum(axis=1), self.split * present.sum(axis=1))
        compute = _fraction(milli_used.sum(axis=1), units.MILLI_PER_GPU * present.sum(axis=1))
        memory = _fraction(used.sum(axis=1), mem_cap.sum(axis=1))
        node = 10 * (slots + compute + memory)
        value = node if self.node_pack else 30 - node
        score = trunc(value * 100 / 30)
        tiebreak = np.round(value * SCALE).astype(np.int64)
        # GPU: its usage with the pod, sorted, walked from the end (full ties: the later index first).
        gpu = 10 * (
            (state.tenants[rows] + 1) / self.split
            + (milli_used + demand.milli) / units.MILLI_PER_GPU
            + _fraction(used + memory_asked(batch), mem_cap)
        )
        key = _keyed(-gpu if self.device_pack else gpu, state.width, highest_index_first=True)
        return Scores(score, ordered_k(eligible, key, demand.count), tiebreak)


HAMI_BINPACK_SPREAD, HAMI_BINPACK_BINPACK, HAMI_SPREAD_SPREAD, HAMI_SPREAD_BINPACK = variants(
    _Hami,
    (
        "hami-binpack-spread",
        "HAMi's default: the fullest node (slots, compute, memory), the emptiest GPU inside",
        True,
        False,
    ),
    (
        "hami-binpack-binpack",
        "HAMi, node and GPU policy binpack: the fullest node, the fullest fitting GPU",
        True,
        True,
    ),
    ("hami-spread-spread", "HAMi, node and GPU policy spread: the emptiest node, the emptiest GPU", False, False),
    ("hami-spread-binpack", "HAMi, node policy spread, GPU policy binpack", False, True),
)


class HamiBinpackMutex(_Hami):
    """HAMi's GPU policy `mutex` (node policy binpack): a GPU any pod already uses is not offered at
    all, so every pod gets GPUs of its own (its order, fewest pods first, then ties from the later
    index, reduces to the later index among the free ones)."""

    name = "hami-binpack-mutex"
    summary = "HAMi, GPU policy mutex (node binpack): only GPUs nobody uses, never shared"
    node_pack = True
    device_pack = True

    def narrow(
        self, state: fleet.FleetState, demand: requests.GpuDemand, rows: IntArray, eligible: BoolArray
    ) -> BoolArray:
        free: BoolArray = eligible & (state.tenants[rows] == 0)
        return free  # within the slots too


class HamiBinpackTopology(_Hami):
    """HAMi's GPU policy `topology-aware` (node policy binpack): one GPU goes to the card least
    connected to the others (its link scores to them sum lowest), keeping well-connected ones for
    multi-GPU pods; several go to the set whose pairwise link scores sum highest (the first such set,
    by index, on ties). Link scores here are sharegpu's link levels (NVLink > PCIe switch > NUMA)."""

    name = "hami-binpack-topology"
    summary = (
        "HAMi, GPU policy topology-aware (node binpack): best-linked GPU sets; a lone GPU on the least linked card"
    )
    node_pack = True
    device_pack = True

    def score(self, batch: Batch) -> Scores:
        base = super().score(batch)
        choice = base.choice.copy()
        for i, row in enumerate(batch.rows.tolist()):
            node = batch.state.inventories[row]
            candidates = np.flatnonzero(batch.eligible[i]).tolist()
            k = batch.demand.count
            if k == 0 or len(candidates) < k:
                continue
            if k == 1:
                others = range(node.gpu_count)
                chosen: tuple[int, ...] = (
                    min(candidates, key=lambda c: (sum(int(node.link(c, o)) for o in others if o != c), c)),
                )
            elif math.comb(len(candidates), k) > 4096:  # HAMi enumerates; past this, sharegpu's greedy search
                chosen, _ = best_connected(node, candidates, k)
            else:
                chosen = max(
                    itertools.combinations(candidates, k),
                    key=lambda combo: (sum(int(node.link(a, b)) for a, b in itertools.combinations(combo, 2)),
                                       [-c for c in combo]),
                )  # fmt: skip
            choice[i] = sum(1 << c for c in chosen)
        return Scores(base.score, choice, base.tiebreak)


class HamiBinpackNuma(_Hami):
    """HAMi's GPU policy `numa` (node policy binpack): the GPUs' only sort key is their NUMA node,
    ties by index (gpu_policy.go: a policy chain naming `numa` alone), so the fitting walk, from the
    end, takes the highest NUMA node's GPUs first, the highest index first, however used they are."""

    name = "hami-binpack-numa"
    summary = "HAMi, GPU policy numa (node binpack): the highest NUMA node's GPUs first, by index, however used"
    node_pack = True
    device_pack = True

    def __init__(self) -> None:
        self.numa: IntArray = np.zeros((0, 0), dtype=np.int64)

    def prepare(self, state: fleet.FleetState) -> None:
        self.numa = np.zeros((len(state), state.width), dtype=np.int64)
        for row, node in enumerate(state.inventories):
            for gpu in node.gpus:
                self.numa[row, gpu.index] = gpu.numa_node

    def score(self, batch: Batch) -> Scores:
        base = super().score(batch)
        width = batch.state.width
        key: IntArray = -(self.numa[batch.rows] * width + np.arange(width, dtype=np.int64))
        return Scores(base.score, ordered_k(batch.eligible, key, batch.demand.count), base.tiebreak)


# ---------------------------------------------------------------------------------------- Koordinator


class _Koordinator(Policy):
    """Koordinator's DeviceShare plugin: LeastAllocated or MostAllocated over GPU memory (its default
    scored resources are gpu-memory-ratio and gpu-memory, weight 1 each; gpu-core is not scored), for
    the node and, in the default allocation path, for each GPU (ties: lowest minor)."""

    system: ClassVar[str] = "Koordinator v1.8.0"
    source: ClassVar[str] = (
        "koordinator-sh/koordinator pkg/scheduler/plugins/deviceshare/scoring.go (node), device_allocator.go "
        "and device_resources.go (GPU order), apis/config/v1/defaults.go (LeastAllocated, resources)"
    )
    most_allocated: ClassVar[bool]

    def _strategy(self, requested: FloatArray, capacity: FloatArray) -> FloatArray:
        cap = np.maximum(capacity, 1e-9)
        if self.most_allocated:
            out: FloatArray = np.minimum(requested, capacity) * 100 / cap
        else:
            out = np.where(requested > capacity, 0.0, (capacity - requested) * 100 / cap)
        return np.where(capacity > 0, np.floor(out), 0.0)

    def score(self, batch: Batch) -> Scores:
        state, demand, rows, eligible = batch.state, batch.demand, batch.rows, batch.eligible
        present = state.present[rows]
        mem_cap = np.where(present, state.gmem_capacity[rows], 0).astype(np.float64)
        used = memory_used(batch)
        asked = memory_asked(batch)
        ratio_cap = np.where(present, 100.0, 0.0)
        ratio_used = _fraction(used, mem_cap) * 100
        ratio_asked = _fraction(asked, mem_cap) * 100
        # Node: requested = in use + one GPU's request (not times the count), per resource, averaged.
        per_gpu_mem = asked.max(axis=1)
        per_gpu_ratio = ratio_asked.max(axis=1)
        node = (
            self._strategy(ratio_used.sum(axis=1) + per_gpu_ratio, ratio_cap.sum(axis=1))
            + self._strategy(used.sum(axis=1) + per_gpu_mem, mem_cap.sum(axis=1))
        ) // 2
        # GPU: the same formula on each GPU alone; highest score first, then lowest minor.
        gpu = (self._strategy(ratio_used + ratio_asked, ratio_cap) + self._strategy(used + asked, mem_cap)) // 2
        key = _keyed(-gpu, state.width, highest_index_first=False)
        choice = first_k(eligible, demand.count) if demand.whole else ordered_k(eligible, key, demand.count)
        return Scores(node.astype(np.int64), choice)


class KoordinatorSpread(_Koordinator):
    name = "koordinator-spread"
    summary = "Koordinator's default (LeastAllocated on GPU memory): the emptiest node, the emptiest GPU"
    most_allocated = False


class KoordinatorBinpack(_Koordinator):
    name = "koordinator-binpack"
    summary = "Koordinator with MostAllocated on GPU memory: the fullest node, the fullest fitting GPU"
    most_allocated = True


# -------------------------------------------------------------------------------------------- Volcano


class _Volcano(_Slotted):
    """Volcano's vGPU (deviceshare plugin): the GPU order of its schedule policy, and a node score only
    where that policy gives one; the best nodes are tied, and Volcano picks among them at random."""

    system: ClassVar[str] = "Volcano v1.15.1"
    source: ClassVar[str] = (
        "volcano-sh/volcano pkg/scheduler/api/devices/nvidia/vgpu/utils.go (GPU order, GPUScore), "
        "device_info.go (node score), pkg/scheduler/plugins/deviceshare/deviceshare.go (arguments)"
    )
    cacheable = False

    @abc.abstractmethod
    def order(self, batch: Batch, used: FloatArray) -> IntArray:
        """(n, g) keys: smaller first."""

    def node_score(self, batch: Batch, used: FloatArray, choice: IntArray) -> IntArray:
        return np.zeros(len(batch.rows), dtype=np.int64)

    def score(self, batch: Batch) -> Scores:
        used = memory_used(batch)
        choice = ordered_k(batch.eligible, self.order(batch, used), batch.demand.count)
        tiebreak = batch.rng.integers(0, 1 << 30, len(batch.rows)).astype(np.int64)
        return Scores(self.node_score(batch, used, choice), choice, tiebreak)


class VolcanoDefault(_Volcano):
    name = "volcano"
    summary = "Volcano's default (no schedule policy, weight 0): GPUs from the highest index; a random fitting node"

    def order(self, batch: Batch, used: FloatArray) -> IntArray:
        return _index_key(batch.state.width, len(batch.rows), highest_first=True)


class VolcanoBinpack(_Volcano):
    name = "volcano-binpack"
    summary = "Volcano, schedule policy binpack: the GPU with the most memory in use; nodes by it"

    def order(self, batch: Batch, used: FloatArray) -> IntArray:
        return _keyed(-used, batch.state.width, highest_index_first=False)

    def node_score(self, batch: Batch, used: FloatArray, choice: IntArray) -> IntArray:
        cap = batch.state.gmem_capacity[batch.rows]
        after = _fraction(used + memory_asked(batch), cap) * 100
        bits = (choice[:, None] >> np.arange(batch.state.width, dtype=np.int64)) & 1 == 1
        total = np.where(bits, after, 0.0).sum(axis=1) / max(batch.demand.count, 1)
        score: IntArray = np.round(total).astype(np.int64)
        return score


class VolcanoSpread(_Volcano):
    name = "volcano-spread"
    summary = "Volcano, schedule policy spread: the GPU with the fewest pods; its node score is always 0"

    def order(self, batch: Batch, used: FloatArray) -> IntArray:
        tenants = batch.state.tenants[batch.rows].astype(np.float64)
        return _keyed(tenants, batch.state.width, highest_index_first=False)


# --------------------------------------------------------------------------------------------- Aliyun


class AliyunGpushare(Policy):
    name = "aliyun-gpushare"
    summary = (
        "Aliyun gpushare: the node by kube-scheduler's LeastAllocated (CPU, memory); the GPU with least free memory"
    )
    system: ClassVar[str] = "Aliyun gpushare-scheduler-extender v0.2.0"
    source: ClassVar[str] = (
        "AliyunContainerService/gpushare-scheduler-extender pkg/cache/nodeinfo.go (allocateGPUID), "
        "pkg/scheduler/predicate.go (filter only: no prioritize verb)"
    )

    def score(self, batch: Batch) -> Scores:
        state, demand, rows, eligible = batch.state, batch.demand, batch.rows, batch.eligible
        cpu_cap = np.maximum(state.cpu_capacity[rows], 1)
        mem_cap = np.maximum(state.mem_capacity[rows], 1)
        cpu_left = (state.cpu_free[rows] - demand.cpu_milli) * 100 // cpu_cap
        mem_left = (state.mem_free[rows] - demand.host_memory_mib) * 100 // mem_cap
        score = (cpu_left + mem_left) // 2
        if demand.count != 1 or demand.whole:
            return Scores(score.astype(np.int64), first_k(eligible, demand.count))  # whole GPUs: the device plugin
        free = state.gmem_capacity[rows] - memory_used(batch)
        return Scores(
            score.astype(np.int64), ordered_k(eligible, _keyed(free, state.width, highest_index_first=False), 1)
        )


# ------------------------------------------------------------------------------------------------ KAI


class _Kai(Policy):
    """KAI scheduler: nodes by the sum of its plugins' scores (ties: node name ascending), fractions on
    shared GPUs that already hold fractions or on a whole idle GPU, memory only."""

    system: ClassVar[str] = "KAI Scheduler v0.13.0"
    source: ClassVar[str] = (
        "NVIDIA/KAI-Scheduler pkg/scheduler/plugins/nodeplacement (pack.go, spread.go), gpupack, gpuspread, "
        "gpusharingorder, pkg/scheduler/framework/session.go (FittingGPUs, node order)"
    )
    cacheable = False
    """The binpack score compares a node with the others of the batch."""
    shares_first: ClassVar[bool]
    """A node with a shared GPU the fraction fits comes first (gpusharingorder, binpack only)."""

    def __init__(self) -> None:
        self.name_rank: IntArray = np.zeros(0, dtype=np.int64)

    def prepare(self, state: fleet.FleetState) -> None:
        order = np.argsort(np.array([str(n) for n in state.names]), kind="stable")
        self.name_rank = np.empty(len(order), dtype=np.int64)
        self.name_rank[order] = np.arange(len(order), dtype=np.int64)

    @abc.abstractmethod
    def _nodes(self, batch: Batch, idle: IntArray, gpus: IntArray) -> FloatArray:
        """Per node, its score before the shared-GPU bonus."""

    @abc.abstractmethod
    def _gpu_key(self, used_fraction: FloatArray, idle: IntArray, width: int) -> IntArray:
        """(n, g) keys ordering a fraction's GPUs: smaller first."""

    def score(self, batch: Batch) -> Scores:
        state, demand, rows, eligible = batch.state, batch.demand, batch.rows, batch.eligible
        present = state.present[rows]
        idle_gpu = present & (state.tenants[rows] == 0)
        idle = idle_gpu.sum(axis=1)
        node = self._nodes(batch, idle, present.sum(axis=1))
        if demand.whole or demand.count == 0:
            choice = first_k(eligible & idle_gpu, demand.count)
            return Scores(trunc(node), choice, -self.name_rank[rows])
        cap = state.gmem_capacity[rows]
        used_fraction = _fraction(memory_used(batch), cap)
        shared_fits = eligible & ~idle_gpu
        key = self._gpu_key(used_fraction, idle_gpu.astype(np.int64), state.width)
        choice = ordered_k(eligible, key, demand.count)
        bonus = np.where(shared_fits.any(axis=1), 50.0, 0.0) if self.shares_first else 0.0
        return Scores(trunc(node + bonus), choice, -self.name_rank[rows])


class KaiBinpack(_Kai):
    name = "kai-binpack"
    summary = (
        "KAI's default (binpack): nodes with a shared GPU the fraction fits, then fewest idle GPUs; fullest shared GPU"
    )
    shares_first = True

    def _nodes(self, batch: Batch, idle: IntArray, gpus: IntArray) -> FloatArray:
        # Idle GPUs scaled between the fewest and the most among the nodes that have GPUs; nothing
        # idle anywhere: 0; all alike: the top score (pack.go: getScoreOfCurrentNode, getMinMaxPerNode).
        with_gpus = idle[gpus > 0]
        low, high = (int(with_gpus.min()), int(with_gpus.max())) if len(with_gpus) else (0, 0)
        if high == 0:
            packed: FloatArray = np.zeros(len(idle), dtype=np.float64)
        elif high == low:
            packed = np.full(len(idle), 9.0)
        else:
            packed = 9.0 * (1 - (idle - low) / (high - low))
        out: FloatArray = np.where(gpus > 0, packed * 5, 0.0)  # 0..45, below the shared-GPU bonus
        return out

    def _gpu_key(self, used_fraction: FloatArray, idle: IntArray, width: int) -> IntArray:
        # Shared GPUs by their used portion, fullest first; an idle GPU scores 0 (last).
        score = np.where(idle == 1, 0.0, used_fraction)
        return _keyed(-score, width, highest_index_first=False)


class KaiSpread(_Kai):
    name = "kai-spread"
    summary = "KAI, placement strategy spread: the node with the most idle GPUs per GPU; an idle GPU, else the emptiest"
    shares_first = False

    def _nodes(self, batch: Batch, idle: IntArray, gpus: IntArray) -> FloatArray:
        out: FloatArray = np.where(gpus > 0, idle * 100 / np.maximum(gpus, 1), 0.0)
        return out

    def _gpu_key(self, used_fraction: FloatArray, idle: IntArray, width: int) -> IntArray:
        score = np.where(idle == 1, 1.0, 1.0 - used_fraction)
        return _keyed(-score, width, highest_index_first=False)


PEERS: tuple[type[Policy], ...] = (
    HAMI_BINPACK_SPREAD,
    HAMI_BINPACK_BINPACK,
    HAMI_SPREAD_SPREAD,
    HAMI_SPREAD_BINPACK,
    HamiBinpackTopology,
    HamiBinpackMutex,
    HamiBinpackNuma,
    KoordinatorSpread,
    KoordinatorBinpack,
    VolcanoDefault,
    VolcanoBinpack,
    VolcanoSpread,
    AliyunGpushare,
    KaiBinpack,
    KaiSpread,
)
DEFAULTS: tuple[str, ...] = ("hami-binpack-spread", "koordinator-spread", "volcano", "aliyun-gpushare", "kai-binpack")
"""Each system's default, in the order the tables print them."""
