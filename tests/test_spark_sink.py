"""The replog-sink (:mod:`replog.spark.sink`): on a real SparkSession (tests marked
``spark``), and its writers driven without a JVM exactly as PySpark 4.x's worker scripts
drive a Python data source (crash tests are in integration/).

``pyspark/sql/worker/write_into_data_source.py`` calls ``streamWriter()`` once to build
the writer whose ``write()`` runs in tasks; ``python_streaming_sink_runner.py`` receives
the pickled *DataSource* and calls ``streamWriter(schema, overwrite)`` again, in the
commit process, right before ``writer.commit(messages, batch_id)`` or
``writer.abort(messages, batch_id)``. A batch write's committer receives the pickled
*writer* (``commit_data_source_write.py``).
"""

from __future__ import annotations

import pickle
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType
from support.logcheck import check_intact, check_log, run_concurrently
from support.logs import filled_log, log_rows
from support.replication import assert_exact_replica, fill_source

from replog.checkpoints import consumers
from replog.core import leases as lease_store
from replog.errors import StagingCollectedError
from replog.log import ReplicationLog
from replog.ops import garbage, recovery
from replog.ops.verify import verify
from replog.spark import sink as spark_sink
from replog.spark.sink import ReplogCommitMessage, ReplogSinkDataSource
from replog.timeutil import now_ms, use_clock

SCHEMA = StructType([StructField("key", StringType()), StructField("data", StringType())])
MINUTE = 60_000


@pytest.mark.spark
def test_batch_write_appends_with_defaults(spark, tmp_path: Path) -> None:
    target = str(tmp_path / "B")
    frame = spark.createDataFrame(
        [(f"k{i % 4}", f'{{"n": {i}}}', "update" if i % 2 else None) for i in range(40)],
        "key string, data string, operation string",
    )
    frame.write.format("replog-sink").mode("append").option("shards", "3").option(
        "collection", "orders"
    ).save(target)
    log = ReplicationLog.open(target)
    rows = check_log(log)
    assert log.shards == 3 and len(rows) == 40
    assert {r["collection"] for r in rows} == {"orders"}
    assert sorted({r["operation"] for r in rows}) == ["insert", "update"]
    assert lease_store.leases(log.storage).readable == []  # the job's staging lease was released


@pytest.mark.spark
def test_batch_writes_with_a_transaction_are_idempotent(spark, tmp_path: Path) -> None:
    target = str(tmp_path / "B")
    frame = spark.createDataFrame([(f"k{i}", str(i)) for i in range(30)], "key string, data string")

    def write(version: int) -> None:
        frame.write.format("replog-sink").mode("append").option("txnAppId", "nightly").option(
            "txnVersion", str(version)
        ).save(target)

    write(1)
    write(1)  # a re-run of the same job (e.g. after a reported failure): skipped
    assert len(check_log(ReplicationLog.open(target))) == 30
    write(2)
    assert len(check_log(ReplicationLog.open(target))) == 60
    with pytest.raises(Exception, match="txnAppId"):
        frame.write.format("replog-sink").mode("append").option("sinkId", "x").save(target)


@pytest.mark.spark
def test_concurrent_batch_writes_both_land(spark, tmp_path: Path) -> None:
    target = str(tmp_path / "B")
    ReplicationLog.create(target, 2)

    def write(name: str) -> None:
        spark.createDataFrame(
            [(f"{name}-{i}", f"{name}-k{i % 3}", str(i)) for i in range(40)],
            "event_id string, key string, data string",
        ).repartition(2).write.format("replog-sink").mode("append").save(target)

    run_concurrently(lambda: write("a"), lambda: write("b"))
    rows = check_log(ReplicationLog.open(target))
    assert sorted(r["event_id"] for r in rows) == sorted(
        f"{n}-{i}" for n in ("a", "b") for i in range(40)
    )


@pytest.mark.spark
@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ("data string, colour string", "unknown column(s) ['colour']"),
        ("key string", "column 'data' (binary or string) is required"),
        ("data int", "column 'data' has type int, expected binary or string"),
        ("data string, timestamp string", "column 'timestamp' has type string"),
    ],
)
def test_bad_input_schema_is_rejected_before_staging(
    spark, tmp_path: Path, columns: str, message: str
) -> None:
    frame = spark.createDataFrame([], columns)
    with pytest.raises(Exception, match=re.escape(message)):
        frame.write.format("replog-sink").mode("append").save(str(tmp_path / "B"))
    assert not (tmp_path / "B" / "shards").exists()


