"""A real Prometheus (built from its Go module) scrapes every component on the real control plane, as
a cluster's Prometheus would: over HTTPS with the token of a ServiceAccount bound to
sharegpu-metrics-reader and nothing else, each target labelled with its component, the chart's
alerting rules loaded as they are. Every target is up; every series it serves passes promtool's
metric lint and has its row in docs/metrics.md; the per-share usage series of a pod an agent
measured reach Prometheus; every panel of the chart's dashboard returns data during a scripted
workload; and every alert rule raises its alert once its situation is staged (and none before): a
GPU over-committed and repaired, a component down and one not ready, a GPU unhealthy by XID, a
budget used up, a share idle, a CustomResourceDefinition older than the release."""

from __future__ import annotations

import asyncio
import copy
import re
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from sharegpu.agent import mps, watchdog
from sharegpu.agent import runtime as agent_runtime
from sharegpu.agent.fakes import nvml as fakenvml
from sharegpu.api import names, paths, resources
from sharegpu.devcluster import controlplane, fakecluster, prometheus, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client, reviews
from sharegpu.serving import access, health
from tests.agent.fake_mps_daemon import write_fake_daemon
from tests.builders import MakeAllocation, MakeNode, MakePod, nvml_with, pod_process, write_nvml
from tests.conftest import REPO
from tests.integration.conftest import (
    Json,
    RunningWebhook,
    account_with_role,
    bind_overcommitted,
    bound_long_ago,
    budget_body,
    get_or_none,
    gpu_pod,
    wait_for,
)

READER = "prometheus-test"
BLIND = "prometheus-test-blind"
"""A controller's ServiceAccount that may review its callers (so /metrics answers) and read nothing."""
RULES = stack.CHART / "files" / "alerts" / "sharegpu.rules.yaml"
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


@pytest.fixture
async def blind_kubeconfig(admin: client.KubeClient, control_plane: controlplane.ControlPlane) -> AsyncIterator[Path]:
    """Credentials of a controller whose RBAC lets it check who calls /metrics and read nothing else:
    it serves its metrics, and its informers are never ready (as with a ClusterRole left out)."""
    rules: list[Json] = [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
    ]
    async with account_with_role(admin, BLIND, rules) as token:
        yield control_plane.token_kubeconfig(f"{BLIND}-{uuid.uuid4().hex[:8]}", token)


