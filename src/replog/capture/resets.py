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

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from replog.capture.events import Event, EventMaker, event_id
from replog.capture.source import Table
from replog.log import ReplicationLog
from replog.tables.changes import latest_events


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
