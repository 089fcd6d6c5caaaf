"""The rows of a table that was dropped and created again under a captured name, deleted.

DESIGN: PostgreSQL sends no event for ``DROP TABLE``, so every table built from the log
would keep the dropped table's rows beside the new table's. Before the first event of the
new table (a change, or a chunk of its snapshot) capture ends its batch, so the log holds
every event of the old table and none of the new one; it then reads the collection's live
keys back from the log and puts a delete of each at the head of the next batch, which
also holds that first event: the deletes and the new table's first event land in one
commit. The cost is one read of the log's events of that collection, once per such DDL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from replog.capture.batch import Batch
from replog.capture.events import Event, EventMaker, event_id
from replog.capture.snapshot import RECREATED, SnapshotPlan
from replog.capture.source import PostgresSource, Table
from replog.capture.stream import Relations
from replog.log import ReplicationLog
from replog.tables.changes import latest_events
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

CHECK_S = 1.0
"""How often a capture looks in the catalog for captured tables dropped and created again."""


class EndBefore(Exception):  # noqa: N818 - control flow of the capture loop, never escapes it
    """The batch must end before the transaction at ``commit_lsn``: the rows of a dropped
    table are deleted first."""

    def __init__(self, commit_lsn: int) -> None:
        super().__init__(commit_lsn)
        self.commit_lsn = commit_lsn


def _of_collection(log: ReplicationLog, collection: str) -> Iterator[pa.RecordBatch]:
    for batch in log.scan():
        kept = batch.filter(pc.equal(batch.column("collection"), collection))
        if kept.num_rows:
            yield kept


def live_keys(log: ReplicationLog, collection: str) -> list[str]:
    """The keys of ``collection`` whose newest event in the log is not a delete."""
    latest = latest_events(_of_collection(log, collection))
    return [] if latest is None else sorted(latest.column("key").to_pylist())


def deletes(
    maker: EventMaker,
    table: Table,
    keys: list[str],
    *,
    old_oid: int,
    ts_ms: int,
    position: int,
) -> list[Event]:
    """A delete event of each of ``keys`` of the dropped table ``old_oid`` (its row as the
    key holds it), placed at ``position`` (the first transaction of the new table)."""
    source = {
        **maker.source_block(table, ts_ms, "false", None, position),
        "table_dropped": old_oid,
    }
    metadata = maker.metadata_text(
        op="d", ts_ms=ts_ms, source=source, schema=maker.shape(table).digest
    )
    return [
        Event(
            event_id(f"{maker.slot}:drop:{old_oid}:{key}"),
            ts_ms,
            "delete",
            table.qualified,
            key,
            key,
            key,
            metadata,
        )
        for key in keys
    ]


class DroppedTables:
    """A capture's watch for captured tables dropped, or dropped and created again (see
    the module docstring): what the plan owes (``resets``), where the current batch must
    end, and the deletes ready for the next one.

    ``owe`` asks the capture for a snapshot of a table; ``changed`` says the plan changed
    (it is saved before the next commit)."""

    def __init__(
        self,
        source: PostgresSource,
        relations: Relations,
        maker: EventMaker,
        log: ReplicationLog,
        owe: Callable[[Table, str], None],
    ) -> None:
        self.source = source
        self.relations = relations
        self.maker = maker
        self.log = log
        self.owe = owe
        self.plan: SnapshotPlan | None = None
        self.changed = False
        self.end_before: int | None = None
        """End the next batch before the transaction at this position (a reset first)."""
        self.ready: dict[str, list[Event]] = {}
        """Deletes of dropped tables' rows, for the head of the next batch, by table."""
        self._checked = 0.0
        self._noted: set[str] = set()

    def start(self, plan: SnapshotPlan) -> None:
        """Take ``plan``: the resets it owes, and the tables replaced while no capture ran
        (their id in the plan is not the catalog's)."""
        self.plan = plan
        for name, reset in plan.resets.items():
            self.relations.gone[int(reset["old_oid"] or 0)] = name
        for table in list(self.source.tables.values()):
            known = plan.tables.get(table.qualified, table.oid)
            if known != table.oid:
                self.replaced(table.qualified, known)

    def check(self, *, now: bool = False) -> None:
        """Look in the catalog (once a second) for captured tables dropped, or dropped and
        created again: nothing in the stream says so, and with capture's own publication
        the new table is not even published (the drop took it out)."""
        clock = time.monotonic()
        if not now and clock - self._checked < CHECK_S:
            return
        self._checked = clock
        for name, oid in self.source.current_oids(list(self.source.tables)).items():
            known = self.source.tables[name].oid
            if oid == known:
                continue
            if oid is None:
                if name not in self._noted:
                    self._noted.add(name)
                    logger.warning(
                        "captured table %s was dropped: tables built from the log keep its "
                        "rows (a table created again under its name replaces them)",
                        name,
                    )
                continue
            self._noted.discard(name)
            self.replaced(name, known)

    def replaced(self, name: str, old_oid: int) -> None:
        """Table ``name`` is a new table (the one with id ``old_oid`` was dropped): its
        predecessor's rows are deleted before its first event, it is published (capture's
        own publication) after its identity was checked, and its rows are snapshotted."""
        assert self.plan is not None
        if name in self.plan.resets:
            return
        self.plan.resets[name] = {"old_oid": old_oid, "done_at": None}
        self.relations.gone[old_oid] = name
        self.changed = True
        table = self.source.table_with_oid(self.source.current_oids([name])[name] or 0)
        if table is None:
            table = self.source.add_table(name)  # its identity checked before publishing
        if self.source.own_publication:
            self.source.add_to_publication(table)
        elif not self.source.is_published(table):
            logger.warning(
                "%s was dropped and created again, and publication %s no longer publishes "
                "it: ALTER PUBLICATION %s ADD TABLE %s, or its changes are not captured",
                name,
                self.source.publication,
                self.source.publication,
                name,
            )
        self.owe(table, RECREATED)

    def first(self, table: Table, batch: Batch, commit_lsn: int) -> None:
        """Before an event of ``table`` in the transaction at ``commit_lsn``: if it is the
        first of a table that replaced a dropped one, the dropped table's rows must be
        deleted first, at the head of this batch; if they are not there yet, the batch
        ends before this transaction (:class:`EndBefore`)."""
        reset = self.plan.resets.get(table.qualified) if self.plan is not None else None
        if reset is None or reset.get("done_at") is not None or table.oid == reset["old_oid"]:
            return
        if table.qualified not in batch.resets:
            raise EndBefore(commit_lsn)

    def head(self, batch: Batch) -> None:
        """Put the deletes made ready at the head of ``batch``."""
        for name, made in self.ready.items():
            batch.add(made)
            batch.resets.append(name)

    def done(self, batch: Batch, position: int) -> None:
        """Write down, before ``batch``'s commit at ``position``, the resets it carries."""
        assert self.plan is not None
        for name in batch.resets:
            self.plan.resets[name]["done_at"] = position
            self.changed = True

    def prepare(self, position: int) -> bool:
        """Once a batch ended before a new table's first event, every event of the
        dropped one is in the log: read its live keys and make their deletes, for the
        head of the next batch. Whether there were any to make."""
        if self.end_before is None or self.plan is None:
            return False
        self.end_before = None
        self.ready = {}
        for name, reset in self.plan.resets.items():
            if reset.get("done_at") is not None:
                continue
            keys = live_keys(self.log, name)
            logger.warning(
                "%s was dropped and created again: deleting the %d rows of the dropped table "
                "(id %s) from the log before the new table's first event",
                name,
                len(keys),
                reset["old_oid"],
            )
            self.ready[name] = deletes(
                self.maker,
                self.source.tables[name],
                keys,
                old_oid=int(reset["old_oid"] or 0),
                ts_ms=now_ms(),
                position=position,
            )
        return True
