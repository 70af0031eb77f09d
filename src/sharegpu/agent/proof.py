"""Proof that an isolation mode holds a process to its GPU memory limit on this node, before the node
offers the mode.

A configured mode is not yet a working one: a HAMi-core library built with hidden symbols limits
nothing, silently, and an MPS client that does not reach its daemon is not limited either. So the
`Prover` runs `cuda.probe` (a short child process on the driver's libcuda) in each mode's environment:

- hami-core: once per installed library (by its SHA-256), preloading the copy containers preload,
  on one GPU;
- mps: once per daemon (by its pid, so a restarted daemon is probed again), on its own GPU.

A probe takes GPU memory (a context, an allocation below the limit and, where nothing enforces, one
of twice the limit), so it runs only on a GPU with `room_mib` that no pod of the node was promised
(the caller works that out from the pods' grants). A GPU without that room is not probed: a library
then waits (not offered) until some GPU has room; a restarted daemon keeps the proof of the
daemon before it on that GPU until its own probe can run. A failed probe is tried again after
`retry` seconds, or at once when what it probed changes.

`COMPUTE` says what each mode does with a pod's compute share, as measured on real hardware
(docs/isolation.md); no probe measures compute (it would have to run kernels for seconds on a GPU
pods use): `scripts/gpu-check` does, on an operator's GPU machine.
"""

from __future__ import annotations

import enum
import hashlib
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from sharegpu.agent import host
from sharegpu.agent.cuda import probe as cudaprobe
from sharegpu.core import devices

COMPUTE: Final[Mapping[devices.Isolation, bool]] = {
    devices.Isolation.MPS: True,
    devices.Isolation.MIG: True,
    devices.Isolation.HAMI_CORE: False,
}
"""Whether a mode holds a pod to its compute share. mps: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps the
SMs a client uses (on an H200 two clients at 25% and 75% ran at 169 and 501 TFLOP/s); mig: the
hardware partitions SMs; hami-core: CUDA_DEVICE_SM_LIMIT=25 left a process at 670 TFLOP/s against
671 unlimited on the same H200, so not, unless the operator measured otherwise on theirs."""


class Run(Protocol):
    def __call__(
        self, env: Mapping[str, str], *, limit_mib: int, libcuda: str, timeout: float
    ) -> Awaitable[tuple[cudaprobe.Finding, ...]]: ...


class State(enum.Enum):
    PROVEN = "proven"
    FAILED = "failed"
    PENDING = "pending"
    """Not probed yet: no GPU with room, or probing is off."""


@dataclass(frozen=True, slots=True)
class Proof:
    """What is known of one mode's memory limit (on one GPU's daemon, for mps)."""

    state: State
    subject: str
    """What was (or is to be) probed: `sha256:<first 16 hex digits>` of a library, `daemon pid <n>`."""
    reason: str = ""
    """FAILED: what failed; PENDING: what it waits for; PROVEN: "" (or whose proof it carries)."""
    at: float | None = None
    """When the probe ran (wall clock); None before one did."""

    @property
    def proven(self) -> bool:
        return self.state is State.PROVEN


