"""`sharegpu controller`: the reconcilers of sharegpu's own resources, and their life cycle.

Every replica runs the informers (pods as `api.lifetimes.TimedPod`, Devices, GPUBudgets and
ClusterGPUBudgets, Namespaces (their labels), SharedDeviceGroups and the pods labelled with a group;
with `--compat`, the deviceshare.io groups or KubeShare's SharePods and their Pods), so a standby's
picture of the cluster is as current as the leader's; only the holder of the `sharegpu-controller`
Lease reconciles (writes statuses, records events). Reconcilers: budgets (`controller.budgets`),
shared device groups (`controller.groups`), idle shares (`controller.idle`, from the agents'
GpuUsages and the GPUIdlePolicies), and where enabled the deviceshare.io mirror
(`controller.deviceshare`), SharePods (`controller.sharepods`) and the defragmenter
(`controller.defrag`, with its own informers: pods, Nodes, PodDisruptionBudgets). A new leader acts on what its
informers listed from the API (the books in each budget's status included), never on anything its
predecessor held in memory. The hand-off and reservation reconcilers stay in the extender, next to
the ledger they follow (docs/architecture.md says why).

Health on one port: /healthz, /readyz (every informer listed and watching, credentials accepted, the
installed CustomResourceDefinitions this release's: `controller.definitions`), /metrics and
/debug/budgets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import prometheus_client
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sharegpu.api import budgets as api_budgets
from sharegpu.api import deviceshare as api_deviceshare
from sharegpu.api import dra, lifetimes, names, paths, resources, wire
from sharegpu.api import groups as api_groups
from sharegpu.api import idle as api_idle
from sharegpu.api import sharepods as api_sharepods
from sharegpu.api import usage as api_usage
from sharegpu.controller import budgets, definitions, defrag, deviceshare, groups, idle, inventory, sharepods
from sharegpu.core import errors, units
from sharegpu.kube import client, informer, leader, reconcile, reviews, terms
from sharegpu.kube import events as kube_events
from sharegpu.serving import access, health

log = logging.getLogger(__name__)


HEALTH_PORT: Final = health.Endpoint(8890)
"""Where the health port listens unless told otherwise (`--host`, `--health-port`)."""


@dataclass(frozen=True, slots=True)
class Options:
    kubeconfig: str | None = None
    health_port: health.Endpoint = HEALTH_PORT
    leader_elect: bool = True
    election: terms.Election = terms.DEFAULT
    write_every: float = 30.0
    budget_fence: float = budgets.FENCE
    """Seconds a new leader's first budget pass waits for its watches (`BudgetReconciler.new_term`)."""
    """Seconds between status writes of a budget whose usage moves (state changes are written at once)."""
    tick: float = 5.0
    """Seconds between passes when nothing wakes the reconcilers."""
    definitions_every: float = 60.0
    """Seconds between reads of the installed CustomResourceDefinitions (`controller.definitions`)."""
    pace: float = 0.25
    """Seconds a reconciler rests after a pass, so that a burst of changes costs one pass."""
    image: str = "sharegpu:latest"
    """Image of the group holder pods (runs `sharegpu reserve`)."""
    compat: frozenset[str] = frozenset()
    """Other systems' resources to serve (`api.resources.COMPAT`): their CRDs must be installed."""
    defrag: bool = False
    """Run the defragmenter and let it evict (through the Eviction API)."""
    defrag_dry_run: bool = False
    """Run the defragmenter, reporting its plans (log, events, metrics) without evicting."""
    defrag_budget_per_hour: int = 10
    """Evictions the defragmenter may make in any hour."""


