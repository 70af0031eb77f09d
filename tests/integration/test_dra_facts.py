"""Facts about Dynamic Resource Allocation (resource.k8s.io) on the control plane the suite runs
(Kubernetes 1.37.2, started exactly as `sharegpu.devcluster.controlplane` starts it: no feature gates,
no --runtime-config), checked before sharegpu becomes a DRA driver. Each test's docstring names its
fact; where the first guess was wrong, the test asserts what is true and says so.

kube-scheduler runs here with its default plugins (a profile of its own name, `SCHEDULER`, so it
schedules only these tests' pods). Nodes are bare Node objects (no kubelet): pods are bound, never
run. Every test makes its own node, ResourceSlice and DeviceClass (named after its namespace) for the
driver `gpu.sharegpu.io`, and deletes them afterwards; namespaced objects go with the namespace.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest

from sharegpu.api import dra as api_dra
from sharegpu.api import names, paths, quantity, selectors, wire
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from tests.builders import MakeAllocation
from tests.integration.conftest import events, wait_for

Json = dict[str, Any]

DRIVER = api_dra.DRIVER
API = "/apis/resource.k8s.io/v1"
SCHEDULER = "dra-facts-scheduler"
"""The profile name of the default-plugin kube-scheduler these tests start (pods name it)."""
PROCESS = "kube-scheduler-dra-facts"
FINALIZER = api_dra.DELETE_PROTECTION
"""What kube-scheduler puts on a claim it allocates; the resourceclaim controller deallocates only
claims that carry it."""
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
GPU_MEMORY = "16Gi"
GPU_MILLI = "1000"


def resource_path(plural: str, namespace: str | None = None, name: str | None = None) -> str:
    base = f"{API}/namespaces/{namespace}/{plural}" if namespace else f"{API}/{plural}"
    return f"{base}/{name}" if name else base


def q(value: Any) -> Decimal:
    return quantity.parse(value)


# ------------------------------------------------------------------------------ object builders


def shared_device(name: str, test: str, *, policy: bool = True, taints: list[Json] | None = None) -> Json:
    """A GPU several claims may share: 16Gi of `memory` (consumed in whole Gi, at least 1Gi, default
    1Gi) and 1000 `milli` of compute (consumed as 250, 500 or 1000, default 1000)."""
    memory: Json = {"value": GPU_MEMORY}
    milli: Json = {"value": GPU_MILLI}
    if policy:
        memory["requestPolicy"] = {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}
        milli["requestPolicy"] = {"default": "1000", "validValues": ["250", "500", "1000"]}
    device: Json = {
        "name": name,
        "allowMultipleAllocations": True,
        "attributes": {"model": {"string": "T4"}, "test": {"string": test}, api_dra.ALLOCATOR: {"string": "sharegpu"}},
        "capacity": {"memory": memory, "milli": milli},
    }
    if taints:
        device["taints"] = taints
    return device


def slice_body(node: str, devices: list[Json], generation: int = 1) -> Json:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def class_body(name: str, test: str, extended_resource: str | None = None, *, sharegpu_only: bool = False) -> Json:
    """A DeviceClass selecting, by CEL, this driver's devices of this test (`sharegpu_only`: with
    sharegpu's own selector, `api.dra.CLASS_SELECTOR`, which no device satisfies for kube-scheduler)."""
    expression = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].test == "{test}"'
    if sharegpu_only:
        expression = f"{api_dra.CLASS_SELECTOR} && {expression}"
    spec: Json = {"selectors": [{"cel": {"expression": expression}}]}
    if extended_resource:
        spec["extendedResourceName"] = extended_resource
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


def claim_spec(device_class: str, *, tolerations: list[Json] | None = None, **capacity: str) -> Json:
    """One request `gpu` for one device of the class, asking `capacity` of it (memory=, milli=)."""
    exactly: Json = {"deviceClassName": device_class}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    if tolerations:
        exactly["tolerations"] = tolerations
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}


def claim_body(name: str, spec: Json, finalizers: list[str] | None = None) -> Json:
    meta: Json = {"name": name, **({"finalizers": finalizers} if finalizers else {})}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": meta, "spec": spec}


def template_body(name: str, spec: Json) -> Json:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": spec},
    }


def allocation(node: str, device: str, *, consumed: dict[str, str], timestamp: bool = True) -> Json:
    """An allocation result as a DRA driver of its own would write it: one share of `device` on `node`."""
    result = {"request": "gpu", "driver": DRIVER, "pool": node, "device": device,
              "shareID": str(uuid.uuid4()), "consumedCapacity": consumed}  # fmt: skip
    selector = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}
    written: Json = {"devices": {"results": [result]}, "nodeSelector": selector}
    if timestamp:
        written["allocationTimestamp"] = wire.timestamp(time.time())
    return written


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dra_scheduler(control_plane: controlplane.ControlPlane) -> Iterator[str]:
    """kube-scheduler with its default plugins under a profile of its own (the project's scheduler
    configuration is for the extender; this one is plain), as system:kube-scheduler."""
    if tuple(int(p) for p in control_plane.version.split(".")[:2]) < (1, 37):
        pytest.skip(f"facts about Kubernetes 1.37; this control plane is {control_plane.version}")
    config = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(control_plane.kubeconfig("system:kube-scheduler"))},
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": SCHEDULER}],
    }
    path = control_plane.workdir / f"{PROCESS}-config.yaml"
    path.write_text(json.dumps(config))  # JSON is valid YAML
    control_plane.start_scheduler(path, name=PROCESS)
    yield SCHEDULER
    control_plane.stop_process(PROCESS)


