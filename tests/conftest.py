"""Shared fixtures and builders for the test suite."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from sharegpu.api import names
from sharegpu.core import devices, fleet, requests
from sharegpu.core import ledger as core_ledger
from sharegpu.devcluster import stack
from tests.agent import cudastubs

REPO = Path(__file__).resolve().parent.parent
Json = dict[str, Any]


def openb_dir() -> Path | None:
    """The shared openb trace folder (SHAREGPU_OPENB, or ../shared/traces/openb beside the repo)."""
    candidates = [os.environ.get("SHAREGPU_OPENB"), str(REPO.parent / "shared" / "traces" / "openb")]
    for candidate in candidates:
        if candidate and (Path(candidate) / "openb_node_list_gpu_node.csv").is_file():
            return Path(candidate)
    return None


@contextlib.contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """bench/<name>.py loaded as the module `bench_<name>`, registered while in use (a dataclass
    looks its module up by name)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture(scope="session")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> cudastubs.Stubs:
    """The C stand-ins for libcuda and HAMi-core (tests/agent/stubs/), built once per session."""
    return cudastubs.build(tmp_path_factory.mktemp("cudastubs"))


@pytest.fixture
def openb() -> Path:
    path = openb_dir()
    if path is None:
        pytest.skip("the openb trace (../shared/traces/openb) is not present")
    return path


def node(
    name: str,
    gpus: int = 2,
    model: str = "T4",
    *,
    memory: int = 16384,
    cpu: int = 32000,
    host_memory: int = 131072,
    nvlink_all: bool = False,
) -> devices.NodeInventory:
    return devices.uniform_node(
        name,
        gpu_count=gpus,
        model=model,
        gpu_memory_mib=memory,
        cpu_milli=cpu,
        memory_mib=host_memory,
        nvlink_all=nvlink_all,
    )


def ledger(*nodes: devices.NodeInventory) -> core_ledger.Ledger:
    return core_ledger.Ledger(fleet.FleetState(list(nodes)))


def pod(key: str, **kwargs: object) -> requests.PodRequest:
    return requests.simple_pod(key, **kwargs)  # type: ignore[arg-type]


async def eventually(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Poll a condition of a component running in this event loop (AssertionError naming it on timeout)."""
    for _ in range(int(timeout / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------------------- the Helm chart, rendered


@functools.cache
def helm() -> str:
    """The pinned helm (scripts/tools installs it and prints its path)."""
    return subprocess.run([REPO / "scripts" / "tools"], check=True, capture_output=True, text=True).stdout.strip()


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, check=False)


@functools.cache
def render(version: str, *settings: str) -> list[Json]:
    """The chart's documents for Kubernetes `version`, with `--set` settings."""
    args = ["template", "sharegpu", str(stack.CHART), "-n", names.SYSTEM_NAMESPACE, "--kube-version", version]
    for setting in settings:
        args += ["--set", setting]
    done = run_helm(*args)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def one(docs: list[Json], kind: str, name: str) -> Json:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found
