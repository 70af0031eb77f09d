"""An API server in memory, as a `Transport`: what the unit tests of every component run against.

It keeps the semantics sharegpu relies on, not the whole API: objects by path with uid,
resourceVersion (one counter for everything, as etcd's revision) and creationTimestamp (distinct and
increasing, one second apart, so creation order is never a tie); paged lists (limit/continue) with
label selectors (equality and set-based) and field selectors; watches that replay events after a
resourceVersion (with a selector, an object a change takes out of it arrives as DELETED, as it was,
and one a change brings in as ADDED), end after timeoutSeconds with a bookmark, and answer 410 for versions older than
the last compaction; discovery of the group versions it is told it serves (`served`); create
(409 AlreadyExists, generateName), get, replace (409 on a stale resourceVersion), merge, strategic
(treated as merge) and JSON patches, delete with uid and
resourceVersion preconditions (409) and a grace period for bound pods (deletionTimestamp and
deletionGracePeriodSeconds, then gone when deleted again with grace 0 or `finish_deletions()`),
finalizers holding a deletion, pods/binding (409 when already bound; the binding's annotations land
on the pod), pods/eviction (its UID precondition and dry run honoured; a pod that is not running, or is being
deleted, goes at once; else 429
when a PodDisruptionBudget of its namespace that selects it, by its full label selector, has
`status.disruptionsAllowed` below 1; otherwise the budget's allowance goes down by one and the pod
is deleted gracefully) and status subresources. tests/integration/test_fake_contract.py holds these
answers against the real API server's. It starts with the CustomResourceDefinitions of sharegpu's
resources as this release writes them (`api.resources.definitions()`), as a cluster sharegpu is installed on.

Faults are injected explicitly: `fail(status, ...)` answers the next matching requests with an error
(429 with Retry-After, 409, 500, ...), instead of carrying them out or, with `after_commit`, after
carrying them out (a 5xx from something on the way back); `lose(...)` gives them no answer at all
(the connection breaks after the request was sent), after carrying them out by default;
`expire_watches()` sends 410 to every open watch and compacts history so resuming is impossible,
`cut_watches()` drops their connections, `stall_watches()` leaves them open but sends nothing more
(a connection the server's side lost without closing it: the client gives it up after its idle
timeout, as the real transport does), and `tokens` makes requests without one of them answer
401. Every request is logged in `requests`.

Single event loop, no locks: every method runs to completion between awaits.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import functools
import itertools
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jsonpatch
import orjson

from sharegpu.api import paths, resources, wire
from sharegpu.api import pods as api_pods
from sharegpu.kube import client, errors, transport

Json = dict[str, Any]


def _resource(collection: str) -> str:
    """A collection's resource: "pods" of "/api/v1|pods"."""
    return collection.partition("|")[2]


class Key(NamedTuple):
    """Where an object is kept: its collection (e.g. "/api/v1|pods" or "/apis/sharegpu.io/v1alpha1|devices"),
    namespace ("" for cluster objects) and name."""

    collection: str
    namespace: str
    name: str

    @property
    def resource(self) -> str:
        """The collection's resource ("pods", "devices")."""
        return _resource(self.collection)

    def within(self, collection: str, namespace: str) -> bool:
        """In `collection`, and in `namespace` unless that is "" (every namespace)."""
        return self.collection == collection and (not namespace or self.namespace == namespace)


LOST = 0
"""A fault's status for "no answer": the connection broke after the request was sent."""


@dataclass
class Fault:
    status: int
    """The answer's status, or LOST."""
    method: str | None = None
    path: str | None = None
    """Matches when the request path starts with this."""
    times: int = 1
    retry_after: int | None = None
    reason: str = ""
    after_commit: bool = False
    """Carry the request out first, then answer with the fault instead of its own answer."""


@dataclass
class _Event:
    version: int
    collection: str
    namespace: str
    kind: wire.EventType
    obj: Json
    old: Json | None = None
    """What a MODIFIED object was before (a watch with a selector sees it leave or enter)."""


@dataclass
class _Watch:
    collection: str
    namespace: str | None
    selector: Selector
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)


