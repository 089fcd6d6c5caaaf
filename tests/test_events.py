from datetime import datetime, timezone

import pyarrow as pa
import pytest

from replog.errors import InvalidEventError
from replog.events import STORED_SCHEMA, events_from_records, events_from_table


def test_records_get_defaults_and_json_payloads() -> None:
    table = events_from_records([{"data": {"b": 1, "a": [1, 2]}}, {"data": "text", "key": "k"}])
    assert table.schema == STORED_SCHEMA
    rows = table.to_pylist()
    assert rows[0]["data"] == b'{"a":[1,2],"b":1}'
    assert rows[0]["operation"] == "insert"
    assert rows[0]["key"] == rows[0]["event_id"]  # no key: routed by event id
    assert rows[1]["key"] == "k" and rows[1]["data"] == b"text"


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
        ({"data": 1, "colour": "red"}, "line 3: unknown field(s) ['colour']"),
        ({"data": 1, "metadata": "[1]"}, "line 3: 'metadata' must be a JSON object"),
        ({"data": 1, "timestamp": "yesterday"}, "line 3: 'timestamp' 'yesterday'"),
        ({"data": None}, "line 3: 'data' is required and must not be null"),
        ({"data": 1, "key": 5}, "line 3: 'key' must be a string"),
    ],
)
def test_bad_records_name_the_line_and_field(record: dict, message: str) -> None:
    with pytest.raises(InvalidEventError) as info:
        events_from_records([{"data": 1}, {"data": 2}, record], where=lambda i: f"line {i + 1}")
    assert message in str(info.value)


def test_table_input_casts_strings_and_fills_defaults() -> None:
    table = events_from_table(
        pa.table(
            {
                "data": ["a", "b"],
                "key": ["k1", None],
                "shard": [9, 9],
                "operation": [None, "delete"],
            }
        ),
        default_collection="users",
    )
    rows = table.to_pylist()
    assert [r["data"] for r in rows] == [b"a", b"b"]
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
    ],
)
def test_bad_columns_are_named(columns: dict, message: str) -> None:
    with pytest.raises(InvalidEventError) as info:
        events_from_table(pa.table(columns))
    assert message in str(info.value)
