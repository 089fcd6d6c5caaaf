"""A replication log at one fsspec URL: the facade over the format, for writers and readers.

The format is described in docs/FORMAT.md and implemented in :mod:`replog.format`; this
module opens logs, keeps their state current, and commits with the rules that make
writes safe:

* a commit is one put-if-absent of the next version; a lost race is retried on the new
  state; an uncertain outcome is resolved by reading the version back;
* staged files are deleted only when it is certain no commit names them: an exception
  after a commit landed, or while its outcome is unknown, keeps them
  (:class:`CommitAttempt`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from replog import merges as merge_plans
from replog.core import fencing, files, history, leases, staging
from replog.core.files import DecodedFiles
from replog.core.staging import CommitAttempt
from replog.errors import (
    CommitConflictError,
    CommitOutcomeUnknownError,
    DataLossError,
    InvalidOptionError,
    LogExistsError,
    LogNotFoundError,
    LogRecreatedError,
    MissingFileError,
    ReplogError,
    StagingCollectedError,
    StorageError,
)
from replog.format import segments
from replog.format.commits import (
    APPEND,
    COMPACT,
    DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_RETENTION_MS,
    DEFAULT_SHARDS,
    DEFAULT_SNAPSHOT_INTERVAL,
    DESCRIPTOR_PATH,
    MAX_SHARDS,
    META_DIR,
    MIN_RETENTION_MS,
    TXN_QUERY,
    CommitRecord,
    LogDescriptor,
    Transaction,
    WriterInfo,
    commit_path,
)
from replog.format.events import EVENT_SCHEMA, events_from_records, events_from_table
from replog.format.gc import CLOCK_SKEW_MS, StagedFiles, StagingStart
from replog.format.leases import Lease
from replog.format.segments import SHARDS_DIR, Part, SegmentInfo, StagedSegment
from replog.format.state import LogState, retained_events
from replog.merges import Merge
from replog.storage import Storage, threads
from replog.timeutil import monotonic_s, now_ms

logger = logging.getLogger(__name__)

MAX_COMMIT_ATTEMPTS = 200
RACE_BACKOFF_MAX_S = 0.02
"""A writer that lost a commit race waits at most this long (at random) before it reads
the winner's commit and tries the next version: the chain of versions is the log's
throughput, and a long back-off leaves it idle."""
FRESH_S = 1.0
"""A writer whose state was checked this recently stages without reading the log first."""
READ_VERIFY_S = 1.0
"""A reader checks that the log at its URL is still its log at most this often while
nothing new arrives (a writer checks before every commit)."""
CHECK_THREADS = 8
RESTAGES = 3
"""How often an append whose staged files a garbage collection may have taken (one that
began while it staged) stages them again before it gives up."""


@dataclass(frozen=True)
class LogInfo:
    """A summary of a log (``replog info``)."""

    url: str
    format_version: int
    log_id: str
    shards: int
    version: int
    heads: dict[int, int]
    lows: dict[int, int]
    segments: int
    files: int
    bytes: int
    sinks: dict[str, dict[str, Any]]
    last_commit_ms: int
    retention_ms: int
    retained_from: int
    auto_compact: bool

    @property
    def events(self) -> int:
        return retained_events(self.heads, self.lows)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "format_version": self.format_version,
            "log_id": self.log_id,
            "shards": self.shards,
            "version": self.version,
            "heads": {str(s): h for s, h in self.heads.items()},
            "lows": {str(s): low for s, low in self.lows.items()},
            "events": self.events,
            "segments": self.segments,
            "files": self.files,
            "bytes": self.bytes,
            "sinks": self.sinks,
            "last_commit_ms": self.last_commit_ms,
            "retention_ms": self.retention_ms,
            "retained_from": self.retained_from,
            "auto_compact": self.auto_compact,
        }


class ReplicationLog:
    """One replog log. Cheap to open; not thread-safe (use one per thread or process, or
    share a :class:`~replog.appender.GroupAppender`)."""

    def __init__(
        self, storage: Storage, descriptor: LogDescriptor, *, auto_compact: bool | None = None
    ) -> None:
        """``auto_compact``: merge small files after this writer's commits (default: as
        the log's descriptor says)."""
        self.storage = storage
        self.descriptor = descriptor
        self.auto_compact = descriptor.auto_compact if auto_compact is None else auto_compact
        self._state: LogState | None = None
        self._files = DecodedFiles()
        """Files this object read (checked against their digests), for its reads."""
        self._written = DecodedFiles(max_bytes=16 * 1024 * 1024)
        """Rows of the files this object wrote lately: its merges take them from here."""
        self._row_sequences: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        """Holed entries' row sequences, by entry (:meth:`row_sequences`)."""
        self._background: ThreadPoolExecutor | None = None
        """Merges and retention run in a thread of this object's own: a merge costs a few
        commits' time, and deleting files ~0.1 ms each on local disk; either would stall
        the commit that triggers it."""
        self._merging: Future[CommitRecord | None] | None = None
        self._merger: ReplicationLog | None = None
        self._expiry: Future[int] | None = None
        self._helper = False
        """A background merger's log object: it schedules no background work itself."""

    # -- opening ----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        url: str,
        shards: int = DEFAULT_SHARDS,
        *,
        storage_options: Mapping[str, Any] | None = None,
        snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
        retention_ms: int = DEFAULT_RETENTION_MS,
        auto_compact: bool = True,
    ) -> ReplicationLog:
        """Create an empty log at ``url``.

        ``retention_ms``: how long commits, snapshots and the files of segments that left
        the log (compacted or truncated) are kept. ``auto_compact``: whether writers merge
        small files after their commits (each writer may override it).

        Raises:
            LogExistsError: a log is already there.
            InvalidOptionError: ``shards`` is not 1..4096, or the URL cannot be opened.
            UnsupportedStorageError: the backend has no atomic create-if-absent.
        """
        if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
            raise InvalidOptionError(
                f"shards must be an integer from 1 to {MAX_SHARDS}, got {shards!r}"
            )
        if snapshot_interval < 1:
            raise InvalidOptionError(f"snapshot_interval must be >= 1, got {snapshot_interval}")
        if retention_ms < MIN_RETENTION_MS:
            raise InvalidOptionError(
                f"retention must be at least {MIN_RETENTION_MS} ms, got {retention_ms}"
            )
        storage = Storage(url, storage_options)
        storage.require_writable()
        _check_place_for_a_log(storage)
        checkpoint_interval = (
            DEFAULT_CHECKPOINT_INTERVAL
            if snapshot_interval % DEFAULT_CHECKPOINT_INTERVAL == 0
            else snapshot_interval
        )
        descriptor = LogDescriptor(
            shards=shards,
            log_id=str(uuid.uuid4()),
            created_ms=now_ms(),
            snapshot_interval=snapshot_interval,
            checkpoint_interval=checkpoint_interval,
            retention_ms=retention_ms,
            auto_compact=auto_compact,
        )
        try:
            storage.put_if_absent(DESCRIPTOR_PATH, descriptor.to_bytes())
        except FileExistsError as exc:
            raise LogExistsError(f"{url!r} already holds a replog log") from exc
        history.hint(storage).advance(0)  # readers find it without probing for headers
        logger.info("created log %s with %d shards", url, shards)
        return cls(storage, descriptor)

    @classmethod
    def open(
        cls,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        auto_compact: bool | None = None,
    ) -> ReplicationLog:
        """Open the log at ``url``.

        Raises:
            LogNotFoundError: there is no log at ``url``.
            UnsupportedFormatError: the log was written by a newer replog.
        """
        return cls.from_storage(Storage(url, storage_options), auto_compact=auto_compact)

    @classmethod
    def from_storage(cls, storage: Storage, *, auto_compact: bool | None = None) -> ReplicationLog:
        try:
            data = storage.read_optional(DESCRIPTOR_PATH)
        except (NotADirectoryError, IsADirectoryError) as exc:
            raise LogNotFoundError(
                f"{storage.url!r} holds no replog log: it is a file, not a directory"
            ) from exc
        if data is None:
            if not storage.exists(""):
                raise LogNotFoundError(
                    f"{storage.url!r} holds no replog log: {storage.where('')} does not exist"
                )
            raise LogNotFoundError(f"{storage.url!r} holds no replog log (no {DESCRIPTOR_PATH})")
        descriptor = LogDescriptor.from_bytes(data, storage.path(DESCRIPTOR_PATH))
        return cls(storage, descriptor, auto_compact=auto_compact)

    @classmethod
    def open_or_create(
        cls, url: str, shards: int, *, storage_options: Mapping[str, Any] | None = None
    ) -> ReplicationLog:
        """Open the log at ``url``, creating it with ``shards`` shards if absent (race-safe)."""
        try:
            return cls.open(url, storage_options=storage_options)
        except LogNotFoundError:
            pass
        try:
            return cls.create(url, shards, storage_options=storage_options)
        except LogExistsError:
            return cls.open(url, storage_options=storage_options)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "storage": self.storage,
            "descriptor": self.descriptor,
            "auto_compact": self.auto_compact,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["storage"], state["descriptor"], auto_compact=state.get("auto_compact")
        )

    def __repr__(self) -> str:
        return f"ReplicationLog({self.url!r}, shards={self.shards})"

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def shards(self) -> int:
        return self.descriptor.shards

    @property
    def log_id(self) -> str:
        return self.descriptor.log_id

    # -- state ------------------------------------------------------------------------

    def refresh(self, *, verify_within: float = READ_VERIFY_S) -> LogState:
        """The current state, reading only what was committed since the last call.

        Raises :class:`~replog.errors.LogRecreatedError` (or ``LogNotFoundError``) if the
        log this object opened was deleted (and another created) at its URL: checked at
        every refresh that finds nothing new, unless it was for this version less than
        ``verify_within`` seconds ago (writers check every time: 0).
        """
        if self._state is None:
            self._state = history.load_state(self.storage, self.descriptor)
            return self._state
        try:
            caught_up = history.catch_up(
                self.storage,
                self._state,
                limit=self.descriptor.snapshot_interval,
                verify_within=verify_within,
                idle_ms=self.descriptor.retention_ms - CLOCK_SKEW_MS,
            )
        except history.BaseMissing:  # retention removed what this idle state was built on
            caught_up = False
        if not caught_up:  # far behind: a snapshot is cheaper than every commit
            fresh = history.load_state(self.storage, self.descriptor)
            if fresh.version >= self._state.version:
                self._state = fresh
        return self._state

    def state(self) -> LogState:
        """The last state read (refreshing only if nothing was read yet)."""
        return self._state if self._state is not None else self.refresh()

    def transaction_version(self, app_id: str) -> int | None:
        """The version of idempotent transaction ``app_id`` (:class:`Transaction`) the log
        holds, read afresh as a writer would (None: the log holds none)."""
        mark = self.refresh(verify_within=0).sinks.get(app_id)
        return mark.epoch_of(TXN_QUERY) if mark else None

    def head(self) -> dict[int, int]:
        """Per-shard last committed sequence (0 for an empty shard)."""
        return dict(enumerate(self.refresh().heads))

    # -- writing ----------------------------------------------------------------------

    def append(
        self,
        events: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]],
        *,
        segment_max_events: int = segments.MAX_SEGMENT_EVENTS,
        transaction: Transaction | None = None,
    ) -> CommitRecord | None:
        """Append change events as one atomic commit; None when there was nothing to append
        (or ``transaction`` is already in the log).

        Args:
            events: dicts with the event fields (``data`` required) or an Arrow table
                with those columns. JSON payloads are stored exactly (numbers, key order).
            segment_max_events: most events per segment file.
            transaction: makes the append idempotent: a version of an app id that the log
                already holds is skipped, so an append whose outcome was unknown can be
                run again.

        Raises:
            InvalidEventError: an event is malformed (nothing was written).
            CommitOutcomeUnknownError: storage failed so that it is unknown whether the
                commit landed; ``replog read`` tells, and nothing is lost either way.

        Example:
            >>> log.append([{"key": "order/1", "data": {"total": 9.5}}])  # doctest: +SKIP
        """
        if isinstance(events, pa.Table | pa.RecordBatch):
            table = events_from_table(events)
        else:
            table = events_from_records(events)
        if table.num_rows == 0:
            return None
        writer = transaction.writer() if transaction is not None else None
        known = self._state
        recent = known is not None and known.verified_within(FRESH_S)
        if writer is not None or not recent:
            known = self.refresh(verify_within=0)  # a transaction must not stage needlessly
            if writer is not None and fencing.holds(known, writer):
                logger.info("%s: %s is already in the log; skipped", self.url, transaction)
                return None
        assert known is not None
        # A version known before staging (maybe a little stale: only ever more cautious).
        since = StagingStart(known.version, now_ms())
        staged = self._stage_and_refresh(table, segment_max_events)
        if self.state().gc_version > since.version:
            # A collection began at a version the stale start does not rule out: stage
            # again from the fresh state rather than be refused (nothing was committed).
            self.discard_staged(staged)
            since = StagingStart(self.state().version, now_ms())
            staged = self.stage(table, max_events=segment_max_events)
        for restage in range(RESTAGES + 1):
            try:
                with staging.committing(self.storage, staged) as attempt:
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
                logger.info("%s: staging the append again: %s", self.url, exc)
                since = StagingStart(self.refresh(verify_within=0).version, now_ms())
                staged = self.stage(table, max_events=segment_max_events)
        if record is None:  # the transaction landed meanwhile (another run of it)
            self.discard_staged(staged)
        else:
            self.maintain()
        return record

    def _stage_and_refresh(self, table: pa.Table, max_events: int) -> list[StagedSegment]:
        """Stage ``table`` and bring the state up to date for the commit that follows (a
        writer checks the log's identity before every commit). On remote storage both go
        out at once: the commit then waits for one round trip less."""
        if not self.storage.is_remote:
            staged = self.stage(table, max_events=max_events)
            try:
                self.refresh(verify_within=0)
            except BaseException:
                self.discard_staged(staged)
                raise
            return staged
        with ThreadPoolExecutor(max_workers=1) as pool:
            refreshing = threads.start(pool, functools.partial(self.refresh, verify_within=0))
            try:
                staged = self.stage(table, max_events=max_events)
            except BaseException:
                if refreshing is not None:
                    refreshing.exception()  # let it finish before the error goes up
                raise
            try:
                if refreshing is None:  # no thread to be had (interpreter shutting down)
                    self.refresh(verify_within=0)
                else:
                    refreshing.result()
            except BaseException:
                self.discard_staged(staged)
                raise
        return staged

    def stage(
        self, table: pa.Table, *, max_events: int = segments.MAX_SEGMENT_EVENTS
    ) -> list[StagedSegment]:
        """Route validated rows to shards and write them as segment files (not yet visible)."""
        self.storage.require_writable()
        return files.stage(
            self.storage, self.shards, table, max_events=max_events, written=self._written
        )

    def discard_staged(self, staged: Iterable[StagedSegment | SegmentInfo]) -> None:
        """Delete staged files that no commit names (the caller must know that)."""
        staging.discard(self.storage, staged)

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
        """Make staged segments visible in one commit, retrying lost races.

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
            self._guard_staged(state, staged, since, lease)
            heads = list(state.heads)
            added = []
            for segment in staged:
                added.append(segment.at(heads[segment.shard] + 1))
                heads[segment.shard] += segment.events
            return CommitRecord.after(state.version, APPEND, add=tuple(added), writer=claimed)

        return self.commit(build, attempt=attempt, refreshed=refreshed)

    def _guard_staged(
        self,
        state: LogState,
        staged: Sequence[StagedSegment | SegmentInfo],
        since: StagingStart | None,
        lease: Lease | None,
    ) -> None:
        """Before committing staged files on ``state``: refuse if a garbage collection
        may have taken them (or the lease that guards them is no longer held), check that
        they exist if that cannot be ruled out (:mod:`replog.format.gc`)."""
        if lease is not None:
            leases.check_held(self.storage, lease, f"a write into {self.url}")
        verdict = state.staged_files(since, now_ms(), leased=lease is not None)
        if verdict is StagedFiles.REFUSE:
            assert since is not None
            raise StagingCollectedError(
                f"{self.url}: a garbage collection (gc mark at version {state.gc_version}) "
                f"began while this write was staging (it began at version "
                f"{since.version}), with a cut-off its staged files may fall under: "
                f"nothing was committed; run the write again. Writers allow for "
                f"{CLOCK_SKEW_MS // 60_000} minutes of clock skew, so a 'replog recover' "
                f"with a --grace shorter than that plus your longest write refuses writes "
                f"in flight"
            )
        if verdict is StagedFiles.CHECK:
            self.check_staged(staged)

    # -- merging ----------------------------------------------------------------------

    def maintain(self) -> None:
        """After a commit: merge one full tier of small files (:func:`merges.plan_auto`) in
        the background, if this writer auto-compacts, its commit's version is a multiple
        of :data:`merges.CHECK_INTERVAL` (as checkpoints, one writer per version: writers
        sharing a log do not all merge the same files) and its last merge is done.

        The merge runs in this object's background thread on a log object of its own, so
        the caller's next commit does not wait for it (a merge of 8 files costs a few
        commits' time). Best effort, never raising (the commit before it has landed): a
        merge that loses a race to another writer is dropped; :meth:`flush` waits for it."""
        state = self.state()
        if not self.auto_compact or state.version % merge_plans.CHECK_INTERVAL:
            return
        if self._merging is not None and not self._merging.done():
            return
        try:
            merge = merge_plans.plan_auto(state)  # may load the state's segments
            if merge is not None:
                self._merging = threads.start(
                    self._executor(), functools.partial(self._merge_quietly, merge)
                )
        except Exception as exc:
            logger.warning("%s: no automatic merge at version %d: %s", self.url,
                           state.version, exc)  # fmt: skip

    def _merge_quietly(self, merge: Merge) -> CommitRecord | None:
        if self._merger is None:
            self._merger = ReplicationLog(self.storage, self.descriptor, auto_compact=False)
            self._merger._written = self._written  # merges take this writer's recent files
            self._merger._helper = True
        try:
            if leases.compaction_running(self.storage):
                logger.debug("%s: a compaction is running; automatic merge skipped", self.url)
                return None
            return self._merger.merge([merge], yielding=True)
        except (CommitConflictError, StagingCollectedError) as exc:
            logger.debug("%s: automatic merge dropped: %s", self.url, exc)
        except (ReplogError, OSError) as exc:
            logger.warning("%s: automatic merge failed (the commit stands): %s", self.url, exc)
        return None

    def _executor(self) -> ThreadPoolExecutor:
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replog")
        return self._background

    def merge(
        self,
        merges: Sequence[Merge],
        *,
        lease: Lease | None = None,
        refreshed: bool = False,
        progress: Callable[[int], None] | None = None,
        yielding: bool = False,
    ) -> CommitRecord | None:
        """Rewrite each merge's segments as larger files in one ``compact`` commit:
        sequences, heads and events do not change. The files replaced stay on storage
        until retention (or ``replog recover``) deletes them: a reader may have planned a
        task on them. ``lease``: the caller's staging lease (long merges), as for
        :meth:`commit_staged`;
        ``refreshed``: as for :meth:`commit`; ``progress``: called with the events of
        each merged file once its rows are read (from the writing threads). ``yielding``: an
        automatic merge, which commits nothing (:class:`CommitConflictError`) while an
        operator's compaction runs, so the compaction does not find its sources merged away.

        Raises :class:`CommitConflictError` (deleting what it wrote) if a source left the
        log meanwhile (another compaction or a truncation): plan again.
        """
        if not merges:
            return None
        if any(source.holed for merge in merges for source in merge.sources):
            raise ValueError("merges rewrite dense entries; key compaction rewrites holed ones")
        since = StagingStart(self.state().version, now_ms())
        staged: list[StagedSegment] = []
        firsts: list[int] = []
        try:
            for group in _within(merges, MERGE_MEMORY_BYTES):
                plans: list[tuple[Sequence[Part], Callable[[], files.Rows]]] = []
                for merge in group:
                    for plan, placed in _merge_plans(self.storage, merge, self._written):
                        plans.append(plan if progress is None else _counted(plan, progress))
                        firsts.extend(placed)
                staged.extend(files.write_files(self.storage, plans, self._written))
                # Give the decoded sources back to the system: Arrow's allocator keeps
                # freed memory for reuse, and a merge frees the most at once.
                pa.default_memory_pool().release_unused()
        except BaseException:
            self.discard_staged(staged)  # none is committed: no commit can name them
            raise
        merged = tuple(s.at(first) for s, first in zip(staged, firsts, strict=True))
        removed = tuple(source for merge in merges for source in merge.sources)
        return self.replace(
            merged, removed, since, lease=lease, refreshed=refreshed, yielding=yielding
        )

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
        Used by merges and by key compaction.

        Raises :class:`CommitConflictError` (deleting ``added``) if an entry of
        ``removed`` left the log meanwhile (another compaction or a truncation).
        """
        added, removed = tuple(added), tuple(removed)

        def build(state: LogState) -> CommitRecord:
            gone = [source.path for source in removed if not state.is_live(source)]
            if gone:
                raise CommitConflictError(
                    f"{self.url}: {len(gone)} segments to rewrite left the log meanwhile "
                    f"(e.g. {gone[0]}); nothing was rewritten, plan again"
                )
            if yielding and leases.compaction_running(self.storage):
                raise CommitConflictError(
                    f"{self.url}: a compaction began; this automatic merge yields to it"
                )
            self._guard_staged(state, added, since, lease)
            return CommitRecord.after(state.version, COMPACT, add=added, remove=removed)

        with staging.committing(self.storage, added) as attempt:
            record = self.commit(build, attempt=attempt, refreshed=refreshed)
        assert record is not None  # build never returns None
        return record

    def check_staged(self, staged: Sequence[StagedSegment | SegmentInfo]) -> None:
        """Raise :class:`MissingFileError` if a staged file is gone (collected by a
        ``replog recover`` whose grace period was shorter than this write)."""
        if not staged:
            return
        present = self.storage.map(
            lambda s: self.storage.exists(s.path), staged, threads=CHECK_THREADS
        )
        missing = [s.path for s, ok in zip(staged, present, strict=True) if not ok]
        if missing:
            raise MissingFileError(
                self.storage.where(missing[0]),
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
        """Commit ``build(state)`` (a record for ``state.version + 1``), retrying lost races.

        ``build`` sees the refreshed state on every attempt and may return None to commit
        nothing. Used for every kind of commit (appends, compaction, truncation).
        ``refreshed`` says the caller has just refreshed the state: the first attempt
        builds on it without reading again. That is safe because the put is
        create-if-absent: a commit that landed since takes the version, and the retry
        builds on a refreshed state.
        """
        attempt = attempt if attempt is not None else CommitAttempt()
        for tries in range(MAX_COMMIT_ATTEMPTS):
            state = self.state() if refreshed and tries == 0 else self.refresh(verify_within=0)
            record = build(state)
            if record is None:
                return None
            if record.log_id != self.log_id:
                record = dataclasses.replace(record, log_id=self.log_id)
            attempt.in_doubt = True
            putting = monotonic_s()  # no one writes the version after it before it lands
            try:
                self.storage.put_if_absent(commit_path(record.version), record.to_bytes())
            except FileExistsError:
                attempt.in_doubt = False  # read back: another writer's record is there
                logger.debug("lost the race for version %d; retrying", record.version)
                time.sleep(random.uniform(0, min(RACE_BACKOFF_MAX_S, 0.001 * 2**tries)))
                continue
            if not self._landed_on_history(state, record, putting):
                attempt.in_doubt = False
                continue
            attempt.landed, attempt.in_doubt = record, False
            state.apply(record)
            state.verified = (record.version, time.monotonic())  # its own commit: its log
            state.head_seen = putting
            self._after_commit(state)
            return record
        raise CommitConflictError(
            f"{self.url}: gave up after {MAX_COMMIT_ATTEMPTS} lost commit races"
        )

    def _landed_on_history(self, state: LogState, record: CommitRecord, putting: float) -> bool:
        """Whether ``record``, just put at ``state.version + 1``, follows the log's history
        rather than filling a slot retention emptied (the writer stalled between finding
        the slot free and its put, while others committed past it and expiry deleted it).

        Expiry deletes a commit only once a header at or after it is older than the
        retention: by storage time, or by its writers' clocks, which may disagree by the
        clock skew (10 minutes). So the slot cannot have been emptied if less than the
        retention less the skew passed, on this process's monotonic clock, since the
        slot was known to be unwritten (:attr:`LogState.head_seen`): no clock of another
        machine enters this. (As a second line, the slot counts as possibly emptied also
        when commit ``state.version`` is that old by this writer's wall clock: a machine
        paused under a monotonic clock that stopped.) Otherwise (or if that time is
        unknown) commit
        ``state.version`` is read again: retention deletes commits oldest first, so if
        it is the one the state applied, the slot was never written. A misplaced commit
        is deleted and False returned (the caller commits again on a fresh state); if
        the log was re-created, it is deleted and the error raised.
        """
        seen = state.head_seen
        window_ms = self.descriptor.retention_ms - CLOCK_SKEW_MS
        recent = seen is not None and (monotonic_s() - seen) * 1000 < window_ms
        # The wall clock too (its error is covered above): a monotonic clock may not count
        # time the machine spent paused.
        if recent and state.version > 0 and state.timestamp_ms > now_ms() - window_ms:
            return True
        try:
            base = None
            if state.version:
                base = self.storage.read_optional(commit_path(state.version))
            history.check_base(self.storage, state, base)
        except history.BaseMissing:
            # Gone since the put, or before it? A commit that landed on the history and
            # whose base expired after it must be neither taken back nor made again.
            first = self._landed_first(record, putting)
            if first:
                logger.info(
                    "%s: commit %d landed on the log's history; its base %d expired since",
                    self.url,
                    record.version,
                    state.version,
                )
                return True
            if first is None:
                self._state = None
                raise CommitOutcomeUnknownError(
                    f"{self.url}: commit {record.version} landed, and its base (commit "
                    f"{state.version}) is gone: retention deleted it, before or after the "
                    f"put, which cannot be told; the commit was kept ('replog read' tells "
                    f"whether its events are in the log)"
                ) from None
            logger.warning(
                "%s: commit %d landed in a range retention deleted (this writer's state was "
                "older than the retention); deleting it and committing again",
                self.url,
                record.version,
            )
            self._take_back(record)
            return False
        except (LogRecreatedError, LogNotFoundError):
            self._take_back(record)
            raise
        except (StorageError, OSError) as exc:
            self._state = None
            raise CommitOutcomeUnknownError(
                f"{self.url}: commit {record.version} landed, but checking that it follows "
                f"the log's history failed: {exc}"
            ) from exc
        return True

    def _landed_first(self, record: CommitRecord, putting: float) -> bool | None:
        """:func:`history.landed_first`. If the record went too: expired, which needs a
        header built on it to age for the retention (by storage time and by clocks within
        the skew), or deleted by an expiry that ran from an older version (so it filled an
        emptied slot). Less than the retention less the skew after ``putting`` (this
        process's monotonic clock) it cannot have expired; later, it landed first if its
        files are live in the log as it is now (no other writer's state can name them).
        A storage failure makes it unknown (None)."""
        try:
            first = history.landed_first(self.storage, record, self.descriptor.snapshot_interval)
            if first is None:
                window_ms = self.descriptor.retention_ms - CLOCK_SKEW_MS
                if (monotonic_s() - putting) * 1000 < window_ms:
                    return False
                fresh = history.load_state(self.storage, self.descriptor)
                if record.add and all(fresh.is_live(segment) for segment in record.add):
                    return True
            return first
        except (ReplogError, OSError) as exc:
            logger.warning("%s: could not tell where commit %d landed: %s", self.url,
                           record.version, exc)  # fmt: skip
            return None

    def _take_back(self, record: CommitRecord) -> None:
        """Delete ``record``'s commit, put where it does not belong (nothing reads it: it
        is below every header of the log there), and forget the state."""
        self._state = None
        try:
            self.storage.delete(commit_path(record.version))
        except (StorageError, OSError) as exc:
            raise CommitOutcomeUnknownError(
                f"{self.url}: commit {record.version} landed where it does not belong and "
                f"could not be deleted: {exc}"
            ) from exc

    def _after_commit(self, state: LogState) -> None:
        """Checkpoint, merges and retention after a commit: best effort, never raising (the
        commit has landed; an error here would make its caller commit it again)."""
        try:
            self._absorb_expiry(state)
            self._checkpoint(state)
            if state.version % self.descriptor.snapshot_interval == 0:
                self._schedule_expiry(state)
        except Exception as exc:
            logger.warning("%s: after commit %d: %s (tried again later)", self.url,
                           state.version, exc)  # fmt: skip

    def _schedule_expiry(self, state: LogState) -> None:
        """Expire what is older than the retention (:func:`history.expire`) in the
        background, unless the last expiry is still running (the next table catches up)."""
        if self._helper or (self._expiry is not None and not self._expiry.done()):
            return
        self._expiry = threads.start(
            self._executor(),
            functools.partial(
                history.expire,
                history.LogSnapshots(self.storage, self.descriptor),
                version=state.version,
                retained_from=state.retained_from,
                live=state.live_paths(),
                now_ms=now_ms(),
            ),
        )

    def _absorb_expiry(self, state: LogState) -> None:
        """Record in ``state`` how far the last finished expiry went (the next header
        carries it)."""
        expiry = self._expiry
        if expiry is None or not expiry.done():
            return
        failure = expiry.exception()  # best effort, as the checkpoint is
        if failure is None:
            state.retained_from = max(state.retained_from, expiry.result())
        else:
            logger.warning("%s: retention failed (it is tried again): %s", self.url, failure)
        self._expiry = None

    def flush(self) -> None:
        """Wait for this object's background work (merges, retention) to finish."""
        pending: list[Future[Any]] = [f for f in (self._merging, self._expiry) if f is not None]
        if pending:
            futures_wait(pending)
        if self._state is not None:
            self._absorb_expiry(self._state)

    def _checkpoint(self, state: LogState) -> None:
        """Best effort: the commit has landed whatever happens here."""
        try:
            history.write_checkpoint(self.storage, self.descriptor, state)
        except Exception as exc:
            logger.warning("could not write the checkpoint at version %d: %s", state.version, exc)

    def added_since(self, version: int, paths: Iterable[str]) -> set[str]:
        """Which of ``paths`` a commit after ``version`` added (reads those commits).

        If retention deleted commits after ``version`` (a write that began longer ago
        than the retention), it cannot be told: every path counts as added, so callers
        keep the files (``replog recover`` collects them if no commit names them)."""
        wanted = set(paths)
        state = self.refresh()
        if version < state.retained_from:
            logger.warning(
                "%s: commits after version %d were deleted by retention; the %d files of a "
                "write that began then are kept for 'replog recover'",
                self.url,
                version,
                len(wanted),
            )
            return wanted
        current = state.version
        found: set[str] = set()
        for record in history.read_commits(self.storage, version + 1, current):
            found.update(segment.path for segment in record.add if segment.path in wanted)
        return found

    # -- reading ----------------------------------------------------------------------

    def check_shard(self, shard: int, option: str = "shard") -> int:
        """``shard`` if the log has it, else :class:`InvalidOptionError` naming ``option``."""
        if not 0 <= shard < self.shards:
            raise InvalidOptionError(
                f"{option} {shard} does not exist: {self.url} has {self.shards} shards "
                f"(0..{self.shards - 1})"
            )
        return shard

    def read(self, shard: int, first: int = 1, last: int | None = None) -> Iterator[pa.RecordBatch]:
        """Events of ``shard`` with sequences in ``[first, last]`` (default: to the head).

        Checked when called (not at the first ``next()``); files that hold several
        shards' rows are decoded once for this log object's reads.

        Raises:
            InvalidOptionError: ``shard`` does not exist.
            DataLossError: ``first`` was removed by retention.
            CorruptionError: a segment does not match its checksum (names the file).
        """
        self.check_shard(shard)
        state = self.refresh()
        last = state.heads[shard] if last is None else min(last, state.heads[shard])
        first = max(first, 1)
        if first < state.lows[shard] and first <= last:
            raise DataLossError(shard, first, state.lows[shard])
        wanted = [(segment, first, last) for segment in state.covering(shard, first, last)]
        return files.read_segments(self.storage, wanted, self._files)

    def row_sequences(self, segment: SegmentInfo) -> np.ndarray:
        """The sequence of each row of a live entry: rate limits end a batch inside one.

        A holed entry's are read from its file once for this object: only the sequence
        array is kept (by entry), not the decoded file, which a key compaction writes up
        to 64 MB large, past what :class:`DecodedFiles` keeps of one file; planning asks
        on every trigger that stops inside the entry.
        """
        if not segment.holed:
            return segments.row_sequences(pa.table({}), segment)
        kept = self._row_sequences
        found = kept.get(segment.key)
        if found is not None:
            kept.move_to_end(segment.key)
            return found
        rows = files.read_stored(self.storage, segment, self._files)
        found = np.array(segments.row_sequences(rows, segment))  # a copy: not the file's buffer
        found.setflags(write=False)  # shared by every later call
        kept[segment.key] = found
        while len(kept) > 1 and sum(a.nbytes for a in kept.values()) > 32 * 1024 * 1024:
            kept.popitem(last=False)  # the least recently used: 32 MB is 4M rows' sequences
        return found

    def scan(
        self,
        start: Mapping[int, int] | None = None,
        end: Mapping[int, int] | None = None,
        *,
        state: LogState | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Events of every shard after ``start`` (``{shard: last sequence read}``; default:
        from the oldest retained) up to ``end`` (default: the heads), shard by shard, from
        one refresh, or from ``state`` (one this object read: a caller reading many ranges
        of one version saves a refresh each). On remote storage the files are fetched in
        parallel across shards.

        Raises:
            DataLossError: an event after ``start`` was removed by retention.
        """
        state = self.refresh() if state is None else state
        wanted: list[tuple[SegmentInfo, int, int]] = []
        for shard in range(self.shards):
            first = (start or {}).get(shard, state.lows[shard] - 1) + 1
            last = min((end or {}).get(shard, state.heads[shard]), state.heads[shard])
            if first < state.lows[shard] and first <= last:
                raise DataLossError(shard, first, state.lows[shard])
            wanted.extend((s, first, last) for s in state.covering(shard, first, last))
        return files.read_segments(self.storage, wanted, self._files)

    def read_all(
        self, start: Mapping[int, int] | None = None, end: Mapping[int, int] | None = None
    ) -> pa.Table:
        """:meth:`scan` as one table."""
        return pa.Table.from_batches(list(self.scan(start, end)), schema=EVENT_SCHEMA)

    def read_table(self, shard: int, first: int = 1, last: int | None = None) -> pa.Table:
        return pa.Table.from_batches(list(self.read(shard, first, last)), schema=EVENT_SCHEMA)

    def info(self) -> LogInfo:
        """A summary of the log, as ``replog info`` prints it."""
        state = self.refresh()
        return LogInfo(
            url=self.url,
            format_version=self.descriptor.format_version,
            log_id=self.log_id,
            shards=self.shards,
            version=state.version,
            heads=dict(enumerate(state.heads)),
            lows=dict(enumerate(state.lows)),
            segments=state.segment_count,
            files=len(state.live_paths()),
            bytes=state.total_bytes,
            sinks={
                name: {"query_id": m.query_id, "epoch": m.epoch, "version": m.version}
                for name, m in sorted(state.sinks.items())
            },
            last_commit_ms=state.timestamp_ms,
            retention_ms=self.descriptor.retention_ms,
            retained_from=state.retained_from,
            auto_compact=self.auto_compact,
        )


def _check_place_for_a_log(storage: Storage) -> None:
    """Refuse, before anything is written, to create a log in a file or in a directory
    that holds something else than a log (another tool's files would be mixed with the
    log's, and a typo in a path would scatter a log into a data directory). A directory
    holding ``_replog/`` is left to the descriptor's put-if-absent: the log exists, or
    another process is creating it right now."""
    root = storage.path("")
    if storage.is_local and os.path.exists(root) and not os.path.isdir(root):
        raise InvalidOptionError(f"cannot create a log at {storage.where('')}: it is a file")
    try:
        found = storage.listdir("")
    except (NotADirectoryError, FileNotFoundError):
        return
    others = [n for n in found if n not in (META_DIR, SHARDS_DIR) and not n.startswith(".")]
    if others and META_DIR not in found:
        shown = ", ".join(sorted(others)[:5]) + (", ..." if len(others) > 5 else "")
        raise InvalidOptionError(
            f"cannot create a log at {storage.where('')}: the directory is not empty and "
            f"holds no replog log ({shown}); give an empty or new directory"
        )


def _runs(entries: Sequence[SegmentInfo]) -> list[list[SegmentInfo]]:
    """Entries of one shard, in sequence order, cut where sequences stop following on."""
    runs: list[list[SegmentInfo]] = []
    for entry in entries:
        if runs and runs[-1][-1].last_sequence + 1 == entry.first_sequence:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs


def _counted(
    plan: tuple[Sequence[Part], Callable[[], Iterator[pa.RecordBatch]]],
    progress: Callable[[int], None],
) -> tuple[Sequence[Part], Callable[[], Iterator[pa.RecordBatch]]]:
    """``plan`` telling ``progress`` its events as its rows are read."""
    parts, rows_of = plan

    def rows() -> Iterator[pa.RecordBatch]:
        for batch in rows_of():
            progress(batch.num_rows)
            yield batch

    return parts, rows


MERGE_MEMORY_BYTES = 48 * 1024 * 1024
"""Bytes of source files merged at once: merges of more run in turns, so a writer's
background merges cost bounded memory whatever the log's size (decoded, concatenated and
encoded again, a merge holds about three times its sources)."""


def _within(merges: Sequence[Merge], budget: int) -> Iterator[list[Merge]]:
    """``merges`` in groups whose sources hold at most ``budget`` bytes (a bigger merge
    alone)."""
    group: list[Merge] = []
    held = 0
    for merge in merges:
        size = sum(source.bytes for source in merge.sources)
        if group and held + size > budget:
            yield group
            group, held = [], 0
        group.append(merge)
        held += size
    if group:
        yield group


def _merged_rows(
    storage: Storage, sources: Sequence[SegmentInfo], known: dict[str, pa.Table]
) -> Iterator[pa.RecordBatch]:
    """The rows of ``sources`` in order, as large record batches (a merge of many small
    files must not keep their tiny batches: readers convert batch by batch), made one
    at a time: a source is read when the batches reach it, so a merge holds the source at
    hand and one batch, not all its rows twice over. ``known`` holds decoded files (this
    writer's recent ones); others are read once each."""
    uses = Counter(source.path for source in sources)
    cache = DecodedFiles()  # a file of several sources (a shared one) is read once
    pending: list[pa.Table] = []
    held = 0
    for source in sources:
        table = known.get(source.path)
        if table is None:
            table = files.read_file(storage, source, cache if uses[source.path] > 1 else None)
        rows = segments.entry_rows(table, source)
        pending.append(rows)
        held += rows.num_rows
        while held >= segments.BATCH_ROWS:
            rest = pa.concat_tables(pending)
            yield from rest.slice(0, segments.BATCH_ROWS).combine_chunks().to_batches()
            rest = rest.slice(segments.BATCH_ROWS)
            pending, held = [rest], rest.num_rows
    if held:
        yield from pa.concat_tables(pending).combine_chunks().to_batches()


def _merge_plans(
    storage: Storage, merge: Merge, written: DecodedFiles
) -> list[tuple[tuple[Sequence[Part], Callable[[], Iterator[pa.RecordBatch]]], list[int]]]:
    """The files a merge writes (one shared file, or one per shard), each with the first
    sequence of each of its parts. A part is a run of consecutive sequences; a merge of
    files between which another writer's big files lie gets several parts per shard.
    Sources this writer wrote lately are taken from ``written`` instead of storage."""
    known = {}
    for source in merge.sources:
        table = written.get(source)
        if table is not None:
            known[source.path] = table
    by_shard: dict[int, list[SegmentInfo]] = {}
    for source in sorted(merge.sources, key=lambda s: (s.shard, s.first_sequence)):
        by_shard.setdefault(source.shard, []).append(source)
    outputs = [sorted(by_shard)] if merge.shared else [[shard] for shard in sorted(by_shard)]
    plans: list[tuple[tuple[Sequence[Part], Callable[[], Iterator[pa.RecordBatch]]], list[int]]]
    plans = []
    for shards in outputs:
        parts: list[Part] = []
        firsts: list[int] = []
        sources: list[SegmentInfo] = []
        for shard in shards:
            for run in _runs(by_shard[shard]):
                rows = sum(entry.events for entry in run)
                stamps = (
                    min(entry.min_timestamp_ms for entry in run),
                    max(entry.max_timestamp_ms for entry in run),
                )
                parts.append(Part(shard, sum(p.rows for p in parts), rows, stamps))
                firsts.append(run[0].first_sequence)
                sources.extend(run)
        rows_of = functools.partial(_merged_rows, storage, tuple(sources), known)
        plans.append(((parts, rows_of), firsts))
    return plans
