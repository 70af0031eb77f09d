"""NVIDIA MPS control daemons: one per GPU, started and kept running by the node agent in MPS mode.

MPS limits (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) only bind a process
whose CUDA driver reaches a control daemon, through the control pipe in CUDA_MPS_PIPE_DIRECTORY.
The agent runs `nvidia-cuda-mps-control -f` once per GPU with CUDA_VISIBLE_DEVICES set to that
GPU's UUID and the GPU's own directories (`Layout`, after `api.handoff`'s names: a pod that demands
MPS mounts `<root>/<directory of its GPU>` and finds `pipe/` and `log/` there). A process talks to
one daemon, so it uses MPS on one GPU.

`Layout` only names paths (no I/O). `Supervisor` owns the processes: `ensure` makes the running
set match the GPUs it is given (the caller leaves out unhealthy ones), a watcher task per GPU
restarts its daemon when it exits, with exponential `Backoff`, and `status` reports each as a
`Status` value. A binary that cannot be found is reported and retried the same way, never raised.
`stop` asks each daemon to quit (SIGTERM), and after a grace period kills its process group (the
daemon and what it started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sharegpu.api import handoff
from sharegpu.core import errors

log = logging.getLogger(__name__)

BINARY: Final = "nvidia-cuda-mps-control"
VISIBLE_DEVICES: Final = "CUDA_VISIBLE_DEVICES"
ROOT: Final = Path(handoff.MPS_HOST_ROOT)
"""Where the daemons' directories live on the host."""
MODE: Final = 0o755

_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9][A-Za-z0-9/._-]*$")


@dataclass(frozen=True, slots=True)
class Layout:
    """The directories of each GPU's daemon: `<root>/<uuid>/pipe` and `<root>/<uuid>/log`."""

    root: Path = ROOT

    def gpu(self, uuid: str) -> Path:
        """The GPU's folder; an old-style MIG UUID's slashes become underscores (one path component)."""
        if not _UUID.match(uuid):
            raise errors.InvalidInputError(f"{uuid!r} is not a GPU or MIG UUID")
        return self.root / handoff.mps_directory(uuid)

    def pipe(self, uuid: str) -> Path:
        return self.gpu(uuid) / "pipe"

    def log(self, uuid: str) -> Path:
        return self.gpu(uuid) / "log"

    def daemon_env(self, uuid: str) -> dict[str, str]:
        """The variables that point a daemon at its GPU and its directories."""
        return {VISIBLE_DEVICES: uuid, handoff.MPS_PIPE: str(self.pipe(uuid)), handoff.MPS_LOG: str(self.log(uuid))}


def locate(binary: str | Path) -> str | None:
    """The executable to run: a path (anything with a slash) if it is an executable file, else PATH's."""
    name = str(binary)
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    return shutil.which(name)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Seconds to wait before restarting a daemon: `first`, doubling per failure up to `most`."""

    first: float = 1.0
    most: float = 60.0
    settled: float = 60.0
    """A daemon that stayed up this long had no failure: its next wait is `first` again."""

    def delay(self, failures: int) -> float:
        """The wait after `failures` failures in a row (0: the first)."""
        return min(self.most, self.first * 2.0 ** min(failures, 64))


@dataclass(frozen=True, slots=True)
class Status:
    """One GPU's daemon as the supervisor sees it."""

    uuid: str
    running: bool
    pid: int | None
    """The running daemon's process id; None when none runs."""
    restarts: int
    """Starts after the first."""
    last_exit: int | None
    """The last exit status (negative: the signal that killed it); None before any exit."""
    since: float | None
    """When the current (or last) daemon started, on the supervisor's clock."""
    problem: str
    """Why it is not running ("" while it runs)."""


def describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"killed by signal {-code} ({name})"


class _Daemon:
    """The supervisor's record of one GPU's daemon (mutated only by its watcher and `_halt`)."""

    def __init__(self, uuid: str) -> None:
        self.uuid = uuid
        self.process: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.last_exit: int | None = None
        self.since: float | None = None
        self.problem = "starting"
        self.task: asyncio.Task[None] | None = None

    def status(self) -> Status:
        process = self.process if self.process is not None and self.process.returncode is None else None
        running = process is not None
        return Status(
            uuid=self.uuid,
            running=running,
            pid=process.pid if process is not None else None,
            restarts=max(0, self.starts - 1),
            last_exit=self.last_exit,
            since=self.since,
            problem="" if running else self.problem,
        )