@pytest.mark.spark
def test_invalid_operation_value_aborts_and_leaves_nothing(spark, tmp_path: Path) -> None:
    target = str(tmp_path / "B")
    ReplicationLog.create(target, 2)
    frame = spark.createDataFrame(
        [("a", "x", "insert"), ("b", "y", "upsert")], "key string, data string, operation string"
    ).repartition(2)
    with pytest.raises(Exception, match=r"column 'operation' has invalid value\(s\) \['upsert'\]"):
        frame.write.format("replog-sink").mode("append").save(target)
    log = ReplicationLog.open(target)
    assert log.refresh().version == 0
    assert garbage.scan(log, 0).garbage == []  # staged files of the good task: deleted
    assert lease_store.leases(log.storage).readable == []


@pytest.mark.spark
def test_streaming_replication_is_exact_and_continuous(spark, tmp_path: Path) -> None:
    source = ReplicationLog.create(str(tmp_path / "A"), 3)
    fill_source(source, commits=2, per_commit=60)
    target_url = str(tmp_path / "B")
    query = (
        spark.readStream.format("replog")
        .load(source.url)
        .writeStream.format("replog-sink")
        .option("checkpointLocation", str(tmp_path / "c"))
        .start(target_url)
    )
    try:
        query.processAllAvailable()
        assert_exact_replica(source, ReplicationLog.open(target_url))
        source.append(
            [
                {"event_id": f"more-{i}", "key": f"k{i % 13}", "data": {"n": 10_000 + i}}
                for i in range(45)
            ]
        )
        query.processAllAvailable()
        assert_exact_replica(source, ReplicationLog.open(target_url))
    finally:
        query.stop()


@pytest.mark.spark
def test_two_sinks_interleave_into_one_log(spark, tmp_path: Path) -> None:
    sources = []
    for name in ("A1", "A2"):
        log = ReplicationLog.create(str(tmp_path / name), 2)
        log.append(
            [
                {"event_id": f"{name}-{i}", "key": f"{name}-k{i % 5}", "data": {"n": i}}
                for i in range(300)
            ]
        )
        sources.append(log)
    target = str(tmp_path / "B")
    ReplicationLog.create(target, 4)
    queries = [
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "50")
        .load(log.url)
        .writeStream.format("replog-sink")
        .option("sinkId", f"from-{i}")
        .option("checkpointLocation", str(tmp_path / f"chk{i}"))
        .trigger(availableNow=True)
        .start(target)
        for i, log in enumerate(sources)
    ]
    run_concurrently(*(query.awaitTermination for query in queries))
    log = ReplicationLog.open(target)
    rows = check_log(log)
    assert sorted(r["event_id"] for r in rows) == sorted(
        f"{name}-{i}" for name in ("A1", "A2") for i in range(300)
    )
    info = log.info()
    assert set(info.sinks) == {"from-0", "from-1"}
    assert info.version >= 12  # at least 6 epochs each, interleaved commits


@pytest.mark.spark
def test_transformed_stream_masks_a_field(spark, tmp_path: Path) -> None:
    source = ReplicationLog.create(str(tmp_path / "A"), 2)
    source.append(
        [
            {
                "key": f"c{i}",
                "collection": "customers",
                "data": {"id": i, "email": f"user{i}@example.com"},
            }
            for i in range(20)
        ]
    )
    masked = (
        spark.readStream.format("replog")
        .load(source.url)
        .withColumn(
            "data",
            F.regexp_replace(F.col("data").cast("string"), r'"email":"[^"]*"', '"email":"***"'),
        )
        .drop("shard", "sequence")
    )
    query = (
        masked.writeStream.format("replog-sink")
        .option("sinkId", "masked")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start(str(tmp_path / "B"))
    )
    query.awaitTermination()
    rows = check_log(ReplicationLog.open(str(tmp_path / "B")))
    assert len(rows) == 20 and all(b"***" in r["data"] and b"@" not in r["data"] for r in rows)


