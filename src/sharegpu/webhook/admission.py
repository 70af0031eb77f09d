"""Admission decisions for Pods and Devices: mutate (translate, schedule with sharegpu, add the
hand-off) and validate (a well-formed canonical request that some GPU can hold; nothing only the
system may set).

Pure: a review in, an `api.admission.ReviewResponse` out. The reviewed pod is read through
`api.wire.Pod` (a mistyped field is refused with its path) and written as a JSON patch against the
dict the API server sent. `Policy` carries what the decisions depend on (who the system is, which
namespaces are left alone, what GPUs the inventory has).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonpatch
import msgspec

from sharegpu.api import admission as api_admission
from sharegpu.api import budgets as api_budgets
from sharegpu.api import devices as api_devices
from sharegpu.api import dra, handoff, names, podgroups, pods, quantity, wire
from sharegpu.api import gangs as api_gangs
from sharegpu.api import groups as api_groups
from sharegpu.api import quotas as api_quotas
from sharegpu.core import devices, errors, requests
from sharegpu.webhook import translate

Json = dict[str, Any]
Answer = api_admission.ReviewResponse


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    system_users: frozenset[str] = frozenset({f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:sharegpu-extender"})
    skip_namespaces: frozenset[str] = frozenset({"kube-system", names.SYSTEM_NAMESPACE, names.HOLDING_NAMESPACE})
    agent_users: frozenset[str] = frozenset({f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:sharegpu-agent"})
    """Node agents: each may write only its own node's Device (the node its token's pod runs on)."""
    largest_gpu_memory_mib: int | None = None
    """The largest GPU memory in the cluster's inventory; None until the inventory is known."""
    largest_gpu_model: str = ""
    models: frozenset[str] = frozenset()
    take_over: frozenset[str] = frozenset(names.REPLACED_SCHEDULERS)
    """GPU pods addressed to these schedulers (or to none) are scheduled by sharegpu instead."""
    budgets: Mapping[str, tuple[api_budgets.GPUBudget, ...]] = dataclasses.field(default_factory=dict)
    """Per namespace, its GPUBudgets as the controller last wrote them."""
    cluster_budgets: tuple[api_budgets.ClusterGPUBudget, ...] = ()
    namespace_labels: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    """Each namespace's labels (what cluster budgets select by); kept only while there are some."""

    def budgets_of(self, namespace: str) -> list[api_budgets.AnyBudget]:
        """The budgets that govern the namespace: its own, and the cluster budgets that select it."""
        labels = self.namespace_labels.get(namespace, {})
        return api_budgets.governing(namespace, labels, self.budgets.get(namespace, ()), self.cluster_budgets)

    default_path: str = names.PATH_EXTENDER
    """The path (`names.PATHS`) of a GPU pod whose own annotation and namespace label say none."""
    namespace_paths: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The namespaces labelled `names.PATH`, and their value."""
    priority_classes: Mapping[str, PriorityClass] = dataclasses.field(default_factory=dict)
    groups: Mapping[str, api_groups.SharedDeviceGroup] = dataclasses.field(default_factory=dict)
    """SharedDeviceGroups by namespace/name, as the webhook last saw them."""


@dataclasses.dataclass(frozen=True, slots=True)
class PriorityClass:
    """What a pod moved to a PriorityClass must carry (the Priority admission plugin ran before us)."""

    value: int
    preemption_policy: str = "PreemptLowerPriority"


def _object(request: api_admission.Request, old: bool = False) -> Json:
    obj = request.old_object if old else request.object
    if obj is None:
        raise errors.InvalidRequestError(f"the review carries no {'oldObject' if old else 'object'}")
    return obj


def _typed(obj: Json, request: api_admission.Request) -> wire.Pod:
    """The pod as typed, named as the API server will store it: at creation its namespace comes from
    the request's URL and is often absent from the object (kubectl run), and a pod made from
    `generateName` has no name yet. Messages then name `namespace/name` (or `namespace/prefix*`)."""
    pod = wire.convert(obj, wire.Pod)
    meta = pod.metadata
    name = meta.name or request.name or (f"{meta.generate_name}*" if meta.generate_name else "")
    if meta.namespace and name == meta.name:
        return pod
    named = msgspec.structs.replace(meta, namespace=meta.namespace or request.namespace, name=name)
    return msgspec.structs.replace(pod, metadata=named)


def _is_system(request: api_admission.Request, policy: Policy) -> bool:
    return request.user_info.username in policy.system_users


def _paired(obj: Json, parsed: requests.PodRequest) -> list[tuple[Json, requests.ContainerRequest]]:
    """The manifest's container dicts next to their parsed requests (both init containers first)."""
    spec = obj.get("spec") or {}
    manifests = list(spec.get("initContainers") or []) + list(spec.get("containers") or [])
    return list(zip(manifests, parsed.containers, strict=True))


