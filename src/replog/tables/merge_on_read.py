"""Merge-on-read: a batch of changes applied at the cost of the change, not of the table.

A copy-on-write merge rewrites every file that holds a changed key; OLTP updates are
spread over the whole key space, so each micro-batch rewrote nearly the whole table
(BENCHMARKS.md, issue 41). Here a batch (scd1: the latest change per key) is written as
Delta's own merge-on-read, which Spark's Delta, Trino, DuckDB, delta-rs and polars read:

1. the rows the batch replaces are found from the keys and positions of the table's files
   (each file's read once per process and kept: files never change, only their deletion
   vectors do), pruned by the files' key statistics;
2. a change at or before its row's position is dropped (the position rule of
   :mod:`replog.tables.changes`), the others mark their row deleted in its file's deletion
   vector (:mod:`replog.tables.deletion_vectors`: one DV file per batch) and, unless they
   delete, append their row image in one new Parquet file;
3. one commit (:class:`replog.tables.delta_log.DeltaLog`) holds the new file, each touched
   file's ``remove`` (its old DV) and ``add`` (its new DV, statistics marked wide), and the
   batch's application transaction. A crash before it leaves unreferenced files (a
   replay writes new ones; ``VACUUM`` deletes the old); another writer's commit in between
   (a compaction) makes the batch start over from the new version.

:func:`purge` folds deletion vectors and small files back into whole files (Delta's
``REORG TABLE ... APPLY (PURGE)`` and ``OPTIMIZE``), as a commit of ``dataChange: false``
actions that loses to any concurrent change of its files.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyroaring import BitMap64

from replog.crashpoints import crash_point
from replog.errors import CommitConflictError
from replog.processlocal import ProcessDict, ProcessLock
from replog.storage import Storage
from replog.tables import deletion_vectors as dvs
from replog.tables.changes import (
    DELETE,
    OPERATION,
    POSITION,
    SEQUENCE,
    SHARD,
    Cuts,
    keys_distinct,
    last_per_key,
)
from replog.tables.delta_log import (
    DELETION_VECTORS,
    ENABLE_DELETION_VECTORS,
    DeltaLog,
    LogState,
    commit_info,
    deletion_vector,
    num_records,
)

logger = logging.getLogger(__name__)

_ROW = "__row"
_CHANGE = "__change"
COMMIT_ATTEMPTS = 10
"""How often a batch starts over after losing its commit to another writer."""


def local_root(target: str) -> str | None:
    """The local folder of ``target`` (a path or ``file://`` URL), None elsewhere: replog
    writes deletion vectors where its storage has an atomic create that delta-rs's own
    commits respect (local disk: both create commit files with a no-replace link)."""
    if target.startswith("file://"):  # as delta-rs gives a table's URI: quoted, a "/" last
        return os.path.abspath(unquote(target[len("file://") :]))
    if "://" in target:
        return None
    return os.path.abspath(target)


class Table:
    """One Delta table replog writes merge-on-read: its storage, log and the keys of its
    files (kept per process: see :func:`table`)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.storage = Storage(root)
        self.log = DeltaLog(self.storage)
        self.lock = threading.Lock()
        """Held while a batch or a purge of this process writes the table."""
        self.purging: threading.Thread | None = None

    def read_file(self, path: str, columns: Sequence[str]) -> pa.Table:
        """Columns of a file, in the types a Delta table reads back (a file delta-rs's
        merge wrote holds ``string_view``, which pyarrow can neither take nor join)."""
        with self.storage.fs.open(self.storage.path(path), "rb") as handle:
            return delta_types(pq.read_table(handle, columns=list(columns)))

    def read_rows(self, path: str, rows: np.ndarray, columns: Sequence[str]) -> pa.Table:
        """Rows ``rows`` (ascending) of a file: only the row groups holding them are read."""
        with self.storage.fs.open(self.storage.path(path), "rb") as handle:
            parquet = pq.ParquetFile(handle)
            sizes = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
            starts = np.concatenate([[0], np.cumsum(sizes)])
            groups = np.unique(np.searchsorted(starts, rows, side="right") - 1)
            read = delta_types(parquet.read_row_groups(groups.tolist(), columns=list(columns)))
        offsets = np.concatenate([[0], np.cumsum([sizes[g] for g in groups])])
        within = np.searchsorted(groups, np.searchsorted(starts, rows, side="right") - 1)
        local = offsets[within] + rows - starts[groups[within]]
        return read.take(pa.array(local))

    def deleted_rows(self, add: Mapping[str, Any]) -> BitMap64 | None:
        """The rows a file's deletion vector deletes (None: it has none); each DV is read
        once per process (a DV never changes: a file's next one has another id)."""
        descriptor = deletion_vector(add)
        if descriptor is None:
            return None

        def read() -> BitMap64:
            if descriptor.storage_type == "i":
                content = b""
            elif descriptor.storage_type == "u":
                content = self.storage.read(descriptor.relative_file())
            else:
                content = bytes(self.storage.fs.cat_file(descriptor.path_or_inline_dv))
            return dvs.from_file(descriptor, content)

        found: BitMap64 = _DELETED.get((self.root, descriptor.unique_id), read)
        return found


_TABLES: ProcessDict[str, Table] = ProcessDict()
_TABLES_LOCK = ProcessLock()


def table(root: str) -> Table:
    """The process's :class:`Table` for ``root`` (one log state and key cache each)."""
    with _TABLES_LOCK:
        if root not in _TABLES:
            _TABLES[root] = Table(root)
        return _TABLES[root]


def purge_done(root: str) -> bool:
    """Wait for this process's background purge of the table at ``root``, if it ever ran
    one (:func:`purge_later`); whether it did."""
    with _TABLES_LOCK:
        found = _TABLES.get(root)
    purging = None if found is None else found.purging
    if purging is None:
        return False
    purging.join()
    return True


class _Cache:
    """Values by key, the least recently used dropped beyond ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = ProcessLock()

    def __reduce__(self) -> tuple[type[_Cache], tuple[int]]:
        """A copy in another process (replog's modules pickled by value) starts empty."""
        return (_Cache, (self.budget,))

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key][0]
        value = make()
        size = _size_of(value)
        with self._lock:
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > self.budget and len(self._items) > 1:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped
        return value


def _size_of(value: Any) -> int:
    if isinstance(value, _FileKeys):
        return value.nbytes
    if isinstance(value, BitMap64):
        return 8 * len(value) // 4 + 64
    return 64


KEY_CACHE_BYTES = int(os.environ.get("REPLOG_KEY_CACHE_BYTES", str(1 << 30)))
"""The keys and positions of the files kept per process (about 24 bytes a row: 1 GiB holds
a 40M-row table's); beyond it the least recently used files are read again when needed."""
_KEYS = _Cache(KEY_CACHE_BYTES)
_DELETED = _Cache(256 << 20)


@dataclass(frozen=True)
class _FileKeys:
    """A file's key columns and positions, row by row; for a single integer key also its
    keys sorted (``sorted_keys``, ``order``: the rows in that order) to look them up."""

    rows: pa.Table
    sorted_keys: np.ndarray | None
    order: np.ndarray | None

    @property
    def nbytes(self) -> int:
        extra = (
            0
            if self.sorted_keys is None or self.order is None
            else (self.sorted_keys.nbytes + self.order.nbytes)
        )
        return int(self.rows.nbytes) + extra


def _file_keys(target: Table, path: str, keys: Sequence[str]) -> _FileKeys:
    def read() -> _FileKeys:
        rows = target.read_file(path, [*keys, *POSITION])
        if len(keys) == 1 and pa.types.is_integer(rows.schema.field(keys[0]).type):
            values = rows.column(keys[0]).to_numpy().astype(np.int64, copy=False)
            order = np.argsort(values, kind="stable").astype(np.int64)
            return _FileKeys(rows, values[order], order)
        return _FileKeys(rows, None, None)

    found: _FileKeys = _KEYS.get((target.root, path, tuple(keys)), read)
    return found


def _overlapping(
    state: LogState, source: pa.Table, keys: Sequence[str]
) -> list[tuple[str, dict[str, Any]]]:
    """The live files whose statistics do not rule out holding a key of ``source``: per
    key column, the file's [min, max] meets the batch's (integer, text and date keys; a
    file without statistics for a column may hold any)."""
    spans = {}
    for key in keys:
        kind = source.schema.field(key).type
        if pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind):
            found = pc.min_max(source.column(key))
            spans[key] = (found["min"].as_py(), found["max"].as_py())
    chosen = []
    for path, add in state.files.items():
        stats = json.loads(add["stats"]) if add.get("stats") else {}
        low, high = stats.get("minValues") or {}, stats.get("maxValues") or {}
        held = True
        for key, (first, last) in spans.items():
            if key in low and key in high and (high[key] < first or low[key] > last):
                held = False
                break
        if held:
            chosen.append((path, add))
    return chosen


