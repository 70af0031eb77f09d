"""sharegpu's DRA allocator on the real control plane (Kubernetes 1.37): the extender process
allocates the claims of its DeviceClass (made by kube-controller-manager from a template), lifts the
pods' scheduling gate, and kube-scheduler's real DRA plugin honours the allocations and binds the pods.
The nodes are DRA nodes as an agent with --dra leaves them (Device `spec.dra`, and a ResourceSlice).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import dra, names, paths, quantity
from sharegpu.core import devices, fleet, placer, policies, requests, units
from sharegpu.core import ledger as core_ledger
from sharegpu.devcluster import agents, controlplane, fakecluster, oracle, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.extender import cache as extender_cache
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from tests import builders
from tests.integration.conftest import Json, events, get_or_none, wait_for


async def template(admin: client.KubeClient, namespace: str, name: str, milli: int, memory: str) -> None:
    request = {"name": "gpu", "exactly": {"deviceClassName": dra.CLASS,
               "capacity": {"requests": {dra.MILLI: str(milli), dra.MEMORY: memory}}}}  # fmt: skip
    body = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [request]}}}}  # fmt: skip
    await admin.create(dra.template_path(namespace), body)


def dra_pod(name: str, namespace: str, template_name: str) -> Json:
    """A pod for sharegpu's scheduler profile, gated, its GPU a claim made from `template_name`."""
    made = builders.MakePod(name, namespace).scheduler().node_selector({"sharegpu.io/test": namespace}).grace(0)
    made.container(image="busybox", requests={"cpu": "100m"}).gate()
    body = made.obj()
    body["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template_name}]
    body["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
    return body


async def claim_of(admin: client.KubeClient, namespace: str, pod: str) -> Json | None:
    """The pod's (first) claim, by name or made from its template; None while it is not made."""
    found = await admin.get(paths.pod(namespace, pod))
    by_name = found["spec"]["resourceClaims"][0].get("resourceClaimName")
    statuses = (found.get("status") or {}).get("resourceClaimStatuses") or []
    name = by_name or (statuses[0].get("resourceClaimName") if statuses else None)
    if not name:
        return None
    claim: Json | None = await get_or_none(admin, f"{dra.claim_path(namespace)}/{name}")
    return claim


async def _none(read: Callable[[], Any]) -> bool:
    return await read() is None


def where(claim: Json) -> list[tuple[str, str, int]]:
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
    return [(r["pool"], r["device"], int(quantity.parse(r["consumedCapacity"][dra.MILLI]))) for r in results]


async def node_of(admin: client.KubeClient, namespace: str, pod: str) -> str | None:
    found: str | None = (await admin.get(paths.pod(namespace, pod)))["spec"].get("nodeName")
    return found


def simulated(nodes: list[str], asks: list[int]) -> list[tuple[str, int]]:
    """Where the placement core, alone, puts the same sequence of shares on the same nodes (one T4
    each) with the extender's default policy, shapes and tie-break order: (node, GPU index) per ask."""
    state = fleet.FleetState([devices.uniform_node(n, gpu_count=1, model="T4", gpu_memory_mib=16384,
                                                   cpu_milli=32000, memory_mib=256 * 1024) for n in nodes])  # fmt: skip
    chooser = placer.Placer(
        state,
        policies.make(policies.DEFAULT, extender_cache.DEFAULT_SHAPES),
        priority=extender_cache.stable_priority(state.names),
    )
    ledger = core_ledger.Ledger(state)
    out = []
    for i, milli in enumerate(asks):
        gpu = requests.GpuRequest(milli=milli, memory_mib=4096)
        pod = requests.PodRequest(units.PodKey(f"ns/p{i}"), (requests.ContainerRequest("gpu", gpu),), cpu_milli=100)
        decision = chooser.place(ledger, pod, np.arange(len(nodes)))
        assert decision.node is not None
        out.append((str(decision.node), decision.gpus[0]))
    return out


async def test_sharegpu_allocates_its_class_s_claims_and_kube_scheduler_binds_the_pods(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    dra_nodes = await nodes(2, gpus=1, dra=True)
    await template(admin, namespace, "share", 400, "4Gi")
    names_ = [f"p{i}" for i in range(5)]
    for name in names_:  # one at a time: the allocator serves them oldest first
        await admin.create(paths.pods(namespace), dra_pod(name, namespace, "share"))
        await wait_for(functools.partial(claim_of, admin, namespace, name), what=f"the claim of {name} made")

    async def four_bound() -> list[str] | None:
        bound = [n for n in names_ if await node_of(admin, namespace, n)]
        return bound if len(bound) == 4 else None

    bound = await wait_for(four_bound, timeout=90, what="four of five pods bound")
    (left,) = set(names_) - set(bound)
    shares: dict[tuple[str, str], int] = {}
    for name in bound:
        claim = await claim_of(admin, namespace, name)
        assert claim is not None
        ((pool, device, milli),) = where(claim)
        assert pool in dra_nodes and await node_of(admin, namespace, name) == pool, "bound where its claim is"
        assert claim["status"]["reservedFor"][0]["name"] == name, "reserved by kube-scheduler"
        assert dra.DELETE_PROTECTION in claim["metadata"]["finalizers"]
        shares[(pool, device)] = shares.get((pool, device), 0) + milli
    assert shares == {(n, "gpu-0"): 800 for n in dra_nodes}, "each GPU shared by two, never beyond its 1000"
    pod = await admin.get(paths.pod(namespace, left))
    assert [g["name"] for g in pod["spec"]["schedulingGates"]] == [names.DRA_GATE], "the fifth waits, gated"

    async def told() -> list[Json] | None:  # the event is written by the allocator's next pass
        found = [e for e in await events(admin, namespace, "ClaimNotAllocated") if e["involvedObject"]["name"] == left]
        return found or None

    said = await wait_for(told, what=f"{left} told why it waits")
    assert "no GPU with 400 milli-GPU free (largest free: 200)" in said[0]["message"], said

    first_four = [n for n in names_ if n != left]
    placed = []
    for name in first_four:
        claim = await claim_of(admin, namespace, name)
        assert claim is not None
        placed.append((where(claim)[0][0], 0))
    assert placed == simulated(dra_nodes, [400] * 4), "the allocations are the placement core's choices"

    await admin.delete(paths.pod(namespace, bound[0]), grace_period=0)
    assert await wait_for(
        lambda: node_of(admin, namespace, left), timeout=90, what="the fifth pod bound once room appeared"
    )
    claim = await claim_of(admin, namespace, left)
    assert claim is not None and where(claim)[0][2] == 400


async def test_a_claim_kube_scheduler_takes_back_is_allocated_again_where_the_pod_fits(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    """The takeover: sharegpu packs the pod's claim next to a share already on node X, but the pod
    cannot run there for something sharegpu does not model (a host port another pod holds). kube-
    scheduler finds it fits no node, its PostFilter clears the unreserved allocation, and sharegpu
    allocates the claim again, on the other node, where the pod is bound."""
    dra_nodes = await nodes(2, gpus=1, dra=True)
    await template(admin, namespace, "share", 300, "1Gi")
    await admin.create(paths.pods(namespace), dra_pod("seed", namespace, "share"))
    busy = await wait_for(functools.partial(node_of, admin, namespace, "seed"), timeout=60, what="seed bound")
    (other,) = set(dra_nodes) - {busy}
    port = {"containerPort": 9000, "hostPort": 9000}
    holder = builders.MakePod("holder", namespace).node(busy).grace(0).container(image="busybox").obj()
    holder["spec"]["containers"][0]["ports"] = [port]
    await admin.create(paths.pods(namespace), holder)
    moved = dra_pod("moved", namespace, "share")
    moved["spec"]["containers"][0]["ports"] = [port]
    await admin.create(paths.pods(namespace), moved)
    node = await wait_for(functools.partial(node_of, admin, namespace, "moved"), timeout=90, what="moved bound")
    assert node == other
    claim = await claim_of(admin, namespace, "moved")
    assert claim is not None and where(claim) == [(other, "gpu-0", 300)]
    failed = [e for e in await events(admin, namespace, "FailedScheduling") if e["involvedObject"]["name"] == "moved"]
    assert failed, "kube-scheduler first found it fitting no node: the allocation on the packed node was taken back"


async def test_a_pod_in_another_system_s_format_goes_the_dra_way_through_the_webhook(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    webhook: Any,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    """The whole DRA path: a pod asking the Koordinator way (half a GPU's compute and memory), with
    `sharegpu.io/path: dra`, is turned by the webhook into a claim of its own by name, gated;
    sharegpu's allocator makes the claim (owned by the pod, with its finalizer), allocates it (half of
    the 16 GiB in MiB) and lifts the gate, and kube-scheduler binds the pod. No template, and
    kube-controller-manager writes nothing for the claim in the pod's status."""
    dra_nodes = await nodes(1, gpus=1, dra=True)
    limits = {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", "cpu": "100m"}
    made = builders.MakePod("koord", namespace).annotations({names.PATH: names.PATH_DRA}).grace(0)
    made.node_selector({"sharegpu.io/test": namespace}).container(image="busybox", limits=limits, requests=limits)
    created = await admin.create(paths.pods(namespace), made.obj())
    shape = dra.Shape(1, 500, memory_permille=500)
    (entry,) = created["spec"]["resourceClaims"]
    assert entry["name"] == dra.POD_CLAIM and dra.claim_shape(entry["resourceClaimName"]) == shape
    assert [g["name"] for g in created["spec"]["schedulingGates"]] == [names.DRA_GATE]
    assert not any("koordinator" in r for r in created["spec"]["containers"][0]["resources"].get("limits", {}))
    node = await wait_for(functools.partial(node_of, admin, namespace, "koord"), timeout=90, what="koord bound")
    assert node == dra_nodes[0]
    claim = await claim_of(admin, namespace, "koord")
    assert claim is not None and where(claim) == [(node, "gpu-0", 500)]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert quantity.parse(result["consumedCapacity"][dra.MEMORY]) == quantity.parse("8Gi")
    (owner,) = claim["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", "koord", created["metadata"]["uid"])
    assert claim["metadata"]["finalizers"] == [dra.DELETE_PROTECTION]
    assert claim["metadata"]["labels"][names.LABEL_ROLE] == names.ROLE_POD_CLAIM
    assert await get_or_none(admin, dra.template_path(namespace, shape.name)) is None, "no template"
    bound = await admin.get(paths.pod(namespace, "koord"))
    assert not bound.get("status", {}).get("resourceClaimStatuses"), "kube-controller-manager wrote nothing"
    await admin.delete(paths.pod(namespace, "koord"), grace_period=0)
    gone = functools.partial(get_or_none, admin, dra.claim_path(namespace, entry["resourceClaimName"]))
    await wait_for(lambda: _none(gone), timeout=60, what="the claim gone with its pod")


async def test_a_pod_written_as_kubernetes_documents_dra_is_gated_by_the_webhook_and_placed_by_sharegpu(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    webhook: Any,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    """Issue 39 item 7: a pod as Kubernetes' DRA documents write it (a claim template of sharegpu's
    class, no scheduling gate, no scheduler named) is gated at admission, so kube-scheduler never
    tries (and fails) it; sharegpu allocates its claim and lifts the gate, and it is bound. A pod whose
    template does not exist yet is gated too, and placed once it does. A pod whose claim is of
    another class is not held back by sharegpu (the webhook reads its template: not gated; a claim
    made only after the pod is held, then let go once it is seen to be another class's)."""
    dra_nodes = await nodes(1, gpus=1, dra=True)
    await template(admin, namespace, "half", 500, "4Gi")

    def documented(name: str, template_name: str) -> Json:
        body = dra_pod(name, namespace, template_name)
        del body["spec"]["schedulingGates"]
        body["spec"].pop("schedulerName", None)
        return body

    created = await admin.create(paths.pods(namespace), documented("docs", "half"))
    assert [g["name"] for g in created["spec"].get("schedulingGates", [])] == [names.DRA_GATE]
    assert "gated" in created["metadata"]["annotations"][names.TRANSLATED]
    early = await admin.create(paths.pods(namespace), documented("early", "later"))
    assert [g["name"] for g in early["spec"].get("schedulingGates", [])] == [names.DRA_GATE], "not known yet: held"
    node = await wait_for(functools.partial(node_of, admin, namespace, "docs"), timeout=90, what="docs bound")
    assert node == dra_nodes[0]
    claim = await claim_of(admin, namespace, "docs")
    assert claim is not None and where(claim) == [(node, "gpu-0", 500)]

    await template(admin, namespace, "later", 250, "2Gi")
    assert await wait_for(functools.partial(node_of, admin, namespace, "early"), timeout=90, what="early bound") == node

    other = {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}
    body = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaimTemplate", "metadata": {"name": "theirs"},
            "spec": {"spec": {"devices": {"requests": [other]}}}}  # fmt: skip
    await admin.create(dra.template_path(namespace), body)
    foreign = await admin.create(paths.pods(namespace), documented("foreign", "theirs"))
    assert not foreign["spec"].get("schedulingGates"), "another driver's claim: left to kube-scheduler"

    # A claim named by the pod, not made yet: held; made of another class: let go by the allocator.
    waiting = documented("waiting", "unused")
    waiting["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "their-claim"}]
    held = await admin.create(paths.pods(namespace), waiting)
    assert [g["name"] for g in held["spec"].get("schedulingGates", [])] == [names.DRA_GATE]
    claim = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaim", "metadata": {"name": "their-claim"},
             "spec": {"devices": {"requests": [other]}}}  # fmt: skip
    await admin.create(dra.claim_path(namespace), claim)

    async def let_go() -> bool:
        return not (await admin.get(paths.pod(namespace, "waiting")))["spec"].get("schedulingGates")

    await wait_for(let_go, timeout=60, what="the allocator let the pod of another class's claim go")


async def shares_on(admin: client.KubeClient, namespace: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(milli, MiB) the API server shows allocated per (node, device), over the namespace's claims."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for claim in (await admin.get(dra.claim_path(namespace)))["items"]:
        for r in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []:
            milli, memory = out.get((r["pool"], r["device"]), (0, 0))
            consumed = r["consumedCapacity"]
            out[(r["pool"], r["device"])] = (
                milli + int(quantity.parse(consumed[dra.MILLI])),
                memory + quantity.mebibytes(consumed[dra.MEMORY]),
            )
    return out


async def test_killed_allocator_agents_and_api_server_leave_nothing_overcommitted_leaked_or_stuck(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    harness: fakecluster.FakeCluster,
    extender: ExtenderProcess,
    namespace: str,
    device_class: str,
    tmp_path: Path,
) -> None:
    """Chaos: gated pods come and go while the extender (the allocator) is SIGKILLed mid-way and
    restarted, once with kube-apiserver restarted too, and the nodes' agents (which publish the
    ResourceSlices and Devices) are killed and started again, once with the extender, once on their
    own. At every check no GPU holds more than its capacity; at the end every pod that fits is bound
    where its claim is, the rest wait gated, and no allocation is left without its pod."""
    inventories = [
        devices.uniform_node(f"{namespace}-chaos-{i}", gpu_count=2, model="T4", gpu_memory_mib=16384,
                             cpu_milli=32000, memory_mib=256 * 1024)
        for i in range(3)
    ]  # fmt: skip
    for inventory in inventories:
        await harness.add_node(inventory, publish=False)
        await admin.patch(paths.node(inventory.name), {"metadata": {"labels": {"sharegpu.io/test": namespace}}})
    dra_nodes = [str(n.name) for n in inventories]
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    node_agents = agents.NodeAgents(kube, tmp_path / "nvml", agent_runtime.Options(interval=0.5, dra=True))
    await node_agents.add(inventories)
    try:
        await _chaos(admin, control_plane, extender, namespace, dra_nodes, node_agents, inventories)
    finally:
        await node_agents.stop()
        await kube.close()


async def _chaos(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    namespace: str,
    dra_nodes: list[str],
    node_agents: agents.NodeAgents,
    inventories: list[devices.NodeInventory],
) -> None:
    await wait_for(lambda: all_sliced(admin, dra_nodes), what="the agents' ResourceSlices")
    await template(admin, namespace, "share", 300, "2Gi")  # three to a GPU: 18 in all
    rng = random.Random(29)
    live: list[str] = []
    serial = 0

    async def no_overcommit() -> None:
        for where, (milli, memory) in (await shares_on(admin, namespace)).items():
            assert milli <= 1000 and memory <= 16384, f"{where} over-committed: {milli} milli, {memory} MiB"

    async def churn(create: int, delete: int) -> None:
        nonlocal serial
        for _ in range(create):
            name = f"c{serial}"
            serial += 1
            await admin.create(paths.pods(namespace), dra_pod(name, namespace, "share"))
            live.append(name)
        for _ in range(delete):
            victim = live.pop(rng.randrange(len(live)))
            await admin.delete(paths.pod(namespace, victim), grace_period=0)
        await asyncio.sleep(rng.uniform(0.1, 0.6))
        await no_overcommit()

    await churn(8, 0)
    for restart_api in (False, True):
        await churn(6, 2)
        extender.kill()  # SIGKILL: mid-allocation, no clean release of the Lease
        if not restart_api:
            await node_agents.stop()  # the agents die too: tasks cancelled mid-write, nothing cleaned up
        await churn(4, 2)  # pods come and go while it is down
        if restart_api:
            await asyncio.to_thread(control_plane.restart, "kube-apiserver", down_for=2.0)
        else:
            await node_agents.add(inventories)
        extender.start()
        await extender.wait_ready(timeout=90)
        await no_overcommit()
        if restart_api:  # the agents killed on their own, while the allocator works
            await node_agents.stop()
            await churn(3, 1)
            await node_agents.add(inventories)
            await no_overcommit()
    assert len(live) > 18, "more pods than room: some must wait"

    async def settled() -> list[str] | None:
        bound = [n for n in live if await node_of(admin, namespace, n)]
        await no_overcommit()
        return bound if len(bound) == 18 else None

    bound = await wait_for(settled, timeout=180, what="18 pods bound, three to a GPU")
    assert set((await shares_on(admin, namespace)).values()) == {(900, 6144)}
    assert len(await shares_on(admin, namespace)) == 6 and {n for n, _ in await shares_on(admin, namespace)} == set(
        dra_nodes
    )
    holders: dict[str, str] = {}
    for name in bound:
        claim = await claim_of(admin, namespace, name)
        assert claim is not None and where(claim)[0][0] == await node_of(admin, namespace, name)
        holders[claim["metadata"]["name"]] = name
    for claim in (await admin.get(dra.claim_path(namespace)))["items"]:
        if (claim.get("status") or {}).get("allocation"):
            assert claim["metadata"]["name"] in holders, f"{claim['metadata']['name']} allocated without a bound pod"
    for name in set(live) - set(bound):
        pod = await admin.get(paths.pod(namespace, name))
        assert [g["name"] for g in pod["spec"].get("schedulingGates") or []] == [names.DRA_GATE], name
    found = await oracle.inspect(admin, nodes=set(dra_nodes), claims=True)
    assert found.problems() == [] and found.claims_bound == 18, found


async def all_sliced(admin: client.KubeClient, nodes: list[str]) -> bool:
    return all([await get_or_none(admin, dra.slice_path(n)) is not None for n in nodes])


async def test_a_gpu_the_agent_finds_unhealthy_is_tainted_and_gets_no_new_claim_until_healed(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    harness: fakecluster.FakeCluster,
    extender: ExtenderProcess,
    namespace: str,
    device_class: str,
    tmp_path: Path,
) -> None:
    """The agent with --dra (not the harness) publishes the node: GPU 0 cannot be read, so its device
    carries the unhealthy taint and the allocator gives it nothing; a claim that fits only there waits,
    gated, with the reason, and is allocated on GPU 0 once the agent sees it healthy again."""
    node = devices.uniform_node(f"{namespace}-dra-agent", gpu_count=2, model="T4", gpu_memory_mib=16384,
                                cpu_milli=32000, memory_mib=256 * 1024)  # fmt: skip
    await harness.add_node(node, publish=False)
    await admin.patch(paths.node(node.name), {"metadata": {"labels": {"sharegpu.io/test": namespace}}})
    nvml = tmp_path / "nvml.yaml"
    nvml.write_text(fakenvml.describe(node) + "faults: {unreadable: [0]}\n")
    kube = stack.kube_for(control_plane, "sharegpu-agent")
    agent = agent_runtime.Agent(
        kube, node.name, fakenvml.FakeNvml(nvml).open(), agent_runtime.Options(interval=0.5, dra=True)
    )
    await agent.start()
    try:

        async def tainted() -> bool:
            found = await get_or_none(admin, dra.slice_path(node.name))
            if found is None:
                return False
            taints = {d["name"]: [t["key"] for t in d.get("taints") or []] for d in found["spec"]["devices"]}
            return taints == {"gpu-0": [dra.UNHEALTHY], "gpu-1": []}

        await wait_for(tainted, what="GPU 0's device tainted unhealthy in the node's ResourceSlice")
        await template(admin, namespace, "big", 600, "4Gi")
        await admin.create(paths.pods(namespace), dra_pod("first", namespace, "big"))
        await wait_for(functools.partial(node_of, admin, namespace, "first"), timeout=90, what="first bound")
        first = await claim_of(admin, namespace, "first")
        assert first is not None and where(first) == [(node.name, "gpu-1", 600)], "the healthy GPU"
        await admin.create(paths.pods(namespace), dra_pod("second", namespace, "big"))

        async def said() -> str | None:
            found = [
                e
                for e in await events(admin, namespace, "ClaimNotAllocated")
                if e["involvedObject"]["name"] == "second"
            ]
            return str(found[0]["message"]) if found else None

        message = await wait_for(said, timeout=60, what="the second pod's claim refused with its reason")
        assert "no GPU with 600 milli-GPU free (largest free: 400)" in message, message  # GPU 0 not counted
        second = await claim_of(admin, namespace, "second")
        assert second is not None and not where(second), "nothing given on the unhealthy GPU"

        nvml.write_text(fakenvml.describe(node))  # GPU 0 readable again
        await wait_for(
            functools.partial(node_of, admin, namespace, "second"), timeout=90, what="second bound once healed"
        )
        second = await claim_of(admin, namespace, "second")
        assert second is not None and where(second) == [(node.name, "gpu-0", 600)]
    finally:
        await agent.stop()
        await kube.close()


async def test_device_taint_rules_keep_claims_off_tolerations_let_them_on_and_no_execute_evicts_once(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    """Issue 39 item 4, on 1.37.2 (DeviceTaintRule served in resource.k8s.io/v1, DRADeviceTaints and
    DRADeviceTaintRules on by default): a NoSchedule rule on GPU 0 sends a claim to GPU 1; with both
    tainted a claim waits, gated, and its event names the taints it does not tolerate; a claim whose
    request tolerates them is placed on a tainted GPU. A NoExecute rule on a bound pod's GPU: the
    pod is evicted by kube-controller-manager's device taint eviction, once (its DisruptionTarget
    condition, one event), and sharegpu does nothing more to it; its claim's GPU takes no new claim."""
    (node,) = await nodes(1, gpus=2, dra=True)
    await template(admin, namespace, "small", 200, "2Gi")
    maint = {"key": f"maint-{namespace}", "value": "yes", "effect": "NoSchedule"}

    async def rule(name: str, device: int, taint: Json) -> None:
        selector = {"driver": dra.DRIVER, "pool": node, "device": dra.device_name(device)}
        body = {"apiVersion": dra.API_VERSION, "kind": "DeviceTaintRule", "metadata": {"name": f"{namespace}-{name}"},
                "spec": {"deviceSelector": selector, "taint": taint}}  # fmt: skip
        await admin.create(dra.TAINT_RULES, body)

    try:
        await rule("gpu0", 0, maint)
        await asyncio.sleep(1.0)  # the extender's watch
        await admin.create(paths.pods(namespace), dra_pod("first", namespace, "small"))
        await wait_for(functools.partial(node_of, admin, namespace, "first"), timeout=90, what="first bound")
        first = await claim_of(admin, namespace, "first")
        assert first is not None and where(first) == [(node, "gpu-1", 200)], "the untainted GPU"

        await rule("gpu1", 1, maint)
        await asyncio.sleep(1.0)
        await admin.create(paths.pods(namespace), dra_pod("second", namespace, "small"))

        async def said() -> str | None:
            found = [
                e
                for e in await events(admin, namespace, "ClaimNotAllocated")
                if e["involvedObject"]["name"] == "second"
            ]
            return str(found[-1]["message"]) if found else None

        message = await wait_for(said, timeout=60, what="the second pod's claim refused with its reason")
        assert f"tainted, not tolerated by the claim's requests: {node}/gpu-0 maint-{namespace}=yes:NoSchedule" in (
            message
        ), message

        tolerant = {"name": "gpu", "exactly": {"deviceClassName": dra.CLASS, "tolerations": [
            {"key": f"maint-{namespace}", "operator": "Exists"}],
            "capacity": {"requests": {dra.MILLI: "200", dra.MEMORY: "2Gi"}}}}  # fmt: skip
        await admin.create(dra.template_path(namespace), {
            "apiVersion": dra.API_VERSION, "kind": "ResourceClaimTemplate", "metadata": {"name": "tolerant"},
            "spec": {"spec": {"devices": {"requests": [tolerant]}}}})  # fmt: skip
        await admin.create(paths.pods(namespace), dra_pod("tolerant", namespace, "tolerant"))
        await wait_for(functools.partial(node_of, admin, namespace, "tolerant"), timeout=90, what="tolerant bound")
        placed = await claim_of(admin, namespace, "tolerant")
        assert placed is not None and where(placed)[0][0] == node, "a tainted GPU, tolerated"
        assert not await node_of(admin, namespace, "second"), "the intolerant one still waits"

        # NoExecute on GPU 1, where `first` runs: kube-controller-manager evicts it, once.
        await rule("evict", 1, {"key": f"gone-{namespace}", "effect": "NoExecute"})

        async def evicted() -> Json | None:
            found = await get_or_none(admin, paths.pod(namespace, "first"))
            if found is None:
                return {"gone": True}
            conditions = found["status"].get("conditions") or []
            return found if any(c.get("reason") == "DeletionByDeviceTaintManager" for c in conditions) else None

        await wait_for(evicted, timeout=90, what="first evicted by kube-controller-manager's device taint eviction")
        await asyncio.sleep(5.0)  # time for any second eviction or sharegpu action to show
        told = [
            e
            for e in await events(admin, namespace, "DeviceTaintManagerEviction")
            if e["involvedObject"]["name"] == "first"
        ]
        assert len(told) == 1 and told[0].get("count", 1) == 1, told
        listed = (await admin.get(paths.events(namespace)))["items"]
        ours = [e for e in listed if e["involvedObject"]["name"] == "first" and "sharegpu" in str(e.get("source"))]
        assert [e["reason"] for e in ours if e["reason"] != "ClaimNotAllocated"] == [], ours
    finally:
        for name in ("gpu0", "gpu1", "evict"):
            with contextlib.suppress(kube_errors.NotFoundError):
                await admin.delete(f"{dra.TAINT_RULES}/{namespace}-{name}")


async def test_claims_get_only_the_gpus_their_selectors_and_the_class_s_pick(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    """CEL selectors on the real stack: the agents publish what NVML (here the fake) says, the extender
    judges each claim's selectors on it, and kube-scheduler binds the pod where its claim went; a claim
    no GPU passes stays gated with an event saying so; a selector an administrator adds to sharegpu's
    DeviceClass narrows every claim from then on."""
    gpu = f'device.attributes["{dra.DRIVER}"]'
    (node,) = await nodes(1, gpus=2, model="T4", dra=True)  # Turing, 7.5, as the fake NVML knows a T4

    async def selective(name: str, expression: str) -> None:
        request = {
            "name": "gpu",
            "exactly": {
                "deviceClassName": dra.CLASS,
                "selectors": [{"cel": {"expression": expression}}],
                "capacity": {"requests": {dra.MILLI: "300", dra.MEMORY: "1Gi"}},
            },
        }
        body = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaimTemplate", "metadata": {"name": name},
                "spec": {"spec": {"devices": {"requests": [request]}}}}  # fmt: skip
        await admin.create(dra.template_path(namespace), body)
        await admin.create(paths.pods(namespace), dra_pod(name, namespace, name))

    await selective("second", f'{gpu}.index == 1 && {gpu}.architecture == "Turing" && '
                              f'{gpu}.cudaComputeCapability.compareTo(semver("7.5.0")) == 0')  # fmt: skip
    await selective("newer", f'{gpu}.cudaComputeCapability.isGreaterThan(semver("8.0.0"))')
    assert await wait_for(lambda: node_of(admin, namespace, "second"), timeout=60, what="the selective pod bound")
    claim = await claim_of(admin, namespace, "second")
    assert claim is not None and where(claim) == [(node, "gpu-1", 300)]

    async def refused() -> str | None:
        said = [
            e for e in await events(admin, namespace, "ClaimNotAllocated") if e["involvedObject"]["name"] == "newer"
        ]
        return str(said[-1]["message"]) if said else None

    assert "no GPU the device selectors pick" in await wait_for(refused, timeout=30, what="the refusal of 'newer'")
    assert await node_of(admin, namespace, "newer") is None

    narrowed = dra.device_class()
    narrowed["spec"]["selectors"].append({"cel": {"expression": f"{gpu}.index == 0"}})
    current = await admin.get(f"{dra.DEVICE_CLASSES}/{dra.CLASS}")
    try:
        await admin.replace(f"{dra.DEVICE_CLASSES}/{dra.CLASS}", {**narrowed, "metadata": current["metadata"]})
        await template(admin, namespace, "any", 300, "1Gi")
        await admin.create(paths.pods(namespace), dra_pod("any", namespace, "any"))
        assert await wait_for(lambda: node_of(admin, namespace, "any"), timeout=60, what="the plain pod bound")
        claim = await claim_of(admin, namespace, "any")
        assert claim is not None and where(claim) == [(node, "gpu-0", 300)], "the class's selector narrows it"
    finally:
        current = await admin.get(f"{dra.DEVICE_CLASSES}/{dra.CLASS}")
        await admin.replace(
            f"{dra.DEVICE_CLASSES}/{dra.CLASS}", {**dra.device_class(), "metadata": current["metadata"]}
        )


async def test_each_request_feature_is_honoured_or_refused_by_name_on_the_real_api_server(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    """What Kubernetes 1.37.2 accepts in a claim, each through the real API server: matchAttribute on
    the standard pcieRoot is honoured; allocationMode All, adminAccess (in a namespace labelled for
    it, as the API server demands), distinctAttribute, firstAvailable and opaque parameters for
    sharegpu's driver keep the pod gated, with a ClaimNotAllocated event naming the field."""
    await admin.patch(
        paths.namespace(namespace), {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}}
    )
    await nodes(1, gpus=2, dra=True)
    capacity = {"requests": {dra.MILLI: "300", dra.MEMORY: "1Gi"}}
    share = {"deviceClassName": dra.CLASS, "capacity": capacity}
    root = "resource.kubernetes.io/pcieRoot"
    specs: dict[str, tuple[Json, str | None]] = {
        "matched": ({"requests": [{"name": "gpu", "exactly": {**share, "count": 2}}],
                     "constraints": [{"matchAttribute": root}]}, None),
        "all": ({"requests": [{"name": "gpu", "exactly": {"deviceClassName": dra.CLASS, "allocationMode": "All"}}]},
                "allocationMode All is not supported"),
        "admin": ({"requests": [{"name": "gpu", "exactly": {**share, "adminAccess": True}}]},
                  "adminAccess is not supported"),
        "distinct": ({"requests": [{"name": "gpu", "exactly": {**share, "count": 2}}],
                      "constraints": [{"distinctAttribute": f"{dra.DRIVER}/uuid"}]},
                     "distinctAttribute is not supported"),
        "first": ({"requests": [{"name": "gpu", "firstAvailable": [{"name": "big", **share}]}]},
                  "firstAvailable is not supported"),
        "config": ({"requests": [{"name": "gpu", "exactly": share}],
                    "config": [{"opaque": {"driver": dra.DRIVER, "parameters": {"isolation": "mps"}}}]},
                   "driver gpu.sharegpu.io takes no parameters"),
    }  # fmt: skip
    for name, (spec, _) in specs.items():
        body = {
            "apiVersion": dra.API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": spec},
        }
        stored = await admin.create(dra.claim_path(namespace), body)
        assert stored["spec"]["devices"] == {**spec, "requests": stored["spec"]["devices"]["requests"]}, (
            "kept as written"
        )
        pod = builders.MakePod(name, namespace).scheduler().node_selector({"sharegpu.io/test": namespace}).grace(0)
        made = pod.container(image="busybox", requests={"cpu": "100m"}).claim(name).gate().obj()
        await admin.create(paths.pods(namespace), made)

    assert await wait_for(lambda: node_of(admin, namespace, "matched"), timeout=60, what="the matched pod bound")
    claim = await admin.get(dra.claim_path(namespace, "matched"))
    assert sorted(d for _, d, _ in where(claim)) == ["gpu-0", "gpu-1"], "two GPUs under one PCIe root"

    async def said() -> dict[str, str] | None:
        found = {
            e["involvedObject"]["name"]: str(e["message"]) for e in await events(admin, namespace, "ClaimNotAllocated")
        }
        return found if all(n in found for n, (_, why) in specs.items() if why) else None

    refused = await wait_for(said, timeout=30, what="a refusal for each claim sharegpu cannot honour")
    for name, (_, why) in specs.items():
        if why is not None:
            assert why in refused[name], (name, refused[name])
            assert await node_of(admin, namespace, name) is None


async def test_a_gang_on_the_dra_path_is_allocated_all_or_nothing_and_bound_whole(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    await nodes(2, gpus=1, dra=True)
    await template(admin, namespace, "share", 700, "4Gi")

    async def member(name: str, size: int) -> None:
        body = dra_pod(name, namespace, "share")
        body["metadata"]["annotations"] = {names.GANG: name.split("-", maxsplit=1)[0], names.GANG_MIN: str(size)}
        await admin.create(paths.pods(namespace), body)
        await wait_for(functools.partial(claim_of, admin, namespace, name), what=f"the claim of {name} made")

    for i in range(3):  # three of 700 on two GPUs: the gang cannot fit, nothing is allocated
        await member(f"big-{i}", 3)

    async def told() -> bool:
        said = await events(admin, namespace, "ClaimNotAllocated")
        return any("none of the gang's claims is allocated" in e["message"] for e in said)

    await wait_for(told, what="the gang told why none of its claims is allocated")
    for i in range(3):
        claim = await claim_of(admin, namespace, f"big-{i}")
        assert claim is not None and not where(claim), "no member holds a GPU while the gang cannot complete"
    for i in range(2):  # a gang of two fits: both allocated, both bound
        await member(f"pair-{i}", 2)

    async def pair_bound() -> list[str] | None:
        found = [await node_of(admin, namespace, f"pair-{i}") for i in range(2)]
        return [n for n in found if n] if all(found) else None

    placed = await wait_for(pair_bound, timeout=90, what="the gang of two bound")
    assert len(set(placed)) == 2


async def test_a_dra_gang_whose_members_keep_apart_gets_a_node_each(
    admin: client.KubeClient,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
    device_class: str,
) -> None:
    """Members with required pod anti-affinity among themselves (one worker per node): claims the
    allocator puts on one node (it prefers the gang's nodes) are taken back by kube-scheduler for the
    member it turns away, and placed again elsewhere (`avoid`): the gang is bound, a node each."""
    await nodes(2, gpus=2, dra=True)
    await template(admin, namespace, "share", 300, "1Gi")
    apart = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"job": "apart"}}, "topologyKey": "kubernetes.io/hostname"}]}}  # fmt: skip
    for i in range(2):
        body = dra_pod(f"apart-{i}", namespace, "share")
        body["metadata"]["annotations"] = {names.GANG: "apart", names.GANG_MIN: "2"}
        body["metadata"]["labels"] = {**body["metadata"].get("labels", {}), "job": "apart"}
        body["spec"]["affinity"] = apart
        await admin.create(paths.pods(namespace), body)

    async def bound() -> list[str] | None:
        found = [await node_of(admin, namespace, f"apart-{i}") for i in range(2)]
        return [n for n in found if n] if all(found) else None

    placed = await wait_for(bound, timeout=90, what="both members bound")
    assert len(set(placed)) == 2, placed
