"""The commands a person runs by hand: `devcluster` (the whole stack on this machine), `gpu-check` (what
the node side relies on, measured on this GPU machine) and `defrag` (plan the evictions that would let
pending GPU pods fit, evicting nothing)."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypeVar

import orjson
import typer
from rich.table import Table

from sharegpu.cli.boundary import UsageError, console, reported
from sharegpu.cli.logs import configure
from sharegpu.cli.options import Compat, Kubeconfig, Runtime, complete_policy
from sharegpu.core import errors, policy_names

if TYPE_CHECKING:
    from sharegpu.agent.tools.gpucheck import Report
    from sharegpu.core.devices import NodeInventory
    from sharegpu.devcluster.realcluster import RealCluster
    from sharegpu.devcluster.stack import Stack


def devcluster(
    nodes: Annotated[int, typer.Option(help="Fake GPU nodes to create.", min=1, max=5000)] = 4,
    gpus: Annotated[int, typer.Option(help="GPUs per node.", min=1, max=63)] = 4,
    model: Annotated[str, typer.Option(help="GPU model of every node.")] = "A100",
    gpu_memory: Annotated[int, typer.Option(help="GPU memory in MiB.")] = 81920,
    policy: Annotated[
        str, typer.Option(help="Placement policy of the extender.", autocompletion=complete_policy)
    ] = policy_names.DEFAULT,
    workdir: Annotated[
        Path | None, typer.Option(help="Where to keep state and logs.", show_default="a new temporary folder")
    ] = None,
    webhook: Annotated[
        bool, typer.Option(help="Run the admission webhook too (translates other systems' GPU requests).")
    ] = True,
    controller: Annotated[bool, typer.Option(help="Run the controller too (GPU-time budgets).")] = True,
    compat: Annotated[
        list[Compat] | None,
        typer.Option(help="Serve another system's resources too (CRDs installed, controller told; repeat)."),
    ] = None,
    dra: Annotated[
        bool,
        typer.Option(
            "--dra",
            help="Try the DRA path: the nodes serve claims of sharegpu's DeviceClass (ResourceSlices), and GPU "
            "pods in any format become claims (Kubernetes 1.36 or later; docs/quickstart.md).",
        ),
    ] = False,
    runtime: Annotated[
        Runtime,
        typer.Option(
            help="The nodes' container runtime. fake: no container runs, thousands of nodes; containerd: "
            "containerd and runc under the real kubelet (run as root; a few nodes), and sharegpu installed by its "
            "chart from the image scripts/build-image builds, every component in its container.",
        ),
    ] = Runtime.FAKE,
    feature_gates: Annotated[
        str,
        typer.Option(
            help="Feature gates of every Kubernetes component (K=V,...), e.g. GenericWorkload=true for Kubernetes' "
            "own gangs (docs/gangs.md)."
        ),
    ] = "",
    runtime_config: Annotated[
        str,
        typer.Option(help="API versions the API server also serves (K=V,...), e.g. scheduling.k8s.io/v1beta1=true."),
    ] = "",
) -> None:
    """Run the whole stack on this machine until Ctrl-C, and print the kubeconfig to use with kubectl.

    The stack: a real control plane, the extender, kube-scheduler, the admission webhook, the
    controller, and fake GPU nodes with an agent each."""
    import tempfile

    from sharegpu.devcluster import stack

    configure("warning")
    with reported():
        from sharegpu.core import policies

        policies.check(policy)
        gates, apis = _pairs(feature_gates, "--feature-gates"), _pairs(runtime_config, "--runtime-config")
        if runtime is Runtime.CONTAINERD:
            if nodes > 8 or gpus > 8:
                raise UsageError(
                    "with --runtime containerd, --nodes and --gpus must be 1..8 (a node is a real kubelet)"
                )
            if compat or not webhook or not controller or gates or apis:
                raise UsageError(
                    "with --runtime containerd the chart installs sharegpu: --compat, --no-webhook, "
                    "--no-controller, --feature-gates and --runtime-config are for the fake runtime"
                )
    folder = workdir or Path(tempfile.mkdtemp(prefix="sharegpu-devcluster-"))
    if runtime is Runtime.CONTAINERD:
        from sharegpu.devcluster import realcluster

        uuids = {f"gpu-node-{n}": tuple(f"GPU-{n}-{i}" for i in range(gpus)) for n in range(nodes)}

        def make_real() -> realcluster.RealCluster:
            return realcluster.RealCluster(folder, uuids, frozenset(uuids) if dra else frozenset())

        with reported(errors.SharegpuError, RuntimeError, OSError):
            asyncio.run(_run_until_stopped(make_real, lambda whole: _bring_up_real(whole, policy)))
        return

    def make_stack() -> stack.Stack:
        compats = tuple(c.value for c in compat or ())
        return stack.Stack(
            folder, policy, webhook=webhook, controller=controller, compat=compats, dra=dra,
            feature_gates=gates, runtime_config=apis,
        )  # fmt: skip

    with reported(errors.SharegpuError, RuntimeError):
        fake = _FakeNodes(nodes, gpus, model, gpu_memory)
        asyncio.run(_run_until_stopped(make_stack, lambda whole: _bring_up(whole, fake, folder)))


def _pairs(text: str, option: str) -> tuple[str, ...]:
    """`K=V,...` as its pairs; UsageError naming `option` for an item that is not one."""
    pairs = tuple(item.strip() for item in text.split(",") if item.strip())
    for item in pairs:
        key, _, value = item.partition("=")
        if not key or not value:
            raise UsageError(f"{option}: {item!r} is not KEY=VALUE")
    return pairs


@dataclasses.dataclass(frozen=True)
class _FakeNodes:
    """The devcluster's fake GPU nodes: `count` alike, each with `gpus` GPUs of `model` and `gpu_memory` MiB."""

    count: int
    gpus: int
    model: str
    gpu_memory: int

    def inventories(self) -> list[NodeInventory]:
        from sharegpu.core import devices

        return [
            devices.uniform_node(
                f"gpu-node-{i}",
                gpu_count=self.gpus,
                model=self.model,
                gpu_memory_mib=self.gpu_memory,
                cpu_milli=64000,
                memory_mib=512 * 1024,
                nvlink_all=self.gpus <= 8,
            )
            for i in range(self.count)
        ]


