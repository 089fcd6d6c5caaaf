"""Read planning: how far a micro-batch goes, and how its events are split into tasks.

Pure functions over a :class:`~replog.format.state.LogState`; the Spark source only adapts
Spark's calls to them. Costs depend on the shards and the segments in the planned range,
never on the age of the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from replog.errors import DataLossError
from replog.format.segments import SegmentInfo
from replog.format.state import LogState
from replog.offsets import Offsets

logger = logging.getLogger(__name__)

RowSequences = Callable[[SegmentInfo], np.ndarray]
"""The sequence of each row of a live entry (a holed entry's read from its file)."""


@dataclass(frozen=True)
class ReadTask:
    """Events ``[first, last]`` of one shard and the segments that hold them."""

    shard: int
    first: int
    last: int
    segments: tuple[SegmentInfo, ...]

    @property
    def events(self) -> int:
        return self.last - self.first + 1


def cap_events(
    start: Offsets,
    target: Offsets,
    max_events: int,
    state: LogState | None = None,
    sequences: RowSequences | None = None,
) -> Offsets:
    """Advance from ``start`` towards ``target`` by about ``max_events`` in all, fairly.

    Every shard with a backlog is admitted in every batch: the budget is filled like
    water, smallest backlogs first, so a shard holding one event is never starved by a
    shard a million behind. When there are more backlogged shards than ``max_events``,
    each still gets one event (the limit is exceeded by at most shards - 1, as Kafka's
    source does for its partitions).

    With ``state``, backlogs count events, not sequences: a range key compaction left
    holes in holds fewer events than sequences (:meth:`LogState.events_between`), so a batch
    crosses it at the full rate rather than at the rate of the holes, and never reads
    more than its share (:func:`advance`, given ``sequences``). A shard whose backlog
    holds no event moves to its target at no cost.
    """
    backlog = {}
    for shard in target:
        first, last = start.get(shard, 0) + 1, target[shard]
        backlog[shard] = (
            max(last - first + 1, 0) if state is None else state.events_between(shard, first, last)
        )
    waiting = sorted((pending, shard) for shard, pending in backlog.items() if pending > 0)
    if sum(pending for pending, _ in waiting) <= max_events:
        return {shard: max(target[shard], start.get(shard, 0)) for shard in target}
    grant = dict.fromkeys(target, 0)
    budget = max(max_events, len(waiting))
    for index, (pending, shard) in enumerate(waiting):
        share = max(budget // (len(waiting) - index), 1)
        grant[shard] = min(pending, share)
        budget -= grant[shard]
    if state is None:
        return {shard: start.get(shard, 0) + grant[shard] for shard in target}
    return {
        shard: advance(
            state, shard, start.get(shard, 0), target[shard], grant[shard], sequences=sequences
        )
        if backlog[shard]
        else max(target[shard], start.get(shard, 0))
        for shard in target
    }


def advance(
    state: LogState,
    shard: int,
    after: int,
    last: int,
    events: int,
    *,
    sequences: RowSequences | None = None,
) -> int:
    """The offset of ``shard`` that reads at most ``events`` events after offset
    ``after`` (and not past ``last``): whole entries while they fit; inside a holed
    entry, the sequence of its ``events``-th row given its rows' ``sequences`` (read
    from its file), else as many sequences as events remain (slower, never more)."""
    position = after
    for segment, low, high, held in state.overlaps(shard, after + 1, last):
        if held > events:
            if sequences is None:
                return low - 1 + events
            found = sequences(segment)
            index = int(np.searchsorted(found, low, side="left")) + events - 1
            return int(found[index]) if events else low - 1
        events -= held
        position = high
        if events == 0:
            break
    return position


def events_for_bytes(state: LogState, start: Offsets, target: Offsets, max_bytes: int) -> int:
    """How many events of the backlog fit in ``max_bytes`` of segment data (at least 1).

    Uses each segment's stored (compressed) size per event, read from the commit
    metadata: no segment is opened.
    """
    total_bytes = 0.0
    total_events = 0
    for shard, end in target.items():
        for segment, low, high, held in state.overlaps(shard, start.get(shard, 0) + 1, end):
            total_bytes += segment.bytes * (high - low + 1) / segment.sequences
            total_events += held  # a holed entry holds fewer events than sequences
    if total_events == 0 or total_bytes <= max_bytes:
        return max(total_events, 1)
    return max(int(max_bytes / (total_bytes / total_events)), 1)


def check_data_loss(state: LogState, start: Offsets, *, fail_on_data_loss: bool) -> Offsets:
    """``start`` with shards whose next event was removed by retention moved forward.

    Raises :class:`DataLossError` unless ``fail_on_data_loss`` is False, in which case
    the skip is logged as a warning.
    """
    adjusted = dict(start)
    for shard, low in enumerate(state.lows):
        wanted = start.get(shard, 0) + 1
        if wanted < low and state.heads[shard] >= low - 1:
            if fail_on_data_loss:
                raise DataLossError(shard, wanted, low)
            logger.warning(
                "shard %d: events %d..%d were removed by retention; skipping to %d "
                "(failOnDataLoss=false)",
                shard,
                wanted,
                low - 1,
                low,
            )
            adjusted[shard] = low - 1
    return adjusted


def plan_tasks(
    state: LogState, start: Offsets, end: Offsets, max_events_per_task: int
) -> list[ReadTask]:
    """Split ``(start, end]`` into tasks of at most ``max_events_per_task`` events.

    Tasks follow segment boundaries where they can, so most tasks open whole segments.
    """
    tasks: list[ReadTask] = []
    for shard in sorted(end):
        first, last = start.get(shard, 0) + 1, end[shard]
        if first > last:
            continue
        pending: list[SegmentInfo] = []
        task_first = first
        count = 0
        for segment in state.covering(shard, first, last):
            seg_first = max(first, segment.first_sequence)
            seg_last = min(last, segment.last_sequence)
            position = seg_first
            while position <= seg_last:
                room = max_events_per_task - count
                take = min(room, seg_last - position + 1)
                pending.append(segment)
                count += take
                position += take
                if count >= max_events_per_task:
                    tasks.append(ReadTask(shard, task_first, position - 1, tuple(pending)))
                    pending, count, task_first = [], 0, position
        if count:
            tasks.append(ReadTask(shard, task_first, last, tuple(pending)))
    return tasks


PACK_BELOW_EVENTS = 10_000
"""Tasks smaller than this share a Spark partition with other small ones."""
PACKED_PARTITION_EVENTS = 50_000


def pack(tasks: list[ReadTask], max_events_per_partition: int) -> list[tuple[ReadTask, ...]]:
    """Group tasks into Spark partitions: large tasks alone, small ones together.

    A Spark task costs tens of milliseconds whatever it reads, and a replog-sink that
    writes the micro-batch stages one file per task and shard: a 1,000-event batch over
    8 shards is one partition, not 8 (8 files staged, not 64).
    """
    limit = min(PACKED_PARTITION_EVENTS, max_events_per_partition)
    partitions: list[tuple[ReadTask, ...]] = []
    small: list[ReadTask] = []
    count = 0
    for task in tasks:
        if task.events >= PACK_BELOW_EVENTS:
            partitions.append((task,))
            continue
        if small and count + task.events > limit:
            partitions.append(tuple(small))
            small, count = [], 0
        small.append(task)
        count += task.events
    if small:
        partitions.append(tuple(small))
    return partitions
