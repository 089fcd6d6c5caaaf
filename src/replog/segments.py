"""Segment files: immutable Arrow IPC files (LZ4-compressed) of one shard's events.

A segment holds :data:`~replog.events.STORED_SCHEMA` rows; its shard and sequence
range come from the commit that made it visible, so a writer can stage a segment
before it knows its sequences. Every read checks the SHA-256 recorded at commit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from replog.errors import CorruptionError
from replog.events import STORED_SCHEMA

SEGMENT_SUFFIX = ".arrow"
BATCH_ROWS = 65_536
"""Rows per IPC record batch inside a segment: the unit a reader decodes at a time."""

_WRITE_OPTIONS = ipc.IpcWriteOptions(compression="lz4")


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
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


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


def encode_segment(table: pa.Table) -> bytes:
    """Serialise stored-schema rows as an Arrow IPC file."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, STORED_SCHEMA, options=_WRITE_OPTIONS) as writer:
        writer.write_table(table, max_chunksize=BATCH_ROWS)
    return bytes(sink.getvalue())


def timestamp_range_ms(table: pa.Table) -> tuple[int, int]:
    """Min and max event time of the rows, in ms since the epoch (0, 0 for no rows)."""
    if table.num_rows == 0:
        return 0, 0
    column = table.column("timestamp").cast(pa.int64())
    bounds = pc.min_max(column).as_py()
    return int(bounds["min"]) // 1000, int(bounds["max"]) // 1000


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_segment(
    data: bytes, *, path: str, expected_sha256: str, expected_rows: int
) -> ipc.RecordBatchFileReader:
    """Check a segment's bytes against its commit entry and open it.

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
        reader = ipc.open_file(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorruptionError(path, f"not a readable Arrow IPC file: {exc}") from exc
    rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    if rows != expected_rows:
        raise CorruptionError(path, f"holds {rows} events, its commit says {expected_rows}")
    if not reader.schema.equals(STORED_SCHEMA):
        raise CorruptionError(path, f"unexpected schema {reader.schema}")
    return reader


def iter_rows(
    reader: ipc.RecordBatchFileReader, skip: int, take: int
) -> Iterator[pa.RecordBatch]:
    """Batches covering rows ``[skip, skip + take)`` of an open segment, without copying."""
    position = 0
    end = skip + take
    for index in range(reader.num_record_batches):
        batch = reader.get_batch(index)
        batch_end = position + batch.num_rows
        if batch_end > skip and position < end:
            lo = max(skip - position, 0)
            hi = min(end, batch_end) - position
            yield batch.slice(lo, hi - lo) if (lo, hi) != (0, batch.num_rows) else batch
        position = batch_end
        if position >= end:
            break
