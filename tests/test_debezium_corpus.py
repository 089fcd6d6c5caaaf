"""Issue 30, items 10-15: real Debezium output (tests/data/debezium/corpus, where each event
was copied from is in its README) comes out exact: appended with its key, its row as sent,
its envelope back byte for byte, and its columns typed to the values the source held
(tests/debezium_corpus.py says what "exact" checks). Each item also has a test of its own."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from debezium_corpus import CORPUS, EXPECTED, arrow_values, check, events, lines
from support.cli import replog
from support.logcheck import check_log

from replog import debezium, ingest
from replog.capture import schemas as capture_schemas
from replog.errors import InvalidEventError
from replog.format import jsontext
from replog.log import ReplicationLog
from replog.schemas import connect, registry


@pytest.mark.parametrize(("name", "number"), events(), ids=[f"{n}:{i}" for n, i in events()])
def test_each_corpus_event_is_exact(name: str, number: int) -> None:
    outcome = check(name, number)
    assert outcome.exact, "\n".join(outcome.problems)


def _convert(line: str, *key_fields: str) -> debezium.Change:
    converted = debezium.convert(jsontext.parse_object(line), key_fields, text=line, filled_ms=0)
    assert isinstance(converted, debezium.Change)
    return converted


# -- 10. JsonConverter's float/double ------------------------------------------------------


def test_float_and_double_are_jsonconverters_names_and_the_old_ones_still_read() -> None:
    """Kafka's JsonSchema names FLOAT32/FLOAT64 "float"/"double" (JsonConverterTest:
    ``{"schema": {"type": "float"}, "payload": 12.34}``); capture wrote float32/float64."""
    for name, kind in (("float", pa.float32()), ("double", pa.float64())):
        column = connect.column({"type": name, "optional": True}, "x")
        assert (column.type, column.connect) == (kind, f"float{kind.bit_width}")
        assert connect.decode(column, Decimal("12.34")) == pytest.approx(12.34)
    assert connect.column({"type": "float64"}, "x").type == pa.float64()  # logs hold them
    lookup = capture_schemas.PgType
    assert capture_schemas.value_schema(700, -1, lookup) == {"type": "float"}
    assert capture_schemas.value_schema(701, -1, lookup) == {"type": "double"}
    old = connect.column({"type": "float32"}, "r")
    new = connect.column({"type": "double"}, "r")
    (merged,) = connect.union([("old", [old]), ("new", [new])])  # capture's old and new
    assert merged.type == pa.float64()
    with pytest.raises(InvalidEventError, match=r"'x'.*unknown Kafka Connect type 'real'"):
        connect.column({"type": "real"}, "x")


# -- 11. a Decimal written as a JSON number ----------------------------------------------------


def test_a_decimal_is_read_by_the_json_type_of_its_value() -> None:
    """decimal.format=NUMERIC keeps the plain Decimal schema: ``1234`` in a decimal(10,0)
    is 1234 (it was base64-decoded to -2658824), ``1.0E-7`` (BigDecimal.toString) exact."""
    qty = connect.column(
        {"type": "bytes", "name": connect.DECIMAL, "version": 1,
         "parameters": {"scale": "0", "connect.decimal.precision": "10"}},
        "qty",
    )  # fmt: skip
    assert connect.decode(qty, 1234) == Decimal("1234")
    assert connect.decode(qty, "BNI=") == Decimal("1234")  # base64: the same value
    tiny = connect.column({"type": "bytes", "name": connect.DECIMAL, "parameters": {"scale": "8"}})
    assert connect.decode(tiny, Decimal("1.0E-7")) == Decimal("0.00000010")
    table = connect.to_arrow([qty], [{"qty": 1234}, {"qty": "BNI="}, {"qty": None}])
    assert table.column("qty").to_pylist() == [Decimal("1234"), Decimal("1234"), None]
    # replog capture marks its decimals: there a string is NaN, no base64
    captured = connect.column(
        {"type": "bytes", "name": connect.DECIMAL,
         "parameters": {"scale": "2", "decimal.format": "NUMERIC"}},
        "total",
    )  # fmt: skip
    assert connect.decode(captured, "NaN") is None
    assert connect.decode(captured, Decimal("1.50")) == Decimal("1.50")


# -- 12. types -------------------------------------------------------------------------------


def test_iso_values_as_debezium_writes_them() -> None:
    """JdbcValueConvertersTemporalPrecisionTest asserts ``2005-05-12Z`` and
    ``10:30:45.123456789Z`` (debezium-connector-common); they came out NULL."""
    date = connect.column({"type": "string", "name": "io.debezium.time.IsoDate"}, "d")
    time = connect.column({"type": "string", "name": "io.debezium.time.IsoTime"}, "t")
    table = connect.to_arrow([date, time], [{"d": "2005-05-12Z", "t": "10:30:45.123456789Z"}])
    assert arrow_values(table) == [{"d": "2005-05-12", "t": "10:30:45.123456789"}]


def test_debeziums_timestamps_without_zone_are_timestamp_ntz() -> None:
    for logical, unit in (("Timestamp", "ms"), ("MicroTimestamp", "us"), ("NanoTimestamp", "ns")):
        column = connect.column({"type": "int64", "name": f"io.debezium.time.{logical}"}, "x")
        assert column.type == pa.timestamp(unit)  # no tz: the wall clock the column held
    zoned = connect.column({"type": "string", "name": "io.debezium.time.ZonedTimestamp"}, "z")
    assert zoned.type == pa.timestamp("ns", tz="UTC")


# -- 13. MongoDB -----------------------------------------------------------------------------


def test_one_mongodb_document_has_one_key_whatever_its_id_looks_like() -> None:
    """The connector writes a document's ``_id`` in v1 strict mode and the key's ``id`` in
    relaxed mode (JsonSerialization.getDocumentId), with or without spaces."""
    forms = [
        '{"_id" : {"$numberLong" : "1004"}}',  # mongodb.adoc's create
        '{"_id": {"$numberLong": "1004"}}',  # mongodb.adoc's update
        '{"_id": 1004}',
    ]
    keys = set()
    for n, document in enumerate(forms):
        value = {"after": document, "source": {"connector": "mongodb", "db": "inventory",
                 "collection": "customers", "name": "f", "rs": "rs0", "ts_ms": 1, "ord": n},
                 "op": "u", "ts_ms": 1}  # fmt: skip
        keys.add(_convert(json.dumps(value), "_id").record["key"])
    message = {"key": {"id": "1004"}, "value": {"op": "d", "source": {"connector": "mongodb",
               "db": "inventory", "collection": "customers"}, "ts_ms": 2}}  # fmt: skip
    keys.add(_convert(json.dumps(message), "_id").record["key"])
    assert keys == {'{"_id":1004}'}


def test_a_change_streams_update_is_appended_and_given_back() -> None:
    """``capture.mode=change_streams``: no ``after``, an ``updateDescription``
    (mongodb.adoc); to_debezium gives ``updateDescription`` back."""
    line = lines("mongodb_change_streams.jsonl")[1]
    change = _convert(line, "_id")
    record = change.record
    assert (record["operation"], record["key"]) == ("update", '{"_id":1004}')
    assert record["data"] == '{"first_name":"Anne Marie","_id":1004}'
    metadata = json.loads(record["metadata"])
    assert metadata["partial"] is True
    assert json.loads(metadata["members"]["updateDescription"]["updatedFields"]) == {
        "first_name": "Anne Marie"
    }
    back = debezium.original_envelope(
        record["metadata"], operation="update", data=record["data"], before=None
    )
    assert back == jsontext.parse_object(line)["value"].text


# -- 14. ExtractNewRecordState ---------------------------------------------------------------


def test_extract_new_record_states_default_output_is_a_row() -> None:
    """event-flattening.adoc: with no options the SMT gives the row alone."""
    record = _convert('{"field1" : "newvalue1", "field2" : "newvalue2"}', "field1").record
    assert (record["operation"], record["key"]) == ("update", '{"field1":"newvalue1"}')
    assert record["data"] == '{"field1" : "newvalue1", "field2" : "newvalue2"}'
    with pytest.raises(InvalidEventError, match=r"'id'.*ExtractNewRecordState row"):
        _convert('{"field1": 1}', "id")


def test_a_deleted_row_keeps_no_newline_of_its_line(tmp_path: Path) -> None:
    line = lines("flattened_rewrite.jsonl")[0]
    read = ingest.read_lines([line + "\n"], format="debezium", key_fields=("pk",))
    (row,) = read.table.to_pylist()
    assert row["operation"] == "delete" and row["data"] == line.encode()


# -- 15. the envelope's member order --------------------------------------------------------


def test_to_debezium_follows_the_inputs_member_order() -> None:
    """Debezium 0.10's serde test resources put ``op`` first and have no ``transaction``;
    2.x's docs put ``transaction`` after ``ts_ns``, or leave it out."""
    for name, number in (
        ("serde_schemaless.jsonl", 1),
        ("postgresql.jsonl", 4),
        ("mongodb.jsonl", 5),
    ):
        line = lines(name)[number - 1]
        key = EXPECTED[name]["key_fields"][0]
        record = _convert(line, key).record
        before = record["before"]
        back = debezium.original_envelope(
            record["metadata"], operation=record["operation"], data=record["data"],
            before=str(before) if before is not None else None,
        )  # fmt: skip
        assert back == line
    # Debezium >= 2.7's order needs no record of it: metadata stays as it was
    modern = (
        '{"before":null,"after":{"id":1},"source":{"connector":"postgresql","name":"s",'
        '"schema":"public","table":"t","lsn":1},"transaction":null,"op":"c","ts_ms":5}'
    )
    assert "order" not in json.loads(_convert(modern, "id").record["metadata"])


