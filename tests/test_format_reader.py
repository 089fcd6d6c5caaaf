"""FORMAT.md is precise enough for a second implementation: a reader written from it
alone (tests/independent/format_reader.py, which imports nothing of replog) reads every
log replog writes, and agrees with replog event for event."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from independent.format_reader import read_log

from replog.core import history
from replog.log import ReplicationLog
from replog.ops import compaction, retention

V2_LOG = Path(__file__).parent / "data" / "v2log"
"""A log written by replog 0.3 (format 2): 24 appends, a compaction and a truncation."""


def events(c: int, n: int = 10) -> list[dict[str, Any]]:
    return [
        {
            "key": f"k{(c * n + j) % 37}",
            "data": {"n": c * n + j},
            "collection": "orders",
            "operation": ("insert", "update", "delete")[j % 3],
            "metadata": {"c": c},
            "before": None if j % 2 else {"old": j},
        }
        for j in range(n)
    ]


def replog_view(url: str) -> dict[str, Any]:
    log = ReplicationLog.open(url)
    state = log.refresh()
    rows = log.read_all().to_pylist()
    return {
        "log_id": log.log_id,
        "version": state.version,
        "heads": dict(enumerate(state.heads)),
        "lows": dict(enumerate(state.lows)),
        "events": [
            {**row, "timestamp": int(row["timestamp"].timestamp() * 1_000_000)} for row in rows
        ],
    }


def assert_same(log: ReplicationLog) -> None:
    log.flush()  # no merge of its own lands between the two reads
    url = log.url
    mine, theirs = replog_view(url), read_log(url)
    for member in ("log_id", "version", "heads", "lows"):
        assert theirs[member] == mine[member], member
    assert len(theirs["events"]) == len(mine["events"]) > 0
    for expected, found in zip(mine["events"], theirs["events"], strict=True):
        assert {k: found[k] for k in expected} == expected


def test_small_commits_merged_as_they_go(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 8, snapshot_interval=20)
    for c in range(130):
        log.append(events(c))
    assert_same(log)


def test_a_big_write_between_small_ones_and_a_full_compaction(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 4, snapshot_interval=20)
    for c in range(15):
        log.append(events(c))
    log.append([{"key": f"b{i % 50}", "data": {"n": i, "pad": "y" * 900}} for i in range(5000)])
    for c in range(15, 45):
        log.append(events(c))
    assert_same(log)
    compaction.compact(log)
    assert_same(log)


def test_expired_history_and_a_truncation(tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "log"), 4, snapshot_interval=20, retention_ms=1000)
    for c in range(50):
        log.append(events(c))
    time.sleep(1.1)
    for c in range(50, 110):
        log.append(events(c))
    heads = log.head()
    retention.truncate(log, {s: max(h - 20, 1) for s, h in heads.items()}, force=True)
    log.append(events(999))
    log.flush()  # retention runs in the writer's background thread
    assert log.refresh().retained_from > 0
    assert_same(log)


def test_a_log_written_by_replog_0_3_and_then_by_this_replog(tmp_path: Path) -> None:
    url = str(tmp_path / "v2log")
    shutil.copytree(V2_LOG, url)
    descriptor = json.loads((Path(url) / "_replog" / "log.json").read_bytes())
    assert descriptor["format_version"] == 2
    before = replog_view(url)
    assert before["version"] == 26 and before["lows"][0] == 3
    log = ReplicationLog.open(url)
    assert_same(log)
    for c in range(40):
        log.append(events(100 + c, 3))
    assert_same(log)
    assert len(replog_view(url)["events"]) == len(before["events"]) + 120


# -- hints that name deleted headers --------------------------------------------------------


@pytest.mark.parametrize("stale", [0, 20])
def test_a_hint_moved_back_past_retention_still_finds_the_log(tmp_path: Path, stale: int) -> None:
    """A slow writer can move the hint back to a header that retention has since deleted
    (or to 0): readers must not see an empty or broken log."""
    log = ReplicationLog.create(str(tmp_path / "log"), 4, snapshot_interval=20, retention_ms=1000)
    for c in range(50):
        log.append(events(c))
    time.sleep(1.1)
    for c in range(50, 110):
        log.append(events(c))
    log.flush()
    expected = replog_view(log.url)
    assert not log.storage.exists(history.header_path(20))
    log.storage.write(history.SNAPSHOT_HINT_PATH, json.dumps({"version": stale}).encode())
    assert replog_view(log.url) == expected
