"""Segment files: immutable Arrow IPC files (LZ4-compressed) of one shard's events.

A segment holds :data:`~replog.events.STORED_SCHEMA` rows; its shard and sequence
range come from the commit that made it visible, so a writer can stage a segment
before it knows its sequences. Every read checks the SHA-256 recorded at commit.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import ipc

from replog.errors import CorruptionError
from replog.events import STORED_SCHEMA

SEGMENT_SUFFIX = ".arrow"
BATCH_ROWS = 65_536
"""Rows per IPC record batch inside a segment: the unit a reader decodes at a time."""

WRITE_COMPRESSION = "lz4"


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
    with ipc.new_file(
        sink, STORED_SCHEMA, options=ipc.IpcWriteOptions(compression=WRITE_COMPRESSION)
    ) as writer:
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
    if not table.schema.equals(STORED_SCHEMA):
        raise CorruptionError(path, f"unexpected schema {table.schema}")
    return table


def slice_batches(table: pa.Table, skip: int, take: int) -> list[pa.RecordBatch]:
    """The record batches of rows ``[skip, skip + take)``, without copying."""
    batches: list[pa.RecordBatch] = table.slice(skip, take).to_batches()
    return batches
