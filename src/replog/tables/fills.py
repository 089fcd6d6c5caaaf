"""Values a change did not send, filled from the key's earlier values: pure Arrow.

A change may not send a column (PostgreSQL's unchanged TOASTed value, Debezium's
placeholder, a column ``metadata.unavailable`` names): its value is the key's previous
change's in the batch, else the old key's (the create of a changed key), else the table's
row of the key. The table's rows come from a :class:`Stored`: a Delta table when a batch is
applied (:mod:`replog.tables.delta`), a version's rows in memory when a table is read as
of a point (:mod:`replog.tables.as_of`), so both fill alike.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replog.tables import changes as rows
from replog.tables.changes import CURRENT, DELETE, OPERATION

logger = logging.getLogger(__name__)


class Stored(Protocol):
    """A table's rows, as a fill reads them."""

    @property
    def schema(self) -> pa.Schema: ...

    def rows(
        self, changes: pa.Table, keys: Sequence[str], columns: Sequence[str], *, current_only: bool
    ) -> pa.Table:
        """``keys`` and ``columns`` of (at least) the rows of ``changes``' keys;
        ``current_only``: scd2's current versions only."""
        ...


def fill_unavailable(table: Stored | None, changes: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``changes`` with each value not sent (Debezium's placeholder for an unchanged TOASTed
    column, or a column :data:`~replog.tables.changes.UNSENT` names) replaced by the key's
    value: from its previous change in the batch, else from the table's (current) row; the
    create of a changed key (:data:`~replog.tables.changes.OLD_KEY`) takes the old key's
    value instead. A key the table does not hold keeps what the change holds: its value is
    not known."""
    changes, marks = rows.fill_unavailable(changes, keys)
    if not marks:
        return changes
    current_only = table is not None and CURRENT in table.schema.names
    deletes = pc.fill_null(pc.equal(changes.column(OPERATION), DELETE), False).to_numpy(
        zero_copy_only=False
    )
    moved = np.zeros(changes.num_rows, dtype=bool)
    if rows.OLD_KEY in changes.column_names:
        moved = pc.is_valid(changes.column(rows.OLD_KEY)).to_numpy(zero_copy_only=False)
        changes, marks = _fill_from_old_keys(table, changes, marks, keys, deletes)
        # a key changed twice (A -> B -> C): B's create took A's value; B's delete takes it
        # from there, and C's create from B's delete, one change of key per round
        while marks:
            left = sum(int(m.sum()) for m in marks.values())
            changes, marks = rows.refill(changes, marks, keys)
            changes, marks = _fill_from_old_keys(table, changes, marks, keys, deletes)
            if sum(int(m.sum()) for m in marks.values()) == left:
                break
    if table is None:
        return changes
    # a delete needs no value; a changed key's own row (if any) is of an earlier life
    own = {name: marked & ~deletes & ~moved for name, marked in marks.items()}
    own = {name: marked for name, marked in own.items() if marked.any()}
    columns = [name for name in own if name in table.schema.names]
    if not columns:
        return changes
    marked_rows = changes.filter(pa.array(np.logical_or.reduce([own[c] for c in columns])))
    stored = table.rows(marked_rows, keys, columns, current_only=current_only)
    return rows.fill_from_rows(changes, own, stored, keys)[0]


def _fill_from_old_keys(
    table: Stored | None,
    changes: pa.Table,
    marks: rows.Marks,
    keys: Sequence[str],
    sources: np.ndarray,
) -> tuple[pa.Table, rows.Marks]:
    """Fill the values a changed key's create did not send (its rows are marked, and carry
    :data:`~replog.tables.changes.OLD_KEY`) with the old key's: its delete in the batch
    (``sources``: the deletes, which the batch fill gave the key's last value sent), else
    the table's row of the old key. Returns the changes and the marks still left."""
    deletes_ops = pc.fill_null(pc.equal(changes.column(OPERATION), DELETE), False)
    waiting = np.logical_or.reduce(list(marks.values())) & ~deletes_ops.to_numpy(
        zero_copy_only=False
    )
    waiting &= pc.is_valid(changes.column(rows.OLD_KEY)).to_numpy(zero_copy_only=False)
    needing = np.flatnonzero(waiting)
    if not len(needing):
        return changes, marks
    old = rows.parse_keys(changes.column(rows.OLD_KEY).take(needing), keys, changes.schema)
    if old is None:
        logger.warning("apply_changes: an old key (metadata.old_key) does not parse: %s", keys)
        return changes, marks
    columns = list(marks)
    proxy = old
    for name in columns:
        proxy = proxy.append_column(name, changes.column(name).take(needing))
    proxy_marks = {name: marks[name][needing] for name in columns}
    # the old key's delete in the batch (its last one), holding the key's last value sent
    candidates = np.flatnonzero(sources)
    if len(candidates):
        deleted = changes.take(candidates).append_column(
            "__candidate", pa.array(candidates, pa.int64())
        )
        last = rows.latest_per_key(deleted, keys)
        chosen = last.column("__candidate").to_numpy()
        for name in columns:
            known = last.filter(pa.array(~marks[name][chosen])).select([*keys, name])
            proxy, held = rows.fill_from_rows(proxy, {name: proxy_marks[name]}, known, keys)
            proxy_marks[name] = proxy_marks[name] & ~held
    if table is not None and any(m.any() for m in proxy_marks.values()):
        current_only = CURRENT in table.schema.names
        present = [name for name in columns if name in table.schema.names]
        stored = table.rows(proxy, keys, present, current_only=current_only)
        proxy, held = rows.fill_from_rows(proxy, proxy_marks, stored, keys)
        proxy_marks = {name: m & ~held if name in present else m for name, m in proxy_marks.items()}
    for name in columns:
        full = changes.column(name).combine_chunks()
        take = np.arange(changes.num_rows, dtype=np.int64)
        values = pa.concat_arrays([full, proxy.column(name).combine_chunks().cast(full.type)])
        take[needing] = changes.num_rows + np.arange(len(needing))
        changes = changes.set_column(
            changes.schema.get_field_index(name), name, values.take(pa.array(take))
        )
        marks[name] = marks[name].copy()
        marks[name][needing] = proxy_marks[name]
    return changes, marks
