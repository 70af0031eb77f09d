"""What every placement policy is: a batch of feasible nodes in, integer scores and GPU choices out,
and the helpers policies share (bit masks of GPUs, the first or best `k` eligible GPUs, the best
connected set of GPUs). `policies` holds sharegpu's own policies and the registry; `peers` the
policies other GPU-sharing schedulers ship.
"""

from __future__ import annotations

import abc
import itertools
import math
from dataclasses import dataclass
from typing import ClassVar, TypeVar, cast

import numpy as np

from sharegpu.core import devices, fleet, frag, requests

IntArray = fleet.IntArray
BoolArray = fleet.BoolArray
_BIG = np.int64(1) << 40


@dataclass(frozen=True, slots=True)
class Scores:
    score: IntArray
    """(n,) integer score 0..100 per node."""
    choice: IntArray
    """(n,) bit mask of the GPUs the pod would get on each node."""
    tiebreak: IntArray | None = None
    """(n,) optional secondary key, higher is better, consulted before the node priority."""


def bit_weights(width: int) -> IntArray:
    weights: IntArray = np.left_shift(np.int64(1), np.arange(width, dtype=np.int64))
    return weights


def mask_to_indices(mask: int) -> tuple[int, ...]:
    return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)


def masks_to_bool(masks: IntArray, width: int) -> BoolArray:
    bits: BoolArray = (masks[:, None] >> np.arange(width, dtype=np.int64)) & 1 == 1
    return bits


def first_k(eligible: BoolArray, k: int) -> IntArray:
    """Mask of the first `k` eligible GPUs of each node (lowest indices)."""
    if k == 0:
        return np.zeros(len(eligible), dtype=np.int64)
    take = eligible & (np.cumsum(eligible, axis=1) <= k)
    return np.asarray((take * bit_weights(eligible.shape[1])).sum(axis=1), dtype=np.int64)


def ordered_k(eligible: BoolArray, key: IntArray, k: int) -> IntArray:
    """Mask of the `k` eligible GPUs with the smallest `key` (lowest index on ties)."""
    n, width = eligible.shape
    if k == 0:
        return np.zeros(n, dtype=np.int64)
    keyed = np.where(eligible, key, _BIG)
    if k == 1:
        single: IntArray = np.left_shift(np.int64(1), np.argmin(keyed, axis=1).astype(np.int64))
        return single
    order = np.argsort(keyed, axis=1, kind="stable")[:, :k]
    return np.asarray(bit_weights(width)[order].sum(axis=1), dtype=np.int64)


def trunc(values: frag.FloatArray) -> IntArray:
    return np.trunc(values).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Batch:
    """What a policy scores at once: the feasible nodes `rows` of `state` for one demand, each with
    its per-GPU eligibility mask from `fit`, and the placer's random generator."""

    state: fleet.FleetState
    demand: requests.GpuDemand
    rows: IntArray
    eligible: BoolArray
    rng: np.random.Generator


class Policy(abc.ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    system: ClassVar[str] = "sharegpu"
    """Whose placement it is: sharegpu (its own, and the paper's baselines it re-implements) or, for a
    peer's, the system and the version whose behaviour it follows."""
    source: ClassVar[str] = ""
    """For a peer's policy: the document or source files it follows."""
    cacheable: ClassVar[bool] = True
    """Scores depend only on each node's own state (so they can be cached per node version)."""
    topology_refine: ClassVar[bool] = False
    """After the node is chosen, re-pick multi-GPU sets for the best interconnect."""

    @classmethod
    def create(cls, shapes: tuple[frag.WeightedShape, ...]) -> Policy:
        """A fresh instance; policies that need the typical pod shapes override this."""
        del shapes
        return cls()

    def prepare(self, state: fleet.FleetState) -> None:  # noqa: B027 - optional hook
        """Called once with the fleet the policy will score."""

    def narrow(
        self, state: fleet.FleetState, demand: requests.GpuDemand, rows: IntArray, eligible: BoolArray
    ) -> BoolArray | None:
        """The GPUs the policy itself allows among those that fit (a peer's own limits, such as a GPU
        taken by nobody else); a node left with too few of them does not fit. None: all that fit."""
        del state, demand, rows, eligible
        return None

    @abc.abstractmethod
    def score(self, batch: Batch) -> Scores:
        """Scores for the batch's feasible nodes."""


P = TypeVar("P", bound=Policy)


def variants(base: type[P], *rows: tuple[str, str, bool, bool]) -> tuple[type[P], ...]:
    """One subclass of `base` per row `(name, summary, node_pack, device_pack)`: the policies of one
    family that differ only in whether they pack or spread nodes, and the GPUs inside a node."""
    return tuple(
        cast(
            "type[P]",
            type(
                "".join(part.title() for part in name.split("-")),
                (base,),
                {
                    "name": name,
                    "summary": summary,
                    "node_pack": node_pack,
                    "device_pack": device_pack,
                    "__module__": base.__module__,
                },
            ),
        )
        for name, summary, node_pack, device_pack in rows
    )


def best_connected(
    node: devices.NodeInventory, candidates: list[int], k: int
) -> tuple[tuple[int, ...], tuple[devices.Link, int]]:
    """A set of `k` GPUs among `candidates` with the best weakest link, then the best total links.

    Exhaustive for small candidate sets, greedy from every seed otherwise.
    """
    if k <= 1 or len(candidates) <= k:
        chosen = tuple(candidates[:k])
        return chosen, _quality(node, chosen)
    if math.comb(len(candidates), k) <= 512:
        best = max(itertools.combinations(candidates, k), key=lambda c: (_quality(node, c), [-i for i in c]))
        return best, _quality(node, best)
    results = []
    for seed in candidates:
        chosen_list = [seed]
        while len(chosen_list) < k:
            rest = [c for c in candidates if c not in chosen_list]
            nxt = max(rest, key=lambda c: (min(node.link(c, x) for x in chosen_list), -c))
            chosen_list.append(nxt)
        chosen_t = tuple(sorted(chosen_list))
        results.append((_quality(node, chosen_t), chosen_t))
    quality, chosen_best = max(results, key=lambda r: (r[0], [-i for i in r[1]]))
    return chosen_best, quality


def _quality(node: devices.NodeInventory, chosen: tuple[int, ...]) -> tuple[devices.Link, int]:
    pairs = list(itertools.combinations(chosen, 2))
    if not pairs:
        return devices.Link.NVLINK, 0
    links = [node.link(a, b) for a, b in pairs]
    return min(links), sum(int(x) for x in links)
