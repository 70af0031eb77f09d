"""A compromised node, played with its own credentials on the real API server: the node agent's token
and a reservation pod's token as TokenRequest issues them (bound to their pod, so that they name the
pod and its node, as the kubelet projects them), and the extender's and controller's accounts. Each
may do what its component does and is refused the rest (docs/security.md)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sharegpu.api import dra, groups, names, paths, pods, resources, usage, wire
from sharegpu.core import units
from sharegpu.devcluster import controlplane, stack
from sharegpu.extender import reservations
from sharegpu.kube import client, leader
from sharegpu.kube import errors as kube_errors
from tests.builders import MakeAllocation, MakeClaim, MakeDevice, MakeNode, MakePod
from tests.integration.conftest import RunningWebhook, get_or_none, leaving, wait_for

Json = dict[str, Any]
SYSTEM = names.SYSTEM_NAMESPACE
HOLDING = names.HOLDING_NAMESPACE


async def refused(write: Callable[[], Any], *words: str) -> str:
    """The message of a write the API server refuses as forbidden, holding each of `words`."""
    with pytest.raises(kube_errors.ApiError) as caught:
        await write()
    assert caught.value.status == 403, caught.value
    for word in words:
        assert word in caught.value.message, caught.value.message
    return caught.value.message


class Node:
    """A fake node with a pod of sharegpu's on it (the agent's, or a reservation)."""

    def __init__(self, admin: client.KubeClient, name: str) -> None:
        self.admin = admin
        self.name = name
        self.made: list[str] = []

    async def pod(self, name: str, component: str, labels: dict[str, str] | None = None) -> Json:
        """A pod running as `component`'s ServiceAccount, in that account's namespace."""
        namespace = names.account_namespace(component)
        body = MakePod(name, namespace).labels(labels or {}).node(self.name)
        body.spec(serviceAccountName=names.account(component))
        made = await self.admin.create(paths.pods(namespace), body.container("c", image="x").restricted().obj())
        self.made.append(paths.pod(namespace, name))
        return made

    async def reservation(self, name: str) -> Json:
        role = {names.LABEL_ROLE: names.ROLE_RESERVATION, names.LABEL_NODE: self.name, names.LABEL_SLOT: "0"}
        return await self.pod(name, "reserve", role)


@pytest.fixture
async def two_nodes(admin: client.KubeClient, system: None) -> AsyncIterator[tuple[Node, Node]]:
    suffix = uuid.uuid4().hex[:6]
    made = (Node(admin, f"here-{suffix}"), Node(admin, f"there-{suffix}"))
    for node in made:
        await admin.create(paths.NODES, MakeNode(node.name).obj())
    yield made
    for node in made:
        for path in node.made:
            await admin.delete(path, grace_period=0)
        with contextlib.suppress(kube_errors.NotFoundError):
            await admin.delete(paths.device(node.name))
        await admin.delete(paths.node(node.name))


async def bound(
    admin: client.KubeClient, plane: controlplane.ControlPlane, component: str, pod: Json | None = None
) -> client.KubeClient:
    """A client with a token of `component`'s ServiceAccount, bound to `pod` when given."""
    token = await stack.issue_token(admin, names.account_namespace(component), names.account(component), pod)
    return stack.kube_with_token(plane, token)


def bare(name: str, namespace: str, node: str) -> Json:
    return MakePod(name, namespace).node(node).container(image="x").obj()


def labelled(key: str, value: str = "") -> Json:
    return {"metadata": {"labels": {key: value}}}


def slice_of(node: str, driver: str) -> Json:
    pool = {"name": node, "generation": 1, "resourceSliceCount": 1}
    return {"apiVersion": dra.API_VERSION, "kind": "ResourceSlice", "metadata": {"name": f"{node}-{driver}"},
            "spec": {"driver": driver, "nodeName": node, "pool": pool, "devices": []}}  # fmt: skip


