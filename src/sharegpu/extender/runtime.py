"""`sharegpu extender`: the parts wired together, and their life cycle.

Informers (Nodes, Devices, Pods, hand-off ConfigMaps, kept gang plans) feed the cluster cache and wake the
reconcilers. The scheduling service answers kube-scheduler on every replica. The reservation,
hand-off and over-commit reconcilers run only while this replica holds the `sharegpu-extender`
Lease (with `leader_elect` off, a single replica always holds it). Bindings whose outcome is
unknown are read back every second, stale assumptions resolved every few seconds. The process
is ready once every informer has listed; `/readyz` stays honest afterwards (see `readiness`).
With `follow_scheduler` the replica leads while the kube-scheduler of its pod holds that Lease.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from sharegpu.api import budgets as api_budgets
from sharegpu.api import dra, names, paths, pods, resources, wire
from sharegpu.api import quotas as api_quotas
from sharegpu.core import frag, policies
from sharegpu.extender import allocator as extender_allocator
from sharegpu.extender import budgets as extender_budgets
from sharegpu.extender import cache as extender_cache
from sharegpu.extender import handle as extender_handle
from sharegpu.extender import handoff as extender_handoff
from sharegpu.extender import metrics as extender_metrics
from sharegpu.extender import overcommit as extender_overcommit
from sharegpu.extender import preemption, requeue, routes, scheduling
from sharegpu.extender import quotas as extender_quotas
from sharegpu.extender import reservations as extender_reservations
from sharegpu.kube import client, informer, leader, reviews, terms
from sharegpu.kube import events as kube_events
from sharegpu.serving import access, health, http2, tls

log = logging.getLogger(__name__)


HEALTH_PORT: Final = health.Endpoint(8889)
"""Where the health port listens unless told otherwise (`--host`, `--health-port`)."""


@dataclass(frozen=True, slots=True)
class Options:
    kubeconfig: str | None = None
    host: str = "0.0.0.0"
    port: int = 8888
    """Port of filter, prioritize and bind (on `host`)."""
    health_port: health.Endpoint = HEALTH_PORT
    policy: str = policies.DEFAULT
    image: str = "sharegpu:latest"
    narrow: bool = True
    shapes: tuple[frag.WeightedShape, ...] | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    """With it, filter/prioritize/bind require a client certificate signed by this CA."""
    leader_elect: bool = True
    follow_scheduler: bool = False
    """Lead while the kube-scheduler of this pod holds the Lease, not campaigning for it
    (`kube.leader.Follower`: the chart runs the two in one pod, on one Lease)."""
    election: terms.Election = terms.DEFAULT
    assume_ttl: float = 30.0
    reservation_idle: float = 3.0
    pace: float = 0.25
    """Seconds a reconciler rests after a pass, so that a burst of changes costs one pass."""
    preemption: bool = True
    """A GPU pod that fits nowhere preempts lower-priority GPU pods (`extender.preemption`)."""
    dra_fence: float = extender_allocator.FENCE
    """Seconds a new leader's DRA allocator waits before its first write (`extender.allocator`)."""


