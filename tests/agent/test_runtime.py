"""The agent over the fake API server and the fake NVML: the Device appears owned by its node,
follows the file (a GPU unhealthy by XID or NVML error, a GPU gone while held), and the node's
labels follow."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from sharegpu.agent import draplugin, hamicore, inventory, mps, podresources, proof, watchdog
from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.cuda import probe as cudaprobe
from sharegpu.agent.fakes import kubelet as fakekubelet
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import devices as api_devices
from sharegpu.api import dra, events, names, paths, resources, wire
from sharegpu.api import groups as api_groups
from sharegpu.kube import client, fake
from tests.agent import cudastubs, drakubelet
from tests.agent.conftest import gone
from tests.agent.fake_mps_daemon import write_fake_daemon
from tests.builders import (
    NVML_FILE,
    NVML_PROCESSES,
    Json,
    MakeAllocation,
    MakeClaim,
    MakeNode,
    MakePod,
    nvml_with,
    write_bytes,
    write_nvml,
)
from tests.conftest import eventually
from tests.extender.conftest import settle


def running(pod: MakePod) -> Json:
    """The pod running on n0 in its one container."""
    return pod.node("n0").container().phase("Running").obj()


async def first_pass(agent: agent_runtime.Agent) -> None:
    """The pass `start` began (with probes, it takes a while) has ended: the test's own passes run alone."""
    for _ in range(1000):
        if agent.loop.completed:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the agent's first pass did not end")


async def one_pass(agent: agent_runtime.Agent, server: fake.FakeApiServer) -> wire.Device:
    if agent.tasks:  # started: its own first pass ends before this one begins
        await first_pass(agent)
    await settle(server)
    await agent.reconcile()
    stored = server.get_object(paths.device("n0"))
    assert stored is not None
    return wire.convert(stored, wire.Device)


async def test_the_agent_publishes_and_keeps_its_nodes_device(tmp_path: Path) -> None:
    server = fake.FakeApiServer()
    node = server.put_object(paths.NODES, MakeNode("n0").obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    agent = agent_runtime.Agent(
        client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), agent_runtime.Options(interval=3600)
    )
    await agent.start()
    try:
        device = await one_pass(agent, server)
        assert [g.uuid for g in device.spec.gpus] == ["GPU-0", "GPU-1", "GPU-2"]
        assert device.spec.nvlinks == [(0, 1)] and device.spec.gpus[0].pcie_switch == 0
        assert [(r.kind, r.name, r.uid) for r in device.metadata.owner_references] == [
            ("Node", "n0", node["metadata"]["uid"])
        ]
        labels = (server.get_object(paths.node("n0")) or {})["metadata"]["labels"]
        assert labels[inventory.COUNT_LABEL] == "3" and labels[inventory.MODEL_LABEL] == "NVIDIA-A100-SXM4-80GB"
        version = device.metadata.resource_version
        assert (await one_pass(agent, server)).metadata.resource_version == version  # nothing changed: no write

        # A pod holds GPU-2 (a reservation reported it); GPU-1 cannot be read; GPU-2 leaves NVML.
        reserved = MakePod("r").annotations({names.GPU_UUID: "GPU-2"}).node("n0")
        server.put_object(paths.pods("sharegpu-system"), reserved.obj())
        elsewhere = MakePod("elsewhere").annotations({names.GPU_UUID: "GPU-0"}).node("n1")
        server.put_object(paths.pods("other"), elsewhere.obj())
        write_nvml(path, NVML_FILE
                   .replace("  - {uuid: GPU-2, model: NVIDIA A100-SXM4-80GB, memoryMiB: 81920, numaNode: 1}\n", "")
                   .replace(NVML_PROCESSES, "faults: {unreadable: [1]}"))  # fmt: skip
        device = await one_pass(agent, server)
        assert [(g.uuid, g.healthy, g.reason) for g in device.spec.gpus] == [
            ("GPU-0", True, ""), ("GPU-1", False, "NVML cannot read it"), ("GPU-2", False, api_devices.GONE)
        ]  # fmt: skip

        # A critical XID on GPU-0 marks it for good (the XID task wakes the loop).
        write_nvml(path, NVML_FILE + "xids: [{gpu: 0, code: 79}]\n")
        for _ in range(100):
            if "GPU-0" in agent.xids:
                break
            await asyncio.sleep(0.05)
        device = await one_pass(agent, server)
        assert [(g.uuid, g.healthy, g.reason) for g in device.spec.gpus] == [
            ("GPU-0", False, "XID 79"), ("GPU-1", True, ""), ("GPU-2", True, "")
        ]  # fmt: skip
    finally:
        await agent.stop()


