"""`kube.reviews.ApiReviewer` on the real API server, held against its shipped fake
(`serving.access.StaticReviewer`) configured as the cluster is: whose each token is, and who may get
/metrics and /debug (the chart's ClusterRoles sharegpu-metrics-reader and sharegpu-debugger), asked
as the extender's own account (system:auth-delegator)."""

from __future__ import annotations

import uuid

from sharegpu.api import names
from sharegpu.api.access import Caller
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client, reviews
from sharegpu.serving import access
from tests.integration.conftest import wait_for

RBAC = "/apis/rbac.authorization.k8s.io/v1"


async def test_the_api_reviewer_answers_as_its_fake_is_told_the_cluster_does(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, system: None
) -> None:
    binding = f"metrics-alice-{uuid.uuid4().hex[:6]}"
    await admin.create(f"{RBAC}/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": binding},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "sharegpu-metrics-reader"},
        "subjects": [{"kind": "User", "name": "alice", "apiGroup": "rbac.authorization.k8s.io"}],
    })  # fmt: skip
    asking = stack.kube_for(control_plane, names.account("extender"))
    real = reviews.ApiReviewer(asking)
    alice, bob = (
        Caller("alice", ("tenants", "system:authenticated")),
        Caller("bob", ("tenants", "system:authenticated")),
    )
    fake = access.StaticReviewer(tokens={"alice-token": alice, "bob-token": bob},
                                 allowed=frozenset({("alice", "/metrics")}))  # fmt: skip
    try:
        for token in ("alice-token", "bob-token", "forged"):
            assert await real.authenticate(token) == await fake.authenticate(token), token

        async def granted() -> bool:
            return await real.authorize(alice, "/metrics", "get")

        await wait_for(granted, what="alice's ClusterRoleBinding")
        for caller in (alice, bob):
            for path in ("/metrics", "/debug/nodes"):
                asked = (caller, path, "get")
                assert await real.authorize(*asked) == await fake.authorize(*asked), asked
        admin_caller = await real.authenticate(control_plane.token("admin"))
        assert admin_caller is not None and "system:masters" in admin_caller.groups
        assert await real.authorize(admin_caller, "/debug/nodes", "get"), "the cluster's admins may read it all"
    finally:
        await asking.close()
        await admin.delete(f"{RBAC}/clusterrolebindings/{binding}")
