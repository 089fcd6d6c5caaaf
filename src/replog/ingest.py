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

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pyarrow as pa

from replog import debezium
from replog.core import history
from replog.errors import (
    DataLossError,
    InvalidEventError,
    InvalidOptionError,
    TransactionOrderError,
)
from replog.format import jsontext
from replog.format.commits import APPEND, TXN_QUERY, CommitRecord, Transaction
from replog.format.events import STORED_SCHEMA, events_from_records
from replog.format.state import LogState
from replog.log import ReplicationLog
from replog.schemas import registry
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

CHUNK_LINES = 50_000
PAYLOAD_FIELDS = ("data", "before", "metadata")
FORMATS = ("replog", "debezium")


@dataclass
class Ingested:
    """Validated events, and what was skipped on the way (by kind)."""

    table: pa.Table
    lines: int
    skipped: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    """Lines that repeated an earlier line's change (collapsed into it)."""
    behind: int = 0
    """Events at or before the source position the log holds (already appended)."""
    position: Transaction | None = None
    """The connector's newest source position, to record with the commit."""
    schemas: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """``(collection, digest)`` -> the Kafka Connect schema the events name."""
    transactions: int = 0
    """Source transactions held whole (BEGIN, their events, END)."""
    partial_transactions: list[str] = field(default_factory=list)
    unkeyed: int = 0
    """Events without a key (each keyed by its event id)."""
    unpositioned: int = 0
    """Debezium changes without a usable source position: appended, but a redelivery of
    one is not recognised."""


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
    duplicates: int = 0
    """Lines that repeated an earlier line's change (collapsed into it)."""
    behind: int = 0
    """Debezium events at or before the source position the log held (not appended)."""
    transactions: int = 0
    """Source transactions the input held whole (bracketed by BEGIN and END)."""
    partial_transactions: list[str] = field(default_factory=list)
    """Source transactions the input held part of."""
    unkeyed: int = 0
    """Events without a key, each keyed by its event id (no order with other events)."""
    unpositioned: int = 0
    """Debezium changes without a usable source position (a sentinel, or none): appended
    without redelivery detection."""

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
            "duplicates": self.duplicates,
            "behind_source_position": self.behind,
            "source_transactions": self.transactions,
            "partial_source_transactions": self.partial_transactions,
            "unkeyed": self.unkeyed,
            "without_source_position": self.unpositioned,
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


def _converter(format: str, key_fields: tuple[str, ...]) -> None:
    """Check the options of ``format``."""
    if format not in FORMATS:
        raise InvalidOptionError(f"format {format!r} is not one of {', '.join(FORMATS)}")
    if format == "debezium" and not key_fields:
        raise InvalidOptionError("--format debezium needs --key-fields (e.g. id)")
    if format != "debezium" and key_fields:
        raise InvalidOptionError("key fields are for --format debezium")


@dataclass
class _Chunks:
    """Event records validated a chunk at a time (bounded memory for big files), with the
    line each came from; exact duplicates (same event id, same change) collapse."""

    tables: list[pa.Table] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    duplicates: int = 0
    unkeyed: int = 0
    """Events without a key (each keyed by its event id)."""

    def add(self, record: dict[str, Any], line: int) -> bool:
        """Add ``record`` unless it repeats an earlier line's change (False then).

        Raises:
            InvalidEventError: an earlier line gave its event id to another change.
        """
        event_id = record.get("event_id")
        if event_id is not None:
            change = hash(tuple(str(record.get(name)) for name in _IDENTITY))
            first = self.seen.setdefault(str(event_id), (line, change))
            if first != (line, change):
                if first[1] != change:
                    raise InvalidEventError(
                        f"line {line}: event_id {event_id!r} was already given by line "
                        f"{first[0]}, to another change"
                    )
                self.duplicates += 1
                return False
        if record.get("key") is None:
            self.unkeyed += 1
        self.records.append(record)
        self.pending.append(line)
        if len(self.records) >= CHUNK_LINES:
            self.flush()
        return True

    def flush(self) -> None:
        if not self.records:
            return
        labels = self.pending.copy()
        self.tables.append(
            events_from_records(self.records, where=lambda i: f"line {labels[i]}")
        )
        self.records.clear()
        self.pending.clear()

    def table(self) -> pa.Table:
        self.flush()
        return pa.concat_tables(self.tables) if self.tables else STORED_SCHEMA.empty_table()


