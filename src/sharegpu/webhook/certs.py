"""Certificates and keys: a private CA and serving certificates (the webhook's bootstrap mode and the
local test control plane), and the service-account signing key of the test control plane."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


@dataclass(frozen=True, slots=True)
class Bundle:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def issue_serving(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common: str,
    days: int = 30,
    dns_names: tuple[str, ...] = (),
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A serving certificate for 127.0.0.1, localhost and `dns_names`, signed by the CA."""
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_bundle(folder: Path) -> Bundle:
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("sharegpu-test-ca"))
        .issuer_name(_name("sharegpu-test-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    serving, serving_key = issue_serving(ca_cert, ca_key, "kube-apiserver")
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    bundle = Bundle(
        ca_cert=folder / "ca.crt",
        ca_key=folder / "ca.key",
        serving_cert=folder / "apiserver.crt",
        serving_key=folder / "apiserver.key",
        sa_key=folder / "sa.key",
        sa_pub=folder / "sa.pub",
    )
    bundle.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(bundle.ca_key, ca_key)
    bundle.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    _write_key(bundle.serving_key, serving_key)
    _write_key(bundle.sa_key, sa_key)
    bundle.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return bundle


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def new_ca(common: str = "sharegpu-ca", days: int = 365) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def write_serving_pair(
    folder: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, dns_names: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """tls.crt and tls.key in `folder` for a fresh serving certificate; written atomically (rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = issue_serving(ca_cert, ca_key, "sharegpu-webhook", days=365, dns_names=dns_names)
    cert_path, key_path = folder / "tls.crt", folder / "tls.key"
    for path, data in (
        (key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())),
        (cert_path, pem(cert)),
    ):  # fmt: skip
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(data)
        temporary.chmod(0o600)
        temporary.replace(path)
    return cert_path, key_path
