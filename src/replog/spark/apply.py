"""``apply_changes``: a ``foreachBatch`` function merging the replog source's changes into
Delta tables exactly once (the core: :mod:`replog.tables.delta`).

One query can feed many tables: ``target`` is then a mapping ``{collection: path}`` or a
path template holding ``{collection}``. The micro-batch is read from the log in one pass
(one Spark job, :mod:`replog.spark.changes`): each collection's events are typed there,
the rows that need no merge written ahead by the tasks, the rest collected and reduced
on the driver; each table's commit carries ``(app_id, batch_id)``: a replayed batch is
skipped table by table, so a crash after some tables committed neither doubles nor skips
the others.
With ``log=``, each collection's row schema, keys and column defaults come from the
schema registry (``replog capture postgres`` registers a table's key columns as its only
non-optional fields).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark import SparkContext
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from replog.crashpoints import crash_point
from replog.errors import InvalidOptionError
from replog.format import jsontext
from replog.log import ReplicationLog
from replog.schemas import connect, registry
from replog.spark.changes import LOCAL_EVENTS, Batch, Part, changes_frame, gather
from replog.tables import ahead as written_ahead
from replog.tables import changes as rows
from replog.tables import coverage as covered
from replog.tables import delta
from replog.tables.delta import TARGET_FILE_SIZE, apply_batch

if TYPE_CHECKING:
    from deltalake import DeltaTable

logger = logging.getLogger(__name__)

TEMPLATE = "{collection}"

Keys = Sequence[str] | str
Schema = StructType | str

MAX_PARTS = 32
"""The most tables one pass over a micro-batch types at once (one projection holds a
parser per table); a log that registers more is read for the collections a batch holds
first."""


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
        self._handles: dict[str, DeltaTable] = {}

    def delta(self, target: str, storage_options: dict[str, str] | None) -> DeltaTable | None:
        """The Delta table at ``target`` at its newest version (None: there is none yet),
        its handle kept between micro-batches."""
        found = delta.refreshed(self._handles.get(target), target, storage_options)
        if found is not None:
            self._handles[target] = found
        return found

    def kept(self, target: str) -> DeltaTable | None:
        """The handle of ``target`` as :meth:`delta` last left it (this pass's lookup:
        a refresh reads the table's log directory, ~5 ms a table holding the GIL)."""
        return self._handles.get(target)

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

    def collections(self, batch: DataFrame, one: str | None) -> tuple[list[str | None], bool]:
        """The collections a micro-batch's pass types, and whether a collection outside
        them is an error (a template's: its events would be lost): one table's
        (``one``), a mapping's, the registry's (``log=``, up to :data:`MAX_PARTS`); else
        those the batch holds (a pass of its own over the batch)."""
        if not self.routed:
            return [one], False
        named = self.named()
        if named is not None:
            return list(named), False
        if self.log is not None:
            known = registry.collections(self.log.storage)
            if len(known) <= MAX_PARTS:
                return list(known), True
        present = {
            r["collection"]: r["key"]
            for r in batch.groupBy("collection").agg(F.first("key").alias("key")).collect()
        }
        if None in present:
            raise _without_collection(present[None])
        return sorted(present), True

    def found(self, collection: str | None) -> list[registry.SchemaVersion]:
        """A collection's registered versions, read with each micro-batch (a version
        registered while the query runs brings its columns and defaults); none when its
        rows are not typed by the registry."""
        if self.log is None or collection is None:
            return []
        return registry.versions(self.log.storage, collection)


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
    if isinstance(target, Mapping):
        _check_one_collection_per_table(target)
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


def _check_one_collection_per_table(target: Mapping[str, str]) -> None:
    """A mapping that sends two collections to one table is refused: each table's commit
    carries the batch id, so the second collection's commit would be taken for a replay
    of the first's and its rows lost."""
    by_table: dict[str, list[str]] = {}
    for name, path in target.items():
        by_table.setdefault(str(path).rstrip("/"), []).append(name)
    shared = {path: names for path, names in by_table.items() if len(names) > 1}
    if shared:
        path, names = next(iter(shared.items()))
        raise InvalidOptionError(
            f"apply_changes: the mapping sends collections {sorted(names)} to one table "
            f"{path!r}: a table takes one collection (its commits carry the batch id, so a "
            f"second collection's rows would be skipped as a replay); give each its own"
        )


@dataclass(frozen=True)
class _Settings:
    """How apply_changes writes: the same for every table of a query."""

    app_id: str
    mode: str
    storage_options: dict[str, str] | None
    target_file_size: int | None
    tombstones: bool
    deletion_vectors: bool = True
    write_ahead_rows: int | None = written_ahead.MIN_ROWS


@dataclass
class _Seen:
    """What a query's last micro-batch held: a small one's successor is split on the
    driver (:data:`replog.spark.changes.LOCAL_EVENTS`)."""

    events: int | None = None


def _parts(  # noqa: PLR0917 - a micro-batch's parts
    settings: _Settings,
    router: _Router,
    collections: Sequence[str | None],
    batch: DataFrame,
    batch_id: int,
    writer: str | None,
) -> list[Part]:
    """The micro-batch's parts: one per table not holding the batch already (a replay is
    skipped table by table, before any of it is computed), with how its rows are typed
    and may be written ahead."""
    parts: list[Part] = []
    struct: bool | None = None
    for index, collection in enumerate(collections):
        table = router.table(collection)
        found = router.delta(table.target, settings.storage_options)
        if delta.replayed(found, settings.app_id, batch_id, writer):
            continue  # before the batch is looked at: a replay computes nothing
        if struct is None:
            struct = isinstance(batch.schema["data"].dataType, StructType)
        versions = [] if table.schema is not None or struct else router.found(collection)
        if table.schema is None and not struct and collection is not None and not versions:
            assert router.log is not None  # else keys= and schema= are given
            raise InvalidOptionError(
                registry.unknown_collection(router.log.storage, collection, "typed")
            )
        plan = None
        if settings.mode == "scd1" and settings.deletion_vectors and settings.write_ahead_rows:
            plan = delta.ahead_plan(
                table.target,
                found,
                table.keys,
                storage_options=settings.storage_options,
                min_rows=settings.write_ahead_rows,
            )
        parts.append(Part(index, collection, table.keys, table.schema, versions, plan))
    return parts


def _without_collection(key: str | None) -> InvalidOptionError:
    return InvalidOptionError(
        f"apply_changes: the micro-batch holds events without a collection (key "
        f"{str(key)[:200]!r}): a mapping or template target routes by collection, so they "
        f"would be lost (nothing was written for this batch)"
    )


def _check_batch(router: _Router, parts: Sequence[Part], batch: Batch, strict: bool) -> None:
    """Refuse a micro-batch whose events a routed query would lose (without a collection,
    or of a collection no table takes) or whose events' keys are not the registry's,
    before any table is written."""
    if router.routed and batch.without_collection is not None:
        raise _without_collection(batch.without_collection)
    if strict:
        for name in sorted(batch.unknown):
            router.table(name)  # no keys for it: an error naming the collection
    for part in parts:
        table = router.table(part.collection)
        if table.registered and part.collection is not None:
            _check_key_fields(part.collection, batch.parts[part.index].sample, table.keys)


def _apply(
    settings: _Settings,
    router: _Router,
    batch: DataFrame,
    batch_id: int,
    collections: tuple[list[str | None], bool],
    *,
    seen: _Seen,
) -> list[str]:
    """One pass over the micro-batch for ``collections``, each table's part applied;
    the collections it held that no part took (a template's: the next pass's)."""
    writer = _query_id()
    names, strict = collections
    parts = _parts(settings, router, names, batch, batch_id, writer)
    if not parts:
        return []
    local = seen.events is not None and seen.events <= LOCAL_EVENTS
    found = gather(*changes_frame(batch, parts, flat=not local), parts, local=local)
    seen.events = found.events
    try:
        _check_batch(router, parts, found, strict)
    except BaseException:
        _discard(router, parts, found)
        raise

    def applied(part: Part) -> None:
        table = router.table(part.collection)
        gathered = found.parts[part.index]
        changes = gathered.table()
        if changes is None:
            return  # none of its events in this batch
        crash_point("apply_before_delta", batch_id)
        apply_batch(
            table.target,
            changes,
            table.keys,
            app_id=settings.app_id,
            batch_id=batch_id,
            mode=settings.mode,
            storage_options=settings.storage_options,
            writer=writer,
            target_file_size=settings.target_file_size,
            defaults=registered_defaults(part.found),
            tombstones=settings.tombstones,
            deletion_vectors=settings.deletion_vectors,
            ahead=gathered.ahead,
            table=router.kept(table.target),
            coverage=_coverage(settings, router, table, part, found, changes),
        )
        crash_point("apply_after_delta", batch_id)

    _each_table(applied, parts)
    return sorted(found.unknown) if strict else []


TABLE_THREADS = 4
"""Tables of one micro-batch committed at once: each is its own Delta table and commit
(a replay skips each that holds the batch), and a commit waits on its files' writes and
fsyncs more than on Python (pgbench's 5 tables followed under load: the batch's commits
took 309 ms instead of 405 at the median)."""


def _each_table(apply: Callable[[Part], None], parts: Sequence[Part]) -> None:
    """``apply`` each part, up to :data:`TABLE_THREADS` at once. Every part is tried (a
    table's commit is not stopped half-way because another's failed); the first part's
    failure is raised, the others' noted on it and logged."""
    if len(parts) == 1:
        apply(parts[0])
        return
    with ThreadPoolExecutor(min(len(parts), TABLE_THREADS), "replog-apply") as pool:
        done = [pool.submit(apply, part) for part in parts]
    failed = [(part, f.exception()) for part, f in zip(parts, done, strict=True) if f.exception()]
    if not failed:
        return
    first = failed[0][1]
    assert first is not None
    for part, other in failed[1:]:
        logger.error("apply_changes: the table of %s failed too: %r", part.collection, other)
        first.add_note(f"the table of {part.collection} failed too: {other!r}")
    raise first


def _coverage(  # noqa: PLR0917 - a table's part of a batch
    settings: _Settings,
    router: _Router,
    table: _Table,
    part: Part,
    batch: Batch,
    changes: Any,
) -> covered.Coverage:
    """What the table's commit covers: the batch's offsets and source spans, and how the
    table is built from the log (its collection, keys, mode, given schema), for as-of
    reads (:mod:`replog.tables.as_of`)."""
    collection = part.collection
    if collection is None and rows.COLLECTION in changes.column_names:
        named = [c for c in changes.column(rows.COLLECTION).unique().to_pylist() if c]
        collection = named[0] if len(named) == 1 else None
    schema = table.schema.json() if isinstance(table.schema, StructType) else table.schema
    return covered.Coverage(
        batch.coverage.offsets,
        batch.coverage.span,
        None if router.log is None else router.log.log_id,
        collection,
        table.keys,
        settings.mode,
        schema,
        batch.coverage.sources,
    )


def _discard(router: _Router, parts: Sequence[Part], batch: Batch) -> None:
    """Delete the files written ahead for ``parts``, whose commits will not be made."""
    for part in parts:
        delta.discard(router.table(part.collection).target, batch.parts[part.index].ahead)


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
    write_ahead_rows: int | None = written_ahead.MIN_ROWS,
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
    The micro-batch is read in one pass: whole row images of keys the table cannot hold
    (a snapshot's rows) are written as Parquet files by the tasks, at least
    ``write_ahead_rows`` of a table per task (None: never), and committed with the rest
    of the batch (scd1, tables on local disk with deletion vectors); the other changes
    are collected to the driver (as Arrow) and reduced there: its memory is bounded by
    the source's ``maxEventsPerTrigger``.
    ``storage_options`` are delta-rs's (``AWS_ENDPOINT_URL``, ...); ``log_options`` the
    log's (fsspec). ``target_file_size`` is the ``delta.targetFileSize`` of the tables it
    creates (docs/CDC.md, "Cost"). ``deletion_vectors`` (tables on local disk): tables are
    created with Delta's deletion vectors enabled and scd1 batches are written
    merge-on-read, at the cost of the change rather than of the files its keys are in.
    """
    opened = _check_arguments(target, keys, app_id, mode, schema, collection, log, log_options)
    if write_ahead_rows is not None and write_ahead_rows < 1:
        raise InvalidOptionError(
            f"apply_changes: write_ahead_rows must be a positive number of rows or None, "
            f"got {write_ahead_rows!r}"
        )
    router = _Router(target, keys, schema, opened)

    settings = _Settings(
        app_id,
        mode,
        storage_options,
        target_file_size,
        tombstones,
        deletion_vectors,
        write_ahead_rows,
    )

    seen = _Seen()

    def apply(batch: DataFrame, batch_id: int) -> None:
        collections = router.collections(batch, collection)
        unknown = _apply(settings, router, batch, batch_id, collections, seen=seen)
        if unknown:  # a template's collections the registry did not list: keys= gives them
            _apply(settings, router, batch, batch_id, (list(unknown), True), seen=seen)

    return apply
