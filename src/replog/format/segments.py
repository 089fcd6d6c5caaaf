"""Segment files: immutable Arrow IPC files (LZ4-compressed) of change events, and the
commit entries that name runs of their rows (pure: encoding, decoding, layout; the reading
and writing is :mod:`replog.core.files`).

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

import hashlib
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
from pyarrow import ipc

from replog.errors import CorruptionError
from replog.format.arrays import strings
from replog.format.events import (
    OPERATIONS,
    STORED_SCHEMA,
    STORED_SCHEMA_V1,
    to_event_batch,
    upgrade_stored,
)
from replog.format.routing import shards_of

SHARDS_DIR = "shards"
SEGMENT_SUFFIX = ".arrow"
BATCH_ROWS = 65_536
"""Rows per IPC record batch inside a segment: the unit a reader decodes at a time."""
WRITE_COMPRESSION = "lz4"

SEQUENCE_COLUMN = "sequence"
HOLED_SCHEMA = STORED_SCHEMA.append(pa.field(SEQUENCE_COLUMN, pa.int64(), nullable=False))
"""A file written by key compaction: the stored columns and each row's sequence (its
entries have holes, FORMAT.md "Holes")."""

MAX_SEGMENT_EVENTS = 262_144
MAX_SEGMENT_BYTES = 64 * 1024 * 1024
"""A staged segment holds at most this many events and about this many bytes of rows
(uncompressed): segments are decoded whole, and Arrow's binary columns hold 2 GiB."""
MAX_ROUTED_BYTES = 256 * 1024 * 1024
"""Rows are routed (sorted by shard) in slices of about this many bytes."""
IO_THREADS = 8


_OPERATIONS = strings(OPERATIONS)

DENSE = -1
"""``SegmentInfo.rows`` of an entry without holes: one row per sequence of its range."""


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
    rows: int = DENSE

    @property
    def sequences(self) -> int:
        """How many sequences the entry covers (its range, holes included)."""
        return self.last_sequence - self.first_sequence + 1

    @property
    def events(self) -> int:
        """How many rows (events) the entry holds: its range, less its holes."""
        return self.sequences if self.rows == DENSE else self.rows

    @property
    def holed(self) -> bool:
        """Whether key compaction left holes in the range: the file then carries each
        row's sequence (column ``sequence``, FORMAT.md "Holes")."""
        return self.rows != DENSE

    @property
    def key(self) -> tuple[str, int]:
        """What identifies an entry: its file and first row (entries never share rows)."""
        return (self.path, self.offset)

    def to_json(self) -> dict[str, Any]:
        document = self._asdict()
        if not self.holed:
            del document["rows"]
        return document

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SegmentInfo:
        values = {name: data[name] for name in cls._fields if name not in ("offset", "rows")}
        values["offset"] = data.get("offset", 0)  # format 2 entries have none
        values["rows"] = data.get("rows", DENSE)
        for name, value in values.items():
            expected = str if name in ("path", "sha256") else int
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ValueError(f"segment entry field {name!r} is {value!r}")
        if values["offset"] < 0 or values["bytes"] < 0 or values["rows"] < DENSE:
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


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_segment_buffer(table: pa.Table) -> pa.Buffer:
    """Serialise stored-schema rows (with a ``sequence`` column: a holed file) as an Arrow
    IPC file, in the buffer Arrow wrote it to (no copy)."""
    schema = HOLED_SCHEMA if table.schema.equals(HOLED_SCHEMA) else STORED_SCHEMA
    return encode_batches(table.to_batches(max_chunksize=BATCH_ROWS), schema)


def encode_batches(
    batches: Iterable[pa.RecordBatch], schema: pa.Schema = STORED_SCHEMA
) -> pa.Buffer:
    """Serialise record batches of ``schema`` as an Arrow IPC file, one batch at a time,
    in the buffer Arrow wrote it to (no copy): a merge of large files holds the encoded
    file and the batch at hand."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(
        sink, schema, options=ipc.IpcWriteOptions(compression=WRITE_COMPRESSION)
    ) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue()


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
    if not any(table.schema.equals(s) for s in (STORED_SCHEMA, STORED_SCHEMA_V1, HOLED_SCHEMA)):
        raise CorruptionError(path, f"unexpected schema {table.schema}")
    _check_operations(table, path)
    return upgrade_stored(table)


def _check_operations(table: pa.Table, path: str) -> None:
    """Refuse a file holding a row whose operation is none of :data:`OPERATIONS` (writers
    refuse them: a consumer must never guess what another one means). About 5 ns a row."""
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    valid = pc.is_in(table.column("operation"), value_set=_OPERATIONS)
    if not pc.all(valid).as_py():
        row = pc.index(valid, False).as_py()
        found = table.column("operation")[row].as_py()
        raise CorruptionError(
            path, f"row {row} has operation {found!r}; allowed: {', '.join(OPERATIONS)}"
        )


def entry_rows(table: pa.Table, segment: SegmentInfo) -> pa.Table:
    """The rows of ``segment`` in its decoded file (zero-copy; a holed file's rows keep
    their ``sequence`` column). A file has that column exactly when its entries are holed:
    a dense entry's rows take their sequences from its range, never from a column."""
    if (SEQUENCE_COLUMN in table.column_names) != segment.holed:
        raise CorruptionError(
            segment.path,
            "a holed entry's file has no sequence column"
            if segment.holed
            else "a dense entry names rows of a file with a sequence column (only holed "
            "entries may)",
        )
    return table.slice(segment.offset, segment.events)


