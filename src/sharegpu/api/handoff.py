"""The device hand-off contract between the admission webhook and the extender.

A sharing pod cannot get its GPU from the device plugin (a reservation pod holds it), so the system
tells its containers through a ConfigMap the pod is given at admission (its name is in the pod's
`sharegpu.io/handoff-configmap` annotation; it cannot depend on the pod's name or UID, which may
not exist yet). Per container, keys `<container>.<VARIABLE>`:

- NVIDIA_VISIBLE_DEVICES: the UUIDs the reservation pods reported (required: the container waits
  for it);
- HAMi-core limits: CUDA_DEVICE_SM_LIMIT (percent of the GPU's compute, from the burst limit) and
  CUDA_DEVICE_MEMORY_LIMIT (MiB with suffix "m"; per device as CUDA_DEVICE_MEMORY_LIMIT_<i> when a
  container has several GPUs);
- SHAREGPU_PRELOAD: HAMI_LIBRARY where the node has HAMi-core's library (the agent installs it in
  `HAMI_HOST_DIR`), else empty; always written. For a pod that demands isolation hami-core the
  webhook makes each GPU container's LD_PRELOAD read it first (`preload_wiring`, keeping what the
  author preloads) and mounts the node's directory read-only, so the limits below take effect in every
  process of the container (other pods get the limits; an image must bring HAMi-core to apply them);
- NVIDIA MPS limits: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
  ("0=4096M,1=4096M").

The node-side folders such a pod needs (its GPU's MPS tenant folder, the node's HAMi-core library)
are not hostPaths: the webhook gives the pod inline CSI volumes of the agent's driver
(`names.VOLUMES_DRIVER`; `mps_volume`, `hami_volume`), which the agent binds read-only from what it
knows of the pod (`agent.volumes`), so the pod's namespace can stay PodSecurity `restricted`.

`variables` says which keys a container may read; the webhook adds exactly those env references
(`reference`; all but NVIDIA_VISIBLE_DEVICES optional), and the extender writes those of them that
the pod's node enforces (`values`, by `Enforcement`): HAMi-core's limits only where the node has the
library (and the pod did not demand mps), MPS's only where it runs MPS daemons and the pod was wired
to them at admission (it demanded isolation mps: `mps_wiring`). A limit the node cannot apply is not
written at all.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from sharegpu.api import names, wire
from sharegpu.core import allocation, devices, units

VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
SM_LIMIT: Final = "CUDA_DEVICE_SM_LIMIT"
MEMORY_LIMIT: Final = "CUDA_DEVICE_MEMORY_LIMIT"
MPS_THREADS: Final = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_MEMORY: Final = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
MPS_PIPE: Final = "CUDA_MPS_PIPE_DIRECTORY"
MPS_LOG: Final = "CUDA_MPS_LOG_DIRECTORY"
MPS_VOLUME: Final = "sharegpu-mps"
"""The prefix of a pod's MPS volumes: one per wired container, `sharegpu-mps-<position>`."""
MPS_HOST_ROOT: Final = "/run/sharegpu/mps"
"""On the node: one directory per GPU UUID, holding `pipe/` and `log/` of its MPS control daemon."""
MPS_MOUNT: Final = "/run/sharegpu/mps"
"""In a container: its GPU's tenant folder (`<MPS_HOST_ROOT>/<uuid>/<MPS_TENANT>`), read-only."""
MPS_TENANT: Final = "tenant"
"""In a GPU's MPS directory: the folder its tenants mount. It holds `pipe/control` alone, a hard link
to the daemon's control socket: no `control_privileged` (so a tenant cannot quit the daemon or change
its limits), no log, nothing a tenant can write (`agent.mps`)."""
MPS_CLIENT_PIPE: Final = f"{MPS_MOUNT}/pipe"
"""In a container: CUDA_MPS_PIPE_DIRECTORY, where the daemon's control socket is linked."""
PRELOAD: Final = "SHAREGPU_PRELOAD"
"""The library a container preloads (HAMI_LIBRARY, or empty where the node has no HAMi-core)."""
LD_PRELOAD: Final = "LD_PRELOAD"
AUTHOR_PRELOAD: Final = "SHAREGPU_AUTHOR_LD_PRELOAD"
"""An author's LD_PRELOAD read from a source (valueFrom), renamed so LD_PRELOAD can compose it."""
HAMI_VOLUME: Final = "sharegpu-hami-core"
HAMI_HOST_DIR: Final = "/run/sharegpu/hami-core"
"""On the node: where the agent installs HAMi-core's library for containers to preload."""
HAMI_MOUNT: Final = "/run/sharegpu/hami-core"
HAMI_LIBRARY: Final = f"{HAMI_MOUNT}/libvgpu.so"
"""The library's path in a container (`HAMI_HOST_DIR` mounted read-only at `HAMI_MOUNT`)."""
NO_GPU: Final = "void"
"""NVIDIA_VISIBLE_DEVICES of a container sharegpu gives no GPU: the NVIDIA container runtime then
mounts no GPU into it (CUDA base images set "all", which would otherwise expose every GPU of the
node to a pod that asked for none)."""
FORGED_REASON: Final = "HandoffForged"
"""The Warning event on a pod whose hand-off ConfigMap sharegpu found written by someone else."""
REQUIRED: Final = frozenset({VISIBLE_DEVICES})
"""Variables a container cannot start without; the limits are optional references."""

