"""Replication on local-cluster[2,1,1024]: executors are separate JVMs and Python workers."""

import json
import sys
from pathlib import Path

import pytest
from support.replication import assert_exact_replica, batches, fill_source, run_app

from replog.log import ReplicationLog
from replog.tables.delta import open_table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_apply_changes import expected_state, table_state, workload

pytestmark = pytest.mark.slow


def test_replication_on_local_cluster(tmp_path: Path) -> None:
    source = ReplicationLog.create(str(tmp_path / "A"), 4)
    fill_source(source, commits=4, per_commit=100)
    result = run_app(
        "replicate.py",
        source.url,
        str(tmp_path / "B"),
        str(tmp_path / "chk"),
        "--master",
        "local-cluster[2,1,1024]",
        "--max-events",
        "250",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert batches(result) == [250, 150]
    assert_exact_replica(source, ReplicationLog.open(str(tmp_path / "B")))


def test_relative_paths_on_local_cluster(tmp_path: Path) -> None:
    """Executors run in other working directories: relative locations are made absolute
    on the driver, so they find the same log."""
    source = ReplicationLog.create(str(tmp_path / "sub" / "A"), 2)
    fill_source(source, commits=2, per_commit=50)
    result = run_app(
        "replicate.py",
        "sub/A",
        "sub/B",
        "chk",
        "--master",
        "local-cluster[2,1,1024]",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert_exact_replica(source, ReplicationLog.open(str(tmp_path / "sub" / "B")))


def test_apply_changes_commits_rows_the_executors_wrote(tmp_path: Path) -> None:
    """On local-cluster[2,1,1024] (executors are JVMs and Python workers of their own), a
    snapshot's rows are written as Parquet by the executors' tasks into the table's
    folder and committed by the driver with each micro-batch; the changes after them
    go through the driver. The table is the log's latest state."""
    snapshot = [
        {"key": json.dumps({"id": k}), "operation": "insert",
         "data": json.dumps({"id": k, "name": f"s{k}", "n": k})}
        for k in range(3000)
    ]  # fmt: skip
    log = ReplicationLog.create(str(tmp_path / "log"), 4)
    log.append(snapshot[:1500])
    log.append(snapshot[1500:])
    log.append(workload(seed=5, events=400, keys=3100))
    target = str(tmp_path / "table")
    result = run_app(
        "apply_to_delta.py", log.url, target, str(tmp_path / "chk"),
        "--master", "local-cluster[2,1,1024]", "--max-events", "1200",
        "--write-ahead-rows", "50",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert table_state(target) == expected_state(log.read_all().to_pylist())
    table = open_table(target, None)
    assert table is not None
    metrics = [commit.get("operationMetrics", {}) for commit in table.history()]
    assert sum(int(m.get("numRowsWrittenAhead", 0)) for m in metrics) >= 2400
    # several tasks (how many depends on how the batches fall across the shards)
    assert sum(int(m.get("numFilesWrittenAhead", 0)) for m in metrics) >= 2
