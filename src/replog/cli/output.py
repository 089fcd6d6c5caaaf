"""How the ``replog`` command shows results: one renderer for text, one for JSON.

Commands compute typed results with the core functions, describe each once as a
:class:`~replog.cli.results.Result` (its JSON document, and its text read from that
document) and hand it to an :class:`Output`; nothing else in the CLI prints results.
Events (``read``, ``tail``) are JSON lines under both renderers.
"""

from __future__ import annotations

import base64
import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from datetime import timezone
from importlib import resources
from typing import IO, Any

from replog.cli.results import Failed, Result, age

__all__ = ["JsonOutput", "Output", "TextOutput", "age", "event_json", "json_schema"]

SCHEMAS_PACKAGE = "replog.cli"
SCHEMAS_DIR = "json_schemas"

COMMAND_SCHEMAS = {
    "create": "create",
    "append": "append",
    "capture": "capture",
    "capture mysql": "capture-mysql",
    "snapshot": "snapshot",
    "snapshot mysql": "snapshot-mysql",
    "slots": "slots",
    "slots drop": "slots-drop",
    "info": "info",
    "schemas": "schemas",
    "read": "event",
    "tail": "event",
    "history": "history",
    "verify": "verify",
    "manifest list": "manifest-list",
    "manifest show": "manifest-show",
    "manifest validate": "manifest-validate",
    "consumer list": "consumer-list",
    "consumer show": "consumer-show",
    "consumer set": "consumer-set",
    "consumer delete": "consumer-delete",
    "status": "status",
    "truncate": "truncate",
    "recover": "recover",
    "compact": "compact",
}
"""Which schema each command's ``--json`` output follows (``read`` and ``tail``: each
line; an error of any command: ``error``)."""


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema ``name`` (a value of :data:`COMMAND_SCHEMAS`, or ``error``) as
    shipped in the package."""
    text = resources.files(SCHEMAS_PACKAGE).joinpath(SCHEMAS_DIR, f"{name}.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def event_json(row: Mapping[str, Any]) -> dict[str, Any]:
    """An event as ``replog read`` prints it (schema ``event``): payloads as text when
    they are UTF-8, else base64 under ``data_base64``/``before_base64``."""
    document = {
        name: value for name, value in row.items() if name not in ("data", "before", "timestamp")
    }
    document["timestamp"] = (
        row["timestamp"].astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    )
    for name in ("data", "before"):
        payload: bytes | None = row.get(name)
        if payload is None:
            document[name] = None
            continue
        try:
            document[name] = payload.decode("utf-8")
        except UnicodeDecodeError:
            document[f"{name}_base64"] = base64.b64encode(payload).decode("ascii")
    return document


class Output(ABC):
    """Where a command's results go: :class:`TextOutput` for people, :class:`JsonOutput`
    for scripts. Both show every :class:`~replog.cli.results.Result` from its one
    description, so no result can be missing from either."""

    json = False

    def __init__(self, stream: IO[str] | None = None, *, verbose: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.verbose = verbose

    def line(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def events(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Events as JSON lines (both renderers: one event per line is what scripts and
        people both read)."""
        for row in rows:
            self.line(json.dumps(event_json(row), sort_keys=True))

    @abstractmethod
    def show(self, result: Result) -> None:
        """Print one command's result."""

    @abstractmethod
    def error(self, message: str, exit_code: int, kind: str) -> None:
        """Report an error that ends the command with ``exit_code``."""


class TextOutput(Output):
    """Text output (for people); errors and notes go to stderr."""

    def show(self, result: Result) -> None:
        for text in result.lines(self.verbose):
            self.line(text)
        for note in result.notes():
            print(note, file=sys.stderr, flush=True)

    def error(self, message: str, exit_code: int, kind: str) -> None:
        print(f"replog: error: {message}", file=sys.stderr, flush=True)


class JsonOutput(Output):
    """One JSON document per result (for scripts and monitoring agents); an error is one
    too (schema ``error``), on stdout where the result would have been."""

    json = True

    def show(self, result: Result) -> None:
        self.line(json.dumps(result.document, sort_keys=True))

    def error(self, message: str, exit_code: int, kind: str) -> None:
        self.show(Failed.of(message, exit_code, kind))
