"""The image, built here (issue 40 item 1): `scripts/build-image` builds it from the repository's
Dockerfile with podman and runc, on a base made from Debian's packages (no registry image can be
pulled here), and writes an OCI archive. Each component then starts in it as the chart runs it: uid
65532, a read-only root filesystem, no capabilities, no privilege escalation; the agent as root with
the two capabilities the chart gives it."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]
PODMAN = ("podman", "--runtime", "runc")


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    limits = ("--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096") if args[0] == "run" else ()
    return subprocess.run([*PODMAN, args[0], *limits, *args[1:]], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("image")
    made = subprocess.run(
        [str(ROOT / "scripts" / "build-image"), str(out)], check=False, capture_output=True, text=True, timeout=1500
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-4000:]
    lines = made.stdout.strip().splitlines()
    return lines[-1], out


def test_the_build_writes_an_oci_archive_and_its_last_line_is_the_reference(built: tuple[str, Path]) -> None:
    reference, out = built
    assert reference.startswith("localhost/sharegpu:")
    (archive,) = out.glob("sharegpu-*.oci.tar")
    with tarfile.open(archive) as tar:
        index = orjson.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
    assert index["manifests"], "an OCI image layout"
    inspected = orjson.loads(podman("image", "inspect", reference).stdout)[0]
    assert inspected["Config"]["User"] == "65532:65532"
    assert inspected["Config"]["Entrypoint"] == ["sharegpu"]


def test_each_component_starts_as_the_chart_runs_it(built: tuple[str, Path]) -> None:
    reference, _ = built
    restricted = ("--rm", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                  "--network", "none")  # fmt: skip
    version = podman("run", *restricted, "--user", "65532:65532", reference, "--version")
    assert version.stdout.strip().endswith(subprocess.run(
        [str(ROOT / ".venv" / "bin" / "sharegpu"), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip().split()[-1])  # fmt: skip
    for component in ("extender", "webhook", "controller", "reserve"):
        shown = podman("run", *restricted, "--user", "65532:65532", reference, component, "--help", check=False)
        assert shown.returncode == 0, (component, shown.stderr[-2000:])
    as_root = ("--rm", "--read-only", "--cap-drop", "ALL", "--cap-add", "KILL", "--cap-add", "DAC_READ_SEARCH",
               "--security-opt", "no-new-privileges", "--network", "none", "--user", "0")  # fmt: skip
    agent = podman("run", *as_root, reference, "agent", "--help", check=False)
    assert agent.returncode == 0, agent.stderr[-2000:]
    # A component that starts for real: the extender without an API server says why and exits.
    started = podman("run", *restricted, "--user", "65532:65532", reference, "extender", "--kubeconfig",
                     "/nonexistent", check=False)  # fmt: skip
    assert started.returncode != 0 and "/nonexistent" in started.stderr, started.stderr[-2000:]
