"""`scripts/gpu-check` on a GPU machine that reaches no registry (issue 40 item 7): `sharegpu
gpu-check` loads none of the heavy packages (so `scripts/gpu-bundle`'s folder can stay small), and
with that folder a plain `python3` runs it from the source tree, no pip, no .venv."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("numpy", "scipy", "matplotlib", "aiohttp", "grpc", "cryptography", "yaml", "prometheus_client")
"""Packages gpu-check must not load: scripts/gpu-bundle does not carry them."""


def test_gpu_check_loads_none_of_the_heavy_packages() -> None:
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['sharegpu', 'gpu-check', '--help']\n"
        "try:\n    runpy.run_module('sharegpu', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "import sharegpu.agent.tools.gpucheck\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert found.stdout.strip().splitlines()[-1] == "[]", found.stdout[-500:]


@pytest.mark.integration
def test_a_plain_python3_runs_gpu_check_from_the_source_tree_with_the_bundle(tmp_path: Path) -> None:
    """Needs PyPI (the bundle's wheels) and the machine's own python3 (no packages of ours)."""
    system = Path("/usr/bin/python3")
    if not system.exists():
        pytest.skip("no /usr/bin/python3 here")
    version = subprocess.run(
        [str(system), "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    tree = tmp_path / "checkout"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu-check", tree / "scripts" / "gpu-check")
    (tree / "src").symlink_to(ROOT / "src")
    made = subprocess.run(
        [str(ROOT / "scripts" / "gpu-bundle"), version, str(tree / ".gpu" / "site")],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    assert f"for CPython {version}" in made.stdout
    size = sum(f.stat().st_size for f in (tree / ".gpu" / "site").rglob("*") if f.is_file())
    assert size < 48 * 1024 * 1024, f"the bundle must travel with a checkout: {size} bytes"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    command = [str(tree / "scripts" / "gpu-check")]
    help_text = subprocess.run([*command, "--help"], check=False, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert help_text.returncode == 0 and "--hami-core-library" in help_text.stdout, help_text.stderr[-2000:]
    run = subprocess.run(command, check=False, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "NVML cannot be loaded here" in run.stderr, "it got as far as the GPU (none here), no ImportError"
    assert not (tree / ".venv").exists(), "nothing installed"