async def test_a_nodes_agent_writes_only_its_own_node_its_device_slices_reservations_and_evictions(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, webhook: RunningWebhook,
    two_nodes: tuple[Node, Node], namespace: str,
) -> None:  # fmt: skip
    here, there = two_nodes
    agent_pod = await here.pod(f"agent-{here.name}", "agent")
    agent = await bound(admin, control_plane, "agent", agent_pod)
    unbound = await bound(admin, control_plane, "agent")
    node, other = paths.node(here.name), paths.node(there.name)
    gpu_label = "sharegpu.io/gpu-model"
    try:
        # Nodes: only sharegpu's labels, only its own.
        await agent.patch(node, labelled(gpu_label, "T4"))
        await agent.patch(node, labelled("sharegpu.io/isolation-mps", "true"))
        await refused(lambda: agent.patch(node, labelled("node-role.kubernetes.io/control-plane")),
                      f"on {here.name} changes only the GPU labels")  # fmt: skip
        # A group's label pulls its members (another tenant's pods, their Secrets) onto the node: the
        # controller's alone to write, on the node the group is bound to.
        await refused(lambda: agent.patch(node, labelled(groups.node_label("t", "g"), groups.BOUND)),
                      "a group's label is the controller's")  # fmt: skip
        await refused(lambda: agent.patch(node, {"spec": {"unschedulable": True}}), f"on {here.name}")
        await refused(lambda: agent.patch(other, labelled(gpu_label, "T4")), f"not UPDATE Node {there.name}")
        # Devices: its node's.
        await agent.create(paths.DEVICES, MakeDevice(here.name).obj())
        device = MakeDevice(there.name).obj()
        await refused(lambda: agent.create(paths.DEVICES, device), f"may write only Device {here.name}")
        # GpuUsages: its node's (what its pods use); another node's figures are not its to write.
        await agent.create(
            paths.GPU_USAGES, wire.encode(usage.report(here.name, None, "2026-01-01T00:00:00Z", 10, [], []))
        )
        here.made.append(paths.gpu_usage(here.name))
        forged = wire.encode(usage.report(there.name, None, "2026-01-01T00:00:00Z", 10, [], []))
        await refused(lambda: agent.create(paths.GPU_USAGES, forged), f"may write only GpuUsage {here.name}")
        await admin.create(paths.GPU_USAGES, forged)
        there.made.append(paths.gpu_usage(there.name))
        status_path, status_body = resources.GPU_USAGE.status_update(
            usage.read(await admin.get(paths.gpu_usage(there.name))).metadata, usage.UsageSpec(node=there.name),
            usage.UsageStatus(observed_at="2026-01-01T00:00:00Z"),
        )  # fmt: skip
        await refused(lambda: agent.replace(status_path, status_body), f"may write only GpuUsage {here.name}")
        await refused(lambda: agent.delete(paths.gpu_usage(here.name)), "cannot delete")  # RBAC gives no delete
        # ResourceSlices: sharegpu's, of its node (where resource.k8s.io/v1 is served).
        if await client.serves_when_answered(admin, dra.API_VERSION):
            await agent.create(dra.SLICES, slice_of(here.name, dra.DRIVER))
            here.made.append(f"{dra.SLICES}/{here.name}-{dra.DRIVER}")
            elsewhere, foreign = slice_of(there.name, dra.DRIVER), slice_of(here.name, "gpu.nvidia.com")
            await refused(lambda: agent.create(dra.SLICES, elsewhere), "ResourceSlices of its own node")
            await refused(lambda: agent.create(dra.SLICES, foreign), "ResourceSlices")
            # It may delete its own (when it stops serving DRA), never another node's.
            await admin.create(dra.SLICES, elsewhere)
            there.made.append(f"{dra.SLICES}/{there.name}-{dra.DRIVER}")
            await refused(lambda: agent.delete(f"{dra.SLICES}/{there.name}-{dra.DRIVER}"), "of its own node")
            await agent.delete(f"{dra.SLICES}/{here.name}-{dra.DRIVER}")
            here.made.remove(f"{dra.SLICES}/{here.name}-{dra.DRIVER}")
        # Pods: the reported GPU of a reservation on its node; nothing else, nobody else's.
        ours = paths.pod(HOLDING, (await here.reservation(f"r-{here.name}"))["metadata"]["name"])
        theirs = paths.pod(HOLDING, (await there.reservation(f"r-{there.name}"))["metadata"]["name"])
        report = {"metadata": {"annotations": {names.GPU_UUID: "GPU-1"}}}
        await agent.patch(ours, report)
        await refused(
            lambda: agent.patch(theirs, report), "changes only the reported GPU of a reservation pod on its node"
        )
        await refused(lambda: agent.patch(ours, labelled("x", "y")), "changes only the reported GPU")
        victim = await admin.create(
            paths.pods(namespace), MakePod("victim", namespace).node(there.name).container(image="x").obj()
        )
        await refused(lambda: agent.patch(paths.pod(namespace, "victim"), labelled("x", "y")))
        # Evictions: pods on its node only.
        local = await admin.create(
            paths.pods(namespace), MakePod("local", namespace).node(here.name).container(image="x").obj()
        )

        def evict(pod: Json) -> Any:
            name = pod["metadata"]["name"]
            body = pods.eviction(units.pod_key(namespace, name), pod["metadata"]["uid"])
            return agent.create(paths.eviction(namespace, name), body)

        await refused(lambda: evict(victim), f"the node agent on {here.name} may evict only pods on its own node")
        await evict(local)
        await wait_for(lambda: leaving(admin, namespace, "local"), what="the local pod evicted")
        # A token bound to no pod names no node: it writes nothing of a node's.
        await refused(lambda: unbound.patch(node, labelled(gpu_label, "A")), "bound to no node")
        await refused(lambda: unbound.patch(ours, report), "a token bound to no node")
    finally:
        await agent.close()
        await unbound.close()


