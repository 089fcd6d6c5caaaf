"""Live segments per shard ("lanes"), the segment table that stores them, and the changes
since a table that let a checkpoint skip the commits in between.

A segment table (every ``snapshot_interval`` versions) lists every live segment, and the
segments removed since the table before it (*tombstones*: their files are deleted once
the table is older than the log's retention). Between tables, each snapshot header comes
with a *changes* file: the segments added and removed since the table. Live segments at
a header are its table plus its changes, so neither a reader nor the writer of the next
table has to read the commits in between.

Applying a commit costs in proportion to its own entries: an entry is found by binary
search on its first sequence, and a run of removed entries goes in one slice deletion.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import pyarrow as pa

from replog.errors import CorruptionError
from replog.format.commits import CommitRecord, commit_path
from replog.format.segments import DENSE, SegmentInfo

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
"""Columns of a segment entry in tables and changes files of format 2 (no ``offset``)."""

ENTRY_SCHEMA = SEGMENT_TABLE_SCHEMA.append(pa.field("offset", pa.int64(), nullable=False))
"""Columns of a segment entry in format 3."""

TABLE_SCHEMA = ENTRY_SCHEMA.append(pa.field("change", pa.string(), nullable=False))
"""A format 3 segment table: ``change`` is ``live`` or ``removed`` (a tombstone)."""

CHANGES_SCHEMA_V2 = SEGMENT_TABLE_SCHEMA.append(pa.field("removed", pa.bool_(), nullable=False))
CHANGES_SCHEMA = TABLE_SCHEMA
"""A format 3 changes file: ``change`` is ``added`` (since the table, live), ``removed``
(an entry of the table, gone) or ``dropped`` (added since the table and gone again)."""

ROWS_FIELD = pa.field("rows", pa.int64(), nullable=False)
"""Appended to a table or changes file holding a holed entry: each entry's rows (-1:
dense). Files without holed entries are written without it, as before."""

LIVE, REMOVED, ADDED, DROPPED = "live", "removed", "added", "dropped"


def _first_sequence(segment: SegmentInfo) -> int:
    return segment.first_sequence


def _insert(lanes: Lanes, segment: SegmentInfo) -> None:
    lane = lanes[segment.shard]
    if not lane or lane[-1].first_sequence < segment.first_sequence:
        lane.append(segment)
    else:
        bisect.insort(lane, segment, key=_first_sequence)


def index_of(lane: list[SegmentInfo], segment: SegmentInfo) -> int | None:
    """Where the live entry ``segment`` names is in ``lane`` (None if it is not live)."""
    index = bisect.bisect_left(lane, segment.first_sequence, key=_first_sequence)
    while index < len(lane) and lane[index].first_sequence == segment.first_sequence:
        if lane[index].key == segment.key:
            return index
        index += 1
    return None


def _remove_all(lanes: Lanes, removed: Iterable[SegmentInfo], where: str) -> None:
    """Remove live entries (each must be live, else the record at ``where`` is corrupt),
    deleting each lane's runs of consecutive entries in one slice."""
    found: dict[int, list[int]] = {}
    for segment in removed:
        index = index_of(lanes[segment.shard], segment)
        if index is None:
            raise CorruptionError(where, f"removes {segment.path}, which is not a live segment")
        found.setdefault(segment.shard, []).append(index)
    for shard, indices in found.items():
        lane = lanes[shard]
        indices.sort(reverse=True)
        stop = start = indices[0]
        for index in indices[1:]:
            if index == start - 1:
                start = index
                continue
            del lane[start : stop + 1]
            stop = start = index
        del lane[start : stop + 1]


def apply_segments(lanes: Lanes, commit: CommitRecord) -> None:
    """Apply a commit's adds and removes; a remove must name a live segment (same file
    and offset), else the record is corrupt."""
    _remove_all(lanes, commit.remove, commit_path(commit.version))
    for segment in commit.add:
        _insert(lanes, segment)


def _rows(segments: Iterable[SegmentInfo], change: str) -> list[tuple[SegmentInfo, str]]:
    ordered = sorted(segments, key=lambda s: (s.shard, s.first_sequence, s.path, s.offset))
    return [(segment, change) for segment in ordered]


