"""Snapshots of captured tables, chunk by chunk, interleaved with the change stream.

DESIGN (Netflix's DBLog; Debezium's incremental snapshots): a table is read in chunks of
a few thousand rows, in key order. For each chunk capture writes a *low watermark* into
the WAL (a logical message), selects the chunk, and writes a *high watermark*. When the
change stream meets the low watermark it starts to drop from the chunk every row a
change of the window names (the change is as new as the row, or newer); at the high
watermark the rows left are emitted as read events (``op`` r), in that commit of the
log. So no snapshot is held open (nothing blocks VACUUM), the stream never stops, and
each chunk is an idempotent commit of the capture like any other.

How far each snapshot got lives in :class:`SnapshotPlan`, a sealed record of the log
(``_replog/captures/<slot>.json``). It is written before the commit that carries a chunk,
naming the commit's position: a restart finds the chunk done if the log holds that
position, else reads it again (at most one chunk is redone per kill, and it was never
committed). Tables wait in a queue: those of the initial snapshot, a table added to the
capture later, one the user asks for (a signal in the WAL, :data:`SIGNAL_PREFIX`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from psycopg import sql

from replog.capture.events import EventMaker, Read
from replog.capture.options import DEFAULT_CHUNK_ROWS
from replog.capture.pgoutput import lsn_to_int
from replog.capture.source import (
    SIGNAL_PREFIX,
    WATERMARK_PREFIX,
    PostgresSource,
    Table,
    connect,
    qualified_name,
    text_rows,
)
from replog.errors import CaptureError, CorruptionError, InvalidOptionError, LogIdentityError
from replog.format.sealed import seal, unseal
from replog.storage import Storage

if TYPE_CHECKING:
    from replog.capture.workers import RangeReaders
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

PLAN_VERSION = 1
CAPTURES_DIR = "_replog/captures"
INITIAL, ADDED, REQUESTED, RECREATED = "initial", "added", "requested", "recreated"
_KEPT_SIGNALS = 100
_KEPT_FINISHED = 20

__all__ = ["SIGNAL_PREFIX", "WATERMARK_PREFIX", "Chunk", "SnapshotPlan", "TableSnapshot"]


def plan_path(slot: str) -> str:
    return f"{CAPTURES_DIR}/{slot}.json"


@dataclass
class TableSnapshot:
    """One table's snapshot: why it is taken and how far it got (what is committed)."""

    table: str
    """The table's ``schema.table`` (its collection)."""
    oid: int
    reason: str
    """``initial``, ``added`` (joined the capture later), ``requested`` (a signal),
    ``recreated`` (dropped and created again under its name)."""
    after: list[str | None] | None = None
    """Key order: the key (each column's text) of the last row read; None: none yet."""
    leaf: int = 0
    """Physical order: which leaf relation of the table is being read."""
    block: int = 0
    """Physical order: the next block of that relation to read."""
    rows: int = 0
    chunks: int = 0
    estimate: int = 0
    """Rows the table had when its snapshot began (``pg_class.reltuples``)."""
    started_ms: int = 0

    @property
    def kind(self) -> str:
        """``source.snapshot`` of its read events, as Debezium writes it."""
        return "true" if self.reason == INITIAL else "incremental"


@dataclass
class PendingChunk:
    """A chunk about to be committed at ``position``: how far its table then got."""

    position: int
    table: str
    after: list[str | None] | None
    leaf: int
    block: int
    rows: int
    finished: bool


