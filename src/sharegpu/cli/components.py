"""The long-running components, one command each: `extender`, `controller`, `agent`, and `reserve` (what a
reservation pod runs). The admission webhook's command is in `webhook`.

Each command configures logging, checks its options before anything starts (bad ones end in one line,
`sharegpu: error: ...`, exit status 2), then serves until stopped. The components' modules are
imported only by their command, so that `sharegpu simulate` never loads the network stack.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from sharegpu.agent import host
from sharegpu.api import cdi, usage
from sharegpu.cli.boundary import UsageError, reported
from sharegpu.cli.logs import LogFormatOption, LogLevelOption, configure
from sharegpu.cli.options import (
    ELECTION,
    Compat,
    HealthCert,
    HealthKey,
    Identity,
    Kubeconfig,
    LeaseDuration,
    MetricsAuth,
    PlainHealth,
    RenewDeadline,
    RetryPeriod,
    complete_policy,
    election,
    health_endpoint,
)
from sharegpu.core import errors, policy_names

ViolationAction = Literal["report", "kill", "evict"]
"""The agent's `--on-violation`: the values of `agent.watchdog.Action` (a test keeps them equal)."""


def serve(main: Coroutine[Any, Any, None]) -> None:
    """Run a long-lived server on uvloop: its event loop and TLS handling cost a fraction of
    asyncio's, which is most of what the extender spends per pod (bench/e2e_throughput.py)."""
    import uvloop

    uvloop.run(main)