PROTECTED: Final = frozenset(
    {
        VISIBLE_DEVICES,
        SM_LIMIT,
        MEMORY_LIMIT,
        MPS_THREADS,
        MPS_MEMORY,
        PRELOAD,
        "NVIDIA_DRIVER_CAPABILITIES",
        "CUDA_VISIBLE_DEVICES",
    }
)
"""Variables only the system may set on a container (see `is_protected`)."""


NVIDIA_PREFIX: Final = "NVIDIA_"
"""Variables the NVIDIA container toolkit reads when it makes a container: which GPUs, MIG devices,
IMEX channels and driver capabilities the container gets. Only sharegpu sets them, but for these."""
TENANT_NVIDIA: Final = ("NVIDIA_REQUIRE_", "NVIDIA_DISABLE_REQUIRE")
"""NVIDIA_* variables a tenant may set (prefixes): requirements, which can only keep its own
container from starting."""
PROTECTED_PREFIXES: Final = (NVIDIA_PREFIX, f"{MEMORY_LIMIT}_")


def is_protected(variable: str) -> bool:
    """Whether only the system may set `variable` on a container: the hand-off's variables, and every
    NVIDIA_* one but the requirements (`TENANT_NVIDIA`)."""
    if variable in PROTECTED or variable.startswith(f"{MEMORY_LIMIT}_"):
        return True
    return variable.startswith(NVIDIA_PREFIX) and not variable.startswith(TENANT_NVIDIA)


def safe_prefix(prefix: str) -> bool:
    """Whether every variable envFrom loads under `prefix` is one a tenant may set: no protected name
    or family can begin with it, and it does not begin one."""
    if any(prefix.startswith(family) for family in PROTECTED_PREFIXES):
        return False
    return not any(name.startswith(prefix) for name in (*PROTECTED, *PROTECTED_PREFIXES))


def no_gpu(container: dict[str, Any]) -> bool:
    """Make a container see no GPU (`NO_GPU`), replacing what its author set; whether it changed."""
    env = list(container.get("env") or [])
    kept = [e for e in env if e.get("name") != VISIBLE_DEVICES]
    kept.append({"name": VISIBLE_DEVICES, "value": NO_GPU})
    if kept == env:
        return False
    container["env"] = kept
    return True


def hides_gpus(env: wire.EnvVar) -> bool:
    """Whether `env` is the literal NVIDIA_VISIBLE_DEVICES=void (it only takes GPUs away)."""
    return env.name == VISIBLE_DEVICES and env.value == NO_GPU and env.value_from is None


def variables(gpu_count: int, limits_memory: bool, preload: bool = False) -> tuple[str, ...]:
    """The hand-off variables a container with `gpu_count` shared GPUs may read (`preload`: it preloads
    what SHAREGPU_PRELOAD names)."""
    out = [VISIBLE_DEVICES, SM_LIMIT, MPS_THREADS]
    if preload:
        out.append(PRELOAD)
    if limits_memory:
        out += [MEMORY_LIMIT] if gpu_count == 1 else [f"{MEMORY_LIMIT}_{i}" for i in range(gpu_count)]
        out.append(MPS_MEMORY)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Enforcement:
    """Which limits a pod's node applies, so the hand-off holds those and no others."""

    hami_core: bool = False
    """The node has HAMi-core's library (and the pod demanded no other mode): SHAREGPU_PRELOAD names
    it, CUDA_DEVICE_SM_LIMIT and CUDA_DEVICE_MEMORY_LIMIT* are its limits."""
    mps: bool = False
    """The node runs MPS daemons and the pod is wired to them: CUDA_MPS_*."""

    @classmethod
    def of(cls, offered: frozenset[devices.Isolation], demanded: devices.Isolation | None) -> Enforcement:
        return cls(
            hami_core=devices.Isolation.HAMI_CORE in offered and demanded in (None, devices.Isolation.HAMI_CORE),
            mps=devices.Isolation.MPS in offered and demanded is devices.Isolation.MPS,
        )


