"""The state of a log at one version: heads, low watermarks, sink marks and live segments.

A state is built from a snapshot plus the commits after it. Heads, low watermarks and sink
marks are kept eagerly (they are what finding the head and committing need); the live
segment list is loaded only when a reader or compactor asks for it, so finding the head
costs the same after 10 or 10,000 commits.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from replog.errors import CorruptionError, FencedError
from replog.format.commits import APPEND, COMPACT, TRUNCATE, CommitRecord, WriterInfo, commit_path
from replog.format.segments import SegmentInfo

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
"""Columns of a snapshot's segment table; rows ordered by shard, then first sequence."""

MAX_QUERIES_PER_SINK = 64
"""How many query ids' last epochs a sink mark remembers (the most recent ones)."""


def retained_events(heads: Mapping[int, int], lows: Mapping[int, int]) -> int:
    """Events a log holds: per shard, from the low watermark to the head."""
    return sum(max(heads[shard] - lows[shard] + 1, 0) for shard in heads)


@dataclass(frozen=True)
class SinkMark:
    """What the log knows of one sink: its latest commit and which run owns it.

    ``queries`` holds the last committed epoch of each of the sink's most recent query ids
    (oldest first), so a replay is recognised even after another query wrote in between.
    ``runs`` holds the generation each recent run of the sink took it over with (oldest
    first); the run with the highest, :attr:`generation`, owns the sink, and a commit of
    any older run is fenced.
    """

    query_id: str
    epoch: int
    version: int
    generation: int = 0
    queries: tuple[tuple[str, int], ...] = ()
    runs: tuple[tuple[str, int], ...] = ()

    def epoch_of(self, query_id: str) -> int | None:
        for query, epoch in self.queries:
            if query == query_id:
                return epoch
        return self.epoch if query_id == self.query_id else None

    def generation_of(self, run_id: str) -> int | None:
        for run, generation in self.runs:
            if run == run_id:
                return generation
        return None

    @property
    def owner(self) -> str | None:
        """The run that owns the sink (None if no fenced writer ever committed)."""
        for run, generation in reversed(self.runs):
            if generation == self.generation:
                return run
        return None

    def after(self, writer: WriterInfo, version: int) -> SinkMark:
        """This mark once ``writer``'s commit at ``version`` is applied."""
        previous = self.epoch_of(writer.query_id)
        epoch = writer.epoch if previous is None else max(previous, writer.epoch)
        queries = [(q, e) for q, e in self.queries if q != writer.query_id]
        queries.append((writer.query_id, epoch))
        runs = list(self.runs)
        if writer.run_id is not None:
            runs = [(r, g) for r, g in runs if r != writer.run_id]
            runs.append((writer.run_id, writer.generation))
        return SinkMark(
            query_id=writer.query_id,
            epoch=writer.epoch,
            version=version,
            generation=max(writer.generation, self.generation),
            queries=tuple(queries[-MAX_QUERIES_PER_SINK:]),
            runs=tuple(runs[-MAX_QUERIES_PER_SINK:]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "query_id": self.query_id,
            "epoch": self.epoch,
            "version": self.version,
            "generation": self.generation,
            "queries": [[query, epoch] for query, epoch in self.queries],
            "runs": [[run, generation] for run, generation in self.runs],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SinkMark:
        return cls(
            query_id=str(data["query_id"]),
            epoch=int(data["epoch"]),
            version=int(data["version"]),
            generation=int(data.get("generation", 0)),
            queries=tuple((str(q), int(e)) for q, e in data.get("queries", [])),
            runs=tuple((str(r), int(g)) for r, g in data.get("runs", [])),
        )


_NO_MARK = SinkMark(query_id="", epoch=-1, version=0)

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

    def apply(self, commit: CommitRecord) -> None:
        """Advance to ``commit`` (which must be version + 1), checking it keeps the invariants."""
        path = commit_path(commit.version)
        if commit.version != self.version + 1:
            raise CorruptionError(
                path, f"holds version {commit.version}, expected {self.version + 1}"
            )
        for segment in (*commit.add, *commit.remove):
            if not 0 <= segment.shard < self.shards or segment.events < 1:
                raise CorruptionError(
                    path, f"segment {segment.path} has shard or range out of bounds"
                )
        if commit.operation == APPEND:
            for segment in commit.add:
                expected = self.heads[segment.shard] + 1
                if segment.first_sequence != expected:
                    raise CorruptionError(
                        path,
                        f"segment {segment.path} starts shard {segment.shard} at sequence "
                        f"{segment.first_sequence}, expected {expected} (sequences must be "
                        f"gapless)",
                    )
                self.heads[segment.shard] = segment.last_sequence
        elif commit.operation == TRUNCATE:
            for shard, low in commit.low_watermarks.items():
                if not 0 <= shard < self.shards or low > self.heads[shard] + 1:
                    raise CorruptionError(
                        path, f"low watermark {low} of shard {shard} is past its head"
                    )
                self.lows[shard] = max(self.lows[shard], low)
            for segment in commit.remove:
                if segment.last_sequence >= self.lows[segment.shard]:
                    raise CorruptionError(
                        path,
                        f"truncation removes {segment.path}, which is not below the low watermark",
                    )
        elif commit.operation == COMPACT:
            _check_compaction(commit, path)
        else:
            raise CorruptionError(path, f"unknown operation {commit.operation!r}")
        self.total_bytes += sum(s.bytes for s in commit.add) - sum(s.bytes for s in commit.remove)
        self.segment_count += len(commit.add) - len(commit.remove)
        if commit.writer is not None:
            mark = self.sinks.get(commit.writer.sink_id) or _NO_MARK
            self.sinks[commit.writer.sink_id] = mark.after(commit.writer, commit.version)
        self.version = commit.version
        self.timestamp_ms = commit.timestamp_ms
        if self._segments is None:
            self._unapplied.append(commit)
        else:
            apply_segments(self._segments, commit)

    # -- the sink rules ------------------------------------------------------------------

    def holds(self, writer: WriterInfo) -> bool:
        """Whether the log already holds ``writer``'s epoch (or a later one of its query)."""
        mark = self.sinks.get(writer.sink_id)
        epoch = mark.epoch_of(writer.query_id) if mark else None
        return epoch is not None and epoch >= writer.epoch

    def claim(self, writer: WriterInfo) -> WriterInfo:
        """``writer`` with the generation its run commits with; raises :class:`FencedError`
        if a newer run owns the sink. A run new to the sink takes it over (generation + 1).
        Writers without a run id (batch writes) are not fenced."""
        mark = self.sinks.get(writer.sink_id)
        if writer.run_id is None:
            return writer
        if mark is None:
            return dataclasses.replace(writer, generation=1)
        known = mark.generation_of(writer.run_id)
        if known is None:
            return dataclasses.replace(writer, generation=mark.generation + 1)
        if known < mark.generation:
            raise FencedError(
                f"sink {writer.sink_id!r}: run {writer.run_id} of query {writer.query_id} is "
                f"fenced: run {mark.owner} (query {mark.query_id}) took the sink over with "
                f"generation {mark.generation}; two live queries must not share a sinkId"
            )
        return dataclasses.replace(writer, generation=known)

    # -- segments ---------------------------------------------------------------------

    @property
    def segments(self) -> list[list[SegmentInfo]]:
        """Live segments per shard, ordered by sequence (loaded on first use)."""
        if self._segments is None:
            assert self._segment_loader is not None
            segments = [list(lane) for lane in self._segment_loader()]
            for commit in self._unapplied:
                apply_segments(segments, commit)
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

    def live_paths(self) -> set[str]:
        return {segment.path for lane in self.segments for segment in lane}

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


def apply_segments(lanes: list[list[SegmentInfo]], commit: CommitRecord) -> None:
    """Apply a commit's adds and removes; a remove must name a live segment (same path and
    sequence range), else the record is corrupt."""
    for segment in commit.remove:
        lane = lanes[segment.shard]
        kept = [s for s in lane if s.path != segment.path]
        if len(kept) == len(lane):
            raise CorruptionError(
                commit_path(commit.version), f"removes {segment.path}, which is not a live segment"
            )
        lanes[segment.shard] = kept
    for segment in commit.add:
        lane = lanes[segment.shard]
        if not lane or lane[-1].first_sequence < segment.first_sequence:
            lane.append(segment)
        else:
            bisect.insort(lane, segment, key=_first_sequence)
