"""Pods to sharegpu's domain values: the request a pod makes, the allocation it holds, its role.

`request` turns a pod's canonical resources and annotations into a `core.requests.PodRequest`
(refusing malformed ones with the field named); `allocation` parses the allocation annotation the
extender wrote into the binding. `Record` is what long-running components keep per pod instead of
the pod itself: the few facts they act on, parsed once when the pod arrives (about a tenth of the
memory of the decoded object, and none of the re-parsing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from sharegpu.api import constraints, gangs, names, quantity, wire
from sharegpu.core import allocation, devices, errors, requests, units

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
NEVER: Final = "Never"
"""The preemption policy of a pod that never preempts others."""


def key(pod: wire.Pod) -> units.PodKey:
    return units.pod_key(pod.metadata.namespace, pod.metadata.name)


SIDECAR: Final = "Always"
"""The restartPolicy that makes an init container a native sidecar (GA in Kubernetes 1.33): it starts
before the app containers and runs beside them, so what it asks for adds to theirs."""


def is_sidecar(container: wire.Container) -> bool:
    return container.restart_policy == SIDECAR


def containers(pod: wire.Pod) -> list[tuple[bool, wire.Container]]:
    """(runs before the app containers and is done when they start, container) for every container,
    init containers first. A native sidecar is an init container that runs beside the app containers:
    it counts as one of them (False)."""
    made = [(not is_sidecar(c), c) for c in pod.spec.init_containers]
    return made + [(False, c) for c in pod.spec.containers]


def wants_gpu(pod: wire.Pod) -> bool:
    return any(name in c.resources.merged() for _, c in containers(pod) for name in names.GPU_RESOURCES)


def charged_namespace(namespace: str, labels: Mapping[str, str]) -> str:
    """The namespace a pod's GPUs count against (quotas, budgets): its own; for a SharedDeviceGroup's
    holder pod (only in `names.HOLDING_NAMESPACE`, where only sharegpu makes pods), its group's."""
    if namespace == names.HOLDING_NAMESPACE and labels.get(names.LABEL_ROLE) == names.ROLE_GROUP_HOLDER:
        return labels.get(names.LABEL_GROUP_NAMESPACE) or namespace
    return namespace


def role(pod: wire.Pod) -> str | None:
    """The part one of sharegpu's own pods plays (`names.LABEL_ROLE`: reservation, group holder);
    None for any other pod. Only pods of `names.HOLDING_NAMESPACE` play one: there only sharegpu
    creates pods, while a label elsewhere is the tenant's to set."""
    if pod.metadata.namespace != names.HOLDING_NAMESPACE:
        return None
    return pod.metadata.labels.get(names.LABEL_ROLE)


def is_reservation(pod: wire.Pod) -> bool:
    return role(pod) == names.ROLE_RESERVATION


def is_terminal(pod: wire.Pod) -> bool:
    return pod.status.phase in TERMINAL_PHASES


def has_soft_preferences(pod: wire.Pod) -> bool:
    """Whether kube-scheduler would rank nodes by the pod's own wishes: preferred node or pod
    (anti-)affinity, or topology spread that only prefers (ScheduleAnyway)."""
    affinity = pod.spec.affinity
    if affinity is not None:
        for part in (affinity.node_affinity, affinity.pod_affinity, affinity.pod_anti_affinity):
            if part is not None and part.preferred_during_scheduling_ignored_during_execution:
                return True
    return any(c.when_unsatisfiable == "ScheduleAnyway" for c in pod.spec.topology_spread_constraints)


