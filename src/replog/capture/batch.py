"""The events of whole source transactions, committed to the log at once.

DESIGN: a :class:`Batch` is what one commit of a capture carries: the events of whole
source transactions, a snapshot chunk's read events, deletes of rows that left a table.
It holds them as columns and stages them as segment files each time many gathered
(under a staging lease), so a transaction of millions of changes costs the memory of a
piece of it; its commit then names every staged file at once and records the capture's
position (the staged-commit protocol, :meth:`~replog.log.ReplicationLog.commit_staged`).
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from replog.capture.chunks import Chunk
from replog.capture.events import ChunkRows, Event, EventColumns
from replog.core import files, leases, staging
from replog.crashpoints import crash_point
from replog.format.commits import CommitRecord, Transaction
from replog.format.gc import StagingStart
from replog.format.leases import Lease
from replog.format.segments import StagedSegment
from replog.log import ReplicationLog
from replog.timeutil import now_ms

_ROW_COLUMNS = ["collection", "key", "data", "operation"]


class Batch:
    """The events of whole source transactions, to be committed at once: held as columns,
    and staged as segment files (under a staging lease) each time many gathered, so a
    transaction of millions of changes costs the memory of ``stage_events`` events."""

    def __init__(self, log: ReplicationLog, owner: str, stage_events: int) -> None:
        self.log = log
        self.owner = owner
        self.stage_events = stage_events
        self.held = EventColumns()
        self.staged: list[StagedSegment] = []
        self.lease: Lease | None = None
        self.since: StagingStart | None = None
        self.events = 0
        self.transactions = 0
        self.position = 0
        """The end LSN of its last whole transaction (0: none yet)."""
        self.chunk: Chunk | None = None
        """The snapshot chunk whose rows it carries."""
        self.captured = 0
        """Transactions it holds events of (the others the log held already)."""
        self.last_commit_ms: int | None = None
        self.heartbeats = 0
        """Transactions it holds that are heartbeats (they carry no event)."""
        self.removed: list[str] = []
        """What the deletes at its head are for (:mod:`~replog.capture.removals`)."""
        self.counts: Counter[tuple[str, str]] = Counter()
        """Its events by (collection, operation; ``read``: a snapshot chunk's rows)."""
        self.truncations = 0
        self.skipped_truncations = 0
        """The TRUNCATEs it holds (or passed over): counted once it commits (a batch
        abandoned and read again would count them twice)."""

    def add(self, events: list[Event]) -> None:
        self.held.add(events)
        self.events += len(events)
        self.counts.update((event.collection, event.operation) for event in events)
        self._stage_if_many()

    def add_chunk(self, chunk: Chunk) -> None:
        """The read events of a snapshot chunk (its rows the window left)."""
        self.add_reads(chunk.table.qualified, chunk.events, chunk.ts_ms, chunk.metadata)
        self.chunk = chunk

    def add_reads(self, collection: str, rows: ChunkRows, ts_ms: int, metadata: str) -> None:
        """The read events of a snapshot chunk of ``collection`` (its rows the window
        left), all with ``ts_ms`` and ``metadata``."""
        self.held.add_table(rows.table(collection, ts_ms, metadata))
        self.events += len(rows)
        self.counts[(collection, "read")] += len(rows)
        self._stage_if_many()

    def _stage_if_many(self) -> None:
        if len(self.held) >= self.stage_events:
            if self.lease is None:
                self.lease = leases.acquire(self.log.storage, self.owner)
            self._stage()

    def _stage(self) -> None:
        if self.since is None:
            self.since = StagingStart(self.log.refresh().version, now_ms())
        self.staged.extend(self.log.stage(self.held.table()))
        self.held.clear()
        crash_point("capture_staged")

    def rows_of(self, collection: str) -> list[pa.Table]:
        """The events of ``collection`` it holds so far (``key``, ``data``, ``operation``),
        in the order added: those staged as files read back, then those held."""
        found = [
            files.read_stored(self.log.storage, staged.at(1)).select(_ROW_COLUMNS)
            for staged in self.staged
        ]
        found.append(self.held.table().select(_ROW_COLUMNS))
        return [table.filter(pc.equal(table.column("collection"), collection)) for table in found]

    def commit(self, transaction: Transaction) -> CommitRecord | None:
        """Commit every event as one commit recording ``transaction``; None if the log
        holds it already. Also with no events: the position moves on."""
        if len(self.held):
            self._stage()
        with staging.committing(self.log.storage, self.staged) as attempt:
            record = self.log.commit_staged(
                self.staged,
                writer=transaction.writer(),
                attempt=attempt,
                since=self.since,
                lease=self.lease,
                follows=transaction.follows,
            )
        if record is None:
            self.log.discard_staged(self.staged)
        elif self.staged:
            self.log.maintain()
        return record

    def release(self) -> None:
        """Give the staging lease back (after a commit, or a failure: ``recover`` then
        collects what was staged and never committed)."""
        if self.lease is not None:
            leases.release_quietly(self.log.storage, self.lease)
            self.lease = None

    def abandon(self) -> None:
        """Before its commit was tried: delete what was staged (no commit can name it)."""
        if self.staged:
            self.log.discard_staged(self.staged)
            self.staged = []
        self.release()
