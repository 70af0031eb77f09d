"""sharegpu as a Dynamic Resource Allocation driver: the ResourceSlice a node publishes
(`resource.k8s.io/v1`), built from the same Device spec the agent writes; the DeviceClass's selector;
the claims sharegpu reads, allocates and asks for (templates per shape).

One slice per node, in a pool named after the node, for the driver `DRIVER`. One device per GPU,
named `gpu-<index>`:

- attributes, under the driver's domain: `uuid`, `model`, `index`, `numaNode`, `pcieSwitch` (where
  known), `nvlinkPeers` (the indexes it is NVLinked to, comma-separated), `mig`, and `allocator:
  sharegpu`, which the class's selector (`CLASS_SELECTOR`) turns away from kube-scheduler's own
  allocator, so that sharegpu allocates the class's claims alone; and, by the names NVIDIA's DRA
  driver gives them (so that a selector written for `gpu.nvidia.com` moves over by changing its
  domain), `type` (`gpu`), `productName`, `architecture`, `cudaComputeCapability`, `driverVersion`
  and `cudaDriverVersion` (versions), `pcieBusID`, each where the agent knows it; and Kubernetes'
  standard `resource.kubernetes.io/pcieRoot` and `resource.kubernetes.io/pciBusID`;
- capacities that several claims share (`allowMultipleAllocations`): `memory` (the GPU's memory, in
  Mi: a claim asks `4Gi` or `4096Mi`) and `milli` (compute, 1000 = the whole GPU), each with a
  request policy that keeps requests in sharegpu's units: memory in steps of 1 MiB, compute in
  steps of 1 milli-GPU, a claim that says nothing taking 1 milli-GPU and 1 MiB;
- an unhealthy GPU carries a device taint (`<driver>/unhealthy`, its reason as the value, cut to
  the API's 63 characters), graded by the reason (`api.devices.lasting`): NoExecute where it lasts
  until the GPU is reset or back (a critical XID, gone from NVML while pods hold it: the pods using
  it cannot go on, and kube-controller-manager evicts them), NoSchedule where it may pass (NVML
  cannot read it); so no new claim is given it. A GPU that pods of the extender path still hold
  carries a NoSchedule taint (`<driver>/held-by-pods`: a node turned to DRA while they run), until
  they are gone.

Taints an administrator puts on devices (`DeviceTaintRule`, selecting by driver, pool and device)
and the tolerations of a claim's requests are read here too: `TaintRule.selects` says which of
sharegpu's devices a rule taints, `tolerates` whether a request's tolerations take a taint (as
Kubernetes matches them: key, operator Equal or Exists, effect; an empty key with Exists takes
every key), and `ClaimRecord.tolerates` whether every request of the claim does.

A claim of the driver's, whoever allocated it, holds part of a GPU: `ResourceClaim` is what sharegpu
reads of one, `ClaimRecord` what its cache keeps (`gpu_request` reads each request of the class in
sharegpu's units, and names what it cannot place), and `held` turns its allocation into a
sharegpu `Allocation` (its pool is the node, its device `gpu-<index>`, its `consumedCapacity` the
share), so the one ledger counts DRA claims and sharing pods alike and never gives a GPU twice.

`claim_allocation` is the other way round: the `status.allocation` for a claim that sharegpu placed
(as kube-scheduler requires of a pre-made one on 1.37: a node selector, a `shareID` and
`consumedCapacity` per result, and an `allocationTimestamp`, without which the scheduler never binds
the pod). `held(claim_allocation(a))` is `a` again.

`Shape` is one shape of request (`sharegpu-1x500m-500pm`, GPU models written in the name when
asked): the webhook names a claim of it for each pod of the DRA path (`Shape.claim_name`, with a
random part), which the allocator makes for that pod (`pod_claim`); a template of the shape's name
(`template`) is made where a pod names one. A request's CEL selectors are compiled here
(`compiled`, `api.selectors`), as are sharegpu's DeviceClass's (`class_selectors`); a claim's
`matchAttribute` constraints are read, and what sharegpu cannot honour (`allocationMode: All`,
`adminAccess`, `distinctAttribute`, `firstAvailable`, opaque config for its driver) is named in the
claim's `problem`.

Pure: no I/O. The agent writes the slice (`agent.publication`); the extender's cache counts claims.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from sharegpu.api import devices as api_devices
from sharegpu.api import names, paths, quantity, selectors, wire
from sharegpu.core import allocation, errors, requests, units

DRIVER: Final = f"gpu.{names.DOMAIN}"
"""The driver's name: the DeviceClass selects on it, the kubelet plugin registers under it."""
GROUP: Final = "resource.k8s.io"
VERSION: Final = "v1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
_BASE: Final = paths.group(GROUP, VERSION)
_CLAIMS: Final = paths.Kind(_BASE, "resourceclaims")
_TEMPLATES: Final = paths.Kind(_BASE, "resourceclaimtemplates")
SLICES: Final = paths.Kind(_BASE, "resourceslices").everywhere
CLAIMS: Final = _CLAIMS.everywhere
"""Every namespace's ResourceClaims (the extender's cache lists and watches them)."""
DEVICE_CLASSES: Final = paths.Kind(_BASE, "deviceclasses").everywhere
TAINT_RULES: Final = paths.Kind(_BASE, "devicetaintrules").everywhere
MEMORY: Final = "memory"
"""The capacity a claim asks GPU memory of (a quantity; the device's is in Mi)."""
MILLI: Final = "milli"
"""The capacity a claim asks GPU compute of (an integer; 1000 = the whole GPU)."""
MEMORY_PERMILLE: Final = "memoryPermille"
"""GPU memory as a share of the chosen GPU's (per mille), in a claim of sharegpu's class instead of
`memory`: read by sharegpu's allocator only, which writes the MiB it comes to on the GPU it picks
as the result's consumed `memory` (a request format that gives a ratio, such as Koordinator's)."""
UNHEALTHY: Final = f"{DRIVER}/unhealthy"
"""The taint key of an unhealthy GPU."""
HELD: Final = f"{DRIVER}/held-by-pods"
"""The taint key of a GPU that pods of the extender path hold (a node turned to DRA while they run):
no claim is given it until they are gone."""
TAINT_VALUE_MAX: Final = 63
ALLOCATOR: Final = "allocator"
"""The device attribute that says who allocates the device's claims: `sharegpu`, always."""
CLASS: Final = DRIVER
"""sharegpu's DeviceClass: the claims sharegpu allocates are the claims of this class."""
CLASS_SELECTOR: Final = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].{ALLOCATOR} == "kube-scheduler"'
"""The DeviceClass's CEL selector. Every device says `allocator: sharegpu`, so kube-scheduler's own
allocator finds no device for a claim of the class, ever: it cannot give a GPU first-fit, nor
race sharegpu's allocator for one (it knows nothing of the extender path's pods, and trusts the
allocations it did not make). It honours the allocations sharegpu writes all the same: it checks
only their node selector (tests/integration/test_dra_facts.py)."""


