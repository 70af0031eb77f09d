"""Leader-election settings (`kube.leader` runs the election): light, so that the command line can
show their defaults without loading the API client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sharegpu.core import errors as core_errors


@dataclass(frozen=True, slots=True)
class Terms:
    """A Lease's timings, in seconds, as client-go's leaderelection names them (kube-scheduler's
    `leaderElection` and the components' `--lease-duration`, `--renew-deadline`, `--retry-period`)."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise core_errors.InvalidInputError(
                "leader election needs 0 < --retry-period < --renew-deadline < --lease-duration, got "
                f"{self.retry_period:g}, {self.renew_deadline:g}, {self.lease_duration:g}"
            )


@dataclass(frozen=True, slots=True)
class Election:
    """A component's leader-election settings, passed whole from its command line (`--lease-duration`,
    `--renew-deadline`, `--retry-period`, `--identity`) to its elector: the Lease's terms, checked when
    made, and this replica's name ("": `identity()`'s)."""

    terms: Terms = Terms()
    identity: str = ""


DEFAULT: Final = Election()
"""The defaults (client-go's: 15, 10 and 2 seconds), the one place they are written."""
TIMINGS: Final = DEFAULT.terms
