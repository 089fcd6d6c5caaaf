"""Payloads parsed in Arrow (replog.tables.payloads): which tables a task parses, and
that it reads each value as the Python decoder of the registry's types does (the same
values Spark's typing gives: tests/test_apply_routing.py compares both through Spark)."""

from __future__ import annotations

import json
from datetime import date, datetime, timedelta
from typing import Any

import pyarrow as pa
import pytest

from replog.errors import InvalidEventError
from replog.schemas import connect
from replog.tables import payloads

SIMPLE = {
    "type": "struct",
    "fields": [
        {"field": "id", "type": "int64", "optional": False},
        {"field": "small", "type": "int16"},
        {"field": "tiny", "type": "int8"},
        {"field": "n", "type": "int32"},
        {"field": "ok", "type": "boolean"},
        {"field": "name", "type": "string"},
        {"field": "born", "type": "int32", "name": "io.debezium.time.Date"},
        {"field": "seen", "type": "int64", "name": "io.debezium.time.MicroTimestamp"},
        {"field": "at", "type": "int64", "name": "io.debezium.time.Timestamp"},
        {"field": "when", "type": "int64", "name": "org.apache.kafka.connect.data.Timestamp"},
        {"field": "clock", "type": "int64", "name": "io.debezium.time.MicroTime"},
        {"field": "ms_clock", "type": "int32", "name": "io.debezium.time.Time"},
        {"field": "spent", "type": "int64", "name": "io.debezium.time.MicroDuration"},
        {"field": "tag", "type": "string", "name": "io.debezium.data.Uuid"},
    ],
}


def columns(schema: dict[str, Any]) -> tuple[connect.Column, ...]:
    return connect.row_columns({"type": "struct", "fields": schema["fields"]})


def parsed(plan: payloads.Plan, texts: list[str | None]) -> list[dict[str, Any]]:
    values = payloads.parse(plan, pa.array(texts, pa.string()), text=pa.string())
    table = pa.table(values, names=list(plan.names))
    return table.to_pylist()


def test_a_table_of_plain_columns_is_parsed_by_a_task() -> None:
    found = payloads.plan("t", columns(SIMPLE), ["d1"])
    assert found is not None
    assert found.names == tuple(f["field"] for f in SIMPLE["fields"])
    assert found.digests == ("d1",)


@pytest.mark.parametrize(
    "field",
    [
        {"field": "x", "type": "float64"},  # NaN is a string on the wire
        {"field": "x", "type": "float32"},
        {"field": "x", "type": "bytes"},  # base64
        {
            "field": "x",
            "type": "bytes",
            "name": "org.apache.kafka.connect.data.Decimal",
            "parameters": {"scale": "2"},
        },
        {"field": "x", "type": "string", "name": "io.debezium.time.ZonedTimestamp"},
        {"field": "x", "type": "string", "name": "io.debezium.time.IsoDate"},
        {"field": "x", "type": "int64", "name": "io.debezium.time.NanoTimestamp"},
        {"field": "x", "type": "array", "items": {"type": "int32"}},
        {"field": "x", "type": "struct", "fields": [{"field": "y", "type": "int32"}]},
        {"field": "x", "type": "map", "keys": {"type": "string"}, "values": {"type": "int32"}},
    ],
)
def test_a_column_arrows_reader_cannot_give_exactly_keeps_the_table_on_spark(
    field: dict[str, Any],
) -> None:
    schema = {"fields": [{"field": "id", "type": "int64"}, field]}
    assert payloads.plan("t", columns(schema), ["d1"]) is None


def _micros(values: pa.Array) -> list[Any]:
    """A column's values, times as integers of microseconds (days for dates)."""
    kind = values.type
    if pa.types.is_date32(kind):
        return values.cast(pa.int32()).to_pylist()
    if pa.types.is_temporal(kind):
        per = {"s": 1_000_000, "ms": 1_000, "us": 1, "ns": 1}[kind.unit]
        width = pa.int32() if kind.bit_width == 32 else pa.int64()
        return [None if v is None else v * per for v in values.view(width).to_pylist()]
    return values.to_pylist()