def _add_handoff(obj: Json, parsed: requests.PodRequest, audit: list[str]) -> None:
    """Give a sharing pod its hand-off ConfigMap (a fresh name: no pod name or UID exists yet) and the
    env references its GPU containers read; a pod that demands isolation hami-core also preloads the
    node's library (`api.handoff.preload_wiring`), one that demands mps is wired to its GPU's MPS
    daemon (`api.handoff.mps_wiring`). Both folders are volumes of the agent's CSI driver, which binds
    them from the node (no hostPath), and only pods that ask get them."""
    name = handoff.new_name()
    obj["metadata"].setdefault("annotations", {})[names.HANDOFF] = name
    mps = parsed.demand.isolation is devices.Isolation.MPS
    preload = parsed.demand.isolation is devices.Isolation.HAMI_CORE
    for position, (container, request) in enumerate(_paired(obj, parsed)):
        gpu = request.gpu
        if gpu is None or gpu.whole:
            continue
        env = container.setdefault("env", [])
        for variable in handoff.variables(gpu.count, bool(gpu.memory_mib or gpu.memory_permille), preload=preload):
            env.append(handoff.reference(name, request.name, variable))
        if preload:
            author = handoff.preload_wiring(container)
            if author is not None:
                audit.append(f"container {request.name}: {handoff.LD_PRELOAD} {author} preloaded after HAMi-core's")
        if mps:
            volume = f"{handoff.MPS_VOLUME}-{position}"
            handoff.mps_wiring(container, volume)
            handoff.with_volume(obj["spec"], handoff.mps_volume(volume, request.name))
    if preload:
        handoff.with_volume(obj["spec"], handoff.hami_volume())


def quota_totals(request: requests.ContainerRequest, *, dra: bool = False) -> dict[str, str]:
    """The accounting resources of one container (`api.names.QUOTA_RESOURCES`, or with `dra` the DRA
    path's `DRA_QUOTA_RESOURCES`, computed by `api.quotas.container_totals`, which the extender's quota
    check uses too)."""
    if request.gpu is None:
        return {}
    milli_name, memory_name = names.DRA_QUOTA_RESOURCES if dra else names.QUOTA_RESOURCES
    milli, memory = api_quotas.container_totals(request.gpu)
    totals = {milli_name: str(milli)}
    if memory is not None:
        totals[memory_name] = str(memory)
    return totals


def _write_totals(obj: Json, parsed: requests.PodRequest, *, dra: bool = False) -> None:
    """Replace whatever accounting resources the containers carry with the ones they ask for."""
    for container, request in _paired(obj, parsed):
        resources = container.setdefault("resources", {})
        totals = quota_totals(request, dra=dra)
        for part in ("limits", "requests"):
            table = resources.get(part)
            if table is None:
                if not totals:
                    continue
                table = resources[part] = {}
            for key in (*names.QUOTA_RESOURCES, *names.DRA_QUOTA_RESOURCES):
                table.pop(key, None)
            table.update(totals)


def _hide_gpus(obj: Json, parsed: requests.PodRequest, audit: list[str]) -> None:
    """Every container sharegpu gives no GPU (init containers too) sees none: NVIDIA_VISIBLE_DEVICES=void,
    whatever its image or author set (an author's other value is replaced and said in the audit). A
    container that uses DRA claims gets it too: the CDI spec of a claim's driver sets the variable
    for the devices it gives (the runtime applies CDI edits over the container's own), and a claim
    that gives no GPU (another driver's, or one with no request) must not leave the image's `all`
    standing. A static pod's mirror is left alone: the kubelet runs the node's manifest, not this
    object."""
    if MIRROR in (obj.get("metadata") or {}).get("annotations", {}):
        return
    for container, request in _paired(obj, parsed):
        if request.gpu is not None:
            continue  # sharing: the hand-off; whole GPUs: the device plugin's value must win
        asked = {
            **((container.get("resources") or {}).get("requests") or {}),
            **((container.get("resources") or {}).get("limits") or {}),
        }
        if any(str(name).startswith(names.NVIDIA_MIG_PREFIX) and _positive(value) for name, value in asked.items()):
            continue  # MIG devices from the device plugin (mig-strategy mixed): its value must win (none for 0)
        before = [e.get("value") for e in container.get("env") or [] if e.get("name") == handoff.VISIBLE_DEVICES]
        if handoff.no_gpu(container) and before and before != [handoff.NO_GPU]:
            shown = ", ".join(str(v) if v is not None else "(from a reference)" for v in before)
            audit.append(
                f"container {request.name}: {handoff.VISIBLE_DEVICES} {shown} -> {handoff.NO_GPU} (it is given no GPU)"
            )


def _positive(value: object) -> bool:
    """A resource amount above 0 (the kubelet asks a device plugin for nothing for 0; a malformed
    amount, which the API server refuses anyway, gives nothing either)."""
    try:
        return quantity.parse(value) > 0
    except errors.InvalidInputError:
        return False


EPHEMERAL = "ephemeralcontainers"
"""The subresource `kubectl debug` adds a container to a running pod through."""


def _hide_from_debuggers(request: api_admission.Request) -> Answer:
    """A container added to a running pod (`kubectl debug`) sees no GPU: it asks for none, and its
    image may say `all` (a debug image built on CUDA). The containers it had are not touched (the API
    server refuses to change them)."""
    original = _object(request)
    before = {c.get("name") for c in ((_object(request, old=True).get("spec") or {}).get("ephemeralContainers") or [])}
    out = copy.deepcopy(original)
    audit = []
    for container in (out.get("spec") or {}).get("ephemeralContainers") or []:
        if container.get("name") not in before and handoff.no_gpu(container):
            audit.append(f"ephemeral container {container.get('name')}: {handoff.VISIBLE_DEVICES} -> {handoff.NO_GPU}")
    patch = _patch(original, out)
    return api_admission.allow(
        request.uid, patch=patch or None, audit={"translated": "; ".join(audit)} if audit else None
    )


def _handoff_wired(pod: wire.Pod, parsed: requests.PodRequest) -> bool:
    """Every GPU container already reads NVIDIA_VISIBLE_DEVICES from the pod's annotated hand-off."""
    own = pod.metadata.annotations.get(names.HANDOFF)
    gpu_containers = [c for (_, c), r in zip(pods.containers(pod), parsed.containers, strict=True) if r.gpu]
    if not own or not gpu_containers:
        return False
    return all(
        any(e.name == handoff.VISIBLE_DEVICES and handoff.is_reference(e, own, c.name) for e in c.env)
        for c in gpu_containers
    )