@dataclass
class SnapshotPlan:
    """The snapshots a capture owes, kept in the log beside its events."""

    slot: str
    log_id: str
    queue: list[TableSnapshot] = field(default_factory=list)
    pending: PendingChunk | None = None
    tables: dict[str, int] = field(default_factory=dict)
    """The tables (name -> id) this capture captured when it last wrote the plan."""
    signals: list[str] = field(default_factory=list)
    """Ids of the latest signals taken (a signal read again after a kill is not taken
    twice)."""
    finished: list[dict[str, Any]] = field(default_factory=list)
    """The latest snapshots that ended: table, reason, rows, chunks, times."""
    resets: dict[str, dict[str, int | None]] = field(default_factory=dict)
    """Tables dropped and created again under a captured name -> ``old_oid`` (the dropped
    table's id) and ``done_at`` (the position of the commit that deletes its rows, once
    one is made): the rows of the dropped table are deleted before the first event of
    the new one."""

    # -- storage -----------------------------------------------------------------------

    @classmethod
    def load(cls, storage: Storage, slot: str, log_id: str) -> SnapshotPlan | None:
        """The plan stored for ``slot`` (None if there is none)."""
        path = plan_path(slot)
        data = storage.read_optional(path)
        if data is None:
            return None
        body = unseal(data, storage.path(path), max_version=PLAN_VERSION)
        if body.get("log_id") != log_id:
            raise LogIdentityError(
                f"{storage.path(path)} belongs to log {body.get('log_id')!r}, not to "
                f"{log_id!r}: the log was re-created with a stale capture record in it"
            )
        try:
            pending = body.get("pending")
            return cls(
                slot=body["slot"],
                log_id=body["log_id"],
                queue=[TableSnapshot(**item) for item in body["queue"]],
                pending=PendingChunk(**pending) if pending else None,
                tables=dict(body["tables"]),
                signals=list(body["signals"]),
                finished=list(body["finished"]),
                resets=dict(body.get("resets", {})),
            )
        except (KeyError, TypeError) as exc:
            raise CorruptionError(storage.path(path), f"malformed capture plan: {exc}") from exc

    def save(self, storage: Storage) -> None:
        document = {"format_version": PLAN_VERSION, **asdict(self)}
        storage.write(plan_path(self.slot), seal(document))

    # -- the queue -----------------------------------------------------------------------

    @property
    def current(self) -> TableSnapshot | None:
        return self.queue[0] if self.queue else None

    def queued(self, table: str) -> bool:
        return any(item.table == table for item in self.queue)

    def enqueue(self, table: Table, reason: str, estimate: int) -> bool:
        """Snapshot ``table`` after those queued; False if it is queued already."""
        if self.queued(table.qualified):
            return False
        self.queue.append(
            TableSnapshot(table.qualified, table.oid, reason, estimate=estimate, started_ms=0)
        )
        logger.info("snapshot of %s queued (%s)", table.qualified, reason)
        return True

    def drop(self, table: str) -> None:
        """Stop snapshotting ``table`` (it was dropped)."""
        self.queue = [item for item in self.queue if item.table != table]
        if self.pending is not None and self.pending.table == table:
            self.pending = None

    def took_signal(self, signal_id: str) -> bool:
        """Whether signal ``signal_id`` was taken before; notes it as taken."""
        if signal_id in self.signals:
            return True
        self.signals = [*self.signals, signal_id][-_KEPT_SIGNALS:]
        return False

    # -- chunks --------------------------------------------------------------------------

    def resolve(self, position: int) -> bool:
        """Settle what was written down for a commit once the log is known to hold
        ``position``: the pending chunk and the resets are done if their commit is at or
        below it, else they are owed again. Whether anything changed."""
        changed = False
        for name, reset in list(self.resets.items()):
            done_at = reset.get("done_at")
            if done_at is not None:
                changed = True
                if done_at <= position:
                    del self.resets[name]
                else:
                    reset["done_at"] = None
        return self._resolve_chunk(position) or changed

    def _resolve_chunk(self, position: int) -> bool:
        pending = self.pending
        if pending is None:
            return False
        self.pending = None
        if position < pending.position:
            logger.info(
                "a chunk of %s was not committed (the log is at %d, it was to be at %d): "
                "it is read again",
                pending.table,
                position,
                pending.position,
            )
            return True
        current = self.current
        if current is None or current.table != pending.table:
            return True
        current.after, current.leaf, current.block = pending.after, pending.leaf, pending.block
        current.rows += pending.rows
        current.chunks += 1
        if pending.finished:
            self.queue.pop(0)
            self.finished = [
                *self.finished,
                {
                    "table": current.table,
                    "reason": current.reason,
                    "rows": current.rows,
                    "chunks": current.chunks,
                    "started_ms": current.started_ms,
                    "finished_ms": now_ms(),
                },
            ][-_KEPT_FINISHED:]
            logger.info(
                "snapshot of %s done: %d rows in %d chunks",
                current.table,
                current.rows,
                current.chunks,
            )
        return True


@dataclass
class Chunk:
    """A chunk in flight: its rows, read between its watermarks, as read events by key."""

    snapshot: TableSnapshot
    table: Table
    mark: str
    """Names this chunk's watermarks (they carry it)."""
    low_lsn: int
    high_lsn: int
    events: dict[str, Read]
    """Key -> the read event of the row, in key order."""
    after: list[str | None] | None
    leaf: int
    block: int
    finished: bool
    low_seen: bool = False
    metadata: str = ""
    """The metadata every read event of the chunk carries."""
    ts_ms: int = 0

    def drop(self, key: str) -> None:
        """A change inside the window names ``key``: the stream's event stands for it."""
        if self.low_seen:
            self.events.pop(key, None)

    def pending(self, position: int) -> PendingChunk:
        return PendingChunk(
            position,
            self.table.qualified,
            self.after,
            self.leaf,
            self.block,
            len(self.events),
            self.finished,
        )


def watermark(content: bytes) -> tuple[str, str] | None:
    """(chunk mark, ``low`` or ``high``) of a watermark message (None: not one)."""
    try:
        body = json.loads(content)
        return str(body["chunk"]), str(body["side"])
    except (ValueError, KeyError, TypeError):
        return None


