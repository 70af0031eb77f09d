"""The import contracts hold over whole packages: an import of a guarded module planted in a module no
contract names (the agent's watchdog, the extender's cache) breaks them, while the tree as it is
keeps them. Runs import-linter on a copy of the package; a few seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

LINT = Path(sys.executable).parent / "lint-imports"


def copy_of_the_tree(tmp_path: Path) -> Path:
    shutil.copytree(
        REPO / "src" / "sharegpu", tmp_path / "src" / "sharegpu", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "tests").mkdir()
    for name in ("__init__.py", "contracts.py"):
        shutil.copy(REPO / "tests" / name, tmp_path / "tests" / name)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, check=False)


def test_a_planted_import_of_a_guarded_module_breaks_its_contract(tmp_path: Path) -> None:
    root = copy_of_the_tree(tmp_path)
    kept = lint(root)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    for module, planted in (
        ("agent/watchdog.py", "from sharegpu.agent import podresources_pb2 as _planted"),
        ("extender/cache.py", "from sharegpu.kube import fake as _planted"),
        ("agent/runtime.py", "from sharegpu.devcluster import cri_pb2 as _planted"),
    ):
        path = root / "src" / "sharegpu" / module
        path.write_text(path.read_text() + f"\n{planted}  # noqa\n")
    broken = lint(root)
    assert broken.returncode == 1
    text = " ".join(broken.stdout.split())
    assert "sharegpu.agent.watchdog imports sharegpu.agent.podresources_pb2, which only its readers may" in text
    assert "sharegpu.extender.cache imports sharegpu.kube.fake, which only its readers may" in text
    assert "sharegpu.agent.runtime imports sharegpu.devcluster.cri_pb2, which only its readers may" in text
