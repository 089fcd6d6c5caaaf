"""Snapshots a capture owes: the plan of which tables (or partitions) are read, why, and
how far each got; the signals that ask for them.

DESIGN (Netflix's DBLog; Debezium's incremental snapshots): a table is read in chunks
between watermarks in the WAL (:mod:`~replog.capture.chunks`), so no snapshot is held
open (nothing blocks VACUUM), the stream never stops, and each chunk is an idempotent
commit of the capture like any other.

How far each snapshot got lives in :class:`SnapshotPlan`, a sealed record of the log
(``_replog/captures/<slot>.json``). It is written before the commit that carries a chunk,
naming the commit's position: a restart finds the chunk done if the log holds that
position, else reads it again (at most one chunk is redone per kill, and it was never
committed). Snapshots wait in a queue: those of the initial snapshot, a table added to
the capture later, a partition attached to a captured table, a table whose columns were
renamed or retyped, one the user asks for (a signal in the WAL, :data:`SIGNAL_PREFIX`). A table is
known by its id: a snapshot owed for a name now held by another table (dropped and
created again) starts over for the new one.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from replog.capture.pgoutput import lsn_to_int, lsn_to_text
from replog.capture.records import read_record
from replog.capture.source import (
    SIGNAL_PREFIX,
    WATERMARK_PREFIX,
    Table,
    connect,
    publication_tables,
    qualified_name,
)
from replog.errors import CorruptionError, InvalidOptionError, SourceConfigError
from replog.format.sealed import seal
from replog.storage import Storage
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

PLAN_VERSION = 2
"""2: a physical-order snapshot names the leaf relation it reads by id (1: by its place in
a list, which a DETACH shifts), snapshots may read one partition (``relation``), and the
plan keeps the captured tables' partitions and column names (what the catalog watch
compares against)."""
CAPTURES_DIR = "_replog/captures"
INITIAL, ADDED, REQUESTED, RECREATED = "initial", "added", "requested", "recreated"
RESYNC = "resync"
"""A table whose changes the stream missed (a new slot in place of one that cannot be
resumed, capture's publication dropped or left by the table): read again whole, after
its rows the source no longer holds were deleted."""
ATTACHED, COLUMNS_CHANGED = "attached", "columns-changed"
_KEPT_SIGNALS = 100
_KEPT_FINISHED = 20

__all__ = ["SIGNAL_PREFIX", "WATERMARK_PREFIX", "PendingChunk", "SnapshotPlan", "TableSnapshot"]


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
    ``recreated`` (dropped and created again under its name), ``resync`` (its changes
    were missed: :data:`RESYNC`), ``attached`` (a partition
    attached to it), ``columns-changed`` (a column renamed or retyped)."""
    after: list[str | None] | None = None
    """Key order: the key (each column's text) of the last row read; None: none yet."""
    leaf: int = 0
    """Physical order: the id of the leaf relation being read (0: none yet); leaves are
    read in the order of their ids."""
    block: int = 0
    """Physical order: the next block of that relation to read."""
    filenode: int = 0
    """Physical order: the storage of that relation (``relfilenode``) the block counts
    in: rewritten since (``VACUUM FULL``, ``CLUSTER``, pg_repack move rows and write no
    change), the relation is read again from its first block."""
    rows: int = 0
    chunks: int = 0
    estimate: int = 0
    """Rows the table had when its snapshot began (``pg_class.reltuples``)."""
    started_ms: int = 0
    relation: int = 0
    """The relation read: 0 the table; else one partition of it (attached while captured)."""

    @property
    def kind(self) -> str:
        """``source.snapshot`` of its read events, as Debezium writes it."""
        return "true" if self.reason == INITIAL else "incremental"

    @property
    def name(self) -> str:
        """The table, and the partition when only one is read (for messages)."""
        return self.table if not self.relation else f"{self.table} (partition {self.relation})"

    def restart(self) -> None:
        """Read the table again from its start."""
        self.after, self.leaf, self.block, self.filenode = None, 0, 0, 0


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
    relation: int = 0
    filenode: int = 0


def _from_version_1(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot (or pending chunk) of a version 1 plan: a physical-order position named
    the leaf by its place in a list, which a DETACH may have shifted since: such a
    snapshot starts its table again (rows read twice are harmless, rows skipped are not)."""
    if item.get("leaf") or item.get("block"):
        logger.warning(
            "capture plan of version 1: the physical-order snapshot of %s starts again",
            item.get("table"),
        )
        item = {**item, "after": None, "leaf": 0, "block": 0}
    return item


def _dataclass_of(cls: type[Any], item: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in item.items() if k in known})


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
    """Positions of the latest signals taken (a signal read again after a kill is not
    taken twice; the same request sent twice is two signals)."""
    finished: list[dict[str, Any]] = field(default_factory=list)
    """The latest snapshots that ended: table, reason, rows, chunks, times."""
    resets: dict[str, dict[str, int | None]] = field(default_factory=dict)
    """Tables dropped and created again under a captured name -> ``old_oid`` (the dropped
    table's id) and ``done_at`` (the position of the commit that deletes its rows, once
    one is made): the rows of the dropped table are deleted before the first event of
    the new one."""
    partitions: dict[str, dict[str, str]] = field(default_factory=dict)
    """Captured partitioned tables -> their leaf partitions (id as text -> partition
    constraint, ``pg_get_partition_constraintdef``), as last seen."""
    columns: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """Captured tables -> their columns (``attnum`` as text -> [name, type, the ``xmin`` of
    its catalog row]), as last seen."""
    attached: dict[str, dict[str, str]] = field(default_factory=dict)
    """Captured partitioned tables -> their leaf partitions -> how each was attached (the
    ``xmin`` of its catalog rows), as last seen: one detached and attached again between
    two looks has other ones."""
    storage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Captured tables -> the table or its leaf partitions -> their storage
    (``relfilenode``), as last seen: a table rewritten has another one."""
    removals: list[dict[str, Any]] = field(default_factory=list)
    """Partitions that left a captured table (detached, dropped): ``id`` (their marker in
    the WAL), ``table``, ``leaf``, ``constraint``, ``done_at`` (the position of the commit
    that deletes their rows, once one is made). With ``cause`` ``resync``: a table whose
    changes the stream missed (``leaf`` its id, ``constraint`` ``true``): its rows the
    source no longer holds are deleted."""
    slot_lsn: int = 0
    """The consistent point of the slot this log's capture created (0: a slot it adopted,
    or a plan of replog before 0.6): a slot found still there is this log's, never
    advanced (its run was killed before its first commit), whoever names its owner."""
    released: dict[str, dict[str, int]] = field(default_factory=dict)
    """Tables ``--tables-changed`` stopped capturing -> ``oid`` and ``at`` (the server's
    WAL position once they left capture's publication): their changes before it, still
    in the slot, are skipped (counted), until the log's position passes it."""

    # -- storage -----------------------------------------------------------------------

    @classmethod
    def load(cls, storage: Storage, slot: str, log_id: str) -> SnapshotPlan | None:
        """The plan stored for ``slot`` (None if there is none)."""
        path = plan_path(slot)
        body = read_record(storage, path, log_id, PLAN_VERSION)
        if body is None:
            return None
        upgrade = _from_version_1 if body.get("format_version", 1) < 2 else dict
        try:
            pending = body.get("pending")
            return cls(
                slot=body["slot"],
                log_id=body["log_id"],
                queue=[_dataclass_of(TableSnapshot, upgrade(item)) for item in body["queue"]],
                pending=_dataclass_of(PendingChunk, upgrade(pending)) if pending else None,
                tables=dict(body["tables"]),
                signals=list(body["signals"]),
                finished=list(body["finished"]),
                resets=dict(body.get("resets", {})),
                partitions=dict(body.get("partitions", {})),
                columns=dict(body.get("columns", {})),
                attached=dict(body.get("attached", {})),
                storage=dict(body.get("storage", {})),
                removals=list(body.get("removals", [])),
                slot_lsn=int(body.get("slot_lsn", 0)),
                released=dict(body.get("released", {})),
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

    def queued(self, table: str, relation: int = 0) -> TableSnapshot | None:
        return next(
            (item for item in self.queue if item.table == table and item.relation == relation),
            None,
        )

    def enqueue(self, table: Table, reason: str, estimate: int, relation: int = 0) -> bool:
        """Snapshot ``table`` (only its partition ``relation`` if given) after those
        queued; False if it is queued already (a request of the user is queued whatever
        is: each one is a snapshot begun after it). A snapshot queued for another table
        of that name (dropped since) starts over for this one."""
        found = None if reason == REQUESTED else self.queued(table.qualified, relation)
        if found is not None and found.oid == table.oid:
            return False
        if found is not None:
            logger.info("the snapshot of %s owed for table %d starts over for table %d",
                        found.name, found.oid, table.oid)  # fmt: skip
            if self.pending is not None and self.pending.table == table.qualified:
                self.pending = None
            found.oid, found.reason, found.rows, found.chunks = table.oid, reason, 0, 0
            found.restart()
            return True
        self.queue.append(
            TableSnapshot(table.qualified, table.oid, reason, estimate=estimate, relation=relation)
        )
        logger.info("snapshot of %s queued (%s)", self.queue[-1].name, reason)
        return True

    def restart(self, table: Table, reason: str, estimate: int) -> bool:
        """Snapshot ``table`` whole again: queued (or started again from its first row if
        it is being read). Whether the plan changed."""
        found = self.queued(table.qualified)
        if found is not None and found.oid == table.oid and (found.after or found.leaf):
            logger.info("the snapshot of %s starts again (%s)", table.qualified, reason)
            found.restart()
            return True
        return self.enqueue(table, reason, estimate)

    def give_up(self, snapshot: TableSnapshot) -> None:
        """Stop taking ``snapshot`` (what it reads left the table)."""
        self.queue = [item for item in self.queue if item is not snapshot]
        pending = self.pending
        if pending is not None and (pending.table, pending.relation) == (
            snapshot.table,
            snapshot.relation,
        ):
            self.pending = None

    def drop(self, table: str) -> None:
        """Stop snapshotting ``table`` (it was dropped)."""
        self.queue = [item for item in self.queue if item.table != table]
        if self.pending is not None and self.pending.table == table:
            self.pending = None

    def took_signal(self, position: int) -> bool:
        """Whether the signal at WAL ``position`` was taken before; notes it as taken."""
        taken = lsn_to_text(position)
        if taken in self.signals:
            return True
        self.signals = [*self.signals, taken][-_KEPT_SIGNALS:]
        return False

    # -- chunks --------------------------------------------------------------------------

    def resolve(self, position: int) -> bool:
        """Settle what was written down for a commit once the log is known to hold
        ``position``: the pending chunk, the resets and the removals are done if their
        commit is at or below it, else they are owed again. Whether anything changed."""
        changed = False
        for name, reset in list(self.resets.items()):
            done_at = reset.get("done_at")
            if done_at is not None:
                changed = True
                if done_at <= position:
                    del self.resets[name]
                else:
                    reset["done_at"] = None
        for removal in list(self.removals):
            done_at = removal.get("done_at")
            if done_at is not None:
                changed = True
                if done_at <= position:
                    self.removals.remove(removal)
                else:
                    removal["done_at"] = None
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
        if current is None or (current.table, current.relation) != (
            pending.table,
            pending.relation,
        ):
            return True
        current.after, current.leaf, current.block = pending.after, pending.leaf, pending.block
        current.filenode = pending.filenode
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
                current.name,
                current.rows,
                current.chunks,
            )
        return True


def watermark(content: bytes) -> tuple[str, str] | None:
    """(chunk mark, ``low`` or ``high``) of a watermark message (None: not one)."""
    try:
        body = json.loads(content)
        return str(body["chunk"]), str(body["side"])
    except (ValueError, KeyError, TypeError):
        return None


def signal(content: bytes, slot: str, position: int) -> tuple[str, list[str]] | None:
    """(signal id, tables to snapshot) of the signal message at WAL ``position`` for
    ``slot`` (None: a signal for another capture); ``ValueError`` for one that cannot be
    read. A signal written without an id (the SQL form) is named by its position."""
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
    return str(signal_id) if signal_id else f"at {lsn_to_text(position)}", tables


def signal_content(tables: Sequence[str], slot: str | None) -> str:
    """The content of a signal asking the capture of ``slot`` (every capture: None) to
    snapshot ``tables``."""
    body: dict[str, Any] = {"id": uuid.uuid4().hex, "snapshot": list(tables)}
    if slot is not None:
        body["slot"] = slot
    return json.dumps(body)


def request_snapshot(
    dsn: str, tables: Sequence[str], slot: str | None = None, publication: str | None = None
) -> tuple[str, int]:
    """Ask the capture of ``slot`` (every capture of the database: None) to snapshot
    ``tables`` while it streams: a signal written into the WAL, so the capture meets it in
    order with the changes, whether it runs now or starts later. Its id and LSN.

    A table the capture does not capture is refused here, before anything is written: the
    captured tables are those of its publication (its own, named after the slot, or
    ``publication``). The same as ``SELECT pg_logical_emit_message(true, 'replog.signal',
    '{"snapshot": ["public.orders"], "slot": "shop"}')`` (``replog snapshot``), which
    checks nothing."""
    if not tables:
        raise InvalidOptionError("name the tables to snapshot")
    names = [qualified_name(t) for t in tables]
    content = signal_content(names, slot)
    with connect(dsn) as connection:
        if slot is not None:
            _check_captured(connection, names, slot, publication)
        row = connection.execute(
            "SELECT pg_logical_emit_message(true, %s, %s)::text", (SIGNAL_PREFIX, content)
        ).fetchone()
    assert row is not None
    return json.loads(content)["id"], lsn_to_int(row[0])


def _check_captured(
    connection: Any, names: Sequence[str], slot: str, publication: str | None
) -> None:
    """Refuse names the capture of ``slot`` does not capture (see :func:`request_snapshot`)."""
    published = publication_tables(connection, publication or slot)
    if published is None:
        raise SourceConfigError(
            f"no publication {publication or slot!r}: a capture of slot {slot!r} publishes "
            f"its tables in one named after the slot, or in the one given with "
            f"--publication (name it here too)"
        )
    unknown = [name for name in names if name not in published]
    if unknown:
        raise InvalidOptionError(
            f"slot {slot!r} does not capture {', '.join(unknown)}: it captures "
            f"{', '.join(published) or 'no table'} (nothing was asked)"
        )


def watermark_content(chunk: str, side: str) -> str:
    """The content of chunk ``chunk``'s ``low`` or ``high`` watermark message."""
    return json.dumps({"chunk": chunk, "side": side})
