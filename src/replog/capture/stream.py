"""The change stream's relations, mapped to captured tables, and what a transaction's
changes need to stay equal to the source downstream.

DESIGN: pgoutput names each change by a relation id. :class:`Relations` says which
captured table that is, in this order: the table with that id (also renamed); the
partitioned table a partition belongs to (a publication without
``publish_via_partition_root``, or changes decoded before capture set it, name
partitions), its values put in the partitioned table's column order; a table created
again under a captured name (described afresh); a table that joined the user's
publication. Nothing is skipped silently: with capture's own publication a relation it
cannot map stops capture before anything of its batch is committed; with ``--publication``
and ``--tables`` skipping the rest is the documented choice, counted and warned about.

:class:`DeferredKeys` keeps a transaction's last word per key for tables whose key is
DEFERRABLE, where one statement may hold two rows under one key for a moment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replog.capture.events import Event
from replog.capture.options import CaptureOptions
from replog.capture.pgoutput import Column, Relation, RowChange, SourceTransaction, lsn_to_text
from replog.capture.progress import CaptureProgress
from replog.capture.source import Columns, PostgresSource, Table
from replog.errors import CaptureError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mapped:
    """A change of a captured table, as that table's relation describes it."""

    table: Table
    change: RowChange
    replaced: int | None = None
    """The id of the table this one replaces under its name (dropped, created again):
    set on the first change of the new one only."""


class Relations:
    """Which captured table each relation of the stream is (see the module docstring)."""

    def __init__(
        self,
        source: PostgresSource,
        options: CaptureOptions,
        progress: CaptureProgress,
        joined: Callable[[Table], None],
        released: dict[str, int] | None = None,
    ) -> None:
        self.source = source
        self.options = options
        self.progress = progress
        self.joined = joined
        """Called with a table that joined the user's publication while capturing."""
        self.released = released if released is not None else {}
        """Tables no longer captured (name -> id): their changes still unread are skipped."""
        self._renames_noted: set[tuple[int, str]] = set()
        self._keys_followed: dict[int, Relation] = {}
        """Table id -> the relation description its key was last checked against."""
        self._translated: dict[int, tuple[Relation, Columns, Relation, tuple[int, ...]]] = {}
        """Partition id -> (its relation, the root's columns then known, as the root's relation,
        value positions)."""
        self._skips_noted: set[tuple[int, int]] = set()
        self._columns_followed: dict[int, Relation] = {}
        self.gone: dict[int, str] = {}
        """Ids of captured tables that were dropped (and created again) -> their names:
        their changes still unread are theirs, not the new table's."""

    def table_of(self, relation: Relation, txn: SourceTransaction) -> Table | None:
        """The captured table ``relation`` is (None for one not captured, counted)."""
        found = self._find(relation, txn)
        return found[0] if found else None

    def map(self, change: RowChange, txn: SourceTransaction) -> Mapped | None:
        """The captured table ``change`` is of, with the change as its relation describes
        it; None for a change skipped by choice (counted, warned)."""
        found = self._find(change.relation, txn)
        if found is None:
            return None
        table, replaced = found
        if table.oid != change.relation.oid:  # a partition: in its root's column order
            change = self._as_root(change, table)
        table = self._follow_columns(table, change.relation)
        return Mapped(self._follow_primary_key(table, change.relation, txn), change, replaced)

    def _follow_columns(self, table: Table, relation: Relation) -> Table:
        """``table`` described afresh when the stream's columns are not the ones known
        (``ADD COLUMN`` while capturing): its defaults, and the columns the snapshot reads."""
        if self._columns_followed.get(table.oid) is relation:
            return table
        self._columns_followed[table.oid] = relation
        known = [name for name, _, _ in table.columns]
        if [column.name for column in relation.columns] == known:
            return table
        return self.source.refresh_columns(table) or table  # dropped: the stream's is all

    def _find(self, relation: Relation, txn: SourceTransaction) -> tuple[Table, int | None] | None:
        source = self.source
        table = source.table_with_oid(relation.oid)
        if table is not None:
            if table.qualified != relation.name:
                self._note_rename(table, relation.name)
            return table, None
        if relation.oid in self.gone:  # a change of the dropped table, read after a restart
            return source.remember_dropped(self.gone[relation.oid], relation), None
        root = source.partition_root(relation.oid)
        parent = source.table_with_oid(root) if root is not None else None
        if parent is not None:
            return parent, None
        captured = source.tables.get(relation.name)
        if captured is not None:
            source.forget(captured)
            table = source.add_table(relation.name)  # errors (no key...) stop it
            logger.warning(
                "%s was dropped and created again (id %d, was %d): captured from now on",
                table.qualified,
                table.oid,
                captured.oid,
            )
            return table, captured.oid
        if not self.options.tables:  # the publication's tables are captured
            name = relation.name if root is None else source.relation_name(root)
            table = source.add_table(name)
            logger.info("%s joined publication %s: captured from now on", name, source.publication)
            self.joined(table)
            return table, None
        self._not_captured(relation, txn)
        return None

    def _not_captured(self, relation: Relation, txn: SourceTransaction) -> None:
        """A relation that is none of the captured tables: skipped by choice (counted,
        warned), or, with capture's own publication, an error before anything of the
        batch is committed."""
        released = relation.oid in self.released.values() or relation.name in self.released
        if self.source.own_publication and not released:
            raise CaptureError(
                f"a change of {relation.name} (relation {relation.oid}, transaction "
                f"{txn.xid}, LSN {lsn_to_text(txn.commit_lsn)}) is not a captured table, yet "
                f"capture's own publication {self.source.publication} published it (was it "
                f"added to the publication by hand?). Nothing of this batch was committed and "
                f"the slot stays where it was: remove it from the publication (ALTER "
                f"PUBLICATION {self.source.publication} DROP TABLE {relation.name}), or add "
                f"it to --tables"
            )
        self._skip(relation, txn)

    def _skip(self, relation: Relation, txn: SourceTransaction) -> None:
        self.progress.skipped_changes += 1
        if (txn.xid, relation.oid) in self._skips_noted:
            return
        self._skips_noted = {(txn.xid, relation.oid)} | {
            noted for noted in self._skips_noted if noted[0] == txn.xid
        }
        logger.warning(
            "changes of %s (transaction %d) are not captured: %s (%d changes skipped so far)",
            relation.name,
            txn.xid,
            f"publication {self.source.publication} publishes it, --tables leaves it out"
            if relation.name not in self.released
            else "it is no longer captured (--tables-changed)",
            self.progress.skipped_changes,
        )

    def _as_root(self, change: RowChange, table: Table) -> RowChange:
        """A partition's change with its values in the partitioned table's column order;
        a column the partition sends that capture does not know the table to have (added
        since it last looked) follows them, so that :meth:`_follow_columns` sees it: left
        out, it was never captured (nor were its values)."""
        cached = self._translated.get(change.relation.oid)
        if cached is None or cached[0] is not change.relation or cached[1] is not table.columns:
            sent = [column.name for column in change.relation.columns]
            known = [name for name, _, _ in table.columns]
            order = (
                *(sent.index(name) for name in known if name in sent),
                *(i for i, name in enumerate(sent) if name not in known),
            )
            columns: tuple[Column, ...] = tuple(change.relation.columns[i] for i in order)
            relation = Relation(
                table.oid, table.schema, table.name, change.relation.replica_identity, columns
            )
            cached = (change.relation, table.columns, relation, order)
            self._translated[change.relation.oid] = cached
        _, _, relation, order = cached

        def reordered(values: Any) -> Any:
            return None if values is None else tuple(values[i] for i in order)

        return RowChange(
            relation,
            change.op,
            change.lsn,
            reordered(change.new),
            reordered(change.old),
            change.old_is_key_only,
        )

    def _note_rename(self, table: Table, name: str) -> None:
        if (table.oid, name) in self._renames_noted:
            return
        self._renames_noted.add((table.oid, name))
        logger.warning(
            "captured table %s is called %s at this point of the stream (renamed): its "
            "changes are captured as collection %s until capture starts again with the "
            "table's current name",
            table.qualified,
            name,
            table.qualified,
        )

    def _follow_primary_key(
        self, table: Table, relation: Relation, txn: SourceTransaction
    ) -> Table:
        """Key ``table`` by its primary key as of this point of the stream. Under the
        default replica identity the columns pgoutput flags as identity are the primary key
        then (decoding reads the catalog as it was), which the catalog read at start-up may
        not be: an ``ALTER TABLE ... PRIMARY KEY`` while capturing, or before a restart with
        changes still unread. Keyed by a stale key, two rows could share one key and be
        merged into one downstream. Keys given with ``--keys`` are kept."""
        if self._keys_followed.get(table.oid) is relation:
            return table  # this description was seen: once per table per decoding session
        self._keys_followed[table.oid] = relation
        if relation.replica_identity != "d" or table.qualified in self.options.keys:
            return table
        identity = [column.name for column in relation.columns if column.in_identity]
        if not identity or set(identity) == set(table.key):
            return table
        current = self.source.primary_key(table.oid)
        key = current if set(current) == set(identity) else tuple(identity)
        logger.warning(
            "the primary key of %s is (%s) from transaction %d on, not (%s): its events are "
            "keyed by it, so rows a table built from the log keeps under the old key are not "
            "updated or deleted by them (rebuild such tables from a snapshot)",
            table.qualified,
            ", ".join(key),
            txn.xid,
            ", ".join(table.key),
        )
        return self.source.rekey(table, key)


