"""The state of a log at one version: heads, low watermarks, sink marks and live segments.

A state is built from a snapshot plus the commits after it. Heads, low watermarks and
sink marks are kept eagerly (they are what finding the head needs); the live segment
list is loaded from the snapshot's Arrow sidecar only when a reader or compactor asks
for it, so finding the head costs the same after 10 or 10,000 commits.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from replog.errors import CorruptionError
from replog.records import APPEND, COMPACT, TRUNCATE, CommitRecord
from replog.segments import SegmentInfo

logger = logging.getLogger(__name__)

SEGMENT_TABLE_SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("first_sequence", pa.int64(), nullable=False),
        pa.field("last_sequence", pa.int64(), nullable=False),
        pa.field("bytes", pa.int64(), nullable=False),
        pa.field("sha256", pa.string(), nullable=False),
        pa.field("min_timestamp_ms", pa.int64(), nullable=False),
        pa.field("max_timestamp_ms", pa.int64(), nullable=False),
    ]
)


@dataclass(frozen=True)
class SinkMark:
    """The last commit a sink made to this log."""

    query_id: str
    epoch: int
    version: int


SegmentLoader = Callable[[], list[list[SegmentInfo]]]


class LogState:
    """Mutable view of a log at :attr:`version`; advanced with :meth:`apply`."""

    def __init__(
        self,
        *,
        shards: int,
        version: int = 0,
        heads: list[int] | None = None,
        lows: list[int] | None = None,
        sinks: dict[str, SinkMark] | None = None,
        total_bytes: int = 0,
        segment_count: int = 0,
        timestamp_ms: int = 0,
        segment_loader: SegmentLoader | None = None,
    ) -> None:
        self.shards = shards
        self.version = version
        self.heads = heads or [0] * shards
        self.lows = lows or [1] * shards
        self.sinks = dict(sinks or {})
        self.total_bytes = total_bytes
        self.segment_count = segment_count
        self.timestamp_ms = timestamp_ms
        self._segments: list[list[SegmentInfo]] | None = (
            None if segment_loader else [[] for _ in range(shards)]
        )
        self._segment_loader = segment_loader
        self._unapplied: list[CommitRecord] = []

    # -- advancing --------------------------------------------------------------------

    def apply(self, commit: CommitRecord, path: str) -> None:
        """Advance to ``commit`` (which must be version + 1), checking it keeps the invariants."""
        if commit.version != self.version + 1:
            raise CorruptionError(
                path, f"holds version {commit.version}, expected {self.version + 1}"
            )
        if commit.operation == APPEND:
            for segment in commit.add:
                expected = self.heads[segment.shard] + 1
                if segment.first_sequence != expected:
                    raise CorruptionError(
                        path,
                        f"segment {segment.path} starts shard {segment.shard} at sequence "
                        f"{segment.first_sequence}, expected {expected} "
                        f"(sequences must be gapless)",
                    )
                self.heads[segment.shard] = segment.last_sequence
        elif commit.operation == TRUNCATE:
            for shard, low in commit.low_watermarks.items():
                self.lows[shard] = max(self.lows[shard], low)
        elif commit.operation == COMPACT:
            _check_compaction(commit, path)
        else:
            raise CorruptionError(path, f"unknown operation {commit.operation!r}")
        self.total_bytes += sum(s.bytes for s in commit.add) - sum(s.bytes for s in commit.remove)
        self.segment_count += len(commit.add) - len(commit.remove)
        if commit.writer is not None:
            self.sinks[commit.writer.sink_id] = SinkMark(
                commit.writer.query_id, commit.writer.epoch, commit.version
            )
        self.version = commit.version
        self.timestamp_ms = commit.timestamp_ms
        if self._segments is None:
            self._unapplied.append(commit)
        else:
            _apply_segments(self._segments, commit)

    # -- segments ---------------------------------------------------------------------

    @property
    def segments(self) -> list[list[SegmentInfo]]:
        """Live segments per shard, ordered by sequence (loaded on first use)."""
        if self._segments is None:
            assert self._segment_loader is not None
            segments = self._segment_loader()
            for commit in self._unapplied:
                _apply_segments(segments, commit)
            self._segments, self._unapplied, self._segment_loader = segments, [], None
        return self._segments

    def covering(self, shard: int, first: int, last: int) -> list[SegmentInfo]:
        """Live segments of ``shard`` that hold any sequence in ``[first, last]``."""
        lane = self.segments[shard]
        index = max(bisect.bisect_right(lane, first, key=_first_sequence) - 1, 0)
        result = []
        for segment in lane[index:]:
            if segment.first_sequence > last:
                break
            if segment.last_sequence >= first:
                result.append(segment)
        return result

    def segments_table(self) -> pa.Table:
        rows = [segment.to_json() for lane in self.segments for segment in lane]
        return pa.Table.from_pylist(rows, schema=SEGMENT_TABLE_SCHEMA)

    def heads_json(self) -> dict[str, int]:
        return {str(shard): head for shard, head in enumerate(self.heads)}

    def lows_json(self) -> dict[str, int]:
        return {str(shard): low for shard, low in enumerate(self.lows)}


def _check_compaction(commit: CommitRecord, path: str) -> None:
    """A compaction must cover, per shard, exactly the sequences it removes."""

    def ranges(segments: tuple[SegmentInfo, ...]) -> dict[int, tuple[int, int, int]]:
        found: dict[int, tuple[int, int, int]] = {}
        for segment in segments:
            low, high, events = found.get(segment.shard, (segment.first_sequence, 0, 0))
            found[segment.shard] = (
                min(low, segment.first_sequence),
                max(high, segment.last_sequence),
                events + segment.events,
            )
        return found

    if ranges(commit.add) != ranges(commit.remove):
        raise CorruptionError(
            path, "compaction adds segments that do not cover exactly the sequences it removes"
        )


def _first_sequence(segment: SegmentInfo) -> int:
    return segment.first_sequence


def segments_from_table(table: pa.Table, shards: int) -> list[list[SegmentInfo]]:
    lanes: list[list[SegmentInfo]] = [[] for _ in range(shards)]
    for row in table.to_pylist():
        lanes[row["shard"]].append(SegmentInfo.from_json(row))
    for lane in lanes:
        lane.sort(key=_first_sequence)
    return lanes


def _apply_segments(lanes: list[list[SegmentInfo]], commit: CommitRecord) -> None:
    removed = {segment.path for segment in commit.remove}
    if removed:
        for shard in {segment.shard for segment in commit.remove}:
            lanes[shard] = [s for s in lanes[shard] if s.path not in removed]
    for segment in commit.add:
        lane = lanes[segment.shard]
        if not lane or lane[-1].first_sequence < segment.first_sequence:
            lane.append(segment)
        else:
            bisect.insort(lane, segment, key=_first_sequence)
