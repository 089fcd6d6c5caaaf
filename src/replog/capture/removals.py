"""Rows that leave a captured table without a delete event each, deleted in the log at the
point where they left.

DESIGN: PostgreSQL writes no row change for ``DROP TABLE``, for ``ALTER TABLE ... DETACH
PARTITION`` or for a partition dropped, so every table built from the log would keep those
rows. Capture deletes them itself, at a point of the stream:

* a table **dropped and created again** under a captured name: before the first event of
  the new table (a change, or a chunk of its snapshot); every live row of the collection
  is deleted;
* a **partition that left** a captured table (detached or dropped): the catalog watch
  (:mod:`~replog.capture.watch`) writes a marker into the WAL when it sees the partition
  gone, and the rows are deleted where the stream meets it: the live rows of the
  collection that the partition's constraint selects and that the table does not hold
  now (a row inserted again since, into another partition, stays);
* a table whose changes the stream **missed** (a new slot in place of one that cannot be
  resumed, capture's publication dropped or left by the table): a marker written once the
  table is published again; where the stream meets it, the live rows of the collection
  the table does not hold now are deleted, and the table is snapshotted again after it.

In each case capture ends its batch just before that point (:class:`EndBefore`), so the
log holds every event before it; it then reads the collection's live rows back from the
log and puts a delete of each at the head of the next batch, which also holds the event
at that point: the deletes and that event land in one commit. What is owed and what is
done is kept in the snapshot plan (``resets``, ``removals``), so a restart finishes it.
The cost is one read of the log's events of that collection, once per such DDL.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from replog.capture.batch import Batch
from replog.capture.events import TRUNCATE_OPERATION, Event, EventMaker, event_id
from replog.capture.snapshot import RESYNC, SnapshotPlan
from replog.capture.source import MARKER_PREFIX, PostgresSource, Table
from replog.log import ReplicationLog
from replog.tables.changes import latest_events
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

RESET, REMOVAL = "reset", "removal"


class EndBefore(Exception):  # noqa: N818 - control flow of the capture loop, never escapes it
    """The batch must end before the transaction at ``commit_lsn``: rows that left the
    table (``what``) are deleted first."""

    def __init__(self, commit_lsn: int, what: str) -> None:
        super().__init__(commit_lsn)
        self.commit_lsn = commit_lsn
        self.what = what


_LIVE_COLUMNS = ["collection", "key", "data", "operation", "shard", "sequence"]
"""What a live row needs: its metadata (most of an event's bytes) is left out."""


def _of_collection(log: ReplicationLog, collection: str) -> Iterator[pa.RecordBatch]:
    for batch in log.scan():
        kept = batch.filter(pc.equal(batch.column("collection"), collection))
        if kept.num_rows:
            yield kept.select(_LIVE_COLUMNS)


def live_rows(log: ReplicationLog, collection: str) -> pa.Table | None:
    """The newest event of each key of ``collection`` that the log holds live: its newest
    event is no delete, and no truncate of the collection follows it on its shard (a
    truncate event is no row either); None when there is none."""
    latest = latest_events(_of_collection(log, collection))
    if latest is None:
        return None
    operation = latest.column("operation")
    truncates = latest.filter(pc.equal(operation, TRUNCATE_OPERATION))
    rows = latest.filter(pc.not_equal(operation, TRUNCATE_OPERATION))
    if truncates.num_rows:  # one key per shard: the newest truncate of each shard
        since = dict(zip(truncates.column("shard").to_pylist(),
                         truncates.column("sequence").to_pylist(), strict=True))  # fmt: skip
        after = [since.get(shard, -1) for shard in rows.column("shard").to_pylist()]
        rows = rows.filter(pc.greater(rows.column("sequence"), pa.array(after, pa.int64())))
    return rows if rows.num_rows else None


def live_keys(log: ReplicationLog, collection: str) -> list[str]:
    """The keys of ``collection`` whose newest event in the log is not a delete."""
    latest = live_rows(log, collection)
    return [] if latest is None else sorted(latest.column("key").to_pylist())


def deletes(
    maker: EventMaker,
    table: Table,
    keys: list[str],
    *,
    cause: dict[str, Any],
    identity: str,
    ts_ms: int,
    position: int,
) -> list[Event]:
    """A delete event of each of ``keys`` of ``table`` (its row as the key holds it),
    placed at ``position``; ``cause`` goes into ``source`` (``table_dropped``: the old
    table's id; ``partition_removed``: the partition's), ``identity`` into event ids."""
    source = {**maker.source_block(table, ts_ms, "false", None, position), **cause}
    metadata = maker.metadata_text(
        op="d", ts_ms=ts_ms, source=source, schema=maker.shape(table).digest
    )
    return [
        Event(
            event_id(f"{maker.slot}:{identity}:{key}"),
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


class Removals:
    """Deletes owed for rows that left captured tables (see the module docstring): what
    the plan owes, where the current batch must end, and the deletes ready for the next.

    ``changed`` says the plan changed (it is saved before the next commit)."""

    def __init__(self, source: PostgresSource, maker: EventMaker, log: ReplicationLog) -> None:
        self.source = source
        self.maker = maker
        self.log = log
        self.plan: SnapshotPlan | None = None
        self.changed = False
        self.end_before: int | None = None
        """End the next batch before the transaction at this position (deletes first)."""
        self.due: set[str] = set()
        """What the batch ended before: the resets and removals whose deletes are made next."""
        self.ready: dict[str, list[Event]] = {}
        """Deletes for the head of the next batch, by what they are for."""
        self._warned: set[int] = set()
        self.superseded: set[int] = set()
        """Ids of tables replaced under their name whose rows are deleted at the head of
        the batch: changes of theirs later in the stream are no longer the collection's
        (a table renamed away while another took its name, still written)."""

    # -- what is owed -------------------------------------------------------------------

    @property
    def owed(self) -> bool:
        """Deletes are owed at a point of the stream not read yet (a batch ended before
        it, or a marker of a partition's removal is still ahead): a capture that is not
        following reads on to it before it ends."""
        return self.end_before is not None or any(
            removal.get("done_at") is None
            for removal in (self.plan.removals if self.plan is not None else [])
        )

    def _reset(self, name: str) -> str:
        return f"{RESET}:{name}"

    def _removal(self, removal_id: str) -> str:
        return f"{REMOVAL}:{removal_id}"

    def first(self, table: Table, batch: Batch, commit_lsn: int) -> None:
        """Before an event of ``table`` in the transaction at ``commit_lsn``: if it is the
        first of a table that replaced a dropped one, the dropped table's rows must be
        deleted first, at the head of this batch; if they are not there yet, the batch
        ends before this transaction (:class:`EndBefore`)."""
        reset = self.plan.resets.get(table.qualified) if self.plan is not None else None
        if reset is None or reset.get("done_at") is not None or table.oid == reset["old_oid"]:
            return
        what = self._reset(table.qualified)
        if what not in batch.removed:
            raise EndBefore(commit_lsn, what)

    def marker(self, removal_id: str, batch: Batch, commit_lsn: int) -> None:
        """Where the stream meets the marker of a partition's removal: its rows are
        deleted here, at the head of this batch (else the batch ends before it)."""
        removal = self._owed_removal(removal_id)
        if removal is None:
            return  # done, or a marker of a run that was killed before writing it down
        what = self._removal(removal_id)
        if what not in batch.removed:
            raise EndBefore(commit_lsn, what)
        if removal.get("cause") != RESYNC:
            self.source.place_partition(int(removal["leaf"]), None)  # its later changes: not ours

    def _owed_removal(self, removal_id: str) -> dict[str, Any] | None:
        if self.plan is None:
            return None
        return next(
            (
                removal
                for removal in self.plan.removals
                if removal["id"] == removal_id and removal.get("done_at") is None
            ),
            None,
        )

    def stale(self, table: Table) -> None:
        """The stream missed changes of ``table``: its rows the log holds and the source
        no longer does are deleted where the stream meets a marker (:meth:`emit_owed`
        writes it: after the plan that owes it is saved)."""
        assert self.plan is not None
        self.plan.removals.append(
            {"id": uuid.uuid4().hex, "table": table.qualified, "leaf": table.oid,
             "constraint": "true", "columns": None, "done_at": None, "cause": RESYNC}
        )  # fmt: skip
        self.changed = True

    def emit_owed(self) -> None:
        """A marker into the WAL now for each resync owed whose marker the stream has not
        met: one written by a run killed before its plan was saved is lost, and one met
        twice is taken once."""
        for removal in self.plan.removals if self.plan is not None else []:
            if removal.get("cause") == RESYNC and removal.get("done_at") is None:
                self.source.emit_message(MARKER_PREFIX, json.dumps({"removal": removal["id"]}))

    # -- the batches --------------------------------------------------------------------

    def head(self, batch: Batch) -> None:
        """Put the deletes made ready at the head of ``batch``."""
        for what, made in self.ready.items():
            batch.add(made)
            batch.removed.append(what)
            kind, _, name = what.partition(":")
            reset = self.plan.resets.get(name) if kind == RESET and self.plan else None
            if reset is not None:
                self.superseded.add(int(reset["old_oid"] or 0))

    def replaced(self, table: Table) -> bool:
        """Whether ``table`` (a change's) was replaced under its name and its rows deleted
        before this point of the stream: its change is not captured (warned once)."""
        if table.oid not in self.superseded:
            return False
        if table.oid not in self._warned:
            self._warned.add(table.oid)
            logger.warning(
                "changes of table %d, which another table replaced as %s, are no longer "
                "captured (it was renamed away: capture follows the name)",
                table.oid,
                table.qualified,
            )
        return True

    def done(self, batch: Batch, position: int) -> None:
        """Write down, before ``batch``'s commit at ``position``, the deletes it carries."""
        assert self.plan is not None
        for what in batch.removed:
            kind, _, name = what.partition(":")
            if kind == RESET:
                self.plan.resets[name]["done_at"] = position
            else:
                removal = self._owed_removal(name)
                if removal is not None:
                    removal["done_at"] = position
            self.changed = True

    def prepare(self, position: int) -> bool:
        """Once a batch ended before the point where rows left a table, every event
        before it is in the log: read the collection's live rows back and make their
        deletes, for the head of the next batch. Whether there were any to make."""
        if self.end_before is None or self.plan is None:
            return False
        self.end_before = None
        self.ready = {}
        for what in sorted(self.due):
            kind, _, name = what.partition(":")
            made = self._reset_deletes(name, position) if kind == RESET else (
                self._removal_deletes(name, position)
            )  # fmt: skip
            if made is not None:
                self.ready[what] = made
        self.due = set()
        return True

    def _reset_deletes(self, name: str, position: int) -> list[Event] | None:
        assert self.plan is not None
        reset = self.plan.resets.get(name)
        if reset is None or reset.get("done_at") is not None:
            return None
        keys = live_keys(self.log, name)
        logger.warning(
            "%s was dropped and created again: deleting the %d rows of the dropped table "
            "(id %s) from the log before the new table's first event",
            name,
            len(keys),
            reset["old_oid"],
        )
        old_oid = int(reset["old_oid"] or 0)
        return deletes(
            self.maker,
            self.source.tables[name],
            keys,
            cause={"table_dropped": old_oid},
            identity=f"drop:{old_oid}",
            ts_ms=now_ms(),
            position=position,
        )

    def _removal_deletes(self, removal_id: str, position: int) -> list[Event] | None:
        removal = self._owed_removal(removal_id)
        table = self.source.tables.get(removal["table"]) if removal is not None else None
        if removal is None or table is None:
            return None
        rows = live_rows(self.log, table.qualified)
        keys = (
            []
            if rows is None
            else self.source.rows_of_partition(
                table, rows, removal["constraint"], removal.get("columns")
            )
        )
        resync = removal.get("cause") == RESYNC
        if resync:
            logger.warning("%s: deleting the %d rows of the log the source no longer holds",
                           table.qualified, len(keys))  # fmt: skip
        else:
            logger.warning(
                "partition %s left %s (detached or dropped): deleting its %d rows from the log",
                removal["leaf"],
                table.qualified,
                len(keys),
            )
        return deletes(
            self.maker,
            table,
            keys,
            cause={"resync" if resync else "partition_removed": int(removal["leaf"])},
            identity=f"partition:{removal_id}",
            ts_ms=now_ms(),
            position=position,
        )
