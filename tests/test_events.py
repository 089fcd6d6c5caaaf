"""Change-event validation (replog.format.events) and exact JSON payloads (jsontext)."""

import json
from datetime import datetime, timezone
from decimal import Decimal

import pyarrow as pa
import pytest

from replog.errors import InvalidEventError
from replog.format.events import STORED_SCHEMA, events_from_records, events_from_table
from replog.format.jsontext import RawJSON, encode, parse_object


def test_records_get_defaults_and_keep_payload_key_order() -> None:
    table = events_from_records([{"data": {"b": 1, "a": [1, 2]}}, {"data": "text", "key": "k"}])
    assert table.schema == STORED_SCHEMA
    rows = table.to_pylist()
    assert rows[0]["data"] == b'{"b":1,"a":[1,2]}'  # key order is data: kept
    assert rows[0]["operation"] == "insert" and rows[0]["before"] is None
    assert rows[0]["key"] == rows[0]["event_id"]  # no key: routed by event id
    assert rows[1]["key"] == "k" and rows[1]["data"] == b"text"


def test_numbers_are_stored_exactly() -> None:
    big = Decimal("12345678901234567890.123456789")
    rows = events_from_records(
        [
            {"data": {"price": big, "count": 10**30, "ratio": 0.1}},
            {"data": RawJSON('{"z": 1e400, "a": 1.50}'), "before": {"z": Decimal("-0.0")}},
        ]
    ).to_pylist()
    assert rows[0]["data"] == (
        b'{"price":12345678901234567890.123456789,"count":1000000000000000000000000000000,'
        b'"ratio":0.1}'
    )
    assert rows[1]["data"] == b'{"z": 1e400, "a": 1.50}'  # exact text, spacing included
    assert rows[1]["before"] == b'{"z":-0.0}'


def test_non_finite_numbers_are_refused() -> None:
    with pytest.raises(InvalidEventError, match="event 0: 'data' cannot be stored as JSON"):
        events_from_records([{"data": {"x": float("nan")}}])
    with pytest.raises(InvalidEventError, match="'before' cannot be stored as JSON"):
        events_from_records([{"data": 1, "before": Decimal("Infinity")}])


def test_exact_json_text_survives_a_parse() -> None:
    line = '{"data": {"n": 12345678901234567890.123456789, "s": "\\u00e9\\n"}, "key": "k"}'
    members = parse_object(line)
    assert members["data"].text == '{"n": 12345678901234567890.123456789, "s": "\\u00e9\\n"}'
    assert encode({"wrapped": members["data"].raw}) == (
        '{"wrapped":{"n": 12345678901234567890.123456789, "s": "\\u00e9\\n"}}'
    )
    with pytest.raises(ValueError, match="NaN is not valid JSON"):
        parse_object('{"data": NaN}')


def test_timestamps_accept_iso_and_epoch_millis() -> None:
    rows = events_from_records(
        [{"data": 1, "timestamp": "2024-05-01T10:00:00Z"}, {"data": 1, "timestamp": 0}]
    ).to_pylist()
    assert rows[0]["timestamp"] == datetime(2024, 5, 1, 10, tzinfo=timezone.utc)
    assert rows[1]["timestamp"] == datetime(1970, 1, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"key": "k"}, "line 3: 'data' is required"),
        ({"data": 1, "operation": "upsert"}, "line 3: unknown operation 'upsert'"),
        ({"data": 1, "operation": ""}, "line 3: unknown operation ''"),
        ({"data": 1, "event_id": ""}, "line 3: 'event_id' must not be empty"),
        ({"data": 1, "event_id": "a"}, "line 3: event_id 'a' was already given by line 1"),
        ({"data": 1, "colour": "red"}, "line 3: unknown field(s) ['colour']"),
        ({"data": 1, "metadata": "[1]"}, "line 3: 'metadata' must be a JSON object"),
        ({"data": 1, "metadata": '{"a":1'}, "line 3: 'metadata' must be a JSON object"),
        ({"data": 1, "timestamp": "yesterday"}, "line 3: 'timestamp' 'yesterday'"),
        ({"data": 1, "timestamp": 10**17}, "line 3: 'timestamp' 100000000000000000 is out of"),
        ({"data": None}, "line 3: 'data' is required and must not be null"),
        ({"data": 1, "key": 5}, "line 3: 'key' must be a string"),
    ],
)
def test_bad_records_name_the_line_and_field(record: dict, message: str) -> None:
    good = [{"data": 1, "event_id": "a"}, {"data": 2}]
    with pytest.raises(InvalidEventError) as info:
        events_from_records([*good, record], where=lambda i: f"line {i + 1}")
    assert message in str(info.value)


LONE_SURROGATE = json.loads('"\\ud800"')


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"data": 1, "key": LONE_SURROGATE}, "key"),
        ({"data": 1, "collection": f"db.{LONE_SURROGATE}"}, "collection"),
        ({"data": 1, "event_id": LONE_SURROGATE}, "event_id"),
        ({"data": LONE_SURROGATE}, "data"),
        ({"data": {"name": LONE_SURROGATE}}, "data"),
        ({"data": 1, "before": LONE_SURROGATE}, "before"),
        ({"data": 1, "metadata": {"m": LONE_SURROGATE}}, "metadata"),
        ({"data": 1, "metadata": {LONE_SURROGATE: 1}}, "metadata"),
        ({"data": 1, "metadata": '{"m": "' + LONE_SURROGATE + '"}'}, "metadata"),
    ],
)
def test_lone_surrogates_are_refused_in_every_string(record: dict, field: str) -> None:
    """A lone UTF-16 surrogate (valid in a JSON string, not storable as UTF-8) is bad
    input wherever it appears, named like any other, never a raw UnicodeEncodeError."""
    with pytest.raises(InvalidEventError, match=f"line 2: '{field}' holds .*lone UTF-16 surrogate"):
        events_from_records([{"data": 1}, record], where=lambda i: f"line {i + 1}")


def test_table_input_casts_strings_and_fills_defaults() -> None:
    table = events_from_table(
        pa.table(
            {
                "data": ["a", "b"],
                "before": [None, "a"],
                "key": ["k1", None],
                "shard": [9, 9],
                "operation": [None, "delete"],
            }
        ),
        default_collection="users",
    )
    rows = table.to_pylist()
    assert [r["data"] for r in rows] == [b"a", b"b"]
    assert [r["before"] for r in rows] == [None, b"a"]
    assert rows[1]["key"] == rows[1]["event_id"]
    assert [r["operation"] for r in rows] == ["insert", "delete"]
    assert [r["collection"] for r in rows] == ["users", "users"]


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"key": ["k"]}, "column 'data' (binary or string) is required"),
        ({"data": [1]}, "column 'data' must be binary or string, got int64"),
        ({"data": ["x"], "extra": [1]}, "unknown column(s) ['extra']"),
        (
            {"data": ["x"], "operation": ["merge"]},
            "column 'operation' has invalid value(s) ['merge']",
        ),
        ({"data": ["x"], "key": [3]}, "column 'key' must be a string"),
        ({"data": pa.array([None], pa.string())}, "column 'data' has 1 null value(s)"),
        ({"data": ["x"], "event_id": [""]}, "column 'event_id'"),
        ({"data": ["x"], "metadata": ["[1]"]}, "column 'metadata'"),
    ],
)
def test_bad_columns_are_named(columns: dict, message: str) -> None:
    with pytest.raises(InvalidEventError) as info:
        events_from_table(pa.table(columns))
    assert message in str(info.value)