class Dra:
    """One test's DRA objects and the waits on them; cluster-scoped objects are deleted at the end."""

    def __init__(self, kube: client.KubeClient, plane: controlplane.ControlPlane, namespace: str) -> None:
        self.kube = kube
        self.plane = plane
        self.namespace = namespace
        self.made: list[str] = []

    # ------------------------------------------------------------------ making

    async def make(self, collection: str, body: Json) -> Json:
        """Create a cluster-scoped object, deleted when the test ends."""
        made = await self.kube.create(collection, body)
        self.made.append(f"{collection}/{made['metadata']['name']}")
        return made

    async def node(self, **extra_labels: str) -> str:
        """A Ready, untainted Node (no kubelet) labelled for this test (and with `extra_labels`)."""
        name = f"{self.namespace}-{uuid.uuid4().hex[:5]}"
        labels = {"kubernetes.io/hostname": name, "sharegpu.io/test": self.namespace, **extra_labels}
        await self.make(paths.NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}})
        capacity = {"cpu": "8", "memory": "32Gi", "pods": "110"}
        ready = {"type": "Ready", "status": "True", "reason": "NoKubelet"}
        await self.kube.patch(
            f"{paths.node(name)}/status",
            {"status": {"capacity": capacity, "allocatable": capacity, "conditions": [ready]}},
        )
        await self.kube.patch(paths.node(name), {"spec": {"taints": None}})  # the not-ready taint of creation
        return name

    async def device_class(self, extended_resource: str | None = None, *, sharegpu_only: bool = False) -> str:
        name = f"{self.namespace}-{uuid.uuid4().hex[:4]}"
        body = class_body(name, self.namespace, extended_resource, sharegpu_only=sharegpu_only)
        await self.make(resource_path("deviceclasses"), body)
        return name

    async def node_with_gpu(self, labels: dict[str, str] | None = None, **device: Any) -> str:
        """A node whose ResourceSlice offers one shared GPU, `gpu-0`."""
        node = await self.node(**(labels or {}))
        await self.make(
            resource_path("resourceslices"), slice_body(node, [shared_device("gpu-0", self.namespace, **device)])
        )
        return node

    async def claim(self, name: str, spec: Json, finalizers: list[str] | None = None) -> Json:
        return await self.kube.create(
            resource_path("resourceclaims", self.namespace), claim_body(name, spec, finalizers)
        )

    async def pod(
        self,
        name: str,
        *,
        claim: str | None = None,
        template: str | None = None,
        limits: dict[str, str] | None = None,
        scheduler: str = SCHEDULER,
        node_selector: dict[str, str] | None = None,
    ) -> Json:
        """A pod kept to this test's nodes, using one claim (`claim` by name, or one made from
        `template`) in its container, or asking `limits`."""
        container: Json = {"name": "c", "image": "busybox", "resources": {}}
        spec: Json = {
            "schedulerName": scheduler,
            "terminationGracePeriodSeconds": 0,
            "nodeSelector": {"sharegpu.io/test": self.namespace, **(node_selector or {})},
            "containers": [container],
        }
        if claim or template:
            source = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": template}
            spec["resourceClaims"] = [{"name": "gpu", **source}]
            container["resources"]["claims"] = [{"name": "gpu"}]
        if limits:
            container["resources"]["limits"] = limits
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
        return await self.kube.create(paths.pods(self.namespace), body)

    async def cleanup(self) -> None:
        await self.kube.request("DELETE", paths.pods(self.namespace), params={"gracePeriodSeconds": 0})
        for path in reversed(self.made):
            await self.kube.delete(path)

    # ------------------------------------------------------------------ reading

    async def get_claim(self, name: str) -> Json:
        return await self.kube.get(resource_path("resourceclaims", self.namespace, name))

    async def get_pod(self, name: str) -> Json:
        return await self.kube.get(paths.pod(self.namespace, name))

    async def claim_of(self, pod: str) -> Json | None:
        """The claim made for the pod's `gpu` claim from its template, once the controller made it."""
        statuses = (await self.get_pod(pod)).get("status", {}).get("resourceClaimStatuses") or []
        names = [s.get("resourceClaimName") for s in statuses if s["name"] == "gpu"]
        return await self.get_claim(names[0]) if names and names[0] else None

    async def node_of(self, pod: str) -> str | None:
        node: str | None = (await self.get_pod(pod))["spec"].get("nodeName")
        return node

    async def unschedulable(self, pod: str) -> str | None:
        """kube-scheduler's PodScheduled=False message for the pod, None while it has not said so."""
        found = await self.get_pod(pod)
        for condition in found.get("status", {}).get("conditions") or []:
            if condition["type"] == "PodScheduled" and condition["status"] == "False":
                return f"{condition.get('reason')}: {condition.get('message')}"
        return None

    async def until(self, predicate: Callable[[], Any], what: str, timeout: float = 60) -> Any:
        """wait_for, with the tail of this scheduler's log in a failure."""
        try:
            return await wait_for(predicate, timeout=timeout, what=what)
        except AssertionError as exc:
            log = self.plane.log(PROCESS)[-3000:]
            raise AssertionError(f"{exc}\n--- {PROCESS} log tail:\n{log}") from None

    async def bound(self, pod: str) -> str:
        """The node the pod got bound to (waits)."""
        node: str = await self.until(lambda: self.node_of(pod), f"pod {pod} bound")
        return node

    async def refused(self, pod: str, still: float = 2.0) -> str:
        """kube-scheduler's reason for leaving the pod Pending (waits), after checking it stays unbound."""
        message: str = await self.until(lambda: self.unschedulable(pod), f"pod {pod} found unschedulable")
        await asyncio.sleep(still)
        assert await self.node_of(pod) is None, f"pod {pod} was bound after all"
        return message

    async def write_allocation(self, name: str, written: Json) -> Json:
        """PUT the claim's status with `written` as its allocation (the status subresource, as a driver would)."""
        current = await self.get_claim(name)
        current["status"] = {**current.get("status", {}), "allocation": written}
        return await self.kube.replace(resource_path("resourceclaims", self.namespace, name) + "/status", current)


@pytest.fixture
async def dra(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, namespace: str, dra_scheduler: str
) -> AsyncIterator[Dra]:
    made = Dra(admin, control_plane, namespace)
    yield made
    await made.cleanup()


def results(claim: Json) -> list[Json]:
    found: list[Json] = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    return found


