"""`sharegpu webhook`: the HTTPS admission server.

Endpoints: POST /mutate/pods, /validate/pods, /validate/devices (AdmissionReview v1), GET /healthz
and /readyz. TLS comes from a certificate and key that are re-read when they change
(`serving.tls.ReloadingTls`), so a renewed certificate is served from the next connection on. With
a kubeconfig, the webhook follows the Device inventory (largest GPU memory, models) for its checks;
/readyz is false until that informer has listed, and again whenever it cannot watch.

Malformed bodies never crash the server: anything that is not a JSON AdmissionReview gets a 400
with a message; a review that cannot be judged is refused (never allowed).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from sharegpu.api import admission as messages
from sharegpu.api import paths, wire
from sharegpu.kube import client, informer
from sharegpu.serving import tls
from sharegpu.webhook import admission

log = logging.getLogger(__name__)
MAX_BODY = 8 * 1024 * 1024


class Webhook:
    """The handlers and the one piece of state they read: the current `Policy`."""

    def __init__(self, policy: admission.Policy) -> None:
        self.policy = policy
        self.devices: dict[str, wire.Device] = {}
        self.inventory: informer.Informer[wire.Device, wire.Device] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/mutate/pods", self._handler("mutate"))
        app.router.add_post("/validate/pods", self._handler("validate"))
        app.router.add_post("/validate/devices", self._handler("devices"))
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        return app

    async def healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(self, _: web.Request) -> web.Response:
        if self.inventory is None or self.inventory.ready:
            return web.Response(text="ok")
        return web.json_response(self.inventory.status(), status=503)

    def _handler(self, kind: str) -> Any:
        async def handle(request: web.Request) -> web.Response:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError as exc:
                return web.json_response({"error": f"malformed JSON: {exc}"}, status=400)
            except web.HTTPRequestEntityTooLarge:
                return web.json_response({"error": "request body too large"}, status=413)
            answer = handle_review(kind, body, self.policy)
            return web.Response(body=messages.encode(answer), content_type="application/json")

        return handle

    def on_device(self, kind: str, device: wire.Device) -> None:
        if kind == "DELETED":
            self.devices.pop(device.metadata.name, None)
        else:
            self.devices[device.metadata.name] = device
        gpus = [(g.model, g.memory_mib) for d in self.devices.values() for g in d.spec.gpus]
        self.policy = admission.with_inventory(self.policy, gpus)


def handle_review(kind: str, body: Any, policy: admission.Policy) -> messages.ReviewResponse:
    """Never raises: a review that cannot be judged is refused with the reason."""
    try:
        return admission.review(kind, body, policy)
    except Exception as exc:  # a bug must not allow a pod through, nor crash the server
        log.exception("admission %s failed", kind)
        uid = ""
        if isinstance(body, dict) and isinstance(body.get("request"), dict):
            uid = str(body["request"].get("uid", ""))
        return messages.deny(uid, f"sharegpu: internal error: {exc}", code=500)


async def serve(
    host: str,
    port: int,
    cert: Path,
    key: Path,
    hook: Webhook,
    kubeconfig: str | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Serve `hook` until cancelled; with a kubeconfig, follow the Device inventory for memory checks."""
    context = tls.ReloadingTls(cert, key)
    tasks = []
    kube = None
    if kubeconfig is not None:
        kube = client.KubeClient.connect(kubeconfig or None)
        hook.inventory = informer.Informer(
            kube, paths.DEVICES, wire.Device, informer.identity, hook.on_device, name="webhook-devices"
        )
        tasks.append(asyncio.create_task(hook.inventory.run()))
    runner = web.AppRunner(hook.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=context.context)
    await site.start()
    log.info("sharegpu webhook listening on %s:%d", host, port)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await informer.cancel(tasks)
        await runner.cleanup()
        if kube is not None:
            await kube.close()


__all__ = ["Webhook", "handle_review", "serve"]
