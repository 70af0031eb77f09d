"""Typed messages for the Kubernetes objects sharegpu reads: only the fields it uses.

These are msgspec Structs decoded straight from the API server's JSON bytes: fields sharegpu does
not name are skipped while parsing (in C, without building dicts for them), which is why a watch of
every pod in a large cluster stays cheap, and a mistyped field fails with the path to it
(`Expected `str`, got `int` - at `$.spec.containers[0].name``). Every field has a default, as in the
API: an absent part is an empty one.

Writers build their bodies from the same Structs where they can (`encode`), so what one component
writes is exactly what the others read.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping
from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
from msgspec import Meta

from sharegpu.core import errors

T = TypeVar("T")
Quantity = str | int | float
"""A resource value: the API server always sends strings; manifests may carry numbers."""


class Message(msgspec.Struct, rename="camel", kw_only=True, frozen=True, omit_defaults=True):
    """Base of every message: camelCase on the wire, defaults for absent fields, immutable."""


# ----------------------------------------------------------------- metadata and common parts


class OwnerReference(Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    name: str = ""
    uid: str = ""
    controller: bool | None = None


class ObjectMeta(Message, kw_only=True, frozen=True):
    name: str = ""
    generate_name: str = ""
    namespace: str = ""
    uid: str = ""
    resource_version: str = ""
    generation: int = 0
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    owner_references: list[OwnerReference] = []
    finalizers: list[str] = []


def controller_reference(api_version: str, kind: str, owner: ObjectMeta) -> OwnerReference:
    """The reference an object makes to the object that controls it (the garbage collector deletes
    it with its owner)."""
    return OwnerReference(api_version=api_version, kind=kind, name=owner.name, uid=owner.uid, controller=True)


class ListMeta(Message, kw_only=True, frozen=True):
    resource_version: str = ""
    continue_: str = msgspec.field(default="", name="continue")


class ObjectList(Message, Generic[T], kw_only=True, frozen=True):
    """A page of a collection (items carry no kind in a list)."""

    metadata: ListMeta = msgspec.field(default_factory=ListMeta)
    items: list[T] = []


class StatusDetails(Message, kw_only=True, frozen=True):
    name: str = ""
    kind: str = ""
    retry_after_seconds: int = 0


class Status(Message, kw_only=True, frozen=True):
    """The API server's error body (also the object of a watch ERROR event)."""

    kind: str = ""
    status: str = ""
    message: str = ""
    reason: str = ""
    code: int = 0
    details: StatusDetails = msgspec.field(default_factory=StatusDetails)


class EventType(enum.StrEnum):
    """The type of a watch event (`WatchEvent.type`), as informers hand them to their handlers."""

    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"
    BOOKMARK = "BOOKMARK"
    ERROR = "ERROR"


class WatchEvent(Message, kw_only=True, frozen=True):
    """One line of a watch stream; `object` is decoded by whoever knows its kind."""

    type: str = ""
    object: msgspec.Raw = msgspec.Raw(b"{}")


# ----------------------------------------------------------------- pods


class ContainerClaim(Message, kw_only=True, frozen=True):
    """One of a container's `resources.claims`: a pod claim entry by name, and one request of it ("":
    every request of the claim)."""

    name: str
    request: str = ""


class ResourceRequirements(Message, kw_only=True, frozen=True):
    limits: dict[str, Quantity] = {}
    requests: dict[str, Quantity] = {}
    claims: list[ContainerClaim] = []

    def merged(self) -> dict[str, Quantity]:
        """Requests overlaid with limits (limits win): what a container asks for."""
        return {**self.requests, **self.limits} if self.requests else self.limits


class KeySelector(Message, kw_only=True, frozen=True):
    name: str = ""
    key: str = ""
    optional: bool | None = None


class EnvVarSource(Message, kw_only=True, frozen=True):
    config_map_key_ref: KeySelector | None = None


class EnvVar(Message, kw_only=True, frozen=True):
    name: str = ""
    value: str | None = None
    value_from: EnvVarSource | None = None


class LocalReference(Message, kw_only=True, frozen=True):
    name: str = ""


class EnvFromSource(Message, kw_only=True, frozen=True):
    config_map_ref: LocalReference | None = None
    secret_ref: LocalReference | None = None
    prefix: str = ""


class ProjectedSource(Message, kw_only=True, frozen=True):
    config_map: LocalReference | None = None


class ProjectedVolume(Message, kw_only=True, frozen=True):
    sources: list[ProjectedSource] = []


class Volume(Message, kw_only=True, frozen=True):
    name: str = ""
    config_map: LocalReference | None = None
    projected: ProjectedVolume | None = None