async def daemons_running(supervisor: mps.Supervisor, count: int) -> None:
    for _ in range(500):
        states = supervisor.status().values()
        if len(states) == count and all(s.running and s.linked for s in states):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"MPS daemons not running: {supervisor.status()}")


def enforcement(device: wire.Device, mode: str) -> wire.ModeEnforcement:
    [entry] = [e for e in device.spec.enforcement if e.mode == mode]
    return entry


async def test_the_agent_offers_each_mode_once_a_probe_proved_it_and_runs_mps_daemons(
    tmp_path: Path, stubs: cudastubs.Stubs
) -> None:
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    library = tmp_path / "libvgpu.so"
    clock = [100.0]
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path), mps.Layout(tmp_path / "mps"), backoff=mps.Backoff(0.05))
    prover = proof.Prover(tmp_path / "scratch", libcuda=str(stubs.libcuda), wall=lambda: 1_800_000_000.0)
    installed = tmp_path / "installed"
    options = agent_runtime.Options(interval=3600, hami_core_library=library, hami_core_dir=installed)
    agent = agent_runtime.Agent(
        client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), options, supervisor=supervisor,
        prover=prover, clock=lambda: clock[0],
    )  # fmt: skip
    assert not agent.readiness()[0], "not ready before the first pass"
    await agent.start()
    try:
        await daemons_running(supervisor, 3)
        device = await one_pass(agent, server)
        assert device.spec.isolation == ["mps"], "no HAMi-core library yet; every GPU's daemon runs, proven"
        assert [(d.uuid, d.running, d.proven) for d in device.spec.mps] == [
            ("GPU-0", True, True), ("GPU-1", True, True), ("GPU-2", True, True)
        ]  # fmt: skip
        entry = enforcement(device, "mps")
        assert (entry.offered, entry.memory, entry.compute, entry.proven_at) == (
            True,
            True,
            True,
            "2027-01-15T08:00:00Z",
        )
        assert entry.subject.startswith("GPU-0 daemon pid ")
        assert enforcement(device, "hami-core").reason == f"no library at {library}"
        assert enforcement(device, "mig").reason == "no GPU in MIG mode"
        library.write_bytes(stubs.enforcing.read_bytes())
        device = await one_pass(agent, server)
        assert device.spec.isolation == ["hami-core", "mps"]
        hami = enforcement(device, "hami-core")
        assert (hami.offered, hami.memory, hami.compute) == (True, True, False)
        assert hami.reason == "compute shares are not enforced (docs/isolation.md)"
        assert hami.subject.startswith("sha256:") and len(hami.subject) == len("sha256:") + 16
        assert (installed / hamicore.LIBRARY_NAME).read_bytes() == stubs.enforcing.read_bytes()
        labels = (server.get_object(paths.node("n0")) or {})["metadata"]["labels"]
        assert labels["sharegpu.io/isolation-mps"] == labels["sharegpu.io/isolation-hami-core"] == "true"
        assert agent.readiness()[0]

        # A daemon killed: restarted by the supervisor, probed again, and the Device says so.
        pid = supervisor.status()["GPU-1"].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            state = supervisor.status()["GPU-1"]
            if state.linked and state.pid != pid:
                break
            await asyncio.sleep(0.02)
        device = await one_pass(agent, server)
        assert [(d.restarts, d.proven) for d in device.spec.mps if d.uuid == "GPU-1"] == [(1, True)]
        assert f"GPU-1 daemon pid {supervisor.status()['GPU-1'].pid}" in enforcement(device, "mps").subject
        text = prometheus_client.generate_latest(agent.metrics.registry).decode()
        assert 'sharegpu_agent_mps_daemon_restarts_total{uuid="GPU-1"} 1.0' in text
        assert 'sharegpu_agent_isolation{mode="mps"} 1.0' in text
        assert 'sharegpu_agent_isolation_proven{mode="hami-core"} 1.0' in text
        assert 'sharegpu_agent_isolation_probes_total{mode="mps",outcome="proven"} 4.0' in text

        # Gone from the node's offer when the library goes; readiness lapses when passes stop succeeding.
        library.unlink()
        assert (await one_pass(agent, server)).spec.isolation == ["mps"]
        clock[0] += 3 * 3600 + 60
        assert agent.readiness() == (False, {**agent.readiness()[1], "lastPassOk": False})
    finally:
        await agent.stop()
    assert all(s.pid is None or gone(s.pid) for s in supervisor.status().values())


