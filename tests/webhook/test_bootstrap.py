"""The bootstrap PKI across its expiry, the clock passed in: the serving certificate is issued again
once a third of its life is left, so the one on disk (which the serving context reloads) is never
expired at any moment; a new CA goes into the bundle beside the old one until the old one expires."""

from __future__ import annotations

import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from sharegpu.webhook import bootstrap

DAY = 86_400.0
T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def signed(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def on_disk(folder: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())


def test_the_serving_certificate_is_never_expired_while_the_webhook_runs(tmp_path: Path) -> None:
    clock = Clock()
    pki = bootstrap.Bootstrap(tmp_path, ("sharegpu-webhook.sharegpu-system.svc",), (), clock=clock,
                              ca_days=30, serving_days=9)  # fmt: skip
    assert pki.renew(), "the first bundle is news"
    first = on_disk(tmp_path)
    issued = {first.serial_number}
    for hour in range(0, 40 * 24):  # every hour for 40 days: past the CA's life too
        clock.now = T0 + hour * 3600.0
        changed = pki.renew()
        served = on_disk(tmp_path)
        issued.add(served.serial_number)
        assert served.not_valid_before_utc.timestamp() <= clock.now < served.not_valid_after_utc.timestamp(), hour
        trusted = list(x509.load_pem_x509_certificates(pki.bundle))
        assert any(signed(served, c) and c.not_valid_after_utc.timestamp() > clock.now for c in trusted), hour
        if changed:
            assert len(trusted) in (1, 2), "the old CA beside the new one, until it expires"
    assert len(issued) >= 40 // 6, "issued again about every six days (a third of nine left)"
    ssl.create_default_context(cadata=pki.bundle.decode())  # a bundle a client loads


def test_nothing_is_issued_again_before_it_is_due(tmp_path: Path) -> None:
    clock = Clock()
    pki = bootstrap.Bootstrap(tmp_path, ("localhost",), ("127.0.0.1",), clock=clock)
    pki.renew()
    first = on_disk(tmp_path)
    clock.now = T0 + 59 * DAY
    assert not pki.renew() and on_disk(tmp_path).serial_number == first.serial_number
    clock.now = T0 + 61 * DAY  # 29 of 90 days left
    assert not pki.renew(), "a new serving certificate, the same CA: the bundle stands"
    assert on_disk(tmp_path).serial_number != first.serial_number
