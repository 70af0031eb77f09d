"""What the agent's tests share (the fake NVML's file is in tests/builders.py)."""

from __future__ import annotations

from pathlib import Path


def gone(pid: int) -> bool:
    """Whether the process has exited (a zombie nobody reaped yet has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")
