"""A real Prometheus (built from its Go module) scrapes every component on the real control plane, as
a cluster's Prometheus would: over HTTPS with the token of a ServiceAccount bound to
sharegpu-metrics-reader and nothing else, each target labelled with its component. Every target is
up, every series it serves passes promtool's metric lint, and the per-share usage series of a pod an
agent measured reach Prometheus."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from sharegpu.agent import fakenvml, mps, watchdog
from sharegpu.agent import runtime as agent_runtime
from sharegpu.api import names, paths, resources
from sharegpu.devcluster import controlplane, prometheus, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client, reviews
from sharegpu.serving import access, health, tls
from tests.agent.fake_mps_daemon import write_fake_daemon
from tests.builders import NVML_FILE, MakeAllocation, MakeNode, MakePod, write_nvml
from tests.integration.conftest import (
    Json,
    RunningWebhook,
    budget_body,
    get_or_none,
    gpu_pod,
    wait_for,
)

READER = "prometheus-test"
NOT_FED: frozenset[str] = frozenset()
"""Dashboard panels this test's workload does not feed: none (every panel must show data)."""


@pytest.fixture
async def scraper_token(admin: client.KubeClient) -> AsyncIterator[str]:
    """A token of a ServiceAccount bound to sharegpu-metrics-reader only."""
    space = names.SYSTEM_NAMESPACE
    account: Json = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": READER, "namespace": space}}
    binding: Json = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": READER},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "sharegpu-metrics-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": READER, "namespace": space}],
    }  # fmt: skip
    await stack.apply(admin, account)
    await stack.apply(admin, binding)
    yield await stack.issue_token(admin, space, READER)
    await admin.delete(f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{READER}")
    await admin.delete(f"{paths.namespace(space)}/serviceaccounts/{READER}")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every target of the chart's dashboard."""
    found: list[tuple[str, str]] = []

    def walk(value: object, title: str) -> None:
        if isinstance(value, dict):
            here = str(value.get("title", title))
            if isinstance(value.get("expr"), str):
                found.append((here, value["expr"]))
            for item in value.values():
                walk(item, here)
        elif isinstance(value, list):
            for item in value:
                walk(item, title)

    walk(orjson.loads((stack.CHART / "dashboards" / "sharegpu.json").read_bytes()), "")
    return found


async def exposition(url: str, token: str) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/metrics", ssl=False, headers={"Authorization": f"Bearer {token}"}) as response,
    ):
        assert response.status == 200, (url, response.status)
        return await response.text()


