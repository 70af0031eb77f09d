"""Who we are to the API server, kept current: kubeconfig or in-cluster credentials that follow
their files.

Credentials change under a running process: the kubelet rotates projected service-account tokens
(the token file is replaced about hourly), cert-manager renews client certificates, and exec
plugins hand out tokens that expire. So nothing here is read once: `Credentials.current()` checks
(at most once per `check_interval`) whether any file it came from changed (the kubeconfig files,
the token file, the CA, the client certificate and key) and re-reads them if so; exec tokens are
fetched again before they expire; and `refresh()`, called by the client after a 401, forces all of
that at once. The TLS material carries a `generation` that changes whenever the certificates do, so
the transport knows to open new connections; a new token alone keeps the generation (and so the
connections, with the watches open on them).

Supported: kubeconfig `server`, `certificate-authority(-data)`, `insecure-skip-tls-verify`,
`tls-server-name`, `token`, `tokenFile`, `client-certificate(-data)`, `client-key(-data)`, `exec`
(client.authentication.k8s.io v1 and v1beta1), and in-cluster service-account credentials.
Several files in $KUBECONFIG are merged as kubectl merges them (`Kubeconfig`: the first file that
defines a cluster, user or context name wins; current-context from the first file that sets one).
`auth-provider` plugins and basic auth are refused with a message saying so, and so is a field of the
wrong kind (a `contexts` that is not a list, a `server` that is not an absolute http(s) URL, an
`insecure-skip-tls-verify` that is not a boolean), naming the field and the file.

Hand-written rather than kubernetes-asyncio's loader: that one reads a token once into a frozen
configuration (the defect this module exists to fix), and the package costs 48 MB and ~0.9 s of
import for these ~250 lines.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import os
import ssl
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from sharegpu.core import errors

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
Clock = Callable[[], float]


class CredentialsError(errors.InvalidInputError):
    """A kubeconfig or in-cluster setup that cannot be used; the message says what is missing."""


@dataclass(frozen=True, slots=True)
class ExecPlugin:
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    api_version: str = "client.authentication.k8s.io/v1"


@dataclass(frozen=True, slots=True)
class Settings:
    """What one kubeconfig context (or the in-cluster environment) says."""

    server: str
    ca_file: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    server_name: str | None = None
    token: str | None = None
    token_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None
    exec_plugin: ExecPlugin | None = None
    origins: tuple[str, ...] = ()
    """The kubeconfig files these came from (watched for changes), if any."""

    def files(self) -> tuple[str, ...]:
        return (*self.origins, *(f for f in (self.ca_file, self.token_file, self.cert_file, self.key_file) if f))


@dataclass(frozen=True, slots=True)
class Tls:
    context: ssl.SSLContext | None
    """None for plain http."""
    server_name: str | None
    generation: int


@dataclass
class _State:
    settings: Settings
    stamps: dict[str, tuple[int, int, int]]
    token: str | None = None
    exec_cert: tuple[bytes, bytes] | None = None
    expires: float | None = None
    """Monotonic time an exec token expires (None: does not)."""
    tls: Tls | None = None
    temporary: list[str] = field(default_factory=list)


def _tls_inputs(state: _State) -> tuple[object, ...]:
    """Everything the TLS context is made from (settings, and the stamps of its files)."""
    s = state.settings
    files = tuple(state.stamps.get(f) for f in (s.ca_file, s.cert_file, s.key_file) if f)
    return (s.server, s.ca_file, s.ca_data, s.insecure, s.server_name, s.cert_file, s.key_file,
            s.cert_data, s.key_data, s.exec_plugin, files)  # fmt: skip


def _stamp(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Credentials:
    """Credentials that follow their sources; see the module docstring."""

    def __init__(
        self, loader: Callable[[], Settings], *, clock: Clock = time.monotonic, check_interval: float = 1.0
    ) -> None:
        self._loader = loader
        self._clock = clock
        self._interval = check_interval
        self._checked = -float("inf")
        self._lock = asyncio.Lock()
        self._generation = 0
        self.reloads = 0
        self._state = self._load()

    @property
    def server(self) -> str:
        return self._state.settings.server.rstrip("/")

    def _load(self) -> _State:
        settings = self._loader()
        state = _State(settings, {f: _stamp(f) for f in settings.files()})
        if settings.token_file:
            try:
                state.token = Path(settings.token_file).read_text().strip() or None
            except OSError as exc:
                raise CredentialsError(f"token file {settings.token_file}: {exc.strerror}") from None
        else:
            state.token = settings.token
        return state

    def _changed(self) -> bool:
        return any(_stamp(f) != stamp for f, stamp in self._state.stamps.items())

    async def _reload(self) -> None:
        old = self._state
        self._state = self._load()
        self.reloads += 1
        if old.tls is not None and _tls_inputs(old) == _tls_inputs(self._state):
            # A new token alone (the kubelet's hourly rotation) keeps the TLS material, and so the
            # transport's connections and every watch open on them.
            self._state.tls = old.tls
            self._state.exec_cert = old.exec_cert
            self._state.temporary = old.temporary
            return
        for path in old.temporary:
            Path(path).unlink(missing_ok=True)

    async def _ensure(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._checked < self._interval:
            state = self._state
            if state.expires is None or now < state.expires:
                return
        async with self._lock:
            self._checked = now
            if force or self._changed():
                await self._reload()
            state = self._state
            plugin = state.settings.exec_plugin
            if plugin is not None and (
                force or state.token is None or (state.expires is not None and now >= state.expires)
            ):
                await self._run_exec(plugin, now)

    async def _run_exec(self, plugin: ExecPlugin, now: float) -> None:
        """Run the exec plugin and take its token (and client certificate, if it gives one)."""
        env = {**os.environ, **dict(plugin.env)}
        env["KUBERNETES_EXEC_INFO"] = orjson.dumps(
            {"apiVersion": plugin.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        ).decode()
        try:
            process = await asyncio.create_subprocess_exec(
                plugin.command, *plugin.args, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        except OSError as exc:
            raise CredentialsError(f"exec credential plugin {plugin.command!r} failed to run: {exc}") from None
        try:
            async with asyncio.timeout(60):
                out, err = await process.communicate()
        except TimeoutError:
            process.kill()
            await process.wait()
            raise CredentialsError(f"exec credential plugin {plugin.command!r} did not answer in 60 s") from None
        if process.returncode != 0:
            raise CredentialsError(
                f"exec credential plugin {plugin.command!r} exited with {process.returncode}: "
                f"{err.decode(errors='replace')[:300]}"
            )
        try:
            status = (orjson.loads(out) or {}).get("status") or {}
        except orjson.JSONDecodeError:
            raise CredentialsError(f"exec credential plugin {plugin.command!r} did not print JSON") from None
        state = self._state
        state.token = status.get("token") or None
        cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
        fresh = (cert.encode(), key.encode()) if cert and key else None
        if fresh != state.exec_cert:
            state.exec_cert = fresh
            state.tls = None
        state.expires = None
        expiry = status.get("expirationTimestamp")
        if expiry:
            try:
                at = datetime.datetime.fromisoformat(str(expiry).replace("Z", "+00:00"))
                remaining = (at - datetime.datetime.now(datetime.UTC)).total_seconds()
                state.expires = now + max(0.0, remaining - 10.0)
            except ValueError:
                state.expires = now + 60.0
        if state.token is None and state.exec_cert is None:
            raise CredentialsError(
                f"exec credential plugin {plugin.command!r} returned neither a token nor a certificate"
            )

    async def authorization(self) -> str | None:
        """The Authorization header value to send now, or None."""
        await self._ensure()
        token = self._state.token
        return f"Bearer {token}" if token else None

    async def tls(self) -> Tls:
        """The TLS client context to connect with now (a new `generation` after any change)."""
        await self._ensure()
        state = self._state
        if state.tls is None:
            self._generation += 1
            state.tls = Tls(self._context(state), state.settings.server_name, self._generation)
        return state.tls

    async def refresh(self) -> None:
        """After a 401: re-read every source and run the exec plugin again."""
        await self._ensure(force=True)

    def _context(self, state: _State) -> ssl.SSLContext | None:
        s = state.settings
        if not s.server.startswith("https"):
            return None
        try:
            context = ssl.create_default_context(cadata=s.ca_data.decode() if s.ca_data else None)
            if s.ca_file:
                try:
                    context.load_verify_locations(cafile=s.ca_file)
                except OSError as exc:
                    raise CredentialsError(f"certificate-authority {s.ca_file}: {exc.strerror or exc}") from None
            if s.insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            pair = state.exec_cert or ((s.cert_data, s.key_data) if s.cert_data and s.key_data else None)
            if pair is not None:
                cert_path, key_path = self._write_private(state, pair)
                context.load_cert_chain(cert_path, key_path)
            elif s.cert_file and s.key_file:
                context.load_cert_chain(s.cert_file, s.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise CredentialsError(f"TLS settings for {s.server}: {exc}") from None
        return context

    @staticmethod
    def _write_private(state: _State, pair: tuple[bytes, bytes]) -> tuple[str, str]:
        """ssl loads client certificates from files only: write inline data to private temporary files."""
        paths = []
        for data in pair:
            handle, path = tempfile.mkstemp(prefix="sharegpu-cred-")
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            state.temporary.append(path)
            paths.append(path)
        return paths[0], paths[1]


# ----------------------------------------------------------------- sources


def _b64(value: Any, what: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError:
        raise CredentialsError(f"{what} is not valid base64") from None


def _relative(base: Path, value: Any) -> str:
    path = Path(str(value)).expanduser()
    return str(path if path.is_absolute() else base.parent / path)


def _listed(value: Any, what: str, path: Path) -> list[Any]:
    """`value` as the list the kubeconfig field `what` must be (absent: empty)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise CredentialsError(f"kubeconfig {path}: {what} is not a list")
    return value


