"""Sweeps on an existing Dask cluster: the runs `sim.runner` would make locally, made by the cluster's
workers instead, with the same figures.

The client connects to the scheduler the user names (`tcp://host:8786`); the workers need sharegpu at
this version (checked before anything is sent) and nothing else: each source is loaded here once and
sent to every worker once (`scatter`, broadcast), so the trace files need not exist there. Each run is
one task (`runner.execute_loaded`), results come back as they finish and are returned in the order of
the specs. Dask (the `distributed` package) is an extra: `pip install 'sharegpu[dask]'`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from collections.abc import Callable, Sequence
from typing import Any

from sharegpu.core import errors
from sharegpu.sim import runner

CONNECT_TIMEOUT = "20s"


class ClusterError(errors.SharegpuError):
    """The Dask cluster could not be reached, does not match, or a run failed there."""


def fingerprint() -> tuple[str, str]:
    """What a worker must share with the client: sharegpu's version and Python's minor version."""
    return importlib.metadata.version("sharegpu"), ".".join(platform.python_version_tuple()[:2])


def run_on_dask(
    specs: Sequence[runner.RunSpec],
    address: str,
    on_done: Callable[[runner.RunResult], None] | None = None,
    *,
    timeout: str = CONNECT_TIMEOUT,
) -> list[runner.RunResult]:
    """Every run on the Dask cluster whose scheduler is at `address`, in the order of `specs`."""
    try:
        distributed: Any = importlib.import_module("distributed")  # an extra: loaded only when asked for
    except ImportError:
        raise ClusterError("--dask needs Dask's distributed package: pip install 'sharegpu[dask]'") from None
    try:
        client = distributed.Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as exc:
        raise ClusterError(f"cannot reach the Dask scheduler at {address}: {exc}") from None
    with client, client.as_current():  # as_completed asks for the current client
        return _run(client, distributed, specs, address, on_done)


def _run(
    client: Any,
    distributed: Any,
    specs: Sequence[runner.RunSpec],
    address: str,
    on_done: Callable[[runner.RunResult], None] | None,
) -> list[runner.RunResult]:
    if not specs:
        return []
    found: dict[str, Any] = client.run(fingerprint)
    if not found:
        raise ClusterError(f"the Dask cluster at {address} has no workers")
    here = fingerprint()
    odd = sorted(f"{worker} ({version}, Python {python})" for worker, (version, python) in found.items()
                 if (version, python) != here)  # fmt: skip
    if odd:
        raise ClusterError(
            f"these Dask workers run another sharegpu or Python than this client (sharegpu {here[0]}, "
            f"Python {here[1]}): {', '.join(odd)}"
        )
    sources = list(dict.fromkeys(spec.source for spec in specs))
    sent = {source: client.scatter(runner.load_source(source), broadcast=True, hash=False) for source in sources}
    futures = [client.submit(runner.execute_loaded, spec, sent[spec.source], pure=False) for spec in specs]
    order = {future.key: i for i, future in enumerate(futures)}
    results: dict[int, runner.RunResult] = {}
    for future in distributed.as_completed(futures):
        if future.status == "error":
            spec = specs[order[future.key]]
            what = f"{spec.source.label} {spec.policy} seed {spec.seed}"
            raise ClusterError(f"run {what} failed on the Dask cluster: {future.exception()!r}")
        result = future.result()
        results[order[future.key]] = result
        if on_done:
            on_done(result)
    return [results[i] for i in range(len(specs))]
