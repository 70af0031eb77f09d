"""`api.access.Reviewer` against the API server: a TokenReview says whose a bearer token is, a
SubjectAccessReview whether that user may `get` a non-resource URL (RBAC's `nonResourceURLs`). The
account that asks needs `create` on both (the ClusterRole system:auth-delegator, which the chart
binds to each component's account)."""

from __future__ import annotations

from sharegpu.api import access
from sharegpu.kube import client


class ApiReviewer:
    def __init__(self, api: client.KubeApi) -> None:
        self.api = api

    async def authenticate(self, token: str) -> access.Caller | None:
        return access.caller_of(await self.api.create(access.TOKEN_REVIEWS, access.token_review(token)))

    async def authorize(self, caller: access.Caller, path: str, verb: str) -> bool:
        return access.allowed(await self.api.create(access.ACCESS_REVIEWS, access.access_review(caller, path, verb)))