def consumed(claims: list[Json], device: str, capacity: str) -> Decimal:
    """What the claims' allocations consume of one device's capacity."""
    return sum(
        (q(r["consumedCapacity"][capacity]) for c in claims for r in results(c) if r["device"] == device),
        start=Decimal(0),
    )


# ------------------------------------------------------------------------------------------ facts


async def test_fact_1_resource_k8s_io_v1_is_served_without_extra_flags(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, dra_scheduler: str
) -> None:
    """Fact 1: resource.k8s.io/v1 is served, with DeviceClass, ResourceSlice, ResourceClaim (and its
    status), ResourceClaimTemplate, and DeviceTaintRule (GA in 1.37), on a kube-apiserver given no
    --feature-gates and no --runtime-config. v1 is the only version served (the v1beta1/v1beta2 APIs
    are off by default), so the driver must speak v1."""
    argv = control_plane.argv["kube-apiserver"]
    assert not [a for a in argv if a.startswith(("--feature-gates", "--runtime-config"))], argv
    group = await admin.get("/apis/resource.k8s.io")
    assert [v["version"] for v in group["versions"]] == ["v1"]
    assert group["preferredVersion"]["version"] == "v1"
    listed = await admin.get(API)
    kinds = {r["name"]: r["kind"] for r in listed["resources"]}
    assert kinds == {
        "deviceclasses": "DeviceClass",
        "devicetaintrules": "DeviceTaintRule",
        "devicetaintrules/status": "DeviceTaintRule",
        "resourceclaims": "ResourceClaim",
        "resourceclaims/status": "ResourceClaim",
        "resourceclaimtemplates": "ResourceClaimTemplate",
        "resourceslices": "ResourceSlice",
    }
    for plural in ("deviceclasses", "resourceslices", "resourceclaims", "resourceclaimtemplates", "devicetaintrules"):
        assert (await admin.get(resource_path(plural)))["kind"].endswith("List")


async def test_fact_2_consumable_capacity_is_accepted_and_kept(dra: Dra) -> None:
    """Fact 2: consumable capacity is on by default (DRAConsumableCapacity, beta since 1.36): a device
    with allowMultipleAllocations and capacities with a requestPolicy (default + validRange,
    default + validValues) is stored as written (quantities canonicalised: "1000" reads back "1k"), the
    policy is validated (`capacity[memory].requestPolicy: Forbidden: allowMultipleAllocations must be
    true` on a device that does not allow multiple allocations), and a claim
    asking capacity.requests of a DeviceClass with a CEL selector on the driver is accepted."""
    node = await dra.node()
    stored = await dra.make(resource_path("resourceslices"), slice_body(node, [shared_device("gpu-0", dra.namespace)]))
    again = await dra.kube.get(resource_path("resourceslices", name=stored["metadata"]["name"]))
    device = again["spec"]["devices"][0]
    assert device["allowMultipleAllocations"] is True
    memory, milli = device["capacity"]["memory"], device["capacity"]["milli"]
    assert q(memory["value"]) == q("16Gi") and q(milli["value"]) == 1000
    assert q(memory["requestPolicy"]["default"]) == q("1Gi")
    assert {k: q(v) for k, v in memory["requestPolicy"]["validRange"].items()} == {"min": q("1Gi"), "step": q("1Gi")}
    assert q(milli["requestPolicy"]["default"]) == 1000
    assert [q(v) for v in milli["requestPolicy"]["validValues"]] == [250, 500, 1000]

    exclusive = shared_device("gpu-1", dra.namespace)
    del exclusive["allowMultipleAllocations"]
    with pytest.raises(
        kube_errors.InvalidError, match=r"requestPolicy: Forbidden: allowMultipleAllocations must be true"
    ):
        await dra.make(resource_path("resourceslices"), slice_body(f"{node}-x", [exclusive]))

    device_class = await dra.device_class()
    read_class = await dra.kube.get(resource_path("deviceclasses", name=device_class))
    assert DRIVER in read_class["spec"]["selectors"][0]["cel"]["expression"]
    claim = await dra.claim("half", claim_spec(device_class, memory="8Gi", milli="500"))
    request = claim["spec"]["devices"]["requests"][0]["exactly"]
    assert request["deviceClassName"] == device_class
    assert {k: q(v) for k, v in request["capacity"]["requests"].items()} == {"memory": q("8Gi"), "milli": 500}
    assert request["allocationMode"] == "ExactCount" and request["count"] == 1  # defaulted


