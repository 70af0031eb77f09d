"""The node agent on the real API server, with its own least RBAC (deploy/helm/sharegpu/files/rbac/agent.yaml) and a
fake NVML: the Device appears owned by its Node, follows an XID, and the node gets its GPU labels;
the extender (with kube-scheduler) keeps off a GPU the agent marks unhealthy; a pod over its GPU
memory is evicted; a reservation's misreported GPU is corrected from the kubelet's PodResources API
(a fake kubelet on a unix socket), across a kubelet restart."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from pathlib import Path

from sharegpu.agent import draplugin, inventory, mps, podresources, proof, watchdog
from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import kubelet as fakekubelet
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import cdi, dra, names, paths, wire
from sharegpu.api import devices as api_devices
from sharegpu.core import devices
from sharegpu.devcluster import controlplane, fakecluster, stack
from sharegpu.kube import client
from tests.agent import cudastubs
from tests.agent.drakubelet import Kubelet
from tests.agent.fake_mps_daemon import write_fake_daemon
from tests.builders import (
    NVML_FILE,
    MakeAllocation,
    MakeClaim,
    MakeNode,
    MakePod,
    nvml_with,
    pod_process,
    write_bytes,
    write_nvml,
)
from tests.integration.conftest import Json, agent_on, get_or_none, gpu_pod, refusal, wait_for


async def test_the_agent_publishes_its_nodes_device_and_follows_an_xid(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None, namespace: str, tmp_path: Path
) -> None:
    """The Device follows the fake NVML file: an XID, a new NVLink, a GPU that vanishes while a pod holds
    it (kept, marked), and is dropped once nothing holds it."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    node = await admin.create(paths.NODES, MakeNode(name).obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    try:
        async with agent_on(control_plane, name, path, agent_runtime.Options(interval=0.5)):

            async def published() -> wire.Device | None:
                found = await get_or_none(admin, paths.device(name))
                return wire.convert(found, wire.Device) if found is not None else None

            device = await wait_for(published, what="the Device")
            assert [g.uuid for g in device.spec.gpus] == ["GPU-0", "GPU-1", "GPU-2"]
            assert device.metadata.owner_references[0].uid == node["metadata"]["uid"]
            labels = (await admin.get(paths.node(name)))["metadata"]["labels"]
            assert labels[inventory.COUNT_LABEL] == "3"

            write_nvml(path, NVML_FILE + "xids: [{gpu: 1, code: 79}]\n")

            async def marked() -> bool:
                found = await published()
                return found is not None and not found.spec.gpus[1].healthy and found.spec.gpus[1].reason == "XID 79"

            await wait_for(marked, what="GPU 1 marked unhealthy")

            write_nvml(
                path,
                NVML_FILE.replace(
                    "nvlinks: [{a: 0, b: 1, count: 12}]", "nvlinks: [{a: 0, b: 1, count: 12}, {a: 1, b: 2}]"
                ),
            )

            async def linked() -> bool:
                found = await published()
                return found is not None and sorted(tuple(p) for p in found.spec.nvlinks) == [(0, 1), (1, 2)]

            await wait_for(linked, what="the new NVLink in the Device's topology")

            holder = {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: name, names.LABEL_SLOT: "0"}
            reserving = MakePod("holder").annotations({names.GPU_UUID: "GPU-2"}).labels(holder).node(name)
            await admin.create(paths.pods(namespace), reserving.container("reserve", image="busybox").obj())
            write_nvml(path, NVML_FILE.split("  - {uuid: GPU-2")[0] + "nvlinks: [{a: 0, b: 1, count: 12}]\n")

            async def kept_marked() -> wire.GpuSpec | None:
                found = await published()
                gone = [g for g in found.spec.gpus if g.uuid == "GPU-2"] if found is not None else []
                return gone[0] if gone and not gone[0].healthy else None

            vanished = await wait_for(kept_marked, what="the vanished GPU kept and marked while a pod holds it")
            assert vanished.reason == api_devices.GONE and vanished.index == 2
            await admin.delete(paths.pod(namespace, "holder"), grace_period=0)

            async def dropped() -> bool:
                found = await published()
                return found is not None and [g.uuid for g in found.spec.gpus] == ["GPU-0", "GPU-1"]

            await wait_for(dropped, what="the vanished GPU dropped once nothing holds it")
    finally:
        await admin.delete(paths.device(name))
        await admin.delete(paths.node(name))