async def test_a_resource_slice_left_from_serving_dra_is_deleted_even_if_refused_at_start(tmp_path: Path) -> None:
    server = fake.FakeApiServer(served=frozenset({dra.API_VERSION}))
    server.put_object(paths.NODES, MakeNode("n0").obj())
    server.put_object(dra.SLICES, {"metadata": {"name": dra.slice_name("n0")}, "spec": {"nodeName": "n0"}})
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    agent = agent_runtime.Agent(
        client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), agent_runtime.Options(interval=3600)
    )
    server.fail(503, method="DELETE", path=dra.slice_path("n0"))
    await agent.start()
    try:
        await first_pass(agent)
        assert not server.faults and server.get_object(dra.slice_path("n0")) is None, "deleted at the first pass"
    finally:
        await agent.stop()


async def test_a_gpu_a_prepared_claim_holds_stays_gone_at_its_index_when_it_leaves_nvml(tmp_path: Path) -> None:
    """GPU-2 falls off the bus while a DRA claim prepared here holds it (no pod annotation names it
    on the DRA path): it stays in the Device, gone, at its index, and its ResourceSlice device is
    tainted NoExecute, as for the extender path's pods. (A review found it dropped: the pods stuck on
    a dead GPU untainted, and its index free for another GPU under a claim that names it.)"""
    folder = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))  # a unix socket's path must be short
    server = fake.FakeApiServer(served=frozenset({dra.API_VERSION}))
    server.put_object(paths.NODES, MakeNode("n0").obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    plugin_paths = draplugin.Paths.under(folder / "plugins", folder / "registry", folder / "cdi")
    options = agent_runtime.Options(interval=3600, dra=True, dra_plugin=plugin_paths)
    agent = agent_runtime.Agent(client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), options)
    await agent.start()
    try:
        await one_pass(agent, server)
        claim = MakeClaim("c").ask(300, "4Gi").obj()
        result = {"request": "gpu", "driver": dra.DRIVER, "pool": "n0", "device": dra.device_name(2),
                  "consumedCapacity": {dra.MILLI: "300", dra.MEMORY: "4Gi"}}  # fmt: skip
        claim["status"] = {"allocation": {"devices": {"results": [result]}}}
        uid = server.put_object(dra.claim_path("ns"), claim)["metadata"]["uid"]
        answer = await drakubelet.Kubelet(plugin_paths).prepare(("c", uid))
        assert not answer.claims[uid].error
        write_nvml(path, NVML_FILE.replace(
            "  - {uuid: GPU-2, model: NVIDIA A100-SXM4-80GB, memoryMiB: 81920, numaNode: 1}\n", "")
            .replace(NVML_PROCESSES, "processes: []"))  # fmt: skip
        device = await one_pass(agent, server)
        assert [(g.index, g.uuid, g.healthy, g.reason) for g in device.spec.gpus][2] == (
            2,
            "GPU-2",
            False,
            api_devices.GONE,
        )
        published = server.get_object(dra.slice_path("n0"))
        assert published is not None
        gpu2 = next(d for d in published["spec"]["devices"] if d["name"] == dra.device_name(2))
        assert [(t["key"], t["effect"]) for t in gpu2.get("taints", [])] == [(dra.UNHEALTHY, "NoExecute")]
    finally:
        await agent.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def test_a_library_that_enforces_nothing_is_not_offered_and_says_why(
    tmp_path: Path, stubs: cudastubs.Stubs
) -> None:
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    library = tmp_path / "libvgpu.so"
    library.write_bytes(stubs.hidden.read_bytes())  # built with hidden symbols: it limits nothing
    installed = tmp_path / "installed"
    options = agent_runtime.Options(interval=3600, hami_core_library=library, hami_core_dir=installed)
    prover = proof.Prover(tmp_path / "scratch", libcuda=str(stubs.libcuda))
    agent = agent_runtime.Agent(client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), options, prover=prover)
    server.fail(503, method="POST", path=paths.events(events.CLUSTER_EVENTS))  # the first pass's warning: refused
    await agent.start()
    try:
        device = await one_pass(agent, server)  # the next pass writes it
        assert not server.faults
        assert device.spec.isolation == []
        hami = enforcement(device, "hami-core")
        assert (hami.offered, hami.memory) == (False, False)
        copy = installed / hamicore.LIBRARY_NAME
        assert hami.reason.startswith(f"HAMi-core at {copy} did not enforce a 1024 MiB limit: 3 of 3 allocations")
        [event] = [e for e in server.list_objects("/api/v1/events") if e["reason"] == "IsolationNotProven"]
        assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "Node"
        assert event["message"].startswith("isolation hami-core not offered: HAMi-core at ")
        await one_pass(agent, server)
        assert len([e for e in server.list_objects("/api/v1/events") if e["reason"] == "IsolationNotProven"]) == 1
        text = prometheus_client.generate_latest(agent.metrics.registry).decode()
        assert 'sharegpu_agent_isolation_probes_total{mode="hami-core",outcome="failed"} 1.0' in text, "not again"
        assert 'sharegpu_agent_isolation_proven{mode="hami-core"} 0.0' in text

        # The operator installs a working build: a new digest, probed at once, offered.
        write_bytes(library, stubs.enforcing.read_bytes())
        device = await one_pass(agent, server)
        assert device.spec.isolation == ["hami-core"] and enforcement(device, "hami-core").memory
    finally:
        await agent.stop()


