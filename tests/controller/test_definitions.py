"""The controller holds the installed CustomResourceDefinitions against this release's: not ready while
one lacks a field (an upgrade without its definitions), ready again once they are applied; a
definition it cannot read says nothing about it. Its RBAC reads exactly those definitions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharegpu.api import paths, resources
from sharegpu.controller import runtime
from sharegpu.kube import client, fake
from tests import builders
from tests.controller.conftest import T0

Json = dict[str, Any]
NAME = resources.GPU_BUDGET.name
RBAC = Path(__file__).parents[2] / "deploy" / "helm" / "sharegpu" / "files" / "rbac" / "controller.yaml"


@pytest.fixture
async def started() -> AsyncIterator[tuple[fake.FakeApiServer, runtime.Controller]]:
    server = fake.FakeApiServer()
    options = runtime.Options(leader_elect=False, tick=3600, pace=0.01, definitions_every=0.02)
    controller = runtime.Controller(client.KubeClient(server), options, clock=builders.Clock(T0))
    await controller.start()
    try:
        yield server, controller
    finally:
        await controller.stop()


async def until(holds: Callable[[], bool]) -> None:
    for _ in range(300):
        if holds():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 3 s")


def replace(server: fake.FakeApiServer, definition: Json) -> None:
    server.remove_object(paths.definition(NAME))
    server.put_object(paths.DEFINITIONS, definition)


def current(controller: runtime.Controller) -> float | None:
    return controller.metrics.registry.get_sample_value("sharegpu_controller_definition_current", {"definition": NAME})


async def test_an_older_definition_makes_the_controller_unready_until_this_releases_is_applied(
    started: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    server, controller = started
    await until(lambda: controller.definitions.checked)
    ready, detail = controller.readiness()
    assert ready and detail["definitions"] == {"lacking": {}, "notRead": {}} and current(controller) == 1, detail

    older = resources.GPU_BUDGET.manifest()
    del older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    replace(server, older)
    await until(lambda: not controller.readiness()[0])
    ready, detail = controller.readiness()
    assert detail["definitions"]["lacking"] == {NAME: ["status.conditions: no such field"]}
    assert current(controller) == 0

    replace(server, resources.GPU_BUDGET.manifest())
    await until(lambda: controller.readiness()[0])
    assert current(controller) == 1

    server.remove_object(paths.definition(NAME))
    await until(lambda: not controller.readiness()[0])
    assert controller.readiness()[1]["definitions"]["lacking"] == {NAME: ["not installed"]}


async def test_a_definition_it_may_not_read_is_reported_and_not_held_against_readiness(
    started: tuple[fake.FakeApiServer, runtime.Controller],
) -> None:
    server, controller = started
    await until(lambda: controller.definitions.checked)
    server.fail(403, method="GET", path=paths.definition(NAME), reason="Forbidden", times=1000)
    await until(lambda: NAME in controller.definitions.unread)
    ready, detail = controller.readiness()
    assert ready and detail["definitions"]["lacking"] == {} and "403" in detail["definitions"]["notRead"][NAME], detail


def test_the_controller_may_read_exactly_the_definitions_it_checks() -> None:
    rules = [
        rule
        for document in yaml.safe_load_all(RBAC.read_text())
        if document and document["kind"] == "ClusterRole"
        for rule in document["rules"]
        if rule.get("resources") == ["customresourcedefinitions"]
    ]
    assert rules == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": list(resources.definitions()),
            "verbs": ["get"],
        }
    ]


def test_the_fake_api_server_starts_with_this_releases_definitions() -> None:
    server = fake.FakeApiServer()
    for name, definition in resources.definitions().items():
        stored = server.get_object(paths.definition(name))
        assert stored is not None and resources.lacking(definition, stored) == ()