@pytest.mark.spark
def test_before_images_and_metadata_are_replicated(spark, tmp_path: Path) -> None:
    source = ReplicationLog.create(str(tmp_path / "A"), 2)
    source.append(
        [
            {
                "event_id": f"u{i}",
                "key": f"k{i}",
                "operation": "update",
                "data": {"n": i, "price": "12345678901234567890.123456789"},
                "before": {"n": i - 1},
                "metadata": {"lsn": i},
            }
            for i in range(10)
        ]
    )
    query = (
        spark.readStream.format("replog")
        .load(source.url)
        .writeStream.format("replog-sink")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start(str(tmp_path / "B"))
    )
    query.awaitTermination()
    assert_exact_replica(source, ReplicationLog.open(str(tmp_path / "B")))


def replicate(spark, source: str, target: str, checkpoint: Path, **options: str) -> None:
    query = (
        spark.readStream.format("replog")
        .options(**{k: v for k, v in options.items() if k in ("consumer", "maxEventsPerTrigger")})
        .load(source)
        .writeStream.format("replog-sink")
        .options(**{k: v for k, v in options.items() if k == "sinkId"})
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start(target)
    )
    query.awaitTermination()


@pytest.mark.spark
def test_a_replaced_checkpoint_neither_doubles_nor_skips(spark, tmp_path: Path) -> None:
    """The consumer's committed offsets lag behind what the sink wrote (Spark's commit of
    the last micro-batch never came: the driver died between the sink's commit and
    Spark's commit log). A new checkpoint with the same consumer and sinkId resumes after
    what the sink wrote, read from the sink's own log commit."""
    source = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(source, commits=4, per_commit=50)
    target = str(tmp_path / "B")
    names = {"consumer": "mirror", "sinkId": "to-b", "maxEventsPerTrigger": "60"}
    replicate(spark, source.url, target, tmp_path / "chk1", **names)
    assert_exact_replica(source, ReplicationLog.open(target))
    # Roll the consumer back as a crash before Spark's commit log would leave it.
    behind = {shard: max(head - 30, 0) for shard, head in source.head().items()}
    consumers.OffsetCommitter(source, "mirror", "crash").commit(
        behind, log_version=source.refresh().version, note="test"
    )
    source.append([{"event_id": f"late-{i}", "key": f"k{i}", "data": i} for i in range(25)])
    replicate(spark, source.url, target, tmp_path / "chk2", **names)
    assert_exact_replica(source, ReplicationLog.open(target))


@pytest.mark.spark
def test_a_second_live_query_on_one_sink_id_fences_the_first(spark, tmp_path: Path) -> None:
    source = ReplicationLog.create(str(tmp_path / "A"), 2)
    fill_source(source, commits=1, per_commit=20)
    target = str(tmp_path / "B")

    def start(checkpoint: str):
        return (
            spark.readStream.format("replog")
            .load(source.url)
            .writeStream.format("replog-sink")
            .option("sinkId", "shared")
            .option("checkpointLocation", str(tmp_path / checkpoint))
            .start(target)
        )

    first = start("chk1")
    try:
        first.processAllAvailable()
        second = start("chk2")
        try:
            second.processAllAvailable()
            source.append([{"key": "k", "data": "late"}])
            with pytest.raises(Exception, match="fenced"):
                first.processAllAvailable()
        finally:
            second.stop()
    finally:
        first.stop()


# -- the writers as PySpark's worker scripts call them (no JVM) ---------------------------


@pytest.fixture
def fresh_spark_caches() -> Iterator[None]:
    """Each test gets the sink's per-process cache empty (a fresh driver)."""
    spark_sink.PROCESS.clear()
    yield
    spark_sink.PROCESS.clear()


def commit_process(source: ReplogSinkDataSource) -> spark_sink.ReplogStreamWriter:
    """What python_streaming_sink_runner.py does for every commit or abort: unpickle the
    data source and call ``streamWriter`` on it."""
    data_source = pickle.loads(pickle.dumps(source))
    return data_source.streamWriter(schema=SCHEMA, overwrite=False)


