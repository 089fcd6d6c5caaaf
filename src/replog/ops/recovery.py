"""Recovery: resolving Pending sink commits left by crashes, and collecting garbage.

A sink resolves its own Pending epoch when its query restarts; ``recover`` does the same
for every sink of a log without Spark, then deletes segment files no commit references
(staged by crashed writers, or replaced by compaction and retention) by the rules of
:mod:`replog.ops.garbage`. Everything younger than the grace period is left alone: a
Pending epoch that recent may belong to a driver that is committing right now, and a file
that recent may belong to a running batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from replog.checkpoints.sinks import PendingResolution, SinkCommitter, list_sinks
from replog.format.gc import CLOCK_SKEW_MS, DEFAULT_GRACE_MS
from replog.log import ReplicationLog
from replog.ops import garbage
from replog.timeutil import now_ms

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_GRACE_MS", "RecoveryReport", "recover"]


@dataclass
class RecoveryReport:
    """What ``recover`` did (or, with ``dry_run``, would do)."""

    dry_run: bool
    grace_ms: int
    resolved: dict[str, PendingResolution] = field(default_factory=dict)
    pending_too_recent: dict[str, int] = field(default_factory=dict)
    scan: garbage.GarbageScan = field(default_factory=garbage.GarbageScan)

    @property
    def garbage(self) -> list[str]:
        return self.scan.garbage

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "grace_ms": self.grace_ms,
            "resolved": {
                sink: {"epoch": r.epoch, "query_id": r.query_id, "committed": r.committed}
                for sink, r in sorted(self.resolved.items())
            },
            "pending_too_recent": dict(sorted(self.pending_too_recent.items())),
            "garbage": sorted(self.scan.garbage),
            "kept": {
                "young": self.scan.kept_young,
                "leased": self.scan.kept_leased,
                "removed_recently": self.scan.kept_removed_recently,
                "pending": self.scan.kept_pending,
            },
            "expired_leases": list(self.scan.expired_leases),
        }


def _resolve_pending(
    log: ReplicationLog, report: RecoveryReport, cutoff: int, *, dry_run: bool
) -> set[str]:
    """Resolve each sink's Pending epoch written before ``cutoff`` (into ``report``); the
    files of the epochs still Pending, younger than that (not garbage yet)."""
    pending_files: set[str] = set()
    for sink_id in list_sinks(log):
        committer = SinkCommitter(log, sink_id)
        found = committer.pending()
        if found is None:
            continue
        manifest, resolution = found
        if manifest.timestamp_ms > cutoff:
            pending_files.update(manifest.pending_segments.get(sink_id, []))
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
    return pending_files


def recover(
    log: ReplicationLog,
    *,
    grace_ms: int = DEFAULT_GRACE_MS,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> RecoveryReport:
    """Resolve every sink's Pending epoch older than ``grace_ms``; delete garbage files.

    With ``dry_run`` nothing is written or deleted; the report says what would be.
    ``progress`` is told the garbage files deleted so far and in all.
    """
    report = RecoveryReport(dry_run=dry_run, grace_ms=grace_ms)
    if not dry_run and grace_ms < CLOCK_SKEW_MS:
        logger.warning(
            "%s: a grace of %d ms is below the %d minutes of clock skew writers allow: "
            "writes staging while this runs are refused (appends stage again; a Spark "
            "micro-batch fails and must be run again)",
            log.url,
            grace_ms,
            CLOCK_SKEW_MS // 60_000,
        )
    now = now_ms()
    cutoff = now - grace_ms
    pending_files = _resolve_pending(log, report, cutoff, dry_run=dry_run)
    notes = garbage.read_first_seen(log)  # before the mark: see garbage.scan
    mark_stamp = None
    if not dry_run:  # before anything is deleted: writers staging from now on are safe
        mark_stamp = garbage.begin(log, cutoff)
    report.scan = garbage.scan(
        log,
        grace_ms,
        now=now,
        mark_stamp_ms=mark_stamp,
        first_seen=notes,
        pending=pending_files,
        remember=not dry_run,
    )
    if not dry_run:
        for done, relative in enumerate(report.scan.garbage, 1):
            log.storage.delete(relative)
            if progress is not None:
                progress(done, len(report.scan.garbage))
        for relative in report.scan.expired_leases:
            log.storage.delete(relative)
        logger.info("recover %s: deleted %d garbage files", log.url, len(report.scan.garbage))
    return report
