"""Segment files: immutable Arrow IPC files (LZ4-compressed) of change events.

A file holds :data:`~replog.format.events.STORED_SCHEMA` rows. Each *segment entry* of a
commit names a file and a run of its rows: ``offset`` (the first row) and the shard and
sequence range those rows take, so a writer can *stage* a file (write it under a unique
name) before it knows its sequences. A file of a big write holds one shard's rows; a file
of a small write holds every shard's rows, grouped by shard (a *shared* file, one entry
per shard): a commit of ten events writes one file, not one per shard. Every read checks
the SHA-256 of the whole file, recorded at commit.

``pyarrow.compute`` is imported where it is used, not with this module: Spark starts a
Python process per streaming query that imports replog to plan it, and planning needs no
compute kernel (the import costs ~30 ms of every query).
"""

from __future__ import annotations

import functools
import hashlib
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
from pyarrow import ipc

from replog.errors import CorruptionError, InvalidEventError, MissingFileError
from replog.format.events import (
    STORED_SCHEMA,
    STORED_SCHEMA_V1,
    to_event_batch,
    upgrade_stored,
)
from replog.format.routing import shards_of
from replog.storage import Storage

SHARDS_DIR = "shards"
SEGMENT_SUFFIX = ".arrow"
BATCH_ROWS = 65_536
"""Rows per IPC record batch inside a segment: the unit a reader decodes at a time."""
WRITE_COMPRESSION = "lz4"

MAX_SEGMENT_EVENTS = 262_144
MAX_SEGMENT_BYTES = 64 * 1024 * 1024
"""A staged segment holds at most this many events and about this many bytes of rows
(uncompressed): segments are decoded whole, and Arrow's binary columns hold 2 GiB."""
MAX_ROUTED_BYTES = 256 * 1024 * 1024
"""Rows are routed (sorted by shard) in slices of about this many bytes."""
IO_THREADS = 8


class SegmentInfo(NamedTuple):
    """What a commit records about one segment (FORMAT.md, "segment entries"): rows
    ``offset .. offset + events - 1`` of the file at ``path`` are sequences
    ``first_sequence .. last_sequence`` of ``shard``. ``bytes`` is this entry's share of
    the file's size (the shares of a file's entries add up to its size); ``sha256`` is the
    whole file's digest.

    A named tuple, not a dataclass: every reader of the log builds thousands of them from
    commits and tables, and a tuple is built several times faster.
    """

    path: str
    shard: int
    first_sequence: int
    last_sequence: int
    bytes: int
    sha256: str
    min_timestamp_ms: int
    max_timestamp_ms: int
    offset: int = 0

    @property
    def events(self) -> int:
        return self.last_sequence - self.first_sequence + 1

    @property
    def key(self) -> tuple[str, int]:
        """What identifies an entry: its file and first row (entries never share rows)."""
        return (self.path, self.offset)

    def to_json(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SegmentInfo:
        values = {name: data[name] for name in cls._fields if name != "offset"}
        values["offset"] = data.get("offset", 0)  # format 2 entries have none
        for name, value in values.items():
            expected = str if name in ("path", "sha256") else int
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"segment entry field {name!r} is {value!r}")
        if values["offset"] < 0 or values["bytes"] < 0:
            raise ValueError(f"segment entry has a negative offset or size: {data!r}")
        return cls(**values)


@dataclass(frozen=True)
class StagedSegment:
    """Rows of one shard in a written file, whose sequences are not yet assigned."""

    path: str
    shard: int
    events: int
    bytes: int
    sha256: str
    min_timestamp_ms: int
    max_timestamp_ms: int
    offset: int = 0

    def at(self, first_sequence: int) -> SegmentInfo:
        """The committed form, placed at ``first_sequence``."""
        return SegmentInfo(
            path=self.path,
            shard=self.shard,
            first_sequence=first_sequence,
            last_sequence=first_sequence + self.events - 1,
            bytes=self.bytes,
            sha256=self.sha256,
            min_timestamp_ms=self.min_timestamp_ms,
            max_timestamp_ms=self.max_timestamp_ms,
            offset=self.offset,
        )


def file_paths(segments: Iterable[StagedSegment | SegmentInfo]) -> list[str]:
    """The distinct files ``segments`` name, in order (a shared file once)."""
    return list(dict.fromkeys(segment.path for segment in segments))


