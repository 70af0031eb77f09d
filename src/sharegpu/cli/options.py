"""Options several commands take, declared once here with their checks.

`Compat` (other systems' resources), `Kubeconfig`, the health port's TLS (`HealthCert`, `HealthKey`,
`PlainHealth`, checked and combined by `health_tls`), the completion of policy names, and the leader
election of the components that take a Lease: `leader_election` gives a command the four options
--lease-duration, --renew-deadline, --retry-period and --identity, and hands them to it as one
`LeaderElection`. The trace options of `simulate` and `bound` are in `simulation`, beside them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from sharegpu.cli.boundary import UsageError
from sharegpu.core import errors

if TYPE_CHECKING:
    from sharegpu.serving import tls


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


def health_tls(cert: Path | None, key: Path | None, plain: bool) -> tls.HealthTls:
    """The health port's `serving.tls.HealthTls` from the three options, with a UsageError naming
    what is wrong."""
    from sharegpu.serving import tls

    for path in (cert, key):
        if path is not None and not path.is_file():
            raise UsageError(f"{path}: no such file")
    try:
        return tls.HealthTls(cert, key, plain)
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


@dataclasses.dataclass(frozen=True)
class LeaderElection:
    """The leader-election options, with their defaults."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    identity: str = ""

    def check(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise UsageError("leader election needs 0 < --retry-period < --renew-deadline < --lease-duration")


ELECTION_DEFAULTS = LeaderElection()
"""The default of a command's `election` parameter (`leader_election` puts the four options in its place)."""

_ELECTION_OPTIONS: dict[str, Any] = {
    "lease_duration": Annotated[float, typer.Option(help="Leader election: seconds a Lease is valid.")],
    "renew_deadline": Annotated[float, typer.Option(help="Leader election: seconds to renew before stepping down.")],
    "retry_period": Annotated[float, typer.Option(help="Leader election: seconds between attempts.")],
    "identity": Annotated[
        str, typer.Option(help="Leader election: this replica's name.", show_default="host, pid and a random suffix")
    ],
}


def leader_election(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with the leader-election options in place of its parameter `election: LeaderElection`.

    Typer reads a command's options from its signature; the one returned here has the four options where
    `election` stood (so they keep their place in the help), and calling it hands them to `command` as
    one `LeaderElection`, unchecked: the command checks it where its other options are checked.
    """
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name != "election":
            parameters.append(parameter)
            continue
        parameters += [
            inspect.Parameter(name, parameter.kind, default=getattr(ELECTION_DEFAULTS, name), annotation=option)
            for name, option in _ELECTION_OPTIONS.items()
        ]
    if len(parameters) == len(signature.parameters):
        raise TypeError(f"{command.__name__} takes no `election` parameter")

    @functools.wraps(command)
    def with_election(**given: Any) -> None:
        election = LeaderElection(**{name: given.pop(name) for name in _ELECTION_OPTIONS})
        command(**given, election=election)

    with_election.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    with_election.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return with_election
