"""Server-side TLS that follows its files, and optionally requires a client certificate; and how a
component serves its health port.

`ReloadingTls` serves the certificate and key found at two paths: every TLS handshake checks the
files' modification times and switches to a fresh context when they changed (cert-manager and the
webhook's bootstrap renew certificates in place), so rotation needs no restart; half-written files
keep the previous pair in service. With `client_ca`, a client must present a certificate signed by
that CA or the handshake fails: that is how the extender accepts filter, prioritize and bind from
kube-scheduler only (see `docs/extender.md`). With `alpn`, the handshake offers those application
protocols (the extender's verbs: HTTP/2 and HTTP/1.1, `serving.http2`).

`HealthTls` says how a component serves its health port (/healthz, /readyz, /metrics, /debug, whose
bearer tokens must not cross the network in the clear): TLS with a pair of files (followed as they
are renewed), a self-signed pair made at start when none is given (as kube-scheduler's secure port
does without --tls-cert-file), or plain HTTP only when asked for.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sharegpu.core import errors
from sharegpu.serving import certs

log = logging.getLogger(__name__)


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A TLS server context (1.2 and later) serving the pair in these files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    # No TLS 1.3 session tickets: kube-scheduler's extender client and kube-apiserver's webhook
    # client keep no session cache, so a ticket is never used, and issuing the two that OpenSSL
    # sends by default (they carry the client certificate) cost more than the rest of the
    # handshake here (~1.5 of ~2.6 ms of server CPU per connection, OpenSSL 3.0).
    context.num_tickets = 0
    return context


class ReloadingTls:
    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None, alpn: tuple[str, ...] = ()) -> None:
        self.cert = cert
        self.alpn = alpn
        self.key = key
        self.client_ca = client_ca
        self.reloads = 0
        try:
            self._stamp = self._stamps()
            self._current = self._load()
            self.context = self._load()
        except (OSError, ssl.SSLError) as exc:
            raise errors.InvalidInputError(f"TLS certificate {cert} / key {key}: {exc}") from None
        self.context.sni_callback = self._pick

    def _stamps(self) -> tuple[float, ...]:
        files = [self.cert, self.key] + ([self.client_ca] if self.client_ca else [])
        return tuple(os.stat(f).st_mtime_ns for f in files)

    def _load(self) -> ssl.SSLContext:
        context = server_context(self.cert, self.key)
        if self.alpn:
            context.set_alpn_protocols(list(self.alpn))
        if self.client_ca is not None:
            context.load_verify_locations(cafile=self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def current(self) -> ssl.SSLContext:
        try:
            stamp = self._stamps()
            if stamp != self._stamp:
                self._current = self._load()
                self._stamp = stamp
                self.reloads += 1
                log.info("TLS certificate reloaded from %s", self.cert)
        except (OSError, ssl.SSLError) as exc:  # half-written files: keep serving the old pair
            log.warning("TLS certificate reload failed, keeping the previous one: %s", exc)
        return self._current

    def _pick(self, sock: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        sock.context = self.current()


@dataclass(frozen=True, slots=True)
class HealthTls:
    """How a health port is served (module docstring): `cert` and `key` (together), a self-signed
    pair (neither), or plain HTTP (`plain`, with neither)."""

    cert: Path | None = None
    key: Path | None = None
    plain: bool = False

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise errors.InvalidInputError("--health-cert and --health-key go together")
        if self.plain and self.cert is not None:
            raise errors.InvalidInputError("--plain-health serves no certificate: drop --health-cert and --health-key")

    @property
    def scheme(self) -> str:
        return "http" if self.plain else "https"

    def context(self) -> ssl.SSLContext | None:
        """The server context (None: plain HTTP); a self-signed pair is made now when none is given."""
        if self.plain:
            return None
        if self.cert is not None and self.key is not None:
            return ReloadingTls(self.cert, self.key).context
        return self_signed()


SELF_SIGNED: Final = HealthTls()
"""TLS with a self-signed pair: the components' default."""

SELF_SIGNED_NAMES: tuple[tuple[str, ...], tuple[str, ...]] = (("localhost",), ("127.0.0.1",))
"""The DNS names and addresses of a self-signed health certificate (its clients do not verify it)."""


def self_signed() -> ssl.SSLContext:
    """A server context with a fresh pair signed by a throw-away CA (kept in memory only: the files
    are read and removed at once)."""
    ca_cert, ca_key = certs.new_ca("sharegpu-health-self-signed")
    dns, ips = SELF_SIGNED_NAMES
    cert, key = certs.issue_serving(ca_cert, ca_key, "sharegpu-health", dns_names=dns, ip_addresses=ips)
    with tempfile.TemporaryDirectory(prefix="sharegpu-health-") as folder:
        return server_context(*certs.write_pair(Path(folder), cert, key))
