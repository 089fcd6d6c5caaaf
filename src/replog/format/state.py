"""The state of a log at one version: heads, low watermarks, sink marks and live segments.

A state is built from a snapshot plus the commits after it. Heads, low watermarks and sink
marks are kept eagerly (they are what finding the head and committing need); the live
segment list is loaded only when a reader, a compactor or the writer of a segment table
asks for it, so finding the head costs the same after 10 or 10,000 commits. A state also
keeps the commits since the newest segment table it has passed (at most two snapshot
intervals of them), from which the next checkpoint's changes file is written.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from replog.errors import CorruptionError, LogRecreatedError
from replog.format.commits import (
    APPEND,
    COMPACT,
    TRUNCATE,
    CommitRecord,
    SourcePosition,
    WriterInfo,
    commit_path,
)
from replog.format.gc import MAX_KEPT_MARKS, StagedFiles, StagingStart, judge
from replog.format.lanes import Lanes, SegmentChanges, apply_segments, index_of
from replog.format.segments import SegmentInfo
from replog.timeutil import monotonic_s

logger = logging.getLogger(__name__)

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
    any older run is fenced. ``sources`` are the source positions the latest commit
    recorded: kept here, they outlive that commit's record (retention).
    """

    query_id: str
    epoch: int
    version: int
    generation: int = 0
    queries: tuple[tuple[str, int], ...] = ()
    runs: tuple[tuple[str, int], ...] = ()
    sources: tuple[SourcePosition, ...] = ()

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
            sources=writer.sources,
        )

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "query_id": self.query_id,
            "epoch": self.epoch,
            "version": self.version,
            "generation": self.generation,
            "queries": [[query, epoch] for query, epoch in self.queries],
            "runs": [[run, generation] for run, generation in self.runs],
        }
        if self.sources:
            document["sources"] = [source.to_json() for source in self.sources]
        return document

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SinkMark:
        return cls(
            query_id=str(data["query_id"]),
            epoch=int(data["epoch"]),
            version=int(data["version"]),
            generation=int(data.get("generation", 0)),
            queries=tuple((str(q), int(e)) for q, e in data.get("queries", [])),
            runs=tuple((str(r), int(g)) for r, g in data.get("runs", [])),
            sources=tuple(SourcePosition.from_json(item) for item in data.get("sources", [])),
        )


_NO_MARK = SinkMark(query_id="", epoch=-1, version=0)