def host_request(pod: wire.Pod) -> tuple[int, int]:
    """(milli-CPU, MiB) the pod holds on its node, as kube-scheduler counts it:

    - per container, its request (its limit when it states none), or, while an in-place resize is
      under way, the larger of that and what the kubelet reports allocated: growing counts at once,
      shrinking only once the kubelet has done it;
    - the app containers and native sidecars add up; a regular init container runs alone, beside the
      sidecars declared before it; the pod needs the largest of those;
    - pod-level resources (spec.resources.requests) replace the total where they are set."""
    reported = {s.name: s for s in (*pod.status.container_statuses, *pod.status.init_container_statuses)}

    def one(container: wire.Container) -> tuple[int, int]:
        req, lim = container.resources.requests, container.resources.limits
        cpu = quantity.milli_cpu(req.get("cpu", lim.get("cpu", 0)))
        memory = quantity.mebibytes(req.get("memory", lim.get("memory", 0)))
        status = reported.get(container.name)
        if status is not None:
            for held in (status.allocated_resources, status.resources.requests if status.resources else {}):
                cpu = max(cpu, quantity.milli_cpu(held.get("cpu", 0)))
                memory = max(memory, quantity.mebibytes(held.get("memory", 0)))
        return cpu, memory

    running = [one(c) for c in pod.spec.containers]
    beside: list[tuple[int, int]] = []
    alone: list[tuple[int, int]] = []
    for container in pod.spec.init_containers:
        need = one(container)
        if is_sidecar(container):
            beside.append(need)
        else:
            alone.append((need[0] + sum(s[0] for s in beside), need[1] + sum(s[1] for s in beside)))
    running += beside
    cpu = max(sum(r[0] for r in running), max((a[0] for a in alone), default=0))
    memory = max(sum(r[1] for r in running), max((a[1] for a in alone), default=0))
    pod_level = pod.spec.resources.requests if pod.spec.resources is not None else {}
    if "cpu" in pod_level:
        cpu = quantity.milli_cpu(pod_level["cpu"])
    if "memory" in pod_level:
        memory = quantity.mebibytes(pod_level["memory"])
    return cpu, memory


def _gpu_request(
    res: dict[str, wire.Quantity], annotations: dict[str, str], models: frozenset[str]
) -> requests.GpuRequest | None:
    if names.NVIDIA_GPU in res:
        mixed = [k for k in names.MANAGED_RESOURCES if k in res]
        if mixed:
            raise errors.InvalidRequestError(
                f"{names.NVIDIA_GPU} asks for whole GPUs; it cannot be combined with a share ({', '.join(mixed)})"
            )
        count = quantity.integer(res[names.NVIDIA_GPU], names.NVIDIA_GPU, 0, units.MAX_GPUS_PER_NODE)
        return requests.GpuRequest(count=count, models=models) if count else None
    if names.GPU not in res and names.GPU_MILLI not in res:
        return None
    count = quantity.integer(res.get(names.GPU, 1), names.GPU, 0, units.MAX_GPUS_PER_NODE)
    milli = quantity.integer(res.get(names.GPU_MILLI, units.MILLI_PER_GPU), names.GPU_MILLI, 1, units.MILLI_PER_GPU)
    if not count:
        return None
    whole = milli == units.MILLI_PER_GPU
    limit = annotations.get(names.LIMIT_MILLI)
    permille = annotations.get(names.MEMORY_PERMILLE)
    return requests.GpuRequest(
        count=count,
        milli=milli,
        limit_milli=None
        if whole or limit is None
        else quantity.integer(limit, names.LIMIT_MILLI, 1, units.MILLI_PER_GPU),
        memory_mib=quantity.integer(res.get(names.GPU_MEMORY, 0), names.GPU_MEMORY, 0, 1 << 30),
        memory_permille=0
        if whole or permille is None
        else quantity.integer(permille, names.MEMORY_PERMILLE, 1, units.PERMILLE),
        models=models,
    )


def cotenancy(annotations: dict[str, str], namespace: str) -> requests.CoTenancy:
    """The pod's co-tenancy rules, each label its namespace's own (`requests.CoTenancy.scoped`)."""
    return requests.CoTenancy(
        affinity=annotations.get(names.AFFINITY),
        anti_affinity=annotations.get(names.ANTI_AFFINITY),
        exclusion=annotations.get(names.EXCLUSION),
        group=annotations.get(names.GROUP),
    ).scoped(namespace)


