"""The ceiling each GPU's MPS daemon holds its clients to (`isolation.ceilings`): the largest grant of
a container that demands mps on that GPU, the whole GPU while there is none."""

from __future__ import annotations

from sharegpu.agent import isolation, mps
from sharegpu.api import names, wire
from sharegpu.core import allocation
from tests import builders

NODE = "n0"
MIB = 16384
DEVICE = wire.DeviceSpec(
    gpus=[wire.GpuSpec(index=i, uuid=f"GPU-{i}", model="NVIDIA A100", memory_mib=MIB) for i in range(2)]
)
MPS = {names.ISOLATION: "mps"}


def pod(name: str, alloc: allocation.Allocation, annotations: dict[str, str] | None = None) -> wire.Pod:
    made = builders.MakePod(name, "ns").uid(f"uid-{name}").annotations(annotations or {}).allocation(alloc)
    return made.node(NODE).container().wire()


def alloc(*grants: tuple[int, int, int, int], container: str = "main") -> allocation.Allocation:
    """(index, milli, memory MiB, limit milli) grants to `container`."""
    made = builders.MakeAllocation("ns/p", NODE).container(container)
    for index, milli, memory, limit in grants:
        made.grant(index, milli, memory, limit=limit, container=container)
    return made.obj()


def ceilings(*pods: wire.Pod) -> dict[str, mps.Ceiling]:
    return isolation.ceilings({p.metadata.uid: p for p in pods}, DEVICE)


def test_a_gpu_without_mps_tenants_is_not_limited() -> None:
    plain = pod("plain", alloc((0, 250, 2048, 250)))  # no mps demanded: the daemon is not its business
    assert ceilings(plain) == {"GPU-0": mps.Ceiling(100, MIB), "GPU-1": mps.Ceiling(100, MIB)}


def test_the_ceiling_is_the_largest_mps_grant_on_each_gpu() -> None:
    small = pod("small", alloc((0, 250, 2048, 250)), MPS)
    bursting = pod("bursting", alloc((0, 250, 4096, 600)), MPS)  # its burst limit is its compute ceiling
    other = pod("other", alloc((1, 500, 1024, 500)), MPS)
    assert ceilings(small) == {"GPU-0": mps.Ceiling(25, 2048), "GPU-1": mps.Ceiling(100, MIB)}
    assert ceilings(small, bursting, other) == {"GPU-0": mps.Ceiling(60, 4096), "GPU-1": mps.Ceiling(50, 1024)}


def test_a_grant_without_a_memory_limit_lifts_the_memory_ceiling() -> None:
    unlimited = pod("unlimited", alloc((0, 300, 0, 300)), MPS)
    assert ceilings(unlimited)["GPU-0"] == mps.Ceiling(30, MIB)


def test_a_pod_whose_allocation_cannot_be_read_sets_nothing() -> None:
    broken = builders.MakePod("broken", "ns").uid("uid-broken").annotations({**MPS, names.ALLOCATION: "{"})
    assert ceilings(broken.node(NODE).container().wire())["GPU-0"] == mps.Ceiling(100, MIB)
