"""A replication log at one fsspec URL: the face writers and readers use.

DESIGN: this module owns opening a log (creating it, finding it, refusing a place that
is not one) and its identity, and is the face over the three rooms that do the work:

* :mod:`replog.reading`: the state, kept current, and reads of events;
* :mod:`replog.writing`: events to a committed record, under the staged-commit
  protocol (:mod:`replog.committing` puts each commit);
* :mod:`replog.maintenance`: merges of small files, checkpoints and expiry.

An append is the writer's, then the maintenance's (a merge after it, in the
background). The format is docs/FORMAT.md's, implemented in :mod:`replog.format`.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from replog.committing import MAX_COMMIT_ATTEMPTS, RACE_BACKOFF_MAX_S
from replog.core import history
from replog.core.staging import CommitAttempt
from replog.errors import InvalidOptionError, LogExistsError, LogNotFoundError
from replog.format import segments
from replog.format.commits import (
    DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_RETENTION_MS,
    DEFAULT_SHARDS,
    DEFAULT_SNAPSHOT_INTERVAL,
    DESCRIPTOR_PATH,
    META_DIR,
    CommitRecord,
    LogDescriptor,
    Transaction,
    WriterInfo,
)
from replog.format.gc import StagingStart
from replog.format.leases import Lease
from replog.format.limits import (
    check_retention,
    check_shards,
    check_snapshot_interval,
    retention_advice,
)
from replog.format.segments import SHARDS_DIR, SegmentInfo, StagedSegment
from replog.format.state import LogState
from replog.maintenance import MERGE_MEMORY_BYTES, LogMaintenance
from replog.merges import Merge
from replog.reading import READ_VERIFY_S, LogInfo, LogReader
from replog.storage import Storage
from replog.timeutil import now_ms
from replog.writing import CHECK_THREADS, FRESH_S, RESTAGES, LogWriter

__all__ = [  # the names this module always had, wherever they live now
    "CHECK_THREADS",
    "FRESH_S",
    "MAX_COMMIT_ATTEMPTS",
    "MERGE_MEMORY_BYTES",
    "RACE_BACKOFF_MAX_S",
    "READ_VERIFY_S",
    "RESTAGES",
    "LogInfo",
    "ReplicationLog",
]

logger = logging.getLogger(__name__)


class ReplicationLog(LogReader):
    """One replog log. Cheap to open; not thread-safe (use one per thread or process, or
    share a :class:`~replog.appender.GroupAppender`).

    It reads as a :class:`~replog.reading.LogReader` (its state, ``read``, ``scan``);
    it writes through a :class:`~replog.writing.LogWriter` and keeps the log small
    through a :class:`~replog.maintenance.LogMaintenance`, both built on it."""

    def __init__(
        self, storage: Storage, descriptor: LogDescriptor, *, auto_compact: bool | None = None
    ) -> None:
        """``auto_compact``: merge small files after this writer's commits (default: as
        the log's descriptor says)."""
        super().__init__(storage, descriptor)
        self.auto_compact = descriptor.auto_compact if auto_compact is None else auto_compact
        self._writer = LogWriter(self)
        self._upkeep = LogMaintenance(self._writer)

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

        ``snapshot_interval``: commits between segment tables (a snapshot header comes
        every 10, or every ``snapshot_interval`` if it is no multiple of 10).
        ``retention_ms``: how long commits, snapshots and the files of segments that left
        the log (compacted or truncated) are kept: at least 10 minutes (a retention shorter
        than ``replog recover``'s default grace plus 10 minutes is warned about).
        ``auto_compact``: whether writers merge small files after their commits (each
        writer may override it). The limits are :mod:`replog.format.limits`'s, the same
        for ``replog create`` and the ``replog-sink``.

        Raises:
            LogExistsError: a log is already there.
            InvalidOptionError: an option is out of its limits (named), or the URL cannot
                be opened.
            UnsupportedStorageError: the backend has no atomic create-if-absent.
        """
        check_shards(shards)
        check_snapshot_interval(snapshot_interval)
        check_retention(retention_ms)
        if not isinstance(auto_compact, bool):
            raise InvalidOptionError(f"auto_compact must be True or False, got {auto_compact!r}")
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
        advice = retention_advice(retention_ms)
        if advice is not None:
            logger.warning("%s: %s", url, advice)
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

    def info(self) -> LogInfo:
        """A summary of the log, as ``replog info`` prints it."""
        return LogInfo.of(self, auto_compact=self.auto_compact)

    # -- writing: replog.writing ------------------------------------------------------

    def append(
        self,
        events: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]],
        *,
        segment_max_events: int = segments.MAX_SEGMENT_EVENTS,
        transaction: Transaction | None = None,
    ) -> CommitRecord | None:
        """Append change events as one atomic commit; None when there was nothing to append
        (or ``transaction`` is already in the log). Then, if this writer auto-compacts,
        merge small files in the background (:meth:`maintain`).

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
        record = self._writer.append(
            events, segment_max_events=segment_max_events, transaction=transaction
        )
        if record is not None:
            self.maintain()
        return record

    def stage(
        self, table: pa.Table, *, max_events: int = segments.MAX_SEGMENT_EVENTS
    ) -> list[StagedSegment]:
        """Route validated rows to shards and write them as segment files (not yet visible)."""
        return self._writer.stage(table, max_events=max_events)

    def discard_staged(self, staged: Iterable[StagedSegment | SegmentInfo]) -> None:
        """Delete staged files that no commit names (the caller must know that)."""
        self._writer.discard_staged(staged)

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
        """Make staged segments visible in one commit, exactly once per ``writer``:
        :meth:`LogWriter.commit_staged`."""
        return self._writer.commit_staged(
            staged,
            writer=writer,
            attempt=attempt,
            refreshed=refreshed,
            since=since,
            lease=lease,
            follows=follows,
        )

    def replace(
        self,
        added: Sequence[SegmentInfo],
        removed: Sequence[SegmentInfo],
        since: StagingStart,
        *,
        lease: Lease | None = None,
        refreshed: bool = False,
    ) -> CommitRecord:
        """Commit staged files ``added`` in place of the live entries ``removed`` (merges,
        key compaction): :meth:`LogWriter.replace`."""
        return self._writer.replace(added, removed, since, lease=lease, refreshed=refreshed)

    def commit(
        self,
        build: Callable[[LogState], CommitRecord | None],
        *,
        attempt: CommitAttempt | None = None,
        refreshed: bool = False,
    ) -> CommitRecord | None:
        """Commit ``build(state)`` (a record for ``state.version + 1``), retrying lost
        races; used for every kind of commit: :func:`replog.committing.commit`."""
        return self._writer.commit(build, attempt=attempt, refreshed=refreshed)

    # -- maintenance: replog.maintenance ----------------------------------------------

    def maintain(self) -> None:
        """After a commit: merge one full tier of small files in the background if this
        writer auto-compacts (:meth:`LogMaintenance.maintain`); never raises."""
        self._upkeep.maintain(auto_compact=self.auto_compact)

    def merge(
        self,
        merges: Sequence[Merge],
        *,
        lease: Lease | None = None,
        refreshed: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> CommitRecord | None:
        """Rewrite each merge's segments as larger files in one ``compact`` commit
        (compaction, and the merges of :meth:`maintain`): :meth:`LogMaintenance.merge`."""
        return self._upkeep.merge(merges, lease=lease, refreshed=refreshed, progress=progress)

    def flush(self) -> None:
        """Wait for this object's background work (merges, retention) to finish."""
        self._upkeep.flush()


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
