"""The `sharegpu` command line.

`sharegpu simulate` replays a workload through the placement core (the embedded synthetic one by
default, or openb CSV files) and prints a summary table per trace and policy; the other commands run
the components (one image holds them all: see the Dockerfile). Bad input (missing file, malformed
row, unknown policy, bad seed list, and click's own usage errors: an unknown option, a value that is
not one of an option's choices) prints one line `sharegpu: error: ...` and exits with status 2.

The components log to stderr, one JSON object per line for log collectors, or one plain line per
record for a person (`--log-format`; `auto`, the default, picks text when stderr is a terminal, so a
pod's logs stay JSON). `sharegpu --version` prints the installed version; `--install-completion`
installs shell completion (option names, and the choices of options that have them).

This module makes `app` and registers every command on it, in the order `sharegpu --help` lists them;
the commands live by family:

    simulation   simulate, bound, policies; the trace options they share
    resources    crds
    components   extender, controller, reserve, agent (the long-running components)
    webhook      webhook, and the check of its --url against its certificate's names
    tools        devcluster, gpu-check, defrag
    options      options several commands take: --compat, --kubeconfig, leader election
    logs         --log-level, --log-format and the two log formats
    boundary     errors as one line `sharegpu: error: ...` (`reported`), the console tables are drawn on
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated

import typer

from sharegpu.cli import components, resources, simulation, tools, webhook
from sharegpu.cli.boundary import Commands
from sharegpu.cli.simulation import parse_policies, parse_seeds

__all__ = ["app", "main", "parse_policies", "parse_seeds"]

app = typer.Typer(
    name="sharegpu",
    cls=Commands,
    help="Share NVIDIA GPUs between Kubernetes pods: placement, simulation and inspection.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"sharegpu {importlib.metadata.version('sharegpu')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    pass


app.command()(simulation.simulate)
app.command()(simulation.bound)
app.command()(resources.crds)
app.command("policies")(simulation.list_policies)
app.command()(components.extender)
app.command()(components.controller)
app.command("defrag")(tools.defrag_plan)
app.command()(components.reserve)
app.command()(components.agent)
app.command("gpu-check")(tools.gpu_check)
app.command()(webhook.webhook)
app.command()(tools.devcluster)


def main() -> None:
    app()
