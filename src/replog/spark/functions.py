"""DataFrame functions for the CDC world: Debezium change events in and out of replog.

``from_debezium`` turns Debezium change-event values (for example a Kafka topic's
``value``) into the replog-sink's input columns, so Kafka → replog is a few lines::

    events = from_debezium(spark.readStream.format("kafka")...load(), key_fields=["id"])
    events.writeStream.format("replog-sink").option("checkpointLocation", chk).start(url)

``parse_payload`` types a payload column (``data``, ``before``) with a schema, parsed
in the JVM (``from_json``), not in Python.

``to_debezium`` turns the replog source's rows into Debezium-style envelopes (``key``,
``value`` strings) for consumers that speak Debezium. Both run the core mapping of
:mod:`replog.debezium` in Python UDFs: payloads keep their exact text.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from replog import debezium
from replog.errors import InvalidEventError, InvalidOptionError
from replog.format import jsontext

EVENT_DDL = (
    "event_id string, ts_ms long, operation string, collection string, key string, "
    "data string, before string, metadata string"
)
"""What the Debezium mapping returns per value (null for a value that carries no row)."""


def _text(value: str | bytes | bytearray | None) -> str | None:
    return bytes(value).decode("utf-8") if isinstance(value, bytes | bytearray) else value


def _event(value: str | bytes | None, key_fields: tuple[str, ...]) -> tuple[object, ...] | None:
    """One Debezium value mapped by the core (runs in the executors' Python workers)."""
    text = _text(value)
    if text is None or text.strip() == "null":
        return None  # a tombstone
    try:
        event = debezium.debezium_record(jsontext.parse_object(text), key_fields)
    except (ValueError, InvalidEventError) as exc:
        raise InvalidEventError(f"from_debezium: {exc}; value: {text[:200]!r}") from exc
    if isinstance(event, debezium.Skipped):
        return None  # a truncate or message event: no row
    return (
        event["event_id"],
        event["timestamp"],
        *(
            None if event[name] is None else str(event[name])
            for name in ("operation", "collection", "key", "data", "before", "metadata")
        ),
    )


def from_debezium(
    frame: DataFrame, key_fields: Sequence[str], *, value: str | Column = "value"
) -> DataFrame:
    """Debezium change-event values (JSON, with or without the schema wrapper; string or
    binary) as the replog-sink's input columns, one row per change.

    Tombstones and truncate/message events give no row. The mapping is the one of
    ``replog append --format debezium`` (docs/CDC.md); ``key_fields`` name the row's key
    columns. A value that is not a Debezium change event fails the query, naming it.
    (A plain Python UDF: ``mapInArrow`` would need pandas on every executor.)
    """
    fields = tuple(key_fields)
    if not fields:
        raise InvalidOptionError("from_debezium: key_fields must name the row's key column(s)")
    column = F.col(value) if isinstance(value, str) else value
    mapped = F.udf(lambda text: _event(text, fields), EVENT_DDL, useArrow=False)(
        column.cast("string")
    )
    return (
        frame.select(mapped.alias("event"))
        .where(F.col("event").isNotNull())
        .select(
            "event.event_id",
            F.timestamp_millis(F.col("event.ts_ms")).alias("timestamp"),
            "event.operation",
            "event.collection",
            "event.key",
            "event.data",
            "event.before",
            "event.metadata",
        )
    )


def _envelope(row: Row, log: str | None) -> str:
    source = {
        "connector": "replog",
        "log": log,
        "collection": row["collection"],
        "shard": row["shard"],
        "sequence": row["sequence"],
        "event_id": row["event_id"],
        "ts_ms": row["ts_ms"],
    }
    return debezium.envelope(
        operation=row["operation"],
        data=_text(row["data"]),
        before=_text(row["before"]),
        ts_ms=row["ts_ms"],
        source=source,
    )


def to_debezium(frame: DataFrame, *, log: str | None = None) -> DataFrame:
    """The replog source's rows as Debezium-style change events: ``key`` (the event's
    key) and ``value`` (``{"before", "after", "op", "ts_ms", "source"}``, payloads
    spliced in exactly; ``source`` names ``log``, the shard and the sequence)."""
    fields = F.struct(
        "shard",
        "sequence",
        "event_id",
        F.unix_millis(F.col("timestamp")).alias("ts_ms"),
        "operation",
        "collection",
        "data",
        "before",
    )
    envelope = F.udf(lambda row: _envelope(row, log), "string", useArrow=False)(fields)
    return frame.select(F.col("key"), envelope.alias("value"))


def parse_payload(
    column: str | Column, schema: StructType | str, options: dict[str, str] | None = None
) -> Column:
    """A payload column (``data`` or ``before``: binary or string JSON) as a typed struct,
    parsed by Spark's ``from_json`` in the JVM::

        events.select("key", parse_payload("data", "id long, total decimal(38,9)").alias("row"))

    Numbers keep their precision when the schema asks for it (``decimal(38, 9)``); a
    payload that does not parse gives null fields (Spark's PERMISSIVE mode) unless
    ``options={"mode": "FAILFAST"}``.
    """
    source = F.col(column) if isinstance(column, str) else column
    return F.from_json(source.cast("string"), schema, options or {})