EVERY_LIMIT: Final = Enforcement(hami_core=True, mps=True)


def mps_wiring(container: dict[str, Any], volume: str) -> None:
    """Wire a container to the MPS daemon of the GPU it will get: the pod volume `volume` (`mps_volume`:
    that GPU's tenant folder, bound by the agent) mounted read-only at `MPS_MOUNT`, and the MPS
    client's pipe directory pointing there."""
    env = [e for e in container.get("env") or [] if e.get("name") not in (MPS_PIPE, MPS_LOG)]
    env.append({"name": MPS_PIPE, "value": MPS_CLIENT_PIPE})
    container["env"] = env
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("mountPath") != MPS_MOUNT]
    mounts.append({"name": volume, "mountPath": MPS_MOUNT, "readOnly": True})
    container["volumeMounts"] = mounts


def preload_wiring(container: dict[str, Any]) -> str | None:
    """Make a container preload what SHAREGPU_PRELOAD names (its hand-off reference must come earlier
    in `env`), before anything its author preloads, and mount the node's HAMi-core directory read-only.
    LD_PRELOAD goes last in `env` so the references it reads are defined; returns the author's
    LD_PRELOAD when it changed shape (for the audit note)."""
    env = list(container.get("env") or [])
    author = next((e for e in env if e.get("name") == LD_PRELOAD), None)
    kept = [e for e in env if e.get("name") != LD_PRELOAD]
    ours = f"$({PRELOAD})"
    noted: str | None = None
    if author is not None and "valueFrom" in author:
        kept = [e for e in kept if e.get("name") != AUTHOR_PRELOAD]
        kept.append({**author, "name": AUTHOR_PRELOAD})
        rest, noted = f"$({AUTHOR_PRELOAD})", f"valueFrom (now {AUTHOR_PRELOAD})"
    else:
        rest = str((author or {}).get("value") or "")
        if rest.split(" ", 1)[0] == ours:  # wired already (the webhook invoked again)
            rest = rest[len(ours) :].strip()
        elif rest:
            noted = rest
    kept.append({"name": LD_PRELOAD, "value": f"{ours} {rest}".strip()})
    container["env"] = kept
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != HAMI_VOLUME]
    mounts.append({"name": HAMI_VOLUME, "mountPath": HAMI_MOUNT, "readOnly": True})
    container["volumeMounts"] = mounts
    return noted


VOLUME_FOLDER: Final = "folder"
"""The attribute of a volume of the agent's driver that says which folder it is (`FOLDER_*`)."""
VOLUME_CONTAINER: Final = "container"
"""The attribute of an MPS volume that names the container it is for (its GPU's folder is bound)."""
FOLDER_MPS: Final = "mps"
FOLDER_HAMI_CORE: Final = "hami-core"


def _node_folder(name: str, attributes: dict[str, str]) -> dict[str, Any]:
    """A pod volume the agent binds read-only from the node (`agent.volumes`)."""
    return {"name": name, "csi": {"driver": names.VOLUMES_DRIVER, "readOnly": True, "volumeAttributes": attributes}}


def hami_volume() -> dict[str, Any]:
    """The pod volume `preload_wiring` mounts: the node's installed library (a pod that demands
    hami-core is placed only where the agent installed it)."""
    return _node_folder(HAMI_VOLUME, {VOLUME_FOLDER: FOLDER_HAMI_CORE})


def mps_volume(volume: str, container: str) -> dict[str, Any]:
    """The pod volume `volume` that `mps_wiring` mounts in container `container`: the tenant folder of
    the GPU that container holds."""
    return _node_folder(volume, {VOLUME_FOLDER: FOLDER_MPS, VOLUME_CONTAINER: container})


def with_volume(spec: dict[str, Any], volume: dict[str, Any]) -> None:
    """Add (or replace) a pod volume by name."""
    kept = [v for v in spec.get("volumes") or [] if v.get("name") != volume["name"]]
    spec["volumes"] = [*kept, volume]


