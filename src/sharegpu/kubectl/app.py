"""The `kubectl sharegpu` command line: `inspect`, `explain POD`, `groups`, `budgets`, `top`, `snapshot DIR`,
`dashboard`.

kubectl runs `kubectl-sharegpu` from PATH with the arguments that follow `kubectl sharegpu`, so each
command takes the connection options itself: `--kubeconfig` (default $KUBECONFIG's files, merged
as kubectl merges them, then ~/.kube/config, then in-cluster), `--context`, `--request-timeout`.
Credentials are the project's own (`kube.credentials`: tokens, client certificates, exec plugins), as
every component loads them.

Errors are one line on stderr, `kubectl sharegpu: error: ...`, and the exit status says whose they
are: 2 for what the command line asked (a bad `-o`, an unreadable kubeconfig, an unknown context or
policy, a dashboard `--port` already in use), 1 for what the cluster answered (no such pod, the API
server unreachable or refusing us, sharegpu's resources not installed, an object in it that sharegpu
cannot read, named). Each command reads what it needs once and runs one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console, RenderableType

from sharegpu.api import names as names_module
from sharegpu.cli import boundary
from sharegpu.core import errors, policies
from sharegpu.kube import client, credentials, transport
from sharegpu.kube import errors as kube_errors
from sharegpu.kubectl import dashboard, read, render, views
from sharegpu.kubectl import snapshot as snapshots

PROG = "kubectl sharegpu"
EXIT_FAILURE = 1
EXIT_USAGE = 2
OUTPUTS = ("wide", "json")

T = TypeVar("T")
Connect = Callable[[str | None, str | None, float], client.KubeClient]


class UsageError(errors.InvalidInputError):
    """Something on the command line that cannot be used (exit status 2)."""


class Failure(errors.SharegpuError):
    """The cluster's answer makes the command fail (exit status 1)."""


def connect(kubeconfig: str | None, context: str | None, timeout: float) -> client.KubeClient:
    """A client with the project's credentials (kubeconfig given, $KUBECONFIG, ~/.kube/config, in-cluster)."""
    creds = credentials.load(kubeconfig, context)
    return client.KubeClient(transport.AiohttpTransport(creds, connections=8), creds, timeout=timeout)


def default_namespace(kubeconfig: str | None, context: str | None) -> str:
    """The namespace of the kubeconfig's context (as kubectl uses it), else `default`; CredentialsError
    for a kubeconfig that cannot be used (as the credentials would raise)."""
    files = credentials.locate(kubeconfig)
    return (credentials.Kubeconfig.read(files).namespace(context) if files else None) or "default"


def check_output(output: str | None, allowed: tuple[str, ...] = OUTPUTS) -> str:
    if output is None or output in allowed:
        return output or ""
    raise UsageError(f"-o {output}: unknown output format; use {' or '.join(allowed)} (default: a table)")


def _console() -> Console:
    console = render.console()
    return console if console.is_terminal else render.console(width=200)


Kubeconfig = Annotated[
    str | None, typer.Option("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster).")
]
Context = Annotated[str | None, typer.Option("--context", help="The kubeconfig context to use (default: current).")]
Timeout = Annotated[float, typer.Option("--request-timeout", help="Seconds to wait for each API request.", min=0.1)]
Output = Annotated[str | None, typer.Option("--output", "-o", help="wide or json (default: a table).")]


def _usage(exc: errors.SharegpuError) -> typer.Exit:
    typer.echo(f"{PROG}: error: {errors.first_line(exc)}", err=True)
    return typer.Exit(EXIT_USAGE)


def _output_format(output: str | None) -> str:
    """`check_output`, a wrong value ending the command as a usage error."""
    try:
        return check_output(output)
    except UsageError as exc:
        raise _usage(exc) from None


def _show(renderable: RenderableType) -> None:
    console = _console()
    if console.is_terminal:
        console.print(render.printable(console, renderable))
        return
    with console.capture() as captured:  # a pipe gets whole lines, without the tables' padding
        console.print(render.printable(console, renderable, soft_wrap=True), soft_wrap=True)
    typer.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


