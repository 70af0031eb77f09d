"""The webhook's own PKI in bootstrap mode (`sharegpu webhook --bootstrap FOLDER`), kept valid for as
long as the webhook runs: a CA (`CA_DAYS`, its key in memory only) and a serving certificate
(`SERVING_DAYS`) for the names the API server reaches the webhook by, written to FOLDER (tls.crt,
tls.key, ca.crt), where the serving context reloads them on the next connection.

`renew` issues the serving certificate again once less than a third of its life is left, and the CA
likewise (a restart makes a new CA anyway: its key is not kept), so no certificate the API server
checks ever expires while the webhook runs: the pods of every namespace it reviews would be refused
from that moment (failurePolicy Fail). A new CA's bundle goes into the webhook configurations beside
the old one until the old one expires, so the serving certificate the API server sees meanwhile
(old or new) is trusted either way. The clock is passed in (`clock`: seconds since the epoch), so a
test walks across the expiry.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509

from sharegpu.serving import certs

log = logging.getLogger(__name__)

CA_DAYS: Final = 3650
SERVING_DAYS: Final = 90
LEFT: Final = 1 / 3
"""Renew a certificate once less than this share of its life is left."""


def _when(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC)


def due(cert: x509.Certificate, now: float) -> bool:
    """Whether less than `LEFT` of the certificate's life is left at `now`."""
    start, end = cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()
    return end - now < (end - start) * LEFT


@dataclass
class Bootstrap:
    folder: Path
    dns_names: Sequence[str]
    ip_addresses: Sequence[str]
    clock: Callable[[], float] = time.time
    ca_days: int = CA_DAYS
    serving_days: int = SERVING_DAYS

    def __post_init__(self) -> None:
        self.cas: list[tuple[x509.Certificate, certs.Key]] = []
        """The CAs whose bundle the API server trusts, the newest last (it signs)."""
        self.serving: x509.Certificate | None = None

    @property
    def bundle(self) -> bytes:
        """The CA bundle the webhook configurations carry: every CA not expired, newest last."""
        now = self.clock()
        return b"".join(certs.pem(c) for c, _ in self.cas if c.not_valid_after_utc.timestamp() > now)

    def renew(self) -> bool:
        """Make what is missing or due (module docstring); whether the bundle changed (write it into
        the webhook configurations)."""
        now = self.clock()
        before = self.bundle
        if not self.cas or due(self.cas[-1][0], now):
            self.cas.append(certs.new_ca("sharegpu-webhook-ca", days=self.ca_days, at=_when(now)))
            self.cas = [(c, k) for c, k in self.cas if c.not_valid_after_utc.timestamp() > now]
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "ca.crt").write_bytes(self.bundle)
            log.info("webhook CA made (valid until %s)", self.cas[-1][0].not_valid_after_utc.isoformat())
        ca_cert, ca_key = self.cas[-1]
        if (
            self.serving is None
            or due(self.serving, now)
            or self.serving.issuer != ca_cert.subject
            or self.bundle != before
        ):
            self.serving, key = certs.issue_serving(
                ca_cert, ca_key, "sharegpu-webhook", dns_names=self.dns_names, ip_addresses=self.ip_addresses,
                days=self.serving_days, at=_when(now),
            )  # fmt: skip
            certs.write_pair(self.folder, self.serving, key)
            log.info(
                "webhook serving certificate issued (valid until %s)", self.serving.not_valid_after_utc.isoformat()
            )
        return self.bundle != before
