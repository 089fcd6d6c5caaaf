"""PostgreSQL -> capture -> Spark -> apply_changes -> Delta, equal row by row, for what a
real schema does: a column added with a default, a key updated with its TOASTed column
unchanged, a partitioned table, a table dropped and created again (a real PostgreSQL,
a real SparkSession, real Delta tables)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.capture import query, run, sql
from test_apply_routing import run as stream

from replog.log import ReplicationLog
from replog.spark.functions import apply_changes
from replog.tables.delta import open_table

pytestmark = pytest.mark.spark

BIG = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 400) g)"


def delta_rows(target: str, key: str = "id") -> dict[Any, dict[str, Any]]:
    table = open_table(target, None)
    assert table is not None
    rows = table.to_pyarrow_table().to_pylist()
    return {r[key]: {k: v for k, v in r.items() if not k.startswith("__")} for r in rows}


def source_rows(dsn: str, table: str, key: str = "id") -> dict[Any, dict[str, Any]]:
    names = [
        name
        for (name,) in query(
            dsn,
            f"SELECT attname FROM pg_attribute WHERE attrelid = '{table}'::regclass"
            " AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        )
    ]
    rows = query(dsn, f"SELECT {', '.join(names)} FROM {table}")
    return {row[names.index(key)]: dict(zip(names, row, strict=True)) for row in rows}


def test_a_real_schema_lands_in_delta_equal_to_the_source(
    spark: Any, pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE docs (id int PRIMARY KEY, title text, body text)",
        f"INSERT INTO docs VALUES (1, 'one', {BIG}), (2, 'two', 'short')",
        "CREATE TABLE orders (id int, region text, amount int, PRIMARY KEY (region, id))"
        " PARTITION BY LIST (region)",
        "CREATE TABLE orders_eu PARTITION OF orders FOR VALUES IN ('eu')",
        "CREATE TABLE orders_us PARTITION OF orders FOR VALUES IN ('us')",
        "INSERT INTO orders VALUES (1, 'eu', 10), (2, 'us', 20)",
        "CREATE TABLE tags (id int PRIMARY KEY, label text)",
        "INSERT INTO tags VALUES (1, 'a'), (2, 'b')",
    )
    tables = ("docs", "orders", "tags")
    run(pg_dsn, url, tables=tables)  # the snapshot
    sql(
        pg_dsn,
        "ALTER TABLE docs ADD COLUMN level int DEFAULT 5",  # rows 1, 2 hold 5, untouched
        "UPDATE docs SET id = 10 WHERE id = 1",  # the key changes, the TOASTed body does not
        "INSERT INTO docs (id, title, body) VALUES (3, 'three', 'x')",
        "INSERT INTO orders VALUES (3, 'us', 30)",
        "UPDATE orders SET amount = 11 WHERE id = 1",
        "DELETE FROM orders WHERE id = 2",
        "DROP TABLE tags",  # and created again under the name: its old rows must go
        "CREATE TABLE tags (id int PRIMARY KEY, label text)",
        "INSERT INTO tags VALUES (2, 'B'), (3, 'c')",
    )
    run(pg_dsn, url, tables=tables)
    log = ReplicationLog.open(url)
    targets = str(tmp_path / "delta" / "{collection}")
    stream(spark, log, tmp_path / "chk", apply_changes(targets, app_id="e2e", log=log.url))

    docs = delta_rows(str(tmp_path / "delta" / "public.docs"))
    assert docs == source_rows(pg_dsn, "docs")
    assert docs[10]["level"] == 5 and len(docs[10]["body"]) == 400 * 32
    orders = {
        (r["region"], i): r
        for i, r in delta_rows(str(tmp_path / "delta" / "public.orders")).items()
    }
    assert orders == {(r["region"], i): r for i, r in source_rows(pg_dsn, "orders").items()}
