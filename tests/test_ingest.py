"""JSON-lines ingestion (replog.ingest) and the Debezium mapping (replog.debezium)."""

import json
from decimal import Decimal

import pytest

from replog import debezium
from replog.errors import InvalidEventError, InvalidOptionError
from replog.format.events import events_from_records
from replog.format.jsontext import RawJSON, encode, parse_object
from replog.ingest import append_lines, read_lines
from replog.log import ReplicationLog

SOURCE = (
    '{"version":"2.5.0.Final","connector":"mysql","name":"dbserver1","ts_ms":1700000001000,'
    '"db":"inventory","table":"products","server_id":223344,"file":"mysql-bin.000003",'
    '"pos":%d,"row":%d}'
)


def change(op: str, before: str | None, after: str | None, pos: int, row: int = 0) -> str:
    envelope = (
        f'{{"before":{before or "null"},"after":{after or "null"},'
        f'"source":{SOURCE % (pos, row)},"op":"{op}","ts_ms":1700000002000,"transaction":null}}'
    )
    return envelope


def wrapped(value: str) -> str:
    return '{"schema":{"type":"struct","optional":false},"payload":' + value + "}"


PRODUCT = (
    '{"id":101,"name":"scooter","weight":3.140000000000000124344978758017532527446746826171875}'
)
UPDATED = '{"id":101,"name":"scooter","weight":5.18}'


def test_replog_lines_keep_payload_text_and_name_bad_lines() -> None:
    lines = [
        '{"event_id":"e1","key":"k","data":{"n":12345678901234567890.123456789,"b":1e400}}\n',
        "\n",
        '{"event_id":"e2","key":"k","data":"plain text","before":{"n":1}}\n',
    ]
    ingested = read_lines(lines)
    rows = ingested.table.to_pylist()
    assert rows[0]["data"] == b'{"n":12345678901234567890.123456789,"b":1e400}'
    assert rows[1]["data"] == b"plain text" and rows[1]["before"] == b'{"n":1}'
    assert ingested.lines == 3
    with pytest.raises(InvalidEventError, match="line 2: not valid JSON"):
        read_lines(['{"data":1}', '{"data": {"a": 1,}}'])
    with pytest.raises(InvalidEventError, match="line 3: event_id 'x' was already given by line 1"):
        read_lines(['{"data":1,"event_id":"x"}', '{"data":2}', '{"data":3,"event_id":"x"}'])


def test_debezium_history_of_one_row() -> None:
    lines = [
        wrapped(change("r", None, PRODUCT, 100)),  # snapshot read, with the wrapper
        change("c", None, '{"id":102,"name":"car","weight":1}', 110),
        change("u", PRODUCT, UPDATED, 120),
        change("d", UPDATED, None, 130),
        "null",  # tombstone
        change("t", None, None, 140),
    ]
    ingested = read_lines(lines, format="debezium", key_fields=("id",))
    rows = ingested.table.to_pylist()
    assert [r["operation"] for r in rows] == ["insert", "insert", "update", "delete"]
    assert [r["key"] for r in rows] == ['{"id":101}', '{"id":102}', '{"id":101}', '{"id":101}']
    assert rows[0]["data"] == PRODUCT.encode()  # 50 digits of weight: unchanged
    assert rows[2]["before"] == PRODUCT.encode() and rows[2]["data"] == UPDATED.encode()
    assert rows[3]["data"] == UPDATED.encode() and rows[3]["before"] == UPDATED.encode()
    assert {r["collection"] for r in rows} == {"inventory.products"}
    assert rows[0]["timestamp"].timestamp() == 1700000001.0  # source.ts_ms
    metadata = json.loads(rows[0]["metadata"])
    assert metadata["source"]["pos"] == 100 and metadata["op"] == "r"
    assert len({r["event_id"] for r in rows}) == 4
    assert dict(ingested.skipped) == {"tombstone (null value)": 1, "truncate event (op t)": 1}


def test_debezium_event_ids_are_stable_and_distinct_per_row() -> None:
    snapshot = [change("r", None, f'{{"id":{i},"name":"x"}}', 100) for i in range(5)]
    first = read_lines(snapshot, format="debezium", key_fields=("id",)).table
    again = read_lines(snapshot, format="debezium", key_fields=("id",)).table
    assert len(set(first.column("event_id").to_pylist())) == 5
    assert first.column("event_id") == again.column("event_id")  # a redelivery keeps its id