def extender(
    kubeconfig: Kubeconfig = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="Port of filter/prioritize/bind (kube-scheduler calls it).")] = 8888,
    health_port: Annotated[int, typer.Option(help="Port of /healthz, /readyz, /metrics and /debug.")] = 8889,
    policy: Annotated[
        str, typer.Option(help="Placement policy (see `sharegpu policies`).", autocompletion=complete_policy)
    ] = policy_names.DEFAULT,
    image: Annotated[
        str, typer.Option(help="Image of reservation pods (runs `sharegpu reserve`).")
    ] = "sharegpu:latest",
    narrow: Annotated[bool, typer.Option(help="Filter answers only the chosen node.")] = True,
    preemption: Annotated[
        bool, typer.Option(help="A GPU pod that fits nowhere preempts GPU pods of lower priority.")
    ] = True,
    shapes_from: Annotated[
        Path | None,
        typer.Option(
            help="openb pod CSV whose popular shapes FGD assumes.", show_default="learned from the cluster's pods"
        ),
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="Serving certificate for the scheduler port (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Serving key (PEM).")] = None,
    client_ca: Annotated[
        Path | None, typer.Option(help="Accept filter/prioritize/bind only with a client certificate from this CA.")
    ] = None,
    leader_elect: Annotated[
        bool, typer.Option(help="Run the background reconcilers only while holding the sharegpu-extender Lease.")
    ] = True,
    follow_scheduler: Annotated[
        bool,
        typer.Option(
            help="Lead while the kube-scheduler of this pod holds the sharegpu-extender Lease, not campaigning "
            "for it (the chart: the two share a pod and a Lease; --identity's pod part, the hostname by default, "
            "names the pod)."
        ),
    ] = False,
    lease_duration: LeaseDuration = ELECTION.terms.lease_duration,
    renew_deadline: RenewDeadline = ELECTION.terms.renew_deadline,
    retry_period: RetryPeriod = ELECTION.terms.retry_period,
    identity: Identity = ELECTION.identity,
    reservation_idle: Annotated[
        float, typer.Option(help="Seconds a reservation pod with no sharers is kept before it is deleted.", min=0)
    ] = 3.0,
    assume_ttl: Annotated[
        float, typer.Option(help="Seconds before an assumed placement whose binding never shows up is checked.")
    ] = 30.0,
    dra_fence: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds a new Lease holder's DRA allocator waits before its first write (the previous "
            "holder's writes land or fail meanwhile).",
        ),
    ] = 20.0,
    health_cert: HealthCert = None,
    health_key: HealthKey = None,
    plain_health: PlainHealth = False,
    metrics_auth: MetricsAuth = True,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run the kube-scheduler extender (filter, prioritize, bind) and its reconcilers."""
    from sharegpu.extender import runtime
    from sharegpu.sim import trace

    configure(log_level, log_format)
    with reported():
        from sharegpu.core import policies

        policies.check(policy)
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together")
        if client_ca is not None and tls_cert is None:
            raise UsageError("--client-ca needs --tls-cert and --tls-key")
        elected = election(lease_duration, renew_deadline, retry_period, identity)
        if assume_ttl <= 0:
            raise UsageError(f"--assume-ttl must be > 0, got {assume_ttl:g}")
        for path in (tls_cert, tls_key, client_ca):
            if path is not None and not path.is_file():
                raise UsageError(f"{path}: no such file")
        shapes = trace.load_pods(shapes_from).typical_shapes() if shapes_from else None
        health = health_endpoint(host, health_port, health_cert, health_key, plain_health, metrics_auth)
    options = runtime.Options(
        kubeconfig=kubeconfig, host=host, port=port, health_port=health, policy=policy, image=image,
        narrow=narrow, shapes=shapes, tls_cert=tls_cert, tls_key=tls_key, client_ca=client_ca,
        leader_elect=leader_elect, follow_scheduler=follow_scheduler, election=elected,
        reservation_idle=reservation_idle, assume_ttl=assume_ttl, preemption=preemption, dra_fence=dra_fence,
    )  # fmt: skip
    with reported():
        serve(runtime.serve(options))


def controller(
    kubeconfig: Kubeconfig = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    health_port: Annotated[int, typer.Option(help="Port of /healthz, /readyz, /metrics and /debug.")] = 8890,
    leader_elect: Annotated[
        bool, typer.Option(help="Reconcile only while holding the sharegpu-controller Lease.")
    ] = True,
    lease_duration: LeaseDuration = ELECTION.terms.lease_duration,
    renew_deadline: RenewDeadline = ELECTION.terms.renew_deadline,
    retry_period: RetryPeriod = ELECTION.terms.retry_period,
    identity: Identity = ELECTION.identity,
    write_every: Annotated[
        float, typer.Option(help="Seconds between status writes of a budget whose usage moves.")
    ] = 30.0,
    image: Annotated[str, typer.Option(help="Image of the group holder pods (it runs `sharegpu reserve`).")] = (
        "sharegpu:latest"
    ),
    compat: Annotated[
        list[Compat] | None,
        typer.Option(help="Serve another system's resources too (their CRDs installed; repeat)."),
    ] = None,
    defrag: Annotated[
        bool,
        typer.Option(
            "--defrag",
            help="Defragment: evict (Eviction API) the fewest pods that a controller recreates elsewhere so that "
            "pending GPU pods fit (docs/defrag.md).",
        ),
    ] = False,
    defrag_dry_run: Annotated[
        bool,
        typer.Option("--defrag-dry-run", help="Run the defragmenter but only report its plans (log, events, metrics)."),
    ] = False,
    defrag_budget_per_hour: Annotated[
        int,
        typer.Option("--defrag-budget-per-hour", help="The most evictions the defragmenter makes in any hour.", min=0),
    ] = 10,
    definitions_every: Annotated[
        float,
        typer.Option(
            "--definitions-every",
            help="Seconds between reads of the installed CustomResourceDefinitions, held against this release's.",
            min=1,
        ),
    ] = 60.0,
    health_cert: HealthCert = None,
    health_key: HealthKey = None,
    plain_health: PlainHealth = False,
    metrics_auth: MetricsAuth = True,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run the controller: GPU-time budgets, shared device groups, other systems' resources (--compat), and the
    defragmenter (--defrag)."""
    from sharegpu.controller import runtime

    configure(log_level, log_format)
    with reported():
        elected = election(lease_duration, renew_deadline, retry_period, identity)
        if write_every <= 0:
            raise UsageError(f"--write-every must be > 0, got {write_every}")
        if defrag and defrag_dry_run:
            raise UsageError("--defrag evicts and --defrag-dry-run only reports: give one of them")
        health = health_endpoint(host, health_port, health_cert, health_key, plain_health, metrics_auth)
    options = runtime.Options(
        kubeconfig=kubeconfig, health_port=health, leader_elect=leader_elect, election=elected,
        write_every=write_every, image=image,
        compat=frozenset(c.value for c in compat or ()), defrag=defrag, defrag_dry_run=defrag_dry_run,
        defrag_budget_per_hour=defrag_budget_per_hour, definitions_every=definitions_every,
    )  # fmt: skip
    with reported():
        serve(runtime.serve(options))


