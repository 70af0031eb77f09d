"""Whether the cluster's CustomResourceDefinitions of sharegpu's resources are this release's.

Helm installs a chart's CRDs on the first install only and never changes them after, so a release
upgraded without `kubectl apply` of its definitions (docs/operations.md, "Upgrade") meets older ones:
the API server then drops the fields they do not have from every object written, and refuses values
they do not allow, without a word to the writer. `Definitions` reads each definition every `every`
seconds and keeps what it lacks of this release's (`api.resources.lacking`): the controller is not
ready while one lacks anything (a rollout waits, the old pods serve on), says what in /readyz, logs
the command that fixes it, and exports `sharegpu_controller_definition_current`. A definition it may
not read (RBAC changed by hand) or could not read for a moment is reported, not held against
readiness: it says nothing about the definition.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Final

from sharegpu.api import paths, resources
from sharegpu.core import errors
from sharegpu.kube import client
from sharegpu.kube import errors as kube_errors

log = logging.getLogger(__name__)

Json = dict[str, Any]

FIX: Final = "sharegpu crds | kubectl apply --server-side -f -"
"""The command that installs this release's definitions (the chart's crds/ folder holds the same)."""


class Definitions:
    """The installed definitions, held against this release's (`expected`)."""

    def __init__(self, api: client.KubeApi, expected: Mapping[str, Json], every: float = 60.0) -> None:
        self.api = api
        self.expected = dict(expected)
        """Per definition's name, this release's (`api.resources.definitions()`)."""
        self.every = every
        self.lacking: dict[str, tuple[str, ...]] = {}
        """Per definition read, what it lacks of this release's (empty: current)."""
        self.unread: dict[str, str] = {}
        """Per definition not read at the last try, why."""
        self.checked = False
        """Every definition was tried once."""

    @property
    def current(self) -> bool:
        """No definition read lacks anything, and each was tried."""
        return self.checked and not any(self.lacking.values())

    def status(self) -> dict[str, Any] | str:
        """For /readyz: what each definition that is not current lacks, and why any was not read."""
        if not self.checked:
            return "not read yet"
        lacking = {name: list(found) for name, found in sorted(self.lacking.items()) if found}
        return {"lacking": lacking, "notRead": dict(sorted(self.unread.items()))}

    async def check(self) -> None:
        """Read every definition once and hold it against this release's."""
        for name, manifest in self.expected.items():
            try:
                installed = await self.api.get(paths.definition(name))
            except kube_errors.NotFoundError:
                self._found(name, ("not installed",))
            except kube_errors.KubeError as exc:  # refused, or no answer: says nothing of the definition
                self.unread[name] = errors.first_line(exc)
            else:
                self._found(name, resources.lacking(manifest, installed))
        self.checked = True

    def _found(self, name: str, lacking: tuple[str, ...]) -> None:
        self.unread.pop(name, None)
        if lacking and self.lacking.get(name) != lacking:
            log.error(
                "CustomResourceDefinition %s is not this release's (%s): the API server drops or refuses what it "
                "lacks; apply this release's definitions: %s",
                name, "; ".join(lacking), FIX,
            )  # fmt: skip
        elif not lacking and self.lacking.get(name):
            log.info("CustomResourceDefinition %s is this release's now", name)
        self.lacking[name] = lacking

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.every)
