"""A batch of changes applied to a Delta table through ``deltalake`` (delta-rs), once.

Each batch is one Delta commit that carries the application transaction
``(app_id, batch_id)``: a batch whose id is at or below the table's recorded version for
``app_id`` was committed before and is skipped. This is Delta's idempotent-writes recipe
(``txnAppId``/``txnVersion``), so a driver killed after the commit and restarted from its
checkpoint replays the batch harmlessly. Rows keep their change's position; a change at or
before a row's position is ignored, so an old batch replayed under another ``app_id`` (a
replaced checkpoint) cannot roll a row back.

``target`` is any location delta-rs opens (a local path, ``file://``, ``s3://``, ...);
``storage_options`` are delta-rs's (``AWS_ENDPOINT_URL``, ...), not fsspec's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from replog.errors import InvalidOptionError, SchemaChangeError
from replog.tables import ahead as written_ahead
from replog.tables import changes as rows
from replog.tables import coverage as covered
from replog.tables import fills, merge_on_read
from replog.tables.changes import (
    ACTION,
    CURRENT,
    DELETE,
    OPERATION,
    POSITION,
    TIMESTAMP,
    VALID_TO,
    VALID_TO_POSITION,
    quoted,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """What one batch did: skipped as a replay, or committed as ``table_version``."""

    batch_id: int
    skipped: bool
    changes: int
    table_version: int | None
    metrics: dict[str, Any]


def _deltalake() -> Any:
    try:
        import deltalake  # noqa: PLC0415 - an optional extra: the error says how to get it
    except ImportError as exc:  # the optional extra
        raise InvalidOptionError(
            "apply_changes needs the deltalake package: pip install 'pyspark-replog[delta]'"
        ) from exc
    return deltalake


def refreshed(
    table: DeltaTable | None, target: str, storage_options: dict[str, str] | None
) -> DeltaTable | None:
    """``table`` (a handle of ``target`` kept from an earlier batch) moved to the newest
    version, reading only the commits since; ``target`` opened when there is none yet.
    Opening reads the log from its last checkpoint, up to 100 commits: a follower's
    micro-batch opened each of its tables twice."""
    if table is None:
        return open_table(target, storage_options)
    table.update_incremental()
    return table


def open_table(target: str, storage_options: dict[str, str] | None) -> DeltaTable | None:
    """The Delta table at ``target``, or None when there is none yet (its log read once)."""
    deltalake = _deltalake()
    try:
        table: DeltaTable = deltalake.DeltaTable(target, storage_options=storage_options)
    except deltalake.exceptions.TableNotFoundError:
        return None
    return table


TARGET_FILE_SIZE_KEY = "delta.targetFileSize"
TARGET_FILE_SIZE = 32 * 1024 * 1024
"""The ``delta.targetFileSize`` of the tables apply_changes creates (delta-rs's default
is 100 MiB): the bytes a merge rewrites for one changed key (BENCHMARKS.md)."""

APP_ID_INFO = "replog.appId"
WRITER_INFO = "replog.writer"
"""Commit info keys: the app id and the writer (a streaming query's id: its checkpoint)."""


def replayed(
    table: DeltaTable | None, app_id: str, batch_id: int, writer: str | None = None
) -> bool:
    """Whether ``table`` holds ``app_id``'s batch ``batch_id`` already (a replay: skipped).

    Raises:
        InvalidOptionError: ``app_id``'s last commit was made by another ``writer`` (a
            replaced checkpoint under the same app id, whose batch ids start at 0 again:
            skipping them would lose their changes).
    """
    done = None if table is None else table.transaction_version(app_id)
    if done is None or batch_id > done:
        return False
    assert table is not None
    last = _last_writer(table, app_id) if writer is not None else None
    if last is not None and last != writer:
        raise InvalidOptionError(
            f"apply_changes: app_id {app_id!r} has committed batches up to {done}, written by "
            f"streaming query {last}; batch {batch_id} of query {writer} (another checkpoint) "
            f"would be skipped as applied and its changes lost. Give a new checkpoint a new "
            f"app_id (docs/CDC.md)"
        )
    logger.info(
        "apply_changes %s: batch %d already committed (%d), skipped", app_id, batch_id, done
    )
    return True


def _last_writer(table: DeltaTable, app_id: str) -> str | None:
    """The writer of ``app_id``'s newest commit that names one (None: none does, e.g. a
    table written before writers were recorded, or its commits' logs expired)."""
    for commit in table.history():  # newest first; read only when a batch is skipped
        if commit.get(APP_ID_INFO) == app_id:
            writer = commit.get(WRITER_INFO)
            return None if writer is None else str(writer)
    return None


def read_table(table: DeltaTable, columns: Sequence[str] | None = None) -> pa.Table:
    """The table's rows, deletion vectors applied: delta-rs's own scan (its
    ``to_pyarrow_table`` refuses a table with deletion vectors in deltalake 1.6)."""
    scan = table.scan(columns=list(columns) if columns is not None else None)
    read = pa.RecordBatchReader.from_stream(scan).read_all()
    schema = table_schema(table)  # plain types: the scan gives string views
    return read.cast(pa.schema([schema.field(name) for name in read.column_names]))


def already_applied(
    target: str,
    app_id: str,
    batch_id: int,
    storage_options: dict[str, str] | None = None,
    writer: str | None = None,
) -> bool:
    """Whether ``app_id``'s batch ``batch_id`` is committed to the table at ``target``: a
    caller can skip a replayed batch before it computes the batch's changes."""
    return replayed(open_table(target, storage_options), app_id, batch_id, writer)


def table_schema(table: DeltaTable) -> pa.Schema:
    return pa.schema(table.schema().to_arrow())


def _commit(
    app_id: str, batch_id: int, writer: str | None, coverage: covered.Coverage | None = None
) -> Any:
    deltalake = _deltalake()
    info: dict[str, Any] = {
        APP_ID_INFO: app_id,
        **({WRITER_INFO: writer} if writer is not None else {}),
        **({covered.INFO_KEY: coverage.to_json()} if coverage is not None else {}),
    }
    return deltalake.CommitProperties(
        custom_metadata=info,
        app_transactions=[deltalake.Transaction(app_id=app_id, version=batch_id)],
    )


def apply_batch(
    target: str,
    changes: pa.Table,
    keys: Sequence[str],
    *,
    app_id: str,
    batch_id: int,
    mode: str = "scd1",
    storage_options: dict[str, str] | None = None,
    writer: str | None = None,
    target_file_size: int | None = TARGET_FILE_SIZE,
    defaults: Mapping[str, Any] | None = None,
    tombstones: bool = True,
    deletion_vectors: bool = True,
    ahead: Sequence[written_ahead.Prewritten] = (),
    table: DeltaTable | None = None,
    coverage: covered.Coverage | None = None,
) -> Applied:
    """Apply one batch of changes (any order; see :mod:`replog.tables.changes`) to the
    Delta table at ``target`` in one commit carrying ``(app_id, batch_id)``, creating the
    table on the first batch. A replayed ``batch_id`` is skipped.

    ``mode="scd1"`` keeps one row per key (deletes remove it); ``"scd2"`` keeps every
    version with ``__valid_from``, ``__valid_to`` and ``__current``. Bad input (keys,
    mode, an incompatible column type) is refused before anything is written.

    ``writer`` names who numbers the batch ids (``apply_changes``: the streaming query's
    id, which its checkpoint keeps); it is recorded with the commit, and a batch id that
    another writer committed under ``app_id`` is an error rather than a skip.

    ``target_file_size`` (bytes) is the ``delta.targetFileSize`` of a table this batch
    creates: a merge rewrites each file holding a changed key whole (delta-rs writes no
    deletion vectors), so it bounds what one change costs (docs/CDC.md, "Cost").

    ``defaults`` (column -> value) are the values that rows written before a column
    existed read (PostgreSQL's ``ADD COLUMN ... DEFAULT``): when a batch adds such a
    column, the table's rows (scd2: its current versions) get it.

    ``tombstones`` (scd1): each deleted key's position is kept beside the table
    (:func:`tombstones_location`), so an older change of a deleted key (a replay under
    a new ``app_id``) never brings it back.

    ``deletion_vectors`` (local tables): a table this batch creates is made with Delta's
    deletion vectors enabled (protocol reader 3 / writer 7, feature ``deletionVectors``),
    and scd1 batches into a table that has them enabled are written merge-on-read
    (:mod:`replog.tables.merge_on_read`): a batch costs what it changes, not the bytes of
    the files its keys are in.

    ``ahead``: the batch's files written already (by Spark's executors:
    :mod:`replog.tables.ahead`), whole row images committed with the batch (scd1, tables
    with deletion vectors on local disk; elsewhere they are read back and applied as
    changes). A row of a key that ``changes`` also holds is applied through them.

    ``table``: the table at ``target`` opened already, at its newest version (a follower
    keeps its handle between batches and moves it with :func:`refreshed` before each:
    after replog's own merge-on-read commit the handle is left before it, and a stale
    handle's history would give the batch's coverage an older base); None: it is opened
    here.

    ``coverage``: what of the log and the source the batch holds (its offsets: the last
    sequence per shard); recorded in the commit's info, made cumulative over the table's
    last (:mod:`replog.tables.coverage`), so a reader maps the version to a position.
    """
    given = changes.num_rows
    keys = rows.check_keys(keys)  # a truncate becomes deletes of keys (scd2)
    rows.check_one_collection(changes)  # a truncate's too: it empties its collection
    changes, cuts = rows.split_truncates(changes, keys, history=mode == "scd2")
    keys = _checked(changes, keys, mode, app_id, batch_id)
    changes = rows.storable(changes)
    unkept = [rows.COLLECTION, *([rows.SOURCE_POSITION] if mode == "scd1" else [])]
    changes = changes.drop_columns([c for c in unkept if c in changes.column_names])
    if table is None:
        table = open_table(target, storage_options)
    if replayed(table, app_id, batch_id, writer):
        discard(target, ahead)  # a replay's files: no commit will name them
        return Applied(batch_id, True, changes.num_rows, None, {})
    coverage = _cumulative(coverage, table)
    options = _Options(
        app_id, batch_id, storage_options, target_file_size, defaults, writer, deletion_vectors,
        cuts, coverage,
    )  # fmt: skip
    counted = given + sum(w.keys.num_rows for w in ahead)
    changes, taken = _taken_ahead(target, table, changes, keys, mode, options, ahead)
    if ahead:  # rows written ahead (scd1) before a truncate of their shard: void
        changes = rows.after_cuts(changes, cuts)
    if changes.num_rows == 0 and taken is None and (table is None or not cuts):
        return Applied(batch_id, False, 0, None, {})
    plan = _MODES[mode]
    changes = _keys_as_in(table, changes, keys)
    changes = _fill_unavailable(table, changes, keys)
    changes = changes.drop_columns(
        [c for c in (rows.UNSENT, rows.OLD_KEY) if c in changes.column_names]
    )
    source = plan.source(table, changes, keys, cuts)
    commit = _commit(app_id, batch_id, writer, coverage)
    if table is not None:  # an incompatible type is refused before anything is written
        source = rows.align(source, table_schema(table))
    if mode == "scd1" and tombstones:
        source = _after_tombstones(target, source, keys, options)
    metrics = _write(
        target, table, source, keys, plan=plan, commit=commit, options=options, ahead=taken
    )
    if metrics.get(COMMITTED_BEFORE):  # by another writer, since replayed() looked
        logger.info("apply_changes %s: batch %d committed by another writer, skipped",
                    app_id, batch_id)  # fmt: skip
        return Applied(batch_id, True, counted, None, {})
    if table is None:  # created by this batch
        table = open_table(target, storage_options)
        assert table is not None
        version: int = table.version()
    elif metrics.get("merge_on_read"):  # committed by replog, not through this handle
        version = metrics.pop(COMMITTED_VERSION)
        _after_own_commit(target, table, version)
    else:  # the merge's handle: delta-rs moves it to the version its commit made
        version = table.version()
    logger.info("apply_changes %s: batch %d -> table version %d", app_id, batch_id, version)
    return Applied(batch_id, False, counted, version, metrics)


def _cumulative(
    coverage: covered.Coverage | None, table: DeltaTable | None
) -> covered.Coverage | None:
    """The batch's coverage made cumulative over what the table's last commit covers."""
    if coverage is None or table is None:
        return coverage
    return coverage.after(last_coverage(table))


def _checked(
    changes: pa.Table, keys: Sequence[str], mode: str, app_id: str, batch_id: int
) -> tuple[str, ...]:
    """The keys, once the arguments and the changes are checked (bad input is refused
    before anything is written)."""
    keys = rows.check_keys(keys)
    rows.check_mode(mode)
    if not app_id:
        raise InvalidOptionError("apply_changes: app_id must name the writer (non-empty)")
    if batch_id < 0:
        raise InvalidOptionError(f"apply_changes: batch_id {batch_id} is negative")
    rows.check_changes(changes, keys)
    rows.check_one_collection(changes)
    return keys


def discard(target: str, ahead: Sequence[written_ahead.Prewritten]) -> None:
    """Delete files written ahead that no commit will name."""
    root = merge_on_read.local_root(target)
    if ahead and root is not None:
        merge_on_read.table(root).storage.delete_many([str(w.add["path"]) for w in ahead])


def _taken_ahead(  # noqa: PLR0917 - a batch's parts
    target: str,
    table: DeltaTable | None,
    changes: pa.Table,
    keys: Sequence[str],
    mode: str,
    options: _Options,
    ahead: Sequence[written_ahead.Prewritten],
) -> tuple[pa.Table, merge_on_read.Ahead | None]:
    """The files written ahead as the commit takes them, and the changes with the rows of
    theirs read back that the commit cannot take as they are: those of keys the changes
    (or the tombstones) hold; all of them when the table cannot take files written ahead
    (copy-on-write, scd2, another schema), which are then deleted."""
    if not ahead:
        return changes, None
    gathered = written_ahead.gathered(ahead)
    root = merge_on_read.local_root(target)
    assert root is not None  # the Spark layer writes ahead into local tables only
    if not _takes_ahead(target, table, changes, mode, options, root, gathered):
        everything = np.ones(gathered.rows.num_rows, dtype=bool)
        changes, _ = written_ahead.take_back(root, gathered, changes, keys, everything)
        discard(target, ahead)
        logger.info(
            "apply_changes %s: %d files written ahead applied as changes", target, len(ahead)
        )
        return changes, None
    graves = open_table(tombstones_location(target), options.storage_options)
    held = None
    if graves is not None:  # a key deleted before: its tombstone's position is checked
        held = ~written_ahead.outside(gathered.rows.column(keys[0]), key_ranges(graves, keys))
    return written_ahead.take_back(root, gathered, changes, keys, held)


def _takes_ahead(  # noqa: PLR0917 - a batch's parts
    target: str,
    table: DeltaTable | None,
    changes: pa.Table,
    mode: str,
    options: _Options,
    root: str,
    gathered: merge_on_read.Ahead,
) -> bool:
    """Whether the commit can take the files written ahead as they are: an scd1 batch into
    a new table or one written merge-on-read, whose columns and types are the files', and
    no truncate in the batch (rows written before it are void)."""
    if mode != "scd1" or not options.deletion_vectors or options.cuts:
        return False
    schema = written_ahead.schema_of(root, gathered)
    columns = [c for c in changes.column_names if not c.startswith("__")]
    if any(c not in schema.names for c in columns):
        return False
    if table is None:
        return True
    if _merge_on_read(target, table, options) is None:
        return False
    current = table_schema(table)
    pending = any((f.metadata or {}).get(FILL_INFO.encode()) for f in current)
    return not pending and [(f.name, f.type) for f in current] == [(f.name, f.type) for f in schema]


def ahead_plan(
    target: str,
    table: DeltaTable | None,
    keys: Sequence[str],
    *,
    storage_options: dict[str, str] | None = None,
    min_rows: int = written_ahead.MIN_ROWS,
) -> written_ahead.Plan | None:
    """How Spark's tasks may write a scd1 batch's rows into ``target`` ahead of its
    commit (:mod:`replog.tables.ahead`), given the table as it is (None: the batch creates
    it); None when they may not: not on local disk, or a table replog does not write
    merge-on-read, or a column added with a default waits for its fill."""
    root = merge_on_read.local_root(target)
    if root is None:
        return None
    schema = None
    held: tuple[list[Any], list[Any]] | None = ([], [])
    if table is not None:
        options = _Options("", 0, storage_options, None, None)
        if _merge_on_read(target, table, options) is None:
            return None
        schema = table_schema(table)
        if any((f.metadata or {}).get(FILL_INFO.encode()) for f in schema):
            return None
        held = key_ranges(table, keys)
    graves = open_table(tombstones_location(target), storage_options)
    if graves is not None and held is not None:
        dead = key_ranges(graves, keys)
        held = (
            None
            if dead is None
            else written_ahead.merged_ranges([*held[0], *dead[0]], [*held[1], *dead[1]])
        )
    return written_ahead.Plan(root, schema, tuple(keys), held, min_rows)


def key_ranges(table: DeltaTable, keys: Sequence[str]) -> tuple[list[Any], list[Any]] | None:
    """The ranges of the first key column that ``table``'s files hold (their statistics),
    joined (:func:`replog.tables.ahead.merged_ranges`); None: a file has none for it (it
    may hold any key)."""
    files = pa.table(table.get_add_actions(flatten=True))
    if files.num_rows == 0:
        return [], []
    low_name, high_name = f"min.{keys[0]}", f"max.{keys[0]}"
    if low_name not in files.column_names or high_name not in files.column_names:
        return None
    lows, highs = files.column(low_name), files.column(high_name)
    if lows.null_count or highs.null_count:
        return None
    return written_ahead.merged_ranges(lows.to_pylist(), highs.to_pylist())


CHECKPOINT_INTERVAL = 100
"""Versions between the checkpoints of tables replog commits to itself (delta-rs's and
Spark's default ``delta.checkpointInterval``): a reader replays at most this many
commits."""


COMMITTED_VERSION = "__version"
"""Set by :func:`_apply_on_read` in its metrics: the version its commit made."""
COMMITTED_BEFORE = "__committed_before"
"""Set by :func:`_apply_on_read` instead when another writer committed the batch's
transaction first (after the batch found it absent): nothing was written."""


def _after_own_commit(target: str, table: DeltaTable, version: int) -> None:
    """What delta-rs does after its own commits, after replog's (``version``; ``table``,
    the handle, is left before it: the next batch's lookup moves it, and a refresh here
    cost each table of a follower's batch a read of its log): a checkpoint every
    :data:`CHECKPOINT_INTERVAL` versions; and a purge of deletion vectors and small files
    in the background when enough have gathered (:func:`merge_on_read.purge_later`)."""
    interval = int(
        table.metadata().configuration.get("delta.checkpointInterval", CHECKPOINT_INTERVAL)
    )
    if version % interval == 0:
        table.update_incremental()
        table.create_checkpoint()
    root = merge_on_read.local_root(target)
    if root is not None:
        merge_on_read.purge_later(merge_on_read.table(root))


def _write(
    target: str,
    table: DeltaTable | None,
    source: pa.Table,
    keys: Sequence[str],
    *,
    plan: _Mode,
    commit: Any,
    options: _Options,
    ahead: merge_on_read.Ahead | None = None,
) -> dict[str, Any]:
    """Write a batch's merge source (and its files written ``ahead``) in one commit: the
    rows of a new table, an append of rows whose keys no file can hold, else a merge (which
    also gives the rows already in the table a new column's default:
    :func:`_defaults_to_fill`)."""
    if source.num_rows == 0 and ahead is None and (table is None or not options.cuts):
        return {}  # scd2: every change at or before its key's row
    if table is None:
        initial = source.filter(plan.initial).drop_columns([plan.marker])
        return _create(target, initial, commit, options, ahead, keys)
    if ahead is not None:  # checked: scd1, merge-on-read, no column to add or fill
        on_read = _merge_on_read(target, table, options)
        assert on_read is not None
        return _apply_on_read(on_read, table, source, keys, options, ahead)
    fill = _defaults_to_fill(table, source, options)
    on_read = _merge_on_read(target, table, options)
    if not fill and not options.cuts and _no_key_held(table, source, keys):  # new keys only
        appended = source.filter(plan.initial).drop_columns([plan.marker])
        return (
            _append(table, appended, commit)
            if on_read is None
            else _apply_on_read(on_read, table, appended, keys, options, append=True)
        )
    if not fill and on_read is not None and plan.marker == OPERATION:
        return _apply_on_read(on_read, table, source, keys, options)
    values = {quoted(c): f"s.{quoted(c)}" for c in source.column_names if c != plan.marker}
    on = " AND ".join(f"t.{quoted(k)} = s.{quoted(k)}" for k in keys)
    predicate, clauses = plan.rules(on, values, fill, options.cuts)
    return _merge(table, source, predicate, clauses, commit)


FILL_INFO = "replog.fill"
"""Field metadata of a column added with a default: ``{"app_id", "batch_id", "sql"}``, the
batch whose merge gives the table's earlier rows the default (SQL ``sql``)."""


def _defaults_to_fill(table: DeltaTable, source: pa.Table, options: _Options) -> dict[str, str]:
    """Column -> SQL default for the rows already in ``table``: the columns ``source``
    adds that have a default, and those a batch added without its merge committing (a
    crash between the two commits). A column with a default is first added on its own,
    its field metadata naming the batch that fills it (delta-rs leaves a column a merge
    adds NULL in rows no source row matched, whatever a clause sets)."""
    schema = table_schema(table)
    fill: dict[str, str] = {}
    for field in schema:
        pending = (field.metadata or {}).get(FILL_INFO.encode())
        if pending is None:
            continue
        note = json.loads(pending)
        done = table.transaction_version(note["app_id"])
        if done is None or done < note["batch_id"]:
            fill[quoted(field.name)] = str(note["sql"])
    added = []
    for name, value in (options.defaults or {}).items():
        if value is None or name not in source.column_names or name in schema.names:
            continue
        kind = source.schema.field(name).type
        try:
            sql = rows.sql_literal(value, kind)
        except SchemaChangeError as exc:  # the rows keep NULL, as before defaults were read
            logger.warning("apply_changes: column %r: %s; its earlier rows stay NULL", name, exc)
            continue
        note = {"app_id": options.app_id, "batch_id": options.batch_id, "sql": sql}
        added.append(pa.field(name, kind, metadata={FILL_INFO: json.dumps(note)}))
    if added:
        _add_columns(table, schema, added)
        for field in added:
            fill[quoted(field.name)] = json.loads(field.metadata[FILL_INFO.encode()])["sql"]
        logger.info("apply_changes: columns %s added, defaults filled", [f.name for f in added])
    return fill


def _add_columns(table: DeltaTable, schema: pa.Schema, added: Sequence[pa.Field]) -> None:
    """Add ``added`` to ``table`` (of ``schema``) in a commit of their own; the handle
    moved to it."""
    _after_purge(table)
    empty = pa.schema([*(f.with_nullable(True) for f in schema), *added]).empty_table()
    _deltalake().write_deltalake(table, empty, mode="append", schema_mode="merge")
    table.update_incremental()


def _create(  # noqa: PLR0917 - one batch's parts
    target: str,
    data: pa.Table,
    commit: Any,
    options: _Options,
    ahead: merge_on_read.Ahead | None = None,
    keys: Sequence[str] = (),
) -> dict[str, Any]:
    # Nullable columns, whatever the source said: a later batch (or schema evolution)
    # must not fail a NOT NULL check on columns it lacks, and a merge into NOT NULL
    # columns (as Spark gives shard and sequence) failed delta-rs 1.6's null check on
    # rows it only copied (seen with SCD2's close updates).
    data = data.cast(pa.schema([field.with_nullable(True) for field in data.schema]))
    size = options.target_file_size
    configuration = {} if size is None else {TARGET_FILE_SIZE_KEY: str(size)}
    root = merge_on_read.local_root(target) if options.deletion_vectors else None
    if root is not None:
        data = merge_on_read.delta_types(data)
        if ahead is not None:  # the table takes the files' columns and types
            schema = written_ahead.schema_of(root, ahead)
            data = rows.align(data, schema).select(schema.names).cast(schema)
        merge_on_read.create(
            merge_on_read.table(root),
            data,
            txn=(options.app_id, options.batch_id),
            info=_info(options),
            configuration=configuration,
            ahead=ahead,
            keys=keys,
        )
        ahead_rows = 0 if ahead is None else int((~ahead.taken).sum())
        return {"num_target_rows_inserted": data.num_rows + ahead_rows}
    _deltalake().write_deltalake(
        target,
        data,
        mode="error",
        configuration=configuration,
        commit_properties=commit,
        storage_options=options.storage_options,
    )
    return {"num_target_rows_inserted": data.num_rows}


def _append(table: DeltaTable, data: pa.Table, commit: Any) -> dict[str, Any]:
    """Append ``data`` (rows of keys the table does not hold) in one commit."""
    _deltalake().write_deltalake(
        table, data, mode="append", schema_mode="merge", commit_properties=commit
    )
    return {"num_target_rows_inserted": data.num_rows, "appended": True}


def _no_key_held(table: DeltaTable, source: pa.Table, keys: Sequence[str]) -> bool:
    """Whether no file of ``table`` can hold a key of ``source``: the range of the first
    key column in the batch lies outside every file's range of it (the file statistics
    the merge itself prunes by). Integer and text keys only; a file without statistics
    for the column counts as holding every key."""
    key = keys[0]
    kind = source.schema.field(key).type
    if not (
        pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
    ):
        return False
    files = pa.table(table.get_add_actions(flatten=True))
    if files.num_rows == 0:
        return True
    low_name, high_name = f"min.{key}", f"max.{key}"
    if low_name not in files.column_names or high_name not in files.column_names:
        return False
    lows, highs = files.column(low_name), files.column(high_name)
    if lows.null_count or highs.null_count:
        return False
    span = pc.min_max(source.column(key))
    low, high = span["min"].as_py(), span["max"].as_py()
    overlaps = pc.and_(
        pc.less_equal(lows, pa.scalar(high, lows.type)),
        pc.greater_equal(highs, pa.scalar(low, highs.type)),
    )
    return not pc.any(overlaps).as_py()


@dataclass(frozen=True)
class _Options:
    """What a batch's writes need besides its rows."""

    app_id: str
    batch_id: int
    storage_options: dict[str, str] | None
    target_file_size: int | None
    defaults: Mapping[str, Any] | None
    writer: str | None = None
    deletion_vectors: bool = True
    cuts: rows.Cuts = dataclasses.field(default_factory=dict)
    """The batch's truncates: the table's rows they remove go in the batch's commit."""
    coverage: covered.Coverage | None = None


def _info(options: _Options) -> dict[str, Any]:
    """The commit info replog's own commits carry (as :func:`_commit`'s do)."""
    coverage = options.coverage
    return {
        APP_ID_INFO: options.app_id,
        **({WRITER_INFO: options.writer} if options.writer is not None else {}),
        **({covered.INFO_KEY: coverage.to_json()} if coverage is not None else {}),
    }


COVERAGE_LOOKBACK = 20
"""Commits read back for a table's last coverage before its whole history is."""


def last_coverage(table: DeltaTable) -> covered.Coverage | None:
    """The coverage of the table's newest commit that records one (None: none does).
    The newest commit alone is read first: it is apply_changes' own, with its coverage,
    unless a compaction or another writer came after (reading 20 commits for each table of
    each micro-batch cost a follower ~8 ms a table)."""
    for limit in (1, COVERAGE_LOOKBACK):
        found = covered.latest(table.history(limit=limit))
        if found is not None or table.version() < limit:
            return found
    return covered.latest(table.history())


def _merge_on_read(target: str, table: DeltaTable, options: _Options) -> merge_on_read.Table | None:
    """The table to write merge-on-read, or None: its deletion vectors are not enabled,
    it is not on local disk, or it has a feature replog's writer does not write."""
    if not options.deletion_vectors:
        return None
    root = merge_on_read.local_root(target)
    if root is None:
        return None
    protocol = table.protocol()
    if "deletionVectors" not in (protocol.writer_features or ()):
        return None
    found = merge_on_read.table(root)
    with found.lock:
        state = found.log.state()
        refused = state.writable()
    if refused is not None:
        logger.info("apply_changes: %s is merged copy-on-write: %s", target, refused)
        return None
    return found if state.deletion_vectors else None


def _apply_on_read(  # noqa: PLR0917 - one batch's parts
    on_read: merge_on_read.Table,
    table: DeltaTable,
    source: pa.Table,
    keys: Sequence[str],
    options: _Options,
    ahead: merge_on_read.Ahead | None = None,
    *,
    append: bool = False,
) -> dict[str, Any]:
    """A scd1 batch written merge-on-read, or (``append``) rows of keys no file holds (scd1
    or scd2) appended by replog's writer; columns it adds are added first (their own
    commit, as :func:`_defaults_to_fill` adds a column with a default)."""
    schema = table_schema(table)
    added = [f for f in source.schema if f.name not in schema.names and f.name != OPERATION]
    if added:
        _add_columns(table, schema, added)
        schema = table_schema(table)
    source = rows.align(source, schema)
    txn, info = (options.app_id, options.batch_id), _info(options)
    written = (
        merge_on_read.append(on_read, source, schema, txn=txn, info=info)
        if append
        else merge_on_read.apply_scd1(
            on_read, source, keys, schema, txn=txn, info=info, ahead=ahead, cuts=options.cuts
        )
    )
    if written is None:
        return {COMMITTED_BEFORE: True}
    return {**written.metrics, COMMITTED_VERSION: written.version}


TOMBSTONES = "_replog_tombstones"


def tombstones_location(target: str) -> str:
    """Where scd1 keeps deleted keys' positions: a Delta table of keys and positions in
    the target's folder (a name starting ``_``, which readers of the target and
    ``VACUUM`` leave alone)."""
    return f"{target.rstrip('/')}/{TOMBSTONES}"


def _after_tombstones(
    target: str, source: pa.Table, keys: Sequence[str], options: _Options
) -> pa.Table:
    """``source`` (scd1: the latest change per key) without the changes older than their
    key's delete, and the batch's deletes recorded, in their own commit carrying the
    batch's transaction, before the table's: a crash between the two leaves tombstones
    of deletes not yet applied, which a change at the tombstone's own position (the
    delete replayed) still passes."""
    location = tombstones_location(target)
    graves = open_table(location, options.storage_options)
    if graves is not None and source.num_rows:
        seen = rows.keys_as(_stored_rows(graves, source, keys, POSITION), source, keys)
        source = rows.after_positions(source, seen, keys, inclusive=True)
    deletes = source.filter(pc.equal(source.column(OPERATION), DELETE)).select([*keys, *POSITION])
    if deletes.num_rows == 0:
        return source
    if (
        graves is not None
        and (graves.transaction_version(options.app_id) or -1) >= options.batch_id
    ):
        return source  # recorded before a crash
    commit = _commit(options.app_id, options.batch_id, None)
    deletes = deletes.cast(pa.schema([f.with_nullable(True) for f in deletes.schema]))
    if graves is None:
        _deltalake().write_deltalake(
            location, deletes, mode="error", commit_properties=commit,
            storage_options=options.storage_options,
        )  # fmt: skip
        return source
    values = {quoted(c): f"s.{quoted(c)}" for c in deletes.column_names}
    on = " AND ".join(f"t.{quoted(k)} = s.{quoted(k)}" for k in keys)
    _merge(
        graves, rows.align(deletes, table_schema(graves)), on,
        [Clause("update", rows.newer_sql(), values), Clause("insert", None, values)], commit,
    )  # fmt: skip
    return source


class Clause(NamedTuple):
    """One clause of a merge: ``delete`` or ``update`` a matched row, ``insert`` a source
    row no row matched, or update a row no source row matched (``unmatched``); when
    ``condition`` holds (None: always), setting ``values`` (column -> SQL expression)."""

    when: Literal["delete", "update", "insert", "unmatched", "unmatched_delete"]
    condition: str | None
    values: Mapping[str, str]


def _after_purge(table: DeltaTable) -> None:
    """Before delta-rs writes ``table``: wait for this process's background purge of it
    (started after replog's own commits: :func:`_after_own_commit`) and move the handle
    past the purge's commit. delta-rs refuses a commit when another came after the version
    it read ("a concurrent transaction added new data"); a purge changes no row, so what
    the batch made of the table before it stays right."""
    root = merge_on_read.local_root(table.table_uri)
    if root is not None and merge_on_read.purge_done(root):
        table.update_incremental()


def _merge(
    table: DeltaTable, source: pa.Table, predicate: str, clauses: Sequence[Clause], commit: Any
) -> dict[str, Any]:
    """Merge ``source`` (alias ``s``) into ``table`` (alias ``t``) in one commit."""
    _after_purge(table)
    merger = table.merge(
        source,
        predicate,
        source_alias="s",
        target_alias="t",
        merge_schema=True,
        # the source in memory (one micro-batch): delta-rs then prunes the table's files by
        # the source's key range (a streamed source reads every file of the table)
        streamed_exec=False,
        commit_properties=commit,
    )
    for clause in clauses:
        if clause.when == "delete":
            merger = merger.when_matched_delete(clause.condition)
        elif clause.when == "update":
            merger = merger.when_matched_update(dict(clause.values), clause.condition)
        elif clause.when == "unmatched":
            merger = merger.when_not_matched_by_source_update(dict(clause.values), clause.condition)
        elif clause.when == "unmatched_delete":
            merger = merger.when_not_matched_by_source_delete(clause.condition)
        else:
            merger = merger.when_not_matched_insert(dict(clause.values), clause.condition)
    metrics: dict[str, Any] = merger.execute()
    return metrics


def _scd1_source(
    table: DeltaTable | None, changes: pa.Table, keys: Sequence[str], cuts: rows.Cuts
) -> pa.Table:
    """The latest change per key (its operation says whether it deletes the row)."""
    return rows.latest_per_key(changes, keys).drop_columns([TIMESTAMP])


def _scd1_rules(
    on: str, values: Mapping[str, str], fill: Mapping[str, str], cuts: rows.Cuts
) -> tuple[str, list[Clause]]:
    """A key's latest change replaces or deletes its row, if newer than the row; a row
    older than its shard's truncate (``cuts``) that no change replaces is deleted; ``fill``
    (column -> SQL value) sets a new column's default in the rows no change replaces."""
    newer = rows.newer_sql()
    is_delete = f"s.{OPERATION} = '{DELETE}'"
    clauses = [
        Clause("delete", f"{is_delete} AND {newer}", {}),
        Clause("update", f"NOT ({is_delete}) AND {newer}", values),
        Clause("insert", f"NOT ({is_delete})", values),
    ]
    if cuts:  # first: a truncated row gets no default
        clauses.append(Clause("unmatched_delete", rows.cut_sql(cuts), {}))
    if fill:
        clauses += [Clause("update", None, fill), Clause("unmatched", None, fill)]
    return on, clauses


def _keys_as_in(table: DeltaTable | None, changes: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``changes`` with their key columns cast to the table's key types (checked: a value
    that does not fit is :class:`SchemaChangeError`), so that they join the table's rows
    (scd2's positions, the placeholders' values): a key widened since the table was made
    (int32 to int64) is still the same key."""
    if table is None:
        return changes
    schema = table_schema(table)
    fields = pa.schema([schema.field(k) for k in keys if k in schema.names])
    cast = rows.align(changes.select(fields.names), fields)
    for name in fields.names:
        changes = changes.set_column(changes.schema.get_field_index(name), name, cast.column(name))
    return changes


def _fill_unavailable(table: DeltaTable | None, changes: pa.Table, keys: Sequence[str]) -> pa.Table:
    """:func:`replog.tables.fills.fill_unavailable` from the table's rows."""
    return fills.fill_unavailable(None if table is None else _DeltaRows(table), changes, keys)


class _DeltaRows:
    """A Delta table's rows as :mod:`replog.tables.fills` reads them."""

    def __init__(self, table: DeltaTable) -> None:
        self.table = table
        self.schema = table_schema(table)

    def rows(
        self, changes: pa.Table, keys: Sequence[str], columns: Sequence[str], *, current_only: bool
    ) -> pa.Table:
        return _stored_rows(self.table, changes, keys, columns, current_only=current_only)


def _stored_rows(
    table: DeltaTable,
    changes: pa.Table,
    keys: Sequence[str],
    columns: Sequence[str],
    *,
    current_only: bool = False,
) -> pa.Table:
    """The table's ``keys`` and ``columns`` of the rows whose first key column is one of
    the changes' (a superset of their keys' rows, narrowed by the caller's join), read with
    that filter pushed down to the files' statistics. A table with deletion vectors is
    read with them applied."""
    if "deletionVectors" in (table.protocol().reader_features or ()):
        return _stored_live_rows(table, changes, keys, columns, current_only=current_only)
    dataset = table.to_pyarrow_dataset()
    kind = dataset.schema.field(keys[0]).type
    values = pc.unique(changes.column(keys[0])).cast(kind)
    wanted = ds.field(keys[0]).isin(values)
    if current_only:
        wanted = wanted & (ds.field(CURRENT) == True)  # noqa: E712 - an expression
    # the files by their statistics (the Delta log's), then the rows in memory: a filter
    # pushed into the files' row groups fails on text a merge wrote as string_view
    files = list(dataset.get_fragments(filter=wanted))
    if not files:
        return dataset.schema.empty_table().select([*keys, *columns])
    chosen = ds.FileSystemDataset(
        files, schema=dataset.schema, format=dataset.format, filesystem=dataset.filesystem
    )
    read = chosen.to_table(columns=[*keys, *columns, *([CURRENT] if current_only else [])])
    keep = pc.is_in(read.column(keys[0]).cast(kind), value_set=values)
    if current_only:
        keep = pc.and_kleene(keep, pc.equal(read.column(CURRENT), True))
    return read.filter(keep).select([*keys, *columns])


def _stored_live_rows(
    table: DeltaTable,
    changes: pa.Table,
    keys: Sequence[str],
    columns: Sequence[str],
    *,
    current_only: bool,
) -> pa.Table:
    """:func:`_stored_rows` of a table with deletion vectors: through replog's key index
    on local disk (scd1's one row per key), else delta-rs's own scan (which applies them)."""
    wanted = [*keys, *columns, *([CURRENT] if current_only else [])]
    root = merge_on_read.local_root(table.table_uri)
    if root is not None and not current_only:
        on_read = merge_on_read.table(root)
        with on_read.lock:
            state = on_read.log.state()
            found = merge_on_read.live_rows(on_read, state, changes, keys, wanted)
        if found.num_rows == 0:
            return pa.schema([f for f in table_schema(table) if f.name in wanted]).empty_table()
        return found.select(wanted).select([*keys, *columns])
    read = read_table(table, wanted)
    kind = read.schema.field(keys[0]).type
    values = pc.unique(changes.column(keys[0])).cast(kind)
    keep = pc.is_in(read.column(keys[0]), value_set=values)
    if current_only:
        keep = pc.and_kleene(keep, pc.equal(read.column(CURRENT), True))
    return read.filter(keep).select([*keys, *columns])


def _positions(table: DeltaTable, changes: pa.Table, keys: Sequence[str]) -> pa.Table:
    """The newest position per key of ``changes`` among the table's rows."""
    found = _stored_rows(table, changes, keys, POSITION)
    return rows.latest_per_key(
        found.append_column(OPERATION, pa.nulls(found.num_rows, pa.string())).append_column(
            TIMESTAMP, pa.nulls(found.num_rows, pa.timestamp("us", tz="UTC"))
        ),
        keys,
    )


def _scd2_source(
    table: DeltaTable | None, changes: pa.Table, keys: Sequence[str], cuts: rows.Cuts
) -> pa.Table:
    """History rows (:func:`replog.tables.changes.scd2_rows`) of the changes newer than
    their key's rows in the table: a merge inserts without seeing the table's rows, so
    the position guard is applied here."""
    if table is not None and changes.num_rows:
        changes = rows.after_positions(changes, _positions(table, changes, keys), keys)
    return rows.scd2_rows(changes, keys, cuts)


def _scd2_rules(
    on: str, values: Mapping[str, str], fill: Mapping[str, str], cuts: rows.Cuts
) -> tuple[str, list[Clause]]:
    """A ``close`` row ends its key's current version (its time and source position);
    ``insert`` rows add versions; a current version older than its shard's truncate
    (``cuts``) that no change closes ends at the truncate; ``fill`` sets a new column's
    default in the current versions (a closed one ended before the column existed)."""
    ended = {VALID_TO: f"s.{VALID_TO}", VALID_TO_POSITION: f"s.{VALID_TO_POSITION}"}
    clauses = [
        Clause("update", None, {**ended, CURRENT: "false", **fill}),
        Clause("insert", f"s.{ACTION} = 'insert'", values),
    ]
    if cuts:
        kind = pa.timestamp("us", tz="UTC")
        ends = " ".join(
            f"WHEN {shard} THEN {rows.sql_literal(cut.timestamp, kind)}"
            for shard, cut in sorted(cuts.items())
        )
        positions = " ".join(
            f"WHEN {shard} THEN CAST({'NULL' if cut.source is None else cut.source} AS BIGINT)"
            for shard, cut in sorted(cuts.items())
        )
        closed = {
            VALID_TO: f"CASE t.{rows.SHARD} {ends} END",
            VALID_TO_POSITION: f"CASE t.{rows.SHARD} {positions} END",
            CURRENT: "false",
        }
        clauses.append(Clause("unmatched", f"t.{CURRENT} AND ({rows.cut_sql(cuts)})", closed))
    if fill:
        clauses.append(Clause("unmatched", f"t.{CURRENT}", fill))
    return f"{on} AND t.{CURRENT} AND s.{ACTION} = 'close'", clauses


@dataclass(frozen=True)
class _Mode:
    """How a mode applies a batch: its merge source rows, whose column ``marker`` (never
    written) tells what each row does; the rows a new table starts with (``initial``);
    the merge's predicate and clauses, given the key equality and the row's values."""

    source: Callable[[DeltaTable | None, pa.Table, Sequence[str], rows.Cuts], pa.Table]
    marker: str
    initial: pc.Expression
    rules: Callable[
        [str, Mapping[str, str], Mapping[str, str], rows.Cuts], tuple[str, list[Clause]]
    ]


_MODES = {
    "scd1": _Mode(_scd1_source, OPERATION, pc.field(OPERATION) != DELETE, _scd1_rules),
    "scd2": _Mode(_scd2_source, ACTION, pc.field(ACTION) == "insert", _scd2_rules),
}
