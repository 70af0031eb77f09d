"""`kubectl sharegpu snapshot DIR` over the fake API server: the GPU nodes (from Devices, or from the
NVIDIA device plugin's allocatable and GPU feature discovery's labels) and the pods' GPU requests in
several formats written as an openb trace the simulator reads; anonymous unless asked; what openb
cannot hold counted; a pod sharegpu refuses left out with why; the replay says what the cluster holds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from sharegpu import cli
from sharegpu.api import dra, names, paths, wire
from sharegpu.kube import client, fake
from sharegpu.kubectl import app, snapshot
from sharegpu.sim import runner, trace
from tests.builders import MakeNode, MakePod
from tests.extender.conftest import add_node
from tests.kubectl.conftest import bound

Json = dict[str, Any]


def cluster() -> fake.FakeApiServer:
    server = fake.FakeApiServer()
    add_node(server, "n0", gpus=2, model="A100", memory=81920)
    # A node with no sharegpu agent: NVIDIA's device plugin and GPU feature discovery describe it.
    plain = MakeNode("plain").labels({snapshot.PRODUCT_LABEL: "NVIDIA-L4", snapshot.MEMORY_LABEL: "23034"})
    server.put_object(paths.NODES, plain.allocatable({"cpu": "16", "memory": "64Gi", names.NVIDIA_GPU: "4"}).obj())
    server.put_object(paths.NODES, MakeNode("cpu-only").allocatable({"cpu": "8", "memory": "32Gi"}).obj())
    server.put_object(paths.pods("ns"), bound("shared", "n0", 0, 600))
    pods = [
        MakePod("hami", "ns").container(limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4000",
                                                "nvidia.com/gpucores": "30", "cpu": "2", "memory": "4Gi"}),
        MakePod("whole", "team").container(limits={names.NVIDIA_GPU: "2", "cpu": "4", "memory": "8Gi"}),
        MakePod("aliyun", "team").container(limits={"aliyun.com/gpu-mem": "8"}),
        MakePod("bad", "team").container(limits={names.NVIDIA_GPU: "1", names.GPU_MILLI: "300"}),
        MakePod("web", "ns").node("n0").container(limits={"cpu": "1", "memory": "1Gi"}).phase("Running"),
        MakePod("elsewhere", "ns").node("cpu-only").container(limits={"cpu": "1"}).phase("Running"),
        MakePod("waiting-cpu", "ns").container(limits={"cpu": "3"}),
        MakePod("done", "ns").container(limits={names.NVIDIA_GPU: "1"}).phase("Succeeded"),
    ]  # fmt: skip
    for made in pods:
        body = made.obj()
        server.put_object(paths.pods(body["metadata"]["namespace"]), body)
    return server


def on(server: fake.FakeApiServer) -> Any:
    return app.make_app(lambda kubeconfig, context, timeout: client.KubeClient(server))


def test_a_snapshot_is_an_openb_trace_the_simulator_reads(tmp_path: Path) -> None:
    ran = CliRunner().invoke(on(cluster()), ["snapshot", str(tmp_path / "snap")])
    assert ran.exit_code == 0, ran.output
    assert "wrote 2 GPU nodes (6 GPUs)" in ran.output and "left out: 1 pods" in ran.output
    nodes = trace.load_nodes(tmp_path / "snap" / trace.NODE_FILE)
    assert [(n.name, n.gpu_count, n.gpus[0].model, n.gpus[0].memory_mib) for n in nodes] == [
        ("node-0000", 2, "A100", 81920), ("node-0001", 4, "NVIDIA-L4", 23034),
    ]  # fmt: skip
    pods = trace.load_pods(tmp_path / "snap" / trace.pod_file(snapshot.TRACE))
    assert pods.snapshot and pods.name == snapshot.TRACE
    rows = {(p.num_gpu, p.gpu_milli, p.gpu_memory_mib, p.node, p.cpu_milli) for p in pods.pods}
    assert rows == {
        (1, 600, 0, "node-0000", 100),  # sharegpu's own, bound
        (1, 300, 4000, None, 2000),  # HAMi: 30% of a GPU, 4000 MiB
        (2, 1000, 0, None, 4000),  # two whole GPUs
        (1, 1, 8192, None, 0),  # Aliyun: memory only (8 GiB): the smallest share, bursting
        (0, 0, 0, "node-0000", 1000),  # a CPU-only pod on a GPU node takes its CPU
    }, "the finished pod, the CPU pod elsewhere and the pending CPU pod are not written"
    assert all(p.name.startswith("pod-") for p in pods.pods), "anonymous by default"
    said = json.loads((tmp_path / "snap" / "snapshot.json").read_text())
    assert said["gpu_pods"] == 4 and said["bound_gpu_pods"] == 1
    (why,) = said["left_out"]
    assert why.startswith("team/bad: ") and "cannot be combined" in why
    # The replay: the simulator runs on it and says what the cluster holds now.
    replay = CliRunner().invoke(
        cli.app,
        ["simulate", "--nodes", str(tmp_path / "snap" / trace.NODE_FILE),
         "--pods", str(tmp_path / "snap" / trace.pod_file(snapshot.TRACE)), "-p", "fgd-balance", "--seeds", "42",
         "-q", "--jobs", "1"],
    )  # fmt: skip
    assert replay.exit_code == 0, replay.output
    assert "snapshot: the cluster now holds 0.6 of 6 GPUs for 1 GPU pods (90.00% unallocated)" in replay.output
    assert "3 GPU pods pending ask for 2.301 more" in replay.output


def test_names_are_kept_when_asked_and_pending_cpu_pods_written(tmp_path: Path) -> None:
    ran = CliRunner().invoke(on(cluster()), ["snapshot", str(tmp_path), "--names", "--pending-cpu-pods"])
    assert ran.exit_code == 0, ran.output
    pods = trace.load_pods(tmp_path / trace.pod_file(snapshot.TRACE))
    assert {p.name for p in pods.pods} == {"ns/shared", "ns/hami", "team/whole", "team/aliyun", "ns/web",
                                           "ns/waiting-cpu"}  # fmt: skip
    assert {n.name for n in trace.load_nodes(tmp_path / trace.NODE_FILE)} == {"n0", "plain"}


def test_what_openb_cannot_hold_is_counted_and_a_cluster_without_gpus_is_refused(tmp_path: Path) -> None:
    server = cluster()
    rules = {names.ANTI_AFFINITY: "noisy", names.GROUP: "g1"}
    server.put_object(paths.pods("ns"), MakePod("ruled", "ns").annotations(rules).container(
        limits={names.GPU_MILLI: "200"}).obj())  # fmt: skip
    listed = snapshot.Listing(
        tuple(wire.convert(n, wire.Node) for n in server.list_objects(paths.NODES)),
        tuple(wire.convert(d, wire.Device) for d in server.list_objects(paths.DEVICES)),
        tuple(server.list_objects(paths.PODS)),
    )
    found = snapshot.take(listed)
    assert found.dropped["pods with co-tenancy rules"] == 1
    assert found.dropped["pods in a shared device group"] == 1
    empty = fake.FakeApiServer()
    empty.put_object(paths.NODES, MakeNode("cpu").allocatable({"cpu": "8", "memory": "8Gi"}).obj())
    ran = CliRunner().invoke(on(empty), ["snapshot", str(tmp_path)])
    assert ran.exit_code == 1 and "no GPU nodes in this cluster" in ran.output


def test_a_resource_the_user_may_not_list_is_noted_and_the_snapshot_still_written(tmp_path: Path) -> None:
    server = cluster()
    server.fail(403, path=paths.DEVICES, reason="Forbidden")
    ran = CliRunner().invoke(on(server), ["snapshot", str(tmp_path)])
    assert ran.exit_code == 0, ran.output
    assert "not read: cannot list devices.sharegpu.io: forbidden (RBAC)" in ran.stdout.splitlines()
    # Without its Device, n0 is known by its allocatable alone: the model is not known.
    nodes = trace.load_nodes(tmp_path / trace.NODE_FILE)
    assert sorted(n.gpus[0].model for n in nodes) == ["NVIDIA-L4", "unknown"]
    said = json.loads((tmp_path / "snapshot.json").read_text())
    assert said["not_read"] == ["cannot list devices.sharegpu.io: forbidden (RBAC)"]


def test_the_replay_of_a_snapshot_gives_the_simulators_figures_for_the_same_trace(tmp_path: Path) -> None:
    """Figures on the snapshot's files equal those on files with the same rows (names do not count)."""
    ran = CliRunner().invoke(on(cluster()), ["snapshot", str(tmp_path)])
    assert ran.exit_code == 0, ran.output
    nodes, pods = tmp_path / trace.NODE_FILE, tmp_path / trace.pod_file(snapshot.TRACE)
    loaded = trace.load_pods(pods)
    renamed = tmp_path / "copy" / "openb_pod_list_copy.csv"
    renamed.parent.mkdir()
    trace.write_pods(renamed, [dataclasses.replace(p, name=f"x{i}") for i, p in enumerate(loaded.pods)])
    one = runner.execute(runner.RunSpec(runner.Source("a", str(nodes), str(pods)), "fgd-balance", 42))
    two = runner.execute(runner.RunSpec(runner.Source("b", str(nodes), str(renamed)), "fgd-balance", 42))
    assert one.unallocated_gpu_pct_at_arrived_100 == two.unallocated_gpu_pct_at_arrived_100
    assert one.curve_y == two.curve_y


def test_a_pods_claims_of_sharegpus_class_are_its_request(tmp_path: Path) -> None:
    server = cluster()
    claim: Json = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "share", "namespace": "ns"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": dra.CLASS, "count": 1, "capacity": {"requests": {dra.MILLI: "350", dra.MEMORY: "2Gi"}},
        }}]}},
    }  # fmt: skip
    server.put_object(dra.claim_path("ns"), claim)
    pod = MakePod("claimer", "ns").container(limits={"cpu": "1"}).obj()
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "share"}]
    server.put_object(paths.pods("ns"), pod)
    ran = CliRunner().invoke(on(server), ["snapshot", str(tmp_path), "--names"])
    assert ran.exit_code == 0, ran.output
    (row,) = [p for p in trace.load_pods(tmp_path / trace.pod_file(snapshot.TRACE)).pods if p.name == "ns/claimer"]
    assert (row.num_gpu, row.gpu_milli, row.gpu_memory_mib, row.cpu_milli) == (1, 350, 2048, 1000)
