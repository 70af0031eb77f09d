"""NVIDIA MPS control daemons: one per GPU, started and kept running by the node agent in MPS mode.

MPS limits (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) only bind a process
whose CUDA driver reaches a control daemon, through the control pipe in CUDA_MPS_PIPE_DIRECTORY.
The agent runs `nvidia-cuda-mps-control -f` once per GPU with CUDA_VISIBLE_DEVICES set to that
GPU's UUID and the GPU's own directories (`Layout`, after `api.handoff`'s names). Its tenants never
see those: a pod that demands MPS mounts `<root>/<directory of its GPU>/tenant` read-only, where the
supervisor hard-links the daemon's `control` socket into `pipe/` once the daemon has made it
(`link_control`, in one rename, following no link). Only that socket: without `control_privileged`
a tenant cannot quit the daemon or change its settings (the daemon refuses both through `control`),
and it has no log folder and nothing it can write. A process talks to one daemon, so it uses MPS on
one GPU.

`Layout` only names paths (no I/O). `Supervisor` owns the processes: `ensure` makes the running
set match the GPUs it is given (the caller leaves out unhealthy ones), a watcher task per GPU
restarts its daemon when it exits, with exponential `Backoff`, and `status` reports each as a
`Status` value. A binary that cannot be found is reported and retried the same way, never raised.

The lifecycle, as the real daemon was seen to behave (driver 580): it starts an
`nvidia-cuda-mps-server` for its first client and, on SIGTERM, exits at once leaving that server
running with its GPU context. So a daemon is stopped through its control pipe: `quit` sent by the
same program in client mode (the server ends, then the daemon), then, after `grace`, SIGKILL to
what is left (the daemon's process group, and every MPS process still tied to the GPU's
directories). The same end awaits a daemon that dies by itself (its server goes with it before
the restart), and, before a GPU's first start, whatever a previous agent left on its directories
(`tied`: MPS processes found in `/proc` by their pipe directory or the files they hold open).
Each daemon's output is read by the supervisor and logged line by line (logger
`sharegpu.agent.mps.daemon`, with the GPU's UUID as `gpu`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sharegpu.agent import host
from sharegpu.api import handoff
from sharegpu.core import errors

log = logging.getLogger(__name__)
daemon_log = logging.getLogger(f"{__name__}.daemon")
"""The daemons' own output, one record per line, with the GPU's UUID as the record's `gpu`."""

VISIBLE_DEVICES: Final = "CUDA_VISIBLE_DEVICES"
"""Where the daemons' directories live on the host."""
MODE: Final = 0o755
PROCESS_NAME: Final = "nvidia-cuda-mps"
"""What `/proc/<pid>/comm` says of the control daemon and the server alike (15 characters kept)."""
QUIT: Final = "quit"
CONTROL: Final = "control"
"""The daemon's control socket, in its pipe folder: what a CUDA client connects to. The daemon refuses
`quit` and every setting through it (seen on driver 580: "Not enough privilege"); those take
`control_privileged`, which a tenant's folder never holds."""
_LINKING: Final = ".control.new"
LINK_POLL: Final = 0.05
"""Seconds between looks for a new daemon's control socket."""

_NUMBER = re.compile(r"\d+(\.\d+)?")
_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9][A-Za-z0-9/._-]*$")


