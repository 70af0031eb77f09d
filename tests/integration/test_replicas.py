"""Two extender replicas, each beside its own kube-scheduler (both leader-elected), on a control
plane of their own: the background reconcilers run on the Lease holder only; kill it (with its
scheduler, as a lost node would) and the other takes over within the lease duration, with no
reservation or hand-off decision made twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sharegpu.api import names, paths
from sharegpu.core import devices
from sharegpu.devcluster import controlplane, fakecluster, oracle, stack
from sharegpu.kube import client
from tests.integration.conftest import gpu_pod, lease_holder, wait_for

LEASE = 4.0
ELECTION = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5")
NAMESPACE = "replicas"


class Pair:
    def __init__(self, plane: controlplane.ControlPlane, name: str) -> None:
        self.name = name
        self.extender = stack.ExtenderProcess(plane, "fgd-used", "--identity", name, *ELECTION)
        self.scheduler = f"kube-scheduler-{name}"

    def start(self, plane: controlplane.ControlPlane) -> None:
        config = stack.scheduler_config(
            plane, self.extender, name=self.scheduler, leader_elect=True, lease=(LEASE, 3.0, 0.5)
        )
        plane.start_scheduler(config, name=self.scheduler)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[controlplane.ControlPlane]:
    made = controlplane.ControlPlane(tmp_path_factory.mktemp("replicas"), controlplane.binaries())
    made.start()
    yield made
    made.stop()


@pytest.fixture(scope="module")
async def cluster(plane: controlplane.ControlPlane) -> AsyncIterator[tuple[client.KubeClient, list[Pair]]]:
    admin = stack.kube_for(plane, "admin")
    await stack.install(admin)
    harness = fakecluster.FakeCluster(admin)
    await harness.start()
    nodes = [
        devices.uniform_node(f"r{i}", gpu_count=2, model="T4", gpu_memory_mib=16384, cpu_milli=32000, memory_mib=65536)
        for i in range(3)
    ]
    await harness.add_nodes(nodes)
    pairs = [Pair(plane, "replica-a"), Pair(plane, "replica-b")]
    for pair in pairs:
        pair.extender.start()
    for pair in pairs:
        await pair.extender.wait_ready()
        pair.start(plane)
    await admin.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    yield admin, pairs
    for pair in pairs:
        pair.extender.kill()
    await harness.stop()
    await admin.close()


async def metric(pair: Pair, name: str, labels: str) -> float:
    async with (
        aiohttp.ClientSession(headers=pair.extender.headers) as session,
        session.get(f"{pair.extender.health_url}/metrics", ssl=pair.extender.health_ssl) as response,
    ):
        for line in (await response.text()).splitlines():
            if line.startswith(f"{name}{{{labels}}}"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def sharing(admin: client.KubeClient, names_: list[str]) -> None:
    for name in names_:
        pod = gpu_pod(name, NAMESPACE, milli=600, annotations={names.HANDOFF: f"sharegpu-handoff-{name}"})
        pod["spec"].pop("nodeSelector")
        await admin.create(paths.pods(NAMESPACE), pod)


async def handoffs(admin: client.KubeClient) -> dict[str, str]:
    """Hand-off ConfigMap -> resourceVersion, once every sharing pod's is filled."""
    items, _ = await admin.list_all(paths.configmaps(NAMESPACE))
    return {
        c["metadata"]["name"]: c["metadata"]["resourceVersion"]
        for c in items
        if c["metadata"]["name"].startswith(names.HANDOFF_PREFIX) and c.get("data")
    }


async def settled(admin: client.KubeClient, count: int) -> dict[str, Any] | None:
    found = await oracle.inspect(admin)
    assert not (found.overcommits or found.double_allocations or found.missing_allocations), found.problems()
    maps = await handoffs(admin)
    if found.bound != count or found.problems() or len(maps) != count:
        return None
    reservations, _ = await admin.list_all(paths.pods(names.HOLDING_NAMESPACE))
    return {"handoffs": maps, "reservations": sorted(p["metadata"]["name"] for p in reservations)}


async def test_the_lease_holder_dies_and_the_other_takes_over_without_repeating_itself(
    cluster: tuple[client.KubeClient, list[Pair]], plane: controlplane.ControlPlane, tmp_path: Path
) -> None:
    admin, pairs = cluster
    first_holder = await wait_for(lambda: lease_holder(admin, names.EXTENDER_LEASE), what="a Lease holder")
    leader = next(p for p in pairs if p.name == first_holder)
    survivor = next(p for p in pairs if p is not leader)
    assert await metric(survivor, "sharegpu_extender_leader", "") == 0.0
    await sharing(admin, ["a1", "a2", "a3"])  # 600 milli each: three shared GPUs
    before = await wait_for(lambda: settled(admin, 3), timeout=90, what="three pods with hand-off and reservation")
    assert await metric(survivor, "sharegpu_extender_reservation_pods_total", 'action="created"') == 0.0
    # Every replica claims a pod's hand-off at its bind (empty: the GPU's UUID is not known yet);
    # only the leader fills it.
    assert await metric(survivor, "sharegpu_extender_handoff_writes_total", 'action="updated"') == 0.0

    killed = time.monotonic()
    leader.extender.kill()  # SIGKILL: no clean release of the Lease
    plane.stop_process(leader.scheduler, sig=9)

    async def taken_over() -> bool:
        return await lease_holder(admin, names.EXTENDER_LEASE) == survivor.name

    await wait_for(taken_over, timeout=30, every=0.1, what="the survivor holding the Lease")
    took = time.monotonic() - killed
    assert took <= LEASE + 1.5, f"take-over after {took:.1f} s (lease {LEASE} s)"

    await sharing(admin, ["b1", "b2", "b3"])
    after = await wait_for(lambda: settled(admin, 6), timeout=120, what="three more pods settled by the survivor")
    for name, version in before["handoffs"].items():
        assert after["handoffs"][name] == version, f"{name} was written again"
    assert set(before["reservations"]) <= set(after["reservations"]), "no reservation was replaced"
    assert len(after["reservations"]) == 6, after["reservations"]
    assert await metric(survivor, "sharegpu_extender_handoff_writes_total", 'action="updated"') == 3.0, "the new only"
    assert await metric(survivor, "sharegpu_extender_reservation_pods_total", 'action="created"') == 3.0
    await asyncio.sleep(0)