async def test_prometheus_scrapes_every_component_and_every_series_passes_promtools_lint(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    webhook: RunningWebhook,
    system_kube: client.KubeClient,
    nodes: Callable[..., Any],
    namespace: str,
    scraper_token: str,
    tmp_path: Path,
) -> None:
    controller = stack.ControllerProcess(control_plane)
    controller.start()
    node = f"prom-{uuid.uuid4().hex[:8]}"
    await admin.create(paths.NODES, MakeNode(node).obj())
    # Ready, as its kubelet would say: the extender's per-GPU series (which the dashboard joins the
    # agent's measurements with) cover ready nodes.
    await admin.patch(f"{paths.node(node)}/status", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    placed = MakeAllocation(f"{namespace}/p", node).grant(0, 300, 4096).obj()
    # The harness's user may write an allocation (the webhook turns anyone else's away).
    pod = await system_kube.create(
        paths.pods(namespace), MakePod("p", namespace).allocation(placed).node(node).container(image="busybox").obj()
    )
    # And a pod over its GPU memory (1024 MiB given, 3000 used), which the agent evicts.
    hogging = MakeAllocation(f"{namespace}/hog", node).grant(1, 300, 1024).obj()
    hog = await system_kube.create(
        paths.pods(namespace), MakePod("hog", namespace).allocation(hogging).node(node).container(image="busybox").obj()
    )
    proc = tmp_path / "proc"
    for pid, owner in ((4242, pod), (4243, hog)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/burstable/pod{owner['metadata']['uid']}/{'b' * 64}\n")
    nvml_path = tmp_path / "nvml.yaml"
    processes = "processes: [{pid: 4242, gpu: 0, usedMiB: 1500, smPercent: 25}, {pid: 4243, gpu: 1, usedMiB: 3000}]"
    write_nvml(nvml_path, NVML_FILE.replace("processes: [{pid: 42, gpu: 2, usedMiB: 2048}]", processes))
    agent_kube = stack.kube_for(control_plane, "sharegpu-agent")
    # MPS daemons (the fake daemon of the agent's tests) and evictions: what the agent panels show.
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), mps.Layout(tmp_path / "mps"))
    options = agent_runtime.Options(interval=0.5, proc=proc, on_violation=watchdog.Action.EVICT)
    agent = agent_runtime.Agent(agent_kube, node, fakenvml.FakeNvml(nvml_path).open(), options, supervisor=supervisor)
    agent_port = controlplane.free_port()
    agent_server = health.HealthServer(
        agent.readiness, agent.metrics.registry, access.Gate(reviews.ApiReviewer(agent_kube))
    )
    scraper: prometheus.Prometheus | None = None
    try:
        await controller.wait_ready()
        await agent_server.start("127.0.0.1", agent_port, tls.SELF_SIGNED.context())
        await agent.start()
        targets = [
            prometheus.Target("scheduler", f"127.0.0.1:{extender.health_port}"),
            prometheus.Target("controller", f"127.0.0.1:{controller.health_port}"),
            prometheus.Target("webhook", f"127.0.0.1:{webhook.port}"),
            prometheus.Target("agent", f"127.0.0.1:{agent_port}"),
        ]
        scraper = prometheus.Prometheus(tmp_path / "prometheus", targets, scraper_token, interval=1.0)
        running = scraper
        await running.start()

        async def all_up() -> list[Json] | None:
            found = await running.active_targets()
            return found if len(found) == 4 and all(t["health"] == "up" for t in found) else None

        try:
            found = await wait_for(all_up, timeout=60, what="every component scraped")
        except AssertionError:
            raise AssertionError(await running.active_targets()) from None
        assert {t["labels"]["component"] for t in found} == {"scheduler", "controller", "webhook", "agent"}

        async def measured() -> list[Json] | None:
            rows = await running.query(f'sharegpu_pod_gpu_sm_utilization_percent{{namespace="{namespace}", pod="p"}}')
            return rows or None

        (row,) = await wait_for(measured, timeout=60, what="the pod's SM use in Prometheus")
        assert row["value"][1] == "25" and row["metric"]["component"] == "agent"
        (share,) = await running.query(f'sharegpu_pod_gpu_share_milli{{namespace="{namespace}", pod="p"}}')
        assert share["value"][1] == "300"

        # The workload: sharing pods placed by the extender on a node of this test (through the
        # webhook), one that cannot fit, a GPU-time budget and a quota on the namespace (with the
        # agent's measured pod, its evicted one and its MPS daemons).
        await nodes(1, gpus=2)
        pods_path = paths.pods(namespace)
        for name, milli in (("train", 700), ("serve", 300), ("notebook", 600)):
            await admin.create(pods_path, gpu_pod(name, namespace, milli=milli))
        await admin.create(pods_path, gpu_pod("waiting", namespace, milli=900))
        await admin.create(resources.GPU_BUDGET.path(namespace), budget_body("team", namespace, gpuHours=10))
        quota: Json = {"metadata": {"name": "gpus"},
                       "spec": {"hard": {f"requests.{names.GPU_MILLI_TOTAL}": "4000",
                                         f"requests.{names.GPU_MEMORY_TOTAL}": "64Gi"}}}  # fmt: skip
        await admin.create(f"{paths.namespace(namespace)}/resourcequotas", quota)

        async def shares_placed() -> bool:
            found, _ = await admin.list_all(pods_path)
            bound = {p["metadata"]["name"] for p in found if p["spec"].get("nodeName")}
            return {"train", "serve", "notebook"} <= bound

        await wait_for(shares_placed, what="the three shares placed")

        # Every panel query of the chart's dashboard, its variables filled as Grafana fills them with
        # "All" selected ($node, $namespace: .*; $__rate_interval: four scrape intervals), is valid
        # PromQL that Prometheus evaluates, and the panels this workload feeds return data.
        queries = dashboard_queries()
        seen: dict[str, set[str]] = {"titles": set()}

        async def answered() -> bool:
            titles = set()
            for title, expr in queries:
                filled = expr.replace("$node", ".*").replace("$namespace", ".*").replace("$__rate_interval", "4s")
                try:
                    if await running.query(filled):
                        titles.add(title)
                except prometheus.PrometheusError as exc:
                    raise AssertionError(f"panel {title!r}: {exc}") from None
            seen["titles"] = titles
            return {t for t, _ in queries} - NOT_FED <= titles

        try:
            await wait_for(answered, timeout=90, every=2, what="data in every panel the workload feeds")
        except AssertionError:
            missing = sorted({t for t, _ in queries} - NOT_FED - seen["titles"])
            raise AssertionError(f"panels without data: {missing}") from None

        _, promtool = prometheus.binaries()
        urls = [f"https://{t.address}" for t in targets]
        for url in urls:
            text = await exposition(url, scraper_token)
            linted = await asyncio.to_thread(
                subprocess.run, [str(promtool), "check", "metrics"], input=text, capture_output=True, text=True,
                check=False,
            )  # fmt: skip
            assert linted.returncode == 0, f"{url}: {linted.stdout}{linted.stderr}"
    finally:
        if scraper is not None:
            scraper.stop()
        await agent.stop()
        await agent_server.stop()
        await agent_kube.close()
        controller.kill()
        await admin.delete(paths.node(node))
        if await get_or_none(admin, paths.gpu_usage(node)) is not None:
            await admin.delete(paths.gpu_usage(node))
