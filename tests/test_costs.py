"""Costs that must not grow with the log: applying a commit, planning a merge, finding a
segment. Counted in executed lines of replog's code (``sys.settrace``), never in time:
a step that visits every live segment shows up as a count that grows with the log."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import replog
from replog.format.commits import APPEND, COMPACT, CommitRecord
from replog.format.lanes import SegmentChanges
from replog.format.segments import SegmentInfo
from replog.format.state import LogState
from replog.merges import plan_auto

SOURCE = str(Path(replog.__file__).parent)
SHARDS = 4


def lines_run(action: Callable[[], Any]) -> int:
    """How many lines of replog's own code ``action`` executes."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if not frame.f_code.co_filename.startswith(SOURCE):
            return None
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        action()
    finally:
        sys.settrace(None)
    return count


def entry(shard: int, first: int, events: int, size: int, name: str) -> SegmentInfo:
    return SegmentInfo(
        path=f"shards/{shard:05d}/{name}.arrow",
        shard=shard,
        first_sequence=first,
        last_sequence=first + events - 1,
        bytes=size,
        sha256="0" * 64,
        min_timestamp_ms=0,
        max_timestamp_ms=0,
    )


def aged_state(segments_per_shard: int) -> LogState:
    """A state whose lanes hold ``segments_per_shard`` big segments each (an old log),
    then a tail of small ones, built by applying commits as a reader does."""
    state = LogState(shards=SHARDS)
    for index in range(segments_per_shard):
        add = tuple(
            entry(shard, index * 1000 + 1, 1000, 60 * 1024 * 1024, f"big-{index}")
            for shard in range(SHARDS)
        )
        state.apply(CommitRecord.after(state.version, APPEND, add=add))
    for index in range(7):  # a tier of small files, one short of a merge
        first = segments_per_shard * 1000 + index * 10 + 1
        add = tuple(entry(shard, first, 10, 2000, f"small-{index}") for shard in range(SHARDS))
        state.apply(CommitRecord.after(state.version, APPEND, add=add))
    return state


def small_append(state: LogState) -> CommitRecord:
    add = tuple(
        entry(shard, state.heads[shard] + 1, 10, 2000, f"new-{state.version}")
        for shard in range(SHARDS)
    )
    return CommitRecord.after(state.version, APPEND, add=add)


def tail_merge(state: LogState) -> CommitRecord:
    """A compaction of each lane's last 8 segments into one."""
    removed = tuple(s for lane in state.segments for s in lane[-8:])
    added = tuple(
        entry(shard, lane[-8].first_sequence, lane[-1].last_sequence - lane[-8].first_sequence + 1,
              16_000, f"merged-{state.version}")
        for shard, lane in enumerate(state.segments)
    )  # fmt: skip
    return CommitRecord.after(state.version, COMPACT, add=added, remove=removed)


def costs(segments_per_shard: int) -> dict[str, int]:
    state = aged_state(segments_per_shard)
    changes = SegmentChanges(0)
    found: dict[str, int] = {}
    append = small_append(state)
    found["apply an append"] = lines_run(lambda: state.apply(append))
    found["plan a merge"] = lines_run(lambda: plan_auto(state))
    merge = tail_merge(state)
    found["apply a compaction"] = lines_run(lambda: state.apply(merge))
    found["track changes"] = lines_run(lambda: (changes.apply(append), changes.apply(merge)))
    found["find a segment"] = lines_run(lambda: state.covering(0, 500, 600))
    return found


def test_applying_and_planning_cost_the_same_on_a_young_and_an_old_log() -> None:
    young, old = costs(100), costs(3200)  # 32 times more live segments
    for step, count in young.items():
        # binary searches may take a few more steps; a scan of the lanes takes 32x
        assert old[step] <= count * 1.25 + 20, (step, count, old[step])


@pytest.mark.parametrize("segments_per_shard", [100])
def test_the_counter_sees_a_scan_of_the_lanes(segments_per_shard: int) -> None:
    """The counter is able to fail: a step that visits every live segment is counted."""
    state = aged_state(segments_per_shard)
    scan = lines_run(state.live_paths)
    assert scan >= segments_per_shard * SHARDS
