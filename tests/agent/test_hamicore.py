"""Installing HAMi-core's library where containers preload it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sharegpu.agent import hamicore


def test_installed_when_missing_replaced_when_different_and_left_when_equal(tmp_path: Path) -> None:
    library = tmp_path / "vgpu" / "libvgpu.so"
    target = tmp_path / "run" / "hami-core"
    assert not hamicore.install(library, target), "no library: nothing offered"
    library.parent.mkdir()
    library.write_bytes(b"one")
    assert hamicore.install(library, target)
    installed = target / hamicore.LIBRARY_NAME
    assert installed.read_bytes() == b"one" and os.access(installed, os.X_OK)
    inode = installed.stat().st_ino
    assert hamicore.install(library, target)
    assert installed.stat().st_ino == inode, "an equal copy is left alone"
    library.write_bytes(b"two")
    assert hamicore.install(library, target)
    assert installed.read_bytes() == b"two" and installed.stat().st_ino != inode, "replaced by a rename"
    assert sorted(p.name for p in target.iterdir()) == [hamicore.LIBRARY_NAME], "no staging file left"


def test_a_folder_that_cannot_be_written_raises(tmp_path: Path) -> None:
    library = tmp_path / "libvgpu.so"
    library.write_bytes(b"x")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"Not a directory|File exists"):
        hamicore.install(library, blocker / "sub")
