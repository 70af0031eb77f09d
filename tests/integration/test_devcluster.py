"""`sharegpu devcluster` as a newcomer runs it: the whole stack comes up (each fake node's Device
written by its own agent), survives a pod near the API's size limit, and Ctrl-C stops every process
it started (once, a dead informer's exception crashed the shutdown and left etcd, kube-apiserver,
kube-scheduler and the extender running). With `--dra`, the DRA walk-through of docs/quickstart.md."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharegpu.api import dra, names, paths
from sharegpu.kube import client
from tests.builders import MakePod
from tests.conftest import REPO
from tests.integration.conftest import get_or_none, gpu_pod, wait_for

Json = dict[str, Any]


def survivors(folder: Path) -> dict[int, str]:
    """Live processes (pid -> command line) that mention the devcluster's folder."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in line and " devcluster " not in line:
            found[int(entry.name)] = line[:200]
    return found


@contextlib.asynccontextmanager
async def devcluster(folder: Path, *args: str) -> AsyncIterator[client.KubeClient]:
    """`sharegpu devcluster --nodes 1 --gpus 2 ARGS`, started, its admin client; Ctrl-C at the end must
    stop every process it started."""
    process = subprocess.Popen(
        [sys.executable, "-m", "sharegpu", "devcluster", "--nodes", "1", "--gpus", "2", "--workdir", str(folder),
         *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdout is not None
    kubeconfig, printed = "", []
    try:
        for _ in range(400):
            line = (await asyncio.to_thread(process.stdout.readline)).decode()
            printed.append(line)
            if "export KUBECONFIG=" in line:
                kubeconfig = line.split("=", 1)[1].strip()
                break
            assert line or process.poll() is None, "devcluster exited during start-up:\n" + "".join(printed[-40:])
        assert kubeconfig, "no kubeconfig printed:\n" + "".join(printed[-40:])
        async with client.KubeClient.connect(kubeconfig) as kube:
            await kube.create(paths.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "try"}})
            yield kube
        assert survivors(folder), "the devcluster's processes are running"
        process.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(process.wait, 60) == 0
        for _ in range(50):
            if not survivors(folder):
                break
            await asyncio.sleep(0.2)
        assert survivors(folder) == {}
    finally:
        if process.poll() is None:  # the test failed: stop it as a user would, so that it cleans up
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.to_thread(process.wait, 90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        process.stdout.close()
        for pid in survivors(folder):  # leave nothing running, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_devcluster_runs_a_pod_and_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    folder = tmp_path / "dev"
    async with devcluster(folder) as kube:
        huge = MakePod("huge").container("c", image="x", env={"B": "x" * 700_000})
        await kube.create(paths.pods("try"), huge.obj())
        pod = gpu_pod("first", "try", milli=500)
        pod["spec"].pop("nodeSelector")
        await kube.create(paths.pods("try"), pod)
        # As a newcomer writes it for Koordinator: no sharegpu schedulerName, another format.
        koord = gpu_pod("koord", "try")
        koord["spec"].pop("nodeSelector")
        koord["spec"]["schedulerName"] = "koord-scheduler"
        koord["spec"]["containers"][0]["resources"] = {"limits": {"koordinator.sh/gpu-core": "30"}}
        await kube.create(paths.pods("try"), koord)

        async def bound(name: str) -> bool:
            found = await kube.get(paths.pod("try", name))
            annotations = found["metadata"].get("annotations") or {}
            if not found["spec"].get("nodeName") or names.ALLOCATION not in annotations:
                return False
            handoff = await get_or_none(kube, paths.configmap("try", annotations[names.HANDOFF]))
            return bool(handoff and (handoff.get("data") or {}).get("main.NVIDIA_VISIBLE_DEVICES"))

        for name in ("first", "koord"):
            await wait_for(functools.partial(bound, name), timeout=60, what=f"pod {name} with its hand-off")
            await kube.delete(paths.pod("try", name), grace_period=0)

        # The node's agent wrote its Device (owned by the Node) from its fake NVML file, and follows it.
        device = await kube.get(paths.device("gpu-node-0"))
        assert [r["kind"] for r in device["metadata"]["ownerReferences"]] == ["Node"]
        assert device["spec"]["isolation"] == ["hami-core"]
        nvml = folder / "nvml" / "gpu-node-0.yaml"
        nvml.write_text(nvml.read_text() + "faults: {unreadable: [1]}\n")

        async def unhealthy() -> bool:
            gpus = (await kube.get(paths.device("gpu-node-0")))["spec"]["gpus"]
            return [g.get("healthy", True) for g in gpus] == [True, False]

        await wait_for(unhealthy, timeout=30, what="GPU 1 unhealthy in the agent's Device")


async def test_devcluster_dra_places_a_pod_as_kubernetes_documents_dra_and_one_in_another_format(
    tmp_path: Path,
) -> None:
    """The DRA walk-through of docs/quickstart.md: `sharegpu devcluster --dra` makes its node a DRA
    node (a ResourceSlice of sharegpu's driver), a pod written as Kubernetes documents DRA (a claim
    template of sharegpu's class, no gate, no scheduler named) and a Koordinator-format pod (turned
    into a claim by the webhook) are both placed by sharegpu and bound, their claims allocated."""
    async with devcluster(tmp_path / "dev", "--dra") as kube:
        slices = (await kube.get(dra.SLICES))["items"]
        assert [s["spec"]["nodeName"] for s in slices] == ["gpu-node-0"]
        request = {"name": "gpu", "exactly": {"deviceClassName": dra.CLASS,
                   "capacity": {"requests": {dra.MILLI: "250", dra.MEMORY: "10Gi"}}}}  # fmt: skip
        template = {"apiVersion": dra.API_VERSION, "kind": "ResourceClaimTemplate", "metadata": {"name": "quarter"},
                    "spec": {"spec": {"devices": {"requests": [request]}}}}  # fmt: skip
        await kube.create(dra.template_path("try"), template)
        documented = MakePod("documented").container(image="busybox").obj()
        documented["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "quarter"}]
        documented["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
        await kube.create(paths.pods("try"), documented)
        koord = MakePod("koord").container(image="busybox", limits={"koordinator.sh/gpu-core": "30"}).obj()
        await kube.create(paths.pods("try"), koord)

        async def placed(name: str) -> bool:
            found = await kube.get(paths.pod("try", name))
            if found["spec"].get("nodeName") != "gpu-node-0" or not (claim_name := claim_named(found)):
                return False
            claim = await kube.get(dra.claim_path("try", claim_name))
            return bool((claim.get("status") or {}).get("allocation"))

        for name in ("documented", "koord"):
            await wait_for(functools.partial(placed, name), timeout=90, what=f"pod {name} bound, its claim allocated")


def claim_named(pod: Json) -> str:
    """The name of a pod's first claim: its own by name (the webhook's pods), or the one made from its
    template (named in its status); "" while not made."""
    statuses = (pod.get("status") or {}).get("resourceClaimStatuses") or []
    by_name: str = pod["spec"]["resourceClaims"][0].get("resourceClaimName") or ""
    return by_name or (statuses[0].get("resourceClaimName") or "" if statuses else "")


async def claim_of(kube: client.KubeClient, namespace: str, pod: str) -> str:
    return claim_named(await kube.get(paths.pod(namespace, pod)))


def quickstart_manifests() -> list[Json]:
    """The manifests of docs/quickstart.md's walk-through on containerd (its `kubectl apply` heredocs)."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    section = text.split("### With real containers", 1)[1].split("\n## ", 1)[0]
    bodies = [part.split("\nYAML\n", 1)[0] for part in section.split("kubectl apply -f - <<'YAML'\n")[1:]]
    return [doc for body in bodies for doc in yaml.safe_load_all(body) if doc]


@pytest.mark.runtime
async def test_devcluster_on_containerd_runs_the_quickstart_pods_in_containers_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """`sharegpu devcluster --runtime containerd --dra` as docs/quickstart.md walks through it: the chart
    installed from the built image, the walk-through's pods (HAMi's format, and a claim template of
    sharegpu's class) run in containerd, their logs (read through the API server, from the kubelet)
    show the GPU each was given; Ctrl-C leaves no process, mount or bridge behind."""
    manifests = quickstart_manifests()
    assert [m["kind"] for m in manifests] == ["Pod", "ResourceClaimTemplate", "Pod"], manifests
    async with devcluster(tmp_path / "dev", "--runtime", "containerd", "--dra") as kube:
        for manifest in manifests:
            manifest["metadata"]["namespace"] = "try"
            path = paths.pods("try") if manifest["kind"] == "Pod" else dra.template_path("try")
            await kube.create(path, manifest)

        async def logged(name: str) -> str:
            found = await kube.get(paths.pod("try", name))
            if found["status"].get("phase") != "Running":
                return ""
            text = (await kube.send("GET", f"{paths.pod('try', name)}/log")).decode()
            return text if "NVIDIA_VISIBLE_DEVICES=" in text else ""

        for pod in ("share", "trainer"):
            text = await wait_for(functools.partial(logged, pod), timeout=120, what=f"pod {pod} running, its log")
            assert isinstance(text, str)
            visible = next(line for line in text.splitlines() if line.startswith("NVIDIA_VISIBLE_DEVICES="))
            uuid = visible.split("=", 1)[1]
            assert uuid in {"GPU-0-0", "GPU-0-1"}, text
            assert {line for line in text.splitlines() if line.startswith("nvidia")} == {
                f"nvidia{uuid[-1]}", "nvidiactl", "nvidia-uvm"}, text  # fmt: skip
            allocated = await kube.get(dra.claim_path("try", await claim_of(kube, "try", pod)))
            (result,) = allocated["status"]["allocation"]["devices"]["results"]
            assert result["device"] == dra.device_name(int(uuid[-1])), (result, uuid)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert "/tmp/sg-" not in mounts, "a node's mount left behind"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert "sgbr" not in links, links