@dataclass(frozen=True)
class Found:
    """The table's live rows of a batch's keys: per row its file, row index, position, and
    the batch row (``change``) of its key."""

    files: list[str]
    file: np.ndarray
    row: np.ndarray
    shard: np.ndarray
    sequence: np.ndarray
    change: np.ndarray


def locate(target: Table, state: LogState, source: pa.Table, keys: Sequence[str]) -> Found:
    """The live rows holding a key of ``source`` (one row per key: scd1)."""
    files: list[str] = []
    if source.num_rows == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Found(files, empty, empty, empty, empty, empty)
    parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    integer = len(keys) == 1 and pa.types.is_integer(source.schema.field(keys[0]).type)
    wanted = source.column(keys[0]).to_numpy().astype(np.int64, copy=False) if integer else None
    probe = source.select(list(keys)).append_column(
        _CHANGE, pa.array(np.arange(source.num_rows, dtype=np.int64))
    )
    for path, add in _overlapping(state, source, keys):
        cached = _file_keys(target, path, keys)
        if cached.sorted_keys is not None and wanted is not None and cached.order is not None:
            rows, changes = _lookup(cached.sorted_keys, cached.order, wanted)
        else:
            rows, changes = _join(cached.rows, probe, keys)
        if not len(rows):
            continue
        deleted = target.deleted_rows(add)
        if deleted is not None and len(deleted):
            alive = np.array([r not in deleted for r in rows.tolist()], dtype=bool)
            rows, changes = rows[alive], changes[alive]
            if not len(rows):
                continue
        shard = cached.rows.column(SHARD).to_numpy()[rows]
        sequence = cached.rows.column(SEQUENCE).to_numpy()[rows]
        parts.append((len(files), rows, shard, sequence, changes))
        files.append(path)
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Found(files, empty, empty, empty, empty, empty)
    return Found(
        files,
        np.concatenate([np.full(len(p[1]), p[0], dtype=np.int64) for p in parts]),
        *(np.concatenate([p[i] for p in parts]).astype(np.int64) for i in (1, 2, 3, 4)),
    )


