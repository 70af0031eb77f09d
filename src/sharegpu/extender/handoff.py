"""The device hand-off: what a sharing pod's containers must see, written into its ConfigMap.

A sharing pod cannot get its GPU from the device plugin (the reservation pod holds it), so the
system tells it: NVIDIA_VISIBLE_DEVICES (the UUIDs the reservation pods reported) plus the limits an
enforcement layer reads, per container:

- HAMi-core: CUDA_DEVICE_MEMORY_LIMIT (MiB, suffix "m"; per device with _<i>) and
  CUDA_DEVICE_SM_LIMIT (percent of the GPU's compute, from the burst limit);
- NVIDIA MPS: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=4096M").

Keys are `<container>.<VARIABLE>` so one ConfigMap serves every container of the pod; the admission
webhook adds the matching `env.valueFrom.configMapKeyRef` entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from sharegpu.core import allocation

VARIABLES = (
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)


def container_env(grants: Sequence[allocation.DeviceGrant], uuid_of: dict[int, str]) -> dict[str, str]:
    """Environment for one container from its grants (`uuid_of`: GPU index -> UUID)."""
    env = {"NVIDIA_VISIBLE_DEVICES": ",".join(uuid_of[g.index] for g in grants)}
    percent = max(1, max((g.limit_milli for g in grants), default=1000) // 10)
    env["CUDA_DEVICE_SM_LIMIT"] = str(percent)
    env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)
    if any(g.memory_mib for g in grants):
        if len(grants) == 1:
            env["CUDA_DEVICE_MEMORY_LIMIT"] = f"{grants[0].memory_mib}m"
        else:
            for position, grant in enumerate(grants):
                env[f"CUDA_DEVICE_MEMORY_LIMIT_{position}"] = f"{grant.memory_mib}m"
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
            f"{position}={grant.memory_mib}M" for position, grant in enumerate(grants)
        )
    return env


def configmap_data(alloc: allocation.Allocation, uuid_of: dict[int, str]) -> dict[str, str]:
    """The hand-off ConfigMap's data for a pod: `<container>.<VARIABLE>` keys."""
    data: dict[str, str] = {}
    for container in alloc.containers:
        for name, value in container_env(container.devices, uuid_of).items():
            data[f"{container.name}.{name}"] = value
    return data
