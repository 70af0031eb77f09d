"""API errors as sharegpu exceptions, decided in one place from the status code.

    KubeError                       anything that went wrong talking to the API server
    ├── ApiError                    the server answered with an error status (status, reason, message)
    │   ├── InvalidError            400, 422: the request or object is malformed (admission refusals too)
    │   ├── UnauthorizedError       401: the credentials were refused, even after re-reading them
    │   ├── ForbiddenError          403: RBAC says no
    │   ├── NotFoundError           404
    │   ├── ConflictError           409: changed under us, or `already_exists`
    │   ├── GoneError               410: a watch's resourceVersion is too old; list again
    │   └── BusyError               429 and 5xx: also a TemporaryError
    └── TemporaryError              worth retrying, after `retry_after` seconds when the server said so
        ├── BusyError
        └── TransportError          no usable answer: refused or reset connection, timeout, cut stream
            └── UndecodableError    an answer came, but holds an object sharegpu cannot read

Callers catch the class they can act on (`ConflictError`, `TemporaryError`); nothing matches
message text. The original aiohttp or OS error stays attached as the cause. An undecodable answer (a
custom resource with a field of the wrong type) is a `TransportError` too, so what retries a lost
answer retries it (an informer lists again, and logs why); a command says what it is instead.

A write that raised did not necessarily fail: `outcome` says what is known of it. The server
refused it (any 4xx: it answered with a Status, 429 included, since throttling answers before the
handler runs), or it never left this process (the connection could not be made): REFUSED, nothing
changed. The connection was lost after the request went out, the answer timed out, or anything on
the way answered 5xx: UNKNOWN, the write may have been applied, and only a later read can say.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping

import msgspec

from sharegpu.api import wire
from sharegpu.core import errors


class KubeError(errors.SharegpuError):
    """Talking to the API server failed."""


class TemporaryError(KubeError):
    """Worth retrying. `retry_after`: seconds the server asked us to wait (None: not said)."""

    retry_after: float | None = None


class ApiError(KubeError):
    """The API server answered with an error status."""

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        method: str = "",
        path: str = "",
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.method = method
        self.path = path
        self.retry_after = retry_after
        super().__init__(f"{method} {path}: {status} {reason}: {message}".strip())


class InvalidError(ApiError):
    """400/422: the API server refused the request or object as malformed."""


class UnauthorizedError(ApiError):
    """401: the credentials were refused (after they were re-read once)."""


class ForbiddenError(ApiError):
    """403: not allowed by RBAC (or by an admission webhook)."""


class NotFoundError(ApiError):
    pass


class ConflictError(ApiError):
    """409: the object changed under us (resourceVersion or precondition), or already exists."""

    @property
    def already_exists(self) -> bool:
        return self.reason == "AlreadyExists"


class GoneError(ApiError):
    """410: a watch's resource version is too old; list again."""


class BusyError(ApiError, TemporaryError):
    """429 (throttled) or 5xx (server error): retry, after `retry_after` when given."""


class TransportError(TemporaryError):
    """No usable answer: the connection was refused, reset or cut, or it timed out.

    `sent`: the request may have reached the server (False only when the connection was never
    made, so the server cannot have seen it)."""

    def __init__(self, message: str, *, sent: bool = True) -> None:
        super().__init__(message)
        self.retry_after = None
        self.sent = sent


class UndecodableError(TransportError):
    """The answer to `path` came, but holds something sharegpu cannot read as the type it expects
    (a custom resource edited by hand: `spec.gpuHours: lots`). `culprit`: the object, "Kind
    namespace/name", where the answer says which ("" if not); `detail`: what is wrong, and where."""

    def __init__(self, method: str, path: str, detail: str, culprit: str = "") -> None:
        super().__init__(f"{method} {path}: undecodable answer: {f'{culprit}: ' if culprit else ''}{detail}")
        self.path = path
        self.detail = detail
        self.culprit = culprit


class Outcome(enum.Enum):
    """What a write did, as far as its answer tells."""

    DONE = "done"
    REFUSED = "refused"
    """Not applied: the server said no, or never saw the request."""
    UNKNOWN = "unknown"
    """Maybe applied: the answer was lost or came from something on the way (5xx)."""


def outcome(exc: BaseException) -> Outcome:
    """What a write that raised `exc` did (see the module docstring). Anything that is not a known
    refusal is UNKNOWN: a cancelled or crashed caller may have sent the request already."""
    if isinstance(exc, TransportError):
        return Outcome.UNKNOWN if exc.sent else Outcome.REFUSED
    if isinstance(exc, ApiError):
        return Outcome.UNKNOWN if exc.status >= 500 else Outcome.REFUSED
    return Outcome.UNKNOWN


_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidError,
    401: UnauthorizedError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    422: InvalidError,
    429: BusyError,
}


def _retry_after(headers: Mapping[str, str], details: int) -> float | None:
    seconds: float | None = float(details) if details > 0 else None
    header = headers.get("Retry-After") or headers.get("retry-after")
    if header:
        with contextlib.suppress(ValueError):  # an HTTP date: rare from the API server; own backoff applies
            seconds = max(seconds or 0.0, float(header))
    return seconds


def from_status(status: int, body: bytes, method: str, path: str, headers: Mapping[str, str] | None = None) -> ApiError:
    """The exception for an error answer (its Status body decoded when there is one)."""
    reason, message, details = "", body.decode(errors="replace")[:500], 0
    try:
        parsed = msgspec.json.decode(body, type=wire.Status)
        reason, message, details = parsed.reason, parsed.message or message, parsed.details.retry_after_seconds
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    kind = _BY_STATUS.get(status, BusyError if status >= 500 else ApiError)
    return kind(status, reason, message, method, path, _retry_after(headers or {}, details))


def from_watch_status(status: wire.Status, path: str) -> ApiError:
    """The exception for a watch ERROR event (410 when the resource version expired)."""
    kind = _BY_STATUS.get(status.code, BusyError if status.code >= 500 else ApiError)
    retry = float(status.details.retry_after_seconds) if status.details.retry_after_seconds > 0 else None
    return kind(status.code or 500, status.reason, status.message, "WATCH", path, retry)
