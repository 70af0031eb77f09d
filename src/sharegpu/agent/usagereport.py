"""The node's GpuUsage (`api.usage`): what its pods use of its GPUs, written for readers of the API.

Each pass's assessment (`agent.watchdog`) is written at most once every `interval` seconds, and then
only when it differs from what was last written by more than the noise (`usage.same_within_noise`:
64 MiB, 5 SM points, or any pod, container or GPU come or gone), or when what was written is
`refresh` seconds old (so a reader can tell a live agent's steady figures from a dead one's). At
1000 nodes and the default minute, that is at most 17 writes a second, and none from a node whose
use holds still. Metrics carry every pass's figures; this object serves the readers that have no
Prometheus (`kubectl sharegpu top`, the GPU map).

The object is made once (its spec names the node); each write replaces its status (the status
subresource) with the resourceVersion last read; a 409 (someone else wrote it) or a 404 (deleted) is
settled by the next write, which reads it (or makes it) first. Failures are logged and kept in
`problem` (on /readyz's detail; they do not make the agent unready: placement does not depend on it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sharegpu.agent import watchdog
from sharegpu.api import paths, resources, usage, wire
from sharegpu.core import errors
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

log = logging.getLogger(__name__)


def figures(assessment: watchdog.Assessment) -> tuple[list[usage.GpuUse], list[usage.PodUse]]:
    """An assessment's figures as the API keeps them."""
    gpus = [
        usage.GpuUse(uuid=g.uuid, index=g.index, memory_mib=g.memory_mib, used_mib=g.used_mib, sm_percent=g.sm_percent)
        for g in assessment.gpus
    ]
    pods = [
        usage.PodUse(
            namespace=u.pod.namespace,
            name=u.pod.name,
            uid=u.pod.uid,
            uuid=u.uuid,
            used_mib=u.used_mib,
            sm_percent=u.sm_percent,
            share_milli=u.share_milli,
            allocated_mib=u.allocated_mib,
            containers=list(u.containers),
        )
        for u in assessment.usages
    ]
    return gpus, pods


class UsageReporter:
    def __init__(
        self,
        api: client.KubeApi,
        node: str,
        interval: float,
        *,
        pass_interval: float,
        refresh: float = usage.REFRESH,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.node = node
        self.interval = interval
        self.pass_interval = pass_interval
        self.refresh = refresh
        self.clock = clock
        self.wall = wall
        self.sent: usage.GpuUsage | None = None
        """What was last written (None: nothing yet, or it must be read again)."""
        self.sent_at: float | None = None
        self.meta: wire.ObjectMeta | None = None
        """The object's metadata after that write (None: read it before the next)."""
        self.owner: wire.OwnerReference | None = None
        self.problem = ""
        self.writes = 0

    async def report(self, assessment: watchdog.Assessment) -> bool:
        """Write the node's figures if it is time and they changed; True if written."""
        now = self.clock()
        if self.sent_at is not None and now - self.sent_at < self.interval:
            return False
        gpus, pods = figures(assessment)
        if self.owner is None:
            node = await self.api.get(paths.node(self.node))
            self.owner = wire.OwnerReference(api_version="v1", kind="Node", name=self.node, uid=node["metadata"]["uid"])
        made = usage.report(self.node, self.owner, wire.timestamp(self.wall()), round(self.pass_interval), gpus, pods)
        fresh = self.sent_at is not None and now - self.sent_at < self.refresh
        if self.sent is not None and fresh and usage.same_within_noise(made.status, self.sent.status):
            return False
        try:
            await self._write(made)
        except errors.SharegpuError as exc:
            self.problem = f"cannot write GpuUsage {self.node}: {exc}"
            self.sent, self.meta = None, None
            log.warning("%s; tried again at the next pass", self.problem)
            return False
        self.problem = ""
        self.sent, self.sent_at = made, now
        self.writes += 1
        return True

    async def _write(self, made: usage.GpuUsage) -> None:
        """The object made if it is missing, then its status (with the resourceVersion last read)."""
        if self.meta is None:
            try:
                current = await self.api.get(paths.gpu_usage(self.node))
            except kube_errors.NotFoundError:
                current = await self.api.create(paths.GPU_USAGES, wire.encode(made))
            self.meta = usage.read(current).metadata
        path, body = resources.GPU_USAGE.status_update(self.meta, made.spec, made.status)
        try:
            written = await self.api.replace(path, body)
        except (kube_errors.ConflictError, kube_errors.NotFoundError):
            self.meta = None
            raise
        self.meta = usage.read(written).metadata
