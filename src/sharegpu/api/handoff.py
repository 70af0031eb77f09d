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
- NVIDIA MPS limits: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
  ("0=4096M,1=4096M").

`variables` says which keys a container reads; the webhook adds exactly those env references
(`reference`), and the extender writes exactly those keys (`values`), both from this one function.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, Final

from sharegpu.api import names, wire
from sharegpu.core import allocation, units

VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
SM_LIMIT: Final = "CUDA_DEVICE_SM_LIMIT"
MEMORY_LIMIT: Final = "CUDA_DEVICE_MEMORY_LIMIT"
MPS_THREADS: Final = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_MEMORY: Final = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
NO_GPU: Final = "void"
"""NVIDIA_VISIBLE_DEVICES of a container sharegpu gives no GPU: the NVIDIA container runtime then
mounts no GPU into it (CUDA base images set "all", which would otherwise expose every GPU of the
node to a pod that asked for none)."""
REQUIRED: Final = frozenset({VISIBLE_DEVICES})
"""Variables a container cannot start without; the limits are optional references."""

PROTECTED: Final = frozenset(
    {
        VISIBLE_DEVICES,
        SM_LIMIT,
        MEMORY_LIMIT,
        MPS_THREADS,
        MPS_MEMORY,
        "NVIDIA_DRIVER_CAPABILITIES",
        "CUDA_VISIBLE_DEVICES",
    }
)
"""Variables only the system may set on a container (see `is_protected`)."""


def is_protected(variable: str) -> bool:
    return variable in PROTECTED or variable.startswith(f"{MEMORY_LIMIT}_")


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


def variables(gpu_count: int, limits_memory: bool) -> tuple[str, ...]:
    """The hand-off variables of a container with `gpu_count` shared GPUs."""
    out = [VISIBLE_DEVICES, SM_LIMIT, MPS_THREADS]
    if limits_memory:
        out += [MEMORY_LIMIT] if gpu_count == 1 else [f"{MEMORY_LIMIT}_{i}" for i in range(gpu_count)]
        out.append(MPS_MEMORY)
    return tuple(out)


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


def values(grants: Sequence[allocation.DeviceGrant], uuid_of: dict[int, str]) -> dict[str, str]:
    """The variables of one container from its grants (`uuid_of`: GPU index -> UUID)."""
    limits_memory = any(g.memory_mib for g in grants)
    wanted = variables(len(grants), limits_memory)
    percent = max(1, max((g.limit_milli for g in grants), default=units.MILLI_PER_GPU) * 100 // units.MILLI_PER_GPU)
    env = {
        VISIBLE_DEVICES: ",".join(uuid_of[g.index] for g in grants),
        SM_LIMIT: str(percent),
        MPS_THREADS: str(percent),
    }
    if limits_memory:
        if len(grants) == 1:
            env[MEMORY_LIMIT] = f"{grants[0].memory_mib}m"
        else:
            for position, grant in enumerate(grants):
                env[f"{MEMORY_LIMIT}_{position}"] = f"{grant.memory_mib}m"
        env[MPS_MEMORY] = ",".join(f"{position}={grant.memory_mib}M" for position, grant in enumerate(grants))
    assert set(env) == set(wanted), "hand-off values and variables disagree"
    return env


def data(alloc: allocation.Allocation, uuid_of: dict[int, str]) -> dict[str, str]:
    """The hand-off ConfigMap's data for a pod's allocation: `<container>.<VARIABLE>` keys."""
    out: dict[str, str] = {}
    for container in alloc.containers:
        for variable, value in values(container.devices, uuid_of).items():
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