MIRROR: str = "kubernetes.io/config.mirror"
"""The annotation of a static pod's mirror (the kubelet runs it; the API object only reflects it)."""


def _take_over(spec: Json, annotations: Json, policy: Policy) -> list[str]:
    """Schedule a GPU pod with sharegpu: when it names no scheduler or one that sharegpu replaces, and
    when its author bound it to a node (`spec.nodeName` skips every scheduler, so the pod would get
    no GPU share and no hand-off): that node becomes a required node affinity. Returns the audit."""
    audit = []
    named = spec.get("schedulerName") or ""
    if named != names.SCHEDULER_NAME and (not named or named in policy.take_over):
        spec["schedulerName"] = names.SCHEDULER_NAME
        if named and named != "default-scheduler":
            audit.append(f"pod: schedulerName {named} -> {names.SCHEDULER_NAME}")
    node = None if MIRROR in annotations else spec.pop("nodeName", None)
    if node:
        affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
        required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
        terms = required.get("nodeSelectorTerms") or [{}]
        pin = {"key": "metadata.name", "operator": "In", "values": [node]}
        for term in terms:  # terms are alternatives: the node must hold in each
            term.setdefault("matchFields", []).append(pin)
        required["nodeSelectorTerms"] = terms
        audit.append(f"pod: spec.nodeName {node} -> required node affinity (sharegpu places GPU pods)")
    return audit


def _join(
    obj: Json,
    joined: tuple[str, str],
    namespace: str,
    parsed: requests.PodRequest,
    policy: Policy,
    audit: list[str],
) -> str | None:
    """Make the pod a member of its SharedDeviceGroup: labelled with the group, selecting the group's
    node label (it runs only where the group is bound, and waits until it is), and every container
    reading NVIDIA_VISIBLE_DEVICES (and a share group's limits) from the group's hand-off ConfigMap.
    Returns why not, if not."""
    group_namespace, group_name = joined
    if parsed.demand.count:
        return (
            f"the pod joins SharedDeviceGroup {group_namespace}/{group_name} and asks for GPUs of its own; a "
            "member uses the group's GPUs: remove its GPU resources"
        )
    group = policy.groups.get(f"{group_namespace}/{group_name}")
    if group is not None and not api_groups.may_join(group, namespace):
        return (
            f"namespace {namespace} may not join SharedDeviceGroup {group_namespace}/{group_name} (the group "
            "admits its own namespace and those in spec.members.namespaces)"
        )
    metadata = obj.setdefault("metadata", {})
    metadata.setdefault("labels", {}).update(api_groups.group_labels(group_namespace, group_name))
    spec = obj.setdefault("spec", {})
    spec.setdefault("nodeSelector", {})[api_groups.node_label(group_namespace, group_name)] = api_groups.BOUND
    for container in list(spec.get("initContainers") or []) + list(spec.get("containers") or []):
        api_groups.member_env(container, group_namespace, group_name)
    state = "" if group is not None else " (not found yet: the pod waits until it exists and binds)"
    audit.append(f"pod: member of SharedDeviceGroup {group_namespace}/{group_name}{state}")
    return None


def leaving_namespaces(request: api_admission.Request) -> list[str]:
    """The namespaces an update of a sharegpu.io group takes out of `spec.members.namespaces` (its own
    namespace never leaves); none for anything else."""
    if request.operation != "UPDATE" or _group_api(request.object) != names.DOMAIN:
        return []
    before, after = (_admitted(o) for o in (request.old_object, request.object))
    return sorted(before - after - {request.namespace})


def is_sharegpu_group(request: api_admission.Request) -> bool:
    """The review is of sharegpu's own group kind (not the shared-device-group project's)."""
    return _group_api(request.old_object or request.object) == names.DOMAIN


def _group_api(obj: Json | None) -> str:
    return str((obj or {}).get("apiVersion") or "").split("/")[0]


def _admitted(obj: Json | None) -> set[str]:
    members = (((obj or {}).get("spec") or {}).get("members")) or {}
    return {str(n) for n in members.get("namespaces") or ()}


def _placement_changes(request: api_admission.Request) -> tuple[str, list[str]]:
    """(the node the group was bound to, the placement fields the update changes); the first is ""
    for a group not bound. Either system's kind: the shared-device-group project's spec is all
    placement."""
    old, new = request.old_object or {}, request.object or {}
    if _group_api(new) == names.DOMAIN:
        before = wire.convert(old, api_groups.SharedDeviceGroup)
        after = wire.convert(new, api_groups.SharedDeviceGroup)
        return before.status.node_name, api_groups.changed_placement(before.spec, after.spec)
    node = str((old.get("status") or {}).get("nodeName") or "")
    before_spec, after_spec = old.get("spec") or {}, new.get("spec") or {}
    return node, sorted(k for k in before_spec.keys() | after_spec.keys() if before_spec.get(k) != after_spec.get(k))


def validate_group(body: Any, members: list[str]) -> Answer:
    """A SharedDeviceGroup's deletion or update (either system's kind). Deletion: refused while live
    pods are its members (`members`: all of them). Update: refused when it changes a bound group's
    placement (`api.groups.PLACEMENT_FIELDS`: the holder and members use it), or takes a namespace out
    of spec.members.namespaces while pods there are members (`members`: those, `leaving_namespaces`)."""
    uid = ""
    try:
        request = api_admission.review(body).request
        uid = request.uid
        refusal = _group_refusal(request, members)
    except errors.SharegpuError as exc:
        refusal = (str(exc), 400)
    if refusal is None:
        return api_admission.allow(uid)
    message, code = refusal
    return api_admission.deny(uid, f"sharegpu: {message}", code=code)


