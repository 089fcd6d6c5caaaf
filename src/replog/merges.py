"""Which segment files to merge: the tiered policy writers apply after their commits, and
the full compaction operators run (pure: plans over a state, no I/O).

Small writes leave small files. Every commit's writer looks at the files its commit left
near the end of each shard and merges those of one size tier once ``fan_in`` of them
are there (as Delta's auto compaction and an LSM tree's size tiers do), so a log of
100,000 small commits holds a few dozen small files, not 100,000, and every event is
rewritten about log(fan_in, size) times. Files with rows of several shards (*shared*
files: small writes) are merged into a shared file until the merged rows are big
enough to be worth a file per shard; files of one shard are merged per shard, up to
the target size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from replog.errors import InvalidOptionError
from replog.format.segments import MAX_SEGMENT_EVENTS, SegmentInfo
from replog.format.state import LogState

DEFAULT_TARGET_BYTES = 64 * 1024 * 1024
"""Merged files grow to about this size (stored bytes)."""
FAN_IN = 8
"""Files of one tier merged at once."""
TIER_BASE_BYTES = 16 * 1024
"""Files below this size are tier 0; tier n + 1 holds files ``fan_in`` times larger."""
GRADUATE_BYTES = 8 * 1024 * 1024
"""Shared files that together hold this much are merged into a file per shard."""
CHECK_INTERVAL = 4
"""The writer of every version divisible by this looks for a full tier to merge."""


@dataclass(frozen=True)
class Merge:
    """Live segment entries to rewrite together: into one shared file (``shared``), or
    into one file per shard."""

    sources: tuple[SegmentInfo, ...]
    shared: bool = False

    @property
    def events(self) -> int:
        return sum(segment.events for segment in self.sources)

    @property
    def bytes(self) -> int:
        return sum(segment.bytes for segment in self.sources)

    @property
    def files(self) -> int:
        return len({segment.path for segment in self.sources})

    @property
    def shards(self) -> list[int]:
        return sorted({segment.shard for segment in self.sources})


@dataclass(frozen=True)
class FileGroup:
    """A live file and those of its live entries a plan looks at."""

    path: str
    entries: tuple[SegmentInfo, ...]

    @property
    def bytes(self) -> int:
        return sum(entry.bytes for entry in self.entries)

    @property
    def events(self) -> int:
        return sum(entry.events for entry in self.entries)

    @property
    def shards(self) -> set[int]:
        return {entry.shard for entry in self.entries}


def tier(size: int, *, fan_in: int = FAN_IN, base: int = TIER_BASE_BYTES) -> int:
    """The size tier of a file of ``size`` stored bytes."""
    if size < base:
        return 0
    return 1 + int(math.log(size / base, fan_in))


def _tails(state: LogState, small: int) -> list[SegmentInfo]:
    """The entries at the end of each lane, back to the first one of ``small`` bytes or
    more: what recent writes left (bounded by the tiers, whatever the log's age)."""
    found = []
    for lane in state.segments:
        for segment in reversed(lane):
            if segment.bytes >= small or segment.holed:
                break
            found.append(segment)
    return found


def _groups(entries: Iterable[SegmentInfo]) -> list[FileGroup]:
    by_path: dict[str, list[SegmentInfo]] = {}
    for entry in entries:
        by_path.setdefault(entry.path, []).append(entry)
    return [FileGroup(path, tuple(found)) for path, found in by_path.items()]


def _full_tier(
    groups: Sequence[FileGroup], fan_in: int, base: int, max_bytes: int, max_events: int
) -> list[FileGroup] | None:
    """The lowest tier holding ``fan_in`` files or more (at most ``max_bytes`` and
    ``max_events`` of them, smallest first); None if no tier is full."""
    tiers: dict[int, list[FileGroup]] = {}
    for group in groups:
        tiers.setdefault(tier(group.bytes, fan_in=fan_in, base=base), []).append(group)
    for level in sorted(tiers):
        chosen: list[FileGroup] = []
        size = events = 0
        for group in sorted(tiers[level], key=lambda g: g.bytes):
            if chosen and (size + group.bytes > max_bytes or events + group.events > max_events):
                break
            chosen.append(group)
            size, events = size + group.bytes, events + group.events
        if len(chosen) >= fan_in:
            return chosen
    return None


def _merge(groups: Iterable[FileGroup], *, shared: bool) -> Merge:
    sources = sorted(
        (entry for group in groups for entry in group.entries),
        key=lambda s: (s.shard, s.first_sequence),
    )
    return Merge(tuple(sources), shared=shared)


def plan_auto(
    state: LogState,
    *,
    fan_in: int = FAN_IN,
    base_bytes: int = TIER_BASE_BYTES,
    graduate_bytes: int = GRADUATE_BYTES,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    max_events: int = MAX_SEGMENT_EVENTS,
) -> Merge | None:
    """The merge a writer runs after its commit: the lowest full tier of shared files,
    else of one shard's files; None when no tier is full. One merge per commit keeps a
    writer's latency bounded; the next commit takes the next tier."""
    groups = _groups(_tails(state, target_bytes // fan_in))
    shared = [group for group in groups if len(group.shards) > 1]
    # Shared files graduate into a file per shard: each shard's part stays within limits.
    chosen = _full_tier(shared, fan_in, base_bytes, target_bytes, max_events * len(state.heads))
    if chosen is not None:
        return _merge(chosen, shared=sum(g.bytes for g in chosen) < graduate_bytes)
    by_shard: dict[int, list[FileGroup]] = {}
    for group in groups:
        if len(group.shards) == 1:
            by_shard.setdefault(next(iter(group.shards)), []).append(group)
    for shard in sorted(by_shard):
        chosen = _full_tier(by_shard[shard], fan_in, base_bytes, target_bytes, max_events)
        if chosen is not None:
            return _merge(chosen, shared=False)
    return None


def check_limits(target_bytes: int, max_events: int) -> None:
    """:class:`InvalidOptionError` naming a compaction limit below 1."""
    for name, value in (("--target-bytes", target_bytes), ("max events", max_events)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidOptionError(f"compaction's {name} must be at least 1, got {value!r}")


def plan_full(
    state: LogState,
    *,
    target_bytes: int = DEFAULT_TARGET_BYTES,
    max_events: int = MAX_SEGMENT_EVENTS,
) -> list[Merge]:
    """What ``replog compact`` merges: per shard, greedy runs of consecutive entries that
    together stay within both limits, into one file each. A single entry is rewritten
    too when its file holds other shards' rows (a shared file), so a compacted shard is
    read from files of its own. Holed entries (key compaction's) are left alone.

    Raises :class:`InvalidOptionError` for a limit below 1."""
    check_limits(target_bytes, max_events)
    file_shards: dict[str, set[int]] = {}
    for lane in state.segments:
        for entry in lane:
            file_shards.setdefault(entry.path, set()).add(entry.shard)

    def worth_merging(run: list[SegmentInfo]) -> bool:
        if any(entry.holed for entry in run):
            return False
        return len(run) >= 2 or (len(run) == 1 and len(file_shards[run[0].path]) > 1)

    merges = []
    for lane in state.segments:
        run: list[SegmentInfo] = []
        size = events = 0
        for segment in lane:
            if run and (
                segment.holed  # key compaction rewrites those (merges keep rows dense)
                or run[-1].holed
                or size + segment.bytes > target_bytes
                or events + segment.events > max_events
            ):
                if worth_merging(run):
                    merges.append(Merge(tuple(run)))
                run, size, events = [], 0, 0
            run.append(segment)
            size, events = size + segment.bytes, events + segment.events
        if worth_merging(run):
            merges.append(Merge(tuple(run)))
    return merges
