"""Segment files on storage: reading them (checksum-verified, a shared file once per
reader, fetched in parallel on remote storage) and writing them (staging: routed rows
become files that no commit names yet). The layout is :mod:`replog.format.segments`.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
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
    encode_segment_buffer,
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
from replog.storage.threads import run_all, submit


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


def _time_ranges(rows: pa.Table | None, parts: Sequence[Part]) -> list[tuple[int, int]]:
    """Each part's event-time range (ms): carried by the part, else read from ``rows``."""
    ranges = []
    for part in parts:
        if part.timestamps_ms is not None:
            ranges.append(part.timestamps_ms)
        elif rows is None:
            raise ValueError("rows given as batches need parts that carry their event times")
        else:
            ranges.append(timestamp_range_ms(rows.slice(part.offset, part.rows)))
    return ranges


def _describe(
    parts: Sequence[Part],
    ranges: Sequence[tuple[int, int]],
    relative: str,
    stored: tuple[int, str],
) -> list[StagedSegment]:
    """The staged segments of a written file (its size and digest ``stored``): one per
    part, sizes shared by rows."""
    size, digest = stored
    return [
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
        for part, share, (low, high) in zip(
            parts, shares(size, [p.rows for p in parts]), ranges, strict=True
        )
    ]


def _payload(storage: Storage, data: pa.Buffer) -> bytes | memoryview:
    """What to hand storage: local files take the encoded buffer as it is (no copy);
    other backends get bytes. The view is of unsigned bytes, as ``bytes`` are (Arrow
    exports signed ones: a view of them compares unequal to the same bytes read back)."""
    return memoryview(data).cast("B") if storage.is_local else data.to_pybytes()


def _store(storage: Storage, relative: str, data: bytes | memoryview) -> tuple[int, str]:
    """Create a file (not yet visible); its size and SHA-256."""
    storage.put_if_absent(relative, data, durability=Durability.DEFERRED)  # type: ignore[arg-type]
    return len(data), sha256_hex(data)


def write_file(
    storage: Storage, plan: tuple[Rows, Sequence[Part]], relative: str
) -> list[StagedSegment]:
    """Write one file (not yet visible) and describe each of its parts.

    The directory entry is made durable by the caller (:meth:`Storage.sync`), once for
    all files of a commit.
    """
    rows, parts = plan
    table = rows if isinstance(rows, pa.Table) else None
    ranges = _time_ranges(table, parts)
    data = _payload(
        storage, encode_segment_buffer(table) if table is not None else encode_batches(rows)
    )
    return _describe(parts, ranges, relative, _store(storage, relative, data))


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
    try:
        storage.sync(paths)
    except BaseException:
        storage.delete_many(paths)
        raise
    if written is not None:
        for staged, table in results:
            if table is not None:
                written.put(staged[0], table)
    return [segment for staged, _ in results for segment in staged]


class RoutedRows:
    """Validated rows grouped by shard as they arrive, until they are staged.

    Each record batch added is hashed and reordered by shard once (one ``take``) and kept
    as one slice per shard, so a writer fed batch by batch (the Spark sink) can let go of
    its input as it goes: it holds one copy of its rows, not two. Per-key order is kept:
    a shard's slices are in the order their batches came, each in input order.
    """

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.pieces: list[list[pa.RecordBatch]] = [[] for _ in range(shards)]
        self.rows = 0
        self.nbytes = 0

    def add(self, rows: pa.Table | pa.RecordBatch) -> None:
        """Route ``rows`` (validated, in the stored schema) to their shards."""
        if not rows.schema.equals(STORED_SCHEMA):
            raise InvalidEventError(
                "staging takes validated rows in the stored schema (from events_from_table "
                f"or events_from_records); got columns {rows.schema.names}"
            )
        batches = [rows] if isinstance(rows, pa.RecordBatch) else rows.to_batches()
        for batch in batches:
            if batch.nbytes <= MAX_ROUTED_BYTES:
                self._add(batch)
                continue
            # Reorder huge batches in slices (the reordered copy is made at once).
            sizes = row_sizes(pa.Table.from_batches([batch]))
            for start, stop in cuts(sizes, len(sizes), MAX_ROUTED_BYTES):
                self._add(batch.slice(start, stop - start))

    def _add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        routed, bounds, _ = route(batch, self.shards)
        for shard in range(self.shards):
            low, high = int(bounds[shard]), int(bounds[shard + 1])
            if high > low:
                self.pieces[shard].append(routed.slice(low, high - low))
        self.rows += batch.num_rows
        self.nbytes += routed.nbytes

    def shard_rows(self, shard: int) -> pa.Table:
        """The rows routed to ``shard``, in order (chunked as they came)."""
        return pa.Table.from_batches(self.pieces[shard], schema=STORED_SCHEMA)


