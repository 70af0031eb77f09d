"""`sharegpu webhook`: the HTTPS admission server.

Endpoints: POST /mutate/pods, /validate/pods (AdmissionReview v1), GET /healthz. TLS comes from a
certificate and key file that are re-read when they change: every TLS handshake checks the files'
modification times and switches to a fresh SSL context, so a rotated certificate is served from the
next connection on, without a restart. `--bootstrap` generates a CA and a serving certificate and
writes the CA bundle into the webhook configurations.

Malformed bodies never crash the server: anything that is not a JSON AdmissionReview gets a 400 with
a message; a review that cannot be judged is refused (never allowed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from sharegpu.kube import client, informer, objects
from sharegpu.webhook import admission

Json = dict[str, Any]
log = logging.getLogger(__name__)
MAX_BODY = 8 * 1024 * 1024


class ReloadingTls:
    """An SSL context that follows its certificate and key files."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert = cert
        self.key = key
        self._stamp: tuple[float, float] = (0.0, 0.0)
        self._current = self._load()
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.load_cert_chain(cert, key)
        self.context.sni_callback = self._pick
        self.reloads = 0

    def _load(self) -> ssl.SSLContext:
        stamp = (os.stat(self.cert).st_mtime, os.stat(self.key).st_mtime)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        self._stamp = stamp
        return context

    def current(self) -> ssl.SSLContext:
        try:
            stamp = (os.stat(self.cert).st_mtime, os.stat(self.key).st_mtime)
            if stamp != self._stamp:
                self._current = self._load()
                self.reloads += 1
                log.info("serving certificate reloaded from %s", self.cert)
        except (OSError, ssl.SSLError) as exc:  # half-written files: keep serving the old pair
            log.warning("certificate reload failed, keeping the previous one: %s", exc)
        return self._current

    def _pick(self, sock: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        sock.context = self.current()


class Webhook:
    def __init__(self, policy: admission.Policy) -> None:
        self.policy = policy
        self.devices: dict[str, Json] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/mutate/pods", self._handler("mutate"))
        app.router.add_post("/validate/pods", self._handler("validate"))
        app.router.add_post("/validate/devices", self._handler("devices"))
        app.router.add_get("/healthz", self.healthz)
        return app

    async def healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _handler(self, kind: str) -> Any:
        async def handle(request: web.Request) -> web.Response:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError as exc:
                return web.json_response({"error": f"malformed JSON: {exc}"}, status=400)
            except web.HTTPRequestEntityTooLarge:
                return web.json_response({"error": "request body too large"}, status=413)
            answer = handle_review(kind, body, self.policy)
            return web.Response(body=orjson.dumps(answer), content_type="application/json")

        return handle

    def on_device(self, kind: str, device: Json) -> None:
        name = device["metadata"]["name"]
        if kind == "DELETED":
            self.devices.pop(name, None)
        else:
            self.devices[name] = device
        largest, model, models = None, "", set()
        for dev in self.devices.values():
            for gpu in (dev.get("spec") or {}).get("gpus") or []:
                models.add(str(gpu.get("model")))
                if largest is None or int(gpu.get("memoryMiB", 0)) > largest:
                    largest, model = int(gpu.get("memoryMiB", 0)), str(gpu.get("model"))
        self.policy.largest_gpu_memory_mib = largest
        self.policy.largest_gpu_model = model
        self.policy.models = frozenset(models)


def handle_review(kind: str, body: Any, policy: admission.Policy) -> Json:
    """Never raises: a review that cannot be judged is refused with the reason."""
    try:
        return admission.review(kind, body, policy)
    except Exception as exc:  # a bug must not allow a pod through, nor crash the server
        log.exception("admission %s failed", kind)
        uid = ""
        if isinstance(body, dict) and isinstance(body.get("request"), dict):
            uid = str(body["request"].get("uid", ""))
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": uid,
                "allowed": False,
                "status": {"code": 500, "message": f"sharegpu: internal error: {exc}"},
            },
        }


async def serve(
    host: str,
    port: int,
    cert: Path,
    key: Path,
    policy: admission.Policy,
    kubeconfig: str | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Serve until cancelled; with a kubeconfig, follow the Device inventory for memory checks."""
    tls = ReloadingTls(cert, key)
    hook = Webhook(policy)
    tasks = []
    kube = None
    if kubeconfig is not None:
        kube = await client.KubeClient.connect(kubeconfig or None)
        devices = informer.Informer(kube, objects.DEVICES_PATH, hook.on_device, name="webhook-devices")
        tasks.append(asyncio.create_task(devices.run()))
    runner = web.AppRunner(hook.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls.context)
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


__all__ = ["ReloadingTls", "Webhook", "handle_review", "serve"]
