"""Spark Connect (issue 23 part 4): the source (batch and AvailableNow stream), the sink and
the functions through a Connect session on a local Connect server (``connect`` fixture)."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest
from support.cli import replog
from support.logcheck import check_log

from replog.log import ReplicationLog

pytestmark = pytest.mark.connect

DATA = Path(__file__).parent / "data" / "debezium"


def debezium_log(tmp_path: Path) -> str:
    url = str(tmp_path / "customers")
    assert replog("create", url, "--shards", "2").returncode == 0
    done = replog(
        "append", url, str(DATA / "postgres_customers.jsonl"),
        "--format", "debezium", "--key-fields", "id",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return url


def test_functions_through_connect(connect, tmp_path: Path) -> None:
    from replog.spark.functions import from_debezium, parse_payload, to_debezium, typed

    url = debezium_log(tmp_path)
    stored = check_log(ReplicationLog.open(url))
    events = connect.read.format("replog").load(url)
    assert events.count() == len(stored) == 6
    parsed = events.select(parse_payload("data", "id int, name string").alias("row"))
    ids = sorted(json.loads(r["data"])["id"] for r in stored)
    assert sorted(r["row"]["id"] for r in parsed.collect()) == ids
    strict = events.select(parse_payload("data", "id int", {"mode": "FAILFAST"}).alias("r"))
    assert sorted(r["r"]["id"] for r in strict.collect()) == ids
    rows = typed(events, url, "inventory.customers").where("operation = 'insert'").collect()
    balances = {r["after"]["id"]: r["after"]["balance"] for r in rows}
    assert balances[1001] == Decimal("1234.56")
    records = to_debezium(events, log=url).collect()
    assert sum(r["value"] is None for r in records) == 1  # the delete's tombstone
    ops = sorted(json.loads(r["value"])["op"] for r in records if r["value"] is not None)
    assert ops == sorted(json.loads(r["metadata"])["op"] for r in stored)  # r kept
    changes = events.where("operation != 'delete'")  # this delete's key is in the Kafka key
    back = from_debezium(to_debezium(changes), ["id"]).collect()
    assert sorted(r["event_id"] for r in back) == sorted(r["event_id"] for r in changes.collect())


def test_source_and_sink_through_connect_before_and_after_register(connect, tmp_path: Path) -> None:
    """A batch read, then ``spark.dataSource.register`` and ``replog.register``, then
    streams (the order that made every later stream fail, issue 23)."""
    import replog as replog_package
    from replog.spark.source import ReplogDataSource

    source = ReplicationLog.create(str(tmp_path / "source"), 2)
    source.append([{"key": f"k{i}", "data": {"id": i}} for i in range(20)])
    assert connect.read.format("replog").load(source.url).count() == 20
    connect.dataSource.register(ReplogDataSource)
    replog_package.register(connect)
    for run in range(2):
        if run:
            source.append([{"key": f"k{i}", "data": {"id": i}} for i in range(20, 25)])
        query = (
            connect.readStream.format("replog")
            .option("consumer", "copier")
            .load(source.url)
            .writeStream.format("replog-sink")
            .option("checkpointLocation", str(tmp_path / "chk"))
            .trigger(availableNow=True)
            .start(str(tmp_path / "target"))
        )
        query.awaitTermination()
        assert query.exception() is None
    target = check_log(ReplicationLog.open(str(tmp_path / "target")))
    assert sorted(json.loads(r["data"])["id"] for r in target) == list(range(25))
    batch = (
        connect.read.format("replog")
        .option("startingOffsets", '{"0": 0, "1": 0}')
        .load(str(tmp_path / "target"))
    )
    assert batch.count() == 25
    written = connect.createDataFrame(
        [("e1", "k", '{"id": 1}')], "event_id string, key string, data string"
    )
    written.write.format("replog-sink").mode("append").save(str(tmp_path / "batch"))
    batch_log = ReplicationLog.open(str(tmp_path / "batch"))
    assert [r["event_id"] for r in check_log(batch_log)] == ["e1"]
