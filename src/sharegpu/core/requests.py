"""GPU requests: what a container asks for, normalised, and the pod-level demand placement uses.

Every request format the webhook accepts (Koordinator, Aliyun, tkestack, KubeShare, HAMi,
nvidia.com/gpu) is translated at the edge into these values; from here on there is one vocabulary.

A pod's GPU demand is one shape: `count` GPUs, each giving `milli` compute and `memory_mib` memory.
Containers of one pod share it: fractional app containers are summed onto one GPU, whole-GPU app
containers add up their counts, and init containers (which run before the app containers) need
only the larger of their own demand and the app containers' sum. Mixing whole and fractional GPUs
in one pod is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sharegpu.core import devices, errors, units

LABEL_MAX = 253
"""The longest co-tenancy label a pod may write."""
SCOPED_LABEL_MAX = LABEL_MAX + 64
"""The longest once scoped by its namespace (`CoTenancy.scoped`: up to 63 characters and a slash)."""


@dataclass(frozen=True, slots=True)
class CoTenancy:
    """Rules about who may share a GPU with this pod.

    affinity: share a GPU only with pods of the same affinity label (and never with unlabelled pods).
    anti_affinity: never share a GPU with another pod of the same anti-affinity label.
    exclusion: a GPU carries at most one exclusion label; pods without one may still join.
    group: join the named GPU group: all members sit on the same physical GPU, which no other pod uses.
    """

    affinity: str | None = None
    anti_affinity: str | None = None
    exclusion: str | None = None
    group: str | None = None

    def __post_init__(self) -> None:
        for kind in ("affinity", "anti_affinity", "exclusion", "group"):
            value = getattr(self, kind)
            if value is not None and (not value or len(value) > SCOPED_LABEL_MAX or not value.isprintable()):
                raise errors.InvalidRequestError(
                    f"co-tenancy {kind} label must be 1..{SCOPED_LABEL_MAX} printable characters, got {value!r}"
                )

    def scoped(self, namespace: str) -> CoTenancy:
        """The rules with every label made the namespace's own (`namespace/label`): a label names pods
        of one namespace, so no other tenant can join a group, share an affinity or pass an exclusion
        by writing the same words. A label already so scoped (an allocation written scoped) stays."""

        def own(value: str | None) -> str | None:
            if value is None or value.startswith(f"{namespace}/"):
                return value
            if not value or len(value) > LABEL_MAX or not value.isprintable():
                raise errors.InvalidRequestError(
                    f"co-tenancy label must be 1..{LABEL_MAX} printable characters, got {value!r}"
                )
            return f"{namespace}/{value}"

        return CoTenancy(own(self.affinity), own(self.anti_affinity), own(self.exclusion), own(self.group))

    @property
    def empty(self) -> bool:
        return self.affinity is None and self.anti_affinity is None and self.exclusion is None and self.group is None


NO_RULES = CoTenancy()


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """What one container asks of each of its GPUs."""

    count: int = 1
    milli: int = units.MILLI_PER_GPU
    """Guaranteed compute share per GPU, 1..1000; 1000 means the whole GPU, exclusively."""
    limit_milli: int | None = None
    """Burst limit per GPU (request <= limit <= 1000); None means equal to the request."""
    memory_mib: int = 0
    """GPU memory per GPU in MiB; 0 asks for no fixed amount."""
    memory_permille: int = 0
    """GPU memory per GPU as a fraction (per mille) of the GPU's memory; 0 means not set."""
    models: frozenset[str] = field(default_factory=frozenset)
    """Allowed GPU models; empty means any."""

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise errors.InvalidRequestError(f"GPU count must be an integer >= 1, got {self.count!r}")
        if self.count > units.MAX_GPUS_PER_NODE:
            raise errors.InvalidRequestError(
                f"GPU count {self.count} exceeds the most GPUs a node can have ({units.MAX_GPUS_PER_NODE})"
            )
        if not 1 <= self.milli <= units.MILLI_PER_GPU:
            raise errors.InvalidRequestError(
                f"GPU compute share must be 1..{units.MILLI_PER_GPU} milli-GPU, got {self.milli}"
            )
        limit = self.limit
        if not self.milli <= limit <= units.MILLI_PER_GPU:
            raise errors.InvalidRequestError(
                f"GPU limit must satisfy request ({self.milli}) <= limit <= {units.MILLI_PER_GPU}, got {limit}"
            )
        if self.memory_mib < 0:
            raise errors.InvalidRequestError(f"GPU memory must be >= 0 MiB, got {self.memory_mib}")
        if not 0 <= self.memory_permille <= units.PERMILLE:
            raise errors.InvalidRequestError(
                f"GPU memory ratio must be 0..{units.PERMILLE} per mille, got {self.memory_permille}"
            )
        if self.memory_mib and self.memory_permille:
            raise errors.InvalidRequestError("give GPU memory either in MiB or as a ratio, not both")
        if self.whole and (self.memory_mib or self.memory_permille):
            raise errors.InvalidRequestError("a whole-GPU request gets all of the GPU's memory; do not set memory")
        for model in self.models:
            if not model or not model.isprintable():
                raise errors.InvalidRequestError(f"GPU model names must be printable and non-empty, got {model!r}")

    @property
    def whole(self) -> bool:
        return self.milli == units.MILLI_PER_GPU

    @property
    def limit(self) -> int:
        return self.milli if self.limit_milli is None else self.limit_milli


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    name: str
    gpu: GpuRequest | None = None
    init: bool = False


