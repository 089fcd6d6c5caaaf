"""``replog history``: every kind of commit described from its record, newest first."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import replog
from support.logs import commit_offsets, filled_log, log_rows

from replog.capture.options import capture_app_id
from replog.checkpoints.sinks import Batch, SinkCommitter
from replog.format.commits import Transaction
from replog.log import ReplicationLog
from replog.ops import compaction, history, keys, recovery, retention


def test_each_kind_of_commit_and_who_wrote_it(tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    log = filled_log(url, commits=2, per_commit=10, shards=2, auto_compact=False)  # 1, 2
    log.append([{"key": "t", "data": {}}], transaction=Transaction("nightly", 7))  # 3
    log.append(
        [{"key": "c", "data": {}}], transaction=Transaction(capture_app_id("shop"), 0x4B80238)
    )
    since = log.refresh().version
    SinkCommitter(log, "s1").commit(  # 5
        Batch("q-1", 3, tuple(log.stage(log_rows(4, 900))), since_version=since)
    )
    compaction.compact(log)  # 6
    commit_offsets(log, "etl", dict(enumerate(log.refresh().heads)))
    keys.compact_by_key(log)  # 7
    retention.truncate(log, {0: 3, 1: 3})  # 8
    recovery.recover(log, grace_ms=0)  # 9: a gc mark
    described = history.log_history(ReplicationLog.open(url))
    kinds = [entry.kind for entry in described.entries]
    assert kinds == [
        "gc", "truncate", "key-compact", "compact", "sink", "capture", "transaction",
        "append", "append",
    ]  # fmt: skip
    by_kind = {entry.kind: entry.to_json() for entry in described.entries}
    assert by_kind["transaction"]["transaction"] == {"app_id": "nightly", "version": 7}
    assert by_kind["capture"]["capture"] == {"slot": "shop", "lsn": "0/4B80238"}
    assert by_kind["sink"]["sink"]["sink_id"] == "s1" and by_kind["sink"]["sink"]["epoch"] == 3
    assert by_kind["append"]["events_added"] == 10 and by_kind["append"]["files_added"] == 1
    merged = by_kind["compact"]
    assert merged["events_added"] == merged["events_removed"] > 0
    assert merged["files_removed"] > merged["files_added"]
    assert by_kind["truncate"]["low_watermarks"] == {"0": 3, "1": 3}
    assert by_kind["gc"]["gc_cutoff_ms"] is not None
    text = replog("history", url).stdout.splitlines()
    assert text[0].split()[:3] == ["version", "time", "(UTC)"]
    assert "app nightly version 7" in text[7] and "slot shop at LSN 0/4B80238" in text[6]
    assert "sink s1 epoch 3" in text[5] and "lows 0:3, 1:3" in text[2]


def test_limit_and_expired_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "log")
    filled_log(url, commits=5, per_commit=2, shards=1, auto_compact=False)
    limited = replog("history", url, "--limit", "2").stdout.splitlines()
    assert [line.split()[0] for line in limited[1:3]] == ["5", "4"]
    assert limited[3] == "(3 older commits not shown: --limit)"
    real = history.read_commit

    def expired(storage: object, version: int) -> object:  # retention deleted 1 and 2
        return None if version <= 2 else real(storage, version)  # type: ignore[arg-type]

    monkeypatch.setattr(history, "read_commit", expired)
    described = history.log_history(ReplicationLog.open(url))
    assert [entry.record.version for entry in described.entries] == [5, 4, 3]
