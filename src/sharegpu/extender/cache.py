"""The extender's view of the cluster, rebuilt from the API server and kept current by informers.

Inventory: one Device per node (its GPUs) and the Node (allocatable CPU and memory, readiness).
Usage: every pod bound to a node, in the `Ledger` (GPU allocations from the pods' allocation
annotations; whole-GPU pods of other schedulers on free GPUs; host CPU and memory of all pods).
Decisions still waiting for their binding are *assumed* entries: they survive inventory rebuilds,
are confirmed when the bound pod comes back through the watch, and are forgotten exactly once when
the bind fails (`forget`) or, if neither ever happens, when they expire (`stale_assumptions`).

Pods are kept as `api.pods.Record`s (the facts placement needs, parsed once per event), not as the
objects themselves. Reservation pods are kept apart (`reservations`): the reservation reconciler
decides about them; the cache only says which GPUs they share (`shared_slots`). DRA
claims are kept in their own tables (`claims`, `extender.claims`): what those of sharegpu's driver
hold goes into the same ledger as the pods. DeviceTaintRules (`taint_rules`) count the GPUs of DRA
nodes they taint unhealthy in the fleet; the allocator lets a claim that tolerates the taints onto
them (`tolerated`). Device selectors (sharegpu's DeviceClass's, `class_selectors`, and a claim's)
name the set of DRA GPUs they all pick in the fleet (`selection`), each node's devices judged once
per version of its Device.

Everything here runs in one event loop and nothing awaits: handlers and decisions never interleave.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from sharegpu.api import constraints, dra, pods, selectors, wire
from sharegpu.api import devices as api_devices
from sharegpu.core import allocation, devices, errors, fleet, frag, placer, policies, units
from sharegpu.core import ledger as core_ledger
from sharegpu.extender import claims as claim_tables
from sharegpu.extender import lookup

log = logging.getLogger(__name__)
Placer = placer.Placer  # the class's `placer` property hides the module inside the class body
PLACEMENTS = frozenset({"binpack", "spread"})
"""The placements a pod may ask for instead of the configured policy."""

# Shapes FGD assumes until the cluster has shown enough of its own pods (1/4, 1/2 and whole GPUs).
DEFAULT_SHAPES = (
    frag.WeightedShape(frag.Shape(0, 250, 1), 0.2),
    frag.WeightedShape(frag.Shape(0, 500, 1), 0.3),
    frag.WeightedShape(frag.Shape(0, units.MILLI_PER_GPU, 1), 0.35),
    frag.WeightedShape(frag.Shape(0, units.MILLI_PER_GPU, 2), 0.1),
    frag.WeightedShape(frag.Shape(0, units.MILLI_PER_GPU, 8), 0.05),
)
MIN_LEARNED_SHAPES = 50
"""Pods the cluster must hold before FGD uses their shapes instead of DEFAULT_SHAPES."""


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """A Device resource as placement needs it (parsed once per event)."""

    name: str
    gpus: tuple[devices.GpuDevice, ...]
    nvlinks: frozenset[tuple[int, int]]
    problem: str | None = None
    isolation: frozenset[devices.Isolation] = frozenset()
    compute_isolation: frozenset[devices.Isolation] = frozenset()
    dra: bool = False
    """The node serves DRA claims only (`wire.DeviceSpec.dra`): no pod is placed there."""
    selectable: tuple[tuple[int, selectors.Device], ...] = ()
    """A DRA node's GPUs (by index) as device selectors see them: the devices of the slice its agent
    publishes (`api.dra.device`)."""


def device_record(device: wire.Device, previous: DeviceRecord | None = None) -> DeviceRecord:
    try:
        found, links = api_devices.gpus(device)
        modes = api_devices.isolation_modes(device)
        compute = api_devices.compute_modes(device)
    except errors.InvalidInputError as exc:
        return DeviceRecord(device.metadata.name, (), frozenset(), str(exc))
    selectable: tuple[tuple[int, selectors.Device], ...] = ()
    if device.spec.dra:
        try:
            selectable = tuple(
                (g.index, selectors.Device.of(dra.DRIVER, dra.device(g, device.spec.nvlinks))) for g in device.spec.gpus
            )
        except errors.InvalidInputError as exc:
            return DeviceRecord(device.metadata.name, (), frozenset(), str(exc))
    return DeviceRecord(
        device.metadata.name, found, links, isolation=modes, compute_isolation=compute, dra=device.spec.dra,
        selectable=selectable,
    )  # fmt: skip


def node_record(node: wire.Node, previous: api_devices.NodeFacts | None = None) -> api_devices.NodeFacts:
    return api_devices.node_facts(node)


@dataclass
class Counters:
    conflicts: int = 0
    """Bound pods that did not fit the ledger when they came (the API and the ledger disagreed; the
    ledger counted them all the same, and blocks the GPUs they over-commit)."""
    invalid: int = 0
    """Pods with an unreadable allocation annotation."""
    rebuilds: int = 0
    expired: int = 0
    """Assumptions forgotten because their bind never completed."""
    ignored_nodes: list[str] = field(default_factory=list)


MATCH_GROUPS = 64
"""The most groups of GPUs with one value of a claim's `matchAttribute` attributes the allocator tries."""