def rule_names() -> set[str]:
    """Every alert the chart's rules file defines."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


async def raised(running: prometheus.Prometheus) -> dict[str, list[Json]]:
    """Alert name -> its alerts pending or firing now."""
    out: dict[str, list[Json]] = {}
    for alert in await running.alerts():
        out.setdefault(alert["labels"]["alertname"], []).append(alert)
    return out


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


async def test_prometheus_scrapes_every_component_every_panel_has_data_and_every_alert_is_raised(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    webhook: RunningWebhook,
    system_kube: client.KubeClient,
    harness: fakecluster.FakeCluster,
    nodes: Callable[..., Any],
    namespace: str,
    scraper_token: str,
    blind_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    controller = stack.ControllerProcess(control_plane, "--definitions-every", "1")
    controller.start()
    blind = stack.ControllerProcess(control_plane, kubeconfig=blind_kubeconfig)
    blind.start()
    node = f"prom-{uuid.uuid4().hex[:8]}"
    await admin.create(paths.NODES, MakeNode(node).obj())
    # Ready, as its kubelet would say: the extender's per-GPU series (which the dashboard joins the
    # agent's measurements with) cover ready nodes.
    await admin.patch(f"{paths.node(node)}/status", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    proc = tmp_path / "proc"
    processes = []
    # A pod using a quarter of GPU 0; one over its GPU memory on GPU 1 (1024 MiB given, 3000 used),
    # which the agent evicts; and one holding 200 milli of GPU 0 and using none of it.
    for pid, (name, gpu, milli, mib, use) in enumerate(
        (("p", 0, 300, 4096, "usedMiB: 1500, smPercent: 25"), ("hog", 1, 300, 1024, "usedMiB: 3000, smPercent: 50"),
         ("idle", 0, 200, 1024, "usedMiB: 100, smPercent: 0")),
        start=4242,
    ):  # fmt: skip
        placed = MakeAllocation(f"{namespace}/{name}", node).grant(gpu, milli, mib).obj()
        # The harness's user may write an allocation (the webhook turns anyone else's away).
        made = MakePod(name, namespace).allocation(placed).node(node).container(image="busybox").obj()
        stored = await system_kube.create(paths.pods(namespace), made)
        pod_process(proc, pid, stored["metadata"]["uid"])
        processes.append(f"{{pid: {pid}, gpu: {gpu}, {use}}}")
    nvml_path = tmp_path / "nvml.yaml"
    nvml_text = nvml_with(*processes)
    write_nvml(nvml_path, nvml_text)
    agent_kube = stack.kube_for(control_plane, "sharegpu-agent")
    # MPS daemons (the fake daemon of the agent's tests) and evictions: what the agent panels show.
    supervisor = mps.Supervisor(write_fake_daemon(tmp_path / "bin"), mps.Layout(tmp_path / "mps"))
    options = agent_runtime.Options(
        interval=0.5, proc=proc, on_violation=watchdog.Action.EVICT, usage_interval=0.5, usage_refresh=1.0
    )  # steady figures written again each second: an idle policy counts idle time by them
    agent = agent_runtime.Agent(agent_kube, node, fakenvml.FakeNvml(nvml_path).open(), options, supervisor=supervisor)
    agent_port = controlplane.free_port()
    agent_server = health.HealthServer(
        agent.readiness, agent.metrics.registry, access.Gate(reviews.ApiReviewer(agent_kube))
    )
    scraper: prometheus.Prometheus | None = None
    played: dict[str, Any] = {}
    groups_definition = paths.definition(resources.SHARED_DEVICE_GROUP.name)
    installed = await admin.get(groups_definition)
    try:
        await controller.wait_ready()
        await agent_server.start(health.Endpoint(agent_port, "127.0.0.1"))
        await agent.start()
        # A DRA agent that is down: nothing listens where it should.
        dead = prometheus.Target("agent-dra", f"127.0.0.1:{controlplane.free_port()}")
        targets = [
            prometheus.Target("scheduler", f"127.0.0.1:{extender.health_port}"),
            prometheus.Target("controller", f"127.0.0.1:{controller.health_port}"),
            prometheus.Target("controller", f"127.0.0.1:{blind.health_port}"),
            prometheus.Target("webhook", f"127.0.0.1:{webhook.port}"),
            prometheus.Target("agent", f"127.0.0.1:{agent_port}"),
        ]
        scraper = prometheus.Prometheus(
            tmp_path / "prometheus", [*targets, dead], scraper_token, interval=1.0, rules=[RULES]
        )
        running = scraper
        await running.start()

        async def all_up() -> list[Json] | None:
            found = await running.active_targets()
            health_of = {t["labels"]["instance"]: t["health"] for t in found}
            wanted = {t.address: "up" for t in targets} | {dead.address: "down"}
            return found if health_of == wanted else None

        try:
            found = await wait_for(all_up, timeout=60, what="every component scraped, the dead one down")
        except AssertionError:
            raise AssertionError(await running.active_targets()) from None
        assert {t["labels"]["component"] for t in found} == {"scheduler", "controller", "webhook", "agent", "agent-dra"}

        async def measured() -> list[Json] | None:
            rows = await running.query(f'sharegpu_pod_gpu_sm_utilization_ratio{{namespace="{namespace}", pod="p"}}')
            return rows or None

        (row,) = await wait_for(measured, timeout=60, what="the pod's SM use in Prometheus")
        assert row["value"][1] == "0.25" and row["metric"]["component"] == "agent"
        (share,) = await running.query(f'sharegpu_pod_gpu_share_gpus{{namespace="{namespace}", pod="p"}}')
        assert share["value"][1] == "0.3"

        # The workload: sharing pods placed by the extender on a node of this test (through the
        # webhook), one that cannot fit, a GPU-time budget and a quota on the namespace (with the
        # agent's measured pods, its evicted one and its MPS daemons).
        await nodes(1, gpus=2)
        pods_path = paths.pods(namespace)
        for name, milli in (("train", 700), ("serve", 300), ("notebook", 600)):
            await admin.create(pods_path, gpu_pod(name, namespace, milli=milli))
        # More GPU memory than any GPU of the test's nodes has: it waits.
        await admin.create(pods_path, gpu_pod("waiting", namespace, milli=900, memory=20_000))
        await admin.create(resources.GPU_BUDGET.path(namespace), budget_body("team", namespace, gpuHours=10))
        quota: Json = {"metadata": {"name": "gpus"},
                       "spec": {"hard": {f"requests.{names.GPU_MILLI_TOTAL}": "8000",
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
        served: set[str] = set()
        for url in [f"https://{t.address}" for t in targets]:
            text = await exposition(url, scraper_token)
            linted = await asyncio.to_thread(
                subprocess.run, [str(promtool), "check", "metrics"], input=text, capture_output=True, text=True,
                check=False,
            )  # fmt: skip
            assert linted.returncode == 0, f"{url}: {linted.stdout}{linted.stderr}"
            served |= {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        listed = set(re.findall(r"`(sharegpu_[a-z_]+)", (REPO / "docs" / "metrics.md").read_text()))
        # (prometheus_client serves a counter's or histogram's creation time as a gauge family `*_created`.)
        undocumented = {name for name in served - listed if not name.endswith("_created")}
        assert not undocumented, f"served, without a row in docs/metrics.md: {sorted(undocumented)}"

        # The alerts: every rule loaded and evaluated without error; before their situations are
        # staged, only the dead target and the blind controller raise theirs.
        rules = await running.rules()
        assert {r["name"] for r in rules if r["type"] == "alerting"} == rule_names()
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        assert set(await raised(running)) == {"SharegpuComponentDown", "SharegpuComponentNotReady"}

        # Staged: a critical XID on GPU 2 of the agent's node; two pods bound past the extender to
        # one GPU that cannot hold both (it evicts the newer, which stays terminating: no kubelet);
        # a whole-GPU pod bound 40000 s ago against the budget's 10 GPU-hours; an idle policy
        # (report only) in the namespace, whose "idle" pod has used nothing; the SharedDeviceGroup
        # definition replaced by an older one, without a status field (nothing here writes groups).
        write_nvml(nvml_path, nvml_text + "xids: [{gpu: 2, code: 79}]\n")
        older = copy.deepcopy(installed)
        schema = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        del schema["properties"]["status"]["properties"]["nodeName"]
        await admin.replace(groups_definition, older)
        (overcommitted,) = await nodes(1, gpus=1)
        played[overcommitted] = harness.inventory.pop(overcommitted)  # no kubelet there: its pods stay Pending
        await bind_overcommitted(system_kube, overcommitted, namespace)
        await bound_long_ago(system_kube, namespace, "old", 40_000)
        policy: Json = {
            "apiVersion": resources.GPU_IDLE_POLICY.api_version, "kind": "GPUIdlePolicy",
            "metadata": {"name": "reclaim", "namespace": namespace},
            "spec": {"idleAfterSeconds": 2, "idleAtMostPercent": 1, "action": "Report"},
        }  # fmt: skip
        await admin.create(resources.GPU_IDLE_POLICY.path(namespace), policy)
        expected = {
            "SharegpuGpuOvercommitted": {"node": overcommitted, "gpu": "0"},
            "SharegpuOvercommitRepaired": {"action": "evicted"},
            "SharegpuComponentNotReady": {"instance": f"127.0.0.1:{blind.health_port}"},
            "SharegpuComponentDown": {"component": "agent-dra", "instance": dead.address},
            "SharegpuGpuUnhealthy": {"instance": f"127.0.0.1:{agent_port}"},
            "SharegpuBudgetExhausted": {"namespace": namespace, "budget": "team"},
            "SharegpuSharesIdle": {"namespace": namespace},
            "SharegpuDefinitionOutdated": {"definition": resources.SHARED_DEVICE_GROUP.name},
        }
        assert set(expected) == rule_names(), "every rule the chart ships is staged here"
        now: dict[str, list[Json]] = {}

        async def all_raised() -> bool:
            now.clear()
            now.update(await raised(running))
            return all(
                any(labels.items() <= a["labels"].items() for a in now.get(name, ()))
                for name, labels in expected.items()
            )

        try:
            await wait_for(all_raised, timeout=90, every=1, what="every alert raised")
        except AssertionError:
            raise AssertionError({n: [a["labels"] for a in found] for n, found in now.items()}) from None
        (idle,) = [a for a in now["SharegpuSharesIdle"] if a["labels"]["namespace"] == namespace]
        assert idle["value"] in ("1", "1e+00"), "one idle share: the busy and evicted pods are not"
        assert {a["state"] for found in now.values() for a in found} <= {"pending", "firing"}
    finally:
        latest = await admin.get(groups_definition)
        if latest["spec"] != installed["spec"]:
            installed["metadata"]["resourceVersion"] = latest["metadata"]["resourceVersion"]
            await admin.replace(groups_definition, installed)
        harness.inventory.update(played)
        if scraper is not None:
            scraper.stop()
        await agent.stop()
        await agent_server.stop()
        await agent_kube.close()
        controller.kill()
        blind.kill()
        for name in (node, f"{namespace}-old-node"):
            if await get_or_none(admin, paths.node(name)) is not None:
                await admin.delete(paths.node(name))
        if await get_or_none(admin, paths.gpu_usage(node)) is not None:
            await admin.delete(paths.gpu_usage(node))
