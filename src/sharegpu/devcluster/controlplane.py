"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler of the version `k8s_version()` names, built by `scripts/build-controlplane` and
started here as child processes.

Every component gets its own identity (static tokens) so RBAC is exercised for real: `admin` is in
system:masters; the scheduler runs as system:kube-scheduler; the extender, webhook and controller
run as the user names of their ServiceAccounts (`names.account_user`), so the chart's RBAC bindings
and admission policies apply to them unchanged. The in-process agents of many fake nodes share one
harness identity with the agent's ClusterRole (`NODE_HARNESS`): a real agent's token is bound to its
pod and node, which a static token cannot be, so the node-scoped policies do not bind the harness;
tests of those policies use tokens that TokenRequest binds to a pod (`stack.issue_token`).

Not for production: certificates are throw-away and tokens sit in a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from sharegpu.api import names
from sharegpu.serving import certs

DEFAULT_VERSION = "1.37.2"
"""The Kubernetes release the suite runs on unless SHAREGPU_K8S_VERSION names another."""
OLDEST_VERSION = "1.32.2"
"""The oldest release the chart admits; scripts/test runs part of the suite on it too."""


def k8s_version() -> str:
    return os.environ.get("SHAREGPU_K8S_VERSION") or DEFAULT_VERSION


REPO_ROOT = Path(__file__).resolve().parents[3]
_PACKAGED = Path(__file__).resolve().parents[1] / "_data"


def data_path(relative: str) -> Path:
    """A shipped file: from the installed package's data, or from the source checkout."""
    packaged = _PACKAGED / relative.removeprefix("scripts/")
    return packaged if packaged.exists() else REPO_ROOT / relative


class ControlPlaneError(RuntimeError):
    """The control plane could not be built or started."""


@dataclass(frozen=True, slots=True)
class Identity:
    user: str
    token: str
    groups: tuple[str, ...] = ()
    alias: str = ""
    """A short name tests and the stack ask for it by (`sharegpu-extender` for its ServiceAccount's user)."""


NODE_HARNESS = "sharegpu-node-harness"
"""The user the in-process agents of the devcluster's fake nodes share (the agent's ClusterRole)."""


def _component(component: str) -> Identity:
    return Identity(
        names.account_user(component), f"{component}-token", names.account_groups(component), names.account(component)
    )


IDENTITIES = (
    Identity("admin", "admin-token", ("system:masters",)),
    Identity("system:kube-scheduler", "scheduler-token"),
    Identity("system:kube-controller-manager", "controller-manager-token", ("system:masters",)),
    _component("extender"),
    _component("webhook"),
    _component("controller"),
    Identity(NODE_HARNESS, "agent-token", (), names.account("agent")),
    Identity("sharegpu-harness", "harness-token", ("system:masters",)),
    Identity("alice", "alice-token", ("tenants",)),
    Identity("bob", "bob-token", ("tenants",)),
)


SERVICE_RANGE = "10.0.0.0/24"
"""The Services' addresses."""
KUBERNETES_SERVICE = "10.0.0.1"
"""The `kubernetes` Service's address (the first of SERVICE_RANGE), as pods call the API server."""


def host_address() -> str:
    """This machine's address on its default route (no packet is sent): what pods in containers reach
    the API server by."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        return str(s.getsockname()[0])


KUBELET_DISK: Final = (
    "evictionHard: {memory.available: 100Mi, nodefs.available: 1Gi, nodefs.inodesFree: 1%, imagefs.available: 1Gi, "
    "imagefs.inodesFree: 1%}\nimageGCHighThresholdPercent: 100\nimageGCLowThresholdPercent: 99\n"
)
"""The kubelets' disk settings on a machine they share (see `ControlPlane.start_kubelet`)."""


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_HANDED_OUT: set[int] = set()
_PICK = random.SystemRandom()  # not the test runner's seeded generator: processes must not pick alike