def _lookup(
    sorted_keys: np.ndarray, order: np.ndarray, wanted: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows (of a file whose keys sorted are ``sorted_keys``) holding a ``wanted`` key,
    and for each the index of its key in ``wanted``; a key held by several rows gives
    each."""
    low = np.searchsorted(sorted_keys, wanted, side="left")
    high = np.searchsorted(sorted_keys, wanted, side="right")
    counts = high - low
    hit = np.flatnonzero(counts)
    if not len(hit):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    if (counts[hit] == 1).all():
        return order[low[hit]], hit.astype(np.int64)
    changes = np.repeat(hit, counts[hit])
    starts = np.repeat(low[hit], counts[hit])
    offsets = np.arange(len(changes)) - np.repeat(np.cumsum(counts[hit]) - counts[hit], counts[hit])
    return order[starts + offsets], changes.astype(np.int64)


def _join(rows: pa.Table, probe: pa.Table, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    numbered = rows.select(list(keys)).append_column(
        _ROW, pa.array(np.arange(rows.num_rows, dtype=np.int64))
    )
    probe = probe.cast(
        pa.schema([*(numbered.schema.field(k) for k in keys), probe.schema.field(_CHANGE)])
    )
    joined = numbered.join(probe, list(keys), join_type="inner", use_threads=False)
    return (
        joined.column(_ROW).to_numpy().astype(np.int64),
        joined.column(_CHANGE).to_numpy().astype(np.int64),
    )


def live_rows(
    target: Table, state: LogState, changes: pa.Table, keys: Sequence[str],
    columns: Sequence[str],
) -> pa.Table:  # fmt: skip
    """The table's live rows (``keys`` and ``columns``) of the keys of ``changes``, read
    with their files' deletion vectors applied."""
    if changes.num_rows == 0:
        return pa.table({})
    probe = changes.select(list(keys))
    found = locate(target, state, probe, keys)
    parts = []
    for index, path in enumerate(found.files):
        parts.append(target.read_rows(path, np.sort(found.row[found.file == index]), columns))
    if not parts:
        return pa.table({})
    return pa.concat_tables(parts, promote_options="permissive")


# -- writing -----------------------------------------------------------------------------


def _stat_value(value: Any) -> Any:
    if isinstance(value, date):
        return value.isoformat()
    return value


def file_stats(data: pa.Table) -> dict[str, Any]:
    """An ``add`` action's statistics: ``numRecords``, and per top-level column its
    ``nullCount`` and, for integers, texts and dates, exact (tight) bounds."""
    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name, column in zip(data.column_names, data.columns, strict=True):
        kind = column.type
        if pa.types.is_nested(kind):
            continue
        nulls[name] = column.null_count
        bounded = (
            pa.types.is_integer(kind)
            or pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
            or pa.types.is_date(kind)
        )
        if bounded and column.null_count < len(column):
            found = pc.min_max(column)
            low[name] = _stat_value(found["min"].as_py())
            high[name] = _stat_value(found["max"].as_py())
    return {"numRecords": data.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls}


def delta_types(data: pa.Table) -> pa.Table:
    """``data`` in the Arrow types a Delta table reads back (delta-rs's schema mapping:
    no views, no large types), so files written here hold what a table's schema says."""
    import deltalake  # noqa: PLC0415 - the optional extra, loaded by the caller already

    return data.cast(pa.schema(deltalake.Schema.from_arrow(data.schema).to_arrow()))


def new_file_name() -> str:
    return f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"


def write_file(storage: Storage, data: pa.Table, name: str | None = None) -> dict[str, Any]:
    """Write ``data`` as one Parquet file in the table's folder; its ``add`` action."""
    name = name or new_file_name()
    sink = pa.BufferOutputStream()
    pq.write_table(data, sink, compression="snappy")
    content = sink.getvalue()
    storage.put_if_absent(name, content.to_pybytes())
    return {
        "path": name,
        "partitionValues": {},
        "size": content.size,
        "modificationTime": int(storage.modified_ms(name) or 0),
        "dataChange": True,
        "stats": json.dumps(file_stats(data), separators=(",", ":")),
    }


def _dv_actions(
    target: Table,
    state: LogState,
    deletions: Mapping[str, np.ndarray],
    *,
    data_change: bool = True,
    ahead: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """The actions marking ``deletions`` (path -> row indexes) deleted: per file a
    ``remove`` of it as it is and an ``add`` with its new DV (its old rows and these), or
    only the ``remove`` when no row is left; and the DV file written (None: none). A file
    written ahead (``ahead``: path -> its ``add``, in no commit yet) gets its ``add`` with
    the DV, or nothing when no row is left."""
    removes, adds, bitmaps = [], [], []
    now = _now_ms()
    for path, rows in deletions.items():
        new = path not in state.files
        add = (ahead or {})[path] if new else state.files[path]
        old = target.deleted_rows(add)
        rows_now = BitMap64(old) if old is not None else BitMap64()
        rows_now.update(rows.astype(np.uint64).tolist())
        if not new:
            removes.append({"remove": _remove(add, now, data_change)})
        total = num_records(add)
        if total is None:
            total = pq.ParquetFile(
                target.storage.fs.open(target.storage.path(path))
            ).metadata.num_rows
        if len(rows_now) >= total:
            continue  # every row of the file deleted: the remove alone
        stats = json.loads(add["stats"]) if add.get("stats") else {}
        stats["numRecords"] = total
        stats["tightBounds"] = False
        adds.append(
            {**add, "stats": json.dumps(stats, separators=(",", ":")), "dataChange": data_change}
        )
        bitmaps.append(rows_now)
    if not bitmaps:
        return removes, None
    name = uuid.uuid4()
    content, descriptors = dvs.pack(bitmaps, name)
    target.storage.put_if_absent(dvs.file_name(name), content)
    for add, descriptor in zip(adds, descriptors, strict=True):
        add["deletionVector"] = descriptor.to_json()
    return [*removes, *({"add": a} for a in adds)], dvs.file_name(name)


def _remove(add: Mapping[str, Any], now: int, data_change: bool) -> dict[str, Any]:
    found = {
        "path": add["path"],
        "deletionTimestamp": now,
        "dataChange": data_change,
        "extendedFileMetadata": True,
        "partitionValues": add.get("partitionValues") or {},
        "size": add["size"],
    }
    for name in ("stats", "deletionVector", "tags"):
        if add.get(name):
            found[name] = add[name]
    return found


@dataclass(frozen=True)
class Written:
    """What a merge-on-read batch committed."""

    version: int
    metrics: dict[str, Any]


FILE = "__file"
ROW = "__row_in_file"


@dataclass(frozen=True)
class Ahead:
    """Parquet files a batch's rows were written to ahead of its commit (by Spark's
    executors: :mod:`replog.tables.ahead`), in the table's folder and in no commit yet:
    their ``add`` actions; per row (``rows``) its key columns, position, file (:data:`FILE`,
    an index into ``adds``) and row in it (:data:`ROW`); and ``taken``, the rows the batch
    applies through its changes instead (their key has other changes in the batch), which
    the commit marks deleted."""

    adds: list[dict[str, Any]]
    rows: pa.Table
    taken: np.ndarray

    @property
    def paths(self) -> list[str]:
        return [str(a["path"]) for a in self.adds]


def _ahead_deletions(
    target: Table, state: LogState, ahead: Ahead, keys: Sequence[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]]:
    """The rows an :class:`Ahead` deletes (table path -> rows), the rows of its own files
    that are not live (written path -> rows): those taken, those of a key written twice
    but the newest, and those at or before the position of their key's row in the table."""
    file = ahead.rows.column(FILE).to_numpy()
    row = ahead.rows.column(ROW).to_numpy()
    dead = ahead.taken.copy()
    live = np.flatnonzero(~dead)
    candidates = ahead.rows.select([*keys, *POSITION]).take(pa.array(live))
    if keys_distinct(candidates, keys):
        newest = live
    else:
        order = pc.sort_indices(candidates, [(SHARD, "ascending"), (SEQUENCE, "ascending")])
        newest = live[order.to_numpy()[last_per_key(candidates.take(order), keys)]]
    dead[live] = True
    dead[newest] = False  # a key written twice (in two tasks): its newest row lives
    twice = len(live) - len(newest)
    winners = ahead.rows.select([*keys, *POSITION]).take(pa.array(newest))
    found = locate(target, state, winners, keys)
    shard = winners.column(SHARD).to_numpy().astype(np.int64)[found.change]
    sequence = winners.column(SEQUENCE).to_numpy().astype(np.int64)[found.change]
    newer = (shard > found.shard) | ((shard == found.shard) & (sequence > found.sequence))
    dead[newest[found.change[~newer]]] = True  # the table holds it at that position or later
    table: dict[str, np.ndarray] = {}
    for index, path in enumerate(found.files):
        rows = found.row[(found.file == index) & newer]
        if len(rows):
            table[path] = rows
    own: dict[str, np.ndarray] = {}
    for index, path in enumerate(ahead.paths):
        rows = row[dead & (file == index)]
        if len(rows):
            own[path] = rows
    metrics = {
        "num_rows_written_ahead": int((~dead).sum()),
        "num_rows_taken_back": int(ahead.taken.sum()),
        "num_rows_ahead_written_twice": int(twice),
        "num_rows_ahead_stale": int((~newer).sum()),
        "num_files_written_ahead": len(ahead.adds),
    }
    return table, own, metrics


def apply_scd1(
    target: Table,
    source: pa.Table,
    keys: Sequence[str],
    schema: pa.Schema,
    *,
    txn: tuple[str, int],
    info: Mapping[str, Any],
    ahead: Ahead | None = None,
    cuts: Cuts | None = None,
) -> Written | None:
    """Apply ``source`` (the latest change per key, deletes marked in :data:`OPERATION`,
    columns aligned to ``schema``, the table's) and the rows written ``ahead`` (none of
    whose keys ``source`` holds) in one commit carrying ``txn``, with the rows the
    batch's truncates remove (``cuts``). Starts over when another
    writer commits first. None: ``txn`` is committed already (the files written ahead
    are then deleted: a replay's, never referenced)."""
    return _commit_batch(
        target,
        "MERGE",
        lambda state: _batch_actions(target, state, source, keys, schema, ahead, cuts),
        txn=txn,
        info=info,
        ahead=ahead,
    )


def append(
    target: Table,
    data: pa.Table,
    schema: pa.Schema,
    *,
    txn: tuple[str, int],
    info: Mapping[str, Any],
) -> Written | None:
    """Append ``data`` (rows of keys no file holds, columns aligned to ``schema``, the
    table's) as one new file (none when it is empty) in one commit carrying ``txn``, as
    ``write_deltalake`` would without reading the table's log again. None: ``txn`` is
    committed already."""

    def batch(state: LogState) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
        metrics = {"num_target_rows_inserted": data.num_rows, "appended": True}
        if data.num_rows == 0:  # deletes of keys never held: the transaction alone
            return [], [], metrics
        add = write_file(target.storage, data.select(schema.names).cast(schema))
        return [{"add": add}], [add["path"]], metrics

    return _commit_batch(target, "WRITE", batch, txn=txn, info=info)


def _commit_batch(
    target: Table,
    operation: str,
    batch: Callable[[LogState], tuple[list[dict[str, Any]], list[str], dict[str, Any]]],
    *,
    txn: tuple[str, int],
    info: Mapping[str, Any],
    ahead: Ahead | None = None,
) -> Written | None:
    """Commit the file actions ``batch`` makes from the table's newest state (and the
    files it wrote for them, and its metrics) with ``txn``; starts over when another writer
    commits first. None: ``txn`` is committed already (the files written ``ahead`` are
    then deleted: a replay's, never referenced)."""
    for attempt in range(COMMIT_ATTEMPTS):
        with target.lock:
            state = target.log.state()
            if state.txns.get(txn[0], -1) >= txn[1]:
                if ahead is not None:
                    target.storage.delete_many(ahead.paths)
                return None
            actions, written, metrics = batch(state)
            crash_point("apply_deletion_vectors", txn[1])
            actions = [
                commit_info(operation, state.version, operationMetrics=_shown(metrics), **info),
                {"txn": {"appId": txn[0], "version": txn[1], "lastUpdated": _now_ms()}},
                *actions,
            ]
            version = state.version + 1  # the commit advances ``state`` itself
            try:
                target.log.commit(version, actions)
            except CommitConflictError:
                logger.info(
                    "%s: version %d taken by another writer; the batch starts over (%d)",
                    target.root, version, attempt + 1,
                )  # fmt: skip
                target.storage.delete_many(written)  # never referenced
                continue
            _delete_unused(target, ahead, actions)
            return Written(version, metrics | {"merge_on_read": True})
    raise CommitConflictError(
        f"{target.root}: lost the commit race {COMMIT_ATTEMPTS} times in a row"
    )


def _shown(metrics: Mapping[str, Any]) -> dict[str, str]:
    """A batch's metrics as a commit's ``operationMetrics`` (Delta's names: camel case,
    strings), where ``DESCRIBE HISTORY`` shows them."""
    shown = {}
    for name, value in metrics.items():
        if isinstance(value, bool):
            continue
        head, *rest = name.split("_")
        shown[head + "".join(word.title() for word in rest)] = str(value)
    return shown


def _delete_unused(
    target: Table, ahead: Ahead | None, actions: Sequence[Mapping[str, Any]]
) -> None:
    """Delete the files written ahead that the commit ``actions`` did not add (every row
    of theirs was deleted): no commit names them."""
    if ahead is None:
        return
    added = {a["add"]["path"] for a in actions if "add" in a}
    target.storage.delete_many([path for path in ahead.paths if path not in added])


def _now_ms() -> int:
    return int(time.time() * 1000)


def _batch_actions(  # noqa: PLR0917 - one batch's parts
    target: Table,
    state: LogState,
    source: pa.Table,
    keys: Sequence[str],
    schema: pa.Schema,
    ahead: Ahead | None = None,
    cuts: Cuts | None = None,
) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """The file actions of one scd1 batch and the files written for them; the rows the
    batch's truncates remove (``cuts``) marked deleted with the rest."""
    found = locate(target, state, source, keys)
    shard = source.column(SHARD).to_numpy().astype(np.int64)
    sequence = source.column(SEQUENCE).to_numpy().astype(np.int64)
    # a change at or before its row's position is an old one (a replay): dropped
    newer = (shard[found.change] > found.shard) | (
        (shard[found.change] == found.shard) & (sequence[found.change] > found.sequence)
    )
    stale = np.zeros(source.num_rows, dtype=bool)
    stale[found.change[~newer]] = True
    replace = ~stale[found.change]
    deletions: dict[str, list[np.ndarray]] = {}
    for index, path in enumerate(found.files):
        rows = found.row[(found.file == index) & replace]
        if len(rows):
            deletions.setdefault(path, []).append(rows)
    truncated = _truncated_rows(target, state, cuts or {}, keys)
    for path, rows in truncated.items():
        deletions.setdefault(path, []).append(rows)
    ahead_metrics: dict[str, int] = {}
    ahead_adds: dict[str, dict[str, Any]] = {}
    if ahead is not None:
        held, own, ahead_metrics = _ahead_deletions(target, state, ahead, keys)
        for path, rows in [*held.items(), *own.items()]:
            deletions.setdefault(path, []).append(rows)
        ahead_adds = {str(a["path"]): dict(a) for a in ahead.adds}
    deletes = pc.fill_null(pc.equal(source.column(OPERATION), DELETE), False).to_numpy(
        zero_copy_only=False
    )
    inserted = source.filter(pa.array(~stale & ~deletes)).drop_columns([OPERATION])
    written: list[str] = []
    actions: list[dict[str, Any]] = []
    if inserted.num_rows:
        add = write_file(target.storage, inserted.select(schema.names).cast(schema))
        written.append(add["path"])
        actions.append({"add": add})
    marked, dv_file = _dv_actions(
        target,
        state,
        {path: np.concatenate(rows) for path, rows in deletions.items()},
        ahead=ahead_adds,
    )
    if dv_file is not None:
        written.append(dv_file)
    actions.extend(marked)
    actions.extend({"add": a} for path, a in ahead_adds.items() if path not in deletions)
    metrics = {
        "num_source_rows": source.num_rows,
        "num_target_rows_inserted": int(inserted.num_rows),
        "num_target_rows_deleted": int(replace.sum()),
        "num_stale_changes": int(stale.sum()),
        "num_target_rows_truncated": sum(len(rows) for rows in truncated.values()),
        "num_target_files_scanned": len(found.files),
        "num_deletion_vectors_written": sum(1 for a in marked if "add" in a),
        **ahead_metrics,
    }
    return actions, written, metrics


def _truncated_rows(
    target: Table, state: LogState, cuts: Cuts, keys: Sequence[str]
) -> dict[str, np.ndarray]:
    """Per live file, its live rows that a truncate of ``cuts`` removes (of its shard, at
    a position before it); files whose position statistics rule them out are not read."""
    found: dict[str, np.ndarray] = {}
    if not cuts:
        return found
    for path, add in state.files.items():
        stats = json.loads(add["stats"]) if add.get("stats") else {}
        low, high = stats.get("minValues") or {}, stats.get("maxValues") or {}
        if all(key in low and key in high for key in POSITION) and not any(
            low[SHARD] <= shard <= high[SHARD] and low[SEQUENCE] < cut.last
            for shard, cut in cuts.items()
        ):
            continue
        positions = _file_keys(target, path, keys).rows
        shard = positions.column(SHARD).to_numpy(zero_copy_only=False)
        sequence = positions.column(SEQUENCE).to_numpy(zero_copy_only=False)
        void = np.zeros(positions.num_rows, dtype=bool)
        for number, cut in cuts.items():
            void |= (shard == number) & (sequence < cut.last)
        deleted = target.deleted_rows(add)
        rows = np.flatnonzero(void)
        if deleted is not None and len(deleted):
            rows = rows[~np.isin(rows, np.fromiter(deleted, np.int64, len(deleted)))]
        if len(rows):
            found[path] = rows.astype(np.int64)
    return found


def create(
    target: Table,
    data: pa.Table,
    *,
    txn: tuple[str, int],
    info: Mapping[str, Any],
    configuration: Mapping[str, str] | None = None,
    ahead: Ahead | None = None,
    keys: Sequence[str] = (),
) -> int:
    """Create the table holding ``data`` (and the rows written ``ahead``, keyed by
    ``keys``, whose files hold ``data``'s columns and types) in commit 0 carrying ``txn``:
    protocol reader 3 / writer 7 with the one feature ``deletionVectors``, which any
    reader that cannot apply deletion vectors refuses.

    Raises:
        CommitConflictError: another writer created the table first.
    """
    import deltalake  # noqa: PLC0415 - the optional extra, loaded by the caller already

    schema = data.schema
    features = [DELETION_VECTORS]
    if any(pa.types.is_timestamp(f.type) and f.type.tz is None for f in schema):
        features.append("timestampNtz")  # PROTOCOL.md: a timestamp without time zone needs it
    files: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"num_output_rows": data.num_rows}
    if ahead is not None:  # a key written twice: its older rows deleted by a DV
        empty = LogState(-1)
        _, own, shown = _ahead_deletions(target, empty, ahead, keys)
        metrics.update(shown)
        metrics["num_output_rows"] += shown["num_rows_written_ahead"]
        adds = {str(a["path"]): dict(a) for a in ahead.adds}
        files, _ = _dv_actions(target, empty, own, ahead=adds)
        files.extend({"add": a} for path, a in adds.items() if path not in own)
    if data.num_rows or not files:
        files.append({"add": write_file(target.storage, data)})
    actions = [
        commit_info("CREATE TABLE", -1, operationMetrics=_shown(metrics), **info),
        {
            "protocol": {
                "minReaderVersion": 3,
                "minWriterVersion": 7,
                "readerFeatures": features,
                "writerFeatures": features,
            }
        },
        {
            "metaData": {
                "id": str(uuid.uuid4()),
                "format": {"provider": "parquet", "options": {}},
                "schemaString": deltalake.Schema.from_arrow(schema).to_json(),
                "partitionColumns": [],
                "configuration": {ENABLE_DELETION_VECTORS: "true", **(configuration or {})},
                "createdTime": _now_ms(),
            }
        },
        {"txn": {"appId": txn[0], "version": txn[1], "lastUpdated": _now_ms()}},
        *files,
    ]
    target.log.commit(0, actions)
    _delete_unused(target, ahead, actions)
    return 0


# -- folding deletion vectors back ----------------------------------------------------------


@dataclass(frozen=True)
class Purged:
    """What a purge did: the files it read and wrote, the rows it dropped."""

    version: int | None
    files_removed: int
    files_added: int
    rows_dropped: int


@dataclass(frozen=True)
class _Folded:
    """Where a purged file's live rows went: output file ``output``, from row ``start``
    on, its row ``r`` at ``start + kept[r] - 1`` (``kept``: the running count of rows
    kept)."""

    path: str
    add: dict[str, Any]
    deleted: BitMap64
    output: int
    start: int
    kept: np.ndarray


def purge(
    target: Table,
    *,
    min_deleted: float = 0.05,
    small_file: int = 8 << 20,
    target_size: int = 32 << 20,
) -> Purged:
    """Rewrite the files whose deletion vectors delete at least ``min_deleted`` of their
    rows, and the files under ``small_file`` bytes, into files of about ``target_size``
    bytes holding their live rows; one commit of ``dataChange: false`` actions.

    Runs beside a writer: what it read is a state; rows deleted in its files since are
    carried into the new files' deletion vectors at commit time (so a running apply
    loses nothing and the purge does not starve). A file removed meanwhile (another
    compaction) makes it give up this round, deleting what it wrote.
    """
    with target.lock:
        state = target.log.state().copy()
    chosen = _to_purge(target, state, min_deleted=min_deleted, small_file=small_file)
    if len(chosen) < 2 and not any(len(d) for _, _, d in chosen):
        return Purged(None, 0, 0, 0)
    schema = table_schema(state)
    folded: list[_Folded] = []
    written: list[dict[str, Any]] = []
    output: list[pa.Table] = []  # the rows of the next file: one file's held at a time
    size = 0
    try:
        for path, add, deleted in chosen:
            data = read_all(target, path, schema)
            keep = dvs.keep_mask(deleted, data.num_rows)
            live = data.filter(pa.array(keep))
            if size >= target_size:
                written.append(write_file(target.storage, pa.concat_tables(output)))
                output, size = [], 0
            start = sum(t.num_rows for t in output)
            output.append(live)
            size += int(add["size"]) * live.num_rows // max(1, data.num_rows)
            folded.append(_Folded(path, add, deleted, len(written), start, np.cumsum(keep)))
        written.append(write_file(target.storage, pa.concat_tables(output)))
    except BaseException:
        target.storage.delete_many([a["path"] for a in written])  # in no commit
        raise
    names = [a["path"] for a in written]
    rows_dropped = sum(len(f.deleted) for f in folded)
    with target.lock:
        for _ in range(COMMIT_ATTEMPTS):
            newest = target.log.state()
            if any(f.path not in newest.files and newest.version > state.version
                   and not _fully_deleted(newest, f) for f in folded):  # fmt: skip
                break
            actions = _purge_actions(target, newest, folded, written)
            version = newest.version + 1  # the commit advances ``newest`` itself
            try:
                target.log.commit(version, actions)
            except CommitConflictError:  # the attempt's DV file: in no commit
                target.storage.delete_many(_deletion_vector_files(actions))
                continue
            return Purged(version, len(folded), len(written), rows_dropped)
    logger.info("%s: purge gave up: a file it rewrote was removed by another writer", target.root)
    target.storage.delete_many(names)
    return Purged(None, 0, 0, 0)


def _to_purge(
    target: Table, state: LogState, *, min_deleted: float = 0.05, small_file: int = 8 << 20
) -> list[tuple[str, dict[str, Any], BitMap64]]:
    """The files a purge rewrites: those whose DV deletes ``min_deleted`` of their rows
    or more, and those under ``small_file`` bytes."""
    chosen = []
    for path, add in state.files.items():
        deleted = target.deleted_rows(add) or BitMap64()
        total = num_records(add) or 0
        if (total and len(deleted) / total >= min_deleted) or int(add["size"]) < small_file:
            chosen.append((path, add, deleted))
    return chosen


PURGE_FILES = int(os.environ.get("REPLOG_PURGE_FILES", "16"))
"""How many files with deletion vectors or under 8 MiB a table gathers before
:func:`purge_later` folds them (each batch adds one file and marks rows in others)."""


def purge_later(target: Table, *, files: int = PURGE_FILES) -> threading.Thread | None:
    """Start :func:`purge` in a thread of its own when ``files`` files of ``target`` have
    deletion vectors or are small, unless one runs already: reads stay fast while the
    writer goes on (a failure is logged, and the next batch starts another)."""
    with target.lock:
        if target.purging is not None and target.purging.is_alive():
            return None
        if len(_to_purge(target, target.log.state())) < files:
            return None

        def run() -> None:
            try:
                done = purge(target)
                logger.info("%s: purged %s", target.root, done)
            except Exception:
                logger.exception("%s: a background purge failed; the next one retries", target.root)

        target.purging = threading.Thread(target=run, name=f"replog-purge {target.root}")
        target.purging.start()
        return target.purging


def _fully_deleted(newest: LogState, folded: _Folded) -> bool:
    """Whether a file gone from ``newest`` went by a batch that deleted its every row
    (a ``remove`` without its ``add``), not by another compaction."""
    return folded.path in newest.removed


def _purge_actions(
    target: Table, newest: LogState, folded: Sequence[_Folded], written: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The purge's commit after ``newest``: its files removed as they are now, the new
    files added, each with a DV of the rows deleted since the purge read them."""
    later: list[list[int]] = [[] for _ in written]
    removes = []
    now = _now_ms()
    for f in folded:
        current = newest.files.get(f.path)
        if current is None:  # all its rows deleted since: all it gave is deleted
            gone = np.flatnonzero(np.diff(np.concatenate([[0], f.kept])) > 0)
        else:
            removes.append({"remove": _remove(current, now, False)})
            deleted = target.deleted_rows(current) or BitMap64()
            gone = np.array(sorted(deleted - f.deleted), dtype=np.int64)
        if len(gone):
            later[f.output].extend((f.start + f.kept[gone] - 1).tolist())
    adds = []
    bitmaps, carrying = [], []
    for index, add in enumerate(written):
        entry = {**add, "dataChange": False}
        if later[index]:
            bitmaps.append(BitMap64(later[index]))
            carrying.append(entry)
        adds.append(entry)
    if bitmaps:
        name = uuid.uuid4()
        content, descriptors = dvs.pack(bitmaps, name)
        target.storage.put_if_absent(dvs.file_name(name), content)
        for entry, descriptor in zip(carrying, descriptors, strict=True):
            stats = json.loads(entry["stats"])
            stats["tightBounds"] = False
            entry["stats"] = json.dumps(stats, separators=(",", ":"))
            entry["deletionVector"] = descriptor.to_json()
    info = commit_info("OPTIMIZE", newest.version, operationParameters={"purge": "true"})
    return [info, *removes, *({"add": a} for a in adds)]


def _deletion_vector_files(actions: Sequence[Mapping[str, Any]]) -> list[str]:
    """The DV files the ``add`` actions of ``actions`` name."""
    found = {deletion_vector(a["add"]) for a in actions if "add" in a}
    return sorted(d.relative_file() for d in found if d is not None and d.storage_type == "u")


def table_schema(state: LogState) -> pa.Schema:
    import deltalake  # noqa: PLC0415 - the optional extra, loaded by the caller already

    return pa.schema(deltalake.Schema.from_json(state.metadata["schemaString"]).to_arrow())


def read_all(target: Table, path: str, schema: pa.Schema) -> pa.Table:
    """A file's rows in the table's schema (columns added since it was written: null)."""
    with target.storage.fs.open(target.storage.path(path), "rb") as handle:
        data = pq.read_table(handle)
    columns = [
        data.column(f.name).cast(f.type) if f.name in data.column_names
        else pa.nulls(data.num_rows, f.type)
        for f in schema
    ]  # fmt: skip
    return pa.table(columns, schema=schema)
