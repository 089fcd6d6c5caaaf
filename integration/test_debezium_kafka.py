"""Issue 44: real Kafka and real Debezium.

The session's one Debezium run (Debezium's PostgreSQL connector 3.6.1 in its embedded
engine, tests/support/debezium_peer.py, on the workload of tests/support/debezium_workload.py,
which the differential test shares) gives records of ``customers`` and ``orders``, as Kafka
Connect's JsonConverter serialized them; they go to a real Kafka broker
(tests/support/kafka.py), and:

* Spark's Kafka source -> ``from_debezium`` -> ``replog-sink`` holds each change exactly
  once, field for field, through driver SIGKILLs at every sink step and Debezium's
  redeliveries (the same records produced again, as a restarted connector resends them),
  every event counted;
* ``to_debezium`` -> Spark's Kafka sink -> a plain consumer (librdkafka) reads the keys and
  values Debezium wrote, byte for byte, tombstones in place;
* a Kafka replay from a time and a replog consumer reset to that time give the same changes.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.debezium_workload import PeerRun
from support.kafka import jars
from support.logcheck import check_log
from support.replication import run_app

from replog import debezium
from replog.format import jsontext
from replog.log import ReplicationLog

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _table_records(run: PeerRun) -> list[dict[str, Any]]:
    """Debezium's records of the keyed-by-id tables (changes and tombstones)."""
    return [
        r
        for r in run.records
        if r["topic"] in ("dbserver1.public.customers", "dbserver1.public.orders")
    ]


def _produce(bootstrap: str, records: list[tuple[str, str | None, str | None, list[Any]]]) -> None:
    from confluent_kafka import Producer

    producer = Producer(
        {"bootstrap.servers": bootstrap, "enable.idempotence": True, "log_level": 3}
    )
    for topic, key, value, headers in records:
        producer.produce(
            topic,
            key=key.encode() if key is not None else None,
            value=value.encode() if value is not None else None,
            headers=[(name, (text or "").encode()) for name, text in headers],
        )
    assert producer.flush(120) == 0


def _create_topics(bootstrap: str, topics: list[str], partitions: int = 2) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(t, partitions, 1) for t in topics]).values():
        future.result(120)


def _consume(bootstrap: str, topic: str, expected: int) -> list[Any]:
    """Every record of ``topic`` (at least ``expected``), read by a plain consumer."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "log_level": 3})  # fmt: skip
    consumer.subscribe([topic])
    found: list[Any] = []
    empty_polls = 0
    while len(found) < expected or empty_polls < 3:
        message = consumer.poll(5)
        if message is None:
            empty_polls += 1
            assert empty_polls < 60, f"{topic}: {len(found)} records of {expected} after 300 s"
            continue
        assert message.error() is None, message.error()
        found.append(message)
    consumer.close()
    return found


def _expected_events(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """event_id -> the event each change of the records is, as replog maps it (the core's
    mapping: what ``from_debezium`` must give through Spark and Kafka, field for field)."""
    expected = {}
    for record in records:
        if record["value"] is None:
            continue
        line = '{"key":' + record["key"] + ',"value":' + record["value"] + "}"
        change = debezium.debezium_record(jsontext.parse_object(line), ("id",))
        if isinstance(change, dict):
            expected[change["event_id"]] = {
                name: None if change[name] is None else str(change[name]) for name in FIELDS
            }
    return expected


FIELDS = ("operation", "collection", "key", "data", "before", "metadata")


def _held(row: dict[str, Any]) -> dict[str, Any]:
    """A log row's event fields as :func:`_expected_events` gives them (payloads as text)."""
    text = {name: row[name] for name in FIELDS}
    for name in ("data", "before"):
        text[name] = None if row[name] is None else row[name].decode()
    return text


KILLS = [("staged", 0), ("after_pending", 0), ("after_log_commit", 0), ("after_committed", 1)]
"""Where each driver run dies: every step of the sink's commit protocol, each on the batch a
restart replays (its staged files left, Pending without and with the log's commit), the
last on the next batch (a replayed batch whose commit the sink already holds never reaches
``after_committed``): each of the four recoveries runs, with one batch or two per run."""


