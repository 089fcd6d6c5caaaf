"""A log deleted and re-created at its URL: every process holding the old one notices
(the log id in every commit and header), writes nothing into the new one and skips
nothing of it."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from support.logcheck import check_log

from replog.appender import GroupAppender
from replog.errors import LogRecreatedError
from replog.log import READ_VERIFY_S, ReplicationLog


def events(tag: str, count: int = 2) -> list[dict[str, object]]:
    return [{"key": f"{tag}-{i}", "data": {"tag": tag}} for i in range(count)]


def recreate(url: str, commits: int) -> ReplicationLog:
    """Replace the log at ``url`` with another of ``commits`` appends, built beside it and
    swapped in by two renames: a holder of the old log checking its identity sees the old
    log or the new one, not a directory half deleted (which fails differently: the log is
    gone, or damaged)."""
    fresh = f"{url}.new"
    log = ReplicationLog.create(fresh, 2, snapshot_interval=10)
    for n in range(commits):
        log.append(events(f"new{n}"))
    log.flush()  # no merge still writing under the path being renamed
    os.rename(url, f"{url}.old")
    os.rename(fresh, url)
    shutil.rmtree(f"{url}.old")
    return ReplicationLog.open(url)


@pytest.mark.parametrize("new_commits", [2, 12], ids=["new log shorter", "new log longer"])
def test_every_holder_of_the_old_log_notices_and_writes_nothing(
    tmp_path: Path, new_commits: int
) -> None:
    url = str(tmp_path / "log")
    old = ReplicationLog.create(url, 2, snapshot_interval=10)
    for n in range(5):
        old.append(events(f"old{n}"))
    reader = ReplicationLog.open(url)
    assert len(reader.read_all()) == 10  # a consumer that read the old log to its end
    appender = GroupAppender(ReplicationLog.open(url))
    appender.append(events("grouped"))

    new = recreate(url, new_commits)
    version = new.refresh().version
    with pytest.raises(LogRecreatedError, match="deleted and re-created"):
        old.append(events("late"))
    with pytest.raises(LogRecreatedError):
        appender.append(events("late-grouped"))
    appender.close()
    time.sleep(READ_VERIFY_S + 0.1)  # a reader that finds nothing new checks once a second
    for call in (reader.refresh, reader.read_all, lambda: list(reader.scan({0: 0, 1: 0}))):
        with pytest.raises(LogRecreatedError):
            call()

    fresh = ReplicationLog.open(url)
    assert fresh.refresh().version == version  # nothing of the old writers landed
    rows = check_log(fresh)
    assert {row["key"].split("-")[0] for row in rows} == {f"new{n}" for n in range(new_commits)}
    new.append(events("after"))  # the new log's own writer goes on
    assert len(check_log(ReplicationLog.open(url))) == 2 * (new_commits + 1)


@pytest.mark.spark
def test_a_running_stream_stops_when_its_log_is_recreated(spark, tmp_path: Path) -> None:
    """The Spark source keeps its log object across micro-batches: the next batch after
    the log was re-created fails, naming the situation, and delivers nothing of the new
    log as if it continued the old one."""
    from pyspark.errors import StreamingQueryException

    url = str(tmp_path / "log")
    old = ReplicationLog.create(url, 2, snapshot_interval=10)
    for n in range(5):
        old.append(events(f"old{n}"))
    query = (
        spark.readStream.format("replog")
        .load(url)
        .writeStream.format("memory")
        .queryName("recreated_log")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .start()
    )
    try:
        query.processAllAvailable()
        assert spark.table("recreated_log").count() == 10
        recreate(url, 12)
        with pytest.raises(StreamingQueryException, match=r"LogRecreatedError.*re-created"):
            query.processAllAvailable()
        keys = {row["key"] for row in spark.table("recreated_log").collect()}
        assert all(key.startswith("old") for key in keys)
    finally:
        query.stop()
