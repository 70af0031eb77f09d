"""API errors translated into sharegpu's exception tree (see core.errors), in one place.

Permanent errors (bad request, forbidden, not found, conflict) are distinct from temporary ones
(timeouts, 429, 5xx, broken connections), which callers may retry.
"""

from __future__ import annotations

from sharegpu.core import errors


class ApiError(errors.SharegpuError):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str, method: str = "", path: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{method} {path}: {status} {reason}: {message}".strip())


class NotFoundError(ApiError):
    pass


class ConflictError(ApiError):
    """409: the object changed under us, or already exists (reason AlreadyExists)."""


class ForbiddenError(ApiError):
    pass


class InvalidError(ApiError):
    """400/422: the API server refused the object as malformed (admission refusals land here too)."""


class GoneError(ApiError):
    """410: a watch's resource version is too old; list again."""


class TemporaryError(errors.SharegpuError):
    """Worth retrying: timeouts, throttling, server errors, broken connections."""


def from_status(status: int, reason: str, message: str, method: str = "", path: str = "") -> errors.SharegpuError:
    kinds: dict[int, type[ApiError]] = {
        400: InvalidError,
        403: ForbiddenError,
        404: NotFoundError,
        409: ConflictError,
        410: GoneError,
        422: InvalidError,
    }
    if status == 429 or status >= 500:
        return TemporaryError(f"{method} {path}: {status} {reason}: {message}")
    return kinds.get(status, ApiError)(status, reason, message, method, path)
