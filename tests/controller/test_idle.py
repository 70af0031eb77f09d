"""Idle shares: a pod whose SM use stays at or below its namespace's policy for the policy's time is
reported once, and under `Evict` evicted through the Eviction API (a refusal told and tried again
later); a busy pod, a pod not measured, a namespace without a policy, a stale report: nothing; a gang
only whole."""

from __future__ import annotations

from typing import Any

import msgspec

from sharegpu.api import idle, names, paths, resources, usage, wire
from sharegpu.controller import idle as controller_idle
from sharegpu.kube import client, fake
from sharegpu.kube import events as kube_events
from tests.builders import Clock, MakePod
from tests.controller.conftest import T0
from tests.extender.conftest import settle

Json = dict[str, Any]


def policy(
    namespace: str, name: str = "reclaim", *, after: int = 600, action: str = "Evict", created: str = ""
) -> Json:
    return {
        "apiVersion": resources.GPU_IDLE_POLICY.api_version,
        "kind": "GPUIdlePolicy",
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created or "2026-11-01T00:00:00Z"},
        "spec": {"idleAfterSeconds": after, "idleAtMostPercent": 1, "action": action},
    }


def report(node: str, at: float, *pods: tuple[str, str, str, int | None]) -> usage.GpuUsage:
    """A node's report at `at`: (namespace, name, uid, SM %) per pod, each on GPU-0 with a 300-milli share."""
    uses = [
        usage.PodUse(namespace=ns, name=name, uid=uid, uuid="GPU-0", used_mib=1000, sm_percent=sm, share_milli=300)
        for ns, name, uid, sm in pods
    ]
    return usage.report(node, None, wire.timestamp(at), 10, [], uses)


class Setup:
    def __init__(self) -> None:
        self.server = fake.FakeApiServer()
        self.clock = Clock(T0)
        api = client.KubeClient(self.server)
        self.reconciler = controller_idle.IdleReconciler(
            api, kube_events.Recorder(api, "c", "c", self.clock), self.clock
        )

    def lazy(self) -> None:
        """Namespace ns under an Evict policy (after 600 s), its pod `lazy` reported idle now."""
        self.policy(policy("ns"))
        self.see(report("n0", self.clock.now, ("ns", "lazy", self.pod("lazy"), 0)))

    def pod(self, name: str, namespace: str = "ns", **annotations: str) -> str:
        made = MakePod(name, namespace).annotations(annotations).node("n0").container().phase("Running").obj()
        stored = self.server.put_object(paths.pods(namespace), made)
        return str(stored["metadata"]["uid"])

    def policy(self, body: Json) -> None:
        stored = self.server.put_object(resources.GPU_IDLE_POLICY.path(body["metadata"]["namespace"]), body)
        self.reconciler.on_policy(wire.EventType.ADDED, wire.convert(stored, idle.GPUIdlePolicy))

    def see(self, found: usage.GpuUsage) -> None:
        self.latest = found
        self.reconciler.on_usage(wire.EventType.MODIFIED, found)

    def refresh(self) -> None:
        """The agent rewrites its latest (steady) figures, measured now."""
        status = msgspec.structs.replace(self.latest.status, observed_at=wire.timestamp(self.clock.now))
        self.see(msgspec.structs.replace(self.latest, status=status))

    async def run(self) -> None:
        await self.reconciler.reconcile()
        await settle(self.server)

    def reasons(self, name: str, namespace: str = "ns") -> list[str]:
        return sorted(
            e["reason"]
            for e in self.server.list_objects(paths.events(namespace))
            if e["involvedObject"]["name"] == name
        )

    def leaving(self, name: str, namespace: str = "ns") -> bool:
        found = self.server.get_object(paths.pod(namespace, name))
        return found is None or bool(found["metadata"].get("deletionTimestamp"))

    def status(self, namespace: str = "ns", name: str = "reclaim") -> idle.IdleStatus:
        found = self.server.get_object(resources.GPU_IDLE_POLICY.path(namespace, name))
        assert found is not None
        return wire.convert(found, idle.GPUIdlePolicy).status


async def test_an_idle_share_is_reported_then_evicted_and_a_busy_one_is_left_alone() -> None:
    s = Setup()
    s.policy(policy("ns"))
    lazy, busy = s.pod("lazy"), s.pod("busy")
    s.see(report("n0", s.clock.now, ("ns", "lazy", lazy, 0), ("ns", "busy", busy, 40)))
    s.clock.advance(599)
    s.refresh()
    await s.run()
    assert not s.leaving("lazy") and s.reasons("lazy") == [], "not idle long enough yet"
    s.clock.advance(1)
    await s.run()
    assert not s.leaving("lazy"), "no report has shown it idle 600 s yet (the agent may be gone)"
    s.refresh()
    await s.run()
    assert s.leaving("lazy") and not s.leaving("busy")
    assert s.reasons("lazy") == [controller_idle.IDLE, controller_idle.EVICTED] and s.reasons("busy") == []
    status = s.status()
    assert status.in_force and status.evictions == 1