@dataclass(frozen=True, slots=True)
class Layout:
    """The directories of each GPU's daemon: `<root>/<uuid>/pipe` and `<root>/<uuid>/log`, the daemon's
    own, and `<root>/<uuid>/tenant/pipe`, its tenants' (only a link to the control socket)."""

    root: Path = host.MPS_ROOT

    def gpu(self, uuid: str) -> Path:
        """The GPU's folder; an old-style MIG UUID's slashes become underscores (one path component)."""
        if not _UUID.match(uuid):
            raise errors.InvalidInputError(f"{uuid!r} is not a GPU or MIG UUID")
        return self.root / handoff.mps_directory(uuid)

    def pipe(self, uuid: str) -> Path:
        """The daemon's own pipe folder (its control sockets; the agent's alone)."""
        return self.gpu(uuid) / "pipe"

    def log(self, uuid: str) -> Path:
        return self.gpu(uuid) / "log"

    def tenant(self, uuid: str) -> Path:
        """The folder the GPU's tenants mount, read-only (`api.handoff.MPS_TENANT`)."""
        return self.gpu(uuid) / handoff.MPS_TENANT

    def tenant_pipe(self, uuid: str) -> Path:
        """The tenants' pipe folder: where a pod's CUDA_MPS_PIPE_DIRECTORY points, seen from the host."""
        return self.tenant(uuid) / Path(handoff.MPS_CLIENT_PIPE).relative_to(handoff.MPS_MOUNT)

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
class Ceiling:
    """The most any one client of a GPU's daemon may take: set daemon-side, as the daemon's defaults
    for the servers it starts next and as the settings of those already running (for their new
    clients). A client's own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
    can lower these and never raise them (seen on driver 580: a client asking for 100% and 8 GiB
    under 25% and 2 GiB got 25% and 2 GiB), so a tenant that drops the hand-off's variables gets the
    ceiling, not the GPU."""

    percent: int
    memory_mib: int

    def __post_init__(self) -> None:
        if not 1 <= self.percent <= 100 or self.memory_mib < 1:
            raise errors.InvalidInputError(f"an MPS ceiling needs 1..100 percent and some memory, not {self}")

    def defaults(self) -> tuple[str, ...]:
        """The daemon's commands that make this the default of the servers it starts next."""
        return (
            f"set_default_active_thread_percentage {self.percent}",
            f"set_default_device_pinned_mem_limit 0 {self.memory_mib}M",
        )

    def of_server(self, pid: int) -> tuple[str, ...]:
        """The daemon's commands that make this the setting of its running server `pid`."""
        return (
            f"set_active_thread_percentage {pid} {self.percent}",
            f"set_device_pinned_mem_limit {pid} 0 {self.memory_mib}M",
        )


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
    linked: bool = False
    """Its control socket is linked into the tenants' pipe folder: a pod can reach it (a running daemon
    is not linked for the moment between its start and its socket's appearing, nor before it took
    its GPU's ceiling, when one is wanted)."""
    ceiling: Ceiling | None = None
    """The ceiling the running daemon took last (None: none yet)."""


def own_directory(parent: Path, name: str) -> None:
    """Make `parent/name` a real directory of the agent's, mode `MODE`, without following a link:
    everything is done relative to the parent's descriptor (opened without following a link itself),
    a symlink or file standing at `name` is removed (never followed: the root agent would otherwise
    create or chmod wherever it points), and the mode is set through the new directory's own
    descriptor. `parent` must be one of the agent's (the MPS root, or a folder made here)."""
    folder = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            os.mkdir(name, MODE, dir_fd=folder)
        except FileExistsError:
            found = os.lstat(name, dir_fd=folder)
            if not stat.S_ISDIR(found.st_mode):
                log.warning("%s/%s was a %s, not the agent's folder: removed", parent, name,
                            "link" if stat.S_ISLNK(found.st_mode) else "file")  # fmt: skip
                os.unlink(name, dir_fd=folder)
                os.mkdir(name, MODE, dir_fd=folder)
        made = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
        try:
            os.fchmod(made, MODE)  # mkdir's mode is masked by the umask
        finally:
            os.close(made)
    finally:
        os.close(folder)


def refused(answer: str) -> bool:
    """Whether the daemon's answer to settings says it did not take one: it echoes a percentage it
    took ("75.0"), says nothing for a memory limit it took, and answers a sentence otherwise (seen on
    driver 580: "Insufficient privileges for UID 4242. ...")."""
    return any(line.strip() and not _NUMBER.fullmatch(line.strip()) for line in answer.splitlines())


