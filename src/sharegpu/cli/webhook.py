"""The admission webhook's command, `sharegpu webhook`, and the check of where the API server reaches it.

With `--bootstrap FOLDER` the webhook makes its own CA and serving certificate and registers itself;
`check_url` makes sure the certificate would cover the `--url` it registers, before anything starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sharegpu.api import names
from sharegpu.cli.boundary import UsageError, reported
from sharegpu.cli.components import serve
from sharegpu.cli.logs import LogFormatOption, LogLevelOption, configure
from sharegpu.cli.options import MetricsAuth

if TYPE_CHECKING:
    from sharegpu.webhook.admission import Policy

DEFAULT_WEBHOOK_NAMES = (
    "sharegpu-webhook",
    "sharegpu-webhook.sharegpu-system",
    "sharegpu-webhook.sharegpu-system.svc",
    "sharegpu-webhook.sharegpu-system.svc.cluster.local",
)


def check_url(url: str, dns_names: tuple[str, ...], ips: tuple[str, ...]) -> None:
    """Refuses (`UsageError`) a `--url` the API server could not call the webhook at with the certificate
    `--bootstrap` makes for `dns_names` and `ips`: the URL must be https with a host, and the certificate
    must name that host, an IP address among `ips` (compared as addresses, so `::1` is `0::1`) or else a
    name among `dns_names`. Otherwise the API server would refuse the certificate on every admission call,
    and with failurePolicy Fail no pod in a covered namespace would be admitted."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "https" or not parsed.hostname:
        raise UsageError(f"--url must be an https URL, got {url!r}")
    target = parsed.hostname
    try:
        covered = str(ipaddress.ip_address(target)) in {str(ipaddress.ip_address(a)) for a in ips}
    except ValueError:
        covered = target in dns_names
    if not covered:
        raise UsageError(
            f"--url host {target!r} is not among the certificate's names ({', '.join(dns_names + ips)}): "
            "the API server would refuse the certificate; add it with --dns-name or --ip-address"
        )


