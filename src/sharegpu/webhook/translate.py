"""Request formats of other GPU-sharing systems, translated into sharegpu's canonical form.

Pure functions over a pod manifest: no I/O. `translate(pod)` reads the pod through `api.wire.Pod`
(a mistyped field is refused with its path), and returns the canonical pod (a new dict) and one
audit line per translation, or raises InvalidRequestError with a message a person can act on. The
table of formats is in docs/admission.md; every row has a test.

Each format has one reader: `_RESOURCE_READERS` for those stated in a container's resources
(sharegpu's own, nvidia.com/gpu in percent, Koordinator, Aliyun, tkestack, HAMi, Volcano), read
container by container, then `_ANNOTATION_READERS` for those stated in pod annotations (KubeShare,
KAI). What they find goes through one writer (`_Translation.write`); `_Translation.finish` then
sets the pod-wide annotations (GPU models, burst limit, memory ratio).

Canonical form (see sharegpu.api.names): whole GPUs stay `nvidia.com/gpu: N` (the NVIDIA device
plugin hands them over); shares become `sharegpu.io/gpu: N` (only above 1), `sharegpu.io/gpu-milli: M` and
`sharegpu.io/gpu-memory: MiB`, with the burst limit, memory ratio, models and co-tenancy rules as
`sharegpu.io/*` pod annotations. A share that states only memory (Aliyun, HAMi without gpucores,
KubeShare without gpu_request) gets the smallest compute guarantee (1 milli) and may burst to the
whole GPU, which is what those systems do.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sharegpu.api import names, pods, quantity, wire
from sharegpu.core import errors, units

Json = dict[str, Any]

KOORD_CORE = ("koordinator.sh/gpu-core", "kubernetes.io/gpu-core")
KOORD_RATIO = ("koordinator.sh/gpu-memory-ratio", "kubernetes.io/gpu-memory-ratio")
KOORD_MEMORY = ("koordinator.sh/gpu-memory", "kubernetes.io/gpu-memory")
KOORD_SHARED = ("koordinator.sh/gpu.shared", "koordinator.sh/gpu-shared")
"""Koordinator's resource is `gpu.shared`; its user manual (GPU share with HAMi) writes `gpu-shared`:
both mean the same here."""
KOORD_GPU = ("koordinator.sh/gpu", "kubernetes.io/gpu")
ALIYUN_MEMORY = "aliyun.com/gpu-mem"
TKE_CORE = "tencent.com/vcuda-core"
TKE_MEMORY = "tencent.com/vcuda-memory"
HAMI_MEMORY = "nvidia.com/gpumem"
HAMI_MEMORY_PERCENT = "nvidia.com/gpumem-percentage"
HAMI_CORES = "nvidia.com/gpucores"
HAMI_USE_TYPE = "nvidia.com/use-gputype"
HAMI_NOUSE_TYPE = "nvidia.com/nouse-gputype"
HAMI_UUID_SELECTORS = ("nvidia.com/use-gpuuuid", "nvidia.com/nouse-gpuuuid")
VOLCANO_NUMBER = "volcano.sh/vgpu-number"
VOLCANO_MEMORY = "volcano.sh/vgpu-memory"
VOLCANO_MEMORY_PERCENT = "volcano.sh/vgpu-memory-percentage"
VOLCANO_CORES = "volcano.sh/vgpu-cores"
KAI_FRACTION = "gpu-fraction"
KAI_MEMORY = "gpu-memory"
KAI_DEVICES = "gpu-fraction-num-devices"
KAI_CONTAINER = "gpu-fraction-container-name"
KAI_KEYS = (KAI_FRACTION, KAI_MEMORY)
NATIVE = names.MANAGED_RESOURCES

FORMATS: dict[str, tuple[str, ...]] = {
    "sharegpu": NATIVE,
    "koordinator": (*KOORD_CORE, *KOORD_RATIO, *KOORD_MEMORY, *KOORD_SHARED, *KOORD_GPU),
    "aliyun": (ALIYUN_MEMORY,),
    "tkestack": (TKE_CORE, TKE_MEMORY),
    "hami": (HAMI_MEMORY, HAMI_MEMORY_PERCENT, HAMI_CORES),
    "volcano": (VOLCANO_NUMBER, VOLCANO_MEMORY, VOLCANO_MEMORY_PERCENT, VOLCANO_CORES),
}
FOREIGN = frozenset(k for name, keys in FORMATS.items() if name != "sharegpu" for k in keys)
"""Resource names of other systems: none may be left on a pod after translation."""
KUBESHARE_REQUEST = "kubeshare/gpu_request"
KUBESHARE_LIMIT = "kubeshare/gpu_limit"
KUBESHARE_MEMORY = "kubeshare/gpu_mem"
KUBESHARE_RULES = {
    "kubeshare/sched_affinity": names.AFFINITY,
    "kubeshare/sched_anti-affinity": names.ANTI_AFFINITY,
    "kubeshare/sched_exclusion": names.EXCLUSION,
    "kubeshare/GPUID": names.GROUP,
}
KUBESHARE_KEYS = (KUBESHARE_REQUEST, KUBESHARE_LIMIT, KUBESHARE_MEMORY)


class _Share:
    """What one container asks for, as translated: count, per-GPU compute, memory, memory ratio."""

    def __init__(self) -> None:
        self.count = 1
        self.milli: int | None = None
        self.memory_mib = 0
        self.permille = 0
        self.whole = False


def _percent_gpus(value: Any, key: str) -> tuple[int, int | None]:
    """Koordinator / tkestack percent convention: 1..100 of one GPU, or 100*k for k whole GPUs."""
    percent = quantity.integer(value, key, 1, 100 * units.MAX_GPUS_PER_NODE)
    if percent > 100:
        if percent % 100:
            raise errors.InvalidRequestError(f"{key} above 100 must be a multiple of 100 (whole GPUs), got {percent}")
        return percent // 100, None
    return 1, percent


def _koordinator(res: Json) -> _Share:
    """Koordinator's protocol: gpu-core and gpu-memory-ratio in percent of one GPU (multiples of 100
    for whole GPUs); koordinator.sh/gpu (and kubernetes.io/gpu) sets both at once; with
    koordinator.sh/gpu.shared: N the pod shares N GPUs and core, ratio and memory are totals over
    them (core 100 on 2 shared GPUs is half of each)."""
    share = _Share()
    core = next(((k, res[k]) for k in KOORD_CORE if k in res), None)
    ratio = next(((k, res[k]) for k in KOORD_RATIO if k in res), None)
    memory = next(((k, res[k]) for k in KOORD_MEMORY if k in res), None)
    both = next((k for k in KOORD_GPU if k in res), None)
    if both:
        if core or ratio:
            raise errors.InvalidRequestError(f"{both} already sets compute and memory; drop gpu-core/gpu-memory-ratio")
        core = ratio = (both, res[both])
    shared = next((k for k in KOORD_SHARED if k in res), None)
    if shared:
        return _koordinator_shared(res, shared, core, ratio, memory)
    if core:
        count, percent = _percent_gpus(core[1], core[0])
        share.count = count
        share.whole = percent is None or percent == 100
        share.milli = None if share.whole else percent * 10  # type: ignore[operator]
    if ratio and not share.whole:
        count, percent = _percent_gpus(ratio[1], ratio[0])
        if core and count != share.count:
            raise errors.InvalidRequestError(f"{core[0]} and {ratio[0]} ask for different numbers of GPUs")
        share.count = count
        if percent is None or (percent == 100 and share.milli is None):
            share.whole = True
        else:
            share.permille = percent * 10
    if memory and not share.whole:
        share.memory_mib = math.ceil(quantity.number(memory[1], memory[0]) / (2**20))
    if share.permille and share.memory_mib:
        raise errors.InvalidRequestError(f"give GPU memory as {ratio[0] if ratio else 'a ratio'} or as bytes, not both")
    return share


def _koordinator_shared(
    res: Json,
    shared: str,
    core: tuple[str, Any] | None,
    ratio: tuple[str, Any] | None,
    memory: tuple[str, Any] | None,
) -> _Share:
    share = _Share()
    share.count = quantity.integer(res[shared], shared, 1, units.MAX_GPUS_PER_NODE)

    def per_gpu(item: tuple[str, Any]) -> int:
        total = quantity.integer(item[1], item[0], 1, 100 * share.count)
        if total % share.count:
            raise errors.InvalidRequestError(
                f"{item[0]} ({total}) is the total over {shared}: {share.count} GPUs and must divide by it"
            )
        return total // share.count

    if core:
        share.milli = per_gpu(core) * 10
    if ratio:
        share.permille = per_gpu(ratio) * 10
    if memory:
        if ratio:
            raise errors.InvalidRequestError(f"give GPU memory as {ratio[0]} or as bytes, not both")
        share.memory_mib = math.ceil(quantity.number(memory[1], memory[0]) / (2**20) / share.count)
    return share


def _whole_sharegpu(res: Json) -> _Share | None:
    """sharegpu.io/gpu: N with no share of compute (gpu-milli absent or 1000) and no memory: N whole
    GPUs, which the device plugin hands over (nvidia.com/gpu); None for a share."""
    if names.GPU not in res or names.GPU_MEMORY in res:
        return None
    if names.GPU_MILLI in res and quantity.integer(res[names.GPU_MILLI], names.GPU_MILLI, 1, units.MILLI_PER_GPU) != (
        units.MILLI_PER_GPU
    ):
        return None
    share = _Share()
    share.count = quantity.integer(res[names.GPU], names.GPU, 0, units.MAX_GPUS_PER_NODE)
    share.whole = True
    return share if share.count else None


def _nvidia_percent(res: Json) -> _Share | None:
    """`nvidia.com/gpu` above any node's GPU count can only be percent of a GPU (Koordinator's
    convention, as koordinator.sh/gpu): a multiple of 100 is that many whole GPUs, 64..99 a share of
    one. None when the value is a count (the NVIDIA device plugin's protocol)."""
    raw = res[names.NVIDIA_GPU]
    value = quantity.integer(raw, names.NVIDIA_GPU, 0, 100 * units.MAX_GPUS_PER_NODE)
    if value <= units.MAX_GPUS_PER_NODE:
        return None
    share = _Share()
    if value % 100 == 0:
        share.count, share.whole = value // 100, True
    elif value < 100:
        share.milli, share.permille = value * 10, value * 10
    else:
        raise errors.InvalidRequestError(
            f"{names.NVIDIA_GPU}: {raw} is neither a GPU count (at most {units.MAX_GPUS_PER_NODE}) nor whole GPUs "
            f"in percent (a multiple of 100); for a share of one GPU write koordinator.sh/gpu: 1..100 or "
            f"{names.GPU_MILLI}"
        )
    return share


def _aliyun(res: Json) -> _Share:
    share = _Share()
    share.memory_mib = 1024 * quantity.integer(res[ALIYUN_MEMORY], f"{ALIYUN_MEMORY} (GiB)", 1, 1 << 20)
    return share


def _tkestack(res: Json) -> _Share:
    share = _Share()
    if TKE_CORE in res:
        count, percent = _percent_gpus(res[TKE_CORE], TKE_CORE)
        if percent is not None and percent > 99:
            share.whole = True
        elif percent is None:
            share.count, share.whole = count, True
        else:
            share.milli = percent * 10
    if TKE_MEMORY in res and not share.whole:
        share.memory_mib = 256 * quantity.integer(res[TKE_MEMORY], f"{TKE_MEMORY} (256 MiB units)", 1, 1 << 20)
    return share


def _hami(res: Json) -> _Share:
    return _vgpu(res, names.NVIDIA_GPU, HAMI_MEMORY, HAMI_MEMORY_PERCENT, HAMI_CORES)


def _volcano(res: Json) -> _Share:
    return _vgpu(res, VOLCANO_NUMBER, VOLCANO_MEMORY, VOLCANO_MEMORY_PERCENT, VOLCANO_CORES)


def _vgpu(res: Json, number: str, memory: str, percent: str, cores: str) -> _Share:
    """HAMi's protocol (Volcano's vGPU spells it with its own names): a count of GPUs, and per GPU
    the percent of its cores, its memory in MiB or in percent."""
    share = _Share()
    if number in res:
        share.count = quantity.integer(res[number], number, 1, units.MAX_GPUS_PER_NODE)
    if cores in res:
        value = quantity.integer(res[cores], cores, 0, 100)
        share.milli = max(1, value * 10)
        share.whole = value == 100 and memory not in res and percent not in res
    if memory in res and percent in res:
        raise errors.InvalidRequestError(f"give {memory} or {percent}, not both")
    if memory in res:
        share.memory_mib = quantity.integer(res[memory], f"{memory} (MiB)", 1, 1 << 30)
    if percent in res:
        share.permille = 10 * quantity.integer(res[percent], percent, 1, 100)
    if share.whole:
        share.milli = None
    return share


def _kai(annotations: Json) -> _Share:
    """KAI Scheduler's pod annotations: gpu-fraction (of one GPU) or gpu-memory (MiB), on
    gpu-fraction-num-devices GPUs (default one)."""
    share = _Share()
    if KAI_DEVICES in annotations:
        share.count = quantity.integer(annotations[KAI_DEVICES], KAI_DEVICES, 1, units.MAX_GPUS_PER_NODE)
    if KAI_FRACTION in annotations and KAI_MEMORY in annotations:
        raise errors.InvalidRequestError(f"give {KAI_FRACTION} or {KAI_MEMORY}, not both")
    if KAI_FRACTION in annotations:
        fraction = quantity.number(annotations[KAI_FRACTION], KAI_FRACTION)
        if not 0 < fraction <= 1:
            raise errors.InvalidRequestError(f"{KAI_FRACTION} must be in (0, 1], got {annotations[KAI_FRACTION]!r}")
        milli = max(1, int((fraction * units.MILLI_PER_GPU).to_integral_value()))
        share.whole = milli == units.MILLI_PER_GPU
        if not share.whole:
            share.milli, share.permille = milli, milli
    if KAI_MEMORY in annotations:
        share.memory_mib = quantity.integer(annotations[KAI_MEMORY], f"{KAI_MEMORY} (MiB)", 1, 1 << 30)
    return share


def gpu_models(annotations: Json, models: frozenset[str]) -> tuple[str, str] | None:
    """HAMi's model selectors (comma lists matched, as HAMi does, as case-insensitive parts of the
    model name) as the cluster's model names: the `sharegpu.io/gpu-models` value and an audit line,
    or None when the pod has none. `models`: the models of the cluster's inventory."""
    use = [v.strip().upper() for v in annotations.get(HAMI_USE_TYPE, "").split(",") if v.strip()]
    avoid = [v.strip().upper() for v in annotations.get(HAMI_NOUSE_TYPE, "").split(",") if v.strip()]
    for key in HAMI_UUID_SELECTORS:
        if key in annotations:
            raise errors.InvalidRequestError(
                f"{key} (choosing GPUs by UUID) is not supported; choose models with {HAMI_USE_TYPE} or "
                f"{names.MODELS}, or a node with a node selector"
            )
    if not use and not avoid:
        return None
    if names.MODELS in annotations:
        raise errors.InvalidRequestError(f"give {names.MODELS} or HAMi's GPU type selectors, not both")
    if not models:
        raise errors.InvalidRequestError("the cluster's GPU models are not known yet (no Device listed); retry")
    chosen = sorted(
        m for m in models if (not use or any(u in m.upper() for u in use)) and not any(a in m.upper() for a in avoid)
    )
    asked = ", ".join(f"{k}={annotations[k]}" for k in (HAMI_USE_TYPE, HAMI_NOUSE_TYPE) if k in annotations)
    if not chosen:
        raise errors.InvalidRequestError(
            f"{asked} leaves no GPU model of the cluster (models: {', '.join(sorted(models))})"
        )
    value = ",".join(chosen)
    return value, f"pod: {asked} -> {names.MODELS}={value}"


def _kubeshare(annotations: Json) -> tuple[_Share, int | None]:
    share = _Share()
    limit: int | None = None
    if KUBESHARE_REQUEST in annotations:
        request = quantity.number(annotations[KUBESHARE_REQUEST], KUBESHARE_REQUEST)
        if not 0 < request <= 1:
            raise errors.InvalidRequestError(
                f"{KUBESHARE_REQUEST} must be in (0, 1], got {annotations[KUBESHARE_REQUEST]!r}"
            )
        share.milli = max(1, int((request * 1000).to_integral_value()))
        share.whole = share.milli == units.MILLI_PER_GPU and KUBESHARE_MEMORY not in annotations
    if KUBESHARE_LIMIT in annotations:
        value = quantity.number(annotations[KUBESHARE_LIMIT], KUBESHARE_LIMIT)
        if not 0 < value <= 1:
            raise errors.InvalidRequestError(
                f"{KUBESHARE_LIMIT} must be in (0, 1], got {annotations[KUBESHARE_LIMIT]!r}"
            )
        limit = int((value * 1000).to_integral_value())
        if share.milli is not None and limit < share.milli:
            raise errors.InvalidRequestError(
                f"{KUBESHARE_LIMIT} ({annotations[KUBESHARE_LIMIT]}) must not be below {KUBESHARE_REQUEST} "
                f"({annotations[KUBESHARE_REQUEST]})"
            )
    if KUBESHARE_MEMORY in annotations:
        share.memory_mib = math.ceil(
            quantity.integer(annotations[KUBESHARE_MEMORY], f"{KUBESHARE_MEMORY} (bytes)", 1, 1 << 50) / 2**20
        )
    return share, limit


# ----------------------------------------------------------------- the table of readers

_RESOURCE_READERS: dict[str, Callable[[Json], _Share | None]] = {
    "sharegpu": _whole_sharegpu,
    "nvidia": _nvidia_percent,
    "koordinator": _koordinator,
    "aliyun": _aliyun,
    "tkestack": _tkestack,
    "hami": _hami,
    "volcano": _volcano,
}
"""Per format stated in a container's resources, its reader: the share asked, or None when there is
nothing to translate (a share already in sharegpu's form; a count of whole GPUs in nvidia.com/gpu).
"nvidia" is nvidia.com/gpu alone; the other formats are those of FORMATS."""
_BESIDE_NVIDIA_GPU = frozenset({"sharegpu", "nvidia", "hami"})
"""Formats not refused beside nvidia.com/gpu (HAMi counts its GPUs with it)."""
_REPLACED = (*(key for keys in FORMATS.values() for key in keys), names.NVIDIA_GPU)
"""The resources a translated container's GPU request is written over."""


def _format_of(name: str, res: Json) -> str | None:
    """The one request format of a container's resources (a key of `_RESOURCE_READERS`); None when
    it asks for no GPU."""
    formats = _formats_in(res)
    if len(formats) > 1:
        raise errors.InvalidRequestError(f"container {name} mixes GPU request formats ({', '.join(formats)}); use one")
    if formats:
        return formats[0]
    return "nvidia" if names.NVIDIA_GPU in res else None


def _formats_in(res: Json) -> list[str]:
    return [name for name, keys in FORMATS.items() if any(k in res for k in keys)]


def _asked(fmt: str, res: Json) -> str:
    """A container's GPU request in its own format's words, for the audit line."""
    if fmt == "nvidia":
        return f"{names.NVIDIA_GPU}={res[names.NVIDIA_GPU]} (percent of a GPU)"
    keys = (names.GPU, names.GPU_MILLI) if fmt == "sharegpu" else FORMATS[fmt]
    if fmt == "hami" and names.NVIDIA_GPU in res:
        keys = (names.NVIDIA_GPU, *keys)
    return ", ".join(f"{k}={res[k]}" for k in keys if k in res)


@dataclass(frozen=True, slots=True)
class _Ask:
    """A GPU request found on the pod, for one container."""

    name: str
    """The container, as audit lines and messages name it."""
    container: Json
    """Its manifest in the canonical pod (written into)."""
    share: _Share | None
    """What it asks for; None: a share already in sharegpu's form that states compute (nothing to write)."""
    asked: str = ""
    """The request in its own format's words."""


def _container_ask(name: str, container: Json, res: Json) -> _Ask | None:
    """What a container's resources ask for, read by its format's reader; None: nothing to translate
    (no GPU, whole GPUs counted in nvidia.com/gpu, a share without compute in sharegpu's form)."""
    fmt = _format_of(name, res)
    if fmt is None:
        return None
    found = _read(fmt, name, res)
    if found is not None:
        return _Ask(name, container, found, _asked(fmt, res))
    if fmt == "sharegpu" and names.GPU_MILLI in res:
        return _Ask(name, container, None)  # already canonical, and it states compute
    return None


def _read(fmt: str, name: str, res: Json) -> _Share | None:
    """The format's reader on a container's resources. Its refusals name the container, but for
    sharegpu's own names (they name the resource)."""
    reader = _RESOURCE_READERS[fmt]
    if fmt == "sharegpu":
        return reader(res)
    try:
        found = reader(res)
        if fmt not in _BESIDE_NVIDIA_GPU and names.NVIDIA_GPU in res:
            raise errors.InvalidRequestError(f"{names.NVIDIA_GPU} cannot be combined with {fmt} resources")
    except errors.InvalidRequestError as exc:
        raise errors.InvalidRequestError(f"container {name}: {exc}") from None
    return found


# ----------------------------------------------------------------- the writer


class _Translation:
    """The canonical pod being written: a copy of the author's, its annotations and containers, the
    audit lines, and what the pod-wide annotations depend on (memory ratios, which shares state compute)."""

    def __init__(self, pod: Json, typed: wire.Pod) -> None:
        self.out = copy.deepcopy(pod)
        self.had_annotations = "annotations" in (pod.get("metadata") or {})
        self.meta: Json = self.out.setdefault("metadata", {})
        self.annotations: Json = self.meta.setdefault("annotations", {})
        spec = self.out.setdefault("spec", {})
        manifests = [("initContainers", c) for c in spec.get("initContainers") or []] + [
            ("containers", c) for c in spec.get("containers") or []
        ]
        typed_containers = pods.containers(typed)
        self.containers = [
            (kind, manifest, read.resources.merged())
            for (kind, manifest), (_, read) in zip(manifests, typed_containers, strict=True)
        ]
        """(kind, manifest, resources as read) of every container, init containers first."""
        self.audit: list[str] = []
        self.permille: set[int] = set()
        self.memory_only: list[str] = []
        """Containers whose share states memory but no compute: they may burst to the whole GPU."""
        self.with_compute: list[str] = []

    def write(self, ask: _Ask) -> None:
        """Replace the container's GPU resources by the canonical ones, with an audit line."""
        share = ask.share
        if share is None:
            self.with_compute.append(ask.name)
            return
        canonical = _canonical(share)
        for table in _resources(ask.container):
            for key in _REPLACED:
                table.pop(key, None)
            table.update(canonical)
        written = ", ".join(f"{k}={v}" for k, v in canonical.items())
        self.audit.append(f"{ask.name}: {ask.asked} -> {written}")
        if share.permille:
            self.permille.add(share.permille)
        if not share.whole:
            (self.with_compute if share.milli is not None else self.memory_only).append(ask.name)

    def finish(self, models: frozenset[str]) -> None:
        """The pod-wide annotations: GPU models, the burst limit of memory-only shares, the memory ratio."""
        selected = gpu_models(self.annotations, models)
        if selected is not None:
            self.annotations[names.MODELS], line = selected
            self.audit.append(line)
        if self.memory_only:
            _burst_to_whole_gpu(self.annotations, self.memory_only, self.with_compute, self.audit)
        if self.permille:
            if len(self.permille) > 1:
                raise errors.InvalidRequestError("containers of one pod ask for different GPU memory ratios")
            self.annotations[names.MEMORY_PERMILLE] = str(self.permille.pop())
        if not self.annotations and not self.had_annotations:
            del self.meta["annotations"]  # nothing added: the canonical pod is the author's, no empty map


def _canonical(share: _Share) -> dict[str, str]:
    """The canonical resources of a share."""
    if share.whole:
        return {names.NVIDIA_GPU: str(share.count)}
    # One GPU is the default: leaving sharegpu.io/gpu out spares kube-scheduler a name check per
    # node and pod (it validates every extended resource name of a pod on every node).
    canonical = {names.GPU: str(share.count)} if share.count != 1 else {}
    canonical[names.GPU_MILLI] = str(share.milli or 1)
    if share.memory_mib:
        canonical[names.GPU_MEMORY] = str(share.memory_mib)
    return canonical


def _resources(container: Json) -> tuple[Json, Json]:
    resources = container.get("resources")
    if not isinstance(resources, dict):
        resources = container["resources"] = {}
    for part in ("limits", "requests"):
        if not isinstance(resources.get(part), dict):
            resources[part] = {}
    return resources["limits"], resources["requests"]


# ----------------------------------------------------------------- formats stated in pod annotations


def _kubeshare_pod(pod: _Translation) -> None:
    """KubeShare's annotations: the share goes to the first app container, the limit becomes the
    burst limit, the scheduling rules become sharegpu's."""
    annotations = pod.annotations
    share, limit = _kubeshare(annotations)
    if KUBESHARE_REQUEST in annotations or KUBESHARE_MEMORY in annotations:
        kai = [k for k in KAI_KEYS if k in annotations]
        if kai:
            theirs = [k for k in (KUBESHARE_REQUEST, KUBESHARE_MEMORY) if k in annotations]
            raise errors.InvalidRequestError(
                f"the pod states its GPU share twice, in KubeShare's annotations ({', '.join(theirs)}) and in KAI's "
                f"({', '.join(kai)}): keep one"
            )
        target = _annotated_target(
            pod.containers, "KubeShare annotations", "a KubeShare pod needs at least one container"
        )
        pod.write(_Ask(str(target.get("name")), target, share, "KubeShare annotations"))
        if limit is not None and not share.whole:
            annotations[names.LIMIT_MILLI] = str(limit)
    _kubeshare_rules(annotations, pod.audit)


def _kubeshare_rules(annotations: Json, audit: list[str]) -> None:
    """KubeShare's scheduling rules (affinity, anti-affinity, exclusion, GPU id) as sharegpu's annotations."""
    for source, target_key in KUBESHARE_RULES.items():
        if source not in annotations:
            continue
        if target_key in annotations and annotations[target_key] != annotations[source]:
            raise errors.InvalidRequestError(f"{source} and {target_key} disagree")
        annotations[target_key] = annotations[source]
        audit.append(f"pod: {source}={annotations[source]} -> {target_key}")


def _kai_pod(pod: _Translation) -> None:
    """KAI Scheduler's annotations: the share goes to the container they name, or the first app container."""
    annotations = pod.annotations
    share = _kai(annotations)
    wanted = annotations.get(KAI_CONTAINER)
    target = _annotated_target(
        pod.containers,
        "KAI's GPU annotations",
        f"{KAI_CONTAINER}: no container {wanted!r}" if wanted else "a KAI GPU pod needs a container",
        wanted,
    )
    asked = ", ".join(f"{k}={annotations[k]}" for k in (KAI_FRACTION, KAI_MEMORY, KAI_DEVICES) if k in annotations)
    pod.write(_Ask(str(target.get("name")), target, share, asked))


_ANNOTATION_READERS: dict[str, tuple[tuple[str, ...], Callable[[_Translation], None]]] = {
    "kubeshare": ((*KUBESHARE_KEYS, *KUBESHARE_RULES), _kubeshare_pod),
    "kai": (KAI_KEYS, _kai_pod),
}
"""Per format stated in pod annotations (after the containers' resources are read, in this order):
the annotations that mean the pod uses it, and its reader, which writes what it finds."""


def _annotated_target(
    containers: list[tuple[str, Json, Json]], source: str, none_found: str, wanted: str | None = None
) -> Json:
    """The container a share stated in pod annotations goes to: the one named `wanted`, or the
    first app container. Refused when containers state GPU resources too, or when there is none."""
    if any(_formats_in(res) or names.NVIDIA_GPU in res for _, _, res in containers):
        raise errors.InvalidRequestError(f"{source} and GPU resources on containers both ask for GPUs; use one format")
    regular = [c for kind, c, _ in containers if kind == "containers"]
    target = next((c for c in regular if c.get("name") == wanted), None) if wanted else next(iter(regular), None)
    if target is None:
        raise errors.InvalidRequestError(none_found)
    return target


def _burst_to_whole_gpu(annotations: Json, memory_only: list[str], with_compute: list[str], audit: list[str]) -> None:
    """A share stated as memory alone gets 1 milli-GPU guaranteed and may use the whole GPU: the burst
    limit (a pod annotation, so one for all its containers) says so, and the hand-off's compute caps
    follow it. A pod that also states compute for another container cannot have both."""
    if names.LIMIT_MILLI in annotations:
        return  # the author chose a burst limit
    if with_compute:
        raise errors.InvalidRequestError(
            f"container {memory_only[0]} asks for GPU memory only and container {with_compute[0]} states a compute "
            "share, but a pod has one burst limit: state a compute share for every GPU container"
        )
    annotations[names.LIMIT_MILLI] = str(units.MILLI_PER_GPU)
    audit.append(f"pod: memory only ({', '.join(memory_only)}) -> {names.LIMIT_MILLI}={units.MILLI_PER_GPU}")


# ----------------------------------------------------------------- the translation


def translate(pod: Json, models: frozenset[str] = frozenset()) -> tuple[Json, list[str]]:
    """The canonical pod and what was translated; InvalidRequestError for what cannot be. `models`:
    the GPU models of the cluster's inventory (HAMi's model selectors are matched against them)."""
    typed = wire.convert(pod, wire.Pod)  # a mistyped manifest is refused here, with the path to the field
    found = _Translation(pod, typed)
    for position, (_, container, res) in enumerate(found.containers):
        ask = _container_ask(container.get("name") or f"#{position}", container, res)
        if ask is not None:
            found.write(ask)
    for keys, read in _ANNOTATION_READERS.values():
        if any(k in found.annotations for k in keys):
            read(found)
    found.finish(models)
    return found.out, found.audit
