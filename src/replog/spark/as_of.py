"""``table_as_of`` and ``tables_as_of``: tables of ``apply_changes`` as the source had them
at a past point (the core: :mod:`replog.tables.as_of`).

The log's events after the chosen Delta version are typed exactly as ``apply_changes``
types a micro-batch (:mod:`replog.spark.changes`: the registry's schemas, or the schema the
table was applied with, which its commits record), then reduced onto the version's rows on
the driver; the result is a DataFrame made from Arrow (:func:`frame_of`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from replog.errors import InvalidOptionError
from replog.log import ReplicationLog
from replog.schemas import registry
from replog.spark.apply import registered_keys
from replog.spark.changes import Part, changes_frame, gather
from replog.spark.conf import setting
from replog.tables import as_of, delta
from replog.tables import coverage as covered


def _log(log: ReplicationLog | str, log_options: dict[str, Any] | None) -> ReplicationLog:
    if isinstance(log, ReplicationLog):
        return log
    if not isinstance(log, str) or not log:
        raise InvalidOptionError(f"table_as_of: log must be the log's URL, got {log!r}")
    return ReplicationLog.open(log, storage_options=log_options)


def table_as_of(
    spark: SparkSession,
    path: str,
    *,
    log: ReplicationLog | str,
    at: str | datetime | None = None,
    lsn: str | None = None,
    collection: str | None = None,
    storage_options: dict[str, str] | None = None,
    log_options: dict[str, Any] | None = None,
) -> DataFrame:
    """The Delta table at ``path`` (written by ``apply_changes`` from ``log``) as the
    source had it at the end of the last transaction at or before the point: ``at`` (ISO
    8601 text or a ``datetime``; without a zone: UTC; to the millisecond) or ``lsn``
    (``0/3A5F1C8``: transactions whose commit LSN is at or below it), exactly one::

        orders = table_as_of(spark, "/tables/public.orders", log=url, lsn="0/3A5F1C8")

    It reads the newest table version at or below the point and the log's events after
    it, never a replay from the start. ``collection`` names the table's collection when
    its commits do not (a one-table ``apply_changes`` of a log of several, without
    ``collection=``). ``storage_options`` are delta-rs's, ``log_options`` the log's.

    Raises:
        AsOfError: the point is outside what the table's versions and the log's retained
            events can show (the message names what is reachable).
    """
    point = as_of.point(at, lsn)
    return _read(spark, path, _log(log, log_options), point, collection, storage_options)


def tables_as_of(
    spark: SparkSession,
    paths: Mapping[str, str],
    *,
    log: ReplicationLog | str,
    at: str | datetime | None = None,
    lsn: str | None = None,
    storage_options: dict[str, str] | None = None,
    log_options: dict[str, Any] | None = None,
) -> dict[str, DataFrame]:
    """``{collection: DataFrame}``: each table of ``paths`` (``{collection: path}``) as of
    the same point (see :func:`table_as_of`), consistent across tables: no row of one
    comes from a transaction later than the point. Each is also registered as a temporary
    view named after its table (the collection's last part, ``public.orders`` ->
    ``orders``; the whole name with ``_`` for ``.`` when two share a last part)."""
    if not isinstance(paths, Mapping) or not paths:
        raise InvalidOptionError(
            f"tables_as_of: paths must map collections to table paths, got {paths!r}"
        )
    point = as_of.point(at, lsn)
    opened = _log(log, log_options)
    names = view_names(list(paths))
    found = {}
    for name, path in paths.items():
        frame = _read(spark, path, opened, point, name, storage_options)
        frame.createOrReplaceTempView(names[name])
        found[name] = frame
    return found


def view_names(collections: list[str]) -> dict[str, str]:
    """The temporary view of each collection: its last dotted part, unless shared."""
    last = {c: c.rsplit(".", 1)[-1] for c in collections}
    shared = {v for v in last.values() if list(last.values()).count(v) > 1}
    return {c: (c.replace(".", "_") if v in shared else v) for c, v in last.items()}


def _read(  # noqa: PLR0917 - one table's read
    spark: SparkSession,
    path: str,
    log: ReplicationLog,
    point: as_of.Point,
    collection: str | None,
    storage_options: dict[str, str] | None,
) -> DataFrame:
    rows = read_rows(spark, path, log, point, collection, storage_options)
    return frame_of(spark, rows)


ARROW_BATCH = "spark.sql.execution.arrow.maxRecordsPerBatch"
MAX_PARTITION_BYTES = 64 * 1024 * 1024
"""The most bytes of one Arrow batch :func:`frame_of` hands Spark."""


def frame_of(spark: SparkSession, table: pa.Table) -> DataFrame:
    """``table`` (the driver's Arrow rows) as a DataFrame, handed to Spark in Arrow batches
    of one core's share of the rows (at most :data:`MAX_PARTITION_BYTES` each), not of
    ``maxRecordsPerBatch`` rows (10,000): the JVM's conversion costs per batch, and a
    counted 1M-row DataFrame took 27 s in 100 batches against 5 s in two (BENCHMARKS.md,
    "Issue 42"). The session's own setting is left as it was."""
    cores = max(spark.sparkContext.defaultParallelism, 1)
    per_row = max(table.nbytes // max(table.num_rows, 1), 1)
    rows = min(-(-table.num_rows // cores), max(MAX_PARTITION_BYTES // per_row, 1))
    with setting(spark, ARROW_BATCH, lambda given: str(max(rows, int(given or 10_000)))):
        return spark.createDataFrame(table)


def read_rows(  # noqa: PLR0917 - one table's read
    spark: SparkSession,
    path: str,
    log: ReplicationLog,
    point: as_of.Point,
    collection: str | None = None,
    storage_options: dict[str, str] | None = None,
    *,
    cut: bool = True,
) -> pa.Table:
    """The rows of the table at ``path`` as of ``point``, as Arrow; an scd2 table from
    the history of a version that holds the point, when one does (unless not ``cut``:
    from the version before the point and the log's events after it)."""
    table = delta.open_table(path, storage_options)
    if table is None:
        raise InvalidOptionError(f"table_as_of: no Delta table at {path}")
    versions = covered.table_history(table.history())
    plan = as_of.plan(versions, log, point, collection=collection, cut=cut)
    if plan.cut:  # scd2: the version's history cut at the point
        assert plan.version is not None
        table.load_as_version(plan.version)
        found = as_of.history_at(delta.read_table(table), point)
        if found is not None:
            return found
        plan = as_of.plan(versions, log, point, collection=collection, cut=False)
    if plan.version is None:
        base = delta.table_schema(table).empty_table()
    else:
        table.load_as_version(plan.version)
        base = delta.read_table(table)
    coverage = plan.coverage
    name = collection or coverage.collection
    keys = coverage.keys or (registered_keys(log, name) if name else ())
    if not keys:
        raise InvalidOptionError(
            f"table_as_of: the commits of {path} do not name its keys or collection: give "
            f"collection="
        )
    changes = _changes(spark, log, plan, name, keys)
    return as_of.rows_as_of(base, changes, keys, mode=coverage.mode, truncates=plan.truncates)


def _changes(
    spark: SparkSession,
    log: ReplicationLog,
    plan: as_of.Plan,
    collection: str | None,
    keys: tuple[str, ...],
) -> pa.Table:
    """The plan's events typed as ``apply_changes`` types them (one pass, as a batch)."""
    if plan.events.num_rows == 0:
        return pa.table({})
    schema: StructType | str | None = plan.coverage.schema
    if isinstance(schema, str) and schema.lstrip().startswith("{"):
        schema = StructType.fromJson(json.loads(schema))
    found = (
        []
        if schema is not None or collection is None
        else registry.versions(log.storage, collection)
    )
    if schema is None and not found:
        raise InvalidOptionError(
            registry.unknown_collection(log.storage, collection or "", "table_as_of")
        )
    events = frame_of(spark, plan.events)
    part = Part(0, collection, keys, schema, found, None)
    gathered = gather(*changes_frame(events, [part]), [part]).parts[0].table()
    return pa.table({}) if gathered is None else gathered
