"""The SharePod reconciler: runs KubeShare's SharePods (`api.sharepods`; enabled by
`sharegpu controller --compat kubeshare`).

For each SharePod: the Pod it describes is created (same namespace and name, owned by it; the
webhook translates KubeShare's annotations and sharegpu schedules it), and the Pod is mirrored into
the SharePod's status (`PodStatus`, `PodObjectMeta`, `BoundDeviceID`: the UUIDs of the GPUs it
holds). A Pod of that name that this SharePod did not make is left alone and the SharePod says so.
A Pod whose SharePod is gone is deleted (the garbage collector, which follows the owner reference,
would too). A Pod made for a SharePod that is deleted while the SharePod stays is made again, as
KubeShare does.

Level-based: each pass works from the informers' copies only, so a new leader carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sharegpu.api import paths, resources, sharepods, wire
from sharegpu.controller import inventory
from sharegpu.kube import client, errors, informer, reconcile
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)
RETRY = 30.0


class SharePodReconciler:
    def __init__(
        self, api: client.KubeApi, recorder: kube_events.Recorder, clock: Callable[[], float], ids: inventory.GpuIds
    ) -> None:
        self.api = api
        self.recorder = recorder
        self.clock = clock
        self.shares: dict[str, sharepods.SharePod] = {}
        self.pods: dict[str, sharepods.MadePod] = {}
        """Pods carrying the SharePod label, by namespace/name."""
        self.others: dict[str, float] = {}
        """namespace/name of SharePods whose name a Pod they did not make holds (found by a 409), and
        when that was found: tried again after `RETRY` seconds (that Pod carries no label to watch)."""
        self.ids = ids
        self.loop = reconcile.Loop("sharepods", self.reconcile)

    def on_share(self, kind: wire.EventType, share: sharepods.SharePod) -> None:
        informer.remember(self.shares, kind, share)
        self.loop.wake()

    def on_pod(self, kind: wire.EventType, pod: sharepods.MadePod) -> None:
        informer.remember(self.pods, kind, pod)
        self.loop.wake()

    def devices(self, pod: sharepods.MadePod) -> str:
        node = pod.spec.node_name
        return ",".join(self.ids.uuid(node, i) or f"{node}/{i}" for i in sharepods.gpu_indexes(pod))

    async def reconcile(self) -> None:
        await self.recorder.retell()
        for key, share in list(self.shares.items()):
            try:
                await self._one(key, share)
            except errors.ConflictError:
                continue
            except errors.NotFoundError:
                self.shares.pop(key, None)
            except errors.KubeError as exc:
                log.warning("sharepod %s: %s", key, exc)
        for key, pod in list(self.pods.items()):
            owner = self.shares.get(key)
            if (owner is not None and sharepods.made_for(pod, owner)) or pod.metadata.deletion_timestamp is not None:
                continue
            try:  # only the pod it saw: one made again under the name (by hand, say) is someone else's
                await self.api.delete(
                    paths.pod(pod.metadata.namespace, pod.metadata.name), preconditions={"uid": pod.metadata.uid}
                )
            except errors.NotFoundError:
                self.pods.pop(key, None)
            except errors.ConflictError:
                continue  # not the pod it saw: the watch brings the one there
            except errors.KubeError as exc:
                log.warning("pod %s of a deleted SharePod: %s", key, exc)

    async def _one(self, key: str, share: sharepods.SharePod) -> None:
        if share.metadata.deletion_timestamp is not None:
            return
        pod = self.pods.get(key)
        if pod is None or not sharepods.made_for(pod, share):
            if self.clock() - self.others.get(key, -RETRY) < RETRY:
                return
            await self._create(key, share)
            return
        if pod.metadata.deletion_timestamp is not None:
            return  # it goes; the next pass makes it again
        await self._write_status(share, sharepods.status_of(pod, self.devices(pod)))

    async def _create(self, key: str, share: sharepods.SharePod) -> None:
        meta = share.metadata
        try:
            stored = await self.api.create(paths.pods(meta.namespace), sharepods.pod_for(share))
        except errors.ConflictError as exc:
            if not exc.already_exists:
                raise
            self.others[key] = self.clock()
            message = f"a Pod {key} exists that this SharePod did not make: delete it or rename the SharePod"
            await self._write_status(share, sharepods.Status(message=message))
            await self._record(share, "PodExists", message, decision=f"exists:{meta.uid}", warning=True)
            return
        except errors.ApiError as exc:
            if exc.status not in (400, 403, 422):
                raise
            message = f"the Pod was refused: {exc}"  # bad spec or refused by admission (quota, the webhook)
            await self._write_status(share, sharepods.Status(message=message))
            await self._record(share, "PodRefused", message, decision=f"refused:{meta.uid}:{meta.generation}",
                               warning=True)  # fmt: skip
            return
        self.others.pop(key, None)
        self.pods[key] = wire.convert(stored, sharepods.MadePod)
        await self._record(share, "PodCreated", f"created Pod {key}", decision=f"created:{stored['metadata']['uid']}")

    async def _write_status(self, share: sharepods.SharePod, status: sharepods.Status) -> None:
        if status == share.status:
            return
        meta = share.metadata
        stored = await self.api.replace(*resources.SHAREPOD.status_update(meta, share.spec, status))
        self.shares[wire.key(meta)] = wire.convert(stored, sharepods.SharePod)

    async def _record(
        self, share: sharepods.SharePod, reason: str, message: str, *, decision: str, warning: bool = False
    ) -> None:
        subject = resources.SHAREPOD.subject(share.metadata)
        await self.recorder.tell(subject, reason, message, decision=decision, kind="Warning" if warning else "Normal")
