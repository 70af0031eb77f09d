"""The package's public surface is deliberate: changing it must change this test (as httpx does)."""

from __future__ import annotations

import types

import sharegpu

EXPECTED = [
    "InvalidInputError",
    "InvalidInventoryError",
    "InvalidRequestError",
    "InvalidTraceError",
    "SharegpuError",
    "UnknownPolicyError",
    "__version__",
]


def test_exported_members() -> None:
    assert sorted(sharegpu.__all__) == EXPECTED
    public = [
        name
        for name in dir(sharegpu)
        if not name.startswith("_") and not isinstance(getattr(sharegpu, name), types.ModuleType)
    ]
    assert sorted(public) == [n for n in EXPECTED if not n.startswith("_")], "every public name is exported"


def test_every_error_is_a_sharegpu_error() -> None:
    for name in sharegpu.__all__:
        member = getattr(sharegpu, name)
        if isinstance(member, type):
            assert issubclass(member, sharegpu.SharegpuError)