def signal(content: bytes, slot: str) -> tuple[str, list[str]] | None:
    """(signal id, tables to snapshot) of a signal message for ``slot`` (None: a signal
    for another capture); ``ValueError`` for one that cannot be read."""
    body = json.loads(content)
    if not isinstance(body, dict):
        raise ValueError("a signal is a JSON object")
    target = body.get("slot")
    if target not in (None, "*", slot):
        return None
    tables = body.get("snapshot")
    if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables):
        raise ValueError('a signal names the tables to snapshot: {"snapshot": ["schema.table"]}')
    signal_id = body.get("id")
    return str(signal_id) if signal_id else content.decode(), tables


def signal_content(tables: Sequence[str], slot: str | None) -> str:
    """The content of a signal asking the capture of ``slot`` (every capture: None) to
    snapshot ``tables``."""
    body: dict[str, Any] = {"id": uuid.uuid4().hex, "snapshot": list(tables)}
    if slot is not None:
        body["slot"] = slot
    return json.dumps(body)


def request_snapshot(dsn: str, tables: Sequence[str], slot: str | None = None) -> int:
    """Ask the capture of ``slot`` (every capture of the database: None) to snapshot
    ``tables`` while it streams: a signal written into the WAL, so the capture meets it in
    order with the changes, whether it runs now or starts later. Its LSN.

    The same as ``SELECT pg_logical_emit_message(true, 'replog.signal',
    '{"snapshot": ["public.orders"], "slot": "shop"}')`` (``replog snapshot``)."""
    if not tables:
        raise InvalidOptionError("name the tables to snapshot")
    with connect(dsn) as connection:
        row = connection.execute(
            "SELECT pg_logical_emit_message(true, %s, %s)::text",
            (SIGNAL_PREFIX, signal_content([qualified_name(t) for t in tables], slot)),
        ).fetchone()
    assert row is not None
    return lsn_to_int(row[0])


