"""Segment files on storage: reading them (checksum-verified, a shared file once per
reader, fetched in parallel on remote storage) and writing them (staging: routed rows
become files that no commit names yet). The layout is :mod:`replog.format.segments`.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa

from replog.errors import InvalidEventError, MissingFileError
from replog.format.events import STORED_SCHEMA
from replog.format.segments import (
    IO_THREADS,
    MAX_ROUTED_BYTES,
    MAX_SEGMENT_BYTES,
    MAX_SEGMENT_EVENTS,
    SHARED_STAGE_BYTES,
    Part,
    SegmentInfo,
    StagedSegment,
    cuts,
    decode_segment,
    encode_batches,
    encode_segment,
    entry_rows,
    event_batches,
    given,
    new_file_path,
    route,
    row_sizes,
    sha256_hex,
    shares,
    timestamp_range_ms,
)
from replog.storage import Storage
from replog.storage.backends import Durability
from replog.storage.threads import run_all


def fetch(storage: Storage, segment: SegmentInfo) -> bytes:
    """The bytes of the file ``segment`` names; :class:`MissingFileError` if it is gone."""
    try:
        return storage.read(segment.path)
    except FileNotFoundError as exc:
        raise MissingFileError(
            storage.where(segment.path),
            "segment file named by a commit is not on storage (deleted outside replog, "
            "collected by 'replog recover' with a --grace shorter than a running read, or "
            "the log's URL resolves to another place here)",
        ) from exc


def decode_file(storage: Storage, segment: SegmentInfo, data: bytes) -> pa.Table:
    """``data`` (the file ``segment`` names) checked against the entry and decoded whole."""
    return decode_segment(
        data,
        path=storage.path(segment.path),
        expected_sha256=segment.sha256,
        min_rows=segment.offset + segment.events,
    )


class DecodedFiles:
    """Decoded files kept for the entries that follow: a shared file (every shard's rows
    of a small write) is fetched and checked once per reader, not once per shard.

    Least recently used files are dropped past ``max_bytes`` of decoded data; files
    larger than a quarter of it are never kept (they hold one shard's rows). Not
    thread-safe: one per reader.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._tables: OrderedDict[tuple[str, str], pa.Table] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # a writer and its background merger share one

    def __getstate__(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_bytes"])  # type: ignore[misc]

    def get(self, segment: SegmentInfo | StagedSegment) -> pa.Table | None:
        key = (segment.path, segment.sha256)
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
            return table

    def put(self, segment: SegmentInfo | StagedSegment, table: pa.Table) -> None:
        size = table.nbytes
        if size > self.max_bytes // 4:
            return
        with self._lock:
            self._tables[(segment.path, segment.sha256)] = table
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, dropped = self._tables.popitem(last=False)
                self._bytes -= dropped.nbytes


def read_file(
    storage: Storage, segment: SegmentInfo, cache: DecodedFiles | None = None
) -> pa.Table:
    """The whole decoded file ``segment`` names, from ``cache`` if it holds it."""
    table = cache.get(segment) if cache is not None else None
    if table is None:
        table = decode_file(storage, segment, fetch(storage, segment))
        if cache is not None:
            cache.put(segment, table)
    return table


def read_stored(
    storage: Storage, segment: SegmentInfo, cache: DecodedFiles | None = None
) -> pa.Table:
    """A committed segment's rows (stored schema), checked against its commit entry.

    Raises :class:`MissingFileError` naming the path tried if the file is not there, and
    :class:`CorruptionError` if it is torn or altered.
    """
    return entry_rows(read_file(storage, segment, cache), segment)


def read_segment(
    storage: Storage,
    segment: SegmentInfo,
    first: int,
    last: int,
    cache: DecodedFiles | None = None,
) -> Iterator[pa.RecordBatch]:
    """Events ``[first, last]`` of one committed segment, checksum-verified.

    A module-level function so Spark executors can read with only the segment entry.
    """
    yield from event_batches(read_stored(storage, segment, cache), segment, first, last)


PREFETCH_BYTES = 64 * 1024 * 1024
"""How much stored data a reader fetches ahead, in parallel, on remote storage."""


def _windows(
    wanted: Sequence[tuple[SegmentInfo, int, int]], files: int, max_bytes: int
) -> Iterator[Sequence[tuple[SegmentInfo, int, int]]]:
    """``wanted`` cut into runs that name at most ``files`` distinct files and about
    ``max_bytes`` of them (a file named by several entries counts once)."""
    start = 0
    while start < len(wanted):
        seen: set[str] = set()
        stop, size = start, 0
        while stop < len(wanted):
            segment = wanted[stop][0]
            if segment.path not in seen:
                if seen and (len(seen) >= files or size >= max_bytes):
                    break
                seen.add(segment.path)
                size += segment.bytes
            stop += 1
        yield wanted[start:stop]
        start = stop


def read_segments(
    storage: Storage,
    wanted: Sequence[tuple[SegmentInfo, int, int]],
    cache: DecodedFiles | None = None,
    *,
    window: int = IO_THREADS,
) -> Iterator[pa.RecordBatch]:
    """Events of several ``(segment, first, last)`` ranges, in order. On remote storage
    the files of up to ``window`` entries (and about :data:`PREFETCH_BYTES`) ahead are
    fetched in parallel; a file is fetched once for all its entries in the run, and not
    at all if ``cache`` holds it."""
    cache = cache if cache is not None else DecodedFiles()
    for run in _windows(wanted, window if storage.is_remote else 1, PREFETCH_BYTES):
        fetched: dict[str, pa.Table] = {}
        todo = list({s.path: s for s, _, _ in run if cache.get(s) is None}.values())
        if len(todo) > 1:
            for segment, data in zip(
                todo, storage.map(lambda s: fetch(storage, s), todo, threads=window), strict=True
            ):
                fetched[segment.path] = decode_file(storage, segment, data)
                cache.put(segment, fetched[segment.path])
        for segment, first, last in run:
            table = fetched.get(segment.path)
            if table is None:
                table = read_file(storage, segment, cache)
            yield from event_batches(entry_rows(table, segment), segment, first, last)


Rows: TypeAlias = pa.Table | Iterator[pa.RecordBatch]
"""A file's rows: a table, or record batches made one at a time (a merge: only the batch at
hand is held; its parts then carry their event times)."""


def write_file(
    storage: Storage, plan: tuple[Rows, Sequence[Part]], relative: str
) -> list[StagedSegment]:
    """Write one file (not yet visible) and describe each of its parts.

    The directory entry is made durable by the caller (:meth:`Storage.sync`), once for
    all files of a commit.
    """
    rows, parts = plan
    if isinstance(rows, pa.Table):
        data = encode_segment(rows)
    else:
        if any(part.timestamps_ms is None for part in parts):
            raise ValueError("rows given as batches need parts that carry their event times")
        data = encode_batches(rows)
    storage.put_if_absent(relative, data, durability=Durability.DEFERRED)
    digest = sha256_hex(data)
    staged = []
    for part, share in zip(parts, shares(len(data), [p.rows for p in parts]), strict=True):
        if part.timestamps_ms is not None:
            low, high = part.timestamps_ms
        else:
            assert isinstance(rows, pa.Table)
            low, high = timestamp_range_ms(rows.slice(part.offset, part.rows))
        staged.append(
            StagedSegment(
                path=relative,
                shard=part.shard,
                events=part.rows,
                bytes=share,
                sha256=digest,
                min_timestamp_ms=low,
                max_timestamp_ms=high,
                offset=part.offset,
            )
        )
    return staged


def write_files(
    storage: Storage,
    plans: Sequence[tuple[Sequence[Part], Callable[[], Rows]]],
    written: DecodedFiles | None = None,
) -> list[StagedSegment]:
    """Write files in parallel, their parts in order (each file's rows are built by its
    callable in the worker, so they can be read or merged there). If any file fails,
    every file of the call is deleted (none is committed yet) and the error raised.
    ``written`` keeps the rows of the files written as tables (a writer merges them
    soon)."""
    paths = [new_file_path(parts) for parts, _ in plans]

    def write(
        parts: Sequence[Part], rows: Callable[[], Rows], path: str
    ) -> tuple[list[StagedSegment], pa.Table | None]:
        made = rows()
        table = made if isinstance(made, pa.Table) else None
        return write_file(storage, (made, parts), path), table

    if len(plans) == 1:  # a small write: a thread pool would cost more than the file
        (parts, rows), path = plans[0], paths[0]
        try:
            results = [write(parts, rows, path)]
        except BaseException:
            storage.delete(path)
            raise
    else:
        futures = run_all(
            [
                functools.partial(write, parts, rows, path)
                for (parts, rows), path in zip(plans, paths, strict=True)
            ],
            threads=IO_THREADS,
        )
        failures = [future.exception() for future in futures if future.exception() is not None]
        if failures:
            for path in paths:
                storage.delete(path)
            raise failures[0]  # type: ignore[misc]
        results = [future.result() for future in futures]
    storage.sync(paths)
    if written is not None:
        for staged, table in results:
            if table is not None:
                written.put(staged[0], table)
    return [segment for staged, _ in results for segment in staged]


def stage(
    storage: Storage,
    shards: int,
    table: pa.Table,
    *,
    max_events: int = MAX_SEGMENT_EVENTS,
    max_bytes: int = MAX_SEGMENT_BYTES,
    shared_bytes: int = SHARED_STAGE_BYTES,
    written: DecodedFiles | None = None,
) -> list[StagedSegment]:
    """Route validated rows to shards and write them as staged segments, in order.

    Rows that take at most ``shared_bytes`` go into one file (one part per shard);
    bigger writes get files of one shard each, of at most ``max_events`` rows and about
    ``max_bytes``. Per-key order is kept: rows of one key go to one shard in input
    order, and the returned list (the order a commit adds them in) keeps each shard's
    segments in order.
    """
    if table.num_rows == 0:
        return []
    if not table.schema.equals(STORED_SCHEMA):
        raise InvalidEventError(
            "staging takes validated rows in the stored schema (from events_from_table or "
            f"events_from_records); got columns {table.schema.names}"
        )
    if table.nbytes <= shared_bytes and table.num_rows <= max_events:
        routed, bounds, _ = route(table, shards)
        parts = [
            Part(shard, int(bounds[shard]), int(bounds[shard + 1] - bounds[shard]))
            for shard in range(shards)
            if bounds[shard + 1] > bounds[shard]
        ]
        return write_files(storage, [(parts, functools.partial(given, routed))], written)
    # Sizes per row matter only when the rows may not fit in one piece (7 ms per 125k).
    small = table.nbytes <= min(max_bytes, MAX_ROUTED_BYTES)
    sizes = np.zeros(table.num_rows, dtype=np.int64) if small else row_sizes(table)
    plans: list[tuple[Sequence[Part], Callable[[], pa.Table]]] = []
    for part_start, part_stop in cuts(sizes, len(sizes), MAX_ROUTED_BYTES):
        routed, bounds, order = route(table.slice(part_start, part_stop - part_start), shards)
        routed_sizes = sizes[part_start:part_stop][order]
        for shard in range(shards):
            low, high = int(bounds[shard]), int(bounds[shard + 1])
            for start, stop in cuts(routed_sizes[low:high], max_events, max_bytes):
                rows = routed.slice(low + start, stop - start)
                plans.append(([Part(shard, 0, stop - start)], functools.partial(given, rows)))
    return write_files(storage, plans, written)