def test_values_read_as_the_registrys_decoder_reads_them() -> None:
    plan = payloads.plan("t", columns(SIMPLE), ["d1"])
    assert plan is not None
    rows = [
        {"id": 1, "small": -32768, "tiny": 127, "n": 2147483647, "ok": True,
         "name": "caf\u00e9 \"q\" \\ \u2603 \ud83d\ude00", "born": -719162, "seen": -1,
         "at": 1_700_000_000_123, "when": 86_400_000, "clock": 86_399_999_999,
         "ms_clock": 45_296_789, "spent": -5_000_001,
         "tag": "6f1b5a2c-0000-4000-8000-000000000001"},
        {"id": 2},  # every other column absent: null
        {"id": 3, "name": None, "ok": False, "seen": 9223372036825200000},  # 'infinity'
    ]  # fmt: skip
    texts = [json.dumps(r) for r in rows]
    got = payloads.parse(plan, pa.array([*texts, None]), text=pa.string())
    expected = connect.to_arrow(columns(SIMPLE), [json.loads(t) for t in texts])
    for name, values in zip(plan.names, got, strict=True):
        assert _micros(values)[:3] == _micros(expected.column(name).combine_chunks()), name
        assert values[3].as_py() is None  # no payload (a truncate's): a row of nulls
    first = pa.table(got, names=list(plan.names)).slice(0, 1).to_pylist()[0]
    assert first["name"] == json.loads(texts[0])["name"]
    assert first["born"] == date(1, 1, 1)
    assert first["seen"] == datetime(1969, 12, 31, 23, 59, 59, 999999)
    assert first["when"] == datetime(1970, 1, 2)
    assert first["ms_clock"] == timedelta(hours=12, minutes=34, seconds=56, milliseconds=789)


def test_spark_types_are_given_texts_as_the_task_receives_them() -> None:
    plan = payloads.plan("t", columns(SIMPLE), ["d1"])
    assert plan is not None
    text = '{"id": 1, "name": "a", "when": 0}'
    for values in (
        payloads.parse(plan, pa.array([text]), text=pa.large_string()),
        payloads.parse(plan, pa.array([], pa.string()), text=pa.large_string()),
    ):
        types = dict(zip(plan.names, (v.type for v in values), strict=True))
        assert types["name"] == types["tag"] == pa.large_string()
        assert types["when"] == types["seen"] == pa.timestamp("us")
        assert types["clock"] == types["spent"] == pa.duration("us")
        assert types["born"] == pa.date32() and types["small"] == pa.int16()


def test_binary_payloads_and_a_payload_over_several_lines_are_read() -> None:
    plan = payloads.plan("t", columns(SIMPLE), ["d1"])
    assert plan is not None
    texts = [b'{"id": 1,\n "name": "x\\ny"}', b'{"id":2}', None, b'  {"id" : 3 }  ']
    values = payloads.parse(plan, pa.array(texts, pa.binary()), text=pa.string())
    assert values[0].to_pylist() == [1, 2, None, 3]
    assert values[plan.names.index("name")].to_pylist() == ["x\ny", None, None, None]


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ('{"id": "one"}', "registered schema's types"),  # a text for an integer
        ('{"id": 1.5}', "registered schema's types"),
        ('{"id": 2147483648123456789012}', "registered schema's types"),
        ('{"n": 2147483648}', "registered schema's types"),  # beyond int32
        ('{"id": 1', "registered schema's types"),  # cut short
        ("[1, 2]", "registered schema's types"),
        ('{"id": 1, "name": 12}', "not a string"),  # Spark would write it as Java does
        ('{"id": "x", "id": 1}', "not a int64"),  # Spark fails at the first
        ("{'id': 1}", "registered"),  # single quotes: Spark reads them, Python does not
    ],
)
def test_a_payload_not_of_the_schema_fails_naming_the_table(text: str, fault: str) -> None:
    plan = payloads.plan("shop.t", columns(SIMPLE), ["d1"])
    assert plan is not None
    with pytest.raises(InvalidEventError, match=r"'shop.t'") as raised:
        parsed(plan, ['{"id": 0}', text])
    assert any(part in str(raised.value) for part in fault.split("|")), raised.value


