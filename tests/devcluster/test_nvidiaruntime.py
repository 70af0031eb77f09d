"""The fake NVIDIA container runtime: a container asking for GPUs by its environment gets their
device nodes (by index, UUID or `all`), the control nodes and the node's fake NVML file; one asking
for none (or void) is left as it is; the bundle is found among runc's arguments."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from sharegpu.devcluster import nvidiaruntime

NVML = "gpus:\n  - {uuid: GPU-a, model: X, memoryMiB: 1}\n  - {uuid: GPU-b, model: X, memoryMiB: 1}\n"


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, Path]:
    """A fake NVML file and a device folder with regular files standing in for the nodes (named as
    `fakecri.fake_device_nodes` names them; their type is read from the file, so c or b is not asked)."""
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (devices / name).write_text("")
    nvml = tmp_path / "nvml.yaml"
    nvml.write_text(NVML)
    return nvml, devices


def config(env: list[str]) -> dict[str, Any]:
    return {"process": {"env": ["PATH=/bin", *env]}, "mounts": [], "linux": {}}


@pytest.mark.parametrize(
    ("asked", "given"),
    [("GPU-b", ["nvidia1"]), ("0", ["nvidia0"]), ("all", ["nvidia0", "nvidia1"]), ("GPU-a,1", ["nvidia0", "nvidia1"])],
)
def test_the_gpus_asked_for_are_given_with_the_control_nodes_and_nvml(
    node: tuple[Path, Path], asked: str, given: list[str]
) -> None:
    nvml, devices = node
    made = config([f"NVIDIA_VISIBLE_DEVICES={asked}"])
    assert nvidiaruntime.edit(made, nvml, devices)
    paths = [d["path"] for d in made["linux"]["devices"]]
    assert paths == [f"/dev/{g}" for g in given] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert len(made["linux"]["resources"]["devices"]) == len(paths), "each one allowed in the device cgroup"
    (mount,) = made["mounts"]
    assert mount["source"] == str(nvml) and "ro" in mount["options"]
    assert f"SHAREGPU_FAKE_NVML={nvidiaruntime.NVML_MOUNT}" in made["process"]["env"]


@pytest.mark.parametrize("env", [[], ["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES="]])
def test_a_container_asking_for_no_gpu_is_left_alone(node: tuple[Path, Path], env: list[str]) -> None:
    nvml, devices = node
    made = config(env)
    assert not nvidiaruntime.edit(made, nvml, devices)
    assert made == config(env)


def test_a_real_character_device_keeps_its_numbers(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    devices = tmp_path / "dev"
    devices.mkdir()
    os.mknod(devices / "nvidia0", 0o666 | stat.S_IFCHR, os.makedev(195, 0))
    made = config(["NVIDIA_VISIBLE_DEVICES=all"])
    assert nvidiaruntime.edit(made, tmp_path / "none.yaml", devices)
    (device,) = made["linux"]["devices"]
    assert (device["type"], device["major"], device["minor"]) == ("c", 195, 0)


def test_the_bundle_is_read_only_for_create_and_run() -> None:
    assert nvidiaruntime.bundle_of(["--root", "/r", "create", "--bundle", "/b", "id"]) == Path("/b")
    assert nvidiaruntime.bundle_of(["run", "--bundle=/c", "id"]) == Path("/c")
    assert nvidiaruntime.bundle_of(["--root", "/r", "start", "id"]) is None
    assert nvidiaruntime.bundle_of(["delete", "--force", "id"]) is None
