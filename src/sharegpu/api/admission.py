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


POD_NAME: Final = "authentication.kubernetes.io/pod-name"
"""UserInfo extra of a service-account token bound to a pod (TokenRequest; projected tokens)."""
NODE_NAME: Final = "authentication.kubernetes.io/node-name"
"""UserInfo extra naming the bound pod's node (Kubernetes 1.30 and later)."""
SERVICE_ACCOUNT_PREFIX: Final = "system:serviceaccount:"


class UserInfo(wire.Message, kw_only=True, frozen=True):
    username: str = ""
    groups: tuple[str, ...] = ()
    extra: dict[str, list[str]] = msgspec.field(default_factory=dict)

    def one(self, key: str) -> str | None:
        """An extra's single value (None when absent or not single)."""
        values = self.extra.get(key) or []
        return values[0] if len(values) == 1 else None

    def bound_pod(self) -> tuple[str, str] | None:
        """(namespace, name) of the pod a service-account token is bound to; None for other tokens."""
        pod = self.one(POD_NAME)
        if pod is None or not self.username.startswith(SERVICE_ACCOUNT_PREFIX):
            return None
        namespace = self.username.removeprefix(SERVICE_ACCOUNT_PREFIX).split(":", 1)[0]
        return namespace, pod


class Request(wire.Message, kw_only=True, frozen=True):
    uid: str
    operation: str = ""
    sub_resource: str = ""
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


def allow(
    uid: str,
    patch: list[dict[str, Any]] | None = None,
    audit: dict[str, str] | None = None,
    warnings: list[str] | None = None,
) -> ReviewResponse:
    encoded = base64.b64encode(orjson.dumps(patch)).decode() if patch else None
    response = Response(
        uid=uid,
        allowed=True,
        patch_type="JSONPatch" if encoded else None,
        patch=encoded,
        audit_annotations=audit or None,
        warnings=warnings or None,
    )
    return ReviewResponse(response=response)


def deny(uid: str, message: str, code: int = 403) -> ReviewResponse:
    reason = {400: "BadRequest", 403: "Forbidden", 500: "InternalError"}.get(code, "Invalid")
    return ReviewResponse(
        response=Response(uid=uid, allowed=False, status=Status(code=code, message=message, reason=reason))
    )


def encode(answer: ReviewResponse) -> bytes:
    return msgspec.json.encode(answer)