async def test_a_policy_made_after_the_latest_report_judges_it_and_a_policy_deleted_forgets_it() -> None:
    """Agents rewrite steady figures only every few minutes: a policy that comes after the report
    counts the pod idle from that report, not from one that may be five minutes away."""
    s = Setup()
    lazy = s.pod("lazy")
    s.see(report("n0", s.clock.now, ("ns", "lazy", lazy, 0)))
    assert s.reconciler.idle_for_long() == {}, "no policy yet"
    s.clock.advance(120)
    s.policy(policy("ns", after=100, action="Report"))
    assert s.reconciler.idle_for_long() == {}, "one report proves no idle time"
    s.refresh()
    assert list(s.reconciler.idle_for_long()) == [lazy], "idle since the report 120 s ago, the latest says still"
    await s.run()
    assert s.reasons("lazy") == [controller_idle.IDLE] and not s.leaving("lazy")
    stored = s.server.get_object(resources.GPU_IDLE_POLICY.path("ns", "reclaim"))
    assert stored is not None
    s.reconciler.on_policy(wire.EventType.DELETED, wire.convert(stored, idle.GPUIdlePolicy))
    assert s.reconciler.idle_for_long() == {} and s.reconciler.tracked == {}


async def test_report_only_a_pod_not_measured_no_policy_and_stale_reports_are_not_acted_on() -> None:
    s = Setup()
    s.policy(policy("ns", action="Report"))
    lazy, unmeasured, elsewhere = s.pod("lazy"), s.pod("mig"), s.pod("free", "other")
    s.see(report("n0", s.clock.now, ("ns", "lazy", lazy, 0), ("ns", "mig", unmeasured, None),
                 ("other", "free", elsewhere, 0)))  # fmt: skip
    s.clock.advance(700)
    s.refresh()
    await s.run()
    assert s.reasons("lazy") == [controller_idle.IDLE] and not s.leaving("lazy"), "Report: told, not evicted"
    assert s.reasons("mig") == [] and s.reasons("free", "other") == []
    assert [(p.name, p.share_milli) for p in s.status().idle] == [("lazy", 300)]
    await s.run()
    assert s.reasons("lazy") == [controller_idle.IDLE], "told once"
    s.clock.advance(controller_idle.STALE + 1)
    assert s.reconciler.idle_for_long() == {}, "a report this old is not acted on"


async def test_a_pod_seen_busy_starts_again_and_a_gang_goes_only_whole() -> None:
    s = Setup()
    s.policy(policy("ns"))
    a, b = s.pod("a", **{names.GANG: "job"}), s.pod("b", **{names.GANG: "job"})
    s.see(report("n0", s.clock.now, ("ns", "a", a, 0), ("ns", "b", b, 30)))
    s.clock.advance(400)
    s.see(report("n0", s.clock.now, ("ns", "a", a, 0), ("ns", "b", b, 0)))
    s.clock.advance(300)
    s.refresh()
    await s.run()
    assert not s.leaving("a") and not s.leaving("b"), "b is idle for 300 s only: the gang stays whole"
    s.clock.advance(300)
    s.refresh()
    await s.run()
    assert s.leaving("a") and s.leaving("b")


async def test_an_eviction_a_disruption_budget_refuses_is_told_and_tried_again_later() -> None:
    s = Setup()
    s.lazy()
    s.clock.advance(600)
    s.refresh()
    s.server.fail(429, method="POST", path=paths.eviction("ns", "lazy"))
    await s.run()
    assert not s.leaving("lazy") and controller_idle.BLOCKED in s.reasons("lazy")
    s.clock.advance(30)
    await s.run()
    assert not s.leaving("lazy"), "not before retry"
    s.clock.advance(controller_idle.RETRY)
    await s.run()
    assert s.leaving("lazy")


async def test_the_oldest_policy_of_a_namespace_is_in_force() -> None:
    s = Setup()
    s.policy(policy("ns", "old", action="Report"))  # the fake API server stamps creation in order
    s.policy(policy("ns", "new", action="Evict"))
    lazy = s.pod("lazy")
    s.see(report("n0", s.clock.now, ("ns", "lazy", lazy, 0)))
    s.clock.advance(600)
    s.refresh()
    await s.run()
    assert not s.leaving("lazy"), "the older policy only reports"
    assert s.status(name="old").in_force and not s.status(name="new").in_force


async def test_the_eviction_event_refused_is_written_at_a_later_pass() -> None:
    """The eviction is made once; its event, refused (the API server restarting), is not lost."""
    s = Setup()
    s.lazy()
    s.clock.advance(599)
    await s.run()
    s.clock.advance(1)
    s.refresh()
    s.server.fail(503, method="POST", path=paths.events("ns"), times=3)
    for _ in range(4):
        await s.run()
    assert not s.server.faults, "each refusal was met"
    assert s.leaving("lazy") and s.reasons("lazy") == [controller_idle.IDLE, controller_idle.EVICTED]
    assert len([p for m, p in s.server.requests if m == "POST" and p.endswith("/eviction")]) == 1


