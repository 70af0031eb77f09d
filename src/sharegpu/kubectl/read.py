"""The plugin's reads from the API: one paged list per resource, decoded into the typed messages the
components use, concurrently (the commands need a handful of lists and nothing else).

A resource the cluster does not serve (sharegpu's CRDs not installed) is a `Missing` error naming
the resource, not a 404 on a path; one this user may not list is a `Forbidden` error (the 403, with
the resource's name), which `optional` turns into a note for the views that can go on without it.
Everything else comes through as the client raised it
(`kube.errors`); the command turns it into one line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from sharegpu.api import budgets as api_budgets
from sharegpu.api import dra, idle, paths, resources, usage, wire
from sharegpu.api import groups as api_groups
from sharegpu.api import quotas as api_quotas
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors
from sharegpu.kubectl import views

T = TypeVar("T")
Json = dict[str, Any]


class Missing(kube_errors.KubeError):
    """The API server does not serve a resource the command needs."""


class Forbidden(kube_errors.ForbiddenError):
    """403 on a list: RBAC does not let this user list `what` (as the 403 it was, plus the name)."""

    def __init__(self, what: str, refused: kube_errors.ForbiddenError) -> None:
        super().__init__(refused.status, refused.reason, refused.message, refused.method, refused.path)
        self.what = what


async def _list(
    api: client.KubeApi, path: str, kind: type[T], what: str, params: Mapping[str, str] | None = None
) -> list[T]:
    try:
        items, _ = await api.list_of(path, kind, params)
    except kube_errors.NotFoundError:
        raise Missing(f"the API server does not serve {what} (is sharegpu installed in this cluster?)") from None
    except kube_errors.ForbiddenError as exc:
        raise Forbidden(what, exc) from None
    return items


async def cluster(api: client.KubeApi, node_selector: str = "", quotas: bool = True) -> views.Listing:
    """Nodes (those `node_selector` selects, if given), Devices, every pod, every ResourceClaim (none
    where resource.k8s.io/v1 is not served) and, with `quotas`, every ResourceQuota: what the
    extender's cache and quota guard are built from."""
    node_params = {"labelSelector": node_selector} if node_selector else None
    nodes, devices, pods, claims, quota_items = await asyncio.gather(
        _list(api, paths.NODES, wire.Node, "nodes", node_params),
        _list(api, paths.DEVICES, wire.Device, "Device resources (devices.sharegpu.io)"),
        _list(api, paths.PODS, wire.Pod, "pods"),
        _claims(api),
        _list(api, paths.RESOURCE_QUOTAS, api_quotas.ResourceQuota, "resourcequotas") if quotas else _none(),
    )
    if node_selector:  # the Devices of the nodes left out are no concern of this listing
        chosen = {n.metadata.name for n in nodes}
        devices = [d for d in devices if d.metadata.name in chosen]
    return views.Listing(tuple(nodes), tuple(devices), tuple(pods), tuple(quota_items), tuple(claims))


async def _claims(api: client.KubeApi) -> list[dra.ResourceClaim]:
    try:
        return await _list(api, dra.CLAIMS, dra.ResourceClaim, "resourceclaims")
    except Missing:
        return []  # before Kubernetes 1.34: no DRA path


async def _none() -> list[api_quotas.ResourceQuota]:
    return []


async def quotas(api: client.KubeApi) -> views.Listing:
    """Every pod and ResourceQuota: what the extender's quota guard counts (no inventory)."""
    pods, quota_items = await asyncio.gather(
        _list(api, paths.PODS, wire.Pod, "pods"),
        _list(api, paths.RESOURCE_QUOTAS, api_quotas.ResourceQuota, "resourcequotas"),
    )
    return views.Listing((), (), tuple(pods), tuple(quota_items))


async def pod(api: client.KubeApi, namespace: str, name: str) -> tuple[wire.Pod, dict[str, str]]:
    """The pod, and its nodeSelector (which the typed message does not keep); NotFoundError if absent."""
    body: Json = await api.get(paths.pod(namespace, name))
    selector = (body.get("spec") or {}).get("nodeSelector") or {}
    return wire.convert(body, wire.Pod), {str(k): str(v) for k, v in selector.items()}


async def groups(api: client.KubeApi, namespace: str | None) -> list[api_groups.SharedDeviceGroup]:
    kind = resources.SHARED_DEVICE_GROUP
    return await _list(api, kind.path(namespace), api_groups.SharedDeviceGroup, f"{kind.plural}.{kind.group}")


async def budgets(
    api: client.KubeApi, namespace: str | None
) -> tuple[list[api_budgets.AnyBudget], dict[str, dict[str, str]]]:
    """Every GPUBudget (of `namespace`, or all) and ClusterGPUBudget, and every namespace's labels."""
    own, pooled, spaces = await asyncio.gather(
        _list(api, resources.GPU_BUDGET.path(namespace), api_budgets.GPUBudget, resources.GPU_BUDGET.name),
        _list(api, resources.CLUSTER_GPU_BUDGET.path(), api_budgets.ClusterGPUBudget,
              resources.CLUSTER_GPU_BUDGET.name),
        _list(api, paths.NAMESPACES, wire.Namespace, "namespaces"),
    )  # fmt: skip
    labels = {n.metadata.name: dict(n.metadata.labels) for n in spaces}
    items: list[api_budgets.AnyBudget] = [*own, *pooled]
    if namespace is not None:
        items = [b for b in items if api_budgets.covers(b, namespace, labels.get(namespace, {}))]
    return items, labels


async def usages(api: client.KubeApi) -> list[usage.GpuUsage]:
    """Every node's GpuUsage (what its pods use, as its agent last wrote it)."""
    return await _list(api, paths.GPU_USAGES, usage.GpuUsage, "GpuUsage resources (gpuusages.sharegpu.io)")


async def idle_policies(api: client.KubeApi) -> list[idle.GPUIdlePolicy]:
    """Every namespace's GPUIdlePolicy."""
    kind = resources.GPU_IDLE_POLICY
    return await _list(api, kind.path(), idle.GPUIdlePolicy, kind.name)


async def optional(read: Awaitable[list[T]]) -> tuple[list[T], str]:
    """What `read` lists, or nothing and why where its resource is not served (sharegpu installed
    without it) or this user may not list it (RBAC): for the views that can go on without it."""
    try:
        return await read, ""
    except Missing as exc:
        return [], str(exc)
    except Forbidden as exc:
        return [], f"cannot list {exc.what}: forbidden (RBAC)"