class ChunkReader:
    """Reads chunks of captured tables on a session of its own, each between the two
    watermarks it writes, into read events (:class:`~replog.capture.events.EventMaker`).
    With ``workers`` (:mod:`~replog.capture.workers`), a chunk of a table read in key order
    is several ranges read at once by processes of their own."""

    def __init__(
        self,
        source: PostgresSource,
        maker: EventMaker,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        self.source = source
        self.maker = maker
        self.chunk_rows = chunk_rows
        self.workers: RangeReaders | None = None
        """Set when the snapshot needs them (they are processes: started late)."""
        self._leaves: dict[int, list[tuple[int, str]]] = {}

    def read(self, snapshot: TableSnapshot, table: Table, connection: Any) -> Chunk:
        """Write the low watermark, read the next chunk of ``table``, write the high one:
        the chunk with its read events, named by the low watermark's position."""
        mark = uuid.uuid4().hex
        low = self.source.emit_message(WATERMARK_PREFIX, _mark(mark, "low"))
        if table.key_indexed and self.workers is not None:
            events, after, finished = self._by_key_ranges(snapshot, table, connection, low)
            leaf = block = 0
        else:
            if table.key_indexed:
                rows, after, leaf, block, finished = self._by_key(snapshot, table, connection)
            else:
                rows, after, leaf, block, finished = self._by_block(snapshot, table, connection)
            events = self.maker.reads(table, rows, low)
        high = self.source.emit_message(WATERMARK_PREFIX, _mark(mark, "high"))
        return Chunk(snapshot, table, mark, low, high, events, after, leaf, block, finished)

    def _select(self, table: Table, relation: sql.Composable) -> sql.Composed:
        columns = sql.SQL(", ").join(sql.Identifier(name) for name, _, _ in table.columns)
        return sql.SQL("SELECT {} FROM {}").format(columns, relation)

    def key_range(
        self,
        table: Table,
        connection: Any,
        after: list[str | None] | None,
        upto: list[str | None] | None,
        limit: int | None,
    ) -> list[tuple[str | None, ...]]:
        """Rows of ``table`` with keys after ``after`` (None: from the first) up to and
        including ``upto`` (None: no bound), in key order, at most ``limit``."""
        keys = sql.SQL(", ").join(sql.Identifier(name) for name in table.key)
        query = self._select(table, self._relation(connection, table.oid))
        conditions: list[sql.Composable] = []
        params: list[Any] = []
        if after is not None:
            conditions.append(sql.SQL("({}) > ({})").format(keys, self.source.key_bound(table)))
            params.extend(after)
        if upto is not None:
            conditions.append(sql.SQL("({}) <= ({})").format(keys, self.source.key_bound(table)))
            params.extend(upto)
        if conditions:
            query = sql.SQL("{} WHERE {}").format(query, sql.SQL(" AND ").join(conditions))
        query = sql.SQL("{} ORDER BY {}").format(query, keys)
        if limit is not None:
            query = sql.SQL("{} LIMIT {}").format(query, sql.Literal(limit))
        return text_rows(connection, query, params)

    def _by_key(
        self, snapshot: TableSnapshot, table: Table, connection: Any
    ) -> tuple[list[tuple[str | None, ...]], list[str | None] | None, int, int, bool]:
        rows = self.key_range(table, connection, snapshot.after, None, self.chunk_rows)
        after = table.key_of(rows[-1]) if rows else snapshot.after
        return rows, after, 0, 0, len(rows) < self.chunk_rows

    def _by_key_ranges(
        self, snapshot: TableSnapshot, table: Table, connection: Any, low: int
    ) -> tuple[dict[str, Read], list[str | None] | None, bool]:
        """The next ``workers`` x ``chunk_rows`` rows, cut into ranges at every
        ``chunk_rows``-th key and read by the workers at once."""
        assert self.workers is not None
        count = self.workers.count
        keys = sql.SQL(", ").join(sql.Identifier(name) for name in table.key)
        inner = sql.SQL("SELECT {}, row_number() OVER (ORDER BY {}) AS n FROM {}").format(
            keys, keys, self._relation(connection, table.oid)
        )
        params: list[Any] = []
        if snapshot.after is not None:
            inner = sql.SQL("{} WHERE ({}) > ({})").format(
                inner, keys, self.source.key_bound(table)
            )
            params = list(snapshot.after)
        inner = sql.SQL("{} ORDER BY {} LIMIT {}").format(
            inner, keys, sql.Literal(count * self.chunk_rows)
        )
        cuts = [
            list(row[:-1])
            for row in text_rows(
                connection,
                sql.SQL("SELECT * FROM ({}) s WHERE n %% {} = 0 ORDER BY n").format(
                    inner, sql.Literal(self.chunk_rows)
                ),
                params,
            )
        ]
        bounds: list[list[str | None] | None] = [snapshot.after, *cuts]
        ranges = list(zip(bounds, [*cuts, None], strict=True))
        if len(cuts) == count:
            ranges = ranges[:-1]  # a full chunk of every worker: the rest is the next's
        found = self.workers.read(table, ranges, low)
        events: dict[str, Read] = {}
        last = snapshot.after
        for reads, range_last in found:
            events.update(reads)
            last = range_last or last
        return events, last, len(cuts) < count

    @staticmethod
    def _relation(connection: Any, oid: int) -> sql.Composable:
        """Relation ``oid`` as the chunk reads it: ``ONLY`` a plain table (inheritance
        children are published as themselves), a partitioned table with its partitions
        (published through it)."""
        row = connection.execute(
            "SELECT c.relkind, quote_ident(n.nspname) || '.' || quote_ident(c.relname)"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
            (oid,),
        ).fetchone()
        if row is None:
            raise CaptureError(f"relation {oid} was dropped while its snapshot was taken")
        only = sql.SQL("ONLY ") if row[0] == "r" else sql.SQL("")
        return sql.SQL("{}{}").format(only, sql.SQL(row[1]))

    def _by_block(
        self, snapshot: TableSnapshot, table: Table, connection: Any
    ) -> tuple[list[tuple[str | None, ...]], list[str | None] | None, int, int, bool]:
        """A table whose key is no unique index of NOT NULL columns is read in physical
        order, a range of blocks of one leaf relation at a time."""
        leaves = self._leaves.get(table.oid)
        if leaves is None:
            leaves = [
                (int(oid), "")
                for (oid,) in connection.execute(
                    "SELECT relid::oid FROM pg_partition_tree(%s) WHERE isleaf ORDER BY 1",
                    (table.oid,),
                ).fetchall()
            ] or [(table.oid, "")]
            self._leaves[table.oid] = leaves
        leaf, block = snapshot.leaf, snapshot.block
        while leaf < len(leaves):
            oid = leaves[leaf][0]
            blocks, per_block = connection.execute(
                "SELECT pg_relation_size(%s) / current_setting('block_size')::int,"
                " CASE WHEN relpages > 0 THEN greatest(reltuples / relpages, 1) ELSE 100 END"
                " FROM pg_class WHERE oid = %s",
                (oid, oid),
            ).fetchone()
            if block >= blocks:
                leaf, block = leaf + 1, 0
                continue
            step = max(1, int(self.chunk_rows / per_block))
            query = sql.SQL("{} WHERE ctid >= %s::tid AND ctid < %s::tid").format(
                self._select(table, self._relation(connection, oid))
            )
            rows = text_rows(connection, query, (f"({block},0)", f"({block + step},0)"))
            return rows, None, leaf, block + step, False
        return [], None, leaf, 0, True


def _mark(chunk: str, side: str) -> str:
    return json.dumps({"chunk": chunk, "side": side})