def slice_name(node: str) -> str:
    """The node's ResourceSlice: one per node, named after it and the driver."""
    return f"{node}-{DRIVER}"


claim_path: Final = _CLAIMS.at
"""A namespace's ResourceClaims (every namespace's when None), or one of them."""
template_path: Final = _TEMPLATES.at
"""A namespace's ResourceClaimTemplates (every namespace's when None), or one of them."""


def device_class(name: str = CLASS, expression: str = CLASS_SELECTOR) -> dict[str, Any]:
    """A DeviceClass selecting by `expression`: by default sharegpu's, as the chart renders it
    (templates/deviceclass.yaml)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def slice_path(node: str) -> str:
    return f"{SLICES}/{slice_name(node)}"


def device_name(index: int) -> str:
    return f"gpu-{index}"


def _attribute(value: str | int | bool) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


def _peers(index: int, nvlinks: list[tuple[int, int]]) -> str:
    found = sorted({b if a == index else a for a, b in nvlinks if index in (a, b)})
    return ",".join(map(str, found))


def device(gpu: wire.GpuSpec, nvlinks: list[tuple[int, int]], held: bool = False) -> dict[str, Any]:
    """One GPU as a device of the slice (see the module docstring); `held`: pods of the extender path
    hold it (tainted, so kube-scheduler's allocator, which cannot see them, gives it no claim)."""
    attributes: dict[str, Any] = {
        "uuid": _attribute(gpu.uuid),
        "model": _attribute(gpu.model),
        "index": _attribute(gpu.index),
        "numaNode": _attribute(gpu.numa_node),
        "mig": _attribute(gpu.mig),
        "nvlinkPeers": _attribute(_peers(gpu.index, nvlinks)),
        ALLOCATOR: _attribute("sharegpu"),
    }
    if gpu.pcie_switch is not None:
        attributes["pcieSwitch"] = _attribute(gpu.pcie_switch)
    attributes.update(_nvidia_named(gpu))
    qualified = {f"{DRIVER}/{key}": value for key, value in attributes.items()}
    if gpu.pcie_root:
        qualified[f"{STANDARD}/pcieRoot"] = _attribute(gpu.pcie_root)
    if gpu.pci_bus_id:
        qualified[f"{STANDARD}/pciBusID"] = _attribute(gpu.pci_bus_id)
    out: dict[str, Any] = {
        "name": device_name(gpu.index),
        "attributes": qualified,
        "capacity": {
            MEMORY: {
                "value": f"{gpu.memory_mib}Mi",
                "requestPolicy": {"default": "1Mi", "validRange": {"min": "1Mi", "step": "1Mi"}},
            },
            MILLI: {
                "value": "1000",
                "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1000", "step": "1"}},
            },
        },
        "allowMultipleAllocations": True,
    }
    taints = []
    if not gpu.healthy:
        reason = (gpu.reason or "unhealthy")[:TAINT_VALUE_MAX]
        effect = NO_EXECUTE if api_devices.lasting(gpu.reason) else NO_SCHEDULE
        taints.append({"key": UNHEALTHY, "value": _taint_value(reason), "effect": effect})
    if held:
        taints.append({"key": HELD, "value": "extender-path", "effect": "NoSchedule"})
    if taints:
        out["taints"] = taints
    return out


STANDARD: Final = "resource.kubernetes.io"
"""The domain of Kubernetes' standard device attributes (`pcieRoot`, `pciBusID`)."""


