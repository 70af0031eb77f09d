"""`sharegpu webhook`: the HTTPS admission server.

Endpoints: POST /mutate/pods, /validate/pods, /validate/devices, /validate/groups (AdmissionReview
v1), GET /healthz, /readyz and /metrics (admissions by kind and outcome, their durations, informer
readiness: docs/metrics.md). TLS comes from a certificate and key that are re-read when they change
(`serving.tls.ReloadingTls`), so a renewed certificate is served from the next connection on. With a
kubeconfig, the webhook follows the Device inventory (largest GPU memory, models) for its checks,
the GPUBudgets and ClusterGPUBudgets (an exhausted one refuses or demotes new GPU pods; cluster ones
by the labels of the namespaces, which it also follows, and asks for a namespace it has not seen
yet) and the PriorityClasses (what a demoted pod must carry); /readyz is false until those informers
have listed, and again whenever one cannot watch. Before it judges a new pod that names
ResourceClaims, it reads each claim or template from the API (`_learn_claims`): a pod whose claims
may be of sharegpu's class is gated for sharegpu's allocator.

Malformed bodies never crash the server: anything that is not a JSON AdmissionReview gets a 400
with a message; a review that cannot be judged is refused (never allowed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import prometheus_client
from aiohttp import web
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sharegpu.api import admission as api_admission
from sharegpu.api import budgets, dra, groups, names, paths, podgroups, resources, wire
from sharegpu.core import errors
from sharegpu.kube import client, informer, reviews
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import access, counters, tls
from sharegpu.webhook import admission

log = logging.getLogger(__name__)

CLAIM_READ_TIMEOUT = 1.5
"""Seconds a new pod's admission waits for each of its claims (or templates) to be read (the API
server gives the webhook 5 s in all)."""
MAX_BODY = 8 * 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.Response]]
Judge = Callable[[web.Request], Awaitable[api_admission.ReviewResponse | web.Response]]
"""A review's answer, or the HTTP error for a body that is not one."""


class Metrics(Collector):
    """The webhook's registry: admissions counted as they are answered, informer readiness read at
    each scrape."""

    def __init__(self, hook: Webhook) -> None:
        self.hook = hook
        self.registry = prometheus_client.CollectorRegistry()
        self.admissions = counters.counter(
            self.registry,
            "sharegpu_webhook_admissions",
            "Admission reviews answered, by kind (mutate, validate, devices, groups, evictions) and outcome "
            "(allowed; denied; error: the body was no review, or it could not be judged)",
            kind=Review,
            outcome=Verdict,
        )
        self.duration = prometheus_client.Histogram(
            "sharegpu_webhook_admission_duration_seconds",
            "Time to answer one admission review, by kind",
            ["kind"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5),
        )
        self.registry.register(self)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ready = GaugeMetricFamily(
            "sharegpu_webhook_informer_ready", "1 while an informer is synced and watching", labels=["informer"]
        )
        for item in self.hook.informers:
            ready.add_metric([item.name], 1 if item.ready else 0)
        yield ready


class Review(enum.StrEnum):
    """Which review a route answers: the `kind` label of `sharegpu_webhook_admissions_total`."""

    MUTATE = "mutate"
    VALIDATE = "validate"
    DEVICES = "devices"
    GROUPS = "groups"
    EVICTIONS = "evictions"


class Verdict(enum.StrEnum):
    """How a review was answered: its `outcome` label."""

    ALLOWED = "allowed"
    DENIED = "denied"
    """A refusal."""
    ERROR = "error"
    """Refused because it could not be judged (a 500), or the body was no review."""


def outcome(answer: api_admission.ReviewResponse) -> Verdict:
    """allowed; denied (a refusal); or error (refused because it could not be judged: a 500)."""
    response = answer.response
    if response.allowed:
        return Verdict.ALLOWED
    return Verdict.ERROR if response.status is not None and response.status.code >= 500 else Verdict.DENIED


