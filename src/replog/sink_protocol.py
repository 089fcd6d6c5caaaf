"""The exactly-once commit protocol of a sink writing into a log (pure; no pyspark).

For sink S, query Q and epoch E, with S's checkpoint manifests in
``<log>/_replog/sinks/S``:

1. Resolve a Pending epoch left by a crash: the log holds its commit → Committed;
   it does not → rolled back (Spark replays it); its staged files are left to
   ``replog recover``, in case a zombie driver of the crashed attempt still commits them.
2. E already committed (manifest or log says so) → discard this attempt's staged
   files and return: a replay.
3. Manifest: Pending(E). 4. Log: one put-if-absent commit naming (S, Q, E).
   5. Manifest: Committed, ``sink_epochs[S] = E``.

:meth:`SinkCommitter.abort` records Failed(reason) and deletes staged files, but never
undoes an epoch the log holds. The log's own check (one commit per (S, Q, E), decided
under put-if-absent) is what makes the protocol safe against zombie drivers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from replog.consumers import sink_store
from replog.faults import fault_point
from replog.log import ReplicationLog
from replog.manifest import CheckpointManifest, SinkCommitStatus
from replog.manifest_store import ManifestStore
from replog.records import CommitRecord, WriterInfo, commit_path
from replog.segments import StagedSegment

logger = logging.getLogger(__name__)

PENDING_SEGMENTS = "pending_segments"
"""Manifest field (per sink) listing the staged files of the Pending epoch."""


class Outcome(Enum):
    COMMITTED = "committed"
    REPLAYED = "replayed"
    EMPTY = "empty"


@dataclass(frozen=True)
class PendingResolution:
    epoch: int
    query_id: str
    committed: bool


class SinkCommitter:
    """Runs the protocol for one sink of one log (driver side)."""

    def __init__(self, log: ReplicationLog, sink_id: str) -> None:
        self.log = log
        self.sink_id = sink_id
        self.store: ManifestStore = sink_store(log, sink_id)

    # -- state --------------------------------------------------------------------------

    def _load(self) -> CheckpointManifest:
        manifest = self.store.load_latest()
        if manifest is None:
            manifest = CheckpointManifest()
        if self.sink_id not in manifest.sink_names:
            manifest.sink_names.append(self.sink_id)
        return manifest

    def _save(self, manifest: CheckpointManifest) -> None:
        self.store.save(manifest)

    def _held(self, writer: WriterInfo) -> tuple[bool, CommitRecord | None]:
        """Whether the log (as last refreshed) holds ``writer``'s epoch, and its record.

        The record is returned only when it is the sink's latest commit (the one a replay
        of this epoch can collide with); an older held epoch needs no record.
        """
        if not self.log.holds_epoch(writer):
            return False, None
        mark = self.log.state().sinks[writer.sink_id]
        if mark.epoch != writer.epoch:
            return True, None
        relative = commit_path(mark.version)
        record = CommitRecord.from_bytes(
            self.log.storage.read(relative), self.log.storage.path(relative)
        )
        return True, record

    def _discard(self, staged: Sequence[StagedSegment], keep: CommitRecord | None) -> None:
        """Delete staged files, except any that ``keep`` (a committed record) made visible."""
        live = {segment.path for segment in keep.add} if keep else set()
        self.log.discard_staged([s for s in staged if s.path not in live])

    def pending(self) -> tuple[CheckpointManifest, PendingResolution] | None:
        """The sink's Pending epoch and how resolving it would end (from the refreshed log),
        or None when nothing is Pending. Writes nothing."""
        self.log.refresh()
        manifest = self._load()
        resolution = self._resolution(manifest)
        return None if resolution is None else (manifest, resolution)

    def recover(self) -> PendingResolution | None:
        """Resolve a Pending epoch left by a crash (idempotent); None if there was none."""
        found = self.pending()
        if found is None:
            return None
        self.resolve_pending(found[0])
        return found[1]

    def _resolution(self, manifest: CheckpointManifest) -> PendingResolution | None:
        status = manifest.sink_commit_statuses.get(self.sink_id)
        if status is None or not status.is_pending:
            return None
        query_id = manifest.sink_query_ids[self.sink_id]
        held = self.log.holds_epoch(WriterInfo(self.sink_id, query_id, manifest.epoch))
        return PendingResolution(manifest.epoch, query_id, held)

    def resolve_pending(
        self, manifest: CheckpointManifest
    ) -> tuple[PendingResolution | None, CheckpointManifest]:
        """Resolve ``manifest``'s Pending epoch from the log as last refreshed: Committed if
        the log holds it, else rolled back. Returns the resolution and the manifest now
        current (``manifest`` itself when nothing was Pending)."""
        resolution = self._resolution(manifest)
        if resolution is None:
            return None, manifest
        resolved = manifest.next()
        pending = resolved.extra.pop(PENDING_SEGMENTS, {}).get(self.sink_id, [])
        if resolution.committed:
            resolved.sink_commit_statuses[self.sink_id] = SinkCommitStatus.committed()
            resolved.sink_epochs[self.sink_id] = manifest.epoch
            logger.warning(
                "sink %s: Pending epoch %d was committed to the log before a crash; "
                "marked Committed",
                self.sink_id,
                manifest.epoch,
            )
        else:
            resolved.sink_commit_statuses[self.sink_id] = SinkCommitStatus.failed(
                f"epoch {manifest.epoch} rolled back: crashed before its log commit"
            )
            # The staged files are left for `replog recover` (after its grace period),
            # not deleted: a zombie driver of the crashed attempt may still commit them,
            # and the log would then name deleted files. Its commit is safe otherwise:
            # the log accepts (sink, query, epoch) once, and the replay defers to it.
            logger.warning(
                "sink %s: Pending epoch %d never reached the log; rolled back, Spark "
                "replays it (%d staged files left for 'replog recover')",
                self.sink_id,
                manifest.epoch,
                len(pending),
            )
        self._save(resolved)
        return resolution, resolved

    # -- protocol -----------------------------------------------------------------------

    def commit(self, query_id: str, epoch: int, staged: Sequence[StagedSegment]) -> Outcome:
        """Commit epoch ``epoch`` of query ``query_id`` exactly once."""
        fault_point("staged", epoch)
        writer = WriterInfo(self.sink_id, query_id, epoch)
        self.log.refresh()  # once: every check below reads this state
        _, manifest = self.resolve_pending(self._load())
        previous_query = manifest.sink_query_ids.get(self.sink_id)
        last_epoch = manifest.sink_epochs.get(self.sink_id)
        if previous_query == query_id and last_epoch is not None and epoch <= last_epoch:
            self._discard(staged, self._held(writer)[1])
            logger.info(
                "sink %s: epoch %d already committed (replay); skipped", self.sink_id, epoch
            )
            return Outcome.REPLAYED
        held, record = self._held(writer)
        if held:
            self._discard(staged, record)
            self._mark_committed(manifest, query_id, epoch)
            logger.info(
                "sink %s: the log already holds epoch %d (replay after a crash); "
                "manifest brought up to date",
                self.sink_id,
                epoch,
            )
            return Outcome.REPLAYED
        if previous_query is not None and previous_query != query_id:
            logger.warning(
                "sink %s: now written by query %s (was query %s, last epoch %s); a new Spark "
                "checkpoint restarts epochs, and this sink's commits continue as a new lineage",
                self.sink_id,
                query_id,
                previous_query,
                last_epoch,
            )
        if not staged:
            return Outcome.EMPTY

        pending = manifest.next(epoch=epoch)
        pending.sink_commit_statuses[self.sink_id] = SinkCommitStatus.pending()
        pending.sink_query_ids[self.sink_id] = query_id
        pending.extra[PENDING_SEGMENTS] = {self.sink_id: [s.path for s in staged]}
        if previous_query != query_id:
            pending.sink_epochs.pop(self.sink_id, None)
        self._save(pending)
        fault_point("after_pending", epoch)

        committed = self.log.commit_staged(list(staged), writer=writer)
        if committed is None:  # another attempt of this epoch won the race to the log
            self._discard(staged, self._held(writer)[1])
        fault_point("after_log_commit", epoch)

        done = pending.next()
        done.extra.pop(PENDING_SEGMENTS, None)
        done.sink_commit_statuses[self.sink_id] = SinkCommitStatus.committed()
        done.sink_epochs[self.sink_id] = epoch
        self._save(done)
        fault_point("after_committed", epoch)
        events = sum(s.events for s in staged)
        logger.info(
            "sink %s: committed epoch %d of query %s (%d events, log version %s)",
            self.sink_id,
            epoch,
            query_id,
            events,
            committed.version if committed else "earlier",
        )
        return Outcome.COMMITTED if committed else Outcome.REPLAYED

    def _mark_committed(self, manifest: CheckpointManifest, query_id: str, epoch: int) -> None:
        done = manifest.next(epoch=epoch)
        done.extra.pop(PENDING_SEGMENTS, None)
        done.sink_commit_statuses[self.sink_id] = SinkCommitStatus.committed()
        done.sink_epochs[self.sink_id] = epoch
        done.sink_query_ids[self.sink_id] = query_id
        self._save(done)

    def abort(
        self, query_id: str | None, epoch: int, staged: Sequence[StagedSegment], reason: str
    ) -> None:
        """Record Failed(reason) and delete staged files; never undo a committed epoch."""
        if query_id is not None:
            writer = WriterInfo(self.sink_id, query_id, epoch)
            self.log.refresh()
            held, record = self._held(writer)
            if held:
                self._discard(staged, record)
                logger.warning(
                    "sink %s: abort of epoch %d ignored: the epoch is committed",
                    self.sink_id,
                    epoch,
                )
                manifest = self._load()
                if manifest.sink_epochs.get(self.sink_id, -1) < epoch:
                    self._mark_committed(manifest, query_id, epoch)
                return
        self.log.discard_staged(staged)
        manifest = self._load()
        failed = manifest.next(epoch=epoch)
        failed.extra.pop(PENDING_SEGMENTS, None)
        failed.sink_commit_statuses[self.sink_id] = SinkCommitStatus.failed(
            reason or "aborted by Spark"
        )
        if query_id is not None:
            failed.sink_query_ids.setdefault(self.sink_id, query_id)
        self._save(failed)
        logger.warning(
            "sink %s: epoch %d aborted (%s); %d staged files deleted",
            self.sink_id,
            epoch,
            reason,
            len(staged),
        )