def _group_refusal(request: api_admission.Request, members: list[str]) -> tuple[str, int] | None:
    """Why `validate_group` refuses, with the HTTP code; None to allow."""
    group = f"SharedDeviceGroup {request.namespace}/{request.name}"
    shown = _shown_members(request.namespace, members)
    if request.operation == "DELETE" and members:
        return f"{group} still has {len(members)} member pod(s): {shown}; delete them first", 409
    if request.operation != "UPDATE":
        return None
    node, changed = _placement_changes(request)
    if node and changed:
        return (
            f"{group} is bound to node {node}; spec {', '.join(changed)} cannot change while it is bound (its "
            "holder pod and members run with them): delete the group and create it anew",
            422,
        )
    if members:
        return (
            f"{group}: namespace(s) {', '.join(leaving_namespaces(request))} cannot leave spec.members.namespaces "
            f"while pods there are its members: {shown}; delete them first",
            409,
        )
    return None


def _shown_members(home: str, members: list[str]) -> str:
    """Members in words for the group's owner: by name in the group's own namespace, counted in the
    others (another namespace's pod names are not the owner's to read)."""
    own = [m for m in members if m.split("/", 1)[0] == home]
    elsewhere = collections.Counter(ns for m in members if (ns := m.split("/", 1)[0]) != home)
    parts = [", ".join(own[:20]) + (f" and {len(own) - 20} more" if len(own) > 20 else "")] if own else []
    parts += [f"{count} in namespace {namespace}" for namespace, count in sorted(elsewhere.items())]
    return ", ".join(parts)


def _apply_budgets(namespace: str, spec: Json, annotations: Json, policy: Policy, audit: list[str]) -> str | None:
    """The exhausted budgets governing the namespace: a Deny budget refuses the pod (returns why); a Demote
    budget moves it to its demotion PriorityClass, unless it is already at or below it."""
    exhausted = [b for b in policy.budgets_of(namespace) if b.status.state == api_budgets.EXHAUSTED]
    for item in exhausted:
        if item.spec.when_exhausted == "Deny":
            return (
                f"{api_budgets.summary(item)}: the budget is used up and refuses new GPU pods until "
                f"{item.status.period_end} (raise spec.gpuHours, or ask for no GPU)"
            )
    for item in exhausted:
        if item.spec.when_exhausted != "Demote":
            continue
        name = item.spec.demote_priority_class
        demoted = policy.priority_classes.get(name)
        if demoted is None:
            return (
                f"{api_budgets.summary(item)}: the budget is used up and demotes new GPU pods to PriorityClass "
                f"{name}, which does not exist (create it: deploy/helm/sharegpu/files/priority/)"
            )
        current = spec.get("priority")
        if isinstance(current, int) and current <= demoted.value:
            return None
        spec["priorityClassName"] = name
        spec["priority"] = demoted.value
        spec["preemptionPolicy"] = demoted.preemption_policy
        annotations[names.DEMOTED] = api_budgets.summary(item)
        audit.append(f"pod: demoted to PriorityClass {name} ({api_budgets.summary(item)})")
        return None
    return None


def path_of(namespace: str, annotations: Mapping[str, str], policy: Policy) -> str:
    """The path a GPU pod goes: its own `names.PATH` annotation, else its namespace's label, else the
    webhook's default. InvalidRequestError for a value that is no path."""
    chosen = annotations.get(names.PATH) or policy.namespace_paths.get(namespace) or policy.default_path
    if chosen not in names.PATHS:
        raise errors.InvalidRequestError(f"{names.PATH} must be one of {', '.join(names.PATHS)}, got {chosen!r}")
    return chosen


