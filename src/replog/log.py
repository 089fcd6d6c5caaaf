"""A replication log at one fsspec URL: create, open, append, read, verify.

The format is described in docs/FORMAT.md. In short: segments are immutable files;
a commit record written with put-if-absent makes them visible; every ``snapshot_interval``
commits a snapshot of the state is written, and a hint file names the newest one, so
finding the head reads a hint, one snapshot header and the few commits after it.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from pyarrow import ipc

from replog.errors import (
    CommitConflictError,
    CorruptionError,
    DataLossError,
    InvalidEventError,
    InvalidOptionError,
    LogExistsError,
    ReplogError,
)
from replog.events import (
    EVENT_SCHEMA,
    STORED_SCHEMA,
    events_from_records,
    events_from_table,
    to_event_batch,
)
from replog.records import (
    APPEND,
    DESCRIPTOR_PATH,
    SHARDS_DIR,
    SNAPSHOT_HINT_PATH,
    CommitRecord,
    LogDescriptor,
    WriterInfo,
    commit_path,
    seal,
    snapshot_path,
    snapshot_segments_path,
    unseal,
)
from replog.routing import shards_of
from replog.segments import (
    SEGMENT_SUFFIX,
    SegmentInfo,
    StagedSegment,
    decode_segment,
    encode_segment,
    sha256_hex,
    slice_batches,
    timestamp_range_ms,
)
from replog.state import LogState, SinkMark, segments_from_table
from replog.storage import Storage, missing_log_error

logger = logging.getLogger(__name__)

DEFAULT_SHARDS = 8
DEFAULT_SEGMENT_MAX_EVENTS = 262_144
MAX_COMMIT_ATTEMPTS = 200
IO_THREADS = 8
DEFAULT_GRACE_MS = 3_600_000
"""Garbage younger than this is kept: it may belong to a live writer or a planned read."""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Problem:
    """A defect ``verify`` found: the file at fault and what is wrong with it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ReplicationLog:
    """One replog log. Cheap to open; not thread-safe (use one per thread or process)."""

    def __init__(self, storage: Storage, descriptor: LogDescriptor) -> None:
        self.storage = storage
        self.descriptor = descriptor
        self._state: LogState | None = None

    # -- opening ----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        url: str,
        shards: int = DEFAULT_SHARDS,
        *,
        storage_options: Mapping[str, Any] | None = None,
        snapshot_interval: int = 100,
    ) -> ReplicationLog:
        """Create an empty log at ``url``; :class:`LogExistsError` if one is there."""
        if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= 4096:
            raise InvalidOptionError(f"shards must be an integer from 1 to 4096, got {shards!r}")
        if snapshot_interval < 1:
            raise InvalidOptionError(f"snapshot_interval must be >= 1, got {snapshot_interval}")
        storage = Storage(url, storage_options)
        descriptor = LogDescriptor(
            shards=shards,
            log_id=str(uuid.uuid4()),
            created_ms=now_ms(),
            snapshot_interval=snapshot_interval,
        )
        try:
            storage.put_if_absent(DESCRIPTOR_PATH, descriptor.to_bytes())
        except FileExistsError as exc:
            raise LogExistsError(f"{url!r} already holds a replog log") from exc
        logger.info("created log %s with %d shards", url, shards)
        return cls(storage, descriptor)

    @classmethod
    def open(cls, url: str, *, storage_options: Mapping[str, Any] | None = None) -> ReplicationLog:
        """Open the log at ``url``; :class:`LogNotFoundError` if there is none."""
        return cls.from_storage(Storage(url, storage_options))

    @classmethod
    def from_storage(cls, storage: Storage) -> ReplicationLog:
        data = storage.read_optional(DESCRIPTOR_PATH)
        if data is None:
            raise missing_log_error(storage.url)
        return cls(storage, LogDescriptor.from_bytes(data, storage.path(DESCRIPTOR_PATH)))

    @classmethod
    def open_or_create(
        cls, url: str, shards: int, *, storage_options: Mapping[str, Any] | None = None
    ) -> ReplicationLog:
        """Open the log at ``url``, creating it with ``shards`` shards if absent (race-safe)."""
        try:
            return cls.open(url, storage_options=storage_options)
        except FileNotFoundError:
            pass
        try:
            return cls.create(url, shards, storage_options=storage_options)
        except LogExistsError:
            return cls.open(url, storage_options=storage_options)

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage, "descriptor": self.descriptor}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.storage, self.descriptor, self._state = state["storage"], state["descriptor"], None

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def shards(self) -> int:
        return self.descriptor.shards

    # -- state ------------------------------------------------------------------------

    def refresh(self) -> LogState:
        """The current state, reading only what was committed since the last call."""
        if self._state is None:
            self._state = self._load_from_snapshot()
        else:
            caught_up = self._read_new_commits(self._state, limit=self.descriptor.snapshot_interval)
            if not caught_up:
                # Far behind: a snapshot is cheaper than replaying every commit.
                fresh = self._load_from_snapshot()
                if fresh.version >= self._state.version:
                    self._state = fresh
        return self._state

    def state(self) -> LogState:
        """The last state read (refreshing only if nothing was read yet)."""
        return self._state if self._state is not None else self.refresh()

    def head(self) -> dict[int, int]:
        """Per-shard last committed sequence (0 for an empty shard)."""
        return dict(enumerate(self.refresh().heads))

    def _read_new_commits(self, state: LogState, limit: int | None = None) -> bool:
        """Apply commits after ``state.version``; False if ``limit`` was hit first."""
        applied = 0
        while limit is None or applied < limit:
            relative = commit_path(state.version + 1)
            data = self.storage.read_optional(relative)
            if data is None:
                return True
            state.apply(CommitRecord.from_bytes(data, self.storage.path(relative)), relative)
            applied += 1
        return False

    def _snapshot_hint(self) -> int:
        data = self.storage.read_optional(SNAPSHOT_HINT_PATH)
        if data is None:
            return 0
        try:
            return int(json.loads(data)["version"])
        except (ValueError, KeyError, TypeError):
            logger.warning(
                "ignoring unreadable snapshot hint %s", self.storage.path(SNAPSHOT_HINT_PATH)
            )
            return 0

    def _load_from_snapshot(self) -> LogState:
        interval = self.descriptor.snapshot_interval
        version = self._snapshot_hint()
        # The hint may lag (it is overwritten without coordination): probe forward.
        while self.storage.exists(snapshot_path(version + interval)):
            version += interval
        while version > 0:
            try:
                state = self._read_snapshot(version)
                break
            except CorruptionError as exc:
                logger.warning(
                    "snapshot at version %d unusable (%s); trying an older one", version, exc
                )
                version -= interval
        else:
            state = LogState(shards=self.shards)
        self._read_new_commits(state)
        return state

    def _read_snapshot(self, version: int) -> LogState:
        relative = snapshot_path(version)
        body = unseal(self.storage.read(relative), self.storage.path(relative))
        segments_relative = snapshot_segments_path(version)
        expected_sha = body["segments_sha256"]

        def load_segments() -> list[list[SegmentInfo]]:
            data = self.storage.read(segments_relative)
            path = self.storage.path(segments_relative)
            if sha256_hex(data) != expected_sha:
                raise CorruptionError(path, f"checksum mismatch: expected sha256 {expected_sha}")
            return segments_from_table(ipc.open_file(pa.BufferReader(data)).read_all(), self.shards)

        return LogState(
            shards=self.shards,
            version=int(body["version"]),
            heads=[int(body["heads"][str(s)]) for s in range(self.shards)],
            lows=[int(body["lows"][str(s)]) for s in range(self.shards)],
            sinks={
                name: SinkMark(str(mark["query_id"]), int(mark["epoch"]), int(mark["version"]))
                for name, mark in body["sinks"].items()
            },
            total_bytes=int(body["bytes"]),
            segment_count=int(body["segment_count"]),
            timestamp_ms=int(body["timestamp_ms"]),
            segment_loader=load_segments,
        )

    def _write_snapshot(self, state: LogState) -> None:
        """Best effort: a missing snapshot only makes the next open read more commits."""
        sink = pa.BufferOutputStream()
        table = state.segments_table()
        with ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        segments_bytes = bytes(sink.getvalue())
        header = seal(
            {
                "format_version": self.descriptor.format_version,
                "version": state.version,
                "timestamp_ms": state.timestamp_ms,
                "shards": self.shards,
                "heads": state.heads_json(),
                "lows": state.lows_json(),
                "sinks": {
                    name: {"query_id": m.query_id, "epoch": m.epoch, "version": m.version}
                    for name, m in sorted(state.sinks.items())
                },
                "bytes": state.total_bytes,
                "segment_count": state.segment_count,
                "segments_sha256": sha256_hex(segments_bytes),
            }
        )
        try:
            self.storage.put_if_absent(snapshot_segments_path(state.version), segments_bytes)
            self.storage.put_if_absent(snapshot_path(state.version), header)
        except FileExistsError:
            return
        if self._snapshot_hint() < state.version:
            self.storage.write(SNAPSHOT_HINT_PATH, json.dumps({"version": state.version}).encode())
        logger.debug("wrote snapshot of %s at version %d", self.url, state.version)

    # -- writing ----------------------------------------------------------------------

    def append(
        self,
        events: pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]],
        *,
        segment_max_events: int = DEFAULT_SEGMENT_MAX_EVENTS,
    ) -> CommitRecord | None:
        """Append change events (dicts or an Arrow table) as one atomic commit.

        Validates everything before writing anything. Returns the commit, or None when
        there was nothing to append.
        """
        if isinstance(events, pa.Table | pa.RecordBatch):
            table = events_from_table(events)
        else:
            table = events_from_records(events)
        if table.num_rows == 0:
            return None
        staged = self.stage(table, segment_max_events=segment_max_events)
        try:
            return self.commit_staged(staged)
        except BaseException:
            self.discard_staged(staged)
            raise

    def stage(
        self, table: pa.Table, *, segment_max_events: int = DEFAULT_SEGMENT_MAX_EVENTS
    ) -> list[StagedSegment]:
        """Route stored-schema rows to shards and write them as segment files (not yet visible)."""
        if table.num_rows == 0:
            return []
        if not table.schema.equals(STORED_SCHEMA):
            raise InvalidEventError(
                "stage() takes validated rows in the stored schema (from events_from_table or "
                f"events_from_records); got columns {table.schema.names}"
            )
        shard_ids = shards_of(table.column("key"), self.shards)
        order = np.argsort(shard_ids, kind="stable")  # stable: keeps per-key order
        # take() on one contiguous chunk is ~2.5x faster than on many small ones
        routed = table.combine_chunks().take(pa.array(order))
        bounds = np.searchsorted(shard_ids[order], np.arange(self.shards + 1), side="left")
        pieces: list[tuple[int, pa.Table]] = []
        for shard in range(self.shards):
            start, stop = int(bounds[shard]), int(bounds[shard + 1])
            for offset in range(start, stop, segment_max_events):
                pieces.append((shard, routed.slice(offset, min(segment_max_events, stop - offset))))
        with ThreadPoolExecutor(max_workers=min(IO_THREADS, len(pieces))) as pool:
            return list(pool.map(lambda piece: self.write_segment(*piece), pieces))

    def write_segment(self, shard: int, table: pa.Table) -> StagedSegment:
        """Write stored-schema rows of one shard as a staged (not yet visible) segment."""
        data = encode_segment(table)
        relative = f"{SHARDS_DIR}/{shard:05d}/{uuid.uuid4().hex}{SEGMENT_SUFFIX}"
        self.storage.put_if_absent(relative, data)
        low, high = timestamp_range_ms(table)
        return StagedSegment(
            path=relative,
            shard=shard,
            events=table.num_rows,
            bytes=len(data),
            sha256=sha256_hex(data),
            min_timestamp_ms=low,
            max_timestamp_ms=high,
        )

    def discard_staged(self, staged: Iterable[StagedSegment | SegmentInfo]) -> None:
        """Delete staged files that will never be committed."""
        for segment in staged:
            self.storage.delete(segment.path)

    def commit_staged(
        self, staged: list[StagedSegment], *, writer: WriterInfo | None = None
    ) -> CommitRecord | None:
        """Make staged segments visible in one put-if-absent commit, retrying lost races.

        With a ``writer``, the commit is exactly-once per (sink id, query id, epoch): if
        the log already holds it (this or an earlier attempt won), returns None and
        commits nothing.
        """

        def build(state: LogState) -> CommitRecord | None:
            if writer is not None and self.holds_epoch(writer):
                return None
            heads = list(state.heads)
            added = []
            for segment in staged:
                added.append(segment.at(heads[segment.shard] + 1))
                heads[segment.shard] += segment.events
            return CommitRecord(
                version=state.version + 1,
                timestamp_ms=now_ms(),
                operation=APPEND,
                add=tuple(added),
                writer=writer,
            )

        return self.commit_with_retries(build)

    def commit_with_retries(
        self, build: Callable[[LogState], CommitRecord | None]
    ) -> CommitRecord | None:
        """Commit ``build(state)`` (a record for ``state.version + 1``), retrying lost races.

        ``build`` sees the refreshed state on every attempt and may return None to commit
        nothing. Also for maintenance commits (compaction, truncation).
        """
        for attempt in range(MAX_COMMIT_ATTEMPTS):
            record = build(self.refresh())
            if record is None or self._try_commit(record):
                return record
            time.sleep(random.uniform(0, min(0.2, 0.005 * 2 ** min(attempt, 6))))
        raise CommitConflictError(
            f"{self.url}: gave up after {MAX_COMMIT_ATTEMPTS} lost commit races"
        )

    def _try_commit(self, record: CommitRecord) -> bool:
        relative = commit_path(record.version)
        try:
            self.storage.put_if_absent(relative, record.to_bytes())
        except FileExistsError:
            logger.debug("lost the race for %s; retrying", relative)
            return False
        state = self.state()
        state.apply(record, relative)
        if record.version % self.descriptor.snapshot_interval == 0:
            try:
                self._write_snapshot(state)
            except (OSError, ReplogError) as exc:
                logger.warning("could not write snapshot at version %d: %s", record.version, exc)
        return True

    def holds_epoch(self, writer: WriterInfo) -> bool:
        """Whether the (refreshed) log already holds the commit of ``writer``'s epoch."""
        mark = self.state().sinks.get(writer.sink_id)
        return mark is not None and mark.query_id == writer.query_id and mark.epoch >= writer.epoch

    def orphaned_segments(self, grace_ms: int = DEFAULT_GRACE_MS) -> list[str]:
        """Segment files no live segment entry references, safe to delete (relative paths).

        Lists the shard directories (repair only). Two kinds of file are protected for
        ``grace_ms``: files written within it (a live writer may have staged them and not
        committed yet) and files that a commit within it removed (compaction, retention:
        a query may have planned a task on them just before).
        """
        state = self.refresh()
        live = {segment.path for lane in state.segments for segment in lane}
        cutoff = now_ms() - grace_ms
        protected = live | self._removed_since(state, cutoff)
        orphans = []
        for shard_dir in self.storage.list(SHARDS_DIR):
            for name in self.storage.list(f"{SHARDS_DIR}/{shard_dir}"):
                relative = f"{SHARDS_DIR}/{shard_dir}/{name}"
                if relative in protected or not name.endswith(SEGMENT_SUFFIX):
                    continue
                modified = self.storage.modified_ms(relative)
                if modified is None or modified <= cutoff:
                    orphans.append(relative)
        return orphans

    def _removed_since(self, state: LogState, cutoff_ms: int) -> set[str]:
        """Paths removed by commits made after ``cutoff_ms`` (reads commits backwards)."""
        removed: set[str] = set()
        for version in range(state.version, 0, -1):
            relative = commit_path(version)
            data = self.storage.read_optional(relative)
            if data is None:  # before the oldest commit kept
                break
            record = CommitRecord.from_bytes(data, self.storage.path(relative))
            if record.timestamp_ms <= cutoff_ms:
                break
            removed.update(segment.path for segment in record.remove)
        return removed

    # -- reading ----------------------------------------------------------------------

    def read(self, shard: int, first: int = 1, last: int | None = None) -> Iterator[pa.RecordBatch]:
        """Events of ``shard`` with sequences in ``[first, last]`` (default: to the head).

        Raises :class:`DataLossError` if ``first`` was removed by retention.
        """
        if not 0 <= shard < self.shards:
            raise InvalidOptionError(f"shard {shard} does not exist (log has {self.shards} shards)")
        state = self.refresh()
        last = state.heads[shard] if last is None else min(last, state.heads[shard])
        first = max(first, 1)
        if first < state.lows[shard] and first <= last:
            raise DataLossError(shard, first, state.lows[shard])
        for segment in state.covering(shard, first, last):
            yield from read_segment(self.storage, segment, first, last)

    def read_table(self, shard: int, first: int = 1, last: int | None = None) -> pa.Table:
        return pa.Table.from_batches(list(self.read(shard, first, last)), schema=EVENT_SCHEMA)

    def info(self) -> dict[str, Any]:
        """A summary of the log, as ``replog info --json`` prints it."""
        state = self.refresh()
        return {
            "url": self.url,
            "format_version": self.descriptor.format_version,
            "log_id": self.descriptor.log_id,
            "shards": self.shards,
            "version": state.version,
            "heads": state.heads_json(),
            "lows": state.lows_json(),
            "events": sum(h - low + 1 for h, low in zip(state.heads, state.lows, strict=True)),
            "segments": state.segment_count,
            "bytes": state.total_bytes,
            "sinks": {
                name: {"query_id": m.query_id, "epoch": m.epoch, "version": m.version}
                for name, m in sorted(state.sinks.items())
            },
            "last_commit_ms": state.timestamp_ms,
        }

    def verify(self) -> list[Problem]:
        """Check every commit record and every live segment against its checksum.

        Returns every problem found (empty when the log is sound).
        """
        problems: list[Problem] = []
        state = LogState(shards=self.shards)
        version = 1
        while True:
            relative = commit_path(version)
            try:
                data = self.storage.read_optional(relative)
                if data is None:
                    break
                state.apply(CommitRecord.from_bytes(data, self.storage.path(relative)), relative)
            except ReplogError as exc:
                problems.append(Problem(self.storage.path(relative), str(exc)))
                break
            version += 1
        for lane in state.segments:
            for segment in lane:
                path = self.storage.path(segment.path)
                try:
                    read_stored(self.storage, segment)
                except CorruptionError as exc:
                    problems.append(Problem(path, str(exc).removeprefix(f"{path}: ")))
        return problems


def read_stored(storage: Storage, segment: SegmentInfo) -> pa.Table:
    """A committed segment's rows (stored schema), checked against its commit entry.

    Raises :class:`CorruptionError` naming the file if it is missing, torn or altered.
    """
    path = storage.path(segment.path)
    try:
        data = storage.read(segment.path)
    except FileNotFoundError as exc:
        raise CorruptionError(
            path,
            "segment file is missing (deleted outside replog, or collected by "
            "'replog recover' with a --grace shorter than a running read?)",
        ) from exc
    return decode_segment(
        data, path=path, expected_sha256=segment.sha256, expected_rows=segment.events
    )


def read_segment(
    storage: Storage, segment: SegmentInfo, first: int, last: int
) -> Iterator[pa.RecordBatch]:
    """Events ``[first, last]`` of one committed segment, checksum-verified.

    A module-level function so Spark executors can read with only the segment entry.
    """
    table = read_stored(storage, segment)
    start = max(first, segment.first_sequence)
    stop = min(last, segment.last_sequence)
    sequence = start
    for batch in slice_batches(table, start - segment.first_sequence, stop - start + 1):
        yield to_event_batch(batch, segment.shard, sequence)
        sequence += batch.num_rows