class Controller:
    """The running controller (see the module docstring)."""

    def __init__(self, api: client.KubeApi, options: Options, clock: Callable[[], float] = time.time) -> None:
        self.api = api
        self.options = options
        self.identity = options.election.identity or leader.identity()
        self.recorder = kube_events.Recorder(api, names.CONTROLLER, self.identity, clock)
        self.budgets = budgets.BudgetReconciler(
            api, self.recorder, clock, write_every=options.write_every, fence=options.budget_fence
        )
        self.ids = inventory.GpuIds()
        self.groups = groups.GroupReconciler(
            api, self.recorder, clock, self.ids, image=options.image,
            held_back=lambda namespace: api_budgets.holds_back_holder(self.budgets.governing(namespace)),
        )  # fmt: skip
        unknown = sorted(options.compat - set(resources.COMPAT))
        if unknown:
            raise errors.InvalidRequestError(f"compat: unknown {', '.join(unknown)} (known: "
                                             f"{', '.join(sorted(resources.COMPAT))})")  # fmt: skip
        self.mirrors = (
            deviceshare.MirrorReconciler(api, self.recorder, clock) if "deviceshare" in options.compat else None
        )
        self.sharepods = (
            sharepods.SharePodReconciler(api, self.recorder, clock, self.ids) if "kubeshare" in options.compat else None
        )
        self.defrag = (
            defrag.DefragReconciler(api, self.recorder, clock, evict=options.defrag,
                                    budget_per_hour=options.defrag_budget_per_hour)
            if options.defrag or options.defrag_dry_run else None
        )  # fmt: skip
        self.idle = idle.IdleReconciler(api, self.recorder, clock)
        self.elector: leader.LeaderElector | leader.Solo = leader.Solo()
        if options.leader_elect:
            self.elector = leader.LeaderElector(
                api, names.SYSTEM_NAMESPACE, names.CONTROLLER_LEASE, self.identity,
                options.election.terms,
            )  # fmt: skip
        self.informers: list[informer.Informer[Any, Any]] = [
            informer.Informer(api, paths.PODS, lifetimes.TimedPod, budgets.pod_books, self.budgets.on_pod, name="pods"),
            informer.Informer(api, paths.DEVICES, wire.Device, informer.identity, self._on_device, name="devices"),
            informer.Informer(
                api, resources.GPU_BUDGET.path(), api_budgets.GPUBudget, informer.identity, self._on_budget,
                name="gpubudgets",
            ),
            informer.Informer(
                api, resources.CLUSTER_GPU_BUDGET.path(), api_budgets.ClusterGPUBudget, informer.identity,
                self._on_budget, name="clustergpubudgets",
            ),
            informer.Informer(
                api, paths.NAMESPACES, wire.Namespace, informer.identity, self.budgets.on_namespace, name="namespaces"
            ),
            informer.Informer(
                api, resources.GPU_IDLE_POLICY.path(), api_idle.GPUIdlePolicy, informer.identity, self.idle.on_policy,
                name="gpuidlepolicies",
            ),
            informer.Informer(
                api, paths.GPU_USAGES, api_usage.GpuUsage, informer.identity, self.idle.on_usage, name="gpuusages"
            ),
            informer.Informer(
                api, resources.SHARED_DEVICE_GROUP.path(), api_groups.SharedDeviceGroup, informer.identity,
                self._on_group, name="shareddevicegroups",
            ),
            informer.Informer(
                api, paths.PODS, wire.Pod, informer.identity, self.groups.on_pod, name="group-pods",
                params={"labelSelector": names.LABEL_GROUP_NAME},
            ),
            informer.Informer(api, paths.NODES, wire.Node, informer.identity, self.groups.on_node, name="group-nodes"),
            informer.Informer(
                api, paths.configmaps(names.HOLDING_NAMESPACE), wire.ConfigMap, informer.identity,
                self.groups.on_holder_handoff, name="holder-handoffs",
                params={"labelSelector": f"{names.LABEL_ROLE}={names.ROLE_HANDOFF}"},
            ),
            informer.Informer(
                api, paths.CONFIGMAPS, wire.ConfigMap, informer.identity, self.groups.on_handoff,
                name="group-handoffs", params={"labelSelector": f"{names.LABEL_ROLE}={names.ROLE_GROUP_HANDOFF}"},
            ),
            informer.Informer(
                api, paths.pod_disruption_budgets(names.HOLDING_NAMESPACE), wire.PodDisruptionBudget,
                informer.identity, self.groups.on_guard, name="holder-guards",
                params={"labelSelector": f"{names.LABEL_ROLE}={names.ROLE_GROUP_GUARD}"},
            ),
        ]  # fmt: skip
        if self.mirrors is not None:
            self.informers.append(informer.Informer(
                api, resources.DEVICESHARE_GROUP.path(), api_deviceshare.DeviceShareGroup, informer.identity,
                self.mirrors.on_source, name="deviceshare-groups",
            ))  # fmt: skip
        if self.sharepods is not None:
            self.informers += [
                informer.Informer(api, resources.SHAREPOD.path(), api_sharepods.SharePod, informer.identity,
                                  self.sharepods.on_share, name="sharepods"),
                informer.Informer(api, paths.PODS, api_sharepods.MadePod, informer.identity, self.sharepods.on_pod,
                                  name="sharepod-pods", params={"labelSelector": api_sharepods.LABEL}),
            ]  # fmt: skip
        self.definitions = definitions.Definitions(api, resources.definitions(), every=options.definitions_every)
        self.metrics = _Metrics(self)
        self.tasks: list[asyncio.Task[None]] = []

    def _on_device(self, kind: wire.EventType, device: wire.Device) -> None:
        self.budgets.on_device(kind, device)
        self.ids.on_device(kind, device)
        self.groups.loop.wake()
        if self.sharepods is not None:
            self.sharepods.loop.wake()
        if self.defrag is not None:
            self.defrag.on_device(kind, device)

    def _on_budget(self, kind: wire.EventType, item: api_budgets.AnyBudget) -> None:
        self.budgets.on_budget(kind, item)
        self.groups.loop.wake()  # a group not bound yet may take its GPUs only within its budgets

    def _on_group(self, kind: wire.EventType, group: api_groups.SharedDeviceGroup) -> None:
        self.groups.on_group(kind, group)
        if self.mirrors is not None:
            self.mirrors.on_group(kind, group)

    def loops(self) -> list[reconcile.Loop]:
        """The reconcilers' loops (the compatibility ones only where enabled)."""
        optional = [r.loop for r in (self.mirrors, self.sharepods, self.defrag) if r is not None]
        return [self.budgets.loop, self.groups.loop, self.idle.loop, *optional]

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        states = {i.name: i.status() for i in self.informers}
        ready = all(i.ready for i in self.informers) and not self.api.refused and self.definitions.current
        return ready, {
            "informers": states,
            "leader": self.elector.is_leader,
            "credentialsRefused": self.api.refused,
            "definitions": self.definitions.status(),
        }

    async def start(self) -> None:
        """Start the informers and wait for their first lists; then campaign and reconcile."""
        if self.defrag is not None and not any(i.name == "poddisruptionbudgets" for i in self.informers):
            self.informers += self.defrag.informers()
        named = {i.name for i in self.informers}
        if "resourceclaims" not in named and await client.serves_when_answered(self.api, dra.API_VERSION):
            self.informers.append(informer.Informer(  # DRA claims are charged to budgets too
                self.api, dra.CLAIMS, dra.ResourceClaim, dra.claim_record, self.budgets.on_claim, name="resourceclaims",
            ))  # fmt: skip
        self.tasks = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in self.informers]
        self.tasks.append(asyncio.create_task(self.definitions.run(), name="definitions"))
        await asyncio.gather(*(i.synced.wait() for i in self.informers))

        def work() -> list[Awaitable[None]]:
            self.budgets.new_term()
            if self.defrag is not None:
                self.defrag.new_term()
            loops = self.loops()
            for loop in loops:
                loop.wake()  # the first pass at once, on what the informers listed
            return [loop.run(tick=self.options.tick, pace=self.options.pace) for loop in loops]

        self.tasks += [
            asyncio.create_task(self.elector.run(), name="leader-election"),
            asyncio.create_task(leader.run_while_leading(self.elector, work), name="reconcilers"),
        ]

    async def stop(self) -> None:
        await informer.cancel(reversed(self.tasks))

    def app(self) -> web.Application:
        """/healthz, /readyz and /metrics (`serving.health`) and /debug/budgets (those two behind the
        gate of `serving.access`)."""
        gate = access.Gate(reviews.ApiReviewer(self.api)) if self.options.health_port.metrics_auth else None
        app = health.HealthServer(self.readiness, self.metrics.registry, gate).app()

        async def debug_budgets(_: web.Request) -> web.Response:
            shown = {key: wire.encode(item.status) for key, item in sorted(self.budgets.budgets.items())}
            return web.json_response({"leader": self.elector.is_leader, "budgets": shown,
                                      "gonePods": len(self.budgets.gone), "writes": self.budgets.writes})  # fmt: skip

        app.router.add_get("/debug/budgets", debug_budgets)
        return app


