"""The change event: its columns, its validation, and its Arrow and Spark schemas.

A log stores events in segments with :data:`STORED_SCHEMA` (no shard, no sequence: those
are assigned when the segment is committed and added back on read, which is what lets a
writer stage a segment before it knows its sequences). Readers see :data:`EVENT_SCHEMA`,
which is also the Spark schema of the ``replog`` source.

Payloads (``data``, ``before``) are bytes, stored byte for byte. A payload given as a
JSON value is stored as its exact JSON text (:mod:`replog.format.jsontext`).

``pyarrow.compute`` is imported where it is used, not with this module: Spark starts a
Python process per streaming query that imports replog to plan it, and planning needs no
compute kernel (the import costs ~30 ms of every query).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa

from replog.errors import InvalidEventError
from replog.format import jsontext
from replog.timeutil import MICROSECONDS_ABOVE, SECONDS_BELOW, iso, now_utc

OPERATIONS: tuple[str, ...] = ("insert", "update", "delete", "bulk", "truncate")
"""The closed set of change operations. ``truncate``: every row of the collection whose
key routes to the event's shard, older than the event, is gone (a source's ``TRUNCATE``
is one such event on each shard: FORMAT.md, "Truncate events")."""

STORED_SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("operation", pa.string(), nullable=False),
        pa.field("collection", pa.string()),
        pa.field("key", pa.string(), nullable=False),
        pa.field("data", pa.binary(), nullable=False),
        pa.field("before", pa.binary()),
        pa.field("metadata", pa.string()),
    ]
)
"""Columns of a segment (format version 2)."""

STORED_SCHEMA_V1 = pa.schema([field for field in STORED_SCHEMA if field.name != "before"])
"""Columns of a segment written by format version 1 (no ``before``; read as null)."""

EVENT_SCHEMA = pa.schema(
    [
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("sequence", pa.int64(), nullable=False),
        *STORED_SCHEMA,
    ]
)

INPUT_COLUMNS = frozenset(
    {"data", "before", "key", "operation", "collection", "event_id", "timestamp", "metadata"}
)
IGNORED_COLUMNS = frozenset({"shard", "sequence"})
"""Columns accepted on input but ignored: the log assigns them."""

MIN_TIMESTAMP_US = -62_135_596_800_000_000
"""0001-01-01T00:00:00Z, the first instant Spark's TIMESTAMP holds."""
MAX_TIMESTAMP_US = 253_402_300_799_999_999
"""9999-12-31T23:59:59.999999Z, the last."""

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _utf8_bytes(text: str, name: str, where: str) -> bytes:
    """``text`` as UTF-8; :class:`InvalidEventError` naming the field and position if it
    cannot be (a lone surrogate, as ``json.loads('"\\ud800"')`` gives)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEventError(
            f"{where}: {name!r} holds {text[exc.start]!r} at position {exc.start}, a lone "
            f"UTF-16 surrogate, which UTF-8 cannot store"
        ) from exc


def _utf8(text: str, name: str, where: str) -> str:
    """``text``, checked to be storable as UTF-8 (:func:`_utf8_bytes`)."""
    _utf8_bytes(text, name, where)
    return text


def _payload(value: Any, name: str, where: str) -> bytes | None:
    """Bytes as given; text (a JSON string's characters, or exact JSON text) as UTF-8;
    other JSON values encoded exactly."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):  # RawJSON included: already the exact text
        return _utf8_bytes(value, name, where)
    try:
        text = jsontext.encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidEventError(f"{where}: {name!r} cannot be stored as JSON: {exc}") from exc
    return _utf8_bytes(text, name, where)


def _micros(value: Any, where: str, default_us: int) -> int:
    """Event time in microseconds since the epoch, checked against Spark's range."""
    if value is None:
        return default_us
    if isinstance(value, datetime):
        stamp = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        delta = stamp - _EPOCH
        micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    elif isinstance(value, int | float) and not isinstance(value, bool):
        # Numbers are milliseconds since the Unix epoch, as in Kafka record timestamps.
        if not math.isfinite(value):
            raise InvalidEventError(f"{where}: 'timestamp' {value!r} is not a number")
        if 0 < value < SECONDS_BELOW:  # 1764000000 read as ms is 1970-01-21
            raise InvalidEventError(
                f"{where}: 'timestamp' {value!r} read as milliseconds is {iso(int(value))}; "
                f"it looks like seconds - pass milliseconds ({round(value * 1000)}) or an "
                f"ISO-8601 string"
            )
        if value > MICROSECONDS_ABOVE:  # year 5138 and later
            raise InvalidEventError(
                f"{where}: 'timestamp' {value!r} is out of range or far in the future read "
                f"as milliseconds; it looks like microseconds or nanoseconds - pass "
                f"milliseconds"
            )
        micros = round(value * 1000)
    elif isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError as exc:
            raise InvalidEventError(
                f"{where}: 'timestamp' {value!r} is not an ISO-8601 date-time"
            ) from exc
        return _micros(parsed, where, default_us)
    else:
        raise InvalidEventError(
            f"{where}: 'timestamp' must be an ISO-8601 string or epoch milliseconds, "
            f"got {type(value).__name__}"
        )
    if not MIN_TIMESTAMP_US <= micros <= MAX_TIMESTAMP_US:
        raise InvalidEventError(
            f"{where}: 'timestamp' {value!r} is out of range (years 0001 to 9999; numbers "
            f"are milliseconds since 1970-01-01)"
        )
    return micros


def _metadata(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        try:
            text = jsontext.encode(value)
        except (TypeError, ValueError) as exc:
            raise InvalidEventError(f"{where}: 'metadata' cannot be stored as JSON: {exc}") from exc
        return _utf8(text, "metadata", where)
    if isinstance(value, str):
        if not jsontext.is_object_text(value):
            raise InvalidEventError(f"{where}: 'metadata' must be a JSON object, got {value!r:.80}")
        return _utf8(str(value), "metadata", where)
    raise InvalidEventError(f"{where}: 'metadata' must be a JSON object or a string holding one")


def _text(record: Mapping[str, Any], name: str, where: str) -> str | None:
    value = record.get(name)
    if value is None or isinstance(value, str):
        return None if value is None else _utf8(str(value), name, where)
    raise InvalidEventError(f"{where}: {name!r} must be a string, got {type(value).__name__}")


def events_from_records(
    records: Iterable[Mapping[str, Any]],
    *,
    where: Callable[[int], str] = lambda i: f"event {i}",
    default_collection: str | None = None,
) -> pa.Table:
    """Validate change events given as dicts and return them as a :data:`STORED_SCHEMA` table.

    ``where(i)`` names the i-th record (0-based) in error messages, e.g. "line 7". Every
    record is validated before anything is returned, so a bad record means nothing is
    written. An ``event_id`` given twice is an error naming both records.

    An event without ``key`` is keyed by its ``event_id`` (FORMAT.md, "Routing"): it then
    has no order with any other event, and key compaction never supersedes it. That is
    the one rule of every way in (``log.append``, ``replog append``, the ``replog-sink``,
    whose rows may lack a key too); ``replog append`` counts such events in its summary.
    """
    now_us = _micros(now_utc(), "now", 0)
    columns: dict[str, list[Any]] = {name: [] for name in STORED_SCHEMA.names}
    micros: list[int] = []
    seen_ids: dict[str, int] = {}
    for index, record in enumerate(records):
        label = where(index)
        if not isinstance(record, Mapping):
            raise InvalidEventError(f"{label}: an event must be a JSON object")
        unknown = set(record) - INPUT_COLUMNS - IGNORED_COLUMNS
        if unknown:
            raise InvalidEventError(
                f"{label}: unknown field(s) {sorted(unknown)}; allowed: {sorted(INPUT_COLUMNS)}"
            )
        data = _payload(record.get("data"), "data", label)
        if data is None:
            raise InvalidEventError(f"{label}: 'data' is required and must not be null")
        operation = record.get("operation", "insert")
        operation = "insert" if operation is None else operation
        if operation not in OPERATIONS:
            raise InvalidEventError(
                f"{label}: unknown operation {operation!r}; allowed: {', '.join(OPERATIONS)}"
            )
        event_id = _text(record, "event_id", label)
        if event_id == "":
            raise InvalidEventError(f"{label}: 'event_id' must not be empty (omit it for a UUID)")
        event_id = event_id or str(uuid.uuid4())
        if event_id in seen_ids:
            raise InvalidEventError(
                f"{label}: event_id {event_id!r} was already given by {where(seen_ids[event_id])}"
            )
        seen_ids[event_id] = index
        key = _text(record, "key", label)
        columns["event_id"].append(event_id)
        micros.append(_micros(record.get("timestamp"), label, now_us))
        columns["operation"].append(operation)
        columns["collection"].append(_text(record, "collection", label) or default_collection)
        columns["key"].append(key if key is not None else event_id)
        columns["data"].append(data)
        columns["before"].append(_payload(record.get("before"), "before", label))
        columns["metadata"].append(_metadata(record.get("metadata"), label))
    columns["timestamp"] = pa.array(micros, pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    return pa.table(columns, schema=STORED_SCHEMA)


def _cast_column(column: pa.ChunkedArray, target: pa.DataType, name: str) -> pa.ChunkedArray:
    try:
        return column.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidEventError(
            f"column {name!r} has type {column.type}, which cannot be used as {target}"
        ) from exc


def _is_text_or_binary(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_null(kind)
    )


def _check_metadata(metadata: pa.ChunkedArray) -> None:
    """Every non-null value must be a JSON object (checked once per distinct value)."""
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    for value in pc.unique(metadata.drop_null()).to_pylist():
        if not jsontext.is_object_text(value):
            raise InvalidEventError(
                f"column 'metadata' holds {value!r:.80}, which is not a JSON object"
            )


def _check_timestamps(timestamp: pa.ChunkedArray) -> None:
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    bounds = pc.min_max(timestamp.cast(pa.int64())).as_py()
    low, high = bounds["min"], bounds["max"]
    if low is not None and (low < MIN_TIMESTAMP_US or high > MAX_TIMESTAMP_US):
        bad = low if low < MIN_TIMESTAMP_US else high
        raise InvalidEventError(
            f"column 'timestamp' holds {bad} microseconds since 1970, out of range "
            f"(years 0001 to 9999)"
        )


class _InputColumns:
    """An input table's columns, each checked and cast to its stored type when asked for
    (None when the table does not have it)."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self.names = set(table.column_names)
        self.rows = table.num_rows

    def payload(self, name: str) -> pa.ChunkedArray | None:
        if name not in self.names:
            return None
        column = self.table.column(name)
        if not _is_text_or_binary(column.type):
            raise InvalidEventError(f"column {name!r} must be binary or string, got {column.type}")
        return _cast_column(column, pa.binary(), name)

    def text(self, name: str) -> pa.ChunkedArray | None:
        if name not in self.names:
            return None
        column = self.table.column(name)
        kind = column.type
        if not (
            pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
        ):
            raise InvalidEventError(f"column {name!r} must be a string, got {column.type}")
        return _cast_column(column, pa.string(), name)


def _check_names(names: set[str]) -> None:
    unknown = names - INPUT_COLUMNS - IGNORED_COLUMNS
    if unknown:
        raise InvalidEventError(
            f"unknown column(s) {sorted(unknown)}; allowed: {sorted(INPUT_COLUMNS)} "
            f"(and {sorted(IGNORED_COLUMNS)}, which are ignored)"
        )
    if "data" not in names:
        raise InvalidEventError("column 'data' (binary or string) is required")


def _data_column(columns: _InputColumns) -> pa.ChunkedArray:
    data = columns.payload("data")
    assert data is not None  # _check_names
    if data.null_count:
        raise InvalidEventError(f"column 'data' has {data.null_count} null value(s)")
    return data


def _operation_column(columns: _InputColumns) -> pa.ChunkedArray:
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    operation = columns.text("operation")
    if operation is None:
        return pa.chunked_array([pa.repeat(pa.scalar("insert", pa.string()), columns.rows)])
    operation = pc.fill_null(operation, "insert")
    valid = pc.is_in(operation, value_set=pa.array(OPERATIONS))
    if not pc.all(valid).as_py():
        values = sorted(set(pc.filter(operation, pc.invert(valid)).to_pylist()))[:5]
        raise InvalidEventError(
            f"column 'operation' has invalid value(s) {values}; allowed: {', '.join(OPERATIONS)}"
        )
    return operation


def _event_id_column(columns: _InputColumns) -> pa.ChunkedArray:
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    event_id = columns.text("event_id")
    if event_id is not None and pc.any(pc.equal(event_id, "")).as_py():
        raise InvalidEventError("column 'event_id' has empty value(s); use null for a fresh UUID")
    if event_id is not None and not event_id.null_count:
        return event_id
    fresh = pa.array([str(uuid.uuid4()) for _ in range(columns.rows)], pa.string())
    return fresh if event_id is None else pc.coalesce(event_id, fresh)


def _collection_column(columns: _InputColumns, default: str | None) -> pa.ChunkedArray:
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    collection = columns.text("collection")
    if collection is None:
        return pa.repeat(pa.scalar(default, pa.string()), columns.rows)
    return collection if default is None else pc.fill_null(collection, default)


def _metadata_column(columns: _InputColumns) -> pa.ChunkedArray:
    metadata = columns.text("metadata")
    if metadata is None:
        return pa.nulls(columns.rows, pa.string())
    if metadata.null_count < columns.rows:
        _check_metadata(metadata)
    return metadata


def _timestamp_column(columns: _InputColumns, now: datetime | None) -> pa.ChunkedArray:
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    stamp = pa.scalar(now or now_utc(), pa.timestamp("us", tz="UTC"))
    if "timestamp" not in columns.names:
        return pa.repeat(stamp, columns.rows)
    given = columns.table.column("timestamp")
    if not (pa.types.is_timestamp(given.type) or pa.types.is_null(given.type)):
        raise InvalidEventError(f"column 'timestamp' must be a timestamp, got {given.type}")
    timestamp = pc.fill_null(_cast_column(given, pa.timestamp("us", tz="UTC"), "timestamp"), stamp)
    _check_timestamps(timestamp)
    return timestamp


def events_from_table(
    table: pa.Table | pa.RecordBatch,
    *,
    default_collection: str | None = None,
    now: datetime | None = None,
) -> pa.Table:
    """Validate change events given as Arrow columns and return a :data:`STORED_SCHEMA` table.

    Columns are matched by name (see :data:`INPUT_COLUMNS`); ``shard``/``sequence`` are
    ignored; any other column is an error naming it. Vectorised: this is the sink's hot path.
    """
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    _check_names(set(table.column_names))
    columns = _InputColumns(table)
    data = _data_column(columns)
    before = columns.payload("before")
    event_id = _event_id_column(columns)
    key = columns.text("key")
    return pa.table(
        [
            event_id,
            _timestamp_column(columns, now),
            _operation_column(columns),
            _collection_column(columns, default_collection),
            event_id if key is None else pc.coalesce(key, event_id),
            data,
            pa.nulls(columns.rows, pa.binary()) if before is None else before,
            _metadata_column(columns),
        ],
        schema=STORED_SCHEMA,
    )


def upgrade_stored(table: pa.Table) -> pa.Table:
    """A segment's rows in the current :data:`STORED_SCHEMA` (format 1 had no ``before``)."""
    if table.schema.equals(STORED_SCHEMA_V1):
        index = STORED_SCHEMA.get_field_index("before")
        return table.add_column(
            index, STORED_SCHEMA.field("before"), pa.nulls(len(table), pa.binary())
        )
    return table


def to_event_batch(
    stored: pa.RecordBatch, shard: int, first_sequence: int | np.ndarray
) -> pa.RecordBatch:
    """Prepend ``shard`` and ``sequence`` to a stored batch (giving :data:`EVENT_SCHEMA`):
    consecutive from ``first_sequence``, or each row's given sequence (a holed entry)."""
    rows = stored.num_rows
    shard_col = pa.array(np.full(rows, shard, dtype=np.int32))
    if isinstance(first_sequence, np.ndarray):
        sequence_col = pa.array(first_sequence, type=pa.int64())
    else:
        sequence_col = pa.array(np.arange(first_sequence, first_sequence + rows, dtype=np.int64))
    return pa.RecordBatch.from_arrays(
        [shard_col, sequence_col, *stored.columns], schema=EVENT_SCHEMA
    )
