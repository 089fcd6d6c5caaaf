"""The replog-sink on a real SparkSession (crash tests are in integration/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from logcheck import check_log, run_concurrently
from pyspark.sql import functions as F
from replication import assert_exact_replica, fill_source
from replog.consumers import sink_store

from replog.log import ReplicationLog

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
    manifest = sink_store(log, "batch").load_latest()
    assert manifest is not None and manifest.sink_commit_statuses["batch"].is_committed


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
        frame.write.format("replog-sink").mode("append").option("sinkId", "bad").save(target)
    log = ReplicationLog.open(target)
    assert log.refresh().version == 0
    assert log.orphaned_segments(grace_ms=0) == []  # staged files of the good task: deleted
    manifest = sink_store(log, "bad").load_latest()
    assert manifest is not None and manifest.sink_commit_statuses["bad"].is_failed


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
    assert set(info["sinks"]) == {"from-0", "from-1"}
    assert info["version"] >= 12  # at least 6 epochs each, interleaved commits


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
