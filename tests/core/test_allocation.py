from __future__ import annotations

import pytest

from sharegpu.core import allocation, errors, requests, units


def _fractional_pod() -> requests.PodRequest:
    return requests.PodRequest(
        key=units.PodKey("ns/p"),
        containers=(
            requests.ContainerRequest("a", requests.GpuRequest(milli=300, limit_milli=600, memory_permille=250)),
            requests.ContainerRequest("b", requests.GpuRequest(milli=200, memory_permille=100)),
        ),
        cpu_milli=1000,
        memory_mib=2048,
        cotenancy=requests.CoTenancy(affinity="team-a", exclusion="x").scoped("ns"),  # as `api.pods` reads them
    )


def test_build_resolves_memory_ratios_against_the_gpu() -> None:
    alloc = allocation.build(_fractional_pod(), units.NodeName("n1"), [1], [16000, 8000], ["u0", "u1"])
    assert alloc.gpu_usage() == {1: (500, 2000 + 800)}
    grant = alloc.containers[0].devices[0]
    assert (grant.index, grant.milli, grant.limit_milli, grant.memory_mib, grant.uuid) == (1, 300, 600, 2000, "u1")
    assert not alloc.exclusive


def test_whole_gpus_are_split_between_containers_and_init_reuses_the_first() -> None:
    pod = requests.PodRequest(
        key=units.PodKey("ns/w"),
        containers=(
            requests.ContainerRequest("init", requests.GpuRequest(count=1), init=True),
            requests.ContainerRequest("a", requests.GpuRequest(count=2)),
            requests.ContainerRequest("b", requests.GpuRequest(count=1)),
        ),
    )
    alloc = allocation.build(pod, units.NodeName("n"), [4, 5, 7], [80000] * 8)
    assert [tuple(d.index for d in c.devices) for c in alloc.containers] == [(4,), (4, 5), (7,)]
    assert alloc.gpu_usage() == {4: (1000, 80000), 5: (1000, 80000), 7: (1000, 80000)}
    assert alloc.exclusive


def test_build_refuses_a_wrong_number_of_gpus() -> None:
    with pytest.raises(errors.InvalidRequestError, match="needs 1 GPU"):
        allocation.build(_fractional_pod(), units.NodeName("n"), [0, 1], [1, 1])


def test_json_round_trip_keeps_everything() -> None:
    alloc = allocation.build(_fractional_pod(), units.NodeName("n1"), [0], [16000], ["GPU-abc"])
    text = alloc.to_json()
    assert '"version":1' in text
    again = allocation.Allocation.from_json(text, pod=alloc.pod, cpu_milli=1000, memory_mib=2048)
    assert again == alloc
    # Written before labels were scoped by namespace: read as the pod's namespace's own.
    older = text.replace('"ns/team-a"', '"team-a"').replace('"ns/x"', '"x"')
    assert (
        older != text
        and allocation.Allocation.from_json(older, pod=alloc.pod, cpu_milli=1000, memory_mib=2048) == alloc
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "expected a JSON object"),
        ('{"version": 2}', "unsupported version 2"),
        ('{"version": 1, "node": 5, "containers": []}', "'node' must be a str"),
        ('{"version": 1, "node": "n", "containers": [{"name": "a", "devices": [{"index": -1}]}]}', "'index' must be"),
        (
            '{"version": 1, "node": "n", "containers": [{"name": "a", "devices": [{"index": 0, "milli": 5000}]}]}',
            "'milli' must be",
        ),
        ('{"version": 1, "node": "n", "containers": ["x"]}', "each container must be an object"),
    ],
)
def test_malformed_annotations_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(errors.InvalidInputError, match=message):
        allocation.Allocation.from_json(text, pod=units.PodKey("ns/p"))


def test_a_whole_gpu_init_container_beside_a_sidecar_gets_a_gpu_of_its_own() -> None:
    """A native sidecar holds GPU 0 while the init container declared after it runs: the init
    container was given GPU 0 too (two whole GPUs' worth on one), which the ledger refused every time."""
    pod = requests.PodRequest(
        key=units.PodKey("ns/p"),
        containers=(
            requests.ContainerRequest("sidecar", requests.GpuRequest(count=1)),
            requests.ContainerRequest("init", requests.GpuRequest(count=1), init=True),
            requests.ContainerRequest("app", requests.GpuRequest(count=1)),
        ),
    )
    assert pod.demand.count == 2
    made = allocation.build(pod, units.NodeName("n"), [0, 1], [16384, 16384])
    assert {c.name: [g.index for g in c.devices] for c in made.containers} == {"sidecar": [0], "init": [1], "app": [1]}
    assert all(milli <= units.MILLI_PER_GPU for milli, _ in made.gpu_usage().values())
