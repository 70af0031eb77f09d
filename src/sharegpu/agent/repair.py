"""Drift repair: the kubelet's PodResources API (which GPUs each container really got, and which the
device plugin offers) against what the API records. `DriftRepair` reads the kubelet (waiting, and
saying why, while its socket is gone), reports each new mismatch (`agent.drift`) as a Warning event
and a metric, corrects a reservation pod's reported UUID, and notes healthy GPUs the device plugin
does not offer."""

from __future__ import annotations

import logging
from collections.abc import Callable

from sharegpu.agent import drift, notices, podresources
from sharegpu.api import events, names, wire
from sharegpu.kube import client, errors

log = logging.getLogger(__name__)


class DriftRepair:
    def __init__(
        self,
        api: client.KubeApi,
        kubelet: podresources.PodResources,
        warnings: notices.Notices,
        grace: float,
        wall: Callable[[], float],
    ) -> None:
        self.api = api
        self.kubelet = kubelet
        self.warnings = warnings
        self.grace = grace
        """Seconds a pod may run before the kubelet must list the GPUs the API says it holds."""
        self.wall = wall
        self.tracker = drift.DriftTracker()
        self.problem = ""
        """Why the kubelet cannot be read now ("" while it answers)."""
        self.unadvertised: tuple[str, ...] = ()
        """Healthy GPUs of the Device the kubelet cannot allocate (its device plugin does not offer them)."""
        self.unknown_allocatable: tuple[str, ...] = ()
        """Device IDs the kubelet can allocate that name no GPU of the Device."""

    async def assigned(self) -> list[podresources.Assigned] | None:
        """The kubelet's assignments; None while it cannot be read (said once, and on /readyz's detail)."""
        try:
            found = await self.kubelet.assigned()
        except podresources.PodResourcesError as exc:
            if str(exc) != self.problem:
                log.warning("drift check waits: %s", exc)
            self.problem = str(exc)
            return None
        if self.problem:
            log.info("the kubelet's PodResources API answers again")
        self.problem = ""
        return found

    async def repair(
        self,
        assigned: list[podresources.Assigned],
        live_by_uid: dict[str, wire.Pod],
        spec: wire.DeviceSpec,
        ids: drift.DeviceIds | None = None,
    ) -> bool:
        """Report and repair what the kubelet and the API disagree on; False while a reservation pod's
        reported GPU is wrong (this pass corrects it; the pods' view follows by the next)."""
        live = {wire.key(p.metadata): p for p in live_by_uid.values()}
        mismatches = drift.check(assigned, live, spec, now=self.wall(), grace=self.grace, ids=ids)
        changes = self.tracker.observe(mismatches)
        for found in changes.new:
            namespace, name = found.pod.split("/", 1)
            pod = live.get(found.pod)
            subject = events.pod(namespace, name, pod.metadata.uid if pod else "")
            decision = f"{found.kind.value}/{found.kubelet}"
            await self.warnings.warn(subject, "GPUAssignmentDrift", found.message, decision)
        done = []
        for repair in drift.repairs(mismatches):
            try:
                await self.api.patch(repair.path, repair.body)
            except errors.NotFoundError:
                continue
            except errors.KubeError as exc:
                log.warning("correcting %s: %s", repair.pod, exc)
                continue
            log.info("%s: reported GPU corrected to %s (the kubelet's assignment)", repair.pod, repair.uuid)
            done.append(repair)
        self.tracker.repaired(done)
        return not any(m.kind is drift.Kind.RESERVATION_UUID for m in mismatches)

    async def compare_allocatable(self, spec: wire.DeviceSpec, ids: drift.DeviceIds) -> None:
        """What the device plugin offers (GetAllocatableResources, kubelets 1.21 and later) against the
        Device: a healthy GPU it does not offer can never be given to a whole-GPU or reservation pod."""
        try:
            offered = await self.kubelet.allocatable()
        except podresources.PodResourcesError:
            return  # said by `assigned` already
        if offered is None:
            return
        uuids, unknown = ids.resolve(offered.get(names.NVIDIA_GPU, ()))
        unadvertised = tuple(sorted(g.uuid for g in spec.gpus if g.healthy and g.uuid not in uuids))
        if (unadvertised, unknown) != (self.unadvertised, self.unknown_allocatable) and (unadvertised or unknown):
            log.warning("the kubelet's %s: healthy GPUs not offered: %s; offered but not in the Device: %s",
                        names.NVIDIA_GPU, ", ".join(unadvertised) or "none", ", ".join(unknown) or "none")  # fmt: skip
        self.unadvertised, self.unknown_allocatable = unadvertised, unknown