def _nvidia_named(gpu: wire.GpuSpec) -> dict[str, Any]:
    """The attributes NVIDIA's DRA driver publishes, by its names, that the agent knows."""
    out: dict[str, Any] = {"type": _attribute("gpu"), "productName": _attribute(gpu.model)}
    if gpu.architecture:
        out["architecture"] = _attribute(gpu.architecture)
    for name, text in (
        ("cudaComputeCapability", gpu.compute_capability),
        ("driverVersion", gpu.driver_version),
        ("cudaDriverVersion", gpu.cuda_driver_version),
    ):
        version = selectors.published_version(text) if text else None
        if version is not None:
            out[name] = {"version": version}
    if gpu.pci_bus_id:
        out["pcieBusID"] = _attribute(gpu.pci_bus_id)
    return out


def _taint_value(text: str) -> str:
    """A reason as a taint value (a label value: letters, digits, '-', '_', '.'; starts and ends
    alphanumeric)."""
    kept = "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-_.")
    return kept or "unhealthy"


def resource_slice(
    node: str, node_uid: str, spec: wire.DeviceSpec, generation: int = 1, held: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The node's ResourceSlice, owned by its Node (it goes with the node); `held`: the UUIDs of GPUs
    pods of the extender path hold."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {
            "name": slice_name(node),
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [device(gpu, spec.nvlinks, gpu.uuid in held) for gpu in spec.gpus],
        },
    }


# ----------------------------------------------------------------- claims


class DeviceResult(wire.Message, kw_only=True, frozen=True):
    request: str = ""
    driver: str = ""
    pool: str = ""
    device: str = ""
    share_id: str | None = msgspec.field(default=None, name="shareID")
    consumed_capacity: dict[str, wire.Quantity] = msgspec.field(default_factory=dict)


class DeviceAllocation(wire.Message, kw_only=True, frozen=True):
    results: list[DeviceResult] = msgspec.field(default_factory=list)


class ClaimAllocation(wire.Message, kw_only=True, frozen=True):
    devices: DeviceAllocation = msgspec.field(default_factory=DeviceAllocation)


class Consumer(wire.Message, kw_only=True, frozen=True):
    """An entry of `status.reservedFor`: who uses the claim (a pod, by name and UID)."""

    resource: str = ""
    name: str = ""
    uid: str = ""


class ClaimStatus(wire.Message, kw_only=True, frozen=True):
    allocation: ClaimAllocation | None = None
    reserved_for: list[Consumer] = msgspec.field(default_factory=list)


class CapacityRequirements(wire.Message, kw_only=True, frozen=True):
    requests: dict[str, wire.Quantity] = msgspec.field(default_factory=dict)


class DeviceTaint(wire.Message, kw_only=True, frozen=True):
    key: str
    value: str = ""
    effect: str = ""

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


class DeviceToleration(wire.Message, kw_only=True, frozen=True):
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""
    toleration_seconds: int | None = None


def tolerates(tolerations: Sequence[DeviceToleration], taint: DeviceTaint) -> bool:
    """Whether any of `tolerations` takes `taint`, as Kubernetes matches them: the effect (empty:
    any), the key (empty with Exists: any key), and the value under Equal (the default operator)."""
    for toleration in tolerations:
        if toleration.effect and toleration.effect != taint.effect:
            continue
        if toleration.operator == "Exists":
            if not toleration.key or toleration.key == taint.key:
                return True
        elif toleration.key == taint.key and toleration.value == taint.value:
            return True
    return False


class TaintSelector(wire.Message, kw_only=True, frozen=True):
    driver: str | None = None
    pool: str | None = None
    device: str | None = None


class TaintRuleSpec(wire.Message, kw_only=True, frozen=True):
    device_selector: TaintSelector | None = None
    taint: DeviceTaint


class TaintRule(wire.Message, kw_only=True, frozen=True):
    """A DeviceTaintRule (`resource.k8s.io/v1` from Kubernetes 1.37): one taint on every device its
    selector picks (without a selector, none)."""

    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: TaintRuleSpec

    def selects(self, node: str, index: int) -> bool:
        """Whether it taints GPU `index` of `node` (sharegpu's pool is the node, its device `gpu-<index>`)."""
        chosen = self.spec.device_selector
        if chosen is None:
            return False
        return (
            chosen.driver in (None, DRIVER)
            and chosen.pool in (None, node)
            and chosen.device in (None, device_name(index))
        )


NO_SCHEDULE: Final = "NoSchedule"
NO_EXECUTE: Final = "NoExecute"
KEEPING_OFF: Final = (NO_SCHEDULE, NO_EXECUTE)
"""The effects that keep new claims off a device (`None` is informational)."""


class ExactRequest(wire.Message, kw_only=True, frozen=True):
    device_class_name: str = ""
    allocation_mode: str = ""
    count: int = 1
    capacity: CapacityRequirements | None = None
    selectors: list[Any] = msgspec.field(default_factory=list)
    admin_access: bool | None = None
    tolerations: list[DeviceToleration] = msgspec.field(default_factory=list)


class DeviceRequest(wire.Message, kw_only=True, frozen=True):
    name: str = ""
    exactly: ExactRequest | None = None
    first_available: list[Any] = msgspec.field(default_factory=list)


class DeviceConstraint(wire.Message, kw_only=True, frozen=True):
    requests: list[str] = msgspec.field(default_factory=list)
    match_attribute: str | None = None
    distinct_attribute: str | None = None


