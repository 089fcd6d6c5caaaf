"""Exactly-once through real crashes: the driver process group is SIGKILLed at each
protocol step, then the query restarts from its checkpoint; every event is counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.replication import assert_exact_replica, batches, fill_source, run_app

from replog.checkpoints.sinks import SinkCommitter
from replog.log import ReplicationLog
from replog.ops import garbage
from replog.ops.verify import verify

pytestmark = pytest.mark.slow

STEPS = ["staged", "after_pending", "after_log_commit", "after_committed"]


def locations(kind: str, tmp_path: Path, s3) -> tuple[str, str, str, dict]:
    if kind == "local":
        return str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "chk"), {}
    return s3.url("A"), s3.url("B"), str(tmp_path / "chk"), s3.storage_options


@pytest.fixture
def maybe_s3(storage_kind: str, request: pytest.FixtureRequest):
    return request.getfixturevalue("s3") if storage_kind == "s3" else None


# Every step on local disk; on S3 the step whose outcome depends on the log commit
# having landed (each S3 run costs ~45 s, and the protocol code is the same).
KILLS = [*(("local", step) for step in STEPS), ("s3", "after_log_commit")]


def _fs_args(options: dict) -> list[str]:
    flat = {k: v for k, v in options.items() if k != "client_kwargs"}
    return ["--fs-json", json.dumps(flat)] if flat else []


@pytest.mark.parametrize(("storage_kind", "step"), KILLS)
def test_driver_killed_at_each_step(step: str, storage_kind: str, maybe_s3, tmp_path: Path) -> None:
    source_url, target_url, checkpoint, options = locations(storage_kind, tmp_path, maybe_s3)
    source = ReplicationLog.create(source_url, 3, storage_options=options)
    fill_source(source)
    args = [source_url, target_url, checkpoint, "--max-events", "150", *_fs_args(options)]

    crashed = run_app("replicate.py", *args, fault=f"{step}@1")
    assert crashed.returncode == -9, crashed.stderr[-3000:]  # SIGKILL, not a clean exit
    target = ReplicationLog.open(target_url, storage_options=options)
    held_before = sum(target.head().values())
    # Epoch 0 is in the log; epoch 1 is there exactly when the kill came after its log commit.
    assert held_before == (300 if step in ("after_log_commit", "after_committed") else 150)

    finished = run_app("replicate.py", *args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert sum(batches(finished)) + held_before >= 600

    target = ReplicationLog.open(target_url, storage_options=options)
    assert_exact_replica(source, target)
    assert verify(target).ok
    committer = SinkCommitter(target, next(iter(target.info().sinks)))
    manifest = committer.store.load_latest()
    assert manifest is not None and manifest.validate() == []
    assert manifest.sink_commit_statuses[committer.sink_id].is_committed
    # Killed before the log commit, the attempt's files are garbage for `recover`: named
    # nowhere ("staged"), or left by the rollback ("after_pending": a zombie driver may
    # still commit them). Killed after it, the log holds them and the replay's own
    # files are discarded: no garbage.
    orphans = garbage.scan(target, 0).garbage
    assert bool(orphans) == (step in ("staged", "after_pending")), orphans


def test_task_failures_are_retried_without_duplicates(tmp_path: Path) -> None:
    source_url, target_url, checkpoint = (str(tmp_path / n) for n in ("A", "B", "chk"))
    source = ReplicationLog.create(source_url, 3)
    fill_source(source)
    result = run_app(
        "replicate.py", source_url, target_url, checkpoint, fault="write_task", action="raise"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "injected fault at write_task" in result.stderr  # tasks really failed
    assert_exact_replica(source, ReplicationLog.open(target_url))


def test_abort_after_commit_never_undoes_the_epoch(tmp_path: Path) -> None:
    source_url, target_url, checkpoint = (str(tmp_path / n) for n in ("A", "B", "chk"))
    source = ReplicationLog.create(source_url, 3)
    fill_source(source)
    failed = run_app(
        "replicate.py",
        source_url,
        target_url,
        checkpoint,
        fault="after_log_commit@1",
        action="raise",
    )
    assert failed.returncode != 0
    target = ReplicationLog.open(target_url)
    assert sum(target.head().values()) == 300  # epoch 1 is in the log despite the failure
    assert verify(target).ok  # abort did not delete the committed segments
    finished = run_app("replicate.py", source_url, target_url, checkpoint)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_exact_replica(source, ReplicationLog.open(target_url))


@pytest.mark.parametrize("step", ["after_log_commit", "after_committed"])
def test_a_replaced_checkpoint_after_a_kill_neither_doubles_nor_skips(
    step: str, tmp_path: Path
) -> None:
    """The driver dies after the sink's log commit, before Spark's commit log; then the
    checkpoint is thrown away. A new checkpoint with the same consumer and sinkId resumes
    after what the sink wrote (recorded in its log commit), not where the consumer's own
    offsets lag."""
    source_url, target_url = str(tmp_path / "A"), str(tmp_path / "B")
    source = ReplicationLog.create(source_url, 3)
    fill_source(source)
    names = ["--consumer", "mirror", "--sink-id", "to-b", "--max-events", "150"]
    crashed = run_app(
        "replicate.py",
        source_url,
        target_url,
        str(tmp_path / "chk1"),
        *names,
        fault=f"{step}@1",
    )
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    assert sum(ReplicationLog.open(target_url).head().values()) == 300
    finished = run_app("replicate.py", source_url, target_url, str(tmp_path / "chk2"), *names)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert sum(batches(finished)) == 300  # only what the sink had not written
    assert_exact_replica(source, ReplicationLog.open(target_url))
