"""Compaction: merging runs of small segments of a shard into larger ones.

Many small micro-batches leave many small segments; each costs a request and a task
slice for every reader. A compaction writes merged segment files and makes them visible
in one ``compact`` commit that adds the merged segments and removes their sources:
sequences, heads and the events themselves do not change, so a running reader either
sees the old files or the new ones, never a mix within one segment. The replaced files
stay on storage until ``recover`` collects them after a grace period, because a query
may have planned tasks on them just before the commit. A compaction holds a staging lease
while it runs, so ``recover`` never collects its merged files however long it takes.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from replog.errors import CommitConflictError
from replog.format import leases, segments
from replog.format.commits import COMPACT, CommitRecord
from replog.format.segments import MAX_SEGMENT_EVENTS, SegmentInfo
from replog.format.state import LogState
from replog.log import CommitAttempt, ReplicationLog

logger = logging.getLogger(__name__)

DEFAULT_TARGET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Merge:
    """Consecutive segments of one shard to be replaced by one."""

    shard: int
    sources: tuple[SegmentInfo, ...]

    @property
    def events(self) -> int:
        return sum(segment.events for segment in self.sources)

    @property
    def bytes(self) -> int:
        return sum(segment.bytes for segment in self.sources)


def plan_compaction(
    state: LogState,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    max_events: int = MAX_SEGMENT_EVENTS,
) -> list[Merge]:
    """Greedy runs of consecutive segments that together stay within both limits."""
    merges = []
    for shard, lane in enumerate(state.segments):
        run: list[SegmentInfo] = []
        for segment in [*lane, None]:
            fits = (
                segment is not None
                and sum(s.bytes for s in run) + segment.bytes <= target_bytes
                and sum(s.events for s in run) + segment.events <= max_events
            )
            if fits:
                assert segment is not None
                run.append(segment)
                continue
            if len(run) >= 2:
                merges.append(Merge(shard, tuple(run)))
            run = [segment] if segment is not None else []
    return merges


@dataclass(frozen=True)
class CompactionResult:
    merges: tuple[Merge, ...]
    record: CommitRecord | None

    @property
    def segments_before(self) -> int:
        return sum(len(merge.sources) for merge in self.merges)

    def to_json(self, dry_run: bool = False) -> dict[str, Any]:
        return {
            "dry_run": dry_run,
            "version": self.record.version if self.record else None,
            "segments_before": self.segments_before,
            "segments_after": len(self.merges),
        }


def compact(
    log: ReplicationLog,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    max_events: int = MAX_SEGMENT_EVENTS,
) -> CompactionResult:
    """Merge small segments of every shard in one atomic commit.

    Appends that land meanwhile are fine (the commit is rebased onto them). If a
    concurrent truncation or compaction removed a source, the merged files are deleted
    and :class:`CommitConflictError` is raised: run it again.
    """
    merges = plan_compaction(log.refresh(), target_bytes=target_bytes, max_events=max_events)
    if not merges:
        return CompactionResult((), None)
    lease = leases.acquire(log.storage, f"compaction of {log.url}")
    try:
        merged = _write_merged(log, merges)
        record = _commit(log, merges, merged)
    finally:
        _release(log, lease)
    logger.info(
        "compacted %s at version %s: %d segments merged into %d",
        log.url,
        record.version if record else None,
        sum(len(merge.sources) for merge in merges),
        len(merged),
    )
    return CompactionResult(tuple(merges), record)


def _write_merged(log: ReplicationLog, merges: list[Merge]) -> list[SegmentInfo]:
    """Write each merge's file (reading and checksum-verifying every source) and place it."""

    def rows(merge: Merge) -> pa.Table:
        return pa.concat_tables(segments.read_stored(log.storage, s) for s in merge.sources)

    staged = segments.write_segments(
        log.storage, [(merge.shard, functools.partial(rows, merge)) for merge in merges]
    )
    return [
        written.at(merge.sources[0].first_sequence)
        for written, merge in zip(staged, merges, strict=True)
    ]


def _commit(
    log: ReplicationLog, merges: list[Merge], merged: list[SegmentInfo]
) -> CommitRecord | None:
    removed = tuple(source for merge in merges for source in merge.sources)

    def build(state: LogState) -> CommitRecord:
        live = state.live_paths()
        gone = [source.path for source in removed if source.path not in live]
        if gone:
            raise CommitConflictError(
                f"{log.url}: {len(gone)} segments to compact were removed concurrently "
                f"(e.g. {gone[0]}); nothing was compacted, run compact again"
            )
        return CommitRecord.after(state.version, COMPACT, add=tuple(merged), remove=removed)

    attempt = CommitAttempt()
    try:
        log.check_staged(merged)
        return log.commit(build, attempt=attempt)
    except BaseException:
        log.discard_after(attempt, merged)
        raise


def _release(log: ReplicationLog, lease: leases.Lease) -> None:
    try:
        leases.release(log.storage, lease)
    except Exception as exc:
        logger.warning("could not release staging lease %s: %s", lease.relative, exc)
