"""Compaction: merging runs of small segments of a shard into larger ones.

Many small micro-batches leave many small segments; each costs a request and a task
slice for every reader. A compaction writes merged segment files and makes them visible
in one ``compact`` commit that adds the merged segments and removes their sources:
sequences, heads and the events themselves do not change, so a running reader either
sees the old files or the new ones, never a mix within one segment. The replaced files
stay on storage until ``recover`` collects them after a grace period, because a query
may have planned tasks on them just before the commit.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa

from replog.errors import CommitConflictError
from replog.log import (
    DEFAULT_SEGMENT_MAX_EVENTS,
    IO_THREADS,
    ReplicationLog,
    now_ms,
    read_stored,
)
from replog.records import COMPACT, CommitRecord
from replog.segments import SegmentInfo
from replog.state import LogState

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
    max_events: int = DEFAULT_SEGMENT_MAX_EVENTS,
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


def _merge(log: ReplicationLog, merge: Merge) -> SegmentInfo:
    """Write the merged file of ``merge`` (verifying every source) and place it."""
    tables = [read_stored(log.storage, source) for source in merge.sources]
    staged = log.write_segment(merge.shard, pa.concat_tables(tables))
    return staged.at(merge.sources[0].first_sequence)


def compact(
    log: ReplicationLog,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    max_events: int = DEFAULT_SEGMENT_MAX_EVENTS,
) -> CompactionResult:
    """Merge small segments of every shard in one atomic commit.

    Appends that land meanwhile are fine (the commit is rebased onto them). If a
    concurrent truncation or compaction removed a source, the merged files are deleted
    and :class:`CommitConflictError` is raised: run it again.
    """
    merges = plan_compaction(log.refresh(), target_bytes=target_bytes, max_events=max_events)
    if not merges:
        return CompactionResult((), None)
    with ThreadPoolExecutor(max_workers=min(IO_THREADS, len(merges))) as pool:
        merged = list(pool.map(lambda merge: _merge(log, merge), merges))
    removed = tuple(source for merge in merges for source in merge.sources)

    def build(state: LogState) -> CommitRecord:
        live = {segment.path for lane in state.segments for segment in lane}
        gone = [source.path for source in removed if source.path not in live]
        if gone:
            raise CommitConflictError(
                f"{log.url}: {len(gone)} segments to compact were removed concurrently "
                f"(e.g. {gone[0]}); nothing was compacted, run compact again"
            )
        return CommitRecord(
            version=state.version + 1,
            timestamp_ms=now_ms(),
            operation=COMPACT,
            add=tuple(merged),
            remove=removed,
        )

    try:
        record = log.commit_with_retries(build)
    except BaseException:
        log.discard_staged(merged)
        raise
    logger.info(
        "compacted %s at version %s: %d segments merged into %d",
        log.url,
        record.version if record else None,
        len(removed),
        len(merged),
    )
    return CompactionResult(tuple(merges), record)