def entries_table(rows: list[tuple[SegmentInfo, str]], schema: pa.Schema) -> pa.Table:
    """Entries with their change as a table, built column by column (a shared file's
    entries repeat its path and digest: the files are written LZ4-compressed). A holed
    entry among them adds the ``rows`` column."""
    if any(entry.holed for entry, _ in rows):
        schema = schema.append(ROWS_FIELD)
    columns = []
    for field in schema:
        if field.name == "change":
            columns.append(pa.array([change for _, change in rows], type=field.type))
        else:
            columns.append(pa.array([getattr(e, field.name) for e, _ in rows], type=field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def segments_table(lanes: Lanes, tombstones: Iterable[SegmentInfo] = ()) -> pa.Table:
    """A format 3 segment table: the live segments, then the tombstones."""
    rows = [
        *_rows((segment for lane in lanes for segment in lane), LIVE),
        *_rows(tombstones, REMOVED),
    ]
    return entries_table(rows, TABLE_SCHEMA)


def _entries(table: pa.Table) -> list[SegmentInfo]:
    """The entries of a checksum-verified table or changes file (its schema types them).
    ``offset`` and ``rows`` are each read if present (absent: 0, dense), file by file."""
    columns = [table.column(name).to_pylist() for name in SEGMENT_TABLE_SCHEMA.names]
    for name, absent in (("offset", 0), ("rows", DENSE)):
        if name in table.column_names:
            columns.append(table.column(name).to_pylist())
        else:
            columns.append([absent] * table.num_rows)
    return [SegmentInfo(*values) for values in zip(*columns, strict=True)]


def _changes(table: pa.Table) -> list[str]:
    """Each row's change (format 2 changes files flag removals with ``removed``)."""
    if "change" in table.column_names:
        return [str(change) for change in table.column("change").to_pylist()]
    if "removed" in table.column_names:
        return [REMOVED if gone else ADDED for gone in table.column("removed").to_pylist()]
    return [LIVE] * table.num_rows


def _where(table: pa.Table, change: str) -> pa.Table:
    """The rows of a table whose change is ``change``, as slices (no compute kernel:
    Spark's per-query planner process would pay ~30 ms to import one)."""
    changes = _changes(table)
    unknown = set(changes) - {LIVE, REMOVED}
    if unknown:
        raise ValueError(f"unknown change {sorted(unknown)} in a segment table")
    runs: list[tuple[int, int]] = []
    for index, found in enumerate(changes):
        if found != change:
            continue
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    if not runs:
        return table.slice(0, 0)
    return pa.concat_tables([table.slice(start, stop - start) for start, stop in runs])


def segments_from_table(table: pa.Table, shards: int) -> Lanes:
    """The live segments of a segment table (of format 2 or 3)."""
    lanes: Lanes = [[] for _ in range(shards)]
    for segment in _entries(_where(table, LIVE)):
        lanes[segment.shard].append(segment)
    for lane in lanes:
        lane.sort(key=_first_sequence)
    return lanes


def tombstones_from_table(table: pa.Table) -> list[SegmentInfo]:
    """The segments a table records as removed since the table before it."""
    return _entries(_where(table, REMOVED))


class SegmentChanges:
    """Segments added and removed by the commits after version :attr:`since` (a table or
    a checkpoint): ``added`` are still live at the end, ``removed`` were live at
    :attr:`since`, ``dropped`` were added and removed again. Removed and dropped segments
    are the *tombstones* of the interval: their files may be deleted once it is older
    than the log's retention.
    """

    def __init__(
        self,
        since: int,
        added: Iterable[SegmentInfo] = (),
        removed: Iterable[SegmentInfo] = (),
        dropped: Iterable[SegmentInfo] = (),
    ) -> None:
        self.since = since
        self.added = {segment.key: segment for segment in added}
        self.removed = {segment.key: segment for segment in removed}
        self.dropped = {segment.key: segment for segment in dropped}

    def __repr__(self) -> str:
        return (
            f"SegmentChanges(since={self.since}, added={len(self.added)}, "
            f"removed={len(self.removed)}, dropped={len(self.dropped)})"
        )

    def copy(self) -> SegmentChanges:
        return SegmentChanges(
            self.since, self.added.values(), self.removed.values(), self.dropped.values()
        )

    @property
    def tombstones(self) -> list[SegmentInfo]:
        """Every segment removed in the interval."""
        return [*self.removed.values(), *self.dropped.values()]

    def apply(self, commit: CommitRecord) -> None:
        for segment in commit.remove:
            if self.added.pop(segment.key, None) is None:
                self.removed[segment.key] = segment
            else:
                self.dropped[segment.key] = segment
        for segment in commit.add:
            self.added[segment.key] = segment

    def apply_to(self, lanes: Lanes, where: str) -> None:
        """Apply these changes to ``lanes`` (the live segments at :attr:`since`), in
        place; a removed segment they do not hold is corruption at ``where``."""
        _remove_all(lanes, self.removed.values(), where)
        for segment in self.added.values():
            _insert(lanes, segment)

    def to_table(self, dropped: Iterable[SegmentInfo] | None = None) -> pa.Table:
        """The changes file: these changes' added and removed segments, and ``dropped``
        (default: these changes' own) as the dropped ones."""
        rows = [
            *_rows(self.added.values(), ADDED),
            *_rows(self.removed.values(), REMOVED),
            *_rows(self.dropped.values() if dropped is None else dropped, DROPPED),
        ]
        return entries_table(rows, CHANGES_SCHEMA)

    @classmethod
    def from_table(cls, table: pa.Table, since: int) -> SegmentChanges:
        kinds: dict[str, list[SegmentInfo]] = {ADDED: [], REMOVED: [], DROPPED: []}
        for segment, change in zip(_entries(table), _changes(table), strict=True):
            if change not in kinds:
                raise ValueError(f"unknown change {change!r} in a changes file")
            kinds[change].append(segment)
        return cls(since, kinds[ADDED], kinds[REMOVED], kinds[DROPPED])
