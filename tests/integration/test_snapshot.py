"""`kubectl sharegpu snapshot` on the real control plane, run by real kubectl as a user who may only
read: a trace loaded into devcluster (`devcluster.traces`: its nodes as fake GPU nodes with their
Devices, its pods created in order in three request formats, with no sharegpu webhook to translate them) comes back
as a snapshot whose replay gives the simulator's figures for the trace itself, seed for seed; and
pods bound by the extender show as what the cluster holds now."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from sharegpu import cli
from sharegpu.api import paths
from sharegpu.devcluster import controlplane, fakecluster, traces
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from sharegpu.sim import runner, trace
from tests.integration.conftest import Json, account_with_role, gpu_pod, plugin, wait_for

READER = "snapshot-reader"
TRACE_NODES = 24
TRACE_PODS = 160


@pytest.fixture
async def reader_kubeconfig(admin: client.KubeClient, control_plane: controlplane.ControlPlane) -> AsyncIterator[Path]:
    """Credentials that may get and list what a snapshot reads, and nothing else."""
    rules: list[Json] = [
        {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list"]},
        {"apiGroups": ["sharegpu.io"], "resources": ["devices"], "verbs": ["get", "list"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims", "resourceclaimtemplates"],
         "verbs": ["get", "list"]},
    ]  # fmt: skip
    async with account_with_role(admin, READER, rules) as token:
        yield control_plane.token_kubeconfig(f"{READER}-{uuid.uuid4().hex[:8]}", token)


def write_trace(folder: Path, prefix: str) -> tuple[Path, Path]:
    """An openb-format trace: nodes of 2, 4 or 8 T4s (names sort in file order), pods of shares
    (multiples of 10 milli), whole GPUs and CPU only."""
    rng = np.random.default_rng(11)
    folder.mkdir(parents=True, exist_ok=True)
    nodes, pods = folder / trace.NODE_FILE, folder / trace.pod_file("loaded")
    trace.write_nodes(nodes, [
        trace.TraceNode(f"{prefix}-n{i:03d}", 64000, 262144, int(rng.choice([2, 4, 8])), "T4")
        for i in range(TRACE_NODES)
    ])  # fmt: skip
    rows = []
    for i in range(TRACE_PODS):
        kind = rng.choice(["share", "share", "whole", "cpu"])
        count, milli = (1, int(rng.choice([100, 250, 460, 500, 810]))) if kind == "share" else (0, 0)
        if kind == "whole":
            count, milli = int(rng.choice([1, 1, 2, 4])), 1000
        rows.append(trace.TracePod(f"p{i:05d}", int(rng.choice([1000, 4000, 8000])), 8192, count, milli))
    trace.write_pods(pods, rows)
    return nodes, pods


async def test_a_trace_loaded_into_devcluster_comes_back_as_a_snapshot_with_the_same_figures(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    harness: fakecluster.FakeCluster,
    namespace: str,
    reader_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    nodes_file, pods_file = write_trace(tmp_path / "trace", namespace)
    inventories = trace.load_nodes(nodes_file)
    loaded = trace.load_pods(pods_file)
    try:
        await traces.load(admin, harness, inventories, loaded, namespace, {"sharegpu.io/test": namespace})
        out = tmp_path / "snap"
        status, said, err = await plugin(
            control_plane, "snapshot", str(out), "-l", f"sharegpu.io/test={namespace}", "-n", namespace,
            "--pending-cpu-pods", kubeconfig=reader_kubeconfig,
        )  # fmt: skip
        assert status == 0, said + err
        assert f"wrote {TRACE_NODES} GPU nodes" in said and f"{TRACE_PODS} pods" in said
        snap = trace.load_pods(out / trace.pod_file("snapshot"))
        assert [(p.num_gpu, p.gpu_milli, p.cpu_milli, p.memory_mib) for p in snap.pods] == [
            (p.num_gpu, p.gpu_milli, p.cpu_milli, p.memory_mib) for p in loaded.pods
        ], "every pod, in the trace's order, with its request whatever its format"
        for seed in (42, 43):
            figures = []
            for nodes, pods in ((nodes_file, pods_file), (out / trace.NODE_FILE, out / trace.pod_file("snapshot"))):
                result = runner.execute(
                    runner.RunSpec(runner.Source(pods.stem, str(nodes), str(pods)), "fgd-balance", seed)
                )
                figures.append((result.unallocated_gpu_pct_at_arrived_100, result.placed, result.curve_y))
            assert figures[0] == figures[1], f"seed {seed}: the snapshot replays as the trace does"
        # The reader may read and nothing more: its snapshot did not need more.
        denied = await plugin(control_plane, "top", kubeconfig=reader_kubeconfig)
        assert denied[0] == 1 and "403" in denied[2]
    finally:
        for node in inventories:
            harness.inventory.pop(node.name, None)
            await admin.delete(paths.node(node.name))
            await admin.delete(f"{paths.DEVICES}/{node.name}")


async def test_pods_placed_by_the_extender_are_what_the_cluster_holds_now(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    tmp_path: Path,
) -> None:
    await nodes(2, gpus=2)
    for name, milli in (("a", 600), ("b", 700), ("c", 300)):
        await admin.create(paths.pods(namespace), gpu_pod(name, namespace, milli=milli))
    await admin.create(paths.pods(namespace), gpu_pod("big", namespace, nvidia=4))

    async def placed() -> bool:
        found, _ = await admin.list_all(paths.pods(namespace))
        return sum(1 for p in found if p["spec"].get("nodeName")) == 3

    await wait_for(placed, what="the three shares placed, the four-GPU pod waiting")
    # Pending pods have no node to select them by: the namespace keeps other tests' (their namespaces
    # may still be going away) out of what this one counts.
    status, said, err = await plugin(
        control_plane, "snapshot", str(tmp_path), "-l", f"sharegpu.io/test={namespace}", "-n", namespace
    )
    assert status == 0, said + err
    replay = CliRunner().invoke(
        cli.app,
        ["simulate", "--nodes", str(tmp_path / trace.NODE_FILE), "--pods", str(tmp_path / trace.pod_file("snapshot")),
         "-p", "fgd-balance", "--seeds", "42", "-q", "--jobs", "1"],
    )  # fmt: skip
    assert replay.exit_code == 0, replay.output
    flat = " ".join(replay.output.split())
    assert "the cluster now holds 1.6 of 4 GPUs for 3 GPU pods (60.00% unallocated)" in flat
    assert "1 GPU pods pending ask for 4 more" in flat