async def test_fact_3_the_default_scheduler_shares_a_device_by_capacity_and_never_beyond_it(dra: Dra) -> None:
    """Fact 3: kube-scheduler's default plugins allocate shares of one device: pods whose claims (from a
    ResourceClaimTemplate, made by kube-controller-manager) ask 7500Mi of memory and 400 milli land on
    the node of the ResourceSlice; each result names the device with a shareID (a UUID, one per claim)
    and consumedCapacity rounded up by the requestPolicy (8Gi: validRange step; 500: the next of
    validValues). The sums never exceed capacity: with room for two, the third pod stays Pending,
    PodScheduled=False reason Unschedulable, "cannot allocate all claims", and a FailedScheduling event.
    Claims the scheduler allocates get the finalizer resource.kubernetes.io/delete-protection."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class()
    await dra.kube.create(
        resource_path("resourceclaimtemplates", dra.namespace),
        template_body("share", claim_spec(device_class, memory="7500Mi", milli="400")),
    )
    pods = ["p0", "p1", "p2"]
    for pod in pods:
        await dra.pod(pod, template="share")

    async def settled() -> tuple[list[str], list[str]] | None:
        bound = [p for p in pods if await dra.node_of(p)]
        waiting = [p for p in pods if await dra.unschedulable(p)]
        return (bound, waiting) if len(bound) == 2 and len(waiting) == 1 else None

    bound, (waiting,) = await dra.until(settled, "two pods bound and one unschedulable")
    message = await dra.refused(waiting)
    assert message.startswith("Unschedulable:") and "cannot allocate all claims" in message, message
    failed = [
        e for e in await events(dra.kube, dra.namespace, "FailedScheduling") if e["involvedObject"]["name"] == waiting
    ]
    assert failed and "cannot allocate all claims" in failed[0]["message"]

    claims = []
    for pod in bound:
        assert await dra.node_of(pod) == node
        claim = await dra.claim_of(pod)
        assert claim is not None
        claims.append(claim)
        (result,) = results(claim)
        assert (result["driver"], result["pool"], result["device"], result["request"]) == (DRIVER, node, "gpu-0", "gpu")
        assert UUID.match(result["shareID"]), result
        assert {k: q(v) for k, v in result["consumedCapacity"].items()} == {"memory": q("8Gi"), "milli": 500}
        assert claim["status"]["reservedFor"] == [
            {"resource": "pods", "name": pod, "uid": (await dra.get_pod(pod))["metadata"]["uid"]}
        ]
        assert FINALIZER in claim["metadata"]["finalizers"]
    assert len({results(c)[0]["shareID"] for c in claims}) == 2
    assert consumed(claims, "gpu-0", "memory") == q(GPU_MEMORY) and consumed(claims, "gpu-0", "milli") == q(GPU_MILLI)
    pending = await dra.claim_of(waiting)
    assert pending is not None and not results(pending)


async def test_fact_4_a_claim_allocated_by_the_driver_is_honoured_and_counted(dra: Dra) -> None:
    """Fact 4: a claim whose status.allocation the driver wrote itself (resourceclaims/status, a
    nodeSelector naming the node, reservedFor empty, allocationTimestamp set; see the next test for
    why that last one matters) is honoured: its pod is bound to that node, the claim's reservedFor
    gains the pod, the allocation is not changed, and no finalizer is added (kube-scheduler adds
    resource.kubernetes.io/delete-protection only to claims it allocates itself). The scheduler also
    counts the written share: of two pods asking half the device each, only one more fits."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class()
    await dra.claim("pre", claim_spec(device_class, memory="8Gi", milli="500"))
    written = await dra.write_allocation("pre", allocation(node, "gpu-0", consumed={"memory": "8Gi", "milli": "500"}))
    written_allocation = written["status"]["allocation"]
    assert "reservedFor" not in written["status"]
    made = await dra.pod("pre", claim="pre")
    assert await dra.bound("pre") == node

    async def reserved() -> Json | None:
        claim = await dra.get_claim("pre")
        return claim if claim["status"].get("reservedFor") else None

    claim = await dra.until(reserved, "claim pre reserved for its pod")
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "pre", "uid": made["metadata"]["uid"]}]
    assert claim["status"]["allocation"] == written_allocation
    assert FINALIZER not in (claim["metadata"].get("finalizers") or [])

    await dra.kube.create(
        resource_path("resourceclaimtemplates", dra.namespace),
        template_body("half", claim_spec(device_class, memory="8Gi", milli="500")),
    )
    await dra.pod("a", template="half")
    await dra.pod("b", template="half")

    async def one_more() -> list[str] | None:
        bound = [p for p in ("a", "b") if await dra.node_of(p)]
        waiting = [p for p in ("a", "b") if await dra.unschedulable(p)]
        return waiting if len(bound) == 1 and len(waiting) == 1 else None

    (waiting,) = await dra.until(one_more, "one of a, b bound, the other unschedulable")
    assert "cannot allocate all claims" in await dra.refused(waiting)


async def test_fact_4_without_allocation_timestamp_the_scheduler_cannot_reserve(dra: Dra) -> None:
    """Fact 4, the condition (FALSE as first stated): an allocation written WITHOUT
    status.allocation.allocationTimestamp is not honoured on 1.37.2. Its pod is never bound: in PreBind
    kube-scheduler adds the missing allocationTimestamp (DRADeviceBindingConditions, beta and on by
    default) in the same status update that adds the reservation, and the API server refuses that as a
    change of the allocation: FailedScheduling `running PreBind plugin "DynamicResources": add
    reservation to claim ...: status.allocation: Invalid value: null: field cannot be modified once set`,
    retried forever. The driver must write allocationTimestamp itself."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class()
    await dra.claim("bare", claim_spec(device_class, memory="8Gi"))
    written = allocation(node, "gpu-0", consumed={"memory": "8Gi", "milli": "1000"}, timestamp=False)
    await dra.write_allocation("bare", written)
    await dra.pod("bare", claim="bare")

    async def prebind_failed() -> Json | None:
        found = await events(dra.kube, dra.namespace, "FailedScheduling")
        return next((e for e in found if "field cannot be modified once set" in e["message"]), None)

    event = await dra.until(prebind_failed, "a FailedScheduling event from PreBind")
    assert 'PreBind plugin "DynamicResources"' in event["message"] and "add reservation to claim" in event["message"]
    assert await dra.node_of("bare") is None
    claim = await dra.get_claim("bare")
    assert "allocationTimestamp" not in claim["status"]["allocation"] and not claim["status"].get("reservedFor")


async def test_fact_4_the_scheduler_does_not_check_a_written_allocation_against_capacity(dra: Dra) -> None:
    """Fact 4, a consequence: kube-scheduler trusts an allocation it did not make. With the device
    already shared out in full by two scheduler-allocated claims, a third claim the driver allocates
    on the same device is still reserved and its pod bound: 24Gi of 16Gi. Over-commit is the
    driver's to prevent."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class()
    await dra.kube.create(
        resource_path("resourceclaimtemplates", dra.namespace),
        template_body("half", claim_spec(device_class, memory="8Gi", milli="500")),
    )
    await dra.pod("a", template="half")
    await dra.pod("b", template="half")
    await dra.bound("a")
    await dra.bound("b")
    await dra.claim("extra", claim_spec(device_class, memory="8Gi", milli="500"))
    await dra.write_allocation("extra", allocation(node, "gpu-0", consumed={"memory": "8Gi", "milli": "500"}))
    await dra.pod("extra", claim="extra")
    assert await dra.bound("extra") == node
    claims = [c for c in [await dra.claim_of("a"), await dra.claim_of("b"), await dra.get_claim("extra")] if c]
    assert consumed(claims, "gpu-0", "memory") == q("24Gi") > q(GPU_MEMORY)