REQUEST_ANNOTATIONS = (
    names.MODELS,
    names.LIMIT_MILLI,
    names.MEMORY_PERMILLE,
    names.AFFINITY,
    names.ANTI_AFFINITY,
    names.EXCLUSION,
    names.GROUP,
    names.ISOLATION,
    names.COMPUTE_GUARANTEE,
)
"""The annotations `request` reads. With the containers' resources (of which only CPU and memory
may change, by an in-place resize: `record` compares them too), they are all a pod's request
depends on."""

_NO_REQUEST_ANNOTATIONS: tuple[str | None, ...] = (None,) * len(REQUEST_ANNOTATIONS)


def request_annotations(annotations: dict[str, str]) -> tuple[str | None, ...]:
    """The values of `REQUEST_ANNOTATIONS` (one shared tuple when the pod sets none of them)."""
    found = tuple(annotations.get(k) for k in REQUEST_ANNOTATIONS)
    return _NO_REQUEST_ANNOTATIONS if found == _NO_REQUEST_ANNOTATIONS else found


def request(pod: wire.Pod, host: tuple[int, int] | None = None) -> requests.PodRequest:
    """The normalised request of a pod; malformed requests raise InvalidRequestError naming the field.
    `host`: its (milli-CPU, MiB) when the caller has them already."""
    pod_key = key(pod)
    annotations = pod.metadata.annotations
    models = frozenset(m.strip() for m in annotations.get(names.MODELS, "").split(",") if m.strip())
    made: list[requests.ContainerRequest] = []
    for init, container in containers(pod):
        try:
            gpu = _gpu_request(container.resources.merged(), annotations, models)
        except errors.InvalidInputError as exc:
            raise errors.InvalidRequestError(f"pod {pod_key}, container {container.name}: {exc}") from None
        made.append(requests.ContainerRequest(container.name, gpu, init=init))
    cpu, memory = host if host is not None else host_request(pod)
    return requests.PodRequest(
        key=pod_key, containers=tuple(made), cpu_milli=cpu, memory_mib=memory,
        cotenancy=cotenancy(annotations, pod.metadata.namespace),
        isolation=isolation(annotations.get(names.ISOLATION), f"pod {pod_key}: annotation {names.ISOLATION}"),
        compute=flag(annotations.get(names.COMPUTE_GUARANTEE), f"pod {pod_key}: annotation {names.COMPUTE_GUARANTEE}"),
    )  # fmt: skip


def flag(text: str | None, where: str) -> bool:
    """A "true"/"false" annotation (absent: false); InvalidRequestError naming `where` otherwise."""
    if text is None or text.strip().lower() == "false":
        return False
    if text.strip().lower() == "true":
        return True
    raise errors.InvalidRequestError(f"{where}: {text!r} is neither true nor false")


def isolation(text: str | None, where: str) -> devices.Isolation | None:
    """An isolation mode by its name (None or "none": no demand); InvalidRequestError naming `where`."""
    if text is None or text.strip() in ("", "none"):
        return None
    try:
        return devices.Isolation(text.strip())
    except ValueError:
        known = ", ".join(["none", *(m.value for m in devices.Isolation)])
        raise errors.InvalidRequestError(f"{where}: unknown isolation mode {text!r} (known: {known})") from None


def allocation_of(pod: wire.Pod) -> allocation.Allocation | None:
    """The allocation recorded on a bound pod, or None if it carries none."""
    text = pod.metadata.annotations.get(names.ALLOCATION)
    if not text:
        return None
    cpu, memory = host_request(pod)
    return allocation.Allocation.from_json(text, pod=key(pod), cpu_milli=cpu, memory_mib=memory)


# ----------------------------------------------------------------- what a long-running component keeps