async def test_a_reservation_pods_token_reports_only_its_own_gpu(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, two_nodes: tuple[Node, Node]
) -> None:
    """What sharegpu reserve does, and nothing of what a stolen token could: another pod's report, its
    own pod's image (the agent's pod's image would be every node's)."""
    here, there = two_nodes
    own = await here.reservation(f"r-{here.name}")
    other = await there.reservation(f"r-{there.name}")
    agent_pod = await here.pod(f"agent-{here.name}", "agent")
    token = await bound(admin, control_plane, "reserve", own)
    report = {"metadata": {"annotations": {names.GPU_UUID: "GPU-7"}}}
    try:
        await token.patch(paths.pod(HOLDING, own["metadata"]["name"]), report)
        stored = await admin.get(paths.pod(HOLDING, own["metadata"]["name"]))
        assert stored["metadata"]["annotations"][names.GPU_UUID] == "GPU-7"
        await refused(lambda: token.patch(paths.pod(HOLDING, other["metadata"]["name"]), report),
                      "changes only its own pod's reported GPU")  # fmt: skip
        # The agent's pod (every node's image) is in another namespace, out of its Role's reach.
        await refused(lambda: token.patch(paths.pod(SYSTEM, agent_pod["metadata"]["name"]), report),
                      f'cannot patch resource "pods" in API group "" in the namespace "{SYSTEM}"')  # fmt: skip
        image = [{"op": "replace", "path": "/spec/containers/0/image", "value": "evil"}]
        await refused(
            lambda: token.patch(paths.pod(HOLDING, own["metadata"]["name"]), image, client.JSON_PATCH),
            "its own pod's reported GPU",
        )
    finally:
        await token.close()


