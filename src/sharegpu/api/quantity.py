"""Kubernetes quantities ("500m", "2Gi", "1.5e3") as exact numbers, and integers in a range.

Every reader of a resource value or a numeric annotation goes through here, so "1.5" is refused
as a GPU count the same way in the webhook, the extender and the simulator's manifests.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Decimal, InvalidOperation

from sharegpu.core import errors

_SUFFIXES: dict[str, Decimal] = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
    "P": Decimal(10**15), "E": Decimal(10**18),
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
MEBIBYTE = 2**20


def parse(value: object) -> Decimal:
    """A quantity as an exact decimal; InvalidInputError for anything that is not one."""
    if isinstance(value, str) and len(value) <= 64:
        return _parse_text(value)  # a cluster uses few distinct quantities: each is parsed once
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _checked(Decimal(str(value)), value)
    return _parse_text(value if isinstance(value, str) else repr(value))


@functools.lru_cache(maxsize=4096)
def _parse_text(text: str) -> Decimal:
    match = _QUANTITY.match(text.strip())
    if not match:
        raise errors.InvalidInputError(f"{text[:40]!r} is not a Kubernetes quantity")
    try:
        number = Decimal(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    except InvalidOperation:
        raise errors.InvalidInputError(f"{text[:40]!r} is not a Kubernetes quantity") from None
    return _checked(number, text)


def _checked(number: Decimal, value: object) -> Decimal:
    if not number.is_finite() or number.adjusted() > 30:
        raise errors.InvalidInputError(f"{str(value)[:40]!r} is too large a quantity")
    return number


def number(value: object, what: str) -> Decimal:
    """`parse`, with a message naming the field (InvalidRequestError)."""
    try:
        return parse(value)
    except errors.InvalidInputError as exc:
        raise errors.InvalidRequestError(f"{what} must be a number: {exc}") from None


def integer(value: object, what: str, low: int, high: int) -> int:
    """A whole number in low..high; InvalidRequestError naming `what` otherwise."""
    parsed = number(value, what)
    if parsed != parsed.to_integral_value() or not low <= parsed <= high:
        raise errors.InvalidRequestError(f"{what} must be an integer in {low}..{high}, got {value!r}")
    return int(parsed)


def milli_cpu(value: object) -> int:
    """CPU in milli-cores (rounded up, as kube-scheduler does)."""
    return math.ceil(parse(value) * 1000)


def mebibytes(value: object) -> int:
    """Bytes as MiB (rounded up)."""
    return math.ceil(parse(value) / MEBIBYTE)
