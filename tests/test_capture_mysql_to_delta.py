"""MariaDB -> capture mysql -> Spark -> typed / apply_changes -> Delta: the registered
schemas give each MySQL type its exact Spark type, and the Delta table equals the source
table row by row (a real MariaDB server, a real SparkSession, real Delta tables)."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from support.mysql import Db, run
from test_apply_routing import run as stream
from test_capture_to_delta import delta_rows

from replog.log import ReplicationLog
from replog.spark.functions import apply_changes, typed

pytestmark = [pytest.mark.spark, pytest.mark.slow]

COLUMNS = (
    "id int PRIMARY KEY",
    "small tinyint(1)",
    "big bigint unsigned",
    "amount decimal(12,2)",
    "ratio double",
    "name varchar(20)",
    "latin char(4) character set latin1",
    "made datetime(6)",
    "seen timestamp(3) NULL",
    "born date",
    "took time(3)",
    "yr year",
    "mood enum('sad','happy')",
    "tags set('a','b','c')",
    "doc json",
    "raw blob",
    "flag bit(1)",
    "bits bit(10)",
)
ROWS = (
    "(1, 2, 18446744073709551615, 1234567890.12, 0.1, 'zoë 😀', 'é', "
    "'2024-01-02 03:04:05.000001', '2024-01-02 03:04:05.123', '2024-02-29', '-01:02:03.5', "
    "0, 'happy', 'c,a', '{\"a\": [1, 2.50]}', 0x00FF, b'1', b'1010000001')",
    "(2, 0, 0, -0.01, -1e300, NULL, NULL, '0000-00-00 00:00:00', NULL, NULL, NULL, 2155, "
    "'sad', '', NULL, NULL, b'0', NULL)",
)


def _source(db: Db) -> dict[int, dict[str, Any]]:
    """The table as PyMySQL reads it, in UTC (TIMESTAMPs are instants)."""
    with db.server.admin(db.name) as connection, connection.cursor() as cursor:
        cursor.execute("SET time_zone = '+00:00'")
        cursor.execute("SELECT * FROM t")
        names = [d[0] for d in cursor.description]
        return {row[0]: dict(zip(names, row, strict=True)) for row in cursor.fetchall()}


def _comparable(column: str, value: Any) -> Any:  # noqa: PLR0911 - one return per type
    """A source value as Delta holds it (``apply_changes``' types)."""
    if value is None:
        return None
    if column == "seen":
        return value.replace(tzinfo=dt.timezone.utc)
    if column == "took":  # TIME: bigint microseconds in Delta (Debezium's MicroTime)
        return value // dt.timedelta(microseconds=1)
    if column == "bits":  # BIT(n): Debezium's Bits, little-endian
        return int.from_bytes(value, "big").to_bytes(2, "little")
    if column == "flag":
        return value == b"\x01"
    if column == "doc":
        return value
    if column in {"amount", "big"}:
        return Decimal(value)
    return value


def test_every_change_of_a_mysql_table_lands_in_delta_exactly(
    spark: Any, mysql_db: Db, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(f"CREATE TABLE t ({', '.join(COLUMNS)})")
    mysql_db.server.sql("SET SESSION sql_mode = ''", f"INSERT INTO t VALUES {ROWS[0]}",
                        f"INSERT INTO t VALUES {ROWS[1]}", database=mysql_db.name)  # fmt: skip
    run(mysql_db.dsn, url, tables=("t",))  # the snapshot
    mysql_db.transaction(
        "INSERT INTO t (id, name, amount) VALUES (3, 'three', 3.30)",
        "UPDATE t SET amount = amount + 1, tags = 'b' WHERE id = 1",
    )
    mysql_db.sql(
        "UPDATE t SET id = 30 WHERE id = 3",  # a key change
        "DELETE FROM t WHERE id = 2",
    )
    run(mysql_db.dsn, url, tables=("t",))
    log = ReplicationLog.open(url)
    collection = f"{mysql_db.name}.t"

    frame = typed(spark.read.format("replog").load(url), url, collection)
    types = {f.name: f.dataType.simpleString() for f in frame.schema["after"].dataType.fields}
    assert types["big"] == "decimal(20,0)" and types["amount"] == "decimal(12,2)"
    assert types["small"] == "smallint" and types["flag"] == "boolean"
    assert types["made"] == "timestamp_ntz" and types["seen"] == "timestamp"
    assert types["born"] == "date" and types["bits"] == "binary"

    targets = str(tmp_path / "delta" / "{collection}")
    stream(spark, log, tmp_path / "chk", apply_changes(targets, app_id="mysql", log=log.url))
    delta = delta_rows(str(tmp_path / "delta" / collection))
    source = _source(mysql_db)
    assert sorted(delta) == sorted(source) == [1, 30]
    for key, row in source.items():
        expected = {column: _comparable(column, value) for column, value in row.items()}
        got = dict(delta[key])
        assert got == expected, key
    assert json.loads(delta[1]["doc"]) == {"a": [1, 2.5]}
