"""The agent's ResourceSlice (`api.dra`): the node's GPUs published for sharegpu's DRA driver, from the
same Device spec each pass builds (`--dra`).

Written when it differs from what was last written: created owned by the Node, else replaced with
the resourceVersion read (a 409 means someone else wrote: the next pass reads theirs), the pool's
generation raised whenever its devices change (so the scheduler never mixes an old slice with a new
one). Where the API server does not serve `resource.k8s.io/v1` (Kubernetes before 1.34) nothing is
written: the agent says so once, in its log and on /readyz's detail, and looks again every
`recheck` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sharegpu.api import dra, paths, wire
from sharegpu.kube import client, errors

log = logging.getLogger(__name__)


class SlicePublisher:
    def __init__(
        self, api: client.KubeApi, node: str, *, recheck: float = 600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.api = api
        self.node = node
        self.recheck = recheck
        self.clock = clock
        self.problem = ""
        """Why no slice is published ("" while it is)."""
        self.written: list[dict[str, Any]] | None = None
        """The devices this agent last wrote (as it sent them)."""
        self._version = ""
        """The slice's resourceVersion after that write."""
        self._served: bool | None = None
        """Whether the API server serves resource.k8s.io/v1 (None: not asked yet)."""
        self._asked_at: float | None = None
        self._node_uid = ""

    @property
    def unserved(self) -> bool:
        """The API server was found not to serve resource.k8s.io/v1 (no claim can come here)."""
        return self._served is False

    async def publish(self, spec: wire.DeviceSpec, held: frozenset[str] = frozenset()) -> None:
        """Write the slice for `spec` if it changed (`held`: GPUs pods of the extender path hold, tainted).

        The API server rewrites what it stores (quantities in canonical form, taints stamped), so
        what was sent is compared with what this agent sent last, at the version it got back."""
        if not await self._serving():
            return
        if not self._node_uid:
            self._node_uid = (await self.api.get(paths.node(self.node)))["metadata"]["uid"]
        try:
            current: dict[str, Any] | None = await self.api.get(dra.slice_path(self.node))
        except errors.NotFoundError:
            current = None
        body = dra.resource_slice(self.node, self._node_uid, spec, held=held)
        devices = body["spec"]["devices"]
        if current is None:
            made = await self.api.create(dra.SLICES, body)
            log.info("ResourceSlice %s created: %d GPU(s)", dra.slice_name(self.node), len(spec.gpus))
        else:
            version = current["metadata"]["resourceVersion"]
            if version == self._version and devices == self.written:
                return
            generation = int((current["spec"].get("pool") or {}).get("generation", 0))
            body["spec"]["pool"]["generation"] = generation + 1 if devices != self.written else max(generation, 1)
            body["metadata"]["resourceVersion"] = version
            made = await self.api.replace(dra.slice_path(self.node), body)
            log.info("ResourceSlice %s updated (pool generation %d)", dra.slice_name(self.node),
                     body["spec"]["pool"]["generation"])  # fmt: skip
        self.written = devices
        self._version = made["metadata"]["resourceVersion"]

    async def _serving(self) -> bool:
        """Whether the API server serves resource.k8s.io/v1 (asked once, then every `recheck` s while not)."""
        now = self.clock()
        if self._served or (self._asked_at is not None and now - self._asked_at < self.recheck):
            return bool(self._served)
        self._asked_at = now
        if not await client.serves(self.api, dra.API_VERSION):
            if self._served is not False:
                log.warning("the API server does not serve %s (Kubernetes 1.34 or later does): no ResourceSlice "
                            "is published", dra.API_VERSION)  # fmt: skip
            self._served = False
            self.problem = f"{dra.API_VERSION} is not served here: no ResourceSlice"
            return False
        self._served = True
        self.problem = ""
        return True