def task_message(
    url: str,
    planned: spark_sink.ReplogStreamWriter | spark_sink.ReplogBatchWriter,
    *,
    epoch: int,
    start: int,
    query: str = "q",
    run: str = "run-1",
) -> ReplogCommitMessage:
    """One task of a micro-batch: stages its rows and returns its commit message (what
    ``_Stager._stage_all`` of the ``planned`` writer, pickled into the task, returns)."""
    staged = tuple(ReplicationLog.open(url).stage(log_rows(6, start)))
    return ReplogCommitMessage(query, run, epoch, 0, staged, since=planned.since)


def test_a_stream_commit_judges_its_files_by_the_planning_writers_staging_start(
    tmp_path: Path, fresh_spark_caches: None
) -> None:
    """The commit process calls ``streamWriter()`` afresh, after every task staged; its own
    StagingStart would see no mark since (the files look safe). The commit takes the
    StagingStart the task messages carry (the planning writer's), so a recover that
    collected the micro-batch's files meanwhile gets the commit refused."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    source = ReplogSinkDataSource({"path": url, "sinkId": "s", "shards": "2"})
    planned = source.streamWriter(schema=SCHEMA, overwrite=False)  # write_into_data_source
    message = task_message(url, planned, epoch=0, start=500)
    assert planned.since.version == 1
    time.sleep(0.02)

    report = recovery.recover(ReplicationLog.open(url), grace_ms=10)
    deleted = set(report.garbage) & {s.path for s in message.segments}
    assert deleted  # the collection took the micro-batch's files

    writer = commit_process(source)
    with pytest.raises(StagingCollectedError):
        writer.commit([message], 0)
    check_intact(url)


def test_a_stream_abort_after_its_commit_landed_keeps_the_committed_files(
    tmp_path: Path, fresh_spark_caches: None
) -> None:
    """Spark calls ``abort`` when ``commit`` raised for any reason, also after the commit
    landed (the commit runner's worker died before reporting success). The abort runs in
    a fresh ``streamWriter()``; it takes the attempt's StagingStart from the commit
    messages, so it looks for the attempt's files in the commits made since planning,
    finds them committed, and deletes nothing."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    source = ReplogSinkDataSource({"path": url, "sinkId": "s", "shards": "2"})
    planned = source.streamWriter(schema=SCHEMA, overwrite=False)  # planning
    message = task_message(url, planned, epoch=0, start=500)

    commit_process(source).commit([message], 0)  # lands; the worker then dies unreported
    assert verify(ReplicationLog.open(url)).ok

    commit_process(source).abort([message], 0)  # Spark's abort of the failed commit
    missing = [s.path for s in message.segments if not Path(url, s.path).exists()]
    assert not missing, f"abort deleted {missing}, which commit 2 names: events lost"
    check_intact(url)


def test_a_leased_batch_write_is_not_refused_by_a_recover_that_kept_its_files(
    tmp_path: Path, fresh_spark_caches: None
) -> None:
    """``df.write`` holds a staging lease from before it staged, so every recover keeps
    its files. A write that began 55 minutes ago, with an hourly default-grace recover in
    between (its cut-off within the clock skew of the write's start), commits: a covering
    mark makes a leased write check its files, never refuse."""
    url = str(tmp_path / "log")
    filled_log(url, commits=1, shards=2)
    began = now_ms() - 55 * MINUTE
    with use_clock(lambda: began / 1000):  # the driver, 55 minutes ago
        writer = ReplogSinkDataSource({"path": url}).writer(schema=SCHEMA, overwrite=False)
    messages = [
        task_message(url, writer, epoch=0, start=500),
        task_message(url, writer, epoch=0, start=600),
    ]
    staged = [s.path for m in messages for s in m.segments]

    report = recovery.recover(ReplicationLog.open(url))  # default grace: 1 hour
    assert not set(report.garbage) & set(staged)  # the lease kept them
    assert all(Path(url, p).exists() for p in staged)

    committer = pickle.loads(pickle.dumps(writer))  # commit_data_source_write.py
    try:
        committer.commit(messages)
    except StagingCollectedError as exc:
        pytest.fail(f"a leased write whose files recover kept was refused: {exc}")
    assert len(check_log(ReplicationLog.open(url))) == 40 + 12
