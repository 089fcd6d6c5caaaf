"""Issue 44: real Kafka and real Debezium.

One Debezium run per session (Debezium's PostgreSQL connector 3.6.1 in its embedded
engine, tests/support/debezium_peer.py) captures a workload on the tests' PostgreSQL
server; its records, as Kafka Connect's JsonConverter serialized them, go to a real Kafka
broker (tests/support/kafka.py), and:

* Spark's Kafka source -> ``from_debezium`` -> ``replog-sink`` holds each change exactly
  once through driver SIGKILLs at every sink step and Debezium's redeliveries (the same
  records produced again, as a restarted connector resends them), every event counted;
* ``to_debezium`` -> Spark's Kafka sink -> a plain consumer (librdkafka) reads the keys and
  values Debezium wrote, byte for byte, tombstones in place;
* a Kafka replay from a time and a replog consumer reset to that time give the same changes.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from support.debezium_peer import DebeziumPeer, change_value
from support.kafka import jars
from support.logcheck import check_log
from support.replication import run_app

from replog import debezium
from replog.format import jsontext
from replog.log import ReplicationLog

pytestmark = [pytest.mark.slow, pytest.mark.spark]

TABLES = ("public.customers", "public.orders", "public.sentinel")
SCHEMA = [
    """CREATE TABLE customers (id int PRIMARY KEY, name text, balance numeric(12,2), born date,
       created timestamp, updated timestamptz, note text, tags text[])""",
    """CREATE TABLE orders (id bigint PRIMARY KEY, customer int, total numeric(12,2),
       status text)""",
    "ALTER TABLE orders REPLICA IDENTITY FULL",
    "CREATE TABLE sentinel (id int PRIMARY KEY)",
]
BIG = "repeat(md5(random()::text), 300)"  # ~10 kB of text: stored out of line (TOASTed)


def snapshot_rows(connection: psycopg.Connection[Any]) -> None:
    for n in range(1, 21):
        connection.execute(
            f"INSERT INTO customers VALUES (%s, %s, %s, '1980-01-02', '2024-03-01 10:00:00.5',"
            f" '2024-03-01 10:00:00+02', {BIG if n % 4 == 0 else 'NULL'}, ARRAY['a', 'b'])",
            (n, f"customer {n}", f"{n}.{n % 100:02d}"),
        )
        connection.execute("INSERT INTO orders VALUES (%s, %s, %s, 'new')", (n, n, f"{n * 3}.50"))


def changes(connection: psycopg.Connection[Any]) -> None:
    """Inserts, updates (TOASTed columns unchanged), deletes, a key change, transactions of
    several tables, one large transaction."""
    for n in range(21, 41):
        with connection.transaction():
            connection.execute(
                f"INSERT INTO customers VALUES (%s, %s, 9999999.99, '2000-02-29', now(), now(),"
                f" {BIG}, ARRAY['x'])",
                (n, f"new {n}"),
            )
            connection.execute("INSERT INTO orders VALUES (%s, %s, 1.00, 'new')", (n, n))
    for n in range(1, 41, 3):
        connection.execute("UPDATE customers SET balance = balance + 1 WHERE id = %s", (n,))
        connection.execute("UPDATE orders SET status = 'paid' WHERE id = %s", (n,))
    connection.execute("UPDATE customers SET id = 1000 WHERE id = 4")  # key change, TOASTed
    for n in range(2, 41, 5):
        with connection.transaction():
            connection.execute("DELETE FROM orders WHERE id = %s", (n,))
            connection.execute("DELETE FROM customers WHERE id = %s", (n,))
    with connection.transaction():  # one large transaction
        connection.execute("UPDATE orders SET total = total * 2 WHERE status = 'new'")
    connection.execute("INSERT INTO sentinel VALUES (1)")


@dataclass
class Run:
    """The workload's database and Debezium's records of it."""

    dsn: str
    records: list[dict[str, Any]]


@pytest.fixture(scope="module")
def debezium_run(postgres_server, tmp_path_factory) -> Iterator[Run]:
    directory = tmp_path_factory.mktemp("debezium")
    with postgres_server.database() as dsn:
        with psycopg.connect(dsn, autocommit=True) as connection:
            for statement in SCHEMA:
                connection.execute(statement)
            snapshot_rows(connection)
        with DebeziumPeer(dsn, directory, tables=TABLES) as peer:
            peer.wait_for(
                lambda r: (change_value(r) or {}).get("source", {}).get("snapshot") == "last"
            )
            with psycopg.connect(dsn, autocommit=True) as connection:
                changes(connection)
            peer.wait_for(
                lambda r: r["topic"].endswith(".sentinel") and change_value(r) is not None
            )
        yield Run(dsn, peer.records())


def _table_records(run: Run) -> list[dict[str, Any]]:
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


def _expected_events(records: list[dict[str, Any]], flat_topics: bool = False) -> dict[str, str]:
    """event_id -> operation of each change the records hold, as replog maps it."""
    expected = {}
    for record in records:
        if record["value"] is None:
            continue
        line = '{"key":' + record["key"] + ',"value":' + record["value"] + "}"
        change = debezium.debezium_record(jsontext.parse_object(line), ("id",))
        if isinstance(change, dict):
            expected[change["event_id"]] = change["operation"]
    return expected


def test_debezium_topics_into_replog_exactly_once_through_kills_and_redeliveries(
    debezium_run: Run, kafka_broker, tmp_path: Path
) -> None:
    run = debezium_run
    prefix = f"crash{uuid.uuid4().hex[:6]}"
    rename = {t: f"{prefix}.{t}" for t in ("dbserver1.public.customers", "dbserver1.public.orders")}
    _create_topics(kafka_broker.bootstrap, list(rename.values()))
    records = _table_records(run)
    assert sum(1 for r in records if r["value"] is None) >= 8  # tombstones after the deletes
    as_sent = [(rename[r["topic"]], r["key"], r["value"], r["headers"]) for r in records]
    half = len(as_sent) // 2
    _produce(kafka_broker.bootstrap, as_sent[:half])
    target, checkpoint = str(tmp_path / "log"), str(tmp_path / "chk")
    connector = ",".join(str(j) for j in jars("spark-kafka"))
    args = [kafka_broker.bootstrap, ",".join(rename.values()), target, checkpoint,
            "--max-offsets", "40", "--jars", connector]  # fmt: skip
    steps = ["staged", "after_pending", "after_log_commit", "after_committed"]
    for number, step in enumerate(steps):
        crashed = run_app("kafka_to_replog.py", *args, fault=f"{step}@{number + 1}")
        assert crashed.returncode == -9, crashed.stderr[-3000:]  # SIGKILL, not a clean exit
        if number == 1:  # the rest of the changes, then a connector restart's resend
            _produce(kafka_broker.bootstrap, as_sent[half:])
        if number == 2:
            _produce(kafka_broker.bootstrap, as_sent[half - 30 : half + 30])
    finished = run_app("kafka_to_replog.py", *args)
    assert finished.returncode == 0, finished.stderr[-3000:]

    expected = _expected_events(records)
    held = check_log(ReplicationLog.open(target))  # gapless, no event id twice
    assert Counter(row["event_id"] for row in held) == Counter(dict.fromkeys(expected, 1))
    assert {row["event_id"]: row["operation"] for row in held} == expected
    operations = Counter(expected.values())
    assert operations["delete"] >= 8 and operations["update"] >= 20 and operations["insert"] >= 80


def test_to_debezium_through_kafka_gives_debeziums_records_byte_for_byte(
    debezium_run: Run, kafka_broker, spark, tmp_path: Path
) -> None:
    """Debezium's schemaless records appended to a log, then out through ``to_debezium``
    and Spark's Kafka sink: a plain consumer reads Debezium's keys and values, byte for
    byte, per key in order, a tombstone after each delete; the headers are replog's."""
    from replog.ingest import read_lines
    from replog.spark.functions import to_debezium

    records = _table_records(debezium_run)
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
    debezium_run: Run, kafka_broker, spark, tmp_path: Path
) -> None:
    """CDC.md "Start from a time": Kafka's ``startingTimestamp`` on the topic (records
    stamped with the change's source time, as Connect stamps them) and ``replog consumer set
    --to-datetime`` on the log fed from it replay the same changes."""
    from support.cli import replog

    from replog.spark.functions import from_debezium

    records = [r for r in _table_records(debezium_run) if r["value"] is not None]
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