class Extender:
    """The running extender (see the module docstring)."""

    def __init__(self, api: client.KubeApi, options: Options, clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.options = options
        self.metrics = extender_metrics.Metrics()
        self.cache = extender_cache.ClusterCache(options.policy, clock=clock, shapes=options.shapes)
        self.quota = extender_quotas.QuotaGuard(self.cache)
        self.metrics.report(lambda: extender_metrics.view(self.cache, self.quota) if self.startup else None)
        identity = options.election.identity or leader.identity()
        recorder = kube_events.Recorder(api, "sharegpu-extender", identity, time.time)
        self.recorder = recorder
        self.handle = extender_handle.Handle(self.cache, api, recorder, self.metrics, clock)
        """What the reconcilers share (`extender.handle`)."""
        self.preemptor = (
            preemption.Preemptor(self.handle, is_leader=lambda: self.elector.is_leader) if options.preemption else None
        )
        self.reservations = extender_reservations.ReservationReconciler(
            self.handle, image=options.image, idle=options.reservation_idle
        )
        self.handoffs = extender_handoff.HandoffReconciler(self.handle, self.reservations.holder)
        self.scheduling = scheduling.SchedulingService(
            self.cache, api, self.metrics, narrow=options.narrow, assume_ttl=options.assume_ttl, clock=clock,
            quota=self.quota, preemptor=self.preemptor, prepare=self.handoffs.prepare,
        )  # fmt: skip
        self.requeuer = requeue.Requeuer(self.handle, self.scheduling)
        self.overcommit = extender_overcommit.OvercommitReconciler(self.handle)
        self.allocator: extender_allocator.ClaimAllocator | None = None
        """The DRA allocator, where resource.k8s.io/v1 is served (set by `start`)."""
        self.elector: leader.LeaderElector | leader.Follower | leader.Solo = leader.Solo()
        if options.leader_elect or options.follow_scheduler:
            kind = leader.Follower if options.follow_scheduler else leader.LeaderElector
            who = identity.split(leader.SEPARATOR, 1)[0] if options.follow_scheduler else identity  # its pod
            self.elector = kind(
                api, names.SYSTEM_NAMESPACE, names.EXTENDER_LEASE, who,
                options.election.terms,
            )  # fmt: skip
        changed = self._changed
        self.informers: list[informer.Informer[Any, Any]] = [
            informer.Informer(
                api, paths.NODES, wire.Node, extender_cache.node_record, changed(self.cache.on_node), name="nodes"
            ),
            informer.Informer(
                api,
                paths.DEVICES,
                wire.Device,
                extender_cache.device_record,
                changed(self.cache.on_device),
                name="devices",
            ),
            informer.Informer(api, paths.PODS, wire.Pod, pods.record, changed(self.cache.on_pod), name="pods"),
            informer.Informer(
                api,
                paths.RESOURCE_QUOTAS,
                api_quotas.ResourceQuota,
                informer.identity,
                self.quota.on_quota,
                name="resourcequotas",
            ),
            informer.Informer(
                api,
                paths.CONFIGMAPS,
                wire.ConfigMap,
                extender_handoff.configmap_record,
                self._changed(self.handoffs.on_configmap),
                name="handoff-configmaps",
                params={"labelSelector": f"{names.LABEL_ROLE}={names.ROLE_HANDOFF}"},
            ),
            informer.Informer(
                api,
                paths.configmaps(names.SYSTEM_NAMESPACE),
                wire.ConfigMap,
                informer.identity,
                self.scheduling.gangs.on_configmap,
                name="gang-plans",
                params={"labelSelector": f"{names.LABEL_ROLE}={names.ROLE_GANG_PLAN}"},
            ),
        ]
        if self.preemptor is not None:  # preemption weighs disruption budgets as kube-scheduler does
            self.informers.append(
                informer.Informer(
                    api,
                    paths.pod_disruption_budgets(),
                    wire.PodDisruptionBudget,
                    informer.identity,
                    self.preemptor.budgets.on_budget,
                    name="poddisruptionbudgets",
                )
            )
        self.tasks: list[asyncio.Task[None]] = []
        self.clock = clock
        self.startup: dict[str, float] = {}
        """Seconds the first lists took, and the cache build after the last page arrived."""

    def _changed(self, handler: Callable[[wire.EventType, Any], None]) -> Callable[[wire.EventType, Any], None]:
        def changed(kind: wire.EventType, obj: Any) -> None:
            handler(kind, obj)
            self.reservations.wake()
            self.handoffs.wake()
            self.overcommit.wake()
            if self.allocator is not None:
                self.allocator.wake()
            if self.preemptor is not None and self.preemptor.nominations:
                self.preemptor.wake()

        return changed

    async def _dra_served(self) -> bool:
        """Whether the API server serves resource.k8s.io/v1 (Kubernetes 1.34 and later): then the
        cache counts the DRA claims of sharegpu's driver too."""
        if await client.serves_when_answered(self.api, dra.API_VERSION):
            return True
        log.info("%s is not served: DRA claims are not counted (there can be none)", dra.API_VERSION)
        return False

    def holder(self, node: str, slot: int) -> pods.Record | None:
        return self.reservations.holder(node, slot)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        states = {i.name: i.status() for i in self.informers}
        for i in self.informers:
            self.metrics.ready.labels(i.name).set(1 if i.ready else 0)
        refused = self.api.refused
        ready = bool(self.informers) and all(i.ready for i in self.informers) and not refused
        self.metrics.leader.set(1 if self.elector.is_leader else 0)
        detail = {"informers": states, "leader": self.elector.is_leader, "credentialsRefused": refused}
        return ready, {**detail, "startup": self.startup}

    async def start(self) -> None:
        """Start the informers and wait for their first lists; then everything else."""
        started = self.clock()
        if await self._dra_served():
            guard = extender_budgets.BudgetGuard()
            self.allocator = extender_allocator.ClaimAllocator(
                self.handle, is_leader=lambda: self.elector.is_leader, fence=self.options.dra_fence, budgets=guard
            )
            self.informers += [
                informer.Informer(
                    self.api, dra.CLAIMS, dra.ResourceClaim, dra.claim_record, self._changed(self.cache.on_claim),
                    name="resourceclaims",
                ),
                informer.Informer(self.api, resources.GPU_BUDGET.path(), api_budgets.GPUBudget, informer.identity,
                                  self._changed(guard.on_budget), name="gpubudgets"),
                informer.Informer(self.api, resources.CLUSTER_GPU_BUDGET.path(), api_budgets.ClusterGPUBudget,
                                  informer.identity, self._changed(guard.on_cluster_budget), name="clustergpubudgets"),
                informer.Informer(self.api, paths.NAMESPACES, wire.Namespace, informer.identity, guard.on_namespace,
                                  name="namespaces"),
                informer.Informer(self.api, paths.PRIORITY_CLASSES, wire.PriorityClass, informer.identity,
                                  guard.on_priority_class, name="priorityclasses"),
            ]  # fmt: skip
            self.informers.append(informer.Informer(
                self.api, dra.DEVICE_CLASSES, dra.DeviceClass, informer.identity,
                self._changed(self.cache.on_device_class), name="deviceclasses",
            ))  # fmt: skip
            if await client.serves_when_answered(self.api, dra.API_VERSION, resource="devicetaintrules"):
                self.informers.append(informer.Informer(
                    self.api, dra.TAINT_RULES, dra.TaintRule, informer.identity,
                    self._changed(self.cache.on_taint_rule), name="devicetaintrules",
                ))  # fmt: skip
            else:
                log.info("DeviceTaintRules are not served (Kubernetes 1.37 serves them): none is honoured")
        self.tasks = [asyncio.create_task(i.run(), name=f"informer-{i.name}") for i in self.informers]
        await asyncio.gather(*(i.synced.wait() for i in self.informers))
        listed = max((i.listed_at or started) for i in self.informers)
        self.cache.rebuild()
        self.scheduling.gangs.restore()  # before anything is served: no one takes a kept gang's room
        # Everything listed so far lives long: keep it out of the collector's full passes, which
        # otherwise walk every cached record and show up as latency spikes on filter and bind.
        gc.freeze()
        built = self.clock()
        self.startup = {"listSeconds": round(listed - started, 3), "rebuildSeconds": round(built - listed, 3)}
        log.info("cache built: lists %.2f s, then %.2f s to build", listed - started, built - listed)

        def background() -> list[Awaitable[None]]:
            work: list[Awaitable[None]] = [
                self.reservations.run(pace=self.options.pace),
                self.handoffs.run(pace=self.options.pace),
                self.overcommit.run(pace=self.options.pace),
            ]
            if self.allocator is not None:
                work.append(self.allocator.run(pace=min(self.options.pace, 0.05)))
            return work

        self.tasks += [
            asyncio.create_task(self.elector.run(), name="leader-election"),
            asyncio.create_task(leader.run_while_leading(self.elector, background), name="reconcilers"),
            asyncio.create_task(self.scheduling.run_expiry(), name="assumption-expiry"),
        ]
        self.tasks.append(asyncio.create_task(self.requeuer.run(), name="requeue"))  # every replica: its own refusals
        if self.preemptor is not None:  # on every replica: its own filter nominated the pods
            self.tasks.append(asyncio.create_task(self.preemptor.run(), name="preemption"))

    async def stop(self) -> None:
        await informer.cancel(reversed(self.tasks))


async def serve(options: Options, started: asyncio.Event | None = None) -> None:
    """Run the extender until cancelled."""
    api = client.KubeClient.connect(options.kubeconfig)
    extender = Extender(api, options)
    context = None
    if options.tls_cert is not None and options.tls_key is not None:
        context = tls.ReloadingTls(options.tls_cert, options.tls_key, options.client_ca, alpn=http2.ALPN).context
    elif options.client_ca is not None:
        raise ValueError("--client-ca needs --tls-cert and --tls-key")
    else:
        log.warning("serving filter/prioritize/bind over plain HTTP: anyone who can reach the port can bind pods")
    verbs = routes.Verbs(extender.scheduling, extender.metrics)
    gate = access.Gate(reviews.ApiReviewer(api)) if options.health_port.metrics_auth else None
    runners = [
        web.AppRunner(verbs.app(), access_log=None),
        web.AppRunner(routes.operations(extender, gate), access_log=None),
    ]
    connections = http2.Connections(verbs, routes.MAX_BODY, extender.metrics.connection)
    listener: http2.Listener | None = None
    try:
        for runner in runners:
            await runner.setup()
        await options.health_port.site(runners[1]).start()
        await extender.start()
        listener = await http2.listen(runners[0], connections, options.host, options.port, context)
        log.info(
            "sharegpu extender: verbs on %s:%d (%s), health on %s, policy %s",
            options.host, options.port, "mutual TLS" if options.client_ca else ("TLS" if context else "http"),
            options.health_port, options.policy,
        )  # fmt: skip
        if started is not None:
            started.set()
        await asyncio.Event().wait()
    finally:
        if listener is not None:
            listener.close()
        await extender.stop()
        for runner in runners:
            await runner.cleanup()
        await api.close()
