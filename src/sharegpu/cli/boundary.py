"""Where the command line meets its user: how errors leave it and how tables are drawn.

Bad input (a missing file, a malformed row, an unknown policy, a bad seed list, and click's own usage
errors: an unknown option, a value that is not one of an option's choices) is reported in one line,
`sharegpu: error: ...`, with exit status 2. A command wraps what may fail in `reported()`, which turns
sharegpu's errors (or the kinds it names) into that line; `Commands`, the command group, does the same
for click's usage errors, which would otherwise be drawn in a box of several lines (the kubectl
plugin's group too, its lines starting `kubectl sharegpu: error:`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import typer
import typer.core
from rich.console import Console

# Typer vendors click: its context and usage errors are only reachable here (typer is pinned in pyproject.toml).
from typer._click.core import Context as ClickContext
from typer._click.exceptions import NoArgsIsHelpError
from typer._click.exceptions import UsageError as ClickUsageError

from sharegpu.core import errors

EXIT_BAD_INPUT = 2


class UsageError(errors.InvalidInputError):
    """A command-line value that cannot be used."""


@contextlib.contextmanager
def reported(*kinds: type[BaseException], status: int = EXIT_BAD_INPUT, doing: str = "") -> Iterator[None]:
    """Turns an error raised in the block into one line on stderr, `sharegpu: error: [doing: ]<its first
    line>`, and exit status `status`. The errors turned are those of `kinds`, by default every
    `SharegpuError` (the bad input sharegpu itself reports); any other error goes on as it is."""
    caught = kinds or (errors.SharegpuError,)
    try:
        yield
    except caught as exc:
        raise _fail(exc, status, doing) from None


def _fail(exc: BaseException, status: int = EXIT_BAD_INPUT, doing: str = "", prog: str = "sharegpu") -> typer.Exit:
    text = f"{doing}: {errors.first_line(exc)}" if doing else errors.first_line(exc)
    typer.echo(f"{prog}: error: {text}", err=True)
    return typer.Exit(status)


class Commands(typer.core.TyperGroup):
    """The command group: click's own usage errors (an unknown option or command, a value that is not
    one of an option's choices, a missing value) are reported as every other bad input is, in one line
    `sharegpu: error: ...` with exit status 2, rather than in a box of several lines. Another command
    line (the kubectl plugin's) uses a subclass that sets `prog`, the name its errors start with."""

    prog = "sharegpu"

    def make_context(
        self, info_name: str | None, args: list[str], parent: ClickContext | None = None, **extra: Any
    ) -> ClickContext:
        with _one_line_usage_errors(self.prog):
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: ClickContext) -> Any:
        with _one_line_usage_errors(self.prog):
            return super().invoke(ctx)


@contextlib.contextmanager
def _one_line_usage_errors(prog: str) -> Iterator[None]:
    try:
        yield
    except NoArgsIsHelpError:
        raise  # the command alone prints the help
    except ClickUsageError as exc:
        # Typer validates choices with pydantic, whose messages start with "Value error, ".
        message = exc.format_message().replace(": Value error, ", ": ", 1)
        raise _fail(UsageError(message), prog=prog) from None


def console() -> Console:
    """The console tables are drawn on: the terminal's width, or 120 columns when output is not a terminal."""
    terminal = Console()
    return terminal if terminal.is_terminal else Console(width=120)
