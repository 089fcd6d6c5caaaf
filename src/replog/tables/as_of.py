"""A table built by ``apply_changes`` as the source had it at any past point: pure core.

The point is a source position (a PostgreSQL LSN) or a time. The table as of it is the
newest Delta version whose events all lie at or before the point (each version records
what it covers: :mod:`replog.tables.coverage`), plus the log's events after that version's
offsets up to the point, reduced per key as ``apply_changes`` reduces a micro-batch
(:func:`rows_as_of`): values not sent filled from the key's earlier values, deletes,
changed keys, truncates. A transaction is whole: its events share its commit position
and time, so all of them are at or before the point, or none.

The cost is a read of that version plus the events after it (to the log's head), never a
replay from the start.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replog.capture.options import capture_slot
from replog.errors import AsOfError, DataLossError, InvalidOptionError
from replog.format.commits import TXN_QUERY
from replog.reading import LogReader
from replog.tables import changes as rows
from replog.tables import coverage as covered
from replog.tables import fills
from replog.tables.changes import (
    ACTION,
    CURRENT,
    DELETE,
    OPERATION,
    POSITION,
    SEQUENCE,
    SHARD,
    SOURCE_POSITION,
    TIMESTAMP,
    VALID_TO,
    VALID_TO_POSITION,
)
from replog.timeutil import iso, iso_instant_ms

logger = logging.getLogger(__name__)

TRUNCATE = "truncate"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Point:
    """A point in the source's history: a position (LSN) or a time (ms since the epoch,
    UTC), exactly one of them."""

    position: int | None = None
    ms: int | None = None

    def __str__(self) -> str:
        if self.position is not None:
            return f"LSN {covered.lsn_to_text(self.position)}"
        assert self.ms is not None
        return iso(self.ms)

    def of(self, span: covered.Span) -> int | None:
        """The span's last position or time, whichever the point is."""
        return span.last_position if self.position is not None else span.last_ms

    def first_of(self, span: covered.Span) -> int | None:
        return span.first_position if self.position is not None else span.first_ms

    @property
    def value(self) -> int:
        found = self.position if self.position is not None else self.ms
        assert found is not None
        return found

    def shown(self, value: int | None) -> str:
        """A position or time of this point's kind, as a user writes it."""
        if value is None:
            return "?"
        return covered.lsn_to_text(value) if self.position is not None else iso(value)

    def holds(self, events: pa.Table | pa.RecordBatch) -> pa.Array:
        """Per event (the log's columns), whether it is at or before the point."""
        if self.position is not None:
            found = covered.event_positions(events.column("metadata"))
        else:
            found = covered.event_times(events.column("timestamp"))
        return pc.fill_null(pc.less_equal(found, self.value), False)


