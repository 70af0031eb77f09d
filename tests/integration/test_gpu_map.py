"""The GPU map page in a real headless Chromium (Debian's), against the real control plane: the page
the plugin serves loads, fetches its document with the plugin's credentials, and shows the node, its
GPUs with the shares the extender placed drawn to scale, and the pending pod with sharegpu's reason.
SHAREGPU_SCREENSHOT=PATH also writes a screenshot there (docs/gpu-map.png was made so)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sharegpu.devcluster.stack import ExtenderProcess
from sharegpu.kube import client
from sharegpu.kubectl import dashboard
from tests.conftest import REPO
from tests.integration.conftest import all_bound, gpu_pod, refusal, wait_for

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
)  # fmt: skip


def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        found = subprocess.run([REPO / "scripts" / "install-chromium"], check=True, capture_output=True,
                               text=True).stdout.strip()  # fmt: skip
    return found


async def browse(url: str, profile: Path, *extra: str) -> str:
    """What Chromium shows of `url` once its scripts have run (the DOM, serialised)."""
    argv = [chromium(), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=15000", *extra, "--dump-dom", url]
    done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


async def test_the_gpu_map_shows_the_cluster_in_a_real_browser(
    admin: client.KubeClient, extender: ExtenderProcess, nodes: Callable[..., Any], namespace: str, tmp_path: Path
) -> None:
    (node,) = await nodes(1, gpus=2)
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    for name, milli in (("train", 700), ("serve", 300), ("notebook", 600)):
        await admin.create(pods_path, gpu_pod(name, namespace, milli=milli))
    await wait_for(lambda: all_bound(admin, namespace, 3), what="three shares placed")
    await admin.create(pods_path, gpu_pod("waiting", namespace, milli=800))
    reason = await wait_for(lambda: refusal(admin, namespace, "waiting"), what="the pending pod's reason")

    served = dashboard.Dashboard(admin, 0)
    await served.start()
    try:
        dom = await browse(served.url, tmp_path / "profile")
        assert 'data-state="ready"' in dom, dom[-3000:]
        assert f'data-node="{node}"' in dom
        for name in ("train", "serve", "notebook"):
            assert f'data-pod="{namespace}/{name}"' in dom, name
        widths = {
            m[1]: float(m[0]) for m in re.findall(r'style="width: ([0-9.]+)%[^"]*" [^>]*data-pod="[^/]+/(\w+)"', dom)
        }
        widths |= {m[0]: float(m[1]) for m in re.findall(r'data-pod="[^/]+/(\w+)"[^>]*style="width: ([0-9.]+)%', dom)}
        assert widths.get("train") == 70 and widths.get("serve") == 30, widths  # drawn to scale
        assert f'data-pod="{namespace}/waiting"' in dom and reason.split(";")[0][:40] in dom
        shot = os.environ.get("SHAREGPU_SCREENSHOT")
        if shot:
            await browse(served.url, tmp_path / "profile2", "--window-size=1200,760", f"--screenshot={shot}")
            assert Path(shot).stat().st_size > 10_000
    finally:
        await served.stop()
