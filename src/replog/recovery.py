"""Recovery: resolving Pending sink commits left by crashes, and collecting garbage.

A sink resolves its own Pending epoch when its query restarts; ``recover`` does the same
for every sink of a log without Spark, then deletes segment files no commit references
(staged by crashed writers, or replaced by compaction and retention). Everything younger
than the grace period is left alone: a Pending epoch that recent may belong to a driver
that is committing right now, and a file that recent may belong to a running batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from replog import consumers
from replog.log import DEFAULT_GRACE_MS, ReplicationLog, now_ms
from replog.sink_protocol import PENDING_SEGMENTS, PendingResolution, SinkCommitter

logger = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    resolved: dict[str, PendingResolution] = field(default_factory=dict)
    pending_too_recent: dict[str, int] = field(default_factory=dict)
    garbage: list[str] = field(default_factory=list)
    deleted: bool = False


def recover(
    log: ReplicationLog, *, grace_ms: int = DEFAULT_GRACE_MS, dry_run: bool = False
) -> RecoveryReport:
    """Resolve every sink's Pending epoch older than ``grace_ms``; delete garbage files.

    With ``dry_run`` nothing is written or deleted; the report says what would be.
    """
    report = RecoveryReport()
    cutoff = now_ms() - grace_ms
    pending_files: set[str] = set()  # files of epochs still Pending: not garbage yet
    for sink_id in consumers.list_sinks(log):
        committer = SinkCommitter(log, sink_id)
        found = committer.pending()
        if found is None:
            continue
        manifest, resolution = found
        if manifest.timestamp_ms > cutoff:
            pending_files.update(manifest.extra.get(PENDING_SEGMENTS, {}).get(sink_id, []))
            report.pending_too_recent[sink_id] = manifest.epoch
            logger.warning(
                "sink %s: Pending epoch %d is younger than the grace period; left alone "
                "(its driver may still be committing)",
                sink_id,
                manifest.epoch,
            )
            continue
        if not dry_run:
            committer.resolve_pending(manifest)
        report.resolved[sink_id] = resolution
    report.garbage = [path for path in log.orphaned_segments(grace_ms) if path not in pending_files]
    if not dry_run:
        for relative in report.garbage:
            log.storage.delete(relative)
        report.deleted = True
        logger.info("recover %s: deleted %d garbage files", log.url, len(report.garbage))
    return report
