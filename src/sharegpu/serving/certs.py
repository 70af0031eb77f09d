"""Certificates and keys: a private CA, serving certificates for the names a server is reached by,
client certificates (kube-scheduler calling the extender), and the local control plane's bundle.

A serving certificate carries exactly the DNS names and IP addresses asked for: a webhook reached
through its Service needs `sharegpu-webhook.sharegpu-system.svc` in it, or every TLS handshake
fails and, with failurePolicy Fail, so does every pod creation in the cluster.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sharegpu.core import errors

Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True, slots=True)
class Bundle:
    """The local control plane's PKI: CA, API server certificate, service-account key pair, and the
    API server's client certificate for the kubelets (logs, exec, port-forward)."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path
    kubelet_client_cert: Path
    kubelet_client_key: Path


def _key_bytes(key: Key | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write atomically (a reader never sees half a file) with the given mode."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    temporary.chmod(mode)
    temporary.replace(path)


def _name(common: str, groups: Sequence[str] = ()) -> x509.Name:
    """CN `common`, and an O per group (how Kubernetes reads a client certificate's groups)."""
    organizations = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
    return x509.Name([*organizations, x509.NameAttribute(NameOID.COMMON_NAME, common)])


def subject_names(dns_names: Sequence[str], ip_addresses: Sequence[str]) -> list[x509.GeneralName]:
    """SAN entries; InvalidInputError for an address that is not one, or for no names at all."""
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys(dns_names)]
    for text in dict.fromkeys(ip_addresses):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(text)))
        except ValueError:
            raise errors.InvalidInputError(f"{text!r} is not an IP address") from None
    if not names:
        raise errors.InvalidInputError("a serving certificate needs at least one DNS name or IP address")
    return names


def new_ca(
    common: str = "sharegpu-ca", days: int = 365, at: datetime.datetime | None = None
) -> tuple[x509.Certificate, Key]:
    """A CA valid `days` from `at` (now)."""
    now = at or datetime.datetime.now(datetime.UTC)
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
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca_cert: x509.Certificate,
    ca_key: Key,
    common: str,
    days: int,
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName] | None,
    at: datetime.datetime | None = None,
    groups: Sequence[str] = (),
) -> tuple[x509.Certificate, Key]:
    now = at or datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common, groups))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def issue_serving(
    ca_cert: x509.Certificate,
    ca_key: Key,
    common: str,
    *,
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    days: int = 365,
    at: datetime.datetime | None = None,
) -> tuple[x509.Certificate, Key]:
    """A serving certificate for exactly `dns_names` and `ip_addresses`, signed by the CA, valid
    `days` from `at` (now)."""
    names = subject_names(dns_names, ip_addresses)
    return _leaf(ca_cert, ca_key, common, days, ExtendedKeyUsageOID.SERVER_AUTH, names, at)


def issue_client(
    ca_cert: x509.Certificate, ca_key: Key, common: str, days: int = 365, groups: Sequence[str] = ()
) -> tuple[x509.Certificate, Key]:
    """A client certificate (e.g. kube-scheduler's, to call the extender), of user `common` in `groups`."""
    return _leaf(ca_cert, ca_key, common, days, ExtendedKeyUsageOID.CLIENT_AUTH, None, groups=groups)


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_pair(folder: Path, cert: x509.Certificate, key: Key, stem: str = "tls") -> tuple[Path, Path]:
    """`<stem>.crt` and `<stem>.key` in `folder`, each written atomically (the key first)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
    _write(key_path, _key_bytes(key))
    _write(cert_path, pem(cert), 0o644)
    return cert_path, key_path


def write_serving_pair(
    folder: Path,
    ca_cert: x509.Certificate,
    ca_key: Key,
    *,
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    common: str = "sharegpu-webhook",
) -> tuple[Path, Path]:
    """tls.crt and tls.key in `folder` for a fresh serving certificate for the given names."""
    cert, key = issue_serving(ca_cert, ca_key, common, dns_names=dns_names, ip_addresses=ip_addresses)
    return write_pair(folder, cert, key)


def write_ca(folder: Path, common: str) -> tuple[x509.Certificate, Key, Path]:
    """A new CA; its certificate goes to `folder`/ca.crt (the key stays in memory)."""
    cert, key = new_ca(common)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ca.crt"
    _write(path, pem(cert), 0o644)
    return cert, key, path


def make_bundle(folder: Path, *, dns_names: Sequence[str] = (), ip_addresses: Sequence[str] = ()) -> Bundle:
    """The local control plane's PKI (throw-away: not for production); the API server's certificate
    is for localhost and 127.0.0.1, and the names and addresses given."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = new_ca("sharegpu-test-ca", days=30)
    serving, serving_key = issue_serving(
        ca_cert, ca_key, "kube-apiserver", dns_names=("localhost", *dns_names),
        ip_addresses=("127.0.0.1", *ip_addresses), days=30,
    )  # fmt: skip
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    # As kubeadm's apiserver-kubelet-client: the kubelets authorise it (a superuser) through the API server.
    kubelet_client, kubelet_client_key = issue_client(
        ca_cert, ca_key, "kube-apiserver-kubelet-client", days=30, groups=("system:masters",)
    )
    bundle = Bundle(
        ca_cert=folder / "ca.crt",
        ca_key=folder / "ca.key",
        serving_cert=folder / "apiserver.crt",
        serving_key=folder / "apiserver.key",
        sa_key=folder / "sa.key",
        sa_pub=folder / "sa.pub",
        kubelet_client_cert=folder / "apiserver-kubelet-client.crt",
        kubelet_client_key=folder / "apiserver-kubelet-client.key",
    )
    _write(bundle.kubelet_client_cert, pem(kubelet_client), 0o644)
    _write(bundle.kubelet_client_key, _key_bytes(kubelet_client_key))
    _write(bundle.ca_cert, pem(ca_cert), 0o644)
    _write(bundle.ca_key, _key_bytes(ca_key))
    _write(bundle.serving_cert, pem(serving), 0o644)
    _write(bundle.serving_key, _key_bytes(serving_key))
    _write(bundle.sa_key, _key_bytes(sa_key))
    _write(
        bundle.sa_pub,
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        0o644,
    )
    return bundle
