"""How the components log: the `--log-level` and `--log-format` options they all take, and the two formats.

The components log to stderr, one JSON object per line for log collectors (`JsonFormatter`), or one
plain line per record for a person (`TextFormatter`); `auto`, the default, picks text when stderr is a
terminal, so a pod's logs stay JSON. `configure` sets the root logger up accordingly.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated, Literal, TextIO

import orjson
import typer

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "text"]

LogLevelOption = Annotated[LogLevel, typer.Option(case_sensitive=False, help="The least severe records logged.")]
LogFormatOption = Annotated[
    LogFormat,
    typer.Option(
        help="Logs on stderr: json (one object per line, for log collectors), text (one line for a person), "
        "or auto: text when stderr is a terminal, else json."
    ),
]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the GPU a record is about when it names
    one (`extra={"gpu": uuid}`, as the MPS daemons' relayed lines do), and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        gpu = getattr(record, "gpu", None)
        if isinstance(gpu, str):
            entry["gpu"] = gpu
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


class TextFormatter(logging.Formatter):
    """One plain line per record for a person at a terminal: time, level, logger, message (and the
    traceback below it when there is one)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")


def configure(level: LogLevel, log_format: LogFormat = "auto", stream: TextIO | None = None) -> None:
    """Logs on `stream` (stderr), replacing any handler set before (a test may call it repeatedly)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    text = log_format == "text" or (log_format == "auto" and _is_terminal(handler.stream))
    handler.setFormatter(TextFormatter() if text else JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
