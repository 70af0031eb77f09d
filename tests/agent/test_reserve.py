from __future__ import annotations

import pytest

from sharegpu.agent import reserve
from sharegpu.core import errors


def test_one_gpu_uuid_is_reported() -> None:
    assert reserve.visible_gpu({"NVIDIA_VISIBLE_DEVICES": " GPU-3f2a-11 "}) == "GPU-3f2a-11"
    assert reserve.visible_gpu({"NVIDIA_VISIBLE_DEVICES": "MIG-GPU-1/2/0"}) == "MIG-GPU-1/2/0"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "is not set"),
        ("all", "not a GPU UUID"),
        ("GPU-a,GPU-b", "names several GPUs"),
        ("0", "not a GPU UUID"),
    ],
)
def test_anything_but_one_uuid_is_refused(value: str, message: str) -> None:
    with pytest.raises(errors.InvalidInputError, match=message):
        reserve.visible_gpu({"NVIDIA_VISIBLE_DEVICES": value})