class OpaqueConfig(wire.Message, kw_only=True, frozen=True):
    driver: str = ""


class DeviceConfig(wire.Message, kw_only=True, frozen=True):
    requests: list[str] = msgspec.field(default_factory=list)
    opaque: OpaqueConfig | None = None


class DeviceClaim(wire.Message, kw_only=True, frozen=True):
    requests: list[DeviceRequest] = msgspec.field(default_factory=list)
    constraints: list[DeviceConstraint] = msgspec.field(default_factory=list)
    config: list[DeviceConfig] = msgspec.field(default_factory=list)


class ClaimSpec(wire.Message, kw_only=True, frozen=True):
    devices: DeviceClaim = msgspec.field(default_factory=DeviceClaim)


class ResourceClaim(wire.Message, kw_only=True, frozen=True):
    """What sharegpu reads of a ResourceClaim (`resource.k8s.io/v1`): who it is, what it asks and
    what it was given."""

    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: ClaimSpec = msgspec.field(default_factory=ClaimSpec)
    status: ClaimStatus = msgspec.field(default_factory=ClaimStatus)


class TemplateSpec(wire.Message, kw_only=True, frozen=True):
    spec: ClaimSpec = msgspec.field(default_factory=ClaimSpec)


class ResourceClaimTemplate(wire.Message, kw_only=True, frozen=True):
    """What sharegpu reads of a ResourceClaimTemplate: the claim it makes."""

    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: TemplateSpec = msgspec.field(default_factory=TemplateSpec)


def asks_class(spec: ClaimSpec) -> bool:
    """Whether a claim's spec (or the one a template makes) asks for sharegpu's class in any request,
    exactly or among its `firstAvailable` alternatives."""
    return any(
        (r.exactly is not None and r.exactly.device_class_name == CLASS) or any(_of_class(s) for s in r.first_available)
        for r in spec.devices.requests
    )


def gpu_request(request: DeviceRequest) -> requests.GpuRequest | None:
    """What one request of a claim asks of sharegpu's GPUs, in sharegpu's units; None when it is not
    a request of the driver's class. Its capacity requests are rounded up as the slice's request
    policies round them (milli-GPU, MiB); what it does not ask takes the policies' defaults (1
    milli-GPU, 1 MiB), as kube-scheduler's allocator does; all 1000 milli-GPU is the whole GPU (its
    memory with it); a count of n is a share of each of n GPUs
    (the scheduler gives a count of 2 two devices). InvalidRequestError naming the request for what
    sharegpu cannot place (allocationMode All, a share beyond one GPU)."""
    exact = request.exactly
    if request.first_available and any(_of_class(sub) for sub in request.first_available):
        raise errors.InvalidRequestError(
            f"claim request {request.name!r}: firstAvailable is not supported for class {CLASS}: write the "
            "alternative you want under `exactly` (sharegpu's placement already picks the GPU that fits)"
        )
    if exact is None or exact.device_class_name != CLASS:
        return None
    where = f"claim request {request.name!r}"
    if exact.allocation_mode not in ("", "ExactCount"):
        raise errors.InvalidRequestError(
            f"{where}: allocationMode {exact.allocation_mode} is not supported for class {CLASS} (a GPU shared "
            "by claims has no 'all of it' to give, and nodes differ in GPUs): write allocationMode ExactCount "
            "with count: N, and a selector for the GPUs you want"
        )
    if exact.admin_access:
        raise errors.InvalidRequestError(
            f"{where}: adminAccess is not supported for class {CLASS} (it would reach GPUs other claims hold, "
            "outside the ledger): watch GPUs with `kubectl sharegpu inspect` and the agent's metrics, or run "
            "a monitor as a privileged DaemonSet, as NVIDIA's DCGM exporter runs"
        )
    asked = exact.capacity.requests if exact.capacity is not None else {}
    if MEMORY in asked and MEMORY_PERMILLE in asked:
        raise errors.InvalidRequestError(f"{where}: ask {MEMORY} or {MEMORY_PERMILLE}, not both")
    try:
        milli = math.ceil(quantity.parse(asked[MILLI])) if MILLI in asked else 1
        memory = quantity.mebibytes(asked[MEMORY]) if MEMORY in asked else 0  # compute only: no fixed amount
        permille = (
            quantity.integer(asked[MEMORY_PERMILLE], MEMORY_PERMILLE, 1, units.PERMILLE)
            if MEMORY_PERMILLE in asked
            else 0
        )
    except errors.InvalidInputError as exc:
        raise errors.InvalidRequestError(f"{where}: {exc}") from None
    if not 1 <= milli <= units.MILLI_PER_GPU:
        raise errors.InvalidRequestError(f"{where}: {MILLI} must be 1..{units.MILLI_PER_GPU}, got {milli}")
    if milli == units.MILLI_PER_GPU:  # all of its compute: the whole GPU, all of its memory with it
        return requests.GpuRequest(count=exact.count)
    if permille:
        return requests.GpuRequest(count=exact.count, milli=milli, memory_permille=permille)
    return requests.GpuRequest(count=exact.count, milli=milli, memory_mib=memory)


def _of_class(sub: Any) -> bool:
    return isinstance(sub, dict) and sub.get("deviceClassName") == CLASS