class _Stoppable(Protocol):
    async def stop(self) -> None: ...


S = TypeVar("S", bound=_Stoppable)


async def _run_until_stopped(make: Callable[[], S], bring_up: Callable[[S], Coroutine[Any, Any, None]]) -> None:
    """Make the cluster, bring it up, then run until SIGINT or SIGTERM.

    Signals are handled from the first moment: Ctrl-C while the control plane starts stops what has
    started, and never leaves a process behind; a start-up failure is reported after the same."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    whole = make()
    starting = asyncio.create_task(bring_up(whole))
    waiting = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a start-up failure is reported, after everything is stopped
            await waiting
    finally:
        for task in (starting, waiting):
            task.cancel()
        await asyncio.gather(starting, waiting, return_exceptions=True)
        await whole.stop()


async def _bring_up(whole: Stack, nodes: _FakeNodes, folder: Path) -> None:
    """Start the stack with its fake GPU nodes, and print how to use it."""
    from sharegpu.api import dra

    await whole.start(harness=True)
    assert whole.harness is not None and whole.extender is not None
    nvml_files = await whole.add_gpu_nodes(nodes.inventories())
    shown = console()
    shown.print(f"[bold]sharegpu devcluster[/bold]: {nodes.count} nodes x {nodes.gpus} {nodes.model}")
    shown.print(f"  agents: one per node; edit its fake NVML file in {nvml_files} (docs/agent.md)")
    if whole.dra:
        shown.print(f"  DRA: the nodes serve claims of DeviceClass {dra.CLASS} (a ResourceSlice each); GPU pods in "
                    "any format become claims, and pods may name the class in their own claims")  # fmt: skip
    shown.print(f"  export KUBECONFIG={whole.plane.kubeconfig('admin')}")
    shown.print(f"  extender: {whole.extender.health_url}/debug/nodes   logs: {folder / 'logs'}")
    if whole.controller is not None:
        shown.print(f"  controller: {whole.controller.health_url}/debug/budgets")
    shown.print(f"  (TLS: curl --cacert {whole.extender.health_pki.ca}, with the admin kubeconfig's token as Bearer)")
    if whole.webhook is not None:
        shown.print(f"  webhook: {whole.webhook.url} (GPU pods in any format are scheduled by sharegpu)")
        shown.print("  Ctrl-C stops everything", highlight=False)
    else:
        shown.print("  pods use schedulerName: sharegpu-scheduler; Ctrl-C stops everything", highlight=False)
    shown.file.flush()


async def _bring_up_real(whole: RealCluster, policy: str) -> None:
    """Start the nodes, install the chart, and print how to use the cluster."""
    from sharegpu.api import dra
    from sharegpu.devcluster import containerd, realcluster

    shown = console()
    shown.print("[bold]sharegpu devcluster --runtime containerd[/bold]: starting (the first run builds "
                "containerd and the image: minutes)")  # fmt: skip
    shown.file.flush()
    await whole.start_nodes()
    # As the fake devcluster's --dra: GPU pods in any format go the DRA way.
    webhook = {"defaultPath": "dra"} if whole.dra else {}
    await whole.install(whole.values(extender={"policy": policy}, webhook=webhook))
    assert whole.plane is not None
    shown.print(f"  nodes: {', '.join(whole.nodes)}, each containerd v{containerd.VERSION} and runc under the real "
                "kubelet, with fake GPUs (device nodes, the NVIDIA device plugin and runtime, faked)")  # fmt: skip
    if whole.dra:
        shown.print(f"  DRA: every node serves claims of DeviceClass {dra.CLASS}; GPU pods in any format become claims")
    shown.print(f"  sharegpu: helm release {realcluster.RELEASE} in {realcluster.SYSTEM}, every component Ready")
    shown.print(f"  export KUBECONFIG={whole.plane.kubeconfig('admin')}")
    shown.print(f"  a shell image for pods: {containerd.BUSYBOX_IMAGE} (imagePullPolicy: Never; nothing can be pulled)")
    shown.print("  Ctrl-C stops everything", highlight=False)
    shown.file.flush()


def gpu_check(
    gpu: Annotated[int, typer.Option(help="Index of the GPU to check (as nvidia-smi numbers them).", min=0)] = 0,
    hami_core_library: Annotated[
        Path | None,
        typer.Option(help="Also check HAMi-core's limits with this library (the operator's own libvgpu.so)."),
    ] = None,
    mps_control: Annotated[str, typer.Option(help="The MPS control daemon to run (a name on PATH or a path).")] = (
        "nvidia-cuda-mps-control"
    ),
    seconds: Annotated[int, typer.Option(help="Seconds each compute measurement runs.", min=5)] = 6,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")] = None,
    libcuda: Annotated[str, typer.Option(help="The driver's CUDA library (a path or a soname).")] = "libcuda.so.1",
) -> None:
    """Check on this GPU machine what sharegpu's node side relies on: NVML, MPS's limits, HAMi-core's.

    Needs the driver and nvidia-smi, no CUDA toolkit; about a minute. Exit status 1 when a check FAILed.
    """
    from sharegpu.agent import nvml
    from sharegpu.agent.tools import gpucheck

    with reported():
        inventory = nvml.Nvml().open()
    options = gpucheck.Options(gpu=gpu, seconds=seconds, hami_core_library=hami_core_library)
    parts = gpucheck.real_parts(
        inventory, libcuda=libcuda, mps_control=mps_control, progress=lambda text: typer.echo(f"... {text}", err=True)
    )
    try:
        with reported():
            report = asyncio.run(gpucheck.check(parts, options))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        inventory.close()
    shown = console()
    shown.print(_gpu_check_table(report))
    if json_path is not None:
        with reported(OSError):
            json_path.write_bytes(orjson.dumps(gpucheck.to_json(report), option=orjson.OPT_INDENT_2))
        shown.print(f"wrote {json_path}")
    raise typer.Exit(report.exit_status())


def _gpu_check_table(report: Report) -> Table:
    from rich.markup import escape

    from sharegpu.agent.tools import gpucheck

    shown = report.gpu
    title = (
        f"sharegpu gpu-check: GPU {shown.index} {shown.model} {shown.uuid}, driver {shown.driver}, CUDA {shown.cuda}"
    )
    table = Table(title=escape(title))
    for column in ("check", "GPU", "result", "figures", "detail"):
        table.add_column(column, overflow="fold")
    colour = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}
    for name, where, result, figures, detail in gpucheck.rows(report):
        table.add_row(name, where, f"[{colour[result]}]{result}[/]", escape(figures), escape(detail))
    return table


def defrag_plan(
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run/--no-dry-run",
            help="Print the plan and evict nothing (the only mode here: the controller evicts, with --defrag).",
        ),
    ] = True,
    budget: Annotated[
        int, typer.Option("--budget", help="Evictions the plan may use (as the controller's hourly budget).", min=0)
    ] = 10,
    output: Annotated[Literal["text", "json"], typer.Option("--output", "-o", help="text or json.")] = "text",
    kubeconfig: Kubeconfig = None,
    request_timeout: Annotated[float, typer.Option("--request-timeout", help="Seconds per API request.")] = 30.0,
) -> None:
    """Plan the fewest evictions that let pending GPU pods fit, and print the plan and its gain (evicts nothing)."""
    from sharegpu.controller import defrag_inputs, defrag_wording
    from sharegpu.kube import client, credentials, transport
    from sharegpu.kube import errors as kube_errors

    with reported():
        if not dry_run:
            raise UsageError("sharegpu defrag only plans (--dry-run); run the controller with --defrag to evict")
        if request_timeout <= 0:
            raise UsageError(f"--request-timeout must be > 0, got {request_timeout}")
        creds = credentials.load(kubeconfig)

    async def work() -> dict[str, Any]:
        api = client.KubeClient(transport.AiohttpTransport(creds, connections=4), creds, timeout=request_timeout)
        try:
            found = await defrag_inputs.snapshot(api)
        finally:
            await api.close()
        result = defrag_inputs.plan(found, budget)
        return {"lines": defrag_wording.describe(result, budget), "json": defrag_wording.to_json(result, budget)}

    # Credentials are used, and so can fail, only once the first request goes: a missing CA file, an
    # exec plugin that is not there (bad input, as the kubeconfig is), beside what the cluster answers.
    with (
        reported(credentials.CredentialsError),
        reported(kube_errors.KubeError, status=1, doing="reading the cluster"),
    ):
        shown = asyncio.run(work())
    if output == "json":
        typer.echo(orjson.dumps(shown["json"], option=orjson.OPT_INDENT_2).decode())
    else:
        typer.echo("\n".join(shown["lines"]))
