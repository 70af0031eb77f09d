"""What the defragmenter plans from: the facts it keeps of pods and Nodes, and the planner's inputs built from them.

`facts` and `node_view` turn a watched Pod or Node into what the defragmenter needs of it (built once
per watch event, frozen). `inputs` rebuilds the fleet from those, as the extender does after a start
(GPU allocations from the pods' allocation annotations, host CPU and memory of every other bound pod),
with the tenants the planner may move, the pending pods it plans for, and each PodDisruptionBudget's
allowance (`policy/v1`'s `status.disruptionsAllowed`, kept by kube-controller-manager). `plan` asks
the planner (`core.defrag.plan`). `snapshot` lists what `inputs` needs once, for `sharegpu defrag`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sharegpu.api import constraints, names, paths, pods, wire
from sharegpu.api import devices as api_devices
from sharegpu.core import allocation, defrag, devices, errors, fleet, policies, units
from sharegpu.core import ledger as core_ledger
from sharegpu.core import placer as core_placer
from sharegpu.kube import client

log = logging.getLogger(__name__)

RECREATED_ELSEWHERE = frozenset({"ReplicaSet", "StatefulSet", "ReplicationController"})
"""Controller owners that keep a number of pods running and recreate an evicted one, placed afresh:
the only owners whose pods are moved. Not a Job's (an eviction counts as a failure against its
backoffLimit unless its podFailurePolicy says otherwise, which is not read here), a DaemonSet's (it
comes back on the same node), a static pod's mirror (owned by its Node), nor any other kind's (a
workflow engine's or an operator's pods may not be made again at all)."""
PROMISE = "~promised"
"""Appended to a pod's key for the room a recent move promised it (never a pod name: `~` is not in one)."""
PLACEMENT_POLICY = "bestfit"
"""The policy the planner places with to prove every victim fits elsewhere (it needs no pod shapes;
the extender decides again, with its own policy, when the victim is recreated)."""


# ----------------------------------------------------------------- the facts kept of each pod


@dataclass(frozen=True, slots=True)
class PodFacts:
    """A pod as the defragmenter needs it (built once per watch event)."""

    record: pods.Record
    owner: str
    """`Kind/name` of its controller owner; "" when it has none."""
    owner_kind: str
    priority: int
    labels: Mapping[str, str]
    unschedulable: bool
    """kube-scheduler's PodScheduled condition is False with reason Unschedulable."""
    terms: constraints.PodTerms
    """Its nodeSelector, required node affinity and tolerations."""

    @property
    def namespace(self) -> str:
        return self.record.key.partition("/")[0]

    @property
    def movable(self) -> bool:
        return (
            self.owner_kind in RECREATED_ELSEWHERE
            and self.record.gang is None  # one member moved alone would break its gang
            and self.namespace not in (names.SYSTEM_NAMESPACE, names.HOLDING_NAMESPACE)
        )

    @property
    def pending(self) -> bool:
        r = self.record
        return (
            self.unschedulable and r.request is not None and r.request.demand.count > 0 and not r.node
            and not r.terminal and not r.deleting and r.scheduler == names.SCHEDULER_NAME
            and r.preempts  # `preemptionPolicy: Never`: it waits; nothing is moved for it
        )  # fmt: skip


def facts(pod: wire.Pod, previous: PodFacts | None = None) -> PodFacts:
    owner = next((o for o in pod.metadata.owner_references if o.controller), None)
    unschedulable = any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable" for c in pod.status.conditions
    )
    return PodFacts(
        record=pods.record(pod, previous.record if previous is not None else None),
        owner=f"{owner.kind}/{owner.name}" if owner is not None else "",
        owner_kind=owner.kind if owner is not None else "",
        priority=pod.spec.priority or 0,
        labels=dict(pod.metadata.labels),
        unschedulable=unschedulable,
        terms=constraints.PodTerms.of(pod.spec),
    )


# ----------------------------------------------------------------- the planner's inputs, from API objects


@dataclass(frozen=True, slots=True)
class NodeView:
    """A Node as the planner needs it: room and readiness, and what pods' constraints look at."""

    facts: api_devices.NodeFacts
    terms: constraints.NodeTerms


def node_view(node: wire.Node, previous: NodeView | None = None) -> NodeView:
    return NodeView(api_devices.node_facts(node), constraints.NodeTerms.of(node))


class _Reach:
    """The nodes pods' constraints let them run on: None (any) when a pod has none and no node is
    tainted; otherwise worked out once per distinct set of constraints, not once per pod."""

    def __init__(self, nodes: Mapping[str, NodeView]) -> None:
        self.nodes = nodes
        self.tainted = any(n.terms.taints for n in nodes.values())
        self.known: dict[bytes, frozenset[str]] = {}

    def __call__(self, terms: constraints.PodTerms) -> frozenset[str] | None:
        if terms.unconstrained and not self.tainted:
            return None
        key = terms.key
        found = self.known.get(key)
        if found is None:
            found = self.known[key] = frozenset(name for name, n in self.nodes.items() if terms.allows(n.terms))
        return found