def _to_claims(obj: Json, parsed: requests.PodRequest, audit: list[str]) -> None:
    """Turn a pod's GPU request (any format, translated) into a DRA claim: its GPU container asks for
    none of sharegpu's resources any more, and uses, as `dra.POD_CLAIM`, a claim of its own by name
    (`Shape.claim_name`: its shape and a random part), which sharegpu's allocator makes for it
    (`dra.pod_claim`, owned by the pod); the pod waits behind `names.DRA_GATE` until the claim is
    allocated. A claim by name, not a template: kube-controller-manager then neither makes it nor
    writes the pod's status for it, and the claim is born with its finalizer (two API writes fewer per
    pod). InvalidRequestError for what a claim of sharegpu's class cannot carry yet, naming it."""
    other_path = f"ask on the extender path ({names.PATH}: {names.PATH_EXTENDER})"
    if not parsed.cotenancy.empty:
        raise errors.InvalidRequestError(f"co-tenancy rules are not available on the DRA path; {other_path}")
    if parsed.isolation is not None or parsed.compute:
        raise errors.InvalidRequestError(f"isolation demands are not available on the DRA path yet; {other_path}")
    wanting = [(c, r) for c, r in _paired(obj, parsed) if r.gpu is not None]
    if len(wanting) != 1 or wanting[0][1].init:
        found = ", ".join(r.name + (" (init)" if r.init else "") for _, r in wanting)
        raise errors.InvalidRequestError(
            f"the DRA path gives GPUs to one app container, and GPU containers here are: {found}; {other_path}"
        )
    container, request = wanting[0]
    gpu = request.gpu
    assert gpu is not None
    if gpu.whole:
        shape = dra.Shape(gpu.count, gpu.milli, models=gpu.models)
    else:
        shape = dra.Shape(gpu.count, gpu.milli, gpu.memory_mib, gpu.memory_permille, gpu.models)
    shape.check()
    spec = obj.setdefault("spec", {})
    entries = spec.setdefault("resourceClaims", [])
    kept = [e.get("resourceClaimName") for e in entries if e.get("name") == dra.POD_CLAIM]
    # Reinvoked: the claim named the first time stays (its name is random).
    named = kept[0] if kept and isinstance(kept[0], str) and dra.claim_shape(kept[0]) == shape else None
    claim = named or shape.claim_name(secrets.token_bytes(dra.POD_CLAIM_TOKEN_BYTES))
    if gpu.limit != gpu.milli:
        audit.append(f"container {request.name}: burst limit {gpu.limit} milli-GPU not carried by a claim")
    resources = container.setdefault("resources", {})
    for part in ("limits", "requests"):
        held = resources.get(part) or {}
        for resource in (*names.GPU_RESOURCES, *names.QUOTA_RESOURCES):
            held.pop(resource, None)
        if not held:
            resources.pop(part, None)
    used = resources.setdefault("claims", [])
    if not any(c.get("name") == dra.POD_CLAIM for c in used):
        used.append({"name": dra.POD_CLAIM})
    handoff.no_gpu(container)  # the claim's CDI spec, applied over the container's own env, names its GPU
    entries[:] = [e for e in entries if e.get("name") != dra.POD_CLAIM]  # reinvoked: the same, once
    entries.append({"name": dra.POD_CLAIM, "resourceClaimName": claim})
    gates = spec.setdefault("schedulingGates", [])
    if not any(g.get("name") == names.DRA_GATE for g in gates):
        gates.append({"name": names.DRA_GATE})
    audit.append(f"container {request.name}: GPU request -> DRA claim {claim} (made for the pod by sharegpu)")


def _patch(before: Json, after: Json) -> list[Json]:
    ops: list[Json] = jsonpatch.make_patch(before, after).patch
    return ops


def _gate_for_claims(obj: Json, seen: Mapping[str, bool | None] | None, audit: list[str]) -> bool:
    """Hold a pod whose ResourceClaims may be of sharegpu's class behind `names.DRA_GATE`, as when the
    webhook turned its request into a claim: a pod written as Kubernetes documents DRA (no gate) would
    otherwise reach kube-scheduler, which cannot allocate sharegpu's class, and whose PostFilter would
    race sharegpu's allocator. `seen`: per `spec.resourceClaims` entry, whether its claim (or template)
    asks for sharegpu's class; an entry not known (not made yet, not readable, no `seen` at all) counts
    as sharegpu's. The allocator lets a gated pod go at once when, its claims made, none is of the class.
    Returns whether the pod may use sharegpu's claims (then sharegpu's scheduler takes it, as a GPU pod)."""
    spec = obj.get("spec") or {}
    maybe = [
        str(e.get("name", "")) for e in spec.get("resourceClaims") or [] if (seen or {}).get(e.get("name")) is not False
    ]
    gates = spec.get("schedulingGates") or []
    if not maybe:
        return False
    if not any(g.get("name") == names.DRA_GATE for g in gates):
        spec["schedulingGates"] = [*gates, {"name": names.DRA_GATE}]
        audit.append(f"resource claims {', '.join(maybe)} of sharegpu's class (or not made yet): "
                     f"gated ({names.DRA_GATE}) until sharegpu allocates them")  # fmt: skip
    return True


def _translate_gang(obj: Json, audit: list[str]) -> None:
    """A group another format states on the pod, as sharegpu's gang annotations (`api.gangs.translate`)."""
    metadata = obj.setdefault("metadata", {})
    found = api_gangs.translate(metadata.get("labels") or {}, metadata.get("annotations") or {})
    if found:
        metadata.setdefault("annotations", {}).update(found)
        audit.append(f"pod group {found[names.GANG]} -> {names.GANG} (minimum {found[names.GANG_MIN]})")


@dataclass(frozen=True, slots=True)
class GroupRead:
    """The group a new pod names, as the server read it: the object, None when it does not exist, or
    why it could not be read."""

    ref: podgroups.GroupRef
    found: Json | None
    problem: str | None = None


def _group_gang(obj: Json, namespace: str, group: GroupRead | None, audit: list[str]) -> list[str]:
    """Writes the gang annotations of the group the pod names (`api.podgroups`); returns the Warnings
    for the group's fields that are not honoured. InvalidRequestError when the group is missing or
    could not be read."""
    metadata = obj.setdefault("metadata", {})
    ref = podgroups.reference(
        namespace, obj.get("spec") or {}, metadata.get("labels") or {}, metadata.get("annotations") or {}
    )
    if ref is None:
        return []
    if group is None or group.ref != ref:
        raise errors.InvalidRequestError(f"{ref} could not be read: the pod's gang cannot be judged")
    if group.problem is not None:
        raise errors.InvalidRequestError(f"{ref} could not be read: {group.problem}")
    if group.found is None:
        raise podgroups.missing(ref)
    found, warnings = podgroups.gang_annotations(ref, group.found)
    if found:
        metadata.setdefault("annotations", {}).update(found)
        audit.append(f"{ref} -> {names.GANG} (minimum {found[names.GANG_MIN]})")
    return warnings


