"""What DDL did to the captured tables, seen in the catalog: nothing in the change stream
says that a table was dropped or renamed, that a partition was attached or detached, or
that a column was renamed.

DESIGN: once a second (and at each start, against what the plan last saw) the watch
compares the catalog with what capture knows, by table id:

* the name resolves to another table and the captured one is gone: **dropped and created
  again** (its rows are replaced: :mod:`~replog.capture.removals`, then a snapshot);
* the name resolves to nothing, the table still exists: **renamed** (captured on under its
  collection, its snapshot goes on by id); the table gone too: **dropped** (its snapshot is
  given up; tables built from the log keep its rows, a warning says so once);
* a leaf partition new to a captured partitioned table: **attached** (its rows, wherever
  their keys fall, are snapshotted: nothing in the WAL brings them);
* a leaf partition gone: **detached or dropped** (a marker into the WAL now; where the
  stream meets it, its rows are deleted);
* a leaf partition whose attachment is new (the ``xmin`` of its ``pg_inherits`` rows):
  **detached and attached again** between two looks (both of the above: its rows may
  have changed meanwhile, unpublished);
* a column with the same ``attnum`` and another name or type: **renamed** or **retyped**
  (the table is snapshotted again: every row carries the new name; a rewrite ``USING`` an
  expression changed values no row change reports); a column **dropped and added again**
  under its name; the table **rewritten** (new ``relfilenode``) with a column's catalog
  row written anew or a column added (``TYPE ... USING`` of the same type, a volatile
  default, ``serial``): each is snapshotted again. A rewrite alone (``VACUUM FULL``)
  changes no value.

Each costs one catalog query for all captured tables. Not seen: a column renamed and
renamed back between two looks (the catalog is as it was; rows changed meanwhile carry
the transient name downstream).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable

from replog.capture.removals import Removals
from replog.capture.snapshot import ATTACHED, COLUMNS_CHANGED, RECREATED, SnapshotPlan
from replog.capture.source import MARKER_PREFIX, PostgresSource, Table
from replog.capture.stream import Relations
from replog.errors import CaptureError

logger = logging.getLogger(__name__)

CHECK_S = 1.0
"""How often a capture looks in the catalog for DDL on its tables."""

Owe = Callable[[Table, str, int], None]
"""(table, reason, relation: 0 or one partition) -> a snapshot owed."""


class CatalogWatch:
    """Compares the catalog with what capture knows (see the module docstring).

    ``owe`` asks the capture for a snapshot, ``restart`` for a table's snapshot from its
    start; ``changed`` says the plan changed (it is saved before the next commit)."""

    def __init__(
        self,
        source: PostgresSource,
        relations: Relations,
        removals: Removals,
        owe: Owe,
        restart: Callable[[Table, str], None],
    ) -> None:
        self.source = source
        self.relations = relations
        self.removals = removals
        self.owe = owe
        self.restart = restart
        self.plan: SnapshotPlan | None = None
        self.changed = False
        self._checked = 0.0
        self._noted: set[tuple[str, str | int]] = set()

    def start(self, plan: SnapshotPlan) -> None:
        """Take ``plan``: the resets it owes; then what changed while no capture ran (a
        table whose id in the plan is not the catalog's was replaced; partitions and
        columns the plan saw are compared, or first recorded)."""
        self.plan = plan
        self.removals.plan = plan
        for name, reset in plan.resets.items():
            self.relations.gone[int(reset["old_oid"] or 0)] = name
        for removal in plan.removals:  # its changes before its marker are its table's
            table = self.source.tables.get(removal["table"])
            if table is not None:
                self.source.place_partition(int(removal["leaf"]), table.oid)
        for table in list(self.source.tables.values()):
            known = plan.tables.get(table.qualified, table.oid)
            if known != table.oid:
                self.replaced(table.qualified, known)
        self.check(now=True)

    def check(self, *, now: bool = False) -> None:
        """Look in the catalog (once a second unless ``now``)."""
        clock = time.monotonic()
        if (not now and clock - self._checked < CHECK_S) or self.plan is None:
            return
        known = {name: table.oid for name, table in self.source.tables.items()}
        found = self.source.catalog_now(known)
        self._published([self.source.tables[name] for name, e in found.items() if e.name])
        for name, entry in found.items():
            table = self.source.tables[name]
            if entry.oid != table.oid:
                if entry.name is None and entry.oid is not None:
                    self.replaced(name, table.oid)
                    continue
                self._moved(table, entry.oid, entry.name)
                if entry.name is None:
                    continue
            self._partitions(table, entry.leaves, entry.attached)
            self._columns(table, entry.columns, self._rewritten(table, entry.storage))
        self._checked = clock  # a look that ended (what it saw is in the plan)

    def _published(self, tables: list[Table]) -> None:
        """Capture's own publication still publishes each captured table that exists: one
        dropped, or a table taken out of it (by hand), leaves its changes out of the
        stream from that point, and capture stops rather than go on without them (a
        restart publishes them again and makes the tables good)."""
        missing = self.source.unpublished([table.oid for table in tables])
        if not missing and missing is not None:
            return
        publication = self.source.publication
        what = (
            f"capture's own publication {publication} was dropped"
            if missing is None
            else f"{', '.join(t.qualified for t in tables if t.oid in missing)} left capture's "
            f"own publication {publication}"
        )
        raise CaptureError(
            f"{what} while capture ran (by hand?): their changes from then on are not in the "
            f"stream. Start capture again: it publishes its tables again, deletes from the "
            f"log the rows the source no longer holds and reads every row again (to stop "
            f"capturing a table, name the others with --tables and give --tables-changed)"
        )

    def _note(self, key: tuple[str, str | int], message: str, *args: object) -> None:
        if key not in self._noted:
            self._noted.add(key)
            logger.warning(message, *args)

    def _moved(self, table: Table, oid: int | None, current_name: str | None) -> None:
        """The captured name no longer names the captured table (``oid``: what it names)."""
        name = table.qualified
        if current_name is None:
            assert self.plan is not None
            if any(item.table == name for item in self.plan.queue):
                self.plan.drop(name)
                self.changed = True
            self._note((name, "dropped"), "captured table %s was dropped: its snapshot is given "
                       "up, and tables built from the log keep its rows (a table created again "
                       "under its name replaces them)", name)  # fmt: skip
            return
        self._note(
            (name, current_name),
            "captured table %s is called %s now (renamed): it is captured on as collection %s%s",
            name,
            current_name,
            name,
            "" if oid is None else f"; the new table {name} is not captured",
        )

    def replaced(self, name: str, old_oid: int) -> None:
        """Table ``name`` is a new table (the one with id ``old_oid`` was dropped, or
        renamed away while no capture ran): its predecessor's rows are deleted before its
        first event, it is published (capture's own publication) after its identity was
        checked, and its rows are snapshotted. A predecessor renamed away leaves capture's
        own publication: the collection is the table of that name now (its changes from
        here on are no longer published, so none follows the deletes)."""
        assert self.plan is not None
        if name in self.plan.resets:
            return
        self.plan.resets[name] = {"old_oid": old_oid, "done_at": None}
        self.relations.gone[old_oid] = name
        self.changed = True
        source = self.source
        table = source.table_with_oid(source.current_oids([name])[name] or 0)
        if table is None:
            source.forget(source.tables[name])
            table = source.add_table(name)  # its identity checked before publishing
        if source.own_publication:
            source.add_to_publication(table)
            if source.remove_from_publication(old_oid):
                logger.warning(
                    "%s is called %s now and another table is called %s: capture follows "
                    "the name (--tables), and no longer publishes %s",
                    name,
                    source.relation_name(old_oid),
                    name,
                    source.relation_name(old_oid),
                )
        elif not source.is_published(table):
            logger.warning(
                "%s was dropped and created again, and publication %s no longer publishes "
                "it: ALTER PUBLICATION %s ADD TABLE %s, or its changes are not captured",
                name,
                source.publication,
                source.publication,
                name,
            )
        for seen in (self.plan.partitions, self.plan.columns, self.plan.attached,
                     self.plan.storage):  # fmt: skip
            seen.pop(name, None)
        self.owe(table, RECREATED, 0)

    def _partitions(self, table: Table, leaves: list[str] | None, attached: dict[str, str]) -> None:
        """Partitions attached (snapshotted) and gone (their rows deleted) since last
        seen; one detached and attached again (its attachment written anew: its rows
        changed unpublished meanwhile) is both. The constraint of each new one is asked
        for (with a lock timeout) and remembered while it is attached."""
        assert self.plan is not None
        name = table.qualified
        seen = self.plan.partitions.get(name)
        seen_attached = self.plan.attached.get(name, {})
        if leaves is None:
            return
        again = sorted(
            (leaf for leaf in set(leaves) & set(seen or {})
             if leaf in seen_attached and attached.get(leaf) != seen_attached[leaf]),
            key=int,
        )  # fmt: skip
        if seen is not None and set(seen) == set(leaves) and not again:
            if attached != seen_attached:
                self.plan.attached[name] = attached
                self.changed = True
            return
        asked = [leaf for leaf in leaves if seen is None or leaf not in seen] + again
        constraints = self.source.partition_constraints(asked) if asked else {}
        if constraints is None:
            return  # a DDL holds the partitions: looked at again in a second
        self.plan.attached[name] = attached
        known = {**(seen or {}), **constraints}
        self.plan.partitions[name] = {leaf: known[leaf] for leaf in leaves}
        self.changed = True
        if seen is None:
            return  # first seen: what it holds now is what the table's snapshot reads
        for leaf in again:
            logger.warning(
                "partition %s of %s was detached and attached again: its rows are taken "
                "out of the log and snapshotted again (changes made while it was detached "
                "were not published)",
                leaf,
                name,
            )
        for leaf in sorted(set(seen) - set(leaves), key=int) + again:
            self._remove(name, leaf, seen[leaf])
        for leaf in sorted(set(leaves) - set(seen), key=int) + again:
            if leaf not in again:
                logger.warning("partition %s was attached to %s: its rows are snapshotted",
                               leaf, name)  # fmt: skip
            self.owe(table, ATTACHED, int(leaf))

    def _remove(self, name: str, leaf: str, constraint: str) -> None:
        """Partition ``leaf`` left table ``name``: a marker into the WAL now, where the
        stream meets it its rows are deleted. Its changes before the marker are the
        table's: the stream names the partition (capture's own publication publishes
        partitions as themselves), which the catalog no longer places under the table."""
        assert self.plan is not None
        self.source.place_partition(int(leaf), self.source.tables[name].oid)
        removal_id = uuid.uuid4().hex
        self.plan.removals.append(
            {
                "id": removal_id,
                "table": name,
                "leaf": int(leaf),
                "constraint": constraint,
                "columns": self.plan.columns.get(name),
                "done_at": None,
            }
        )  # fmt: skip  (the columns as the constraint names them: seen at the same look)
        self.source.emit_message(MARKER_PREFIX, json.dumps({"removal": removal_id}))
        logger.warning(
            "partition %s left %s (detached or dropped): its rows are deleted from the "
            "log where the stream meets marker %s",
            leaf,
            name,
            removal_id,
        )

    def _rewritten(self, table: Table, storage: dict[str, int]) -> bool:
        """Whether the table (or a leaf partition of it) was rewritten since last seen
        (new storage); what is seen now is kept."""
        assert self.plan is not None
        seen = self.plan.storage.get(table.qualified)
        if seen == storage:
            return False
        self.plan.storage[table.qualified] = storage
        self.changed = True
        return seen is not None and any(
            leaf in storage and storage[leaf] != node for leaf, node in seen.items()
        )

    def _columns(self, table: Table, columns: dict[str, list[str]], rewritten: bool) -> None:
        """Columns whose values changed with no row change since last seen: the table is
        snapshotted again. A column renamed leaves every row's value under the old name
        downstream; one retyped, or rewritten ``USING`` an expression (its catalog row
        written anew, the table rewritten), changed every row; one dropped and added again
        under its name holds the new column's values; one added by a rewrite (a volatile
        default: ``random()``, ``serial``, identity) holds a value each row got then."""
        assert self.plan is not None
        name = table.qualified
        seen = self.plan.columns.get(name)
        if seen == columns:
            return
        self.plan.columns[name] = columns
        self.changed = True
        if seen is None:
            return
        changed = []
        for attnum in sorted(set(seen) & set(columns), key=int):
            before, now = seen[attnum], columns[attnum]
            if before[:2] != now[:2]:
                changed.append(f"{' '.join(before[:2])} -> {' '.join(now[:2])}")
            elif rewritten and len(before) > 2 and before[2] != now[2]:
                changed.append(f"{now[0]} rewritten")
        gone = {seen[attnum][0] for attnum in set(seen) - set(columns)}
        for attnum in sorted(set(columns) - set(seen), key=int):
            if columns[attnum][0] in gone:
                changed.append(f"{columns[attnum][0]} dropped and added again")
            elif rewritten:
                changed.append(f"{columns[attnum][0]} added by a rewrite")
        if changed:
            logger.warning("columns of %s changed (%s): the table is snapshotted again",
                           name, ", ".join(changed))  # fmt: skip
            self.restart(table, COLUMNS_CHANGED)