# -- the CLI, and the corpus through Spark ---------------------------------------------------


def appended(tmp_path: Path, name: str) -> str:
    url = str(tmp_path / name.replace(".jsonl", ""))
    assert replog("create", url, "--shards", "2").returncode == 0
    key_fields = ",".join(EXPECTED[name]["key_fields"])
    done = replog("append", url, str(CORPUS / name), "--format", "debezium",
                  "--key-fields", key_fields, "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    return url


CORPUS_FILES = sorted(EXPECTED)
TYPED_FILES = [
    name
    for name in CORPUS_FILES
    if any("values" in line for line in EXPECTED[name]["lines"].values())
]


def _kafka_records(name: str) -> list[tuple[str | None, str]]:
    """A corpus file as Kafka records (key, value): record lines split, values alone else."""
    records = []
    for line in lines(name):
        members = jsontext.parse_object(line)
        if "value" in members and set(members) <= {"key", "value"}:
            records.append((members["key"].text, members["value"].text))
        else:
            records.append((None, line))
    return records


@pytest.mark.spark
@pytest.mark.parametrize("name", CORPUS_FILES)
def test_the_cli_and_from_debezium_agree(spark, tmp_path: Path, name: str) -> None:
    from replog.spark.functions import from_debezium

    url = appended(tmp_path, name)
    stored = {row["event_id"]: row for row in check_log(ReplicationLog.open(url))}
    frame = spark.createDataFrame(_kafka_records(name), "key string, value string")
    mapped = from_debezium(frame, EXPECTED[name]["key_fields"]).collect()
    assert sorted(r["event_id"] for r in mapped) == sorted(stored)
    for row in mapped:
        cli = stored[row["event_id"]]
        for column in ("operation", "collection", "key", "metadata"):
            filled = column == "metadata" and "replog_filled" in (cli["metadata"] or "")
            if not filled:  # the time an append fills in differs
                assert row[column] == cli[column], column
        assert row["data"] == cli["data"].decode()
        assert row["before"] == (cli["before"].decode() if cli["before"] is not None else None)


@pytest.mark.spark
@pytest.mark.parametrize("name", CORPUS_FILES)
def test_to_debezium_gives_the_corpus_envelopes_back(spark, tmp_path: Path, name: str) -> None:
    from replog.spark.functions import to_debezium

    url = appended(tmp_path, name)
    values = [
        r["value"] for r in to_debezium(spark.read.format("replog").load(url), tombstones=False)
        .orderBy("headers").collect()
    ]  # fmt: skip
    expected = []
    for (_key, value), (_number, spec) in zip(
        _kafka_records(name),
        sorted(EXPECTED[name]["lines"].items(), key=lambda i: int(i[0])),
        strict=True,
    ):
        if "skipped" in spec:
            continue
        members = jsontext.parse_object(value)
        wrapped = "payload" in members and set(members) <= {"schema", "payload"}
        expected.append(members["payload"].text if wrapped else value)
    assert sorted(values) == sorted(expected)


@pytest.mark.spark
@pytest.mark.parametrize("name", TYPED_FILES)
def test_typed_gives_the_sources_values(spark, tmp_path: Path, name: str) -> None:
    from pyspark.sql import functions as F

    from replog.spark.functions import typed

    url = appended(tmp_path, name)
    log = ReplicationLog.open(url)
    (collection,) = {v.collection for v in registry.versions(log.storage)}
    columns = connect.union([(v.digest, v.columns()) for v in registry.versions(log.storage)])
    kinds = {}
    for c in columns:
        if pa.types.is_time(c.type):
            kinds[c.name] = "time"
        elif pa.types.is_duration(c.type):
            kinds[c.name] = "duration"
        elif pa.types.is_interval(c.type):
            kinds[c.name] = "interval"
    frame = typed(spark.read.format("replog").load(url), url, collection)
    rows = frame.select("after.*").orderBy(F.col(columns[0].name)).toArrow()
    got = arrow_values(rows, kinds)
    wanted = [
        spec["values"]
        for _, spec in sorted(EXPECTED[name]["lines"].items(), key=lambda i: int(i[0]))
        if "values" in spec
    ]
    assert got == sorted(wanted, key=lambda v: v[columns[0].name])