class _Metrics(Collector):
    """Per budget its use, limit and state (read from the books at each scrape), leadership, and the
    informers' readiness."""

    def __init__(self, controller: Controller) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.controller = controller
        self.registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["namespace", "budget"]
        used = GaugeMetricFamily("sharegpu_budget_used_gpu_seconds", "GPU-seconds used this period", labels=labels)
        limit = GaugeMetricFamily("sharegpu_budget_limit_gpu_seconds", "GPU-seconds per period", labels=labels)
        state = GaugeMetricFamily(
            "sharegpu_budget_state", "1 for the budget's state (Within, Warning, Exhausted)", labels=[*labels, "state"]
        )
        for item in self.controller.budgets.budgets.values():
            values = [item.metadata.namespace, item.metadata.name]
            used.add_metric(values, item.status.used_gpu_seconds)
            limit.add_metric(values, api_budgets.limit_seconds(item.spec))
            for name in (api_budgets.WITHIN, api_budgets.WARNING, api_budgets.EXHAUSTED):
                state.add_metric([*values, name], 1 if item.status.state == name else 0)
        leading = GaugeMetricFamily("sharegpu_controller_leader", "1 while this replica reconciles")
        leading.add_metric([], 1 if self.controller.elector.is_leader else 0)
        ready = GaugeMetricFamily(
            "sharegpu_controller_informer_ready", "1 while an informer is synced and watching", labels=["informer"]
        )
        for found in self.controller.informers:
            ready.add_metric([found.name], 1 if found.ready else 0)
        current = GaugeMetricFamily(
            "sharegpu_controller_definition_current",
            "1 while the installed CustomResourceDefinition has all of this release's (0: apply its definitions)",
            labels=["definition"],
        )
        for name, lacking in sorted(self.controller.definitions.lacking.items()):
            current.add_metric([name], 0 if lacking else 1)
        idle_now = GaugeMetricFamily(
            "sharegpu_idle_shares", "Pods idle for longer than their namespace's GPUIdlePolicy says",
            labels=["namespace"],
        )  # fmt: skip
        spaces: dict[str, int] = {}
        for tracked in self.controller.idle.idle_for_long().values():
            spaces[tracked.namespace] = spaces.get(tracked.namespace, 0) + 1
        for space, count in sorted(spaces.items()):
            idle_now.add_metric([space], count)
        evictions = CounterMetricFamily(
            "sharegpu_idle_evictions", "Evictions of idle shares tried, by outcome", labels=["outcome"]
        )
        for outcome, count in sorted(self.controller.idle.counters.evictions.items()):
            evictions.add_metric([outcome], count)
        yield from (used, limit, state, leading, ready, current, idle_now, evictions)
        defragmenter = self.controller.defrag
        if defragmenter is not None:
            c = defragmenter.counters
            for name, help_text, value in (
                ("sharegpu_defrag_pending_pods", "Pending GPU pods the defragmenter's last pass planned for",
                 c.pending),
                ("sharegpu_defrag_planned_evictions", "Evictions in the defragmenter's last plan",
                 c.planned_evictions),
                ("sharegpu_defrag_planned_gain_gpus", "GPU compute (in GPUs) of the pending pods the last "
                 "plan lets in", c.planned_gain_milli / units.MILLI_PER_GPU),
                ("sharegpu_defrag_budget_left", "Evictions left in the defragmenter's hourly budget",
                 defragmenter.allowance()),
            ):  # fmt: skip
                gauge = GaugeMetricFamily(name, help_text)
                gauge.add_metric([], value)
                yield gauge
            for name, help_text, value in (
                ("sharegpu_defrag_evictions", "Evictions the defragmenter made (the API server accepted)",
                 c.evictions),
                ("sharegpu_defrag_evictions_refused", "Evictions the API server refused (a disruption budget)",
                 c.refused),
            ):  # fmt: skip
                counter = CounterMetricFamily(name, help_text)
                counter.add_metric([], value)
                yield counter


async def serve(options: Options, started: asyncio.Event | None = None) -> None:
    """Run the controller until cancelled."""
    api = client.KubeClient.connect(options.kubeconfig)
    controller = Controller(api, options)
    runner = web.AppRunner(controller.app(), access_log=None)
    try:
        await runner.setup()
        await options.health_port.site(runner).start()
        await controller.start()
        log.info(
            "sharegpu controller %s: health on %s", controller.identity, options.health_port,
        )  # fmt: skip
        if started is not None:
            started.set()
        await asyncio.Event().wait()
    finally:
        await controller.stop()
        await runner.cleanup()
        await api.close()
