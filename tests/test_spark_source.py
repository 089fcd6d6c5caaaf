"""The replog source on a real SparkSession."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.replication import fill_source

from replog.checkpoints import consumers
from replog.core import history
from replog.format.commits import TRUNCATE, CommitRecord, commit_path
from replog.log import ReplicationLog
from replog.ops import status

pytestmark = pytest.mark.spark


def ids(rows) -> list[str]:
    return sorted(row["event_id"] for row in rows)


def start_memory_query(
    spark, url: str, name: str, checkpoint: Path, *, available_now: bool = False, **options: str
):
    """Stream the log at ``url`` into the in-memory table ``name``."""
    writer = (
        spark.readStream.format("replog")
        .options(**options)
        .load(url)
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(checkpoint))
    )
    return (writer.trigger(availableNow=True) if available_now else writer).start()


def source_ids(log: ReplicationLog) -> list[str]:
    return sorted(
        event_id
        for shard in range(log.shards)
        for event_id in log.read_table(shard).column("event_id").to_pylist()
    )


def test_the_spark_schema_is_the_event_schema(spark) -> None:
    """The DDL the source declares and the Arrow schema its batches carry agree."""
    from pyspark.sql.pandas.types import from_arrow_schema
    from pyspark.sql.types import _parse_datatype_string

    from replog.format.events import EVENT_SCHEMA
    from replog.spark.schema import SPARK_SCHEMA_DDL

    declared = _parse_datatype_string(SPARK_SCHEMA_DDL)
    assert declared == from_arrow_schema(EVENT_SCHEMA)


def test_schema_and_batch_read_without_register(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 3)
    fill_source(log, commits=2, per_commit=50)
    frame = spark.read.format("replog").load(log.url)
    assert [f.name for f in frame.schema.fields] == [
        "shard",
        "sequence",
        "event_id",
        "timestamp",
        "operation",
        "collection",
        "key",
        "data",
        "before",
        "metadata",
    ]
    rows = frame.collect()
    assert ids(rows) == source_ids(log)
    first = frame.where("shard = 0 and sequence = 1").collect()[0]
    assert json.loads(bytes(first["data"]))["n"] >= 0


def test_batch_read_with_offsets_and_partition_split(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(log, commits=3, per_commit=40)
    frame = (
        spark.read.format("replog")
        .option("startingOffsets", '{"0": 5}')
        .option("endingOffsets", '{"0": 30, "1": 10}')
        .option("maxEventsPerPartition", "7")
        .load(log.url)
    )
    rows = frame.collect()
    by_shard = {s: sorted(r["sequence"] for r in rows if r["shard"] == s) for s in (0, 1)}
    assert by_shard == {0: list(range(6, 31)), 1: list(range(1, 11))}
    assert frame.rdd.getNumPartitions() == 4 + 2  # 25 events / 7, 10 events / 7


def test_stream_sees_events_appended_while_running(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 3)
    fill_source(log, commits=1, per_commit=30)
    query = start_memory_query(spark, log.url, "live_events", tmp_path / "chk")
    try:
        query.processAllAvailable()
        assert spark.table("live_events").count() == 30
        log.append([{"event_id": f"late-{i}", "key": f"k{i}", "data": "x"} for i in range(20)])
        query.processAllAvailable()
        rows = spark.table("live_events").collect()
        assert ids(rows) == source_ids(log) and len(rows) == 50
        progress = query.lastProgress
        assert progress["sources"][0]["latestOffset"] is not None
    finally:
        query.stop()


def test_restart_from_checkpoint_neither_skips_nor_repeats(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 3)
    fill_source(log, commits=2, per_commit=50)
    out, chk = str(tmp_path / "out"), str(tmp_path / "chk")

    def run() -> list[int]:
        query = (
            spark.readStream.format("replog")
            .option("maxEventsPerTrigger", "40")
            .load(log.url)
            .writeStream.format("parquet")
            .option("path", out)
            .option("checkpointLocation", chk)
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        return [p["numInputRows"] for p in query.recentProgress]

    first = run()
    assert all(n <= 40 for n in first) and sum(first) == 100 and len(first) >= 3
    fill_source(log, commits=1, per_commit=30)  # event ids collide by design; use sequences
    second = run()
    assert sum(second) == 30
    rows = spark.read.parquet(out).collect()
    pairs = sorted((r["shard"], r["sequence"]) for r in rows)
    assert len(pairs) == len(set(pairs)) == 130


def test_fresh_checkpoint_resumes_from_consumer_manifest(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(log, commits=2, per_commit=40)
    query = start_memory_query(spark, log.url, "etl_first", tmp_path / "chk1", consumer="etl")
    try:
        query.processAllAvailable()
        fill_source(log, commits=1, per_commit=10)
        query.processAllAvailable()  # planning this batch commits the previous one
    finally:
        query.stop()
    committed = consumers.committed_position(log, "etl")
    assert committed is not None and sum(committed.offsets.values()) >= 80
    query = start_memory_query(spark, log.url, "etl_second", tmp_path / "chk2", consumer="etl")
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    rows = spark.table("etl_second").collect()
    expected = sum(log.head().values()) - sum(committed.offsets.values())
    committed = consumers.committed_position(log, "etl")
    assert committed is not None
    assert len(rows) == expected
    assert all(r["sequence"] > committed.offsets[r["shard"]] for r in rows)
    # A batch read as the same consumer starts at the earliest event by default (the
    # manifest only when asked for) and commits nothing.
    assert spark.read.format("replog").option("consumer", "etl").load(log.url).count() == 90
    resumed = (
        spark.read.format("replog")
        .option("consumer", "etl")
        .option("startingOffsets", "manifest")
        .load(log.url)
    )
    assert resumed.count() == 90 - sum(committed.offsets.values())
    assert consumers.committed_position(log, "etl") == committed  # batch reads commit nothing


def test_max_bytes_per_trigger_bounds_batches(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(log, commits=4, per_commit=50)
    per_event = log.info().bytes / 200
    query = (
        spark.readStream.format("replog")
        .option("maxBytesPerTrigger", str(int(per_event * 60)))
        .load(log.url)
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    sizes = [p["numInputRows"] for p in query.recentProgress]
    assert sum(sizes) == 200 and len(sizes) >= 3 and max(sizes) <= 61


def test_data_loss_is_reported_or_skipped(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 1)
    fill_source(log, commits=3, per_commit=10)
    first = log.state().segments[0][0]
    log.commit(
        lambda state: CommitRecord.after(
            state.version, TRUNCATE, remove=(first,), low_watermarks={0: 11}
        )
    )
    with pytest.raises(
        Exception,
        match=r"shard 0: events from sequence 1 were requested but "
        r"the log only holds sequences from 11",
    ):
        spark.read.format("replog").option("startingOffsets", '{"0": 0}').load(log.url).count()
    rows = (
        spark.read.format("replog")
        .option("startingOffsets", '{"0": 0}')
        .option("failOnDataLoss", "false")
        .load(log.url)
        .collect()
    )
    assert sorted(r["sequence"] for r in rows) == list(range(11, 31))


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("startingOffsets", "newest", "option 'startingOffsets': 'newest' is not allowed"),
        ("startingOffsets", "{oops", "option 'startingOffsets': '{oops' is neither"),
        ("startingOffsets", '{"9": 1}', "shard 9 does not exist"),
        ("maxEventsPerTrigger", "-5", "option 'maxEventsPerTrigger': must be a positive"),
        (
            "maxEventsPerPartition",
            "lots",
            "option 'maxEventsPerPartition': 'lots' is not an integer",
        ),
        ("failOnDataLoss", "maybe", "option 'failOnDataLoss': expected true or false"),
        ("endingOffsets", "earliest", "option 'endingOffsets': 'earliest' is not allowed"),
    ],
)
def test_bad_options_name_the_option(
    spark, tmp_path: Path, option: str, value: str, message: str
) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(log, commits=1, per_commit=5)
    with pytest.raises(Exception, match=re.escape(message)):
        spark.read.format("replog").option(option, value).load(log.url).count()


def test_stream_from_s3_endpoint(spark, s3, tmp_path: Path) -> None:
    url = s3.url("logs", "A")
    log = ReplicationLog.create(url, 2, storage_options=s3.storage_options)
    fill_source(log, commits=2, per_commit=25)
    query = start_memory_query(
        spark, url, "from_s3", tmp_path / "chk", available_now=True, **s3.spark_options
    )
    query.awaitTermination()
    rows = spark.table("from_s3").collect()
    assert ids(rows) == source_ids(log)
    progress_text = json.dumps(query.recentProgress, default=str)
    assert "testing" not in progress_text  # the secret is not in progress reports


def replicate_to_parquet(spark, url: str, out: Path, checkpoint: Path, **options: str) -> int:
    """Run an AvailableNow query from ``url`` into Parquet; return the rows it read."""
    query = (
        spark.readStream.format("replog")
        .options(**options)
        .load(url)
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return sum(p["numInputRows"] for p in query.recentProgress)


def test_queries_without_a_consumer_each_get_their_own(spark, tmp_path: Path) -> None:
    """Two jobs that name no consumer must not share one: each reads everything, and
    after an AvailableNow run that read everything, neither shows lag."""
    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(log, commits=3, per_commit=40)
    for job in ("first", "second"):
        read = replicate_to_parquet(
            spark, log.url, tmp_path / job, tmp_path / f"chk-{job}", maxEventsPerTrigger="50"
        )
        assert read == 120
    report = status.log_status(log)
    assert len(report.consumers) == 2
    assert all(c.name.startswith("query-") for c in report.consumers)
    assert [c.total_lag for c in report.consumers] == [0, 0]  # no phantom batch of lag
    # A restart from the same checkpoint keeps its consumer and reads only what is new.
    log.append([{"event_id": f"late-{i}", "key": f"k{i}", "data": i} for i in range(10)])
    assert replicate_to_parquet(spark, log.url, tmp_path / "first", tmp_path / "chk-first") == 10
    assert spark.read.parquet(str(tmp_path / "first")).count() == 130
    report = status.log_status(log)
    assert len(report.consumers) == 2 and sorted(c.total_lag for c in report.consumers) == [0, 10]


def test_starting_timestamp_streams_and_batch_reads(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    t0 = 1_750_000_000_000
    log.append([{"key": f"k{i}", "data": i, "timestamp": t0 + i} for i in range(10)])
    log.append([{"key": f"k{i}", "data": i, "timestamp": t0 + 100 + i} for i in range(10)])
    start = str(t0 + 100)
    batch = spark.read.format("replog").option("startingTimestamp", start).load(log.url)
    assert batch.count() == 10
    query = start_memory_query(
        spark, log.url, "since_t", tmp_path / "chk", available_now=True, startingTimestamp=start
    )
    query.awaitTermination()
    assert spark.table("since_t").count() == 10
    with pytest.raises(Exception, match="seconds"):
        spark.read.format("replog").option("startingTimestamp", "1750000000").load(log.url).count()


def test_unknown_options_are_refused_with_a_hint(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 1)
    for option, hint in [
        ("maxOffsetsPerTrigger", "maxEventsPerTrigger"),
        ("startingOffset", "did you mean startingOffsets"),
    ]:
        with pytest.raises(Exception, match=hint):
            spark.read.format("replog").option(option, "5").load(log.url).count()


def test_relative_paths_resolve_against_the_driver_working_directory(spark, tmp_path: Path) -> None:
    """As Spark's file sources do: the driver's (JVM's) working directory, once."""
    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(log, commits=1, per_commit=20)
    driver_cwd = spark.sparkContext._jvm.System.getProperty("user.dir")
    relative = os.path.relpath(tmp_path / "A", driver_cwd)
    assert not os.path.isabs(relative)
    assert spark.read.format("replog").load(relative).count() == 20


def test_min_events_per_trigger_waits_for_enough_events(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 1)
    fill_source(log, commits=1, per_commit=5)
    query = start_memory_query(
        spark,
        log.url,
        "batched",
        tmp_path / "chk",
        minEventsPerTrigger="20",
        maxTriggerDelay="1h",
    )
    try:
        query.processAllAvailable()
        assert spark.table("batched").count() == 0  # 5 waiting, fewer than 20
        fill_source(log, commits=1, per_commit=20)
        query.processAllAvailable()
        assert spark.table("batched").count() == 25
    finally:
        query.stop()


def test_a_query_restarted_on_its_old_checkpoint_stops_at_an_operator_reset(
    spark, tmp_path: Path
) -> None:
    """An operator moved the consumer back with ``replog consumer set``; the query
    restarted from its old checkpoint would silently undo that. It stops, saying how to
    apply the reset; started on a new checkpoint, it reads from the reset position."""
    from support.cli import replog

    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(log, commits=2, per_commit=30)

    def run(checkpoint: str, name: str) -> int:
        return replicate_to_parquet(
            spark, log.url, tmp_path / name, tmp_path / checkpoint, consumer="etl"
        )

    assert run("chk", "before_reset") == 60
    reset = replog("consumer", "set", log.url, "--consumer", "etl", "--to-earliest", "--execute")
    assert reset.returncode == 0, reset.stderr
    fill_source(log, commits=1, per_commit=10)
    with pytest.raises(Exception, match=r"replog consumer set.*new checkpoint"):
        run("chk", "old_checkpoint")
    assert run("chk2", "new_checkpoint") == 70


# -- damage (issue 40): named as replog read names it, or read past as it reads past ---------


def _damaged_log(tmp_path: Path, name: str) -> ReplicationLog:
    """Three shards, a header every 10 commits: commits 1-35, 4 events each."""
    log = ReplicationLog.create(str(tmp_path / name), 3, snapshot_interval=20, auto_compact=False)
    for c in range(35):
        log.append([{"key": f"{c}-{j}", "data": "x"} for j in range(4)])
    log.flush()
    return log


def test_damage_is_named_or_read_past_by_the_source_as_by_replog_read(
    spark, tmp_path: Path
) -> None:
    """One log per kind of damage (FORMAT.md, "Damage"): a header under another
    version's name, the newest header corrupt (the hint's copy intact), the checkpoint's
    own commit deleted, the hint deleted: every event; a commit missing in the middle:
    an error naming it (it read the 128 events before it as the whole log)."""
    root = Path(str(tmp_path))

    def misnamed(p: Path) -> None:  # and a hint without the copy, which would serve
        shutil.copyfile(p / history.header_path(20), p / history.header_path(30))
        (p / history.SNAPSHOT_HINT_PATH).write_text(json.dumps({"version": 30}))

    damages = {
        "misnamed": misnamed,
        "corrupt_header": lambda p: (p / history.header_path(30)).write_bytes(b"{}"),
        "checkpoint_commit": lambda p: (p / commit_path(30)).unlink(),
        "hint": lambda p: (p / history.SNAPSHOT_HINT_PATH).unlink(),
    }
    for name, damage in damages.items():
        log = _damaged_log(root, name)
        damage(Path(log.url))
        assert spark.read.format("replog").load(log.url).count() == 140, name
    gapped = _damaged_log(root, "gap")
    (Path(gapped.url) / commit_path(33)).unlink()
    with pytest.raises(Exception, match="commit 33 is missing, but commit 34 exists"):
        spark.read.format("replog").load(gapped.url).count()


def test_a_streaming_query_fails_on_a_gap_that_appears_while_it_runs(spark, tmp_path: Path) -> None:
    """Commits 26, 28 and 29 land while the query runs, 27 never does (deleted or lost):
    the query stopped advancing at 26 as if at the head. It fails naming commit 27."""
    log = ReplicationLog.create(str(tmp_path / "A"), 3, auto_compact=False)
    for c in range(25):
        log.append([{"key": f"{c}-{j}", "data": "x"} for j in range(4)])
    twin = tmp_path / "twin"  # the same log, gone on to commit 29
    shutil.copytree(log.url, twin)
    writer = ReplicationLog.open(str(twin), auto_compact=False)
    for c in range(25, 29):
        writer.append([{"key": f"{c}-{j}", "data": "x"} for j in range(4)])
    query = start_memory_query(spark, log.url, "gapped", tmp_path / "chk")
    try:
        query.processAllAvailable()
        assert spark.table("gapped").count() == 100
        for segment in (twin / "shards").rglob("*.arrow"):
            target = Path(log.url) / segment.relative_to(twin)
            if not target.exists():
                shutil.copyfile(segment, target)
        for version in (28, 29, 26):  # 26 last: the query applies it, then misses 27
            shutil.copyfile(twin / commit_path(version), Path(log.url) / commit_path(version))
        with pytest.raises(Exception, match="commit 27 is missing, but commit 28 exists"):
            query.processAllAvailable()
        assert spark.table("gapped").count() == 100
    finally:
        query.stop()


def _read(log: ReplicationLog, *, joined: bool = True) -> list:
    """The log's events as its read tasks hand them to Spark (``joined=False``: as the
    log's entries hold them)."""
    from replog import offsets as positions
    from replog import planning
    from replog.core.files import read_segments
    from replog.spark import source

    state = log.refresh()
    tasks = planning.plan_tasks(state, {}, positions.latest(state), 10**9)
    if not joined:
        wanted = [(s, t.first, t.last) for t in tasks for s in t.segments]
        return list(read_segments(log.storage, wanted))
    return [
        batch
        for index, group in enumerate(planning.pack(tasks, 10**9))
        for batch in source.read_partition(source.ReplogPartition(log.storage, index, group))
    ]


def test_a_task_hands_spark_few_large_batches_of_the_same_events(tmp_path: Path) -> None:
    """The log's entries reach Spark joined (its intake of a Python source's batches costs
    per batch): every event once, in order."""
    log = ReplicationLog.create(str(tmp_path / "A"), 1)
    fill_source(log, commits=30, per_commit=300)
    batches = _read(log)
    assert [b.num_rows for b in batches] == [9000]
    events = [(e["shard"], e["sequence"], e["event_id"]) for b in batches for e in b.to_pylist()]
    assert events == [
        (e["shard"], e["sequence"], e["event_id"])
        for b in _read(log, joined=False)
        for e in b.to_pylist()
    ]
    assert len(_read(log, joined=False)) > 1


def test_joined_batches_are_bounded_in_rows_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most COALESCE_ROWS rows and COALESCE_BYTES bytes per batch, or one entry's
    batch alone when it is bigger; order kept."""
    import pyarrow as pa

    from replog.spark import source

    sizes = [2400, 3300, *[300] * 11]
    starts = np.cumsum([0, *sizes[:-1]])
    given = [
        pa.record_batch({"n": np.arange(s, s + n)}) for s, n in zip(starts, sizes, strict=True)
    ]

    def joined() -> list[int]:
        out = list(source._coalesced(iter(given)))
        assert pa.concat_batches(out).column("n").to_pylist() == list(range(sum(sizes)))
        return [b.num_rows for b in out]

    assert joined() == [sum(sizes)]
    monkeypatch.setattr(source, "COALESCE_ROWS", 6000)
    assert joined() == [6000, 3000]
    monkeypatch.setattr(source, "COALESCE_ROWS", 3000)
    assert joined() == [2400, 3300, 3000, 300]
    monkeypatch.setattr(source, "COALESCE_ROWS", 10**6)
    monkeypatch.setattr(source, "COALESCE_BYTES", 1)
    assert joined() == sizes