class Snapshots(Protocol):
    """Where a state loads the segment bookkeeping it does not hold in memory."""

    @property
    def table_interval(self) -> int:
        """Versions between segment tables (the log's ``snapshot_interval``)."""
        ...

    def segments(self, version: int) -> Lanes:
        """Live segments at checkpoint ``version``."""
        ...

    def changes(self, version: int) -> SegmentChanges:
        """Changes at checkpoint ``version`` since the table at or below it."""
        ...

    def table_sha256(self, version: int) -> str | None:
        """Checksum of the segment table at ``version`` (None at 0, the empty log)."""
        ...

    def remember_table(self, version: int, sha256: str) -> None:
        """Note the checksum of a table just written."""
        ...


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
        gc_marks: Sequence[tuple[int, int]] = (),
        gc_known_since: int = 0,
        snapshots: Snapshots | None = None,
        log_id: str = "",
        retained_from: int = 0,
    ) -> None:
        """``snapshots`` loads what a state at ``version`` > 0 needs beyond its header;
        without it the state starts empty at version 0 and keeps no commits for
        checkpoints (as ``verify`` builds it). ``gc_marks``: the newest gc marks at or
        below ``version`` as ``(version, cut-off)``, complete after ``gc_known_since``
        (a header written before marks existed gives none, known since its version).
        ``log_id``: the log's id, which every commit applied must name (if it names
        one). ``retained_from``: commits and snapshots older than this version may have
        been deleted by retention."""
        self.shards = shards
        self.log_id = log_id
        self.retained_from = retained_from
        self.verified: tuple[int, float] | None = None
        """(version, when by :func:`~replog.timeutil.monotonic_s`) the log at the URL was
        last found to be this state's log, at this version (the clock of
        :attr:`head_seen`: one clock for both, and the one tests move)."""
        self.head_seen: float | None = None
        """When (:func:`~replog.timeutil.monotonic_s`) commit :attr:`version` + 1 was last
        known not to be written yet: just before a read found it missing that was
        followed by a check that commit :attr:`version` is still this state's (so
        retention had not emptied the slot), or just before this process put commit
        :attr:`version` itself (no one writes the next before it lands). None: unknown.
        A commit put at :attr:`version` + 1 less than the retention (less the clock
        skew) after this cannot have landed in a slot retention emptied."""
        self.last_token: str | None = None
        """The token of commit :attr:`version`, once this state applied it (a state loaded
        from a header does not know it): finding that very record at that version proves
        the log still has this state's history, not a record written later in its place."""
        self.version = version
        self.heads = heads or [0] * shards
        self.lows = lows or [1] * shards
        self.sinks = dict(sinks or {})
        self.total_bytes = total_bytes
        self.segment_count = segment_count
        self.timestamp_ms = timestamp_ms
        self.gc_marks = list(gc_marks)
        self.gc_known_since = gc_known_since
        if snapshots is None and version > 0:
            raise ValueError("a state past version 0 needs its snapshots")
        self._snapshots = snapshots
        self._base = version
        """The checkpoint version the segments (if not loaded) and changes are based on."""
        self._since_base: list[CommitRecord] = []
        self._base_changes: SegmentChanges | None = None
        self._segments: Lanes | None = [[] for _ in range(shards)] if version == 0 else None

    def verified_within(self, seconds: float) -> bool:
        """Whether this version was found to be this log's less than ``seconds`` ago."""
        return (
            self.verified is not None
            and self.verified[0] == self.version
            and monotonic_s() - self.verified[1] < seconds
        )

    # -- advancing --------------------------------------------------------------------

    def apply(self, commit: CommitRecord) -> None:
        """Advance to ``commit`` (which must be version + 1), checking it keeps the invariants."""
        path = commit_path(commit.version)
        self._check(commit, path)
        self._HANDLERS[commit.operation](self, commit, path)
        self.total_bytes += sum(s.bytes for s in commit.add) - sum(s.bytes for s in commit.remove)
        self.segment_count += len(commit.add) - len(commit.remove)
        if commit.writer is not None:
            mark = self.sinks.get(commit.writer.sink_id) or _NO_MARK
            self.sinks[commit.writer.sink_id] = mark.after(commit.writer, commit.version)
        self.version = commit.version
        self.timestamp_ms = commit.timestamp_ms
        self.last_token = commit.token or None
        self.head_seen = None
        if commit.gc is not None:
            self._note_gc_mark(commit.version, commit.gc.cutoff_ms)
        if self._segments is not None:
            apply_segments(self._segments, commit)
        if self._snapshots is not None or self._segments is None:
            self._since_base.append(commit)
            self._rebase()

    def _check(self, commit: CommitRecord, path: str) -> None:
        """What every commit must satisfy: the next version, this log, entries in range,
        an operation this replog knows."""
        if commit.version != self.version + 1:
            raise CorruptionError(
                path, f"holds version {commit.version}, expected {self.version + 1}"
            )
        if commit.log_id and self.log_id and commit.log_id != self.log_id:
            raise LogRecreatedError(path, commit.log_id, self.log_id)
        for segment in (*commit.add, *commit.remove):
            if (
                not 0 <= segment.shard < self.shards
                or segment.sequences < 1
                or segment.events > segment.sequences
            ):
                raise CorruptionError(
                    path, f"segment {segment.path} has shard or range out of bounds"
                )
        if commit.operation not in self._HANDLERS:
            raise CorruptionError(path, f"unknown operation {commit.operation!r}")

    def _apply_append(self, commit: CommitRecord, path: str) -> None:
        """Each added segment continues its shard: heads move, gapless."""
        for segment in commit.add:
            expected = self.heads[segment.shard] + 1
            if segment.first_sequence != expected:
                raise CorruptionError(
                    path,
                    f"segment {segment.path} starts shard {segment.shard} at sequence "
                    f"{segment.first_sequence}, expected {expected} (sequences must be gapless)",
                )
            self.heads[segment.shard] = segment.last_sequence

    def _apply_truncate(self, commit: CommitRecord, path: str) -> None:
        """Low watermarks rise; only segments wholly below them leave."""
        for shard, low in commit.low_watermarks.items():
            if not 0 <= shard < self.shards or low > self.heads[shard] + 1:
                raise CorruptionError(
                    path, f"low watermark {low} of shard {shard} is past its head"
                )
            self.lows[shard] = max(self.lows[shard], low)
        for segment in commit.remove:
            if segment.last_sequence >= self.lows[segment.shard]:
                raise CorruptionError(
                    path, f"truncation removes {segment.path}, which is not below the low watermark"
                )

    def _apply_compact(self, commit: CommitRecord, path: str) -> None:
        """Merged segments cover exactly the sequences they replace."""
        _check_compaction(commit, path)

    _HANDLERS: ClassVar[dict[str, Callable[[LogState, CommitRecord, str], None]]] = {
        APPEND: _apply_append,
        TRUNCATE: _apply_truncate,
        COMPACT: _apply_compact,
    }

    def _note_gc_mark(self, version: int, cutoff_ms: int) -> None:
        self.gc_marks.append((version, cutoff_ms))
        if len(self.gc_marks) > MAX_KEPT_MARKS:
            forgotten, _ = self.gc_marks.pop(0)
            self.gc_known_since = max(self.gc_known_since, forgotten)

    def _rebase(self) -> None:
        """Once past a segment table's version (its writer has had its turn to write it),
        base the state on that table and forget the commits up to it."""
        if self._snapshots is None:
            return
        interval = self._snapshots.table_interval
        table = self.version - self.version % interval
        if self._base < table < self.version:
            self._since_base = [c for c in self._since_base if c.version > table]
            self._base, self._base_changes = table, None

    @property
    def gc_version(self) -> int:
        """The newest version at which a garbage collection may have begun (0: none)."""
        return max(self.gc_known_since, self.gc_marks[-1][0] if self.gc_marks else 0)

    def staged_files(
        self, start: StagingStart | None, now_ms: int, *, leased: bool = False
    ) -> StagedFiles:
        """What a writer that began staging at ``start`` must do about its staged files
        before committing on this state (:func:`replog.format.gc.judge`)."""
        return judge(
            start,
            marks=self.gc_marks,
            known_since=self.gc_known_since,
            now_ms=now_ms,
            leased=leased,
        )

    # -- segments ---------------------------------------------------------------------

    @property
    def segments(self) -> Lanes:
        """Live segments per shard, ordered by sequence (loaded on first use)."""
        if self._segments is None:
            assert self._snapshots is not None
            segments = [list(lane) for lane in self._snapshots.segments(self._base)]
            for commit in self._since_base:
                apply_segments(segments, commit)
            self._segments = segments
        return self._segments

    @property
    def snapshots(self) -> Snapshots | None:
        return self._snapshots

    def changes(self) -> SegmentChanges:
        """Segments added and removed since the segment table below this state's version
        (what a checkpoint between two tables records); only a state whose version is
        not a table version (or is one whose commit it applied last) keeps them."""
        if self._snapshots is None:
            raise ValueError("a state without snapshots keeps no changes")
        interval = self._snapshots.table_interval
        table = self._base - self._base % interval
        if self._base == table:
            changes = SegmentChanges(table)
        else:
            if self._base_changes is None:
                self._base_changes = self._snapshots.changes(self._base)
            changes = self._base_changes.copy()
        for commit in self._since_base:
            changes.apply(commit)
        return changes

    def changes_since(self, version: int) -> SegmentChanges:
        """Segments added and removed by the commits after ``version`` (a checkpoint at
        most one interval back: what the next checkpoint's changes file or its table's
        tombstones record)."""
        if self._snapshots is None:
            raise ValueError("a state without snapshots keeps no changes")
        if version < self._base:
            raise ValueError(f"commits after {version} are not held (based on {self._base})")
        changes = SegmentChanges(version)
        for commit in self._since_base:
            if commit.version > version:
                changes.apply(commit)
        return changes

    def covering(self, shard: int, first: int, last: int) -> list[SegmentInfo]:
        """Live segments of ``shard`` that hold any sequence in ``[first, last]``.

        Raises :class:`CorruptionError` if they leave a retained sequence of that range
        uncovered: live segments tile a shard from its low watermark to its head, so a
        gap means a damaged segment table or changes file, never a quiet skip.
        """
        lane = self.segments[shard]
        index = max(bisect.bisect_right(lane, first, key=lambda s: s.first_sequence) - 1, 0)
        result = []
        for segment in lane[index:]:
            if segment.first_sequence > last:
                break
            if segment.last_sequence >= first:
                result.append(segment)
        wanted, end = max(first, self.lows[shard]), min(last, self.heads[shard])
        for segment in result:
            if segment.first_sequence > wanted:
                break
            wanted = max(wanted, segment.last_sequence + 1)
        if wanted <= end:
            raise CorruptionError(
                f"shards/{shard:05d}",
                f"no live segment holds sequence {wanted} (retained: {self.lows[shard]}.."
                f"{self.heads[shard]}) at log version {self.version}: a snapshot's segment "
                f"table or changes file is damaged; run 'replog verify'",
            )
        return result

    def overlaps(
        self, shard: int, first: int, last: int
    ) -> Iterator[tuple[SegmentInfo, int, int, int]]:
        """For each live entry of ``shard`` overlapping ``[first, last]``: the entry, the
        overlap's first and last sequence, and the most events the overlap can hold
        (fewer than its sequences when key compaction left holes in the entry)."""
        if first > last:
            return
        for segment in self.covering(shard, first, last):
            low, high = max(first, segment.first_sequence), min(last, segment.last_sequence)
            yield segment, low, high, min(high - low + 1, segment.events)

    def events_between(self, shard: int, first: int, last: int) -> int:
        """At most how many events sequences ``[first, last]`` of ``shard`` hold: exact
        without holes, a holed entry counting at most its rows. Every reader that measures
        a backlog counts it here, so none counts a compacted range by its sequences."""
        return sum(events for *_, events in self.overlaps(shard, first, last))

    def is_live(self, segment: SegmentInfo) -> bool:
        """Whether ``segment`` is a live entry (same file and rows) of this state."""
        return index_of(self.segments[segment.shard], segment) is not None

    def live_paths(self) -> set[str]:
        return {segment.path for lane in self.segments for segment in lane}

    def heads_json(self) -> dict[str, int]:
        return {str(shard): head for shard, head in enumerate(self.heads)}

    def lows_json(self) -> dict[str, int]:
        return {str(shard): low for shard, low in enumerate(self.lows)}


