"""Operator commands against real queries: recover after a crash that left a Pending
commit, compaction and retention while a streaming query reads, all on local disk and
on the S3 endpoint."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from support.cli import replog
from support.logcheck import check_key_order, check_log
from support.replication import assert_exact_replica, fill_source, run_app

from replog.checkpoints.sinks import SinkCommitter, list_sinks
from replog.log import ReplicationLog
from replog.ops import compaction, garbage, recovery, retention
from replog.ops.verify import verify

pytestmark = pytest.mark.slow


@pytest.fixture(params=["local", "s3"])
def place(request: pytest.FixtureRequest, tmp_path: Path):
    """(url factory, storage options, CLI fs args, --fs-json args for the app)."""
    if request.param == "local":
        return (lambda name: str(tmp_path / name)), {}, [], []
    s3 = request.getfixturevalue("s3")
    flat = {k: v for k, v in s3.storage_options.items() if k != "client_kwargs"}
    return s3.url, s3.storage_options, s3.fs_cli_args, ["--fs-json", json.dumps(flat)]


@pytest.mark.parametrize(
    ("place", "step"), [("local", "staged"), ("s3", "after_pending")], indirect=["place"]
)
def test_recover_after_a_crash(step: str, place, tmp_path: Path) -> None:
    url, options, fs_cli, fs_app = place
    source = ReplicationLog.create(url("A"), 3, storage_options=options)
    fill_source(source)
    args = [source.url, url("B"), str(tmp_path / "chk"), "--max-events", "150", *fs_app]
    crashed = run_app("replicate.py", *args, fault=f"{step}@1")
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    target = ReplicationLog.open(url("B"), storage_options=options)
    [sink_id] = list_sinks(target)
    doomed = recovery.recover(target, grace_ms=0, dry_run=True).garbage
    status = SinkCommitter(target, sink_id).store.load_latest().sink_commit_statuses[sink_id]
    assert status.is_pending == (step == "after_pending")
    assert doomed  # files of the killed attempt: named nowhere, or by the Pending epoch

    shown = json.loads(replog("status", target.url, "--json", *fs_cli).stdout)
    [sink] = shown["sinks"]
    assert sink["status"] == str(status) and sink["log_epoch"] == 0

    # S3 stamps have whole seconds: a gc mark in the second the killed attempt wrote its
    # file ties with it, and a tie keeps the file (the safe side); it failed 1 run in 6
    time.sleep(1.1)
    recovered = replog("recover", target.url, "--grace", "0", *fs_cli)
    assert recovered.returncode == 0, recovered.stderr
    if step == "after_pending":
        assert f"sink {sink_id}: resolved Pending epoch 1 -> rolled back" in recovered.stdout
    assert f"deleted {len(doomed)} garbage" in recovered.stdout
    target = ReplicationLog.open(url("B"), storage_options=options)
    committer = SinkCommitter(target, sink_id)
    assert not committer.store.load_latest().sink_commit_statuses[sink_id].is_pending
    assert garbage.scan(target, 0).garbage == []
    assert sum(target.head().values()) == 150 and verify(target).ok

    finished = run_app("replicate.py", *args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_exact_replica(source, ReplicationLog.open(url("B"), storage_options=options))


def test_compaction_and_retention_while_a_query_reads(spark, place, tmp_path: Path) -> None:
    url, options, fs_cli, _ = place
    source = ReplicationLog.create(url("A"), 3, storage_options=options)
    fill_source(source, commits=4, per_commit=60)
    fs = {f"fs.{k}": str(v) for k, v in options.items() if k != "client_kwargs"}
    query = (
        spark.readStream.format("replog")
        .options(**fs)
        .option("consumer", "mirror")
        .option("maxEventsPerTrigger", 70)
        .load(source.url)
        .writeStream.format("replog-sink")
        .options(**fs)
        .option("sinkId", "mirror-sink")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(processingTime="200 milliseconds")
        .start(url("B"))
    )
    done = threading.Event()
    compactions = []
    failures: list[BaseException] = []

    def operate() -> None:
        try:
            operator = ReplicationLog.open(source.url, storage_options=options)
            for round_ in range(4):
                fill_more(operator, round_)
                heads = operator.head()
                compactions.append(compaction.compact(operator).record)
                # Safe retention: only what the running query's consumer has committed,
                # once it has committed this round's events (a state that, once reached,
                # stays: the query may have read them during the compaction already).
                stuck_after = time.monotonic() + 240  # a hang, not slowness
                while any(
                    low <= heads[shard] for shard, low in retention.consumed_lows(operator).items()
                ):
                    assert query.isActive, query.exception()
                    assert time.monotonic() < stuck_after, f"round {round_}: consumer stuck"
                    time.sleep(0.2)
                retention.truncate(operator, retention.consumed_lows(operator))
            done.set()
        except BaseException as exc:  # reported by the test below, not lost with the thread
            failures.append(exc)

    worker = threading.Thread(target=operate)
    worker.start()
    try:
        worker.join()
        if failures:
            raise failures[0]
        assert done.is_set()
        query.processAllAvailable()
    finally:
        query.stop()
    assert query.exception() is None
    assert sum(1 for record in compactions if record is not None) >= 2
    target = ReplicationLog.open(url("B"), storage_options=options)
    source = ReplicationLog.open(source.url, storage_options=options)
    assert min(source.refresh().lows) > 1  # retention really dropped events
    # Everything ever appended to A reached B exactly once and in per-key order, though
    # A was compacted and truncated while the query ran.
    rows = check_log(target)
    expected = {f"e{c:02d}-{i:03d}" for c in range(4) for i in range(60)}
    expected |= {f"r{r}-{i:03d}" for r in range(4) for i in range(30)}
    assert {row["event_id"] for row in rows} == expected and len(rows) == len(expected)
    check_key_order(rows)
    assert verify(source).ok and verify(target).ok
    status = json.loads(replog("status", source.url, "--json", *fs_cli).stdout)
    [mirror] = status["consumers"]
    assert mirror["name"] == "mirror" and mirror["total_lag"] == 0


def fill_more(log: ReplicationLog, round_: int) -> None:
    log.append(
        [
            {
                "event_id": f"r{round_}-{i:03d}",
                "key": f"k{i % 13}",
                "data": {"n": 90_000 + round_ * 100 + i},
            }
            for i in range(30)
        ]
    )