async def test_the_extender_places_nothing_on_a_gpu_the_agent_marks_unhealthy(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    harness: fakecluster.FakeCluster,
    extender: stack.ExtenderProcess,
    namespace: str,
    tmp_path: Path,
) -> None:
    """The agent (not the harness) writes the node's Device; GPU 0 cannot be read, GPU 1 is taken by a
    whole-GPU pod: the next pod waits with the reason, and runs once the agent sees GPU 0 healthy again."""
    inventory_ = devices.uniform_node(f"{namespace}-agent", gpu_count=2, model="T4", gpu_memory_mib=16384,
                                      cpu_milli=32000, memory_mib=256 * 1024)  # fmt: skip
    await harness.add_node(inventory_, publish=False)
    await admin.patch(paths.node(inventory_.name), {"metadata": {"labels": {"sharegpu.io/test": namespace}}})
    path = tmp_path / "nvml.yaml"
    path.write_text(fakenvml.describe(inventory_) + "faults: {unreadable: [0]}\n")
    async with agent_on(control_plane, inventory_.name, path, agent_runtime.Options(interval=0.5)):
        await admin.create(paths.pods(namespace), gpu_pod("first", namespace, nvidia=1))
        await wait_for(lambda: _bound(admin, namespace, "first"), what="first pod placed on the healthy GPU")
        await admin.create(paths.pods(namespace), gpu_pod("second", namespace, nvidia=1))

        message = await wait_for(lambda: refusal(admin, namespace, "second"), what="second pod refused")
        assert "no healthy GPU" in message or "no entirely free GPU" in message, message
        path.write_text(fakenvml.describe(inventory_))
        await wait_for(lambda: _bound(admin, namespace, "second"), timeout=90, what="second pod placed once healed")


async def _bound(kube: client.KubeClient, namespace: str, name: str) -> bool:
    return bool((await kube.get(paths.pod(namespace, name)))["spec"].get("nodeName"))