_IDENTITY = ("operation", "collection", "key", "data", "before")
"""What makes two lines with one event id the same change (a redelivery may differ in
the envelope's processing time, kept in ``metadata``)."""


def _members(line: str, number: int) -> dict[str, jsontext.Member]:
    try:
        return jsontext.parse_object(line)
    except ValueError as exc:
        raise InvalidEventError(f"line {number}: not valid JSON: {exc}") from exc


HeldLookup = Callable[[str, str, int], bool | None]
"""``(app id, event id, position) ->`` whether the log holds that event of the connector
(None: it cannot tell, its history having expired)."""


@dataclass
class _Positions:
    """The source position of one connector across an input. Events past the position
    the log holds are new; one at or before it is dropped (counted) when the log holds its
    event id: a redelivery. One the log does not hold is kept: the position is the
    connector's, and a file of another of its topics (tables) appended after this one's
    holds older positions that are new to the log. The newest position is recorded."""

    recorded: Callable[[str], int | None]
    held: HeldLookup
    app_id: str | None = None
    first_line: int = 0
    logged: int | None = None
    newest: debezium.Position | None = None
    behind: int = 0
    kept_behind: bool = False
    """An event at or before the recorded position was kept (the log does not hold it)."""

    def keep(self, position: debezium.Position, line: int, event_id: str) -> bool:
        if self.app_id is None:
            self.app_id, self.first_line = position.app_id, line
            self.logged = self.recorded(position.app_id)
        elif position.app_id != self.app_id:
            raise InvalidEventError(
                f"line {line}: an event of {position.app_id}, but line {self.first_line} was "
                f"of {self.app_id}: append each connector's events on their own (one source "
                f"position per commit)"
            )
        if self.newest is None or position.version > self.newest.version:
            self.newest = position
        if self.logged is None or position.version > self.logged:
            return True
        if position.snapshot and position.version == self.logged:
            return True  # snapshot rows share a position: kept (a re-run appends them again)
        if self.held(self.app_id, event_id, position.version) is False:
            self.kept_behind = True
            return True
        self.behind += 1
        return False

    def transaction(self) -> Transaction | None:
        """The position to record: the newest of the input, if the log is behind it. It
        follows the position the input was sorted against: another append of the connector
        committed meanwhile would have the events both hold doubled, so the commit fails
        (:class:`~replog.errors.TransactionOrderError`) and a re-run sorts them again."""
        if self.newest is None:
            return None
        if self.logged is not None and self.newest.version <= self.logged:
            if not self.kept_behind:
                return None
            # Events the log did not hold, all at or before its position (a file of another
            # topic): the commit must still fail if another append of the connector landed
            # meanwhile (two runs racing both found them new). It records one past the
            # position: every event up to a recorded position is looked up by id, so a real
            # event there is still told apart, and recorded positions still rise.
            return Transaction(self.newest.app_id, self.logged + 1, follows=self.logged)
        follows = self.logged if self.logged is not None else 0
        return Transaction(self.newest.app_id, self.newest.version, follows=follows)


def _no_position(app_id: str) -> int | None:
    return None


def _nothing_known(app_id: str, event_id: str, position: int) -> bool | None:
    return None