async def test_fact_4_writing_an_allocation_needs_resourceclaims_binding(
    dra: Dra, control_plane: controlplane.ControlPlane
) -> None:
    """Fact 4, the permission: with DRAResourceClaimGranularStatusAuthorization (beta, on by default in
    1.37), update/patch of resourceclaims/status is not enough to write status.allocation or
    status.reservedFor: it also takes verb update (PUT) or patch on the synthetic subresource
    resourceclaims/binding, cluster-wide (a ClusterRole). Refused as 422 Invalid, not 403:
    `status.allocation: Forbidden: changing status.allocation or status.reservedFor requires
    resource="resourceclaims/binding", verb="update" permission`."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class()
    await dra.claim("mine", claim_spec(device_class, memory="1Gi"))
    name = f"{dra.namespace}-claims"
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    rules = [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims", "resourceclaims/status"],
              "verbs": ["get", "update", "patch"]}]  # fmt: skip
    subject = [{"kind": "User", "name": "bob", "apiGroup": "rbac.authorization.k8s.io"}]
    await dra.kube.create(f"{rbac}/namespaces/{dra.namespace}/roles", {"metadata": {"name": name}, "rules": rules})
    await dra.kube.create(
        f"{rbac}/namespaces/{dra.namespace}/rolebindings",
        {"metadata": {"name": name}, "subjects": subject,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}},
    )  # fmt: skip
    bob = stack.kube_for(control_plane, "bob")
    as_bob = Dra(bob, control_plane, dra.namespace)
    written = allocation(node, "gpu-0", consumed={"memory": "1Gi", "milli": "1000"})
    try:
        await wait_for(functools.partial(_readable, as_bob, "mine"), what="bob may read claims")
        with pytest.raises(kube_errors.InvalidError, match='requires resource="resourceclaims/binding", verb="update"'):
            await as_bob.write_allocation("mine", written)
        assert not results(await dra.get_claim("mine"))
        await dra.make(
            f"{rbac}/clusterroles",
            {
                "metadata": {"name": name},
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "resources": ["resourceclaims/binding"],
                        "verbs": ["update", "patch"],
                    }
                ],
            },
        )
        await dra.make(
            f"{rbac}/clusterrolebindings",
            {
                "metadata": {"name": name},
                "subjects": subject,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            },
        )

        async def accepted() -> Json | None:
            try:
                return await as_bob.write_allocation("mine", written)
            except kube_errors.InvalidError as exc:
                if "resourceclaims/binding" not in str(exc):  # only the permission may fail, until RBAC catches up
                    raise
                return None

        claim = await wait_for(accepted, what="bob's allocation accepted once bound to resourceclaims/binding")
        assert results(claim)[0]["device"] == "gpu-0"
    finally:
        await bob.close()


async def test_fact_4_only_claims_with_the_finalizer_are_deallocated_when_their_pod_goes(dra: Dra) -> None:
    """Fact 4, after the pod: kube-controller-manager's resourceclaim controller drops a deleted pod
    from reservedFor, but clears status.allocation (and then removes the finalizer) only when the claim
    carries resource.kubernetes.io/delete-protection. A driver-written allocation without it stays
    allocated (its capacity stays consumed) until someone clears it."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class()
    await dra.claim("kept", claim_spec(device_class, memory="4Gi"))
    await dra.claim("freed", claim_spec(device_class, memory="4Gi"), finalizers=[FINALIZER])
    for name in ("kept", "freed"):
        await dra.write_allocation(name, allocation(node, "gpu-0", consumed={"memory": "4Gi", "milli": "1000"}))
        await dra.pod(name, claim=name)
    for name in ("kept", "freed"):
        await dra.bound(name)
        await dra.until(functools.partial(_reserved, dra, name), f"claim {name} reserved")
        await dra.kube.delete(paths.pod(dra.namespace, name), grace_period=0)

    async def freed() -> Json | None:
        claim = await dra.get_claim("freed")
        return claim if not claim["status"].get("allocation") and not claim["metadata"].get("finalizers") else None

    await dra.until(freed, "claim freed deallocated and its finalizer removed")

    async def unreserved() -> Json | None:
        claim = await dra.get_claim("kept")
        return None if claim["status"].get("reservedFor") else claim

    await dra.until(unreserved, "claim kept no longer reserved")
    await asyncio.sleep(2)
    kept = await dra.get_claim("kept")
    assert results(kept) and not kept["status"].get("reservedFor")


async def _readable(dra: Dra, name: str) -> Json | None:
    try:
        return await dra.get_claim(name)
    except kube_errors.ForbiddenError:  # until RBAC catches up
        return None


async def _reserved(dra: Dra, name: str) -> bool:
    return bool((await dra.get_claim(name))["status"].get("reservedFor"))


