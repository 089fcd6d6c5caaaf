"""Kafka's habits for offsets (issue 23): ``consumer set --to-datetime/--shift-by/
--by-duration``, ISO 8601 ``startingTimestamp``, and option errors that state the
offset semantics of batch reads (exclusive start, inclusive end: the reverse of Kafka)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import replog

from replog.errors import InvalidOptionError
from replog.log import ReplicationLog
from replog.offsets import parse_offsets_json
from replog.spark.options import SourceOptions
from replog.timeutil import duration_ms, instant_ms, iso_instant_ms, now_ms

T0 = 1_750_000_000_000  # 2025-06-15T15:06:40Z
T0_ISO = "2025-06-15T15:06:40Z"


def offsets(url: str, name: str = "etl") -> dict[str, int]:
    shown = replog("consumer", "show", url, "--consumer", name, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)["offsets"]


def timed(url: str, stamps: list[int]) -> str:
    """A one-shard log with one event per time in ``stamps``."""
    log = ReplicationLog.create(url, 1)
    log.append([{"key": "k", "data": {"n": i}, "timestamp": t} for i, t in enumerate(stamps)])
    return url


def test_iso_instants_and_durations() -> None:
    assert iso_instant_ms(T0_ISO, "x") == T0
    assert iso_instant_ms("2025-06-15T17:06:40+02:00", "x") == T0
    assert iso_instant_ms("2025-06-15T15:06:40", "x") == T0  # no offset: UTC
    assert iso_instant_ms("2025-06-15T15:06:40.250Z", "x") == T0 + 250
    assert instant_ms(str(T0), "x") == T0 and instant_ms(T0_ISO, "x") == T0
    assert duration_ms("PT1H", "x") == 3_600_000 and duration_ms("P1DT30M", "x") == 88_200_000
    assert duration_ms("PT0.5S", "x") == 500 and duration_ms("90s", "x") == 90_000
    for bad in ("P", "PT", "1 hour"):
        with pytest.raises(InvalidOptionError, match=r"--by-duration: .* is not a duration"):
            duration_ms(bad, "--by-duration")
    with pytest.raises(InvalidOptionError, match="'yesterday' is not an ISO 8601 time"):
        instant_ms("yesterday", "startingTimestamp")


def test_starting_timestamp_takes_iso_8601_as_well_as_milliseconds() -> None:
    for given in (str(T0), T0_ISO, "2025-06-15T17:06:40+02:00"):
        parsed = SourceOptions.parse({"path": "/l", "startingTimestamp": given})
        assert parsed.starting_timestamp_ms == T0
    with pytest.raises(InvalidOptionError, match="startingTimestamp: '15/06/2025'"):
        SourceOptions.parse({"path": "/l", "startingTimestamp": "15/06/2025"})
    with pytest.raises(InvalidOptionError, match="looks like seconds"):
        SourceOptions.parse({"path": "/l", "startingTimestamp": "1750000000"})


def test_offset_errors_state_exclusive_start_and_inclusive_end() -> None:
    with pytest.raises(InvalidOptionError, match="starts after it - exclusive, unlike Kafka"):
        SourceOptions.parse({"path": "/l", "startingOffsets": "first"}, streaming=False)
    with pytest.raises(InvalidOptionError, match="the last sequence to read - inclusive"):
        SourceOptions.parse({"path": "/l", "endingOffsets": "end"}, streaming=False)
    with pytest.raises(InvalidOptionError, match=r"to read \(inclusive, unlike Kafka"):
        parse_offsets_json('{"0": -1}', 1, "endingOffsets")
    with pytest.raises(InvalidOptionError, match=r"starts after it, unlike Kafka"):
        parse_offsets_json('{"0": "x"}', 1, "startingOffsets")


def test_consumer_set_to_datetime(tmp_path: Path) -> None:
    url = timed(str(tmp_path / "log"), [T0 - 2000, T0 - 1000, T0, T0 + 1000])
    dry = replog("consumer", "set", url, "--consumer", "etl", "--to-datetime", T0_ISO, "--create")
    assert dry.returncode == 0, dry.stderr
    done = replog(
        "consumer", "set", url, "--consumer", "etl", "--create", "--execute",
        "--to-datetime", "2025-06-15T17:06:40+02:00",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert offsets(url) == {"0": 2}  # before event 3, the first at or after T0
    bad = replog("consumer", "set", url, "--consumer", "etl", "--to-datetime", "noon")
    assert bad.returncode == 2 and "--to-datetime: 'noon' is not an ISO 8601 time" in bad.stderr


def test_consumer_set_by_duration(tmp_path: Path) -> None:
    now = now_ms()
    hour = 3_600_000
    url = timed(str(tmp_path / "log"), [now - 3 * hour, now - 2 * hour, now - hour // 2])
    for duration, expected in (("PT1H", 2), ("150m", 1), ("P1D", 0)):
        done = replog(
            "consumer", "set", url, "--consumer", "etl", "--create", "--execute",
            "--by-duration", duration,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert offsets(url) == {"0": expected}, duration
    bad = replog("consumer", "set", url, "--consumer", "etl", "--by-duration", "soon")
    assert bad.returncode == 2 and "--by-duration: 'soon' is not a duration" in bad.stderr


def test_consumer_set_shift_by_stays_between_earliest_and_latest(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 2)
    log.append([{"key": f"k{i}", "data": {"n": i}} for i in range(40)])
    heads = dict(enumerate(log.refresh().heads))
    orphan = replog("consumer", "set", url, "--consumer", "etl", "--shift-by", "1", "--create")
    assert orphan.returncode == 2 and "no committed offsets to shift" in orphan.stderr
    start = json.dumps({"0": 2, "1": 3})
    replog("consumer", "set", url, "--consumer", "etl", "--offsets", start, "--create", "--execute")
    shifted = replog("consumer", "set", url, "--consumer", "etl", "--shift-by", "5", "--execute")
    assert shifted.returncode == 0, shifted.stderr
    assert offsets(url) == {"0": 7, "1": 8}
    replog("consumer", "set", url, "--consumer", "etl", "--shift-by", "-6", "--execute")
    assert offsets(url) == {"0": 1, "1": 2}
    replog("consumer", "set", url, "--consumer", "etl", "--shift-by", "-100", "--execute")
    assert offsets(url) == {"0": 0, "1": 0}  # earliest
    replog("consumer", "set", url, "--consumer", "etl", "--shift-by", "1000", "--execute")
    assert offsets(url) == {str(s): h for s, h in heads.items()}  # latest
    two = replog("consumer", "set", url, "--consumer", "etl", "--shift-by", "1", "--to-latest")
    assert two.returncode == 2 and "exactly one target" in two.stderr
