"""PostgreSQL changes into a log, each source transaction exactly once (``replog capture
postgres``; docs/CDC.md, "Capturing PostgreSQL").

DESIGN: this module is the loop that commits (on :class:`~replog.capture.driver.CaptureDriver`,
which the MySQL capture shares); the stages it drives live beside it: the
source (:mod:`~replog.capture.source`: checks, catalog, slot, publication), the change
stream (:mod:`~replog.capture.pgoutput` decoding, :mod:`~replog.capture.stream` relations),
the events (:mod:`~replog.capture.events`) and the snapshot
(:mod:`~replog.capture.chunks`: chunks between watermarks; :mod:`~replog.capture.snapshot`:
the plan) and the catalog watch (:mod:`~replog.capture.watch`: DDL the stream does not
show; :mod:`~replog.capture.removals`: rows that left a table without delete events).

How it stays exactly once:

* The slot is read with ``pg_logical_slot_peek_binary_changes`` (``pgoutput``, protocol 1):
  a peek consumes nothing, and the server returns whole transactions only. Messages are
  fetched a few thousand at a time and a big transaction's events are staged as segment
  files as they are made (:class:`Batch`), so memory holds a piece of it, never all.
* Each commit to the log holds whole source transactions (one or many) and is an
  idempotent append (:class:`~replog.format.commits.Transaction`): app id
  ``pg-capture.<slot>``, version = the end LSN of its last transaction. The position
  is thus recorded in the same atomic commit as the events, and a version the log
  already holds is never appended again.
* The slot is advanced (``pg_replication_slot_advance``) only after the commit landed.
  A capture killed in between finds the log ahead of the slot on restart: it advances
  the slot to the log's position and skips every transaction at or below it.
* Snapshots are read in chunks between watermarks in the stream; a chunk's rows are in
  the commit that passes its high watermark, and the plan (written just before that
  commit) says how far each table got. A restart reads again only a chunk whose commit
  did not land.

This module never imports pyspark.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import replace

from replog.capture.batch import Batch
from replog.capture.chunks import Chunk, ChunkReader
from replog.capture.driver import CaptureDriver, ProgressCallback
from replog.capture.events import UNAVAILABLE, EventMaker
from replog.capture.options import CaptureOptions, capture_app_id
from replog.capture.pgoutput import (
    Commit,
    Decoder,
    Message,
    RowChange,
    SourceTransaction,
    Truncation,
    lsn_to_text,
)
from replog.capture.progress import CaptureProgress
from replog.capture.removals import EndBefore, Removals
from replog.capture.running import RunRecord
from replog.capture.snapshot import (
    ADDED,
    INITIAL,
    RECREATED,
    REQUESTED,
    RESYNC,
    SnapshotPlan,
    signal,
    watermark,
)
from replog.capture.source import (
    HEARTBEAT_PREFIX,
    MARKER_PREFIX,
    SIGNAL_PREFIX,
    WATERMARK_PREFIX,
    LogHolds,
    PostgresSource,
    SlotHealth,
    SlotInfo,
    Table,
    qualified_name,
    server_positions,
)
from replog.capture.stream import DeferredKeys, Relations
from replog.capture.truncates import Truncations
from replog.capture.watch import CatalogWatch
from replog.crashpoints import crash_point
from replog.errors import (
    InvalidOptionError,
    SourcePositionError,
)
from replog.log import ReplicationLog
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

__all__ = ["UNAVAILABLE", "PostgresCapture", "capture", "server_positions"]

IDLE_WAL_BYTES = 64 * 1024
"""WAL the server may write past capture's position and still be idle: after a heartbeat
it writes its own bookkeeping (a running-transactions record every 15 s, a checkpoint),
which must not call for the next heartbeat, or an idle server writes WAL forever (and,
with ``archive_timeout``, switches and archives a segment each time)."""


class PostgresCapture(CaptureDriver):
    """One capture of a PostgreSQL database into one log (see the module docstring)."""

    events: EventMaker
    reads = "the slot"
    one_per = "slot"

    def __init__(
        self,
        options: CaptureOptions,
        log: ReplicationLog,
        *,
        stop: threading.Event | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        options.check()
        super().__init__(log, capture_app_id(options.slot), stop=stop, progress=progress)
        self.identity = f"capture of slot {options.slot!r}"
        self.released: dict[str, int] = {}
        """Tables the log's capture of the slot captured that ``--tables`` now leaves out
        (``--tables-changed``): their changes still in the slot are skipped, counted."""
        options = self._remembered(options)
        self.options = options
        self.source = PostgresSource(options)
        self.source.known = self._known
        try:
            self.source.lock_slot()  # before anything else touches the slot
            logged = log.transaction_version(self.app_id)
            self.source.check(LogHolds(log.log_id, logged, self._slot_lsn))
            self._check_left_out()
            self.run_record = RunRecord(log.storage, options.slot, log.log_id)
            self.run_record.claim()
        except BaseException:
            self.source.close()
            raise
        self.events = EventMaker(
            self.source.database, options.slot, self.source.pg_type, self.source.current_values
        )
        self.decoder = Decoder()
        self.relations = Relations(self.source, options, self.progress, self._joined, self.released)
        self.deferred = DeferredKeys()
        self.chunks = ChunkReader(
            self.source, self.events, options.snapshot_chunk_rows, options.snapshot_workers
        )
        self.removals = Removals(self.source, self.events, log)
        self.truncations = Truncations(self.relations, self.events, log)
        self.watch = CatalogWatch(
            self.source, self.relations, self.removals, self._owe_snapshot, self._restart_snapshot
        )
        self.chunk: Chunk | None = None
        self._resources = ExitStack()
        self._resources.callback(self.chunks.close)
        self._txn: SourceTransaction | None = None
        """The transaction being read."""
        self._beat_at = time.monotonic()
        """When the last heartbeat was written (or the capture started)."""
        self._heartbeat_seen = False
        """The transaction being read holds a heartbeat (it carries no event)."""

    def close(self) -> None:
        self._resources.close()
        self.source.close()

    def _run(self) -> None:
        position = self._start()
        self.progress.position = position
        self._snapshotted = self._snapshot_owed()
        while not self.stop.is_set():
            self.watch.check()
            self._save_plan()
            self._next_chunk()
            captured = self._capture_batch()
            self._report(idle=not captured)
            self.run_record.beat(self.progress.position)
            if not captured and self.chunk is None and not self._snapshot_owed():
                if not self.options.follow:
                    self.watch.check(now=True)  # DDL since the last look owes nothing
                    self._save_plan()
                    if self._snapshot_owed() or self.removals.owed:
                        continue  # a marker written at that look is in the WAL: read to it
                    break
                self._heartbeat()
                self.stop.wait(self.options.poll_s)
        if self.options.drop_slot:
            # Only a capture that got here retires the slot (one that failed keeps it: the
            # changes after its last commit are still to be read), and only once it has
            # read what is left (a stopped follower may not have).
            while self._capture_batch():
                self._report()
            self.source.drop_slot()
            self.progress.slot_dropped = True
            self.progress.publication_dropped = self.source.drop_own_publication()
        else:
            self._look_at_slot()

    def _heartbeat(self) -> None:
        """While the tables are idle and the server writes WAL elsewhere, confirm how far
        capture got every ``heartbeat_s``: a transactional message, which the next batch
        reads and commits (with no events) like any transaction, so the slot advances
        and keeps WAL within a few heartbeats of the server's position (WAL moved: more
        than :data:`IDLE_WAL_BYTES`). Also looks at the slot: how much WAL it keeps, and
        whether the server invalidated it."""
        interval = self.options.heartbeat_s
        clock = time.monotonic()
        if not interval or clock - self._beat_at < interval:
            return
        self._beat_at = clock
        self._look_at_slot()
        if self.source.current_position() - self.progress.position > IDLE_WAL_BYTES:
            self.source.emit_message(HEARTBEAT_PREFIX, json.dumps({"slot": self.options.slot}))
            self.progress.heartbeats += 1

    def _look_at_slot(self) -> None:
        """How much WAL the slot keeps (progress and warnings), and whether it was lost."""
        health = self.source.slot_health()
        if health is None:
            return
        self.progress.retained_wal_bytes = health.retained_bytes
        self.progress.slot_wal_status = health.wal_status
        self._check_health(health)
        limit = health.limit_bytes
        if health.wal_status in ("extended", "unreserved") or (
            limit is not None and health.safe_bytes is not None and health.safe_bytes < limit / 4
        ):
            logger.warning(
                "slot %s keeps %d bytes of WAL (wal_status %s; max_slot_wal_keep_size %s, "
                "%s bytes left before the server invalidates it): capture is behind",
                self.options.slot,
                health.retained_bytes,
                health.wal_status,
                health.limit,
                health.safe_bytes,
            )

    def _lag_bytes(self) -> int:
        return max(self.source.current_position() - self.progress.position, 0)

    # -- starting: the slot and the log must agree --------------------------------------

    @property
    def _lease_owner(self) -> str:
        return f"replog capture of slot {self.options.slot}"

    def _remembered(self, options: CaptureOptions) -> CaptureOptions:
        """``options`` with the tables the log's capture of the slot captures when none are
        named (and no ``--publication``); a restart naming fewer is refused unless
        ``--tables-changed`` says so (more: each new one gets its snapshot)."""
        plan = SnapshotPlan.load(self.log.storage, options.slot, self.log.log_id)
        self._known = dict(plan.tables) if plan is not None else {}
        self._slot_lsn = plan.slot_lsn if plan is not None else 0
        remembered = sorted(self._known)
        if not options.tables and not options.publication:
            if not remembered:
                raise InvalidOptionError(
                    f"name the tables to capture (--tables) or a --publication: the log at "
                    f"{self.log.url} holds no capture of slot {options.slot!r} to resume"
                )
            logger.info("capturing the tables the log's capture of slot %s captures: %s",
                        options.slot, ", ".join(remembered))  # fmt: skip
            return replace(options, tables=tuple(remembered))
        return options

    def _check_left_out(self) -> None:
        """Tables the log's capture of the slot captured and ``--tables`` leaves out
        (a table renamed since is the same table, known by its id): refused unless
        ``--tables-changed``; then released (no longer captured)."""
        captured = {table.oid for table in self.source.tables.values()}
        left_out = {
            name: oid
            for name, oid in self._known.items()
            if oid not in captured and name not in self.source.tables
        }
        if left_out and not self.options.tables_changed:
            raise InvalidOptionError(
                f"--tables leaves out {', '.join(sorted(left_out))}, which the log's capture "
                f"of slot {self.options.slot!r} captures ({', '.join(sorted(self._known))}): "
                f"give them all (or no --tables: the log's are captured), or add "
                f"--tables-changed to stop capturing them (their rows stay in tables built "
                f"from the log)"
            )
        self.released.update(left_out)

    def _start(self) -> int:
        self._release_dead_leases()
        logged = self.log.transaction_version(self.app_id)  # the slot position it holds
        self._logged = logged or 0
        slot = self.source.slot()
        if logged is None:
            return self._start_new(slot)
        why = self._not_resumable(logged, slot)
        if why is not None:
            if self.options.reset_slot or self._started_over(logged, slot):
                logger.warning("%s: starting over with a new slot (--reset-slot)", why)
                return self._start_new(slot, resync=True)
            raise SourcePositionError(
                f"{why}. --reset-slot starts over with a new slot into this log: the rows "
                f"the source no longer holds are deleted from it, and every row is read again"
            )
        assert slot is not None
        plan = SnapshotPlan.load(self.log.storage, self.options.slot, self.log.log_id)
        if plan is None:  # a capture of an earlier replog, or one that never had a plan
            plan = SnapshotPlan(self.options.slot, self.log.log_id, tables=self._table_ids())
            self._plan_changed = True
        self.plan = self.truncations.plan = plan
        self._plan_changed |= plan.resolve(logged)
        missed = self._missed(plan)  # before the publication is made whole
        self.removals.plan = plan
        for table, why in missed:
            self._resync(table, why)
        if missed:  # what is owed, saved before the publication changes (as it was)
            plan.save(self.log.storage)
        added = self._publish()
        self._release(plan, logged)
        self.watch.start(plan)  # what DDL did while no capture ran
        for table in self.source.tables.values():
            if table.qualified not in plan.tables or (table in added and table not in dict(missed)):
                self._owe_snapshot(table, ADDED)
        self.removals.emit_owed()
        self._save_plan()
        confirmed = slot[2]
        if confirmed < logged:  # killed after a commit, before the advance
            logger.info(
                "advancing slot %s from %s to the log's %s",
                self.options.slot,
                lsn_to_text(confirmed),
                lsn_to_text(logged),
            )
            self.source.advance(logged)
        return logged

    def _not_resumable(self, logged: int, slot: SlotInfo | None) -> str | None:
        """Why the log's capture cannot go on reading the slot from its position (None:
        it can)."""
        name, at = self.options.slot, lsn_to_text(logged)
        if slot is None:
            return (
                f"the log holds capture position {at} of slot {name!r}, but the slot does "
                f"not exist: changes after it are gone"
            )
        health = self.source.slot_health()
        if health is not None and health.lost:
            reason = health.invalidation or "wal_status lost"
            return (
                f"the server invalidated slot {name!r} ({reason}): the WAL after the log's "
                f"position {at} is gone (max_slot_wal_keep_size is {health.limit}: raise it, "
                f"or keep the capture running)"
            )
        if slot[2] > logged:
            return (
                f"slot {name!r} was advanced to {lsn_to_text(slot[2])}, past the log's "
                f"position {at}: the changes between were consumed elsewhere and would be lost"
            )
        owner = self.source.slot_owner()
        if owner is not None and owner.get("log_id") != self.log.log_id:  # --reset-slot
            return f"slot {name!r} belongs to log {owner.get('log', '?')}"
        return None

    def _check_health(self, health: SlotHealth) -> None:
        """A slot the server invalidated while capture ran (``max_slot_wal_keep_size``, an
        old xmin) holds none of the changes after its position: say so with the way on,
        never loop."""
        if health.lost:
            raise SourcePositionError(
                f"the server invalidated slot {self.options.slot!r} "
                f"({health.invalidation or 'wal_status lost'}): the WAL after the log's "
                f"position is gone (max_slot_wal_keep_size is {health.limit}). Start over with "
                f"--reset-slot (a new slot into this log: the rows the source no longer holds "
                f"are deleted from it, and every row is read again), and raise "
                f"max_slot_wal_keep_size or keep the capture running"
            )

    def _started_over(self, logged: int, slot: SlotInfo | None) -> bool:
        """The slot is one this log's capture created in place of one it could not resume
        (``--reset-slot``) and never advanced: that run was killed before its first
        commit, and this one starts over again."""
        return slot is not None and bool(self._slot_lsn) and slot[2] == self._slot_lsn > logged

    def _missed(self, plan: SnapshotPlan) -> list[tuple[Table, str]]:
        """The captured tables whose changes since the log's position the stream lacks,
        and why: capture's own publication dropped meanwhile (created again at start) or
        the table taken out of it, or, for a partitioned table, a publication through
        partition roots (replog before 0.6), which sent no TRUNCATE of one partition."""
        state = self.source.own_publication_state()
        if state == "user":
            return []
        publication = self.source.publication
        if state is None:
            why = f"capture's own publication {publication} was dropped since the log's position"
            return [(table, why) for table in self.source.tables.values()]
        missing = self.source.unpublished([table.oid for table in self.source.tables.values()])
        found = []
        for table in self.source.tables.values():
            if plan.tables.get(table.qualified) != table.oid:
                continue  # new to the capture, or created again: its snapshot is owed anyway
            if missing and table.oid in missing:
                why = f"{table.qualified} was taken out of capture's own publication {publication}"
                found.append((table, f"{why} since the log's position"))
            elif state == "root" and self.source.is_partitioned(table.oid):
                why = f"publication {publication} published through partition roots (replog "
                found.append((table, f"{why}before 0.6), which sends no TRUNCATE of a partition"))
        return found

    def _resync(self, table: Table, why: str) -> None:
        """The stream missed changes of ``table``: its rows the source no longer holds are
        deleted from the log (at a marker), and it is snapshotted again."""
        logger.warning(
            "%s: changes of %s are missing from the stream since the log's position. Its rows "
            "the source no longer holds are deleted from the log, and it is snapshotted again",
            why,
            table.qualified,
        )
        self.removals.stale(table)
        self._restart_snapshot(table, RESYNC)

    def _publish(self) -> list[Table]:
        """Capture's own publication made whole for the tables (and naming this log its
        owner), the tables ``--tables-changed`` released taken out; the tables it added."""
        added = self.source.ensure_publication(self._owner)
        for name, oid in self.released.items():
            if self.source.remove_from_publication(oid):
                logger.warning("%s is no longer captured (--tables-changed): its rows stay in "
                               "tables built from the log", name)  # fmt: skip
        return added

    def _release(self, plan: SnapshotPlan, logged: int) -> None:
        """Remember in the plan the tables released now, and skip the changes still unread
        of those released before (until the log's position passes where they left)."""
        at = self.source.current_position()
        for name, oid in self.released.items():
            plan.drop(name)
            plan.released[name] = {"oid": oid, "at": at}
            self._plan_changed = True
        captured = {table.oid for table in self.source.tables.values()}
        for name, entry in list(plan.released.items()):
            if entry["at"] <= logged or entry["oid"] in captured:
                del plan.released[name]
                self._plan_changed = True
            else:
                self.released.setdefault(name, entry["oid"])

    @property
    def _owner(self) -> dict[str, str]:
        return {"log_id": self.log.log_id, "log": self.log.url}

    def _start_new(self, slot: SlotInfo | None, *, resync: bool = False) -> int:
        """A capture the log holds nothing of (or, ``resync``, one that cannot resume its
        slot): a new slot, every table's snapshot owed (with ``resync``, after the rows
        the source no longer holds are deleted)."""
        ours_to_redo = self.source.slot_ours and self.options.snapshot == "initial"
        if slot is not None and (self.options.reset_slot or ours_to_redo or resync):
            logger.warning(
                "%s: dropping slot %s (the log holds no capture it can resume) to start over "
                "with a new slot and a snapshot",
                "--reset-slot"
                if self.options.reset_slot
                else "this log's earlier run ended before its first commit",
                self.options.slot,
            )
            self.source.drop_slot()
            slot = None
        self._publish()
        position = slot[2] if slot is not None else self.source.create_slot()
        self.plan = SnapshotPlan(
            self.options.slot,
            self.log.log_id,
            tables=self._table_ids(),
            slot_lsn=0 if slot is not None else position,
        )
        self._slot_lsn = self.plan.slot_lsn
        self.truncations.plan = self.plan
        self.watch.start(self.plan)
        if resync:
            for table in self.source.tables.values():
                self._resync(table, f"slot {self.options.slot} started over")
        elif self.options.snapshot == "initial":
            for table in self.source.tables.values():
                self.plan.enqueue(table, INITIAL, self.source.estimated_rows(table))
        self._plan_changed = True
        self._save_plan()
        self.removals.emit_owed()
        return position

    def _table_ids(self) -> dict[str, int]:
        return {name: table.oid for name, table in self.source.tables.items()}

    def _owe_snapshot(self, table: Table, reason: str, relation: int = 0) -> None:
        """A table's rows so far (or those of its partition ``relation``) never reached
        the log: snapshot them (unless snapshots are off: then say what is missing)."""
        assert self.plan is not None
        if self.options.snapshot != "initial":
            logger.warning(
                "%s: rows of %s%s are not captured (--snapshot never), only changes from now on",
                reason,
                table.qualified,
                f" (partition {relation})" if relation else "",
            )
            return
        estimate = self.source.estimated_rows(table, relation)
        if self.plan.enqueue(table, reason, estimate, relation):
            self._plan_changed = True
            self._snapshotted = True

    def _restart_snapshot(self, table: Table, reason: str) -> None:
        """Every row of ``table`` again (its snapshot from the start if it is running)."""
        assert self.plan is not None
        if self._never_again(self.options.snapshot, reason, table.qualified):
            return
        if self.plan.restart(table, reason, self.source.estimated_rows(table)):
            self._plan_changed = True
            self._snapshotted = True

    def _joined(self, table: Table) -> None:
        self._owe_snapshot(table, ADDED)

    def _save_plan(self) -> None:
        self._plan_changed |= self.watch.changed or self.removals.changed
        self.watch.changed = self.removals.changed = False
        if self.plan is not None and self.plan.tables != self._table_ids():
            self._plan_changed = True  # a table joined, was released or replaced
        super()._save_plan()

    # -- snapshot chunks -------------------------------------------------------------------

    def _next_chunk(self) -> None:
        """Read the next chunk owed, between its watermarks, unless one is in flight."""
        if self.chunk is not None or self.plan is None:
            return
        owed = self.plan.current
        if owed is None:
            return
        table = self.source.tables.get(owed.table)
        if table is None:
            logger.warning("%s is no longer captured: its snapshot is dropped", owed.table)
            self.plan.drop(owed.table)
            self._plan_changed = True
            return
        if owed.oid != table.oid:  # owed for a table of that name dropped since
            self._owe_snapshot(table, RECREATED, owed.relation)
            return
        if not owed.started_ms:
            owed.started_ms = now_ms()
        chunk = self.chunks.read(owed, table)
        if chunk is None:  # the table, or the partition, left: the watch says what comes of it
            logger.warning("%s was dropped (or detached) while its snapshot was read: the "
                           "snapshot is given up", owed.name)  # fmt: skip
            self.plan.give_up(owed)
            self._plan_changed = True
            self.watch.check(now=True)
            return
        chunk.ts_ms = now_ms()
        chunk.metadata = self.events.snapshot_metadata(
            chunk.table, ts_ms=chunk.ts_ms, position=chunk.high_lsn, kind=owed.kind
        )
        self.chunk = chunk

    def _watermark(self, message: Message, batch: Batch) -> None:
        """Take a watermark message: at the high watermark of the chunk in flight its rows
        go into ``batch``, which then ends with this transaction."""
        found = watermark(message.content)
        chunk = self.chunk
        if found is None or chunk is None or found[0] != chunk.mark:
            return  # another capture's, or a chunk of a run that was killed
        if found[1] == "low":
            chunk.low_seen = True
            return
        assert self._txn is not None
        self.removals.first(chunk.table, batch, self._txn.commit_lsn)
        batch.add_chunk(chunk)
        self.chunk = None

    def _signal(self, message: Message) -> None:
        """A request for snapshots (``replog capture snapshot``, or the SQL it runs)."""
        assert self.plan is not None
        try:
            found = signal(message.content, self.options.slot, message.lsn)
        except ValueError as exc:
            logger.warning("a signal at LSN %s cannot be read: %s", lsn_to_text(message.lsn), exc)
            return
        if found is None:
            return
        signal_id, names = found
        if self.plan.took_signal(message.lsn):
            return
        logger.info("signal %s asks for snapshots of %s", signal_id, ", ".join(names))
        self._plan_changed = True
        for name in names:
            table = self.source.captured(qualified_name(name))
            if table is None:
                logger.warning(
                    "a signal asks for a snapshot of %s, which this capture does not capture",
                    name,
                )
                continue
            self._owe_snapshot(table, REQUESTED)

    # -- streaming -----------------------------------------------------------------------

    def _capture_batch(self) -> bool:
        """Read whole transactions from the slot, commit them, then advance the slot.
        Whether the slot had any (or a batch had to end early, to delete the rows of a
        dropped table first)."""
        position = self.progress.position
        batch = Batch(self.log, self._lease_owner, self.options.stage_events)
        try:
            self.removals.head(batch)
            self._read_batch(batch, position)
        except EndBefore as early:
            batch.abandon()
            self.removals.end_before = early.commit_lsn
            self.removals.due.add(early.what)
            return True
        except BaseException:
            batch.abandon()
            raise
        if not batch.transactions:
            batch.abandon()
            return self.removals.prepare(position)
        last = batch.position
        if last > position:
            try:
                self._note_for_plan(batch, last)
            except BaseException:
                batch.abandon()
                raise
            try:
                self._commit(batch, last)
            finally:
                batch.release()
        self.removals.ready = {}
        crash_point("capture_committed")
        self.source.advance(last)
        if self.plan is not None and self.plan.resolve(max(position, last)):
            self._plan_changed = True  # saved with the next change of the plan
        self.progress.position = max(position, last)
        self._counted(batch, snapshot_rows=len(batch.chunk.events) if batch.chunk else 0,
                      captured=batch.captured, last_commit_ms=batch.last_commit_ms)  # fmt: skip
        self.progress.skipped_transactions += batch.transactions - batch.captured - batch.heartbeats
        self.removals.prepare(max(position, last))
        return True

    def _note_for_plan(self, batch: Batch, position: int) -> None:
        """Write down, before the commit, what it carries of the plan: a chunk (how far
        its table then got), deletes of dropped tables' rows. A restart reads the log's
        position to tell whether that commit landed (:meth:`SnapshotPlan.resolve`)."""
        if self.plan is None:
            return
        if batch.chunk is not None:
            self.plan.pending = batch.chunk.pending(position)
            self._plan_changed = True
        self.removals.done(batch, position)
        self._save_plan()

    def _read_batch(self, batch: Batch, position: int) -> None:  # noqa: C901 - per message kind
        """Fill ``batch`` with whole transactions from the slot (a high watermark ends it)."""
        txn: SourceTransaction | None = None
        skip = False
        order = 1
        ts_ms = now_ms()
        for lsn, message in self.source.peek_stream(self.options.max_changes):
            item = self.decoder.feed(lsn, message)
            if isinstance(item, SourceTransaction):
                end_before = self.removals.end_before
                if end_before is not None and item.commit_lsn >= end_before:
                    break  # the deletes of a dropped table's rows come first
                txn, order = item, 1
                self._txn = item
                skip = item.commit_lsn < position  # the log holds it (killed before advance)
                self.deferred.begin()
                self._heartbeat_seen = False
            elif isinstance(item, Commit):
                self._end_transaction(item.transaction, batch, skip)
                if batch.chunk is not None:
                    break  # the commit carrying a chunk ends at its high watermark
            elif item is None or skip:
                continue
            elif isinstance(item, RowChange):
                assert txn is not None
                order = self._change(item, txn, order, ts_ms, batch)
            elif isinstance(item, Truncation):
                assert txn is not None
                order = self.truncations.take(item, txn, order=order, batch=batch,
                                              chunk=self.chunk)  # fmt: skip
            elif item.prefix == WATERMARK_PREFIX:
                self._watermark(item, batch)
            elif item.prefix == SIGNAL_PREFIX:
                self._signal(item)
            elif item.prefix == MARKER_PREFIX:
                assert txn is not None
                self._marker(item, batch, txn)
            elif item.prefix == HEARTBEAT_PREFIX:
                self._heartbeat_seen = True

    def _marker(self, message: Message, batch: Batch, txn: SourceTransaction) -> None:
        """A marker the catalog watch wrote: where rows that left a table are deleted."""
        try:
            removal_id = str(json.loads(message.content)["removal"])
        except (ValueError, KeyError, TypeError):
            logger.warning("a marker at LSN %s cannot be read", lsn_to_text(message.lsn))
            return
        self.removals.marker(removal_id, batch, txn.commit_lsn)

    def _end_transaction(self, done: SourceTransaction, batch: Batch, skipped: bool) -> None:
        batch.transactions += 1
        batch.position = done.end_lsn
        if self._heartbeat_seen:  # a heartbeat's transaction: it moves the position only
            batch.heartbeats += 1
        elif not skipped:
            batch.captured += 1
            batch.last_commit_ms = done.commit_ms

    def _change(
        self, change: RowChange, txn: SourceTransaction, order: int, ts_ms: int, batch: Batch
    ) -> int:
        """Add the events of one row change to ``batch``; the next event's order number."""
        mapped = self.relations.map(change, txn)
        if mapped is None:
            return order
        table = mapped.table
        if self.removals.replaced(table):
            return order
        if mapped.replaced is not None:  # seen in the stream first (a user's publication)
            self.watch.replaced(table.qualified, mapped.replaced)
        self.removals.first(table, batch, txn.commit_lsn)
        chunk = self.chunk
        if chunk is None or chunk.table.oid != table.oid:
            made = self.events.changes(table, mapped.change, txn, order, ts_ms)
        else:  # a change in a chunk's window stands for its key's row
            made = self.events.changes(table, mapped.change, txn, order, ts_ms, unsent=chunk.unsent)
            for event in made:
                chunk.stood_for(event.key, event.data)
        batch.add(self.deferred.keep(table, made))
        return order + len(made)

    # -- committing ------------------------------------------------------------------------

    def _commit(self, batch: Batch, position: int) -> None:
        """One atomic commit of ``batch`` that records ``position``."""
        if self._commit_batch(batch, position):
            self.progress.truncations += batch.truncations
            self.progress.skipped_truncations += batch.skipped_truncations
            if batch.chunk is not None:
                self.progress.snapshot_rows += len(batch.chunk.events)


def capture(
    options: CaptureOptions,
    log: ReplicationLog,
    *,
    stop: threading.Event | None = None,
    progress: ProgressCallback | None = None,
) -> CaptureProgress:
    """Capture ``options`` into ``log`` (the Python form of ``replog capture postgres``)."""
    with PostgresCapture(options, log, stop=stop, progress=progress) as running:
        return running.run()
