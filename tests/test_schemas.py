"""Debezium with schemas through ``append`` and ``typed`` (issue 23, parts 1, 2 and 5).

The fixtures under ``tests/data/debezium/`` are envelopes as Debezium 2.5 emits them with
JsonConverter ``schemas.enable=true``: a PostgreSQL ``inventory.customers`` table with
``decimal.handling.mode=precise`` and every time type (a snapshot, a transaction with
BEGIN/END, a redelivered event, a column added mid-stream, a delete without its before
image given as a Kafka record with its key, and a tombstone), and a MySQL
``inventory.orders`` table (binlog positions, an event without any time, ts_us/ts_ns, and
ExtractNewRecordState rows).
"""

from __future__ import annotations

import base64
import json
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from replog import ingest
from replog.cli import main
from replog.errors import IncompatibleSchemaError
from replog.format.commits import TXN_QUERY
from replog.log import ReplicationLog
from replog.schemas import connect, registry

DATA = Path(__file__).parent / "data" / "debezium"
POSTGRES = (DATA / "postgres_customers.jsonl").read_text().splitlines()
MYSQL = (DATA / "mysql_orders.jsonl").read_text().splitlines()
FLOATS = (DATA / "postgres_float_defaults.jsonl").read_text().splitlines()
"""A PostgreSQL ``inventory.gauges`` table whose schema holds float defaults (``0.0``)."""


def _append(log: ReplicationLog, lines: list[str]) -> ingest.AppendReport:
    return ingest.append_lines(log, lines, format="debezium", key_fields=("id",))


def _events(log: ReplicationLog) -> list[dict[str, Any]]:
    rows = [
        row for shard in range(log.shards) for batch in log.read(shard) for row in batch.to_pylist()
    ]
    return sorted(rows, key=lambda row: (row["timestamp"], row["key"]))


@pytest.fixture
def log(tmp_path: Path) -> ReplicationLog:
    return ReplicationLog.create(str(tmp_path / "log"), shards=2)


def test_schemas_are_registered_once_per_collection_and_named_by_events(
    log: ReplicationLog,
) -> None:
    report = _append(log, POSTGRES)
    versions = registry.versions(log.storage, "inventory.customers")
    assert len(versions) == 2  # the column added mid-stream made a second version
    first, second = versions
    assert [c.name for c in second.columns()] == [c.name for c in first.columns()] + ["email"]
    named = {json.loads(row["metadata"])["schema"] for row in _events(log)}
    assert named == {first.digest, second.digest}
    assert report.events == 6
    _append(log, MYSQL)
    assert len(registry.versions(log.storage)) == 2 + 2  # orders: the envelope and flat rows


def test_a_schema_holding_floats_is_registered_under_the_digest_events_name(
    log: ReplicationLog,
) -> None:
    """A schema is parsed once, for its digest and for the registry: ``"default": 0.0`` read
    as a Decimal (the payloads' exact parsing) could not be written as the schema's JSON."""
    report = _append(log, FLOATS)
    assert report.events == 2 and report.record is not None
    given = json.loads(FLOATS[0])["schema"]
    [version] = registry.versions(log.storage, "inventory.gauges")
    assert version.schema == given
    defaults = [field.get("default") for field in version.schema["fields"][1]["fields"]]
    assert defaults == [0, 0.0, 1.25] and isinstance(defaults[1], float)
    assert version.digest == connect.digest(given)  # content-addressed by the schema given
    assert log.storage.exists(registry.schema_path("inventory.gauges", version.digest))
    named = {json.loads(row["metadata"])["schema"] for row in _events(log)}
    assert named == {version.digest}
    again = _append(log, FLOATS)  # registered already: nothing new, nothing appended
    assert again.record is None and again.behind == 2
    assert [v.digest for v in registry.versions(log.storage, "inventory.gauges")] == [
        version.digest
    ]