def test_debezium_topics_into_replog_exactly_once_through_kills_and_redeliveries(
    peer_run: PeerRun, kafka_broker, spark, tmp_path: Path
) -> None:
    """Four driver processes SIGKILLed (driver, JVM and Python workers at once), one at each
    sink step; the records after the first half arrive after the second kill, a connector's
    resend of 60 of them after the third; the killed pipeline is then finished in this
    test's own session (a fifth JVM start would add nothing to the proof)."""
    from apps.kafka_to_replog import start_query

    run = peer_run
    prefix = f"crash{uuid.uuid4().hex[:6]}"
    rename = {t: f"{prefix}.{t}" for t in ("dbserver1.public.customers", "dbserver1.public.orders")}
    _create_topics(kafka_broker.bootstrap, list(rename.values()))
    records = _table_records(run)
    assert sum(1 for r in records if r["value"] is None) >= 8  # tombstones after the deletes
    as_sent = [(rename[r["topic"]], r["key"], r["value"], r["headers"]) for r in records]
    half = len(as_sent) // 2
    _produce(kafka_broker.bootstrap, as_sent[:half])
    target, checkpoint = str(tmp_path / "log"), str(tmp_path / "chk")
    topics = ",".join(rename.values())
    connector = ",".join(str(j) for j in jars("spark-kafka"))
    args = [kafka_broker.bootstrap, topics, target, checkpoint, "--max-offsets", "40",
            "--jars", connector]  # fmt: skip
    for number, (step, epoch) in enumerate(KILLS):
        crashed = run_app("kafka_to_replog.py", *args, fault=f"{step}@{epoch}")
        # SIGKILL: only the fault hook sends it, and only at this step of this batch
        assert crashed.returncode == -9, crashed.stderr[-3000:]
        if number == 1:  # the rest of the changes, then a connector restart's resend
            _produce(kafka_broker.bootstrap, as_sent[half:])
        if number == 2:
            _produce(kafka_broker.bootstrap, as_sent[half - 30 : half + 30])
    finished = start_query(
        spark, kafka_broker.bootstrap, topics, target, checkpoint, max_offsets="100000"
    )
    finished.awaitTermination()
    assert finished.exception() is None

    expected = _expected_events(records)
    held = check_log(ReplicationLog.open(target))  # gapless, no event id twice
    assert Counter(row["event_id"] for row in held) == Counter(dict.fromkeys(expected, 1))
    differing = [e for e in held if _held(e) != expected[e["event_id"]]]
    assert not differing, (differing[0], expected[differing[0]["event_id"]])
    operations = Counter(event["operation"] for event in expected.values())
    assert operations["delete"] >= 8 and operations["update"] >= 20 and operations["insert"] >= 80