def probing_agent(
    server: fake.FakeApiServer, tmp_path: Path, stubs: cudastubs.Stubs, **extra: Any
) -> tuple[agent_runtime.Agent, list[str]]:
    """An agent of n0 (three A100s) with the stub HAMi-core that enforces, and the GPUs its isolation
    probes ran on (filled as they run)."""
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    library = tmp_path / "libvgpu.so"
    library.write_bytes(stubs.enforcing.read_bytes())
    options = agent_runtime.Options(interval=3600, hami_core_library=library, hami_core_dir=tmp_path / "installed")
    probed: list[str] = []

    async def run(env: Mapping[str, str], **kwargs: Any) -> tuple[cudaprobe.Finding, ...]:
        probed.append(env["CUDA_VISIBLE_DEVICES"])
        return await cudaprobe.run(env, **kwargs)

    prover = proof.Prover(tmp_path / "scratch", run=run, libcuda=str(stubs.libcuda))
    nvml = fakenvml.FakeNvml(path).open()
    return agent_runtime.Agent(client.KubeClient(server), "n0", nvml, options, prover=prover, **extra), probed


async def test_no_probe_takes_memory_a_pod_was_promised(tmp_path: Path, stubs: cudastubs.Stubs) -> None:
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    for index in range(3):
        placed = MakeAllocation(f"ns/p{index}", "n0").grant(index, 900, 79000)
        server.put_object(paths.pods("ns"), running(MakePod(f"p{index}").allocation(placed.obj())))
    agent, probed = probing_agent(server, tmp_path, stubs)
    await agent.start()
    try:
        device = await one_pass(agent, server)
        assert probed == [] and device.spec.isolation == []
        hami = enforcement(device, "hami-core")
        assert hami.reason.startswith("not probed: waiting for a GPU with 4096 MiB that no pod was promised")
        assert not [e for e in server.list_objects("/api/v1/events") if e["reason"] == "IsolationNotProven"]
        server.remove_object(paths.pod("ns", "p1"))  # GPU-1 has room again
        device = await one_pass(agent, server)
        assert probed == ["GPU-1"] and device.spec.isolation == ["hami-core"]
    finally:
        await agent.stop()


