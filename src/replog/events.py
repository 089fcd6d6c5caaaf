"""The change event: its columns, its validation, and its Arrow and Spark schemas.

A log stores events in segments with :data:`STORED_SCHEMA` (no shard, no sequence:
those are assigned when the segment is committed and added back on read, which is what
lets a writer stage a segment before it knows its sequences). Readers see
:data:`EVENT_SCHEMA`, which is also the Spark schema of the ``replog`` source.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replog.errors import InvalidEventError

OPERATIONS: tuple[str, ...] = ("insert", "update", "delete", "bulk")
"""The closed set of change operations."""

STORED_SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.string(), nullable=False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("operation", pa.string(), nullable=False),
        pa.field("collection", pa.string()),
        pa.field("key", pa.string(), nullable=False),
        pa.field("data", pa.binary(), nullable=False),
        pa.field("metadata", pa.string()),
    ]
)

EVENT_SCHEMA = pa.schema(
    [
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("sequence", pa.int64(), nullable=False),
        *STORED_SCHEMA,
    ]
)

SPARK_SCHEMA_DDL = (
    "shard INT NOT NULL, sequence BIGINT NOT NULL, event_id STRING NOT NULL, "
    "timestamp TIMESTAMP NOT NULL, operation STRING NOT NULL, collection STRING, "
    "key STRING NOT NULL, data BINARY NOT NULL, metadata STRING"
)
""":data:`EVENT_SCHEMA` as a Spark DDL string (kept next to it so the two agree)."""

INPUT_COLUMNS = frozenset(
    {"data", "key", "operation", "collection", "event_id", "timestamp", "metadata"}
)
IGNORED_COLUMNS = frozenset({"shard", "sequence"})
"""Columns accepted on input but ignored: the log assigns them."""


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def _encode_data(value: Any, where: str) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if value is None:
        raise InvalidEventError(f"{where}: 'data' is required and must not be null")
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InvalidEventError(f"{where}: 'data' is not JSON-serialisable: {exc}") from exc


def _parse_timestamp(value: Any, where: str, default: datetime) -> datetime:
    if value is None:
        return default
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, int | float) and not isinstance(value, bool):
        # Integers are milliseconds since the Unix epoch, as in Kafka record timestamps.
        return datetime.fromtimestamp(value / 1000.0, tz=timezone.utc)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError as exc:
            raise InvalidEventError(
                f"{where}: 'timestamp' {value!r} is not an ISO-8601 date-time"
            ) from exc
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)
    raise InvalidEventError(
        f"{where}: 'timestamp' must be an ISO-8601 string or epoch milliseconds, "
        f"got {type(value).__name__}"
    )


def _encode_metadata(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError as exc:
            raise InvalidEventError(f"{where}: 'metadata' is not valid JSON: {exc}") from exc
        if not isinstance(decoded, dict):
            raise InvalidEventError(f"{where}: 'metadata' must be a JSON object")
        return value
    raise InvalidEventError(f"{where}: 'metadata' must be a JSON object or a string holding one")


def _optional_str(record: Mapping[str, Any], name: str, where: str) -> str | None:
    value = record.get(name)
    if value is None or isinstance(value, str):
        return value
    raise InvalidEventError(f"{where}: {name!r} must be a string, got {type(value).__name__}")


def events_from_records(
    records: Iterable[Mapping[str, Any]],
    *,
    where: Callable[[int], str] = lambda i: f"event {i}",
    default_collection: str | None = None,
) -> pa.Table:
    """Validate change events given as dicts and return them as a :data:`STORED_SCHEMA` table.

    ``where(i)`` names the i-th record (0-based) in error messages, e.g. "line 7".
    Validation covers every record before anything is returned, so a bad record means
    nothing is written.
    """
    now = now_utc()
    columns: dict[str, list[Any]] = {name: [] for name in STORED_SCHEMA.names}
    for index, record in enumerate(records):
        label = where(index)
        if not isinstance(record, Mapping):
            raise InvalidEventError(f"{label}: an event must be a JSON object")
        unknown = set(record) - INPUT_COLUMNS - IGNORED_COLUMNS
        if unknown:
            raise InvalidEventError(
                f"{label}: unknown field(s) {sorted(unknown)}; allowed: {sorted(INPUT_COLUMNS)}"
            )
        if "data" not in record:
            raise InvalidEventError(f"{label}: 'data' is required")
        operation = record.get("operation") or "insert"
        if operation not in OPERATIONS:
            raise InvalidEventError(
                f"{label}: unknown operation {operation!r}; allowed: {', '.join(OPERATIONS)}"
            )
        event_id = _optional_str(record, "event_id", label) or str(uuid.uuid4())
        key = _optional_str(record, "key", label)
        columns["event_id"].append(event_id)
        columns["timestamp"].append(_parse_timestamp(record.get("timestamp"), label, now))
        columns["operation"].append(operation)
        columns["collection"].append(
            _optional_str(record, "collection", label) or default_collection
        )
        columns["key"].append(key if key is not None else event_id)
        columns["data"].append(_encode_data(record["data"], label))
        columns["metadata"].append(_encode_metadata(record.get("metadata"), label))
    return pa.table(columns, schema=STORED_SCHEMA)


def _cast_column(column: pa.ChunkedArray, target: pa.DataType, name: str) -> pa.ChunkedArray:
    try:
        return column.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidEventError(
            f"column {name!r} has type {column.type}, which cannot be used as {target}"
        ) from exc


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
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    names = set(table.column_names)
    unknown = names - INPUT_COLUMNS - IGNORED_COLUMNS
    if unknown:
        raise InvalidEventError(
            f"unknown column(s) {sorted(unknown)}; allowed: {sorted(INPUT_COLUMNS)} "
            f"(and {sorted(IGNORED_COLUMNS)}, which are ignored)"
        )
    if "data" not in names:
        raise InvalidEventError("column 'data' (binary or string) is required")
    rows = table.num_rows
    data = table.column("data")
    if not (
        pa.types.is_binary(data.type)
        or pa.types.is_large_binary(data.type)
        or pa.types.is_string(data.type)
        or pa.types.is_large_string(data.type)
    ):
        raise InvalidEventError(f"column 'data' must be binary or string, got {data.type}")
    data = _cast_column(data, pa.binary(), "data")
    if data.null_count:
        raise InvalidEventError(f"column 'data' has {data.null_count} null value(s)")

    def string_column(name: str) -> pa.ChunkedArray | None:
        if name not in names:
            return None
        column = table.column(name)
        if not (
            pa.types.is_string(column.type)
            or pa.types.is_large_string(column.type)
            or pa.types.is_null(column.type)
        ):
            raise InvalidEventError(f"column {name!r} must be a string, got {column.type}")
        return _cast_column(column, pa.string(), name)

    operation = string_column("operation")
    if operation is None:
        operation = pa.chunked_array([pa.repeat(pa.scalar("insert", pa.string()), rows)])
    else:
        operation = pc.fill_null(operation, "insert")
        valid = pc.is_in(operation, value_set=pa.array(OPERATIONS))
        if not pc.all(valid).as_py():
            bad = pc.filter(operation, pc.invert(valid))
            values = sorted(set(bad.to_pylist()))[:5]
            raise InvalidEventError(
                f"column 'operation' has invalid value(s) {values}; "
                f"allowed: {', '.join(OPERATIONS)}"
            )

    event_id = string_column("event_id")
    if event_id is None or event_id.null_count:
        fresh = pa.array([str(uuid.uuid4()) for _ in range(rows)], pa.string())
        event_id = fresh if event_id is None else pc.coalesce(event_id, fresh)

    key = string_column("key")
    key = event_id if key is None else pc.coalesce(key, event_id)

    collection = string_column("collection")
    if collection is None:
        collection = pa.repeat(pa.scalar(default_collection, pa.string()), rows)
    elif default_collection is not None:
        collection = pc.fill_null(collection, default_collection)

    metadata = string_column("metadata")
    if metadata is None:
        metadata = pa.nulls(rows, pa.string())

    stamp = pa.scalar(now or now_utc(), pa.timestamp("us", tz="UTC"))
    if "timestamp" in names:
        ts = table.column("timestamp")
        if not pa.types.is_timestamp(ts.type):
            raise InvalidEventError(f"column 'timestamp' must be a timestamp, got {ts.type}")
        timestamp = pc.fill_null(_cast_column(ts, pa.timestamp("us", tz="UTC"), "timestamp"), stamp)
    else:
        timestamp = pa.repeat(stamp, rows)

    return pa.table(
        [event_id, timestamp, operation, collection, key, data, metadata], schema=STORED_SCHEMA
    )


def to_event_batch(stored: pa.RecordBatch, shard: int, first_sequence: int) -> pa.RecordBatch:
    """Prepend ``shard`` and ``sequence`` to a stored batch (giving :data:`EVENT_SCHEMA`)."""
    rows = stored.num_rows
    shard_col = pa.array(np.full(rows, shard, dtype=np.int32))
    sequence_col = pa.array(np.arange(first_sequence, first_sequence + rows, dtype=np.int64))
    return pa.RecordBatch.from_arrays(
        [shard_col, sequence_col, *stored.columns], schema=EVENT_SCHEMA
    )
