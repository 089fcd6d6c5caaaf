"""Sinks of a log and the exactly-once commit protocol they follow (pure; no pyspark).

For sink S, query Q, run R and epoch E, with S's manifests in ``<log>/_replog/sinks/S``:

1. A Pending epoch left by a crash is resolved from the log: the log holds it →
   Committed; it does not → rolled back (Spark replays it). Its staged files are left to
   ``replog recover``: a zombie driver of the crashed attempt may still commit them.
2. The log already holds (S, Q, E) → a replay: this attempt's files are discarded (no
   commit can name them) and the manifest is brought up to date.
3. A newer run owns S → :class:`~replog.errors.FencedError`, before anything is written.
4. Manifest: Pending(E), naming the staged files. 5. Log: one put-if-absent commit naming
   (S, Q, E), R's generation and the source positions the data covers. 6. Manifest:
   Committed (bookkeeping: if it fails, step 1 of the next commit completes it).

:meth:`SinkCommitter.abort` never deletes a file a commit names: it looks the attempt's
files up in every commit made since its micro-batch began, and while the attempt's log
commit may still be in flight (the manifest says Pending for it) it keeps them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from enum import Enum

from replog.checkpoints.manifest import CheckpointManifest, SinkCommitStatus
from replog.checkpoints.store import ManifestStore, named_stores
from replog.core import fencing, staging
from replog.crashpoints import crash_point
from replog.format.commits import META_DIR, CommitRecord, SourcePosition, WriterInfo
from replog.format.gc import StagingStart
from replog.format.segments import StagedSegment
from replog.log import ReplicationLog
from replog.names import check_name

logger = logging.getLogger(__name__)

SINKS_DIR = f"{META_DIR}/sinks"


def sink_store(log: ReplicationLog, sink_id: str) -> ManifestStore:
    return ManifestStore(log.storage.child(f"{SINKS_DIR}/{check_name(sink_id, 'sinkId')}"))


def list_sinks(log: ReplicationLog) -> list[str]:
    """Every sink that wrote to ``log`` (stray entries skipped: :func:`named_stores`)."""
    return named_stores(log.storage, SINKS_DIR)[0]


RUNS_DIR = "runs"


def _run_path(run_id: str) -> str:
    """Where a sink keeps the generation of run ``run_id`` (named by its digest: run ids
    are chosen by callers)."""
    return f"{RUNS_DIR}/{hashlib.sha256(run_id.encode()).hexdigest()[:32]}.json"


class Outcome(Enum):
    COMMITTED = "committed"
    REPLAYED = "replayed"
    EMPTY = "empty"


@dataclass(frozen=True)
class PendingResolution:
    epoch: int
    query_id: str
    committed: bool


@dataclass(frozen=True)
class Batch:
    """One attempt of one epoch: what its tasks staged, and who wrote it.

    ``since_version`` and ``since_ms`` are a log version known and the clock when the
    attempt began (its writer was created), before anything was staged: any commit
    naming its files comes after that version, and the gc marks since then tell whether
    a collection may have taken them (:mod:`replog.format.gc`). Without ``since_ms``
    every staged file is checked to exist before the commit.
    """

    query_id: str
    epoch: int
    staged: tuple[StagedSegment, ...] = ()
    run_id: str | None = None
    sources: tuple[SourcePosition, ...] = ()
    since_version: int = 0
    since_ms: int | None = None

    @property
    def since(self) -> StagingStart | None:
        return None if self.since_ms is None else StagingStart(self.since_version, self.since_ms)

    @property
    def paths(self) -> list[str]:
        return [segment.path for segment in self.staged]

    @property
    def events(self) -> int:
        return sum(segment.events for segment in self.staged)


class SinkCommitter:
    """Runs the protocol for one sink of one log (driver side)."""

    def __init__(self, log: ReplicationLog, sink_id: str) -> None:
        self.log = log
        self.sink_id = check_name(sink_id, "sinkId")
        self.store: ManifestStore = sink_store(log, sink_id)
        self._generations: dict[str, int] = {}
        """The generation each run committed with, as this process knows it: a run the
        log's sink mark has forgotten still knows it, and is fenced by it. Each run's
        first commit also records it on storage (:meth:`_record_run`), so a process that
        builds a fresh committer for an old run (a zombie driver) finds it there."""
        self._recorded_runs: set[str] = set()

    # -- state --------------------------------------------------------------------------

    def _load(self) -> CheckpointManifest:
        manifest = self.store.load_latest() or CheckpointManifest()
        if self.sink_id not in manifest.sink_names:
            manifest.sink_names.append(self.sink_id)
        return manifest

    def _status(
        self, base: CheckpointManifest, query_id: str, epoch: int, status: SinkCommitStatus
    ) -> CheckpointManifest:
        manifest = self.store.next_manifest(base)
        manifest.epoch = epoch
        manifest.pending_segments = {}
        manifest.sink_commit_statuses[self.sink_id] = status
        manifest.sink_query_ids[self.sink_id] = query_id
        if status.is_committed:
            manifest.sink_epochs[self.sink_id] = epoch
        return manifest

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
        held = fencing.holds(self.log.state(), WriterInfo(self.sink_id, query_id, manifest.epoch))
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
        pending = manifest.pending_segments.get(self.sink_id, [])
        if resolution.committed:
            status = SinkCommitStatus.committed()
            logger.warning(
                "sink %s: Pending epoch %d is in the log (the driver stopped before marking "
                "it); marked Committed",
                self.sink_id,
                manifest.epoch,
            )
        else:
            status = SinkCommitStatus.failed(
                f"epoch {manifest.epoch} rolled back: its driver stopped before its log commit"
            )
            # The staged files are left for `replog recover` (after its grace period), not
            # deleted: a zombie driver of that attempt may still commit them, and the log
            # would then name deleted files. Its commit is safe otherwise: the log accepts
            # (sink, query, epoch) once, and the replay defers to it.
            logger.warning(
                "sink %s: Pending epoch %d never reached the log; rolled back, Spark replays "
                "it (%d staged files left for 'replog recover')",
                self.sink_id,
                manifest.epoch,
                len(pending),
            )
        resolved = self._status(manifest, resolution.query_id, manifest.epoch, status)
        self.store.save(resolved)
        return resolution, resolved

    # -- protocol -----------------------------------------------------------------------

    def commit(self, batch: Batch) -> Outcome:
        """Commit ``batch`` exactly once, by the six steps of the module docstring."""
        crash_point("staged", batch.epoch)
        writer = self._writer(batch)
        state = self.log.refresh()  # once: every check below reads this state
        _, manifest = self.resolve_pending(self._load())  # 1
        if fencing.holds(state, writer):  # 2
            return self._replayed(manifest, batch)
        fencing.claim(state, writer)  # 3: a fenced run stops here, before writing anything
        self._note_new_query(manifest, batch)
        if not batch.staged:
            return Outcome.EMPTY
        pending = self._save_pending(manifest, batch)  # 4
        record = self._commit_to_log(pending, batch, writer)  # 5
        self._save_committed(pending, batch)  # 6
        if record is not None:
            self.log.maintain()
        logger.info(
            "sink %s: committed epoch %d of query %s (%d events, log version %s)",
            self.sink_id,
            batch.epoch,
            batch.query_id,
            batch.events,
            record.version if record else "of an earlier attempt",
        )
        return Outcome.COMMITTED if record else Outcome.REPLAYED

    def _writer(self, batch: Batch) -> WriterInfo:
        """Who commits ``batch``: with the generation this process saw its run commit with
        (a run the log's sink mark has forgotten is still fenced by it)."""
        generation = self._run_generation(batch.run_id) if batch.run_id else 0
        return WriterInfo(
            self.sink_id,
            batch.query_id,
            batch.epoch,
            run_id=batch.run_id,
            generation=generation,
            sources=batch.sources,
        )

    def _run_generation(self, run_id: str) -> int:
        """The generation ``run_id`` committed with (0: a run new to this sink)."""
        if run_id not in self._generations:
            data = self.store.storage.read_optional(_run_path(run_id))
            if data is None:
                return 0  # new to this sink (or not recorded yet): not remembered as such
            self._generations[run_id] = int(json.loads(data)["generation"])
            self._recorded_runs.add(run_id)
        return self._generations[run_id]

    def _record_run(self, run_id: str, generation: int) -> None:
        """Keep ``run_id``'s generation in memory, and on storage where no later run
        pushes it out (the sink mark keeps the newest runs only): written once per run,
        best effort (its commit has landed; a failure is tried again at its next
        commit, and memory fences it meanwhile)."""
        self._generations[run_id] = generation
        if run_id in self._recorded_runs:
            return
        document = json.dumps({"run_id": run_id, "generation": generation}).encode()
        try:
            self.store.storage.put_if_absent(_run_path(run_id), document)
        except FileExistsError:
            pass
        except Exception as exc:
            logger.warning("sink %s: could not record run %s: %s", self.sink_id, run_id, exc)
            return
        self._recorded_runs.add(run_id)

    def _replayed(self, manifest: CheckpointManifest, batch: Batch) -> Outcome:
        """The log holds the epoch already: another attempt's commit, or this very
        attempt's (a commit called again after an unknown outcome). Delete only the files
        no commit names, and bring the manifest up to date."""
        mark = self.log.state().sinks.get(self.sink_id)
        known = mark.generation_of(batch.run_id) if mark and batch.run_id else None
        if batch.run_id and known:  # an attempt of this run landed (perhaps in doubt)
            self._record_run(batch.run_id, known)
        named = self.log.added_since(batch.since_version, batch.paths) if batch.staged else set()
        self.log.discard_staged(s for s in batch.staged if s.path not in named)
        if manifest.sink_epochs.get(self.sink_id, -1) < batch.epoch or (
            manifest.sink_query_ids.get(self.sink_id) != batch.query_id
        ):
            committed = SinkCommitStatus.committed()
            self.store.save(self._status(manifest, batch.query_id, batch.epoch, committed))
        logger.info(
            "sink %s: epoch %d is already in the log (replay); skipped", self.sink_id, batch.epoch
        )
        return Outcome.REPLAYED

    def _note_new_query(self, manifest: CheckpointManifest, batch: Batch) -> None:
        previous = manifest.sink_query_ids.get(self.sink_id)
        if previous not in (None, batch.query_id):
            logger.warning(
                "sink %s: now written by query %s (was %s): a new Spark checkpoint; its "
                "epochs start a new lineage",
                self.sink_id,
                batch.query_id,
                previous,
            )

    def _save_pending(self, manifest: CheckpointManifest, batch: Batch) -> CheckpointManifest:
        """Step 4: the manifest says Pending(E) and names the staged files."""
        pending = self._status(manifest, batch.query_id, batch.epoch, SinkCommitStatus.pending())
        same_query = manifest.sink_query_ids.get(self.sink_id) == batch.query_id
        pending.sink_epochs = dict(manifest.sink_epochs) if same_query else {}
        pending.pending_segments = {self.sink_id: batch.paths}
        self.store.save(pending, provisional=True)  # Committed or Failed follows
        crash_point("after_pending", batch.epoch)
        return pending

    def _commit_to_log(
        self, pending: CheckpointManifest, batch: Batch, writer: WriterInfo
    ) -> CommitRecord | None:
        """Step 5: the one log commit naming (S, Q, E). Failed: the manifest says so when
        it is certain nothing landed (then the files go too); None: another attempt of
        the epoch reached the log first (this attempt's files go)."""
        with staging.committing(self.log.storage, batch.staged) as attempt:
            try:
                record = self.log.commit_staged(
                    batch.staged, writer=writer, attempt=attempt, refreshed=True, since=batch.since
                )
            except BaseException as exc:
                if attempt.safe_to_discard:  # certain: nothing of this attempt is in the log
                    failed = SinkCommitStatus.failed(str(exc)[:500])
                    self.store.save(self._status(pending, batch.query_id, batch.epoch, failed))
                raise
        if record is None:
            self.log.discard_staged(batch.staged)
        elif record.writer is not None and record.writer.run_id is not None:
            self._record_run(record.writer.run_id, record.writer.generation)
        crash_point("after_log_commit", batch.epoch)
        return record

    def _save_committed(self, pending: CheckpointManifest, batch: Batch) -> None:
        """Step 6, bookkeeping: if it fails, step 1 of the next commit completes it."""
        done = self._status(pending, batch.query_id, batch.epoch, SinkCommitStatus.committed())
        try:
            self.store.save(done)
        except Exception as exc:
            logger.warning(
                "sink %s: epoch %d is in the log but its manifest could not be marked "
                "Committed (%s); the next commit or 'replog recover' completes it",
                self.sink_id,
                batch.epoch,
                exc,
            )
        crash_point("after_committed", batch.epoch)

    def abort(self, batch: Batch, reason: str) -> None:
        """Record Failed(reason) and delete the attempt's staged files, unless a commit
        names them (then the epoch stays committed) or its log commit may be in flight
        (then they stay for ``replog recover``)."""
        self.log.refresh()
        if batch.staged and self.log.added_since(batch.since_version, batch.paths):
            logger.warning(
                "sink %s: abort of epoch %d ignored: the epoch is in the log",
                self.sink_id,
                batch.epoch,
            )
            manifest = self._load()
            held = fencing.holds(
                self.log.state(), WriterInfo(self.sink_id, batch.query_id, batch.epoch)
            )
            if held and manifest.sink_epochs.get(self.sink_id, -1) < batch.epoch:
                self.store.save(
                    self._status(
                        manifest, batch.query_id, batch.epoch, SinkCommitStatus.committed()
                    )
                )
            return
        manifest = self._load()
        status = manifest.sink_commit_statuses.get(self.sink_id)
        in_flight = (
            status is not None
            and status.is_pending
            and manifest.epoch == batch.epoch
            and manifest.sink_query_ids.get(self.sink_id) == batch.query_id
            and set(manifest.pending_segments.get(self.sink_id, [])) == set(batch.paths)
        )
        if in_flight and batch.staged:
            logger.warning(
                "sink %s: epoch %d aborted (%s) while its log commit may still land; its %d "
                "staged files are kept and the Pending epoch is resolved at the next commit "
                "or by 'replog recover'",
                self.sink_id,
                batch.epoch,
                reason,
                len(batch.staged),
            )
            return
        self.log.discard_staged(batch.staged)
        self.store.save(
            self._status(manifest, batch.query_id, batch.epoch, SinkCommitStatus.failed(reason))
        )
        logger.warning(
            "sink %s: epoch %d aborted (%s); %d staged files deleted",
            self.sink_id,
            batch.epoch,
            reason,
            len(batch.staged),
        )
