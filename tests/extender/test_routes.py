"""The extender's HTTP surface: typed bodies, clear 400s, honest /readyz, the debug explain, and the
scheduler port that accepts only clients with a certificate from the scheduler's CA."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import test_utils, web

from sharegpu.api import names
from sharegpu.extender import routes
from sharegpu.serving import certs, tls
from tests.extender.conftest import Harness, gpu_pod


async def test_verbs_decode_typed_bodies_and_refuse_malformed_ones(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2)
    pod = await h.create(gpu_pod("a", milli=300))
    verbs = routes.Verbs(h.extender.scheduling, h.extender.metrics)
    async with test_utils.TestClient(test_utils.TestServer(verbs.app())) as http:
        response = await http.post("/filter", json={"Pod": pod, "NodeNames": ["n0", "n1"]})
        body = await response.json()
        assert response.status == 200 and len(body["NodeNames"]) == 1
        response = await http.post("/filter", data=b"{not json")
        assert response.status == 400 and "malformed JSON" in (await response.json())["Error"]
        response = await http.post("/filter", json={"Pod": {"spec": {"containers": "nope"}}, "NodeNames": ["n0"]})
        assert response.status == 400 and "$.Pod.spec.containers" in (await response.json())["Error"]
        response = await http.post(
            "/bind",
            json={"PodName": "a", "PodNamespace": "ns", "PodUID": pod["metadata"]["uid"], "Node": body["NodeNames"][0]},
        )
        assert (await response.json()) == {}, "an empty Error: bound"
    # the same function answers HTTP/2 (serving.http2), where no router stands in front of it
    missing = await verbs("POST", "/unbind", b"{}")
    assert missing.status == 404 and b"no such verb: /unbind" in missing.body
    wrong = await verbs("GET", "/filter", b"")
    assert wrong.status == 405 and b"/filter takes POST, not GET" in wrong.body
    malformed = await verbs("POST", "/prioritize?x=1", b"[]")
    assert malformed.status == 400 and b"malformed Args" in malformed.body


async def test_operations_tell_readiness_and_explain_pending_pods(harness: Callable[..., Any]) -> None:
    h: Harness = await harness(nodes=2, gpus=1)
    await h.create(gpu_pod("big", nvidia=2))
    app = routes.operations(h.extender)
    async with test_utils.TestClient(test_utils.TestServer(app)) as http:
        assert (await http.get("/readyz")).status == 200
        h.extender.informers[2]._needs_list = True  # as after a 410, until the relist completes
        response = await http.get("/readyz")
        assert response.status == 503 and (await response.json())["informers"]["pods"]["ready"] is False
        h.extender.informers[2]._needs_list = False
        explained = await (await http.get("/debug/pods/ns/big")).json()
        assert explained["nodesByShortfall"] == {"TOO_FEW_GPUS": 2}
        assert explained["closest"][0]["reasons"][-1].endswith("(the node has fewer GPUs than the pod asks for)")
        nodes = await (await http.get("/debug/nodes")).json()
        assert {n["node"] for n in nodes["nodes"]} == {"n0", "n1"}
        assert "sharegpu_extender_decisions" in await (await http.get("/metrics")).text()


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca_cert, ca_key, ca_path = certs.write_ca(tmp_path / "ca", "scheduler-link")
    serving = certs.issue_serving(ca_cert, ca_key, "extender", ip_addresses=("127.0.0.1",))
    cert, key = certs.write_pair(tmp_path, *serving, stem="extender")
    client_cert, client_key = certs.write_pair(
        tmp_path, *certs.issue_client(ca_cert, ca_key, "scheduler"), stem="client"
    )
    other_ca, other_key, _ = certs.write_ca(tmp_path / "other", "someone-else")
    stranger = certs.write_pair(tmp_path, *certs.issue_client(other_ca, other_key, "stranger"), stem="stranger")
    return {
        "ca": ca_path,
        "cert": cert,
        "key": key,
        "client_cert": client_cert,
        "client_key": client_key,
        "stranger_cert": stranger[0],
        "stranger_key": stranger[1],
    }


async def test_the_scheduler_port_requires_the_schedulers_client_certificate(pki: dict[str, Path]) -> None:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="bound")

    app = web.Application()
    app.router.add_post("/bind", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    server_tls = tls.ReloadingTls(pki["cert"], pki["key"], pki["ca"])
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_tls.context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"https://127.0.0.1:{port}/bind"

    def context(cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
        made = ssl.create_default_context(cafile=str(pki["ca"]))
        if cert is not None and key is not None:
            made.load_cert_chain(cert, key)
        return made

    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, ssl=context(pki["client_cert"], pki["client_key"])) as response:
                assert await response.text() == "bound"
            for refused in (context(), context(pki["stranger_cert"], pki["stranger_key"])):
                with pytest.raises(aiohttp.ClientError):
                    async with session.post(url, ssl=refused) as response:
                        await response.read()
            with pytest.raises(aiohttp.ClientError):
                async with session.post(f"http://127.0.0.1:{port}/bind") as response:
                    await response.read()
    finally:
        await runner.cleanup()
    await asyncio.sleep(0)


def test_the_scheduler_port_issues_no_session_tickets(pki: dict[str, Path]) -> None:
    """kube-scheduler keeps no TLS session cache, so tickets would be made per connection for
    nothing (they are most of a handshake's cost): a full handshake leaves the client none."""
    server = tls.ReloadingTls(pki["cert"], pki["key"], pki["ca"]).context
    client = ssl.create_default_context(cafile=str(pki["ca"]))
    client.load_cert_chain(pki["client_cert"], pki["client_key"])
    to_server, to_client, server_out, client_out = (ssl.MemoryBIO() for _ in range(4))
    server_side = server.wrap_bio(to_server, server_out, server_side=True)
    client_side = client.wrap_bio(to_client, client_out, server_hostname="127.0.0.1")
    done = [False, False]
    for _ in range(6):
        for i, side in enumerate((client_side, server_side)):
            try:
                side.do_handshake()
                done[i] = True
            except ssl.SSLWantReadError:
                pass
        to_server.write(client_out.read())
        to_client.write(server_out.read())
    server_side.write(b"bound")
    to_client.write(server_out.read())
    assert all(done) and client_side.version() == "TLSv1.3"
    assert client_side.read() == b"bound"
    assert client_side.session is not None and not client_side.session.has_ticket


def test_the_hand_off_and_reservation_vocabulary_is_shared() -> None:
    assert names.reservation_name("n" * 300, 3, "abcdef").endswith("-3-abcdef")
    assert len(names.reservation_name("n" * 300, 3, "abcdef")) <= 253


async def test_metrics_count_each_namespaces_gpu_use_over_every_gpu(harness: Callable[..., Any]) -> None:
    """A pod of 2 GPUs at 500 milli holds 1000 milli-GPU: what a quota on the namespace counts."""
    h: Harness = await harness(nodes=2, gpus=2)
    await h.schedule(await h.create(gpu_pod("pair", milli=500, count=2)))
    await h.schedule(await h.create(gpu_pod("one", milli=300, namespace="other")))
    app = routes.operations(h.extender)
    async with test_utils.TestClient(test_utils.TestServer(app)) as http:
        text = await (await http.get("/metrics")).text()
    assert 'sharegpu_namespace_gpu_compute_allocated_gpus{namespace="ns"} 1.0' in text
    assert 'sharegpu_namespace_gpu_compute_allocated_gpus{namespace="other"} 0.3' in text
