"""Faithful Debezium output (issue 23 part 3): Debezium JSON in → ``replog append --format
debezium`` → ``to_debezium`` → the same envelopes, apart from the differences CDC.md lists
("Debezium out"): no schema wrapper, the Kafka key in Debezium's schemaless form, BEGIN/END
records and redeliveries not repeated, a ``ts_ms`` the event lacked left out."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from support.cli import replog
from support.logcheck import check_log

from replog import debezium
from replog.format import jsontext
from replog.log import ReplicationLog

DATA = Path(__file__).parent / "data" / "debezium"
FIXTURES = ("postgres_customers.jsonl", "mysql_orders.jsonl")


def expected_records(path: Path) -> dict[str, list[str | None]]:
    """Per key, the value texts Debezium sent (the payload's exact text; None for a
    tombstone), in order, without BEGIN/END records and redeliveries."""
    per_key: dict[str, list[str | None]] = defaultdict(list)
    seen: set[str] = set()
    for line in path.read_text().splitlines():
        members = jsontext.parse_object(line)
        if "value" in members and set(members) <= {"key", "value"}:
            key_members = jsontext.parse_object(members["key"].text)
            key_text = key_members["payload"].text if "payload" in key_members else None
            if members["value"].value is None:
                assert key_text is not None
                per_key[key_text].append(None)  # the tombstone after a delete
                continue
            members = jsontext.parse_object(members["value"].text)
        value = members.get("payload")
        text = value.text if value is not None else line
        envelope = jsontext.parse_object(text)
        if "status" in envelope:  # a transaction BEGIN/END record
            continue
        if text in seen:  # a redelivery
            continue
        seen.add(text)
        row = envelope.get("after") if "op" in envelope else None
        if "op" in envelope and envelope["op"].value == "d":
            row = envelope.get("before")
        image = jsontext.parse_object(row.text) if row is not None and row.value else envelope
        key = '{"id":' + image["id"].text + "}" if "id" in image else key_text
        assert key is not None
        per_key[key].append(text)
        deleted = ("op" in envelope and envelope["op"].value == "d") or (
            "__deleted" in envelope and envelope["__deleted"].value == "true"
        )
        if deleted and not line.startswith('{"key"'):  # a Kafka record line brings its own
            per_key[key].append(None)
    return dict(per_key)


def appended(tmp_path: Path, name: str) -> str:
    url = str(tmp_path / name)
    assert replog("create", url, "--shards", "2").returncode == 0
    result = replog(
        "append", url, str(DATA / name), "--format", "debezium", "--key-fields", "id", "--json"
    )
    assert result.returncode == 0, result.stderr
    return url


@pytest.mark.parametrize("name", FIXTURES)
def test_the_original_envelopes_come_back(tmp_path: Path, name: str) -> None:
    """The core mapping, without Spark: each stored event gives its envelope back."""
    url = appended(tmp_path, name)
    per_key: dict[str, list[str | None]] = defaultdict(list)
    for row in sorted(check_log(ReplicationLog.open(url)), key=lambda r: r["sequence"]):
        value = debezium.original_envelope(
            row["metadata"],
            operation=row["operation"],
            data=row["data"].decode(),
            before=row["before"].decode() if row["before"] is not None else None,
        )
        assert value is not None
        per_key[row["key"]].append(value)
        if row["operation"] == "delete":
            per_key[row["key"]].append(None)
    assert dict(per_key) == expected_records(DATA / name)


def test_events_not_from_debezium_get_a_replog_envelope() -> None:
    for metadata in ('{"note": 1}', None, '{"op": "c", "source": "x"}'):
        made = debezium.original_envelope(metadata, operation="insert", data="{}", before=None)
        assert made is None
    made = debezium.envelope(
        operation="bulk", data='{"id":1}', before=None, ts_ms=5, source={"connector": "replog"}
    )
    assert made == (
        '{"before":null,"after":{"id":1},"source":{"connector":"replog"},'
        '"transaction":null,"op":"c","ts_ms":5}'
    )


@pytest.mark.spark
@pytest.mark.parametrize("name", FIXTURES)
def test_to_debezium_gives_kafka_records_of_the_original_envelopes(
    spark, tmp_path: Path, name: str
) -> None:
    from replog.spark.functions import to_debezium

    url = appended(tmp_path, name)
    log_id = ReplicationLog.open(url).log_id
    frame = to_debezium(spark.read.format("replog").load(url), log=url)
    assert frame.schema.simpleString() == (
        "struct<key:string,value:string,headers:array<struct<key:string,value:binary>>>"
    )
    rows = frame.collect()
    per_key: dict[str, list[str | None]] = defaultdict(list)
    for row in rows:  # a task keeps its shard's order: a delete, then its tombstone
        headers = {h["key"]: bytes(h["value"]).decode() for h in row["headers"]}
        assert headers["replog.log_id"] == log_id
        names = ("event_id", "log_id", "sequence", "shard")
        assert sorted(headers) == [f"replog.{h}" for h in names]
        per_key[row["key"]].append(row["value"])
    assert dict(per_key) == expected_records(DATA / name)
    kept = to_debezium(spark.read.format("replog").load(url), tombstones=False).collect()
    assert len(kept) == len(rows) - sum(r["value"] is None for r in rows)
    assert all(r["value"] is not None for r in kept)
    assert all(len(r["headers"]) == 3 for r in kept)  # no log named: no log id
    if name.startswith("postgres"):
        ops = [json.loads(r["value"])["op"] for r in kept]
        assert ops.count("r") == 2  # snapshot reads stay reads
        first = json.loads(kept[0]["value"]) if kept else {}
        assert first["source"]["connector"] == "postgresql"