# -- encoding ----------------------------------------------------------------------------


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_segment(table: pa.Table) -> bytes:
    """Serialise stored-schema rows as an Arrow IPC file."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(
        sink, STORED_SCHEMA, options=ipc.IpcWriteOptions(compression=WRITE_COMPRESSION)
    ) as writer:
        writer.write_table(table, max_chunksize=BATCH_ROWS)
    return bytes(sink.getvalue())


def timestamp_range_ms(table: pa.Table) -> tuple[int, int]:
    """Min and max event time of the rows, in ms since the epoch (0, 0 for no rows)."""
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    if table.num_rows == 0:
        return 0, 0
    bounds = pc.min_max(table.column("timestamp").cast(pa.int64())).as_py()
    return int(bounds["min"]) // 1000, int(bounds["max"]) // 1000


def decode_segment(data: bytes, *, path: str, expected_sha256: str, min_rows: int) -> pa.Table:
    """Check a file's bytes against a commit entry's digest and decode it (once).

    Raises :class:`CorruptionError` naming ``path`` on a checksum mismatch, fewer rows
    than the entry needs (``offset + events``), or bytes Arrow cannot decode.
    """
    actual = sha256_hex(data)
    if actual != expected_sha256:
        raise CorruptionError(
            path,
            f"checksum mismatch: expected sha256 {expected_sha256}, found {actual} "
            f"({len(data)} bytes)",
        )
    try:
        table = ipc.open_file(pa.BufferReader(data)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorruptionError(path, f"not a readable Arrow IPC file: {exc}") from exc
    if table.num_rows < min_rows:
        raise CorruptionError(path, f"holds {table.num_rows} events, its commit needs {min_rows}")
    if not (table.schema.equals(STORED_SCHEMA) or table.schema.equals(STORED_SCHEMA_V1)):
        raise CorruptionError(path, f"unexpected schema {table.schema}")
    return upgrade_stored(table)


# -- reading -------------------------------------------------------------------------------


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


def entry_rows(table: pa.Table, segment: SegmentInfo) -> pa.Table:
    """The rows of ``segment`` in its decoded file (zero-copy)."""
    return table.slice(segment.offset, segment.events)


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


def event_batches(
    rows: pa.Table, segment: SegmentInfo, first: int, last: int
) -> Iterator[pa.RecordBatch]:
    """Events ``[first, last]`` of ``segment``, given its rows, with shard and sequence."""
    start = max(first, segment.first_sequence)
    stop = min(last, segment.last_sequence)
    if stop < start:
        return
    sequence = start
    for batch in rows.slice(start - segment.first_sequence, stop - start + 1).to_batches():
        yield to_event_batch(batch, segment.shard, sequence)
        sequence += batch.num_rows


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


# -- staging -------------------------------------------------------------------------------


def row_sizes(table: pa.Table) -> np.ndarray:
    """Approximate bytes of each row (its variable-length values plus fixed columns)."""
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    sizes = np.full(table.num_rows, 24, dtype=np.int64)
    for name in ("event_id", "collection", "key", "data", "before", "metadata"):
        lengths = pc.binary_length(table.column(name)).to_numpy(zero_copy_only=False)
        sizes += np.nan_to_num(lengths.astype(np.float64)).astype(np.int64)
    return sizes


def _cuts(sizes: np.ndarray, max_events: int, max_bytes: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, stop)`` ranges of at most ``max_events`` rows and about
    ``max_bytes`` (a single larger row gets a range of its own)."""
    ranges = []
    start, total = 0, len(sizes)
    cumulative = np.cumsum(sizes)
    while start < total:
        base = cumulative[start - 1] if start else 0
        stop = int(np.searchsorted(cumulative, base + max_bytes, side="right"))
        stop = min(max(stop, start + 1), start + max_events, total)
        ranges.append((start, stop))
        start = stop
    return ranges


SHARED_DIR = "shared"
"""Files holding several shards' rows live in ``shards/shared/``."""
SHARED_STAGE_BYTES = 4 * 1024 * 1024
"""A write whose rows take at most this much memory is staged as one shared file."""


@dataclass(frozen=True)
class Part:
    """Rows ``offset .. offset + rows - 1`` of a file to be written belong to ``shard``;
    the range of their event times, if the writer knows it (else it is computed)."""

    shard: int
    offset: int
    rows: int
    timestamps_ms: tuple[int, int] | None = None


FilePlan = tuple[pa.Table, Sequence[Part]]
"""The rows of one file to write and how they divide into shards."""


def new_file_path(parts: Sequence[Part]) -> str:
    """A unique path for a file holding ``parts``: under its shard's directory if it holds
    one shard's rows, under ``shards/shared/`` otherwise."""
    shards = {part.shard for part in parts}
    directory = f"{shards.pop():05d}" if len(shards) == 1 else SHARED_DIR
    return f"{SHARDS_DIR}/{directory}/{uuid.uuid4().hex}{SEGMENT_SUFFIX}"


