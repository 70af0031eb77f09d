"""`kubectl sharegpu dashboard`: a read-only GPU map in the browser, served on 127.0.0.1.

One page (`page/index.html`, plain HTML, CSS and JavaScript: no build step) and one JSON document
(`/api/map`, `render.map_json`) it fetches every few seconds: every node and GPU with its shares drawn
to scale and who holds them, what each uses (the agents' GpuUsage), pending GPU pods with the reason
in sharegpu's words, budgets and quotas, idle shares. The server reads the API with the user's own
credentials (the plugin's kubeconfig handling), so the page shows exactly what `kubectl sharegpu
inspect`, `top` and `budgets` would show that user.

It acts with those credentials, so it answers only its own page: it listens on 127.0.0.1 alone; a
request whose Host is not this address and port (a DNS-rebinding page that resolved its own name to
127.0.0.1) is refused, and so is one whose Origin, when sent, is another site (a page elsewhere
fetching from it); only GET and HEAD; responses forbid framing and sniffing, and the page loads
nothing from anywhere else (Content-Security-Policy).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources as package_files
from typing import Any, Final

from aiohttp import web

from sharegpu.core import errors
from sharegpu.kube import client
from sharegpu.kubectl import read, render, views

log = logging.getLogger(__name__)

HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
PAGE_FILES: Final = {"/": ("index.html", "text/html"), "/map.js": ("map.js", "text/javascript"),
                     "/map.css": ("map.css", "text/css")}  # fmt: skip


async def gpu_map(api: client.KubeApi, now: float) -> dict[str, Any]:
    """The page's document, read from the API once."""
    (listing, (budget_items, labels), (usages, usage_note), (policies, idle_note)) = await asyncio.gather(
        read.cluster(api),
        read.budgets(api, None),
        read.optional(read.usages(api)),
        read.optional(read.idle_policies(api)),
    )
    cluster = views.cluster(listing)
    notes = [n for n in (usage_note, idle_note) if n]
    return render.map_json(
        views.inventory(cluster),
        views.usage_rows(usages, None, now),
        views.pending(listing),
        views.budget_views(budget_items, labels),
        views.quota_views(cluster),
        views.idle_views(policies),
        notes,
    )


def _page(name: str) -> bytes:
    return (package_files.files("sharegpu.kubectl") / "page" / name).read_bytes()


class Dashboard:
    """The page and its document on 127.0.0.1:`port` (see the module docstring)."""

    def __init__(
        self, api: client.KubeApi, port: int, *, clock: Callable[[], float] = time.time, host: str = "127.0.0.1"
    ) -> None:
        self.api = api
        self.port = port
        self.host = host
        self.clock = clock
        self.runner: web.AppRunner | None = None

    @property
    def allowed_hosts(self) -> frozenset[str]:
        return frozenset({f"127.0.0.1:{self.port}", f"localhost:{self.port}"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.host not in self.allowed_hosts:
            return self._refuse(421, f"this dashboard answers only {self.url} (Host {request.host!r})")
        origin = request.headers.get("Origin")
        if origin is not None and origin not in {f"http://{h}" for h in self.allowed_hosts}:
            return self._refuse(403, f"requests from another site ({origin}) are refused")
        if request.method not in ("GET", "HEAD"):
            return self._refuse(405, "the dashboard is read-only")
        response = await handler(request)
        response.headers.update(HEADERS)
        return response

    @staticmethod
    def _refuse(status: int, why: str) -> web.Response:
        return web.Response(status=status, text=why + "\n", headers=HEADERS)

    async def _document(self, _: web.Request) -> web.Response:
        try:
            body = await gpu_map(self.api, self.clock())
        except errors.SharegpuError as exc:
            return web.json_response({"error": errors.first_line(exc)}, status=502)
        return web.Response(body=render.dumps(body), content_type="application/json")

    async def _file(self, request: web.Request) -> web.Response:
        name, kind = PAGE_FILES[request.path]
        return web.Response(body=_page(name), content_type=kind)

    def app(self) -> web.Application:
        made = web.Application(middlewares=[self._guard])
        made.router.add_get("/api/map", self._document)
        for path in PAGE_FILES:
            made.router.add_get(path, self._file)
        return made

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        if self.port == 0:  # the port the system chose
            self.port = int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
