"""``TRUNCATE`` as data: events that empty a table, or exactly one partition of it, at the
point of the stream where the source did.

DESIGN: pgoutput sends a TRUNCATE as its own message naming the relations it emptied
(capture's own publication publishes partitions as themselves, so a TRUNCATE of one
partition is in the stream too; through a root PostgreSQL sends none).

* A **table** emptied (or every partition of a partitioned one): one ``truncate`` event
  on each shard of the log (:meth:`~replog.capture.events.EventMaker.truncates`). Each
  shard orders it with the events of its own keys, so a reader that cuts its batches
  across shards anywhere still removes exactly the rows older than the TRUNCATE.
* **Some partitions** of a partitioned table: a delete of each row they held, at that
  point of the transaction. Which rows: the collection's live rows (the log's, then those
  of this batch before the TRUNCATE, then a snapshot chunk's in flight) that each
  partition's constraint selects, judged by the server. Every row the log holds before the
  transaction must be there to judge, so a batch that holds earlier transactions ends
  before it (:class:`~replog.capture.removals.EndBefore`) and the next one starts with it.
* ``--skip-truncate``: warned about and counted, for partitions too (before 0.6).

A chunk in flight whose window the TRUNCATE falls in loses the rows it removed: the rows
were read before it, and emitting them after it would bring them back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replog.capture.batch import Batch
from replog.capture.chunks import Chunk
from replog.capture.events import TRUNCATE_OPERATION, EventMaker
from replog.capture.options import CaptureOptions
from replog.capture.pgoutput import SourceTransaction, Truncation, lsn_to_text
from replog.capture.progress import CaptureProgress
from replog.capture.removals import EndBefore, deletes, live_rows
from replog.capture.snapshot import SnapshotPlan
from replog.capture.source import PostgresSource, Table
from replog.capture.stream import Relations
from replog.errors import CaptureError
from replog.log import ReplicationLog
from replog.tables.changes import DELETE, last_per_key

logger = logging.getLogger(__name__)

TRUNCATE = "truncate"
"""What an :class:`EndBefore` is for when a partition's TRUNCATE needs the log whole."""


