"""An openb trace loaded into devcluster: its nodes as fake GPU nodes (`fakecluster`, each with its
Device), its pods created one by one in the trace's order (so their creation times keep it) and
left pending for a scheduler that does not run, each GPU request in one of several formats: whole
GPUs as `nvidia.com/gpu`, shares alternately as sharegpu's `sharegpu.io/gpu-milli` and HAMi's
`nvidia.com/gpu` + `nvidia.com/gpucores` (where the share is whole percent), GPU models as
sharegpu's annotation. What `kubectl sharegpu snapshot` makes of such a cluster replays as the
trace itself does (tests/integration/test_snapshot.py, bench/snapshot_roundtrip.py).
"""

from __future__ import annotations

from typing import Any

from sharegpu.api import names, paths
from sharegpu.core import devices, units
from sharegpu.devcluster import fakecluster
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from sharegpu.sim import trace

Json = dict[str, Any]
SCHEDULER = "sharegpu-trace-loaded"
"""The loaded pods' scheduler: none runs, so they stay pending."""
HAMI_CORES = "nvidia.com/gpucores"


def pod(row: trace.TracePod, namespace: str, index: int) -> Json:
    """The trace's row as a pod (see the module docstring); `index` picks the share's format."""
    limits: dict[str, str] = {"cpu": f"{row.cpu_milli}m", "memory": f"{row.memory_mib}Mi"}
    if row.num_gpu and row.gpu_milli == units.MILLI_PER_GPU:
        limits[names.NVIDIA_GPU] = str(row.num_gpu)
    elif row.num_gpu and index % 2 and row.gpu_milli % 10 == 0:
        limits |= {names.NVIDIA_GPU: "1", HAMI_CORES: str(row.gpu_milli // 10)}
    elif row.num_gpu:
        limits[names.GPU_MILLI] = str(row.gpu_milli)
    annotations = {names.MODELS: ",".join(sorted(row.models))} if row.models and row.num_gpu else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": row.name, "namespace": namespace, "annotations": annotations},
        "spec": {
            "schedulerName": SCHEDULER,
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": limits}}],
        },
    }


async def load(
    kube: client.KubeApi,
    harness: fakecluster.FakeCluster,
    nodes: list[devices.NodeInventory],
    pods: trace.Trace,
    namespace: str,
    labels: dict[str, str] | None = None,
) -> None:
    """The nodes (labelled `labels`) and the pods, in order, into `namespace` (made if missing)."""
    await harness.add_nodes(nodes)
    for node in nodes if labels else ():
        await kube.patch(paths.node(node.name), {"metadata": {"labels": labels}})
    try:
        await kube.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    except kube_errors.ConflictError as exc:
        if not exc.already_exists:
            raise
    for index, row in enumerate(pods.pods):  # one by one: creation order is the trace's
        await kube.create(paths.pods(namespace), pod(row, namespace, index))