_KIND = {
    "pods": "Pod", "nodes": "Node", "configmaps": "ConfigMap", "namespaces": "Namespace", "events": "Event",
    "leases": "Lease", "devices": "Device", "bindings": "Binding", "secrets": "Secret",
    "serviceaccounts": "ServiceAccount", "poddisruptionbudgets": "PodDisruptionBudget",
    "resourceclaims": "ResourceClaim", "resourceslices": "ResourceSlice",
    "resourceclaimtemplates": "ResourceClaimTemplate",
}  # fmt: skip


_STATUS_SUBRESOURCE = frozenset({"/api/v1|pods", "/api/v1|nodes", "/apis/resource.k8s.io/v1|resourceclaims"})
"""Collections whose status only the status subresource changes."""


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


FIELD = "field:"
"""Prefix of field-selector keys in a parsed selector (`spec.nodeName=n0` -> `field:spec.nodeName`)."""


def _field(obj: Json, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


@dataclass(frozen=True, slots=True)
class _Requirement:
    """One term of a selector: a label's (`key`) or a field's (`FIELD` + its path)."""

    key: str
    operator: str
    """"=", "!=", "in", "notin", "exists" or "!" (does not exist)."""
    values: frozenset[str] = frozenset()

    def holds(self, obj: Json) -> bool:
        if self.key.startswith(FIELD):
            found: str | None = _field(obj, self.key[len(FIELD) :])
        else:
            found = ((obj.get("metadata") or {}).get("labels") or {}).get(self.key)
        if self.operator in ("=", "in"):
            return found is not None and found in self.values
        if self.operator in ("!=", "notin"):
            return found is None or found not in self.values
        return (found is not None) == (self.operator == "exists")


Selector = tuple[_Requirement, ...]


def _selected(obj: Json, selector: Selector) -> bool:
    return all(requirement.holds(obj) for requirement in selector)


def _selectors(params: Mapping[str, str]) -> Selector:
    """The label selector and the field selector of a list or watch, as one."""
    fields = tuple(
        _Requirement(FIELD + r.key, r.operator, r.values) for r in _parse_selector(params.get("fieldSelector", ""))
    )
    return _parse_selector(params.get("labelSelector", "")) + fields


_SET = re.compile(r"^([^\s!=(),]+)\s+(in|notin)\s*\(([^()]*)\)$")


def _parse_selector(text: str) -> Selector:
    """Label selectors as the API server reads them: `a=b`, `a==b`, `a!=b`, `a in (b,c)`,
    `a notin (b,c)`, `a` (exists), `!a` (does not exist); terms joined by commas."""
    out: list[_Requirement] = []
    for part in filter(None, (p.strip() for p in re.split(r",(?![^(]*\))", text))):
        matched = _SET.match(part)
        if matched:
            key, operator, values = matched.groups()
            out.append(_Requirement(key, operator, frozenset(v.strip() for v in values.split(",") if v.strip())))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            out.append(_Requirement(key.strip(), "!=", frozenset({value.strip()})))
        elif "=" in part:
            key, value = part.replace("==", "=").split("=", 1)
            out.append(_Requirement(key.strip(), "=", frozenset({value.strip()})))
        elif part.startswith("!"):
            out.append(_Requirement(part[1:].strip(), "!"))
        else:
            out.append(_Requirement(part, "exists"))
    return tuple(out)


class _AnswerError(Exception):
    def __init__(self, status: int, reason: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after


class _FakeStream:
    def __init__(
        self, status: int, body: bytes, queue: asyncio.Queue[bytes | None] | None, idle_timeout: float | None = None
    ) -> None:
        self.status = status
        self.headers: Mapping[str, str] = {}
        self._body = body
        self._queue = queue
        self._idle_timeout = idle_timeout

    async def read(self) -> bytes:
        return self._body

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._queue is None:
            return
        while True:
            try:
                async with asyncio.timeout(self._idle_timeout):  # no task of its own: events keep their pace
                    item = await self._queue.get()
            except TimeoutError:
                raise errors.TransportError(f"watch: no byte for {self._idle_timeout:g} s (fake)") from None
            if item is None:
                return
            if item == b"":
                raise errors.TransportError("watch connection cut (fake)")
            yield item


@functools.cache
def _definitions() -> tuple[Json, ...]:
    return tuple(resources.definitions().values())


class FakeApiServer:
    """See the module docstring."""

    def __init__(
        self,
        *,
        tokens: set[str] | None = None,
        history: int = 10_000,
        served: frozenset[str] = frozenset(),
        epoch: datetime.datetime | None = None,
    ) -> None:
        self.served = served
        """API group versions whose discovery document answers (e.g. "resource.k8s.io/v1"); any other
        answers 404, as an API server that does not serve it."""
        self.objects: dict[Key, Json] = {}
        self.version = 0
        self.compacted = 0
        self.history = history
        self.log: list[_Event] = []
        self.watches: list[_Watch] = []
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self.tokens = tokens
        self._uids = itertools.count(1)
        self._start = (epoch or datetime.datetime.now(datetime.UTC)).replace(microsecond=0)
        """Where its creation timestamps begin (`epoch`: a test's clock; now by default)."""
        self._seconds = itertools.count(0)
        for definition in _definitions():
            self.put_object(paths.DEFINITIONS, copy.deepcopy(definition))

    # ----------------------------------------------------------------- test controls

    def fail(
        self,
        status: int,
        *,
        method: str | None = None,
        path: str | None = None,
        times: int = 1,
        retry_after: int | None = None,
        reason: str = "",
        after_commit: bool = False,
    ) -> None:
        """Answer the next `times` matching requests with `status` (method "WATCH" for watches):
        instead of carrying them out, or after it with `after_commit`."""
        self.faults.append(Fault(status, method, path, times, retry_after, reason, after_commit))

    def lose(
        self, *, method: str | None = None, path: str | None = None, times: int = 1, after_commit: bool = True
    ) -> None:
        """Give the next `times` matching requests no answer (a TransportError that says the request
        was sent): carried out first with `after_commit` (the answer was lost on its way back), not
        at all otherwise (the request was lost on its way in)."""
        self.faults.append(Fault(LOST, method, path, times, after_commit=after_commit))

    def expire_watches(self) -> None:
        """Every open watch gets 410 Gone, and history is compacted so no one can resume from it."""
        self.compacted = self.version
        gone = orjson.dumps(
            {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                          "message": "too old resource version"}}
        ) + b"\n"  # fmt: skip
        for watch in self.watches:
            watch.queue.put_nowait(gone)
            watch.queue.put_nowait(None)
        self.watches.clear()

    def cut_watches(self) -> None:
        """Drop every open watch connection (a network fault or an API server restart)."""
        for watch in self.watches:
            watch.queue.put_nowait(b"")
        self.watches.clear()

    def stall_watches(self) -> int:
        """Every open watch hears nothing more, its connection left open (the server's side lost it
        without closing it); returns how many there were."""
        stalled = len(self.watches)
        self.watches.clear()
        return stalled

    def finish_deletions(self) -> None:
        """Remove every object that is being deleted (what the kubelet does for pods)."""
        for key, obj in list(self.objects.items()):
            if (obj.get("metadata") or {}).get("deletionTimestamp"):
                self._remove(key)

    def get_object(self, path: str) -> Json | None:
        """The stored object at an object path, or None (a copy)."""
        collection, namespace, name, _ = self._route(path)
        found = self.objects.get(Key(collection, namespace, name or ""))
        return copy.deepcopy(found) if found is not None else None

    def list_objects(self, collection_path: str) -> list[Json]:
        """The stored objects of a collection (of one namespace, or all), as copies."""
        collection, namespace, _, _ = self._route(collection_path)
        items: list[Json] = self._list(collection, namespace, {})["items"]
        return items

    def remove_object(self, path: str) -> None:
        """Delete an object at once (no grace, no faults), as a watch would see a deletion."""
        collection, namespace, name, _ = self._route(path)
        self._remove(Key(collection, namespace, name or ""))

    def put_object(self, collection_path: str, obj: Json) -> Json:
        """Store an object directly (as if created), bypassing faults and auth; returns it."""
        collection, namespace, _, _ = self._route(collection_path)
        return self._create(collection, namespace or (obj.get("metadata") or {}).get("namespace", ""), obj)

    # ----------------------------------------------------------------- Transport

    async def send(self, request: transport.Request, timeout: float) -> transport.Response:
        await asyncio.sleep(0)
        self.requests.append((request.method, request.path))
        try:
            self._authorize(request)
            fault = self._fault_for(request)
            if fault is not None and not fault.after_commit:
                return self._answer_fault(request, fault)
            try:
                status, body = self._handle(request)
                answer = transport.Response(status, orjson.dumps(body))
            except _AnswerError as refused:
                answer = self._error(refused)
            return answer if fault is None else self._answer_fault(request, fault)
        except _AnswerError as refused:
            return self._error(refused)

    def _answer_fault(self, request: transport.Request, fault: Fault) -> transport.Response:
        if fault.status == LOST:
            raise errors.TransportError(f"{request.method} {request.path}: the answer was lost (fake)")
        reason = fault.reason or "Injected"
        return self._error(_AnswerError(fault.status, reason, f"injected {fault.status}", fault.retry_after))

    @contextlib.asynccontextmanager
    async def stream(self, request: transport.Request, idle_timeout: float) -> AsyncIterator[transport.Stream]:
        await asyncio.sleep(0)
        self.requests.append(("WATCH", request.path))
        try:
            self._authorize(request)
            fault = self._fault_for(request)
            if fault is not None:
                if fault.status == LOST:
                    raise errors.TransportError(f"WATCH {request.path}: the connection broke (fake)")
                reason = fault.reason or "Injected"
                raise _AnswerError(fault.status, reason, f"injected {fault.status}", fault.retry_after)
            watch = self._open_watch(request)
        except _AnswerError as answer:
            response = self._error(answer)
            yield _FakeStream(response.status, response.body, None)
            return
        timeout = float(request.params.get("timeoutSeconds", "300"))
        loop = asyncio.get_running_loop()
        ending = loop.call_later(timeout, self._end_watch, watch)
        try:
            yield _FakeStream(200, b"", watch.queue, idle_timeout)
        finally:
            ending.cancel()
            if watch in self.watches:
                self.watches.remove(watch)

    async def close(self) -> None:
        return None

    # ----------------------------------------------------------------- internals

    def _now(self) -> str:
        """Timestamps one second apart and increasing, so ordering by them is deterministic."""
        at = self._start + datetime.timedelta(seconds=next(self._seconds))
        return at.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _error(self, answer: _AnswerError) -> transport.Response:
        body: Json = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": answer.message,
                      "reason": answer.reason, "code": answer.status}  # fmt: skip
        headers: dict[str, str] = {}
        if answer.retry_after is not None:
            body["details"] = {"retryAfterSeconds": answer.retry_after}
            headers["Retry-After"] = str(answer.retry_after)
        return transport.Response(answer.status, orjson.dumps(body), headers)

    def _authorize(self, request: transport.Request) -> None:
        if self.tokens is not None:
            token = (request.authorization or "").removeprefix("Bearer ")
            if token not in self.tokens:
                raise _AnswerError(401, "Unauthorized", "Unauthorized")

    def _fault_for(self, request: transport.Request) -> Fault | None:
        """The fault the request meets (one use of it taken), or None."""
        method = "WATCH" if request.params.get("watch") else request.method
        for fault in self.faults:
            if (fault.method is None or fault.method == method) and (
                fault.path is None or request.path.startswith(fault.path)
            ):
                fault.times -= 1
                if fault.times <= 0:
                    self.faults.remove(fault)
                return fault
        return None

    @staticmethod
    def _route(path: str) -> tuple[str, str, str | None, str | None]:
        """(collection, namespace, name, subresource) of a REST path."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            prefix, rest = "/api/v1", parts[2:]
        elif parts and parts[0] == "apis" and len(parts) >= 3:
            prefix, rest = "/" + "/".join(parts[:3]), parts[3:]
        else:
            raise _AnswerError(404, "NotFound", f"the server could not find the requested resource {path}")
        namespace = ""
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if not rest:
            raise _AnswerError(404, "NotFound", f"no resource in {path}")
        collection = f"{prefix}|{rest[0]}"
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        return collection, namespace, name, sub

    def _handle(self, request: transport.Request) -> tuple[int, Json]:
        group_version = request.path.removeprefix("/apis/")
        if request.method == "GET" and group_version in self.served:
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": []}
        collection, namespace, name, sub = self._route(request.path)
        body = orjson.loads(request.body) if request.body else None
        method = request.method
        if method == "GET" and name is None:
            return 200, self._list(collection, namespace, request.params)
        if name is None:
            if method == "POST":
                return 201, self._create(collection, namespace, body)
            raise _AnswerError(405, "MethodNotAllowed", f"{method} on a collection")
        key = Key(collection, namespace, name)
        if method == "POST" and sub == "binding":
            return 201, self._bind(key, body)
        if method == "POST" and sub == "eviction" and collection == "/api/v1|pods":
            return 201, self._evict(key, body.get("deleteOptions") or {} if isinstance(body, dict) else {})
        current = self.objects.get(key)
        if current is None:
            raise _AnswerError(404, "NotFound", f'{_resource(collection)} "{name}" not found')
        if method == "GET":
            return 200, copy.deepcopy(current)
        if method in ("PUT", "PATCH"):
            if not isinstance(body, dict | list):
                raise _AnswerError(400, "BadRequest", "the body is not JSON")
            if method == "PUT":
                version = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
                if version and version != current["metadata"]["resourceVersion"]:
                    raise _AnswerError(
                        409, "Conflict", "the object has been modified; please apply your changes to the latest version"
                    )
                candidate = body
            elif request.content_type == client.JSON_PATCH:
                try:
                    candidate = jsonpatch.apply_patch(current, body)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                    raise _AnswerError(422, "Invalid", str(exc)) from None
            else:
                version = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("resourceVersion")
                if version and version != current["metadata"]["resourceVersion"]:
                    raise _AnswerError(
                        409, "Conflict", "the object has been modified; please apply your changes to the latest version"
                    )
                candidate = _merge(current, body)
            if not isinstance(candidate, dict):
                raise _AnswerError(422, "Invalid", "the result is not an object")
            if sub == "status":
                candidate = {**current, "status": candidate.get("status")}
            elif collection in _STATUS_SUBRESOURCE and "status" in current:
                candidate = {**candidate, "status": current["status"]}
            return 200, self._update(key, candidate, keep=current)
        if method == "DELETE":
            return 200, self._delete(key, current, body or {})
        raise _AnswerError(405, "MethodNotAllowed", method)

    def _list(self, collection: str, namespace: str, params: Mapping[str, str]) -> Json:
        selector = _selectors(params)
        keys = sorted(
            k for k in self.objects
            if k.within(collection, namespace) and _selected(self.objects[k], selector)
        )  # fmt: skip
        after = params.get("continue")
        if after:
            position = tuple(orjson.loads(base64.urlsafe_b64decode(after)))
            keys = [k for k in keys if k[1:] > position]
        limit = int(params.get("limit", "0") or 0)
        token = ""
        if limit and len(keys) > limit:
            keys = keys[:limit]
            token = base64.urlsafe_b64encode(orjson.dumps(list(keys[-1][1:]))).decode()
        kind = _KIND.get(_resource(collection), "Object")
        return {
            "kind": f"{kind}List",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.version), **({"continue": token} if token else {})},
            "items": [copy.deepcopy(self.objects[k]) for k in keys],
        }

    def _stamp(self, obj: Json, kind: str) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj.setdefault("kind", _KIND.get(kind, kind))

    def _create(self, collection: str, namespace: str, body: Any) -> Json:
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise _AnswerError(400, "BadRequest", "the body is not an object with metadata")
        obj = copy.deepcopy(body)
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            raise _AnswerError(422, "Invalid", "metadata.name: Required value")
        if namespace:
            meta["namespace"] = namespace
        key = Key(collection, namespace, meta["name"])
        if key in self.objects:
            raise _AnswerError(409, "AlreadyExists", f'{key.resource} "{meta["name"]}" already exists')
        meta["uid"] = str(uuid.UUID(int=next(self._uids)))  # the form the API server gives (cgroups name pods by it)
        meta["creationTimestamp"] = self._now()
        meta.pop("resourceVersion", None)
        meta.pop("deletionTimestamp", None)
        self._stamp(obj, key.resource)
        self.objects[key] = obj
        self._emit(collection, namespace, wire.EventType.ADDED, obj)
        return copy.deepcopy(obj)

    def _update(self, key: Key, obj: Json, keep: Json) -> Json:
        obj = copy.deepcopy(obj)
        for field_name in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if field_name in keep["metadata"]:
                obj["metadata"][field_name] = keep["metadata"][field_name]
        if obj == keep:
            return copy.deepcopy(keep)
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            self.objects[key] = obj
            return self._remove(key)
        self._stamp(obj, key.resource)
        self.objects[key] = obj
        self._emit(key.collection, key.namespace, wire.EventType.MODIFIED, obj, old=keep)
        return copy.deepcopy(obj)

    def _bind(self, key: Key, body: Any) -> Json:
        pod = self.objects.get(key)
        if pod is None:
            raise _AnswerError(404, "NotFound", f'pods "{key.name}" not found')
        if (pod.get("spec") or {}).get("nodeName"):
            raise _AnswerError(409, "Conflict", f"pod {key.name} is already assigned to node {pod['spec']['nodeName']}")
        target = ((body or {}).get("target") or {}).get("name")
        if not target:
            raise _AnswerError(422, "Invalid", "binding target: Required value")
        meta = (body or {}).get("metadata") or {}
        uid = pod["metadata"].get("uid")
        if meta.get("uid") and meta["uid"] != uid:
            said = f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: {uid}"
            raise _AnswerError(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{key.name}": {said}')
        annotations = meta.get("annotations") or {}
        patch = {"spec": {"nodeName": target}, "metadata": {"annotations": annotations}}
        self._update(key, _merge(pod, patch), keep=pod)
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    def _evict(self, key: Key, options: Json) -> Json:
        pod = self.objects.get(key)
        if pod is None:
            raise _AnswerError(404, "NotFound", f'pods "{key.name}" not found')
        done = {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}
        dry = "All" in (options.get("dryRun") or [])
        phase = (pod.get("status") or {}).get("phase") or "Pending"
        if phase == "Pending" or phase in api_pods.TERMINAL_PHASES or pod["metadata"].get("deletionTimestamp"):
            # As the API server: no budget guards a pod that is not running; a dry run deletes nothing.
            if dry:
                self._preconditions(key, pod, options)
            else:
                self._delete(key, pod, options)
            return done
        labels = pod["metadata"].get("labels") or {}
        budgets = [
            k for k, obj in sorted(self.objects.items())
            if k.collection.startswith("/apis/policy/") and k.resource == "poddisruptionbudgets"
            and k.namespace == key.namespace
            and wire.budget_selects(wire.convert({"spec": obj.get("spec") or {}}, wire.PodDisruptionBudget), labels)
        ]  # fmt: skip
        for budget in budgets:
            if int((self.objects[budget].get("status") or {}).get("disruptionsAllowed", 0)) < 1:
                message = "Cannot evict pod as it would violate the pod's disruption budget."
                raise _AnswerError(429, "TooManyRequests", message)
        if dry:
            self._preconditions(key, pod, options)
            return done
        for budget in budgets:
            current = self.objects[budget]
            status = dict(current.get("status") or {})
            status["disruptionsAllowed"] = int(status.get("disruptionsAllowed", 0)) - 1
            self._update(budget, {**current, "status": status}, keep=current)
        self._delete(key, pod, options)
        return done

    def _preconditions(self, key: Key, current: Json, options: Json) -> None:
        pre = options.get("preconditions") or {}
        meta = current["metadata"]
        if pre.get("uid") and pre["uid"] != meta.get("uid"):
            kind = _KIND.get(key.resource, "object")
            raise _AnswerError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {kind} "{key.name}": the UID in the precondition ({pre["uid"]}) '
                f"does not match the UID in record ({meta.get('uid')}). The object might have been deleted and "
                "then recreated",
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta.get("resourceVersion"):
            raise _AnswerError(409, "Conflict", "Precondition failed: resourceVersion in precondition does not match")

    def _delete(self, key: Key, current: Json, options: Json) -> Json:
        self._preconditions(key, current, options)
        meta = current["metadata"]
        if meta.get("finalizers"):  # as the API server: marked, and removed when the last finalizer goes
            if not meta.get("deletionTimestamp"):
                marked = copy.deepcopy(current)
                marked["metadata"]["deletionTimestamp"] = self._now()
                self._stamp(marked, key.resource)
                self.objects[key] = marked
                self._emit(key.collection, key.namespace, wire.EventType.MODIFIED, marked)
                return copy.deepcopy(marked)
            return copy.deepcopy(current)
        grace = options.get("gracePeriodSeconds")
        if key.collection == "/api/v1|pods" and grace != 0 and (current.get("spec") or {}).get("nodeName"):
            if not meta.get("deletionTimestamp"):
                marked = copy.deepcopy(current)
                marked["metadata"]["deletionTimestamp"] = self._now()
                default = (current.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                marked["metadata"]["deletionGracePeriodSeconds"] = default if grace is None else grace
                self._stamp(marked, "pods")
                self.objects[key] = marked
                self._emit(key.collection, key.namespace, wire.EventType.MODIFIED, marked)
                return copy.deepcopy(marked)
            return copy.deepcopy(current)
        return self._remove(key)

    def _remove(self, key: Key) -> Json:
        obj = self.objects.pop(key)
        self._stamp(obj, key.resource)
        self._emit(key.collection, key.namespace, wire.EventType.DELETED, obj)
        return copy.deepcopy(obj)

    def _emit(self, collection: str, namespace: str, kind: wire.EventType, obj: Json, old: Json | None = None) -> None:
        event = _Event(self.version, collection, namespace, kind, copy.deepcopy(obj), old)
        self.log.append(event)
        if len(self.log) > self.history:
            dropped = self.log[: len(self.log) - self.history]
            del self.log[: len(dropped)]
            self.compacted = max(self.compacted, dropped[-1].version)
        for watch in self.watches:
            seen = self._seen(watch, event)
            if seen is not None:
                watch.queue.put_nowait(self._line(seen, event))

    @staticmethod
    def _line(seen: wire.EventType, event: _Event) -> bytes:
        """A watch event as sent: an object that left the selection is sent as it was before (with the
        version of the change that took it out), as the API server's watch cache does."""
        obj = event.obj
        if seen == wire.EventType.DELETED and event.kind == wire.EventType.MODIFIED and event.old is not None:
            obj = copy.deepcopy(event.old)
            obj["metadata"]["resourceVersion"] = event.obj["metadata"]["resourceVersion"]
        return orjson.dumps({"type": seen, "object": obj}) + b"\n"

    @staticmethod
    def _seen(watch: _Watch, event: _Event) -> wire.EventType | None:
        """How `watch` sees `event`: as it is; or, with a selector, a modification that takes the object
        out of the selection as DELETED and one that brings it in as ADDED (as the API server does);
        None when the watch does not see it."""
        if watch.collection != event.collection or (watch.namespace is not None and watch.namespace != event.namespace):
            return None
        now = _selected(event.obj, watch.selector)
        if event.kind != wire.EventType.MODIFIED or event.old is None:
            return event.kind if now else None
        before = _selected(event.old, watch.selector)
        if now:
            return wire.EventType.MODIFIED if before else wire.EventType.ADDED
        return wire.EventType.DELETED if before else None

    def _open_watch(self, request: transport.Request) -> _Watch:
        collection, namespace, name, _ = self._route(request.path)
        if name is not None:
            raise _AnswerError(405, "MethodNotAllowed", "watch a collection")
        watch = _Watch(collection, namespace or None, _selectors(request.params))
        version_text = request.params.get("resourceVersion", "")
        if version_text in ("", "0"):
            for key, obj in sorted(self.objects.items()):
                if key.within(collection, namespace) and _selected(obj, watch.selector):
                    watch.queue.put_nowait(orjson.dumps({"type": wire.EventType.ADDED, "object": obj}) + b"\n")
        else:
            since = int(version_text)
            if since < self.compacted:
                raise _AnswerError(410, "Expired", f"too old resource version: {since} ({self.compacted})")
            for event in self.log:
                seen = self._seen(watch, event) if event.version > since else None
                if seen is not None:
                    watch.queue.put_nowait(self._line(seen, event))
        self.watches.append(watch)
        return watch

    def _end_watch(self, watch: _Watch) -> None:
        """A watch's timeoutSeconds passed: a bookmark with the current version, then the end."""
        if watch in self.watches:
            bookmark = {"type": wire.EventType.BOOKMARK, "object": {"metadata": {"resourceVersion": str(self.version)}}}
            watch.queue.put_nowait(orjson.dumps(bookmark) + b"\n")
            watch.queue.put_nowait(None)
            self.watches.remove(watch)
