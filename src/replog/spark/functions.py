"""DataFrame functions for the CDC world: Debezium change events in and out of replog.

``from_debezium`` turns Debezium change-event values (for example a Kafka topic's
``value``) into the replog-sink's input columns, so Kafka → replog is a few lines::

    events = from_debezium(spark.readStream.format("kafka")...load(), key_fields=["id"])
    events.writeStream.format("replog-sink").option("checkpointLocation", chk).start(url)

``to_debezium`` turns the replog source's rows into Debezium-style envelopes (``key``,
``value`` strings) for consumers that speak Debezium. Both run the core mapping of
:mod:`replog.debezium` in Arrow batches (``mapInArrow``): payloads keep their exact text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from replog import debezium
from replog.errors import InvalidEventError, InvalidOptionError
from replog.format import jsontext

SINK_INPUT_DDL = (
    "event_id string, timestamp timestamp, operation string, collection string, "
    "key string, data string, before string, metadata string"
)
ENVELOPE_DDL = "key string, value string"
_SINK_INPUT = pa.schema(
    [
        ("event_id", pa.string()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("operation", pa.string()),
        ("collection", pa.string()),
        ("key", pa.string()),
        ("data", pa.string()),
        ("before", pa.string()),
        ("metadata", pa.string()),
    ]
)


def _text(value: str | bytes | None) -> str | None:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _events(
    batches: Iterator[pa.RecordBatch], key_fields: tuple[str, ...]
) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        rows: dict[str, list[object]] = {name: [] for name in _SINK_INPUT.names}
        for value in batch.column(0).to_pylist():
            text = _text(value)
            if text is None or text.strip() == "null":
                continue  # a tombstone
            try:
                event = debezium.event_from_members(jsontext.parse_object(text), key_fields)
            except (ValueError, InvalidEventError) as exc:
                raise InvalidEventError(f"from_debezium: {exc}; value: {text[:200]!r}") from exc
            if isinstance(event, str):
                continue  # a truncate or message event: no row
            stamp = event["timestamp"]
            rows["event_id"].append(event["event_id"])
            rows["timestamp"].append(None if stamp is None else int(stamp) * 1000)
            for name in ("operation", "collection", "key", "data", "before", "metadata"):
                value_out = event[name]
                rows[name].append(None if value_out is None else str(value_out))
        yield pa.RecordBatch.from_pydict(rows, schema=_SINK_INPUT)


def from_debezium(
    frame: DataFrame, key_fields: Sequence[str], *, value: str | Column = "value"
) -> DataFrame:
    """Debezium change-event values (JSON, with or without the schema wrapper; string or
    binary) as the replog-sink's input columns, one row per change.

    Tombstones and truncate/message events give no row. The mapping is the one of
    ``replog append --format debezium`` (docs/CDC.md); ``key_fields`` name the row's key
    columns. A value that is not a Debezium change event fails the query, naming it.
    """
    fields = tuple(key_fields)
    if not fields:
        raise InvalidOptionError("from_debezium: key_fields must name the row's key column(s)")
    column = F.col(value) if isinstance(value, str) else value
    values = frame.select(column.cast("string").alias("value"))
    return values.mapInArrow(lambda batches: _events(batches, fields), SINK_INPUT_DDL)


def _envelopes(batches: Iterator[pa.RecordBatch], log: str | None) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        keys, values = [], []
        for row in batch.to_pylist():
            source = {
                "connector": "replog",
                "log": log,
                "collection": row["collection"],
                "shard": row["shard"],
                "sequence": row["sequence"],
                "event_id": row["event_id"],
                "ts_ms": row["ts_ms"],
            }
            values.append(
                debezium.envelope(
                    operation=row["operation"],
                    data=_text(row["data"]),
                    before=_text(row["before"]),
                    ts_ms=row["ts_ms"],
                    source=source,
                )
            )
            keys.append(row["key"])
        yield pa.RecordBatch.from_pydict({"key": keys, "value": values})


def to_debezium(frame: DataFrame, *, log: str | None = None) -> DataFrame:
    """The replog source's rows as Debezium-style change events: ``key`` (the event's
    key) and ``value`` (``{"before", "after", "op", "ts_ms", "source"}``, payloads
    spliced in exactly; ``source`` names ``log``, the shard and the sequence)."""
    columns = frame.select(
        "shard",
        "sequence",
        "event_id",
        F.unix_millis(F.col("timestamp")).alias("ts_ms"),
        "operation",
        "collection",
        "key",
        "data",
        "before",
    )
    return columns.mapInArrow(lambda batches: _envelopes(batches, log), ENVELOPE_DDL)
