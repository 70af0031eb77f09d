"""An oracle that reads only the API server: no GPU is over-committed, every bound GPU pod of the
sharegpu scheduler carries exactly one valid allocation, and every shared GPU has a reservation."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sharegpu.core import allocation
from sharegpu.kube import client, objects

Json = dict[str, Any]


async def check(kube: client.KubeClient, *, reservations: bool = True) -> dict[str, int]:
    pods, _ = await kube.list_all("/api/v1/pods")
    device_list, _ = await kube.list_all(paths.DEVICES)
    capacity = {
        (d["metadata"]["name"], g["index"]): (1000, g["memoryMiB"]) for d in device_list for g in d["spec"]["gpus"]
    }
    used: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    exclusive: dict[tuple[str, int], int] = defaultdict(int)
    tenants: dict[tuple[str, int], int] = defaultdict(int)
    live_reservations: set[tuple[str, int]] = set()
    bound = 0
    for pod in pods:
        spec, meta = pod.get("spec") or {}, pod["metadata"]
        node = spec.get("nodeName")
        if objects.is_reservation(pod):
            if node and not meta.get("deletionTimestamp"):
                live_reservations.add((node, int(meta["labels"][names.LABEL_SLOT])))
            continue
        if not node or objects.is_terminal(pod) or spec.get("schedulerName") != names.SCHEDULER_NAME:
            continue
        if not objects.wants_gpu(pod):
            continue
        bound += 1
        text = (meta.get("annotations") or {}).get(names.ALLOCATION)
        assert text, f"bound pod {objects.pod_key(pod)} has no allocation"
        alloc = allocation.Allocation.from_json(text, pod=objects.pod_key(pod))
        assert alloc.node == node, f"{objects.pod_key(pod)}: allocation says {alloc.node}, bound to {node}"
        for index, (milli, memory) in alloc.gpu_usage().items():
            used[(node, index)][0] += milli
            used[(node, index)][1] += memory
            tenants[(node, index)] += 1
            if alloc.exclusive:
                exclusive[(node, index)] += 1
    for where, (milli, memory) in used.items():
        cap_milli, cap_memory = capacity[where]
        assert milli <= cap_milli, f"{where}: {milli} milli allocated of {cap_milli}"
        assert memory <= cap_memory, f"{where}: {memory} MiB allocated of {cap_memory}"
        if exclusive[where]:
            assert tenants[where] == 1, f"{where}: a whole GPU is shared by {tenants[where]} pods"
        elif reservations:
            assert where in live_reservations, f"{where} is shared but held by no reservation pod"
    return {"bound": bound, "gpus_in_use": len(used)}