def _ephemeral_low() -> int:
    """Where the kernel's range for outgoing connections' ports begins (Linux: 32768 by default)."""
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 nothing is bound to now, not handed out before by this process, and below
    the ephemeral range: a port the kernel chose (bind to 0) comes from that range, where the stack's
    own outgoing connections may take it before the component binds it (an extender failed to start
    so, with `address already in use`)."""
    low = _ephemeral_low()
    if low > 11000:
        for _ in range(200):
            port = _PICK.randrange(10000, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range: the kernel's
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


def binaries(build: bool = True, version: str | None = None) -> Path:
    """The folder with the control plane binaries, building them if needed (minutes, once)."""
    explicit = os.environ.get("SHAREGPU_K8S_BIN")
    if explicit:
        return Path(explicit)
    version = version or k8s_version()
    script = data_path("scripts/build-controlplane")
    if not script.is_file():
        raise ControlPlaneError(f"{script} not found; set SHAREGPU_K8S_BIN to a folder with the binaries")
    if not build:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sharegpu" / f"k8s-v{version}"
        return cache / "bin"
    done = subprocess.run(["bash", str(script), version], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ControlPlaneError(f"building the control plane failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass
class ControlPlane:
    workdir: Path
    bin_dir: Path
    identities: tuple[Identity, ...] = IDENTITIES
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    port: int = 0
    bundle: certs.Bundle | None = None
    version: str = field(default_factory=k8s_version)
    """The Kubernetes release of the binaries (the chart is rendered for it)."""
    feature_gates: tuple[str, ...] = ()
    """`Name=true|false` feature gates given to every component (API server, controller manager,
    schedulers, kubelets), e.g. `GenericWorkload=true`."""
    runtime_config: tuple[str, ...] = ()
    """API versions the API server serves beyond its defaults (`--runtime-config`), e.g.
    `scheduling.k8s.io/v1beta1=true`."""
    pod_network: bool = False
    """Pods in real containers call the API server (`devcluster.containerd` nodes): it then listens on
    every address, advertises this machine's (`host_address`) as the `kubernetes` Service's endpoint,
    its certificate names that Service, and the ServiceAccount admission plugin gives pods their
    tokens; `start_kube_proxy` routes Service addresses. Otherwise loopback only and no tokens in pods
    (the fake nodes run no process that would read one)."""

    # ----------------------------------------------------------------- addresses and credentials

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def identity(self, user: str) -> Identity:
        """The identity of `user` (its user name, or its alias)."""
        for identity in self.identities:
            if user in (identity.user, identity.alias):
                return identity
        raise KeyError(user)

    def token(self, user: str) -> str:
        return self.identity(user).token

    def kubeconfig(self, user: str) -> Path:
        """A kubeconfig file for `user` (written once)."""
        user = self.identity(user).user
        return self.token_kubeconfig(user, self.token(user))

    def token_kubeconfig(self, user: str, token: str) -> Path:
        """A kubeconfig file named for `user` that presents `token` (a ServiceAccount's, say), written
        once; `kubeconfig` for the control plane's own identities."""
        assert self.bundle is not None
        path = self.workdir / "kubeconfigs" / f"{user.replace(':', '_')}.yaml"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            config = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {"server": self.url, "certificate-authority": str(self.bundle.ca_cert)},
                    }
                ],
                "users": [{"name": user, "user": {"token": token}}],
                "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
                "current-context": "local",
            }
            path.write_text(json.dumps(config))  # JSON is valid YAML
        return path

    # ----------------------------------------------------------------- life cycle

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        names = ("kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")
        self.bundle = (
            certs.make_bundle(self.workdir / "pki", dns_names=names, ip_addresses=(KUBERNETES_SERVICE, host_address()))
            if self.pod_network
            else certs.make_bundle(self.workdir / "pki")
        )
        tokens = self.workdir / "tokens.csv"
        tokens.write_text("".join(f'{i.token},{i.user},{i.user},"{",".join(i.groups)}"\n' for i in self.identities))
        etcd_port, peer_port = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer_port}",
                "--log-level",
                "warn",
            ],
        )
        self.port = free_port()
        b = self.bundle
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--secure-port={self.port}",
                *(
                    ["--bind-address=0.0.0.0", f"--advertise-address={host_address()}"]
                    if self.pod_network
                    else ["--bind-address=127.0.0.1"]
                ),
                f"--tls-cert-file={b.serving_cert}",
                f"--tls-private-key-file={b.serving_key}",
                f"--client-ca-file={b.ca_cert}",
                # The kubelets by their InternalIP (no DNS here knows the nodes' names), as a superuser.
                f"--kubelet-client-certificate={b.kubelet_client_cert}",
                f"--kubelet-client-key={b.kubelet_client_key}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--service-account-key-file={b.sa_pub}",
                f"--service-account-signing-key-file={b.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                # As kubeadm and the managed offerings run it: the chart's agent is privileged.
                "--allow-privileged=true",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                *([] if self.pod_network else ["--disable-admission-plugins=ServiceAccount"]),
                "--enable-priority-and-fairness=false",
                *self._gates(),
                *([f"--runtime-config={','.join(self.runtime_config)}"] if self.runtime_config else []),
                "--max-requests-inflight=2000",
                "--max-mutating-requests-inflight=1000",
                "--v=0",
            ],
        )
        self.wait_ready()
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig('system:kube-controller-manager')}",
                "--leader-elect=false",
                "--secure-port=0",
                "--controllers=*,-nodelifecycle,-serviceaccount-token",
                f"--service-account-private-key-file={b.sa_key}",
                f"--root-ca-file={b.ca_cert}",
                "--use-service-account-credentials=false",
                "--kube-api-qps=500",
                "--kube-api-burst=1000",
                *self._gates(),
                "--v=0",
            ],
        )

    def _gates(self, extra: tuple[str, ...] = ()) -> list[str]:
        """The `--feature-gates` flag for `feature_gates` and then `extra` (a later gate wins)."""
        gates = dict(g.split("=", 1) for g in (*self.feature_gates, *extra))
        return [f"--feature-gates={','.join(f'{k}={v}' for k, v in gates.items())}"] if gates else []

    def start_scheduler(
        self, config: Path, name: str = "kube-scheduler", binary: Path | None = None, extra: tuple[str, ...] = ()
    ) -> None:
        """kube-scheduler with `config` (and `extra` arguments); or another scheduler built on its
        framework (`binary`: a peer's, for bench/peers.py), with the same flags."""
        argv = [str(binary or self.bin_dir / "kube-scheduler"), f"--config={config}", "--secure-port=0", "--v=1"]
        gates = tuple(g for a in extra if a.startswith("--feature-gates=") for g in a.split("=", 1)[1].split(","))
        rest = [a for a in extra if not a.startswith("--feature-gates=")]
        self._spawn(name, [*argv, *self._gates(gates), *rest])

    def start_default_scheduler(self) -> str:
        """The cluster's own kube-scheduler (profile default-scheduler), which places the pods no other
        scheduler is named for (the chart's components among them). Returns the process's name."""
        config = self.workdir / "default-scheduler.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(self.kubeconfig("system:kube-scheduler"))},
            "leaderElection": {"leaderElect": False},
        }))  # fmt: skip
        self.start_scheduler(config, name="default-scheduler")
        return "default-scheduler"

    def start_peer(self, name: str, argv: list[str]) -> None:
        """A peer's own process that is not built on kube-scheduler's framework (HAMi's extender, for
        bench/peers.py), as the cluster's admin: KUBECONFIG names the admin's kubeconfig."""
        self._spawn(name, ["env", f"KUBECONFIG={self.kubeconfig('admin')}", *argv])

    def start_kube_proxy(self, cluster_cidr: str) -> str:
        """kube-proxy (iptables) for this machine, as the cluster's admin: every test node shares the
        machine's network namespace, so one serves them all, routing Service addresses to pods and to
        the API server, for pods and for this machine's processes (the API server calling a webhook).
        Every Service's traffic is masqueraded (pods of one node's bridge reach each other through a
        Service too); conntrack's sysctls are left alone. Returns the process's name."""
        address = host_address()
        self._spawn(
            "kube-proxy",
            [
                str(self.bin_dir / "kube-proxy"),
                f"--kubeconfig={self.kubeconfig('admin')}",
                "--proxy-mode=iptables", f"--cluster-cidr={cluster_cidr}", "--masquerade-all",
                f"--hostname-override={socket.gethostname()}", f"--bind-address={address}",
                "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
                f"--healthz-bind-address=127.0.0.1:{free_port()}", f"--metrics-bind-address=127.0.0.1:{free_port()}",
                "--v=2",
            ],
        )  # fmt: skip
        return "kube-proxy"

    @property
    def has_kubelet(self) -> bool:
        """The kubelet was built with the control plane (the suite's version: scripts/build-controlplane)."""
        return (self.bin_dir / "kubelet").is_file()

    def start_kubelet(
        self,
        node: str,
        root_dir: Path,
        runtime_endpoint: str,
        labels: dict[str, str],
        *,
        cgroup_root: str = "",
        enter: tuple[str, ...] = (),
        root_seen_as: Path | None = None,
    ) -> str:
        """A real kubelet (as the cluster's admin) registering `node`, with its state under `root_dir`
        and the container runtime at `runtime_endpoint`. Flags for a machine without systemd: cgroup v1
        allowed (1.37 refuses it by default), no node allocatable enforcement, swap allowed, only a
        random port served. With the project's fake CRI no cgroups at all; with `cgroup_root` (a real
        runtime) per-pod cgroups under that cgroup of its own (`containerd.make_cgroup` it first), so that
        kubelets side by side do not share one; `enter` prefixes its command (a node's mount namespace,
        `containerd.MountNamespace`), in which it finds `root_dir` at `root_seen_as`. Returns the
        process's name (for `stop_process` and `log`)."""
        name = f"kubelet-{node}"
        assert self.bundle is not None, "start the control plane first"
        root_dir.mkdir(parents=True, exist_ok=True)
        # What has no flag: the pods' logs stay under root_dir, the machine's firewall is left alone, and
        # the disk is not the node's own: the kubelet's default thresholds are shares of the filesystem
        # (DiskPressure below 15% free for images, garbage collection of images above 85% used), which a
        # machine shared with builds crosses, and then every pod but the DaemonSets' is refused (Failed,
        # Evicted) or an imported image deleted. Absolute floors instead.
        config = root_dir / "kubelet.yaml"
        config.write_text(
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"
            f"podLogsDir: {root_dir / 'logs'}\nmakeIPTablesUtilChains: false\n{KUBELET_DISK}"
        )
        cgroups = ["--cgroups-per-qos=true", f"--cgroup-root={cgroup_root}"] if cgroup_root else [
            "--cgroups-per-qos=false"]  # fmt: skip
        self._spawn(
            name,
            [
                *enter,
                str(self.bin_dir / "kubelet"),
                f"--kubeconfig={self.kubeconfig('admin')}",
                f"--config={config}",
                f"--hostname-override={node}",
                f"--root-dir={root_seen_as or root_dir}",
                f"--cert-dir={root_dir / 'pki'}",
                f"--client-ca-file={self.bundle.ca_cert}",  # the API server's calls (logs, exec)
                f"--container-runtime-endpoint={runtime_endpoint}",
                f"--node-labels={','.join(f'{k}={v}' for k, v in sorted(labels.items()))}",
                "--fail-cgroupv1=false", "--fail-swap-on=false", *cgroups,
                "--enforce-node-allocatable=", "--cgroup-driver=cgroupfs",
                f"--port={free_port()}", "--read-only-port=0", "--healthz-port=0",
                *self._gates(), "--v=2",
            ],
        )  # fmt: skip
        return name

    def stop_process(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = self.processes.pop(name, None)
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def restart(self, name: str, *, down_for: float = 0.0, sig: int = signal.SIGKILL) -> None:
        """Kill one component (SIGKILL by default, as a crash) and start it again with the same
        arguments after `down_for` seconds; waits for the API server when it is the one restarted."""
        argv = self.argv[name]
        self.stop_process(name, sig)
        time.sleep(down_for)
        self._spawn(name, argv)
        if name in ("kube-apiserver", "etcd"):
            self.wait_ready(timeout=120)

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            self.stop_process(name)
        if "kube-proxy" in self.argv:  # its rules outlive it
            subprocess.run(
                [str(self.bin_dir / "kube-proxy"), "--cleanup"], capture_output=True, check=False, timeout=60
            )
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)  # logs stay for post-mortems

    def log(self, name: str) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.argv[name] = argv
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        with (logs / f"{name}.log").open("ab") as handle:  # the child keeps its own copy of the descriptor
            self.processes[name] = subprocess.Popen(
                argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.bundle is not None
        context = ssl.create_default_context(cafile=str(self.bundle.ca_cert))
        request = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": "Bearer admin-token"})
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            process = self.processes.get("kube-apiserver")
            if process is not None and process.poll() is not None:
                raise ControlPlaneError(f"kube-apiserver exited:\n{self.log('kube-apiserver')[-3000:]}")
            try:
                with urllib.request.urlopen(request, context=context, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise ControlPlaneError(f"kube-apiserver not ready after {timeout:.0f} s ({last})")