async def test_a_whole_gpu_pod_keeps_the_probe_off_its_own_gpu_only(tmp_path: Path, stubs: cudastubs.Stubs) -> None:
    """The kubelet gave a whole-GPU pod GPU-0: the isolation probe runs on another GPU. Read as "some
    GPU", the pod had kept every GPU from the probe, so a node running one whole-GPU pod offered no
    isolation mode after an agent restart."""
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    placed = MakeAllocation("ns/w", "n0").grants((0, 1000, 81920)).exclusive()
    whole = MakePod("w").allocation(placed.obj()).node("n0").container(limits={names.NVIDIA_GPU: "1"})
    server.put_object(paths.pods("ns"), whole.phase("Running").obj())
    folder = Path(tempfile.mkdtemp(dir="/tmp"))  # a unix socket's path must be short
    kubelet = fakekubelet.FakeKubelet(folder / "k.sock")
    kubelet.set_devices("ns", "w", "main", names.NVIDIA_GPU, ["GPU-0"])
    await kubelet.start()
    lister = podresources.KubeletPodResources(folder / "k.sock", 2.0)
    agent, probed = probing_agent(server, tmp_path, stubs, kubelet=lister)
    await agent.start()
    try:
        device = await one_pass(agent, server)
        assert probed and "GPU-0" not in probed and device.spec.isolation == ["hami-core"]
    finally:
        await agent.stop()
        await lister.close()
        await kubelet.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def test_the_agent_kills_a_process_over_its_pods_memory_and_corrects_a_reported_uuid(tmp_path: Path) -> None:
    """Usage watchdog and drift repair in one pass: a sharing pod's process uses 4096 MiB of GPU-0 against
    1024 allocated (killed, with an event), and a reservation pod reported GPU-1 although the kubelet's
    PodResources API says it got GPU-0 (corrected, with an event)."""
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    placed = MakeAllocation("ns/p", "n0").grant(0, 300, 1024)
    sharing = server.put_object(paths.pods("ns"), running(MakePod("p").allocation(placed.obj())))
    role = {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: "n0", names.LABEL_SLOT: "0"}
    reserve = MakePod("r").annotations({names.GPU_UUID: "GPU-1"}).labels(role).node("n0")
    reserve.container("reserve", limits={names.NVIDIA_GPU: "1"}).phase("Running")
    server.put_object(paths.pods(names.HOLDING_NAMESPACE), reserve.obj())
    victim = await asyncio.create_subprocess_exec("sleep", "60")
    uid = sharing["metadata"]["uid"].replace("-", "_")
    proc = tmp_path / "proc"
    (proc / str(victim.pid)).mkdir(parents=True)
    scope = f"kubepods-burstable-pod{uid}.slice/cri-containerd-{'a' * 64}.scope"
    (proc / str(victim.pid) / "cgroup").write_text(f"0::/kubepods.slice/kubepods-burstable.slice/{scope}\n")
    path = tmp_path / "nvml.yaml"
    write_nvml(path, nvml_with(f"{{pid: {victim.pid}, gpu: 0, usedMiB: 4096}}"))
    socket = Path(tempfile.mkdtemp(dir="/tmp")) / "k.sock"
    kubelet = fakekubelet.FakeKubelet(socket)
    kubelet.set_devices(names.HOLDING_NAMESPACE, "r", "reserve", names.NVIDIA_GPU, ["GPU-0"])
    kubelet.set_allocatable(names.NVIDIA_GPU, ["0", "1", "GPU-9"])  # indexes, and a GPU NVML does not know
    await kubelet.start()
    lister = podresources.KubeletPodResources(socket, 2.0)
    options = agent_runtime.Options(interval=3600, on_violation=watchdog.Action.KILL, proc=proc)
    agent = agent_runtime.Agent(
        client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), options, kubelet=lister
    )
    await agent.start()
    try:
        await one_pass(agent, server)
        assert await asyncio.wait_for(victim.wait(), 5) == -signal.SIGKILL
        reserved = server.get_object(paths.pod(names.HOLDING_NAMESPACE, "r")) or {}
        assert reserved["metadata"]["annotations"][names.GPU_UUID] == "GPU-0"
        reasons = {e["reason"]: e["message"] for e in server.list_objects("/api/v1/events")}
        assert f"killed process(es) {victim.pid}" in reasons["GPUProcessKilled"]
        assert "uses 4096 MiB" in reasons["GPUProcessKilled"] and "1024 MiB" in reasons["GPUProcessKilled"]
        assert "reported GPU-1 but the kubelet gave it GPU-0" in reasons["GPUAssignmentDrift"]
        text = prometheus_client.generate_latest(agent.metrics.registry).decode()
        assert 'sharegpu_agent_actions_total{action="kill"} 1.0' in text
        assert "sharegpu_agent_drift_repairs_total 1.0" in text
        assert 'sharegpu_pod_gpu_memory_used_bytes{namespace="ns",pod="p",uuid="GPU-0"} 4.294967296e+09' in text
        assert agent.repair is not None
        assert (agent.repair.unadvertised, agent.repair.unknown_allocatable) == (("GPU-2",), ("GPU-9",))
        assert 'sharegpu_agent_drift{kind="unadvertised_gpu"} 1.0' in text

        # The kubelet restarts: its socket vanishes; the agent waits, stays ready, says why, and goes on.
        await kubelet.stop()
        await one_pass(agent, server)
        ready, detail = agent.readiness()
        assert ready and str(socket) in detail["kubelet"]
        await kubelet.start()
        await one_pass(agent, server)
        assert "kubelet" not in agent.readiness()[1]
    finally:
        await agent.stop()
        await lister.close()
        await kubelet.stop()
        if victim.returncode is None:
            victim.kill()
            await victim.wait()


