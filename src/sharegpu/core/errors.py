"""The one exception tree of sharegpu.

Exceptions are for faults: bad input, broken invariants, unreachable services. A pod that does not
fit is not a fault; placement answers it with a `status.Status` value instead.

    SharegpuError
    ├── InvalidInputError          a value from outside (CLI, trace, manifest) is malformed
    │   ├── InvalidRequestError    a GPU request that can never be valid
    │   ├── InvalidInventoryError  a node or device description that is inconsistent
    │   └── InvalidTraceError      a workload file that cannot be read
    └── UnknownPolicyError         a placement policy name nobody registered

Components translate third-party errors (API client, HTTP) into this tree at their boundary.
"""

from __future__ import annotations


class SharegpuError(Exception):
    """Root of every error sharegpu raises on purpose."""


class InvalidInputError(SharegpuError, ValueError):
    """A value that came from outside is malformed; the message names what and why."""


class InvalidRequestError(InvalidInputError):
    """A GPU request that no cluster could ever satisfy as written."""


class InvalidInventoryError(InvalidInputError):
    """A node or GPU inventory that contradicts itself."""


class InvalidTraceError(InvalidInputError):
    """A workload or cluster file that cannot be parsed."""


class UnknownPolicyError(SharegpuError, KeyError):
    """A placement policy name that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain sentence.
        return str(self.args[0]) if self.args else "unknown policy"


def first_line(exc: BaseException) -> str:
    """What a one-line error report shows of `exc`: the first line of its message, or the name of its
    type when it has no message (the command lines' `...: error: ...`)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
