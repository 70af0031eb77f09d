"""Options several commands take, declared once here with their checks.

`Compat` (other systems' resources), `Kubeconfig`, the health port's TLS and access (`HealthCert`,
`HealthKey`, `PlainHealth`, `MetricsAuth`, checked and combined with its address by `health_endpoint`
into the one `serving.health.Endpoint` a component takes), the completion of policy names, and the leader
election of the components that take a Lease: the four options --lease-duration, --renew-deadline,
--retry-period and --identity (`LeaseDuration`... `Identity`, their defaults `ELECTION`), which
`election` turns into one `kube.terms.Election`. The trace options of `simulate` and `bound` are in
`simulation`, beside them.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sharegpu.cli.boundary import UsageError
from sharegpu.core import errors
from sharegpu.kube import terms

if TYPE_CHECKING:
    from sharegpu.serving import health


class Compat(enum.StrEnum):
    """Other systems' resources sharegpu can serve (`--compat`): the keys of `api.resources.COMPAT`,
    spelled here so that the command line loads without the wire vocabulary (a test keeps them equal)."""

    DEVICESHARE = "deviceshare"
    KUBESHARE = "kubeshare"
    COSCHEDULING = "coscheduling"
    VOLCANO = "volcano"
    KAI = "kai"


class Runtime(enum.StrEnum):
    """The container runtime of devcluster's nodes (`--runtime`)."""

    FAKE = "fake"
    CONTAINERD = "containerd"


Kubeconfig = Annotated[
    str | None, typer.Option(help="kubeconfig file.", show_default="$KUBECONFIG, ~/.kube/config, or in-cluster")
]


MetricsAuth = Annotated[
    bool,
    typer.Option(
        "--metrics-auth/--no-metrics-auth",
        help="Serve /metrics and /debug only to a bearer token the API server accepts, of a user allowed to "
        "get the path (RBAC nonResourceURLs; the chart's ClusterRole sharegpu-metrics-reader grants /metrics).",
    ),
]


HealthCert = Annotated[
    Path | None,
    typer.Option(
        help="Certificate of the health port (PEM; followed as it is renewed).",
        show_default="a self-signed one made at start",
    ),
]
HealthKey = Annotated[Path | None, typer.Option(help="Key of --health-cert (PEM).")]
PlainHealth = Annotated[
    bool,
    typer.Option(
        "--plain-health",
        help="Serve the health port over plain HTTP: the bearer tokens /metrics and /debug ask for then "
        "cross the network in the clear.",
    ),
]


def health_endpoint(
    host: str, port: int, cert: Path | None, key: Path | None, plain: bool, metrics_auth: bool
) -> health.Endpoint:
    """The health port's `serving.health.Endpoint` from its options, with a UsageError naming what
    is wrong."""
    from sharegpu.serving import health, tls

    for path in (cert, key):
        if path is not None and not path.is_file():
            raise UsageError(f"{path}: no such file")
    try:
        return health.Endpoint(port, host, tls.HealthTls(cert, key, plain), metrics_auth)
    except errors.InvalidInputError as exc:
        raise UsageError(str(exc)) from None


def complete_policy(incomplete: str) -> list[str]:
    """A component's policy: sharegpu's own."""
    from sharegpu.core import policies  # numpy: only when completing

    return [name for name in [*policies.REGISTRY, *policies.ALIASES] if name.startswith(incomplete)]


def complete_policies(incomplete: str) -> list[str]:
    """The simulator's policies (the peers' too); completes the last name of a comma-separated list."""
    from sharegpu.core import policies
    from sharegpu.sim import catalog

    done, comma, last = incomplete.rpartition(",")
    found = [name for name in [*catalog.REGISTRY, *policies.ALIASES] if name.startswith(last)]
    return [done + comma + name for name in found]


ELECTION = terms.DEFAULT
"""The leader-election defaults: the options below show them, the runtimes take them as they are."""
LeaseDuration = Annotated[float, typer.Option(help="Leader election: seconds a Lease is valid.")]
RenewDeadline = Annotated[float, typer.Option(help="Leader election: seconds to renew before stepping down.")]
RetryPeriod = Annotated[float, typer.Option(help="Leader election: seconds between attempts.")]
Identity = Annotated[
    str, typer.Option(help="Leader election: this replica's name.", show_default="host, pid and a random suffix")
]


def election(lease_duration: float, renew_deadline: float, retry_period: float, identity: str) -> terms.Election:
    """The four options as one `kube.terms.Election` (InvalidInputError when the timings do not nest)."""
    return terms.Election(terms.Terms(lease_duration, renew_deadline, retry_period), identity)
