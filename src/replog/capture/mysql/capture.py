"""MySQL and MariaDB changes into a log, each source transaction exactly once (``replog
capture mysql``; docs/CDC.md, "Capturing MySQL and MariaDB").

DESIGN: the PostgreSQL capture's loop (:mod:`replog.capture.postgres`), for the binlog; what
the two share (the run record, the idempotent commit, progress, the plan saved) is
:class:`~replog.capture.driver.CaptureDriver`:

* The binlog is read as a replica, non-blocking, from the position the log holds
  (:mod:`~replog.capture.mysql.binlog`): whole transactions, their row events decoded
  into events as they come and staged as segment files every ``stage_events``
  (:class:`~replog.capture.batch.Batch`), so a transaction of millions of rows costs the
  memory of a piece of it.
* Each commit to the log holds whole transactions and is an idempotent append: app id
  ``mysql-capture.<name>``, version = the position after its last transaction
  (:mod:`~replog.capture.mysql.positions`: the GTID count, or the binlog coordinate). The
  position itself (file, offset, GTID state) is written to the log just before the commit
  (:class:`~replog.capture.mysql.positions.PositionRecord`); a restart reads the one whose
  version the log holds and reads the binlog after it. The server keeps no state for
  capture (there is no slot): nothing needs advancing after a commit.
* Snapshots are read in chunks between watermark rows (:mod:`~replog.capture.mysql.chunks`);
  a chunk's rows are in the commit that passes its high watermark, and the plan
  (:class:`~replog.capture.snapshot.SnapshotPlan`, written just before that commit) says
  how far each table got.
* DDL is read from the statements of the binlog (:mod:`~replog.capture.mysql.ddl`):
  TRUNCATE as truncate events, a table dropped and created again as a truncate of its
  rows and a new snapshot, column changes that rewrote rows without row events as a new
  snapshot; every row event carries its table's columns as they were then.

This module never imports pyspark.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pymysql

from replog.capture.batch import Batch
from replog.capture.driver import CaptureDriver, ProgressCallback
from replog.capture.mysql import ddl
from replog.capture.mysql.binlog import (
    Begin,
    BinlogGone,
    BinlogReader,
    Connection,
    End,
    Rows,
    Statement,
    StreamBroken,
    binlog_columns,
)
from replog.capture.mysql.chunks import MySqlChunk, MySqlChunks
from replog.capture.mysql.columns import MySqlColumn
from replog.capture.mysql.events import MySqlEvents, Transaction
from replog.capture.mysql.options import (
    SIGNAL_DATABASE,
    MySqlOptions,
    capture_app_id,
)
from replog.capture.mysql.positions import GTID, BinlogPosition, PositionRecord
from replog.capture.mysql.server import SIGNALS, MySqlServer, TableInfo, connect, lost
from replog.capture.progress import CaptureProgress
from replog.capture.running import RunRecord
from replog.capture.snapshot import (
    ADDED,
    COLUMNS_CHANGED,
    INITIAL,
    RECREATED,
    REQUESTED,
    SnapshotPlan,
    TableSnapshot,
)
from replog.crashpoints import crash_point
from replog.errors import (
    CaptureError,
    InvalidOptionError,
    SourceConnectionError,
    SourcePositionError,
)
from replog.log import ReplicationLog
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
"""How often a capture whose tables are idle records how far it read (a commit with no
events), while the server's binlog moves with other tables' changes."""
RECONNECT_S = 300.0
"""How long a capture waits for a server out of reach (restarting) before it stops."""
WATERMARKS_TABLE = "watermarks"
SIGNALS_TABLE = "signals"


@dataclass
class _Read:
    """What one batch read: the position after its last whole transaction, and counts."""

    position: BinlogPosition
    transactions: int = 0
    captured: int = 0
    last_commit_ms: int | None = None
    chunk: MySqlChunk | None = None
    reads: int = 0
    """Events of the batch that are a chunk's read events (not changes)."""
    at_end: bool = False
    """It read to the end of the binlog (as the server had it then)."""
    resets: list[str] = field(default_factory=list)
    """Collections whose re-created table's truncate this batch carries."""
    changed: bool = False
    """It changed the plan (a DDL, a signal): commit it even without events."""


