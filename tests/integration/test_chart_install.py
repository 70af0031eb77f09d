"""The chart's 1.20 rendering against the real API server (1.20): every object is accepted (kubectl
apply with a server-side dry run: schema, defaulting, validation and admission, nothing stored, so
the other tests' webhook registration is left alone), and the kube-scheduler configuration it
renders starts a real kube-scheduler that schedules a GPU pod (submitted with kubectl) through the
extender."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from sharegpu.api import names, paths
from sharegpu.devcluster import controlplane, stack
from sharegpu.kube import client
from tests.integration.conftest import get_or_none, gpu_pod, wait_for
from tests.integration.test_compat import kubectl
from tests.test_chart import one, render

CHART_DOCS = "1.20.2"


async def test_every_object_of_the_1_20_rendering_is_accepted(
    control_plane: controlplane.ControlPlane, system: None, tmp_path: Path
) -> None:
    docs = render(CHART_DOCS)
    manifest = tmp_path / "sharegpu.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    _, out = await kubectl(control_plane, "apply", "--dry-run=server", "-f", str(manifest))
    accepted = [line for line in out.splitlines() if "(server dry run)" in line]
    assert len(accepted) == len(docs), out
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "DaemonSet", "MutatingWebhookConfiguration", "PodDisruptionBudget", "Secret"} <= kinds


async def test_the_rendered_scheduler_configuration_runs_and_places_a_gpu_pod(
    admin: client.KubeClient,
    control_plane: controlplane.ControlPlane,
    extender: stack.ExtenderProcess,
    nodes: object,
    namespace: str,
    tmp_path: Path,
) -> None:
    """The chart's ConfigMap, with the paths a pod would mount pointed at this test's files, runs a
    second kube-scheduler (leader-elected, as the chart runs it) that places a pod through the extender."""
    docs = render(CHART_DOCS)
    text = one(docs, "ConfigMap", "sharegpu-scheduler")["data"]["config.yaml"]
    configuration = yaml.safe_load(text)
    # As the admin: its Lease is this test's own (the chart's RBAC names only sharegpu-scheduler's).
    configuration["clientConnection"]["kubeconfig"] = str(control_plane.kubeconfig("admin"))
    configuration["healthzBindAddress"] = configuration["metricsBindAddress"] = f"127.0.0.1:{controlplane.free_port()}"
    configuration["leaderElection"]["resourceName"] = f"chart-{namespace}"  # not the running scheduler's Lease
    (extender_config,) = configuration["extenders"]
    extender_config["urlPrefix"] = extender.url
    pki = extender.pki
    extender_config["tlsConfig"] = {
        "certFile": str(pki.client_cert),
        "keyFile": str(pki.client_key),
        "caFile": str(pki.ca),
    }
    (profile,) = configuration["profiles"]
    profile["schedulerName"] = f"chart-{namespace}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(configuration))
    log = (tmp_path / "scheduler.log").open("w")
    process = subprocess.Popen(
        [str(control_plane.bin_dir / "kube-scheduler"), f"--config={path}", "--port=0", "--secure-port=0"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        await nodes(1, gpus=1)  # type: ignore[operator]
        pod = gpu_pod("through-the-chart", namespace, milli=300, annotations={names.HANDOFF: "handoff-chart"})
        pod["spec"]["schedulerName"] = f"chart-{namespace}"
        submitted = tmp_path / "pod.yaml"
        submitted.write_text(yaml.safe_dump(pod))
        await kubectl(control_plane, "apply", "-n", namespace, "-f", str(submitted))  # as a user would

        async def placed() -> dict[str, str] | None:
            found = await admin.get(paths.pod(namespace, "through-the-chart"))
            if not found["spec"].get("nodeName"):
                return None
            handoff = await get_or_none(admin, paths.configmap(namespace, "handoff-chart"))
            return dict(handoff.get("data") or {}) or None if handoff is not None else None

        try:
            data = await wait_for(placed, timeout=60, what="the pod placed by the chart's scheduler configuration")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\nkube-scheduler's log:\n{(tmp_path / 'scheduler.log').read_text()[-3000:]}"
            ) from None
        assert data["main.NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    finally:
        process.terminate()
        process.wait(10)
        log.close()