def mutate(
    body: Any, policy: Policy, seen: Mapping[str, bool | None] | None = None, group: GroupRead | None = None
) -> Answer:
    """The mutating decision for a Pod review (`seen`: what `_gate_for_claims` knows of its
    ResourceClaims, read from the API by the server; `group`: the pod group it names, read likewise)."""
    uid = ""
    try:
        request = api_admission.review(body).request
        uid = request.uid
        if request.namespace in policy.skip_namespaces:
            return api_admission.allow(uid)
        if request.operation == "UPDATE" and request.sub_resource == EPHEMERAL:
            return _hide_from_debuggers(request)
        if request.operation != "CREATE":
            return api_admission.allow(uid)
        original = _object(request)
        out, audit = translate.translate(original, policy.models)
        _translate_gang(out, audit)
        warnings = _group_gang(out, request.namespace, group, audit)
        pod = _typed(out, request)
        parsed = pods.request(pod)
        joined = api_groups.membership(pod.metadata.annotations, request.namespace)
        named = (out.get("metadata") or {}).get("annotations") or {}
        if names.HANDOFF in named and not _is_system(request, policy):
            sharing = parsed.demand.sharing and joined is None
            if not sharing or path_of(request.namespace, named, policy) == names.PATH_DRA:
                # only a sharing pod of the extender path has a hand-off, and sharegpu names it: a name the
                # author chose would make its references look like the pod's own (another pod's GPU)
                del named[names.HANDOFF]
                audit.append(f"annotation {names.HANDOFF} removed: this pod has no GPU hand-off")
                pod = _typed(out, request)
        if joined is not None:
            refusal = _join(out, joined, request.namespace, parsed, policy, audit)
            if refusal is not None:
                return api_admission.deny(uid, f"sharegpu: {refusal}", code=400)
            if not _is_system(request, policy):
                audit += _take_over(out.setdefault("spec", {}), out["metadata"].setdefault("annotations", {}), policy)
            annotations = out["metadata"].setdefault("annotations", {})
            annotations[names.TRANSLATED] = "; ".join(audit)
            return api_admission.allow(
                uid, patch=_patch(original, out), audit={"translated": "; ".join(audit)}, warnings=warnings
            )
        _hide_gpus(out, parsed, audit)
        if not _is_system(request, policy) and _gate_for_claims(out, seen, audit):
            metadata = out.setdefault("metadata", {})
            audit += _take_over(out.setdefault("spec", {}), metadata.setdefault("annotations", {}), policy)
        if parsed.demand.count == 0:
            if audit:
                out["metadata"].setdefault("annotations", {})[names.TRANSLATED] = "; ".join(audit)
            patch = _patch(original, out)
            return api_admission.allow(
                uid, patch=patch or None, audit={"translated": "; ".join(audit)} if audit else None, warnings=warnings
            )
        annotations = out.setdefault("metadata", {}).setdefault("annotations", {})
        system = _is_system(request, policy)
        claims = not system and path_of(request.namespace, annotations, policy) == names.PATH_DRA
        if claims:
            _to_claims(out, parsed, audit)
        elif not system and not _handoff_wired(pod, parsed):
            # Users never choose the hand-off ConfigMap: a fresh one is set below for sharing pods. (A pod
            # already wired to its annotation comes from an earlier invocation of this webhook; a forged
            # one gains nothing: the extender fills a ConfigMap for one claimant only.)
            annotations.pop(names.HANDOFF, None)
        spec = out.setdefault("spec", {})
        if not system:
            audit += _take_over(spec, annotations, policy)
            refusal = _apply_budgets(request.namespace, spec, annotations, policy, audit)
            if refusal is not None:
                return api_admission.deny(uid, f"sharegpu: {refusal}", code=403)
        if not claims and parsed.demand.sharing and names.HANDOFF not in annotations:
            _add_handoff(out, parsed, audit)  # (a claim's GPUs come with its CDI spec: no hand-off)
        _write_totals(out, parsed, dra=claims)
        if audit:
            annotations[names.TRANSLATED] = "; ".join(audit)
        return api_admission.allow(
            uid,
            patch=_patch(original, out),
            audit={"translated": "; ".join(audit)} if audit else None,
            warnings=warnings,
        )
    except errors.SharegpuError as exc:
        return api_admission.deny(uid, f"sharegpu: {exc}", code=400)