class Truncations:
    """Turns the stream's TRUNCATE messages into events (see the module docstring)."""

    def __init__(self, relations: Relations, maker: EventMaker, log: ReplicationLog) -> None:
        self.relations = relations
        self.source: PostgresSource = relations.source
        self.options: CaptureOptions = relations.options
        self.progress: CaptureProgress = relations.progress
        self.maker = maker
        self.log = log
        self.plan: SnapshotPlan | None = None

    def take(
        self,
        truncation: Truncation,
        txn: SourceTransaction,
        *,
        order: int,
        batch: Batch,
        chunk: Chunk | None,
    ) -> int:
        """Add the events of ``truncation`` (in ``txn``) to ``batch``; the next event's
        order number in the transaction."""
        emptied: dict[str, tuple[Table, set[int]]] = {}
        for relation in truncation.relations:
            table = self.relations.table_of(relation, txn)
            if table is not None:
                emptied.setdefault(table.qualified, (table, set()))[1].add(relation.oid)
        for table, oids in emptied.values():
            in_window = chunk if chunk is not None and chunk.table.oid == table.oid else None
            if self.options.skip_truncate:
                self._skip(table, txn, truncation.lsn, oids)
            elif table.oid in oids or self._every_partition(table, oids):
                batch.add(
                    self.maker.truncates(
                        table, txn, lsn=truncation.lsn, order=order, ts_ms=txn.commit_ms,
                        shards=self.log.shards,
                    )
                )  # fmt: skip
                order += 1
                self.progress.truncations += 1
                if in_window is not None and in_window.low_seen:
                    in_window.events.clear()
                    in_window.images.clear()
                logger.info("TRUNCATE of %s (transaction %d, LSN %s) captured",
                            table.qualified, txn.xid, lsn_to_text(truncation.lsn))  # fmt: skip
            else:
                order = self._partitions(table, sorted(oids), txn, truncation.lsn, order, batch,
                                         in_window)  # fmt: skip
        return order

    def _every_partition(self, table: Table, oids: set[int]) -> bool:
        leaves = self.plan.partitions.get(table.qualified) if self.plan is not None else None
        return leaves is not None and {int(leaf) for leaf in leaves} <= oids

    def _partitions(  # noqa: PLR0917 - the truncation's place in the stream
        self,
        table: Table,
        leaves: Sequence[int],
        txn: SourceTransaction,
        lsn: int,
        order: int,
        batch: Batch,
        chunk: Chunk | None,
    ) -> int:
        """Deletes of the rows ``leaves`` (partitions of ``table``) held at this point."""
        if batch.transactions:  # the log must hold every transaction before this one
            raise EndBefore(txn.commit_lsn, TRUNCATE)
        rows = self._live(table, batch, chunk)
        known = self.plan.partitions.get(table.qualified, {}) if self.plan is not None else {}
        missing = [str(leaf) for leaf in leaves if str(leaf) not in known]
        constraints = {**known, **(self.source.partition_constraints(missing) or {})}
        keys: list[str] = []
        for leaf in leaves:
            constraint = constraints.get(str(leaf))
            if constraint is None:
                raise CaptureError(
                    f"TRUNCATE of partition {leaf} of {table.qualified} (transaction {txn.xid}, "
                    f"LSN {lsn_to_text(lsn)}): the partition is gone and capture never saw its "
                    f"bound, so it cannot tell which rows it held. Nothing of this batch was "
                    f"committed; --skip-truncate passes it over (tables built from the log "
                    f"keep those rows)"
                )
            if rows.num_rows:
                keys.extend(self.source.rows_of_partition(table, rows, constraint, keep_held=True))
        found = sorted(set(keys))
        batch.add(
            deletes(
                self.maker, table, found,
                cause={"partition_truncated": list(leaves)},
                identity=f"truncate:{txn.commit_lsn}:{order}", ts_ms=txn.commit_ms, position=lsn,
            )
        )  # fmt: skip
        if chunk is not None and chunk.low_seen:
            for key in found:
                chunk.events.pop(key, None)
                chunk.images.pop(key, None)
        self.progress.truncations += 1
        logger.info(
            "TRUNCATE of partition(s) %s of %s (transaction %d, LSN %s): %d rows deleted",
            ", ".join(map(str, leaves)), table.qualified, txn.xid, lsn_to_text(lsn), len(found),
        )  # fmt: skip
        return order + 1

    def _live(self, table: Table, batch: Batch, chunk: Chunk | None) -> pa.Table:
        """Each key of the collection the source may hold here, with its newest image
        (``key``, ``data``): the log's live rows, this batch's, a chunk's in flight. A
        truncate of the table earlier in this batch leaves only what follows it; a key
        whose newest event is a delete is held by no partition."""
        parts = []
        logged = live_rows(self.log, table.qualified)
        if logged is not None:
            parts.append(logged.select(["key", "data", "operation"]))
        for held in batch.rows_of(table.qualified):
            truncated = np.flatnonzero(pc.equal(held.column("operation"), TRUNCATE_OPERATION))
            if truncated.size:  # the table's TRUNCATE (its copies are together): after it
                parts = []
            parts.append(held.slice(int(truncated[-1]) + 1 if truncated.size else 0).select(
                ["key", "data", "operation"]
            ))  # fmt: skip
        if chunk is not None and chunk.low_seen and chunk.events:
            reads = list(chunk.events.values())
            parts.append(
                pa.table(
                    {
                        "key": pa.array([read.key for read in reads], pa.string()),
                        "data": pa.array([read.data for read in reads], pa.string()).cast(
                            pa.binary()
                        ),
                        "operation": pa.array(["insert"] * len(reads), pa.string()),
                    }
                )
            )
        if not parts:
            return pa.table({"key": pa.array([], pa.string()), "data": pa.array([], pa.binary())})
        every = pa.concat_tables([part.cast(parts[0].schema) for part in parts])
        newest = every.take(last_per_key(every, ["key"]))
        return newest.filter(pc.not_equal(newest.column("operation"), DELETE)).select(
            ["key", "data"]
        )

    def _skip(self, table: Table, txn: SourceTransaction, lsn: int, oids: set[int]) -> None:
        self.progress.skipped_truncations += 1
        logger.warning(
            "TRUNCATE of %s%s (transaction %d, LSN %s) is not captured (--skip-truncate): "
            "tables built from the log keep the rows the source removed",
            table.qualified,
            "" if table.oid in oids else f" (partitions {', '.join(map(str, sorted(oids)))})",
            txn.xid,
            lsn_to_text(lsn),
        )
