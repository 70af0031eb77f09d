"""sharegpu's generated custom resources on the real API server: accepted as installed, validated
by the API server as the code reads them, a status subresource, the columns kubectl prints, and the
controller's check that the installed definitions are this release's."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sharegpu.api import paths, resources
from sharegpu.controller import runtime
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from tests.integration.conftest import wait_for

Json = dict[str, Any]
GROUPS = resources.SHARED_DEVICE_GROUP
BUDGETS = resources.GPU_BUDGET


def group(name: str, spec: Json) -> Json:
    return {"apiVersion": GROUPS.api_version, "kind": GROUPS.kind, "metadata": {"name": name}, "spec": spec}


async def test_a_group_is_stored_shown_with_its_columns_and_its_status_is_its_own(
    admin: client.KubeClient, system: None, namespace: str
) -> None:
    made = await admin.create(GROUPS.path(namespace), group("pair", {"gpus": 2, "schedulingStrategy": "spread"}))
    assert made["spec"] == {"gpus": 2, "schedulingStrategy": "spread"}, "stored as written: no defaults added"
    status = {"phase": "Bound", "nodeName": "gpu-node-1", "devices": [{"index": 0, "uuid": "GPU-a"}]}
    await admin.request("PUT", GROUPS.path(namespace, "pair") + "/status", body={**made, "status": status})
    again = await admin.get(GROUPS.path(namespace, "pair"))
    again["spec"]["gpus"] = 3
    again["status"] = {"phase": "Failed"}
    await admin.replace(GROUPS.path(namespace, "pair"), again)  # a spec write does not touch the status
    stored = await admin.get(GROUPS.path(namespace, "pair"))
    assert stored["spec"]["gpus"] == 3 and stored["status"]["phase"] == "Bound"
    table = await admin.table(GROUPS.path(namespace))
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Phase", "Node", "Age"]
    assert table["rows"][0]["cells"][:3] == ["pair", "Bound", "gpu-node-1"]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"gpus": 0}, "spec.gpus"),
        ({"gpus": 2, "schedulingStrategy": "diagonal"}, "spec.schedulingStrategy"),
        ({"gpus": 1, "share": {"milli": 1500}}, "spec.share.milli"),
        ({"schedulingStrategy": "binpack"}, "spec.gpus"),
    ],
)
async def test_the_api_server_refuses_a_group_the_code_would_not_read_and_names_the_field(
    admin: client.KubeClient, system: None, namespace: str, spec: Json, says: str
) -> None:
    with pytest.raises(kube_errors.InvalidError, match=says.replace(".", r"\.")):
        await admin.create(GROUPS.path(namespace), group("bad", spec))


async def test_a_budget_is_validated_and_shown_with_its_columns(
    admin: client.KubeClient, system: None, namespace: str
) -> None:
    body = {"apiVersion": BUDGETS.api_version, "kind": BUDGETS.kind, "metadata": {"name": "team"}}
    with pytest.raises(kube_errors.InvalidError, match=r"spec\.whenExhausted"):
        await admin.create(BUDGETS.path(namespace), {**body, "spec": {"gpuHours": 20, "whenExhausted": "Suspend"}})
    for undated in ("2026-11-01", "2026-11-01T00:00:00"):  # a date alone, a time without its zone
        with pytest.raises(kube_errors.InvalidError, match=r"spec\.periodStart"):
            await admin.create(BUDGETS.path(namespace), {**body, "spec": {"gpuHours": 20, "periodStart": undated}})
    await admin.create(BUDGETS.path(namespace), {**body, "spec": {"gpuHours": 20, "whenExhausted": "Deny"}})
    table = await admin.table(BUDGETS.path(namespace))
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Budget", "Used", "State", "Age"]
    assert table["rows"][0]["cells"][:2] == ["team", 20]


async def test_the_controller_reads_the_installed_definitions_with_its_own_rights_and_names_what_an_older_lacks(
    admin: client.KubeClient, controller: runtime.Controller
) -> None:
    """As the API server stores them (with what it adds), the definitions the suite installed from the
    chart lack nothing of this release's; one replaced by an older (a status field gone: the API server
    would prune it from every status written) makes the controller unready, naming the field."""

    async def read() -> bool:
        return controller.definitions.checked

    await wait_for(read, timeout=30, what="the definitions read")
    ready, detail = controller.readiness()
    assert ready and detail["definitions"] == {"lacking": {}, "notRead": {}}, detail
    assert set(controller.definitions.lacking) == set(resources.definitions()), "read with its own rights"
    stored = await admin.get(paths.definition(BUDGETS.name))
    older = copy.deepcopy(stored)
    del older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    await admin.replace(paths.definition(BUDGETS.name), older)
    try:
        await controller.definitions.check()
        ready, detail = controller.readiness()
        assert not ready and detail["definitions"]["lacking"] == {BUDGETS.name: ["status.conditions: no such field"]}
    finally:
        latest = await admin.get(paths.definition(BUDGETS.name))
        stored["metadata"]["resourceVersion"] = latest["metadata"]["resourceVersion"]
        await admin.replace(paths.definition(BUDGETS.name), stored)
    await controller.definitions.check()
    assert controller.readiness()[0]
