"""What the agent does about a pod over its GPU allocation (`--on-violation`): the usage watchdog
(`agent.watchdog`) says which pods violate and what to do; the `Enforcer` does it: a Warning event
(report), SIGKILL to the offending processes after their owner is checked again through a pidfd
that pins each process, so a reused pid is never hit (kill), or an Eviction through the API, which
honours disruption budgets (evict)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from sharegpu.agent import cgroups, notices, watchdog
from sharegpu.api import events, paths
from sharegpu.api import pods as api_pods
from sharegpu.core import units
from sharegpu.kube import client, errors

log = logging.getLogger(__name__)


class Enforcer:
    """Carries out the watchdog's decisions and counts what it killed and evicted."""

    def __init__(self, api: client.KubeApi, warnings: notices.Notices, proc: Path) -> None:
        self.api = api
        self.warnings = warnings
        self.proc = proc
        """Where the node's processes are seen (an owner is checked again just before a kill)."""
        self.watchdog = watchdog.Watchdog()
        self.killed = 0
        self.evicted = 0

    async def enforce(self, usage: watchdog.Assessment, action: watchdog.Action) -> None:
        for step in self.watchdog.decide(usage, action):
            await self.act(step)

    async def act(self, act: watchdog.Act) -> None:
        violation = act.violation
        pod = violation.pod
        subject = events.pod(pod.namespace, pod.name, pod.uid)
        decision = f"{violation.kind.value}/{violation.uuid}/{self.watchdog.passes}"
        if act.what is watchdog.Action.REPORT:
            reason = "GPUMemoryExceeded" if violation.kind is watchdog.Kind.OVER_MEMORY else "GPUNotAllocated"
            await self.warnings.warn(subject, reason, violation.message, decision)
        elif act.what is watchdog.Action.KILL:
            killed = await asyncio.to_thread(self.kill, act.pids, pod.uid)
            self.killed += len(killed)
            shown = ", ".join(map(str, killed)) or "none (gone meanwhile)"
            message = f"{violation.message}; killed process(es) {shown}"
            await self.warnings.warn(subject, "GPUProcessKilled", message, decision)
        else:
            try:
                body = api_pods.eviction(units.pod_key(pod.namespace, pod.name), pod.uid)
                await self.api.create(paths.eviction(pod.namespace, pod.name), body)
            except (errors.NotFoundError, errors.ConflictError):
                return  # gone already, or made again under its name: the next pass sees
            except errors.KubeError as exc:  # 429: a disruption budget refuses it now; unknown: the watch tells
                log.warning("evicting %s/%s (%s): %s", pod.namespace, pod.name, errors.outcome(exc).value, exc)
                return
            self.evicted += 1
            message = f"{violation.message}; the pod was evicted"
            await self.warnings.warn(subject, "GPUPodEvicted", message, decision)

    def kill(self, pids: tuple[int, ...], uid: str) -> list[int]:
        """SIGKILL each process that still belongs to the pod. A pid may be reused at any moment: each
        process is first pinned by a pidfd, its owner then read, and the signal sent through the pidfd,
        so it reaches the very process whose owner was read, or none (it exited meanwhile)."""
        done = []
        for pid in pids:
            try:
                pinned = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # gone already
            except OSError as exc:  # no pidfd on this kernel (before Linux 5.3): say so, kill nothing
                log.warning("killing process %d: a pidfd cannot be opened (%s); only reported", pid, exc)
                continue
            try:
                owner = cgroups.read_owner(pid, self.proc)
                if owner is None or owner.pod_uid != uid:
                    continue
                signal.pidfd_send_signal(pinned, signal.SIGKILL)
            except (ProcessLookupError, PermissionError) as exc:
                log.warning("killing process %d: %s", pid, exc)
                continue
            finally:
                os.close(pinned)
            done.append(pid)
        return done