def test_cli_appends_debezium_values_whose_schema_holds_floats(
    log: ReplicationLog, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(DATA / "postgres_float_defaults.jsonl")
    assert main(["append", log.url, path, "--format", "debezium", "--key-fields", "id"]) == 0
    assert len(_events(log)) == 2
    assert [len(v.columns()) for v in registry.versions(log.storage, "inventory.gauges")] == [3]


def test_payloads_stay_exactly_as_given(log: ReplicationLog) -> None:
    _append(log, POSTGRES)
    envelope = json.loads(POSTGRES[0])["payload"]
    after_text = POSTGRES[0].split('"after":', 1)[1].split(',"source":', 1)[0]
    first = next(row for row in _events(log) if row["key"] == '{"id":1001}')
    assert first["data"].decode() == after_text
    assert json.loads(after_text) == envelope["after"]


def test_kafka_connect_types_map_to_exact_arrow_types_and_values() -> None:
    schema = json.loads(POSTGRES[0])["schema"]
    columns = {c.name: c for c in connect.row_columns(schema)}
    assert str(columns["balance"].type) == "decimal128(12, 2)"
    assert str(columns["created"].type) == "timestamp[us]"  # MicroTimestamp: no time zone
    assert str(columns["lunch"].type) == "time32[ms]"
    row = json.loads(POSTGRES[1])["payload"]["after"]
    table = connect.to_arrow(list(columns.values()), [row]).to_pylist()[0]
    assert table["balance"] == Decimal("-1234.56")
    assert table["born"] == date(2024, 2, 29)
    assert table["created"] == datetime(2024, 3, 1, 10, 0, 0, 123456)  # the wall clock
    assert table["updated"] == datetime(2024, 3, 1, 10, 0, 0, 123456, tzinfo=timezone.utc)
    assert table["ratio"] == "3.1415"
    assert connect.decode_decimal("AeJA", 2) == Decimal("1234.56")


@pytest.mark.parametrize(
    "text",
    [
        "123456789012345678901234567890.123",  # 33 digits: Debezium's VariableScaleDecimal
        "-99999999999999999999999999.999999999999",  # numeric(38, 12)'s largest, negated
        "0.000000000000000000000000000000000001",
        "1.50",  # the scale kept, trailing zero and all
        "12345678901234567890123456789012345678E+5",  # a negative scale (Connect allows it)
    ],
)
def test_connect_decimals_decode_every_digit(text: str) -> None:
    """Past 28 digits too: Python's default decimal context rounds arithmetic there (a
    33-digit PostgreSQL numeric from Debezium came back as 123456789012345678901234567900)."""
    value = Decimal(text)
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    unscaled = int("".join(map(str, digits))) * (-1 if sign else 1)
    wire = base64.b64encode(unscaled.to_bytes(20, "big", signed=True)).decode()
    assert str(connect.decode_decimal(wire, -exponent)) == str(value)
    decoded = connect.decode_variable_scale({"scale": -exponent, "value": wire})
    assert str(decoded) == str(value)


def test_an_incompatible_change_names_the_column_and_both_versions() -> None:
    schema = json.loads(POSTGRES[0])["schema"]
    changed = json.loads(json.dumps(schema))
    for image in changed["fields"][:2]:
        for field in image["fields"]:
            if field["field"] == "balance":
                field.clear()
                field.update({"type": "string", "optional": True, "field": "balance"})
    old, new = connect.digest(schema), connect.digest(changed)
    with pytest.raises(IncompatibleSchemaError, match=rf"'balance'.*{old}.*{new}"):
        connect.union([(old, connect.row_columns(schema)), (new, connect.row_columns(changed))])


def test_redelivered_events_are_skipped_and_counted(log: ReplicationLog) -> None:
    first = _append(log, POSTGRES)
    assert first.duplicates == 1  # line 7 repeats line 4 (a redelivery within the input)
    assert first.transaction is not None and first.transaction.app_id == "debezium.dbserver1"
    mark = log.refresh().sinks["debezium.dbserver1"]
    assert mark.epoch_of(TXN_QUERY) == first.transaction.version  # in the same commit
    assert log.transaction_version("debezium.dbserver1") == first.transaction.version
    assert log.transaction_version("debezium.elsewhere") is None
    again = _append(log, POSTGRES)  # the connector restarted and sent it all again
    assert again.record is None and again.behind == 7 and again.events == 0
    later = (
        POSTGRES[7]
        .replace('"lsn":24023300', '"lsn":24023500')
        .replace('\\"24023200\\",\\"24023300\\"', '\\"24023400\\",\\"24023500\\"')
        .replace('"id":1004', '"id":1005')
    )
    more = _append(log, [*POSTGRES[7:9], later])  # overlaps what the log holds
    assert more.behind == 2 and more.record is not None and more.events == 1
    assert len(_events(log)) == 6 + 1


def test_one_append_takes_one_connector_position(log: ReplicationLog) -> None:
    with pytest.raises(ingest.InvalidEventError, match=r"line 2: .*debezium\.mysqlsrv.*line 1"):
        _append(log, [POSTGRES[3], MYSQL[0]])
    assert _events(log) == []


def test_transactions_flattened_rows_keys_and_times_are_understood(log: ReplicationLog) -> None:
    report = _append(log, POSTGRES)
    assert report.skipped == {
        "transaction BEGIN record": 1,
        "transaction END record": 1,
        "tombstone (null value)": 1,
    }
    assert report.transactions == 1 and report.partial_transactions == []
    rows = _events(log)
    delete = rows[-1]
    assert delete["operation"] == "delete" and delete["key"] == '{"id":1002}'
    assert delete["data"] == b'{"id":1002}'  # the message key: before was null
    metadata = json.loads(rows[0]["metadata"])
    assert metadata["ts_us"] == 1709287100500007 and metadata["ts_ns"] == 1709287100500007089
    assert "replog_filled" not in metadata

    orders = _append(log, MYSQL)
    assert orders.events == 6
    mysql = [row for row in _events(log) if row["collection"] == "inventory.orders"]
    filled = [json.loads(row["metadata"]) for row in mysql if row["key"] == '{"id":1}']
    assert [m.get("replog_filled") for m in filled] == [None, ["timestamp"]]
    flat = [row for row in mysql if row["key"] == '{"id":3}']
    assert [row["operation"] for row in flat] == ["insert", "delete"]
    assert json.loads(flat[0]["metadata"])["flattened"] is True
    assert flat[0]["data"].decode() == json.dumps(
        json.loads(MYSQL[4])["payload"], separators=(",", ":")
    )


def test_schemas_command_lists_versions_and_fields(
    log: ReplicationLog, capsys: pytest.CaptureFixture[str]
) -> None:
    _append(log, POSTGRES)
    assert main(["schemas", log.url, "--collection", "inventory.customers"]) == 0
    text = capsys.readouterr().out
    assert "balance" in text and "decimal128(12, 2)" in text
    assert "org.apache.kafka.connect.data.Decimal" in text and "email" in text
    assert main(["schemas", log.url, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [len(v["fields"]) for v in document["versions"]] == [14, 15]


# -- Spark -------------------------------------------------------------------------------------


@pytest.mark.spark
def test_typed_gives_exact_values_across_versions(spark, log: ReplicationLog) -> None:
    from pyspark.sql import functions as F

    from replog.spark.functions import typed

    _append(log, POSTGRES)
    _append(log, MYSQL)
    frame = typed(spark.read.format("replog").load(log.url), log, "inventory.customers")
    types = {f.name: f.dataType.simpleString() for f in frame.schema["after"].dataType.fields}
    assert types["balance"] == "decimal(12,2)" and types["born"] == "date"
    assert types["created"] == "timestamp_ntz"  # MicroTimestamp: a column without a zone
    assert types["updated"] == "timestamp" and types["wake"] == "interval day to second"
    rows = {
        (row["key"], row["operation"]): row
        for row in frame.select(
            "key",
            "operation",
            "after",
            "before",
            "data",
            F.unix_micros("after.updated").alias("updated_us"),
        ).collect()
    }
    sally = rows[('{"id":1001}', "update")]
    assert sally["after"]["balance"] == Decimal("999999999.99")
    assert sally["before"]["balance"] == Decimal("1234.56")
    assert rows[('{"id":1002}', "insert")]["after"]["balance"] == Decimal("-1234.56")
    assert rows[('{"id":1003}', "insert")]["after"]["balance"] == Decimal("0.01")
    after = sally["after"]
    assert after["born"] == date(2024, 2, 29)
    assert after["created"] == datetime(2024, 3, 1, 10, 0, 0, 123456)  # whatever the session zone
    assert after["seen_ns"] == datetime(2024, 3, 1, 10, 0, 0, 123456)  # ns cut to Spark's us
    assert after["stamp_ms"] == datetime(2024, 3, 1, 10, 0, 0, 123000)
    assert sally["updated_us"] == 1709287200123456  # 12:00:00.123456+02:00 in UTC
    assert after["wake"] == timedelta(hours=7, microseconds=1)
    assert after["lunch"] == timedelta(hours=12, minutes=30, milliseconds=500)
    assert after["profile"] == '{"vip": true, "n": 1.10}'  # JSON kept as its text
    assert after["tier"] == "gold" and after["ratio"] == "3.1415"
    assert after["email"] is None  # added by a later version
    assert rows[('{"id":1004}', "insert")]["after"]["email"] == "annek@noanswer.org"
    deleted = rows[('{"id":1002}', "delete")]
    assert deleted["after"] is None and deleted["data"]["id"] == 1002

    orders = typed(spark.read.format("replog").load(log.url), log.url, "inventory.orders")
    amounts = sorted(
        (row["key"], row["operation"], row["data"]["amount"])
        for row in orders.select("key", "operation", "data").collect()
    )
    assert amounts[0] == ('{"id":1}', "insert", Decimal("1234.560"))
    assert ('{"id":2}', "insert", Decimal("-0.005")) in amounts
    assert ('{"id":3}', "insert", Decimal("7.000")) in amounts


def test_versions_registered_in_one_millisecond_keep_their_order(log: ReplicationLog) -> None:
    """One append registers several versions at once; "oldest first" must not fall back
    to digest order when their times tie."""
    from replog.timeutil import use_clock

    schemas = [
        {"type": "struct", "fields": [{"field": "id", "type": "int32", "optional": False}]},
        {"type": "struct", "fields": [{"field": "id", "type": "int64", "optional": False}]},
    ]
    schemas.sort(key=connect.digest, reverse=True)  # registered in reverse digest order
    with use_clock(lambda: 1_700_000_000.0):
        digests = [registry.register(log.storage, "c", schema) for schema in schemas]
    assert [v.digest for v in registry.versions(log.storage, "c")] == digests


@pytest.mark.spark
def test_typed_refuses_events_of_a_version_registered_after_it_was_called(
    spark, log: ReplicationLog, tmp_path: Path
) -> None:
    """A streaming query calls ``typed`` once; a schema version registered later (a column
    added mid-stream) must not be read with the older union, which would drop the new
    column silently (``email`` null forever in a table built from it)."""
    from replog.spark.functions import typed

    _append(log, POSTGRES[:7])  # the first version only
    assert len(registry.versions(log.storage, "inventory.customers")) == 1
    frame = typed(spark.readStream.format("replog").load(log.url), log, "inventory.customers")
    assert "email" not in frame.schema["after"].dataType.names
    seen: list[Any] = []
    query = (
        frame.writeStream.foreachBatch(lambda batch, _: seen.extend(batch.collect()))
        .option("checkpointLocation", str(tmp_path / "chk"))
        .start()
    )
    try:
        query.processAllAvailable()  # the events typed() knows the version of are read
        known = len(seen)
        assert known
        _append(log, POSTGRES[7:])  # the column added: a second version, named by new events
        with pytest.raises(Exception, match="not known to typed"):
            query.processAllAvailable()
    finally:
        query.stop()
    assert len(seen) == known  # nothing of the failed batch was handed on
