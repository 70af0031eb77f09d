"""A stand-in for `nvidia-cuda-mps-control -f`, for tests of the MPS supervisor and beyond.

`write_fake_daemon(folder)` writes an executable script that, like the control daemon in the
foreground, refuses to start unless CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY exist,
creates its control pipe (`<pipe>/control`, a FIFO), appends a line to `<log>/control.log` naming
its pid and CUDA_VISIBLE_DEVICES, and runs until SIGTERM (or SIGINT), removing the pipe on exit.
`started(log_dir)` reads those lines back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

NAME = "nvidia-cuda-mps-control"

_SCRIPT = '''\
"""Fake nvidia-cuda-mps-control (foreground mode only)."""

import os
import signal
import sys
from pathlib import Path

EXIT_AT_ONCE = {exit_code!r}


def main() -> int:
    if sys.argv[1:] != ["-f"]:
        print("fake MPS control daemon: only -f is supported", file=sys.stderr)
        return 2
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    if not pipe.is_dir() or not logs.is_dir():
        print(f"fake MPS control daemon: {{pipe}} or {{logs}} is not a directory", file=sys.stderr)
        return 1
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    with open(logs / "control.log", "a") as out:
        out.write(f"started pid={{os.getpid()}} devices={{devices}}\\n")
    if EXIT_AT_ONCE is not None:
        return EXIT_AT_ONCE

    def quit_(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, quit_)
    signal.signal(signal.SIGINT, quit_)
    control = pipe / "control"
    try:  # from here on, SIGTERM removes the pipe
        control.unlink(missing_ok=True)  # left by a daemon that was killed
        os.mkfifo(control)
        while True:
            signal.pause()
    finally:
        control.unlink(missing_ok=True)


sys.exit(main())
'''


@dataclass(frozen=True, slots=True)
class Start:
    """One line of the fake's control.log."""

    pid: int
    devices: str


def write_fake_daemon(folder: Path, *, exit_code: int | None = None) -> Path:
    """Write the fake daemon as `<folder>/nvidia-cuda-mps-control`; with `exit_code`, it exits at once with it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / NAME
    path.write_text(f"#!{sys.executable}\n" + _SCRIPT.format(exit_code=exit_code))
    path.chmod(0o755)
    return path


def started(log_dir: Path) -> list[Start]:
    """Every start the fake recorded in `log_dir`, oldest first."""
    path = log_dir / "control.log"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        fields = dict(field.split("=", 1) for field in line.split()[1:])
        out.append(Start(int(fields["pid"]), fields["devices"]))
    return out
