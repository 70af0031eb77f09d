"""The fake held against the real thing: each case runs against `kube.fake.FakeApiServer` (what every
unit test talks to) and against the real kube-apiserver of the test control plane, and asserts the
same answer from both, so the fake cannot drift from what the API server does.

Covered: 409 AlreadyExists and 409 Conflict (a stale resourceVersion, a uid precondition, a binding
naming another pod's UID), 404 with
its Status reason, label selectors (equality, inequality, set-based, existence) and field
selectors, a watch from a list's resourceVersion seeing each change in order, a watch with a label
selector seeing objects leave (DELETED) and enter (ADDED) its selection, evictions against a
PodDisruptionBudget that selects by expression (a running pod it guards: refused, 429; one it
guards that is not running, and one it does not select: carried out, gracefully where the pod is
bound), deletion held by a finalizer until it goes, and pods deleted at once when unbound and
gracefully when bound. Not here: 410 for an expired version, which the real server answers only
once its watch cache or etcd compaction has moved past the version (the fake's `expire_watches` is
unit-tested against the informer instead)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from sharegpu.api import paths, wire
from sharegpu.api import pods as api_pods
from sharegpu.core import units
from sharegpu.kube import client, errors, fake
from tests import builders
from tests.integration.conftest import Json, wait_for


@dataclass(frozen=True, slots=True)
class Side:
    """One API server under test: the client, the namespace to work in, and whether it is the real one."""

    kube: client.KubeClient
    namespace: str
    real: bool


@pytest.fixture(params=["fake", "real"])
async def side(request: pytest.FixtureRequest, admin: client.KubeClient) -> AsyncIterator[Side]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    if request.param == "real":
        await admin.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        try:
            yield Side(admin, name, True)
        finally:
            await admin.request("DELETE", paths.pods(name), params={"gracePeriodSeconds": 0})
            await admin.delete(f"{paths.NAMESPACES}/{name}")
        return
    kube = client.KubeClient(fake.FakeApiServer())
    try:
        yield Side(kube, name, False)
    finally:
        await kube.close()


def configmap(name: str, **meta: object) -> Json:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}, "data": {"k": "v"}}


def pod(name: str, labels: dict[str, str] | None = None, node: str | None = None) -> Json:
    made = builders.MakePod(name).labels(labels or {}).container("c", image="busybox")
    return (made if node is None else made.node(node)).obj()


async def gone(side: Side, path: str) -> bool:
    try:
        await side.kube.get(path)
    except errors.NotFoundError:
        return True
    return False


async def test_a_second_create_is_409_already_exists_and_a_stale_replace_409_conflict(side: Side) -> None:
    made = await side.kube.create(paths.configmaps(side.namespace), configmap("a"))
    with pytest.raises(errors.ConflictError) as twice:
        await side.kube.create(paths.configmaps(side.namespace), configmap("a"))
    assert twice.value.status == 409 and twice.value.already_exists
    await side.kube.replace(paths.configmap(side.namespace, "a"), {**made, "data": {"k": "w"}})
    with pytest.raises(errors.ConflictError) as stale:
        await side.kube.replace(paths.configmap(side.namespace, "a"), {**made, "data": {"k": "x"}})
    assert stale.value.status == 409 and stale.value.reason == "Conflict" and not stale.value.already_exists
    with pytest.raises(errors.ConflictError) as precondition:
        await side.kube.delete(paths.configmap(side.namespace, "a"), preconditions={"uid": str(uuid.uuid4())})
    assert precondition.value.status == 409 and "the UID in the precondition" in precondition.value.message


async def test_a_missing_object_is_404_not_found(side: Side) -> None:
    with pytest.raises(errors.NotFoundError) as missing:
        await side.kube.get(paths.configmap(side.namespace, "nothing"))
    assert (missing.value.status, missing.value.reason) == (404, "NotFound")
    assert '"nothing" not found' in missing.value.message


async def test_label_and_field_selectors_pick_the_same_pods(side: Side) -> None:
    for name, labels, node in [("a", {"app": "x"}, "n1"), ("b", {"app": "y"}, None), ("c", {}, "n2")]:
        await side.kube.create(paths.pods(side.namespace), pod(name, labels, node))

    async def names(**params: str) -> list[str]:
        found = await side.kube.get(paths.pods(side.namespace), **params)
        return sorted(item["metadata"]["name"] for item in found["items"])

    assert await names(labelSelector="app=x") == ["a"]
    assert await names(labelSelector="app!=x") == ["b", "c"]
    assert await names(labelSelector="app in (x,y)") == ["a", "b"]
    assert await names(labelSelector="app") == ["a", "b"]
    assert await names(labelSelector="!app") == ["c"]
    assert await names(fieldSelector="spec.nodeName=n1") == ["a"]
    assert await names(fieldSelector="spec.nodeName=") == ["b"]


async def test_a_watch_from_a_lists_version_sees_each_change_in_order(side: Side) -> None:
    await side.kube.create(paths.configmaps(side.namespace), configmap("before"))
    listed = await side.kube.get(paths.configmaps(side.namespace))
    version = listed["metadata"]["resourceVersion"]
    seen: list[tuple[str, str, str]] = []

    async def watch() -> None:
        async for kind, obj, _ in side.kube.watch(paths.configmaps(side.namespace), wire.ConfigMap, version):
            if kind in (client.OPENED, wire.EventType.BOOKMARK) or obj is None:
                continue
            if obj.metadata.name == "kube-root-ca.crt":
                continue  # kube-controller-manager publishes it into a new namespace, whenever it gets to it
            seen.append((kind, obj.metadata.name, obj.data.get("k", "")))
            if len(seen) == 3:
                return

    task = asyncio.create_task(watch())
    made = await side.kube.create(paths.configmaps(side.namespace), configmap("a"))
    await side.kube.replace(paths.configmap(side.namespace, "a"), {**made, "data": {"k": "w"}})
    await side.kube.delete(paths.configmap(side.namespace, "a"))
    await asyncio.wait_for(task, 30)
    assert seen == [("ADDED", "a", "v"), ("MODIFIED", "a", "w"), ("DELETED", "a", "w")]


async def test_a_watch_with_a_label_selector_sees_objects_leave_and_enter_the_selection(side: Side) -> None:
    """A change that takes an object out of a watch's selection arrives as DELETED (of the object as it
    was), one that brings it in as ADDED (the extender relies on it to see a hand-off whose label was
    stripped)."""
    made = await side.kube.create(paths.configmaps(side.namespace), configmap("a", labels={"role": "x"}))
    listed = await side.kube.get(paths.configmaps(side.namespace), labelSelector="role=x")
    seen: list[tuple[str, str]] = []

    async def watch() -> None:
        version = listed["metadata"]["resourceVersion"]
        params = {"labelSelector": "role=x"}
        async for kind, obj, _ in side.kube.watch(paths.configmaps(side.namespace), wire.ConfigMap, version, params):
            if kind in (client.OPENED, wire.EventType.BOOKMARK) or obj is None:
                continue
            seen.append((kind, obj.data.get("k", "")))
            if len(seen) == 2:
                return

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.2)
    left = await side.kube.replace(
        paths.configmap(side.namespace, "a"),
        {**made, "metadata": {**made["metadata"], "labels": {}}, "data": {"k": "w"}},
    )
    await side.kube.replace(paths.configmap(side.namespace, "a"), {**left, "metadata": {**left["metadata"],
                            "labels": {"role": "x"}}, "data": {"k": "z"}})  # fmt: skip
    await asyncio.wait_for(task, 30)
    assert seen == [("DELETED", "v"), ("ADDED", "z")], "what left is sent as it was while it was selected"


async def running(side: Side, name: str, labels: dict[str, str]) -> Json:
    """A pod bound to a node and reported running and ready (as its kubelet would)."""
    made = await side.kube.create(paths.pods(side.namespace), pod(name, labels, "n1"))
    ready = [{"type": "Ready", "status": "True"}]
    await side.kube.patch(
        f"{paths.pod(side.namespace, name)}/status", {"status": {"phase": "Running", "conditions": ready}}
    )
    return made


async def test_an_eviction_honours_a_budget_that_selects_by_expression(side: Side) -> None:
    db = await running(side, "db", {"tier": "db"})
    web = await running(side, "web", {"tier": "web"})
    waiting = await side.kube.create(paths.pods(side.namespace), pod("db-pending", {"tier": "db"}))
    budget = builders.MakePDB("keep-db").min_available(1).match_expression("tier", "In", "db").obj()
    await side.kube.create(paths.pod_disruption_budgets(side.namespace), budget)
    if side.real:  # the disruption controller counts the ready pod first (the fake's budgets hold what is written)

        async def observed() -> bool:
            found = await side.kube.get(f"{paths.pod_disruption_budgets(side.namespace)}/keep-db")
            status = found.get("status") or {}
            return bool(status.get("observedGeneration") == found["metadata"]["generation"]
                        and status.get("currentHealthy") == 1)  # fmt: skip

        await wait_for(observed, what="the disruption controller to see the budget")

    def eviction(obj: Json) -> Json:
        return api_pods.eviction(units.pod_key(side.namespace, obj["metadata"]["name"]), obj["metadata"]["uid"])

    with pytest.raises(errors.BusyError) as refused:
        await side.kube.create(paths.eviction(side.namespace, "db"), eviction(db))
    assert refused.value.status == 429 and "disruption budget" in refused.value.message
    assert not await gone(side, paths.pod(side.namespace, "db"))

    with pytest.raises(errors.BusyError):  # a dry run is refused alike
        await side.kube.create(paths.eviction(side.namespace, "db"), api_pods.eviction(
            units.pod_key(side.namespace, "db"), db["metadata"]["uid"], dry_run=True))  # fmt: skip
    await side.kube.create(paths.eviction(side.namespace, "web"), api_pods.eviction(
        units.pod_key(side.namespace, "web"), web["metadata"]["uid"], dry_run=True))  # fmt: skip
    assert not (await side.kube.get(paths.pod(side.namespace, "web")))["metadata"].get("deletionTimestamp"), (
        "a dry run deletes nothing"
    )
    with pytest.raises(errors.ConflictError):  # not the pod of that UID (one made again under its name)
        await side.kube.create(paths.eviction(side.namespace, "web"), api_pods.eviction(
            units.pod_key(side.namespace, "web"), "00000000-0000-0000-0000-000000000000"))  # fmt: skip
    with pytest.raises(errors.ConflictError):  # no longer as it was (changed since: started, say)
        await side.kube.create(paths.eviction(side.namespace, "web"), api_pods.eviction(
            units.pod_key(side.namespace, "web"), web["metadata"]["uid"],
            resource_version=web["metadata"]["resourceVersion"]))  # fmt: skip
    await side.kube.create(paths.eviction(side.namespace, "db-pending"), eviction(waiting))
    assert await gone(side, paths.pod(side.namespace, "db-pending")), "no budget guards a pod that is not running"

    await side.kube.create(paths.eviction(side.namespace, "web"), eviction(web))
    left = await side.kube.get(paths.pod(side.namespace, "web"))
    assert left["metadata"].get("deletionTimestamp"), "a bound pod is deleted gracefully (its kubelet ends it)"


async def test_a_finalizer_holds_a_deletion_until_it_goes(side: Side) -> None:
    path = paths.configmap(side.namespace, "held")
    await side.kube.create(paths.configmaps(side.namespace), configmap("held", finalizers=["sharegpu.io/test"]))
    await side.kube.delete(path)
    marked = await side.kube.get(path)
    assert marked["metadata"].get("deletionTimestamp") and marked["metadata"]["finalizers"] == ["sharegpu.io/test"]
    await side.kube.patch(path, {"metadata": {"finalizers": None}})
    assert await gone(side, path)


async def test_a_bound_pod_is_deleted_gracefully_and_an_unbound_one_at_once(side: Side) -> None:
    await side.kube.create(paths.pods(side.namespace), pod("bound", node="n1"))
    await side.kube.create(paths.pods(side.namespace), pod("pending"))
    await side.kube.delete(paths.pod(side.namespace, "pending"))
    assert await gone(side, paths.pod(side.namespace, "pending"))
    await side.kube.delete(paths.pod(side.namespace, "bound"))
    ending = await side.kube.get(paths.pod(side.namespace, "bound"))
    assert ending["metadata"].get("deletionTimestamp") and ending["metadata"].get("deletionGracePeriodSeconds") == 30
    await side.kube.delete(paths.pod(side.namespace, "bound"), grace_period=0)
    assert await gone(side, paths.pod(side.namespace, "bound"))


async def test_a_binding_for_a_pod_replaced_since_is_409_and_binds_nothing(side: Side) -> None:
    """The extender's binding carries the pod's UID: a pod of the same name made meanwhile is not
    bound with the allocation meant for the one that went."""
    first = await side.kube.create(paths.pods(side.namespace), pod("p"))
    await side.kube.delete(paths.pod(side.namespace, "p"))
    await side.kube.create(paths.pods(side.namespace), pod("p"))
    body = {"apiVersion": "v1", "kind": "Binding", "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
            "metadata": {"name": "p", "namespace": side.namespace, "uid": first["metadata"]["uid"]}}  # fmt: skip
    with pytest.raises(errors.ConflictError):
        await side.kube.create(paths.binding(side.namespace, "p"), body)
    stored = await side.kube.get(paths.pod(side.namespace, "p"))
    assert not stored["spec"].get("nodeName")
