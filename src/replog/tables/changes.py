"""A batch of changes as rows of a keyed table: pure Arrow, no I/O.

A batch of changes is an Arrow table with the row's columns (``data``'s fields, the key
columns among them) and four bookkeeping columns: :data:`SHARD` and :data:`SEQUENCE`
(the event's position in the log), :data:`OPERATION` and :data:`TIMESTAMP`.

The position rule: a key's events always share one shard, so ``(shard, sequence)``
orders them; positions compare lexicographically (:func:`newer_sql`), which orders any
two positions the same way everywhere (in a batch and against the table).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replog.errors import InvalidOptionError, SchemaChangeError
from replog.format.events import TRUNCATE

SHARD = "__shard"
SEQUENCE = "__sequence"
OPERATION = "__operation"
TIMESTAMP = "__timestamp"
VALID_FROM = "__valid_from"
VALID_TO = "__valid_to"
CURRENT = "__current"
ACTION = "__action"
"""SCD2 merge source only: ``close`` (ends the table's current version) or ``insert``."""
SOURCE_POSITION = "__source_position"
"""Optional bookkeeping column: each change's source position (its transaction's commit
LSN as a number: :func:`replog.tables.coverage.event_positions`; null: none known)."""
VALID_FROM_POSITION = "__valid_from_position"
VALID_TO_POSITION = "__valid_to_position"
"""SCD2: the source positions of the transactions that opened and closed a version, beside
``__valid_from`` and ``__valid_to`` (a time alone does not order two transactions of one
millisecond; the position does, and a reader can cut the history at any position)."""

CHANGE_COLUMNS = (SHARD, SEQUENCE, OPERATION, TIMESTAMP)
"""The bookkeeping columns every batch of changes carries."""
POSITION = (SHARD, SEQUENCE)
MODES = ("scd1", "scd2")
DELETE = "delete"

_ROW_INDEX = "__row"


def check_keys(keys: Sequence[str] | str) -> tuple[str, ...]:
    """The key columns as a tuple; a bad ``keys`` argument names itself."""
    if isinstance(keys, str):
        keys = (keys,)
    found = tuple(keys)
    if not found or not all(isinstance(k, str) and k for k in found):
        raise InvalidOptionError(
            f"apply_changes: keys must name the table's key column(s), got {keys!r}"
        )
    reserved = [k for k in found if k.startswith("__")]
    if reserved:
        raise InvalidOptionError(f"apply_changes: keys {reserved} use the reserved prefix '__'")
    if len(set(found)) != len(found):
        raise InvalidOptionError(f"apply_changes: keys {list(found)} repeat a column")
    return found


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise InvalidOptionError(f"apply_changes: mode {mode!r} is not one of {list(MODES)}")
    return mode


def check_columns(columns: Sequence[str], keys: Sequence[str]) -> None:
    """The row's columns hold every key and none of the reserved names."""
    missing = [k for k in keys if k not in columns]
    if missing:
        raise InvalidOptionError(
            f"apply_changes: keys {missing} are not columns of the changes' rows "
            f"(columns: {[c for c in columns if c not in CHANGE_COLUMNS]})"
        )
    bookkeeping = (*CHANGE_COLUMNS, UNSENT, COLLECTION, OLD_KEY, SOURCE_POSITION)
    clashing = [c for c in columns if c.startswith("__") and c not in bookkeeping]
    if clashing:
        raise InvalidOptionError(
            f"apply_changes: row columns {clashing} use the prefix '__' that replog reserves "
            f"for its bookkeeping columns"
        )


COLLECTION = "__collection"
"""Optional bookkeeping column: each change's collection. A table mirrors one collection:
changes of several in one batch (equal keys of different tables) are refused."""


def check_one_collection(changes: pa.Table) -> None:
    """Refuse changes of more than one collection (:data:`COLLECTION`, where given)."""
    if COLLECTION not in changes.column_names:
        return
    found = pc.unique(changes.column(COLLECTION)).to_pylist()
    if len(found) > 1:
        shown = sorted(found, key=lambda name: (name is not None, name or ""))
        raise InvalidOptionError(
            f"apply_changes: the changes hold events of collections {shown[:5]}"
            f"{' ...' if len(shown) > 5 else ''}; a table mirrors one collection (equal keys "
            f"of different collections would be merged): give collection= (nothing was written)"
        )


def check_changes(changes: pa.Table, keys: Sequence[str]) -> None:
    """A batch of changes has its bookkeeping columns, its keys, and no null key."""
    absent = [c for c in CHANGE_COLUMNS if c not in changes.column_names]
    if absent:
        raise InvalidOptionError(f"apply_changes: the changes lack the columns {absent}")
    check_columns(changes.column_names, keys)
    for key in keys:
        if changes.column(key).null_count:
            raise InvalidOptionError(
                f"apply_changes: key column {key!r} is null in {changes.column(key).null_count} "
                f"change(s): every change must carry its key in its row"
            )


def _storable_type(kind: pa.DataType) -> pa.DataType:
    """``kind`` as a Delta table can hold it: Delta has no duration or time-of-day type,
    so those become ``bigint`` counts of their own unit (Debezium's own ``MicroDuration``
    and ``MicroTime``); a timestamp with a zone is in UTC (Spark hands its tasks the
    session's zone, ``Etc/UTC``, which delta-rs refuses); nested types are mapped member
    by member."""
    if pa.types.is_duration(kind) or pa.types.is_time(kind):
        return pa.int64()
    if pa.types.is_timestamp(kind) and kind.tz is not None and kind.tz != "UTC":
        return pa.timestamp(kind.unit, tz="UTC")  # the same instants; Delta names no other zone
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(_storable_type(f.type)) for f in kind])
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        item = kind.value_field.with_type(_storable_type(kind.value_type))
        return pa.list_(item) if pa.types.is_list(kind) else pa.large_list(item)
    if pa.types.is_map(kind):
        return pa.map_(kind.key_type, _storable_type(kind.item_type))
    return kind


