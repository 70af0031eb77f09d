"""The package's public surface is deliberate: changing it must change this test."""

from __future__ import annotations

import sharegpu


def test_exported_members() -> None:
    assert sorted(sharegpu.__all__) == [
        "InvalidInputError",
        "InvalidInventoryError",
        "InvalidRequestError",
        "InvalidTraceError",
        "SharegpuError",
        "UnknownPolicyError",
        "__version__",
    ]
    for name in sharegpu.__all__:
        assert hasattr(sharegpu, name)


def test_every_error_is_a_sharegpu_error() -> None:
    for name in sharegpu.__all__:
        member = getattr(sharegpu, name)
        if isinstance(member, type):
            assert issubclass(member, sharegpu.SharegpuError)