@dataclass
class _History:
    """The event ids of a log's appends, read back from the head only as far as a lookup
    needs. An event at source position ``p`` is in a commit recording a position at or
    past ``p`` (a commit records its input's newest), and the positions a connector's
    commits record rise; so once a commit recording less than ``p`` has been read, every
    commit that can hold the event has been."""

    log: ReplicationLog
    app_id: str
    state: LogState
    """The log as the lookups read it (one refresh for them all)."""
    next_version: int
    ids: set[str] = field(default_factory=set)
    floor: int | None = None
    """The position recorded by the oldest of the connector's commits read (None: none)."""
    expired: bool = False
    unknown_to: float | None = None
    """Events at or before this position may be in a commit whose events are no longer all
    there (expired, truncated, or key-compacted: the log held them, and a key compaction
    drops only events a newer change of their key supersedes); None: none. The lookups that
    read such a commit are those of positions up to the floor when it was read."""
    warned: bool = False

    def holds(self, event_id: str, position: int) -> bool | None:
        while not self.expired and (self.floor is None or self.floor >= position):
            if event_id in self.ids:
                return True
            if self.next_version == 0:  # the whole log was read
                break
            self._read(self.next_version)
            self.next_version -= 1
        if event_id in self.ids:
            return True
        # Unknown only if a commit that can hold it is not all there: the commits read past
        # an expiry or a compacted one, before a floor below ``position``, still tell.
        return None if self.unknown_to is not None and position <= self.unknown_to else False

    def _unknown(self) -> None:
        above = float("inf") if self.floor is None else self.floor
        self.unknown_to = above if self.unknown_to is None else max(self.unknown_to, above)

    def _read(self, version: int) -> None:
        record = history.read_commit(self.log.storage, version)
        if record is None:  # expired by retention: what it held is unknown
            self._unknown()
            self.expired = True
            return
        try:
            if record.operation == APPEND and record.add:
                # An append's entries on a shard are one run of sequences: one scan reads
                # them all, from the state the lookups began with (no refresh per entry).
                runs: dict[int, tuple[int, int]] = {}
                for segment in record.add:
                    first, last = runs.get(
                        segment.shard, (segment.first_sequence, segment.last_sequence)
                    )
                    runs[segment.shard] = (
                        min(first, segment.first_sequence),
                        max(last, segment.last_sequence),
                    )
                start = dict.fromkeys(range(self.log.shards), 0)  # other shards: none
                end = dict(start)
                for shard, (first, last) in runs.items():
                    start[shard], end[shard] = first - 1, last
                read = 0
                for batch in self.log.scan(start, end, state=self.state):
                    self.ids.update(batch.column("event_id").to_pylist())
                    read += batch.num_rows
                if read < sum(last - first + 1 for first, last in runs.values()):
                    self._unknown()  # key-compacted since: the ids it dropped are gone
        except DataLossError:  # truncated since: its events are gone from the log
            self._unknown()
            self.expired = True
            return
        writer = record.writer
        if writer is not None and (writer.sink_id, writer.query_id) == (self.app_id, TXN_QUERY):
            self.floor = writer.epoch


def _held_by(log: ReplicationLog) -> HeldLookup:
    """Whether ``log`` holds an event of a connector, reading its commits back from the
    head as far as the event's position needs (once per append: earlier lookups' reading
    is kept). Unknown (None) past expired history: such events count as appended."""
    histories: dict[str, _History] = {}

    def held(app_id: str, event_id: str, position: int) -> bool | None:
        if app_id not in histories:
            state = log.refresh(verify_within=0)
            histories[app_id] = _History(log, app_id, state, state.version)
        found = histories[app_id].holds(event_id, position)
        if found is None and not histories[app_id].warned:
            histories[app_id].warned = True
            logger.warning(
                "%s: events of %s before the position it records, from position %d on, are "
                "taken as appended: the history that would tell expired or was compacted",
                log.url,
                app_id,
                position,
            )
        return found

    return held


