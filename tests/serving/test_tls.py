"""How a health port is served (`serving.tls.HealthTls`): over TLS with a self-signed pair by
default (a plain-HTTP client gets nothing), with a given pair that a client verifies by name, plain
only when asked, and the options' combinations checked."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import prometheus_client
import pytest

from sharegpu.core import errors
from sharegpu.devcluster import controlplane
from sharegpu.serving import certs, health, tls


async def answer(url: str, context: ssl.SSLContext | bool = True) -> int:
    async with aiohttp.ClientSession() as session, session.get(url, ssl=context) as response:
        return response.status


async def serving(choice: tls.HealthTls) -> tuple[health.HealthServer, int]:
    server = health.HealthServer(lambda: (True, {}), prometheus_client.CollectorRegistry())
    port = controlplane.free_port()
    await server.start(health.Endpoint(port, "127.0.0.1", choice))
    return server, port


async def test_by_default_the_port_serves_tls_with_a_self_signed_pair_and_no_plain_http() -> None:
    server, port = await serving(tls.SELF_SIGNED)
    try:
        assert await answer(f"https://127.0.0.1:{port}/readyz", False) == 200  # not verified: self-signed
        with pytest.raises(aiohttp.ClientError):
            await answer(f"http://127.0.0.1:{port}/readyz")
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await answer(f"https://127.0.0.1:{port}/readyz", ssl.create_default_context())
    finally:
        await server.stop()


async def test_a_given_pair_is_served_and_verified_by_its_name(tmp_path: Path) -> None:
    ca_cert, ca_key, ca_path = certs.write_ca(tmp_path, "health-ca")
    cert, key = certs.write_serving_pair(tmp_path, ca_cert, ca_key, ip_addresses=("127.0.0.1",), common="health")
    server, port = await serving(tls.HealthTls(cert, key))
    try:
        assert await answer(f"https://127.0.0.1:{port}/healthz", ssl.create_default_context(cafile=ca_path)) == 200
    finally:
        await server.stop()


async def test_plain_http_only_when_asked() -> None:
    server, port = await serving(tls.HealthTls(plain=True))
    try:
        assert await answer(f"http://127.0.0.1:{port}/healthz") == 200
    finally:
        await server.stop()
    assert (tls.HealthTls(plain=True).scheme, tls.SELF_SIGNED.scheme) == ("http", "https")


def test_the_options_go_together() -> None:
    with pytest.raises(errors.InvalidInputError, match="--health-cert and --health-key go together"):
        tls.HealthTls(cert=Path("a.crt"))
    with pytest.raises(errors.InvalidInputError, match="--plain-health serves no certificate"):
        tls.HealthTls(Path("a.crt"), Path("a.key"), plain=True)
    with pytest.raises(errors.InvalidInputError, match="TLS certificate"):
        tls.HealthTls(Path("/absent.crt"), Path("/absent.key")).context()
