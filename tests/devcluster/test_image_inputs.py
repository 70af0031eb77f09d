"""The image archive a devcluster loads is rebuilt when the sources it is built from change: the
project's version alone stays the same across edits, and a stale archive once ran old code in the
real-container tests of a working tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sharegpu.devcluster import controlplane, realcluster

BUILD = """#!/bin/sh
echo built >> "$(dirname "$0")/../builds"
mkdir -p "$(dirname "$0")/../out"
echo image > "$(dirname "$0")/../out/sharegpu-9.9.9.oci.tar"
"""


def checkout(root: Path) -> Path:
    (root / ".dockerignore").write_text("*\n!pyproject.toml\n!src/\n\n**/__pycache__\n**/*_pb2.py\n")
    (root / "Dockerfile").write_text("FROM base\n")
    (root / "pyproject.toml").write_text('version = "9.9.9"\n')
    (root / "src" / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "src" / "pkg" / "a.py").write_text("A = 1\n")
    (root / "src" / "pkg" / "a_pb2.py").write_text("# generated\n")
    (root / "src" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (root / "tests").mkdir()
    (root / "tests" / "test_a.py").write_text("")
    script = root / "scripts" / "build-image"
    script.parent.mkdir()
    script.write_text(BUILD)
    script.chmod(0o755)
    return root


def test_the_digest_follows_the_build_context_and_nothing_else(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    first = realcluster.image_inputs(root)
    (root / "src" / "pkg" / "a_pb2.py").write_text("# generated again\n")
    (root / "src" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\1")
    (root / "tests" / "test_a.py").write_text("x = 1\n")
    assert realcluster.image_inputs(root) == first, "caches, generated code and tests are not built in"
    (root / "src" / "pkg" / "a.py").write_text("A = 2\n")
    second = realcluster.image_inputs(root)
    assert second != first
    (root / "Dockerfile").write_text("FROM other\n")
    assert realcluster.image_inputs(root) != second
    (root / "src" / "pkg" / "b.py").write_text("")
    assert realcluster.image_inputs(root) not in (first, second)


def test_an_archive_built_from_other_sources_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = checkout(tmp_path)
    monkeypatch.setattr(controlplane, "REPO_ROOT", root)
    monkeypatch.setattr(realcluster, "version", lambda: "9.9.9")
    monkeypatch.delenv("SHAREGPU_IMAGE_ARCHIVE", raising=False)

    def builds() -> int:
        return len((root / "builds").read_text().splitlines()) if (root / "builds").exists() else 0

    # An archive left by an earlier build, with no record of its sources: not trusted.
    (root / "out").mkdir()
    (root / "out" / "sharegpu-9.9.9.oci.tar").write_text("old image\n")
    archive = realcluster.image_archive()
    assert builds() == 1 and archive.read_text() == "image\n"
    assert realcluster.image_archive() == archive and builds() == 1, "unchanged sources reuse it"
    (root / "src" / "pkg" / "a.py").write_text("A = 2\n")
    realcluster.image_archive()
    assert builds() == 2
    monkeypatch.setenv("SHAREGPU_IMAGE_ARCHIVE", os.fspath(tmp_path / "named.tar"))
    assert realcluster.image_archive() == tmp_path / "named.tar" and builds() == 2
