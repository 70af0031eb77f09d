"""The hand-off contract: what the webhook references is exactly what the extender writes."""

from __future__ import annotations

import pytest

from sharegpu.api import handoff, wire
from sharegpu.core import devices
from tests.builders import MakeAllocation


def test_one_container_one_gpu_gets_hami_and_mps_limits() -> None:
    alloc = MakeAllocation("ns/p", "n").grant(1, 300, 4096, limit=600).obj()
    assert handoff.data(alloc, {1: "GPU-b"}, handoff.EVERY_LIMIT) == {
        "main.NVIDIA_VISIBLE_DEVICES": "GPU-b",
        "main.CUDA_DEVICE_SM_LIMIT": "60",
        "main.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60",
        "main.CUDA_DEVICE_MEMORY_LIMIT": "4096m",
        "main.CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
        "main.SHAREGPU_PRELOAD": "/run/sharegpu/hami-core/libvgpu.so",
    }


def test_the_hand_off_holds_the_limits_the_node_enforces_and_no_others() -> None:
    alloc = MakeAllocation("ns/p", "n").grant(0, 300, 4096).obj()
    uuid = {0: "GPU-a"}
    assert handoff.data(alloc, uuid, handoff.Enforcement()) == {
        "main.NVIDIA_VISIBLE_DEVICES": "GPU-a", "main.SHAREGPU_PRELOAD": ""
    }, "no HAMi-core: nothing preloaded (the key is written: LD_PRELOAD reads it)"  # fmt: skip
    hami = handoff.data(alloc, uuid, handoff.Enforcement(hami_core=True))
    assert set(hami) == {"main.NVIDIA_VISIBLE_DEVICES", "main.CUDA_DEVICE_SM_LIMIT", "main.CUDA_DEVICE_MEMORY_LIMIT",
                         "main.SHAREGPU_PRELOAD"}  # fmt: skip
    assert hami["main.SHAREGPU_PRELOAD"] == handoff.HAMI_LIBRARY
    mps = handoff.data(alloc, uuid, handoff.Enforcement(mps=True))
    assert not any("CUDA_DEVICE_" in k for k in mps) and mps["main.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert mps["main.SHAREGPU_PRELOAD"] == "", "MPS alone: HAMi-core is not preloaded"
    offered = frozenset({devices.Isolation.MPS, devices.Isolation.HAMI_CORE})
    assert handoff.Enforcement.of(offered, None) == handoff.Enforcement(hami_core=True), "not wired: no MPS"
    assert handoff.Enforcement.of(offered, devices.Isolation.MPS) == handoff.Enforcement(mps=True), "MPS alone"
    assert handoff.Enforcement.of(offered, devices.Isolation.HAMI_CORE) == handoff.Enforcement(hami_core=True)
    assert handoff.Enforcement.of(frozenset(), devices.Isolation.MPS) == handoff.Enforcement()


def test_several_gpus_and_containers_and_no_memory_limit() -> None:
    alloc = (
        MakeAllocation("ns/p", "n")
        .grant(0, 250, 1000, container="a")
        .grant(2, 250, 2000, container="a")
        .grant(0, 100, container="b")
        .obj()
    )
    data = handoff.data(alloc, {0: "GPU-x", 2: "GPU-z"}, handoff.EVERY_LIMIT)
    assert data["a.NVIDIA_VISIBLE_DEVICES"] == "GPU-x,GPU-z"
    assert data["a.CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"
    assert data["a.CUDA_DEVICE_MEMORY_LIMIT_1"] == "2000m"
    assert data["a.CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1000M,1=2000M"
    assert data["b.CUDA_DEVICE_SM_LIMIT"] == "10"
    assert "b.CUDA_DEVICE_MEMORY_LIMIT" not in data


@pytest.mark.parametrize(("count", "memory"), [(1, False), (1, True), (3, True), (2, False)])
def test_the_keys_written_are_the_keys_referenced(count: int, memory: bool) -> None:
    made = MakeAllocation("ns/p", "n")
    for i in range(count):
        made.grant(i, 200, 512 if memory else 0, limit=400)
    uuids = {i: f"GPU-{i}" for i in range(count)}
    written = set(handoff.data(made.obj(), uuids, handoff.Enforcement(hami_core=True)))
    mps = set(handoff.data(made.obj(), uuids, handoff.EVERY_LIMIT)) - written
    variables = handoff.variables(count, memory, preload=True)
    references = [handoff.reference("cm", "main", v) for v in variables]
    read = {r["valueFrom"]["configMapKeyRef"]["key"] for r in references}
    assert written | mps == read, "every key written is read; with every limit, every key read is written"
    for ref in references:
        env = wire.convert(ref, wire.EnvVar)
        assert handoff.is_reference(env, "cm", "main")
        assert not handoff.is_reference(env, "other", "main")
        assert ref["valueFrom"]["configMapKeyRef"]["optional"] is (env.name != handoff.VISIBLE_DEVICES)


@pytest.mark.parametrize(
    ("author", "value", "renamed", "noted"),
    [
        (None, "$(SHAREGPU_PRELOAD)", None, None),
        ({"name": "LD_PRELOAD", "value": "/lib/libjemalloc.so"}, "$(SHAREGPU_PRELOAD) /lib/libjemalloc.so", None,
         "/lib/libjemalloc.so"),
        ({"name": "LD_PRELOAD", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
         "$(SHAREGPU_PRELOAD) $(SHAREGPU_AUTHOR_LD_PRELOAD)", {"secretKeyRef": {"name": "s", "key": "k"}},
         "valueFrom (now SHAREGPU_AUTHOR_LD_PRELOAD)"),
    ],
)  # fmt: skip
def test_preload_comes_first_after_the_references_it_reads(
    author: dict[str, object] | None, value: str, renamed: object, noted: str | None
) -> None:
    env: list[dict[str, object]] = [author] if author is not None else []
    container: dict[str, object] = {"name": "main", "env": [*env, handoff.reference("cm", "main", handoff.PRELOAD)]}
    assert handoff.preload_wiring(container) == noted
    names = [e["name"] for e in container["env"]]  # type: ignore[attr-defined]
    assert names[-1] == "LD_PRELOAD" and names.index(handoff.PRELOAD) < names.index("LD_PRELOAD")
    assert container["env"][-1]["value"] == value  # type: ignore[index]
    moved = [e for e in container["env"] if e["name"] == handoff.AUTHOR_PRELOAD]  # type: ignore[attr-defined]
    assert [e["valueFrom"] for e in moved] == ([renamed] if renamed is not None else [])
    assert container["volumeMounts"] == [
        {"name": handoff.HAMI_VOLUME, "mountPath": handoff.HAMI_MOUNT, "readOnly": True}
    ]
    once = repr(container)
    assert handoff.preload_wiring(container) is None
    assert repr(container) == once, "wired again (a webhook invoked twice): the same container"