class Supervisor:
    """Runs one MPS control daemon per GPU it is asked for, and keeps them running."""

    def __init__(
        self,
        binary: str | Path = BINARY,
        layout: Layout = Layout(),
        *,
        backoff: Backoff = Backoff(),
        grace: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.binary = binary
        self.layout = layout
        self.backoff = backoff
        self.grace = grace
        """Seconds a daemon has to quit after SIGTERM before its process group is killed."""
        self.clock = clock
        self._daemons: dict[str, _Daemon] = {}
        self._lock = asyncio.Lock()

    def available(self) -> bool:
        """Whether the daemon's binary can be found (the node can offer MPS)."""
        return locate(self.binary) is not None

    def status(self) -> dict[str, Status]:
        return {uuid: self._daemons[uuid].status() for uuid in sorted(self._daemons)}

    async def ensure(self, uuids: Set[str]) -> None:
        """Run a daemon for each of `uuids` and none for any other GPU."""
        for uuid in uuids:
            self.layout.gpu(uuid)  # refuse a bad UUID before changing anything
        async with self._lock:
            gone = [self._daemons.pop(uuid) for uuid in sorted(set(self._daemons) - set(uuids))]
            await asyncio.gather(*(self._halt(daemon) for daemon in gone))
            for uuid in sorted(set(uuids) - set(self._daemons)):
                daemon = self._daemons[uuid] = _Daemon(uuid)
                daemon.task = asyncio.create_task(self._watch(daemon), name=f"mps-{uuid}")

    async def stop(self) -> None:
        """Stop every daemon and its watcher; returns once all have exited and been reaped."""
        async with self._lock:
            gone = list(self._daemons.values())
            self._daemons.clear()
            await asyncio.gather(*(self._halt(daemon) for daemon in gone))

    # ------------------------------------------------------------------ one GPU

    async def _watch(self, daemon: _Daemon) -> None:
        failures = 0
        while True:
            began, starts = self.clock(), daemon.starts
            problem = await self._run(daemon)
            if self.clock() - began >= self.backoff.settled:
                failures = 0
            delay = self.backoff.delay(failures)
            failures += 1
            again = "restarting" if daemon.starts > starts else "trying again"
            daemon.problem = f"{problem}; {again} in {delay:g} s"
            log.warning("MPS daemon for %s: %s", daemon.uuid, daemon.problem)
            await asyncio.sleep(delay)

    async def _run(self, daemon: _Daemon) -> str:
        """Start the daemon and wait for it to exit; why it is not running."""
        executable = locate(self.binary)
        if executable is None:
            if os.sep in str(self.binary):
                return f"binary {self.binary} is missing or not executable"
            return f"binary {self.binary} not found on PATH"
        try:
            self._prepare(daemon.uuid)
            process = await asyncio.create_subprocess_exec(
                executable, "-f",
                env={**os.environ, **self.layout.daemon_env(daemon.uuid)},
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        except OSError as error:
            return f"cannot start {self.binary}: {error}"
        daemon.process = process
        daemon.since = self.clock()
        daemon.starts += 1
        log.info("MPS daemon for %s started: pid %d", daemon.uuid, process.pid)
        daemon.last_exit = await process.wait()
        return describe_exit(daemon.last_exit)

    def _prepare(self, uuid: str) -> None:
        """Create the GPU's directories (the pipe directory must exist before the daemon starts)."""
        self.layout.root.mkdir(mode=MODE, parents=True, exist_ok=True)
        for path in (self.layout.gpu(uuid), self.layout.pipe(uuid), self.layout.log(uuid)):
            path.mkdir(mode=MODE, exist_ok=True)
            path.chmod(MODE)  # mkdir's mode is masked by the umask

    async def _halt(self, daemon: _Daemon) -> None:
        """End the watcher, then the daemon: SIGTERM, and after `grace` SIGKILL to its process group."""
        if daemon.task is not None:
            daemon.task.cancel()
            [ended] = await asyncio.gather(daemon.task, return_exceptions=True)
            if isinstance(ended, Exception):
                log.error("MPS watcher for %s had failed", daemon.uuid, exc_info=ended)
        process = daemon.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            # Not process.terminate(): Popen polls first, and may reap the child asyncio waits for.
            os.kill(process.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(self.grace):
                code = await process.wait()
        except TimeoutError:
            log.warning("MPS daemon for %s ignored SIGTERM for %g s: killing it", daemon.uuid, self.grace)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            code = await process.wait()
        log.info("MPS daemon for %s stopped (%s)", daemon.uuid, describe_exit(code))
