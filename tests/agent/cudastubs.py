"""Build the C stand-ins for the CUDA probe's tests (tests/agent/stubs/), with the machine's gcc.

`build(folder)` compiles the fake driver (`libcuda`, a `libcuda.so.1`; and `legacy`, the same without
cuGetProcAddress, like a driver older than CUDA 11.3) and the fake HAMi-core twice from one source:
`enforcing` (default visibility: it intercepts and limits) and `hidden` (built with -fvisibility=hidden:
it exports nothing and limits nothing, the broken build seen on a real node).
The four compile in parallel; a missing gcc or a failed compile fails the test with gcc's words.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCES = Path(__file__).resolve().parent / "stubs"
FLAGS = ("-shared", "-fPIC", "-O1", "-Wall", "-Wextra")


@dataclass(frozen=True, slots=True)
class Stubs:
    libcuda: Path
    legacy: Path
    enforcing: Path
    hidden: Path


def build(folder: Path) -> Stubs:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("the CUDA probe's tests build their stubs with gcc, and gcc is not on PATH")
    stubs = Stubs(
        libcuda=folder / "libcuda.so.1",
        legacy=folder / "legacy" / "libcuda.so.1",
        enforcing=folder / "enforcing" / "libvgpu.so",
        hidden=folder / "hidden" / "libvgpu.so",
    )
    jobs = [
        (stubs.libcuda, "libcuda_stub.c", ()),
        (stubs.legacy, "libcuda_stub.c", ("-DSTUB_NO_PROC_ADDRESS",)),
        (stubs.enforcing, "hami_stub.c", ()),
        (stubs.hidden, "hami_stub.c", ("-fvisibility=hidden",)),
    ]
    running = []
    for target, source, extra in jobs:
        target.parent.mkdir(parents=True, exist_ok=True)
        command = [gcc, *FLAGS, *extra, "-o", str(target), str(SOURCES / source), "-ldl"]
        running.append((command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    for command, process in running:
        out, _ = process.communicate(timeout=60)
        if process.returncode != 0:
            pytest.fail(f"{' '.join(command)} failed ({process.returncode}):\n{out.decode(errors='replace')}")
    return stubs