def validate(body: Any, policy: Policy) -> Answer:
    """The validating decision for a Pod review (runs after every mutation)."""
    uid = ""
    try:
        request = api_admission.review(body).request
        uid = request.uid
        if request.namespace in policy.skip_namespaces or request.operation not in ("CREATE", "UPDATE"):
            return api_admission.allow(uid)
        pod = _typed(_object(request), request)
        if not _is_system(request, policy):
            old = _typed(_object(request, old=True), request) if request.operation == "UPDATE" else None
            problem = guard(pod, old)
            if problem:
                return api_admission.deny(uid, f"sharegpu: {problem}", code=403)
        for _, container in pods.containers(pod):
            for key in container.resources.merged():
                if key in translate.FOREIGN:
                    return api_admission.deny(
                        uid, f"sharegpu: container {container.name}: {key} was not translated", 400
                    )
                if key in names.DRA_QUOTA_RESOURCES and not container.resources.claims:
                    return api_admission.deny(
                        uid, f"sharegpu: container {container.name}: {key} is written by sharegpu on containers "
                        "whose GPUs come from DRA claims only", 400,
                    )  # fmt: skip
        api_gangs.of(request.namespace, pod.metadata.annotations)  # a malformed gang is refused by name
        parsed = pods.request(pod)
        outside = _scheduled_outside(pod, parsed, request, policy)
        if outside is not None:
            return api_admission.deny(uid, f"sharegpu: {outside}", 403)
        if parsed.demand.count:
            for (_, container), container_request in zip(pods.containers(pod), parsed.containers, strict=True):
                given = container.resources.merged()
                carried = {
                    k: str(quantity.integer(given[k], k, 0, 1 << 40)) for k in names.QUOTA_RESOURCES if k in given
                }
                expected = quota_totals(container_request)
                if carried != expected:
                    return api_admission.deny(
                        uid,
                        f"sharegpu: container {container.name}: {', '.join(names.QUOTA_RESOURCES)} are written by "
                        f"sharegpu from the GPU request (expected {expected or 'none'})",
                        400,
                    )
        demand = parsed.demand
        largest = policy.largest_gpu_memory_mib
        if largest is not None and demand.memory_mib > largest:
            return api_admission.deny(
                uid,
                f"sharegpu: the pod asks for {demand.memory_mib} MiB of GPU memory per GPU; the largest GPU in the "
                f"cluster has {largest} MiB ({policy.largest_gpu_model})",
                400,
            )
        if demand.models and policy.models and not demand.models & policy.models:
            return api_admission.deny(
                uid,
                f"sharegpu: no GPU of model {', '.join(sorted(demand.models))} in the cluster "
                f"(models: {', '.join(sorted(policy.models))})",
                400,
            )
        return api_admission.allow(uid)
    except errors.SharegpuError as exc:
        return api_admission.deny(uid, f"sharegpu: {exc}", code=400)


def _scheduled_outside(
    pod: wire.Pod, parsed: requests.PodRequest, request: api_admission.Request, policy: Policy
) -> str | None:
    """Why a new GPU pod would be placed outside sharegpu's books: a scheduler sharegpu does not take
    over (the mutation took over the ones it does, and turned a preset node into affinity). None
    when it is sharegpu's to place (or the system's own, or a static pod's mirror)."""
    if request.operation != "CREATE" or not parsed.demand.count or _is_system(request, policy):
        return None
    if MIRROR in pod.metadata.annotations or pod.spec.scheduler_name == names.SCHEDULER_NAME:
        return None
    return (
        f"GPU pod {pod.metadata.namespace}/{pod.metadata.name} names scheduler {pod.spec.scheduler_name!r}, "
        f"which would place it outside sharegpu's books (no GPU chosen, none counted before it runs): "
        f"leave schedulerName out, or name {names.SCHEDULER_NAME}, or have the webhook take it over "
        "(--take-over, the chart's webhook.takeOver)"
    )


def guard(pod: wire.Pod, old: wire.Pod | None) -> str | None:
    """What a pod of an ordinary user may not do; None when it does none of it."""
    annotations = pod.metadata.annotations
    for key in names.SYSTEM_ONLY_ANNOTATIONS:
        if old is not None:
            if annotations.get(key) != old.metadata.annotations.get(key):
                return f"annotation {key} is set by sharegpu only and cannot be changed"
        elif key in annotations and key != names.HANDOFF:
            return f"annotation {key} is set by sharegpu only"
    before = old.metadata.annotations if old is not None else annotations
    for key in pods.REQUEST_ANNOTATIONS:
        if annotations.get(key) != before.get(key):
            return (
                f"annotation {key} is part of the pod's GPU request and cannot change after creation "
                "(the node and the books read it as placed): delete the pod and create it again"
            )
    own = annotations.get(names.HANDOFF)
    try:
        joined = api_groups.membership(annotations, pod.metadata.namespace)
    except errors.InvalidRequestError as exc:
        return str(exc)
    labels = pod.metadata.labels
    labelled = (labels.get(names.LABEL_GROUP_NAMESPACE), labels.get(names.LABEL_GROUP_NAME))
    if labelled != (None, None) and (joined is None or labelled != tuple(api_groups.group_labels(*joined).values())):
        return f"labels {names.LABEL_GROUP_NAMESPACE} and {names.LABEL_GROUP_NAME} are set by sharegpu only"
    group_source = api_groups.handoff_name(*joined) if joined is not None else None
    for container in [c for _, c in pods.containers(pod)] + list(pod.spec.ephemeral_containers):
        for env in container.env:
            ref = env.value_from.config_map_key_ref if env.value_from is not None else None
            if (
                group_source is not None and env.name in api_groups.MEMBER_VARIABLES and ref is not None
                and ref.name == group_source and ref.key == env.name
            ):  # fmt: skip
                continue
            if (
                handoff.is_protected(env.name) and not handoff.is_reference(env, own, container.name)
                and not handoff.hides_gpus(env)
            ):  # fmt: skip
                return f"container {container.name}: {env.name} is set by sharegpu only{_why(env.name)}"
            if ref is not None and ref.name.startswith(names.HANDOFF_PREFIX) and ref.name != own:
                return f"container {container.name}: ConfigMap {ref.name} is another pod's GPU hand-off"
        hidden = (  # the container sees no GPU: its own `void` stands (no hand-off, no claim's CDI spec over it)
            any(handoff.hides_gpus(env) for env in container.env)
            and not any(handoff.is_reference(env, own, container.name) for env in container.env)
            and not container.resources.claims
        )
        for source in container.env_from:
            loaded = source.config_map_ref
            if loaded is not None and loaded.name.startswith(names.HANDOFF_PREFIX):
                return f"container {container.name}: envFrom may not load a GPU hand-off ConfigMap ({loaded.name})"
            if not hidden and not handoff.safe_prefix(source.prefix):
                named = loaded or source.secret_ref
                what = f"{'ConfigMap' if loaded is not None else 'Secret'} {named.name if named else ''}".strip()
                return (f"container {container.name}: envFrom {what} needs a prefix (such as APP_) in a container "
                        f"that may see a GPU: it could set {handoff.VISIBLE_DEVICES} or another variable only "
                        "sharegpu sets, and the device plugin's value does not win over it")  # fmt: skip
    for volume in pod.spec.volumes:
        targets = [volume.config_map] + [s.config_map for s in (volume.projected.sources if volume.projected else [])]
        for target in targets:
            if target is not None and target.name.startswith(names.HANDOFF_PREFIX):
                return f"volume {volume.name}: may not mount a GPU hand-off ConfigMap ({target.name})"
    return None