def test_debezium_postgres_uses_schema_and_source_ts_fallback() -> None:
    value = (
        '{"before":null,"after":{"id":1,"a":2},"op":"c","ts_ms":1700000005000,'
        '"source":{"connector":"postgresql","db":"shop","schema":"public","table":"orders",'
        '"ts_ms":0,"lsn":42}}'
    )
    row = read_lines([value], format="debezium", key_fields=("id", "a")).table.to_pylist()[0]
    assert row["collection"] == "public.orders" and row["key"] == '{"id":1,"a":2}'
    assert row["timestamp"].timestamp() == 1700000005.0  # source.ts_ms is 0: envelope ts_ms


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"op":"x","after":{"id":1}}', "line 1: 'op' is 'x': not a Debezium change event"),
        ('{"op":"c","after":null}', "line 1: op 'c' without a 'after' image"),
        ('{"op":"c","after":{"name":"x"}}', "line 1: key field(s) ['id'] are not in the after"),
    ],
)
def test_bad_debezium_lines_are_named(line: str, message: str) -> None:
    with pytest.raises(InvalidEventError) as info:
        read_lines([line], format="debezium", key_fields=("id",))
    assert message in str(info.value)


def test_format_options_are_checked() -> None:
    with pytest.raises(InvalidOptionError, match="needs --key-fields"):
        read_lines([], format="debezium")
    with pytest.raises(InvalidOptionError, match="'avro' is not one of"):
        read_lines([], format="avro")


def test_debezium_envelope_round_trips_exact_payloads() -> None:
    text = debezium.envelope(
        operation="update", data=UPDATED, before=PRODUCT, ts_ms=5, source={"shard": 1}
    )
    members = parse_object(text)
    assert members["after"].text == UPDATED and members["before"].text == PRODUCT
    assert members["op"].value == "u" and json.loads(text)["source"] == {"shard": 1}


def test_append_lines_is_one_atomic_commit(memory_url: str) -> None:
    log = ReplicationLog.create(memory_url, 2)
    report = append_lines(
        log, [change("c", None, PRODUCT, 1), "null"], format="debezium", key_fields=("id",)
    )
    assert report.events == 1 and report.record is not None and report.record.version == 1
    assert report.to_json()["skipped"] == {"tombstone (null value)": 1}
    with pytest.raises(InvalidEventError, match="line 2"):
        append_lines(log, ['{"data":1}', "{oops"])
    assert log.refresh().version == 1  # the bad file wrote nothing


def test_raw_json_is_spliced_in_at_any_depth() -> None:
    """RawJSON is exact text wherever it is, never a string to quote (``[1.50]``, not
    ``["1.50"]``), and the C encoder's output is kept for values without it."""
    assert encode({"a": [RawJSON("1.50")]}) == '{"a":[1.50]}'
    assert encode([{"n": RawJSON("1e400")}, (RawJSON("0.000"),)]) == '[{"n":1e400},[0.000]]'
    assert encode({"a": {"b": {"c": RawJSON('{"d": 1.0}')}}}) == '{"a":{"b":{"c":{"d": 1.0}}}}'
    assert encode({"a": RawJSON("2.50"), "s": "2.50"}) == '{"a":2.50,"s":"2.50"}'
    assert encode(RawJSON("[1.0]")) == "[1.0]"
    assert encode({"d": [Decimal("1.10")], "t": "zo\u00eb"}) == '{"d":[1.10],"t":"zo\u00eb"}'
    assert encode({"f": [0.1, 1], "n": None}) == '{"f":[0.1,1],"n":null}'
    with pytest.raises(ValueError, match="not a JSON number"):
        encode({"a": [RawJSON("1"), Decimal("NaN")]})
    row = events_from_records([{"key": "k", "data": {"amounts": [RawJSON("1.50")]}}])
    assert row.column("data").to_pylist() == [b'{"amounts":[1.50]}']


def test_a_connector_name_replog_names_do_not_allow_still_records_its_position() -> None:
    """Kafka Connect allows more characters in a connector's name than replog's names
    (``{context}-server-1`` in Debezium's docs): the app id stays valid and distinct."""
    from replog.debezium import position_app_id
    from replog.names import is_valid_name

    assert position_app_id("dbserver1") == "debezium.dbserver1"  # valid names are kept
    odd = position_app_id("{context}-server-1")
    other = position_app_id("[context]-server-1")
    assert is_valid_name(odd) and is_valid_name(other) and odd != other
    assert is_valid_name(position_app_id("x" * 300, "rs0"))
