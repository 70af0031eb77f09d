"""The agent's Warning events: one the API refuses is kept and written at a later pass, once."""

from __future__ import annotations

from sharegpu.agent import notices
from sharegpu.api import events, paths
from sharegpu.kube import client, fake
from sharegpu.kube import events as kube_events


async def test_a_refused_warning_is_written_at_a_later_pass_and_only_once() -> None:
    server = fake.FakeApiServer()
    api = client.KubeClient(server)
    warnings = notices.Notices(kube_events.Recorder(api, "sharegpu-agent", "n0", lambda: 0.0))
    node = events.node("n0", "uid-n0")
    pod = events.pod("team", "a", "uid-a")
    server.fail(503, method="POST", path=paths.events(events.CLUSTER_EVENTS), times=2)
    assert not await warnings.warn(node, "IsolationNotProven", "isolation mps not offered", "mps/node")
    assert await warnings.warn(pod, "GPUProcessKilled", "killed process(es) 7", "kill|7")
    await warnings.retell()  # refused again: kept
    assert len(warnings.untold) == 1
    await warnings.retell()
    await warnings.retell()
    written = server.list_objects(paths.events(events.CLUSTER_EVENTS))
    assert [(e["reason"], e["message"]) for e in written] == [("IsolationNotProven", "isolation mps not offered")]
    assert not warnings.untold
    assert [e["reason"] for e in server.list_objects(paths.events("team"))] == ["GPUProcessKilled"]


async def test_what_is_kept_is_bounded() -> None:
    server = fake.FakeApiServer()
    warnings = notices.Notices(kube_events.Recorder(client.KubeClient(server), "sharegpu-agent", "n0", lambda: 0.0))
    server.fail(503, method="POST", times=notices.KEPT + 5)
    for i in range(notices.KEPT + 5):
        await warnings.warn(events.pod("team", f"p{i}", f"u{i}"), "GPUAssignmentDrift", "drift", f"d{i}")
    assert len(warnings.untold) == notices.KEPT and warnings.untold[0][0].name == "p5", "the newest are kept"
