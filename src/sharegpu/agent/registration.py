"""The kubelet's plugin registration (`pluginregistration.Registration`), served for one plugin of the
agent (its DRA plugin, its CSI plugin): the plugin puts a unix socket in the kubelet's
plugins_registry directory; the kubelet, watching that directory, asks it what it is (`GetInfo`: the
plugin's type, name, socket and versions) and then tells it whether it was registered
(`NotifyRegistrationStatus`, logged, a refusal with its reason). A kubelet that restarts scans the
directory and asks again; `keep` serves a new socket wherever the served one is gone (a directory
cleaned by hand, a kubelet that removed it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import grpc

from sharegpu.agent import pluginregistration_pb2 as reg
from sharegpu.serving import unixgrpc

log = logging.getLogger(__name__)

SERVICE: Final = "pluginregistration.Registration"
GET_INFO: Final = "GetInfo"
NOTIFY: Final = "NotifyRegistrationStatus"


def sockets(driver: str, socket: str, plugins: Path, registry: Path) -> tuple[Path, Path]:
    """A plugin's own socket (`<plugins>/<driver>/<socket>`) and its registration socket
    (`<registry>/<driver>-reg.sock`)."""
    return plugins / driver / socket, registry / f"{driver}-reg.sock"


class Registration:
    """Registers one plugin with the kubelet (see the module docstring)."""

    def __init__(self, socket: Path, kind: str, name: str, endpoint: Path, versions: tuple[str, ...]) -> None:
        self.socket = socket
        self.info = reg.PluginInfo(type=kind, name=name, endpoint=str(endpoint), supported_versions=list(versions))
        self.registered: bool | None = None
        """What the kubelet last said of the registration (None: nothing yet)."""
        self.error = ""
        """The kubelet's reason when it refused the registration."""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Serve the registration socket (the plugin's own service must already be served)."""
        info = unixgrpc.unary(self._get_info, reg.InfoRequest, reg.PluginInfo)
        notify = unixgrpc.unary(self._notify, reg.RegistrationStatus, reg.RegistrationStatusResponse)
        handler = grpc.method_handlers_generic_handler(SERVICE, {GET_INFO: info, NOTIFY: notify})
        self._server = await unixgrpc.serve(self.socket, [handler])
        log.info("%s %s: serving %s, registration at %s", self.info.type, self.info.name, self.info.endpoint,
                 self.socket)  # fmt: skip

    async def keep(self, serve_endpoint: Callable[[], Awaitable[None]], every: float = 5.0) -> None:
        """Whenever the plugin's own socket is gone, serve it again (`serve_endpoint`); whenever the
        registration socket is gone, or the plugin's was served again, serve a new registration
        socket, so that the kubelet registers the plugin anew and dials its socket again (until
        cancelled)."""
        while True:
            await asyncio.sleep(every)
            endpoint_gone = not Path(self.info.endpoint).exists()
            if endpoint_gone:
                log.warning("%s %s: its socket %s is gone; serving it again", self.info.type, self.info.name,
                            self.info.endpoint)  # fmt: skip
                await serve_endpoint()
            if endpoint_gone or not self.socket.exists():
                log.warning("%s %s: registering it again at %s", self.info.type, self.info.name, self.socket)
                await unixgrpc.stop(self._server, None)
                self._server = None
                self.registered = None
                await self.start()

    async def stop(self) -> None:
        """Stop serving and remove the socket."""
        await unixgrpc.stop(self._server, self.socket)
        self._server = None

    def status(self) -> str:
        """The registration in words (for /readyz)."""
        if self.registered:
            return "registered"
        if self.registered is False:
            return f"the kubelet refused its registration: {self.error}"
        return "waiting for the kubelet to register it"

    async def _get_info(self, request: reg.InfoRequest, context: Any) -> reg.PluginInfo:
        return self.info

    async def _notify(self, request: reg.RegistrationStatus, context: Any) -> reg.RegistrationStatusResponse:
        self.registered = request.plugin_registered
        self.error = request.error
        if request.plugin_registered:
            log.info("%s %s: registered with the kubelet", self.info.type, self.info.name)
        else:
            log.error("%s %s: the kubelet refused the registration: %s", self.info.type, self.info.name,
                      request.error)  # fmt: skip
        return reg.RegistrationStatusResponse()