@dataclass(frozen=True, slots=True)
class Slot:
    """The GPU a reservation pod holds: its node and index, and the UUID it reported (once known)."""

    node: str
    index: int
    uuid: str | None


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """One of a pod's `spec.resourceClaims`: its name in the pod, the ResourceClaim's ("" while a
    template's claim has not been made yet) and the template's ("" for a claim by name)."""

    name: str
    claim: str
    template: str = ""


def claim_refs(pod: wire.Pod) -> tuple[ClaimRef, ...]:
    made = {s.name: s.resource_claim_name or "" for s in pod.status.resource_claim_statuses}
    return tuple(
        ClaimRef(c.name, c.resource_claim_name or made.get(c.name, ""), c.resource_claim_template_name or "")
        for c in pod.spec.resource_claims
    )


@dataclass(frozen=True, slots=True)
class Record:
    """One pod as the extender and the controllers need it; built once per watch event by `record`."""

    key: units.PodKey
    uid: str
    resource_version: str
    node: str
    """"" until bound."""
    scheduler: str
    phase: str
    deleting: bool
    created: str
    gpu: bool
    """The pod asks for a GPU resource (whether or not its request is valid)."""
    request: requests.PodRequest | None
    """The parsed request; None if it asks for no GPU or is malformed (then `problem` says why)."""
    request_annotations: tuple[str | None, ...]
    """The annotations `request` was parsed from (`request_annotations`; all None for a pod that asks
    for no GPU): the same uid with the same values has the same request."""
    problem: str | None
    allocation_text: str | None
    """The allocation annotation as written (compared as text, parsed once by `allocation`)."""
    allocation: allocation.Allocation | None
    handoff: str | None
    """The hand-off ConfigMap the pod's containers read."""
    reservation: Slot | None
    """Set for reservation pods."""
    cpu_milli: int
    memory_mib: int
    owned: bool = False
    """A controller owns it (a ReplicaSet, Job, StatefulSet...): deleted, it is made again."""
    priority: int = 0
    """Its priority (0 when none is set): a pod may preempt only pods of a lower one."""
    preempts: bool = True
    """Its preemption policy lets it preempt others (not `Never`)."""
    claims: tuple[ClaimRef, ...] = ()
    """Its `spec.resourceClaims` (DRA), each with the claim it names or that was made for it."""
    container_claims: tuple[tuple[str, tuple[wire.ContainerClaim, ...]], ...] = ()
    """(container name, its `resources.claims`) of each container (init containers first) that uses
    a claim."""
    gate: int = -1
    """Where sharegpu's scheduling gate (`names.DRA_GATE`) is in its `spec.schedulingGates` (-1: not
    there): the allocator removes it by that position, after checking it is still there."""
    terms: constraints.PodTerms | None = None
    """Its own constraints on nodes: kept for pods with claims and gang members only (the DRA
    allocator picks their node, and a gang's plan its members' nodes, before kube-scheduler does)."""
    gates: int = 0
    """How many scheduling gates it waits behind (anyone's: Kueue's until it admits the pod)."""
    gang: gangs.Gang | None = None
    """The gang it belongs to (`api.gangs`); None for none, or a malformed one (`problem` says why
    for a GPU pod)."""
    labels: tuple[tuple[str, str], ...] = ()
    """Its labels, sorted (what PodDisruptionBudgets select it by)."""

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def gated(self) -> bool:
        """It waits behind sharegpu's scheduling gate."""
        return self.gate >= 0

    @property
    def held_elsewhere(self) -> bool:
        """It waits behind a scheduling gate not sharegpu's (Kueue's, until Kueue admits it)."""
        return self.gates > (1 if self.gated else 0)

    def same_request(self, uid: str, annotations: tuple[str | None, ...]) -> bool:
        """Whether a version of the pod with this uid and these `request_annotations` has this request."""
        return bool(uid) and uid == self.uid and annotations == self.request_annotations

    @property
    def live(self) -> bool:
        """Bound, not finished and not being deleted."""
        return bool(self.node) and not self.terminal and not self.deleting