class Container(Message, kw_only=True, frozen=True):
    name: str = ""
    resources: ResourceRequirements = msgspec.field(default_factory=ResourceRequirements)
    env: list[EnvVar] = []
    env_from: list[EnvFromSource] = []
    restart_policy: str = ""
    """"Always" on an init container: a native sidecar, which runs beside the app containers."""


class PreferredTerm(Message, kw_only=True, frozen=True):
    weight: int = 0


class NodeSelectorRequirement(Message, kw_only=True, frozen=True):
    key: str = ""
    operator: str = ""
    values: list[str] = []


class NodeSelectorTerm(Message, kw_only=True, frozen=True):
    match_expressions: list[NodeSelectorRequirement] = []
    match_fields: list[NodeSelectorRequirement] = []


class NodeSelector(Message, kw_only=True, frozen=True):
    node_selector_terms: list[NodeSelectorTerm] = []


class NodeAffinity(Message, kw_only=True, frozen=True):
    preferred_during_scheduling_ignored_during_execution: list[PreferredTerm] = []
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None


class Toleration(Message, kw_only=True, frozen=True):
    key: str = ""
    operator: str = ""
    value: str = ""
    effect: str = ""


class Taint(Message, kw_only=True, frozen=True):
    key: str = ""
    value: str = ""
    effect: str = ""


class PodAffinityTerm(Message, kw_only=True, frozen=True):
    """One required pod (anti-)affinity term: pods its selector matches, in its namespaces (none named
    and no selector: the pod's own), within one value of `topology_key`."""

    label_selector: LabelSelector | None = None
    namespaces: list[str] = []
    namespace_selector: LabelSelector | None = None
    topology_key: str = ""


class PodAffinity(Message, kw_only=True, frozen=True):
    preferred_during_scheduling_ignored_during_execution: list[PreferredTerm] = []
    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = []


class Affinity(Message, kw_only=True, frozen=True):
    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class TopologySpreadConstraint(Message, kw_only=True, frozen=True):
    when_unsatisfiable: str = ""


class PodResourceClaim(Message, kw_only=True, frozen=True):
    """One entry of `spec.resourceClaims`: a claim by name, or one made from a template per pod."""

    name: str = ""
    resource_claim_name: str | None = None
    resource_claim_template_name: str | None = None


class PodResourceClaimStatus(Message, kw_only=True, frozen=True):
    """The claim kube-controller-manager made for a template entry (`status.resourceClaimStatuses`)."""

    name: str = ""
    resource_claim_name: str | None = None


class SchedulingGate(Message, kw_only=True, frozen=True):
    name: str = ""


class PodSpec(Message, kw_only=True, frozen=True):
    node_name: str = ""
    scheduler_name: str = ""
    containers: list[Container] = []
    init_containers: list[Container] = []
    ephemeral_containers: list[Container] = []
    """Added later through the pods/ephemeralcontainers subresource (`kubectl debug`)."""
    volumes: list[Volume] = []
    affinity: Affinity | None = None
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    topology_spread_constraints: list[TopologySpreadConstraint] = []
    priority: int | None = None
    """Resolved from the pod's PriorityClass by the API server's admission (None: no priority set)."""
    preemption_policy: str = ""
    """PreemptLowerPriority (the default) or Never, from the PriorityClass like `priority`."""
    resources: ResourceRequirements | None = None
    """Pod-level CPU and memory (Kubernetes 1.34+, beta and on by default): they replace the
    containers' total in scheduling."""
    resource_claims: list[PodResourceClaim] = []
    scheduling_gates: list[SchedulingGate] = []


class PodCondition(Message, kw_only=True, frozen=True):
    type: str = ""
    status: str = ""
    reason: str = ""
    message: str = ""


class ContainerStatus(Message, kw_only=True, frozen=True):
    """What the kubelet reports of a container: its runtime id, and its resources (they differ from
    the spec while an in-place resize is under way)."""

    name: str = ""
    container_id: str = msgspec.field(default="", name="containerID")
    """The runtime's id of the container, as `<runtime>://<id>` ("" until it is made)."""
    allocated_resources: dict[str, Quantity] = {}
    resources: ResourceRequirements | None = None


class PodStatus(Message, kw_only=True, frozen=True):
    phase: str = ""
    conditions: list[PodCondition] = []
    container_statuses: list[ContainerStatus] = []
    init_container_statuses: list[ContainerStatus] = []
    resource_claim_statuses: list[PodResourceClaimStatus] = []


class Pod(Message, kw_only=True, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=PodSpec)
    status: PodStatus = msgspec.field(default_factory=PodStatus)


