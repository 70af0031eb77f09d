"""AdmissionReview (admission.k8s.io/v1) as typed messages, and the answers sharegpu gives.

The reviewed object stays a plain dict: the mutating webhook answers with a JSON patch computed
against it. Reading it goes through `wire.convert`, so a mistyped pod is refused with the path to the
field that is wrong.
"""

from __future__ import annotations

import base64
from typing import Any, Final

import msgspec
import orjson

from sharegpu.api import wire

API_VERSION: Final = "admission.k8s.io/v1"


class UserInfo(wire.Message, kw_only=True, frozen=True):
    username: str = ""
    groups: tuple[str, ...] = ()


class Request(wire.Message, kw_only=True, frozen=True):
    uid: str
    operation: str = ""
    namespace: str = ""
    name: str = ""
    user_info: UserInfo = msgspec.field(default_factory=UserInfo)
    object: dict[str, Any] | None = None
    old_object: dict[str, Any] | None = None
    dry_run: bool = False


class Review(wire.Message, kw_only=True, frozen=True):
    api_version: str = ""
    kind: str = ""
    request: Request


class Status(wire.Message, kw_only=True, frozen=True):
    code: int
    message: str
    reason: str = ""


class Response(wire.Message, kw_only=True, frozen=True):
    uid: str
    allowed: bool
    status: Status | None = None
    patch_type: str | None = None
    patch: str | None = None
    audit_annotations: dict[str, str] | None = None
    warnings: list[str] | None = None


class ReviewResponse(wire.Message, kw_only=True, frozen=True, omit_defaults=False):
    response: Response
    api_version: str = API_VERSION
    kind: str = "AdmissionReview"


def review(body: Any) -> Review:
    """A review from a parsed body; InvalidInputError saying what is missing or mistyped."""
    return wire.convert(body, Review)


def allow(uid: str, patch: list[dict[str, Any]] | None = None, audit: dict[str, str] | None = None) -> ReviewResponse:
    response = Response(uid=uid, allowed=True, audit_annotations=audit or None)
    if patch:
        encoded = base64.b64encode(orjson.dumps(patch)).decode()
        response = Response(
            uid=uid, allowed=True, patch_type="JSONPatch", patch=encoded, audit_annotations=audit or None
        )
    return ReviewResponse(response=response)


def deny(uid: str, message: str, code: int = 403) -> ReviewResponse:
    reason = {400: "BadRequest", 403: "Forbidden", 500: "InternalError"}.get(code, "Invalid")
    return ReviewResponse(
        response=Response(uid=uid, allowed=False, status=Status(code=code, message=message, reason=reason))
    )


def encode(answer: ReviewResponse) -> bytes:
    return msgspec.json.encode(answer)
