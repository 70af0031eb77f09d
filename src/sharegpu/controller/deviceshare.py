"""The mirror reconciler: serves the shared-device-group project's `deviceshare.io` groups through
sharegpu's own (`api.deviceshare`; enabled by `sharegpu controller --compat deviceshare`).

For each deviceshare.io SharedDeviceGroup it keeps a sharegpu.io SharedDeviceGroup of the same
namespace and name (labelled as a mirror, owned by the original) whose spec follows the original's,
and writes the mirror's status back into the original in the project's format. The group reconciler
does the real work on the mirror. A mirror whose original is gone is deleted (the garbage collector
would too; this is faster, and the webhook still refuses it while members live). A sharegpu group
of the same name that is not the original's mirror is left alone and the original is marked Failed.

Level-based: each pass works from the informers' copies only, so a new leader carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sharegpu.api import deviceshare, groups, resources, wire
from sharegpu.api import events as api_events
from sharegpu.core import errors as core_errors
from sharegpu.kube import client, errors, informer, reconcile
from sharegpu.kube import events as kube_events

log = logging.getLogger(__name__)


class MirrorReconciler:
    def __init__(self, api: client.KubeApi, recorder: kube_events.Recorder, clock: Callable[[], float]) -> None:
        self.api = api
        self.recorder = recorder
        self.clock = clock
        self.sources: dict[str, deviceshare.DeviceShareGroup] = {}
        self.groups: dict[str, groups.SharedDeviceGroup] = {}
        self.loop = reconcile.Loop("deviceshare", self.reconcile)

    def on_source(self, kind: wire.EventType, source: deviceshare.DeviceShareGroup) -> None:
        informer.remember(self.sources, kind, source)
        self.loop.wake()

    def on_group(self, kind: wire.EventType, group: groups.SharedDeviceGroup) -> None:
        informer.remember(self.groups, kind, group)
        self.loop.wake()

    async def reconcile(self) -> None:
        await self.recorder.retell()
        for key, source in list(self.sources.items()):
            try:
                await self._one(source)
            except errors.ConflictError:
                continue  # a newer version is on its way
            except errors.NotFoundError:
                self.sources.pop(key, None)
            except errors.KubeError as exc:
                log.warning("deviceshare group %s: %s", key, exc)
        for key, group in list(self.groups.items()):
            if group.metadata.labels.get(deviceshare.LABEL_MIRROR) != deviceshare.GROUP:
                continue
            if key in self.sources or group.metadata.deletion_timestamp is not None:
                continue
            try:
                await self.api.delete(resources.SHARED_DEVICE_GROUP.path(group.metadata.namespace, group.metadata.name))
            except errors.NotFoundError:
                self.groups.pop(key, None)
            except errors.KubeError as exc:  # the webhook refuses while members live: tried again next pass
                log.info("mirror %s of a deleted deviceshare group stays for now: %s", key, exc)

    async def _one(self, source: deviceshare.DeviceShareGroup) -> None:
        meta = source.metadata
        if meta.deletion_timestamp is not None:
            return
        try:
            spec = deviceshare.mirror_spec(source)
        except core_errors.InvalidRequestError as exc:
            await self._write_status(source, deviceshare.Status(phase=groups.PHASE_FAILED, message=str(exc)),
                                     reason="Invalid")  # fmt: skip
            return
        mirror = self.groups.get(wire.key(meta))
        if mirror is None:
            await self._create(source, spec)
            return
        if not deviceshare.mirrors(mirror, source):
            message = (
                f"a {resources.SHARED_DEVICE_GROUP.api_version} SharedDeviceGroup {wire.key(meta)} exists and is not "
                "this group's mirror: rename one of them"
            )
            await self._write_status(source, deviceshare.Status(phase=groups.PHASE_FAILED, message=message),
                                     reason="NameTaken")  # fmt: skip
            return
        if mirror.spec != spec:
            body = {"spec": wire.encode(spec), "metadata": {"resourceVersion": mirror.metadata.resource_version}}
            await self.api.patch(resources.SHARED_DEVICE_GROUP.path(meta.namespace, meta.name), body)
            return
        await self._write_status(source, deviceshare.status_of(mirror, meta.namespace))

    async def _create(self, source: deviceshare.DeviceShareGroup, spec: groups.GroupSpec) -> None:
        meta = source.metadata
        body = {
            "apiVersion": resources.SHARED_DEVICE_GROUP.api_version,
            "kind": resources.SHARED_DEVICE_GROUP.kind,
            "metadata": {
                "name": meta.name,
                "namespace": meta.namespace,
                "labels": {deviceshare.LABEL_MIRROR: deviceshare.GROUP},
                "ownerReferences": [wire.encode(deviceshare.owner(source))],
            },
            "spec": wire.encode(spec),
        }
        try:
            stored = await self.api.create(resources.SHARED_DEVICE_GROUP.path(meta.namespace), body)
        except errors.ConflictError as exc:
            if not exc.already_exists:
                raise
            return  # the informer brings it; the next pass compares owners
        self.groups[wire.key(meta)] = wire.convert(stored, groups.SharedDeviceGroup)
        await self._record(source, "Mirrored", f"served by {resources.SHARED_DEVICE_GROUP.api_version} "
                           f"SharedDeviceGroup {wire.key(meta)}", decision=f"mirrored:{meta.uid}")  # fmt: skip

    async def _write_status(self, source: deviceshare.DeviceShareGroup, status: deviceshare.Status,
                            reason: str = "") -> None:  # fmt: skip
        if status == source.status:
            return
        meta = source.metadata
        stored = await self.api.replace(*resources.DEVICESHARE_GROUP.status_update(meta, source.spec, status))
        self.sources[wire.key(meta)] = wire.convert(stored, deviceshare.DeviceShareGroup)
        if reason:
            await self._record(source, reason, status.message, decision=f"{reason}:{meta.generation}")

    async def _record(self, source: deviceshare.DeviceShareGroup, reason: str, message: str, *, decision: str) -> None:
        subject = resources.DEVICESHARE_GROUP.subject(source.metadata)
        kind: api_events.Kind = "Normal" if reason == "Mirrored" else "Warning"
        await self.recorder.tell(subject, reason, message, decision=decision, kind=kind)