def reserve(
    kubeconfig: Annotated[str | None, typer.Option(help="kubeconfig file.", show_default="in-cluster")] = None,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run inside a reservation pod: report the GPU the device plugin gave it, then hold it."""
    from sharegpu.agent import reserve as reserve_mod

    configure(log_level, log_format)
    with reported(errors.InvalidInputError):
        asyncio.run(reserve_mod.main(kubeconfig))


# The agent's options about isolation (MPS, HAMi-core, the probe that proves them) and its enforcement,
# declared apart so that `agent` reads as a whole.
Mps = Annotated[
    bool, typer.Option("--mps", help="Run and supervise an MPS control daemon per GPU (isolation mode mps).")
]
MpsBinary = Annotated[str, typer.Option(help="The MPS control daemon to run (a name on PATH or a path).")]
MpsRoot = Annotated[Path, typer.Option(help="Host folder of the daemons' pipe and log folders (pods mount it).")]
HamiCoreLibrary = Annotated[
    str, typer.Option(help="HAMi-core's library: the node offers hami-core while it exists ('': never).")
]
HamiCoreDir = Annotated[
    Path, typer.Option(help="Host folder the library is installed in for containers (the webhook mounts it).")
]
HamiCoreEnforcesCompute = Annotated[
    bool,
    typer.Option(
        "--hami-core-enforces-compute",
        help="Say that this node's HAMi-core enforces compute shares (only where scripts/gpu-check measured it).",
    ),
]
IsolationProbe = Annotated[
    bool,
    typer.Option(
        help="Offer hami-core and mps only after a probe proved here that they enforce a memory limit "
        "(off, or with --fake-nvml: offered unproven, and the Device says so)."
    ),
]
ProbeLibcuda = Annotated[
    str, typer.Option(help="The driver library the probe loads (a name the loader finds, or a path).")
]
Dra = Annotated[
    bool,
    typer.Option(
        "--dra",
        help="Serve sharegpu's DRA claims on this node: publish its GPUs as a ResourceSlice and serve the "
        "kubelet's DRA plugin (docs/dra.md).",
    ),
]
Volumes = Annotated[
    bool,
    typer.Option(
        help="Serve the kubelet's CSI plugin that binds sharing pods' node folders (their GPU's MPS tenant "
        "folder, HAMi-core's library) into their volumes, read-only; off: such pods of the extender path "
        "cannot start here (docs/isolation.md).",
    ),
]
KubeletPluginsDir = Annotated[
    Path, typer.Option(help="Where the kubelet's plugin sockets go (each plugin's own folder under it).")
]
KubeletRegistryDir = Annotated[Path, typer.Option(help="The kubelet's plugin registration folder (it watches it).")]
CdiDir = Annotated[
    Path, typer.Option(help="With --dra: where the CDI specs of prepared claims go (the runtime reads it).")
]
ProbeDir = Annotated[Path, typer.Option(help="A writable folder of the probe's own (its HAMi-core accounting file).")]
OnViolation = Annotated[
    ViolationAction,
    typer.Option(
        case_sensitive=False,
        help="When a pod uses more GPU memory than allocated, or a GPU it was not given: "
        "report (an event), kill (its processes) or evict (the pod).",
    ),
]


def agent(
    node: Annotated[str, typer.Option(help="This node's name (in a DaemonSet: the downward API's spec.nodeName).")],
    fake_nvml: Annotated[
        Path | None,
        typer.Option(
            help="Read GPUs from this file instead of NVML (docs/agent.md: its format); a test node's fake "
            "NVIDIA runtime names it in the environment, as the real one gives the container NVML.",
            envvar="SHAREGPU_FAKE_NVML",
        ),
    ] = None,
    kubeconfig: Kubeconfig = None,
    interval: Annotated[float, typer.Option(help="Seconds between inventory passes.", min=0.5)] = 10.0,
    mps: Mps = False,
    mps_binary: MpsBinary = host.MPS_BINARY,
    mps_root: MpsRoot = host.MPS_ROOT,
    hami_core_library: HamiCoreLibrary = str(host.HAMI_CORE_LIBRARY),
    hami_core_dir: HamiCoreDir = host.HAMI_CORE_DIR,
    hami_core_enforces_compute: HamiCoreEnforcesCompute = False,
    isolation_probe: IsolationProbe = True,
    probe_libcuda: ProbeLibcuda = host.LIBCUDA,
    probe_dir: ProbeDir = host.PROBE_DIR,
    dra: Dra = False,
    volumes: Volumes = True,
    kubelet_plugins_dir: KubeletPluginsDir = host.KUBELET_PLUGINS_DIR,
    kubelet_registry_dir: KubeletRegistryDir = host.KUBELET_REGISTRY_DIR,
    cdi_dir: CdiDir = host.CDI_DIR,
    on_violation: OnViolation = "report",
    slack_mib: Annotated[
        int, typer.Option(help="MiB a pod may exceed its GPU memory by before it violates.", min=0)
    ] = 0,
    proc: Annotated[
        Path, typer.Option(help="The node's /proc (the agent needs the host's PID namespace).")
    ] = host.PROC,
    usage_interval: Annotated[
        float,
        typer.Option(
            help="Write the node's GpuUsage (what its pods use, for `kubectl sharegpu top`) at most this often, "
            "in seconds, and only when it changed (0: never).",
            min=0,
        ),
    ] = 60.0,
    usage_refresh: Annotated[
        float,
        typer.Option(
            help="Write the GpuUsage again once what was written is this many seconds old, changed or not (readers "
            "tell a live agent's steady figures from a dead one's; GPUIdlePolicies count idle time by them).",
            min=1,
        ),
    ] = usage.REFRESH,
    kubelet_socket: Annotated[
        str, typer.Option(help="The kubelet's PodResources socket, for drift repair ('': not checked).")
    ] = str(host.PODRESOURCES_SOCKET),
    host: Annotated[str, typer.Option(help="Address of /healthz, /readyz and /metrics.")] = "0.0.0.0",
    health_port: Annotated[
        int, typer.Option(help="Port of /healthz, /readyz and /metrics (0: none).", min=0, max=65535)
    ] = 9403,
    health_cert: HealthCert = None,
    health_key: HealthKey = None,
    plain_health: PlainHealth = False,
    metrics_auth: MetricsAuth = True,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run the node agent: publish this node's GPUs and the isolation it offers as its Device resource.

    The GPUs come from NVML, or from the file --fake-nvml names; with --mps the agent runs an MPS
    control daemon per GPU."""
    from sharegpu.agent import draplugin, nvml, podresources, proof, watchdog
    from sharegpu.agent import mps as agent_mps
    from sharegpu.agent import runtime as agent_runtime
    from sharegpu.agent import volumes as agent_volumes
    from sharegpu.agent.fakes import nvml as fakenvml

    configure(log_level, log_format)
    source: agent_runtime.Source
    with reported():
        action = watchdog.Action.parse(on_violation)
        health = health_endpoint(host, health_port, health_cert, health_key, plain_health, metrics_auth)
        source = fakenvml.FakeNvml(fake_nvml).open() if fake_nvml is not None else nvml.Nvml().open()
    options = agent_runtime.Options(
        interval=interval, hami_core_library=Path(hami_core_library) if hami_core_library else None,
        hami_core_dir=hami_core_dir, on_violation=action, proc=proc, slack_mib=slack_mib,
        hami_core_compute=hami_core_enforces_compute, dra=dra,
        dra_plugin=(
            draplugin.Paths.under(
                kubelet_plugins_dir, kubelet_registry_dir, cdi_dir, cdi.HostPaths(str(hami_core_dir), str(mps_root))
            )
            if dra
            else None
        ),
        volumes=agent_volumes.Paths.under(kubelet_plugins_dir, kubelet_registry_dir) if volumes else None,
        usage_interval=usage_interval, usage_refresh=usage_refresh,
    )  # fmt: skip
    supervisor = agent_mps.Supervisor(mps_binary, agent_mps.Layout(mps_root), proc=proc) if mps else None
    # A fake NVML has no GPU to probe: its modes are offered unproven.
    prover = proof.Prover(probe_dir, libcuda=probe_libcuda) if isolation_probe and fake_nvml is None else None
    kubelet = podresources.KubeletPodResources(Path(kubelet_socket), 5.0) if kubelet_socket else None
    try:
        with reported():
            serve(agent_runtime.serve(kubeconfig, node, source, options, supervisor=supervisor, kubelet=kubelet,
                                      prover=prover, health_port=health if health_port else None))  # fmt: skip
    except KeyboardInterrupt:
        pass
    finally:
        source.close()
