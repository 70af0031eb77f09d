"""Install HAMi-core's library where sharing containers preload it.

The webhook mounts the node's `api.handoff.HAMI_HOST_DIR` read-only into every sharing container and
points LD_PRELOAD at the library in it (through the hand-off, only on nodes that offer hami-core). The
agent keeps that copy equal to the library the operator installed (`--hami-core-library`): copied
when missing or different, to a temporary file renamed into place, so a container starting meanwhile
sees the old library or the new one, never half of one, and processes that mapped the old file keep
it (a rename leaves their inode alone).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import tempfile
from pathlib import Path

LIBRARY_NAME = "libvgpu.so"
"""The installed file's name (the webhook's LD_PRELOAD names it: `api.handoff.HAMI_LIBRARY`)."""


def install(library: Path, directory: Path) -> bool:
    """Make `directory/LIBRARY_NAME` a copy of `library`; False when `library` is not a file. Raises
    OSError when the copy cannot be made (the caller reports it and offers no hami-core)."""
    if not library.is_file():
        return False
    target = directory / LIBRARY_NAME
    if target.is_file() and filecmp.cmp(library, target, shallow=False):
        return True
    directory.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{LIBRARY_NAME}.", dir=directory)
    os.close(handle)
    staging = Path(name)
    try:
        shutil.copyfile(library, staging)
        staging.chmod(0o755)
        staging.replace(target)
    finally:
        staging.unlink(missing_ok=True)
    return True
