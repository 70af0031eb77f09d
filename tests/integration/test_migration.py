"""Other systems' own manifests (tests/integration/manifests, byte for byte from their READMEs and user
guides; SOURCE.md says where from), applied with kubectl to the real control plane with the webhook
registered: each pod is placed by sharegpu whatever scheduler it names, runs, and holds what its
author asked for, with its hand-off when it shares a GPU; or it is refused with a message that says
what to fix. Every system sharegpu replaces is replayed: HAMi, Koordinator, Volcano, KAI Scheduler,
Aliyun gpushare and tkestack (KubeShare and shared-device-group: test_compat.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sharegpu.api import names, paths, quantity, wire
from sharegpu.devcluster import controlplane, fakecluster, stack
from sharegpu.kube import client
from tests.integration.conftest import MANIFESTS, RunningWebhook, get_or_none, kubectl, wait_for

Json = dict[str, Any]


@dataclass(frozen=True)
class Held:
    """What each pod of a manifest must hold: GPUs, and per GPU compute (None: whole GPUs) and MiB."""

    gpus: int
    milli: int | None = None
    memory_mib: int = 0
    pods: int = 1


CASES = {
    "hami/default_use.yaml": Held(1, 300, 3000),
    "hami/readme-submit-task.yaml": Held(2, 300, 3000),
    "koordinator/gpu-share-with-hami.yaml": Held(1, 500),  # memory as a ratio: 50% of the GPU it lands on
    "koordinator/fine-grained-device-scheduling.yaml": Held(1),  # kubernetes.io/gpu: "100" is one whole GPU
    "volcano/how_to_use_vgpu.yaml": Held(2, 500, 2000),
    "kai/gpu-sharing.yaml": Held(1, 500),
    "kai/gpu-memory.yaml": Held(1, 1, 2000),  # memory only: the least compute guarantee, may burst to all
}


@pytest.fixture(scope="module")
async def gpu_nodes(harness: fakecluster.FakeCluster) -> None:
    """Nodes enough for every manifest (they select no node, so any GPU node of the cluster may do)."""
    from sharegpu.core import devices

    made = [devices.uniform_node(f"migration-{i}", gpu_count=4, model="T4", gpu_memory_mib=16384, cpu_milli=64000,
                                 memory_mib=256 * 1024) for i in range(3)]  # fmt: skip
    await harness.add_nodes(made)


async def _running(admin: client.KubeClient, namespace: str, count: int) -> list[Json] | None:
    listed = await admin.get(paths.pods(namespace))
    items = [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]
    ok = len(items) == count and all(p["status"].get("phase") == "Running" for p in items)
    return items if ok else None


def _held(pod: Json) -> Held:
    limits: dict[str, str] = {}
    for container in pod["spec"]["containers"]:
        limits.update((container.get("resources") or {}).get("limits") or {})
    count = {k: int(quantity.parse(v)) for k, v in limits.items() if k in names.GPU_RESOURCES}  # "3000" reads "3k"
    if names.NVIDIA_GPU in count:
        return Held(count[names.NVIDIA_GPU])
    return Held(count.get(names.GPU, 1), count[names.GPU_MILLI], count.get(names.GPU_MEMORY, 0))  # no gpu: one


async def _emptied(admin: client.KubeClient, namespace: str) -> bool:
    return not (await admin.get(paths.pods(namespace)))["items"]


async def _filled(admin: client.KubeClient, path: str) -> Json | None:
    found = await get_or_none(admin, path)
    return found if found is not None and found.get("data") else None


async def _check(admin: client.KubeClient, pods_: list[Json], held: Held) -> None:
    for pod in pods_:
        assert pod["spec"]["schedulerName"] == names.SCHEDULER_NAME
        assert _held(pod) == Held(held.gpus, held.milli, held.memory_mib), pod["metadata"]["name"]
        if held.milli is None:
            continue
        handoff = paths.configmap(pod["metadata"]["namespace"], pod["metadata"]["annotations"][names.HANDOFF])
        data = (await wait_for(functools.partial(_filled, admin, handoff), what=f"hand-off {handoff}"))["data"]
        container = next(c for c in pod["spec"]["containers"] if names.GPU_MILLI in c["resources"]["limits"])["name"]
        visible = data[f"{container}.NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(visible) == held.gpus and all(v.startswith("GPU-") for v in visible), data
        allocation = wire.convert(pod, wire.Pod).metadata.annotations[names.ALLOCATION]
        assert pod["spec"]["nodeName"] in allocation


@pytest.mark.parametrize("manifest", sorted(CASES))
async def test_a_systems_own_manifest_runs_on_sharegpu(
    manifest: str,
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: stack.ExtenderProcess,
    namespace: str,
    gpu_nodes: None,
    webhook: RunningWebhook,
) -> None:
    held = CASES[manifest]
    path = MANIFESTS / manifest
    pinned = "namespace: default" in path.read_text()  # Koordinator's manual names its namespace
    where = "default" if pinned else namespace
    await kubectl(control_plane, "apply", *([] if pinned else ["-n", namespace]), "-f", str(path))
    try:
        running = await wait_for(functools.partial(_running, admin, where, held.pods), what=f"{manifest} running")
        await _check(admin, running, held)
    finally:
        if pinned:
            await kubectl(control_plane, "delete", "-f", str(path), "--grace-period=0", "--force", ok=False)

            await wait_for(functools.partial(_emptied, admin, "default"), what="the default namespace emptied")


async def test_aliyuns_statefulset_needs_only_its_retired_api_version_changed(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: stack.ExtenderProcess,
    namespace: str,
    gpu_nodes: None,
    webhook: RunningWebhook,
    tmp_path: Path,
) -> None:
    """Aliyun's user guide writes `apps/v1beta1`, which Kubernetes stopped serving in 1.16: kubectl
    refuses it before sharegpu is asked. With `apps/v1` (the only change), its 3 pods of 3 GiB each
    run, each with its hand-off."""
    original = MANIFESTS / "aliyun" / "userguide.yaml"
    code, text = await kubectl(control_plane, "apply", "-n", namespace, "-f", str(original), ok=False)
    assert code != 0 and 'no matches for kind "StatefulSet" in version "apps/v1beta1"' in text, text
    current = tmp_path / "userguide.yaml"
    current.write_text(original.read_text().replace("apiVersion: apps/v1beta1", "apiVersion: apps/v1", 1))
    await kubectl(control_plane, "apply", "-n", namespace, "-f", str(current))
    running = await wait_for(functools.partial(_running, admin, namespace, 3), what="the StatefulSet's 3 pods")
    await _check(admin, running, Held(1, 1, 3072))


async def test_tkestacks_examples_are_refused_by_kubernetes_and_run_once_quoted(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: stack.ExtenderProcess,
    namespace: str,
    gpu_nodes: None,
    webhook: RunningWebhook,
    tmp_path: Path,
) -> None:
    """gpu-manager's README writes numbers where Kubernetes wants strings (the command's `- 10`, the
    annotation `tencent.com/vcuda-core-limit: 50`): kubectl or the API server refuses both examples
    before sharegpu is asked, naming the field. With those quoted (the only change), the share (vcuda-core 50,
    vcuda-memory 30 x 256 MiB) and the two whole GPUs (vcuda-core 200) run."""
    for name, held in (("readme-share.yaml", Held(1, 500, 7680)), ("readme-whole.yaml", Held(2))):
        original = MANIFESTS / "tkestack" / name
        code, text = await kubectl(control_plane, "apply", "-n", namespace, "-f", str(original), ok=False)
        # kubectl itself refuses the numeric annotation; the API server refuses the numeric command
        # (1.20 says `Container.Command: []string`, later releases `containers.command of type string`).
        refusals = ("annotations of type string", "Container.Command: []string", "containers.command of type string")
        assert code != 0 and any(r in text for r in refusals), text
        quoted = tmp_path / name
        fixed = original.read_text().replace("- 10\n", '- "10"\n').replace("limit: 50\n", 'limit: "50"\n')
        quoted.write_text(fixed)
        await kubectl(control_plane, "apply", "-n", namespace, "-f", str(quoted))
        running = await wait_for(functools.partial(_running, admin, namespace, 1), what=f"tkestack {name}")
        await _check(admin, running, held)
        await kubectl(control_plane, "delete", "-n", namespace, "-f", str(quoted), "--grace-period=0", "--force")
        await wait_for(functools.partial(_emptied, admin, namespace), what="the pod gone")
