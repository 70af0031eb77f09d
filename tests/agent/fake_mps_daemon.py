"""A stand-in for `nvidia-cuda-mps-control` and the server it starts, behaving as the real ones were
seen to on an H200 (driver 580), for tests of the MPS supervisor and beyond.

`write_fake_daemon(folder)` writes two executable scripts into `folder`:

- `nvidia-cuda-mps-control`. With `-f` (the daemon in the foreground) it refuses to start unless
  CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY exist, makes its two control pipes there (FIFOs
  where the real daemon makes sockets): `control`, which anyone may use, and `control_privileged`,
  for its owner and root; appends `started pid=... devices=...` to `<log>/control.log`, logs a line
  on stdout (the real daemon in the foreground logs there) and reads commands from both: a line
  `client ...` (what a CUDA client's driver sends; `tests/agent/stubs/libcuda_stub.c` writes one)
  starts the server on the first client; `quit` ends the server, then the daemon; `set_default_...`
  is recorded in `<log>/control.log` as `set ...`. `quit` and the setters are refused on `control`
  (the real daemon's words logged, nothing done), as the real daemon refuses them to a client that
  has no `control_privileged`. SIGTERM ends the daemon at once and leaves the server running, as the
  real one does. Without `-f` it is the client: it writes each line of stdin into the pipe folder's
  `control_privileged` where there is one, else its `control`, or fails as the real one does when no
  daemon listens there.
- `nvidia-cuda-mps-server`: appends `server pid=...` to `<log>/server.log`, keeps that file open (as
  the real server keeps its log) and runs until a signal ends it.

`started(log_dir)`, `settings(log_dir)` and `servers(log_dir)` read those lines back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

NAME = "nvidia-cuda-mps-control"
SERVER = "nvidia-cuda-mps-server"

_CONTROL = '''\
"""Fake nvidia-cuda-mps-control."""

import errno
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path

EXIT_AT_ONCE = {exit_code!r}
SERVER = {server!r}


def client(pipe: Path) -> int:
    name = "control_privileged" if (pipe / "control_privileged").exists() else "control"
    try:
        fd = os.open(pipe / name, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENOENT):
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        raise
    with os.fdopen(fd, "w") as out:
        out.write(sys.stdin.read())
    return 0


def daemon(pipe: Path, logs: Path) -> int:
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    with open(logs / "control.log", "a") as out:
        out.write(f"started pid={{os.getpid()}} devices={{devices}}\\n")
    if EXIT_AT_ONCE is not None:
        return EXIT_AT_ONCE
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))  # leaves the server, as the real one
    paths = {{privileged: pipe / name for privileged, name in ((False, "control"), (True, "control_privileged"))}}
    for path in paths.values():
        path.unlink(missing_ok=True)  # left by a daemon that was killed
        os.mkfifo(path)
    print(f"[fake] control daemon started for {{devices}}", flush=True)
    server = None
    watch = selectors.DefaultSelector()
    for privileged, path in paths.items():
        # read and write: no end of file when a client closes it
        watch.register(os.fdopen(os.open(path, os.O_RDWR), "rb", buffering=0), selectors.EVENT_READ, privileged)
    while True:
        for key, _ in watch.select():
            for line in key.fileobj.read(65536).splitlines():
                words = line.decode().split()
                if words[:1] == ["client"] and server is None:
                    print("[fake] starting a server for the first client", flush=True)
                    server = subprocess.Popen([SERVER], stdin=subprocess.DEVNULL)
                elif words[:1] == ["quit"] or words[:1] and words[0].startswith("set_"):
                    if not key.data:
                        print(f"[fake] Not enough privilege to execute {{words[0]}} command", flush=True)
                    elif words[0] == "quit":
                        print("[fake] quitting", flush=True)
                        if server is not None:
                            server.terminate()
                            server.wait()
                        for path in paths.values():
                            path.unlink(missing_ok=True)
                        return 0
                    else:
                        with open(logs / "control.log", "a") as out:
                            out.write(f"set {{' '.join(words)}}\\n")


def main() -> int:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    if sys.argv[1:] == []:
        return client(pipe)
    if sys.argv[1:] != ["-f"]:
        print("fake MPS control: only -f or commands on stdin are supported", file=sys.stderr)
        return 2
    if not pipe.is_dir() or not logs.is_dir():
        print(f"fake MPS control daemon: {{pipe}} or {{logs}} is not a directory", file=sys.stderr)
        return 1
    return daemon(pipe, logs)


sys.exit(main())
'''

_SERVER = '''\
"""Fake nvidia-cuda-mps-server."""

import os
import signal
from pathlib import Path

logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
out = open(logs / "server.log", "a")
out.write(f"server pid={{os.getpid()}}\\n")
out.flush()
while True:
    signal.pause()
'''


@dataclass(frozen=True, slots=True)
class Start:
    """One line of the fake's control.log."""

    pid: int
    devices: str


def write_fake_daemon(folder: Path, *, exit_code: int | None = None) -> Path:
    """Write the fake control program and server into `folder` and return the control program's path;
    with `exit_code`, the daemon exits at once with it."""
    folder.mkdir(parents=True, exist_ok=True)
    server = folder / SERVER
    server.write_text(f"#!{sys.executable}\n" + _SERVER.format())
    server.chmod(0o755)
    path = folder / NAME
    path.write_text(f"#!{sys.executable}\n" + _CONTROL.format(exit_code=exit_code, server=str(server)))
    path.chmod(0o755)
    return path


def started(log_dir: Path) -> list[Start]:
    """Every start the fake recorded in `log_dir`, oldest first."""
    path = log_dir / "control.log"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("started "):
            continue
        fields = dict(field.split("=", 1) for field in line.split()[1:])
        out.append(Start(int(fields["pid"]), fields["devices"]))
    return out


def settings(log_dir: Path) -> list[str]:
    """Every setting the fake daemon took through its privileged pipe (`set_default_... VALUE`), oldest first."""
    path = log_dir / "control.log"
    if not path.exists():
        return []
    return [line.removeprefix("set ") for line in path.read_text().splitlines() if line.startswith("set ")]


def servers(log_dir: Path) -> list[int]:
    """The pid of every server the fake started for `log_dir`'s daemon, oldest first."""
    path = log_dir / "server.log"
    if not path.exists():
        return []
    return [int(line.split("=", 1)[1]) for line in path.read_text().splitlines()]


def connect(pipe_dir: Path) -> None:
    """Be a CUDA client for a moment: tell the daemon listening in `pipe_dir` (it then starts its server)."""
    with open(pipe_dir / "control", "w") as out:
        out.write("client test\n")
