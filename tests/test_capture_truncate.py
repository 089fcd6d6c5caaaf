"""TRUNCATE as data (a real PostgreSQL): a table's TRUNCATE is a truncate event on each
shard, a partition's a delete of each row it held, at the point of the transaction where
the source did it; the table the log builds equals the source's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.capture import run, sql
from support.logcheck import check_log
from support.replay import differences, log_table, source_table
from test_capture_motion import Moved, capture_moved

from replog.log import ReplicationLog


def _equal(url: str, dsn: str, table: str = "t") -> None:
    found = differences(log_table(url, f"public.{table}"), source_table(dsn, table))
    assert not found, found


def _partitioned(dsn: str) -> None:
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)",
        "CREATE TABLE t_1 PARTITION OF t FOR VALUES FROM (1) TO (101)",
        "CREATE TABLE t_2 PARTITION OF t FOR VALUES FROM (101) TO (201)",
        "CREATE TABLE t_3 PARTITION OF t FOR VALUES FROM (201) TO (301)",
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 300) g",
    )


def test_a_truncated_table_is_emptied_in_the_log_on_every_shard(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'a' FROM generate_series(1, 100) g")  # fmt: skip
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t", "INSERT INTO t VALUES (1, 'new'), (2, 'new')")
    progress = run(pg_dsn, url, tables=("t",))
    assert progress.truncations == 1
    truncates = [r for r in check_log(ReplicationLog.open(url)) if r["operation"] == "truncate"]
    assert sorted(r["shard"] for r in truncates) == [0, 1, 2, 3]  # one per shard
    assert {json.loads(r["metadata"])["op"] for r in truncates} == {"t"}
    _equal(url, pg_dsn)


def test_a_truncate_inside_a_transaction_orders_with_its_inserts(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'a' FROM generate_series(1, 50) g")  # fmt: skip
    run(pg_dsn, url, tables=("t",))
    with_inserts = (
        "DO $$ BEGIN INSERT INTO t VALUES (500, 'before'); TRUNCATE t;"
        " INSERT INTO t VALUES (7, 'after'), (501, 'after'); END $$"
    )
    sql(pg_dsn, with_inserts)
    run(pg_dsn, url, tables=("t",))
    _equal(url, pg_dsn)
    assert set(log_table(url, "public.t")) == {'{"id":7}', '{"id":501}'}


def test_a_truncated_partition_takes_exactly_its_rows(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t_2", "INSERT INTO t VALUES (150, 'again')")
    progress = run(pg_dsn, url, tables=("t",))
    assert progress.truncations == 1
    _equal(url, pg_dsn)
    assert len(log_table(url, "public.t")) == 201


def test_a_partition_truncated_and_refilled_in_one_transaction(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "UPDATE t SET v = 'touched' WHERE id = 5",
        "DO $$ BEGIN INSERT INTO t_3 VALUES (300, 'x') ON CONFLICT (id) DO UPDATE SET v = 'y';"
        " UPDATE t SET v = 'changed' WHERE id = 250; TRUNCATE t_3;"
        " INSERT INTO t SELECT g, 'refilled' FROM generate_series(201, 220) g;"
        " UPDATE t SET v = 'kept' WHERE id = 120; END $$",
    )
    run(pg_dsn, url, tables=("t",))
    _equal(url, pg_dsn)


def test_truncating_every_partition_is_a_table_truncate(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t", "INSERT INTO t VALUES (10, 'new')")
    run(pg_dsn, url, tables=("t",))
    rows = check_log(ReplicationLog.open(url))
    assert [r["operation"] for r in rows].count("truncate") == 4  # not a delete per row
    assert [r["operation"] for r in rows].count("delete") == 0
    _equal(url, pg_dsn)


def test_a_truncate_inside_a_chunks_window_drops_the_rows_the_chunk_read(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t SELECT g, 'a' FROM generate_series(1, 300) g")  # fmt: skip
    moved = Moved(pg_dsn, inside={2: ["TRUNCATE t", "INSERT INTO t VALUES (150, 'new')"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    _equal(url, pg_dsn)


def test_a_partition_truncated_inside_a_chunks_window(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    moved = Moved(pg_dsn, inside={2: ["TRUNCATE t_2", "INSERT INTO t VALUES (150, 'new')"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    _equal(url, pg_dsn)


def test_skip_truncate_counts_a_partitions_truncate_too(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t_2")
    with caplog.at_level("WARNING", logger="replog.capture"):
        progress = run(pg_dsn, url, tables=("t",), skip_truncate=True)
    assert progress.skipped_truncations == 1 and progress.truncations == 0
    assert any("partitions" in r.getMessage() and "--skip-truncate" in r.getMessage()
               for r in caplog.records)  # fmt: skip
