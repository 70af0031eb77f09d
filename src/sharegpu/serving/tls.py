"""Server-side TLS that follows its files, and optionally requires a client certificate.

`ReloadingTls` serves the certificate and key found at two paths: every TLS handshake checks the
files' modification times and switches to a fresh context when they changed (cert-manager and the
webhook's bootstrap renew certificates in place), so rotation needs no restart; half-written files
keep the previous pair in service. With `client_ca`, a client must present a certificate signed by
that CA or the handshake fails: that is how the extender accepts filter, prioritize and bind from
kube-scheduler only (see `docs/extender.md`). With `alpn`, the handshake offers those application
protocols (the extender's verbs: HTTP/2 and HTTP/1.1, `serving.http2`).
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

from sharegpu.core import errors

log = logging.getLogger(__name__)


class ReloadingTls:
    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None, alpn: tuple[str, ...] = ()) -> None:
        self.cert = cert
        self.alpn = alpn
        self.key = key
        self.client_ca = client_ca
        self.reloads = 0
        self._stamp = self._stamps()
        try:
            self._current = self._load()
            self.context = self._load()
        except (OSError, ssl.SSLError) as exc:
            raise errors.InvalidInputError(f"TLS certificate {cert} / key {key}: {exc}") from None
        self.context.sni_callback = self._pick

    def _stamps(self) -> tuple[float, ...]:
        files = [self.cert, self.key] + ([self.client_ca] if self.client_ca else [])
        return tuple(os.stat(f).st_mtime_ns for f in files)

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        # No TLS 1.3 session tickets: kube-scheduler's extender client and kube-apiserver's webhook
        # client keep no session cache, so a ticket is never used, and issuing the two that OpenSSL
        # sends by default (they carry the client certificate) cost more than the rest of the
        # handshake here (~1.5 of ~2.6 ms of server CPU per connection, OpenSSL 3.0).
        context.num_tickets = 0
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