def row_sequences(rows: pa.Table, segment: SegmentInfo) -> np.ndarray:
    """The sequence of each of ``segment``'s rows: its range for a dense entry, the file's
    ``sequence`` column for a holed one (checked: increasing, within the range)."""
    if not segment.holed:
        return np.arange(segment.first_sequence, segment.last_sequence + 1, dtype=np.int64)
    if SEQUENCE_COLUMN not in rows.column_names:
        raise CorruptionError(segment.path, "a holed entry's file has no sequence column")
    found: np.ndarray = np.asarray(rows.column(SEQUENCE_COLUMN).to_numpy(), dtype=np.int64)
    if len(found) and (
        found[0] < segment.first_sequence
        or found[-1] > segment.last_sequence
        or (len(found) > 1 and not bool(np.all(found[1:] > found[:-1])))
    ):
        raise CorruptionError(
            segment.path,
            f"sequences of shard {segment.shard} rows are not increasing within "
            f"{segment.first_sequence}..{segment.last_sequence}",
        )
    return found


def event_batches(
    rows: pa.Table, segment: SegmentInfo, first: int, last: int
) -> Iterator[pa.RecordBatch]:
    """Events ``[first, last]`` of ``segment``, given its rows, with shard and sequence
    (the sequences a holed entry's rows carry, skipping its holes)."""
    start = max(first, segment.first_sequence)
    stop = min(last, segment.last_sequence)
    if stop < start:
        return
    if segment.holed:
        sequences = row_sequences(rows, segment)
        low = int(np.searchsorted(sequences, start, side="left"))
        high = int(np.searchsorted(sequences, stop, side="right"))
        stored = rows.drop_columns([SEQUENCE_COLUMN]).slice(low, high - low)
        taken = sequences[low:high]
        done = 0
        for batch in stored.to_batches():
            yield to_event_batch(batch, segment.shard, taken[done : done + batch.num_rows])
            done += batch.num_rows
        return
    sequence = start
    for batch in rows.slice(start - segment.first_sequence, stop - start + 1).to_batches():
        yield to_event_batch(batch, segment.shard, sequence)
        sequence += batch.num_rows


def row_sizes(table: pa.Table) -> np.ndarray:
    """Approximate bytes of each row (its variable-length values plus fixed columns)."""
    import pyarrow.compute as pc  # noqa: PLC0415 (see the module docstring)

    sizes = np.full(table.num_rows, 24, dtype=np.int64)
    for name in ("event_id", "collection", "key", "data", "before", "metadata"):
        lengths = pc.binary_length(table.column(name)).to_numpy(zero_copy_only=False)
        sizes += np.nan_to_num(lengths.astype(np.float64)).astype(np.int64)
    return sizes


def cuts(sizes: np.ndarray, max_events: int, max_bytes: int) -> list[tuple[int, int]]:
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
    if count == 0:  # a file of key compaction may keep no rows at all
        return [total] + [0] * (len(rows) - 1)
    portions = [total * n // count for n in rows]
    portions[0] += total - sum(portions)
    return portions


def given(table: pa.Table) -> pa.Table:
    return table


def route(
    table: pa.Table | pa.RecordBatch, shards: int
) -> tuple[pa.Table | pa.RecordBatch, np.ndarray, np.ndarray]:
    """``table``'s rows grouped by shard (stable: per-key order kept), where each shard's
    rows are (``bounds[s] .. bounds[s + 1]``), and the order that groups them."""
    shard_ids = shards_of(table.column("key"), shards)
    order = np.argsort(shard_ids, kind="stable")
    routed = table.take(pa.array(order))
    bounds = np.searchsorted(shard_ids[order], np.arange(shards + 1), side="left")
    return routed, bounds, order