async def test_the_watchdog_reads_the_kubelets_index_ids_as_the_gpus_they_name(tmp_path: Path) -> None:
    """With DEVICE_ID_STRATEGY=index the kubelet lists "0", not GPU-0: a whole-GPU pod using the GPU it was
    given is no violation (read as a UUID it was "a GPU sharegpu did not give it")."""
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    pod = MakePod("w").node("n0").container(limits={names.NVIDIA_GPU: "1"}).phase("Running")
    whole = server.put_object(paths.pods("ns"), pod.obj())
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"0::/kubepods/pod{whole['metadata']['uid']}/{'c' * 64}\n")
    path = tmp_path / "nvml.yaml"
    write_nvml(path, nvml_with("{pid: 4242, gpu: 0, usedMiB: 2048}"))
    async with beside_a_kubelet(server, path, tmp_path / "proc", ("ns", "w", "main", "0")) as (agent, _):
        await one_pass(agent, server)
        assert [u.used_mib for u in agent.usage.usages] == [2048], "the pod's use is seen"
        assert agent.usage.violations == ()


@contextlib.asynccontextmanager
async def beside_a_kubelet(
    server: fake.FakeApiServer, nvml: Path, proc: Path, *devices: tuple[str, str, str, str]
) -> AsyncIterator[tuple[agent_runtime.Agent, fakekubelet.FakeKubelet]]:
    """An agent of node n0 (NVML from `nvml`, /proc at `proc`) reading the fake kubelet's PodResources,
    which lists `devices` ((namespace, pod, container, device ID) of nvidia.com/gpu)."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))  # a unix socket's path must be short
    kubelet = fakekubelet.FakeKubelet(folder / "k.sock")
    for namespace, pod, container, device in devices:
        kubelet.set_devices(namespace, pod, container, names.NVIDIA_GPU, [device])
    await kubelet.start()
    lister = podresources.KubeletPodResources(folder / "k.sock", 2.0)
    options = agent_runtime.Options(interval=3600, proc=proc)
    agent = agent_runtime.Agent(
        client.KubeClient(server), "n0", fakenvml.FakeNvml(nvml).open(), options, kubelet=lister
    )
    await agent.start()
    try:
        yield agent, kubelet
    finally:
        await agent.stop()
        await lister.close()
        await kubelet.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def test_a_pod_labelled_with_a_group_counts_as_a_member_only_where_the_group_admits_it(tmp_path: Path) -> None:
    """The agent keeps the SharedDeviceGroups: a pod in a namespace the group does not admit, though
    labelled with it, is judged on its own (its use of the group's GPU is a violation) until the group
    admits its namespace."""
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    group = {"metadata": {"name": "pair", "namespace": "team"}, "spec": {"gpus": 1}}
    server.put_object(resources.SHARED_DEVICE_GROUP.path("team"), group)
    labels = api_groups.group_labels("team", "pair")
    holder = MakePod("holder", names.HOLDING_NAMESPACE).labels({names.LABEL_ROLE: names.ROLE_GROUP_HOLDER, **labels})
    holder.annotations({names.GPU_UUID: "GPU-0"}).node("n0").container(limits={names.NVIDIA_GPU: "1"})
    server.put_object(paths.pods(names.HOLDING_NAMESPACE), holder.phase("Running").obj())
    made = {ns: server.put_object(paths.pods(ns), running(MakePod("m", ns).labels(labels))) for ns in ("team", "other")}
    proc = tmp_path / "proc"
    for pid, namespace in ((4242, "team"), (4343, "other")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/pod{made[namespace]['metadata']['uid']}/{'c' * 64}\n")
    path = tmp_path / "nvml.yaml"
    write_nvml(path, nvml_with("{pid: 4242, gpu: 0, usedMiB: 1000}", "{pid: 4343, gpu: 0, usedMiB: 1000}"))
    agent = agent_runtime.Agent(
        client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), agent_runtime.Options(interval=3600, proc=proc)
    )
    await agent.start()
    try:
        await one_pass(agent, server)
        assert agent.readiness()[1]["groups"]["listed"]
        found = [(v.pod.namespace, v.kind) for v in agent.usage.violations]
        assert found == [("other", watchdog.Kind.UNALLOCATED_GPU)], "only the member the group admits holds its GPU"
        await agent.api.patch(
            resources.SHARED_DEVICE_GROUP.path("team", "pair"), {"spec": {"members": {"namespaces": ["other"]}}}
        )
        await one_pass(agent, server)
        assert agent.usage.violations == ()
    finally:
        await agent.stop()


async def test_xids_are_still_seen_after_nvml_failed_to_wait_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed wait (events not supported, the event set lost) must not end the XID watch: a later
    critical XID would never mark its GPU."""
    monkeypatch.setattr(agent_runtime, "XID_RETRY", 0.05)
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE + "faults: {xidWait: true}\n")
    agent = agent_runtime.Agent(
        client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), agent_runtime.Options(interval=3600)
    )
    await agent.start()
    try:
        await eventually(lambda: agent.xid_failures >= 2, "failed waits, tried again")
        write_nvml(path, NVML_FILE + "xids: [{gpu: 0, code: 79}]\n")
        await eventually(lambda: "GPU-0" in agent.xids, "the XID, once NVML answers again")
        device = await one_pass(agent, server)
        assert {g.uuid: g.healthy for g in device.spec.gpus}["GPU-0"] is False
    finally:
        await agent.stop()