@dataclass
class _Brackets:
    """Source transactions as BEGIN/END records bracket them: which are whole in the input."""

    begun: set[str] = field(default_factory=set)
    ended: dict[str, int | None] = field(default_factory=dict)
    events: dict[str, set[str]] = field(default_factory=dict)
    """Transaction id -> the (distinct) event ids of it in the input."""

    def mark(self, marker: debezium.Marker) -> None:
        if marker.status == "BEGIN":
            self.begun.add(marker.id)
        else:
            self.ended[marker.id] = marker.event_count

    def count(self, change: debezium.Change) -> None:
        if change.transaction_id is not None:
            ids = self.events.setdefault(change.transaction_id, set())
            ids.add(str(change.record["event_id"]))

    def whole(self) -> tuple[int, list[str]]:
        """How many transactions the input holds whole, and the ids of those it holds part
        of (only when it has BEGIN/END records at all)."""
        if not self.begun and not self.ended:
            return 0, []
        ids = self.begun | set(self.ended) | set(self.events)
        whole = {
            i
            for i in ids
            if i in self.begun
            and i in self.ended
            and self.ended[i] in (None, len(self.events.get(i, ())))
        }
        return len(whole), sorted(ids - whole)


@dataclass
class _Taken:
    """What an input gave so far: its events and what was dropped on the way (why)."""

    positions: _Positions
    chunks: _Chunks = field(default_factory=_Chunks)
    skipped: Counter[str] = field(default_factory=Counter)
    brackets: _Brackets = field(default_factory=_Brackets)
    schemas: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    unpinned: Counter[str] = field(default_factory=Counter)
    """Event id -> how often a change whose source does not pin it gave it so far."""
    unpositioned: int = 0
    """Changes taken without a usable source position (no redelivery detection)."""

    def take(
        self, converted: debezium.Change | debezium.Skipped | debezium.Marker, line: int
    ) -> None:
        """One Debezium record: an event unless the log or an earlier line has it."""
        if isinstance(converted, debezium.Marker):
            self.brackets.mark(converted)
            self.skipped[f"transaction {converted.status} record"] += 1
            return
        if isinstance(converted, debezium.Skipped):  # a record that carries no event
            self.skipped[converted.reason] += 1
            return
        if not converted.pinned:
            # Two changes of one row may look alike (X, Y, X): neither is a redelivery of
            # the other that could be told apart, so none collapses (each its own id).
            event_id = str(converted.record["event_id"])
            repeats = self.unpinned[event_id]
            self.unpinned[event_id] += 1
            if repeats:
                converted.record["event_id"] = str(
                    uuid.uuid5(debezium.EVENT_ID_NAMESPACE, f"{event_id}#{repeats}")
                )
        self.brackets.count(converted)
        if converted.position is not None and not self.positions.keep(
            converted.position, line, str(converted.record["event_id"])
        ):
            return
        if not self.chunks.add(converted.record, line):
            return  # a redelivery of an earlier line
        if converted.position is None:
            self.unpositioned += 1
        collection = converted.record["collection"]
        if converted.digest is not None and converted.schema is not None and collection:
            self.schemas.setdefault((collection, converted.digest), converted.schema)