class Commands:
    """The plugin's commands, each reading the cluster through `connector` (tests hand in the fake API
    server); `run` is the boundary that turns every error into one line and an exit status."""

    def __init__(self, connector: Connect = connect) -> None:
        self.connector = connector

    def run(
        self,
        kubeconfig: str | None,
        context: str | None,
        timeout: float,
        work: Callable[[client.KubeApi], Awaitable[T]],
    ) -> T:
        """Connect, do `work`, close; every error becomes one line and an exit status."""

        async def session() -> T:
            api = self.connector(kubeconfig, context, timeout)
            try:
                return await work(api)
            except kube_errors.UndecodableError as exc:
                culprit = f"{exc.culprit}: " if exc.culprit else ""
                raise Failure(
                    f"the API server's {exc.path} answer holds an object sharegpu cannot read: {culprit}{exc.detail}"
                ) from None
            except kube_errors.TransportError as exc:
                auth = api.auth
                where = f" at {auth.server}" if isinstance(auth, credentials.Credentials) else ""
                raise Failure(f"cannot reach the API server{where}: {errors.first_line(exc)}") from None
            finally:
                await api.close()

        try:
            return asyncio.run(session())
        except errors.InvalidInputError as exc:
            typer.echo(f"{PROG}: error: {errors.first_line(exc)}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        except kube_errors.UnauthorizedError:
            typer.echo(f"{PROG}: error: the API server refused the credentials (401 Unauthorized)", err=True)
            raise typer.Exit(EXIT_FAILURE) from None
        except kube_errors.ApiError as exc:
            typer.echo(f"{PROG}: error: {exc.status} {exc.reason}: {exc.message or exc.path}", err=True)
            raise typer.Exit(EXIT_FAILURE) from None
        except errors.SharegpuError as exc:
            typer.echo(f"{PROG}: error: {errors.first_line(exc)}", err=True)
            raise typer.Exit(EXIT_FAILURE) from None

    def inspect(
        self,
        nodes: Annotated[list[str] | None, typer.Argument(help="Only these nodes (default: every GPU node).")] = None,
        selector: Annotated[
            str, typer.Option("--selector", "-l", help="Only nodes with these labels (a label selector).")
        ] = "",
        output: Output = None,
        kubeconfig: Kubeconfig = None,
        context: Context = None,
        request_timeout: Timeout = 10.0,
    ) -> None:
        """Per node and GPU: model, memory, compute and memory held and free, and which pods hold them."""
        chosen = _output_format(output)

        async def work(api: client.KubeApi) -> views.Inventory:
            listing = await read.cluster(api, selector, quotas=False)
            found = views.inventory(views.cluster(listing), nodes or ())
            unknown = sorted(set(nodes or ()) - {n.name for n in found.nodes} - {n for n, _ in found.ignored})
            if unknown:
                raise Failure(f"no GPU node named {', '.join(unknown)}")
            return found

        result = self.run(kubeconfig, context, request_timeout, work)
        if chosen == "json":
            typer.echo(render.dumps(render.inventory_json(result)), nl=False)
        elif not result.nodes and not result.ignored:
            typer.echo("No GPU nodes (no node has both a Node and a Device resource).")
        else:
            _show(render.inventory_table(result, wide=chosen == "wide"))

    def explain(
        self,
        pod: Annotated[str, typer.Argument(help="The pod (NAME, or NAMESPACE/NAME).")],
        namespace: Annotated[
            str | None, typer.Option("--namespace", "-n", help="Its namespace (default: the context's).")
        ] = None,
        policy: Annotated[
            str, typer.Option("--policy", help="The extender's placement policy (for the node it would choose).")
        ] = policies.DEFAULT,
        detail: Annotated[
            int, typer.Option("--detail", help="Nodes to explain GPU by GPU (closest to fitting first).", min=0)
        ] = views.DETAIL_NODES,
        output: Output = None,
        kubeconfig: Kubeconfig = None,
        context: Context = None,
        request_timeout: Timeout = 10.0,
    ) -> None:
        """Why a pod is pending (or where it runs): node by node and GPU by GPU, from the extender's own filter."""
        try:
            chosen = check_output(output, ("json",))
            policies.check(policy)
            space, _, name = pod.rpartition("/")
            if not name or "/" in space:
                raise UsageError(f"{pod!r}: give the pod as NAME or NAMESPACE/NAME")
            space = space or namespace or default_namespace(kubeconfig, context)
        except errors.SharegpuError as exc:
            raise _usage(exc) from None

        async def work(api: client.KubeApi) -> views.Explanation:
            try:
                found, node_selector = await read.pod(api, space, name)
            except kube_errors.NotFoundError:
                raise Failure(f"pod {space}/{name} not found") from None
            listing = await read.cluster(api)
            return views.explain(views.cluster(listing, policy), found, node_selector, detail=detail)

        result = self.run(kubeconfig, context, request_timeout, work)
        if chosen == "json":
            typer.echo(render.dumps(render.explanation_json(result)), nl=False)
        else:
            _show(render.explanation_text(result))

    def groups(
        self,
        namespace: Annotated[
            str | None, typer.Option("--namespace", "-n", help="Only this namespace (default: all).")
        ] = None,
        output: Output = None,
        kubeconfig: Kubeconfig = None,
        context: Context = None,
        request_timeout: Timeout = 10.0,
    ) -> None:
        """SharedDeviceGroups: phase, node, devices and members."""
        chosen = _output_format(output)

        async def work(api: client.KubeApi) -> list[views.GroupView]:
            return views.group_views(await read.groups(api, namespace))

        result = self.run(kubeconfig, context, request_timeout, work)
        if chosen == "json":
            typer.echo(render.dumps(render.groups_json(result)), nl=False)
        else:
            _show(render.groups_table(result, wide=chosen == "wide"))

    def budgets(
        self,
        namespace: Annotated[
            str | None, typer.Option("--namespace", "-n", help="Only what governs this namespace (default: all).")
        ] = None,
        output: Output = None,
        kubeconfig: Kubeconfig = None,
        context: Context = None,
        request_timeout: Timeout = 10.0,
    ) -> None:
        """GPU-time budgets and GPU quotas per namespace, with usage bars."""
        chosen = _output_format(output)

        async def work(api: client.KubeApi) -> tuple[list[views.BudgetView], list[views.QuotaView]]:
            (items, labels), listing = await asyncio.gather(read.budgets(api, namespace), read.quotas(api))
            return views.budget_views(items, labels), views.quota_views(views.cluster(listing), namespace)

        found, quotas = self.run(kubeconfig, context, request_timeout, work)
        if chosen == "json":
            typer.echo(render.dumps(render.budgets_json(found, quotas)), nl=False)
        else:
            _show(render.budgets_tables(found, quotas, wide=chosen == "wide"))

    def top(
        self,
        namespace: Annotated[
            str | None, typer.Option("--namespace", "-n", help="Only this namespace (default: all).")
        ] = None,
        by: Annotated[str, typer.Option("--by", help="One row per pod and GPU (pod) or per namespace.")] = "pod",
        sort: Annotated[
            str, typer.Option("--sort", help=f"Order: {', '.join(views.TOP_SORTS)} (idle: least of its share used).")
        ] = "used",
        output: Output = None,
        kubeconfig: Kubeconfig = None,
        context: Context = None,
        request_timeout: Timeout = 10.0,
    ) -> None:
        """What each pod uses of its GPU share (memory, SM), beside what it was given, from the node agents."""
        try:
            chosen = check_output(output, ("json",))
            if by not in ("pod", "namespace"):
                raise UsageError(f"--by: unknown {by!r} (valid: pod, namespace)")
            views.check_sort(sort)
        except errors.SharegpuError as exc:
            raise _usage(exc) from None

        async def work(api: client.KubeApi) -> list[views.UsageRow]:
            rows = views.usage_rows(await read.usages(api), namespace, time.time())
            return views.sort_rows(views.by_namespace(rows) if by == "namespace" else rows, sort)

        result = self.run(kubeconfig, context, request_timeout, work)
        if chosen == "json":
            typer.echo(render.dumps(render.top_json(result, by == "namespace")), nl=False)
        elif not result:
            typer.echo("No GPU use reported" + (f" in namespace {namespace}." if namespace else "."))
        else:
            _show(render.top_table(result, by == "namespace"))

    def snapshot(
        self,
        directory: Annotated[Path, typer.Argument(help="Write the trace here (made if missing).")],
        names: Annotated[
            bool, typer.Option("--names", help="Keep pods' namespace/name and nodes' names (else anonymous).")
        ] = False,
        selector: Annotated[
            str, typer.Option("--selector", "-l", help="Only nodes with these labels (a label selector): a node pool.")
        ] = "",
        namespace: Annotated[
            str | None, typer.Option("--namespace", "-n", help="Only this namespace's pods (default: all).")
        ] = None,
        pending_cpu_pods: Annotated[
            bool,
            typer.Option(
                "--pending-cpu-pods",
                help="Also write pending pods that ask for no GPU (else only CPU-only pods bound to a GPU node).",
            ),
        ] = False,
        kubeconfig: Kubeconfig = None,
        context: Context = None,
        request_timeout: Timeout = 30.0,
    ) -> None:
        """The cluster's GPU nodes and its pods' GPU requests as a trace in the openb format, for `sharegpu
        simulate` and `sharegpu bound` to say what each policy would leave idle here (read rights only)."""

        async def work(api: client.KubeApi) -> snapshots.Snapshot:
            found = await snapshots.read(api, selector, namespace)
            return snapshots.take(found, names_kept=names, pending_cpu_pods=pending_cpu_pods)

        found = self.run(kubeconfig, context, request_timeout, work)
        if not found.nodes:
            typer.echo(f"{PROG}: error: no GPU nodes in this cluster (no Device lists GPUs, no node has "
                       f"{names_module.NVIDIA_GPU} allocatable): nothing to replay", err=True)  # fmt: skip
            raise typer.Exit(EXIT_FAILURE)
        command = shlex.join(["kubectl", "sharegpu", "snapshot", *sys.argv[2:]])
        try:
            node_file, pod_file = snapshots.write(found, directory, command)
        except OSError as exc:
            typer.echo(f"{PROG}: error: cannot write {directory}: {exc.strerror or exc}", err=True)
            raise typer.Exit(EXIT_FAILURE) from None
        gpu_pods = [p for p in found.pods if p.num_gpu]
        typer.echo(
            f"wrote {len(found.nodes)} GPU nodes ({sum(n.gpus for n in found.nodes)} GPUs) to {node_file} and "
            f"{len(found.pods)} pods ({len(gpu_pods)} asking for GPUs, {sum(1 for p in gpu_pods if p.node)} bound) "
            f"to {pod_file}"
        )
        for what, count in found.dropped.items():
            typer.echo(f"not written: {what}: {count}")
        for note in found.notes:
            typer.echo(f"not read: {note}")
        if found.skipped:
            typer.echo(
                f"left out: {len(found.skipped)} pods whose request sharegpu refuses ({directory / 'snapshot.json'})"
            )
        typer.echo(f"replay: sharegpu simulate --nodes {node_file} --pods {pod_file}")

    def dashboard(
        self,
        port: Annotated[
            int, typer.Option("--port", help="Serve on http://127.0.0.1:PORT/ (0: any free port).", min=0, max=65535)
        ] = 8765,
        kubeconfig: Kubeconfig = None,
        context: Context = None,
        request_timeout: Timeout = 10.0,
    ) -> None:
        """A read-only GPU map in the browser: nodes and GPUs with their shares to scale, what each uses,
        pending pods and why, budgets, idle shares (on 127.0.0.1 only; it reads with your credentials)."""

        async def work(api: client.KubeApi) -> None:
            served = dashboard.Dashboard(api, port)
            try:
                await served.start()
            except OSError as exc:  # the port is taken, or not ours to take
                await served.stop()
                why = os.strerror(exc.errno) if exc.errno else str(exc)
                raise UsageError(f"--port {port}: cannot serve on 127.0.0.1:{port}: {why}") from None
            typer.echo(f"sharegpu GPU map on {served.url} (Ctrl-C stops it)")
            try:
                await asyncio.Event().wait()
            finally:
                await served.stop()

        with contextlib.suppress(KeyboardInterrupt):
            self.run(kubeconfig, context, request_timeout, work)


class _Group(boundary.Commands):
    """click's usage errors (an unknown option or command, a value out of range, a missing argument)
    in one line `kubectl sharegpu: error: ...`, exit status 2, as `sharegpu`'s own."""

    prog = PROG


def make_app(connector: Connect = connect) -> typer.Typer:
    """The command line, talking to the API through `connector`."""
    app = typer.Typer(
        name=PROG,
        cls=_Group,
        help="sharegpu's view of the cluster: GPUs and who holds them, why a pod is pending, groups, budgets, "
        "what each share uses.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    commands = Commands(connector)
    commands_ = (
        commands.inspect,
        commands.explain,
        commands.groups,
        commands.budgets,
        commands.top,
        commands.snapshot,
        commands.dashboard,
    )
    for command in commands_:
        app.command()(command)
    return app


app = make_app()


def main() -> None:
    # The extender's cache logs the nodes it leaves out; the commands say so in their output instead.
    logging.getLogger("sharegpu").addHandler(logging.NullHandler())
    app(prog_name=PROG, args=sys.argv[1:])
