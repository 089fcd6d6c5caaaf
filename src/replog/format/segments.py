"""Segment files: immutable Arrow IPC files (LZ4-compressed) of one shard's events.

A segment holds :data:`~replog.format.events.STORED_SCHEMA` rows; its shard and sequence
range come from the commit that makes it visible, so a writer can *stage* a segment
(write it under a unique name) before it knows its sequences. Every read checks the
SHA-256 recorded at commit.

``pyarrow.compute`` is imported where it is used, not with this module: Spark starts a
Python process per streaming query that imports replog to plan it, and planning needs no
compute kernel (the import costs ~30 ms of every query).
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

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


@dataclass(frozen=True)
class SegmentInfo:
    """What a commit records about one segment (FORMAT.md, "segment entries")."""

    path: str
    shard: int
    first_sequence: int
    last_sequence: int
    bytes: int
    sha256: str
    min_timestamp_ms: int
    max_timestamp_ms: int

    @property
    def events(self) -> int:
        return self.last_sequence - self.first_sequence + 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SegmentInfo:
        values = {name: data[name] for name in cls.__dataclass_fields__}
        for name, value in values.items():
            expected = str if name in ("path", "sha256") else int
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"segment entry field {name!r} is {value!r}")
        return cls(**values)


@dataclass(frozen=True)
class StagedSegment:
    """A written segment file whose sequences are not yet assigned."""

    path: str
    shard: int
    events: int
    bytes: int
    sha256: str
    min_timestamp_ms: int
    max_timestamp_ms: int

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
        )


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


def decode_segment(data: bytes, *, path: str, expected_sha256: str, expected_rows: int) -> pa.Table:
    """Check a segment's bytes against its commit entry and decode it (once).

    Raises :class:`CorruptionError` naming ``path`` on a checksum mismatch, a row count
    that differs from the commit, or bytes Arrow cannot decode.
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
    if table.num_rows != expected_rows:
        raise CorruptionError(
            path, f"holds {table.num_rows} events, its commit says {expected_rows}"
        )
    if not (table.schema.equals(STORED_SCHEMA) or table.schema.equals(STORED_SCHEMA_V1)):
        raise CorruptionError(path, f"unexpected schema {table.schema}")
    return upgrade_stored(table)


# -- reading -------------------------------------------------------------------------------


def read_stored(storage: Storage, segment: SegmentInfo) -> pa.Table:
    """A committed segment's rows (stored schema), checked against its commit entry.

    Raises :class:`MissingFileError` naming the path tried if the file is not there, and
    :class:`CorruptionError` if it is torn or altered.
    """
    path = storage.path(segment.path)
    try:
        data = storage.read(segment.path)
    except FileNotFoundError as exc:
        raise MissingFileError(
            storage.where(segment.path),
            "segment file named by a commit is not on storage (deleted outside replog, "
            "collected by 'replog recover' with a --grace shorter than a running read, or "
            "the log's URL resolves to another place here)",
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
    if stop < start:
        return
    sequence = start
    for batch in table.slice(start - segment.first_sequence, stop - start + 1).to_batches():
        yield to_event_batch(batch, segment.shard, sequence)
        sequence += batch.num_rows


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


def new_segment_path(shard: int) -> str:
    """A unique path for a segment of ``shard`` to be staged."""
    return f"{SHARDS_DIR}/{shard:05d}/{uuid.uuid4().hex}{SEGMENT_SUFFIX}"


def write_segment(
    storage: Storage, shard: int, table: pa.Table, relative: str | None = None
) -> StagedSegment:
    """Write stored-schema rows of one shard as a staged (not yet visible) segment.

    The directory entry is made durable by the caller (:meth:`Storage.sync`), once for
    all segments of a commit.
    """
    relative = relative or new_segment_path(shard)
    data = encode_segment(table)
    storage.put_if_absent(relative, data, sync=False)
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


def write_segments(
    storage: Storage, pieces: Sequence[tuple[int, Callable[[], pa.Table]]]
) -> list[StagedSegment]:
    """Write ``(shard, rows)`` pieces as staged segments in parallel, in order (``rows`` is
    called in the worker, so a piece can be read or built there). If any piece fails,
    every file of the call is deleted (none is committed yet) and the error raised."""
    paths = [new_segment_path(shard) for shard, _ in pieces]
    with ThreadPoolExecutor(max_workers=max(1, min(IO_THREADS, len(pieces)))) as pool:
        futures = [
            pool.submit(lambda s, r, p: write_segment(storage, s, r(), p), shard, rows, path)
            for (shard, rows), path in zip(pieces, paths, strict=True)
        ]
    failures = [future.exception() for future in futures if future.exception() is not None]
    if failures:
        for path in paths:
            storage.delete(path)
        raise failures[0]  # type: ignore[misc]
    staged = [future.result() for future in futures]
    storage.sync(paths)
    return staged


def _given(table: pa.Table) -> pa.Table:
    return table


def stage(
    storage: Storage,
    shards: int,
    table: pa.Table,
    *,
    max_events: int = MAX_SEGMENT_EVENTS,
    max_bytes: int = MAX_SEGMENT_BYTES,
) -> list[StagedSegment]:
    """Route validated rows to shards and write them as staged segments, in order.

    Per-key order is kept: rows of one key go to one shard in input order, and the
    returned list (the order a commit adds them in) keeps each shard's segments in order.
    """
    if table.num_rows == 0:
        return []
    if not table.schema.equals(STORED_SCHEMA):
        raise InvalidEventError(
            "staging takes validated rows in the stored schema (from events_from_table or "
            f"events_from_records); got columns {table.schema.names}"
        )
    # Sizes per row matter only when the rows may not fit in one piece (7 ms per 125k).
    small = table.nbytes <= min(max_bytes, MAX_ROUTED_BYTES)
    sizes = np.zeros(table.num_rows, dtype=np.int64) if small else row_sizes(table)
    pieces: list[tuple[int, Callable[[], pa.Table]]] = []
    for part_start, part_stop in _cuts(sizes, len(sizes), MAX_ROUTED_BYTES):
        part = table.slice(part_start, part_stop - part_start)
        shard_ids = shards_of(part.column("key"), shards)
        order = np.argsort(shard_ids, kind="stable")  # stable: keeps per-key order
        routed = part.take(pa.array(order))
        routed_sizes = sizes[part_start:part_stop][order]
        bounds = np.searchsorted(shard_ids[order], np.arange(shards + 1), side="left")
        for shard in range(shards):
            low, high = int(bounds[shard]), int(bounds[shard + 1])
            for start, stop in _cuts(routed_sizes[low:high], max_events, max_bytes):
                rows = routed.slice(low + start, stop - start)
                pieces.append((shard, functools.partial(_given, rows)))
    return write_segments(storage, pieces)
