"""Issue 44: the Kafka message key ``to_debezium`` writes is the one the event's connector
writes. Inside the log a MongoDB event's key is one canonical form (``{"_id":1004}``); out to
Kafka it is the MongoDB connector's ``{"id":"<the id as relaxed extended JSON>"}``
(Debezium 3.x ``JsonSerialization.getDocumentIdOplog``: MongoDB's writer in relaxed mode,
indented with no indent and no new lines), so a consumer looking a document up by the key's
``id`` finds it. Every other connector's key is the event's key as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_debezium_corpus import _kafka_records, appended

from replog import debezium
from replog.format import jsontext

# (the document's _id as the connector writes the document, the key Debezium writes)
MONGODB_IDS = [
    ('{"$numberLong": "1004"}', '{"id":"1004"}'),
    ("1004", '{"id":"1004"}'),
    ("1004.5", '{"id":"1004.5"}'),
    ("1004.0", '{"id":"1004.0"}'),
    ("1e20", '{"id":"1.0E20"}'),
    ('{"$oid": "596e275826f08b2730779e1f"}', r'{"id":"{\"$oid\": \"596e275826f08b2730779e1f\"}"}'),
    ('"customer-7"', r'{"id":"\"customer-7\""}'),
    ('{"region": "eu", "n": 7}', r'{"id":"{\"region\": \"eu\",\"n\": 7}"}'),
    ('{"$date": 1577836800123}', r'{"id":"{\"$date\": \"2020-01-01T00:00:00.123Z\"}"}'),
    ('{"$binary": "AAE=", "$type": "00"}',
     r'{"id":"{\"$binary\": {\"base64\": \"AAE=\",\"subType\": \"00\"}}"}'),
]  # fmt: skip

INTEGRAL_DOUBLES = {"1004.0": "1004", "1e20": "100000000000000000000"}
"""Doubles of an integral value: the canonical key holds 1004.0 as 1004 (one document for
both, CDC.md), so a delete that carries no document goes out under the integer's key."""

SOURCE = (
    '{"version":"3.6.1.Final","connector":"mongodb","name":"fulfillment","ts_ms":1558965508000,'
    '"snapshot":"false","db":"inventory","rs":"rs0","collection":"customers","ord":%d}'
)


def _mongodb(op: str, document: str | None, key: str | None, ord_: int) -> dict[str, object]:
    value = {"op": op, "ts_ms": 1558965515240, "source": json.loads(SOURCE % ord_)}
    value["after" if op != "d" else "before"] = document
    line = json.dumps({"key": json.loads(key), "value": value} if key else value)
    converted = debezium.convert(jsontext.parse_object(line), ("_id",), text=line, filled_ms=0)
    assert isinstance(converted, debezium.Change)
    return converted.record


@pytest.mark.parametrize(("id_text", "expected"), MONGODB_IDS, ids=[i for i, _ in MONGODB_IDS])
def test_a_mongodb_event_goes_out_under_the_connectors_own_key(id_text: str, expected: str) -> None:
    created = _mongodb("c", '{"_id" : ' + id_text + ', "name" : "Anne"}', None, 1)
    deleted = _mongodb("d", None, expected, 2)  # keyed from the message key alone
    assert created["key"] == deleted["key"]  # one document inside the log
    assert created["key"].startswith('{"_id":')
    out = debezium.message_key(created["key"], str(created["metadata"]), str(created["data"]))
    assert out == expected
    assert json.loads(json.loads(out)["id"]) is not None  # the id is extended JSON
    out = debezium.message_key(deleted["key"], str(deleted["metadata"]), str(deleted["data"]))
    if id_text in INTEGRAL_DOUBLES:  # a delete without its document: the canonical id alone
        assert out == '{"id":"' + INTEGRAL_DOUBLES[id_text] + '"}'
    else:
        assert out == expected


def test_other_connectors_keys_go_out_as_they_are() -> None:
    line = (
        '{"before":null,"after":{"id":1001,"name":"x"},"source":{"connector":"postgresql",'
        '"name":"dbserver1","schema":"inventory","table":"customers","lsn":24023128,'
        '"txId":555,"ts_ms":1},"op":"c","ts_ms":2}'
    )
    converted = debezium.convert(jsontext.parse_object(line), ("id",), text=line, filled_ms=0)
    assert isinstance(converted, debezium.Change)
    record = converted.record
    assert debezium.message_key(record["key"], str(record["metadata"]), str(record["data"])) == (
        '{"id":1001}'
    )
    # a replog event whose key happens to be {"_id":...}: not MongoDB's, kept
    assert debezium.message_key('{"_id":5}', None, '{"_id":5}') == '{"_id":5}'


def _keys_in(name: str) -> list[str]:
    """The message keys of a corpus file's change records, schemaless and compact, as a
    connector with ``key.converter.schemas.enable=false`` writes them."""
    keys = []
    for key, value in _kafka_records(name):
        if key is None or value == "null":
            continue
        members = jsontext.parse_object(key)
        payload = members["payload"].value if "payload" in members else json.loads(key)
        if isinstance(payload.get("id"), str):  # the 1.x docs' key: strict mode, " : "
            payload["id"] = payload["id"].replace('" : ', '": ')  # 3.x writes relaxed, ": "
        keys.append(json.dumps(payload, separators=(",", ":"), ensure_ascii=False))
    return keys


@pytest.mark.spark
@pytest.mark.parametrize(
    "name", ["mongodb_change_streams.jsonl", "mysql_tutorial.jsonl"], ids=["mongodb", "mysql"]
)
def test_to_debezium_writes_each_connectors_message_key(spark, tmp_path: Path, name: str) -> None:
    """The corpus's Kafka records (Debezium's documentation): appended, then out through
    ``to_debezium``: each record's key is the connector's, byte for byte."""
    from replog.spark.functions import to_debezium

    url = appended(tmp_path, name)
    events = spark.read.format("replog").load(url)
    out = [r["key"] for r in to_debezium(events, tombstones=False).collect()]
    expected = _keys_in(name)  # the records of the file that came with their key
    assert expected
    assert sorted(set(expected)) == sorted(set(expected) & set(out))
    if "mongodb" not in name:  # the event's own key: Debezium's for these connectors
        assert sorted(out) == sorted(r["key"] for r in events.collect())
