from __future__ import annotations

import pytest

from sharegpu.core import devices, errors, requests, units


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "GPU count must be an integer >= 1"),
        ({"milli": 0}, "compute share must be 1..1000"),
        ({"milli": 1001}, "compute share must be 1..1000"),
        ({"milli": 500, "limit_milli": 400}, "request (500) <= limit <= 1000"),
        ({"milli": 500, "limit_milli": 1200}, "request (500) <= limit <= 1000"),
        ({"milli": 500, "memory_mib": -1}, "GPU memory must be >= 0"),
        ({"milli": 500, "memory_mib": 10, "memory_permille": 10}, "either in MiB or as a ratio"),
        ({"milli": 1000, "memory_mib": 10}, "whole-GPU request gets all"),
        ({"count": 64}, "exceeds the most GPUs"),
        ({"milli": 500, "memory_permille": 1001}, "ratio must be 0..1000"),
    ],
)
def test_malformed_gpu_requests_are_refused_with_a_message(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(errors.InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        requests.GpuRequest(**kwargs)  # type: ignore[arg-type]


def test_limit_defaults_to_request() -> None:
    assert requests.GpuRequest(milli=300).limit == 300
    assert requests.GpuRequest(milli=300, limit_milli=800).limit == 800


def _pod(*containers: requests.ContainerRequest) -> requests.PodRequest:
    return requests.PodRequest(key=units.PodKey("ns/p"), containers=containers)


def test_fractional_app_containers_share_one_gpu_and_add_up() -> None:
    demand = _pod(
        requests.ContainerRequest("a", requests.GpuRequest(milli=300, memory_mib=1000)),
        requests.ContainerRequest("b", requests.GpuRequest(milli=200, memory_mib=500)),
    ).demand
    assert (demand.count, demand.milli, demand.memory_mib) == (1, 500, 1500)
    assert demand.sharing


def test_init_container_needs_only_the_larger_of_itself_and_the_app_sum() -> None:
    demand = _pod(
        requests.ContainerRequest("init", requests.GpuRequest(milli=700), init=True),
        requests.ContainerRequest("a", requests.GpuRequest(milli=300)),
        requests.ContainerRequest("b", requests.GpuRequest(milli=200)),
    ).demand
    assert demand.milli == 700


def test_whole_gpu_containers_add_their_counts() -> None:
    demand = _pod(
        requests.ContainerRequest("init", requests.GpuRequest(count=1), init=True),
        requests.ContainerRequest("a", requests.GpuRequest(count=2)),
        requests.ContainerRequest("b", requests.GpuRequest(count=1)),
    ).demand
    assert (demand.count, demand.whole) == (3, True)


def test_an_init_container_runs_beside_the_sidecars_declared_before_it() -> None:
    """A native sidecar (300 milli, 8192 MiB) keeps running while the init container after it (600,
    10240) runs, then beside the app container (400, 4096): 900 and 18432 at once at most (the init
    container alone counted 700 and 12288)."""
    share = requests.GpuRequest
    containers = (
        requests.ContainerRequest("sidecar", share(milli=300, memory_mib=8192)),  # sidecars are not `init`
        requests.ContainerRequest("setup", share(milli=600, memory_mib=10240), init=True),
        requests.ContainerRequest("main", share(milli=400, memory_mib=4096)),
    )
    demand = _pod(*containers).demand
    assert (demand.milli, demand.memory_mib) == (900, 18432)
    assert requests.peak([(True, 600), (False, 500), (True, 700), (False, 400)]) == 1200
    assert requests.peak([(True, 700), (False, 200)]) == 700


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        (
            (
                requests.ContainerRequest("a", requests.GpuRequest(count=1)),
                requests.ContainerRequest("b", requests.GpuRequest(milli=500)),
            ),
            "mixing whole-GPU and fractional-GPU",
        ),
        (
            (
                requests.ContainerRequest("a", requests.GpuRequest(milli=600)),
                requests.ContainerRequest("b", requests.GpuRequest(milli=600)),
            ),
            "ask for 1200 milli-GPU in total",
        ),
        (  # all of one GPU from two shares: was taken for a whole GPU, its memory and group unchecked
            (
                requests.ContainerRequest("a", requests.GpuRequest(milli=500, memory_mib=10000)),
                requests.ContainerRequest("b", requests.GpuRequest(milli=500, memory_mib=10000)),
            ),
            "ask for 1000 milli-GPU in total",
        ),
        (
            (
                requests.ContainerRequest("a", requests.GpuRequest(milli=600, models=frozenset({"T4"}))),
                requests.ContainerRequest("b", requests.GpuRequest(milli=100, models=frozenset({"A100"}))),
            ),
            "no GPU model in common",
        ),
        (
            (
                requests.ContainerRequest("a", requests.GpuRequest(milli=100)),
                requests.ContainerRequest("a", requests.GpuRequest(milli=100)),
            ),
            "container names are not unique",
        ),
    ],
)
def test_contradictory_pods_are_refused(containers: tuple[requests.ContainerRequest, ...], message: str) -> None:
    with pytest.raises(errors.InvalidRequestError, match=message):
        _pod(*containers)


def test_pod_without_gpu_has_empty_demand() -> None:
    demand = requests.simple_pod("ns/cpu", cpu_milli=2000).demand
    assert demand.count == 0 and demand.gpu_milli_total == 0 and demand.cpu_milli == 2000


def test_cotenancy_labels_are_checked() -> None:
    with pytest.raises(errors.InvalidRequestError, match="co-tenancy affinity label"):
        requests.CoTenancy(affinity="")
    assert requests.CoTenancy().empty
    assert not requests.CoTenancy(exclusion="x").empty


def test_an_isolation_demand_needs_a_shared_gpu_and_mps_one_gpu_per_container() -> None:
    mps = devices.Isolation.MPS

    def make(gpu: requests.GpuRequest | None, isolation: devices.Isolation) -> requests.PodRequest:
        return requests.PodRequest(units.PodKey("ns/p"), (requests.ContainerRequest("main", gpu),), isolation=isolation)

    assert make(requests.GpuRequest(count=1, milli=300), mps).demand.isolation is mps
    with pytest.raises(errors.InvalidRequestError, match="demands isolation mps but asks for no GPU"):
        make(None, mps)
    with pytest.raises(errors.InvalidRequestError, match="a pod of whole GPUs shares none"):
        make(requests.GpuRequest(count=1), devices.Isolation.HAMI_CORE)
    with pytest.raises(errors.InvalidRequestError, match="a process reaches only one"):
        make(requests.GpuRequest(count=2, milli=300), mps)
    assert make(requests.GpuRequest(count=2, milli=300), devices.Isolation.HAMI_CORE).demand.count == 2


def test_a_compute_guarantee_needs_an_isolation_mode() -> None:
    gpu = (requests.ContainerRequest("main", requests.GpuRequest(count=1, milli=300)),)
    key = units.PodKey("ns/p")
    guaranteed = requests.PodRequest(key, gpu, isolation=devices.Isolation.MPS, compute=True)
    assert guaranteed.demand.compute and guaranteed.demand.isolation is devices.Isolation.MPS
    with pytest.raises(errors.InvalidRequestError, match="a compute guarantee needs an isolation mode that enforces"):
        requests.PodRequest(key, gpu, compute=True)
