"""Recording events: an event recorded twice is in the API once; one `tell` could not write (the
API server restarting) is kept, once however often it is told, and written by a later `retell`,
once; what is kept is bounded."""

from __future__ import annotations

import asyncio

from sharegpu.api import events, paths
from sharegpu.kube import client, fake
from sharegpu.kube import events as kube_events


def recorder(server: fake.FakeApiServer) -> kube_events.Recorder:
    return kube_events.Recorder(client.KubeClient(server), "sharegpu-agent", "n0", lambda: 0.0)


async def test_the_same_decision_is_recorded_once() -> None:
    server = fake.FakeApiServer()
    told = recorder(server)
    pod = events.pod("team", "a", "uid-a")
    assert await told.record(pod, "GPUProcessKilled", "killed 7", decision="kill|7")
    assert not await told.record(pod, "GPUProcessKilled", "killed 7", decision="kill|7")
    assert len(server.list_objects(paths.events("team"))) == 1 and (told.recorded, told.repeated) == (1, 1)


async def test_a_refused_event_is_written_by_a_later_retell_and_only_once() -> None:
    server = fake.FakeApiServer()
    told = recorder(server)
    node = events.node("n0", "uid-n0")
    pod = events.pod("team", "a", "uid-a")
    server.fail(503, method="POST", path=paths.events(events.CLUSTER_EVENTS), times=2)
    assert not await told.tell(node, "IsolationNotProven", "isolation mps not offered", decision="mps/node")
    assert await told.tell(pod, "GPUProcessKilled", "killed process(es) 7", decision="kill|7", kind="Warning")
    await told.retell()  # refused again: kept
    assert len(told.untold) == 1
    await told.retell()
    await told.retell()
    written = server.list_objects(paths.events(events.CLUSTER_EVENTS))
    assert [(e["reason"], e["message"]) for e in written] == [("IsolationNotProven", "isolation mps not offered")]
    assert not told.untold
    assert [(e["reason"], e["type"]) for e in server.list_objects(paths.events("team"))] == [
        ("GPUProcessKilled", "Warning")
    ]


async def test_what_is_kept_is_bounded_to_the_newest() -> None:
    server = fake.FakeApiServer()
    told = recorder(server)
    server.fail(503, method="POST", times=kube_events.KEPT + 5)
    for i in range(kube_events.KEPT + 5):
        await told.tell(events.pod("team", f"p{i}", f"u{i}"), "GPUAssignmentDrift", "drift", decision=f"d{i}")
    assert len(told.untold) == kube_events.KEPT and next(iter(told.untold))[0].name == "p5"


async def test_two_passes_retelling_at_once_share_the_kept_events() -> None:
    """Reconcilers of one component share its recorder and retell from their own loops."""
    server = fake.FakeApiServer()
    told = recorder(server)
    server.fail(503, method="POST", times=3)
    for i in range(3):
        await told.tell(events.pod("team", f"p{i}", f"u{i}"), "GPUShareIdleEvicted", "evicted", decision=f"d{i}")
    await asyncio.gather(told.retell(), told.retell(), told.retell())
    assert not told.untold and len(server.list_objects(paths.events("team"))) == 3


async def test_an_event_told_again_while_it_is_kept_is_kept_once() -> None:
    """A caller that retries its own decision each pass (the idle reclaimer's warning) while the API
    refuses keeps one event, not one a pass; once its own retry succeeds, nothing is left to retell."""
    server = fake.FakeApiServer()
    told = recorder(server)
    pod = events.pod("team", "a", "uid-a")
    server.fail(503, method="POST", times=3)
    for minutes in (10, 11, 12):
        await told.tell(pod, "GPUShareIdle", f"idle for {minutes} min", decision="uid-a|1000", kind="Warning")
    assert list(told.untold.values()) == [("idle for 10 min", "Warning")]
    assert await told.tell(pod, "GPUShareIdle", "idle for 13 min", decision="uid-a|1000", kind="Warning")
    assert not told.untold
    await told.retell()
    assert [e["message"] for e in server.list_objects(paths.events("team"))] == ["idle for 13 min"]