# ----------------------------------------------------------------- nodes


class NodeCondition(Message, kw_only=True, frozen=True):
    type: str = ""
    status: str = ""


class NodeSpec(Message, kw_only=True, frozen=True):
    unschedulable: bool = False
    taints: list[Taint] = []


class NodeStatus(Message, kw_only=True, frozen=True):
    allocatable: dict[str, Quantity] = {}
    conditions: list[NodeCondition] = []


class Node(Message, kw_only=True, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: NodeSpec = msgspec.field(default_factory=NodeSpec)
    status: NodeStatus = msgspec.field(default_factory=NodeStatus)


class Namespace(Message, kw_only=True, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)


# ----------------------------------------------------------------- label selectors


class SelectorRequirement(Message, kw_only=True, frozen=True):
    """One requirement of a label selector (metav1.LabelSelectorRequirement)."""

    key: Annotated[str, Meta(min_length=1, max_length=317)]
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = []


class LabelSelector(Message, kw_only=True, frozen=True):
    """A label selector (metav1.LabelSelector): every `matchLabels` pair and every requirement must
    hold; an empty selector selects everything."""

    match_labels: dict[str, str] = {}
    match_expressions: list[SelectorRequirement] = []


def selector_problem(selector: LabelSelector) -> str | None:
    """Why the API would refuse this selector (In/NotIn need values, Exists/DoesNotExist take
    none); None if it is well formed."""
    for number, requirement in enumerate(selector.match_expressions):
        wants_values = requirement.operator in ("In", "NotIn")
        if wants_values and not requirement.values:
            return f"matchExpressions[{number}] ({requirement.key} {requirement.operator}) needs values"
        if not wants_values and requirement.values:
            return f"matchExpressions[{number}] ({requirement.key} {requirement.operator}) takes no values"
    return None


def selects(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Whether `labels` satisfy the selector (as Kubernetes reads one; malformed requirements, see
    `selector_problem`, select nothing)."""
    if selector_problem(selector) is not None:
        return False
    if any(labels.get(k) != v for k, v in selector.match_labels.items()):
        return False
    for requirement in selector.match_expressions:
        present = requirement.key in labels
        if requirement.operator == "Exists" and not present:
            return False
        if requirement.operator == "DoesNotExist" and present:
            return False
        if requirement.operator == "In" and (not present or labels[requirement.key] not in requirement.values):
            return False
        if requirement.operator == "NotIn" and present and labels[requirement.key] in requirement.values:
            return False
    return True


# ----------------------------------------------------------------- sharegpu's Device resource


class GpuSpec(Message, kw_only=True, frozen=True):
    index: int
    uuid: str
    model: str
    memory_mib: int = msgspec.field(name="memoryMiB")
    healthy: bool = True
    numa_node: int = 0
    pcie_switch: int | None = None
    minor: int | None = None
    mig: bool = False
    reason: str = ""
    """Why the GPU is unhealthy (an XID, an NVML error, gone while pods hold it)."""
    architecture: str = ""
    compute_capability: str = ""
    """CUDA compute capability, "major.minor"."""
    driver_version: str = ""
    cuda_driver_version: str = ""
    pci_bus_id: str = msgspec.field(default="", name="pciBusID")
    pcie_root: str = ""
    """What the DRA slice publishes for selectors (`api.dra.device`); empty where NVML cannot say."""


class MpsDaemon(Message, kw_only=True, frozen=True):
    """The state of one GPU's MPS control daemon, as the agent's supervisor reports it."""

    uuid: str
    running: bool = False
    restarts: int = 0
    problem: str = ""
    proven: bool = False
    """A probe client of this daemon was held to a memory limit (the node offers mps only while every
    healthy GPU's daemon is running and proven)."""


class ModeEnforcement(Message, kw_only=True, frozen=True):
    """What one isolation mode enforces on the node, as its agent found it (docs/isolation.md)."""

    mode: str
    """A `core.devices.Isolation` value."""
    offered: bool = False
    memory: bool = False
    """A pod's GPU memory limit holds: proven on this node by a probe (mig: by the hardware)."""
    compute: bool = False
    """A pod's compute share holds (mps: the thread percentage; mig: the hardware; hami-core: only
    where the operator measured that its library enforces it, `--hami-core-enforces-compute`)."""
    subject: str = ""
    """What was proven: the library's digest, the daemons' pids."""
    proven_at: str = ""
    """When the proof was made (RFC 3339)."""
    reason: str = ""
    """Why the mode is not offered, or what of it was not proven."""


class DeviceSpec(Message, kw_only=True, frozen=True):
    gpus: list[GpuSpec] = []
    nvlinks: list[tuple[int, int]] = []
    isolation: list[str] = []
    """The isolation modes the node offers (`core.devices.Isolation` values)."""
    mps: list[MpsDaemon] = []
    """Per GPU its MPS control daemon, on nodes that run them."""
    enforcement: list[ModeEnforcement] = []
    """Per isolation mode the node could offer: whether it does, and what it was seen to enforce."""
    dra: bool = False
    """The node publishes its GPUs for DRA claims (its agent runs with `--dra`). Until sharegpu
    allocates those claims itself, kube-scheduler's allocator does, knowing nothing of sharing pods:
    so the extender places no pod on such a node (one path per node)."""


class Device(Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: DeviceSpec = msgspec.field(default_factory=DeviceSpec)


# ----------------------------------------------------------------- ConfigMaps and Leases


class ConfigMap(Message, kw_only=True, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    data: dict[str, str] = {}


class LeaseSpec(Message, kw_only=True, frozen=True):
    holder_identity: str | None = None
    lease_duration_seconds: int | None = None
    acquire_time: str | None = None
    renew_time: str | None = None
    lease_transitions: int | None = None


class Lease(Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: LeaseSpec = msgspec.field(default_factory=LeaseSpec)


class PriorityClass(Message, kw_only=True, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    value: int = 0
    preemption_policy: str = ""


# ----------------------------------------------------------------- disruption budgets


class PodDisruptionBudgetSpec(Message, kw_only=True, frozen=True):
    selector: LabelSelector | None = None
    min_available: int | str | None = None
    max_unavailable: int | str | None = None


class PodDisruptionBudgetStatus(Message, kw_only=True, frozen=True):
    disruptions_allowed: int = 0
    """Computed by kube-controller-manager's disruption controller; the Eviction API refuses (429)
    an eviction it would take below zero."""
    observed_generation: int = 0


class PodDisruptionBudget(Message, kw_only=True, frozen=True):
    """policy/v1."""

    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodDisruptionBudgetSpec = msgspec.field(default_factory=PodDisruptionBudgetSpec)
    status: PodDisruptionBudgetStatus = msgspec.field(default_factory=PodDisruptionBudgetStatus)


def budget_selects(budget: PodDisruptionBudget, labels: Mapping[str, str]) -> bool:
    """Whether the budget covers a pod of its namespace with `labels`, as policy/v1 reads its selector:
    the full label selector; none at all selects no pod, an empty one every pod."""
    selector = budget.spec.selector
    return selector is not None and selects(selector, labels)


# ----------------------------------------------------------------- helpers

_DECODERS: dict[Any, msgspec.json.Decoder[Any]] = {}


def decoder(kind: type[T]) -> msgspec.json.Decoder[T]:
    """One cached JSON decoder per message type."""
    found = _DECODERS.get(kind)
    if found is None:
        found = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return found


def decode(data: bytes | msgspec.Raw, kind: type[T]) -> T:
    """Bytes to a typed message; InvalidInputError with the path to the field that is wrong."""
    try:
        return decoder(kind).decode(data)
    except msgspec.ValidationError as exc:
        raise errors.InvalidInputError(f"malformed {kind.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise errors.InvalidInputError(f"malformed JSON for {kind.__name__}: {exc}") from None


def convert(value: object, kind: type[T]) -> T:
    """Already-parsed JSON (dicts and lists) to a typed message, with the same errors as `decode`."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise errors.InvalidInputError(f"malformed {kind.__name__}: {exc}") from None


def encode(message: msgspec.Struct) -> dict[str, Any]:
    """A message as plain JSON values (for a request body)."""
    body: dict[str, Any] = msgspec.to_builtins(message)
    return body


def seconds(stamp: str) -> int:
    """An API timestamp (RFC 3339, as `creationTimestamp` or a condition's `lastTransitionTime`) in
    whole seconds since the epoch; InvalidInputError naming the text if it is not one."""
    try:
        at = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        raise errors.InvalidInputError(f"not an RFC 3339 timestamp: {stamp!r}") from None
    if at.tzinfo is None:
        raise errors.InvalidInputError(f"an RFC 3339 timestamp has a time zone: {stamp!r}")
    return int(at.timestamp())


def timestamp(seconds_: float) -> str:
    """Seconds since the epoch as the API writes timestamps (UTC, whole seconds)."""
    return datetime.datetime.fromtimestamp(int(seconds_), datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def key(meta: ObjectMeta) -> str:
    """`namespace/name` for namespaced objects, `name` for cluster-scoped ones."""
    return f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name