def test_to_debezium_through_kafka_gives_debeziums_records_byte_for_byte(
    peer_run: PeerRun, kafka_broker, spark, tmp_path: Path
) -> None:
    """Debezium's schemaless records appended to a log, then out through ``to_debezium``
    and Spark's Kafka sink: a plain consumer reads Debezium's keys and values, byte for
    byte, per key in order, a tombstone after each delete; the headers are replog's."""
    from replog.ingest import read_lines
    from replog.spark.functions import to_debezium

    records = _table_records(peer_run)
    url = str(tmp_path / "log")
    log = ReplicationLog.create(url, 4)
    lines = ['{"key":' + r["key_plain"] + ',"value":' + (r["value_plain"] or "null") + "}\n"
             for r in records]  # fmt: skip
    log.append(read_lines(lines, format="debezium", key_fields=("id",)).table)
    topic = f"out-{uuid.uuid4().hex[:8]}"
    _create_topics(kafka_broker.bootstrap, [topic], partitions=3)
    query = (
        to_debezium(spark.readStream.format("replog").load(url), log=url)
        .writeStream.format("kafka")
        .option("kafka.bootstrap.servers", kafka_broker.bootstrap)
        .option("topic", topic)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    consumed = _consume(kafka_broker.bootstrap, topic, len(records))
    assert len(consumed) == len(records)

    def per_key(pairs: list[tuple[bytes, bytes | None]]) -> dict[bytes, list[bytes | None]]:
        grouped: dict[bytes, list[bytes | None]] = {}
        for key, value in pairs:
            grouped.setdefault(key, []).append(value)
        return grouped

    debeziums = [(r["key_plain"].encode(), r["value_plain"].encode() if r["value_plain"] else None)
                 for r in records]  # fmt: skip
    assert per_key([(m.key(), m.value()) for m in consumed]) == per_key(debeziums)
    log_id = ReplicationLog.open(url).log_id
    for message in consumed:
        headers = dict(message.headers())
        assert set(headers) == {
            "replog.shard",
            "replog.sequence",
            "replog.event_id",
            "replog.log_id",
        }
        assert headers["replog.log_id"] == log_id.encode()
        int(headers["replog.sequence"]), uuid.UUID(headers["replog.event_id"].decode())


def test_a_kafka_replay_from_a_time_and_a_consumer_reset_to_it_agree(
    peer_run: PeerRun, kafka_broker, spark, tmp_path: Path
) -> None:
    """CDC.md "Start from a time": Kafka's ``startingTimestamp`` on the topic (records
    stamped with the change's source time, as Connect stamps them) and ``replog consumer set
    --to-datetime`` on the log fed from it replay the same changes."""
    from support.cli import replog

    from replog.spark.functions import from_debezium

    records = [r for r in _table_records(peer_run) if r["value"] is not None]
    topic = f"replay-{uuid.uuid4().hex[:8]}"
    _create_topics(kafka_broker.bootstrap, [topic], partitions=1)
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap, "log_level": 3})
    stamps = []
    for record in records:
        stamp = json.loads(record["value"])["payload"]["source"]["ts_ms"]
        stamps.append(stamp)
        producer.produce(topic, key=record["key"].encode(), value=record["value"].encode(),
                         timestamp=stamp)  # fmt: skip
    assert producer.flush(120) == 0
    url = str(tmp_path / "log")
    assert replog("create", url, "--shards", "2").returncode == 0
    kafka = (spark.readStream.format("kafka")
             .option("kafka.bootstrap.servers", kafka_broker.bootstrap)
             .option("subscribe", topic).option("startingOffsets", "earliest").load())  # fmt: skip
    query = (from_debezium(kafka, ["id"]).writeStream.format("replog-sink")
             .option("checkpointLocation", str(tmp_path / "chk"))
             .trigger(availableNow=True).start(url))  # fmt: skip
    query.awaitTermination()
    middle = sorted(set(stamps))[len(set(stamps)) // 2]  # a time inside the stream

    replayed_kafka = from_debezium(
        spark.read.format("kafka").option("kafka.bootstrap.servers", kafka_broker.bootstrap)
        .option("subscribe", topic).option("startingTimestamp", str(middle)).load(),
        ["id"],
    )  # fmt: skip
    iso = datetime.datetime.fromtimestamp(middle / 1000, datetime.timezone.utc)
    when = iso.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    done = replog("consumer", "set", url, "--consumer", "replay", "--create", "--execute",
                  "--to-datetime", when)  # fmt: skip
    assert done.returncode == 0, done.stderr
    replayed: list[str] = []
    (spark.readStream.format("replog").option("consumer", "replay").load(url).select("event_id")
     .writeStream.foreachBatch(lambda b, _: replayed.extend(r[0] for r in b.collect()))
     .option("checkpointLocation", str(tmp_path / "chk-replay"))
     .trigger(availableNow=True).start().awaitTermination())  # fmt: skip
    from_kafka = sorted(r["event_id"] for r in replayed_kafka.collect())
    assert from_kafka and sorted(replayed) == from_kafka
    assert len(from_kafka) < len(records)  # a replay, not everything
