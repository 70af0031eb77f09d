"""The node's GpuUsage: written at most once per interval, only when it changed beyond the noise or
grew old, owned by the Node; a 409 or a lost object settled by the next write."""

from __future__ import annotations

from sharegpu.agent import usagereport, watchdog
from sharegpu.api import paths, usage
from sharegpu.kube import client, fake
from tests.builders import MakeNode


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def assessment(used: int, sm: int | None, *, pod: str = "p") -> watchdog.Assessment:
    use = watchdog.Usage(
        watchdog.PodRef("ns", pod, f"uid-{pod}"), "GPU-0", 0, used, 4096, ((10, used),), sm_percent=sm,
        share_milli=300, containers=(usage.ContainerUse(name="main", used_mib=used, sm_percent=sm),),
    )  # fmt: skip
    gpu = watchdog.GpuTotal("GPU-0", 0, 16384, used, used, 0, 0, sm)
    return watchdog.Assessment((use,), (gpu,), ())


def setup() -> tuple[fake.FakeApiServer, usagereport.UsageReporter, Clock]:
    server = fake.FakeApiServer()
    server.put_object(paths.NODES, MakeNode("n0").obj())
    clock = Clock()
    reporter = usagereport.UsageReporter(client.KubeClient(server), "n0", 60, pass_interval=10, clock=clock, wall=clock)
    return server, reporter, clock


def stored(server: fake.FakeApiServer) -> usage.UsageStatus:
    found = server.get_object(paths.gpu_usage("n0"))
    assert found is not None
    return usage.read(found).status


async def test_the_first_report_is_written_owned_by_the_node_with_every_figure() -> None:
    server, reporter, _ = setup()
    assert await reporter.report(assessment(1000, 40))
    found = stored(server)
    node = server.get_object(paths.node("n0")) or {}
    meta = usage.read(server.get_object(paths.gpu_usage("n0"))).metadata
    assert [(r.kind, r.uid) for r in meta.owner_references] == [("Node", node["metadata"]["uid"])]
    (pod,) = found.pods
    assert (pod.namespace, pod.name, pod.uuid, pod.used_mib, pod.sm_percent, pod.share_milli, pod.allocated_mib) == (
        "ns", "p", "GPU-0", 1000, 40, 300, 4096
    )  # fmt: skip
    assert [(c.name, c.used_mib, c.sm_percent) for c in pod.containers] == [("main", 1000, 40)]
    assert [(g.uuid, g.used_mib, g.sm_percent) for g in found.gpus] == [("GPU-0", 1000, 40)]
    assert found.observed_at == "1970-01-01T00:16:40Z" and found.interval_seconds == 10


async def test_writes_come_at_most_once_per_interval_and_only_when_something_changed() -> None:
    server, reporter, clock = setup()
    assert await reporter.report(assessment(1000, 40))
    clock.now += 30
    assert not await reporter.report(assessment(3000, 90)), "within the interval: not written"
    clock.now += 30
    assert not await reporter.report(assessment(1040, 43)), "noise: not written"
    assert await reporter.report(assessment(1000, 60)), "20 SM points: written"
    assert stored(server).pods[0].sm_percent == 60
    clock.now += 60
    assert await reporter.report(assessment(1000, 60, pod="q")), "another pod: written"
    clock.now += 60
    assert not await reporter.report(assessment(1000, 60, pod="q"))
    clock.now += usage.REFRESH
    assert await reporter.report(assessment(1000, 60, pod="q")), "old: written again so readers see it is live"
    assert reporter.writes == 4


async def test_a_conflict_or_a_deleted_object_is_settled_by_the_next_write() -> None:
    server, reporter, clock = setup()
    assert await reporter.report(assessment(1000, 40))
    server.fail(409, method="PUT", path=paths.gpu_usage("n0") + "/status")
    clock.now += 60
    assert not await reporter.report(assessment(5000, 40))
    assert reporter.problem.startswith("cannot write GpuUsage n0"), reporter.problem
    clock.now += 1  # a failed write is tried again at the next pass
    assert await reporter.report(assessment(5000, 40)) and reporter.problem == ""
    assert stored(server).pods[0].used_mib == 5000
    await client.KubeClient(server).delete(paths.gpu_usage("n0"))
    clock.now += 60
    assert not await reporter.report(assessment(6000, 40))
    assert await reporter.report(assessment(6000, 40)), "made again"
    assert stored(server).pods[0].used_mib == 6000