def _covered(segments: tuple[SegmentInfo, ...]) -> dict[int, list[tuple[int, int]]]:
    """Per shard, the sequences ``segments`` cover as sorted disjoint ranges (adjacent ones
    joined). Raises ``ValueError`` if two of them share a sequence."""
    found: dict[int, list[tuple[int, int]]] = {}
    ranges = sorted((s.shard, s.first_sequence, s.last_sequence) for s in segments)
    for shard, first, last in ranges:
        covered = found.setdefault(shard, [])
        if covered and first <= covered[-1][1]:
            raise ValueError(f"two entries of shard {shard} hold sequence {first}")
        if covered and first == covered[-1][1] + 1:
            covered[-1] = (covered[-1][0], last)
        else:
            covered.append((first, last))
    return found


def _check_compaction(commit: CommitRecord, path: str) -> None:
    """A compaction must cover, per shard, exactly the sequences it removes: each once, no
    more, no fewer (the rows may be fewer: key compaction leaves holes)."""
    try:
        added, removed = _covered(commit.add), _covered(commit.remove)
    except ValueError as exc:
        raise CorruptionError(path, f"compaction: {exc}") from exc
    if added != removed:
        raise CorruptionError(
            path, "compaction adds segments that do not cover exactly the sequences it removes"
        )