def read_lines(
    lines: Iterable[str],
    *,
    format: str = "replog",
    key_fields: tuple[str, ...] = (),
    progress: Callable[[int], None] | None = None,
    recorded: Callable[[str], int | None] = _no_position,
    held: HeldLookup = _nothing_known,
    now: int | None = None,
) -> Ingested:
    """Parse and validate JSON lines (blank lines are skipped).

    Args:
        lines: the input, one JSON object per line.
        format: ``"replog"`` (change events) or ``"debezium"`` (Debezium values, or Kafka
            records ``{"key", "value"}`` of them).
        key_fields: for Debezium, the row fields that make an event's key.
        progress: called with the byte length of each line read.
        recorded: the source position a log holds for a connector's app id (Debezium:
            events after it are new).
        held: whether a log holds an event of a connector at or before that position
            (held: dropped and counted; not held: kept; None, unknown: dropped).
        now: the time of events that carry none (marked in their metadata).

    Raises:
        InvalidEventError: a line is not valid JSON or not a valid event (names the line).
    """
    _converter(format, key_fields)
    taken = _Taken(positions=_Positions(recorded, held))
    filled_ms = now if now is not None else now_ms()
    count = 0
    for count, line in enumerate(lines, start=1):
        if progress is not None:
            progress(len(line.encode("utf-8")))
        if not line.strip():
            continue
        if format == "debezium" and line.strip() == "null":
            taken.skipped["tombstone (null value)"] += 1
            continue
        members = _members(line, count)
        if format != "debezium":
            taken.chunks.add(replog_record(members), count)
            continue
        try:
            converted = debezium.convert(members, key_fields, text=line, filled_ms=filled_ms)
        except InvalidEventError as exc:
            raise InvalidEventError(f"line {count}: {exc}") from exc
        taken.take(converted, count)
    whole, partial = taken.brackets.whole()
    if partial:
        logger.warning(
            "the input holds part of source transaction(s) %s only (BEGIN/END): they are "
            "split across commits",
            ", ".join(partial[:5]),
        )
    return Ingested(
        taken.chunks.table(),
        count,
        taken.skipped,
        duplicates=taken.chunks.duplicates,
        behind=taken.positions.behind,
        position=taken.positions.transaction(),
        schemas=taken.schemas,
        transactions=whole,
        partial_transactions=partial,
        unkeyed=taken.chunks.unkeyed,
        unpositioned=taken.unpositioned,
    )


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

    Debezium input is idempotent by itself: the connector's newest source position is
    recorded in the commit (a :class:`Transaction` ``debezium.<source.name>`` whose version
    is the position), and events at or before the position the log holds are dropped and
    counted. An explicit ``transaction`` is refused when the input has a position to record
    (:class:`InvalidOptionError`, nothing written). The schemas the
    events name are registered (put-if-absent) before the commit.
    """
    ingested = read_lines(
        lines,
        format=format,
        key_fields=key_fields,
        progress=progress,
        recorded=log.transaction_version,
        held=_held_by(log),
    )
    if transaction is not None and ingested.position is not None:
        # Its events past the connector's recorded position would sit in a commit that
        # records none: a later commit recording an older position (a file of another
        # topic) would end the lookup before it, and a redelivery of them be appended again.
        raise InvalidOptionError(
            f"{log.url}: the input's newest source position ({ingested.position.app_id} "
            f"{ingested.position.version}) is past the one the log records, and an explicit "
            f"transaction would take its place: leave --txn-app-id out (the position makes "
            f"the append idempotent)"
        )
    transaction = transaction or ingested.position
    record = None
    if ingested.table.num_rows:
        for (collection, digest), schema in ingested.schemas.items():
            registry.register(log.storage, collection, schema, digest)
        record = log.append(ingested.table, transaction=transaction)
        if record is None and transaction is not None and transaction is ingested.position:
            # The position was past the log's when the input was checked against it: an
            # append of the connector recording it or a later one landed meanwhile. Its
            # events are not these (two inputs sharing a newest position, or two files of
            # other topics), so skipping as "already applied" would lose them.
            raise TransactionOrderError(
                f"{log.url}: another append of {transaction.app_id} recorded position "
                f"{transaction.version} or later while this one ran; nothing was committed "
                f"(run it again)"
            )
    return AppendReport(
        log.url,
        ingested.lines,
        record,
        ingested.skipped,
        transaction=transaction,
        already_applied=record is None and ingested.table.num_rows > 0,
        duplicates=ingested.duplicates,
        behind=ingested.behind,
        transactions=ingested.transactions,
        partial_transactions=ingested.partial_transactions,
        unkeyed=ingested.unkeyed,
        unpositioned=ingested.unpositioned,
    )