def _contiguous(table: pa.Table) -> pa.Table:
    """``table`` as one chunk per column (a file's record batches are then full-sized)."""
    if all(column.num_chunks <= 1 for column in table.columns):
        return table
    return table.combine_chunks()


def _rows_of(table: pa.Table, start: int, stop: int) -> pa.Table:
    return _contiguous(table.slice(start, stop - start))


def stage_routed(
    storage: Storage,
    routed: RoutedRows,
    *,
    max_events: int = MAX_SEGMENT_EVENTS,
    max_bytes: int = MAX_SEGMENT_BYTES,
    shared_bytes: int = SHARED_STAGE_BYTES,
    written: DecodedFiles | None = None,
) -> list[StagedSegment]:
    """Write routed rows as staged segments, in order (the layout of :func:`stage`)."""
    if routed.rows == 0:
        return []
    if routed.nbytes <= shared_bytes and routed.rows <= max_events:
        parts, offset = [], 0
        for shard in range(routed.shards):
            count = sum(piece.num_rows for piece in routed.pieces[shard])
            if count:
                parts.append(Part(shard, offset, count))
                offset += count
        batches = [piece for pieces in routed.pieces for piece in pieces]
        rows = _contiguous(pa.Table.from_batches(batches, schema=STORED_SCHEMA))
        return write_files(storage, [(parts, functools.partial(given, rows))], written)
    plans: list[tuple[Sequence[Part], Callable[[], pa.Table]]] = []
    for shard in range(routed.shards):
        if not routed.pieces[shard]:
            continue
        table = routed.shard_rows(shard)
        # Sizes per row matter only when the rows may not fit in one file.
        big = table.nbytes > max_bytes
        sizes = row_sizes(table) if big else np.zeros(table.num_rows, dtype=np.int64)
        for start, stop in cuts(sizes, max_events, max_bytes):
            plans.append(
                ([Part(shard, 0, stop - start)], functools.partial(_rows_of, table, start, stop))
            )
    return write_in_turn(storage, plans, written)


def write_in_turn(
    storage: Storage,
    plans: Sequence[tuple[Sequence[Part], Callable[[], pa.Table]]],
    written: DecodedFiles | None = None,
    *,
    threads: int = IO_THREADS,
) -> list[StagedSegment]:
    """Write files whose rows are in memory: built and encoded one after another in this
    thread (each file's rows and encoding reuse the memory the previous one let go of),
    checksummed and stored by a pool of threads (disk and network waits overlap). If any
    file fails, every file of the call is deleted (none is committed yet) and the error
    raised."""
    paths = [new_file_path(parts) for parts, _ in plans]

    def store(path: str, data: pa.Buffer) -> tuple[int, str]:
        return _store(storage, path, _payload(storage, data))

    # Per file: its parts' event-time ranges, the rows kept for ``written``, the store.
    pending: list[tuple[list[tuple[int, int]], pa.Table | None, Future[tuple[int, str]]]] = []
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(plans)))) as pool:
        try:
            for (parts, rows), path in zip(plans, paths, strict=True):
                table = rows()
                ranges = _time_ranges(table, parts)
                future = submit(pool, functools.partial(store, path, encode_segment_buffer(table)))
                pending.append((ranges, table if written is not None else None, future))
                del table  # its memory serves the next file's rows
        except BaseException:
            for _, _, future in pending:
                future.cancel()
            wait([future for _, _, future in pending])
            storage.delete_many(paths)
            raise
        failures = [f.exception() for _, _, f in pending if f.exception() is not None]
        if failures:
            storage.delete_many(paths)
            raise failures[0]  # type: ignore[misc]
        # The directory entries, one directory per thread (a shard's files share one).
        by_directory: dict[str, list[str]] = {}
        for path in paths:
            by_directory.setdefault(path.rsplit("/", 1)[0], []).append(path)
        syncs = [
            submit(pool, functools.partial(storage.sync, group)) for group in by_directory.values()
        ]
        wait(syncs)
        failed = [f.exception() for f in syncs if f.exception() is not None]
        if failed:
            storage.delete_many(paths)
            raise failed[0]  # type: ignore[misc]
    staged = []
    for (parts, _), path, (ranges, kept, future) in zip(plans, paths, pending, strict=True):
        described = _describe(parts, ranges, path, future.result())
        if written is not None and kept is not None:
            written.put(described[0], kept)
        staged.extend(described)
    return staged


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
    routed = RoutedRows(shards)
    routed.add(table)
    return stage_routed(
        storage,
        routed,
        max_events=max_events,
        max_bytes=max_bytes,
        shared_bytes=shared_bytes,
        written=written,
    )