def slot_of(pod: wire.Pod) -> Slot | None:
    """The GPU a reservation pod holds (index -1 where its slot label is not a number); None for any
    other pod."""
    if not is_reservation(pod):
        return None
    labels = pod.metadata.labels
    try:
        index = int(labels.get(names.LABEL_SLOT, ""))
    except ValueError:
        index = -1
    return Slot(labels.get(names.LABEL_NODE, ""), index, pod.metadata.annotations.get(names.GPU_UUID))


def record(pod: wire.Pod, previous: Record | None = None) -> Record:
    """The `Record` of a pod. Parsing is skipped for what did not change since `previous`."""
    meta = pod.metadata
    annotations = meta.annotations
    pod_key = key(pod)
    try:
        host: tuple[int, int] | None = host_request(pod)
    except errors.InvalidInputError:
        host = None
    cpu, memory = host or (0, 0)
    slot = slot_of(pod)
    gpu = slot is None and wants_gpu(pod)
    parsed: requests.PodRequest | None = None
    problem: str | None = None
    inputs = request_annotations(annotations) if gpu else _NO_REQUEST_ANNOTATIONS
    same_host = previous is not None and (previous.cpu_milli, previous.memory_mib) == (cpu, memory)
    if gpu:
        if (
            previous is not None
            and previous.request is not None
            and previous.same_request(meta.uid, inputs)
            and same_host
        ):
            parsed = previous.request  # every update after the first: status, binding, annotations
        else:
            try:
                parsed = request(pod, host)
            except errors.InvalidInputError as exc:
                problem = str(exc)
    handoff = annotations.get(names.HANDOFF)
    if gpu and problem is None and handoff is not None and not handoff.startswith(names.HANDOFF_PREFIX):
        problem = (f"annotation {names.HANDOFF} names ConfigMap {handoff!r}: sharegpu hands GPUs off only "
                   f"through ConfigMaps named {names.HANDOFF_PREFIX}* (the name the webhook gives)")  # fmt: skip
    gang: gangs.Gang | None = None
    try:
        gang = gangs.of(meta.namespace, annotations)
    except errors.InvalidInputError as exc:
        problem = problem if problem is not None or not gpu else str(exc)
    text = annotations.get(names.ALLOCATION)
    alloc: allocation.Allocation | None = None
    if text:
        if previous is not None and previous.allocation_text == text and previous.allocation is not None and same_host:
            alloc = previous.allocation  # CPU and memory may change by an in-place resize: then parsed again
        else:
            try:
                alloc = allocation.Allocation.from_json(text, pod=pod_key, cpu_milli=cpu, memory_mib=memory)
            except errors.InvalidInputError as exc:
                problem = str(exc)
    return Record(
        key=pod_key,
        uid=meta.uid,
        resource_version=meta.resource_version,
        node=pod.spec.node_name,
        scheduler=pod.spec.scheduler_name,
        phase=pod.status.phase,
        deleting=meta.deletion_timestamp is not None,
        created=meta.creation_timestamp or "",
        gpu=gpu,
        request=parsed,
        request_annotations=inputs,
        problem=problem,
        allocation_text=text,
        allocation=alloc,
        handoff=handoff,
        reservation=slot,
        cpu_milli=cpu,
        memory_mib=memory,
        owned=any(ref.controller for ref in meta.owner_references),
        priority=pod.spec.priority or 0,
        preempts=pod.spec.preemption_policy != NEVER,
        claims=claim_refs(pod) if pod.spec.resource_claims else (),
        container_claims=tuple((c.name, tuple(c.resources.claims)) for _, c in containers(pod) if c.resources.claims),
        gate=next((i for i, g in enumerate(pod.spec.scheduling_gates) if g.name == names.DRA_GATE), -1),
        terms=constraints.PodTerms.of(pod.spec, meta) if pod.spec.resource_claims or gang is not None else None,
        gates=len(pod.spec.scheduling_gates),
        gang=gang,
        labels=tuple(sorted(meta.labels.items())),
    )