def storable(changes: pa.Table) -> pa.Table:
    """``changes`` with each column of a type Delta cannot hold (durations, times of
    day, as Spark's ``interval day to second`` arrives) cast to one it can."""
    schema = pa.schema([f.with_type(_storable_type(f.type)) for f in changes.schema])
    return changes if schema.equals(changes.schema) else changes.cast(schema)


def last_per_key(table: pa.Table, keys: Sequence[str]) -> np.ndarray:
    """Indices (ascending) of the last row of each key among ``table``'s rows, in the
    order they come in (a null key value is a key like any other)."""
    if table.num_rows == 0:
        return np.zeros(0, dtype=np.int64)
    indexed = table.select(list(keys)).append_column(
        _ROW_INDEX, pa.array(np.arange(table.num_rows, dtype=np.int64))
    )
    last = indexed.group_by(list(keys), use_threads=False).aggregate([(_ROW_INDEX, "max")])
    return np.sort(last.column(f"{_ROW_INDEX}_max").to_numpy())


def keys_distinct(table: pa.Table, keys: Sequence[str]) -> bool:
    """Whether no two rows of ``table`` share a key (a quick test before a reduction: a
    snapshot's rows have a key each)."""
    if table.num_rows < 2:
        return True
    if len(keys) == 1 and pa.types.is_integer(table.schema.field(keys[0]).type):
        column = table.column(keys[0])
        if column.null_count == 0:
            values = np.sort(column.to_numpy())
            return bool((values[1:] != values[:-1]).all())
    groups = table.select(list(keys)).group_by(list(keys), use_threads=False).aggregate([])
    return bool(groups.num_rows == table.num_rows)


def latest_per_key(
    changes: pa.Table, keys: Sequence[str], position: Sequence[str] = POSITION
) -> pa.Table:
    """The last change per key in log order (deletes included: they remove the row)."""
    if changes.num_rows == 0:
        return changes
    ordered = changes.sort_by([(column, "ascending") for column in position])
    return ordered.take(last_per_key(ordered, keys))  # in log order


def newer_sql(source: str = "s", target: str = "t") -> str:
    """The position rule as a merge predicate: the source change is newer than the row."""
    return (
        f"({source}.{SHARD} > {target}.{SHARD} OR ({source}.{SHARD} = {target}.{SHARD} "
        f"AND {source}.{SEQUENCE} > {target}.{SEQUENCE}))"
    )


def after_positions(
    changes: pa.Table, positions: pa.Table, keys: Sequence[str], *, inclusive: bool = False
) -> pa.Table:
    """The changes newer than their key's position in ``positions`` (keys + position,
    one row per key; ``inclusive``: or at it); keys absent from ``positions`` keep all
    their changes."""
    if changes.num_rows == 0 or positions.num_rows == 0:
        return changes
    seen = positions.select([*keys, *POSITION]).rename_columns(
        [*keys, "__seen_shard", "__seen_sequence"]
    )
    # Joined on keys, positions and row numbers only: Acero joins no list, struct or map
    # column (a PostgreSQL array), and the row numbers keep the changes' order.
    numbered = changes.select([*keys, *POSITION]).append_column(
        _ROW_INDEX, pa.array(np.arange(changes.num_rows, dtype=np.int64))
    )
    joined = numbered.join(seen, list(keys), join_type="left outer", use_threads=False)
    shard, sequence = joined.column(SHARD), joined.column(SEQUENCE)
    seen_shard, seen_sequence = joined.column("__seen_shard"), joined.column("__seen_sequence")
    newer = pc.or_kleene(
        pc.is_null(seen_shard),
        pc.or_kleene(
            pc.greater(shard, seen_shard),
            pc.and_kleene(
                pc.equal(shard, seen_shard),
                (pc.greater_equal if inclusive else pc.greater)(sequence, seen_sequence),
            ),
        ),
    )
    kept = joined.filter(newer).column(_ROW_INDEX)
    return changes.take(pc.take(kept, pc.sort_indices(kept)))


