"""The agent's DRA kubelet plugin: the kubelet prepares sharegpu's claims through it before a pod's
containers start, and unprepares them once the pod is gone.

Two gRPC services, each on a unix socket:

- **DRAPlugin** (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`, and `...v1beta1.DRAPlugin` for older
  kubelets: the same messages less `share_id`, the same field numbers) on `<plugins>/<driver>/dra.sock`.
  `NodePrepareResources` reads each claim from the API server (its UID must be the one the kubelet
  names, its allocation on this node's pool), writes the claim's CDI spec (`api.cdi`: the GPUs' UUIDs
  and the limits this node enforces, as the hand-off gives them on the extender path) atomically
  into the CDI directory, and answers per device the CDI IDs to apply: the NVIDIA container
  toolkit's device of that GPU, and sharegpu's device of the claim's request (on the request's first
  device). `NodeUnprepareResources` removes the claim's spec. Both are idempotent, across agent
  restarts too: the spec file is the only state, named by the claim's UID; preparing again writes
  the same file, unpreparing one that is gone is done. The spec also records which claim it is and
  what it holds per GPU (`api.cdi.PreparedClaim`, an annotation); `claims` keeps those, read back
  from the files at `start`, for the usage watchdog to judge the pods that use them.
- **Registration** on `<plugins_registry>/<driver>-reg.sock` (`agent.registration`: type
  `DRAPlugin`, the driver, the socket above, the versions it serves), kept served while the agent runs.

Errors per claim go back in the answer (`error`), naming the claim and what is wrong; the kubelet
retries them. Nothing here raises into gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
import orjson

from sharegpu.agent import draplugin_pb2 as pb
from sharegpu.agent import host, registration
from sharegpu.api import cdi, dra, handoff, wire
from sharegpu.core import errors
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from sharegpu.serving import unixgrpc

log = logging.getLogger(__name__)

SERVICES: Final = ("k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin")
VERSIONS: Final = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
PLUGIN_TYPE: Final = "DRAPlugin"
PREPARE: Final = "NodePrepareResources"
UNPREPARE: Final = "NodeUnprepareResources"


@dataclass(frozen=True, slots=True)
class Paths:
    plugin_socket: Path
    registration_socket: Path
    cdi_dir: Path
    mounts: cdi.HostPaths = cdi.AGENT_DEFAULTS
    """The agent's folders a claim's containers mount (its --hami-core-dir and --mps-root)."""

    @classmethod
    def under(
        cls,
        plugins: Path = host.KUBELET_PLUGINS_DIR,
        registry: Path = host.KUBELET_REGISTRY_DIR,
        cdi_dir: Path = host.CDI_DIR,
        mounts: cdi.HostPaths = cdi.AGENT_DEFAULTS,
    ) -> Paths:
        return cls(*registration.sockets(dra.DRIVER, "dra.sock", plugins, registry), cdi_dir, mounts)


class ClaimNotPreparable(errors.SharegpuError):
    """A claim the plugin cannot prepare (its message goes back to the kubelet)."""


class DraPlugin:
    """Serves the kubelet's DRA plugin and registration services (see the module docstring)."""

    def __init__(
        self,
        api: client.KubeApi,
        node: str,
        paths: Paths,
        inventory: Callable[[], wire.DeviceSpec | None],
        enforcement: Callable[[], handoff.Enforcement],
    ) -> None:
        self.api = api
        self.node = node
        self.paths = paths
        self.inventory = inventory
        """The node's GPUs as its Device says them now (None until discovered)."""
        self.enforcement = enforcement
        """The limits the node enforces now (what its proven isolation modes give)."""
        self.claims: dict[tuple[str, str], cdi.PreparedClaim] | None = None
        """(namespace, name) -> each claim prepared here, from its spec (None until read at `start`):
        what the watchdog judges the pods that use it by."""
        self.registration = registration.Registration(
            paths.registration_socket, PLUGIN_TYPE, dra.DRIVER, paths.plugin_socket, VERSIONS
        )
        self._plugin: grpc.aio.Server | None = None

    # ----------------------------------------------------------------- serving

    async def start(self) -> None:
        """Serve the plugin, then register it (the kubelet may call the plugin as soon as it sees the
        registration socket)."""
        self.paths.cdi_dir.mkdir(parents=True, exist_ok=True)
        recovered = await asyncio.to_thread(self._recover)
        self.claims = {(c.namespace, c.name): c for c in recovered}  # the newest spec of a name, until the API says
        await self._collect(recovered)
        await self._serve()
        await self.registration.start()

    async def _serve(self) -> None:
        """Serve the plugin's own socket (anew: a server before is stopped)."""
        await unixgrpc.stop(self._plugin, None)
        prepare = unixgrpc.unary(self._prepare, pb.NodePrepareResourcesRequest, pb.NodePrepareResourcesResponse)
        unprepare = unixgrpc.unary(self._unprepare, pb.NodeUnprepareResourcesRequest, pb.NodeUnprepareResourcesResponse)
        handlers = [grpc.method_handlers_generic_handler(s, {PREPARE: prepare, UNPREPARE: unprepare}) for s in SERVICES]
        self._plugin = await unixgrpc.serve(self.paths.plugin_socket, handlers)

    async def keep(self, every: float = 5.0) -> None:
        """Serve both sockets again whenever one is gone (`registration.Registration.keep`)."""
        await self.registration.keep(self._serve, every)

    async def stop(self) -> None:
        """Stop both services and remove their sockets (the CDI specs stay: pods may still run)."""
        await self.registration.stop()
        await unixgrpc.stop(self._plugin, self.paths.plugin_socket)
        self._plugin = None

    # ----------------------------------------------------------------- prepare and unprepare

    async def _prepare(self, request: pb.NodePrepareResourcesRequest, context: Any) -> pb.NodePrepareResourcesResponse:
        out = pb.NodePrepareResourcesResponse()
        for claim in request.claims:
            try:
                devices = await self.prepare(claim.namespace, claim.name, claim.uid)
            except errors.SharegpuError as exc:
                log.warning("DRA plugin: claim %s/%s not prepared: %s", claim.namespace, claim.name, exc)
                out.claims[claim.uid].error = str(exc)
                continue
            out.claims[claim.uid].devices.extend(devices)
        return out

    async def _unprepare(
        self, request: pb.NodeUnprepareResourcesRequest, context: Any
    ) -> pb.NodeUnprepareResourcesResponse:
        out = pb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            try:
                self.unprepare(claim.uid)
            except OSError as exc:
                out.claims[claim.uid].error = f"claim {claim.namespace}/{claim.name}: removing its CDI spec: {exc}"
                continue
            out.claims[claim.uid].error = ""
        return out

    async def prepare(self, namespace: str, name: str, uid: str) -> list[pb.Device]:
        """Write the claim's CDI spec; the devices to answer. ClaimNotPreparable (or an API error)
        naming the claim and what is wrong."""
        where = f"claim {namespace}/{name}"
        try:
            found = wire.convert(await self.api.get(dra.claim_path(namespace, name)), dra.ResourceClaim)
        except kube_errors.NotFoundError:
            raise ClaimNotPreparable(f"{where} does not exist") from None
        if found.metadata.uid != uid:
            raise ClaimNotPreparable(f"{where} has UID {found.metadata.uid}, not the {uid} the kubelet names")
        record = dra.claim_record(found)
        allocation = found.status.allocation
        results = [r for r in (allocation.devices.results if allocation else []) if r.driver == dra.DRIVER]
        if not results:
            raise ClaimNotPreparable(f"{where} holds no device of {dra.DRIVER}")
        elsewhere = sorted({r.pool for r in results} - {self.node})
        if elsewhere:
            raise ClaimNotPreparable(f"{where} is allocated on {', '.join(elsewhere)}, not on this node {self.node}")
        spec = self.inventory()
        if spec is None:
            raise ClaimNotPreparable(f"{where}: this node's GPUs are not discovered yet")
        uuid_of = {gpu.index: gpu.uuid for gpu in spec.gpus}
        memory_of = {(self.node, gpu.index): gpu.memory_mib for gpu in spec.gpus}
        try:
            held = dra.held(record, memory_of)
        except errors.InvalidInputError as exc:
            raise ClaimNotPreparable(str(exc)) from None
        assert held is not None
        missing = sorted({g.index for c in held.containers for g in c.devices} - set(uuid_of))
        if missing:
            raise ClaimNotPreparable(f"{where}: GPU(s) {missing} are not on this node")
        requests = [cdi.RequestDevices(c.name, c.devices) for c in held.containers]
        prepared = cdi.PreparedClaim.of(namespace, name, uid, requests, uuid_of)
        self._write(uid, cdi.spec(uid, requests, uuid_of, self._enforcement(uid), prepared, self.paths.mounts))
        if self.claims is not None:
            self.claims[(namespace, name)] = prepared
        devices = []
        first: set[str] = set()
        for result in results:
            index = int(result.device.removeprefix("gpu-"))
            ids = [cdi.nvidia_device(uuid_of[index])]
            request = result.request or "claim"
            if request not in first:
                first.add(request)
                ids.append(cdi.device_id(uid, request))
            device = pb.Device(
                request_names=[request], pool_name=result.pool, device_name=result.device, cdi_device_ids=ids
            )
            if result.share_id:
                device.share_id = result.share_id
            devices.append(device)
        log.info("DRA plugin: claim %s prepared: %s", where, ", ".join(i for d in devices for i in d.cdi_device_ids))
        return devices

    def _enforcement(self, uid: str) -> handoff.Enforcement:
        """The limits to write: what the node offers now, and never less than a spec of this claim
        written before holds (a kubelet may prepare a claim again, e.g. after it restarted, while a
        mode is not offered for the moment: HAMi-core waits for its proof after an agent restart);
        its pods' containers, restarted, must not come back without the limits they started with."""
        now = self.enforcement()
        try:
            body = orjson.loads((self.paths.cdi_dir / cdi.file_name(uid)).read_bytes())
        except FileNotFoundError:
            return now
        except (OSError, orjson.JSONDecodeError) as error:
            log.warning("DRA plugin: cannot read the CDI spec of claim %s: %s; written anew", uid, error)
            return now
        before = cdi.enforcement_of(body) if isinstance(body, dict) else handoff.Enforcement()
        return handoff.Enforcement(hami_core=now.hami_core or before.hami_core, mps=now.mps or before.mps)

    def unprepare(self, uid: str) -> bool:
        """Remove the claim's CDI spec: True if there was one."""
        path = self.paths.cdi_dir / cdi.file_name(uid)
        if self.claims is not None:
            for key in [k for k, c in self.claims.items() if c.uid == uid]:
                del self.claims[key]
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        log.info("DRA plugin: claim %s unprepared", uid)
        return True

    def prepared(self) -> list[str]:
        """The CDI spec files of the claims prepared here (what survives an agent restart)."""
        prefix = cdi.file_name("")
        return sorted(p.name for p in self.paths.cdi_dir.glob(f"{prefix.removesuffix('.json')}*.json"))

    async def _collect(self, recovered: list[cdi.PreparedClaim]) -> None:
        """Remove the specs of claims that no longer exist (or exist again under another UID): their
        pods are gone, and the kubelet will not unprepare what it no longer knows. Of two specs of one
        claim name (the claim made again and prepared before the old one was unprepared), the one of
        the UID the API shows is the claim's. A claim that cannot be read now keeps its spec, and so
        does every claim while the API server does not serve claims' version (a 404 then says
        nothing of the claim: an API server of another version answered)."""
        if recovered:
            try:
                served = await client.serves(self.api, dra.API_VERSION)
            except kube_errors.KubeError as error:
                log.warning("DRA plugin: cannot tell whether %s is served: %s; no spec removed", dra.API_VERSION, error)
                return
            if not served:
                log.warning("DRA plugin: %s is not served now; no spec removed", dra.API_VERSION)
                return
        for claim in recovered:
            namespace, name = claim.namespace, claim.name
            try:
                found = await self.api.get(dra.claim_path(namespace, name))
            except kube_errors.NotFoundError:
                found = None
            except kube_errors.KubeError as error:
                log.warning("DRA plugin: cannot tell whether claim %s/%s still exists: %s", namespace, name, error)
                continue
            if found is None or (found.get("metadata") or {}).get("uid") != claim.uid:
                log.info("DRA plugin: claim %s/%s (UID %s) is gone: its CDI spec removed", namespace, name, claim.uid)
                self.unprepare(claim.uid)
            elif self.claims is not None:
                self.claims[(namespace, name)] = claim

    def _recover(self) -> list[cdi.PreparedClaim]:
        """The claims prepared here, read back from their specs, oldest spec first (an agent that
        restarts meets pods that still use them); a spec that does not say its claim is left out
        (logged): its pods go unjudged."""
        out: list[tuple[float, cdi.PreparedClaim]] = []
        for name in self.prepared():
            try:
                body = orjson.loads((self.paths.cdi_dir / name).read_bytes())
            except (OSError, orjson.JSONDecodeError) as error:
                log.warning("DRA plugin: cannot read the CDI spec %s: %s", name, error)
                continue
            found = cdi.PreparedClaim.of_spec(body) if isinstance(body, dict) else None
            if found is None:
                log.warning(
                    "DRA plugin: the CDI spec %s does not say which claim it is for: its pods go unjudged", name
                )
                continue
            with contextlib.suppress(OSError):
                out.append(((self.paths.cdi_dir / name).stat().st_mtime, found))
        return [claim for _, claim in sorted(out, key=lambda pair: pair[0])]

    def _write(self, uid: str, body: dict[str, Any]) -> None:
        """Atomically: a runtime reading the directory sees the old file or the new one, never half."""
        target = self.paths.cdi_dir / cdi.file_name(uid)
        # Not named *.json (nor *.yaml): a runtime scanning the folder for specs must not read it half written.
        descriptor, temporary = tempfile.mkstemp(dir=self.paths.cdi_dir, prefix=".sharegpu-", suffix=".partial")
        try:
            with os.fdopen(descriptor, "wb") as out:
                out.write(orjson.dumps(body, option=orjson.OPT_INDENT_2))
            os.chmod(temporary, 0o644)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