async def test_the_extender_and_controller_create_only_sharegpus_own_pods_and_the_extender_only_lifts_its_gate(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, two_nodes: tuple[Node, Node], namespace: str
) -> None:
    here, _ = two_nodes
    extender = stack.kube_for(control_plane, names.account("extender"))
    controller = stack.kube_for(control_plane, names.account("controller"))
    try:
        made = reservations.reservation_pod(
            names.reservation_name(here.name, 0, "abcdef"), here.name, 0, "sharegpu:test"
        )
        await extender.create(paths.pods(HOLDING), made)
        here.made.append(paths.pod(HOLDING, made["metadata"]["name"]))
        # What PodSecurity's restricted level lets by (a capability it allows, another command) our
        # policy refuses; what it does not (SYS_ADMIN) it refuses first.
        for name, change in (("capable", {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}),
                             ("other-command", {}), ("admin", {"capabilities": {"add": ["SYS_ADMIN"]}})):  # fmt: skip
            evil = reservations.reservation_pod(f"evil-{name}-{here.name}", here.name, 0, "sharegpu:test")
            container = evil["spec"]["containers"][0]
            container["securityContext"] = {**container["securityContext"], **change}
            if name == "other-command":
                container["command"] = ["sh", "-c", "id"]
            words = ["PodSecurity"] if name == "admin" else ["creates only sharegpu's own GPU-holding pods"]
            await refused(lambda e=evil: extender.create(paths.pods(HOLDING), e), *words)  # type: ignore[misc]
        host = reservations.reservation_pod(f"evil-host-{here.name}", here.name, 0, "sharegpu:test")
        host["spec"]["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
        await refused(lambda: extender.create(paths.pods(HOLDING), host), "hostPath")  # PodSecurity, then ours
        # Only in the holding namespace: not beside sharegpu's own components (their accounts, secrets).
        beside = reservations.reservation_pod(f"beside-{here.name}", here.name, 0, "sharegpu:test")
        beside["metadata"]["namespace"] = SYSTEM
        await refused(lambda: extender.create(paths.pods(SYSTEM), beside), f'in the namespace "{SYSTEM}"')
        holder = reservations.reservation_pod(f"holder-{here.name}", here.name, 0, "sharegpu:test")
        holder["metadata"]["labels"] = {names.LABEL_ROLE: names.ROLE_GROUP_HOLDER, **groups.group_labels("t", "g")}
        await refused(lambda: extender.create(paths.pods(HOLDING), holder), "creates only")
        await controller.create(paths.pods(HOLDING), holder)
        here.made.append(paths.pod(HOLDING, holder["metadata"]["name"]))
        # The DRA gate: only it goes.
        gated = MakePod("gated", namespace).container(image="x").obj()
        gated["spec"]["schedulingGates"] = [{"name": "someone.else/gate"}, {"name": names.DRA_GATE}]
        await admin.create(paths.pods(namespace), gated)
        path = paths.pod(namespace, "gated")
        theirs = [{"op": "remove", "path": "/spec/schedulingGates/0"}]
        await refused(lambda: extender.patch(path, theirs, client.JSON_PATCH),
                      "only to lift its scheduling gate sharegpu.io/dra-allocation")  # fmt: skip
        await refused(lambda: extender.patch(path, {"metadata": {"labels": {"x": "y"}}}), "only to lift")
        # InvalidError: no gate at 1 (a JSON patch error, not a refusal), as the suite's own extender,
        # running as this same account, lifted it first (it lets a gated pod with no claim go at once).
        with contextlib.suppress(kube_errors.InvalidError):
            await extender.patch(path, [{"op": "remove", "path": "/spec/schedulingGates/1"}], client.JSON_PATCH)
        stored = await admin.get(path)
        assert stored["spec"]["schedulingGates"] == [{"name": "someone.else/gate"}]
    finally:
        await extender.close()
        await controller.close()


async def test_the_controller_changes_only_the_groups_labels_of_a_node(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, two_nodes: tuple[Node, Node]
) -> None:
    here, _ = two_nodes
    controller = stack.kube_for(control_plane, names.account("controller"))
    node = paths.node(here.name)
    try:
        await controller.patch(node, labelled(groups.node_label("t", "g"), groups.BOUND))
        for change in (labelled("node-role.kubernetes.io/control-plane"), {"spec": {"unschedulable": True}},
                       {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}):  # fmt: skip
            await refused(lambda c=change: controller.patch(node, c),  # type: ignore[misc]
                          "changes only the SharedDeviceGroups' labels")  # fmt: skip
    finally:
        await controller.close()


HandTo = Callable[[str], Any]


@pytest.fixture
async def extender_lease(admin: client.KubeClient) -> AsyncIterator[HandTo]:
    """Hands the Lease `sharegpu-extender` to a pod (the holder identity kube.leader writes for it);
    the Lease is as it was afterwards."""
    lease = paths.lease(SYSTEM, names.EXTENDER_LEASE)
    before = await get_or_none(admin, lease)

    async def hand_to(pod: str) -> None:
        spec = {"holderIdentity": leader.identity(pod), "leaseDurationSeconds": 3600}
        current = await get_or_none(admin, lease)
        if current is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": names.EXTENDER_LEASE, "namespace": SYSTEM}, "spec": spec}  # fmt: skip
            await admin.create(paths.leases(SYSTEM), body)
        else:
            current["spec"] = {**current["spec"], **spec}
            await admin.replace(lease, current)

    yield hand_to
    if before is None:
        with contextlib.suppress(kube_errors.NotFoundError):
            await admin.delete(lease)
    else:
        current = await admin.get(lease)
        current["spec"] = before["spec"]
        await admin.replace(lease, current)


def passes(write: Callable[[], Any]) -> Callable[[], Any]:
    """`write` as a `wait_for` predicate: False while the policy refuses it (it has not read the
    Lease's new holder yet)."""

    async def attempt() -> bool:
        try:
            await write()
        except kube_errors.ForbiddenError:
            return False
        return True

    return attempt


async def test_an_old_leaders_claim_write_that_arrives_after_the_lease_moved_is_refused(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    two_nodes: tuple[Node, Node],
    namespace: str,
    extender_lease: HandTo,
) -> None:
    """Two extender replicas (their tokens bound to their pods, as in a cluster): a claim's allocation
    written by the one that holds the Lease passes; the same write from the other, or from the first
    once the Lease has moved (a write held in flight past the new leader's fence), is refused by the
    API server (the `sharegpu-leader` policy)."""
    if not await client.serves_when_answered(admin, dra.API_VERSION):
        pytest.skip("no resource.k8s.io/v1 here: no claims")
    here, _ = two_nodes
    first = await bound(admin, control_plane, "extender", await here.pod(f"ext-a-{here.name}", "extender"))
    second = await bound(admin, control_plane, "extender", await here.pod(f"ext-b-{here.name}", "extender"))
    for name in ("lead", "other", "late", "new"):
        await admin.create(dra.claim_path(namespace), MakeClaim(name, namespace).ask(300, "4Gi").obj())

    async def allocate(kube: client.KubeClient, name: str) -> Any:
        claim = await admin.get(dra.claim_path(namespace, name))
        placed = MakeAllocation(f"{namespace}/{name}#claim", here.name).grant(0, 300, 4096, container="gpu").obj()
        claim["status"] = {"allocation": dra.claim_allocation(placed, [str(uuid.uuid4())], wire.timestamp(1e9))}
        return await kube.replace(f"{dra.claim_path(namespace, name)}/status", claim)

    try:
        await extender_lease(f"ext-a-{here.name}")
        await wait_for(passes(lambda: allocate(first, "lead")), what="the leader's write let through")
        await refused(lambda: allocate(second, "other"), f"pod ext-b-{here.name} does not")
        await extender_lease(f"ext-b-{here.name}")  # the leader changes while ext-a's write is in flight
        await wait_for(passes(lambda: allocate(second, "new")), what="the new leader's write let through")
        await refused(lambda: allocate(first, "late"), "only the pod that holds the Lease sharegpu-extender")
        assert not ((await admin.get(dra.claim_path(namespace, "late"))).get("status") or {}).get("allocation")
    finally:
        await first.close()
        await second.close()


async def test_an_old_leaders_binding_that_arrives_after_the_lease_moved_is_refused(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    two_nodes: tuple[Node, Node],
    extender_lease: HandTo,
) -> None:
    """The same fence for pods/binding in the chart's pod (kube-scheduler and the extender, under the
    scheduler's account): a binding (with its allocation annotation) sent by the pod that held the
    Lease but landing after the Lease moved, e.g. held at a gang's barrier or on the network while
    its kube-scheduler was replaced, is refused, so it cannot put a second pod on a GPU the new
    leader has given away meanwhile. An extender run apart from kube-scheduler under its own account
    binds from every replica (kube-scheduler calls any of them), so its bindings are not judged."""
    here, there = two_nodes
    pods_of: dict[str, list[client.KubeClient]] = {}
    for component in ("scheduler", "extender"):
        pods_of[component] = [
            await bound(admin, control_plane, component, await here.pod(f"{component}-{n}-{here.name}", component))
            for n in ("a", "b")
        ]
    first, second = pods_of["scheduler"]
    namespace = names.SYSTEM_NAMESPACE  # beside the replicas' pods (two_nodes deletes them all)
    suffix = uuid.uuid4().hex[:6]
    for name in ("lead", "other", "late", "new", "apart"):
        made = MakePod(f"{name}-{suffix}", namespace).container(image="x").restricted().obj()
        await admin.create(paths.pods(namespace), made)
        there.made.append(paths.pod(namespace, f"{name}-{suffix}"))

    async def bind(kube: client.KubeClient, name: str) -> Any:
        pod = f"{name}-{suffix}"
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod, "namespace": namespace},
                "target": {"apiVersion": "v1", "kind": "Node", "name": there.name}}  # fmt: skip
        return await kube.create(paths.binding(namespace, pod), body)

    async def node_of(name: str) -> str:
        return str((await admin.get(paths.pod(namespace, f"{name}-{suffix}")))["spec"].get("nodeName") or "")

    try:
        await extender_lease(f"scheduler-a-{here.name}")
        await wait_for(passes(lambda: bind(first, "lead")), what="the leader's binding let through")
        await refused(lambda: bind(second, "other"), f"pod scheduler-b-{here.name} does not")
        await extender_lease(f"scheduler-b-{here.name}")  # the leader changes while a's binding is in flight
        await wait_for(passes(lambda: bind(second, "new")), what="the new leader's binding let through")
        await refused(lambda: bind(first, "late"), "only the pod that holds the Lease sharegpu-extender")
        await bind(pods_of["extender"][0], "apart")  # neither holds the Lease: not judged
        assert [await node_of(n) for n in ("lead", "other", "late", "new", "apart")] == [
            there.name,
            "",
            "",
            there.name,
            there.name,
        ]
    finally:
        for kube in (*pods_of["scheduler"], *pods_of["extender"]):
            await kube.close()


