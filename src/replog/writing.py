"""Writing a log: events in, a committed record out, under the staged-commit protocol.

DESIGN: this module owns the way from events to a commit, and the rules that make it
safe (docs/FORMAT.md, docs/RELIABILITY.md):

* rows are validated and staged as segment files no commit names yet
  (:meth:`LogWriter.stage`), while the state is brought up to date;
* before a commit names staged files, they are guarded against a garbage collection that
  began while they were staged (:meth:`LogWriter.guard_staged`, :mod:`replog.format.gc`);
* the commit is :mod:`replog.committing`'s: one put-if-absent of the next version,
  races retried, uncertain outcomes resolved by reading back;
* staged files are deleted only when it is certain no commit names them: an exception
  after a commit landed, or while its outcome is unknown, keeps them
  (:class:`~replog.core.staging.CommitAttempt`).

A writer builds on a :class:`~replog.reading.LogReader` (the log as it read it) and keeps
the rows of the files it wrote lately (merges take them from there). What runs after a
commit (checkpoints, expiry) is its ``after_commit`` hook, which :mod:`replog.maintenance`
sets; it merges nothing itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from replog import committing
from replog.core import fencing, files, leases, staging
from replog.core.files import DecodedFiles
from replog.core.staging import CommitAttempt
from replog.errors import CommitConflictError, MissingFileError, StagingCollectedError
from replog.format import segments
from replog.format.commits import APPEND, COMPACT, CommitRecord, Transaction, WriterInfo
from replog.format.events import events_from_records, events_from_table
from replog.format.gc import CLOCK_SKEW_MS, StagedFiles, StagingStart
from replog.format.leases import Lease
from replog.format.segments import SegmentInfo, StagedSegment
from replog.format.state import LogState
from replog.reading import LogReader
from replog.storage import threads
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

FRESH_S = 1.0
"""A writer whose state was checked this recently stages without reading the log first."""
CHECK_THREADS = 8
RESTAGES = 3
"""How often an append whose staged files a garbage collection may have taken (one that
began while it staged) stages them again before it gives up."""


class LogWriter:
    """Appends and commits to the log ``log`` reads. Not thread-safe."""

    def __init__(self, log: LogReader, *, written: DecodedFiles | None = None) -> None:
        self.log = log
        self.written = DecodedFiles(max_bytes=16 * 1024 * 1024) if written is None else written
        """Rows of the files this writer wrote lately: merges take them from here."""
        self.after_commit: Callable[[LogState], None] | None = None
        """Called with the new state after each commit lands; must not raise."""

    def append(
        self,
        events: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]],
        *,
        segment_max_events: int = segments.MAX_SEGMENT_EVENTS,
        transaction: Transaction | None = None,
    ) -> CommitRecord | None:
        """Validate ``events``, stage them and commit them (see
        :meth:`replog.log.ReplicationLog.append`). A version known before staging, a
        gc mark that may cover it, and a refused or vanished staging are each met by
        staging again from a fresh state, up to :data:`RESTAGES` times."""
        if isinstance(events, pa.Table | pa.RecordBatch):
            table = events_from_table(events)
        else:
            table = events_from_records(events)
        if table.num_rows == 0:
            return None
        log = self.log
        writer = transaction.writer() if transaction is not None else None
        known = log.known
        recent = known is not None and known.verified_within(FRESH_S)
        if writer is not None or not recent:
            known = log.refresh(verify_within=0)  # a transaction must not stage needlessly
            if writer is not None and fencing.holds(known, writer):
                logger.info("%s: %s is already in the log; skipped", log.url, transaction)
                return None
        assert known is not None
        # A version known before staging (maybe a little stale: only ever more cautious).
        since = StagingStart(known.version, now_ms())
        staged = self._stage_and_refresh(table, segment_max_events)
        if log.state().gc_version > since.version:
            # A collection began at a version the stale start does not rule out: stage
            # again from the fresh state rather than be refused (nothing was committed).
            self.discard_staged(staged)
            since = StagingStart(log.state().version, now_ms())
            staged = self.stage(table, max_events=segment_max_events)
        for restage in range(RESTAGES + 1):
            try:
                with staging.committing(log.storage, staged) as attempt:
                    record = self.commit_staged(
                        staged,
                        writer=writer,
                        attempt=attempt,
                        since=since,
                        refreshed=restage == 0,
                        follows=transaction.follows if transaction is not None else None,
                    )
                break
            except (StagingCollectedError, MissingFileError) as exc:
                # A collection began while this write staged (a short --grace): its files
                # may be gone. Nothing was committed and the rows are at hand: stage
                # them again (``committing`` deleted the old files).
                if restage == RESTAGES or not attempt.safe_to_discard:
                    raise
                logger.info("%s: staging the append again: %s", log.url, exc)
                since = StagingStart(log.refresh(verify_within=0).version, now_ms())
                staged = self.stage(table, max_events=segment_max_events)
        if record is None:  # the transaction landed meanwhile (another run of it)
            self.discard_staged(staged)
        return record

    def _stage_and_refresh(self, table: pa.Table, max_events: int) -> list[StagedSegment]:
        """Stage ``table`` and bring the state up to date for the commit that follows (a
        writer checks the log's identity before every commit). On remote storage both go
        out at once: the commit then waits for one round trip less."""
        log = self.log
        if not log.storage.is_remote:
            staged = self.stage(table, max_events=max_events)
            try:
                log.refresh(verify_within=0)
            except BaseException:
                self.discard_staged(staged)
                raise
            return staged
        with ThreadPoolExecutor(max_workers=1) as pool:
            # run here, before staging, if the pool takes no work (interpreter shutting down)
            refreshing = threads.submit(pool, functools.partial(log.refresh, verify_within=0))
            try:
                staged = self.stage(table, max_events=max_events)
            except BaseException:
                refreshing.exception()  # let it finish before the error goes up
                raise
            try:
                refreshing.result()
            except BaseException:
                self.discard_staged(staged)
                raise
        return staged

    def stage(
        self, table: pa.Table, *, max_events: int = segments.MAX_SEGMENT_EVENTS
    ) -> list[StagedSegment]:
        """Route validated rows to shards and write them as segment files (not yet visible)."""
        storage = self.log.storage
        storage.require_writable()
        return files.stage(
            storage, self.log.shards, table, max_events=max_events, written=self.written
        )

    def discard_staged(self, staged: Iterable[StagedSegment | SegmentInfo]) -> None:
        """Delete staged files that no commit names (the caller must know that)."""
        staging.discard(self.log.storage, staged)

    def commit_staged(
        self,
        staged: Sequence[StagedSegment],
        *,
        writer: WriterInfo | None = None,
        attempt: CommitAttempt | None = None,
        refreshed: bool = False,
        since: StagingStart | None = None,
        lease: Lease | None = None,
        follows: int | None = None,
    ) -> CommitRecord | None:
        """Make staged segments visible in one ``append`` commit, retrying lost races.

        With a ``writer``, the commit is exactly-once per (sink id, query id, epoch): if
        the log already holds it, returns None and commits nothing; if a newer run owns
        the sink, raises :class:`~replog.errors.FencedError`. ``refreshed``: as for
        :meth:`commit`.

        ``since`` says when the writer began staging: a log version it had just read and
        its clock (a stale version can get a write refused for nothing). The gc marks in
        the state the commit is built on tell whether ``replog recover`` may have
        deleted the staged files (:mod:`replog.format.gc`): if not, nothing is checked;
        if so, :class:`~replog.errors.StagingCollectedError` is raised and nothing is
        committed; without ``since``, or after staging for long, every staged file is
        checked to exist first. ``lease``: a staging lease the writer took before it
        staged; the files are then checked, never refused, unless the lease is gone,
        damaged or ran out (:class:`~replog.errors.StagingCollectedError`).
        ``follows``: with a ``writer``, the epoch of its query the log must hold (0: none),
        checked on the state the commit is built on, so it holds atomically with the
        commit (:attr:`~replog.format.commits.Transaction.follows`).
        """

        def build(state: LogState) -> CommitRecord | None:
            claimed = None
            if writer is not None:
                if fencing.holds(state, writer):
                    return None
                if follows is not None:
                    fencing.check_follows(state, writer, follows)
                claimed = fencing.claim(state, writer)  # FencedError if a newer run owns the sink
            self.guard_staged(state, staged, since, lease)
            heads = list(state.heads)
            added = []
            for segment in staged:
                added.append(segment.at(heads[segment.shard] + 1))
                heads[segment.shard] += segment.events
            return CommitRecord.after(state.version, APPEND, add=tuple(added), writer=claimed)

        return self.commit(build, attempt=attempt, refreshed=refreshed)

    def replace(
        self,
        added: Sequence[SegmentInfo],
        removed: Sequence[SegmentInfo],
        since: StagingStart,
        *,
        lease: Lease | None = None,
        refreshed: bool = False,
        yielding: bool = False,
    ) -> CommitRecord:
        """Commit staged files ``added`` in place of the live entries ``removed`` (one
        ``compact`` commit: the same sequences, heads unchanged), under the staging
        protocol: ``since`` is when staging began, ``lease`` the caller's staging lease.
        Used by merges and by key compaction. ``yielding``: an automatic merge, which
        commits nothing while an operator's compaction runs.

        Raises :class:`CommitConflictError` (deleting ``added``) if an entry of
        ``removed`` left the log meanwhile (another compaction or a truncation).
        """
        added, removed = tuple(added), tuple(removed)
        log = self.log

        def build(state: LogState) -> CommitRecord:
            gone = [source.path for source in removed if not state.is_live(source)]
            if gone:
                raise CommitConflictError(
                    f"{log.url}: {len(gone)} segments to rewrite left the log meanwhile "
                    f"(e.g. {gone[0]}); nothing was rewritten, plan again"
                )
            if yielding and leases.compaction_running(log.storage):
                raise CommitConflictError(
                    f"{log.url}: a compaction began; this automatic merge yields to it"
                )
            self.guard_staged(state, added, since, lease)
            return CommitRecord.after(state.version, COMPACT, add=added, remove=removed)

        with staging.committing(log.storage, added) as attempt:
            record = self.commit(build, attempt=attempt, refreshed=refreshed)
        assert record is not None  # build never returns None
        return record

    def guard_staged(
        self,
        state: LogState,
        staged: Sequence[StagedSegment | SegmentInfo],
        since: StagingStart | None,
        lease: Lease | None,
    ) -> None:
        """Before committing staged files on ``state``: refuse if a garbage collection
        may have taken them (or the lease that guards them is no longer held), check that
        they exist if that cannot be ruled out (:mod:`replog.format.gc`)."""
        url = self.log.url
        if lease is not None:
            leases.check_held(self.log.storage, lease, f"a write into {url}")
        verdict = state.staged_files(since, now_ms(), leased=lease is not None)
        if verdict is StagedFiles.REFUSE:
            assert since is not None
            raise StagingCollectedError(
                f"{url}: a garbage collection (gc mark at version {state.gc_version}) "
                f"began while this write was staging (it began at version "
                f"{since.version}), with a cut-off its staged files may fall under: "
                f"nothing was committed; run the write again. Writers allow for "
                f"{CLOCK_SKEW_MS // 60_000} minutes of clock skew, so a 'replog recover' "
                f"with a --grace shorter than that plus your longest write refuses writes "
                f"in flight"
            )
        if verdict is StagedFiles.CHECK:
            self.check_staged(staged)

    def check_staged(self, staged: Sequence[StagedSegment | SegmentInfo]) -> None:
        """Raise :class:`MissingFileError` if a staged file is gone (collected by a
        ``replog recover`` whose grace period was shorter than this write)."""
        if not staged:
            return
        storage = self.log.storage
        present = storage.map(lambda s: storage.exists(s.path), staged, threads=CHECK_THREADS)
        missing = [s.path for s, ok in zip(staged, present, strict=True) if not ok]
        if missing:
            raise MissingFileError(
                storage.where(missing[0]),
                f"{len(missing)} staged segment file(s) are gone before their commit (collected "
                f"by 'replog recover' with a --grace shorter than this write?); nothing was "
                f"committed, run the write again",
            )

    def commit(
        self,
        build: Callable[[LogState], CommitRecord | None],
        *,
        attempt: CommitAttempt | None = None,
        refreshed: bool = False,
    ) -> CommitRecord | None:
        """Commit ``build(state)`` (:func:`replog.committing.commit`), then run
        :attr:`after_commit`."""
        return committing.commit(
            self.log, build, attempt=attempt, refreshed=refreshed, after_commit=self.after_commit
        )