@dataclass(frozen=True)
class Cut:
    """The truncates of one shard in a batch: every row of the shard at a position before
    ``last`` (its newest) is gone; the rows the table held before the batch ended at the
    first (``first``, at ``timestamp``: that truncate's time, and ``source``: its source
    position, None when unknown)."""

    first: int
    last: int
    timestamp: Any
    source: int | None = None


Cuts = dict[int, Cut]
"""Per shard, its truncates in a batch (:func:`split_truncates`)."""


def split_truncates(
    changes: pa.Table, keys: Sequence[str] = (), *, history: bool = False
) -> tuple[pa.Table, Cuts]:
    """``changes`` without their truncate events, and per shard its truncates. The
    changes a truncate of their shard later in the batch makes void are dropped; with
    ``history`` (scd2, whose versions are kept) they stay and each truncate becomes a
    delete, at its position, of every key of ``keys`` its shard holds live at that point
    of the batch. A batch without truncates comes back as it is."""
    needed = (OPERATION, SHARD, SEQUENCE)
    if changes.num_rows == 0 or any(c not in changes.column_names for c in needed):
        return changes, {}  # lacking columns: check_changes names them
    truncate = pc.fill_null(pc.equal(changes.column(OPERATION), TRUNCATE), False)
    if not pc.any(truncate).as_py():
        return changes, {}
    events = changes.filter(truncate)
    if TIMESTAMP not in events.column_names:
        events = events.append_column(TIMESTAMP, pa.nulls(events.num_rows, pa.timestamp("us")))
    if SOURCE_POSITION not in events.column_names:
        events = events.append_column(SOURCE_POSITION, pa.nulls(events.num_rows, pa.int64()))
    events = events.select([SHARD, SEQUENCE, TIMESTAMP, SOURCE_POSITION])
    events = events.sort_by([(SEQUENCE, "ascending")])
    cuts: Cuts = {}
    made: list[pa.Table] = []
    rest = changes.filter(pc.invert(truncate))
    for shard, sequence, timestamp, source in zip(
        *(events.column(c).to_pylist() for c in (SHARD, SEQUENCE, TIMESTAMP, SOURCE_POSITION)),
        strict=True,
    ):
        before = cuts.get(shard)
        if history:
            made.append(_truncate_deletes(rest, keys, shard, (sequence, timestamp, source), before))
        if before is None:
            cuts[int(shard)] = Cut(int(sequence), int(sequence), timestamp, source)
        else:
            cuts[int(shard)] = Cut(before.first, int(sequence), before.timestamp, before.source)
    if history:
        return pa.concat_tables([rest, *made]), cuts
    return after_cuts(rest, cuts), cuts


def _truncate_deletes(
    changes: pa.Table,
    keys: Sequence[str],
    shard: int,
    place: tuple[int, Any, int | None],
    before: Cut | None,
) -> pa.Table:
    """A delete, at a truncate's ``place`` (its sequence, time and source position), of
    each key whose newest change on the truncate's shard between the shard's previous
    truncate (``before``) and it is no delete (its last image kept as the delete's row)."""
    sequence, timestamp, source = place
    at = changes.column(SHARD).to_numpy(zero_copy_only=False)
    position = changes.column(SEQUENCE).to_numpy(zero_copy_only=False)
    since = -1 if before is None else before.last
    window = (at == shard) & (position > since) & (position < sequence)
    if not window.any() or any(k not in changes.column_names for k in keys):
        return changes.slice(0, 0)
    held = changes.filter(pa.array(window)).sort_by([(SEQUENCE, "ascending")])
    newest = held.take(last_per_key(held, keys))
    alive = newest.filter(
        pc.invert(pc.fill_null(pc.equal(newest.column(OPERATION), DELETE), False))
    )
    count = alive.num_rows
    values = {
        SHARD: pa.array([shard] * count, changes.schema.field(SHARD).type),
        SEQUENCE: pa.array([sequence] * count, changes.schema.field(SEQUENCE).type),
        OPERATION: pa.array([DELETE] * count, changes.schema.field(OPERATION).type),
        OLD_KEY: pa.nulls(count, pa.string()),
    }
    if TIMESTAMP in changes.column_names:
        values[TIMESTAMP] = pa.array([timestamp] * count, changes.schema.field(TIMESTAMP).type)
    if SOURCE_POSITION in changes.column_names:
        values[SOURCE_POSITION] = pa.array([source] * count, pa.int64())
    for name, column in values.items():
        if name in alive.column_names:
            index = alive.schema.get_field_index(name)
            alive = alive.set_column(index, name, column.cast(alive.schema.field(name).type))
    return alive