async def test_fact_5_an_allocation_cannot_be_changed_only_cleared(dra: Dra) -> None:
    """Fact 5: once set, status.allocation cannot be changed (another device in the results, or the
    same device with another consumedCapacity: 422 `status.allocation: Invalid value: null: field
    cannot be modified once set`), only cleared, and clearing needs reservedFor empty too (else
    `status.reservedFor: Forbidden: may not be specified when `allocated` is not set`). After
    clearing, a new allocation may be written: a change is clear-then-write, two updates."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class()
    await dra.claim("c", claim_spec(device_class, memory="2Gi"))
    first = allocation(node, "gpu-0", consumed={"memory": "2Gi", "milli": "1000"})
    await dra.write_allocation("c", first)
    other_device = json.loads(json.dumps(first))
    other_device["devices"]["results"][0]["device"] = "gpu-1"
    more = json.loads(json.dumps(first))
    more["devices"]["results"][0]["consumedCapacity"]["memory"] = "4Gi"
    for changed in (other_device, more):
        with pytest.raises(kube_errors.InvalidError, match=r"status\.allocation: .*field cannot be modified once set"):
            await dra.write_allocation("c", changed)

    made = await dra.pod("c", claim="c", scheduler="nobody")  # never scheduled: it only holds the reservation
    claim = await dra.get_claim("c")
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": "c", "uid": made["metadata"]["uid"]}]
    path = resource_path("resourceclaims", dra.namespace, "c") + "/status"
    claim = await dra.kube.replace(path, claim)
    del claim["status"]["allocation"]
    with pytest.raises(kube_errors.InvalidError, match=r"status\.reservedFor: Forbidden: may not be specified when"):
        await dra.kube.replace(path, claim)
    claim = await dra.get_claim("c")
    claim["status"] = {}
    cleared = await dra.kube.replace(path, claim)
    assert not cleared.get("status")
    second = allocation(node, "gpu-0", consumed={"memory": "4Gi", "milli": "1000"})
    rewritten = await dra.write_allocation("c", second)
    assert q(results(rewritten)[0]["consumedCapacity"]["memory"]) == q("4Gi")


async def test_fact_6_tainted_devices_get_no_new_allocation(dra: Dra) -> None:
    """Fact 6: device taints are on by default (DRADeviceTaints and DRADeviceTaintRules are GA in 1.37,
    not locked). A NoSchedule taint in the ResourceSlice (the API server stamps its timeAdded) or from
    a DeviceTaintRule (resource.k8s.io/v1, selecting driver/pool/device) keeps new claims off the
    device: the claim stays unallocated and its pod Pending ("cannot allocate all claims"), while a
    claim that tolerates the taint gets the device, its tolerations copied into the result."""
    node = await dra.node()
    taint = {"key": f"{DRIVER}/unhealthy", "value": "ecc", "effect": "NoSchedule"}
    selector = {"driver": DRIVER, "pool": node, "device": "gpu-1"}
    rule = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": dra.namespace},
            "spec": {"deviceSelector": selector, "taint": taint}}  # fmt: skip
    await dra.make(resource_path("devicetaintrules"), rule)
    devices = [shared_device("gpu-0", dra.namespace, taints=[taint]), shared_device("gpu-1", dra.namespace)]
    made = await dra.make(resource_path("resourceslices"), slice_body(node, devices))
    assert made["spec"]["devices"][0]["taints"][0]["timeAdded"]
    device_class = await dra.device_class()
    await asyncio.sleep(1)  # the scheduler's informers see the rule before the pods
    tolerate = [{"key": taint["key"], "operator": "Exists", "effect": "NoSchedule"}]
    await dra.claim("plain", claim_spec(device_class, memory="1Gi"))
    await dra.claim("tolerant", claim_spec(device_class, memory="1Gi", tolerations=tolerate))
    await dra.pod("plain", claim="plain")
    await dra.pod("tolerant", claim="tolerant")
    assert await dra.bound("tolerant") == node
    (result,) = results(await dra.get_claim("tolerant"))
    assert result["tolerations"] == tolerate
    assert "cannot allocate all claims" in await dra.refused("plain")
    assert not results(await dra.get_claim("plain"))


async def test_fact_7_an_extended_resource_backed_by_a_device_class_gets_a_claim_made_by_the_scheduler(
    dra: Dra,
) -> None:
    """Fact 7: DeviceClass.spec.extendedResourceName works on 1.37.2 with no flags (DRAExtendedResource
    is GA and locked on). A pod asking limits {<name>: 1} and no claim is bound to the node with the
    device; kube-scheduler creates a ResourceClaim `<pod>-extended-resources-<random>` owned by the pod
    (annotation resource.kubernetes.io/extended-resource-claim: "true"), with one request
    `container-0-request-0` for `count` devices of the class and no capacity requests, and records it
    in pod.status.extendedResourceClaimStatus {resourceClaimName, requestMappings[{containerName,
    resourceName, requestName}]}. On a shared device it consumes the requestPolicy default (4Gi here).
    A count of 2 means two distinct devices: with one shared device (room left) the pod stays Pending,
    and once the slice offers a second device it is bound with one share of each."""
    node = await dra.node()
    name = f"{DRIVER}/{dra.namespace}"
    device = shared_device("gpu-0", dra.namespace)
    device["capacity"]["memory"]["requestPolicy"]["default"] = "4Gi"
    device["capacity"]["milli"]["requestPolicy"]["default"] = "250"
    made = await dra.make(resource_path("resourceslices"), slice_body(node, [device]))
    device_class = await dra.device_class(extended_resource=name)
    await dra.pod("one", limits={name: "1"})
    assert await dra.bound("one") == node
    pod = await dra.get_pod("one")
    status = pod["status"]["extendedResourceClaimStatus"]
    assert status["requestMappings"] == [
        {"containerName": "c", "resourceName": name, "requestName": "container-0-request-0"}
    ]
    assert status["resourceClaimName"].startswith("one-extended-resources-")
    claim = await dra.get_claim(status["resourceClaimName"])
    assert claim["metadata"]["annotations"] == {"resource.kubernetes.io/extended-resource-claim": "true"}
    (owner,) = claim["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "Pod",
        "one",
        pod["metadata"]["uid"],
        True,
    )
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["name"] == "container-0-request-0"
    assert request["exactly"] == {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": 1}
    (result,) = results(claim)
    assert result["device"] == "gpu-0" and UUID.match(result["shareID"])
    assert {k: q(v) for k, v in result["consumedCapacity"].items()} == {"memory": q("4Gi"), "milli": 250}
    assert claim["status"]["reservedFor"][0]["name"] == "one"

    await dra.pod("two", limits={name: "2"})
    assert "cannot allocate all claims" in await dra.refused("two")
    second = shared_device("gpu-1", dra.namespace)
    second["capacity"] = device["capacity"]
    made["spec"]["devices"].append(second)
    made["spec"]["pool"]["generation"] = 2
    await dra.kube.replace(resource_path("resourceslices", name=made["metadata"]["name"]), made)
    assert await dra.bound("two") == node
    two = await dra.get_pod("two")
    claim = await dra.get_claim(two["status"]["extendedResourceClaimStatus"]["resourceClaimName"])
    assert claim["spec"]["devices"]["requests"][0]["exactly"]["count"] == 2
    assert sorted(r["device"] for r in results(claim)) == ["gpu-0", "gpu-1"]


async def test_the_allocation_sharegpu_writes_is_honoured_by_kube_scheduler(dra: Dra) -> None:
    """The product's own writer (`api.dra.claim_allocation`, what sharegpu's allocator will write):
    kube-scheduler binds the pod to the node it names, reserves the claim for it, and leaves the
    allocation as written; and the extender's reader (`api.dra.held`) reads it back as the same share."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class()
    await dra.claim("ours", claim_spec(device_class, memory="4Gi", milli="300"))
    placed = MakeAllocation(f"{dra.namespace}/ours#claim", node).grant(0, 300, 4096, container="gpu").obj()
    status = api_dra.claim_allocation(placed, [str(uuid.uuid4())], wire.timestamp(time.time()))
    written = await dra.write_allocation("ours", status)
    await dra.pod("ours", claim="ours")
    assert await dra.bound("ours") == node
    claim = await dra.get_claim("ours")
    assert claim["status"]["allocation"] == written["status"]["allocation"]
    back = api_dra.held(api_dra.claim_record(wire.convert(claim, api_dra.ResourceClaim)), {})
    assert back is not None and back.node == node and back.gpu_usage() == {0: (300, 4096)}