# ----------------------------------------------------------------- found by a review (stop 64)


async def test_the_agents_own_mps_server_is_never_judged_as_a_tenant(tmp_path: Path) -> None:
    """The MPS daemon and its servers are the agent's children, in its own pod's cgroup (a privileged
    container shares the host's cgroup namespace); its pod asks for no GPU. The agent reads its own
    pod from its own cgroup and never judges what runs there (before: an MPS server was an
    UNALLOCATED_GPU intruder, SIGKILLed under --on-violation kill, every tenant of the GPU with it)."""
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    agent_pod = server.put_object(paths.pods("sharegpu-system"), running(MakePod("sharegpu-agent-abcde")))
    mps_server = await asyncio.create_subprocess_exec("sleep", "60")
    uid = agent_pod["metadata"]["uid"].replace("-", "_")
    scope = f"kubepods-burstable-pod{uid}.slice/cri-containerd-{'a' * 64}.scope"
    proc = tmp_path / "proc"
    for pid in (mps_server.pid, os.getpid()):  # the server, and the agent itself, in the agent's pod
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::/kubepods.slice/kubepods-burstable.slice/{scope}\n")
    path = tmp_path / "nvml.yaml"
    write_nvml(path, nvml_with(f"{{pid: {mps_server.pid}, gpu: 0, usedMiB: 30}}"))
    options = agent_runtime.Options(interval=3600, on_violation=watchdog.Action.KILL, proc=proc)
    agent = agent_runtime.Agent(client.KubeClient(server), "n0", fakenvml.FakeNvml(path).open(), options)
    await agent.start()
    try:
        await one_pass(agent, server)
        await asyncio.sleep(0.5)
        assert mps_server.returncode is None and agent.usage.violations == ()
    finally:
        await agent.stop()
        if mps_server.returncode is None:
            mps_server.kill()
            await mps_server.wait()


