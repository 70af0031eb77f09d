"""Credentials follow their files: kubeconfig parsing, rotated token files and certificates,
exec plugins with expiry, in-cluster service accounts, and clear errors for what is unsupported."""

from __future__ import annotations

import base64
import datetime
import json
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import trustme

from sharegpu.kube import credentials
from tests.builders import Clock


def kubeconfig(folder: Path, user: Mapping[str, object], cluster: Mapping[str, object] | None = None) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }
    path = folder / "config"
    path.write_text(json.dumps(doc))
    return path


def touch_later(path: Path, text: str) -> None:
    """Rewrite a file so that its stamp surely changes (mtime resolution can be coarse)."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


async def test_a_rotated_token_file_is_read_again(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    clock = Clock()
    creds = credentials.Credentials(
        lambda: credentials.parse_kubeconfig(kubeconfig(tmp_path, {"tokenFile": "token"})), clock=clock
    )
    assert await creds.authorization() == "Bearer first"
    touch_later(token, "second")
    assert await creds.authorization() == "Bearer first", "files are checked at most once per interval"
    clock.advance(1.5)
    assert await creds.authorization() == "Bearer second"
    touch_later(token, "third")
    await creds.refresh()
    assert await creds.authorization() == "Bearer third", "a 401 forces the check"


async def test_rotated_client_certificates_open_new_connections(tmp_path: Path) -> None:
    ca = trustme.CA()
    first = ca.issue_cert("alice")
    cert, key = tmp_path / "c.crt", tmp_path / "c.key"
    first.cert_chain_pems[0].write_to_path(str(cert))
    first.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    clock = Clock()
    config = kubeconfig(
        tmp_path,
        {"client-certificate": "c.crt", "client-key": "c.key"},
        {"server": "https://127.0.0.1:6443", "certificate-authority": "ca.crt"},
    )
    creds = credentials.Credentials(lambda: credentials.parse_kubeconfig(config), clock=clock)
    tls = await creds.tls()
    assert tls.context is not None and (await creds.tls()).generation == tls.generation
    second = ca.issue_cert("alice")
    before = cert.stat().st_mtime_ns
    second.cert_chain_pems[0].write_to_path(str(cert))
    second.private_key_pem.write_to_path(str(key))
    os.utime(cert, ns=(before + 10**9, before + 10**9))
    clock.advance(2)
    assert (await creds.tls()).generation == tls.generation + 1


async def test_a_new_token_keeps_the_connections(tmp_path: Path) -> None:
    """The kubelet rewrites the token file about hourly: that must not open new connections (and
    so drop every watch open on the old ones); a new CA must."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    token = tmp_path / "token"
    token.write_text("first")
    clock = Clock()
    config = kubeconfig(
        tmp_path, {"tokenFile": "token"}, {"server": "https://127.0.0.1:6443", "certificate-authority": "ca.crt"}
    )
    creds = credentials.Credentials(lambda: credentials.parse_kubeconfig(config), clock=clock)
    tls = await creds.tls()
    touch_later(token, "second")
    clock.advance(2)
    assert await creds.authorization() == "Bearer second"
    assert await creds.tls() is tls, "same TLS material, same generation"
    touch_later(tmp_path / "ca.crt", trustme.CA().cert_pem.bytes().decode())
    clock.advance(2)
    assert (await creds.tls()).generation == tls.generation + 1


async def test_inline_data_and_tls_server_name(tmp_path: Path) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("bob")
    user = {
        "client-certificate-data": base64.b64encode(leaf.cert_chain_pems[0].bytes()).decode(),
        "client-key-data": base64.b64encode(leaf.private_key_pem.bytes()).decode(),
    }
    cluster = {
        "server": "https://10.0.0.1:443",
        "certificate-authority-data": base64.b64encode(ca.cert_pem.bytes()).decode(),
        "tls-server-name": "kubernetes.default.svc",
    }
    creds = credentials.Credentials(lambda: credentials.parse_kubeconfig(kubeconfig(tmp_path, user, cluster)))
    tls = await creds.tls()
    assert tls.context is not None and tls.server_name == "kubernetes.default.svc"
    assert await creds.authorization() is None


async def test_exec_plugins_are_run_again_when_their_token_expires(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    plugin = tmp_path / "plugin.py"
    soon = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M:%SZ")
    plugin.write_text(
        "import json, os, pathlib\n"
        f"p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n))\n"
        "assert json.loads(os.environ['KUBERNETES_EXEC_INFO'])['kind'] == 'ExecCredential'\n"
        f"print(json.dumps({{'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',"
        f" 'status': {{'token': f'tok-{{n}}', 'expirationTimestamp': {soon!r}}}}}))\n"
    )
    plugin.chmod(plugin.stat().st_mode | stat.S_IEXEC)
    clock = Clock()
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable, "args": [str(plugin)]}}
    creds = credentials.Credentials(lambda: credentials.parse_kubeconfig(kubeconfig(tmp_path, user)), clock=clock)
    assert await creds.authorization() == "Bearer tok-1"
    assert await creds.authorization() == "Bearer tok-1"
    clock.advance(55)  # the token expires in 60 s; it is renewed 10 s early
    assert await creds.authorization() == "Bearer tok-2"


