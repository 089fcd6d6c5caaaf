"""Small logs for tests: filled, aged, and with consumers at given positions."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import pyarrow as pa

from replog.checkpoints.consumers import OffsetCommitter
from replog.format.commits import DESCRIPTOR_PATH
from replog.format.events import events_from_records
from replog.log import ReplicationLog


def filled_log(
    url: str,
    commits: int = 4,
    per_commit: int = 40,
    shards: int = 2,
    storage_options: dict[str, Any] | None = None,
    *,
    auto_compact: bool = True,
) -> ReplicationLog:
    log = ReplicationLog.create(
        url, shards, storage_options=storage_options, auto_compact=auto_compact
    )
    for c in range(commits):
        log.append(
            [{"key": f"k{i % 7}", "data": {"n": c * per_commit + i}} for i in range(per_commit)]
        )
    return log


def log_rows(count: int, start: int = 0) -> pa.Table:
    return events_from_records(
        [{"key": f"s{i}", "data": {"n": i}} for i in range(start, start + count)]
    )


def commit_offsets(log: ReplicationLog, consumer: str, offsets: dict[int, int]) -> None:
    """Record ``consumer`` at ``offsets`` (shards not named: 0), as a reader would."""
    full = {shard: offsets.get(shard, 0) for shard in range(log.shards)}
    OffsetCommitter(log, consumer, owner=f"test-{consumer}").commit(
        full, log_version=log.refresh().version, note="test"
    )


def segment_files(log: ReplicationLog) -> set[str]:
    return {
        f"shards/{lane}/{name}"
        for lane in log.storage.listdir("shards")
        for name in log.storage.listdir(f"shards/{lane}")
    }


def backdate(log: ReplicationLog, relative: str, seconds: float) -> None:
    """Age a local file (only garbage collection looks at file times)."""
    path = log.storage.path(relative)
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


def append_commits(log: ReplicationLog) -> int:
    """How many of the log's commits are appends (writers' automatic merges commit too)."""
    from replog.core import history

    records = history.read_commits(log.storage, 1, log.refresh().version)
    return sum(1 for record in records if record.operation == "append" and record.add)


def short_retention_log(url: str, shards: int, retention_ms: int, **options: Any) -> ReplicationLog:
    """A new log whose retention is ``retention_ms``, below the 10 minutes a log can be
    created with since replog 0.6 (replog 0.5 created such logs, which stay readable and
    writable): retention then runs within a test's seconds, on real clocks. Created with
    the minimum, its descriptor is sealed again before anything is written."""
    log = ReplicationLog.create(url, shards, **options)
    descriptor = dataclasses.replace(log.descriptor, retention_ms=retention_ms)
    log.storage.write(DESCRIPTOR_PATH, descriptor.to_bytes())
    return ReplicationLog.open(url, storage_options=options.get("storage_options"))