TEMPLATE_PREFIX: Final = "sharegpu-"
POD_CLAIM: Final = "sharegpu-gpu"
"""The name of the claim entry (`spec.resourceClaims[]`) the webhook gives a pod it turns to the DRA path."""
_TEMPLATE = re.compile(r"^sharegpu-(\d+)x(\d+)m-(\d+)(mi|pm)(?:-m([a-z2-7]+))?(?:-c([a-z2-7]{16}))?$")
POD_CLAIM_TOKEN_BYTES: Final = 10
"""The random part of a pod's claim name (`Shape.claim_name`): 80 bits, 16 base32 characters."""
NAME_MAX: Final = 253
"""The longest object name (a DNS subdomain)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """What a claim template of sharegpu's asks: `count` GPUs with `milli` of each, and `memory_mib`
    or `memory_permille` of each (0: none named), of one of `models` (empty: any)."""

    count: int
    milli: int
    memory_mib: int = 0
    memory_permille: int = 0
    models: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        """The template's name: one per shape and namespace (`template_shape` reads it back). The models
        are written in it, base32 (lower case, a name's alphabet), so that the allocator, which makes a
        missing template from its name alone, makes the selector they come to."""
        memory = f"{self.memory_permille}pm" if self.memory_permille else f"{self.memory_mib}mi"
        name = f"{TEMPLATE_PREFIX}{self.count}x{self.milli}m-{memory}"
        if self.models:
            encoded = base64.b32encode("\n".join(sorted(self.models)).encode()).decode().rstrip("=").lower()
            name += f"-m{encoded}"
        return name

    def claim_name(self, token: bytes) -> str:
        """The name of a claim of this shape for one pod (`token`: `POD_CLAIM_TOKEN_BYTES` random
        bytes): the webhook names it in the pod, the allocator makes it (`pod_claim`) for the pod that
        names it, owned by that pod. One claim per pod, made once it waits: no template, so
        kube-controller-manager neither makes it nor writes the pod's status for it."""
        return f"{self.name}-c{base64.b32encode(token).decode().lower()}"

    def check(self) -> None:
        """InvalidRequestError for a shape no template can be named after (models too long to write in a
        name, or one with a line break)."""
        if any("\n" in m for m in self.models):
            raise errors.InvalidRequestError("a GPU model name with a line break cannot be asked for on the DRA path")
        longest = len(self.claim_name(bytes(POD_CLAIM_TOKEN_BYTES)))
        if longest > NAME_MAX:
            raise errors.InvalidRequestError(
                f"the GPU models {sorted(self.models)} are too long to name a claim template after "
                f"({longest} characters, at most {NAME_MAX}): allow fewer models, or ask with a "
                "ResourceClaim of sharegpu's class and a selector on productName"
            )

    @property
    def selector(self) -> str | None:
        """The CEL selector of its models (None: any model)."""
        if not self.models:
            return None
        listed = ", ".join(json.dumps(m) for m in sorted(self.models))
        return f'device.attributes["{DRIVER}"].productName in [{listed}]'


def template_shape(name: str) -> Shape | None:
    """The shape a template name says; None for any other name."""
    found = _TEMPLATE.match(name)
    if found is None or found.group(6):
        return None
    return _shape(found)


def asks_as_named(claim: ClaimRecord, shape: Shape) -> bool:
    """The claim asks for what its shape-given name (or its template's) says: the very requests of the
    claim sharegpu writes for the shape (`pod_claim`, `template`). One of that name written by anyone
    else may ask for more than the pod's quota totals say."""
    return claim.asks == _shape_asks(shape)


@functools.lru_cache(maxsize=256)
def _shape_asks(shape: Shape) -> tuple[tuple[str, requests.GpuRequest], ...]:
    made = {"metadata": {"name": shape.name, "namespace": "-", "uid": "-"}, "spec": _claim_spec(shape)}
    return claim_record(wire.convert(made, ResourceClaim)).asks


def claim_shape(name: str) -> Shape | None:
    """The shape a pod's claim name (`Shape.claim_name`) says; None for any other name."""
    found = _TEMPLATE.match(name)
    if found is None or not found.group(6):
        return None
    return _shape(found)


def _shape(found: re.Match[str]) -> Shape | None:
    count, milli, memory = (int(g) for g in found.groups()[:3])
    if not 1 <= count <= units.MAX_GPUS_PER_NODE or not 1 <= milli <= units.MILLI_PER_GPU:
        return None
    models: frozenset[str] = frozenset()
    if found.group(5):
        encoded = found.group(5).upper()
        try:
            models = frozenset(base64.b32decode(encoded + "=" * (-len(encoded) % 8)).decode().split("\n"))
        except (binascii.Error, UnicodeDecodeError):
            return None
    if found.group(4) == "pm":
        if not 1 <= memory <= units.PERMILLE:
            return None
        return Shape(count, milli, memory_permille=memory, models=models)
    return Shape(count, milli, memory_mib=memory, models=models)


def template(namespace: str, name: str) -> dict[str, Any]:
    """The ResourceClaimTemplate `name` (a `Shape.name`) of `namespace`: one request `gpu` of the
    class, for its shape. InvalidInputError for a name that is not a shape."""
    shape = template_shape(name)
    if shape is None:
        raise errors.InvalidInputError(f"{name!r} is not a sharegpu claim template name")
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": {names.LABEL_ROLE: names.ROLE_CLAIM_TEMPLATE}},
        "spec": {"spec": _claim_spec(shape)},
    }