async def test_a_memory_violation_evicts_the_pod_and_a_misreported_gpu_is_corrected(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None, namespace: str, tmp_path: Path
) -> None:
    """With the agent's own RBAC on the real API server: a sharing pod using 4096 MiB of its 1024 is
    evicted (Eviction API) with a Warning event; a reservation pod that reported GPU-2 while the kubelet's
    PodResources API says GPU-1 is corrected, with an event; a kubelet restart is waited out."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    await admin.create(paths.NODES, MakeNode(name).obj())
    placed = MakeAllocation(f"{namespace}/p", name).grant(0, 300, 1024).obj()
    sharing = await admin.create(
        paths.pods(namespace), MakePod("p").allocation(placed).node(name).container(image="busybox").obj()
    )
    system_ns = names.HOLDING_NAMESPACE  # reservations: only there is the role label sharegpu's
    reservations = [f"r{slot}-{name}" for slot in (0, 1)]
    for slot, reported in ((0, "GPU-0"), (1, "GPU-2")):  # slot 1's device plugin really gave it GPU-1
        role = {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: name, names.LABEL_SLOT: str(slot)}
        reserve = MakePod(reservations[slot], system_ns).annotations({names.GPU_UUID: reported}).labels(role).node(name)
        reserve.container("reserve", image="busybox", limits={names.NVIDIA_GPU: "1"}).restricted()
        await admin.create(paths.pods(system_ns), reserve.obj())
        await admin.patch(f"{paths.pod(system_ns, reservations[slot])}/status", {"status": {"phase": "Running"}})
    proc = tmp_path / "proc"
    pod_process(proc, 4242, sharing["metadata"]["uid"])
    path = tmp_path / "nvml.yaml"
    write_nvml(path, nvml_with("{pid: 4242, gpu: 0, usedMiB: 4096}"))
    socket = Path(tempfile.mkdtemp(dir="/tmp")) / "k.sock"
    kubelet = fakekubelet.FakeKubelet(socket, allocatable_api=False)  # as a 1.20 kubelet
    kubelet.set_devices(system_ns, reservations[0], "reserve", names.NVIDIA_GPU, ["GPU-0"])
    kubelet.set_devices(system_ns, reservations[1], "reserve", names.NVIDIA_GPU, ["GPU-1"])
    await kubelet.start()
    lister = podresources.KubeletPodResources(socket, 2.0)
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    options = agent_runtime.Options(interval=0.5, on_violation=watchdog.Action.EVICT, proc=proc)
    agent = agent_runtime.Agent(kube, name, fakenvml.FakeNvml(path).open(), options, kubelet=lister)
    await kubelet.stop()  # the kubelet restarts while the agent starts: it waits, then checks
    await agent.start()
    try:
        await asyncio.sleep(1.5)
        assert str(socket) in agent.readiness()[1].get("kubelet", "")
        await kubelet.start()

        async def corrected() -> bool:
            pod = await admin.get(paths.pod(system_ns, reservations[1]))
            return bool(pod["metadata"]["annotations"][names.GPU_UUID] == "GPU-1")

        await wait_for(corrected, what="the reservation's UUID corrected to the kubelet's")

        async def evicted() -> bool:
            found = await get_or_none(admin, paths.pod(namespace, "p"))
            return found is None or bool(found["metadata"].get("deletionTimestamp"))

        await wait_for(evicted, what="the pod over its GPU memory evicted")

        async def told() -> dict[str, str] | None:  # the event is written once the eviction is answered
            found, _ = await admin.list_all(paths.events(namespace))
            drifted, _ = await admin.list_all(paths.events(system_ns))
            named = ("p", reservations[1])
            said = {e["reason"]: e["message"] for e in found + drifted if e["involvedObject"]["name"] in named}
            return said if "GPUPodEvicted" in said else None

        reasons = await wait_for(told, what="the GPUPodEvicted event")
        evicted_because = reasons["GPUPodEvicted"]
        assert "uses 4096 MiB" in evicted_because and "1024 MiB" in evicted_because, evicted_because
        assert "the pod was evicted" in evicted_because
        assert "reported GPU-2 but the kubelet gave it GPU-1" in reasons["GPUAssignmentDrift"]
    finally:
        await agent.stop()
        await lister.close()
        await kubelet.stop()
        await kube.close()
        await admin.delete(paths.node(name))
        for reservation in reservations:
            await admin.delete(paths.pod(system_ns, reservation), grace_period=0)


async def test_the_device_on_the_api_server_says_what_each_mode_was_proven_to_enforce(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None, tmp_path: Path,
    stubs: cudastubs.Stubs,
) -> None:  # fmt: skip
    """With the agent's own RBAC: a HAMi-core library that enforces nothing is not offered, the stored
    Device keeps the reason (the CRD's schema holds spec.enforcement and spec.mps[].proven), and the
    Node gets a Warning event; a working build is then proven and offered, as are the MPS daemons."""
    name = f"proof-{uuid.uuid4().hex[:8]}"
    node = await admin.create(paths.NODES, MakeNode(name).obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    library = tmp_path / "libvgpu.so"
    library.write_bytes(stubs.hidden.read_bytes())
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), mps.Layout(tmp_path / "mps"))
    options = agent_runtime.Options(interval=0.5, hami_core_library=library, hami_core_dir=tmp_path / "installed")
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    prover = proof.Prover(tmp_path / "scratch", libcuda=str(stubs.libcuda))
    agent = agent_runtime.Agent(
        kube, name, fakenvml.FakeNvml(path).open(), options, supervisor=supervisor, prover=prover
    )
    await agent.start()
    try:

        async def stored() -> wire.Device | None:
            found = await get_or_none(admin, paths.device(name))
            device = wire.convert(found, wire.Device) if found is not None else None
            return device if device is not None and device.spec.enforcement else None

        async def refused() -> wire.Device | None:
            device = await stored()
            return device if device is not None and device.spec.isolation == ["mps"] else None

        device = await wait_for(refused, what="mps offered, hami-core refused")
        [hami] = [e for e in device.spec.enforcement if e.mode == "hami-core"]
        assert not hami.offered and not hami.memory and hami.subject.startswith("sha256:")
        assert "did not enforce a 1024 MiB limit: 3 of 3 allocations above it succeeded" in hami.reason
        [daemons] = [e for e in device.spec.enforcement if e.mode == "mps"]
        assert daemons.offered and daemons.memory and daemons.compute and daemons.proven_at
        assert [(d.uuid, d.running, d.proven) for d in device.spec.mps] == [
            ("GPU-0", True, True), ("GPU-1", True, True), ("GPU-2", True, True)
        ]  # fmt: skip

        async def warned() -> list[Json]:
            found = await admin.get(paths.events("default"), fieldSelector=f"involvedObject.name={name}")
            return [e for e in found["items"] if e["reason"] == "IsolationNotProven"]

        [event] = await wait_for(warned, what="the IsolationNotProven event on the Node")
        assert event["type"] == "Warning" and event["involvedObject"]["uid"] == node["metadata"]["uid"]
        assert event["message"].startswith("isolation hami-core not offered: HAMi-core at ")

        write_bytes(library, stubs.enforcing.read_bytes())

        async def offered() -> wire.Device | None:
            device = await stored()
            return device if device is not None and device.spec.isolation == ["hami-core", "mps"] else None

        device = await wait_for(offered, what="the working build proven and offered")
        [hami] = [e for e in device.spec.enforcement if e.mode == "hami-core"]
        assert hami.memory and not hami.compute and "compute shares are not enforced" in hami.reason
    finally:
        await agent.stop()
        await kube.close()
    assert mps.tied(Path("/proc"), supervisor.layout, "GPU-0") == []


async def test_the_agent_publishes_its_gpus_as_a_resource_slice_where_dra_is_served(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None, namespace: str, tmp_path: Path
) -> None:
    """With `--dra` and the agent's own RBAC: on Kubernetes 1.34 and later the node's ResourceSlice
    appears (owned by the Node; every GPU a shareable device whose capacities and request policies the
    API server keeps), and a GPU that turns unhealthy is tainted in a new pool generation. Where
    `resource.k8s.io/v1` is not served (1.32), nothing is written and /readyz's detail says why."""
    name = f"dra-{uuid.uuid4().hex[:8]}"
    node = await admin.create(paths.NODES, MakeNode(name).obj())
    path = tmp_path / "nvml.yaml"
    write_nvml(path, NVML_FILE)
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    agent = agent_runtime.Agent(
        kube, name, fakenvml.FakeNvml(path).open(), agent_runtime.Options(interval=0.5, dra=True)
    )
    await agent.start()
    try:
        served = tuple(int(p) for p in control_plane.version.split(".")[:2]) >= (1, 34)
        if not served:

            async def said() -> bool:
                return agent.readiness()[1].get("dra") == "resource.k8s.io/v1 is not served here: no ResourceSlice"

            await wait_for(said, what="the agent to say DRA is not served")
            assert agent.readiness()[0], "still ready: the Device is what the extender path needs"
            return

        async def published() -> Json | None:
            return await get_or_none(admin, dra.slice_path(name))

        found = await wait_for(published, what="the node's ResourceSlice")
        device = await admin.get(paths.device(name))
        assert device["spec"]["dra"] is True, "the Device says so: the extender places no pod here"
        assert found["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]
        spec = found["spec"]
        assert spec["driver"] == dra.DRIVER and spec["nodeName"] == name and spec["pool"]["generation"] == 1
        first = spec["devices"][0]
        assert first["allowMultipleAllocations"] is True, "consumable capacity is kept (on by default from 1.36)"
        assert first["capacity"]["memory"]["value"] == "80Gi"
        assert first["capacity"]["milli"]["requestPolicy"]["validRange"]["max"] == "1k"
        assert first["attributes"][f"{dra.DRIVER}/uuid"] == {"string": "GPU-0"}
        assert first["attributes"][f"{dra.DRIVER}/nvlinkPeers"] == {"string": "1"}

        await asyncio.sleep(1.6)  # three passes more, nothing changed: nothing written
        again = await published()
        assert again is not None and again["metadata"]["resourceVersion"] == found["metadata"]["resourceVersion"]

        # A pod of the extender path still holds GPU 2 (the node turned to DRA while it runs): tainted.
        holder = {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: name, names.LABEL_SLOT: "2"}
        reserving = MakePod("holder").annotations({names.GPU_UUID: "GPU-2"}).labels(holder).node(name)
        await admin.create(paths.pods(namespace), reserving.container("reserve", image="busybox").obj())

        def taint_keys(found: Json | None, index: int) -> list[str]:
            devices = (found or {}).get("spec", {}).get("devices", [])
            return [t["key"] for t in devices[index].get("taints", [])] if len(devices) == 3 else []

        async def held() -> Json | None:
            found = await published()
            return found if taint_keys(found, 2) == [dra.HELD] else None

        found = await wait_for(held, what="GPU 2 tainted as held by pods")
        assert found["spec"]["pool"]["generation"] == 2

        write_nvml(path, NVML_FILE + "xids: [{gpu: 1, code: 79}]\n")

        async def tainted() -> Json | None:
            found = await published()
            return found if taint_keys(found, 1) == [dra.UNHEALTHY] else None

        found = await wait_for(tainted, what="GPU 1 tainted in the slice")
        assert found["spec"]["devices"][1]["taints"][0]["value"] == "XID-79"
        assert found["spec"]["pool"]["generation"] == 3
    finally:
        await agent.stop()
        await kube.close()


async def test_the_agent_s_kubelet_plugin_prepares_a_claim_allocated_on_its_node(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None, namespace: str
) -> None:
    """With `--dra`, the agent (its own RBAC) serves the kubelet's DRA plugin: registered by the
    kubelet's protocol, it prepares a claim allocated on its node from what the real API server shows
    (a CDI spec with the GPU's UUID; the IDs of the NVIDIA toolkit's device and of sharegpu's), refuses
    one with another UID, and unprepares it."""
    if tuple(int(p) for p in control_plane.version.split(".")[:2]) < (1, 34):
        return  # no resource.k8s.io/v1: no claims (the slice test above says what the agent does then)
    name = f"plug-{uuid.uuid4().hex[:8]}"
    await admin.create(paths.NODES, MakeNode(name).obj())
    folder = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    nvml_path = folder / "nvml.yaml"
    write_nvml(nvml_path, NVML_FILE)
    plugin_paths = draplugin.Paths.under(folder / "plugins", folder / "registry", folder / "cdi")
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    options = agent_runtime.Options(interval=0.5, dra=True, dra_plugin=plugin_paths)
    agent = agent_runtime.Agent(kube, name, fakenvml.FakeNvml(nvml_path).open(), options)
    claims = dra.claim_path(namespace)
    await agent.start()
    try:
        kubelet = Kubelet(plugin_paths, namespace)
        info = await kubelet.info()
        assert (info.type, info.name, info.endpoint) == ("DRAPlugin", dra.DRIVER, str(plugin_paths.plugin_socket))
        await wait_for(lambda: get_or_none(admin, dra.slice_path(name)), what="the node's ResourceSlice")
        made = await admin.create(claims, MakeClaim("c", namespace).ask(300, "4Gi").obj())
        placed = MakeAllocation(f"{namespace}/c#claim", name).grant(1, 300, 4096, container="gpu").obj()
        made["status"] = {"allocation": dra.claim_allocation(placed, [str(uuid.uuid4())], wire.timestamp(1e9))}
        await admin.replace(f"{claims}/c/status", made)
        uid = made["metadata"]["uid"]
        answer = await kubelet.prepare(("c", uid))
        assert answer.claims[uid].error == "", answer
        (device,) = answer.claims[uid].devices
        assert list(device.cdi_device_ids) == ["nvidia.com/gpu=GPU-1", f"sharegpu.io/claim={uid}-gpu"]
        spec_file = plugin_paths.cdi_dir / cdi.file_name(uid)
        assert "NVIDIA_VISIBLE_DEVICES=GPU-1" in spec_file.read_text()
        wrong = await kubelet.prepare(("c", "another-uid"))
        assert "not the another-uid the kubelet names" in wrong.claims["another-uid"].error
        await kubelet.unprepare(("c", uid))
        assert not spec_file.exists()
        # /readyz: not ready until the kubelet has registered the plugin.
        assert agent.readiness()[1]["draPlugin"] == "waiting for the kubelet to register it"
        assert not agent.readiness()[0]
        await kubelet.notify(False, "driver name taken")
        assert agent.readiness()[1]["draPlugin"] == "the kubelet refused its registration: driver name taken"
        await kubelet.notify(True, "")
        ready = agent.readiness

        async def registered() -> bool:
            return ready()[0]

        await wait_for(registered, what="the agent ready once the kubelet registered its plugin")
        # A claim prepared, then gone while the agent was down: its spec is collected at the next start.
        await kubelet.prepare(("c", uid))
        await agent.stop()
        await admin.delete(f"{claims}/c")
        agent = agent_runtime.Agent(kube, name, fakenvml.FakeNvml(nvml_path).open(), options)
        await agent.start()
        assert not spec_file.exists() and agent.plugin is not None and agent.plugin.claims == {}
        # Without --dra, the node's ResourceSlice goes (the agent's own RBAC and policy allow it).
        await agent.stop()
        agent = agent_runtime.Agent(
            kube, name, fakenvml.FakeNvml(nvml_path).open(), agent_runtime.Options(interval=0.5)
        )
        await agent.start()
        assert await get_or_none(admin, dra.slice_path(name)) is None
    finally:
        await agent.stop()
        await kube.close()
        shutil.rmtree(folder, ignore_errors=True)
