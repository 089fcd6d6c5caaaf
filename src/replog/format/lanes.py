"""Live segments per shard ("lanes"), the segment table that stores them, and the changes
since a table that let a checkpoint skip the commits in between.

A segment table (every ``snapshot_interval`` versions) lists every live segment. Between
tables, each snapshot header comes with a *changes* file: the segments added and removed
since the table. Live segments at a header are its table plus its changes, so neither a
reader nor the writer of the next table has to read the commits in between.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import pyarrow as pa

from replog.errors import CorruptionError
from replog.format.commits import CommitRecord, commit_path
from replog.format.segments import SegmentInfo

Lanes = list[list[SegmentInfo]]
"""Live segments per shard, each lane ordered by first sequence."""

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
"""Columns of a segment table; rows ordered by shard, then first sequence."""

CHANGES_SCHEMA = SEGMENT_TABLE_SCHEMA.append(pa.field("removed", pa.bool_(), nullable=False))
"""Columns of a changes file: segment entries, each flagged added (false) or removed."""


def _first_sequence(segment: SegmentInfo) -> int:
    return segment.first_sequence


def _insert(lanes: Lanes, segment: SegmentInfo) -> None:
    lane = lanes[segment.shard]
    if not lane or lane[-1].first_sequence < segment.first_sequence:
        lane.append(segment)
    else:
        bisect.insort(lane, segment, key=_first_sequence)


def _remove(lanes: Lanes, segment: SegmentInfo, where: str) -> None:
    lane = lanes[segment.shard]
    kept = [s for s in lane if s.path != segment.path]
    if len(kept) == len(lane):
        raise CorruptionError(where, f"removes {segment.path}, which is not a live segment")
    lanes[segment.shard] = kept


def apply_segments(lanes: Lanes, commit: CommitRecord) -> None:
    """Apply a commit's adds and removes; a remove must name a live segment (same path),
    else the record is corrupt."""
    for segment in commit.remove:
        _remove(lanes, segment, commit_path(commit.version))
    for segment in commit.add:
        _insert(lanes, segment)


def _rows(segments: Iterable[SegmentInfo]) -> list[dict[str, object]]:
    ordered = sorted(segments, key=lambda s: (s.shard, s.first_sequence, s.path))
    return [segment.to_json() for segment in ordered]


def segments_table(lanes: Lanes) -> pa.Table:
    return pa.Table.from_pylist(
        _rows(segment for lane in lanes for segment in lane), schema=SEGMENT_TABLE_SCHEMA
    )


def segments_from_table(table: pa.Table, shards: int) -> Lanes:
    lanes: Lanes = [[] for _ in range(shards)]
    for row in table.select(SEGMENT_TABLE_SCHEMA.names).to_pylist():
        lanes[row["shard"]].append(SegmentInfo.from_json(row))
    for lane in lanes:
        lane.sort(key=_first_sequence)
    return lanes


class SegmentChanges:
    """Segments added and removed since the segment table at :attr:`table_version`.

    Version 0 stands for the empty log (no table file). A segment added and removed
    again after the table appears in neither list.
    """

    def __init__(
        self,
        table_version: int,
        added: Iterable[SegmentInfo] = (),
        removed: Iterable[SegmentInfo] = (),
    ) -> None:
        self.table_version = table_version
        self.added = {segment.path: segment for segment in added}
        self.removed = {segment.path: segment for segment in removed}

    def __repr__(self) -> str:
        return (
            f"SegmentChanges(table_version={self.table_version}, "
            f"added={len(self.added)}, removed={len(self.removed)})"
        )

    def copy(self) -> SegmentChanges:
        return SegmentChanges(self.table_version, self.added.values(), self.removed.values())

    def apply(self, commit: CommitRecord) -> None:
        for segment in commit.remove:
            if self.added.pop(segment.path, None) is None:
                self.removed[segment.path] = segment
        for segment in commit.add:
            self.added[segment.path] = segment

    def applied_to(self, table: Lanes, where: str) -> Lanes:
        """The live segments: ``table`` (the lanes of table :attr:`table_version`) with
        these changes applied; a removed segment missing from it is corruption at ``where``."""
        lanes = [list(lane) for lane in table]
        for segment in self.removed.values():
            _remove(lanes, segment, where)
        for segment in self.added.values():
            _insert(lanes, segment)
        return lanes

    def to_table(self) -> pa.Table:
        rows = [
            *({**row, "removed": False} for row in _rows(self.added.values())),
            *({**row, "removed": True} for row in _rows(self.removed.values())),
        ]
        return pa.Table.from_pylist(rows, schema=CHANGES_SCHEMA)

    @classmethod
    def from_table(cls, table: pa.Table, table_version: int) -> SegmentChanges:
        removed = table.column("removed").to_pylist()
        segments = [
            SegmentInfo.from_json(row)
            for row in table.select(SEGMENT_TABLE_SCHEMA.names).to_pylist()
        ]
        return cls(
            table_version,
            added=(s for s, gone in zip(segments, removed, strict=True) if not gone),
            removed=(s for s, gone in zip(segments, removed, strict=True) if gone),
        )
