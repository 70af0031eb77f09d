"""The GPU map's server: its page and document, and its guard (it acts with the user's credentials):
only its own Host, no other site's Origin, read-only, framing and sniffing forbidden."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from sharegpu.api import paths, usage, wire
from sharegpu.kube import client, fake
from sharegpu.kubectl import dashboard
from tests.extender.conftest import add_node, gpu_pod
from tests.kubectl.conftest import bound


@pytest.fixture
async def served() -> AsyncIterator[dashboard.Dashboard]:
    server = fake.FakeApiServer()
    add_node(server, "n0", gpus=2)
    server.put_object(paths.pods("ns"), bound("a", "n0", 0, 600))
    waiting = gpu_pod("big", milli=500)
    waiting["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes: no GPU free"}
    ]}  # fmt: skip
    server.put_object(paths.pods("ns"), waiting)
    use = usage.PodUse(namespace="ns", name="a", uid="u", uuid="GPU-n0-0", used_mib=900, sm_percent=20, share_milli=600)
    report = usage.report(
        "n0", None, "2026-11-28T00:00:00Z", 10, [usage.GpuUse(uuid="GPU-n0-0", index=0, used_mib=900)], [use]
    )
    server.put_object(paths.GPU_USAGES, wire.encode(report))
    made = dashboard.Dashboard(client.KubeClient(server), 0)
    await made.start()
    yield made
    await made.stop()


async def get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


async def test_the_page_and_its_document(served: dashboard.Dashboard) -> None:
    status, headers, body = await get(served.url)
    assert status == 200 and b"sharegpu GPU map" in body and headers["Content-Type"].startswith("text/html")
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"] and headers["X-Frame-Options"] == "DENY"
    assert (await get(f"{served.url}map.js"))[0] == 200
    status, _, body = await get(f"{served.url}api/map")
    document = orjson.loads(body)
    assert status == 200 and document["kind"] == "GPUMap"
    (node,) = document["inventory"]["nodes"]
    assert node["name"] == "n0" and [p["pod"] for p in node["gpus"][0]["pods"]] == ["ns/a"]
    assert [(p["pod"], p["message"]) for p in document["pending"]] == [("big", "0/1 nodes: no GPU free")]
    assert [(r["pod"], r["smPercent"]) for r in document["usage"]] == [("a", 20)]
    assert "GpuIdlePolic" in " ".join(document["notes"]) or document["idle"] == []


async def test_another_host_another_sites_origin_and_writes_are_refused(served: dashboard.Dashboard) -> None:
    rebound = await get(f"{served.url}api/map", Host=f"evil.example:{served.port}")
    assert rebound[0] == 421 and b"answers only" in rebound[2]
    assert (await get(f"{served.url}api/map", Host=f"localhost:{served.port}"))[0] == 200
    elsewhere = await get(f"{served.url}api/map", Origin="https://evil.example")
    assert elsewhere[0] == 403 and b"another site" in elsewhere[2]
    assert (await get(f"{served.url}api/map", Origin=f"http://127.0.0.1:{served.port}"))[0] == 200
    async with aiohttp.ClientSession() as session, session.post(f"{served.url}api/map") as response:
        assert response.status == 405


async def test_a_resource_the_user_may_not_list_is_a_note_not_a_broken_map(served: dashboard.Dashboard) -> None:
    kube = served.api
    assert isinstance(kube, client.KubeClient) and isinstance(kube.transport, fake.FakeApiServer)
    server = kube.transport
    server.fail(403, path=paths.GPU_USAGES, reason="Forbidden")
    status, _, body = await get(f"{served.url}api/map")
    document = orjson.loads(body)
    assert status == 200, document
    assert document["usage"] == [] and [n["name"] for n in document["inventory"]["nodes"]] == ["n0"]
    assert "cannot list GpuUsage resources (gpuusages.sharegpu.io): forbidden (RBAC)" in document["notes"]