def pod_claim(namespace: str, name: str, pod: str, pod_uid: str) -> dict[str, Any]:
    """The ResourceClaim `name` (a `Shape.claim_name`) of `namespace` for the pod that names it: its
    shape's request, owned by the pod (it goes with the pod), born with the finalizer
    `DELETE_PROTECTION` (so kube-controller-manager frees it when the pod goes, and the allocator
    writes no finalizer). InvalidInputError for a name that is not a pod's claim."""
    shape = claim_shape(name)
    if shape is None:
        raise errors.InvalidInputError(f"{name!r} is not a sharegpu pod claim name")
    owner = {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": pod_uid, "controller": True}
    meta = {"name": name, "namespace": namespace, "labels": {names.LABEL_ROLE: names.ROLE_POD_CLAIM},
            "finalizers": [DELETE_PROTECTION], "ownerReferences": [owner]}  # fmt: skip
    return {"apiVersion": API_VERSION, "kind": "ResourceClaim", "metadata": meta, "spec": _claim_spec(shape)}


def _claim_spec(shape: Shape) -> dict[str, Any]:
    """The claim spec of a shape: one request `gpu` of the class."""
    count, milli = shape.count, shape.milli
    asked: dict[str, str] = {MILLI: str(milli)}
    if milli < units.MILLI_PER_GPU and shape.memory_permille:
        asked[MEMORY_PERMILLE] = str(shape.memory_permille)
    elif milli < units.MILLI_PER_GPU and shape.memory_mib:
        asked[MEMORY] = f"{shape.memory_mib}Mi"
    exactly: dict[str, Any] = {"deviceClassName": CLASS, "count": count, "capacity": {"requests": asked}}
    if shape.selector is not None:
        exactly["selectors"] = [{"cel": {"expression": shape.selector}}]
    request = {"name": "gpu", "exactly": exactly}
    return {"devices": {"requests": [request]}}


DELETE_PROTECTION: Final = "resource.kubernetes.io/delete-protection"
"""The finalizer without which the resourceclaim controller does not free a claim when its pod goes."""
CLAIM_KEY_SUFFIX: Final = "#claim"
"""A claim's key in the ledger, beside pods': `<namespace>/<name>#claim` (a pod name has no '#')."""
_DEVICE = re.compile(r"^gpu-(\d+)$")


def claim_key(namespace: str, name: str) -> units.PodKey:
    """The ledger's key of claim `namespace/name` (`ClaimName.of` reads it back)."""
    return units.PodKey(f"{namespace}/{name}{CLAIM_KEY_SUFFIX}")


@dataclass(frozen=True, slots=True)
class ClaimName:
    """A claim's namespace and name, read back from its ledger key."""

    namespace: str
    name: str

    @classmethod
    def of(cls, key: str) -> ClaimName | None:
        """The claim a ledger key stands for; None for a pod's key."""
        if not key.endswith(CLAIM_KEY_SUFFIX):
            return None
        namespace, _, name = key.removesuffix(CLAIM_KEY_SUFFIX).partition("/")
        return cls(namespace, name)


def is_claim_key(key: str) -> bool:
    """Whether a ledger key is a claim's (not a pod's)."""
    return key.endswith(CLAIM_KEY_SUFFIX)


def held(claim: ClaimRecord, memory_of: Mapping[tuple[str, int], int]) -> allocation.Allocation | None:
    """What an allocated claim holds of the driver's GPUs, as an allocation of its node (None: it
    holds none of them). A result without `consumedCapacity` (a claim that took a whole device)
    holds the whole GPU; `memory_of` gives each (node, index)'s memory for that. InvalidInputError
    for a result sharegpu cannot read (another pool per node than its own, a device it never
    published)."""
    found = claim.allocation
    if found is None:
        return None
    mine = [r for r in found.devices.results if r.driver == DRIVER]
    if not mine:
        return None
    key = claim.key
    asked = dict(claim.asks)
    nodes = {r.pool for r in mine}
    if len(nodes) != 1:
        raise errors.InvalidInputError(f"claim {key}: its {DRIVER} devices lie in several pools: {sorted(nodes)}")
    node = nodes.pop()
    per_request: dict[str, list[allocation.DeviceGrant]] = {}
    for result in mine:
        matched = _DEVICE.match(result.device)
        if matched is None:
            raise errors.InvalidInputError(f"claim {key}: {result.device!r} is not a device {DRIVER} publishes")
        index = int(matched.group(1))
        capacity = result.consumed_capacity
        whole = not capacity
        milli = (
            units.MILLI_PER_GPU if whole else quantity.integer(capacity.get(MILLI, 1), MILLI, 1, units.MILLI_PER_GPU)
        )
        if whole:
            memory = memory_of.get((node, index), 0)
        else:
            memory = quantity.mebibytes(capacity[MEMORY]) if MEMORY in capacity else 0
            ask = asked.get(result.request)
            if ask is not None and not ask.memory_mib and not ask.memory_permille:
                memory = 0  # it asked for compute only: the 1Mi consumed is the device's least, not a limit
        per_request.setdefault(result.request or "claim", []).append(
            allocation.DeviceGrant(index, milli, memory, milli)
        )
    containers = tuple(allocation.ContainerAllocation(name, tuple(grants)) for name, grants in per_request.items())
    return allocation.Allocation(
        key, units.NodeName(node), containers, exclusive=all(not r.consumed_capacity for r in mine), device_claim=True
    )


def claim_allocation(alloc: allocation.Allocation, share_ids: list[str], now: str) -> dict[str, Any]:
    """The `status.allocation` of a claim sharegpu placed as `alloc`: one result per GPU each of its
    containers holds, the container's name being the claim's request (`share_ids`: one fresh UUID
    per result; `now`: RFC 3339)."""
    grants = [(c.name, g) for c in alloc.containers for g in c.devices]
    if len(share_ids) != len(grants):
        raise errors.InvalidInputError(f"claim {alloc.pod}: {len(grants)} GPU(s) but {len(share_ids)} share id(s)")
    results = [
        {
            "request": request,
            "driver": DRIVER,
            "pool": alloc.node,
            "device": device_name(grant.index),
            "shareID": share,
            # A share that asked for compute only consumes the device's least (its requestPolicy's 1Mi).
            "consumedCapacity": {MILLI: str(grant.milli), MEMORY: f"{max(grant.memory_mib, 1)}Mi"},
        }
        for (request, grant), share in zip(grants, share_ids, strict=True)
    ]
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [alloc.node]}]}
    return {"devices": {"results": results}, "nodeSelector": {"nodeSelectorTerms": [term]}, "allocationTimestamp": now}


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """A ResourceClaim as sharegpu's cache and allocator need it (parsed once per watch event)."""

    key: units.PodKey
    """`claim_key`: the claim's key in the ledger."""
    namespace: str
    name: str
    uid: str
    resource_version: str
    asks: tuple[tuple[str, requests.GpuRequest], ...]
    """Its requests of sharegpu's class, by request name (what the allocator places)."""
    tolerations: tuple[tuple[DeviceToleration, ...], ...]
    """Per request of `asks`, its tolerations."""
    problem: str | None
    """Why sharegpu cannot allocate it (None: it can, or it asks nothing of sharegpu)."""
    allocation: ClaimAllocation | None
    reserved: tuple[str, ...]
    """The UIDs of the pods it is reserved for (`status.reservedFor`)."""
    finalizers: tuple[str, ...]
    deleting: bool
    created: str = ""
    """Its creation timestamp (RFC 3339: ordered as text)."""
    selectors: tuple[selectors.Selector, ...] = ()
    """The CEL selectors of its requests of sharegpu's class, compiled: sharegpu places a claim's
    requests as one unit, so each GPU it gives the claim must pass all of them."""
    match: tuple[str, ...] = ()
    """Attributes (fully qualified) its GPUs must all have, with one value (`matchAttribute`; applied to
    all its requests, which sharegpu places as one unit)."""

    @property
    def protected(self) -> bool:
        """It carries `DELETE_PROTECTION` (so the resourceclaim controller frees it when its pods go)."""
        return DELETE_PROTECTION in self.finalizers

    @property
    def ours(self) -> bool:
        """sharegpu allocates it: it asks for sharegpu's class."""
        return bool(self.asks) or self.problem is not None

    @property
    def allocated(self) -> bool:
        return self.allocation is not None

    def tolerates(self, taint: DeviceTaint) -> bool:
        """Whether every request of sharegpu's class tolerates `taint` (any of them may land on the
        tainted GPU; a claim with no such request tolerates nothing)."""
        return bool(self.tolerations) and all(tolerates(t, taint) for t in self.tolerations)

    def holds_ours(self) -> bool:
        """Its allocation holds devices of sharegpu's driver (whoever allocated it)."""
        return self.allocation is not None and any(r.driver == DRIVER for r in self.allocation.devices.results)

    def pod_request(self, cpu_milli: int, memory_mib: int, selection: str = "") -> requests.PodRequest:
        """What placing it asks: its requests as the containers of one request keyed by the claim, with
        the host CPU and memory of the pod that uses it (checked, not held: the pod holds them once
        bound), on the GPUs of the fleet's selection `selection` (its device selectors'; empty: any).
        InvalidRequestError for requests that cannot go together (whole and fractional)."""
        return _request(self.key, self.asks, cpu_milli, memory_mib, selection)


