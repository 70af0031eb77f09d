"""Delegated authentication and authorisation, as words of the API: who a caller is (`Caller`), the
narrow protocol to ask the API server (`Reviewer`: a TokenReview, a SubjectAccessReview on a
non-resource URL), and the bodies of both reviews and how their answers read. The gate that uses it
is `serving.access`; the reviewer against the API server `kube.reviews`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol

TOKEN_REVIEWS: Final = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS: Final = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


@dataclass(frozen=True, slots=True)
class Caller:
    user: str
    groups: tuple[str, ...] = ()


class Reviewer(Protocol):
    async def authenticate(self, token: str) -> Caller | None:
        """Whose token it is; None for a token the API server does not accept."""
        ...

    async def authorize(self, caller: Caller, path: str, verb: str) -> bool:
        """Whether `caller` may `verb` the non-resource URL `path`."""
        ...


def token_review(token: str) -> dict[str, Any]:
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}


def caller_of(answer: dict[str, Any]) -> Caller | None:
    """The caller a TokenReview's answer names; None when the token was not accepted."""
    status = answer.get("status") or {}
    if not status.get("authenticated"):
        return None
    user = status.get("user") or {}
    return Caller(str(user.get("username", "")), tuple(user.get("groups") or ()))


def access_review(caller: Caller, path: str, verb: str) -> dict[str, Any]:
    asked = {"path": path, "verb": verb}
    spec = {"user": caller.user, "groups": list(caller.groups), "nonResourceAttributes": asked}
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}


def allowed(answer: dict[str, Any]) -> bool:
    return bool((answer.get("status") or {}).get("allowed"))