async def test_the_extender_makes_only_sharegpus_pod_claims(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None, namespace: str
) -> None:
    """The extender may create ResourceClaims (the claim the webhook named for a pod of the DRA path),
    and RBAC cannot say which: the `sharegpu-pod-claims` policy keeps it, with its own credentials,
    to claims of sharegpu's pod-claim name, owned by one Pod, of sharegpu's class only."""
    if not await client.serves_when_answered(admin, dra.API_VERSION):
        pytest.skip("no resource.k8s.io/v1 here: no claims")
    pod = await admin.create(paths.pods(namespace), MakePod("owner", namespace).container(image="x").obj())
    extender = stack.kube_for(control_plane, names.account("extender"))
    name = dra.Shape(1, 300, memory_mib=4096).claim_name(bytes(10))
    try:
        made = dra.pod_claim(namespace, name, "owner", pod["metadata"]["uid"])

        async def in_force() -> bool:  # the API server loads a new policy within a second or so
            probe = {**made, "metadata": {**made["metadata"], "name": f"probe-{uuid.uuid4().hex[:8]}"}}
            try:
                await extender.create(dra.claim_path(namespace), probe)
            except kube_errors.ForbiddenError:
                return True
            await admin.delete(dra.claim_path(namespace, probe["metadata"]["name"]))
            return False

        await wait_for(in_force, what="the sharegpu-pod-claims policy in force")
        await extender.create(dra.claim_path(namespace), made)  # what the allocator makes: let through
        wrong_name = {**made, "metadata": {**made["metadata"], "name": "anything"}}
        await refused(lambda: extender.create(dra.claim_path(namespace), wrong_name), "only sharegpu pod claims")
        other = dra.Shape(1, 300, memory_mib=4096).claim_name(bytes([1] * 10))
        orphan = dra.pod_claim(namespace, other, "owner", pod["metadata"]["uid"])
        del orphan["metadata"]["ownerReferences"]
        await refused(lambda: extender.create(dra.claim_path(namespace), orphan), "owned by its one Pod")
        foreign = dra.pod_claim(namespace, other, "owner", pod["metadata"]["uid"])
        foreign["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
        await refused(lambda: extender.create(dra.claim_path(namespace), foreign), "sharegpu's class only")
        assert await get_or_none(admin, dra.claim_path(namespace, other)) is None
    finally:
        await extender.close()