async def test_an_exec_plugin_that_fails_says_why(tmp_path: Path) -> None:
    user = {
        "exec": {"command": sys.executable, "args": ["-c", "import sys; sys.stderr.write('no login'); sys.exit(3)"]}
    }
    creds = credentials.Credentials(lambda: credentials.parse_kubeconfig(kubeconfig(tmp_path, user)))
    with pytest.raises(credentials.CredentialsError, match="exited with 3: no login"):
        await creds.authorization()


def test_in_cluster_settings(tmp_path: Path) -> None:
    settings = credentials.in_cluster(
        {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path
    )
    assert settings.server == "https://10.0.0.1:443"
    assert settings.token_file == str(tmp_path / "token")
    with pytest.raises(credentials.CredentialsError, match="not running in a pod"):
        credentials.in_cluster({}, tmp_path)


@pytest.mark.parametrize(
    ("user", "message"),
    [
        ({"auth-provider": {"name": "gcp"}}, "auth-provider plugins are not supported"),
        ({"username": "a", "password": "b"}, "basic authentication is not supported"),
        ({"client-certificate-data": "%%%"}, "client-certificate-data is not valid base64"),
    ],
)
def test_unsupported_or_broken_kubeconfigs_are_refused_clearly(
    tmp_path: Path, user: dict[str, object], message: str
) -> None:
    with pytest.raises(credentials.CredentialsError, match=message):
        credentials.parse_kubeconfig(kubeconfig(tmp_path, user))


SERVER = "https://127.0.0.1:6443"


@pytest.mark.parametrize(
    ("top", "cluster", "user", "message"),
    [
        ({"contexts": 5}, {}, {}, r"kubeconfig .*config: contexts is not a list"),
        ({"clusters": {"c": {}}}, {}, {}, r"kubeconfig .*config: clusters is not a list"),
        ({"users": "u"}, {}, {}, r"kubeconfig .*config: users is not a list"),
        ({}, {"server": "127.0.0.1:6443"}, {}, r"cluster 'c': server '127.0.0.1:6443' is not an http\(s\) URL"),
        ({}, {"server": "https://h:port"}, {}, r"server 'https://h:port' is not an http\(s\) URL"),
        ({}, {"server": "https://h:99999"}, {}, r"server 'https://h:99999' is not an http\(s\) URL"),
        ({}, {"insecure-skip-tls-verify": "false"}, {}, r"insecure-skip-tls-verify is 'false', not true or false"),
        ({}, {}, {"exec": {"command": "get-token", "args": 5}}, r"exec args is not a list"),
        ({}, {}, {"exec": {"command": "get-token", "env": {"A": "b"}}}, r"exec env is not a list"),
    ],
)
def test_a_malformed_kubeconfig_is_refused_naming_the_field_and_the_file(
    tmp_path: Path, top: dict[str, object], cluster: dict[str, object], user: dict[str, object], message: str
) -> None:
    path = kubeconfig(tmp_path, user or {"token": "t"}, {"server": SERVER, **cluster})
    path.write_text(json.dumps({**json.loads(path.read_text()), **top}))
    with pytest.raises(credentials.CredentialsError, match=message):
        credentials.parse_kubeconfig(path)


async def test_a_missing_certificate_authority_file_is_named(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"token": "t"}, {"server": "https://127.0.0.1:6443", "certificate-authority": "ca.crt"})
    creds = credentials.Credentials(lambda: credentials.parse_kubeconfig(path))
    with pytest.raises(
        credentials.CredentialsError, match=f"certificate-authority {tmp_path / 'ca.crt'}: No such file"
    ):
        await creds.tls()


def test_the_files_of_kubeconfig_are_merged_as_kubectl_merges_them(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "config", tmp_path / "b" / "config"
    first.write_text(json.dumps({
        "clusters": [{"name": "c", "cluster": {"server": "https://first:6443"}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    second.write_text(json.dumps({
        "current-context": "ctx",
        "clusters": [{"name": "c", "cluster": {"server": "https://second:6443"}},
                     {"name": "d", "cluster": {"server": "https://d:6443", "certificate-authority": "ca.crt"}}],
        "users": [{"name": "u", "user": {"tokenFile": "token"}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "d"}}, {"name": "other", "context": {"cluster": "d"}}],
    }))  # fmt: skip
    environ = {"KUBECONFIG": os.pathsep.join([str(tmp_path / "gone"), str(first), str(second), str(first)]),
               "HOME": str(tmp_path)}  # fmt: skip
    files = credentials.locate(None, environ)
    assert files == (first, second), "every file that exists, once, in order"
    settings = credentials.parse_kubeconfig(files)
    # current-context from the second (the first sets none); the context and cluster c from the first,
    # the user from the second, its token file relative to the second.
    assert settings.server == "https://first:6443"
    assert settings.token_file == str(tmp_path / "b" / "token")
    assert settings.files()[:2] == (str(first), str(second)), "both files are watched"
    other = credentials.parse_kubeconfig(files, "other")
    assert (other.server, other.ca_file) == ("https://d:6443", str(tmp_path / "b" / "ca.crt"))
    with pytest.raises(credentials.CredentialsError, match=f"{first}:{second}: no context named 'nope'"):
        credentials.parse_kubeconfig(files, "nope")
    assert credentials.locate("given", environ) == (Path("given"),), "--kubeconfig names one file"


def test_a_missing_token_file_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(credentials.CredentialsError, match=r"token file .*: No such file"):
        credentials.Credentials(lambda: credentials.parse_kubeconfig(kubeconfig(tmp_path, {"tokenFile": "gone"})))