class MySqlCapture(CaptureDriver):
    """One capture of a MySQL or MariaDB server into one log (see the module docstring)."""

    events: MySqlEvents
    reads = "the binlog"
    one_per = "name"

    def __init__(
        self,
        options: MySqlOptions,
        log: ReplicationLog,
        *,
        stop: threading.Event | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        options.check()
        super().__init__(log, capture_app_id(options.name), stop=stop, progress=progress)
        self.identity = f"capture named {options.name!r}"
        self.plan_name = f"mysql.{options.name}"
        """Names the capture's plan and run record in the log (``_replog/captures/``)."""
        self.plan = SnapshotPlan.load(log.storage, self.plan_name, log.log_id)
        options = self._remembered(options)
        self.options = options
        self.server = MySqlServer(options)
        self.replica_id = options.replica_id(log.log_id)
        try:
            self.server.check_settings()
            self.server.check_binlog_privileges()
            self._probe_replication()
            self.captured = list(dict.fromkeys(options.qualified(t) for t in options.tables))
            """The captured tables' names (some may not exist now: dropped while captured)."""
            self.tables: dict[str, TableInfo] = {}
            """The captured tables that exist, as last described."""
            for name in self.captured:
                if name in self._known and self.server.describe(name) is None:
                    logger.warning("%s, captured, does not exist now (dropped): its rows stay "
                                   "in the log; a table created under its name is captured "
                                   "in its place", name)  # fmt: skip
                    continue
                self.tables[name] = self.server.table(name)
            self._check_left_out()
            self.server.ensure_own_tables()
            self.run_record = RunRecord(log.storage, self.plan_name, log.log_id)
            self.run_record.claim()
        except BaseException:
            self.server.close()
            raise
        self.events = MySqlEvents(options.name)
        self.chunks = MySqlChunks(
            self.server, self.events, options.name, options.snapshot_chunk_rows
        )
        self.server_id = self.server.server_id()
        self.server_uuid = self.server.server_uuid()
        """The server read (a position's binlog file and offset are its)."""
        self.position: BinlogPosition | None = None
        self.record = PositionRecord(options.name, log.log_id, [])
        self.chunk: MySqlChunk | None = None
        self._by_gtid = False
        self._committed_at = time.monotonic()
        self._lost_since: float | None = None
        self._at_end = False
        """The last batch read to the end of the binlog."""
        self._reset_tables: list[str] = []
        """``--reset-position``: the tables whose truncate the first commit carries."""
        self._dropped_warned: set[str] = set()

    def _probe_replication(self) -> None:
        """Read the binlog from the server's position now (to its end: nothing): proves
        ``REPLICATION SLAVE`` before anything is written."""
        position = self.server.current(self.server.mode(self.options.position))
        with BinlogReader(self._connection(), position, {SIGNAL_DATABASE}) as reader:
            for _ in reader.items():
                pass

    def close(self) -> None:
        self.chunks.close()
        self.server.close()

    @property
    def zero_dates(self) -> dict[str, int]:
        """``db.table.column`` -> zero dates (``0000-00-00``) written as null so far."""
        return dict(self.events.zero_dates)

    # -- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        self.position = self._start()
        self.progress.position = self.position.version
        self._snapshotted = self._snapshot_owed()
        while not self.stop.is_set():
            try:
                self._save_plan()
                self._next_chunk()
                captured = self._capture_batch()
            except (StreamBroken, SourceConnectionError, pymysql.err.OperationalError) as exc:
                if not isinstance(exc, StreamBroken) and not lost(exc):
                    raise
                self._waiting(exc)
                continue
            self._lost_since = None
            self._report(idle=not captured)
            self.run_record.beat(self.progress.position)
            if self._at_end and self.chunk is None and not self._snapshot_owed():
                if not self.options.follow:
                    break  # caught up: the binlog's end as the last read met it
                if not captured:
                    self.stop.wait(self.options.poll_s)
        self._commit_position()

    def _waiting(self, exc: BaseException) -> None:
        """The server is out of reach, or the binlog connection broke: read again from the
        last whole transaction once it answers (a server restart), for at most
        :data:`RECONNECT_S`. A chunk read but not committed is read again."""
        now = time.monotonic()
        if self._lost_since is None:
            self._lost_since = now
        self.progress.errors += 1
        waited = now - self._lost_since
        if waited >= RECONNECT_S:
            raise CaptureError(
                f"the server has been out of reach for {waited:.0f} s ({exc}): capture stops; "
                f"the log holds every commit made before (start it again)"
            ) from exc
        assert self.position is not None
        logger.warning("%s: reading again from %s once the server answers", exc,
                       self.position.text())  # fmt: skip
        self.chunks.close()
        self.stop.wait(min(0.2 + waited / 4, 5.0))

    def _lag_bytes(self) -> int | None:
        assert self.position is not None
        with contextlib.suppress(pymysql.err.MySQLError, SourceConnectionError):
            return self.server.lag_bytes(self.position)
        return None

    # -- starting ---------------------------------------------------------------------------

    def _remembered(self, options: MySqlOptions) -> MySqlOptions:
        """``options`` with the tables the log's capture of this name captures when none
        are named."""
        known = sorted(self.plan.tables) if self.plan is not None else []
        self._known = known
        if options.tables:
            return options
        if not known:
            raise InvalidOptionError(
                f"name the tables to capture (--tables db.t,...): the log at {self.log.url} "
                f"holds no MySQL capture named {options.name!r} to resume"
            )
        logger.info("capturing the tables the log's capture %s captures: %s", options.name,
                    ", ".join(known))  # fmt: skip
        return replace(options, tables=tuple(known))

    def _check_left_out(self) -> None:
        left_out = [name for name in self._known if name not in self.captured]
        if left_out and not self.options.tables_changed:
            raise InvalidOptionError(
                f"--tables leaves out {', '.join(left_out)}, which the log's capture "
                f"{self.options.name!r} captures: give them all (or no --tables: the log's are "
                f"captured), or add --tables-changed to stop capturing them (their rows stay "
                f"in tables built from the log)"
            )

    @property
    def _lease_owner(self) -> str:
        return f"replog capture mysql {self.options.name}"

    def _start(self) -> BinlogPosition:
        self._release_dead_leases()
        logged = self.log.transaction_version(self.app_id)
        self._logged = logged or 0
        record = PositionRecord.load(self.log.storage, self.options.name, self.log.log_id)
        if record is not None:
            self.record = record
        if logged is None or self.options.reset_position:
            return self._start_new(logged)
        position = self.record.at(logged)
        if position is None:
            raise SourcePositionError(
                f"the log holds position {logged} of MySQL capture {self.options.name!r} but "
                f"no record of where that is in the binlog "
                f"({self.log.storage.path('_replog/captures')}): --reset-position starts over "
                f"from the server's position now, with a new snapshot into this log"
            )
        if self.options.position not in {"auto", position.mode}:
            raise InvalidOptionError(
                f"--position {self.options.position}: the log's capture {self.options.name!r} "
                f"records {position.mode} positions (a capture keeps its mode)"
            )
        self._by_gtid = self._check_resumable(position)
        plan = self.plan
        if plan is None:
            plan = SnapshotPlan(self.plan_name, self.log.log_id, tables=self._table_ids())
            self._plan_changed = True
        self.plan = plan
        self._plan_changed |= plan.resolve(logged)
        for name in [n for n in plan.tables if n not in self.captured]:
            plan.drop(name)
            logger.warning("%s is no longer captured (--tables-changed): its rows stay in "
                           "tables built from the log", name)  # fmt: skip
        for name, table in self.tables.items():
            if name not in plan.tables:
                self._owe_snapshot(table, ADDED)
            if name not in plan.columns:  # (else the columns as the stream last saw them:
                self._note_columns(table)  # its ALTERs since are read, and compared, again)
        self._save_plan()
        return position

    def _start_new(self, logged: int | None) -> BinlogPosition:
        """A capture the log holds nothing of (or ``--reset-position``): the server's
        position now, and every table's snapshot owed."""
        mode = self.server.mode(self.options.position)
        position = self.server.current(mode)
        if logged is not None:
            if position.version <= logged:
                raise SourcePositionError(
                    f"--reset-position: the server's position {position.text()} (version "
                    f"{position.version}) is not past the log's ({logged}): the server's "
                    f"binlog was reset. Capture it into a new log"
                )
            logger.warning(
                "--reset-position: capture %s starts over at %s: each table is truncated in "
                "the log, then snapshotted anew (the changes between the log's position and "
                "this one are not captured: the snapshot brings their result)",
                self.options.name, position.text(),
            )  # fmt: skip
            self._reset_tables = sorted(self.captured)
        self.plan = SnapshotPlan(self.plan_name, self.log.log_id, tables=self._table_ids())
        if self.options.snapshot == "initial":
            for table in self.tables.values():
                self._owe_snapshot(table, INITIAL)
        for table in self.tables.values():
            self._note_columns(table)
        self._plan_changed = True
        self._save_plan()
        return position

    def _check_resumable(self, position: BinlogPosition) -> bool:
        """Whether to read from ``position`` by GTID (another server, or its file gone by
        GTIDs) rather than by binlog file and offset; a position the server no longer has
        is refused with the way on."""
        files = [name for name, _ in self.server.binlog_files()]
        same = position.server_id == self.server_id and position.server_uuid == self.server_uuid
        if same and position.file in files:
            return False
        if position.mode == GTID and not same:
            logger.warning(
                "capture %s resumes on another server (server_id %s, was %s) by GTID: "
                "%s", self.options.name, self.server_id, position.server_id,
                position.gtids,
            )  # fmt: skip
            return True
        raise self._purged(position, files)

    def _purged(self, position: BinlogPosition, files: Sequence[str]) -> SourcePositionError:
        first = files[0] if files else "none"
        return SourcePositionError(
            f"the binlog after the log's position {position.text()} is gone from the server "
            f"(purged: its oldest binlog is {first}): the changes since cannot be read. "
            f"--reset-position starts over from the server's position now, with a new "
            f"snapshot of every table into this log (raise binlog_expire_logs_seconds / "
            f"expire_logs_days, or keep capture running)"
        )

    def _table_ids(self) -> dict[str, int]:
        return dict.fromkeys(self.captured, 0)

    # -- the plan --------------------------------------------------------------------------

    def _owe_snapshot(self, table: TableInfo, reason: str) -> None:
        assert self.plan is not None
        if self.options.snapshot != "initial":
            logger.warning("%s: rows of %s are not captured (--snapshot never), only changes",
                           reason, table.qualified)  # fmt: skip
            return
        if reason != REQUESTED and self.plan.queued(table.qualified) is not None:
            return
        self.plan.queue.append(
            TableSnapshot(table.qualified, 0, reason, estimate=self._estimate(table))
        )
        logger.info("snapshot of %s queued (%s)", table.qualified, reason)
        self._plan_changed = self._snapshotted = True

    def _restart_snapshot(self, table: TableInfo, reason: str) -> None:
        """Every row of ``table`` again (its snapshot from the start if it is running)."""
        assert self.plan is not None
        if self._never_again(self.options.snapshot, reason, table.qualified):
            return
        found = self.plan.queued(table.qualified)
        if found is not None:
            found.restart()
            found.reason = reason
            if self.plan.pending is not None and self.plan.pending.table == table.qualified:
                self.plan.pending = None
            if self.chunk is not None and self.chunk.table.qualified == table.qualified:
                self.chunk = None  # its watermarks are passed over
            self._plan_changed = True
            logger.info("the snapshot of %s starts again (%s)", table.qualified, reason)
            return
        self._owe_snapshot(table, reason)

    def _estimate(self, table: TableInfo) -> int:
        found = self.server.scalar(
            "SELECT TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s AND "
            "TABLE_NAME = %s",
            (table.database, table.name),
        )
        return int(found or 0)

    def _note_columns(self, table: TableInfo) -> None:
        assert self.plan is not None
        described = {str(i): [c.name, _signature(c)] for i, c in enumerate(table.columns)}
        if self.plan.columns.get(table.qualified) != described:
            self.plan.columns[table.qualified] = described
            self._plan_changed = True

    # -- snapshot chunks -------------------------------------------------------------------

    def _next_chunk(self) -> None:
        if self.chunk is not None or self.plan is None:
            return
        owed = self.plan.current
        if owed is None:
            return
        table = self.tables.get(owed.table)
        if table is None:
            self.plan.drop(owed.table)
            self._plan_changed = True
            return
        if not owed.started_ms:
            owed.started_ms = now_ms()
        chunk = self.chunks.read(owed, table)
        if chunk is None:
            logger.warning("%s was dropped while its snapshot was read: the snapshot is "
                           "given up", owed.table)  # fmt: skip
            self.plan.drop(owed.table)
            self._plan_changed = True
            return
        self.tables[owed.table] = chunk.table
        chunk.ts_ms = now_ms()
        self.chunk = chunk

    # -- reading the binlog -------------------------------------------------------------

    def _connection(self) -> Connection:
        dsn = self.server.dsn
        extra: dict[str, Any] = {}
        if dsn.unix_socket:
            extra["unix_socket"] = dsn.unix_socket
        return Connection(dsn.host, dsn.port, dsn.user, dsn.password, self.replica_id,
                          self.server.flavor, extra)  # fmt: skip

    def _wanted(self, schema: str, table: str) -> bool:
        name = f"{schema}.{table}"
        return name in self.captured or schema == SIGNAL_DATABASE

    def _capture_batch(self) -> bool:
        """Read whole transactions from the position, commit them. Whether any were read."""
        assert self.position is not None
        batch = Batch(self.log, self._lease_owner, self.options.stage_events)
        read = _Read(self.position)
        schemas = {name.partition(".")[0] for name in self.captured} | {SIGNAL_DATABASE}
        try:
            self._truncate_for_reset(batch, read)
            with BinlogReader(
                self._connection(), self.position, schemas, by_gtid=self._by_gtid,
                wanted=self._wanted,
            ) as reader:  # fmt: skip
                self._read_batch(reader, batch, read)
        except BinlogGone as exc:
            batch.abandon()
            raise self._purged(self.position, [n for n, _ in self.server.binlog_files()]) from exc
        except BaseException:
            batch.abandon()
            raise
        self._at_end = read.at_end
        if not read.transactions and not read.changed:
            batch.abandon()
            return False
        self._by_gtid = False
        position = read.position
        due = time.monotonic() - self._committed_at >= HEARTBEAT_S
        if batch.events or read.chunk is not None or read.changed or due:
            try:
                self._note_for_plan(read, position)
            except BaseException:
                batch.abandon()
                raise
            try:
                self._commit(batch, position, len(read.chunk.events) if read.chunk else 0)
            finally:
                batch.release()
        else:
            batch.abandon()
            self.position = position  # recorded by a later commit (at most the heartbeat's)
        snapshot_rows = len(read.chunk.events) if read.chunk else 0
        self._counted(batch, snapshot_rows=snapshot_rows, captured=read.captured,
                      last_commit_ms=read.last_commit_ms)  # fmt: skip
        return True

    def _truncate_for_reset(self, batch: Batch, read: _Read) -> None:
        """``--reset-position`` on a log that holds a capture: the rows the log holds of
        each table may have changed in the binlog that was skipped (a row deleted there
        has no event): a truncate of each goes first, in the first commit, and the new
        snapshot brings the rows the table has."""
        if not self._reset_tables:
            return
        position = read.position
        txn = Transaction(None, now_ms(), self.server_id, position.file, position.pos)
        why = {"position_reset": True}
        order = 1
        for collection in self._reset_tables:
            order = self._truncated(collection, txn, order, now_ms(), batch, read, why=why)
        self._reset_tables = []

    def _read_batch(self, reader: BinlogReader, batch: Batch, read: _Read) -> None:
        """Fill ``batch`` with whole transactions (a high watermark, or ``max_changes``
        events, ends it at the end of a transaction)."""
        txn: Transaction | None = None
        order = 1
        changed_before = 0
        ts_ms = now_ms()
        for item in reader.items():
            if isinstance(item, Begin):
                txn = Transaction(item.gtid, item.ts_ms, item.server_id, item.file, item.pos)
                self._check_order(read.position, txn)
                order, changed_before = 1, batch.events - read.reads
            elif isinstance(item, End):
                assert txn is not None
                after, _ = read.position.after(item.file, item.pos, txn.gtid)
                read.position = replace(after, server_id=self.server_id,
                                        server_uuid=self.server_uuid)  # fmt: skip
                read.transactions += 1
                if batch.events - read.reads > changed_before:
                    read.captured += 1
                    read.last_commit_ms = item.ts_ms
                if batch.events >= self.options.max_changes or read.chunk is not None:
                    return
            elif txn is None:
                continue
            elif isinstance(item, Rows):
                order = self._rows(item, txn, order, ts_ms, batch, read)
            elif isinstance(item, Statement):
                order = self._statement(item, txn, order, ts_ms, batch, read)
        read.at_end = True

    @staticmethod
    def _check_order(position: BinlogPosition, txn: Transaction) -> None:
        """Each transaction read must be new to the position before it: reading from the
        exact end of the last one, a GTID the state holds already (MariaDB: a sequence
        number not past its domain's) is out of order, and its version would not rise
        (a log taking it for one it holds would drop it)."""
        if txn.gtid is None or position.mode != GTID:
            return
        if not position.after(txn.file, txn.start, txn.gtid)[1]:
            raise CaptureError(
                f"transaction {txn.gtid} at {txn.file}:{txn.start} is not past the GTID state "
                f"before it ({position.gtids}): GTIDs out of order (set gtid_strict_mode=ON on "
                f"MariaDB). A capture cannot tell such a transaction from one it captured: "
                f"capture stops before it"
            )

    def _rows(  # noqa: PLR0917 - a transaction's place and its batch
        self, rows: Rows, txn: Transaction, order: int, ts_ms: int, batch: Batch, read: _Read
    ) -> int:
        if rows.schema == SIGNAL_DATABASE:
            if rows.table == WATERMARKS_TABLE:
                self._watermark(rows, batch, read)
            elif rows.table == SIGNALS_TABLE and rows.op == "c":
                self._signal(rows, read)
            return order
        collection = f"{rows.schema}.{rows.table}"
        table = self.tables.get(collection)
        if table is None:
            if collection not in self.captured:
                return order
            described = self.server.describe(collection, self.options.keys.get(collection, ()))
            if described is None:  # never skipped silently
                raise CaptureError(
                    f"the binlog has rows of {collection} at {rows.position[0]}:"
                    f"{rows.position[1]}, a captured table the server no longer has: capture "
                    f"cannot tell its JSON columns and key (start it again, with a snapshot: "
                    f"--reset-position)"
                )
            self.tables[collection] = table = described
        columns = binlog_columns(rows.event.table_map[rows.event.table_id], table.json_columns)
        key = self.options.keys.get(collection) or rows.key or table.key
        if not key:
            raise CaptureError(
                f"{collection} has no primary key at {rows.position[0]}:{rows.position[1]}: "
                f"capture cannot key its changes (name unique NOT NULL columns with --keys)"
            )
        made = self.events.changes(rows, collection, columns, key, txn, order, ts_ms)
        chunk = self.chunk
        if chunk is not None and chunk.table.qualified == collection:
            for event in made:
                chunk.stood_for(event.key)
        batch.add(made)
        return order + len(made)

    def _watermark(self, rows: Rows, batch: Batch, read: _Read) -> None:
        chunk = self.chunk
        for _, after in rows.rows:
            if after is None or chunk is None:
                continue
            capture, mark, side = (json.loads(v) if v is not None else None for v in after[:3])
            if capture != self.options.name or mark != chunk.mark:
                continue  # another capture's, or a chunk of a run that was killed
            if side == "low":
                chunk.low_seen = True
            elif side == "high" and chunk.low_seen:
                chunk.metadata = self.events.snapshot_metadata(
                    chunk.table, ts_ms=chunk.ts_ms, kind=chunk.snapshot.kind,
                    server_id=read.position.server_id, file=rows.position[0],
                    pos=rows.position[1],
                )  # fmt: skip
                batch.add_reads(chunk.table.qualified, chunk.events, chunk.ts_ms, chunk.metadata)
                read.reads += len(chunk.events)
                read.chunk = chunk
                self.chunk = None

    def _signal(self, rows: Rows, read: _Read) -> None:
        """A snapshot request (``replog snapshot mysql``: a row of ``replog.signals``)."""
        assert self.plan is not None
        for _, after in rows.rows:
            if after is None:
                continue
            signal_id, capture, tables = (
                json.loads(v) if v is not None else None for v in after[:3]
            )
            if capture not in (None, "", self.options.name) or signal_id in self.plan.signals:
                continue
            self.plan.signals = [*self.plan.signals, str(signal_id)][-100:]
            read.changed = self._plan_changed = True
            names = json.loads(tables) if isinstance(tables, str) else []
            logger.info("signal %s asks for snapshots of %s", signal_id, ", ".join(names))
            for name in names:
                table = self.tables.get(name)
                if table is None:
                    logger.warning("a signal asks for a snapshot of %s, which capture %s does "
                                   "not capture", name, self.options.name)  # fmt: skip
                    continue
                self._owe_snapshot(table, REQUESTED)

    # -- DDL ----------------------------------------------------------------------------------

    def _statement(  # noqa: PLR0917 - a transaction's place and its batch
        self, statement: Statement, txn: Transaction, order: int, ts_ms: int, batch: Batch,
        read: _Read,
    ) -> int:  # fmt: skip
        for change in ddl.parse(statement.query, statement.schema):
            if change.action == "rename":
                order = self._dropped(change.table, order=order, renamed_to=change.target)
                if change.target is not None:
                    order = self._created(change.target, txn, order, ts_ms, batch, read)
            elif change.action == "drop":
                order = self._dropped(change.table, order=order)
            elif change.action == "create":
                order = self._created(change.table, txn, order, ts_ms, batch, read)
            elif change.action == "truncate" and change.table in self.captured:
                order = self._truncated(change.table, txn, order, ts_ms, batch, read)
            elif change.action == "alter" and change.table in self.tables:
                self._altered(change.table, read)
        return order

    def _truncated(  # noqa: PLR0917 - a transaction's place and its batch
        self, collection: str, txn: Transaction, order: int, ts_ms: int, batch: Batch,
        read: _Read, why: dict[str, Any] | None = None,
    ) -> int:  # fmt: skip
        if self.options.skip_truncate and why is None:
            logger.warning("TRUNCATE of %s in transaction %s is not captured (--skip-truncate)",
                           collection, txn.id)  # fmt: skip
            self.progress.skipped_truncations += 1
            return order
        assert self.position is not None
        batch.add(
            self.events.truncates(
                self.tables.get(collection), collection, txn, order=order, ts_ms=ts_ms,
                shards=self.log.shards, position=(txn.file, txn.start), why=why,
            )
        )  # fmt: skip
        if why is None:
            self.progress.truncations += 1
        if self.chunk is not None and self.chunk.table.qualified == collection:
            self.chunk.emptied()
        read.changed = True
        return order + 1

    def _dropped(self, collection: str, *, order: int, renamed_to: str | None = None) -> int:
        """A captured table dropped (or renamed away): its rows stay downstream until a
        table of its name is created again (then they are truncated)."""
        if collection not in self.captured:
            return order
        assert self.plan is not None
        self.tables.pop(collection, None)
        if collection not in self._dropped_warned:
            self._dropped_warned.add(collection)
            logger.warning(
                "%s was %s: its rows stay in tables built from the log; a table created "
                "under its name again is captured in its place (its rows replace them)",
                collection, f"renamed to {renamed_to}" if renamed_to else "dropped",
            )  # fmt: skip
        self.plan.resets[collection] = {"old_oid": 0, "done_at": None}
        self.plan.queue = [s for s in self.plan.queue if s.table != collection]
        if self.plan.pending is not None and self.plan.pending.table == collection:
            self.plan.pending = None
        if self.chunk is not None and self.chunk.table.qualified == collection:
            self.chunk = None
        self._plan_changed = True
        return order

    def _created(  # noqa: PLR0917 - a transaction's place and its batch
        self, collection: str, txn: Transaction, order: int, ts_ms: int, batch: Batch,
        read: _Read,
    ) -> int:  # fmt: skip
        """A table created under a captured name that was dropped: the old table's rows
        are truncated downstream (here, in binlog order), the new one is snapshotted."""
        assert self.plan is not None
        reset = self.plan.resets.get(collection)
        if collection not in self.captured or reset is None or reset.get("done_at") is not None:
            return order
        order = self._truncated(collection, txn, order, ts_ms, batch, read,
                                why={"table_recreated": True})  # fmt: skip
        read.resets.append(collection)
        described = self.server.describe(collection, self.options.keys.get(collection, ()))
        if described is not None and described.key:
            self.tables[collection] = described
            self._note_columns(described)
            self._restart_snapshot(described, RECREATED)
        return order

    def _altered(self, collection: str, read: _Read) -> None:
        """An ALTER TABLE of a captured table: a column renamed or retyped, or added with a
        value for the rows it already has (a default, NOT NULL, generated), changed rows
        without row events: the table is snapshotted again."""
        assert self.plan is not None
        before = self.plan.columns.get(collection, {})
        described = self.server.describe(collection, self.options.keys.get(collection, ()))
        if described is None or not described.key:
            return
        self.tables[collection] = described
        old = {name: signature for name, signature in before.values()}
        new = {c.name: _signature(c) for c in described.columns}
        renamed_or_retyped = any(
            name not in new or new[name] != signature for name, signature in old.items()
        ) and bool(set(new) - set(old))
        retyped = any(name in new and new[name] != sig for name, sig in old.items())
        added = [name for name in new if name not in old]
        filled = [name for name in added if name in described.filled_when_added]
        self._note_columns(described)
        read.changed = True
        if renamed_or_retyped or retyped or filled:
            why = ", ".join(
                part
                for part in (
                    "a column renamed or retyped" if renamed_or_retyped or retyped else "",
                    f"{', '.join(filled)} added with a value for every row" if filled else "",
                )
                if part
            )
            logger.warning("%s: %s; its rows are snapshotted again", collection, why)
            self._restart_snapshot(described, COLUMNS_CHANGED)

    # -- committing -----------------------------------------------------------------------

    def _note_for_plan(self, read: _Read, position: BinlogPosition) -> None:
        """Write down, before the commit, what it carries of the plan (a chunk, the
        truncates of re-created tables), and where in the binlog it is."""
        assert self.plan is not None
        version = position.version
        if read.chunk is not None:
            self.plan.pending = read.chunk.pending(version)
            self._plan_changed = True
        for collection in read.resets:
            reset = self.plan.resets.get(collection)
            if reset is not None:
                reset["done_at"] = version
                self._plan_changed = True
        self._save_plan()
        self.record.write(self.log.storage, position, logged=self._logged)
        crash_point("capture_noted")

    def _commit(self, batch: Batch, position: BinlogPosition, snapshot_rows: int = 0) -> None:
        """One atomic commit of ``batch`` recording ``position`` (also with no events)."""
        version = position.version
        committed = self._commit_batch(batch, version)
        crash_point("capture_committed")
        if committed:
            self.progress.snapshot_rows += snapshot_rows
        self.position = position
        self.progress.position = version
        self._committed_at = time.monotonic()
        if self.plan is not None and self.plan.resolve(version):
            self._plan_changed = True

    def _commit_position(self) -> None:
        """Record how far the binlog was read (a capture that read only other tables'
        transactions since its last commit)."""
        if self.position is None or self.position.version <= self._logged:
            return
        batch = Batch(self.log, self._lease_owner, self.options.stage_events)
        try:
            self._note_for_plan(_Read(self.position), self.position)
            self._commit(batch, self.position)
        finally:
            batch.release()


def _signature(column: MySqlColumn) -> str:
    """What a column's values are, as the plan keeps it (a retype changes it)."""
    return json.dumps([column.kind, column.unsigned, column.precision, column.scale, column.fsp,
                       column.length, list(column.members)])  # fmt: skip


def capture(
    options: MySqlOptions,
    log: ReplicationLog,
    *,
    stop: threading.Event | None = None,
    progress: ProgressCallback | None = None,
) -> CaptureProgress:
    """Capture ``options`` into ``log`` (the Python form of ``replog capture mysql``)."""
    with MySqlCapture(options, log, stop=stop, progress=progress) as running:
        return running.run()


def request_snapshot(dsn: str, tables: Sequence[str], name: str | None = None) -> str:
    """Ask the capture ``name`` (every capture of the server: None) to snapshot ``tables``
    while it streams: a row in ``replog.signals``, which the capture meets in binlog
    order, whether it runs now or starts later. The request's id."""
    options = MySqlOptions(dsn=dsn, tables=tuple(tables), name=name or "mysql")
    options.check()
    if not tables:
        raise InvalidOptionError("name the tables to snapshot")
    names = [options.qualified(t) for t in tables]
    signal_id = uuid.uuid4().hex
    connection = connect(options.source)
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {SIGNALS} VALUES (%s, %s, %s, NOW(6))",
                (signal_id, name, json.dumps(names)),
            )
    finally:
        connection.close()
    return signal_id
