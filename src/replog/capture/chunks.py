"""Snapshot chunks: rows of a table read between two watermarks in the WAL, reconciled
with the changes the stream meets inside that window.

DESIGN (Netflix's DBLog): for each chunk capture writes a *low watermark* into the WAL (a
logical message), reads the chunk, and writes a *high watermark*. When the stream meets
the low watermark it starts to drop from the chunk every row a change of the window
names (the change is as new as the row, or newer); at the high watermark the rows left
are emitted as read events (``op`` r).

A change of the window may lack values: under the default replica identity an update
that leaves a TOASTed column alone does not send it. Such a change stands for a row the
chunk read whole, so its unsent values are taken from the row image the key had last in
the window: the chunk's (read inside the window), or that of the key's previous change
in the window. Without that, no image downstream would ever hold the value.

The table moves while it is read: before each chunk the reader describes the table
anew from the catalog by its id (a column added, dropped, retyped, renamed; the table
renamed), and after reading it looks again; if the columns changed in between (or the
read failed on a column that went away), the chunk is read again between new
watermarks (the stream passes the old ones: no chunk carries them). A key column
retyped starts the table's snapshot again from its first key (key order may differ).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa

from replog.capture.chunk_sizes import ChunkSizes
from replog.capture.events import ChunkRows, EventMaker
from replog.capture.options import DEFAULT_CHUNK_ROWS
from replog.capture.reads import Key, RelationGone, TableRows, last_key, next_leaf, no_rows
from replog.capture.snapshot import PendingChunk, TableSnapshot, watermark_content
from replog.capture.source import WATERMARK_PREFIX, PostgresSource, Table
from replog.capture.workers import RangeReaders
from replog.errors import CaptureError
from replog.format.jsontext import parse_object

logger = logging.getLogger(__name__)

ATTEMPTS = 5
"""Reads of one chunk before capture gives up on a table whose columns change each time."""

_MOVED = (
    psycopg.errors.UndefinedColumn,
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedFunction,
    RelationGone,
)
"""What a read meets when the table changed under it: the relation or a column gone, a
key column retyped so that its old type's bound no longer compares with it (``text >
integer``)."""
_CHANGED = (psycopg.errors.UndefinedColumn, psycopg.errors.UndefinedFunction)
"""Of those, the ones taken as a change only when the catalog shows it (else raised: a
query of capture's that is wrong must not pass for DDL)."""


@dataclass
class Chunk:
    """A chunk in flight: its rows, read between its watermarks, as read events by key."""

    snapshot: TableSnapshot
    table: Table
    mark: str
    """Names this chunk's watermarks (they carry it)."""
    low_lsn: int
    high_lsn: int
    events: ChunkRows
    """Key -> the read event of the row, in key order."""
    after: Key | None
    leaf: int
    block: int
    finished: bool
    filenode: int = 0
    """Physical order: the storage of ``leaf`` that ``block`` counts in."""
    low_seen: bool = False
    metadata: str = ""
    """The metadata every read event of the chunk carries."""
    ts_ms: int = 0
    images: dict[str, str] = field(default_factory=dict)
    """Key -> the row image its newest change of the window left (the chunk's read
    image before that): where a later change's unsent values come from."""

    def stood_for(self, key: str, data: str) -> None:
        """A change of the window with row image ``data`` names ``key``: it stands for
        the row the chunk read (dropped from the chunk), and is the image the key's next
        change takes unsent values from."""
        if not self.low_seen:
            return
        read = self.events.pop(key, None)
        if read is not None or key in self.images:
            self.images[key] = data

    def unsent(self, key: str, columns: list[str]) -> dict[str, str]:
        """The JSON text of ``columns`` in the image ``key`` had last in the window (none
        before the low watermark, or for a key the chunk did not read)."""
        if not self.low_seen:
            return {}
        image = self.images.get(key)
        if image is None:
            read = self.events.get(key)
            image = read.data if read is not None else None
        if image is None:
            return {}
        members = parse_object(image)
        return {name: members[name].text for name in columns if name in members}

    def pending(self, position: int) -> PendingChunk:
        return PendingChunk(
            position,
            self.table.qualified,
            self.after,
            self.leaf,
            self.block,
            len(self.events),
            self.finished,
            self.snapshot.relation,
            self.filenode,
        )


class ChunkReader:
    """Reads chunks of captured tables on a session of its own, each between the two
    watermarks it writes, into read events (:class:`~replog.capture.events.EventMaker`).
    With ``workers`` > 1 (:mod:`~replog.capture.workers`), a chunk of a table read in key
    order is several ranges read at once by processes of their own (started at the first
    such chunk)."""

    def __init__(
        self,
        source: PostgresSource,
        maker: EventMaker,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        workers: int = 1,
    ) -> None:
        self.source = source
        self.maker = maker
        self.sizes = ChunkSizes(chunk_rows)
        self.worker_count = workers
        self._workers: RangeReaders | None = None
        self._connection: psycopg.Connection[Any] | None = None
        self._rows: TableRows | None = None

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    @property
    def rows(self) -> TableRows:
        if self._rows is None:
            self._connection = self.source.reader()
            self._rows = TableRows(self.source, self._connection)
        return self._rows

    def read(self, snapshot: TableSnapshot, table: Table) -> Chunk | None:
        """The next chunk of ``snapshot`` (of ``table``, described anew), read between
        its watermarks; None if the table (or the partition read) left meanwhile."""
        for _ in range(ATTEMPTS):
            described = self._describe(snapshot, table)
            if described is None:
                return None
            table = described
            mark = uuid.uuid4().hex
            low = self.source.emit_message(WATERMARK_PREFIX, watermark_content(mark, "low"))
            try:
                read = self._read(snapshot, table, low)
            except _MOVED as exc:
                if isinstance(exc, _CHANGED) and not self._moved(snapshot, table):
                    raise
                logger.info("%s changed while a chunk was read (%s): read again", snapshot.name,
                            str(exc).strip().splitlines()[0])  # fmt: skip
                continue
            if self._moved(snapshot, table):
                logger.info("%s changed while a chunk was read: read again",
                            snapshot.name)  # fmt: skip
                continue
            events, after, (leaf, block, filenode), finished = read
            high = self.source.emit_message(WATERMARK_PREFIX, watermark_content(mark, "high"))
            return Chunk(
                snapshot, table, mark, low, high, events, after, leaf, block, finished, filenode
            )
        raise CaptureError(
            f"the columns of {table.qualified} changed during each of {ATTEMPTS} reads of a "
            f"snapshot chunk: capture stops rather than read rows of a shape it cannot name "
            f"(start it again once the DDL on the table is done)"
        )

    def _moved(self, snapshot: TableSnapshot, table: Table) -> bool:
        """Whether ``table`` changed since it was described: its columns (or the table
        gone), or the partition the snapshot reads no longer one of its leaves."""
        return self.source.columns_of(table.oid) != table.columns or bool(
            snapshot.relation and not self.source.is_leaf_of(snapshot.relation, table.oid)
        )

    def _describe(self, snapshot: TableSnapshot, table: Table) -> Table | None:
        """``table`` as the catalog has it now (None: dropped, or the partition the
        snapshot reads dropped or detached: its rows are no longer the table's); a key
        column retyped starts its snapshot again from the first key."""
        described = self.source.refresh_columns(table)
        if described is None:
            return None
        if snapshot.relation and not self.source.is_leaf_of(snapshot.relation, table.oid):
            return None
        if _key_types(described) != _key_types(table) and snapshot.after is not None:
            logger.warning(
                "a key column of %s was retyped while its snapshot ran: the snapshot starts "
                "again from its first key (the new type may order keys otherwise)",
                table.qualified,
            )
            snapshot.after = None
        return described

    def _read(
        self, snapshot: TableSnapshot, table: Table, low: int
    ) -> tuple[ChunkRows, Key | None, Block, bool]:
        """The chunk's read events, the last key read (key order) or the next block
        (physical order), and whether the table (or partition) was read to its end."""
        relation = snapshot.relation or table.oid
        chunk_rows = self.sizes.rows(table.qualified)
        if not table.key_indexed:
            rows, block, finished = self._by_block(snapshot, table, relation, chunk_rows)
            self.sizes.learn(table.qualified, rows.num_rows, rows.nbytes)
            return self.maker.reads(table, rows, low), None, block, finished
        if self.worker_count > 1:
            events, after, finished = self._by_key_ranges(
                snapshot, table, relation, low, chunk_rows
            )
            return events, after, _NO_BLOCK, finished
        rows = self.rows.key_range(table, relation, snapshot.after, None, chunk_rows)
        self.sizes.learn(table.qualified, rows.num_rows, rows.nbytes)
        after = last_key(table, rows) or snapshot.after
        finished = rows.num_rows < chunk_rows
        return self.maker.reads(table, rows, low), after, _NO_BLOCK, finished

    def _by_key_ranges(
        self, snapshot: TableSnapshot, table: Table, relation: int, low: int, chunk_rows: int
    ) -> tuple[ChunkRows, Key | None, bool]:
        """The next ``workers`` x ``chunk_rows`` rows, cut into ranges at every
        ``chunk_rows``-th key (the last range ending at the table's last key when fewer
        are left), read by the workers at once."""
        if self._workers is None:
            self._workers = RangeReaders(self.source.options, self.worker_count)
        count = self._workers.count
        cuts, last = self.rows.key_cuts(table, relation, snapshot.after, chunk_rows, count)
        ends = [*cuts, last] if last is not None and last not in cuts else cuts
        if not ends:
            return ChunkRows.empty(), snapshot.after, True
        starts = [snapshot.after, *ends[:-1]]
        found = self._workers.read(table, relation, list(zip(starts, ends, strict=True)), low)
        events = ChunkRows.joined([reads for reads, _ in found])
        self.sizes.learn(table.qualified, len(events), events.nbytes)
        return events, ends[-1], len(cuts) < count

    def _by_block(
        self, snapshot: TableSnapshot, table: Table, relation: int, chunk_rows: int
    ) -> tuple[pa.Table, Block, bool]:
        """A table whose key is no unique index of NOT NULL columns is read in physical
        order, a range of blocks of one leaf relation at a time, leaves in the order of
        their ids (the plan names the one being read by its id, and the storage its
        blocks count in: a leaf rewritten since is read again from its first block)."""
        leaves = self.rows.leaves(relation)
        leaf, block, filenode = snapshot.leaf, snapshot.block, snapshot.filenode
        if leaf not in leaves:  # none read yet, or detached: the next one by id
            leaf, block, filenode = next_leaf(leaves, leaf) or 0, 0, 0
        while leaf:
            try:
                rows, end, filenode = self.rows.blocks(table, leaf, block, chunk_rows, filenode)
            except RelationGone:  # detached and dropped between two looks
                rows, end = no_rows(table), block
            if rows.num_rows or end > block:
                return rows, (leaf, end, filenode), False
            leaf, block, filenode = next_leaf(leaves, leaf) or 0, 0, 0
        return no_rows(table), _NO_BLOCK, True


Block = tuple[int, int, int]
"""Physical order: the leaf relation read, its next block, and the storage
(``relfilenode``) that block counts in."""
_NO_BLOCK: Block = (0, 0, 0)


def _key_types(table: Table) -> list[tuple[int, int]]:
    types = {name: (type_oid, modifier) for name, type_oid, modifier in table.columns}
    return [types.get(name, (0, -1)) for name in table.key]
