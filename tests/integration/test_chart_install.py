"""The chart's rendering for the control plane's version against its real API server: every object
is accepted (kubectl apply with a server-side dry run: schema, defaulting, validation and admission,
nothing stored, so the other tests' webhook registration is left alone). test_chart_components.py
runs what it renders."""

from __future__ import annotations

from pathlib import Path

import yaml

from sharegpu.devcluster import controlplane
from tests.conftest import render
from tests.integration.conftest import kubectl


async def test_every_object_of_the_rendering_is_accepted(
    control_plane: controlplane.ControlPlane, system: None, tmp_path: Path
) -> None:
    docs = render(control_plane.version)
    manifest = tmp_path / "sharegpu.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    _, out = await kubectl(control_plane, "apply", "--dry-run=server", "-f", str(manifest))
    accepted = [line for line in out.splitlines() if "(server dry run)" in line]
    assert len(accepted) == len(docs), out
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "DaemonSet", "MutatingWebhookConfiguration", "PodDisruptionBudget", "Secret"} <= kinds
