"""Positions (replog.offsets) and micro-batch planning (replog.planning)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replog.errors import InvalidOptionError, LogIdentityError
from replog.log import ReplicationLog
from replog.offsets import for_timestamp, parse_offsets_json, resolve
from replog.planning import cap_events
from replog.spark.offsets import SparkOffset
from replog.timeutil import check_epoch_ms

T0 = 1_750_000_000_000  # 2025-06-15, epoch milliseconds


def timed_log(url: str, stamps: list[list[int]]) -> ReplicationLog:
    """One shard; one commit (segment) per inner list of event times (ms)."""
    log = ReplicationLog.create(url, 1)
    n = 0
    for commit in stamps:
        log.append([{"key": "k", "data": {"n": (n := n + 1)}, "timestamp": t} for t in commit])
    return log


def test_starting_timestamp_finds_the_first_event_at_or_after_it(tmp_path: Path) -> None:
    log = timed_log(str(tmp_path / "log"), [[T0, T0 + 10], [T0 + 20, T0 + 30], [T0 + 40]])
    state = log.refresh()
    assert for_timestamp(log, state, T0) == {0: 0}
    assert for_timestamp(log, state, T0 + 11) == {0: 2}  # event 3 is the first >= T0+11
    assert for_timestamp(log, state, T0 + 30) == {0: 3}
    assert for_timestamp(log, state, T0 + 41) == {0: 5}  # none: the head


def test_non_monotonic_times_start_at_the_first_event_in_sequence_order(tmp_path: Path) -> None:
    log = timed_log(str(tmp_path / "log"), [[T0 + 50, T0], [T0 + 60]])
    # Event 1 (T0+50) is the first at or after T0+40; event 2 (T0) still follows it.
    assert for_timestamp(log, log.refresh(), T0 + 40) == {0: 0}
    assert resolve(log, "", "startingTimestamp", timestamp_ms=T0 + 55) == {0: 2}


def test_segments_older_than_the_timestamp_are_not_read(tmp_path: Path, monkeypatch) -> None:
    log = timed_log(str(tmp_path / "log"), [[T0], [T0 + 1], [T0 + 100]])
    read: list[str] = []
    from replog import offsets as offsets_module

    original = offsets_module.read_stored

    def counting(storage, segment):
        read.append(segment.path)
        return original(storage, segment)

    monkeypatch.setattr(offsets_module, "read_stored", counting)
    assert for_timestamp(log, log.refresh(), T0 + 50) == {0: 2}
    assert len(read) == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1_700_000_000, "seconds"),
        (1_700_000_000_000_000, "microseconds"),
        (-5, "before 1970"),
    ],
)
def test_epoch_milliseconds_in_the_wrong_unit_are_refused(value: int, message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message) as info:
        check_epoch_ms(value, "startingTimestamp")
    assert "startingTimestamp" in str(info.value)


def test_offsets_json_errors_name_the_option_and_value() -> None:
    assert parse_offsets_json('{"1": 4}', 3, "startingOffsets") == {0: 0, 1: 4, 2: 0}
    for text, message in [
        ("earliest!", "neither a keyword nor valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"x": 1}', "'x' is not a shard number"),
        ('{"7": 1}', "shard 7 does not exist"),
        ('{"0": -1}', "expected the last processed sequence"),
    ]:
        with pytest.raises(InvalidOptionError, match="startingOffsets") as info:
            parse_offsets_json(text, 3, "startingOffsets")
        assert message in str(info.value)


def test_a_spark_offset_for_another_log_or_past_the_head_is_refused(tmp_path: Path) -> None:
    log = timed_log(str(tmp_path / "log"), [[T0, T0]])
    state = log.refresh()
    SparkOffset({0: 2}, 1, log.log_id).check_log(log, state)
    with pytest.raises(LogIdentityError, match="recreated"):
        SparkOffset({0: 1}, 1, "another-log").check_log(log, state)
    with pytest.raises(LogIdentityError, match="past the log's head"):
        SparkOffset({0: 9}, 1, log.log_id).check_log(log, state)
    document = SparkOffset({0: 2}, 1, log.log_id, "query-abc").to_json()
    assert SparkOffset.from_json(document).consumer == "query-abc"


def test_capped_batches_admit_every_backlogged_shard() -> None:
    start = {0: 0, 1: 0, 2: 0}
    target = {0: 1_000_000, 1: 1, 2: 5}
    capped = cap_events(start, target, 100)
    assert capped[1] == 1 and capped[2] == 5  # small backlogs are never starved
    assert sum(capped.values()) == 100
    assert cap_events(start, {0: 10, 1: 10, 2: 10}, 2) == {0: 1, 1: 1, 2: 1}  # >= 1 each
    assert cap_events(start, target, 10**9) == target


def test_small_tasks_share_a_partition_large_ones_stand_alone() -> None:
    from replog.planning import PACK_BELOW_EVENTS, ReadTask, pack

    small = [ReadTask(shard, 1, 100, ()) for shard in range(8)]
    assert pack(small, 500_000) == [tuple(small)]
    big = ReadTask(9, 1, PACK_BELOW_EVENTS, ())
    assert pack([small[0], big, small[1]], 500_000) == [(big,), (small[0], small[1])]
    assert pack(small, 150) == [(task,) for task in small]  # maxEventsPerPartition holds