def link_control(pipe: Path, tenant_pipe: Path) -> None:
    """Hard-link the daemon's control socket (`pipe/control`) into its tenants' pipe folder, replacing
    what stood there in one rename, never following a link: both folders are opened without following
    one, and only a socket (the real daemon's) or a FIFO (the test fake's) is linked. Raises OSError
    when there is no control socket, InvalidInputError when something else stands in its place."""
    source = os.open(pipe, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        target = os.open(tenant_pipe, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            found = os.lstat(CONTROL, dir_fd=source)
            if not (stat.S_ISSOCK(found.st_mode) or stat.S_ISFIFO(found.st_mode)):
                raise errors.InvalidInputError(f"{pipe}/{CONTROL} is not the daemon's control socket")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_LINKING, dir_fd=target)
            os.link(CONTROL, _LINKING, src_dir_fd=source, dst_dir_fd=target, follow_symlinks=False)
            os.replace(_LINKING, CONTROL, src_dir_fd=target, dst_dir_fd=target)
        finally:
            os.close(target)
    finally:
        os.close(source)


def unlink_control(folder: Path) -> None:
    """Remove `folder/control` (a daemon's that has exited, or a tenant link to it), if there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / CONTROL)


def tied(proc: Path, layout: Layout, uuid: str) -> list[int]:
    """The MPS processes (control daemons and servers) that belong to `uuid`'s directories: named
    `PROCESS_NAME`, with CUDA_MPS_PIPE_DIRECTORY set to its pipe directory or a file open under its
    folder. Clients are never among them (their name is their own program's); a process that ends
    while it is read is left out."""
    folder = str(layout.gpu(uuid))
    pipe = f"{handoff.MPS_PIPE}={layout.pipe(uuid)}".encode()
    found = []
    for entry in _processes(proc):
        try:
            if not (entry / "comm").read_text().startswith(PROCESS_NAME):
                continue
            if pipe in (entry / "environ").read_bytes().split(b"\0") or any(
                target == folder or target.startswith(folder + os.sep) for target in _open_files(entry)
            ):
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return sorted(found)


def _processes(proc: Path) -> Iterator[Path]:
    try:
        entries = list(proc.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            yield entry


def _open_files(entry: Path) -> Iterator[str]:
    try:
        fds = list((entry / "fd").iterdir())
    except (FileNotFoundError, PermissionError):
        return
    for fd in fds:
        with contextlib.suppress(OSError):
            yield os.readlink(fd)


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
        self.relay: asyncio.Task[None] | None = None
        self.starts = 0
        self.last_exit: int | None = None
        self.since: float | None = None
        self.problem = "starting"
        self.linked = False
        self.ceiling: Ceiling | None = None
        self.changed = asyncio.Event()
        """Set when the GPU's wanted ceiling changes (its daemon's linker applies it)."""
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
            linked=running and self.linked,
            ceiling=self.ceiling if running else None,
        )


class Supervisor:
    """Runs one MPS control daemon per GPU it is asked for, keeps them running, and ends each with
    everything it started."""

    def __init__(
        self,
        binary: str | Path = host.MPS_BINARY,
        layout: Layout = Layout(),
        *,
        backoff: Backoff = Backoff(),
        grace: float = 5.0,
        proc: Path = host.PROC,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.binary = binary
        self.layout = layout
        self.backoff = backoff
        self.grace = grace
        """Seconds a daemon and its server have to quit before what is left is killed."""
        self.proc = proc
        """Where the node's processes are seen (to find a daemon's server and what a previous agent left)."""
        self.clock = clock
        self._daemons: dict[str, _Daemon] = {}
        self._wanted: dict[str, Ceiling] = {}
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

    def limit(self, ceilings: Mapping[str, Ceiling]) -> None:
        """Want each GPU's daemon to hold its clients to `ceilings[uuid]` (a GPU left out keeps what it
        has). A daemon that starts takes its GPU's before its socket is linked for tenants; a running
        one takes a change at once, for its servers' new clients (a client keeps what it connected with)."""
        for uuid, ceiling in ceilings.items():
            if self._wanted.get(uuid) != ceiling:
                self._wanted[uuid] = ceiling
                if uuid in self._daemons:
                    self._daemons[uuid].changed.set()

    async def stop(self) -> None:
        """Stop every daemon, its server and its watcher; returns once all have exited."""
        async with self._lock:
            gone = list(self._daemons.values())
            self._daemons.clear()
            await asyncio.gather(*(self._halt(daemon) for daemon in gone))

    # ------------------------------------------------------------------ one GPU

    async def _watch(self, daemon: _Daemon) -> None:
        left = await asyncio.to_thread(tied, self.proc, self.layout, daemon.uuid)
        if left:
            log.warning("MPS on %s: ending %d process(es) a previous agent left: %s",
                        daemon.uuid, len(left), ", ".join(map(str, left)))  # fmt: skip
            await self._end(daemon.uuid, None, ask=True)
        failures = 0
        while True:
            began, starts = self.clock(), daemon.starts
            problem = await self._run(daemon)
            if daemon.process is not None:  # it ran: what it started goes with it
                await self._end(daemon.uuid, daemon.process, ask=False)
                await self._close_relay(daemon)
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
        daemon.process = None
        executable = locate(self.binary)
        if executable is None:
            if os.sep in str(self.binary):
                return f"binary {self.binary} is missing or not executable"
            return f"binary {self.binary} not found on PATH"
        # The output goes through a pipe of our own, not asyncio's: the server inherits it, and a
        # process whose asyncio pipes are still held elsewhere is never reported as exited.
        reading, writing = os.pipe()
        try:
            self._prepare(daemon.uuid)
            process = await asyncio.create_subprocess_exec(
                executable, "-f",
                env={**os.environ, **self.layout.daemon_env(daemon.uuid)},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=writing,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        except OSError as error:
            os.close(reading)
            return f"cannot start {self.binary}: {error}"
        finally:
            os.close(writing)
        daemon.process = process
        daemon.since = self.clock()
        daemon.starts += 1
        daemon.relay = asyncio.create_task(_relay(daemon.uuid, reading), name=f"mps-log-{daemon.uuid}")
        log.info("MPS daemon for %s started: pid %d", daemon.uuid, process.pid)
        linker = asyncio.create_task(self._link(daemon, process), name=f"mps-link-{daemon.uuid}")
        try:
            daemon.last_exit = await process.wait()
        finally:
            linker.cancel()
            await asyncio.gather(linker, return_exceptions=True)
            daemon.linked, daemon.ceiling = False, None  # a new daemon takes its ceiling anew
            unlink_control(self.layout.tenant_pipe(daemon.uuid))
        return describe_exit(daemon.last_exit)

    async def _link(self, daemon: _Daemon, process: asyncio.subprocess.Process) -> None:
        """Once the daemon has made its control socket: give it its GPU's ceiling, link the socket into
        the tenants' pipe folder, then give it every change of the ceiling."""
        pipe, tenant_pipe = self.layout.pipe(daemon.uuid), self.layout.tenant_pipe(daemon.uuid)
        while process.returncode is None and not os.path.lexists(pipe / CONTROL):
            await asyncio.sleep(LINK_POLL)
        if process.returncode is not None:
            return
        await self._apply(daemon, process, servers=False)
        try:
            await asyncio.to_thread(link_control, pipe, tenant_pipe)
        except (OSError, errors.InvalidInputError) as error:
            log.error("MPS daemon for %s: its control socket cannot be linked for tenants: %s", daemon.uuid, error)
            return
        daemon.linked = True
        log.info("MPS daemon for %s: control socket linked into %s", daemon.uuid, tenant_pipe)
        while process.returncode is None:
            await daemon.changed.wait()
            await self._apply(daemon, process, servers=True)

    async def _apply(self, daemon: _Daemon, process: asyncio.subprocess.Process, *, servers: bool) -> None:
        """Give the daemon its GPU's wanted ceiling: its defaults and, with `servers`, the settings of
        each server it runs (found in /proc, `tied` to its directories)."""
        daemon.changed.clear()
        wanted = self._wanted.get(daemon.uuid)
        if wanted is None or wanted == daemon.ceiling:
            return
        commands = list(wanted.defaults())
        if servers:
            running = await asyncio.to_thread(tied, self.proc, self.layout, daemon.uuid)
            for pid in running:
                if pid != process.pid:
                    commands += wanted.of_server(pid)
        said = await self._tell(daemon.uuid, commands)
        if said is None or refused(said):
            log.error("MPS daemon for %s did not take its ceiling (%d%%, %d MiB): %s",
                      daemon.uuid, wanted.percent, wanted.memory_mib, said or "not delivered")  # fmt: skip
            return
        daemon.ceiling = wanted
        log.info(
            "MPS daemon for %s: clients held to %d%% and %d MiB at most", daemon.uuid, wanted.percent, wanted.memory_mib
        )

    def _prepare(self, uuid: str) -> None:
        """Create the GPU's directories (the pipe directory must exist before the daemon starts),
        never following a link (`own_directory`: whatever stands there may have been planted by a
        tenant of an agent before this design, which mounted the GPU's whole folder read-write), and
        take away a control socket an earlier daemon left, in the daemon's folder and the tenants'
        (so that the socket linked next is this daemon's)."""
        self.layout.root.mkdir(mode=MODE, parents=True, exist_ok=True)
        own_directory(self.layout.root, self.layout.gpu(uuid).name)
        for path in (
            self.layout.pipe(uuid),
            self.layout.log(uuid),
            self.layout.tenant(uuid),
            self.layout.tenant_pipe(uuid),
        ):
            own_directory(path.parent, path.name)
        unlink_control(self.layout.tenant_pipe(uuid))
        unlink_control(self.layout.pipe(uuid))

    async def _halt(self, daemon: _Daemon) -> None:
        """End the watcher, then the daemon and its server."""
        if daemon.task is not None:
            daemon.task.cancel()
            [ended] = await asyncio.gather(daemon.task, return_exceptions=True)
            if isinstance(ended, Exception):
                log.error("MPS watcher for %s had failed", daemon.uuid, exc_info=ended)
        process = daemon.process
        if process is not None and process.returncode is None:
            await self._end(daemon.uuid, process, ask=True)
            log.info("MPS daemon for %s stopped (%s)", daemon.uuid, describe_exit(process.returncode or 0))
        elif await asyncio.to_thread(tied, self.proc, self.layout, daemon.uuid):
            await self._end(daemon.uuid, None, ask=False)  # stopped while ending a daemon that had died
        await self._close_relay(daemon)

    async def _end(self, uuid: str, process: asyncio.subprocess.Process | None, *, ask: bool) -> None:
        """End the GPU's daemon (`process`, when this supervisor started it) and every MPS process
        tied to its directories: `quit` through the control pipe when `ask` (SIGTERM to the daemon
        if that cannot be sent), SIGTERM to what is left when not; after `grace`, SIGKILL to the
        daemon's process group and to whatever is still tied."""

        def alive() -> bool:
            return process is not None and process.returncode is None

        asked = ask and await self._quit(uuid)
        if process is not None and alive() and not asked:
            with contextlib.suppress(ProcessLookupError):
                # Not process.terminate(): Popen polls first, and may reap the child asyncio waits for.
                os.kill(process.pid, signal.SIGTERM)
        if not ask:
            for pid in await asyncio.to_thread(tied, self.proc, self.layout, uuid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        left = await asyncio.to_thread(tied, self.proc, self.layout, uuid)
        while (alive() or left) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            left = await asyncio.to_thread(tied, self.proc, self.layout, uuid)
        if alive() or left:
            log.warning("MPS on %s: %s still running %g s after being asked to end: killing it",
                        uuid, ", ".join(map(str, left)) or "the daemon", self.grace)  # fmt: skip
            if process is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if process is not None:
            await process.wait()

    async def _quit(self, uuid: str) -> bool:
        """Send `quit` to the GPU's daemon through its control pipe; whether it was delivered."""
        return await self._tell(uuid, [QUIT]) is not None

    async def ask(self, uuid: str, commands: Sequence[str], *, tenant: bool = False) -> str | None:
        """Send `commands` to the GPU's daemon as the agent does or, with `tenant`, as one of its tenants
        could (through the tenants' pipe folder): what it answered, None when not delivered."""
        return await self._tell(uuid, commands, self.layout.tenant_pipe(uuid) if tenant else None)

    async def _tell(self, uuid: str, commands: Sequence[str], pipe: Path | None = None) -> str | None:
        """Send `commands` to the GPU's daemon through its own pipe folder (the control program in
        client mode, which reaches `control_privileged` there), or through `pipe`; what it answered,
        or None when they could not be delivered (logged)."""
        executable = locate(self.binary)
        env = self.layout.daemon_env(uuid)
        if pipe is not None:
            env[handoff.MPS_PIPE] = str(pipe)
        if executable is None or not (Path(env[handoff.MPS_PIPE]) / CONTROL).exists():
            return None
        try:
            client = await asyncio.create_subprocess_exec(
                executable,
                env={**os.environ, **env},
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as error:
            log.warning("MPS on %s: cannot run %s to send %s: %s", uuid, self.binary, commands[0], error)
            return None
        try:
            async with asyncio.timeout(self.grace):
                said, _ = await client.communicate("".join(f"{c}\n" for c in commands).encode())
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(client.pid, signal.SIGKILL)
            await client.wait()
            log.warning("MPS on %s: %s was not taken within %g s", uuid, commands[0], self.grace)
            return None
        text = said.decode(errors="replace").strip()
        if client.returncode != 0:
            log.warning(
                "MPS on %s: %s refused (%s): %s", uuid, commands[0], describe_exit(client.returncode or 0), text
            )
            return None
        return text

    @staticmethod
    async def _close_relay(daemon: _Daemon) -> None:
        """Let the daemon's log relay read to the end (everything that held its pipe is gone by now)."""
        relay, daemon.relay = daemon.relay, None
        if relay is None:
            return
        try:
            async with asyncio.timeout(1.0):
                await asyncio.shield(relay)
        except TimeoutError:
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)


async def _relay(uuid: str, fd: int) -> None:
    """Log each line the daemon writes (to the pipe whose reading end is `fd`, closed at the end) as
    the agent's own record with the GPU's UUID."""
    loop = asyncio.get_running_loop()
    stream = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(fd, "rb", 0))
    try:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            if text:
                daemon_log.info("%s", text, extra={"gpu": uuid})
    finally:
        transport.close()