_SECTIONS: tuple[str, ...] = ("clusters", "users", "contexts")


def _document(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CredentialsError(f"kubeconfig {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise CredentialsError(f"kubeconfig {path} is not valid YAML: {exc}") from None
    if doc is None:
        return {}  # an empty file: nothing defined (kubectl reads it so)
    if not isinstance(doc, dict):
        raise CredentialsError(f"kubeconfig {path} is not a mapping")
    return doc


@dataclass(frozen=True, slots=True)
class Kubeconfig:
    """One or more kubeconfig files merged as kubectl merges $KUBECONFIG: for clusters, users and
    contexts the first file that defines a name wins; current-context is the first file's that sets one.
    Each entry remembers its file (relative paths in it are relative to that file)."""

    files: tuple[Path, ...]
    current: str | None
    entries: Mapping[str, Mapping[str, tuple[dict[str, Any], Path]]]
    """section ("clusters", "users", "contexts") -> name -> (its body, the file that defined it)."""

    @classmethod
    def read(cls, given: Path | tuple[Path, ...]) -> Kubeconfig:
        files = (given,) if isinstance(given, Path) else given
        current: str | None = None
        entries: dict[str, dict[str, tuple[dict[str, Any], Path]]] = {section: {} for section in _SECTIONS}
        for path in files:
            doc = _document(path)
            if current is None and doc.get("current-context"):
                current = str(doc["current-context"])
            for section in _SECTIONS:
                for item in _listed(doc.get(section), section, path):
                    if isinstance(item, dict) and item.get("name") is not None:
                        body = item.get(section[:-1])
                        entries[section].setdefault(str(item["name"]), (body if isinstance(body, dict) else {}, path))
        return cls(files, current, entries)

    @property
    def where(self) -> str:
        return os.pathsep.join(str(f) for f in self.files)

    def context(self, context: str | None) -> tuple[str, dict[str, Any], Path]:
        """The context's name, body and file (`context`, else current-context)."""
        chosen = context or self.current
        if not chosen:
            raise CredentialsError(f"kubeconfig {self.where} has no current-context; name one")
        body, path = self.named("contexts", chosen)
        return chosen, body, path

    def named(self, section: str, name: str) -> tuple[dict[str, Any], Path]:
        found = self.entries[section].get(name)
        if found is None:
            raise CredentialsError(f"{self.where}: no {section[:-1]} named {name!r}")
        return found

    def namespace(self, context: str | None = None) -> str | None:
        """The namespace the context names (None: it names none)."""
        chosen, body, path = self.context(context)
        namespace = body.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise CredentialsError(f"kubeconfig {path}: context {chosen!r}: namespace {namespace!r} is not a string")
        return namespace or None


def _server(value: Any, cluster: str, path: Path) -> str:
    """The cluster's `server`, which must be an absolute http(s) URL."""
    server = str(value)
    try:
        parts = urllib.parse.urlsplit(server)
        fine = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, or out of range
        fine = False
    if not fine:
        raise CredentialsError(
            f"kubeconfig {path}: cluster {cluster!r}: server {server!r} is not an http(s) URL (https://HOST[:PORT])"
        )
    return server


def _flag(value: Any, what: str, path: Path) -> bool:
    if not isinstance(value, bool):
        raise CredentialsError(f"kubeconfig {path}: {what} is {value!r}, not true or false")
    return value


def parse_kubeconfig(files: Path | tuple[Path, ...], context: str | None = None) -> Settings:
    """The settings of `context` (default: current-context) in the kubeconfig file, or the files merged
    (`Kubeconfig`)."""
    config = Kubeconfig.read(files)
    _, ctx, _ = config.context(context)
    cluster, cluster_file = config.named("clusters", str(ctx.get("cluster")))
    user, path = config.named("users", str(ctx.get("user"))) if ctx.get("user") else ({}, cluster_file)
    if not cluster.get("server"):
        raise CredentialsError(f"kubeconfig {cluster_file}: cluster {ctx.get('cluster')!r} has no server")
    server = _server(cluster["server"], str(ctx.get("cluster")), cluster_file)
    if user.get("auth-provider"):
        raise CredentialsError(f"kubeconfig {path}: auth-provider plugins are not supported; use exec")
    if user.get("username") or user.get("password"):
        raise CredentialsError(f"kubeconfig {path}: basic authentication is not supported")
    plugin = None
    if isinstance(user.get("exec"), dict):
        spec = user["exec"]
        if not spec.get("command"):
            raise CredentialsError(f"kubeconfig {path}: exec needs a command")
        plugin = ExecPlugin(
            command=str(spec["command"]),
            args=tuple(str(a) for a in _listed(spec.get("args"), "exec args", path)),
            env=tuple(
                (str(e.get("name")), str(e.get("value")))
                for e in _listed(spec.get("env"), "exec env", path)
                if isinstance(e, dict)
            ),
            api_version=str(spec.get("apiVersion") or "client.authentication.k8s.io/v1"),
        )
    return Settings(
        server=server,
        ca_file=_relative(cluster_file, cluster["certificate-authority"])
        if cluster.get("certificate-authority")
        else None,
        ca_data=_b64(cluster["certificate-authority-data"], "certificate-authority-data")
        if cluster.get("certificate-authority-data")
        else None,
        insecure=_flag(cluster.get("insecure-skip-tls-verify", False), "insecure-skip-tls-verify", cluster_file),
        server_name=str(cluster["tls-server-name"]) if cluster.get("tls-server-name") else None,
        token=str(user["token"]) if user.get("token") else None,
        token_file=_relative(path, user["tokenFile"]) if user.get("tokenFile") else None,
        cert_file=_relative(path, user["client-certificate"]) if user.get("client-certificate") else None,
        key_file=_relative(path, user["client-key"]) if user.get("client-key") else None,
        cert_data=_b64(user["client-certificate-data"], "client-certificate-data")
        if user.get("client-certificate-data")
        else None,
        key_data=_b64(user["client-key-data"], "client-key-data") if user.get("client-key-data") else None,
        exec_plugin=plugin,
        origins=tuple(str(f) for f in config.files),
    )


def in_cluster(environ: Mapping[str, str] = os.environ, folder: Path = SERVICE_ACCOUNT) -> Settings:
    """The pod's service account: the API server from the environment, the token file (rotated by
    the kubelet) and the cluster CA."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise CredentialsError(
            "no kubeconfig given, none at $KUBECONFIG or ~/.kube/config, and not running in a pod "
            "(KUBERNETES_SERVICE_HOST is not set)"
        )
    if ":" in host:
        host = f"[{host}]"
    return Settings(server=f"https://{host}:{port}", ca_file=str(folder / "ca.crt"), token_file=str(folder / "token"))


def locate(kubeconfig: str | None, environ: Mapping[str, str] = os.environ) -> tuple[Path, ...]:
    """The kubeconfig files to use: the one given, else every file of $KUBECONFIG that exists (merged
    as kubectl merges them: `Kubeconfig`), else ~/.kube/config; none: in-cluster."""
    if kubeconfig:
        return (Path(kubeconfig).expanduser(),)
    listed: list[Path] = []
    for candidate in (environ.get("KUBECONFIG") or "").split(os.pathsep):
        path = Path(candidate).expanduser()
        if candidate and path.is_file() and path not in listed:
            listed.append(path)
    if listed:
        return tuple(listed)
    default = Path(environ.get("HOME", str(Path.home()))) / ".kube" / "config"
    return (default,) if default.is_file() else ()


def load(kubeconfig: str | None = None, context: str | None = None, *, clock: Clock = time.monotonic) -> Credentials:
    """Credentials from a kubeconfig (given, $KUBECONFIG's files or ~/.kube/config), else in-cluster."""
    files = locate(kubeconfig)
    if not files:
        return Credentials(in_cluster, clock=clock)
    return Credentials(lambda: parse_kubeconfig(files, context), clock=clock)


def static(
    server: str, *, token: str | None = None, token_file: str | None = None, ca_file: str | None = None
) -> Credentials:
    """Credentials given directly (tests, the local control plane)."""
    settings = Settings(server=server, token=token, token_file=token_file, ca_file=ca_file)
    return Credentials(lambda: settings)