def after_cuts(changes: pa.Table, cuts: Cuts) -> pa.Table:
    """The changes no truncate of ``cuts`` voids: of a shard without one, or after it."""
    if not cuts or changes.num_rows == 0:
        return changes
    shard = changes.column(SHARD).to_numpy(zero_copy_only=False)
    sequence = changes.column(SEQUENCE).to_numpy(zero_copy_only=False)
    void = np.zeros(changes.num_rows, dtype=bool)
    for number, cut in cuts.items():
        void |= (shard == number) & (sequence < cut.last)
    return changes.filter(pa.array(~void)) if void.any() else changes


def cut_sql(cuts: Cuts, target: str = "t") -> str:
    """The rows a batch's truncates remove, as a merge condition on the table's rows."""
    return " OR ".join(
        f"({target}.{SHARD} = {shard} AND {target}.{SEQUENCE} < {cut.last})"
        for shard, cut in sorted(cuts.items())
    )


UNAVAILABLE = "__debezium_unavailable_value"
"""Debezium's placeholder for a value the change did not send (PostgreSQL's unchanged
TOASTed column in an update): the column keeps the value it had, never the placeholder."""


def _is_text(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
    )


UNSENT = "__unavailable"
"""Optional bookkeeping column: per change, the names of the columns it did not send
(``metadata.unavailable`` of a captured event), whatever their type; a typed value there
(NULL for a numeric, bytes decoded from the placeholder text) is not the column's. When
given, it is taken as complete: a delete's values count where it does not name them."""


def placeholders(changes: pa.Table, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Per row column (neither key nor bookkeeping) that some change did not send (a text
    holding :data:`UNAVAILABLE`, or named in :data:`UNSENT`): which rows did not."""
    named: dict[str, np.ndarray] = {}
    if UNSENT in changes.column_names:
        lists = changes.column(UNSENT).combine_chunks()
        parents = pc.list_parent_indices(lists).to_numpy()
        flat = pc.list_flatten(lists).to_numpy(zero_copy_only=False)
        for name in set(flat.tolist()):
            marked = np.zeros(changes.num_rows, dtype=bool)
            marked[parents[flat == name]] = True
            named[str(name)] = marked
    found = {}
    for field in changes.schema:
        if field.name in keys or field.name.startswith("__"):
            continue
        marked = named.get(field.name, np.zeros(changes.num_rows, dtype=bool))
        if _is_text(field.type):
            text = pc.fill_null(pc.equal(changes.column(field.name), UNAVAILABLE), False)
            marked = marked | text.to_numpy(zero_copy_only=False)
        if marked.any():
            found[field.name] = marked
    return found


Marks = dict[str, np.ndarray]
"""Per column, which rows of a batch hold no value of their own (:func:`placeholders`)."""


OLD_KEY = "__old_key"
"""Optional bookkeeping column: on the create of a key that an update changed (capture's
``metadata.old_key``), the old key as the event's key text (``{"id":1}``): a column the
create did not send (an unchanged TOASTed value) takes the old key's value."""


def event_marks(metadata: pa.Array) -> tuple[pa.Array, pa.Array]:
    """Per event (its ``metadata`` text), :data:`UNSENT` (the ``unavailable`` columns: a
    list, empty when it names none) and :data:`OLD_KEY` (``old_key``'s text; null), as
    Spark's ``from_json(metadata, "unavailable array<string>, old_key string")`` reads
    them. Only a text naming one of them is parsed: most events name neither, and the
    events of a snapshot chunk or a transaction share one text (give each distinct text
    once). A text that does not begin with a JSON object, or a member of another shape,
    marks nothing; what follows the object is not read. (Spark's parser also takes single
    quotes, and a repeated member's last readable value: no replog writer makes either.)"""
    texts = metadata.cast(pa.string()) if pa.types.is_binary(metadata.type) else metadata
    named = pc.or_(pc.match_substring(texts, 'unavailable"'), pc.match_substring(texts, 'old_key"'))
    unsent: list[list[str | None]] = [[] for _ in range(len(texts))]
    old_keys: list[str | None] = [None] * len(texts)
    for at in np.flatnonzero(pc.fill_null(named, False).to_numpy(zero_copy_only=False)):
        found = _leading_json(texts[at].as_py())
        if not isinstance(found, dict):
            continue
        columns = found.get("unavailable")
        if isinstance(columns, list):
            unsent[at] = [_as_text(c) for c in columns]
        old_keys[at] = _as_text(found.get("old_key"))
    return pa.array(unsent, pa.list_(pa.string())), pa.array(old_keys, pa.string())


def _leading_json(text: str) -> Any:
    """The JSON value ``text`` begins with (None: none, or one nested too deep to read)."""
    try:
        return json.JSONDecoder().raw_decode(text.lstrip())[0]
    except (ValueError, RecursionError):
        return None


def _as_text(value: Any) -> str | None:
    """A JSON value read into a string column, as Spark does: a text as it is (a lone
    surrogate escape, which no UTF-8 text can hold, as ``?``), null as null, any other
    value as its compact JSON."""
    if value is None:
        return None
    text = (
        value
        if isinstance(value, str)
        else json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    )
    return text.encode("utf-8", "replace").decode("utf-8")


def fill_unavailable(changes: pa.Table, keys: Sequence[str]) -> tuple[pa.Table, Marks]:
    """``changes`` with each value not sent (:func:`placeholders`) replaced by the value of
    the same column in the key's previous change of the batch (in log order), and the
    marks of those left. A delete sends no value (its row is an old image, often the key
    only) unless :data:`UNSENT` is given (then it says what each change did not send: the
    Spark layer lists a raw delete's every column, and a delete its reduction made holds
    the key's last values sent), and a key's values start again at an insert: what came
    before it belongs to an earlier life of the key. A row left is filled from elsewhere
    by the caller: from the table's row of its key (:func:`fill_from_rows`) or, where its
    life began with the create of a changed key, from the old key's (:data:`OLD_KEY`,
    which comes back set on every row of that life). The rows come back sorted by key and
    position when any change did not send a column."""
    marks = placeholders(changes, keys)
    if not marks:
        return changes, marks
    order = pc.sort_indices(
        changes,
        sort_keys=[
            *((k, "ascending") for k in keys),
            (SHARD, "ascending"),
            (SEQUENCE, "ascending"),
        ],
    ).to_numpy()
    ordered = changes.take(order)
    index = np.arange(ordered.num_rows, dtype=np.int64)
    same_next = _same_key_as_next(ordered, keys).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[True], ~same_next[:-1]])
    operation = ordered.column(OPERATION)
    starts |= pc.fill_null(pc.equal(operation, "insert"), False).to_numpy(zero_copy_only=False)
    deletes = pc.fill_null(pc.equal(operation, DELETE), False).to_numpy(zero_copy_only=False)
    if UNSENT in ordered.column_names:  # it names what each change did not send, deletes too
        deletes = np.zeros(ordered.num_rows, dtype=bool)
    if OLD_KEY in ordered.column_names:
        old_key = ordered.column(OLD_KEY)
        starts |= pc.is_valid(old_key).to_numpy(zero_copy_only=False)
    group_start = np.maximum.accumulate(np.where(starts, index, 0))
    if OLD_KEY in ordered.column_names:  # each row of a life: the old key it began with
        position = ordered.schema.get_field_index(OLD_KEY)
        ordered = ordered.set_column(position, OLD_KEY, old_key.take(pa.array(group_start)))
    left = {}
    for name, unordered in marks.items():
        marked = unordered[order] | deletes
        # the last row at or before each row that holds a value (not the placeholder)
        last_value = np.maximum.accumulate(np.where(marked, -1, index))
        found = marked & (last_value >= group_start)
        take = np.where(found, last_value, index)
        position = ordered.schema.get_field_index(name)
        ordered = ordered.set_column(position, name, ordered.column(name).take(take))
        if (marked & ~found).any():
            left[name] = marked & ~found
    return ordered, left


