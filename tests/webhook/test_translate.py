"""Every request format the webhook accepts, translated into the canonical form (docs/admission.md)."""

from __future__ import annotations

from typing import Any

import pytest

from sharegpu.api import handoff, names, pods, wire
from sharegpu.core import allocation, errors, units
from sharegpu.webhook import translate
from tests.webhook.conftest import ROWS

Json = dict[str, Any]


def pod(limits: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> Json:
    return {
        "metadata": {"name": "p", "namespace": "ns", "annotations": dict(annotations or {})},
        "spec": {"containers": [{"name": "main", "resources": {"limits": dict(limits or {})}}]},
    }


def gpu_limits(out: Json) -> dict[str, str]:
    limits = out["spec"]["containers"][0]["resources"]["limits"]
    return {k: v for k, v in limits.items() if "gpu" in k or "vcuda" in k}


@pytest.mark.parametrize(
    ("fmt", "limits", "annotations", "canonical", "canonical_annotations"), ROWS, ids=[r[0] for r in ROWS]
)
def test_formats_translate(
    fmt: str,
    limits: dict[str, str],
    annotations: dict[str, str],
    canonical: dict[str, str],
    canonical_annotations: dict[str, str],
) -> None:
    out, audit = translate.translate(pod(limits, annotations))
    assert gpu_limits(out) == canonical
    if audit:  # translated: requests carry the same canonical resources as limits
        requests = out["spec"]["containers"][0]["resources"]["requests"]
        assert {k: v for k, v in requests.items() if k in canonical} == canonical
    for key, value in canonical_annotations.items():
        assert out["metadata"]["annotations"][key] == value
    pods.request(wire.convert(out, wire.Pod))  # the result is a valid canonical request
    assert bool(audit) == (fmt not in ("sharegpu", "nvidia whole"))


@pytest.mark.parametrize(
    ("limits", "annotations", "message"),
    [
        ({"koordinator.sh/gpu-core": "150"}, {}, "above 100 must be a multiple of 100"),
        ({"koordinator.sh/gpu-core": "50", "tencent.com/vcuda-core": "50"}, {}, "mixes GPU request formats"),
        ({"tencent.com/vcuda-core": "abc"}, {}, "must be a number"),
        ({"nvidia.com/gpumem": "100", "nvidia.com/gpumem-percentage": "10"}, {}, "not both"),
        ({"aliyun.com/gpu-mem": "0"}, {}, "aliyun.com/gpu-mem \\(GiB\\) must be an integer in 1.."),
        ({}, {"kubeshare/gpu_request": "1.5"}, "must be in \\(0, 1\\]"),
        ({}, {"kubeshare/gpu_request": "0.6", "kubeshare/gpu_limit": "0.4"}, "must not be below"),
        ({names.GPU_MILLI: "300"}, {"kubeshare/gpu_request": "0.5"}, "use one format"),
        ({"koordinator.sh/gpu-core": "50", "nvidia.com/gpu": "1"}, {}, "cannot be combined"),
        ({"nvidia.com/gpu": "150"}, {}, "neither a GPU count .* nor whole GPUs in percent .* koordinator.sh/gpu"),
        ({}, {"gpu-fraction": "1.5"}, r"gpu-fraction must be in \(0, 1\]"),
        ({}, {"gpu-fraction": "0.5", "gpu-memory": "100"}, "give gpu-fraction or gpu-memory, not both"),
        ({"nvidia.com/gpu": "1"}, {"gpu-fraction": "0.5"}, "KAI's GPU annotations and GPU resources"),
        ({"volcano.sh/vgpu-cores": "120"}, {}, r"volcano.sh/vgpu-cores must be an integer in 0\.\.100"),
        ({"nvidia.com/gpu": "1"}, {"nvidia.com/use-gpuuuid": "GPU-1"}, "choosing GPUs by UUID.* is not supported"),
        ({"koordinator.sh/gpu.shared": "2", "koordinator.sh/gpu-core": "75"}, {}, "total over .* must divide"),
        ({"koordinator.sh/gpu.shared": "2", "koordinator.sh/gpu-core": "300"}, {}, r"integer in 1\.\.200"),
    ],
)
def test_malformed_requests_are_refused_with_a_message(
    limits: dict[str, str], annotations: dict[str, str], message: str
) -> None:
    with pytest.raises(errors.InvalidRequestError, match=message):
        translate.translate(pod(limits, annotations))


def test_translation_names_the_container_and_leaves_the_input_alone() -> None:
    original = pod({"koordinator.sh/gpu-core": "250"})
    with pytest.raises(errors.InvalidRequestError, match="container main: "):
        translate.translate(original)
    assert original["spec"]["containers"][0]["resources"]["limits"] == {"koordinator.sh/gpu-core": "250"}


@pytest.mark.parametrize(
    ("limits", "annotations"),
    [
        ({"aliyun.com/gpu-mem": "3"}, {}),
        ({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000"}, {}),
        ({}, {"kubeshare/gpu_mem": "2147483648"}),
    ],
)
def test_a_share_of_memory_alone_may_use_the_whole_gpus_compute(
    limits: dict[str, str], annotations: dict[str, str]
) -> None:
    """What those systems do: the guarantee is the smallest, and the hand-off's compute caps (HAMi-core
    and MPS) are the whole GPU, not 1%."""
    out, audit = translate.translate(pod(limits, annotations))
    request = pods.request(wire.convert(out, wire.Pod))
    gpu = request.containers[0].gpu
    assert gpu is not None and gpu.milli == 1 and gpu.limit == 1000
    alloc = allocation.build(request, units.NodeName("n"), (0,), [16384], [units.GpuUuid("GPU-0")])
    env = handoff.values(alloc.containers[0].devices, {0: "GPU-0"}, handoff.EVERY_LIMIT)
    assert env[handoff.SM_LIMIT] == "100" and env[handoff.MPS_THREADS] == "100"
    assert any(names.LIMIT_MILLI in line for line in audit)


def test_a_burst_limit_the_author_wrote_is_kept() -> None:
    out, _ = translate.translate(pod({"aliyun.com/gpu-mem": "3"}, {names.LIMIT_MILLI: "400"}))
    assert out["metadata"]["annotations"][names.LIMIT_MILLI] == "400"


def test_memory_alone_beside_a_stated_compute_share_is_refused_with_the_fix() -> None:
    body = pod({"aliyun.com/gpu-mem": "3"})
    body["spec"]["containers"].append(
        {"name": "side", "resources": {"limits": {"koordinator.sh/gpu-core": "30", "koordinator.sh/gpu-memory": "1Gi"}}}
    )
    with pytest.raises(errors.InvalidRequestError, match="container main asks for GPU memory only and container side"):
        translate.translate(body)


def test_kai_can_name_the_container_that_gets_the_gpu() -> None:
    body = pod({}, {"gpu-fraction": "0.5", "gpu-fraction-container-name": "worker"})
    body["spec"]["containers"].append({"name": "worker", "resources": {}})
    out, _ = translate.translate(body)
    assert names.GPU_MILLI not in out["spec"]["containers"][0]["resources"].get("limits", {})
    assert out["spec"]["containers"][1]["resources"]["limits"][names.GPU_MILLI] == "500"
    with pytest.raises(errors.InvalidRequestError, match="no container 'nope'"):
        translate.translate(pod({}, {"gpu-fraction": "0.5", "gpu-fraction-container-name": "nope"}))


def test_a_share_stated_in_both_kubeshare_and_kai_annotations_is_refused() -> None:
    both = {"kubeshare/gpu_request": "0.5", "gpu-fraction": "0.25"}
    with pytest.raises(errors.InvalidRequestError, match=r"KubeShare's annotations \(kubeshare/gpu_request\) and in "
                       r"KAI's \(gpu-fraction\): keep one"):  # fmt: skip
        translate.translate(pod({}, both))
    for one in ({"kubeshare/gpu_request": "0.5"}, {"gpu-fraction": "0.25"}):
        out, _ = translate.translate(pod({}, one))
        assert out["spec"]["containers"][0]["resources"]["limits"][names.GPU_MILLI] in ("500", "250")


MODELS = frozenset({"NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "Tesla T4", "NVIDIA H100 80GB HBM3"})


@pytest.mark.parametrize(
    ("annotations", "chosen"),
    [
        ({"nvidia.com/use-gputype": "a100"}, "NVIDIA A100-PCIE-40GB,NVIDIA A100-SXM4-80GB"),
        ({"nvidia.com/use-gputype": "A100,T4", "nvidia.com/nouse-gputype": "PCIE"},
         "NVIDIA A100-SXM4-80GB,Tesla T4"),
        ({"nvidia.com/nouse-gputype": "A100"}, "NVIDIA H100 80GB HBM3,Tesla T4"),
    ],
)  # fmt: skip
def test_hamis_model_selectors_become_the_clusters_model_names(annotations: dict[str, str], chosen: str) -> None:
    out, audit = translate.translate(pod({"nvidia.com/gpu": "1"}, annotations), MODELS)
    assert out["metadata"]["annotations"][names.MODELS] == chosen
    assert any(names.MODELS in line for line in audit)


def test_model_selectors_that_leave_no_model_or_come_before_the_inventory_are_refused() -> None:
    with pytest.raises(errors.InvalidRequestError, match="leaves no GPU model of the cluster"):
        translate.translate(pod({"nvidia.com/gpu": "1"}, {"nvidia.com/use-gputype": "V100"}), MODELS)
    with pytest.raises(errors.InvalidRequestError, match="not known yet"):
        translate.translate(pod({"nvidia.com/gpu": "1"}, {"nvidia.com/use-gputype": "A100"}))
