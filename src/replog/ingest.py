"""Ingestion: JSON lines of change events into validated Arrow tables, payloads kept exact.

``replog append`` uses it, and so can any Python program::

    with open("events.jsonl") as lines:
        table = ingest.read_lines(lines).table
    log.append(table)

Each line is one event object with the fields of the change event (FORMAT.md), or, with
``format="debezium"``, one Debezium change-event value (:mod:`replog.debezium`). A payload
given as a JSON value is stored as the exact text it had in the line. Every line is
validated before anything is returned: a bad line is an error that names it.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from replog import debezium
from replog.errors import InvalidEventError, InvalidOptionError
from replog.format import jsontext
from replog.format.commits import CommitRecord, Transaction
from replog.format.events import STORED_SCHEMA, events_from_records
from replog.log import ReplicationLog

CHUNK_LINES = 50_000
PAYLOAD_FIELDS = ("data", "before", "metadata")
FORMATS = ("replog", "debezium")


@dataclass
class Ingested:
    """Validated events, and what was skipped on the way (by kind)."""

    table: pa.Table
    lines: int
    skipped: Counter[str] = field(default_factory=Counter)


@dataclass
class AppendReport:
    """What :func:`append_lines` committed (``record`` is None when nothing was)."""

    url: str
    lines: int
    record: CommitRecord | None
    skipped: Counter[str]
    transaction: Transaction | None = None
    already_applied: bool = False
    """The transaction was in the log before: nothing was appended (a safe re-run)."""

    @property
    def events(self) -> int:
        return sum(segment.events for segment in self.record.add) if self.record else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "lines": self.lines,
            "events": self.events,
            "version": self.record.version if self.record else None,
            "segments": len(self.record.add) if self.record else 0,
            "skipped": dict(sorted(self.skipped.items())),
            "transaction": (
                {"app_id": self.transaction.app_id, "version": self.transaction.version}
                if self.transaction
                else None
            ),
            "already_applied": self.already_applied,
        }


def replog_record(members: dict[str, jsontext.Member]) -> dict[str, Any]:
    """A replog event record from one line's members: payloads as their exact text."""
    record: dict[str, Any] = {}
    for name, member in members.items():
        if name in PAYLOAD_FIELDS:
            record[name] = member.raw
        elif isinstance(member.value, Decimal):
            record[name] = float(member.value)  # a fractional epoch-ms timestamp
        else:
            record[name] = member.value
    return record


def _check_unique_ids(table: pa.Table, numbers: list[int]) -> None:
    counts = pc.value_counts(table.column("event_id"))
    repeated = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    if len(repeated):
        event_id = repeated[0]["values"].as_py()
        where = [
            numbers[i]
            for i, value in enumerate(table.column("event_id").to_pylist())
            if value == event_id
        ]
        raise InvalidEventError(
            f"line {where[1]}: event_id {event_id!r} was already given on line {where[0]}"
        )


Convert = Callable[[dict[str, jsontext.Member]], "dict[str, Any] | debezium.Skipped"]


def _converter(format: str, key_fields: tuple[str, ...]) -> Convert:
    """How one line's members become an event record, for ``format``."""
    if format not in FORMATS:
        raise InvalidOptionError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    if format == "debezium":
        if not key_fields:
            raise InvalidOptionError("--format debezium needs --key-fields (e.g. id)")
        return functools.partial(debezium.debezium_record, key_fields=key_fields)
    if key_fields:
        raise InvalidOptionError("key fields are for --format debezium")
    return replog_record


@dataclass
class _Chunks:
    """Event records validated a chunk at a time (bounded memory for big files), with the
    line each came from."""

    tables: list[pa.Table] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)

    def add(self, record: dict[str, Any], line: int) -> None:
        self.records.append(record)
        self.pending.append(line)
        if len(self.records) >= CHUNK_LINES:
            self.flush()

    def flush(self) -> None:
        if not self.records:
            return
        labels = self.pending.copy()
        self.tables.append(events_from_records(self.records, where=lambda i: f"line {labels[i]}"))
        self.numbers.extend(labels)
        self.records.clear()
        self.pending.clear()

    def table(self) -> pa.Table:
        self.flush()
        table = pa.concat_tables(self.tables) if self.tables else STORED_SCHEMA.empty_table()
        _check_unique_ids(table, self.numbers)
        return table


def _parse(line: str, number: int, convert: Convert) -> dict[str, Any] | debezium.Skipped:
    try:
        members = jsontext.parse_object(line)
    except ValueError as exc:
        raise InvalidEventError(f"line {number}: not valid JSON: {exc}") from exc
    try:
        return convert(members)
    except InvalidEventError as exc:
        raise InvalidEventError(f"line {number}: {exc}") from exc


def read_lines(
    lines: Iterable[str],
    *,
    format: str = "replog",
    key_fields: tuple[str, ...] = (),
    progress: Callable[[int], None] | None = None,
) -> Ingested:
    """Parse and validate JSON lines (blank lines are skipped).

    Args:
        lines: the input, one JSON object per line.
        format: ``"replog"`` (change events) or ``"debezium"`` (Debezium values).
        key_fields: for Debezium, the row fields that make an event's key.
        progress: called with the byte length of each line read.

    Raises:
        InvalidEventError: a line is not valid JSON or not a valid event (names the line).
    """
    convert = _converter(format, key_fields)
    chunks = _Chunks()
    skipped: Counter[str] = Counter()
    count = 0
    for count, line in enumerate(lines, start=1):
        if progress is not None:
            progress(len(line.encode("utf-8")))
        if not line.strip():
            continue
        if format == "debezium" and line.strip() == "null":
            skipped["tombstone (null value)"] += 1
            continue
        converted = _parse(line, count, convert)
        if isinstance(converted, debezium.Skipped):  # a record that carries no event
            skipped[converted.reason] += 1
        else:
            chunks.add(converted, count)
    return Ingested(chunks.table(), count, skipped)


def append_lines(
    log: ReplicationLog,
    lines: Iterable[str],
    *,
    format: str = "replog",
    key_fields: tuple[str, ...] = (),
    progress: Callable[[int], None] | None = None,
    transaction: Transaction | None = None,
) -> AppendReport:
    """Validate every line, then append all events as one atomic commit (``replog append``).

    A bad line raises :class:`InvalidEventError` naming it, and nothing is written. With a
    ``transaction`` already in the log, nothing is appended (``already_applied``).
    """
    ingested = read_lines(lines, format=format, key_fields=key_fields, progress=progress)
    record = None
    if ingested.table.num_rows:
        record = log.append(ingested.table, transaction=transaction)
    return AppendReport(
        log.url,
        ingested.lines,
        record,
        ingested.skipped,
        transaction=transaction,
        already_applied=record is None and ingested.table.num_rows > 0,
    )