@dataclass(frozen=True, slots=True)
class Selection:
    """A set of GPUs device selectors picked (`ClusterCache.selection`)."""

    name: str
    """Its name in the fleet (`GpuDemand.selection`)."""
    failures: tuple[str, ...]
    """Per device a selector failed on: where, which and why (a device that fails is not picked)."""


def _judged(
    node: str, record: DeviceRecord, chosen: tuple[selectors.Selector, ...]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    picked: list[int] = []
    failed: list[str] = []
    for index, device in record.selectable:
        for selector in chosen:
            verdict = selector.judge(device)
            if verdict.error:
                failed.append(f"{node}/{dra.device_name(index)}: {selector.expression!r}: {verdict.error}")
                break
            if not verdict.matches:
                break
        else:
            picked.append(index)
    return tuple(picked), tuple(failed)


class ClusterCache:
    def __init__(
        self,
        policy: str = policies.DEFAULT,
        clock: Callable[[], float] = time.monotonic,
        shapes: tuple[frag.WeightedShape, ...] | None = None,
    ) -> None:
        self.policy_name = policies.check(policy)
        self.fixed_shapes = shapes
        """Typical pod shapes for fragmentation-aware policies; None: learn them from the cluster's pods."""
        self.clock = clock
        self.nodes: dict[str, api_devices.NodeFacts] = {}
        self.devices: dict[str, DeviceRecord] = {}
        self.pods: dict[units.PodKey, pods.Record] = {}
        self.reservations: dict[units.PodKey, pods.Record] = {}
        self.pods_on: Counter[str] = Counter()
        """Pods bound to each node that have not ended, reservations included (what its pod capacity,
        `allocatable.pods`, is counted against)."""
        self.claims = claim_tables.ClaimTable()
        """DRA claims (`extender.claims`): what those of sharegpu's driver hold is counted in the ledger."""
        self.claiming: set[units.PodKey] = set()
        """Pods with `spec.resourceClaims` or sharegpu's scheduling gate that are not bound yet (nor
        finished, nor being deleted)."""
        self.handoff_pods: set[units.PodKey] = set()
        """Pods that name a hand-off ConfigMap (the only ones the hand-off reconciler looks at)."""
        self.pending: set[units.PodKey] = set()
        """Pods that ask for a GPU and are not bound yet (nor finished, nor being deleted)."""
        self.gangs: dict[str, set[units.PodKey]] = {}
        """Gang (`api.gangs.Gang.key`) -> the pods that state it, in any phase."""
        self.assumed: dict[units.PodKey, allocation.Allocation] = {}
        self.aside: dict[units.PodKey, float] = {}
        """Assumed pods whose allocation no longer fitted at a rebuild (their node left the inventory,
        or changed) -> since when: kept in `assumed`, and in the ledger where their node and GPUs
        still exist (counted, over-committing them), applied again at each rebuild, until settled,
        forgotten or expired. A binding whose outcome is unknown may still land there; a bind of the
        pod's own does not use it (`counts_assumed`)."""
        self.assumed_at: dict[units.PodKey, float] = {}
        """When each assumption was made: a rebuild keeps its age, so it still expires."""
        self.assumed_uid: dict[units.PodKey, str] = {}
        """The UID of the pod each assumption is for ("" where not told): an event of another pod of that
        name (its predecessor, deleted or ended late) does not touch it."""
        self.confirmed: dict[units.PodKey, allocation.Allocation] = {}
        """Pods a read showed bound (a binding whose answer was lost), or whose binding this process
        wrote, before the watch does: held against older views of them and across rebuilds until the
        watch shows them bound or gone (or a read, `assume_ttl` later, finds them not there)."""
        self.confirmed_at: dict[units.PodKey, float] = {}
        """When each of `confirmed` was confirmed (by `clock`)."""
        self.freed_at = 0.0
        """When (by `clock`) room last appeared: a placed pod gone or finished, an assumption
        forgotten, a hold released, a node or Device changed."""
        self.holds: dict[units.PodKey, tuple[str, tuple[int, ...]]] = {}
        """Pods that preempted others -> the node and GPUs kept for them (`hold`)."""
        self.counters = Counters()
        self._dirty = True
        self._state: fleet.FleetState | None = None
        self._ledger: core_ledger.Ledger | None = None
        self._placer: placer.Placer | None = None
        self._overrides: dict[str, Placer] = {}
        self._names: lookup.NameIndex | None = None
        self.taint_rules: dict[str, dra.TaintRule] = {}
        """DeviceTaintRules by name (where the API serves them)."""
        self.taints: dict[tuple[str, int], tuple[tuple[str, dra.DeviceTaint], ...]] = {}
        """(node, GPU index) of a DRA node -> the (rule, taint) pairs that keep new claims off it
        (NoSchedule, NoExecute), as of the last rebuild. The fleet counts such a GPU unhealthy; the
        allocator lets a claim that tolerates them all onto it (`tolerated`)."""
        self.class_selectors: tuple[selectors.Selector, ...] = ()
        """The selectors of sharegpu's DeviceClass its allocator applies (`api.dra.class_selectors`)."""
        self.class_problem: str | None = None
        """Why the class's selectors cannot be applied (one does not compile here): no claim is placed."""
        self._verdicts: dict[tuple[str, str], tuple[DeviceRecord, tuple[int, ...], tuple[str, ...]]] = {}
        self._selected: dict[str, tuple[str, ...]] = {}
        self._selected_in: int = 0
        self._dra_nodes: frozenset[str] = frozenset()
        self.dra_rows: fleet.BoolArray = np.zeros(0, dtype=np.bool_)
        """Fleet rows of nodes that serve DRA claims only (the allocator's); `pod_rows` the others."""
        self.pod_rows: fleet.BoolArray = np.zeros(0, dtype=np.bool_)

    # ----------------------------------------------------------------- the fleet, rebuilt on demand

    def _inventory(self) -> list[devices.NodeInventory]:
        out = []
        ignored = []
        dra_nodes: set[str] = set()
        taints: dict[tuple[str, int], tuple[tuple[str, dra.DeviceTaint], ...]] = {}
        for name, device in sorted(self.devices.items()):
            node = self.nodes.get(name)
            if node is None or not node.schedulable:
                continue
            if device.problem is not None:
                ignored.append(name)
                log.error("ignoring node %s: %s", name, device.problem)
                continue
            gpus = device.gpus
            if device.dra:
                dra_nodes.add(name)  # its GPUs go to DRA claims only: one path per node
                gpus, tainted = self._tainted(name, gpus)
                taints.update(tainted)
            try:
                out.append(
                    devices.NodeInventory(
                        units.NodeName(name),
                        units.MilliCpu(node.cpu_milli),
                        units.MiB(node.memory_mib),
                        gpus,
                        device.nvlinks,
                        device.isolation,
                        device.compute_isolation,
                    )
                )
            except errors.InvalidInputError as exc:
                ignored.append(name)
                log.error("ignoring node %s: %s", name, exc)
        self.counters.ignored_nodes = ignored
        self._dra_nodes = frozenset(dra_nodes)
        self.taints = taints
        return out

    def _tainted(
        self, node: str, gpus: tuple[devices.GpuDevice, ...]
    ) -> tuple[tuple[devices.GpuDevice, ...], dict[tuple[str, int], tuple[tuple[str, dra.DeviceTaint], ...]]]:
        """A DRA node's GPUs with those the DeviceTaintRules keep new claims off counted unhealthy,
        and those taints per GPU."""
        if not self.taint_rules:
            return gpus, {}
        found: dict[tuple[str, int], tuple[tuple[str, dra.DeviceTaint], ...]] = {}
        out = []
        for gpu in gpus:
            pairs = tuple(
                (name, rule.spec.taint)
                for name, rule in sorted(self.taint_rules.items())
                if rule.spec.taint.effect in dra.KEEPING_OFF and rule.selects(node, gpu.index)
            )
            if pairs:
                found[(node, gpu.index)] = pairs
            out.append(dataclasses.replace(gpu, healthy=False) if pairs and gpu.healthy else gpu)
        return tuple(out), found

    def on_taint_rule(self, kind: wire.EventType, rule: dra.TaintRule) -> None:
        """A DeviceTaintRule as the watch shows it: the fleet is rebuilt with its taints."""
        name = rule.metadata.name
        if kind == wire.EventType.DELETED:
            if self.taint_rules.pop(name, None) is None:
                return
            self.freed_at = self.clock()
        else:
            if self.taint_rules.get(name) == rule:
                return
            self.taint_rules[name] = rule
        self._dirty = True

    def on_device_class(self, kind: wire.EventType, found: dra.DeviceClass) -> None:
        """A DeviceClass as the watch shows it: sharegpu's gives the selectors every claim's GPUs pass."""
        if found.metadata.name != dra.CLASS:
            return
        chosen: tuple[selectors.Selector, ...] = ()
        problem = None
        if kind != wire.EventType.DELETED:
            try:
                chosen = dra.class_selectors(found)
            except errors.InvalidInputError as exc:
                problem = str(exc)
        self.class_selectors, self.class_problem = chosen, problem

    def selection(self, chosen: tuple[selectors.Selector, ...]) -> Selection:
        """The set of DRA GPUs every one of `chosen` picks, named in the fleet (`FleetState.select`),
        with what failed on the devices that it left out. Judged as kube-scheduler judges a device:
        the selectors in order, the first that does not match or fails decides."""
        state = self.state
        name = "cel:" + hashlib.sha256("\0".join(s.expression for s in chosen).encode()).hexdigest()[:16]
        if self._selected_in != id(state):
            self._selected, self._selected_in = {}, id(state)
        found = self._selected.get(name)
        if found is not None and name in state.selections:
            return Selection(name, found)
        if len(self._verdicts) > 200_000:  # selections long gone, nodes long changed
            self._verdicts.clear()
        picked: list[tuple[str, int]] = []
        failed: list[str] = []
        for node, record in self.devices.items():
            if not record.dra or state.row(node) is None:
                continue
            memo = self._verdicts.get((name, node))
            if memo is None or memo[0] is not record:
                memo = (record, *_judged(node, record, chosen))
                self._verdicts[(name, node)] = memo
            picked += [(node, index) for index in memo[1]]
            failed += memo[2]
        state.select(name, picked)
        self._selected[name] = tuple(failed)
        return Selection(name, tuple(failed))

    def matching(self, attributes: tuple[str, ...], within: Selection | None) -> list[Selection]:
        """The DRA GPUs (of `within`; all: None) grouped by the values they have of `attributes`
        (fully qualified; a GPU lacking one is in no group), each group named in the fleet: largest
        first, at most `MATCH_GROUPS`. A claim with `matchAttribute` gets its GPUs from one group."""
        state = self.state
        digest = hashlib.sha256("\0".join((within.name if within else "", *attributes)).encode())
        key = f"match:{digest.hexdigest()[:16]}"
        groups: dict[tuple[str, ...], list[tuple[str, int]]] = {}
        for node, record in self.devices.items():
            row = state.row(node)
            if not record.dra or row is None:
                continue
            allowed = state.selection_mask(within.name, np.array([row]))[0] if within else None
            for index, device in record.selectable:
                if allowed is not None and not allowed[index]:
                    continue
                values = [device.value_of(name) for name in attributes]
                if all(v is not None for v in values):
                    groups.setdefault(tuple(str(v) for v in values), []).append((node, index))
        out = []
        ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))[:MATCH_GROUPS]
        for i, (_, gpus) in enumerate(ordered):
            name = f"{key}:{i}"
            state.select(name, gpus)
            out.append(Selection(name, within.failures if within else ()))
        return out

    def tolerated(self, claim: dra.ClaimRecord) -> list[tuple[str, int]]:
        """The (node, GPU index) of GPUs kept off only by taints `claim` tolerates, and healthy
        otherwise (the agent's own health is not tolerated: an unhealthy GPU takes no claim)."""
        out = []
        for (node, index), pairs in self.taints.items():
            if all(claim.tolerates(taint) for _, taint in pairs) and self._healthy(node, index):
                out.append((node, index))
        return out

    def _healthy(self, node: str, index: int) -> bool:
        device = self.devices.get(node)
        return device is not None and any(g.index == index and g.healthy for g in device.gpus)

    def rebuild(self) -> None:
        """New fleet arrays from the inventory, then every bound pod and assumed decision re-applied."""
        state = fleet.FleetState(self._inventory())
        self._state = state
        self.dra_rows = np.array([n in self._dra_nodes for n in state.names], dtype=np.bool_)
        self.pod_rows = ~self.dra_rows
        self._ledger = core_ledger.Ledger(state, clock=self.clock)
        self._placer = placer.Placer(
            state, policies.make(self.policy_name, self._shapes()), priority=stable_priority(state.names)
        )
        self._overrides = {}
        self._names = None
        self._dirty = False
        self.counters.rebuilds += 1
        # Pods that carry their allocation go in at once (after a restart: tens of thousands); then
        # the rest, among them whole-GPU pods of other schedulers, which take the GPUs left free.
        recorded: list[pods.Record] = []
        rest: list[pods.Record] = []
        for record in self.pods.values():
            alloc = record.allocation
            usable = (
                alloc is not None and record.live and alloc.node == record.node and state.row(record.node) is not None
            )
            (recorded if usable else rest).append(record)
        results = self._ledger.load([r.allocation for r in recorded if r.allocation is not None])
        for record, result in zip(recorded, results, strict=True):
            if not result.ok:
                self.counters.conflicts += 1
                log.error("pod %s on %s conflicts with the ledger: %s", record.key, record.node, result.message)
        for record in rest:
            self._account(record)
        for alloc in self.claims.held.values():
            self._add_claim(self._ledger, alloc)
        for key, alloc in list(self.claims.assumed.items()):
            # Its write may land: counted all the same (its GPU then over-committed), or the room would
            # be given to another while the write goes on.
            if key not in self._ledger and not self._ledger.assume(alloc, force=True).ok:
                log.warning("claim %s being allocated no longer fits after the inventory changed", key)
        for node, gpus in self.holds.values():
            self._hold(state, node, gpus, +1)
        for key, alloc in self.confirmed.items():
            if key not in self._ledger and not self._ledger.add(alloc).ok:
                self.counters.conflicts += 1
                log.error("pod %s, read back bound on %s, conflicts with the ledger", key, alloc.node)
        self.aside = {key: at for key, at in self.aside.items() if key in self.assumed}
        for key, alloc in list(self.assumed.items()):
            if key in self._ledger:
                continue
            since = self.assumed_at.get(key)
            if self._ledger.assume(alloc, since=since).ok:
                self.aside.pop(key, None)
                continue
            # Its binding may be under way, or its answer lost: where its node and GPUs still exist it
            # is counted all the same (those GPUs over-committed, so nothing more lands there), and a
            # bind of its own decides again.
            self._ledger.assume(alloc, since=since, force=True)
            if key not in self.aside:
                log.warning("assumed pod %s no longer fits after the inventory changed; kept aside", key)
                self.aside[key] = self.clock()

    def _shapes(self) -> tuple[frag.WeightedShape, ...]:
        if self.fixed_shapes:
            return self.fixed_shapes
        shapes = [
            frag.Shape(r.request.demand.cpu_milli, r.request.demand.milli, r.request.demand.count,
                       tuple(sorted(r.request.demand.models)))
            for r in self.pods.values()
            if r.request is not None and r.request.demand.count
        ]  # fmt: skip
        return frag.typical_shapes(shapes) if len(shapes) >= MIN_LEARNED_SHAPES else DEFAULT_SHAPES

    @property
    def state(self) -> fleet.FleetState:
        if self._dirty or self._state is None:
            self.rebuild()
        assert self._state is not None
        return self._state

    @property
    def ledger(self) -> core_ledger.Ledger:
        self.state  # noqa: B018 - rebuild if needed
        assert self._ledger is not None
        return self._ledger

    @property
    def placer(self) -> placer.Placer:
        self.state  # noqa: B018
        assert self._placer is not None
        return self._placer

    def placer_for(self, placement: str | None) -> Placer:
        """The placer of a pod that asks for `binpack` or `spread` placement (`api.names.PLACEMENT`; a
        SharedDeviceGroup's holder does), over the same fleet state; the configured policy's otherwise."""
        if placement not in PLACEMENTS:
            return self.placer
        state = self.state
        found = self._overrides.get(placement)
        if found is None:
            found = placer.Placer(state, policies.make(placement), priority=stable_priority(state.names))
            self._overrides[placement] = found
        return found

    def allocations(self) -> list[allocation.Allocation]:
        """Every allocation held or assumed now (the ledger of the current fleet state)."""
        return self.ledger.allocations()

    def name_index(self) -> lookup.NameIndex:
        """Every node's name with its fleet row (-1 for a node the fleet does not place on), for
        mapping kube-scheduler's candidate lists; built once per fleet state."""
        state = self.state
        if self._names is None:
            others = [n for n in self.nodes if n not in state.row_of]
            rows = [-1 if dra else r for r, dra in enumerate(self.dra_rows.tolist())]  # DRA-only: not for pods
            self._names = lookup.NameIndex([*state.names, *others], [*rows, *(-1 for _ in others)])
        return self._names

    # ----------------------------------------------------------------- informer handlers

    def on_node(self, kind: wire.EventType, node: api_devices.NodeFacts) -> None:
        old = self.nodes.get(node.name)
        if kind == wire.EventType.DELETED:
            self.nodes.pop(node.name, None)
            self._dirty = True
            return
        self.nodes[node.name] = node
        if old != node:
            self._dirty = True
            self.freed_at = self.clock()

    def on_device(self, kind: wire.EventType, device: DeviceRecord) -> None:
        if kind == wire.EventType.DELETED:
            self.devices.pop(device.name, None)
        else:
            old = self.devices.get(device.name)
            self.devices[device.name] = device
            if old == device:
                return
            self.freed_at = self.clock()
        self._dirty = True

    def on_pod(self, kind: wire.EventType, record: pods.Record) -> None:
        key = record.key
        previous = self.pods.get(key) or self.reservations.get(key)  # what was counted for it
        stale = previous is not None and previous.node and not record.node and previous.uid == record.uid
        if kind != wire.EventType.DELETED and stale:
            return  # an older view (a relist from a lagging cache): a bound pod is never unbound
        if previous is not None and previous.node and not previous.terminal:
            self.pods_on[previous.node] -= 1
            if not self.pods_on[previous.node]:
                del self.pods_on[previous.node]
        if kind != wire.EventType.DELETED and record.node and not record.terminal:
            self.pods_on[record.node] += 1
        self._index_gang(key, previous, None if kind == wire.EventType.DELETED else record)
        if record.reservation is not None:
            if kind == wire.EventType.DELETED:
                self.reservations.pop(key, None)
            else:
                self.reservations[key] = record
            return
        if kind == wire.EventType.DELETED:
            self.pods.pop(key, None)
            self._unconfirm(key)
            self.handoff_pods.discard(key)
            self.pending.discard(key)
            self.claiming.discard(key)
            if not self._same_pod(key, record.uid):
                return  # a predecessor of that name went: the assumption is its successor's
            self.forget(key)
            if not self._dirty and self._ledger is not None and key in self._ledger:
                self._ledger.remove(key)  # bound (a rebuild may have counted it while it was assumed)
                self.freed_at = self.clock()
            return
        self.pods[key] = record
        if record.handoff:
            self.handoff_pods.add(key)
        waiting = not record.node and not record.terminal and not record.deleting
        if record.gpu and waiting:
            self.pending.add(key)
        else:
            self.pending.discard(key)
        if (record.claims or record.gated) and waiting:
            self.claiming.add(key)
        else:
            self.claiming.discard(key)
        if not self._dirty:
            self._account(record)

    def _index_gang(self, key: units.PodKey, old: pods.Record | None, new: pods.Record | None) -> None:
        was = old.gang.key if old is not None and old.gang is not None else None
        now = new.gang.key if new is not None and new.gang is not None else None
        if was == now:
            return
        if was is not None:
            members = self.gangs.get(was)
            if members is not None:
                members.discard(key)
                if not members:
                    del self.gangs[was]
        if now is not None:
            self.gangs.setdefault(now, set()).add(key)

    def gang_members(self, gang: str) -> list[pods.Record]:
        """The pods that state gang `gang` (any phase), by name."""
        return [self.pods[k] for k in sorted(self.gangs.get(gang, ())) if k in self.pods]

    def live_gang_members(self, gang: str) -> list[pods.Record]:
        """`gang_members` that have neither ended nor are being deleted."""
        return [m for m in self.gang_members(gang) if not m.terminal and not m.deleting]

    def on_claim(self, kind: wire.EventType, record: dra.ClaimRecord) -> None:
        """A DRA claim, as the watch shows it (`claims`). One holding the driver's GPUs, whoever
        allocated it, is held in the one ledger beside the pods: no GPU is given twice, or past its
        capacity, across the two paths (a claim that does not fit is counted all the same and blocks
        its GPU, as a bound pod would). A claim the allocator is writing stays held while the watch
        still shows it unallocated."""
        seen = self.claims.observe(kind, record, self._memory_of())
        key, old, alloc = seen.key, seen.old, seen.new
        if seen.invalid is not None:
            self.counters.invalid += 1
            log.error("claim %s is not counted: %s", key, seen.invalid)
        if seen.forget:
            self.forget_claim(key)
        elif seen.as_decided:
            return  # shown from before the write landed: held as decided
        if old == alloc or self._dirty or self._ledger is None:
            if alloc is not None and not self._dirty and self._ledger is not None and key not in self._ledger:
                self._add_claim(self._ledger, alloc)
            return
        if old is not None and key in self._ledger:
            self._ledger.remove(key)
            self.freed_at = self.clock()
        if alloc is not None:
            self._add_claim(self._ledger, alloc)

    def assume_claim(self, alloc: allocation.Allocation) -> bool:
        """Hold a claim the allocator decided, before it writes it (the next decision sees it)."""
        if not self.ledger.assume(alloc).ok:
            return False
        self.claims.assumed[alloc.pod] = alloc
        return True

    def forget_claim(self, key: units.PodKey) -> bool:
        """Undo `assume_claim` (its write failed, or can no longer land): True if there was one."""
        if self.claims.assumed.pop(key, None) is None:
            return False
        if not self._dirty and self._ledger is not None:
            self._ledger.forget(key)
        self.freed_at = self.clock()
        return True

    def _add_claim(self, ledger: core_ledger.Ledger, alloc: allocation.Allocation) -> None:
        if ledger.state.row(alloc.node) is None:
            return  # a node without a Device here: counted once it has one (the rebuild re-adds it)
        result = ledger.add(alloc)
        if not result.ok:
            self.counters.conflicts += 1
            log.error("claim %s on %s conflicts with the ledger: %s", alloc.pod, alloc.node, result.message)

    def _memory_of(self) -> Mapping[tuple[str, int], int]:
        """(node, GPU index) -> its memory in MiB, from the Devices (looked up, not built: a claim
        event must not cost a pass over every GPU of the cluster)."""
        return _GpuMemory(self.devices)

    def _account(self, record: pods.Record) -> None:
        """Bring the ledger in line with one pod as the API server shows it."""
        assert self._ledger is not None and self._state is not None
        key, node, ledger = record.key, record.node, self._ledger
        if not self._same_pod(key, record.uid):
            return  # a late view of a predecessor of that name: the assumption is its successor's
        if not node or record.terminal or self._state.row(node) is None:
            if node and record.terminal:
                self._unassume(key)
                self._unconfirm(key)
            elif key in self.confirmed:
                return  # read back bound: this view is older
            if key in ledger and (node or key not in self.assumed):
                ledger.remove(key)
                self._unassume(key)
                self.freed_at = self.clock()
            return
        if record.problem is not None and record.allocation_text:
            self.counters.invalid += 1
            log.error("pod %s has an unreadable allocation: %s", key, record.problem)
        alloc = record.allocation if record.allocation is not None and record.allocation.node == node else None
        if alloc is None:
            alloc = self._derived_allocation(record, node)
            if alloc is None:
                return
        self._unconfirm(key)  # the watch shows it bound: the record counts it from now on
        entry = ledger.get(key)
        if entry is not None and entry.alloc == alloc and entry.phase is core_ledger.Phase.ADDED:
            return
        result = ledger.add(alloc)
        self._unassume(key)
        if not result.ok:
            self.counters.conflicts += 1
            log.error("pod %s on %s conflicts with the ledger: %s", key, node, result.message)

    def _derived_allocation(self, record: pods.Record, node: str) -> allocation.Allocation | None:
        """What a bound pod without an allocation annotation holds: host resources, and whole GPUs
        (nvidia.com/gpu from another scheduler) on the first entirely free GPUs of its node."""
        state, ledger = self._state, self._ledger
        assert state is not None and ledger is not None
        entry = ledger.get(record.key)
        if entry is not None and entry.alloc.node == node:
            return entry.alloc  # keep the slots already chosen for it
        request = record.request
        bare = allocation.Allocation(
            pod=record.key, node=units.NodeName(node), cpu_milli=record.cpu_milli, memory_mib=record.memory_mib
        )
        if request is None or request.demand.count == 0 or not request.demand.whole:
            return bare
        row = state.row(node)
        assert row is not None
        free = np.flatnonzero((state.milli_free[row] == state.milli_capacity[row]) & state.present[row])
        chosen = free[: request.demand.count].tolist()
        if len(chosen) < request.demand.count:
            self.counters.conflicts += 1
            log.error(
                "pod %s holds %d whole GPU(s) on %s but only %d are free",
                record.key,
                request.demand.count,
                node,
                len(chosen),
            )
            return bare
        return allocation.build(request, units.NodeName(node), chosen, [int(m) for m in state.gmem_capacity[row]])

    # ----------------------------------------------------------------- decisions

    def hold(self, key: units.PodKey, node: str, gpus: tuple[int, ...]) -> None:
        """Keep GPUs of `node` for pod `key` (it preempted their tenants): no other pod is placed on
        them until `release`. Kept across rebuilds while the node has them."""
        self.release(key)
        state = self.state  # rebuilt first if it must be: the rebuild re-applies the other holds
        self.holds[key] = (node, gpus)
        self._hold(state, node, gpus, +1)

    def release(self, key: units.PodKey) -> bool:
        """Let go of what `hold` kept for `key`: True if there was something."""
        found = self.holds.pop(key, None)
        if found is None:
            return False
        if not self._dirty and self._state is not None:
            self._hold(self._state, *found, -1)
        self.freed_at = self.clock()
        return True

    @staticmethod
    def _hold(state: fleet.FleetState, node: str, gpus: tuple[int, ...], sign: int) -> None:
        row = state.row(node)
        if row is None:
            return
        present = [i for i in gpus if i < state.width and state.present[row, i]]
        if present:
            state.hold(row, present, sign)

    def assume(self, alloc: allocation.Allocation, uid: str = "") -> bool:
        """Hold `alloc` for the pod of UID `uid` (where known) until the watch shows it bound."""
        result = self.ledger.assume(alloc)
        if result.ok:
            self.assumed[alloc.pod] = alloc
            self.assumed_uid[alloc.pod] = uid
            self.assumed_at[alloc.pod] = self.clock()
        return result.ok

    def _same_pod(self, key: units.PodKey, uid: str) -> bool:
        """Whether an event of the pod of UID `uid` may touch what is held under `key`: no assumption
        for another pod of that name stands."""
        return key not in self.assumed or self.assumed_uid.get(key, "") in ("", uid)

    def _unassume(self, key: units.PodKey) -> allocation.Allocation | None:
        self.assumed_uid.pop(key, None)
        self.assumed_at.pop(key, None)
        self.aside.pop(key, None)
        return self.assumed.pop(key, None)

    def forget(self, key: units.PodKey) -> bool:
        """Undo an assumption, once: True if there was one to undo."""
        if self._unassume(key) is None:
            return False
        self.ledger.forget(key)  # refused (nothing done) where it was set aside out of the ledger
        self.freed_at = self.clock()
        return True

    def confirm(self, alloc: allocation.Allocation) -> bool:
        """The API shows the assumed pod bound with this allocation (the watch has not yet): keep it as
        added, and against older views of the pod and rebuilds until the watch shows it (`confirmed`)."""
        self._unassume(alloc.pod)
        self.confirmed[alloc.pod] = alloc
        self.confirmed_at[alloc.pod] = self.clock()
        return self.ledger.add(alloc).ok

    def unseen_confirmations(self, ttl: float) -> list[tuple[units.PodKey, allocation.Allocation]]:
        """Pods held as bound (`confirm`) for `ttl` seconds or more that the watch has not shown bound."""
        now = self.clock()
        return [(key, alloc) for key, alloc in self.confirmed.items() if now - self.confirmed_at[key] >= ttl]

    def _unconfirm(self, key: units.PodKey) -> allocation.Allocation | None:
        self.confirmed_at.pop(key, None)
        return self.confirmed.pop(key, None)

    def drop_confirmation(self, key: units.PodKey) -> None:
        """A pod held as bound is not (gone, replaced, bound elsewhere): its room is let go."""
        alloc = self._unconfirm(key)
        if alloc is not None and not self._dirty and self._ledger is not None:
            entry = self._ledger.get(key)
            if entry is not None and entry.alloc == alloc:
                self._ledger.remove(key)
                self.freed_at = self.clock()

    def stale_assumptions(self, ttl: float) -> list[units.PodKey]:
        """Assumed pods older than `ttl` seconds (neither confirmed by the watch nor forgotten)."""
        now = self.clock()
        aside = [k for k, at in self.aside.items() if k in self.assumed and k not in self.ledger and now - at >= ttl]
        return [*(key for key in self.ledger.assumed_before(ttl) if key in self.assumed), *aside]

    def counts_assumed(self, key: units.PodKey) -> bool:
        """The ledger counts the pod's assumed allocation, which still fits (not set aside by a rebuild)."""
        return key in self.assumed and key in self.ledger and key not in self.aside

    # ----------------------------------------------------------------- queries

    def admits(self, terms: constraints.PodTerms, node: str) -> bool:
        """Whether a pod's own constraints (node selector, required affinity, tolerations) admit the node
        (one whose Node this cache has not seen is admitted: its facts come with it)."""
        facts = self.nodes.get(node)
        return facts is None or facts.terms is None or terms.allows(facts.terms)

    def by_label(self, label: str, rows: Iterable[int]) -> dict[str, list[int]]:
        """`rows` grouped by their node's value of `label` (nodes without it are in no group)."""
        found: dict[str, list[int]] = {}
        for row in rows:
            facts = self.nodes.get(self.state.names[row])
            value = facts.terms.labels.get(label) if facts is not None and facts.terms is not None else None
            if value is not None:
                found.setdefault(value, []).append(row)
        return found

    def record(self, key: units.PodKey) -> pods.Record | None:
        return self.pods.get(key)

    def shared_slots(self) -> set[tuple[str, int]]:
        """Every (node, GPU index) that some pod holds a share of, assumed ones included: the GPUs that
        need a reservation pod. A claim's share needs none (the kubelet plugin hands its GPU over), so
        on DRA nodes only the shares of pods count (pods of the extender path still running on a node
        turned to DRA)."""
        state = self.state
        shared = state.tenants - state.exclusive - state.claimed > 0  # pods' shares: the fleet counts them
        return {(state.names[r], int(s)) for r, s in np.argwhere(shared).tolist()}

    def live_reservations(self) -> Iterator[pods.Record]:
        return (r for r in self.reservations.values() if not r.terminal and not r.deleting)

    def summary(self, holder_of: Callable[[str, int], pods.Record | None] | None = None) -> list[dict[str, object]]:
        """Per node and GPU: capacity, used, free, and who holds what (the debug endpoint)."""
        state = self.state
        overcommitted = {(o.node, o.index): o.problems for o in self.ledger.overcommitted()}
        holders: dict[tuple[str, int], list[dict[str, object]]] = {}
        for key, entry in self.ledger.entries():
            for index, (milli, memory) in entry.alloc.gpu_usage().items():
                holders.setdefault((entry.alloc.node, index), []).append(
                    {"pod": key, "milli": milli, "memoryMiB": memory, "phase": entry.phase.value}
                )
        out: list[dict[str, object]] = []
        for row, name in enumerate(state.names):
            gpus = []
            for index in range(int(state.gpu_count[row])):
                held = holder_of(name, index) if holder_of else None
                capacity = int(state.milli_capacity[row, index])
                gpus.append(
                    {
                        "index": index,
                        "model": state.model_names[state.model_id[row, index]],
                        "healthy": bool(state.healthy[row, index]),
                        "milli": {
                            "capacity": capacity,
                            "used": capacity - int(state.milli_free[row, index]),
                            "free": int(state.milli_free[row, index]),
                        },
                        "memoryMiB": {
                            "capacity": int(state.gmem_capacity[row, index]),
                            "used": int(state.gmem_capacity[row, index] - state.gmem_free[row, index]),
                            "free": int(state.gmem_free[row, index]),
                        },
                        "holders": holders.get((name, index), []),
                        "overcommitted": list(overcommitted.get((name, index), ())),
                        "reservation": None
                        if held is None or held.reservation is None
                        else {"pod": held.key, "uuid": held.reservation.uuid},
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


class _GpuMemory(Mapping[tuple[str, int], int]):
    """The memory of a node's GPU by (node, index), read from the Devices as asked."""

    def __init__(self, devices_: dict[str, DeviceRecord]) -> None:
        self._devices = devices_

    def __getitem__(self, key: tuple[str, int]) -> int:
        node, index = key
        record = self._devices.get(node)
        found = next((g.memory_mib for g in record.gpus if g.index == index), None) if record else None
        if found is None:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return ((name, g.index) for name, record in self._devices.items() for g in record.gpus)

    def __len__(self) -> int:
        return sum(len(record.gpus) for record in self._devices.values())


def stable_priority(names: tuple[units.NodeName, ...]) -> fleet.IntArray:
    """A fixed tie-break order that does not depend on when nodes joined: by a hash of the name."""
    keys = [hashlib.blake2b(n.encode(), digest_size=8).digest() for n in names]
    order = sorted(range(len(names)), key=lambda i: keys[i])
    ranks = np.empty(len(names), dtype=np.int64)
    ranks[order] = np.arange(len(names), dtype=np.int64)
    return ranks