def mps_directory(uuid: str) -> str:
    """A GPU's directory under `MPS_HOST_ROOT` (one path component: an old-style MIG UUID's slashes
    become underscores)."""
    return uuid.replace("/", "_")


def percent_of(grants: Sequence[allocation.DeviceGrant]) -> int:
    """The compute ceiling a container's grants give it, in percent (the largest burst limit; at least 1):
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_DEVICE_SM_LIMIT."""
    return max(1, max((g.limit_milli for g in grants), default=units.MILLI_PER_GPU) * 100 // units.MILLI_PER_GPU)


def mps_tenant_folder(uuid: str, root: str = MPS_HOST_ROOT) -> str:
    """The host folder a tenant of GPU `uuid`'s daemon mounts (`MPS_TENANT` in its directory under
    `root`, the agent's MPS folder)."""
    return f"{root}/{mps_directory(uuid)}/{MPS_TENANT}"


def key(container: str, variable: str) -> str:
    """The ConfigMap key a container's variable is read from."""
    return f"{container}.{variable}"


def new_name() -> str:
    """A fresh ConfigMap name (random: at admission no pod name or UID need exist)."""
    return names.HANDOFF_PREFIX + secrets.token_hex(8)


def reference(configmap: str, container: str, variable: str) -> dict[str, Any]:
    """The env entry that reads `variable` from the hand-off ConfigMap."""
    return {
        "name": variable,
        "valueFrom": {
            "configMapKeyRef": {
                "name": configmap,
                "key": key(container, variable),
                "optional": variable not in REQUIRED,
            }
        },
    }


def is_reference(env: wire.EnvVar, configmap: str | None, container: str) -> bool:
    """Whether `env` reads its value from the hand-off ConfigMap `configmap` under the right key."""
    ref = env.value_from.config_map_key_ref if env.value_from is not None else None
    return configmap is not None and ref is not None and ref.name == configmap and ref.key == key(container, env.name)


def values(grants: Sequence[allocation.DeviceGrant], uuid_of: dict[int, str], enforce: Enforcement) -> dict[str, str]:
    """The variables of one container from its grants (`uuid_of`: GPU index -> UUID), with the limits
    its node enforces (`enforce`)."""
    limits_memory = any(g.memory_mib for g in grants)
    percent = percent_of(grants)
    env = {VISIBLE_DEVICES: ",".join(uuid_of[g.index] for g in grants), PRELOAD: ""}
    if enforce.hami_core:
        env[PRELOAD] = HAMI_LIBRARY
        env[SM_LIMIT] = str(percent)
        if limits_memory and len(grants) == 1:
            env[MEMORY_LIMIT] = f"{grants[0].memory_mib}m"
        elif limits_memory:
            for position, grant in enumerate(grants):
                env[f"{MEMORY_LIMIT}_{position}"] = f"{grant.memory_mib}m"
    if enforce.mps:
        env[MPS_THREADS] = str(percent)
        if limits_memory:
            env[MPS_MEMORY] = ",".join(f"{position}={grant.memory_mib}M" for position, grant in enumerate(grants))
    every = variables(len(grants), limits_memory, preload=True)
    assert set(env) <= set(every), "hand-off values and variables disagree"
    return env


def data(alloc: allocation.Allocation, uuid_of: dict[int, str], enforce: Enforcement) -> dict[str, str]:
    """The hand-off ConfigMap's data for a pod's allocation: `<container>.<VARIABLE>` keys."""
    out: dict[str, str] = {}
    for container in alloc.containers:
        for variable, value in values(container.devices, uuid_of, enforce).items():
            out[key(container.name, variable)] = value
    return out


def configmap(name: str, namespace: str, owner: str, owner_uid: str, content: dict[str, str]) -> dict[str, Any]:
    """The ConfigMap body, owned by the pod it serves (it goes when the pod goes)."""
    body = wire.ConfigMap(
        metadata=wire.ObjectMeta(
            name=name,
            namespace=namespace,
            labels={names.LABEL_ROLE: names.ROLE_HANDOFF},
            owner_references=[wire.OwnerReference(api_version="v1", kind="Pod", name=owner, uid=owner_uid)],
        ),
        data=content,
    )
    return {"apiVersion": "v1", "kind": "ConfigMap", **wire.encode(body)}
