"""The replog-sink on a real SparkSession (crash tests are in integration/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pyspark.sql import functions as F
from support.logcheck import check_log, run_concurrently
from support.replication import assert_exact_replica, fill_source

from replog.checkpoints import consumers
from replog.core import leases as lease_store
from replog.log import ReplicationLog
from replog.ops import garbage

pytestmark = pytest.mark.spark


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
    assert not lease_store.leases(log.storage)  # the job's staging lease was released


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
    assert not lease_store.leases(log.storage)


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
