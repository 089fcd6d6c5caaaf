"""``replog compact``: merging every shard's segments into files of the target size.

Writers already merge the small files of recent writes as they commit
(:func:`replog.merges.plan_auto`); an operator's compaction goes further: per shard, runs
of consecutive segments up to the target size become one file of that shard each, so a
compacted shard is read from a few files of its own. The merged files become visible in
one ``compact`` commit that adds them and removes their sources: sequences, heads and the
events themselves do not change, so a running reader sees the old files or the new ones,
never a mix within one segment. The replaced files stay on storage until retention (or
``recover``) deletes them, because a query may have planned tasks on them just before
the commit. A compaction holds a staging lease while it runs, so ``recover`` never
collects its merged files however long it takes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replog.core import leases
from replog.errors import CommitConflictError
from replog.format.commits import CommitRecord
from replog.format.segments import MAX_SEGMENT_EVENTS
from replog.log import ReplicationLog
from replog.merges import DEFAULT_TARGET_BYTES, Merge, check_limits, plan_full

logger = logging.getLogger(__name__)

ATTEMPTS = 5
"""How often a compaction whose sources another writer merged first is planned again."""

__all__ = ["DEFAULT_TARGET_BYTES", "CompactionResult", "Merge", "compact"]


@dataclass(frozen=True)
class CompactionResult:
    merges: tuple[Merge, ...]
    record: CommitRecord | None

    @property
    def segments_before(self) -> int:
        return sum(len(merge.sources) for merge in self.merges)

    @property
    def segments_after(self) -> int:
        return len(self.record.add) if self.record is not None else len(self.merges)

    def to_json(self, dry_run: bool = False) -> dict[str, Any]:
        return {
            "dry_run": dry_run,
            "version": self.record.version if self.record else None,
            "segments_before": self.segments_before,
            "segments_after": self.segments_after,
        }


def compact(
    log: ReplicationLog,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    max_events: int = MAX_SEGMENT_EVENTS,
    progress: Callable[[int, int], None] | None = None,
) -> CompactionResult:
    """Merge every shard's segments into files of about ``target_bytes`` in one atomic
    commit.

    Appends that land meanwhile are fine (the commit is rebased onto them). If a
    concurrent truncation or merge removed a source (writers merge small files as they
    commit), the merged files are deleted and the compaction planned again, up to
    :data:`ATTEMPTS` times; then :class:`CommitConflictError` is raised: run it again.
    ``progress`` is told the events merged so far and in all, as each file is read.
    """
    check_limits(target_bytes, max_events)  # before the lease: nothing written for bad input
    with leases.compacting(log.storage, f"compaction of {log.url}") as (lease, beat):
        for attempt in range(1, ATTEMPTS + 1):
            beat()
            merges = plan_full(log.refresh(), target_bytes=target_bytes, max_events=max_events)
            if not merges:
                return CompactionResult((), None)
            try:
                record = log.merge(
                    merges, lease=lease, progress=_events_done(merges, progress, beat)
                )
                break
            except CommitConflictError:
                if attempt == ATTEMPTS:
                    raise
                logger.info("%s: a source left the log during compaction; planning again", log.url)
    logger.info(
        "compacted %s at version %s: %d segments merged into %d",
        log.url,
        record.version if record else None,
        sum(len(merge.sources) for merge in merges),
        len(record.add) if record else 0,
    )
    return CompactionResult(tuple(merges), record)


def _events_done(
    merges: list[Merge], progress: Callable[[int, int], None] | None, beat: leases.Heartbeat
) -> Callable[[int], None]:
    """A merge's per-file callback that tells ``progress`` (done, total) events, and
    ``beat`` that the compaction is alive."""
    total = sum(source.events for merge in merges for source in merge.sources)
    done = [0]
    lock = threading.Lock()

    def merged(events: int) -> None:
        beat()
        if progress is None:
            return
        with lock:
            done[0] += events
            progress(done[0], total)

    return merged
