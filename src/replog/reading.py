"""Reading a log: what one log object knows of it, kept current, and its events.

DESIGN: this module owns a log object's view of its log: the storage and descriptor it
opened, the last state it read (:meth:`LogReader.refresh` reads only what was committed
since, and checks that the log at the URL is still the one it opened), the files it
decoded, and the reads over that state: one shard's events (:meth:`LogReader.read`),
every shard's (:meth:`LogReader.scan`), the row sequences of holed entries, which
commits added a file (:meth:`LogReader.added_since`) and the summary ``replog info``
prints (:class:`LogInfo`). It writes nothing: :mod:`replog.writing` commits on this
view, :mod:`replog.maintenance` merges and expires, and :class:`replog.log.ReplicationLog`
is the face over the three.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from replog.core import files, history
from replog.core.files import DecodedFiles
from replog.errors import DataLossError, InvalidOptionError, MissingCommitError
from replog.format import segments
from replog.format.commits import TXN_QUERY, LogDescriptor
from replog.format.events import EVENT_SCHEMA
from replog.format.segments import SegmentInfo
from replog.format.state import LogState, retained_events
from replog.storage import Storage

logger = logging.getLogger(__name__)

READ_VERIFY_S = 1.0
"""A reader checks that the log at its URL is still its log at most this often while
nothing new arrives (a writer checks before every commit)."""


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

    @classmethod
    def of(cls, log: LogReader, *, auto_compact: bool) -> LogInfo:
        """The summary of ``log`` as it is now (``auto_compact``: its writer's setting,
        which the log's descriptor only defaults)."""
        state = log.refresh()
        return cls(
            url=log.url,
            format_version=log.descriptor.format_version,
            log_id=log.descriptor.log_id,
            shards=log.shards,
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
            retention_ms=log.descriptor.retention_ms,
            retained_from=state.retained_from,
            auto_compact=auto_compact,
        )

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


class LogReader:
    """One log object's view of its log, and its reads: the ground floor of
    :class:`~replog.log.ReplicationLog`. Not thread-safe."""

    def __init__(self, storage: Storage, descriptor: LogDescriptor) -> None:
        self.storage = storage
        self.descriptor = descriptor
        self._state: LogState | None = None
        self._files = DecodedFiles()
        """Files this object read (checked against their digests), for its reads."""
        self._row_sequences: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        """Holed entries' row sequences, by entry (:meth:`row_sequences`)."""

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
                idle_ms=self.descriptor.surely_kept_ms,
            )
        except history.BaseMissing:  # retention removed what this idle state was built on
            caught_up = False
        except MissingCommitError as gap:  # a header past the gap holds the state, or raise
            fresh = history.load_state(self.storage, self.descriptor)
            logger.warning(
                "%s: commit %d is missing (commit %d exists), but snapshot %d holds the state "
                "past it: reading on from there ('replog verify' names the damage)",
                self.url,
                gap.version,
                gap.later,
                fresh.version - fresh.version % self.descriptor.checkpoint_interval,
            )
            self._state = fresh
            return fresh
        if not caught_up:  # far behind: a snapshot is cheaper than every commit
            fresh = history.load_state(self.storage, self.descriptor)
            if fresh.version >= self._state.version:
                self._state = fresh
        return self._state

    def state(self) -> LogState:
        """The last state read (refreshing only if nothing was read yet)."""
        return self._state if self._state is not None else self.refresh()

    @property
    def known(self) -> LogState | None:
        """The last state read, without reading (None: nothing read yet, or forgotten)."""
        return self._state

    def forget(self) -> None:
        """Drop the state: the next :meth:`refresh` reads it whole (after a commit that
        did not belong, or whose check failed)."""
        self._state = None

    def transaction_version(self, app_id: str) -> int | None:
        """The version of idempotent transaction ``app_id``
        (:class:`~replog.format.commits.Transaction`) the log holds, read afresh as a
        writer would (None: the log holds none)."""
        mark = self.refresh(verify_within=0).sinks.get(app_id)
        return mark.epoch_of(TXN_QUERY) if mark else None

    def head(self) -> dict[int, int]:
        """Per-shard last committed sequence (0 for an empty shard)."""
        return dict(enumerate(self.refresh().heads))

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

    # -- events -----------------------------------------------------------------------

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
