"""Builders for the API edge's tests."""

from __future__ import annotations

import json
from pathlib import Path

from sharegpu.kube import credentials


def local_credentials(folder: Path, port: int) -> credentials.Credentials:
    """Credentials for a plain-HTTP test server on 127.0.0.1:`port`, from a kubeconfig in `folder`."""
    config = folder / f"config-{port}"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    return credentials.Credentials(lambda: credentials.parse_kubeconfig(config))