@dataclass(frozen=True, slots=True)
class Inputs:
    ledger: core_ledger.Ledger
    placer: core_placer.Placer
    tenants: Mapping[units.PodKey, defrag.Tenant]
    pending: tuple[defrag.Pending, ...]
    allowances: Mapping[str, int]
    """Per PodDisruptionBudget (`namespace/name`), the disruptions it allows now."""


def inputs(
    nodes: Iterable[NodeView],
    devices_: Iterable[wire.Device],
    pod_facts: Iterable[PodFacts],
    budgets: Iterable[wire.PodDisruptionBudget],
    *,
    skip: frozenset[units.PodKey] = frozenset(),
    promised: Iterable[allocation.Allocation] = (),
) -> Inputs:
    """The fleet and the planner's inputs from what the API holds; pods in `skip` are not planned for;
    `promised`: room recent moves counted on, held as well (a pending pod's, once it runs there, is
    not held twice)."""
    ready = {n.facts.name: n for n in nodes if n.facts.schedulable}
    reach = _Reach(ready)
    inventories: list[devices.NodeInventory] = []
    for device in sorted(devices_, key=lambda d: d.metadata.name):
        view = ready.get(device.metadata.name)
        if view is None or device.spec.dra:  # the extender places no pod on a node serving DRA claims
            continue
        try:
            inventories.append(api_devices.inventory(device, view.facts))
        except errors.InvalidInputError as exc:
            log.warning("defrag: ignoring node %s: %s", device.metadata.name, exc)
    state = fleet.FleetState(inventories)
    ledger = core_ledger.Ledger(state)
    placer = core_placer.Placer(state, policies.make(PLACEMENT_POLICY))
    groups = {wire.key(b.metadata): b for b in budgets}
    allocations: list[allocation.Allocation] = []
    tenants: dict[units.PodKey, defrag.Tenant] = {}
    pending: list[defrag.Pending] = []
    for item in pod_facts:
        r = item.record
        if item.pending and r.key not in skip and r.request is not None:
            pending.append(defrag.Pending(r.request, item.priority, reach(item.terms)))
        if not r.node or r.terminal or state.row(r.node) is None:
            continue  # a pod being deleted still holds its GPU until it has gone (it is no tenant to move)
        alloc = r.allocation if r.allocation is not None and r.allocation.node == r.node else None
        if alloc is None:  # host CPU and memory only (GPUs of other schedulers are not counted)
            alloc = allocation.Allocation(r.key, units.NodeName(r.node), cpu_milli=r.cpu_milli, memory_mib=r.memory_mib)
        allocations.append(alloc)
        if r.request is not None and alloc.gpu_usage() and not r.deleting:
            covering = tuple(
                key for key, b in groups.items()
                if b.metadata.namespace == item.namespace and wire.budget_selects(b, item.labels)
            )  # fmt: skip
            allowed = reach(item.terms)
            tenants[r.key] = defrag.Tenant(r.request, item.movable, item.priority, covering, item.owner, allowed)
    for alloc, result in zip(allocations, ledger.load(allocations), strict=True):
        if not result.ok:
            log.warning("defrag: pod %s does not fit the ledger: %s", alloc.pod, result.message)
    running = {a.pod: a.node for a in allocations}
    for held in promised:
        if running.get(held.pod) == held.node or state.row(held.node) is None:
            continue  # there already (or its node gone)
        ledger.add(dataclasses.replace(held, pod=units.PodKey(f"{held.pod}{PROMISE}")))
    allowances = {key: b.status.disruptions_allowed for key, b in groups.items()}
    return Inputs(ledger, placer, tenants, tuple(pending), allowances)


def plan(found: Inputs, evictions: int) -> defrag.Plan:
    return defrag.plan(
        found.ledger, found.placer, found.tenants, found.pending, defrag.Limits(evictions, found.allowances)
    )


# ----------------------------------------------------------------- reading the cluster once (the CLI)


async def snapshot(api: client.KubeApi, *, skip: frozenset[units.PodKey] = frozenset()) -> Inputs:
    """Nodes, Devices, pods and PodDisruptionBudgets, listed once, as the planner's inputs."""
    (nodes, _), (found, _), (listed, _), (budgets, _) = await asyncio.gather(
        api.list_of(paths.NODES, wire.Node),
        api.list_of(paths.DEVICES, wire.Device),
        api.list_of(paths.PODS, wire.Pod),
        api.list_of(paths.pod_disruption_budgets(), wire.PodDisruptionBudget),
    )
    return inputs([node_view(n) for n in nodes], found, [facts(p) for p in listed], budgets, skip=skip)