def claim_record(claim: ResourceClaim, previous: ClaimRecord | None = None) -> ClaimRecord:
    meta = claim.metadata
    key = claim_key(meta.namespace, meta.name)
    asks: list[tuple[str, requests.GpuRequest]] = []
    tolerations: list[tuple[DeviceToleration, ...]] = []
    chosen: list[selectors.Selector] = []
    match: tuple[str, ...] = ()
    problem = None
    others = []
    try:
        for request in claim.spec.devices.requests:
            found = gpu_request(request)
            if found is not None:
                asks.append((request.name, found))
                exact = request.exactly
                tolerations.append(tuple(exact.tolerations) if exact is not None else ())
                chosen += compiled(exact.selectors if exact is not None else [], f"claim request {request.name!r}")
            else:
                others.append(request.name)
        if asks and others:
            raise errors.InvalidRequestError(
                f"its requests {others} are not of class {CLASS}: sharegpu allocates only claims whose every "
                f"request is of its class (give the other devices a claim of their own)"
            )
        if asks:
            match = _constraints(claim.spec.devices.constraints)
            _configs(claim.spec.devices.config)
            _request(key, asks)  # they must go together (as placement will combine them)
    except errors.InvalidInputError as exc:
        problem = f"claim {meta.namespace}/{meta.name}: {exc}"
    return ClaimRecord(
        key=key,
        namespace=meta.namespace,
        name=meta.name,
        uid=meta.uid,
        resource_version=meta.resource_version,
        asks=tuple(asks) if problem is None else (),
        tolerations=tuple(tolerations) if problem is None else (),
        problem=problem,
        allocation=claim.status.allocation,
        reserved=tuple(c.uid for c in claim.status.reserved_for),
        finalizers=tuple(meta.finalizers),
        deleting=meta.deletion_timestamp is not None,
        created=meta.creation_timestamp or "",
        selectors=tuple(dict.fromkeys(chosen)) if problem is None else (),
        match=match if problem is None else (),
    )