def _why(variable: str) -> str:
    """Why a variable outside the hand-off's own is the system's (an NVIDIA_* one)."""
    if variable in handoff.PROTECTED or not variable.startswith(handoff.NVIDIA_PREFIX):
        return ""
    allowed = ", ".join(p + ("*" if p.endswith("_") else "") for p in handoff.TENANT_NVIDIA)
    return (f" ({handoff.NVIDIA_PREFIX}* variables choose the devices and capabilities a container gets; "
            f"a pod may set only {allowed})")  # fmt: skip


@dataclass(frozen=True, slots=True)
class DeviceWriter:
    """Who writes a Device, as far as the request tells: a node agent or not (then RBAC decides);
    for an agent, the node its token names (1.30+), else the pod (namespace, name) its token is
    bound to, whose node the caller looks up; neither for a token that names no pod or node."""

    agent: bool
    node: str = ""
    pod: tuple[str, str] | None = None


def device_writer(request: api_admission.Request, policy: Policy) -> DeviceWriter:
    """Who writes a Device (`DeviceWriter`)."""
    user = request.user_info
    if user.username not in policy.agent_users:
        return DeviceWriter(agent=False)
    node = user.one(api_admission.NODE_NAME)
    if node is not None:
        return DeviceWriter(agent=True, node=node)
    return DeviceWriter(agent=True, pod=user.bound_pod())


def validate_device(body: Any, policy: Policy, writer_node: str | None = None) -> Answer:
    """Device resources (the node agent writes them) must describe a consistent inventory, and a node
    agent may write only its own node's (`writer_node`, from `device_writer`; as the kubelet's
    NodeRestriction limits kubelets to their own Node)."""
    uid = ""
    try:
        request = api_admission.review(body).request
        uid = request.uid
        if request.operation not in ("CREATE", "UPDATE"):
            return api_admission.allow(uid)
        if request.user_info.username in policy.agent_users:
            if not writer_node:
                return api_admission.deny(
                    uid,
                    f"sharegpu: {request.user_info.username} may write only its own node's Device, and its token "
                    "names no pod or node (give the agent a projected service-account token bound to its pod)",
                    code=403,
                )
            if writer_node != request.name:
                return api_admission.deny(
                    uid,
                    f"sharegpu: the node agent on {writer_node} may write only Device {writer_node}, "
                    f"not {request.name}",
                    code=403,
                )
        device = wire.convert(copy.deepcopy(_object(request)), wire.Device)
        api_devices.inventory(device, None)
        return api_admission.allow(uid)
    except errors.SharegpuError as exc:
        return api_admission.deny(uid, f"sharegpu: {exc}", code=400)


def validate_eviction(body: Any, policy: Policy, pod_node: str) -> Answer:
    """A node agent evicts only pods on its own node (the node its token is bound to; `pod_node`: the
    evicted pod's, "" when it is gone or not placed). Anyone else: RBAC decides."""
    uid = ""
    try:
        request = api_admission.review(body).request
        uid = request.uid
        user = request.user_info
        if user.username not in policy.agent_users:
            return api_admission.allow(uid)
        node = user.one(api_admission.NODE_NAME)
        if not node or node != pod_node:
            where = f"the node agent on {node}" if node else "a node agent whose token is bound to no node"
            return api_admission.deny(
                uid,
                f"sharegpu: {where} may evict only pods on its own node, not {request.namespace}/{request.name}",
                code=403,
            )
        return api_admission.allow(uid)
    except errors.SharegpuError as exc:
        return api_admission.deny(uid, f"sharegpu: {exc}", code=400)


def review(
    kind: str,
    body: Any,
    policy: Policy,
    seen: Mapping[str, bool | None] | None = None,
    group: GroupRead | None = None,
) -> Answer:
    """The decision for pods and Devices (group deletions and updates need the API: `validate_group`;
    `seen` and `group`: see `mutate`)."""
    if kind == "devices":
        return validate_device(body, policy)
    return mutate(body, policy, seen, group) if kind == "mutate" else validate(body, policy)


def with_inventory(policy: Policy, inventory: list[tuple[str, int]]) -> Policy:
    """`policy` knowing the cluster's GPUs, as (model, memory MiB) pairs."""
    if not inventory:
        return dataclasses.replace(policy, largest_gpu_memory_mib=None, largest_gpu_model="", models=frozenset())
    model, memory = max(inventory, key=lambda g: (g[1], g[0]))
    return dataclasses.replace(
        policy, largest_gpu_memory_mib=memory, largest_gpu_model=model, models=frozenset(m for m, _ in inventory)
    )


__all__ = [
    "Policy",
    "PriorityClass",
    "guard",
    "leaving_namespaces",
    "mutate",
    "review",
    "validate",
    "validate_device",
    "validate_eviction",
    "validate_group",
    "with_inventory",
]
