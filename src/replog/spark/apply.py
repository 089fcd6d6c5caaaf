"""``apply_changes``: a ``foreachBatch`` function merging the replog source's changes into
Delta tables exactly once (the core: :mod:`replog.tables.delta`).

One query can feed many tables: ``target`` is then a mapping ``{collection: path}`` or a
path template holding ``{collection}``. The micro-batch is read from the log once
(persisted), each collection's events are typed, reduced and applied to its table, and
each table's commit carries ``(app_id, batch_id)``: a replayed batch is skipped table by
table, so a crash after some tables committed neither doubles nor skips the others.
With ``log=``, each collection's row schema, keys and column defaults come from the
schema registry (``replog capture postgres`` registers a table's key columns as its only
non-optional fields).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark import SparkContext
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType, TimestampType

from replog.crashpoints import crash_point
from replog.errors import InvalidOptionError
from replog.format import jsontext
from replog.log import ReplicationLog
from replog.schemas import connect, registry
from replog.spark.typed import typed_by
from replog.tables import changes as rows
from replog.tables.delta import TARGET_FILE_SIZE, already_applied, apply_batch

_EVENT_COLUMNS = ("shard", "sequence", "operation", "timestamp", "data")
TEMPLATE = "{collection}"

Keys = Sequence[str] | str
Schema = StructType | str


def _changes(batch: DataFrame, keys: tuple[str, ...], schema: Schema | None) -> DataFrame:
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
            "StructType of the row), log= (the schemas registered in the log) or type it "
            "first (parse_payload, typed)"
        )
    else:
        source = F.col("data").cast("string")
        row = F.from_json(source, schema, {"mode": "FAILFAST"})
    marked = batch.select("*", _marks(batch).alias(_MARKS))  # parsed once per event
    frame = marked.select(
        row.alias("__row"),
        F.col("shard").alias(rows.SHARD),
        F.col("sequence").alias(rows.SEQUENCE),
        F.col("operation").alias(rows.OPERATION),
        F.col("timestamp").cast(TimestampType()).alias(rows.TIMESTAMP),
        F.coalesce(F.col(f"{_MARKS}.unavailable"), F.array().cast("array<string>")).alias(
            rows.UNSENT
        ),
        (
            F.col("collection") if "collection" in batch.columns else F.lit(None).cast("string")
        ).alias(rows.COLLECTION),
        F.col(f"{_MARKS}.old_key").alias(rows.OLD_KEY),
    )
    fields = frame.schema["__row"].dataType
    assert isinstance(fields, StructType)
    rows.check_columns(fields.names, keys)
    values = [name for name in fields.names if name not in keys]
    # a delete's row is its old image (often the key only): it sends no value
    unsent = F.when(
        F.col(rows.OPERATION) == F.lit(rows.DELETE),
        F.array(*[F.lit(name) for name in values]).cast("array<string>"),
    ).otherwise(F.col(rows.UNSENT))
    return frame.select(
        "__row.*",
        *rows.CHANGE_COLUMNS,
        unsent.alias(rows.UNSENT),
        rows.COLLECTION,
        rows.OLD_KEY,
    )


_MARKS = "__replog_marks"
_MARKS_FIELDS = "unavailable array<string>, old_key string"


def _marks(batch: DataFrame) -> Column:
    """``metadata``'s ``unavailable`` (the columns an event did not send, as ``replog
    capture postgres`` lists unchanged TOASTed columns) and ``old_key`` (on a changed key's
    create: the old key's JSON text), as a struct. Parsed only where the text names one of
    them: most events name neither, and a parse of every event's metadata cost a
    snapshot's load a quarter of its time."""
    if "metadata" not in batch.columns:
        return F.lit(None).cast("struct<unavailable: array<string>, old_key: string>")
    text = F.col("metadata").cast("string")
    # contains() tests a position's first byte before comparing (instr() compares at
    # every position: it cost as much as the parse it spares)
    named = text.contains('unavailable"') | text.contains('old_key"')
    return F.when(named, F.from_json(text, _MARKS_FIELDS))


def _query_id() -> str | None:
    """The id of the streaming query running this ``foreachBatch`` call: its checkpoint
    keeps it, so a replaced checkpoint reusing an ``app_id`` is refused rather than its
    batches skipped as applied. None outside a query, and with Spark Connect (no context
    in this process: the check is off)."""
    context = SparkContext._active_spark_context
    return None if context is None else context.getLocalProperty("sql.streaming.queryId")


@dataclass(frozen=True)
class _Table:
    """How one collection is applied: its Delta table, keys and row schema."""

    target: str
    keys: tuple[str, ...]
    schema: Schema | None
    registered: bool = False
    """The keys are the registry's (checked against the events' own keys)."""


def registered_keys(log: ReplicationLog, collection: str) -> tuple[str, ...]:
    """A collection's key columns from its newest registered schema: its non-optional
    fields (``replog capture postgres`` makes exactly the key columns non-optional).

    Raises:
        InvalidOptionError: no schema is registered, or it has no non-optional field.
    """
    found = registry.versions(log.storage, collection)
    if not found:
        raise InvalidOptionError(
            registry.unknown_collection(log.storage, collection, "apply_changes")
            + " (or give keys= and schema= for it)"
        )
    keys = tuple(c.name for c in found[-1].columns() if not c.optional)
    if not keys:
        raise InvalidOptionError(
            f"apply_changes: the registered schema {found[-1].digest} of {collection!r} has "
            f"no non-optional field to key it by: give keys= for it"
        )
    return keys


def registered_defaults(found: Sequence[registry.SchemaVersion]) -> dict[str, Any]:
    """Column -> default (as its typed value) for the columns of a collection's
    registered schemas ``found`` that give one (Kafka Connect's ``default``)."""
    if not found:
        return {}
    columns = connect.union([(v.digest, v.columns()) for v in found])
    return {c.name: connect.decode(c, c.default) for c in columns if c.default is not None}


class _Router:
    """Which table, keys and schema each collection of a micro-batch goes to."""

    def __init__(
        self,
        target: str | Mapping[str, str],
        keys: Keys | Mapping[str, Keys] | None,
        schema: Schema | Mapping[str, Schema] | None,
        log: ReplicationLog | None,
    ) -> None:
        self.target, self.keys, self.schema, self.log = target, keys, schema, log
        self._tables: dict[str, _Table] = {}

    @property
    def routed(self) -> bool:
        return not isinstance(self.target, str) or TEMPLATE in self.target

    def named(self) -> list[str] | None:
        """The collections a mapping names (None for a template: any collection)."""
        return None if isinstance(self.target, str) else sorted(self.target)

    def table(self, collection: str | None) -> _Table:
        key = collection or ""
        if key not in self._tables:
            self._tables[key] = self._resolve(collection)
        return self._tables[key]

    def _resolve(self, collection: str | None) -> _Table:
        if isinstance(self.target, str):
            target = self.target.replace(TEMPLATE, collection or "")
        else:
            target = self.target[collection or ""]
        given = self.keys.get(collection or "") if isinstance(self.keys, Mapping) else self.keys
        if given is not None:
            keys = rows.check_keys(given)
        elif self.log is not None and collection is not None:
            keys = registered_keys(self.log, collection)
        else:
            raise InvalidOptionError(
                f"apply_changes: no keys for collection {collection!r}: give keys= or log= "
                f"(the keys registered with its schema)"
            )
        schema = (
            self.schema.get(collection or "") if isinstance(self.schema, Mapping) else self.schema
        )
        return _Table(target, keys, schema, registered=given is None)

    def rows_of(self, batch: DataFrame, collection: str | None) -> tuple[DataFrame, dict[str, Any]]:
        """The micro-batch's events of ``collection``, typed by the registry (``log=``)
        unless a schema is given or ``data`` is typed already; and the registered column
        defaults. The registry is read once, with each micro-batch: a version registered
        while the query runs brings its columns and defaults."""
        if collection is not None:
            batch = batch.where(F.col("collection") == F.lit(collection))
        if self.log is None or collection is None:
            return batch, {}
        found = registry.versions(self.log.storage, collection)
        payload = batch.schema["data"].dataType
        if self.table(collection).schema is None and not isinstance(payload, StructType):
            if not found:
                raise InvalidOptionError(
                    registry.unknown_collection(self.log.storage, collection, "typed")
                )
            batch = typed_by(batch, collection, found).drop("after")
        return batch, registered_defaults(found)


def _check_key_fields(collection: str, sample: str | None, keys: tuple[str, ...]) -> None:
    """The events' key (its JSON object's fields) names the same columns as ``keys``: a
    table keyed otherwise would merge rows the log keeps apart (or split a row)."""
    if sample is None:
        return
    try:
        fields = tuple(jsontext.parse_object(sample))
    except (ValueError, TypeError):
        return  # not a JSON object: nothing to compare with
    if set(fields) != set(keys):
        raise InvalidOptionError(
            f"apply_changes: collection {collection!r} is keyed by {list(keys)} but its "
            f"events' keys name {list(fields)} (e.g. {sample[:200]!r}): give keys= for it"
        )


def _check_arguments(  # noqa: PLR0917 - apply_changes' own arguments
    target: str | Mapping[str, str],
    keys: Keys | Mapping[str, Keys] | None,
    app_id: str,
    mode: str,
    schema: Schema | Mapping[str, Schema] | None,
    collection: str | None,
    log: ReplicationLog | str | None,
    log_options: dict[str, Any] | None,
) -> ReplicationLog | None:
    """Bad arguments refused when apply_changes is called; the log opened."""
    rows.check_mode(mode)
    if not isinstance(app_id, str) or not app_id:
        raise InvalidOptionError(
            f"apply_changes: app_id must be a non-empty string, got {app_id!r}"
        )
    if keys is not None and not isinstance(keys, Mapping):
        wanted = rows.check_keys(keys)
        if isinstance(schema, StructType):
            rows.check_columns(schema.names, wanted)
    routed = not isinstance(target, str) or TEMPLATE in target
    if routed and collection is not None:
        raise InvalidOptionError(
            "apply_changes: collection= is for one table; a mapping or template target "
            "routes each collection to its own"
        )
    if not routed and keys is None and (log is None or collection is None):
        raise InvalidOptionError(
            "apply_changes: keys must name the table's key column(s) (or give log= and "
            "collection= to take them from the schema registry)"
        )
    return ReplicationLog.open(log, storage_options=log_options) if isinstance(log, str) else log


@dataclass(frozen=True)
class _Settings:
    """How apply_changes writes: the same for every table of a query."""

    app_id: str
    mode: str
    storage_options: dict[str, str] | None
    target_file_size: int | None
    tombstones: bool
    deletion_vectors: bool = True


def _write(  # noqa: PLR0917 - one table's part of a micro-batch
    settings: _Settings,
    table: _Table,
    frame: DataFrame,
    defaults: Mapping[str, Any],
    batch_id: int,
    writer: str | None,
) -> None:
    """One table's events of a micro-batch, collected as they are and applied: the core
    reduces them in Arrow (a reduction in Spark, a shuffle of every column, cost three
    times the rest of a snapshot's load, BENCHMARKS.md)."""
    collected = _changes(frame, table.keys, table.schema).toArrow()
    crash_point("apply_before_delta", batch_id)
    apply_batch(
        table.target,
        collected,
        table.keys,
        app_id=settings.app_id,
        batch_id=batch_id,
        mode=settings.mode,
        storage_options=settings.storage_options,
        writer=writer,
        target_file_size=settings.target_file_size,
        defaults=defaults,
        tombstones=settings.tombstones,
        deletion_vectors=settings.deletion_vectors,
    )
    crash_point("apply_after_delta", batch_id)


def _apply_routed(
    settings: _Settings, router: _Router, batch: DataFrame, batch_id: int, writer: str | None
) -> None:
    """A micro-batch of many collections, each to its table (skipped where committed)."""
    app_id, options = settings.app_id, settings.storage_options
    named = router.named()
    done = {  # a mapping's tables, each asked once; a template's, as its collections show
        c: already_applied(router.table(c).target, app_id, batch_id, options, writer)
        for c in named or ()
    }
    if named is not None and all(done.values()):
        return  # every table has it: a replay
    batch = batch.persist()  # the log is read once for every table
    try:
        present = {
            r["collection"]: r["key"]
            for r in batch.groupBy("collection").agg(F.first("key").alias("key")).collect()
        }
        if None in present:
            raise InvalidOptionError(
                f"apply_changes: the micro-batch holds events without a collection (key "
                f"{str(present[None])[:200]!r}): a mapping or template target routes by "
                f"collection, so they would be lost (nothing was written for this batch)"
            )
        for name in sorted(present):
            if named is not None and name not in named:
                continue
            table = router.table(name)
            if name not in done:
                done[name] = already_applied(table.target, app_id, batch_id, options, writer)
            if done[name]:
                continue  # committed before a crash: the other tables go on
            if table.registered:
                _check_key_fields(name, present[name], table.keys)
            _write(settings, table, *router.rows_of(batch, name), batch_id, writer)
    finally:
        batch.unpersist()


def apply_changes(
    target: str | Mapping[str, str],
    keys: Keys | Mapping[str, Keys] | None = None,
    *,
    app_id: str,
    mode: str = "scd1",
    schema: Schema | Mapping[str, Schema] | None = None,
    collection: str | None = None,
    log: ReplicationLog | str | None = None,
    log_options: dict[str, Any] | None = None,
    storage_options: dict[str, str] | None = None,
    target_file_size: int | None = TARGET_FILE_SIZE,
    tombstones: bool = True,
    deletion_vectors: bool = True,
) -> Callable[[DataFrame, int], None]:
    """A ``foreachBatch`` function that applies the replog source's changes to Delta
    tables, exactly once::

        (spark.readStream.format("replog").load(url)
           .writeStream.foreachBatch(apply_changes("/tables/orders", ["id"], app_id="orders",
                                                   schema="id long, total decimal(38, 9)"))
           .option("checkpointLocation", chk).start())

        # every captured table of the log, one query, keys and types from the registry:
        apply_changes("/tables/{collection}", app_id="replica", log=url)

    ``target`` is one table's path, or routes collections to tables: a mapping
    ``{collection: path}`` (other collections are ignored) or a path holding
    ``{collection}``. The row is ``data`` (typed by ``schema``, by the registry of
    ``log``, or a struct already); ``keys`` are its key columns (a mapping gives them per
    collection; with ``log`` they default to the registered key). ``mode="scd1"`` keeps
    the latest row per key (deletes remove it; their positions are kept beside the table
    unless ``tombstones=False``); ``"scd2"`` keeps every version (``__valid_from``,
    ``__valid_to``, ``__current``). Each table's commit carries ``(app_id, batch_id)``: a
    replayed batch is skipped before any of it is computed. Give a new checkpoint a new
    ``app_id``. ``collection`` keeps that collection's events only (one table).
    Each table's events of the micro-batch are collected to the driver (as Arrow) and
    reduced there: its memory is bounded by the source's ``maxEventsPerTrigger``.
    ``storage_options`` are delta-rs's (``AWS_ENDPOINT_URL``, ...); ``log_options`` the
    log's (fsspec). ``target_file_size`` is the ``delta.targetFileSize`` of the tables it
    creates (docs/CDC.md, "Cost"). ``deletion_vectors`` (tables on local disk): tables are
    created with Delta's deletion vectors enabled and scd1 batches are written
    merge-on-read, at the cost of the change rather than of the files its keys are in.
    """
    opened = _check_arguments(target, keys, app_id, mode, schema, collection, log, log_options)
    router = _Router(target, keys, schema, opened)

    settings = _Settings(
        app_id, mode, storage_options, target_file_size, tombstones, deletion_vectors
    )

    def apply(batch: DataFrame, batch_id: int) -> None:
        writer = _query_id()
        if not router.routed:
            one = router.table(collection)
            if already_applied(one.target, app_id, batch_id, storage_options, writer):
                return  # a replay: no Spark job, nothing collected (apply_batch checks again)
            _write(settings, one, *router.rows_of(batch, collection), batch_id, writer)
            return
        _apply_routed(settings, router, batch, batch_id, writer)

    return apply
