"""Lease-based leader election over the fake API server: one leader at a time, clean hand-over,
take-over after a partitioned leader steps down, work that runs only while leading, and a follower
that leads exactly while a process of its pod holds the Lease."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from sharegpu.kube import client, errors, fake, informer, leader, terms, transport

LEASE, DEADLINE, RETRY = 0.6, 0.4, 0.05


def elector(kube: client.KubeClient, identity: str) -> leader.LeaderElector:
    return leader.LeaderElector(kube, "ns", "lock", identity, terms.Terms(LEASE, DEADLINE, RETRY))


class Partition:
    """A transport that can be cut off from the server (a network partition for one replica)."""

    def __init__(self, inner: fake.FakeApiServer) -> None:
        self.inner = inner
        self.cut = False

    async def send(self, request: transport.Request, timeout: float) -> transport.Response:
        if self.cut:
            raise errors.TransportError("partitioned")
        return await self.inner.send(request, timeout)

    def stream(
        self, request: transport.Request, idle_timeout: float
    ) -> contextlib.AbstractAsyncContextManager[transport.Stream]:
        return self.inner.stream(request, idle_timeout)

    async def close(self) -> None:
        return None


@contextlib.asynccontextmanager
async def running(*electors: leader.LeaderElector) -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks = [asyncio.create_task(e.run()) for e in electors]
    try:
        yield tasks
    finally:
        await informer.cancel(tasks)


async def watch_leaders(
    electors: Sequence[leader.Leadership], seconds: float, until: Callable[[], bool] = lambda: False
) -> int:
    """The most electors that led at the same moment during `seconds` (or until `until()` holds)."""
    most = 0
    for _ in range(int(seconds / 0.01)):
        most = max(most, sum(e.is_leader for e in electors))
        if until():
            break
        await asyncio.sleep(0.01)
    return most


async def test_one_leader_and_a_clean_hand_over() -> None:
    server = fake.FakeApiServer()
    a = elector(client.KubeClient(server), "a")
    b = elector(client.KubeClient(server), "b")
    async with running(a) as first:
        await asyncio.wait_for(a.leading.wait(), 2)
        async with running(b):
            assert await watch_leaders([a, b], 1.0) == 1
            assert a.is_leader and not b.is_leader
            loop = asyncio.get_running_loop()
            stopped = loop.time()
            await informer.cancel(first)  # a stops cleanly and releases the Lease
            await asyncio.wait_for(b.leading.wait(), 2)
            assert loop.time() - stopped < LEASE, "a released Lease is taken at once"
    lease = server.get_object("/apis/coordination.k8s.io/v1/namespaces/ns/leases/lock")
    assert lease is not None and lease["spec"]["leaseTransitions"] == 1


async def test_a_partitioned_leader_steps_down_before_another_takes_over() -> None:
    server = fake.FakeApiServer()
    link = Partition(server)
    a = elector(client.KubeClient(link), "a")
    b = elector(client.KubeClient(server), "b")
    async with running(a, b):
        await asyncio.wait_for(a.leading.wait(), 2)
        await asyncio.sleep(0.2)
        link.cut = True
        most = await watch_leaders([a, b], 1.5, until=lambda: b.is_leader)
        assert most == 1, "never two leaders at once"
        assert b.is_leader and not a.is_leader


async def test_work_runs_only_while_leading() -> None:
    server = fake.FakeApiServer()
    link = Partition(server)
    a = elector(client.KubeClient(link), "a")
    state = {"running": 0, "started": 0}

    async def work() -> None:
        state["running"] += 1
        state["started"] += 1
        try:
            await asyncio.Event().wait()
        finally:
            state["running"] -= 1

    async with running(a):
        runner = asyncio.create_task(leader.run_while_leading(a, lambda: [work()]))
        await asyncio.wait_for(a.leading.wait(), 2)
        await asyncio.sleep(0.1)
        assert state == {"running": 1, "started": 1}
        link.cut = True
        for _ in range(100):
            if not a.is_leader:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert state["running"] == 0, "the work stops with the leadership"
        link.cut = False
        await asyncio.wait_for(a.leading.wait(), 3)
        await asyncio.sleep(0.1)
        assert state == {"running": 1, "started": 2}
        await informer.cancel([runner])


def test_timings_must_nest() -> None:
    import pytest

    with pytest.raises(ValueError, match="--retry-period < --renew-deadline < --lease-duration, got 2, 2, 1"):
        terms.Terms(lease_duration=1, renew_deadline=2)
    with pytest.raises(ValueError, match="0 < --retry-period"):
        terms.Terms(retry_period=0)


def follower(kube: client.KubeClient, pod: str) -> leader.Follower:
    return leader.Follower(kube, "ns", "lock", pod, terms.Terms(LEASE, DEADLINE, RETRY))


async def test_a_follower_leads_exactly_while_a_process_of_its_pod_holds_the_lease() -> None:
    """Two pods, each a campaigning process (kube-scheduler's identity: `<pod>_<uuid>`) and a follower
    (the extender beside it): the followers lead where their pod's process leads, never both, and
    the lead moves with the Lease; the followers never write it."""
    server = fake.FakeApiServer()
    a, b = elector(client.KubeClient(server), "pod-a_1111"), elector(client.KubeClient(server), "pod-b_2222")
    fa, fb = follower(client.KubeClient(server), "pod-a"), follower(client.KubeClient(server), "pod-b")
    followers = [fa, fb]
    f_tasks = [asyncio.create_task(f.run()) for f in followers]
    try:
        async with running(a) as first:
            await asyncio.wait_for(fa.leading.wait(), 2)
            async with running(b):
                assert await watch_leaders(followers, 0.5) == 1
                assert [f.is_leader for f in followers] == [True, False]
                await informer.cancel(first)  # pod-a's process goes; pod-b's takes the Lease
                most = await watch_leaders(followers, 2.0, until=lambda: fb.is_leader)
                assert most == 1 and [f.is_leader for f in followers] == [False, True]
        lease = server.get_object("/apis/coordination.k8s.io/v1/namespaces/ns/leases/lock")
        assert lease is not None and lease["spec"]["leaseTransitions"] == 1, "only the campaigners wrote it"
    finally:
        await informer.cancel(f_tasks)


async def test_a_follower_steps_down_when_it_cannot_read_the_lease_or_its_holder_stops_renewing() -> None:
    server = fake.FakeApiServer()
    holder_link, link = Partition(server), Partition(server)
    holder = elector(client.KubeClient(holder_link), "pod-a_1111")
    f = follower(client.KubeClient(link), "pod-a")
    prefix = follower(client.KubeClient(server), "pod")  # a pod whose name only begins the holder's pod's
    loop = asyncio.get_running_loop()

    async def stepped_down() -> float:
        began = loop.time()
        while f.is_leader and loop.time() - began < 3:
            await asyncio.sleep(0.01)
        assert not f.is_leader
        return loop.time() - began

    tasks = [asyncio.create_task(f.run()), asyncio.create_task(prefix.run())]
    try:
        async with running(holder):
            await asyncio.wait_for(f.leading.wait(), 2)
            assert not prefix.is_leader, "pod-a's process is not pod's"
            link.cut = True  # the follower cannot read the Lease
            assert await stepped_down() < LEASE, "stepped down before another could take the Lease"
            link.cut = False
            await asyncio.wait_for(f.leading.wait(), 2)
            holder_link.cut = True  # the holder stops renewing (not released: the Lease still names it)
            await stepped_down()
            lease = server.get_object("/apis/coordination.k8s.io/v1/namespaces/ns/leases/lock")
            assert lease is not None and lease["spec"]["holderIdentity"] == "pod-a_1111"
    finally:
        await informer.cancel(tasks)
