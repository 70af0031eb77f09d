"""The Kubernetes resources sharegpu defines: `sharegpu crds` prints or writes their CustomResourceDefinitions."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from sharegpu.cli.boundary import UsageError, reported
from sharegpu.cli.options import Compat


def crds(
    out: Annotated[
        Path | None, typer.Option(help="Write one file per resource into this directory instead of printing.")
    ] = None,
    compat: Annotated[
        list[Compat] | None,
        typer.Option(help="Instead, another system's resources that sharegpu serves (repeat)."),
    ] = None,
) -> None:
    """Print every sharegpu CustomResourceDefinition (YAML: the generated ones and the Device's, which
    the package holds as written), or write the generated ones into a directory."""
    from sharegpu.api import resources

    chosen: list[resources.CustomResource] = list(resources.GENERATED)
    if compat:
        chosen = [r for name in compat for r in resources.COMPAT[name.value]]
    if out is None:
        texts = [resources.render(r) for r in chosen]
        if not compat:
            texts.append(resources.DEVICE_DEFINITION.read_text())
        sys.stdout.write("---\n".join(texts))
        return
    with reported():
        if not out.is_dir():
            raise UsageError(f"--out {out}: not a directory")
    for resource in chosen:
        (out / resources.file_name(resource)).write_text(resources.render(resource))
