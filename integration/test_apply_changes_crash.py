"""apply_changes through real crashes: the driver's process group is SIGKILLed just
before a micro-batch's Delta commit, between a merge-on-read batch's files (its rows and
deletion vectors) and its commit, or just after the commit (before Spark's commit log),
at a random batch, several times; the query restarts from its checkpoint each time.
Finally the Delta table equals the latest state computed from the log, and every file
its log names is there; read as of any event's time it equals the log's state then."""

from __future__ import annotations

import json
import random
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import polars
import pyarrow as pa
import pytest
from support.replication import run_app

from replog.capture.events import truncate_key
from replog.log import ReplicationLog
from replog.spark.as_of import read_rows
from replog.tables import as_of
from replog.tables.delta import open_table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_apply_changes import T0, expected_state, table_state, workload

pytestmark = pytest.mark.slow

STEPS = ["apply_before_delta", "apply_deletion_vectors", "apply_after_delta"]


def test_random_driver_kills_at_every_step_leave_the_latest_state(
    spark: Any, tmp_path: Path
) -> None:
    events = workload(seed=24, events=900, keys=60)
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    for start in range(0, len(events), 100):
        log.append(events[start : start + 100])
    target, checkpoint = str(tmp_path / "table"), str(tmp_path / "chk")
    args = [log.url, target, checkpoint, "--max-events", "100"]
    batches = len(events) // 100
    steps = list(STEPS)
    random.Random(24).shuffle(steps)  # batch ids 0..2 killed once each, at a random step
    while steps[0] == "apply_deletion_vectors":  # batch 0 creates the table: no DV yet
        random.Random(len(steps)).shuffle(steps)
    for batch, step in enumerate(steps):
        crashed = run_app("apply_to_delta.py", *args, fault=f"{step}@{batch}")
        assert crashed.returncode == -9, crashed.stderr[-3000:]  # SIGKILL, not a clean exit
    finished = run_app("apply_to_delta.py", *args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert table_state(target) == expected_state(log.read_all().to_pylist())
    table = open_table(target, None)
    assert table is not None
    assert table.transaction_version("crash-test") == batches - 1  # the last batch id
    # one Delta commit per batch id (0 created the table): a batch replayed after a kill
    # past its Delta commit added none. (Its skip is not what this proves: with the skip
    # undone the position guard leaves the merge nothing to change, and delta-rs then
    # commits nothing; tests/test_apply_changes.py checks the skip itself.)
    assert table.version() == batches - 1
    written = pa.RecordBatchReader.from_stream(table.deletion_vectors()).read_all()
    assert written.num_rows, "the batches wrote deletion vectors"
    # the files written before a kill are in no commit: the table reads without them
    assert polars.read_delta(target).height == len(table_state(target))
    # and the table as of any event's time (inside micro-batches and at their ends) is
    # the log's state then: the kills left each commit's recorded coverage true
    logged = log.read_all().to_pylist()
    for n in [*range(0, len(events), 89), len(events) - 1]:
        at = T0 + timedelta(seconds=n)
        found = read_rows(spark, target, log, as_of.point(at=at)).to_pylist()
        rows = {r["id"]: {"id": r["id"], "name": r["name"], "n": r.get("n")} for r in found}
        assert rows == expected_state([e for e in logged if e["timestamp"] <= at]), n


def _unreferenced_files(target: str) -> list[str]:
    """Parquet files in the table's folder that no commit of its log names."""
    table = open_table(target, None)
    uris = [] if table is None else table.file_uris()
    named = {str(Path(uri.removeprefix("file://")).resolve()) for uri in uris}
    return [str(p) for p in Path(target).glob("*.parquet") if str(p.resolve()) not in named]


def test_kills_between_the_tasks_files_and_the_commit_lose_and_double_nothing(
    tmp_path: Path,
) -> None:
    """A snapshot's rows written ahead by Spark's tasks (write_ahead_rows=5), then changes
    of the same keys: the driver is SIGKILLed after the tasks wrote their files and before
    its commit, at three batches; each restart replays the batch (new files) and the
    first ones stay unreferenced. Every row is there once, as the log says."""
    snapshot = [
        {"key": json.dumps({"id": k}), "operation": "insert",
         "data": json.dumps({"id": k, "name": f"s{k}", "n": k})}
        for k in range(600)
    ]  # fmt: skip
    events = snapshot + workload(seed=7, events=300, keys=700)
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    for start in range(0, len(events), 150):
        log.append(events[start : start + 150])
    target, checkpoint = str(tmp_path / "table"), str(tmp_path / "chk")
    args = [log.url, target, checkpoint, "--max-events", "150", "--write-ahead-rows", "5"]
    for batch in (0, 2):
        crashed = run_app("apply_to_delta.py", *args, fault=f"apply_before_delta@{batch}")
        assert crashed.returncode == -9, crashed.stderr[-3000:]  # SIGKILL, not a clean exit
        assert _unreferenced_files(target), f"the tasks of batch {batch} wrote files ahead"
    finished = run_app("apply_to_delta.py", *args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    state = table_state(target)  # one row per key
    assert state == expected_state(log.read_all().to_pylist())
    table = open_table(target, None)
    assert table is not None
    ahead = [
        int(commit.get("operationMetrics", {}).get("numRowsWrittenAhead", 0))
        for commit in table.history()
    ]
    assert sum(ahead) >= 600 - 150, "the snapshot's rows went through files written ahead"
    for uri in table.file_uris():  # every file the log names is there
        assert Path(uri.removeprefix("file://")).exists()
    assert polars.read_delta(target).height == len(state)


def _truncated_state(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The latest row per key from the log's events, each truncate emptying its shard's
    keys older than it (FORMAT.md, "Segments")."""
    shards: dict[int, dict[str, dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: (r["shard"], r["sequence"])):
        held = shards.setdefault(row["shard"], {})
        if row["operation"] == "truncate":
            held.clear()
        elif row["operation"] == "delete":
            held.pop(row["key"], None)
        else:
            held[row["key"]] = json.loads(row["data"])
    return {r["id"]: r for held in shards.values() for r in held.values()}


def test_kills_around_the_commit_of_a_truncate_apply_it_once(tmp_path: Path) -> None:
    """The micro-batch holding a truncate (a copy on each shard), inserts before it and a
    refill after it: the driver SIGKILLed before its Delta commit, between its deletion
    vectors and its commit, and just after the commit (Spark's commit log not written);
    the restarted query applies it once: one Delta commit for the batch, the rows of before
    it gone, the refill there."""
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    log.append([
        {"key": json.dumps({"id": k}), "operation": "insert",
         "data": json.dumps({"id": k, "name": f"s{k}", "n": k})}
        for k in range(40)
    ])  # fmt: skip
    target, checkpoint = str(tmp_path / "table"), str(tmp_path / "chk")
    args = [log.url, target, checkpoint, "--max-events", "1000"]
    first = run_app("apply_to_delta.py", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    log.append([
        *({"key": json.dumps({"id": k}), "operation": "update",
           "data": json.dumps({"id": k, "name": f"u{k}", "n": k})} for k in range(5)),
        *({"key": truncate_key(shard, 2), "operation": "truncate", "data": "{}"}
          for shard in range(2)),
        *({"key": json.dumps({"id": k}), "operation": "insert",
           "data": json.dumps({"id": k, "name": f"r{k}", "n": k})} for k in range(30, 45)),
    ])  # fmt: skip
    for step in STEPS[1:]:  # before the commit is a plain restart: the other tests have it
        crashed = run_app("apply_to_delta.py", *args, fault=f"{step}@1")
        assert crashed.returncode == -9, crashed.stderr[-3000:]  # SIGKILL, not a clean exit
    finished = run_app("apply_to_delta.py", *args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "batch 1 already committed" in finished.stderr  # the replay was skipped
    expected = _truncated_state(log.read_all().to_pylist())
    assert sorted(expected) == list(range(30, 45))
    assert table_state(target) == expected
    table = open_table(target, None)
    assert table is not None and table.version() == 1  # batch 1: one commit, once
    assert polars.read_delta(target).height == len(expected)