def refill(ordered: pa.Table, marks: Marks, keys: Sequence[str]) -> tuple[pa.Table, Marks]:
    """``ordered`` (as :func:`fill_unavailable` leaves it: sorted by key and position,
    :data:`OLD_KEY` on every row of a life) with the values ``marks`` names filled again
    from the rows before them in their life that hold one now: a value filled since (a
    changed key's create, from its old key) reaches the key's later changes, as the delete
    of a key changed again in the batch, whose next create takes it. The marks left."""
    if not marks or ordered.num_rows == 0:
        return ordered, marks
    index = np.arange(ordered.num_rows, dtype=np.int64)
    same_next = _same_key_as_next(ordered, keys).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[True], ~same_next[:-1]])
    operation = ordered.column(OPERATION)
    starts |= pc.fill_null(pc.equal(operation, "insert"), False).to_numpy(zero_copy_only=False)
    if OLD_KEY in ordered.column_names:  # a life's rows share the old key it began with
        old = ordered.column(OLD_KEY).combine_chunks()
        differ = pc.fill_null(pc.not_equal(old.slice(1), old.slice(0, len(old) - 1)), True)
        both_null = pc.and_(pc.is_null(old.slice(1)), pc.is_null(old.slice(0, len(old) - 1)))
        changed = pc.and_not(differ, both_null).to_numpy(zero_copy_only=False)
        starts[1:] |= changed
    deletes = np.zeros(ordered.num_rows, dtype=bool)
    if UNSENT not in ordered.column_names:  # a delete's own image holds no value
        deletes = pc.fill_null(pc.equal(operation, DELETE), False).to_numpy(zero_copy_only=False)
    group_start = np.maximum.accumulate(np.where(starts, index, 0))
    left = {}
    for name, unmarked in marks.items():
        marked = unmarked | deletes
        last_value = np.maximum.accumulate(np.where(marked, -1, index))
        found = unmarked & (last_value >= group_start)
        take = np.where(found, last_value, index)
        position = ordered.schema.get_field_index(name)
        ordered = ordered.set_column(position, name, ordered.column(name).take(take))
        if (unmarked & ~found).any():
            left[name] = unmarked & ~found
    return ordered, left