def evictions_of(s: Setup, name: str) -> int:
    return len([p for m, p in s.server.requests if m == "POST" and p == paths.eviction("ns", name)])


async def test_a_gang_whose_member_a_budget_protects_is_not_split_nor_asked_again_before_retry() -> None:
    s = Setup()
    s.policy(policy("ns"))
    a, b = s.pod("a", **{names.GANG: "job"}), s.pod("b", **{names.GANG: "job"})
    s.see(report("n0", s.clock.now, ("ns", "a", a, 0), ("ns", "b", b, 0)))
    s.clock.advance(600)
    s.refresh()
    s.server.fail(429, method="POST", path=paths.eviction("ns", "b"), times=100)
    await s.run()
    assert not s.leaving("a") and not s.leaving("b"), "b's budget refuses: a is not evicted without it"
    assert controller_idle.BLOCKED in s.reasons("b")
    asked = evictions_of(s, "a") + evictions_of(s, "b")
    for _ in range(3):  # a's turn comes at each pass, but the gang waits out the retry
        s.clock.advance(1)
        await s.run()
    assert evictions_of(s, "a") + evictions_of(s, "b") == asked


async def test_a_policy_edited_or_deleted_while_a_pass_runs_is_obeyed() -> None:
    s = Setup()
    s.policy(policy("ns"))
    a, b = s.pod("a"), s.pod("b")
    s.see(report("n0", s.clock.now, ("ns", "a", a, 0), ("ns", "b", b, 0)))
    s.clock.advance(600)
    s.refresh()
    r = s.reconciler
    evict = r.api.create

    async def create(path: str, body: Any, **params: Any) -> Any:
        out = await evict(path, body, **params)
        stored = s.server.get_object(resources.GPU_IDLE_POLICY.path("ns", "reclaim"))
        if path.endswith("/eviction") and stored is not None and stored["spec"]["action"] == "Evict":
            stored["spec"]["action"] = "Report"  # the user switches to Report after the first eviction
            r.on_policy(wire.EventType.MODIFIED, wire.convert(stored, idle.GPUIdlePolicy))
        return out

    r.api.create = create  # type: ignore[method-assign]
    await s.run()
    assert s.leaving("a") != s.leaving("b"), "one evicted, the other not after the policy says Report"


async def test_a_policy_deleted_while_its_status_is_written_stays_deleted() -> None:
    s = Setup()
    s.lazy()
    r = s.reconciler
    write = r.api.replace

    async def replace(path: str, body: Any, **params: Any) -> Any:
        stored = await write(path, body, **params)
        s.server.remove_object(resources.GPU_IDLE_POLICY.path("ns", "reclaim"))
        r.on_policy(wire.EventType.DELETED, wire.convert(stored, idle.GPUIdlePolicy))  # before the answer
        r.api.replace = write  # type: ignore[method-assign]
        return stored

    r.api.replace = replace  # type: ignore[method-assign]
    await s.run()
    assert r.policies == {}
    late = s.pod("late")
    s.see(report("n0", s.clock.now, ("ns", "late", late, 0)))
    s.clock.advance(600)
    s.refresh()
    await s.run()
    assert not s.leaving("late"), "evicted under a deleted policy"


async def test_an_agent_whose_clock_runs_behind_proves_no_idle_time_with_one_report() -> None:
    s = Setup()
    s.policy(policy("ns"))
    lazy = s.pod("lazy")
    s.see(report("n0", s.clock.now - 600, ("ns", "lazy", lazy, 0)))  # its clock 10 min behind
    await s.run()
    assert not s.leaving("lazy")


async def test_a_policy_replaced_by_its_own_watch_event_mid_pass_is_still_in_force() -> None:
    s = Setup()
    s.policy(policy("ns", action="Report"))
    lazy = s.pod("lazy")
    s.see(report("n0", s.clock.now, ("ns", "lazy", lazy, 0)))
    s.clock.advance(600)
    s.refresh()
    r = s.reconciler
    tell = r.recorder.tell

    async def echoed(*args: Any, **params: Any) -> Any:
        stored = s.server.get_object(resources.GPU_IDLE_POLICY.path("ns", "reclaim"))
        assert stored is not None
        r.on_policy(wire.EventType.MODIFIED, wire.convert(stored, idle.GPUIdlePolicy))  # same policy, a new object
        return await tell(*args, **params)

    r.recorder.tell = echoed  # type: ignore[method-assign]
    await s.run()
    assert s.status().in_force and [p.name for p in s.status().idle] == ["lazy"]


async def test_a_report_of_another_nodes_pod_evicts_nothing() -> None:
    """A node's agent may write only its own GpuUsage, but what it lists there is its own word: a
    compromised node listing a pod of another node as idle got that pod evicted. The pod must be on
    the node whose report says it is idle."""
    s = Setup()
    s.policy(policy("ns"))
    victim = s.pod("victim")  # on n0
    s.see(report("evil", s.clock.now, ("ns", "victim", victim, 0)))
    s.clock.advance(600)
    s.refresh()
    await s.run()
    assert not s.leaving("victim")