class DeferredKeys:
    """A transaction's last word per key, for tables whose key is DEFERRABLE.

    ``UPDATE seats SET id = id + 1`` moves row 1 to key 2 while row 2 still holds it
    (the key is checked at the end of the statement), then row 2 to key 3: the stream
    says delete 1, create 2, delete 2, create 3. Taken one by one, key 2 ends deleted.
    Such a table has REPLICA IDENTITY FULL (a deferrable key cannot be the identity), so a
    delete carries the whole old row: a delete of a key this transaction created whose
    old row is not the row it created is the removal of the row that held the key before,
    and leaves the created one in place; it is not emitted. (Two rows equal in every
    column cannot be told apart: such a delete is taken as the created row's.)
    """

    def __init__(self) -> None:
        self._created: dict[tuple[str, str], str] = {}

    def begin(self) -> None:
        self._created.clear()

    def keep(self, table: Table, events: list[Event]) -> list[Event]:
        """``events`` without the deletes that would remove a row this transaction put
        under a key after another row had it."""
        if not table.key_deferrable:
            return events
        kept = []
        for event in events:
            slot = (event.collection, event.key)
            operation = event.operation
            if operation == "insert" or (operation == "update" and slot in self._created):
                self._created[slot] = event.data
            elif operation == "delete" and slot in self._created:
                if event.before != self._created[slot]:
                    logger.debug("%s %s: the row that held the key before left it", *slot)
                    continue
                del self._created[slot]
            kept.append(event)
        return kept