def point(at: str | datetime | None = None, lsn: str | None = None) -> Point:
    """The point ``table_as_of`` is given: ``at`` (ISO 8601 text or a ``datetime``; one
    without a zone is UTC, as the log's times are) or ``lsn`` (``0/3A5F1C8``), exactly one.
    A time counts to the millisecond (the source's commit times are kept in ms)."""
    if (at is None) == (lsn is None):
        raise InvalidOptionError(
            f"table_as_of: give exactly one of at= (a time) and lsn= (a position), got "
            f"at={at!r}, lsn={lsn!r}"
        )
    if lsn is not None:
        if not isinstance(lsn, str):
            raise InvalidOptionError(f"table_as_of: lsn must be text like '0/3A5F1C8', got {lsn!r}")
        return Point(position=covered.lsn_to_int(lsn, "table_as_of: lsn"))
    if isinstance(at, datetime):
        moment = at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)
        return Point(ms=(moment - _EPOCH) // timedelta(milliseconds=1))
    if isinstance(at, str):
        return Point(ms=iso_instant_ms(at, "table_as_of: at"))
    raise InvalidOptionError(
        f"table_as_of: at must be ISO 8601 text or a datetime, got {type(at).__name__}"
    )


@dataclass(frozen=True)
class Plan:
    """How a table is read as of a point: its ``version`` (None: from the empty table),
    the log's ``events`` of the table after it up to the point (truncates apart), and how
    the table is built (``coverage``: keys, mode, schema, collection)."""

    point: Point
    version: int | None
    coverage: covered.Coverage
    events: pa.Table
    truncates: pa.Table
    """The truncate events among them: shard, sequence, timestamp, (source) position."""
    cut: bool = False
    """scd2: ``version`` holds every event up to the point (and later ones): its history
    cut at the point (:func:`history_at`) is the table as of it, no log event needed."""


def reachable(
    versions: Sequence[covered.VersionCoverage], point: Point, lows: Mapping[int, int]
) -> tuple[int | None, int | None]:
    """The oldest and newest position or time (of ``point``'s kind) the table can be read
    as of from its ``versions`` and a log whose oldest retained sequence per shard is
    ``lows``; None: unbounded (oldest: the log holds every event; newest: not known)."""
    whole_log = all(low <= 1 for low in lows.values())
    oldest = None
    if not whole_log:
        for entry in versions:
            if all(entry.coverage.offsets.get(s, 0) + 1 >= low for s, low in lows.items()):
                oldest = point.of(entry.reached)
                break
        else:
            oldest = point.of(versions[-1].reached) if versions else None
    newest = point.of(versions[-1].reached) if versions else None
    return oldest, newest


def plan(
    versions: Sequence[covered.VersionCoverage],
    log: LogReader,
    at: Point,
    *,
    collection: str | None = None,
    cut: bool = True,
) -> Plan:
    """Which version and which of the log's events give the table as of ``at``. An scd2
    table (unless not ``cut``) is read from the first version after the point that holds
    every event up to it, when one does (:attr:`Plan.cut`): a read of that version alone.

    Raises:
        AsOfError: the table records no coverage, names another log, or ``at`` is outside
            what its versions and the log's retained events can show (the message names
            the range that is).
    """
    if not versions:
        raise AsOfError(
            "table_as_of: the table's commits record no log coverage: it was not written by "
            "apply_changes of this replog (or its history was cleaned up); apply the log "
            "again into a new table"
        )
    last = versions[-1].coverage
    if last.log_id is not None and last.log_id != log.log_id:
        raise AsOfError(
            f"table_as_of: the table was applied from log {last.log_id}, not {log.url} "
            f"({log.log_id})"
        )
    collection = collection or last.collection
    base = _base(versions, at)
    state = log.refresh()
    lows = dict(enumerate(state.lows))
    offsets = dict(base.coverage.offsets) if base is not None else {}
    newest = newest_in_log(log, at, state)
    if base is None and versions[0].version > 0 and not _from_start(state):
        raise _unreachable(versions, at, lows, log, newest)  # its first rows came otherwise
    if newest is not None and at.value > newest:
        raise AsOfError(
            f"table_as_of: {at} is newer than the log's newest event "
            f"({at.shown(newest)}): the log cannot tell what happened after it. "
            f"Reachable: {_range_text(versions, at, lows, newest)}"
        )
    if cut and last.mode == "scd2":
        holding = _holding(versions, base, log, state, at)
        if holding is not None:
            empty = _empty_events().select(["shard", "sequence", "timestamp"])
            return Plan(at, holding.version, last, _empty_events(), empty, cut=True)
    try:
        events = _tail(log, offsets, collection, state, at)
    except DataLossError as exc:
        if base is not None and _ends_at(versions, base, at):  # Delta alone shows it
            empty = _empty_events().select(["shard", "sequence", "timestamp"])
            return Plan(at, base.version, last, _empty_events(), empty)
        raise _unreachable(versions, at, lows, log, newest) from exc
    is_truncate = pc.fill_null(pc.equal(events.column("operation"), TRUNCATE), False)
    truncated = events.filter(is_truncate)
    truncates = truncated.select(["shard", "sequence", "timestamp"]).append_column(
        "position", covered.event_positions(truncated.column("metadata"))
    )
    events = events.filter(pc.invert(is_truncate))
    return Plan(at, base.version if base is not None else None, last, events, truncates)


def _base(versions: Sequence[covered.VersionCoverage], at: Point) -> covered.VersionCoverage | None:
    """The newest version whose every applied event is at or before ``at`` (None: none)."""
    base = None
    for entry in versions:
        reached = at.of(entry.reached)
        if reached is None and entry.reached.first_ms is None:
            continue  # applied no event yet
        if reached is None:
            raise AsOfError(
                f"table_as_of: version {entry.version} covers events without a source "
                f"position: read it as of a time (at=) instead"
            )
        if reached <= at.value:
            base = entry
    return base


def _holding(
    versions: Sequence[covered.VersionCoverage],
    base: covered.VersionCoverage | None,
    log: LogReader,
    state: Any,
    at: Point,
) -> covered.VersionCoverage | None:
    """A version after ``base`` that holds every event at or before ``at`` (the first
    one after it, else the newest): on each shard of the log, its next event (none: the
    head) is past the point. None: neither does, or the log cannot tell."""
    later = [v for v in versions if base is None or v.version > base.version]
    for entry in later[:1] + later[-1:] if len(later) > 1 else later:
        if all(_past(log, state, shard, entry, at) for shard in range(len(state.heads))):
            return entry
    return None


def _past(
    log: LogReader, state: Any, shard: int, entry: covered.VersionCoverage, at: Point
) -> bool:
    """Whether the shard's first event ``entry`` did not apply is past ``at`` (no such
    event: the table applied the whole shard)."""
    following = entry.coverage.offsets.get(shard, 0) + 1
    if following > state.heads[shard]:
        return True
    try:
        found = [b for b in log.read(shard, following, following) if b.num_rows]
    except DataLossError:  # retention removed it: the log cannot tell
        return False
    if not found:
        return False
    newest = _newest(found[0].slice(0, 1), at)
    return newest is not None and newest > at.value


def history_at(table: pa.Table, at: Point) -> pa.Table | None:
    """An scd2 table's rows (a version holding every event up to ``at``: :attr:`Plan.cut`)
    as of ``at``: the versions opened at or before it, those closed after it open again
    (current, no end). None when a row's opening is not known in ``at``'s kind (rows
    written before the validity positions were)."""
    opened = _in_kind(table, rows.VALID_FROM, rows.VALID_FROM_POSITION, at)
    if opened is None or opened.null_count:
        return None
    closed = _in_kind(table, VALID_TO, VALID_TO_POSITION, at)
    if closed is None:
        return None
    kept = table.filter(pc.less_equal(opened, at.value))
    closed = closed.filter(pc.less_equal(opened, at.value))
    reopen = pc.fill_null(pc.greater(closed, at.value), False)
    for name in (VALID_TO, VALID_TO_POSITION):
        column = kept.column(name)
        ends = pc.if_else(reopen, pa.scalar(None, column.type), column)
        kept = kept.set_column(kept.schema.get_field_index(name), name, ends)
    still = pc.or_(pc.fill_null(kept.column(CURRENT), False), reopen)
    kind = kept.schema.field(CURRENT).type
    return kept.set_column(kept.schema.get_field_index(CURRENT), CURRENT, still.cast(kind))


def _in_kind(table: pa.Table, time: str, position: str, at: Point) -> pa.Array | None:
    """A validity column of ``table`` in ``at``'s kind: the position, or the time in ms
    (None: the table has no such column)."""
    if at.position is not None:
        if position not in table.column_names:
            return None
        return table.column(position).combine_chunks().cast(pa.int64())
    if time not in table.column_names:
        return None
    return covered.event_times(table.column(time))


def _captured(state: Any, at: Point) -> int | None:
    """How far the log's PostgreSQL captures have read their source (the position each
    recorded with its last commit: every transaction committed before it is in the log);
    None for a time point (a capture records no time) or a log no capture writes."""
    if at.position is None:
        return None
    found = [
        mark.epoch_of(TXN_QUERY)
        for app_id, mark in state.sinks.items()
        if capture_slot(app_id) is not None
    ]
    return max((f for f in found if f is not None), default=None)


def _empty_events() -> pa.Table:
    from replog.format.events import EVENT_SCHEMA  # noqa: PLC0415 - the log's schema

    return EVENT_SCHEMA.empty_table()


def _from_start(state: Any) -> bool:
    """Whether the log still holds its first event of every shard."""
    return all(low <= 1 for low in state.lows)


def _ends_at(
    versions: Sequence[covered.VersionCoverage], base: covered.VersionCoverage, at: Point
) -> bool:
    """Whether no event at or before ``at`` was applied after ``base``: the next version
    that applied events starts after the point."""
    for entry in versions:
        if entry.version <= base.version or not entry.own:
            continue
        first = at.first_of(entry.coverage.batch)
        if first is None:
            continue
        return first > at.value
    return False


def _tail(
    log: LogReader, offsets: Mapping[int, int], collection: str | None, state: Any, at: Point
) -> pa.Table:
    """The log's events after ``offsets`` up to ``at`` (of ``collection``, when known).
    A shard's events are in source order, so its read stops at its first event past the
    point: the cost is the events up to the point, not to the log's head."""
    wanted = []
    for shard in range(len(state.heads)):
        first = offsets.get(shard, 0) + 1
        if first > state.heads[shard]:
            continue
        for batch in log.read(shard, first, state.heads[shard]):
            held = at.holds(batch)
            kept = batch.filter(held)
            if collection is not None:
                kept = kept.filter(pc.equal(kept.column("collection"), collection))
            if kept.num_rows:
                wanted.append(kept)
            if not pc.all(held).as_py():
                break  # the rest of the shard is past the point
    if not wanted:
        return _empty_events()
    return pa.Table.from_batches(wanted)


def _newest(events: pa.Table | pa.RecordBatch, at: Point) -> int | None:
    """The newest position or time (``at``'s kind) among ``events``."""
    if at.position is not None:
        found = covered.event_positions(events.column("metadata"))
    else:
        found = covered.event_times(events.column("timestamp"))
    newest: int | None = pc.max(found).as_py()
    return newest


def _range_text(
    versions: Sequence[covered.VersionCoverage],
    at: Point,
    lows: Mapping[int, int],
    newest: int | None = None,
) -> str:
    oldest, reached = reachable(versions, at, lows)
    newest = newest if newest is not None else reached
    start = "the beginning" if oldest is None else at.shown(oldest)
    end = "the log's newest event" if newest is None else at.shown(newest)
    return f"from {start} to {end}"


def _unreachable(
    versions: Sequence[covered.VersionCoverage],
    at: Point,
    lows: Mapping[int, int],
    log: LogReader,
    newest: int | None,
) -> AsOfError:
    return AsOfError(
        f"table_as_of: {at} is not reachable: no table version ends there and the log "
        f"{log.url} no longer holds the events after the newest version before it "
        f"(retention). Reachable: {_range_text(versions, at, lows, newest)}"
    )


class _InMemory:
    """A version's rows as :class:`replog.tables.fills.Stored` (the fills read them)."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.schema = table.schema

    def rows(
        self, changes: pa.Table, keys: Sequence[str], columns: Sequence[str], *, current_only: bool
    ) -> pa.Table:
        found = _of_keys(self.table, changes, keys)
        if current_only and CURRENT in found.column_names:
            found = found.filter(pc.fill_null(found.column(CURRENT), False))
        return found.select([*keys, *columns])


def rows_as_of(
    base: pa.Table,
    changes: pa.Table,
    keys: Sequence[str],
    *,
    mode: str = "scd1",
    truncates: pa.Table | None = None,
) -> pa.Table:
    """The table's rows ``base`` (a version's) with ``changes`` (the log's events after
    it, typed as ``apply_changes`` types them: :mod:`replog.tables.changes`) applied as
    one micro-batch would apply them, in memory; ``truncates`` (shard, sequence,
    timestamp, and optionally the source position, of truncate events) end the rows of
    their shard, as a micro-batch holding them does (:func:`_truncated`)."""
    keys = rows.check_keys(keys)
    rows.check_mode(mode)
    cuts: rows.Cuts = {}
    if truncates is not None and truncates.num_rows:
        changes, cuts = _truncated(changes, truncates, keys, mode)
        if mode == "scd1":
            base = _without_cut(base, cuts)
    if changes.num_rows == 0:
        return _closed_by_cuts(base, cuts) if mode == "scd2" else base
    changes = rows.storable(changes)
    unkept = [rows.COLLECTION, *([SOURCE_POSITION] if mode == "scd1" else [])]
    changes = changes.drop_columns([c for c in unkept if c in changes.column_names])
    if base.num_rows:
        changes = rows.keys_as(changes, base, keys)
        seen = _positions(_of_keys(base, changes, keys), keys)
        if seen is not None:
            changes = rows.after_positions(changes, seen, keys)
    stored = _InMemory(base) if base.num_columns else None
    changes = fills.fill_unavailable(stored, changes, keys)
    changes = changes.drop_columns(
        [c for c in (rows.UNSENT, rows.OLD_KEY) if c in changes.column_names]
    )
    if mode == "scd1":
        return _scd1(base, changes, keys)
    return _scd2(base, changes, keys, cuts)


def _of_keys(base: pa.Table, changes: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``base``'s rows whose first key column holds a value of ``changes``' (a superset of
    their keys' rows): what the fills and the position guard look at costs the changes,
    not the table."""
    if base.num_rows == 0 or changes.num_rows == 0:
        return base.slice(0, 0)
    kind = base.schema.field(keys[0]).type
    values = pc.unique(changes.column(keys[0])).cast(kind)
    return base.filter(pc.is_in(base.column(keys[0]), value_set=values))