async def test_fact_8_a_class_no_device_satisfies_is_left_to_the_driver(dra: Dra) -> None:
    """Fact 8: with sharegpu's DeviceClass selector (`api.dra.CLASS_SELECTOR`: the devices say
    `allocator: sharegpu`, the class asks for `kube-scheduler`), kube-scheduler's allocator never
    allocates a claim of the class: its pod stays Pending, "cannot allocate all claims", the claim
    unallocated. An allocation the driver writes for the same claim is honoured all the same (the
    scheduler checks a written allocation's node selector, not the class's selector): the pod is
    bound to its node."""
    node = await dra.node_with_gpu()
    device_class = await dra.device_class(sharegpu_only=True)
    await dra.claim("ours", claim_spec(device_class, memory="4Gi", milli="500"))
    await dra.pod("ours", claim="ours")
    assert "cannot allocate all claims" in await dra.refused("ours")
    assert not results(await dra.get_claim("ours"))
    placed = MakeAllocation(f"{dra.namespace}/ours#claim", node).grant(0, 500, 4096, container="gpu").obj()
    status = api_dra.claim_allocation(placed, [str(uuid.uuid4())], wire.timestamp(time.time()))
    await dra.write_allocation("ours", status)
    assert await dra.bound("ours") == node
    assert await _reserved(dra, "ours")


async def test_fact_9_postfilter_clears_an_unreserved_allocation_whose_pod_fits_no_node(dra: Dra) -> None:
    """Fact 9, the takeover: a claim allocated on node A whose pod can only go to node B (its node
    selector) leaves the pod unschedulable, and kube-scheduler's PostFilter then clears the claim's
    allocation (nobody had reserved it). With sharegpu's class, the scheduler cannot allocate it
    again itself: the claim stays unallocated until the driver writes a new allocation, on B, where
    the pod is then bound."""
    node_a = await dra.node_with_gpu()
    node_b = await dra.node_with_gpu(labels={"sharegpu.io/side": "b"})
    device_class = await dra.device_class(sharegpu_only=True)
    await dra.claim("moved", claim_spec(device_class, memory="4Gi", milli="500"))
    placed = MakeAllocation(f"{dra.namespace}/moved#claim", node_a).grant(0, 500, 4096, container="gpu").obj()
    status = api_dra.claim_allocation(placed, [str(uuid.uuid4())], wire.timestamp(time.time()))
    await dra.write_allocation("moved", status)
    await dra.pod("moved", claim="moved", node_selector={"sharegpu.io/side": "b"})

    async def cleared() -> bool:
        return not results(await dra.get_claim("moved"))

    await dra.until(cleared, "the allocation on node A cleared by PostFilter")
    await asyncio.sleep(3)
    claim = await dra.get_claim("moved")
    assert not results(claim) and not claim["status"].get("reservedFor"), claim["status"]
    assert await dra.node_of("moved") is None
    placed = MakeAllocation(f"{dra.namespace}/moved#claim", node_b).grant(0, 500, 4096, container="gpu").obj()
    status = api_dra.claim_allocation(placed, [str(uuid.uuid4())], wire.timestamp(time.time()))
    await dra.write_allocation("moved", status)
    assert await dra.bound("moved") == node_b


PARITY_GPUS = (
    ("NVIDIA A100-SXM4-40GB", "Ampere", "8.0", 40960, "pci0000:00", 0),
    ("NVIDIA A100-SXM4-80GB", "Ampere", "8.0", 81920, "pci0000:00", 0),
    ("NVIDIA H100 80GB HBM3", "Hopper", "9.0", 81559, "pci0000:80", None),
    ("NVIDIA L40S", "Ada", "8.9", 46068, "pci0000:80", None),
)
_G = f'device.attributes["{DRIVER}"]'
_C = f'device.capacity["{DRIVER}"]'
PARITY_SELECTORS = (
    f'{_G}.productName.startsWith("NVIDIA A100")',
    f'{_G}.cudaComputeCapability.isGreaterThan(semver("8.0.0"))',
    f'{_G}.driverVersion == semver("535.104.5") && {_G}.cudaDriverVersion.compareTo(semver("12.2.0")) == 0',
    f'{_C}.memory.compareTo(quantity("40Gi")) > 0',
    f'{_C}.memory.isLessThan(quantity("81559Mi")) || {_C}.memory == quantity("80Gi")',
    'device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:80"',
    f'cel.bind(g, {_G}, g.architecture in ["Hopper", "Ada"] && g.index % 2 == 1)',
    f'"pcieSwitch" in {_G}',
    'device.attributes["gpu.nvidia.com"].?productName.orValue("none") == "none"',
    f'{_G}.productName.lowerAscii().contains("h100") || {_G}.pcieBusID.split(":")[1] == "02"',
    'sign(quantity("1")) == 1 && quantity("2k").add(quantity("500")).asApproximateFloat() == 2500.0',
    f'semver("v9", true).major() == 9 && isSemver("9.0.0") && {_G}.cudaComputeCapability.major() >= 9',
    f"{_C}.milli.isInteger() && {_C}.milli.asInteger() == 1000 && device.allowMultipleAllocations",
    f'{_G}.productName == "nothing"',
    f"{_G}.pcieSwitch == 0",  # the GPUs without a switch lack the attribute: an error on them
)