class Webhook:
    """The handlers and the one piece of state they read: the current `Policy`."""

    def __init__(self, policy: admission.Policy) -> None:
        self.policy = policy
        self.devices: dict[str, wire.Device] = {}
        self.budgets: dict[str, budgets.GPUBudget] = {}
        self.cluster_budgets: dict[str, budgets.ClusterGPUBudget] = {}
        self.namespaces: dict[str, dict[str, str]] = {}
        self.priority_classes: dict[str, admission.PriorityClass] = {}
        self.groups: dict[str, groups.SharedDeviceGroup] = {}
        self.informers: list[informer.Informer[Any, Any]] = []
        self.kube: client.KubeApi | None = None
        self._served: bool | None = None
        """Whether the API server serves resource.k8s.io/v1 (None: not asked yet)."""
        self.metrics = Metrics(self)

    def follow(self, kube: client.KubeApi) -> None:
        """Follow the Devices, GPUBudgets, PriorityClasses and SharedDeviceGroups the decisions depend on."""
        self.kube = kube
        self.informers = [
            informer.Informer(kube, paths.DEVICES, wire.Device, informer.identity, self.on_device,
                              name="webhook-devices"),
            informer.Informer(kube, resources.GPU_BUDGET.path(), budgets.GPUBudget, informer.identity,
                              self.on_budget, name="webhook-gpubudgets"),
            informer.Informer(kube, resources.CLUSTER_GPU_BUDGET.path(), budgets.ClusterGPUBudget,
                              informer.identity, self.on_cluster_budget, name="webhook-clustergpubudgets"),
            informer.Informer(kube, paths.NAMESPACES, wire.Namespace, informer.identity, self.on_namespace,
                              name="webhook-namespaces"),
            informer.Informer(kube, paths.PRIORITY_CLASSES, wire.PriorityClass, informer.identity,
                              self.on_priority_class, name="webhook-priorityclasses"),
            informer.Informer(kube, resources.SHARED_DEVICE_GROUP.path(), groups.SharedDeviceGroup,
                              informer.identity, self.on_group, name="webhook-shareddevicegroups"),
        ]  # fmt: skip

    def app(self, gate: access.Gate | None = None) -> web.Application:
        """The admission paths (the API server calls them), /healthz and /readyz; /metrics behind
        `gate` (`serving.access`) when given."""
        app = web.Application(client_max_size=MAX_BODY, middlewares=[gate.middleware] if gate is not None else [])
        app.router.add_post("/mutate/pods", self._counted(Review.MUTATE, self._handler("mutate")))
        app.router.add_post("/validate/pods", self._counted(Review.VALIDATE, self._handler("validate")))
        app.router.add_post("/validate/devices", self._counted(Review.DEVICES, self.validate_device))
        app.router.add_post("/validate/groups", self._counted(Review.GROUPS, self.validate_group))
        app.router.add_post("/validate/evictions", self._counted(Review.EVICTIONS, self.validate_eviction))
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.prometheus)
        return app

    def _counted(self, kind: Review, judge: Judge) -> Handler:
        """The route of `judge`: its answer encoded, counted by outcome and timed (a body that is not
        a review is an error: the API server refuses the request, as for a review not judged)."""

        async def counted(request: web.Request) -> web.Response:
            started = time.perf_counter()
            reply = await judge(request)
            found = Verdict.ERROR
            if isinstance(reply, api_admission.ReviewResponse):
                found = outcome(reply)
                reply = web.Response(body=api_admission.encode(reply), content_type="application/json")
            self.metrics.admissions.labels(kind, found).inc()
            self.metrics.duration.labels(kind).observe(time.perf_counter() - started)
            return reply

        return counted

    async def prometheus(self, _: web.Request) -> web.Response:
        body = prometheus_client.generate_latest(self.metrics.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, _: web.Request) -> web.Response:
        if all(i.ready for i in self.informers):
            return web.Response(text="ok")
        return web.json_response({i.name: i.status() for i in self.informers}, status=503)

    def _handler(self, kind: str) -> Judge:
        async def handle(request: web.Request) -> api_admission.ReviewResponse | web.Response:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError as exc:
                return web.json_response({"error": f"malformed JSON: {exc}"}, status=400)
            except web.HTTPRequestEntityTooLarge:
                return web.json_response({"error": "request body too large"}, status=413)
            claims = group = None
            if kind == "mutate":
                await self._learn_namespace(body)
                claims = await self._learn_claims(body)
                group = await self._learn_group(body)
            return handle_review(kind, body, self.policy, claims, group)

        return handle

    def on_device(self, kind: wire.EventType, device: wire.Device) -> None:
        informer.remember(self.devices, kind, device)
        gpus = [(g.model, g.memory_mib) for d in self.devices.values() for g in d.spec.gpus]
        self.policy = admission.with_inventory(self.policy, gpus)

    async def _asking_the_api(
        self, request: web.Request, failed: str, judge: Callable[[Any], Awaitable[api_admission.ReviewResponse]]
    ) -> api_admission.ReviewResponse | web.Response:
        """A review whose judgement asks the API: `judge(body)`, or a refusal saying it `failed` and
        why (never allow what could not be judged)."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return web.json_response({"error": f"malformed JSON: {exc}"}, status=400)
        try:
            return await judge(body)
        except Exception as exc:
            log.exception("review failed: %s", failed)
            uid = str((body.get("request") or {}).get("uid", "")) if isinstance(body, dict) else ""
            return api_admission.deny(uid, f"sharegpu: {failed}: {exc}", code=500)

    async def validate_group(self, request: web.Request) -> api_admission.ReviewResponse | web.Response:
        """A group's deletion (refused while live pods are its members) or update (refused when it
        changes a bound group's placement, or takes out a namespace whose pods are members); members
        are asked of the API, not a cache."""

        async def judge(body: Any) -> api_admission.ReviewResponse:
            review = api_admission.review(body).request
            members: list[str] = []
            if review.operation == "DELETE":
                # The namespaces the stored group admits, not those of the review's oldObject: anyone on
                # the pod network can send a review, and have members listed in namespaces they choose.
                stored = self.groups.get(f"{review.namespace}/{review.name}")
                if stored is not None:
                    admitted: Collection[str] = stored.spec.members.namespaces
                else:
                    old = ((review.old_object or {}).get("spec") or {}).get("members") or {}
                    admitted = () if admission.is_sharegpu_group(review) else old.get("namespaces") or ()
                members = await self._members(review.namespace, review.name, admitted)
            elif leaving := admission.leaving_namespaces(review):
                found = await self._members(review.namespace, review.name, leaving)
                members = [key for key in found if key.split("/", 1)[0] in leaving]
            return admission.validate_group(body, members)

        return await self._asking_the_api(request, "could not list the group's members", judge)

    async def validate_device(self, request: web.Request) -> api_admission.ReviewResponse | web.Response:
        """A Device write: consistent, and a node agent's only for its own node (the node of the pod
        its token is bound to, asked of the API when the token does not name the node itself)."""

        async def judge(body: Any) -> api_admission.ReviewResponse:
            writer = admission.device_writer(api_admission.review(body).request, self.policy)
            node = writer.node or (await self._node_of(writer.pod) if writer.pod is not None else "")
            return admission.validate_device(body, self.policy, node if writer.agent else None)

        return await self._asking_the_api(request, "could not judge the Device write", judge)

    async def validate_eviction(self, request: web.Request) -> api_admission.ReviewResponse | web.Response:
        """An eviction by a node agent: only of a pod on the agent's own node (asked of the API: a
        policy cannot read the evicted pod)."""

        async def judge(body: Any) -> api_admission.ReviewResponse:
            review = api_admission.review(body).request
            node = ""
            if review.user_info.username in self.policy.agent_users:
                node = await self._node_of((review.namespace, review.name))
            return admission.validate_eviction(body, self.policy, node)

        return await self._asking_the_api(request, "could not judge the eviction", judge)

    async def _node_of(self, pod: tuple[str, str]) -> str:
        if self.kube is None:
            raise errors.InvalidInputError("the webhook runs without a kubeconfig: it cannot find the agent's node")
        try:
            found = await self.kube.get(paths.pod(*pod))
        except kube_errors.NotFoundError:
            return ""
        return str((found.get("spec") or {}).get("nodeName") or "")

    async def _members(self, namespace: str, name: str, admitted: Collection[str]) -> list[str]:
        """The live members of a group (of either system's kind: the other's spec may admit no other
        namespace) that its namespaces admit."""
        if self.kube is None:
            raise errors.InvalidInputError("the webhook runs without a kubeconfig: it cannot list members")
        listed = await self.kube.get(paths.PODS, labelSelector=groups.group_selector(namespace, name))
        members = (wire.convert(item, wire.Pod) for item in listed.get("items") or [])
        return sorted(wire.key(p.metadata) for p in members if groups.live_member(p, namespace, admitted))

    def on_group(self, kind: wire.EventType, item: groups.SharedDeviceGroup) -> None:
        informer.remember(self.groups, kind, item)
        self.policy = dataclasses.replace(self.policy, groups=dict(self.groups))

    def on_budget(self, kind: wire.EventType, item: budgets.GPUBudget) -> None:
        informer.remember(self.budgets, kind, item)
        by_namespace: dict[str, list[budgets.GPUBudget]] = {}
        for found in self.budgets.values():
            by_namespace.setdefault(found.metadata.namespace, []).append(found)
        grouped = {ns: tuple(items) for ns, items in by_namespace.items()}
        self.policy = dataclasses.replace(self.policy, budgets=grouped)

    def on_cluster_budget(self, kind: wire.EventType, item: budgets.ClusterGPUBudget) -> None:
        informer.remember(self.cluster_budgets, kind, item)
        self._share_namespaces()

    def on_namespace(self, kind: wire.EventType, item: wire.Namespace) -> None:
        if not informer.remember_labels(self.namespaces, kind, item):
            return
        if self.cluster_budgets:
            self._share_namespaces()
        chosen = {ns: labels[names.PATH] for ns, labels in self.namespaces.items() if names.PATH in labels}
        if chosen != self.policy.namespace_paths:
            self.policy = dataclasses.replace(self.policy, namespace_paths=chosen)

    def _share_namespaces(self) -> None:
        """Give the policy the cluster budgets, and the namespaces' labels while any exist (a copy per
        change: the policy is a value the handlers read between awaits)."""
        labels = {ns: dict(v) for ns, v in self.namespaces.items()} if self.cluster_budgets else {}
        self.policy = dataclasses.replace(
            self.policy, cluster_budgets=tuple(self.cluster_budgets.values()), namespace_labels=labels
        )

    async def _learn_namespace(self, body: Any) -> None:
        """Before judging a pod of a namespace the informer has not brought yet (created a moment ago),
        read its labels from the API, so no cluster budget and no path label (`names.PATH`) misses it."""
        if self.kube is None or not isinstance(body, dict):
            return
        request = body.get("request")
        namespace = request.get("namespace") if isinstance(request, dict) else None
        if not isinstance(namespace, str) or not namespace or namespace in self.namespaces:
            return
        try:
            found = wire.convert(await self.kube.get(paths.namespace(namespace)), wire.Namespace)
        except errors.SharegpuError as exc:  # judged without its labels; the informer brings them soon
            log.warning("namespace %s: could not read its labels: %s", namespace, exc)
            return
        self.on_namespace(wire.EventType.ADDED, found)

    async def _learn_claims(self, body: Any) -> dict[str, bool | None] | None:
        """For a new pod with ResourceClaims: per `spec.resourceClaims` entry, whether its claim (or the
        template it is made from) asks for sharegpu's class, read from the API at this moment (None:
        not made yet, or not readable within `CLAIM_READ_TIMEOUT`: held as sharegpu's). Where
        resource.k8s.io/v1 is not served no claim is sharegpu's. None for any other review, or
        without the API (every entry then counts as sharegpu's)."""
        request = body.get("request") if isinstance(body, dict) else None
        if self.kube is None or not isinstance(request, dict) or request.get("operation") != "CREATE":
            return None
        spec = (request.get("object") or {}).get("spec") or {}
        entries = [e for e in spec.get("resourceClaims") or [] if isinstance(e, dict)]
        if not entries:
            return None
        if not await self._dra_served():
            return {str(e.get("name", "")): False for e in entries}
        namespace = str(request.get("namespace") or "")
        out: dict[str, bool | None] = {}
        for entry in entries:
            out[str(entry.get("name", ""))] = await self._asks_class(namespace, entry)
        return out

    async def _learn_group(self, body: Any) -> admission.GroupRead | None:
        """For a new pod that names another scheduler's pod group (`api.podgroups`): the group, read from
        the API at this moment (its gang is written from it). None for any other review, or without the API."""
        request = body.get("request") if isinstance(body, dict) else None
        if self.kube is None or not isinstance(request, dict) or request.get("operation") != "CREATE":
            return None
        pod = _mapping(request.get("object"))
        metadata = _mapping(pod.get("metadata"))
        labels, annotations = _mapping(metadata.get("labels")), _mapping(metadata.get("annotations"))
        try:
            ref = podgroups.reference(
                str(request.get("namespace") or ""), _mapping(pod.get("spec")), labels, annotations
            )
        except (AttributeError, TypeError):
            return None  # a malformed pod: mutate refuses it with the reason
        if ref is None:
            return None
        try:
            found = await asyncio.wait_for(self.kube.get(ref.path), CLAIM_READ_TIMEOUT)
        except kube_errors.NotFoundError:
            return admission.GroupRead(ref, None)
        except (errors.SharegpuError, TimeoutError) as exc:
            return admission.GroupRead(ref, None, str(exc) or "timed out")
        return admission.GroupRead(ref, found)

    async def _asks_class(self, namespace: str, entry: dict[str, Any]) -> bool | None:
        claim, template = entry.get("resourceClaimName"), entry.get("resourceClaimTemplateName")
        assert self.kube is not None
        if isinstance(claim, str) and dra.claim_shape(claim) is not None:
            return True  # a pod's claim of sharegpu's (the allocator makes it): no read (a claim of that
            # name someone made of another class: the allocator lets the gated pod go)
        try:
            if isinstance(claim, str) and claim:
                read = self.kube.get(dra.claim_path(namespace, claim))
                found = wire.convert(await asyncio.wait_for(read, CLAIM_READ_TIMEOUT), dra.ResourceClaim).spec
            elif isinstance(template, str) and template:
                read = self.kube.get(dra.template_path(namespace, template))
                made = wire.convert(await asyncio.wait_for(read, CLAIM_READ_TIMEOUT), dra.ResourceClaimTemplate)
                found = made.spec.spec
            else:
                return None
        except kube_errors.NotFoundError:
            return None
        except (errors.SharegpuError, TimeoutError) as exc:
            log.warning("pod in %s: could not read its claim %s: %s (held as sharegpu's)", namespace,
                        claim or template, exc or "timed out")  # fmt: skip
            return None
        return dra.asks_class(found)

    async def _dra_served(self) -> bool:
        """Whether the API server serves resource.k8s.io/v1 (asked once; an error counts as served)."""
        if self._served is None and self.kube is not None:
            try:
                self._served = await asyncio.wait_for(client.serves(self.kube, dra.API_VERSION), CLAIM_READ_TIMEOUT)
            except (errors.SharegpuError, TimeoutError) as exc:
                log.warning("could not learn whether %s is served: %s", dra.API_VERSION, exc or "timed out")
                return True
        return self._served is not False

    def on_priority_class(self, kind: wire.EventType, item: wire.PriorityClass) -> None:
        if kind == wire.EventType.DELETED:
            self.priority_classes.pop(item.metadata.name, None)
        else:
            policy = item.preemption_policy or "PreemptLowerPriority"
            self.priority_classes[item.metadata.name] = admission.PriorityClass(item.value, policy)
        self.policy = dataclasses.replace(self.policy, priority_classes=dict(self.priority_classes))


def _mapping(value: object) -> dict[str, Any]:
    """`value` when it is a JSON object, else an empty one (a malformed review is refused later, by name)."""
    return value if isinstance(value, dict) else {}


def handle_review(
    kind: str,
    body: Any,
    policy: admission.Policy,
    claims: Mapping[str, bool | None] | None = None,
    group: admission.GroupRead | None = None,
) -> api_admission.ReviewResponse:
    """Never raises: a review that cannot be judged is refused with the reason."""
    try:
        return admission.review(kind, body, policy, claims, group)
    except Exception as exc:  # a bug must not allow a pod through, nor crash the server
        log.exception("admission %s failed", kind)
        uid = ""
        if isinstance(body, dict) and isinstance(body.get("request"), dict):
            uid = str(body["request"].get("uid", ""))
        return api_admission.deny(uid, f"sharegpu: internal error: {exc}", code=500)


async def serve(
    host: str,
    port: int,
    cert: Path,
    key: Path,
    hook: Webhook,
    kubeconfig: str | None = None,
    ready: asyncio.Event | None = None,
    metrics_auth: bool = True,
) -> None:
    """Serve `hook` until cancelled; with a kubeconfig, follow what its decisions depend on (and,
    with `metrics_auth`, let only a token the API server allows read /metrics)."""
    context = tls.ReloadingTls(cert, key)
    tasks = []
    kube = None
    gate = None
    if kubeconfig is not None:
        kube = client.KubeClient.connect(kubeconfig or None)
        hook.follow(kube)
        tasks = [asyncio.create_task(i.run(), name=i.name) for i in hook.informers]
        gate = access.Gate(reviews.ApiReviewer(kube)) if metrics_auth else None
    runner = web.AppRunner(hook.app(gate), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=context.context)
    await site.start()
    log.info("sharegpu webhook listening on %s:%d", host, port)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await informer.cancel(tasks)
        await runner.cleanup()
        if kube is not None:
            await kube.close()


__all__ = ["Metrics", "Webhook", "handle_review", "outcome", "serve"]
