"""Keeping a log small and bounded: merges of small files, checkpoints and expiry.

DESIGN: this module owns the work a writer does for the log beside its own commits:

* after each commit (the writer's ``after_commit`` hook), a checkpoint when one is due,
  and every snapshot interval an expiry of what is older than the retention, run in the
  background (:func:`replog.core.history.expire`), its progress carried by the next
  header;
* after an append, a merge of one full tier of small files (:func:`replog.merges.plan_auto`)
  in the background, on a writer of its own, yielding to an operator's compaction;
* :meth:`LogMaintenance.merge`: rewriting merges' sources as larger files, streamed under
  a memory budget, committed as one ``compact`` commit (:meth:`LogWriter.replace`).

What to merge is :mod:`replog.merges`' (pure plans); how to commit is
:mod:`replog.writing`'s. Every background step is best effort: the commit before it has
landed, so none raises into its caller.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import pyarrow as pa

from replog import merges as merge_plans
from replog.core import files, history, leases
from replog.core.files import DecodedFiles
from replog.errors import CommitConflictError, ReplogError, StagingCollectedError
from replog.format import segments
from replog.format.commits import CommitRecord
from replog.format.gc import StagingStart
from replog.format.leases import Lease
from replog.format.segments import Part, SegmentInfo, StagedSegment
from replog.format.state import LogState
from replog.merges import Merge
from replog.reading import LogReader
from replog.storage import Storage, threads
from replog.timeutil import now_ms
from replog.writing import LogWriter

logger = logging.getLogger(__name__)

MERGE_MEMORY_BYTES = 48 * 1024 * 1024
"""Bytes of source files merged at once: merges of more run in turns, so a writer's
background merges cost bounded memory whatever the log's size (decoded, concatenated and
encoded again, a merge holds about three times its sources)."""

Plan = tuple[Sequence[Part], Callable[[], Iterator[pa.RecordBatch]]]
"""A file to write: its parts, and its rows, read when called."""


class LogMaintenance:
    """The upkeep of the log ``writer`` commits to: it hooks itself after every commit of
    ``writer``. ``helper``: the writer of a background merge, which schedules no
    background work itself."""

    def __init__(self, writer: LogWriter, *, helper: bool = False) -> None:
        self.writer = writer
        writer.after_commit = self.after_commit
        self._helper = helper
        self._background: ThreadPoolExecutor | None = None
        """Merges and retention run in a thread of this object's own: a merge costs a few
        commits' time, and deleting files ~0.1 ms each on local disk; either would stall
        the commit that triggers it."""
        self._merging: Future[CommitRecord | None] | None = None
        self._merger: LogMaintenance | None = None
        self._expiry: Future[int] | None = None

    @property
    def log(self) -> LogReader:
        return self.writer.log

    # -- after each commit ------------------------------------------------------------

    def after_commit(self, state: LogState) -> None:
        """Checkpoint, merges and retention after a commit: best effort, never raising (the
        commit has landed; an error here would make its caller commit it again)."""
        try:
            self._absorb_expiry(state)
            self._checkpoint(state)
            if state.version % self.log.descriptor.snapshot_interval == 0:
                self._schedule_expiry(state)
        except Exception as exc:
            logger.warning("%s: after commit %d: %s (tried again later)", self.log.url,
                           state.version, exc)  # fmt: skip

    def _checkpoint(self, state: LogState) -> None:
        """Best effort: the commit has landed whatever happens here."""
        try:
            history.write_checkpoint(self.log.storage, self.log.descriptor, state)
        except Exception as exc:
            logger.warning("could not write the checkpoint at version %d: %s", state.version, exc)

    def _schedule_expiry(self, state: LogState) -> None:
        """Expire what is older than the retention (:func:`history.expire`) in the
        background, unless the last expiry is still running (the next table catches up)."""
        if self._helper or (self._expiry is not None and not self._expiry.done()):
            return
        self._expiry = threads.start(
            self._executor(),
            functools.partial(
                history.expire,
                history.LogSnapshots(self.log.storage, self.log.descriptor),
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
            logger.warning("%s: retention failed (it is tried again): %s", self.log.url, failure)
        self._expiry = None

    def flush(self) -> None:
        """Wait for the background work (merges, retention) to finish."""
        pending: list[Future[Any]] = [f for f in (self._merging, self._expiry) if f is not None]
        if pending:
            futures_wait(pending)
        if self.log.known is not None:
            self._absorb_expiry(self.log.known)

    # -- merging ----------------------------------------------------------------------

    def maintain(self, *, auto_compact: bool) -> None:
        """After a commit: merge one full tier of small files (:func:`merges.plan_auto`) in
        the background, if ``auto_compact``, the commit's version is a multiple of
        :data:`merges.CHECK_INTERVAL` (as checkpoints, one writer per version: writers
        sharing a log do not all merge the same files) and the last merge is done.

        The merge runs in this object's background thread on a log object of its own, so
        the caller's next commit does not wait for it (a merge of 8 files costs a few
        commits' time). Best effort, never raising (the commit before it has landed): a
        merge that loses a race to another writer is dropped; :meth:`flush` waits for it."""
        state = self.log.state()
        if not auto_compact or state.version % merge_plans.CHECK_INTERVAL:
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
            logger.warning("%s: no automatic merge at version %d: %s", self.log.url,
                           state.version, exc)  # fmt: skip

    def _merge_quietly(self, merge: Merge) -> CommitRecord | None:
        if self._merger is None:  # a log object of its own, sharing this writer's files
            log = LogReader(self.log.storage, self.log.descriptor)
            self._merger = LogMaintenance(LogWriter(log, written=self.writer.written), helper=True)
        try:
            if leases.compaction_running(self.log.storage):
                logger.debug("%s: a compaction is running; automatic merge skipped", self.log.url)
                return None
            return self._merger.merge([merge], yielding=True)
        except (CommitConflictError, StagingCollectedError) as exc:
            logger.debug("%s: automatic merge dropped: %s", self.log.url, exc)
        except (ReplogError, OSError) as exc:
            logger.warning("%s: automatic merge failed (the commit stands): %s", self.log.url, exc)
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
        :meth:`LogWriter.commit_staged`; ``refreshed``: as for :func:`committing.commit`;
        ``progress``: called with the events of each merged file once its rows are read
        (from the writing threads). ``yielding``: an automatic merge, which commits nothing
        (:class:`CommitConflictError`) while an operator's compaction runs, so the
        compaction does not find its sources merged away.

        Sources are read :data:`MERGE_MEMORY_BYTES` at a time; those this writer wrote
        lately are taken from memory.

        Raises :class:`CommitConflictError` (deleting what it wrote) if a source left the
        log meanwhile (another compaction or a truncation): plan again.
        """
        if not merges:
            return None
        if any(source.holed for merge in merges for source in merge.sources):
            raise ValueError("merges rewrite dense entries; key compaction rewrites holed ones")
        writer, storage = self.writer, self.log.storage
        since = StagingStart(self.log.state().version, now_ms())
        staged: list[StagedSegment] = []
        firsts: list[int] = []
        try:
            for group in _within(merges, MERGE_MEMORY_BYTES):
                plans: list[Plan] = []
                for merge in group:
                    for plan, placed in _merge_plans(storage, merge, writer.written):
                        plans.append(plan if progress is None else _counted(plan, progress))
                        firsts.extend(placed)
                staged.extend(files.write_files(storage, plans))
                # Give the decoded sources back to the system: Arrow's allocator keeps
                # freed memory for reuse, and a merge frees the most at once.
                pa.default_memory_pool().release_unused()
        except BaseException:
            writer.discard_staged(staged)  # none is committed: no commit can name them
            raise
        merged = tuple(s.at(first) for s, first in zip(staged, firsts, strict=True))
        removed = tuple(source for merge in merges for source in merge.sources)
        return writer.replace(
            merged, removed, since, lease=lease, refreshed=refreshed, yielding=yielding
        )


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


def _merge_plans(
    storage: Storage, merge: Merge, written: DecodedFiles
) -> list[tuple[Plan, list[int]]]:
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
    plans: list[tuple[Plan, list[int]]] = []
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


def _runs(entries: Sequence[SegmentInfo]) -> list[list[SegmentInfo]]:
    """Entries of one shard, in sequence order, cut where sequences stop following on."""
    runs: list[list[SegmentInfo]] = []
    for entry in entries:
        if runs and runs[-1][-1].last_sequence + 1 == entry.first_sequence:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    return runs


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


def _counted(plan: Plan, progress: Callable[[int], None]) -> Plan:
    """``plan`` telling ``progress`` its events as its rows are read."""
    parts, rows_of = plan

    def rows() -> Iterator[pa.RecordBatch]:
        for batch in rows_of():
            progress(batch.num_rows)
            yield batch

    return parts, rows
