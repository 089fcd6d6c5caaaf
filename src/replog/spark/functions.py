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
into a Delta table exactly once (:mod:`replog.tables.delta`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pyspark import SparkContext
from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructType, TimestampType

from replog import debezium
from replog.crashpoints import crash_point
from replog.errors import InvalidEventError, InvalidOptionError
from replog.format import jsontext
from replog.spark.typed import typed
from replog.tables import changes as rows
from replog.tables.delta import already_applied, apply_batch

__all__ = ["apply_changes", "from_debezium", "parse_payload", "to_debezium", "typed"]

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


def _envelope(row: Row, log: str | None) -> str:
    """The Debezium value of one replog event: the envelope it was appended from when
    its metadata holds one (:func:`replog.debezium.original_envelope`), else replog's."""
    data, before = _text(row["data"]), _text(row["before"])
    original = debezium.original_envelope(
        row["metadata"], operation=row["operation"], data=data, before=before
    )
    if original is not None:
        return original
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
    ``df.write.format("kafka")``: ``key`` (the event's key, Debezium's message-key form),
    ``value`` (the envelope) and ``headers`` (``replog.shard``, ``replog.sequence``,
    ``replog.event_id`` and, when ``log`` names the log, ``replog.log_id``; UTF-8 text).

    An event appended from Debezium gets its original envelope back (``source``, ``op``
    with ``r`` kept, ``transaction``, ``ts_*``, payloads as their exact text); any other
    event a replog-made one (docs/CDC.md "Debezium out"). Each delete is followed by a
    tombstone (the same key, a null value), as Debezium sends it for log compaction,
    unless ``tombstones=False``.
    """
    if not isinstance(tombstones, bool):
        raise InvalidOptionError(
            f"to_debezium: tombstones must be True or False, not {tombstones!r}"
        )
    fields = F.struct(
        "shard",
        "sequence",
        "event_id",
        F.unix_millis(F.col("timestamp")).alias("ts_ms"),
        "operation",
        "collection",
        "data",
        "before",
        F.col("metadata").cast("string").alias("metadata"),
    )
    envelope = F.udf(lambda row: _envelope(row, log), "string", useArrow=False)(fields)
    log_id = _log_id(log, storage_options)
    headers = [
        _header(SHARD_HEADER, F.col("shard")),
        _header(SEQUENCE_HEADER, F.col("sequence")),
        _header(EVENT_ID_HEADER, F.col("event_id")),
    ]
    if log_id is not None:
        headers.append(_header(LOG_ID_HEADER, F.lit(log_id)))
    records = frame.select(
        F.col("key"),
        F.col("operation"),
        envelope.alias("value"),
        F.array(*headers).cast(HEADERS_TYPE).alias("headers"),
    )
    values = F.array(F.col("value"))
    if tombstones:  # the delete, then its tombstone: explode keeps the order in the task
        values = F.when(
            F.col("operation") == F.lit("delete"),
            F.array(F.col("value"), F.lit(None).cast("string")),
        ).otherwise(values)
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


_EVENT_COLUMNS = ("shard", "sequence", "operation", "timestamp", "data")


def _changes(batch: DataFrame, keys: tuple[str, ...], schema: StructType | str | None) -> DataFrame:
    """The source's rows as a batch of changes: ``data``'s fields plus the bookkeeping
    columns of :mod:`replog.tables.changes`."""
    absent = [c for c in _EVENT_COLUMNS if c not in batch.columns]
    if absent:
        raise InvalidOptionError(
            f"apply_changes: the micro-batch lacks the replog source's columns {absent} "
            f"(columns: {batch.columns})"
        )
    payload = batch.schema["data"].dataType
    if isinstance(payload, StructType):
        row = F.col("data")  # typed already (parse_payload, typed)
    elif schema is None:
        raise InvalidOptionError(
            "apply_changes: 'data' is a JSON payload: give schema= (a DDL string or a "
            "StructType of the row) or type it first (parse_payload)"
        )
    else:
        row = parse_payload("data", schema, {"mode": "FAILFAST"})
    frame = batch.select(
        row.alias("__row"),
        F.col("shard").alias(rows.SHARD),
        F.col("sequence").alias(rows.SEQUENCE),
        F.col("operation").alias(rows.OPERATION),
        F.col("timestamp").cast(TimestampType()).alias(rows.TIMESTAMP),
        _unsent(batch).alias(rows.UNSENT),
        (
            F.col("collection") if "collection" in batch.columns else F.lit(None).cast("string")
        ).alias(rows.COLLECTION),
    )
    fields = frame.schema["__row"].dataType
    assert isinstance(fields, StructType)
    rows.check_columns(fields.names, keys)
    return frame.select("__row.*", *rows.CHANGE_COLUMNS, rows.UNSENT, rows.COLLECTION)


def _unsent(batch: DataFrame) -> Column:
    """The columns each event did not send (``metadata.unavailable``, as ``replog capture
    postgres`` lists unchanged TOASTed columns): an empty list when it names none."""
    if "metadata" not in batch.columns:
        return F.array().cast("array<string>")
    listed = F.get_json_object(F.col("metadata").cast("string"), "$.unavailable")
    return F.coalesce(F.from_json(listed, "array<string>"), F.array().cast("array<string>"))


def _latest_per_key(frame: DataFrame, keys: tuple[str, ...]) -> DataFrame:
    """The last change per key (by position), as the driver collects it for scd1. A column
    the last change did not send (Debezium's placeholder text for an unchanged TOASTed
    column, or named in ``metadata.unavailable``) takes the key's last value that was sent
    (the core takes the table's when the batch has none, and keeps the column in
    :data:`~replog.tables.changes.UNSENT`: :func:`replog.tables.delta.apply_batch`)."""
    position = [F.col(c) for c in rows.POSITION]
    unsent = F.col(rows.UNSENT)
    values = [
        field
        for field in frame.schema.fields
        if field.name not in keys and not field.name.startswith("__")
    ]
    aggregates, sent_any = [], []
    for number, field in enumerate(values):
        value = F.col(field.name)
        sent = ~F.array_contains(unsent, F.lit(field.name))
        if isinstance(field.dataType, StringType):
            sent = sent & ~value.eqNullSafe(F.lit(rows.UNAVAILABLE))
        aggregates.append(F.max_by(value, F.struct(sent, *position)).alias(f"__sent{number}"))
        aggregates.append(F.max(sent).alias(f"__any{number}"))
        sent_any.append(F.when(~F.col(f"__any{number}"), F.lit(field.name)))
    reduced = frame.groupBy(*keys, rows.COLLECTION).agg(  # two collections' keys both kept
        F.max_by(F.struct(*frame.columns), F.struct(*position)).alias("__last"), *aggregates
    )
    index = {field.name: number for number, field in enumerate(values)}
    return reduced.select(
        *[
            F.col(f"__sent{index[name]}").alias(name)
            if name in index
            else F.array_compact(F.array(*sent_any)).cast("array<string>").alias(name)
            if name == rows.UNSENT
            else F.col("__last").getField(name).alias(name)
            for name in frame.columns
        ]
    )


def _query_id() -> str | None:
    """The id of the streaming query running this ``foreachBatch`` call: its checkpoint
    keeps it, so a replaced checkpoint reusing an ``app_id`` is refused rather than its
    batches skipped as applied. None outside a query, and with Spark Connect (no context
    in this process: the check is off)."""
    context = SparkContext._active_spark_context
    return None if context is None else context.getLocalProperty("sql.streaming.queryId")


def apply_changes(
    target: str,
    keys: Sequence[str] | str,
    *,
    app_id: str,
    mode: str = "scd1",
    schema: StructType | str | None = None,
    collection: str | None = None,
    storage_options: dict[str, str] | None = None,
) -> Callable[[DataFrame, int], None]:
    """A ``foreachBatch`` function that applies the replog source's changes to the Delta
    table at ``target``, exactly once::

        (spark.readStream.format("replog").load(url)
           .writeStream.foreachBatch(apply_changes("/tables/orders", ["id"], app_id="orders",
                                                   schema="id long, total decimal(38, 9)"))
           .option("checkpointLocation", chk).start())

    The row is ``data`` (typed by ``schema``, or a struct already); ``keys`` are its key
    columns. ``mode="scd1"`` keeps the latest row per key (deletes remove it); ``"scd2"``
    keeps every version (``__valid_from``, ``__valid_to``, ``__current``). Each micro-batch
    is one Delta commit carrying ``(app_id, batch_id)``: a replayed batch is skipped
    before any of it is computed or collected. Give a new checkpoint a new ``app_id``.
    ``collection`` keeps that collection's events only.
    The micro-batch is reduced in Spark (latest per key for scd1) and then collected to
    the driver: its memory is bounded by the source's ``maxEventsPerTrigger``.
    ``storage_options`` are delta-rs's (``AWS_ENDPOINT_URL``, ...).
    """
    wanted = rows.check_keys(keys)
    rows.check_mode(mode)
    if not isinstance(app_id, str) or not app_id:
        raise InvalidOptionError(
            f"apply_changes: app_id must be a non-empty string, got {app_id!r}"
        )
    if isinstance(schema, StructType):
        rows.check_columns(schema.names, wanted)

    def apply(batch: DataFrame, batch_id: int) -> None:
        writer = _query_id()
        if already_applied(target, app_id, batch_id, storage_options, writer):
            return  # a replay: no Spark job, nothing collected (apply_batch checks again)
        if collection is not None:
            batch = batch.where(F.col("collection") == F.lit(collection))
        frame = _changes(batch, wanted, schema)
        if mode == "scd1":  # reduced in Spark: the driver gets one change per key
            frame = _latest_per_key(frame, wanted)
        changes = frame.toArrow()
        crash_point("apply_before_delta", batch_id)
        apply_batch(
            target,
            changes,
            wanted,
            app_id=app_id,
            batch_id=batch_id,
            mode=mode,
            storage_options=storage_options,
            writer=writer,
        )
        crash_point("apply_after_delta", batch_id)

    return apply