async def test_index_ids_are_read_by_nvmls_numbering_not_the_devices(tmp_path: Path) -> None:
    """DEVICE_ID_STRATEGY=index: GPU-0 falls off the bus (held by nobody); NVML and the device plugin
    renumber (GPU-2 is "1" now) while the Device keeps GPU-1 at 1 and GPU-2 at 2. The kubelet's "1"
    is GPU-2: the reservation's correct report stays (before: "repaired" to GPU-1)."""
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    role = {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: "n0", names.LABEL_SLOT: "2"}
    reserve = MakePod("r").annotations({names.GPU_UUID: "GPU-2"}).labels(role).node("n0")
    reserve.container("reserve", limits={names.NVIDIA_GPU: "1"}).phase("Running")
    server.put_object(paths.pods(names.HOLDING_NAMESPACE), reserve.obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, nvml_with())
    listed = (names.HOLDING_NAMESPACE, "r", "reserve", "2")
    async with beside_a_kubelet(server, path, tmp_path / "proc", listed) as (agent, kubelet):
        await one_pass(agent, server)
        first = "  - {uuid: GPU-0, model: NVIDIA A100-SXM4-80GB, memoryMiB: 81920, pcieSwitch: 0}\n"
        gone = NVML_FILE.replace(first, "")
        write_nvml(path, gone.replace("nvlinks: [{a: 0, b: 1, count: 12}]", "nvlinks: []").replace(NVML_PROCESSES, ""))
        kubelet.set_devices(names.HOLDING_NAMESPACE, "r", "reserve", names.NVIDIA_GPU, ["1"])
        device = await one_pass(agent, server)
        assert [(g.index, g.uuid) for g in device.spec.gpus] == [(1, "GPU-1"), (2, "GPU-2")]
        stored = server.get_object(paths.pod(names.HOLDING_NAMESPACE, "r"))
        assert stored is not None and stored["metadata"]["annotations"][names.GPU_UUID] == "GPU-2"
