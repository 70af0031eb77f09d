"""Two `sharegpu controller` processes, leader-elected on the real API server: only the Lease holder
decides; SIGKILL it and the standby takes over within the lease duration, carries on from the books
in the API (usage continues, not reset) and makes no decision twice (each budget's crossing is one
Event in the API, whoever recorded it)."""

from __future__ import annotations

import functools
import time
from typing import Any

import aiohttp

from sharegpu.api import budgets, names, paths, resources, wire
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from tests.integration.conftest import bound_long_ago, budget_body, events, get_or_none, lease_holder, wait_for

LEASE = 4.0
ELECTION = (
    "--lease-duration",
    "4",
    "--renew-deadline",
    "3",
    "--retry-period",
    "0.5",
    "--write-every",
    "1",
    "--log-level",
    "INFO",
)


async def holder(kube: client.KubeClient) -> str:
    return await lease_holder(kube, names.CONTROLLER_LEASE)


async def budget(kube: client.KubeClient, namespace: str, name: str) -> budgets.GPUBudget:
    return wire.convert(await kube.get(resources.GPU_BUDGET.path(namespace, name)), budgets.GPUBudget)


async def test_kill_the_leader_and_the_standby_takes_over_with_no_decision_made_twice(
    control_plane: controlplane.ControlPlane, admin: client.KubeClient, system: None, namespace: str
) -> None:
    replicas = {
        name: stack.ControllerProcess(control_plane, "--identity", name, *ELECTION) for name in ("ctl-a", "ctl-b")
    }
    try:
        for process in replicas.values():
            process.start()
        for process in replicas.values():
            await process.wait_ready()
        leader = await wait_for(lambda: holder(admin), what="a leader")
        assert leader in replicas

        await bound_long_ago(admin, namespace, "old", 7200)
        await admin.create(resources.GPU_BUDGET.path(namespace), budget_body("first", namespace))

        async def exhausted(name: str) -> Any:
            item = await budget(admin, namespace, name)
            return item if item.status.state == "Exhausted" else None

        try:
            first = await wait_for(lambda: exhausted("first"), what="first exhausted")
        except AssertionError as exc:  # say what each replica saw (seen once in CI, not reproduced)
            raise AssertionError(f"{exc}\n{await _diagnosis(admin, namespace, replicas)}") from None
        assert abs(first.status.used_gpu_seconds - 7200) <= 72
        recorded = await wait_for(lambda: events(admin, namespace, "BudgetExhausted"), what="the event")
        assert [e["reportingInstance"] for e in recorded] == [leader]

        replicas[leader].kill()
        killed = time.monotonic()
        standby = next(n for n in replicas if n != leader)

        async def taken_over() -> bool:
            return await holder(admin) == standby

        await wait_for(taken_over, timeout=LEASE * 4, every=0.1, what="the standby to take over")
        took = time.monotonic() - killed
        assert took <= LEASE + 1.5, f"took over after {took:.1f} s"

        # The new leader decides what is new, and carries the first budget's books on.
        await admin.create(resources.GPU_BUDGET.path(namespace), budget_body("second", namespace))
        await wait_for(lambda: exhausted("second"), what="second exhausted")

        async def moved_on() -> Any:
            item = await budget(admin, namespace, "first")
            return item if item.status.accounting.accounted_at > first.status.accounting.accounted_at else None

        later = await wait_for(moved_on, what="the first budget written by the new leader")
        assert later.status.used_gpu_seconds >= first.status.used_gpu_seconds
        for _ in range(3):  # a few more passes of the new leader: nothing is recorded again
            after = functools.partial(_written_after, admin, namespace, later.status.accounting.accounted_at)
            later = await wait_for(after, what="another pass")
        every = await events(admin, namespace, "BudgetExhausted")
        by_budget: dict[str, list[str]] = {}
        for event in every:
            by_budget.setdefault(event["involvedObject"]["name"], []).append(event["reportingInstance"])
        assert by_budget == {"first": [leader], "second": [standby]}
        assert await events(admin, namespace, "BudgetWarning") == []
    finally:
        for process in replicas.values():
            process.kill()


async def _written_after(kube: client.KubeClient, namespace: str, stamp: str) -> budgets.GPUBudget | None:
    item = await budget(kube, namespace, "first")
    return item if item.status.accounting.accounted_at > stamp else None


async def _diagnosis(kube: client.KubeClient, namespace: str, replicas: dict[str, stack.ControllerProcess]) -> str:
    lines = [f"lease holder: {await holder(kube)}"]
    pod = await get_or_none(kube, paths.pod(namespace, "old"))
    lines.append(f"pod old status: {(pod or {}).get('status')}")
    found = await get_or_none(kube, resources.GPU_BUDGET.path(namespace, "first"))
    lines.append(f"budget first status: {(found or {}).get('status')}")
    for name, process in replicas.items():
        try:
            async with (
                aiohttp.ClientSession(headers=process.headers) as session,
                session.get(f"{process.health_url}/debug/budgets", ssl=process.health_ssl) as got,
            ):
                lines.append(f"{name} /debug/budgets: {await got.text()}")
        except aiohttp.ClientError as exc:
            lines.append(f"{name}: {exc}")
        lines.append(f"{name} log tail: {process.log.read_text()[-2000:]}")
    return "\n".join(lines)