def eviction(pod: units.PodKey, uid: str, *, dry_run: bool = False, resource_version: str = "") -> dict[str, Any]:
    """An Eviction (policy/v1) of `pod`, POSTed to `paths.eviction`: the API server honours its
    disruption budgets. Only if it is still the pod with `uid` (not one made again under its name)
    and, with `resource_version`, still as it was then (not started since, say: 409 otherwise).
    `dry_run`: only asked whether the budgets allow it (nothing is deleted, no allowance used)."""
    namespace, _, name = pod.partition("/")
    options: dict[str, Any] = {"preconditions": {"uid": uid}}
    if resource_version:
        options["preconditions"]["resourceVersion"] = resource_version
    if dry_run:
        options["dryRun"] = ["All"]
    return {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
        "deleteOptions": options,
    }


DISRUPTION_TARGET: Final = "DisruptionTarget"
"""The condition kube-scheduler and the kubelet put on a pod that is about to be deleted for a reason
of the cluster's (preemption, eviction), so that its controller and its Job's failure policy know."""
PREEMPTED: Final = "PreemptionByScheduler"
"""The `DisruptionTarget` reason of a pod a scheduler preempts (the value kube-scheduler writes)."""


def condition(kind: str, reason: str, message: str, now: str) -> dict[str, Any]:
    """A strategic-merge patch of a pod's status setting one condition (True) of type `kind`;
    conditions merge by type, so the pod's other conditions stay."""
    found = {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
    return {"status": {"conditions": [found]}}


def preempted(message: str, now: str) -> dict[str, Any]:
    """The status patch saying a pod is being preempted (`DISRUPTION_TARGET`)."""
    return condition(DISRUPTION_TARGET, PREEMPTED, message, now)


def nominated(node: str | None) -> dict[str, Any]:
    """A merge patch of a pending pod's status naming the node room is being made on for it (what
    `kubectl get pod -o wide` shows as NOMINATED NODE, and what kube-scheduler tries first); None
    clears it."""
    return {"status": {"nominatedNodeName": node}}


RESERVE_CONTAINER: Final = "reserve"
"""The container of sharegpu's own GPU-holding pods (its hand-off keys start with this name)."""


def reserve_container(image: str, gpus: int, role: str = "", share: tuple[int, int] | None = None) -> dict[str, Any]:
    """The container of sharegpu's own GPU-holding pods (a reservation pod holds one GPU, a group's
    holder several): it runs `sharegpu reserve`, which reports the GPUs the device plugin gave it and
    holds them; `role` tells it which kind of pod it is in. With `share` (milli-GPU, memory MiB; 0:
    none given) it asks for that share of each of `gpus` GPUs through sharegpu's resources instead,
    and only holds (the extender's hand-off says which GPUs)."""
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if role:
        env.append({"name": names.ROLE_ENV, "value": role})
    limits = {names.NVIDIA_GPU: str(gpus), "cpu": "10m", "memory": "32Mi"}
    if share is not None:
        milli, memory = share
        del limits[names.NVIDIA_GPU]
        limits |= {names.GPU: str(gpus), names.GPU_MILLI: str(milli)}
        if memory:
            limits[names.GPU_MEMORY] = str(memory)
    return {
        "name": RESERVE_CONTAINER,
        "image": image,
        "command": ["sharegpu", "reserve"],
        "env": env,
        "resources": {"limits": limits, "requests": dict(limits)},
        "securityContext": RESTRICTED,
    }


RESTRICTED: Final = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""What PodSecurity's `restricted` level asks of a container: sharegpu's GPU-holding pods meet it
(as the image's own user, 65532, named so the kubelet need not read the image to check it)."""