def webhook(
    cert: Annotated[Path | None, typer.Option(help="Serving certificate (PEM); re-read when it changes.")] = None,
    key: Annotated[Path | None, typer.Option(help="Serving key (PEM).")] = None,
    bootstrap: Annotated[
        Path | None,
        typer.Option(
            help="Folder: make a CA and serving certificate there and write the CA bundle "
            "into the webhook configurations."
        ),
    ] = None,
    url: Annotated[str | None, typer.Option(help="With --bootstrap: register the webhooks at this https URL.")] = None,
    dns_name: Annotated[
        list[str] | None,
        typer.Option(
            help="With --bootstrap: a DNS name the API server reaches the webhook by (repeat).",
            show_default="the sharegpu-webhook Service's names, unless --ip-address is given",
        ),
    ] = None,
    ip_address: Annotated[
        list[str] | None, typer.Option(help="With --bootstrap: an IP address the API server reaches it by (repeat).")
    ] = None,
    kubeconfig: Annotated[
        str | None,
        typer.Option(
            help="kubeconfig (Device inventory, bootstrap).",
            show_default="$KUBECONFIG, ~/.kube/config, or in-cluster",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8443,
    system_user: Annotated[
        list[str] | None, typer.Option(help="Users allowed to set what only sharegpu may set (repeat).")
    ] = None,
    skip_namespace: Annotated[list[str] | None, typer.Option(help="Namespaces left alone (repeat).")] = None,
    agent_user: Annotated[
        list[str] | None,
        typer.Option(
            help="Node agents' users: each may write only its own node's Device (repeat).",
            show_default="system:serviceaccount:sharegpu-system:sharegpu-agent",
        ),
    ] = None,
    take_over: Annotated[
        list[str] | None,
        typer.Option(
            help="Schedulers whose GPU pods sharegpu schedules instead (repeat).",
            show_default="default-scheduler and the GPU schedulers sharegpu replaces: docs/admission.md",
        ),
    ] = None,
    default_path: Annotated[
        str,
        typer.Option(
            help="How a GPU pod whose annotation and namespace label sharegpu.io/path say nothing asks: "
            "extender (sharegpu's resources) or dra (a claim of sharegpu's DeviceClass): docs/dra.md."
        ),
    ] = "extender",
    metrics_auth: MetricsAuth = True,
    log_level: LogLevelOption = "info",
    log_format: LogFormatOption = "auto",
) -> None:
    """Run the admission webhook: translate GPU requests, add the hand-off, validate, guard."""
    from sharegpu.serving import certs

    configure(log_level, log_format)
    policy = _policy(system_user, skip_namespace, agent_user, take_over)
    with reported():
        if default_path not in names.PATHS:
            raise UsageError(f"--default-path must be one of {', '.join(names.PATHS)}, got {default_path!r}")
    policy = dataclasses.replace(policy, default_path=default_path)
    dns_names = tuple(dns_name or (() if ip_address else DEFAULT_WEBHOOK_NAMES))
    ips = tuple(ip_address or ())
    with reported():
        if bootstrap is None and (cert is None or key is None):
            raise UsageError("give --cert and --key, or --bootstrap FOLDER")
        if bootstrap is None and (url or dns_name or ip_address):
            raise UsageError("--url, --dns-name and --ip-address go with --bootstrap")
        if url:
            check_url(url, dns_names, ips)
        certs.subject_names(dns_names, ips)
    with reported():
        serve(_run(policy, cert, key, bootstrap, url, dns_names, ips, kubeconfig, host, port, metrics_auth))


def _policy(
    system_user: list[str] | None,
    skip_namespace: list[str] | None,
    agent_user: list[str] | None,
    take_over: list[str] | None,
) -> Policy:
    """The admission policy: the default's, with each list that was given in place of its default."""
    from sharegpu.webhook import admission

    policy = admission.Policy()
    if system_user:
        policy = dataclasses.replace(policy, system_users=frozenset(system_user))
    if skip_namespace:
        policy = dataclasses.replace(policy, skip_namespaces=frozenset(skip_namespace))
    if agent_user:
        policy = dataclasses.replace(policy, agent_users=frozenset(agent_user))
    if take_over:
        policy = dataclasses.replace(policy, take_over=frozenset(take_over))
    return policy


async def _run(
    policy: Policy,
    cert: Path | None,
    key: Path | None,
    bootstrap: Path | None,
    url: str | None,
    dns_names: tuple[str, ...],
    ips: tuple[str, ...],
    kubeconfig: str | None,
    host: str,
    port: int,
    metrics_auth: bool,
) -> None:
    """Serve; with `bootstrap`, first make a CA and the serving pair there and register the CA bundle
    (with `url`: the webhook configurations themselves, at that URL), and keep both valid meanwhile
    (`webhook.bootstrap`: checked every hour, the bundle written again when the CA changes)."""
    from sharegpu.kube import client as kube_client
    from sharegpu.webhook import bootstrap as webhook_bootstrap
    from sharegpu.webhook import config as webhook_config
    from sharegpu.webhook import server as webhook_server

    if bootstrap is None:
        assert cert is not None and key is not None
        await webhook_server.serve(host, port, cert, key, webhook_server.Webhook(policy), kubeconfig,
                                   metrics_auth=metrics_auth)  # fmt: skip
        return
    pki = webhook_bootstrap.Bootstrap(bootstrap, dns_names, ips)
    pki.renew()
    async with kube_client.KubeClient.connect(kubeconfig) as kube:
        if url:
            await webhook_config.install(kube, url, pki.bundle)
        else:
            await webhook_config.set_ca_bundle(kube, pki.bundle)

        async def keep_valid() -> None:
            while True:
                await asyncio.sleep(RECHECK)
                if pki.renew():
                    await webhook_config.set_ca_bundle(kube, pki.bundle)

        hook = webhook_server.Webhook(policy)
        pair = (bootstrap / "tls.crt", bootstrap / "tls.key")
        await asyncio.gather(
            webhook_server.serve(host, port, *pair, hook, kubeconfig, metrics_auth=metrics_auth), keep_valid()
        )


RECHECK = 3600.0
"""Seconds between checks of the bootstrap certificates (`webhook.bootstrap.Bootstrap.renew`)."""
