"""Debezium in and out on a real SparkSession (replog.spark.functions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.logcheck import check_log, read_all

from replog.format.jsontext import parse_object
from replog.log import ReplicationLog
from replog.spark.functions import from_debezium, to_debezium

pytestmark = pytest.mark.spark

SOURCE = '{"connector":"mysql","db":"inventory","table":"products","ts_ms":1700000000000,"pos":%d}'
PRODUCT = (
    '{"id":101,"name":"scooter","weight":3.140000000000000124344978758017532527446746826171875}'
)
UPDATED = '{"id":101,"name":"scooter","weight":5.18}'


def change(op: str, before: str | None, after: str | None, pos: int) -> str:
    return (
        f'{{"before":{before or "null"},"after":{after or "null"},"source":{SOURCE % pos},'
        f'"op":"{op}","ts_ms":1700000009000}}'
    )


def test_from_debezium_feeds_the_sink_with_exact_payloads(spark, tmp_path: Path) -> None:
    values = [
        '{"schema":{"type":"struct"},"payload":' + change("r", None, PRODUCT, 1) + "}",
        change("u", PRODUCT, UPDATED, 2),
        None,  # a Kafka tombstone
        change("d", UPDATED, None, 3),
        '{"op":"t","source":{"db":"inventory","table":"products"}}',
    ]
    kafka_like = spark.createDataFrame(
        [(None if v is None else bytearray(v.encode()),) for v in values], "value binary"
    )
    events = from_debezium(kafka_like, ["id"])
    events.write.format("replog-sink").mode("append").save(str(tmp_path / "B"))
    rows = sorted(check_log(ReplicationLog.open(str(tmp_path / "B"))), key=lambda r: r["data"])
    assert len(rows) == 3 and {r["key"] for r in rows} == {'{"id":101}'}
    by_op = {r["operation"]: r for r in rows}
    assert by_op["insert"]["data"] == PRODUCT.encode()  # 50 digits kept
    assert by_op["update"]["before"] == PRODUCT.encode()
    assert by_op["update"]["data"] == UPDATED.encode()
    assert by_op["delete"]["data"] == UPDATED.encode()
    assert {r["collection"] for r in rows} == {"inventory.products"}


def test_from_debezium_names_a_bad_value(spark) -> None:
    frame = spark.createDataFrame([('{"op":"c","after":{"name":"x"}}',)], "value string")
    with pytest.raises(Exception, match=r"key field\(s\) \['id'\]"):
        from_debezium(frame, ["id"]).collect()


def test_to_debezium_round_trips_through_from_debezium(spark, tmp_path: Path) -> None:
    log = ReplicationLog.create(str(tmp_path / "A"), 2)
    log.append(
        [
            {"key": '{"id":1}', "operation": "insert", "data": '{"id":1,"w":1.50}'},
            {
                "key": '{"id":1}',
                "operation": "update",
                "data": '{"id":1,"w":2.25}',
                "before": '{"id":1,"w":1.50}',
            },
            {"key": '{"id":1}', "operation": "delete", "data": '{"id":1,"w":2.25}'},
        ]
    )
    envelopes = to_debezium(spark.read.format("replog").load(log.url), log=log.url)
    records = envelopes.collect()
    assert [r["value"] is None for r in records].count(True) == 1  # the delete's tombstone
    rows = sorted(
        (r for r in records if r["value"] is not None),
        key=lambda r: json.loads(r["value"])["source"]["sequence"],
    )
    values = [parse_object(r["value"]) for r in rows]
    assert [v["op"].value for v in values] == ["c", "u", "d"]
    assert values[1]["before"].text == '{"id":1,"w":1.50}'
    assert values[1]["after"].text == '{"id":1,"w":2.25}'
    assert values[2]["after"].value is None and values[2]["before"].text == '{"id":1,"w":2.25}'
    source = json.loads(rows[0]["value"])["source"]
    assert source["log"] == log.url and source["sequence"] == 1 and source["shard"] in (0, 1)
    assert [r["key"] for r in rows] == ['{"id":1}'] * 3
    back = {r["operation"]: r for r in from_debezium(envelopes, ["id"]).collect()}
    assert sorted(back) == ["delete", "insert", "update"]
    assert back["update"]["before"] == '{"id":1,"w":1.50}'
    assert back["update"]["data"] == '{"id":1,"w":2.25}'
    assert back["delete"]["data"] == '{"id":1,"w":2.25}'
    assert {r["key"] for r in back.values()} == {'{"id":1}'}


def test_parse_payload_types_data_with_exact_decimals(spark, tmp_path: Path) -> None:
    from replog.spark.functions import parse_payload

    log = ReplicationLog.create(str(tmp_path / "A"), 1)
    log.append([{"key": "k", "data": '{"id": 7, "price": 12345678901234567890.123456789}'}])
    typed = (
        spark.read.format("replog")
        .load(log.url)
        .select(parse_payload("data", "id long, price decimal(38, 9)").alias("row"))
        .select("row.*")
        .collect()
    )
    assert typed[0]["id"] == 7
    assert str(typed[0]["price"]) == "12345678901234567890.123456789"


def _redelivery_stream(spark, folder: Path, target: str, checkpoint: str, within: str | None):
    events = from_debezium(spark.readStream.text(str(folder)), ["id"], redeliveries_within=within)
    query = (
        events.writeStream.format("replog-sink")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start(target)
    )
    query.awaitTermination()
    assert query.exception() is None


@pytest.mark.parametrize("within", ["1 hour", None])
def test_from_debezium_drops_redeliveries_across_micro_batches(
    spark, tmp_path: Path, within: str | None
) -> None:
    """Debezium restarted redelivers what it sent since its last offset commit: the topic
    holds those changes twice, at later Kafka offsets, so they reach a later micro-batch
    (here a later run of the query). With ``redeliveries_within`` each is written once."""
    folder = tmp_path / "topic"
    folder.mkdir()
    row = '{"id":%d,"name":"p%d"}'
    lines = [change("c", None, row % (pos, pos), pos) for pos in range(1, 9)]
    (folder / "0.json").write_text("\n".join(lines[:5] + lines[2:5]) + "\n")  # 3-5 twice
    target, checkpoint = str(tmp_path / "log"), str(tmp_path / "chk")
    _redelivery_stream(spark, folder, target, checkpoint, within)
    (folder / "1.json").write_text("\n".join(lines[3:]) + "\n")  # restarted from 4
    _redelivery_stream(spark, folder, target, checkpoint, within)
    log = ReplicationLog.open(target)
    if within is None:  # what the option is for: each redelivery written again
        assert read_all(log).num_rows == 8 + 3 + 2
    else:
        expected = sorted((row % (pos, pos)).encode() for pos in range(1, 9))
        assert sorted(r["data"] for r in check_log(log)) == expected