class Prover:
    """Probes the node's modes and remembers each proof by what it probed (one instance per agent)."""

    def __init__(
        self,
        scratch: Path,
        *,
        run: Run = cudaprobe.run,
        libcuda: str = host.LIBCUDA,
        limit_mib: int = cudaprobe.PROBE_LIMIT_MIB,
        room_mib: int = cudaprobe.PROBE_ROOM_MIB,
        timeout: float = 60.0,
        retry: float = 600.0,
        base_env: Mapping[str, str] | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.scratch = scratch
        """A private directory (HAMi-core's accounting file for the probe)."""
        self.run = run
        self.libcuda = libcuda
        self.limit_mib = limit_mib
        self.room_mib = room_mib
        self.timeout = timeout
        self.retry = retry
        self.base_env = base_env
        self.wall = wall
        self.hami_core: Proof | None = None
        self.daemons: dict[str, Proof] = {}
        """GPU UUID -> the proof of its MPS daemon."""
        self.probes: dict[tuple[str, str], int] = {}
        """(mode, outcome: proven, failed, error) -> probes run."""
        self._digests: dict[tuple[int, int, int], str] = {}

    # ----------------------------------------------------------------- hami-core

    async def hami(self, library: Path, room: Mapping[str, int]) -> Proof:
        """The proof of the library containers preload (`library`, the installed copy); probed on
        the GPU with the most room when it has not been."""
        subject = self._digest(library)
        known = self.hami_core
        if known is not None and known.subject == subject and not self._due(known):
            return known
        uuid = self._roomiest(room)
        if uuid is None:
            self.hami_core = Proof(State.PENDING, subject, self._no_room())
            return self.hami_core
        self.scratch.mkdir(parents=True, exist_ok=True)
        cache = self.scratch / "hami-core-probe.cache"
        cache.unlink(missing_ok=True)
        env = cudaprobe.hami_env(self._base(), library, uuid, self.limit_mib, cache)
        where = f"HAMi-core at {library}"
        self.hami_core = await self._probe(devices.Isolation.HAMI_CORE, subject, env, where, library=library)
        return self.hami_core

    # ----------------------------------------------------------------- mps

    async def mps(self, uuid: str, pid: int, pipe: Path, room_mib: int) -> Proof:
        """The proof of `uuid`'s daemon (`pid`): a probe client of it through `pipe` (the tenants' pipe
        folder, as a pod reaches it), on its GPU."""
        subject = f"daemon pid {pid}"
        known = self.daemons.get(uuid)
        if known is not None and known.subject == subject and not self._due(known):
            return known
        if room_mib < self.room_mib:
            if known is not None and known.proven:  # the daemon before it, on this GPU, was proven
                carried = f"carried from {known.subject}; {subject} is probed once its GPU has {self._room()}"
                self.daemons[uuid] = Proof(State.PROVEN, known.subject, carried, known.at)
            else:
                self.daemons[uuid] = Proof(State.PENDING, subject, self._no_room())
            return self.daemons[uuid]
        env = cudaprobe.mps_env(self._base(), pipe, uuid, self.limit_mib)
        self.daemons[uuid] = await self._probe(devices.Isolation.MPS, subject, env, f"MPS on {uuid}", uuid=uuid)
        return self.daemons[uuid]

    def forget(self, keep: set[str]) -> None:
        """Drop the proofs of daemons on GPUs other than `keep` (gone, or unhealthy)."""
        for uuid in set(self.daemons) - keep:
            del self.daemons[uuid]

    # ----------------------------------------------------------------- common

    async def _probe(
        self,
        mode: devices.Isolation,
        subject: str,
        env: Mapping[str, str],
        where: str,
        *,
        library: Path | None = None,
        uuid: str = "",
    ) -> Proof:
        now = self.wall()
        try:
            findings = await self.run(env, limit_mib=self.limit_mib, libcuda=self.libcuda, timeout=self.timeout)
        except cudaprobe.ProbeError as exc:
            self._count(mode, "error")
            return Proof(State.FAILED, subject, f"{where}: the probe failed: {exc}", now)
        if library is not None:
            verdict = cudaprobe.judge_hami(findings, library, self.limit_mib)
        else:
            verdict = cudaprobe.judge_mps(findings, uuid, self.limit_mib)
        self._count(mode, "proven" if verdict.proven else "failed")
        return Proof(State.PROVEN if verdict.proven else State.FAILED, subject, verdict.reason, now)

    def _count(self, mode: devices.Isolation, outcome: str) -> None:
        self.probes[(mode.value, outcome)] = self.probes.get((mode.value, outcome), 0) + 1

    def _due(self, proof: Proof) -> bool:
        """Whether to probe again: still pending, or failed `retry` seconds ago."""
        if proof.state is State.PENDING:
            return True
        return proof.state is State.FAILED and (proof.at is None or self.wall() - proof.at >= self.retry)

    def _roomiest(self, room: Mapping[str, int]) -> str | None:
        best = max(sorted(room), key=lambda uuid: room[uuid], default=None)
        return best if best is not None and room[best] >= self.room_mib else None

    def _no_room(self) -> str:
        return f"not probed: waiting for a GPU with {self._room()}"

    def _room(self) -> str:
        return f"{self.room_mib} MiB that no pod was promised"

    def _base(self) -> dict[str, str]:
        return dict(self.base_env if self.base_env is not None else os.environ)

    def _digest(self, library: Path) -> str:
        """`sha256:<16 hex digits>` of the file, read again only when its inode, size or time change."""
        info = library.stat()
        key = (info.st_ino, info.st_size, info.st_mtime_ns)
        found = self._digests.get(key)
        if found is None:
            found = f"sha256:{hashlib.sha256(library.read_bytes()).hexdigest()[:16]}"
            self._digests = {key: found}
        return found
