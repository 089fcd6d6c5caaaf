"""DataFrame functions for the CDC world: Debezium change events in and out of replog.

``from_debezium`` turns Debezium change-event values (for example a Kafka topic's
``value``) into the replog-sink's input columns, so Kafka → replog is a few lines::

    events = from_debezium(spark.readStream.format("kafka")...load(), key_fields=["id"])
    events.writeStream.format("replog-sink").option("checkpointLocation", chk).start(url)

``parse_payload`` types a payload column (``data``, ``before``) with a schema, parsed
in the JVM (``from_json``), not in Python.

``to_debezium`` turns the replog source's rows into Kafka records (``key``, ``value``,
``headers``) of Debezium change events: the original envelope for events appended from
Debezium. Both run the core mapping of :mod:`replog.debezium` in Python UDFs: payloads
keep their exact text.

``apply_changes`` returns a ``foreachBatch`` function that merges the source's changes
into Delta tables exactly once (:mod:`replog.spark.apply`); ``table_as_of`` and
``tables_as_of`` read those tables as the source had them at a past point
(:mod:`replog.spark.as_of`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from replog import debezium
from replog.errors import InvalidEventError, InvalidOptionError
from replog.format import jsontext
from replog.format.events import TRUNCATE
from replog.spark.apply import apply_changes
from replog.spark.as_of import table_as_of, tables_as_of
from replog.spark.typed import typed

__all__ = [
    "apply_changes",
    "from_debezium",
    "parse_payload",
    "table_as_of",
    "tables_as_of",
    "to_debezium",
    "typed",
]

EVENT_DDL = (
    "event_id string, ts_ms long, operation string, collection string, key string, "
    "data string, before string, metadata string"
)
"""What the Debezium mapping returns per value (null for a value that carries no row)."""


def _text(value: str | bytes | bytearray | None) -> str | None:
    return bytes(value).decode("utf-8") if isinstance(value, bytes | bytearray) else value


def _record(text: str, key: str | None) -> tuple[dict[str, jsontext.Member], str | None]:
    """The record to map: the value alone, or with its Kafka key as a record line
    ``{"key", "value"}`` (a delete without ``before``, a MongoDB change, take their key from
    it). A key that is no JSON object (a StringConverter's) is not used."""
    if key is not None and jsontext.is_object_text(key):
        line = '{"key":' + key + ',"value":' + text + "}"
        return jsontext.parse_object(line), None
    return jsontext.parse_object(text), text


def _event(
    value: str | bytes | None, key_fields: tuple[str, ...], key: str | bytes | None = None
) -> tuple[object, ...] | None:
    """One Debezium value mapped by the core (runs in the executors' Python workers)."""
    text = _text(value)
    if text is None or text.strip() == "null":
        return None  # a tombstone
    try:
        members, exact = _record(text, _text(key))
        event = debezium.debezium_record(members, key_fields, text=exact)
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


ARRIVAL = "__replog_arrival"
"""The column redeliveries are told apart by (a micro-batch's time; dropped again)."""


def from_debezium(
    frame: DataFrame,
    key_fields: Sequence[str],
    *,
    value: str | Column = "value",
    key: str | Column | None = "key",
    redeliveries_within: str | None = None,
) -> DataFrame:
    """Debezium change-event values (JSON, with or without the schema wrapper; string or
    binary) as the replog-sink's input columns, one row per change.

    Tombstones and truncate/message events give no row. The mapping is the one of
    ``replog append --format debezium`` (docs/CDC.md); ``key_fields`` name the row's key
    columns. ``key`` (default: the frame's ``key`` column, as Kafka's source gives it, when
    there is one) is the Kafka key: a delete without ``before`` and a MongoDB change without
    its document take their key from it. A value that is not a Debezium change event fails
    the query, naming it.
    (A plain Python UDF: ``mapInArrow`` would need pandas on every executor.)

    ``redeliveries_within`` (a Spark interval, ``"1 hour"``): a change given again within
    that time of its first arrival (Debezium redelivers after a restart) is dropped by its
    ``event_id``, which a redelivery keeps. Spark's ``dropDuplicatesWithinWatermark`` keeps
    the ids in the query's state; the watermark is on arrival (the micro-batch's time), not
    on the events' time, so a late change is never dropped for being late.
    """
    fields = tuple(key_fields)
    if not fields:
        raise InvalidOptionError("from_debezium: key_fields must name the row's key column(s)")
    column = F.col(value) if isinstance(value, str) else value
    if isinstance(key, str):
        key = F.col(key) if key in frame.columns else None
    key_column = (key if key is not None else F.lit(None)).cast("string")
    mapped = F.udf(lambda text, k: _event(text, fields, k), EVENT_DDL, useArrow=False)(
        column.cast("string"), key_column
    )
    events = (
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
    if redeliveries_within is None:
        return events
    return (
        events.withColumn(ARRIVAL, F.current_timestamp())
        .withWatermark(ARRIVAL, redeliveries_within)
        .dropDuplicatesWithinWatermark(["event_id"])
        .drop(ARRIVAL)
    )


def _record_out(row: Row, log: str | None) -> tuple[str | None, str]:
    """The Kafka message key and Debezium value of one replog event: the key the event's
    connector writes (:func:`replog.debezium.message_key`: MongoDB's ``{"id":"1004"}``, every
    other event's own key) and the envelope it was appended from when its metadata holds one
    (:func:`replog.debezium.original_envelope`), else replog's."""
    data, before = _text(row["data"]), _text(row["before"])
    truncate = row["operation"] == TRUNCATE  # a table's: Debezium gives no key
    key = None if truncate else debezium.message_key(row["key"], row["metadata"], data)
    original = debezium.original_envelope(
        row["metadata"], operation=row["operation"], data=data, before=before
    )
    if original is not None:
        return key, original
    source = {
        "connector": "replog",
        "log": log,
        "collection": row["collection"],
        "shard": row["shard"],
        "sequence": row["sequence"],
        "event_id": row["event_id"],
        "ts_ms": row["ts_ms"],
    }
    return key, debezium.envelope(
        operation=row["operation"], data=data, before=before, ts_ms=row["ts_ms"], source=source
    )


HEADERS_TYPE = "array<struct<key:string,value:binary>>"
"""Kafka record headers as Spark's Kafka sink takes them."""

SHARD_HEADER, SEQUENCE_HEADER, LOG_ID_HEADER, EVENT_ID_HEADER = (
    "replog.shard",
    "replog.sequence",
    "replog.log_id",
    "replog.event_id",
)


def _header(name: str, value: Column) -> Column:
    return F.struct(F.lit(name).alias("key"), value.cast("string").cast("binary").alias("value"))


def _log_id(log: str | None, storage_options: dict[str, str] | None) -> str | None:
    if log is None:
        return None
    from replog.log import ReplicationLog  # noqa: PLC0415 - only when a log is named

    return ReplicationLog.open(log, storage_options=storage_options).log_id


def to_debezium(
    frame: DataFrame,
    *,
    log: str | None = None,
    tombstones: bool = True,
    storage_options: dict[str, str] | None = None,
) -> DataFrame:
    """The replog source's rows as Kafka records of Debezium change events, ready for
    ``df.write.format("kafka")``: ``key`` (the event's key, Debezium's message-key form; for
    MongoDB the connector's own ``{"id":"<id as extended JSON>"}``),
    ``value`` (the envelope) and ``headers`` (``replog.shard``, ``replog.sequence``,
    ``replog.event_id`` and, when ``log`` names the log, ``replog.log_id``; UTF-8 text).

    An event appended from Debezium gets its original envelope back (``source``, ``op``
    with ``r`` kept, ``transaction``, ``ts_*``, payloads as their exact text); any other
    event a replog-made one (docs/CDC.md "Debezium out"). Each delete is followed by a
    tombstone (the same key, a null value), as Debezium sends it for log compaction,
    unless ``tombstones=False``. A truncate (one event per shard of the log) is one
    Debezium truncate record (op ``t``, null key, ``before`` and ``after`` null), written
    from its copy on shard 0.
    """
    if not isinstance(tombstones, bool):
        raise InvalidOptionError(
            f"to_debezium: tombstones must be True or False, not {tombstones!r}"
        )
    fields = F.struct(
        "shard",
        "sequence",
        "event_id",
        "key",
        F.unix_millis(F.col("timestamp")).alias("ts_ms"),
        "operation",
        "collection",
        "data",
        "before",
        F.col("metadata").cast("string").alias("metadata"),
    )
    record = F.udf(lambda row: _record_out(row, log), "key string, value string", useArrow=False)(
        fields
    )
    log_id = _log_id(log, storage_options)
    headers = [
        _header(SHARD_HEADER, F.col("shard")),
        _header(SEQUENCE_HEADER, F.col("sequence")),
        _header(EVENT_ID_HEADER, F.col("event_id")),
    ]
    if log_id is not None:
        headers.append(_header(LOG_ID_HEADER, F.lit(log_id)))
    once = (F.col("operation") != F.lit(TRUNCATE)) | (F.col("shard") == F.lit(0))
    records = frame.where(once).select(
        record.alias("record"),
        F.col("operation"),
        F.array(*headers).cast(HEADERS_TYPE).alias("headers"),
    )
    values = F.array(F.col("value"))
    if tombstones:  # the delete, then its tombstone: explode keeps the order in the task
        values = F.when(
            F.col("operation") == F.lit("delete"),
            F.array(F.col("value"), F.lit(None).cast("string")),
        ).otherwise(values)
    records = records.select("record.key", "operation", "record.value", "headers")
    return records.select("key", F.explode(values).alias("value"), "headers")


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
    if not options:  # no map at all: Spark Connect sends {} as MAP<VOID, VOID>, which
        return F.from_json(source.cast("string"), schema)  # from_json refuses
    given = {str(name): str(value) for name, value in options.items()}
    return F.from_json(source.cast("string"), schema, given)