def test_the_versions_events_name_and_one_the_plan_does_not_know() -> None:
    texts = pa.array(
        [
            '{"source":{"lsn":1},"schema":"d1"}',
            '{"schema":"d2","x":1}',
            None,
            '{"source":{}}',
            "not json",
            '{"schema": 7}',
            '{"schema": null}',
            '{"sch\\u0065ma": "d3"} trailing',
            '{"schema": "d1", "schema": "dX"}',  # get_json_object reads the first
        ]
    )
    versions = payloads.schema_versions(texts)
    assert versions.to_pylist() == ["d1", "d2", None, None, None, "7", None, "d3", "d1"]
    plan = payloads.plan("shop.t", columns(SIMPLE), ["d1", "d2"])
    assert plan is not None
    payloads.check_versions(
        plan, versions.filter(pa.array([True, True, True, True, True, False, True, False, True]))
    )
    with pytest.raises(InvalidEventError, match=r"'shop.t' names schema version 7, not known"):
        payloads.check_versions(plan, versions)


def test_what_arrows_reader_refuses_but_spark_reads_is_read_as_spark_reads_it() -> None:
    """A lone surrogate escape is valid JSON (the log takes it) that no UTF-8 text holds:
    Spark's from_json reads it as '?'; a byte that is no UTF-8 as U+FFFD; a number or an
    object in a text column as its JSON text. Arrow's reader refuses each: the batch is
    read one payload at a time then, rather than failing every retry of the batch."""
    plan = payloads.plan("t", columns(SIMPLE), ["d1"])
    assert plan is not None
    texts = [
        b'{"id": 1, "name": "a\\ud800b"}',
        b'{"id": 2, "name": "\xff\xfe"}',
        b'{"id": 3, "name": "\\u00e9", "x": {"id": "deep"}} trailing',
        None,
        b'{"id": 5, "ok": true, "n": null}',
        b"",  # Spark: a row of nulls
        b" null ",
        b'{"id": 7}\n{"id": 70}',  # the first value
        b'{"id": 8}',
    ]
    values = payloads.parse(plan, pa.array(texts, pa.binary()), text=pa.string())
    table = pa.table(values, names=list(plan.names))
    assert table.column("id").to_pylist() == [1, 2, 3, None, 5, None, None, 7, 8]
    assert table.column("name").to_pylist()[:4] == ["a?b", "\ufffd\ufffd", "\u00e9", None]
    assert table.column("ok").to_pylist()[3:5] == [None, True]
    assert table.schema == pa.schema(
        [pa.field(n, v.type) for n, v in zip(plan.names, values, strict=True)]
    )
    for refused in ('{"id": 1, "name": "\\ud800", "n": "x"}', '{"id": true, "name": "\\ud800"}',
                    '{"ok": 1, "name": "\\ud800"}', '{"n": 1.5, "name": "\\ud800"}'):  # fmt: skip
        with pytest.raises(InvalidEventError, match="registered schema's types"):
            parsed(plan, [refused])


@pytest.mark.parametrize(
    ("texts", "ids"),
    [
        (["null", '{"id": 1}'], [None, 1]),  # first: Arrow's reader crashed the process
        (['{"id": 1}\n{"id": 2}', '{"id": 3}', ""], [1, 3, None]),  # no row shifts up
        (['{"id": 1}{"id": 2}', '{"id": 3}', "  "], [1, 3, None]),
        (['{"id": 1}\r{"id": 2}', '{"id": 3}', "null"], [1, 3, None]),
        (['{"id": 1}', '\n{"id": 2,\n"n": 3}\n'], [1, 2]),  # spread over lines
    ],
)
def test_each_payload_gives_its_own_row(texts: list[str], ids: list[int | None]) -> None:
    plan = payloads.plan("t", columns(SIMPLE), ["d1"])
    assert plan is not None
    assert payloads.parse(plan, pa.array(texts), text=pa.string())[0].to_pylist() == ids


def test_a_text_that_is_no_utf8_is_read_as_spark_reads_it() -> None:
    plan = payloads.plan("t", columns(SIMPLE), ["d1"])
    assert plan is not None
    raw = [b'{"id": 1, "name": "a\xffb"}', b'{"id": 2, "name": "ok"}']
    for payloads_array in (pa.array(raw), pa.array(raw).cast(pa.string(), safe=False)):
        values = payloads.parse(plan, payloads_array, text=pa.string())
        name = values[plan.names.index("name")]
        name.validate(full=True)
        assert name.to_pylist() == ["a\ufffdb", "ok"]
