"""Faults real clusters throw, through the real control plane: objects near the API's size limit,
a rotated service-account token, an API server restart, a watch gone silent on a connection left
open; and what wins when a pod states soft
preferences of its own."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from sharegpu.api import names, paths, wire
from sharegpu.devcluster import controlplane, faults, stack
from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client, informer
from tests.builders import MakePod
from tests.integration.conftest import consistent, gpu_pod, wait_for

Json = dict[str, Any]


async def bound_node(admin: client.KubeClient, namespace: str, name: str) -> str | None:
    pod = await admin.get(paths.pod(namespace, name))
    node = pod["spec"].get("nodeName")
    return str(node) if node else None


async def used_milli(extender: ExtenderProcess, node: str) -> int:
    summary = {n["node"]: n for n in await extender.debug_nodes()}
    return sum(int(g["milli"]["used"]) for g in summary[node]["gpus"])


async def ready(extender: ExtenderProcess) -> bool:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{extender.health_url}/readyz", ssl=extender.health_ssl) as response,
    ):
        return response.status == 200


async def test_objects_near_the_size_limit_do_not_stop_the_watches(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    """A 1.2 MiB pod (a huge env value, any namespace, any scheduler) and a Device carrying 255 KiB of
    annotations: the extender keeps following the cluster (the pod once killed its pod informer)."""
    (node,) = await nodes(1, gpus=2)
    sharing = gpu_pod("sharing", namespace, milli=400)
    await admin.create(paths.pods(namespace), sharing)
    await wait_for(lambda: bound_node(admin, namespace, "sharing"), what="the sharing pod bound")
    big = MakePod("huge").node_selector({"sharegpu.io/test": "nowhere"})
    big.container("c", image="busybox", env={"BLOB": "x" * (1200 * 1024)})
    await admin.create(paths.pods(namespace), big.obj())
    # Annotations may take 256 KiB in all: the largest Device the API server accepts carries them.
    await admin.patch(paths.device(node), {"metadata": {"annotations": {"blob": "y" * (255 * 1024)}}})
    await admin.delete(paths.pod(namespace, "sharing"), grace_period=0)

    async def released() -> bool:
        return await used_milli(extender, node) == 0

    await wait_for(released, what="the deleted pod's share released (the watch survived the big objects)")
    assert await ready(extender)
    await admin.create(paths.pods(namespace), gpu_pod("after", namespace, milli=700))
    assert await wait_for(lambda: bound_node(admin, namespace, "after"), what="a pod placed after them") == node
    informers = await extender.get("/debug/informers")
    assert informers["informers"]["pods"]["undecodable"] == 0


async def mint_token(admin: client.KubeClient, secret: str) -> str:
    """A service-account token bound to a Secret: it dies when the Secret is deleted."""
    made = await admin.create(
        paths.secrets(names.SYSTEM_NAMESPACE),
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret}, "type": "Opaque"},
    )
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "expirationSeconds": 3600,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Secret", "name": secret, "uid": made["metadata"]["uid"]},
        },
    }
    answer = await admin.create(
        f"/api/v1/namespaces/{names.SYSTEM_NAMESPACE}/serviceaccounts/sharegpu-extender/token", request
    )
    return str(answer["status"]["token"])


async def service_account_replica(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, tmp_path: Path
) -> tuple[ExtenderProcess, Path, str]:
    """An extender replica that runs as its ServiceAccount with a token file, as the kubelet projects
    it (RBAC bound as the chart binds it); with the token file and the suffix of its names."""
    account = {"name": "sharegpu-extender", "namespace": names.SYSTEM_NAMESPACE}
    await stack.apply(admin, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account})
    suffix = uuid.uuid4().hex[:6]
    for doc in stack.manifests("files/rbac/extender.yaml"):  # bound to the ServiceAccount, as the chart binds them
        doc["metadata"]["name"] += f"-sa-{suffix}"
        if doc["kind"].endswith("Binding"):
            doc["roleRef"]["name"] = doc["roleRef"]["name"] + f"-sa-{suffix}"
        await stack.apply(admin, doc)
    first = await mint_token(admin, f"token-a-{suffix}")
    token_file = tmp_path / "token"
    token_file.write_text(first)
    assert control_plane.bundle is not None
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": control_plane.url,
                                                         "certificate-authority": str(control_plane.bundle.ca_cert)}}],
                "users": [{"name": "sa", "user": {"tokenFile": str(token_file)}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "sa"}}],
                "current-context": "c",
            }
        )
    )  # fmt: skip
    replica = ExtenderProcess(
        control_plane, "fgd-used", "--lease-duration", "3", "--renew-deadline", "2", "--retry-period", "0.5",
        kubeconfig=kubeconfig,
    )  # fmt: skip
    return replica, token_file, suffix


async def test_a_rotated_service_account_token_is_read_again_and_readyz_tells_the_truth(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, extender: ExtenderProcess, tmp_path: Path
) -> None:
    """The token dies (its bound Secret is deleted): /readyz says so. The kubelet writes a new one:
    the extender reads it without a restart and is ready again."""
    replica, token_file, suffix = await service_account_replica(admin, control_plane, tmp_path)
    replica.start()
    try:
        await replica.wait_ready()
        pid = replica.process.pid if replica.process else None
        await admin.delete(f"{paths.secrets(names.SYSTEM_NAMESPACE)}/token-a-{suffix}")

        async def refused() -> bool:
            return not await ready(replica)

        await wait_for(refused, timeout=30, what="/readyz false while the API refuses the token")
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{replica.health_url}/readyz", ssl=replica.health_ssl) as response,
        ):
            assert response.status == 503 and (await response.json())["credentialsRefused"] is True
            # /debug and /metrics cannot check their callers meanwhile (their reviews use the same token)
        async with (
            aiohttp.ClientSession(headers=replica.headers) as session,
            session.get(f"{replica.health_url}/debug/informers", ssl=replica.health_ssl) as response,
        ):
            assert response.status == 503
        token_file.write_text(await mint_token(admin, f"token-b-{suffix}"))
        await wait_for(lambda: ready(replica), timeout=30, what="/readyz true with the rotated token")
        assert replica.process is not None and replica.process.pid == pid and replica.process.poll() is None
    finally:
        replica.kill()


async def test_the_watches_keep_delivering_across_a_token_rotation(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """The kubelet's routine rotation: a new token in the file while the old one still works. The
    replica's open watches must go on delivering (they once stalled silently: the new token made
    the transport replace its connection pool, and aiohttp left the readers of the closed
    connections waiting for ever while /readyz said ok)."""
    replica, token_file, suffix = await service_account_replica(admin, control_plane, tmp_path)
    replica.start()
    try:
        await replica.wait_ready()
        body = await replica.get("/debug/informers")
        resumes = {name: state["resumes"] for name, state in body["informers"].items()}
        token_file.write_text(await mint_token(admin, f"token-b-{suffix}"))
        await asyncio.sleep(3)  # read again within a second; the lease renewals use it at once
        (node,) = await nodes(1, gpus=1)

        async def seen() -> bool:
            return node in {n["node"] for n in await replica.debug_nodes()}

        await wait_for(seen, timeout=20, what="the node created after the rotation in the replica's cache")
        body = await replica.get("/debug/informers")
        assert {name: state["resumes"] for name, state in body["informers"].items()} == resumes, (
            "the watches were not even interrupted"
        )
    finally:
        replica.kill()


async def test_soft_preferences_win_over_packing_and_packing_decides_among_equals(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str
) -> None:
    """docs/extender.md: a pod's soft preferences are weighed by kube-scheduler against sharegpu's
    ranking, which can move a node's total by at most half its range; a node a preference clearly
    favours wins, and between nodes the preferences rate alike, sharegpu's choice wins."""
    made = await nodes(2, gpus=2)
    await admin.create(paths.pods(namespace), gpu_pod("first", namespace, milli=300))
    packed = await wait_for(lambda: bound_node(admin, namespace, "first"), what="first bound")
    await admin.create(paths.pods(namespace), gpu_pod("probe", namespace, milli=300))
    choice = await wait_for(lambda: bound_node(admin, namespace, "probe"), what="probe bound")
    assert choice == packed, "without preferences, sharegpu packs next to the first pod"
    await admin.delete(paths.pod(namespace, "probe"), grace_period=0)
    await wait_for(lambda: used_milli_is(extender, choice, 300), what="the probe's share released")
    other = next(n for n in made if n != choice)

    def preferring(name: str, key: str, value: str) -> Json:
        pod = gpu_pod(name, namespace, milli=300)
        term = {"weight": 100, "preference": {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}}
        pod["spec"]["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term]}}
        return pod

    await admin.create(paths.pods(namespace), preferring("prefers-other", "kubernetes.io/hostname", other))
    assert await wait_for(lambda: bound_node(admin, namespace, "prefers-other"), what="bound") == other
    await admin.create(paths.pods(namespace), preferring("prefers-both", "sharegpu.io/test", namespace))
    assert await wait_for(lambda: bound_node(admin, namespace, "prefers-both"), what="bound") == choice
    await consistent(admin, made)


async def used_milli_is(extender: ExtenderProcess, node: str, milli: int) -> bool:
    return await used_milli(extender, node) == milli


async def test_an_api_server_restart_is_ridden_out(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: ExtenderProcess,
    nodes: Callable[..., Any],
    namespace: str,
) -> None:
    (node,) = await nodes(1, gpus=2)
    await admin.create(paths.pods(namespace), gpu_pod("before", namespace, milli=500))
    await wait_for(lambda: bound_node(admin, namespace, "before"), what="bound before the restart")
    await asyncio.to_thread(control_plane.restart, "kube-apiserver", down_for=2.0)
    await wait_for(lambda: ready(extender), timeout=60, what="the extender ready again")
    await admin.create(paths.pods(namespace), gpu_pod("after", namespace, milli=500))
    assert await wait_for(lambda: bound_node(admin, namespace, "after"), timeout=90, what="bound after") == node
    await consistent(admin, [node])
    informers = (await extender.get("/debug/informers"))["informers"]
    assert all(state["ready"] for state in informers.values()), informers


async def test_a_watch_gone_silent_on_a_connection_left_open_is_given_up_and_resumed(
    admin: client.KubeClient, control_plane: controlplane.ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """A half-open connection: the fault proxy keeps an informer's watch open but passes nothing more
    from the real API server (its bookmarks and its end included). The client's own read timeout
    (`watch_idle`, here 3 s) gives the connection up, and the informer resumes from its version
    through a new one: the change made meanwhile arrives, with no relist."""
    assert control_plane.bundle is not None
    proxy = faults.FaultProxy(control_plane.url, str(control_plane.bundle.ca_cert))
    await proxy.start()
    config = json.loads(control_plane.kubeconfig("admin").read_text())
    config["clusters"][0]["cluster"] = {"server": proxy.url}
    (tmp_path / "kubeconfig").write_text(json.dumps(config))
    kube = client.KubeClient.connect(str(tmp_path / "kubeconfig"))
    seen: list[str] = []
    watcher: informer.Informer[wire.ConfigMap, wire.ConfigMap] = informer.Informer(
        kube, paths.configmaps(namespace), wire.ConfigMap, informer.identity,
        lambda kind, made: seen.append(f"{kind} {made.metadata.name}"), watch_idle=3.0, max_backoff=0.2,
    )  # fmt: skip
    task = asyncio.create_task(watcher.run())
    made = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": "v"}}

    async def stalled() -> bool:
        return proxy.stall_watches() > 0

    async def arrived() -> bool:
        return "ADDED while-silent" in seen

    try:
        await asyncio.wait_for(watcher.synced.wait(), 30)
        await wait_for(stalled, timeout=30, what="the informer's watch open through the proxy")
        silent_from = asyncio.get_running_loop().time()
        await admin.create(paths.configmaps(namespace), {**made, "metadata": {"name": "while-silent"}})
        await wait_for(arrived, timeout=30, what="the change, through a new watch")
        took = asyncio.get_running_loop().time() - silent_from
        assert proxy.injected == {"watch-stalled": 1}
        assert "timeout" in watcher.last_error.lower(), watcher.last_error
        assert took < 15, f"seen {took:.1f} s after the stall (idle timeout 3 s)"
        assert watcher.lists == 1, "resumed from its version, not listed again"
        await admin.create(paths.configmaps(namespace), {**made, "metadata": {"name": "after"}})
        await wait_for(lambda: _has(seen, "ADDED after"), timeout=30, what="the resumed watch delivering")
    finally:
        await informer.cancel([task])
        await kube.close()
        await proxy.stop()


async def _has(seen: list[str], event: str) -> bool:
    return event in seen