def _positions(base: pa.Table, keys: Sequence[str]) -> pa.Table | None:
    """The newest position per key among ``base``'s rows (the guard ``apply_changes``
    applies: a change at or before its key's row is not applied again)."""
    if SHARD not in base.column_names or SEQUENCE not in base.column_names:
        return None
    return rows.latest_per_key(base.select([*keys, *POSITION]), keys)


def _scd1(base: pa.Table, changes: pa.Table, keys: Sequence[str]) -> pa.Table:
    latest = rows.latest_per_key(changes, keys)
    kept = _without_keys(base, latest, keys)
    is_delete = pc.fill_null(pc.equal(latest.column(OPERATION), DELETE), False)
    added = latest.filter(pc.invert(is_delete)).drop_columns([OPERATION, TIMESTAMP])
    return _stacked(kept, added)


def _scd2(base: pa.Table, changes: pa.Table, keys: Sequence[str], cuts: rows.Cuts) -> pa.Table:
    """As the scd2 merge: a key's close row ends its current version (at a truncate of
    its shard when that came first), the other current versions of a truncated shard end
    at its first truncate, the new versions are added."""
    history = rows.scd2_rows(changes, keys, cuts)
    closes = history.filter(pc.equal(history.column(ACTION), "close"))
    versions = history.filter(pc.equal(history.column(ACTION), "insert")).drop_columns([ACTION])
    if base.num_rows and closes.num_rows:
        base = _closed(base, closes.select([*keys, VALID_TO, VALID_TO_POSITION]), keys)
    return _stacked(_closed_by_cuts(base, cuts), versions)