def shares(total: int, rows: Sequence[int]) -> list[int]:
    """``total`` bytes divided among parts in proportion to their rows; the remainder
    goes to the first, so the shares add up to ``total`` exactly."""
    count = sum(rows)
    portions = [total * n // count for n in rows]
    portions[0] += total - sum(portions)
    return portions


def write_file(storage: Storage, plan: FilePlan, relative: str) -> list[StagedSegment]:
    """Write one file (not yet visible) and describe each of its parts.

    The directory entry is made durable by the caller (:meth:`Storage.sync`), once for
    all files of a commit.
    """
    rows, parts = plan
    data = encode_segment(rows)
    storage.put_if_absent(relative, data, sync=False)
    digest = sha256_hex(data)
    staged = []
    for part, share in zip(parts, shares(len(data), [p.rows for p in parts]), strict=True):
        low, high = part.timestamps_ms or timestamp_range_ms(rows.slice(part.offset, part.rows))
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
    plans: Sequence[tuple[Sequence[Part], Callable[[], pa.Table]]],
    written: DecodedFiles | None = None,
) -> list[StagedSegment]:
    """Write files in parallel, their parts in order (each file's rows are built by its
    callable in the worker, so they can be read or merged there). If any file fails,
    every file of the call is deleted (none is committed yet) and the error raised.
    ``written`` keeps the rows of the files written (a writer merges them soon)."""
    paths = [new_file_path(parts) for parts, _ in plans]

    def write(
        parts: Sequence[Part], rows: Callable[[], pa.Table], path: str
    ) -> tuple[list[StagedSegment], pa.Table]:
        table = rows()
        return write_file(storage, (table, parts), path), table

    if len(plans) == 1:  # a small write: a thread pool would cost more than the file
        (parts, rows), path = plans[0], paths[0]
        try:
            results = [write(parts, rows, path)]
        except BaseException:
            storage.delete(path)
            raise
    else:
        with ThreadPoolExecutor(max_workers=max(1, min(IO_THREADS, len(plans)))) as pool:
            futures = [
                pool.submit(write, parts, rows, path)
                for (parts, rows), path in zip(plans, paths, strict=True)
            ]
        failures = [future.exception() for future in futures if future.exception() is not None]
        if failures:
            for path in paths:
                storage.delete(path)
            raise failures[0]  # type: ignore[misc]
        results = [future.result() for future in futures]
    storage.sync(paths)
    if written is not None:
        for staged, table in results:
            written.put(staged[0], table)
    return [segment for staged, _ in results for segment in staged]


def _given(table: pa.Table) -> pa.Table:
    return table


def _route(table: pa.Table, shards: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """``table``'s rows grouped by shard (stable: per-key order kept), where each shard's
    rows are (``bounds[s] .. bounds[s + 1]``), and the order that groups them."""
    shard_ids = shards_of(table.column("key"), shards)
    order = np.argsort(shard_ids, kind="stable")
    routed = table.take(pa.array(order))
    bounds = np.searchsorted(shard_ids[order], np.arange(shards + 1), side="left")
    return routed, bounds, order


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
        routed, bounds, _ = _route(table, shards)
        parts = [
            Part(shard, int(bounds[shard]), int(bounds[shard + 1] - bounds[shard]))
            for shard in range(shards)
            if bounds[shard + 1] > bounds[shard]
        ]
        return write_files(storage, [(parts, functools.partial(_given, routed))], written)
    # Sizes per row matter only when the rows may not fit in one piece (7 ms per 125k).
    small = table.nbytes <= min(max_bytes, MAX_ROUTED_BYTES)
    sizes = np.zeros(table.num_rows, dtype=np.int64) if small else row_sizes(table)
    plans: list[tuple[Sequence[Part], Callable[[], pa.Table]]] = []
    for part_start, part_stop in _cuts(sizes, len(sizes), MAX_ROUTED_BYTES):
        routed, bounds, order = _route(table.slice(part_start, part_stop - part_start), shards)
        routed_sizes = sizes[part_start:part_stop][order]
        for shard in range(shards):
            low, high = int(bounds[shard]), int(bounds[shard + 1])
            for start, stop in _cuts(routed_sizes[low:high], max_events, max_bytes):
                rows = routed.slice(low + start, stop - start)
                plans.append(([Part(shard, 0, stop - start)], functools.partial(_given, rows)))
    return write_files(storage, plans, written)