def keys_as(table: pa.Table, like: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``table`` with its key columns cast to ``like``'s types, to join the two (a
    table's int32 id, an int64 in the changes)."""
    for key in keys:
        position = table.schema.get_field_index(key)
        table = table.set_column(position, key, table.column(key).cast(like.schema.field(key).type))
    return table


def fill_from_rows(
    changes: pa.Table, marks: Marks, stored: pa.Table, keys: Sequence[str]
) -> tuple[pa.Table, np.ndarray]:
    """``changes`` with each value ``marks`` names replaced by the key's value in
    ``stored`` (the table's rows: keys and columns, one row per key), and which rows
    ``stored`` holds a row for; keys or columns ``stored`` lacks keep what the change
    holds."""
    columns = [name for name in marks if name in stored.column_names]
    held = np.zeros(changes.num_rows, dtype=bool)
    if not columns or stored.num_rows == 0:
        return changes, held
    stored = keys_as(stored.select([*keys, *columns]), changes, keys)
    left = changes.select(list(keys)).append_column(
        _ROW_INDEX, pa.array(np.arange(changes.num_rows, dtype=np.int64))
    )
    right = stored.select(list(keys)).append_column(
        "__stored", pa.array(np.arange(stored.num_rows, dtype=np.int64))
    )
    pairs = left.join(right, list(keys), join_type="inner", use_threads=False)
    match = np.full(changes.num_rows, -1, dtype=np.int64)
    match[pairs.column(_ROW_INDEX).to_numpy()] = pairs.column("__stored").to_numpy()
    index = np.arange(changes.num_rows, dtype=np.int64)
    for name in columns:
        have = changes.column(name).combine_chunks()
        values = pa.concat_arrays([have, stored.column(name).combine_chunks().cast(have.type)])
        take = np.where(marks[name] & (match >= 0), changes.num_rows + match, index)
        position = changes.schema.get_field_index(name)
        changes = changes.set_column(position, name, values.take(pa.array(take)))
    return changes, match >= 0


def parse_keys(texts: pa.Array, keys: Sequence[str], schema: pa.Schema) -> pa.Table | None:
    """Event keys (their JSON text, ``{"id":1}``) as key columns of ``schema``'s types;
    None when one does not parse or a value does not fit its column."""
    values: dict[str, list[Any]] = {k: [] for k in keys}
    try:
        for text in texts.to_pylist():
            found = json.loads(text)
            for k in keys:
                values[k].append(found[k])
        return pa.table({k: pa.array(values[k]).cast(schema.field(k).type) for k in keys})
    except (TypeError, KeyError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def _same_key_as_next(ordered: pa.Table, keys: Sequence[str]) -> pa.Array:
    """Per row of ``ordered`` (sorted by key, then position): whether the next row is
    a change of the same key."""
    rows = ordered.num_rows
    if rows == 0:
        return pa.array([], pa.bool_())
    same = pa.array([True] * (rows - 1), pa.bool_())
    for key in keys:
        column = ordered.column(key).combine_chunks()
        same = pc.and_(same, pc.equal(column.slice(0, rows - 1), column.slice(1)))
    return pa.concat_arrays([same, pa.array([False])])


def scd2_rows(changes: pa.Table, keys: Sequence[str], cuts: Cuts | None = None) -> pa.Table:
    """SCD type 2 merge source for a batch: one ``insert`` row per non-delete change (a
    version valid from its change's timestamp and source position until the key's next
    change, current if there is none) and one ``close`` row per key (ending the table's
    current version at the key's first change, or at its shard's first truncate in
    ``cuts`` if that came first). Bookkeeping columns other than the position are
    dropped; the source positions (:data:`SOURCE_POSITION`, null where not given) become
    :data:`VALID_FROM_POSITION` and :data:`VALID_TO_POSITION`."""
    if SOURCE_POSITION not in changes.column_names:
        changes = changes.append_column(SOURCE_POSITION, pa.nulls(changes.num_rows, pa.int64()))
    elif changes.schema.field(SOURCE_POSITION).type != pa.int64():
        index = changes.schema.get_field_index(SOURCE_POSITION)
        column = changes.column(SOURCE_POSITION).cast(pa.int64())
        changes = changes.set_column(index, SOURCE_POSITION, column)
    dropped = [OPERATION, TIMESTAMP, SOURCE_POSITION]
    if changes.num_rows == 0:  # a batch of truncates only: the rules still read ACTION
        kind = changes.schema.field(TIMESTAMP).type
        return (
            changes.append_column(VALID_FROM, pa.nulls(0, kind))
            .append_column(VALID_TO, pa.nulls(0, kind))
            .append_column(CURRENT, pa.array([], pa.bool_()))
            .append_column(VALID_FROM_POSITION, pa.nulls(0, pa.int64()))
            .append_column(VALID_TO_POSITION, pa.nulls(0, pa.int64()))
            .append_column(ACTION, pa.array([], pa.string()))
            .drop_columns(dropped)
        )
    ordered = changes.sort_by(
        [*((k, "ascending") for k in keys), (SHARD, "ascending"), (SEQUENCE, "ascending")]
    )
    same_next = _same_key_as_next(ordered, keys)
    timestamps = ordered.column(TIMESTAMP).combine_chunks()
    positions = ordered.column(SOURCE_POSITION).combine_chunks()
    is_delete = pc.equal(ordered.column(OPERATION), DELETE)
    versions = (
        ordered.append_column(VALID_FROM, timestamps)
        .append_column(VALID_TO, _of_next(timestamps, same_next))
        .append_column(CURRENT, pc.invert(same_next))
        .append_column(VALID_FROM_POSITION, positions)
        .append_column(VALID_TO_POSITION, _of_next(positions, same_next))
        .append_column(ACTION, pa.array(["insert"] * ordered.num_rows, pa.string()))
        .filter(pc.invert(is_delete))
    )
    same_previous = pa.concat_arrays([pa.array([False]), same_next.slice(0, len(same_next) - 1)])
    firsts = ordered.filter(pc.invert(same_previous))
    ends, end_positions = firsts.column(TIMESTAMP), firsts.column(SOURCE_POSITION)
    if cuts:  # a version the table held ended at its shard's first truncate, if before
        times, places = ends.to_pylist(), end_positions.to_pylist()
        for row, (shard, sequence) in enumerate(
            zip(*(firsts.column(c).to_pylist() for c in (SHARD, SEQUENCE)), strict=True)
        ):
            if shard in cuts and sequence > cuts[shard].first:
                times[row], places[row] = cuts[shard].timestamp, cuts[shard].source
        ends, end_positions = pa.array(times, timestamps.type), pa.array(places, pa.int64())
    closes = (
        firsts.append_column(VALID_FROM, pa.nulls(firsts.num_rows, timestamps.type))
        .append_column(VALID_TO, ends)
        .append_column(CURRENT, pa.array([False] * firsts.num_rows, pa.bool_()))
        .append_column(VALID_FROM_POSITION, pa.nulls(firsts.num_rows, pa.int64()))
        .append_column(VALID_TO_POSITION, end_positions)
        .append_column(ACTION, pa.array(["close"] * firsts.num_rows, pa.string()))
    )
    return pa.concat_tables([closes, versions]).drop_columns(dropped)


def _of_next(values: pa.Array, same_next: pa.Array) -> pa.Array:
    """Per row (sorted by key and position), the next row's value when it is a change of
    the same key, else null."""
    following = pa.concat_arrays([values.slice(1), pa.nulls(1, values.type)])
    return pc.if_else(same_next, following, pa.scalar(None, values.type))


def _compatible(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether values of ``source`` may be written to a column of ``target`` (a cast that
    loses nothing is still checked value by value)."""
    families = (
        (pa.types.is_integer, pa.types.is_integer),
        (pa.types.is_integer, pa.types.is_floating),
        (pa.types.is_floating, pa.types.is_floating),
        (pa.types.is_decimal, pa.types.is_decimal),
        (pa.types.is_timestamp, pa.types.is_timestamp),
        (pa.types.is_date, pa.types.is_date),
    )
    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    binary = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view)
    if source == target or pa.types.is_null(source):
        return True
    if any(a(source) and b(target) for a, b in families):
        return True
    for kind in (text, binary):
        if any(f(source) for f in kind) and any(f(target) for f in kind):
            return True
    return False


def align(source: pa.Table, target: pa.Schema) -> pa.Table:
    """``source`` with the target's columns it lacks (as nulls: a change's row is the whole
    row) and its columns cast to the target's types; columns the target lacks stay (the
    merge's schema evolution adds them). An incompatible type is an error naming the
    column."""
    columns = dict(zip(source.column_names, source.columns, strict=True))
    for field in target:
        if field.name not in columns:
            columns[field.name] = pa.nulls(source.num_rows, field.type)
            continue
        have = columns[field.name].type
        if have == field.type:
            continue
        if not _compatible(have, field.type):
            raise SchemaChangeError(
                field.name,
                f"the changes hold {have} but the table's column is {field.type}; an "
                f"incompatible type change is not applied (nothing was written)",
            )
        try:
            cast = columns[field.name].cast(field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SchemaChangeError(
                field.name, f"a value does not fit the table's type {field.type}: {exc}"
            ) from exc
        if not _lossless(columns[field.name], cast):
            raise SchemaChangeError(
                field.name,
                f"a value does not fit the table's type {field.type}: the cast from {have} "
                f"would change it (nothing was written)",
            )
        columns[field.name] = cast
    return pa.table(columns)


def _lossless(original: pa.ChunkedArray, cast: pa.ChunkedArray) -> bool:
    """Whether ``cast`` (``original`` cast to another type) gives every value back. Arrow's
    safe casts check integers, decimals and timestamps but round a double to a float
    silently (0.1 is 0.10000000149011612 in 32 bits)."""
    if not pa.types.is_floating(cast.type) or not pa.types.is_floating(original.type):
        return True
    back = cast.cast(original.type)
    same = pc.or_kleene(pc.equal(back, original), pc.and_(pc.is_nan(back), pc.is_nan(original)))
    return pc.all(same).as_py() is not False


def sql_literal(value: Any, kind: pa.DataType) -> str:  # noqa: PLR0911 - one per type
    """``value`` (of Arrow type ``kind``) as a delta-rs (DataFusion) SQL expression of
    that type.

    Raises:
        SchemaChangeError: no literal of this type is written (nested types, NaN).
    """
    if value is None:
        return "NULL"
    if pa.types.is_boolean(kind):
        return "TRUE" if value else "FALSE"
    if pa.types.is_integer(kind):
        return f"CAST({int(value)} AS BIGINT)"
    if pa.types.is_floating(kind) and np.isfinite(value):
        return f"CAST('{float(value)!r}' AS DOUBLE)"
    if pa.types.is_decimal(kind):
        return f"CAST('{value}' AS DECIMAL({kind.precision}, {kind.scale}))"
    if _is_text(kind):
        return "'" + str(value).replace("'", "''") + "'"
    if pa.types.is_date(kind):
        return f"CAST('{_day(value, kind).isoformat()}' AS DATE)"
    if pa.types.is_timestamp(kind):
        stamp = pa.scalar(value, kind).cast(pa.timestamp("us", tz=kind.tz)).as_py()
        if kind.tz is not None:
            stamp = stamp.astimezone(timezone.utc).replace(tzinfo=None)
        return f"CAST('{stamp.isoformat()}' AS TIMESTAMP)"
    raise SchemaChangeError(
        str(kind), f"a default of type {kind} ({value!r}) cannot be written into the table's rows"
    )


def _day(value: Any, kind: pa.DataType) -> date:
    """A date, or days since 1970-01-01 (as ``connect`` decodes a date), as a ``date``."""
    try:
        day: date = pa.scalar(value, kind).as_py()
    except (ValueError, OverflowError, pa.ArrowException) as exc:
        raise SchemaChangeError(
            str(kind), f"a default date {value!r} is outside what a table's rows can hold"
        ) from exc
    return day


def quoted(name: str) -> str:
    """A column name for a delta-rs (DataFusion) SQL expression."""
    if '"' in name:
        raise InvalidOptionError(f"apply_changes: column name {name!r} holds a double quote")
    return f'"{name}"'


EVENT_KEY = ("collection", "key")
EVENT_POSITION = ("shard", "sequence")
REDUCE_EVERY = 200_000
"""Rows held before :func:`latest_events` reduces them again (bounds its memory)."""


def latest_events(batches: Iterable[pa.RecordBatch | pa.Table]) -> pa.Table | None:
    """The newest event per ``(collection, key)`` among the log's events (as read:
    ``shard`` and ``sequence`` columns) that is a row: deletes and truncate events dropped,
    and each event older than a truncate of its collection on its shard; None for no
    events. Memory is bounded by the distinct keys (plus :data:`REDUCE_EVERY` rows)."""
    held: list[pa.Table] = []
    added = 0  # rows held beyond the last reduction (one per distinct key)
    for batch in batches:
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        held.append(table)
        added += table.num_rows
        if added > REDUCE_EVERY:  # not the rows held: past REDUCE_EVERY distinct keys
            # that would reduce them all again for each batch (quadratic)
            held, added = [latest_per_key(pa.concat_tables(held), EVENT_KEY, EVENT_POSITION)], 0
    if not held:
        return None
    latest = latest_per_key(pa.concat_tables(held), EVENT_KEY, EVENT_POSITION)
    return _truncated(latest.filter(pc.not_equal(latest.column("operation"), DELETE)))


def _truncated(latest: pa.Table) -> pa.Table:
    """``latest`` (one event per key) without its truncate events and the events each
    makes void: of its collection, on its shard, older (truncate events are one key per
    shard and collection, so the newest of each is there)."""
    truncate = pc.equal(latest.column("operation"), TRUNCATE)
    if not pc.any(truncate).as_py():
        return latest
    events = latest.filter(truncate)
    void = np.zeros(latest.num_rows, dtype=bool)
    collection = latest.column("collection")
    shard = latest.column("shard").to_numpy(zero_copy_only=False)
    sequence = latest.column("sequence").to_numpy(zero_copy_only=False)
    for name, number, cut in zip(
        *(events.column(c).to_pylist() for c in ("collection", "shard", "sequence")), strict=True
    ):
        same = pc.is_null(collection) if name is None else pc.equal(collection, name)
        void |= pc.fill_null(same, False).to_numpy(zero_copy_only=False) & (
            (shard == number) & (sequence < cut)
        )
    return latest.filter(pa.array(~void & ~truncate.to_numpy(zero_copy_only=False)))