@dataclass(frozen=True, slots=True)
class GpuDemand:
    """The pod-level shape placement works with; hashable, so placement caches by it."""

    count: int = 0
    milli: int = 0
    memory_mib: int = 0
    memory_permille: int = 0
    models: frozenset[str] = field(default_factory=frozenset)
    cpu_milli: int = 0
    host_memory_mib: int = 0
    cotenancy: CoTenancy = NO_RULES
    isolation: devices.Isolation | None = None
    """The isolation mode the pod demands: only nodes that offer it take the pod."""
    compute: bool = False
    """The pod demands its compute share enforced: only nodes where its isolation mode does take it."""
    selection: str = ""
    """The name of a set of GPUs the fleet holds (`fleet.FleetState.select`): only those take it
    (a DRA claim's device selectors); empty: any GPU."""

    @property
    def whole(self) -> bool:
        return self.milli == units.MILLI_PER_GPU

    @property
    def gpu_milli_total(self) -> int:
        return self.count * self.milli

    @property
    def sharing(self) -> bool:
        """A fractional pod that shares one GPU with others."""
        return self.count >= 1 and not self.whole

    def needs_at_least(self, other: GpuDemand) -> bool:
        """This demand asks for at least as much of every quantity as `other`, under the same kind
        (whole or shared), models, co-tenancy rules and isolation. The filter is monotone in each
        quantity, so wherever `other` does not fit, this does not either."""
        return (
            self.whole == other.whole
            and self.models == other.models
            and self.cotenancy == other.cotenancy
            and self.isolation == other.isolation
            and self.compute == other.compute
            and self.selection == other.selection
            and self.count >= other.count
            and self.milli >= other.milli
            and self.memory_mib >= other.memory_mib
            and self.memory_permille >= other.memory_permille
            and self.cpu_milli >= other.cpu_milli
            and self.host_memory_mib >= other.host_memory_mib
        )


@dataclass(frozen=True, slots=True)
class PodRequest:
    """A pod's normalised request; `demand` is derived from the containers and checked on creation."""

    key: units.PodKey
    containers: tuple[ContainerRequest, ...] = ()
    """In the pod's declared order, init containers (native sidecars among them, not `init`) first:
    what runs at once depends on it (`peak`)."""
    cpu_milli: int = 0
    memory_mib: int = 0
    cotenancy: CoTenancy = NO_RULES
    isolation: devices.Isolation | None = None
    compute: bool = False
    """A compute guarantee: its isolation mode must enforce its compute share where it runs."""
    selection: str = ""
    """`GpuDemand.selection`."""
    demand: GpuDemand = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise errors.InvalidRequestError(
                f"pod {self.key}: CPU and memory requests must be >= 0, got {self.cpu_milli}m, {self.memory_mib} MiB"
            )
        names = [c.name for c in self.containers]
        if len(set(names)) != len(names):
            raise errors.InvalidRequestError(f"pod {self.key}: container names are not unique: {names}")
        object.__setattr__(self, "demand", _pod_demand(self))


def _pod_demand(pod: PodRequest) -> GpuDemand:
    app = [c.gpu for c in pod.containers if c.gpu is not None and not c.init]
    init = [c.gpu for c in pod.containers if c.gpu is not None and c.init]
    rules = pod.cotenancy
    if pod.compute and pod.isolation is None:
        raise errors.InvalidRequestError(
            f"pod {pod.key}: a compute guarantee needs an isolation mode that enforces compute: demand mps or mig "
            "(or hami-core, where a node's agent says its library enforces compute)"
        )
    if not app and not init:
        if pod.isolation is not None:
            raise errors.InvalidRequestError(
                f"pod {pod.key}: it demands isolation {pod.isolation.value} but asks for no GPU"
            )
        return GpuDemand(cpu_milli=pod.cpu_milli, host_memory_mib=pod.memory_mib, cotenancy=rules)
    kinds = {g.whole for g in app + init}
    if len(kinds) > 1:
        raise errors.InvalidRequestError(
            f"pod {pod.key}: mixing whole-GPU and fractional-GPU containers in one pod is not supported"
        )
    models = _common_models(pod.key, app + init)
    if kinds == {True}:
        return _whole_demand(pod, app, init, models)
    return _shared_demand(pod, app, init, models)


def peak(ordered: Sequence[tuple[bool, int]]) -> int:
    """The most of a quantity a pod's containers hold at once, from (init, amount) in declared order
    (init containers first): app containers and native sidecars (not init: they keep running) add up;
    a regular init container runs alone beside the sidecars declared before it (Kubernetes' rule)."""
    running = top = 0
    for init, amount in ordered:
        if init:
            top = max(top, running + amount)
        else:
            running += amount
    return max(top, running)


