"""The CDI specs of prepared claims: the hand-off's variables as literal values, and the mounts the
node's limits need."""

from __future__ import annotations

import pytest

from sharegpu.api import cdi, handoff
from sharegpu.core import allocation, errors

UUIDS = {0: "GPU-a", 1: "GPU-b"}


def grant(index: int, milli: int, memory: int) -> allocation.DeviceGrant:
    return allocation.DeviceGrant(index, milli, memory, milli)


def test_mps_wires_the_gpu_s_daemon_and_its_limits() -> None:
    made = cdi.edits([grant(1, 250, 2048)], UUIDS, handoff.Enforcement(mps=True))
    env = made["env"]
    assert "NVIDIA_VISIBLE_DEVICES=GPU-b" in env and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in env
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M" in env
    assert f"CUDA_MPS_PIPE_DIRECTORY={handoff.MPS_MOUNT}/pipe" in env
    assert not any(e.startswith(("LD_PRELOAD=", "CUDA_DEVICE_MEMORY_LIMIT")) for e in env), "not HAMi-core's"
    assert not any(e.startswith("CUDA_MPS_LOG_DIRECTORY=") for e in env), "a tenant has no log folder"
    (mount,) = made["mounts"]
    assert mount["hostPath"] == f"{handoff.MPS_HOST_ROOT}/GPU-b/tenant", "the tenant folder, not the daemon's"
    assert mount["containerPath"] == handoff.MPS_MOUNT and "ro" in mount["options"]


def test_a_node_that_enforces_nothing_gives_the_gpus_alone() -> None:
    made = cdi.edits([grant(0, 1000, 16384), grant(1, 1000, 16384)], UUIDS, handoff.Enforcement())
    assert made == {"env": ["NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b"]}


def test_names_are_safe_for_cdi_and_a_device_needs_a_gpu() -> None:
    assert cdi.device_id("u-1", "my request") == "sharegpu.io/claim=u-1-my_request"
    assert cdi.file_name("u/1") == "sharegpu.io-claim_u_1.json"
    with pytest.raises(errors.InvalidInputError, match="at least one GPU"):
        cdi.edits([], UUIDS, handoff.Enforcement())
