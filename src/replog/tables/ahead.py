"""A batch's new rows written by Spark's executors, ahead of the driver's commit.

A snapshot's millions of inserts need no merge: their keys are new. Rather than collect
them to the driver, each executor task writes the rows of its partition that can need no
merge (whole row images of keys no file of the table may hold: :func:`write_ahead`) as a
Parquet file in the table's folder, and hands the driver the file's ``add`` action and,
row by row, its keys and positions (:class:`Prewritten`). The driver commits the files with
the rest of the batch in one Delta commit carrying the batch's application transaction
(:mod:`replog.tables.merge_on_read`). Until then no commit names them: a crash leaves
them unreferenced (the replayed batch writes new ones; ``VACUUM`` deletes these).

The driver checks every row it did not see: of a key written twice (in two tasks) or a key
the table holds, the newer position lives and the other row is marked deleted by a
deletion vector; the rows of a key that has other changes in the batch are taken back into
the driver's changes (:func:`take_back`), which apply them as usual (a change that did not
send a value is filled from them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from replog.errors import SchemaChangeError
from replog.storage import Storage
from replog.tables import changes as rows
from replog.tables import merge_on_read
from replog.tables.changes import DELETE, OLD_KEY, OPERATION, POSITION, TIMESTAMP, UNSENT

MIN_ROWS = 20_000
"""The fewest rows a task writes ahead as a file of a table: fewer go to the driver (a
follower's micro-batches of a few hundred changes would leave a small file per task)."""


@dataclass(frozen=True)
class Plan:
    """How a task may write one table's rows ahead: the table's local folder, the file's
    columns and types (the table's; None: a table the batch creates, whose columns are
    the rows' and its types as Delta reads them back), the key columns, and the ranges of
    the first key column (``held``: :func:`merged_ranges` of the files of the table and of
    its tombstones) inside which a key may be held already (None: any key may be)."""

    root: str
    schema: pa.Schema | None
    keys: tuple[str, ...]
    held: tuple[list[Any], list[Any]] | None
    min_rows: int = MIN_ROWS


@dataclass(frozen=True)
class Prewritten:
    """A file written ahead: its ``add`` action, and its rows' keys and positions (the
    key columns, ``__shard``, ``__sequence``), in the file's order."""

    add: dict[str, Any]
    keys: pa.Table

    def to_bytes(self) -> bytes:
        """The form a task hands to the driver (Spark carries it as a binary value)."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self.keys.schema) as stream:
            stream.write_table(self.keys)
        head = json.dumps(self.add, separators=(",", ":")).encode()
        body: bytes = sink.getvalue().to_pybytes()
        return len(head).to_bytes(4, "big") + head + body

    @classmethod
    def from_bytes(cls, data: bytes) -> Prewritten:
        size = int.from_bytes(data[:4], "big")
        add = json.loads(data[4 : 4 + size])
        with pa.ipc.open_stream(pa.py_buffer(data[4 + size :])) as stream:
            return cls(add, stream.read_all())


def plain(changes: pa.Table, keys: Sequence[str]) -> np.ndarray:
    """Which changes are a whole row image (what a file written ahead may hold): not a
    delete, every column sent (no placeholder, nothing named in ``__unavailable``), not
    the create of a changed key (``__old_key``)."""
    deletes = pc.fill_null(pc.equal(changes.column(OPERATION), DELETE), False)
    whole: np.ndarray = ~np.asarray(deletes.to_numpy(zero_copy_only=False), dtype=bool)
    if UNSENT in changes.column_names:
        named = pc.fill_null(pc.list_value_length(changes.column(UNSENT)), 0)
        whole &= pc.equal(named, 0).to_numpy(zero_copy_only=False)
    if OLD_KEY in changes.column_names:
        whole &= pc.is_null(changes.column(OLD_KEY)).to_numpy(zero_copy_only=False)
    texts = changes.drop_columns([UNSENT]) if UNSENT in changes.column_names else changes
    for marked in rows.placeholders(texts, keys).values():  # Debezium's placeholder text
        whole &= ~marked
    return whole


def merged_ranges(lows: Sequence[Any], highs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Ranges ``[low, high]`` joined where they overlap, in order: what :func:`outside`
    looks values up in."""
    merged: list[list[Any]] = []
    for low, high in sorted(zip(lows, highs, strict=True)):
        if merged and low <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return [m[0] for m in merged], [m[1] for m in merged]


def outside(values: pa.ChunkedArray, held: tuple[list[Any], list[Any]] | None) -> np.ndarray:
    """Which ``values`` (of the first key column; nulls: inside) lie outside every range
    of ``held`` (:func:`merged_ranges`). Beside an empty ``held``, integers and texts
    only: other types count as inside."""
    if held is None:
        return np.zeros(len(values), dtype=bool)
    lows, highs = held
    if not lows:
        return np.asarray(pc.is_valid(values).to_numpy(zero_copy_only=False), dtype=bool)
    kind = values.type
    text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    if not (pa.types.is_integer(kind) or text):
        return np.zeros(len(values), dtype=bool)  # compared as integers and texts only
    found = np.asarray(values.to_numpy(zero_copy_only=False))
    kind = object if found.dtype == object else None
    starts, ends = np.asarray(lows, dtype=kind), np.asarray(highs, dtype=kind)
    valid = pc.is_valid(values).to_numpy(zero_copy_only=False)
    result = np.zeros(len(found), dtype=bool)
    if not valid.any():
        return result
    probe = found[valid]
    index = np.searchsorted(starts, probe, side="right") - 1
    inside = (index >= 0) & (probe <= ends[np.maximum(index, 0)])
    result[np.flatnonzero(valid)] = ~inside
    return result


def write_ahead(changes: pa.Table, plan: Plan) -> tuple[pa.Table, Prewritten | None]:
    """One task's changes of a table split: its whole row images of keys outside
    ``plan.held``, the newest per key (a later whole image holds all an earlier one did),
    written as one Parquet file in the table's folder when there are ``plan.min_rows`` of
    them; and the changes left for the driver (all of them when no file is written)."""
    keys = plan.keys
    if plan.held is not None and any(k not in changes.column_names for k in keys):
        return changes, None
    chosen = plain(changes, keys) & outside(changes.column(keys[0]), plan.held)
    if chosen.sum() < plan.min_rows:
        return changes, None
    every = bool(chosen.all())
    newest = changes if every else changes.filter(pa.array(chosen))
    if not rows.keys_distinct(newest, keys):
        newest = rows.latest_per_key(newest, keys)
    data = rows.storable(newest)
    bookkeeping = {OPERATION, TIMESTAMP, UNSENT, OLD_KEY, rows.COLLECTION, rows.SOURCE_POSITION}
    data = data.select([c for c in data.column_names if c not in bookkeeping])
    if plan.schema is None:  # as the driver creates a table: nullable, Delta's types
        nullable = pa.schema([f.with_nullable(True) for f in data.schema])
        data = merge_on_read.delta_types(data.cast(nullable))
    elif any(name not in plan.schema.names for name in data.column_names):
        return changes, None  # a column the table lacks: the driver adds it first
    else:
        try:
            data = rows.align(data, plan.schema).select(plan.schema.names).cast(plan.schema)
        except (SchemaChangeError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return changes, None  # the driver's merge says what does not fit
    add = merge_on_read.write_file(Storage(plan.root), data)
    left = changes.slice(0, 0) if every else changes.filter(pa.array(~chosen))
    return left, Prewritten(add, data.select([*keys, *POSITION]))


def gathered(written: Sequence[Prewritten]) -> merge_on_read.Ahead:
    """The files of a batch written ahead, as the commit takes them (nothing taken)."""
    parts = []
    for index, one in enumerate(written):
        count = one.keys.num_rows
        parts.append(
            one.keys.append_column(
                merge_on_read.FILE, pa.array(np.full(count, index, dtype=np.int64))
            ).append_column(merge_on_read.ROW, pa.array(np.arange(count, dtype=np.int64)))
        )
    table = pa.concat_tables(parts, promote_options="permissive")
    return merge_on_read.Ahead([w.add for w in written], table, np.zeros(table.num_rows, bool))


def schema_of(root: str, ahead: merge_on_read.Ahead) -> pa.Schema:
    """The columns and types of the files written ahead (one plan wrote them all)."""
    storage = Storage(root)
    with storage.fs.open(storage.path(ahead.paths[0]), "rb") as handle:
        return pq.read_schema(handle)


def take_back(
    root: str,
    ahead: merge_on_read.Ahead,
    changes: pa.Table,
    keys: Sequence[str],
    also: np.ndarray | None = None,
) -> tuple[pa.Table, merge_on_read.Ahead]:
    """The rows written ahead of the keys ``changes`` holds (and those ``also`` marks),
    read back into the changes (as inserts: whole row images) and marked taken."""
    wanted = _keys_in(ahead.rows, changes, keys) & ~ahead.taken
    if also is not None:
        wanted |= also & ~ahead.taken
    if not wanted.any():
        return changes, ahead
    target = merge_on_read.table(root)
    files = ahead.rows.column(merge_on_read.FILE).to_numpy()
    within = ahead.rows.column(merge_on_read.ROW).to_numpy()
    schema = schema_of(root, ahead)
    parts = []
    for index in np.unique(files[wanted]):
        picked = np.sort(within[wanted & (files == index)])
        parts.append(target.read_rows(ahead.paths[int(index)], picked, schema.names))
    back = pa.concat_tables(parts)
    back = _as_changes(back, changes)
    merged = pa.concat_tables([changes, back], promote_options="permissive")
    return merged, merge_on_read.Ahead(ahead.adds, ahead.rows, ahead.taken | wanted)


def _keys_in(found: pa.Table, changes: pa.Table, keys: Sequence[str]) -> np.ndarray:
    """Which rows of ``found`` have a key among ``changes``'."""
    if changes.num_rows == 0 or found.num_rows == 0:
        return np.zeros(found.num_rows, dtype=bool)
    probe = rows.keys_as(changes.select(list(keys)), found, keys)
    numbered = found.select(list(keys)).append_column(
        "__found", pa.array(np.arange(found.num_rows, dtype=np.int64))
    )
    joined = numbered.join(_distinct(probe, keys), list(keys), join_type="inner", use_threads=False)
    marked = np.zeros(found.num_rows, dtype=bool)
    marked[joined.column("__found").to_numpy()] = True
    return marked


def _distinct(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``table``'s distinct keys."""
    return table.group_by(list(keys), use_threads=False).aggregate([])


def _as_changes(back: pa.Table, like: pa.Table) -> pa.Table:
    """Rows read back from a file as changes with ``like``'s bookkeeping columns: inserts
    (whole row images) at their stored positions."""
    count = back.num_rows
    back = back.append_column(OPERATION, pa.array(["insert"] * count, pa.string()))
    if TIMESTAMP in like.column_names:
        back = back.append_column(TIMESTAMP, pa.nulls(count, like.schema.field(TIMESTAMP).type))
    if UNSENT in like.column_names:
        back = back.append_column(UNSENT, pa.nulls(count, like.schema.field(UNSENT).type))
    if OLD_KEY in like.column_names:
        back = back.append_column(OLD_KEY, pa.nulls(count, like.schema.field(OLD_KEY).type))
    return back  # types as the table's: the batch's concatenation widens them