def _whole_demand(pod: PodRequest, app: list[GpuRequest], init: list[GpuRequest], models: frozenset[str]) -> GpuDemand:
    """The demand of a pod of whole GPUs (the most any container asks for at once)."""
    rules = pod.cotenancy
    if rules.group is not None:
        raise errors.InvalidRequestError(
            f"pod {pod.key}: whole GPUs cannot join GPU group {rules.group!r}; a group shares one GPU"
        )
    if pod.isolation is not None:
        raise errors.InvalidRequestError(
            f"pod {pod.key}: it demands isolation {pod.isolation.value}, which is about sharing a GPU; a pod of "
            "whole GPUs shares none (remove the demand, or ask for a share)"
        )
    count = peak([(c.init, c.gpu.count) for c in pod.containers if c.gpu is not None])
    return GpuDemand(
        count=count,
        milli=units.MILLI_PER_GPU,
        models=models,
        cpu_milli=pod.cpu_milli,
        host_memory_mib=pod.memory_mib,
        cotenancy=rules,
        selection=pod.selection,
    )


def _shared_demand(pod: PodRequest, app: list[GpuRequest], init: list[GpuRequest], models: frozenset[str]) -> GpuDemand:
    """The demand of a pod of GPU shares: its containers share each GPU, so their shares add up."""
    rules = pod.cotenancy
    counts = {g.count for g in app + init}
    if len(counts) > 1 or (len(app) > 1 and counts != {1}):
        raise errors.InvalidRequestError(
            f"pod {pod.key}: fractional containers must each ask for one GPU (they share it), "
            f"or a single container may ask for several fractional GPUs"
        )
    if any(g.memory_permille for g in app + init) and any(g.memory_mib for g in app + init):
        raise errors.InvalidRequestError(
            f"pod {pod.key}: containers mix GPU memory in MiB with GPU memory ratios; use one form"
        )
    if pod.isolation is devices.Isolation.MPS and counts != {1}:
        raise errors.InvalidRequestError(
            f"pod {pod.key}: isolation mps gives each shared GPU its own MPS daemon and a process reaches only one; "
            "ask for one shared GPU per container"
        )
    if rules.group is not None and counts != {1}:
        raise errors.InvalidRequestError(f"pod {pod.key}: GPU group {rules.group!r} shares one GPU; ask for one GPU")
    gpus = [(c.init, c.gpu) for c in pod.containers if c.gpu is not None]
    milli = peak([(init, g.milli) for init, g in gpus])
    memory = peak([(init, g.memory_mib) for init, g in gpus])
    permille = peak([(init, g.memory_permille) for init, g in gpus])
    if milli >= units.MILLI_PER_GPU:  # 1000 is a whole GPU, which one container holds alone
        raise errors.InvalidRequestError(
            f"pod {pod.key}: its containers share one GPU but ask for {milli} milli-GPU in total "
            f"(less than {units.MILLI_PER_GPU} together; for all of it, give one container the whole GPU)"
        )
    if permille > units.PERMILLE:
        raise errors.InvalidRequestError(
            f"pod {pod.key}: its containers share one GPU but ask for {permille / 10:.1f}% of its memory"
        )
    return GpuDemand(
        count=counts.pop(),
        milli=milli,
        memory_mib=memory,
        memory_permille=permille,
        models=models,
        cpu_milli=pod.cpu_milli,
        host_memory_mib=pod.memory_mib,
        cotenancy=rules,
        isolation=pod.isolation,
        compute=pod.compute,
        selection=pod.selection,
    )


def _common_models(key: str, requests: list[GpuRequest]) -> frozenset[str]:
    constrained = [g.models for g in requests if g.models]
    if not constrained:
        return frozenset()
    common = frozenset.intersection(*constrained)
    if not common:
        raise errors.InvalidRequestError(f"pod {key}: its containers allow no GPU model in common")
    return common


def simple_pod(
    key: str,
    *,
    count: int = 0,
    milli: int = units.MILLI_PER_GPU,
    memory_mib: int = 0,
    memory_permille: int = 0,
    models: frozenset[str] = frozenset(),
    cpu_milli: int = 0,
    host_memory_mib: int = 0,
    cotenancy: CoTenancy = NO_RULES,
    limit_milli: int | None = None,
    selection: str = "",
) -> PodRequest:
    """A one-container pod; `count=0` makes a pod that wants no GPU."""
    gpu = (
        GpuRequest(
            count=count,
            milli=milli,
            limit_milli=limit_milli,
            memory_mib=memory_mib,
            memory_permille=memory_permille,
            models=models,
        )
        if count
        else None
    )
    return PodRequest(
        key=units.PodKey(key),
        containers=(ContainerRequest("main", gpu),),
        cpu_milli=cpu_milli,
        memory_mib=host_memory_mib,
        selection=selection,
        cotenancy=cotenancy,
    )