def _closed(base: pa.Table, closes: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``base`` with the current version of each key of ``closes`` ended at its
    ``__valid_to`` and ``__valid_to_position``."""
    closes = rows.keys_as(closes, base, keys)
    numbered = base.select(list(keys)).append_column(
        "__row", pa.array(np.arange(base.num_rows, dtype=np.int64))
    )
    numbered = numbered.filter(pc.fill_null(base.column(CURRENT), False))
    pairs = numbered.join(
        closes.rename_columns([*keys, "__ends", "__end_positions"]),
        list(keys),
        join_type="inner",
        use_threads=False,
    )
    index = pairs.column("__row").to_numpy()
    take = np.arange(base.num_rows, dtype=np.int64)
    take[index] = base.num_rows + np.arange(len(index))
    for name, ended in ((VALID_TO, "__ends"), (VALID_TO_POSITION, "__end_positions")):
        base = _set_at(base, name, pairs.column(ended), take)
    current = base.column(CURRENT).combine_chunks().to_numpy(zero_copy_only=False).copy()
    current[index] = False
    return base.set_column(
        base.schema.get_field_index(CURRENT),
        CURRENT,
        pa.array(current, base.schema.field(CURRENT).type),
    )


def _set_at(base: pa.Table, name: str, values: pa.ChunkedArray, take: np.ndarray) -> pa.Table:
    """``base`` with column ``name`` taken from its own values and ``values`` appended
    after them (``take``: per row, its index in the two; a column ``base`` lacks, as a
    table written before it existed, is added)."""
    if name not in base.column_names:
        base = base.append_column(name, pa.nulls(base.num_rows, values.type))
    have = base.column(name).combine_chunks()
    joined = pa.concat_arrays([have, values.combine_chunks().cast(have.type)])
    return base.set_column(base.schema.get_field_index(name), name, joined.take(pa.array(take)))


def _without_keys(base: pa.Table, latest: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``base``'s rows whose key ``latest`` does not hold."""
    if base.num_rows == 0 or latest.num_rows == 0:
        return base
    changed = rows.keys_as(latest.select(list(keys)), base, keys)
    numbered = base.select(list(keys)).append_column(
        "__row", pa.array(np.arange(base.num_rows, dtype=np.int64))
    )
    gone = numbered.join(changed, list(keys), join_type="left semi", use_threads=False)
    keep = np.ones(base.num_rows, dtype=bool)
    keep[gone.column("__row").to_numpy()] = False
    return base.filter(pa.array(keep))


def _stacked(base: pa.Table, added: pa.Table) -> pa.Table:
    """``base``'s rows then ``added``'s, in ``base``'s columns (and those ``added`` brings:
    a column the tail adds is null in older rows)."""
    if added.num_rows == 0:
        return base
    if base.num_columns == 0:
        return added
    added = rows.align(added, base.schema)
    schema = pa.schema(
        [*base.schema, *(f for f in added.schema if f.name not in base.schema.names)]
    )
    base = rows.align(base, schema) if len(schema) > len(base.schema) else base
    return pa.concat_tables([base.select(schema.names), added.select(schema.names).cast(schema)])


def _truncated(
    changes: pa.Table, truncates: pa.Table, keys: Sequence[str], mode: str
) -> tuple[pa.Table, rows.Cuts]:
    """``changes`` with the truncate events among them, split as a micro-batch splits
    them (:func:`replog.tables.changes.split_truncates`): scd1 drops the changes of a
    shard before its last truncate, scd2 keeps them and ends, at each truncate, the keys
    its shard holds live then; and the cuts, per shard. A partition's TRUNCATE needs
    nothing here: capture writes it as a delete of each row the partition held."""
    marks = {
        SHARD: truncates.column("shard"),
        SEQUENCE: truncates.column("sequence"),
        OPERATION: pa.array([TRUNCATE] * truncates.num_rows, pa.string()),
        TIMESTAMP: truncates.column("timestamp"),
    }
    if "position" in truncates.column_names:
        marks[SOURCE_POSITION] = truncates.column("position")
    events = pa.table(marks)
    if changes.num_columns:
        like = [changes.schema.field(n) for n in events.column_names if n in changes.schema.names]
        events = rows.align(events, pa.schema(like))
        events = pa.concat_tables([changes, events], promote_options="permissive")
    return rows.split_truncates(events, keys, history=mode == "scd2")


def _without_cut(base: pa.Table, cuts: rows.Cuts) -> pa.Table:
    """scd1: ``base`` without the rows a truncate of their shard removed."""
    if not cuts or base.num_rows == 0 or SHARD not in base.column_names:
        return base
    return base.filter(pc.invert(_cut_rows(base, cuts)))


def _cut_rows(base: pa.Table, cuts: rows.Cuts) -> pa.Array:
    """Per row of ``base``, whether a truncate of ``cuts`` is after it on its shard."""
    shard = base.column(SHARD).to_numpy(zero_copy_only=False)
    sequence = base.column(SEQUENCE).to_numpy(zero_copy_only=False)
    hit = np.zeros(base.num_rows, dtype=bool)
    for number, cut in cuts.items():
        hit |= (shard == number) & (sequence < cut.last)
    return pa.array(hit)


def _closed_by_cuts(base: pa.Table, cuts: rows.Cuts) -> pa.Table:
    """scd2: ``base``'s current versions that a truncate of their shard ended, ended at
    the shard's first truncate in ``cuts`` (its time and source position)."""
    if not cuts or base.num_rows == 0 or SHARD not in base.column_names:
        return base
    current = pc.fill_null(base.column(CURRENT), False)
    ending = pc.and_(_cut_rows(base, cuts), current).to_numpy(zero_copy_only=False)
    if not ending.any():
        return base
    shards = base.column(SHARD).to_pylist()
    if VALID_TO_POSITION not in base.column_names:
        base = base.append_column(VALID_TO_POSITION, pa.nulls(base.num_rows, pa.int64()))
    for name in (VALID_TO, VALID_TO_POSITION):
        values = base.column(name).to_pylist()
        for index in np.flatnonzero(ending):
            cut = cuts[shards[index]]
            values[index] = cut.timestamp if name == VALID_TO else cut.source
        kind = base.schema.field(name).type
        base = base.set_column(base.schema.get_field_index(name), name, pa.array(values, kind))
    still = pc.and_(current, pa.array(~ending))
    return base.set_column(base.schema.get_field_index(CURRENT), CURRENT, still)


def newest_in_log(log: LogReader, at: Point, state: Any | None = None) -> int | None:
    """The newest position or time (``at``'s kind) the log knows of its source: its
    newest event's (a shard's events are in source order: its last event is its newest)
    and, for a position, how far its PostgreSQL captures have read."""
    state = log.refresh() if state is None else state
    found = [_captured(state, at)]
    for shard, head in enumerate(state.heads):
        if head >= max(state.lows[shard], 1):
            last = list(log.read(shard, head, head))
            if last:
                found.append(_newest(pa.Table.from_batches(last), at))
    return max((f for f in found if f is not None), default=None)


def check_log_reaches(log: LogReader, at: Point, *, whole: bool = True) -> None:
    """For the log's latest rows as of ``at`` read from the log alone: the log still
    holds every event up to it (unless not ``whole``: what is retained is read) and
    knows its source up to it.

    Raises:
        AsOfError: naming the shard whose first events are gone, or the newest point the
            log knows.
    """
    state = log.refresh()
    if whole:
        for shard, low in enumerate(state.lows):
            if low > 1:
                raise AsOfError(
                    f"the latest rows as of {at} cannot be read from {log.url} alone: shard "
                    f"{shard} holds events from sequence {low} on (retention removed the "
                    f"earlier ones). Read a Delta replica with table_as_of, or set "
                    f"failOnDataLoss=false to reduce what is retained"
                )
    newest = newest_in_log(log, at, state)
    if newest is None or at.value > newest:
        shown = "it holds no event" if newest is None else f"its newest is {at.shown(newest)}"
        raise AsOfError(
            f"{at} is newer than what the log {log.url} knows of its source ({shown}): the "
            f"log cannot tell what happened after it"
        )


@dataclass(frozen=True)
class Reach:
    """The oldest and newest points a read as of can be given: positions (LSN) and
    times (ms). An oldest of None with ``from_beginning``: any point from before the
    first event on; None otherwise: not known (no event carries one)."""

    oldest_position: int | None
    newest_position: int | None
    oldest_ms: int | None
    newest_ms: int | None
    from_beginning: bool

    def to_json(self) -> dict[str, Any]:
        def lsn(value: int | None) -> str | None:
            return None if value is None else covered.lsn_to_text(value)

        return {
            "from_beginning": self.from_beginning,
            "oldest_lsn": lsn(self.oldest_position),
            "newest_lsn": lsn(self.newest_position),
            "oldest_ms": self.oldest_ms,
            "newest_ms": self.newest_ms,
        }


def log_reach(log: LogReader) -> Reach | None:
    """What ``view=latest`` as of a point can read from the log alone (None: nothing,
    retention removed its first events)."""
    state = log.refresh()
    if not _from_start(state):
        return None
    return _reach(log, state, None, None, from_beginning=True)


def table_reach(versions: Sequence[covered.VersionCoverage], log: LogReader) -> Reach:
    """What ``table_as_of`` can read of a table with ``versions`` and ``log``."""
    state = log.refresh()
    lows = dict(enumerate(state.lows))
    oldest_position, _ = reachable(versions, Point(position=0), lows)
    oldest_ms, _ = reachable(versions, Point(ms=0), lows)
    whole = _from_start(state) and bool(versions) and versions[0].version == 0
    return _reach(log, state, oldest_position, oldest_ms, from_beginning=whole)


def _reach(
    log: LogReader,
    state: Any,
    oldest_position: int | None,
    oldest_ms: int | None,
    *,
    from_beginning: bool,
) -> Reach:
    """A reach from these oldest points to the newest the log knows."""
    newest_position = newest_in_log(log, Point(position=0), state)
    newest_ms = newest_in_log(log, Point(ms=0), state)
    return Reach(oldest_position, newest_position, oldest_ms, newest_ms, from_beginning)
