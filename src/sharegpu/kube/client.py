"""A small async Kubernetes REST client that speaks raw JSON.

kubernetes-asyncio reads kubeconfig files and in-cluster credentials; requests go through one
aiohttp session and bodies stay plain dicts (decoded with orjson), which keeps per-object cost low
for the informers and the extender's hot path. Errors become `kube.errors` exceptions here and
nowhere else.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import Configuration

from sharegpu.kube import errors

Json = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@dataclass(frozen=True, slots=True)
class Credentials:
    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True


async def load_credentials(kubeconfig: str | None = None, context: str | None = None) -> Credentials:
    """From a kubeconfig file (or $KUBECONFIG / ~/.kube/config), else the pod's service account."""
    cfg = Configuration()
    try:
        await kube_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    except (kube_config.ConfigException, FileNotFoundError, TypeError):
        if kubeconfig:
            raise
        kube_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    token = None
    auth = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
    if auth:
        token = auth.removeprefix("Bearer ").strip()
    return Credentials(
        server=str(cfg.host),
        token=token,
        ca_file=cfg.ssl_ca_cert,
        cert_file=cfg.cert_file,
        key_file=cfg.key_file,
        verify=cfg.verify_ssl,
    )


class KubeClient:
    def __init__(self, credentials: Credentials, *, timeout: float = 30.0, connections: int = 64) -> None:
        self.credentials = credentials
        self._timeout = timeout
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, context: str | None = None) -> KubeClient:
        return cls(await load_credentials(kubeconfig, context))

    def _ssl(self) -> ssl.SSLContext | bool:
        c = self.credentials
        if not c.server.startswith("https"):
            return False
        context = ssl.create_default_context(cafile=c.ca_file) if c.ca_file else ssl.create_default_context()
        if not c.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if c.cert_file and c.key_file:
            context.load_cert_chain(c.cert_file, c.key_file)
        return context

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json"}
            if self.credentials.token:
                headers["Authorization"] = f"Bearer {self.credentials.token}"
            connector = aiohttp.TCPConnector(ssl=self._ssl(), limit=self._connections)
            self._session = aiohttp.ClientSession(
                base_url=self.credentials.server.rstrip("/") + "/",
                headers=headers,
                connector=connector,
                json_serialize=lambda o: orjson.dumps(o).decode(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- requests

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Json:
        data = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else None
        try:
            async with self.session.request(
                method,
                path.lstrip("/"),
                params=_params(params),
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout or self._timeout),
            ) as response:
                raw = await response.read()
                if response.status >= 400:
                    raise _error(response.status, raw, method, path)
                result: Json = orjson.loads(raw) if raw else {}
                return result
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise errors.TemporaryError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    async def get(self, path: str, **params: str | int) -> Json:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Json) -> Json:
        return await self.request("POST", path, body=body)

    async def replace(self, path: str, body: Json) -> Json:
        return await self.request("PUT", path, body=body)

    async def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH) -> Json:
        return await self.request("PATCH", path, body=body, content_type=content_type)

    async def delete(self, path: str, *, grace_period: int | None = None, missing_ok: bool = True) -> Json | None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_period is not None:
            body["gracePeriodSeconds"] = grace_period  # type: ignore[assignment]
        try:
            return await self.request("DELETE", path, body=body)
        except errors.NotFoundError:
            if missing_ok:
                return None
            raise

    async def list_all(
        self, path: str, params: Mapping[str, str | int] | None = None, *, page: int = 500
    ) -> tuple[list[Json], str]:
        """Every item of a collection (paged), and the collection's resourceVersion."""
        items: list[Json] = []
        token = ""
        while True:
            query: dict[str, str | int] = {"limit": page, **(params or {})}
            if token:
                query["continue"] = token
            body = await self.request("GET", path, params=query)
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return items, str(meta.get("resourceVersion", ""))

    async def watch(
        self,
        path: str,
        resource_version: str,
        params: Mapping[str, str | int] | None = None,
        *,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[tuple[str, Json]]:
        """Events (type, object) from `resource_version` on; raises GoneError when it is too old."""
        query: dict[str, str | int] = {
            "watch": 1,
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": timeout_seconds,
            **(params or {}),
        }
        try:
            async with self.session.get(
                path.lstrip("/"),
                params=_params(query),
                timeout=aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + 30),
            ) as response:
                if response.status >= 400:
                    raise _error(response.status, await response.read(), "WATCH", path)
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = orjson.loads(line)
                    kind = event.get("type", "")
                    obj = event.get("object") or {}
                    if kind == "ERROR":
                        raise errors.from_status(
                            int(obj.get("code", 500)), obj.get("reason", ""), obj.get("message", ""), "WATCH", path
                        )
                    yield kind, obj
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise errors.TemporaryError(f"WATCH {path}: {type(exc).__name__}: {exc}") from exc


def _params(params: Mapping[str, str | int] | None) -> dict[str, str] | None:
    return {k: str(v) for k, v in params.items()} if params else None


def _error(status: int, raw: bytes, method: str, path: str) -> Exception:
    reason, message = "", raw.decode(errors="replace")[:500]
    try:
        body = orjson.loads(raw)
        if isinstance(body, dict):
            reason = str(body.get("reason", ""))
            message = str(body.get("message", message))
    except orjson.JSONDecodeError:
        pass
    return errors.from_status(status, reason, message, method, path)