async def test_fact_10_device_selectors_get_the_same_answers_from_kube_scheduler_and_sharegpu(dra: Dra) -> None:
    """Fact 10: CEL selectors (Kubernetes' quantity and semver libraries, bindings, optional values,
    strings, an absent domain, the standard pcieRoot) pick the same devices in kube-scheduler's
    allocator as in sharegpu's (`api.selectors`), on the devices sharegpu's agent publishes
    (`api.dra.device`). kube-scheduler allocates a claim of `allocationMode: All` on a class it
    allocates: every device the selector picks (a shared device, once with its default capacity);
    none picked: the pod stays Pending; a selector that fails on a device (a missing attribute): the
    claim is not allocated, "CEL runtime error" (sharegpu names the failure and leaves the device out)."""
    node = await dra.node()
    devices = []
    for index, (model, architecture, capability, memory, root, switch) in enumerate(PARITY_GPUS):
        spec = wire.GpuSpec(
            index=index, uuid=f"GPU-{uuid.uuid4()}", model=model, memory_mib=memory, pcie_switch=switch,
            architecture=architecture, compute_capability=capability, driver_version="535.104.05",
            cuda_driver_version="12.2", pci_bus_id=f"0000:{index + 1:02x}:00.0", pcie_root=root,
        )  # fmt: skip
        device = api_dra.device(spec, [(0, 1)])
        device["attributes"][f"{DRIVER}/test"] = {"string": dra.namespace}  # what the test's class selects on
        devices.append(device)
    made = await dra.make(resource_path("resourceslices"), slice_body(node, devices))
    device_class = await dra.device_class()
    for i, expression in enumerate(PARITY_SELECTORS):
        exactly = {"deviceClassName": device_class, "allocationMode": "All",
                   "selectors": [{"cel": {"expression": expression}}]}  # fmt: skip
        await dra.claim(f"sel-{i}", {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}})
        await dra.pod(f"sel-{i}", claim=f"sel-{i}")

    async def answer(pod: str) -> tuple[str, frozenset[str]] | None:
        if await dra.node_of(pod):
            return "picked", frozenset(r["device"] for r in results(await dra.get_claim(pod)))
        refused = await dra.unschedulable(pod)
        if refused is None:
            return None
        return ("failed" if "CEL runtime error" in refused else "none"), frozenset()

    published = (await dra.kube.get(resource_path("resourceslices", name=made["metadata"]["name"])))["spec"]["devices"]
    seen = [(d["name"], selectors.Device.of(DRIVER, d)) for d in published]
    kinds = set()
    for i, expression in enumerate(PARITY_SELECTORS):
        theirs = await dra.until(functools.partial(answer, f"sel-{i}"), f"kube-scheduler's answer to {expression}")
        compiled = selectors.compile_selector(expression)
        assert isinstance(compiled, selectors.Selector), compiled
        verdicts = {name: compiled.judge(device) for name, device in seen}
        picked = frozenset(name for name, v in verdicts.items() if v.matches)
        failed = any(v.error for v in verdicts.values())
        ours = ("failed" if failed else "picked" if picked else "none"), (frozenset() if failed else picked)
        assert ours == theirs, f"selector {expression!r}: sharegpu {ours}, kube-scheduler {theirs}"
        print(f"{expression}: {ours[0]} {sorted(ours[1])}")  # the table, with -s
        kinds.add(ours[0])
    assert kinds == {"picked", "none", "failed"}


async def test_fact_11_an_extended_resource_of_sharegpus_class_gets_no_claim_kube_scheduler_cannot_allocate(
    dra: Dra,
) -> None:
    """Fact 11 (KEP-5004 with sharegpu's class): a DeviceClass with sharegpu's selector
    (`CLASS_SELECTOR`) and `extendedResourceName: sharegpu.io/gpu` makes kube-scheduler treat a pod's
    `sharegpu.io/gpu` (a resource no node advertises) as a request of the class; but its own allocator
    finds no device for the class, so the pod stays Pending ("cannot allocate all claims") and no
    ResourceClaim is made at all: kube-scheduler creates the extended-resource claim only when its
    allocator has allocated it, at binding. There is no claim for sharegpu's allocator to place, nor
    a name to write one under. So pods written with sharegpu's resources reach DRA nodes through the
    webhook, which turns their request into a claim of the class before scheduling (the DRA path);
    the chart's class names no extended resource."""
    await dra.node_with_gpu()
    name = f"{dra.namespace}-{uuid.uuid4().hex[:4]}"
    body = class_body(name, dra.namespace, names.GPU, sharegpu_only=True)
    await dra.make(resource_path("deviceclasses"), body)
    await dra.pod("asks", limits={names.GPU: "1"})
    assert "cannot allocate all claims" in await dra.refused("asks")
    made = await dra.kube.get(resource_path("resourceclaims", dra.namespace))
    assert made["items"] == [], "kube-scheduler made no claim"
    assert "extendedResourceClaimStatus" not in (await dra.get_pod("asks")).get("status", {})
