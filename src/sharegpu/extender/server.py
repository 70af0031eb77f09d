"""The extender's HTTP server (kube-scheduler's extender protocol) and its background loops.

Endpoints: POST /filter, /prioritize, /bind (JSON with Go field names: Pod, NodeNames, FailedNodes,
Host, Score, PodName, PodNamespace, Node, Error); GET /healthz, /readyz (caches synced), /metrics
(Prometheus) and /debug/nodes (per node and GPU: capacity, used, free, holders).

Filter narrows the feasible nodes to the one the policy chooses (with sharegpu's own tie-break), so
kube-scheduler's random choice among equal scores and its 0..10 extender scale cannot undo the
placement; the other feasible nodes are simply left out. Bind re-checks the pod on the chosen node,
assumes the allocation, makes sure each shared GPU is held by a reservation pod, and binds with one
pods/binding that carries the allocation annotation; any failure forgets the assumption, once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson
import prometheus_client
from aiohttp import web

from sharegpu.core import errors, fit, frag, units
from sharegpu.extender import cache as cache_mod
from sharegpu.extender import handoff
from sharegpu.kube import client, informer, objects
from sharegpu.kube import errors as kube_errors

Json = dict[str, Any]
log = logging.getLogger(__name__)
MAX_REASON = 600


class Metrics:
    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.decisions = prometheus_client.Counter(
            "sharegpu_extender_decisions", "Filter decisions by outcome", ["verb", "outcome"], registry=self.registry
        )
        self.latency = prometheus_client.Histogram(
            "sharegpu_extender_latency_seconds",
            "Handler latency",
            ["verb"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        self.binds = prometheus_client.Counter(
            "sharegpu_extender_binds", "Bind results", ["outcome"], registry=self.registry
        )
        self.reservations = prometheus_client.Counter(
            "sharegpu_reservation_pods", "Reservation pods created and deleted", ["action"], registry=self.registry
        )


class Extender:
    def __init__(
        self,
        kube: client.KubeClient,
        cache: cache_mod.ClusterCache,
        *,
        image: str = "sharegpu:latest",
        narrow: bool = True,
    ) -> None:
        self.kube = kube
        self.cache = cache
        self.image = image
        self.narrow = narrow
        self.metrics = Metrics()
        self.informers: list[informer.Informer] = []
        self.tasks: list[asyncio.Task[None]] = []
        self._creating: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._wake = asyncio.Event()
        self._filled: dict[units.PodKey, tuple[str, tuple[tuple[str, str], ...]]] = {}
        self._owner_of: dict[tuple[str, str], units.PodKey] = {}
        """(namespace, hand-off ConfigMap) -> the pod it was written for."""
        self._replacements: dict[tuple[str, int], tuple[int, float]] = {}
        """Per GPU: how many times its reservation was replaced, and not before when again."""

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> None:
        self.informers = [
            informer.Informer(self.kube, "/api/v1/nodes", self._changed(self.cache.on_node), name="nodes"),
            informer.Informer(self.kube, objects.DEVICES_PATH, self._changed(self.cache.on_device), name="devices"),
            informer.Informer(self.kube, "/api/v1/pods", self._changed(self.cache.on_pod), name="pods"),
        ]
        self.tasks = [asyncio.create_task(i.run()) for i in self.informers]
        await asyncio.gather(*(i.synced.wait() for i in self.informers))
        self.cache.rebuild()
        self.tasks.append(asyncio.create_task(self._reconcile_loop()))

    async def stop(self) -> None:
        await informer.cancel(self.tasks)

    def _changed(self, handler: Callable[[str, Json], None]) -> Callable[[str, Json], None]:
        def wrapped(kind: str, obj: Json) -> None:
            handler(kind, obj)
            self._wake.set()

        return wrapped

    @property
    def ready(self) -> bool:
        return bool(self.informers) and all(i.synced.is_set() for i in self.informers)

    # ----------------------------------------------------------------- HTTP

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/filter", self._timed("filter", self.filter))
        app.router.add_post("/prioritize", self._timed("prioritize", self.prioritize))
        app.router.add_post("/bind", self._timed("bind", self.bind))
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/debug/nodes", self.debug_nodes)
        return app

    def _timed(
        self, verb: str, handler: Callable[[Json], Awaitable[Any]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def route(request: web.Request) -> web.Response:
            started = time.perf_counter()
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError as exc:
                return web.json_response({"Error": f"malformed JSON: {exc}"}, status=400)
            if not isinstance(body, dict):
                return web.json_response({"Error": "expected a JSON object"}, status=400)
            result = await handler(body)
            self.metrics.latency.labels(verb).observe(time.perf_counter() - started)
            return web.Response(body=orjson.dumps(result), content_type="application/json")

        return route

    async def healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok") if self.ready else web.Response(text="caches not synced", status=503)

    async def prometheus(self, _: web.Request) -> web.Response:
        return web.Response(
            body=prometheus_client.generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8"
        )

    async def debug_nodes(self, _: web.Request) -> web.Response:
        counters = dataclasses.asdict(self.cache.counters)
        body = {"nodes": self.cache.summary(), "counters": counters}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    # ----------------------------------------------------------------- filter / prioritize

    def _candidates(self, args: Json) -> list[str]:
        names = args.get("NodeNames")
        if names is None:
            names = [n["metadata"]["name"] for n in ((args.get("Nodes") or {}).get("items") or [])]
        return [str(n) for n in names]

    async def filter(self, args: Json) -> Json:
        names = self._candidates(args)
        pod = args.get("Pod") or {}
        try:
            request = objects.pod_request(pod)
        except errors.InvalidInputError as exc:
            self.metrics.decisions.labels("filter", "invalid").inc()
            return {"NodeNames": [], "FailedNodes": dict.fromkeys(names, f"invalid GPU request: {exc}"), "Error": ""}
        state = self.cache.state
        failed: dict[str, str] = {}
        rows = []
        for name in names:
            row = state.row(name)
            if row is None:
                failed[name] = "node has no sharegpu GPU inventory (Device resource) or is not ready"
            else:
                rows.append(row)
        row_array = np.array(rows, dtype=np.int64)
        demand = request.demand
        _, feasible, *_ = self.cache.placer.evaluate(demand, row_array)
        ok_rows = row_array[feasible]
        if not len(ok_rows):
            for row in row_array.tolist():
                failed[state.names[row]] = _reason(fit.explain_node(state, demand, row))
            self.metrics.decisions.labels("filter", "unschedulable").inc()
            return {"NodeNames": [], "FailedNodes": failed, "Error": ""}
        for row in row_array[~feasible].tolist():
            failed[state.names[row]] = "insufficient GPU (sharegpu)"
        self.metrics.decisions.labels("filter", "feasible").inc()
        if self.narrow:
            decision = self.cache.placer.decide(demand, ok_rows)
            return {"NodeNames": [decision.node], "FailedNodes": failed, "Error": ""}
        return {"NodeNames": [state.names[r] for r in ok_rows.tolist()], "FailedNodes": failed, "Error": ""}

    async def prioritize(self, args: Json) -> list[Json]:
        names = self._candidates(args)
        try:
            request = objects.pod_request(args.get("Pod") or {})
        except errors.InvalidInputError:
            return [{"Host": n, "Score": 0} for n in names]
        state = self.cache.state
        known = [(n, state.row(n)) for n in names]
        rows = np.array([r for _, r in known if r is not None], dtype=np.int64)
        decision = self.cache.placer.decide(request.demand, rows) if len(rows) else None
        _, feasible, score, *_ = self.cache.placer.evaluate(request.demand, rows)
        by_row = {int(r): (bool(f), int(s)) for r, f, s in zip(rows.tolist(), feasible, score, strict=True)}
        out = []
        for name, row in known:
            if decision is not None and name == decision.node:
                value = 10
            elif row is None or not by_row[row][0]:
                value = 0
            else:
                value = min(9, by_row[row][1] * 10 // 100)
            out.append({"Host": name, "Score": value})
        return out

    # ----------------------------------------------------------------- bind

    async def bind(self, args: Json) -> Json:
        namespace, name, node = (
            str(args.get("PodNamespace", "")),
            str(args.get("PodName", "")),
            str(args.get("Node", "")),
        )
        key = units.pod_key(namespace, name)
        pod = self.cache.pods.get(key)
        if pod is None or (pod.get("metadata") or {}).get("uid") != args.get("PodUID"):
            try:
                pod = await self.kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
            except errors.SharegpuError as exc:
                self.metrics.binds.labels("error").inc()
                return {"Error": f"cannot read pod {key}: {exc}"}
        try:
            request = objects.pod_request(pod)
        except errors.InvalidInputError as exc:
            self.metrics.binds.labels("invalid").inc()
            return {"Error": str(exc)}
        state = self.cache.state
        row = state.row(node)
        if row is None:
            self.metrics.binds.labels("error").inc()
            return {"Error": f"node {node} has no sharegpu inventory"}
        if key in self.cache.ledger:
            self.metrics.binds.labels("error").inc()
            return {"Error": f"pod {key} is already placed or being bound"}
        decision = self.cache.placer.decide(request.demand, np.array([row], dtype=np.int64))
        if not decision.status.ok:
            self.metrics.binds.labels("unschedulable").inc()
            return {
                "Error": f"pod {key} no longer fits on {node}: {_reason(fit.explain_node(state, request.demand, row))}"
            }
        alloc = self.cache.placer.allocation_for(request, decision)
        if not self.cache.assume(alloc):
            self.metrics.binds.labels("conflict").inc()
            return {"Error": f"pod {key}: the allocation conflicts with the ledger"}
        try:
            if not alloc.exclusive:
                for slot in alloc.gpu_indices:
                    await self.ensure_reservation(node, slot)
            binding = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "annotations": {objects.ANNOTATION_ALLOCATION: alloc.to_json()},
                },
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            }
            await self.kube.create(f"/api/v1/namespaces/{namespace}/pods/{name}/binding", binding)
        except (errors.SharegpuError, OSError) as exc:
            self.cache.forget(key)
            self._wake.set()
            self.metrics.binds.labels("error").inc()
            return {"Error": f"binding {key} to {node} failed: {exc}"}
        self.metrics.binds.labels("bound").inc()
        return {"Error": ""}

    async def ensure_reservation(self, node: str, slot: int) -> None:
        """Make sure a live reservation pod holds GPU `slot` of `node` (creating one if needed)."""
        current = self.cache.reservations.get((node, slot))
        if current is not None and not current.retiring:
            return
        pending = self._creating.get((node, slot))
        if pending is not None:
            await asyncio.shield(pending)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._creating[(node, slot)] = future
        try:
            name = objects.reservation_name(node, slot) + "-" + secrets.token_hex(3)
            await self.kube.create(
                f"/api/v1/namespaces/{objects.SYSTEM_NAMESPACE}/pods", self._reservation_pod(name, node, slot)
            )
            self.cache.reservations[(node, slot)] = cache_mod.Reservation(name, node, slot)
            self.metrics.reservations.labels("created").inc()
            future.set_result(None)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            del self._creating[(node, slot)]

    def _reservation_pod(self, name: str, node: str, slot: int) -> Json:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": objects.SYSTEM_NAMESPACE,
                "labels": {
                    objects.LABEL_ROLE: objects.ROLE_RESERVATION,
                    objects.LABEL_NODE: node,
                    objects.LABEL_SLOT: str(slot),
                },
            },
            "spec": {
                "nodeName": node,
                "priorityClassName": "system-node-critical",
                "tolerations": [{"operator": "Exists"}],
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "reserve",
                        "image": self.image,
                        "command": ["sharegpu", "reserve"],
                        "env": [
                            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                        ],
                        "resources": {
                            "limits": {objects.NVIDIA_GPU: "1", "cpu": "10m", "memory": "32Mi"},
                            "requests": {objects.NVIDIA_GPU: "1", "cpu": "10m", "memory": "32Mi"},
                        },
                    }
                ],
            },
        }

    # ----------------------------------------------------------------- reconcile: hand-off and cleanup

    async def _reconcile_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile failed; retrying")
            await asyncio.sleep(0.05)

    async def reconcile(self) -> None:
        """Fill hand-off ConfigMaps whose GPUs are known; delete reservation pods whose last sharer is gone."""
        await self.fill_handoffs()
        for (node, slot), reservation in list(self.cache.reservations.items()):
            if reservation.uuid:
                self._replacements.pop((node, slot), None)  # it runs: the backoff starts over
            if reservation.retiring or self.cache.sharers(node, slot) or (node, slot) in self._creating:
                continue
            reservation.retiring = True  # from now on no new sharer is given this reservation
            try:
                await self.kube.delete(f"/api/v1/namespaces/{objects.SYSTEM_NAMESPACE}/pods/{reservation.name}")
                self.metrics.reservations.labels("deleted").inc()
            except errors.SharegpuError as exc:
                reservation.retiring = False
                log.warning("deleting reservation %s failed: %s", reservation.name, exc)
        await self.replace_lost_reservations()

    async def replace_lost_reservations(self) -> None:
        """A shared GPU whose reservation pod is gone (evicted, failed, deleted by hand) gets a new one,
        with exponential backoff per GPU (a device plugin that cannot admit it must not cause churn);
        reservation pods that ended are deleted."""
        for name in list(self.cache.finished_reservations):
            self.cache.finished_reservations.discard(name)
            await self.kube.delete(f"/api/v1/namespaces/{objects.SYSTEM_NAMESPACE}/pods/{name}")
        state = self.cache.state
        shared = np.argwhere(state.tenants - state.exclusive > 0)
        now = time.monotonic()
        for row, slot in shared.tolist():
            node = state.names[row]
            current = self.cache.reservations.get((node, slot))
            if (current is not None and not current.retiring) or (node, slot) in self._creating:
                continue
            attempts, not_before = self._replacements.get((node, slot), (0, 0.0))
            if now < not_before:
                self._wake_later(not_before - now)
                continue
            self._replacements[(node, slot)] = (attempts + 1, now + min(60.0, 0.5 * 2**attempts))
            try:
                await self.ensure_reservation(node, slot)
                log.warning("GPU %d of %s lost its reservation pod; created a new one", slot, node)
            except errors.SharegpuError as exc:
                log.warning("re-creating the reservation of %s/gpu%d failed: %s", node, slot, exc)

    def _wake_later(self, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self._wake.set)

    def _handoff_owners(self) -> dict[tuple[str, str], units.PodKey]:
        """(namespace, ConfigMap) -> the one pod it belongs to. The pod that already owns it keeps it;
        otherwise the oldest claimant. A pod naming another pod's ConfigMap (a copied name) gets nothing."""
        claimants: dict[tuple[str, str], list[tuple[str, units.PodKey]]] = {}
        for key in self.cache.handoff_pods:
            meta = self.cache.pods[key].get("metadata") or {}
            claim = (
                str(meta.get("namespace", "")),
                str((meta.get("annotations") or {}).get(objects.ANNOTATION_HANDOFF)),
            )
            claimants.setdefault(claim, []).append((str(meta.get("creationTimestamp", "")), key))
        owners: dict[tuple[str, str], units.PodKey] = {}
        for claim, pods in claimants.items():
            keys = [key for _, key in pods]
            owner = self._owner_of.get(claim)
            owners[claim] = owner if owner in keys else min(pods)[1]
            if len(pods) > 1:
                log.warning(
                    "hand-off ConfigMap %s/%s is named by %d pods; only %s gets it", *claim, len(pods), owners[claim]
                )
        for claim in list(self._owner_of):
            if claim not in claimants:
                del self._owner_of[claim]
        return owners

    async def fill_handoffs(self) -> None:
        owners = self._handoff_owners()
        for key in list(self.cache.handoff_pods):
            pod = self.cache.pods[key]
            meta = pod.get("metadata") or {}
            configmap = (meta.get("annotations") or {}).get(objects.ANNOTATION_HANDOFF)
            node = (pod.get("spec") or {}).get("nodeName")
            if not configmap or not node or objects.is_terminal(pod):
                continue
            if owners.get((str(meta.get("namespace", "")), str(configmap))) != key:
                continue
            try:
                alloc = objects.pod_allocation(pod)
            except errors.InvalidInputError:
                continue
            if alloc is None or alloc.exclusive:
                continue
            uuid_of: dict[int, str] = {}
            for slot in alloc.gpu_indices:
                reservation = self.cache.reservations.get((node, slot))
                if reservation is None or reservation.retiring or not reservation.uuid:
                    break
                uuid_of[slot] = reservation.uuid
            else:
                data = handoff.configmap_data(alloc, uuid_of)
                marker = (str(meta.get("uid", "")), tuple(sorted(data.items())))
                if self._filled.get(key) == marker:
                    continue
                if await self._write_configmap(key, meta, str(configmap), data):
                    self._filled[key] = marker
        for key in list(self._filled):
            if key not in self.cache.pods:
                del self._filled[key]

    async def _write_configmap(self, key: units.PodKey, owner: Json, name: str, data: dict[str, str]) -> bool:
        """Create or update the pod's hand-off ConfigMap; False if it belongs to another live pod."""
        namespace = str(owner["namespace"])
        reference = [{"apiVersion": "v1", "kind": "Pod", "name": owner["name"], "uid": owner["uid"]}]
        body: Json = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": {objects.LABEL_ROLE: "handoff"},
                         "ownerReferences": reference},
            "data": data,
        }  # fmt: skip
        path = f"/api/v1/namespaces/{namespace}/configmaps"
        try:
            try:
                await self.kube.create(path, body)
            except kube_errors.ConflictError:
                current = await self.kube.get(f"{path}/{name}")
                live = {str((p.get("metadata") or {}).get("uid")): k for k, p in self.cache.pods.items()}
                for ref in (current.get("metadata") or {}).get("ownerReferences") or []:
                    holder = live.get(str(ref.get("uid")))
                    if ref.get("uid") != owner["uid"] and holder is not None:
                        self._owner_of[(namespace, name)] = holder
                        log.warning("hand-off ConfigMap %s/%s belongs to %s; not giving it to %s", namespace, name,
                                    holder, key)  # fmt: skip
                        return False
                await self.kube.patch(f"{path}/{name}", {"data": data, "metadata": {"ownerReferences": reference}})
        except errors.SharegpuError as exc:
            log.warning("hand-off ConfigMap %s/%s: %s", namespace, name, exc)
            return False
        self._owner_of[(namespace, name)] = key
        return True


def _reason(verdict: Any) -> str:
    text = "; ".join(str(r) for r in verdict.reasons) or verdict.message or "does not fit"
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


async def serve(
    kubeconfig: str | None,
    host: str,
    port: int,
    policy: str,
    image: str,
    narrow: bool = True,
    shapes: tuple[frag.WeightedShape, ...] | None = None,
) -> None:
    """Run the extender until cancelled."""
    kube = await client.KubeClient.connect(kubeconfig)
    extender = Extender(kube, cache_mod.ClusterCache(policy, shapes=shapes), image=image, narrow=narrow)
    runner = web.AppRunner(extender.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await extender.start()
    await site.start()
    log.info("sharegpu extender listening on %s:%d (policy %s)", host, port, policy)
    try:
        await asyncio.Event().wait()
    finally:
        await extender.stop()
        await runner.cleanup()
        await kube.close()


__all__ = ["Extender", "serve"]