def _constraints(constraints: Sequence[DeviceConstraint]) -> tuple[str, ...]:
    """The attributes a claim's devices must agree on (`matchAttribute`, fully qualified), or
    InvalidRequestError naming a constraint sharegpu cannot honour."""
    match = []
    for i, constraint in enumerate(constraints):
        where = f"constraints[{i}]"
        if constraint.distinct_attribute is not None:
            raise errors.InvalidRequestError(
                f"{where}.distinctAttribute is not supported for class {CLASS} (sharegpu puts a claim's requests "
                "on the same GPUs, as its containers share a pod's): ask one request for count: N, which gives N "
                "distinct GPUs"
            )
        name = constraint.match_attribute
        if name is None:
            raise errors.InvalidRequestError(f"{where}: a constraint sharegpu does not know (only matchAttribute)")
        if "/" not in name:
            raise errors.InvalidRequestError(f"{where}.matchAttribute {name!r} must name its domain (domain/name)")
        match.append(name)
    return tuple(dict.fromkeys(match))


def _configs(configs: Sequence[DeviceConfig]) -> None:
    """InvalidRequestError for opaque parameters given to sharegpu's driver, which takes none."""
    for i, config in enumerate(configs):
        if config.opaque is not None and config.opaque.driver == DRIVER:
            raise errors.InvalidRequestError(
                f"config[{i}].opaque: driver {DRIVER} takes no parameters (a share's size is the request's "
                "capacity, its GPUs the selectors): remove the config"
            )


def compiled(written: Sequence[Any], where: str) -> list[selectors.Selector]:
    """The CEL selectors of a request or a class (`[{"cel": {"expression": ...}}]`), compiled;
    InvalidRequestError naming the one that is malformed or does not compile here."""
    out = []
    for i, selector in enumerate(written):
        expression = selector.get("cel", {}).get("expression") if isinstance(selector, dict) else None
        if not isinstance(expression, str):
            raise errors.InvalidRequestError(f"{where}: selector #{i} is not a CEL selector")
        found = selectors.compile_selector(expression)
        if isinstance(found, selectors.Problem):
            raise errors.InvalidRequestError(f"{where}: selector #{i} does not compile here: {found.message}")
        out.append(found)
    return out


class DeviceClassSpec(wire.Message, kw_only=True, frozen=True):
    selectors: list[Any] = msgspec.field(default_factory=list)
    config: list[DeviceConfig] = msgspec.field(default_factory=list)


class DeviceClass(wire.Message, kw_only=True, frozen=True):
    """What sharegpu reads of a DeviceClass: its selectors."""

    metadata: wire.ObjectMeta = msgspec.field(default_factory=wire.ObjectMeta)
    spec: DeviceClassSpec = msgspec.field(default_factory=DeviceClassSpec)


def class_selectors(found: DeviceClass) -> tuple[selectors.Selector, ...]:
    """The selectors of sharegpu's DeviceClass that sharegpu's allocator applies: all but
    `CLASS_SELECTOR`, which only keeps kube-scheduler's allocator away (an administrator may add
    others, to narrow the class: sharegpu honours them as kube-scheduler would). InvalidRequestError
    naming one that does not compile here."""
    kept = [
        s
        for s in found.spec.selectors
        if not (isinstance(s, dict) and " ".join(str(s.get("cel", {}).get("expression", "")).split()) == CLASS_SELECTOR)
    ]
    where = f"DeviceClass {found.metadata.name}"
    try:
        _configs(found.spec.config)
    except errors.InvalidRequestError as exc:
        raise errors.InvalidRequestError(f"{where}: {exc}") from None
    return tuple(compiled(kept, where))


def _request(
    key: units.PodKey,
    asks: Sequence[tuple[str, requests.GpuRequest]],
    cpu_milli: int = 0,
    memory_mib: int = 0,
    selection: str = "",
) -> requests.PodRequest:
    """A claim's requests as the containers of one request (InvalidRequestError when they cannot go
    together: whole and fractional)."""
    containers = tuple(requests.ContainerRequest(name, gpu) for name, gpu in asks)
    return requests.PodRequest(key, containers, cpu_milli=cpu_milli, memory_mib=memory_mib, selection=selection)
