"""Helpers for tests that run replication apps as real processes and compare logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from replog.checkpoints.manifest import SinkCommitStatus
from replog.log import ReplicationLog
from support.logcheck import check_log

APPS = Path(__file__).parents[2] / "integration" / "apps"


def run_app(
    app: str,
    *args: str,
    fault: str | None = None,
    action: str = "kill",
    extra_env: dict[str, str] | None = None,
    timeout: int = 600,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(extra_env or {})}
    env.pop("REPLOG_FAULT", None)
    if fault:
        env["REPLOG_FAULT"] = fault
        env["REPLOG_FAULT_ACTION"] = action
    return subprocess.run(
        [sys.executable, str(APPS / app), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        start_new_session=True,
        check=False,
        cwd=cwd,
    )


def fill_source(log: ReplicationLog, commits: int = 6, per_commit: int = 100) -> None:
    for c in range(commits):
        log.append(
            [
                {
                    "event_id": f"e{c:02d}-{i:03d}",
                    "key": f"k{i % 13}",
                    "data": {"n": c * 1000 + i},
                    "collection": ["customers", "orders"][i % 2],
                    "operation": ["insert", "update", "delete"][i % 3],
                }
                for i in range(per_commit)
            ]
        )


def key_histories(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    histories: dict[str, list[str]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: (r["shard"], r["sequence"])):
        histories[row["key"]].append(row["event_id"])
    return dict(histories)


def assert_exact_replica(source: ReplicationLog, target: ReplicationLog) -> None:
    """Target holds every source event exactly once, with the same per-key order."""
    source_rows = check_log(source)
    target_rows = check_log(target)  # gapless and no duplicated event ids
    assert sorted(r["event_id"] for r in target_rows) == sorted(
        r["event_id"] for r in source_rows
    ), "target does not hold exactly the source's events"
    assert key_histories(target_rows) == key_histories(source_rows), "per-key order differs"
    by_id = {r["event_id"]: r for r in source_rows}
    for row in target_rows:
        original = by_id[row["event_id"]]
        fields = ("data", "before", "metadata", "operation", "collection", "timestamp")
        assert [row[f] for f in fields] == [original[f] for f in fields], row["event_id"]


def batches(result: subprocess.CompletedProcess[str]) -> list[int]:
    for line in result.stdout.splitlines():
        if line.startswith("BATCHES "):
            return list(json.loads(line.removeprefix("BATCHES ")))
    raise AssertionError(f"app printed no BATCHES line:\n{result.stdout}\n{result.stderr[-3000:]}")


def leave_pending(committer, query: str, epoch: int, staged: list) -> None:
    """What a driver killed right after writing Pending(epoch) leaves: the manifest says
    Pending and names ``staged``; the log has no commit of the epoch."""
    pending = committer.store.next_manifest(committer.store.load_latest())
    pending.epoch = epoch
    pending.sink_names = sorted({*pending.sink_names, committer.sink_id})
    pending.sink_commit_statuses[committer.sink_id] = SinkCommitStatus.pending()
    pending.sink_query_ids[committer.sink_id] = query
    pending.pending_segments = {committer.sink_id: [s.path for s in staged]}
    committer.store.save(pending)
