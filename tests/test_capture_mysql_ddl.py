"""DDL under a MySQL capture (a real MariaDB server): each event has its table's schema at
its binlog position, column changes that rewrote rows without row events bring a new
snapshot, a table dropped and created again (or renamed in) replaces its rows, and the log
applied row by row equals the table the server has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.mysql import Db, assert_equal_to_table, events, racing_chunks, run

from replog.log import ReplicationLog
from replog.schemas import registry

pytestmark = pytest.mark.slow  # a MariaDB server for the session


def _reads_since(url: str, version: int) -> list[str]:
    return sorted(e["key"] for e in events(url) if e["op"] == "r" and e["version"] > version)


def _version(url: str) -> int:
    return ReplicationLog.open(url).refresh().version


def test_each_event_has_the_columns_of_its_position_and_rewrites_are_snapshotted(
    mysql_db: Db, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, a int)",
        "INSERT INTO t VALUES (1, 1), (2, 2), (3, 3)",
    )
    run(mysql_db.dsn, url, tables=("t",))
    # read in one run: the insert before the ALTER has the columns it had then
    mysql_db.sql(
        "INSERT INTO t VALUES (4, 4)",
        "ALTER TABLE t ADD COLUMN b int NULL",  # no value for rows it has: no snapshot
        "INSERT INTO t VALUES (5, 5, 5)",
    )
    before = _version(url)
    run(mysql_db.dsn, url, tables=("t",))
    four, five = [e for e in events(url) if e["op"] == "c"]
    assert (four["data"], five["data"]) == ('{"id":4,"a":4}', '{"id":5,"a":5,"b":5}')
    assert four["metadata"]["schema"] != five["metadata"]["schema"]
    assert _reads_since(url, before) == []
    digests = {v.digest for v in registry.versions(ReplicationLog.open(url).storage,
                                                   f"{mysql_db.name}.t")}  # fmt: skip
    assert {four["metadata"]["schema"], five["metadata"]["schema"]} <= digests
    assert_equal_to_table(mysql_db, url)

    everyone = ['{"id":1}', '{"id":2}', '{"id":3}', '{"id":4}', '{"id":5}']
    for statement in (
        "ALTER TABLE t ADD COLUMN c int NOT NULL DEFAULT 7",  # every row holds 7 now
        "ALTER TABLE t RENAME COLUMN a TO a2",
        "ALTER TABLE t MODIFY b varchar(10)",  # 5 is '5' now
    ):
        before = _version(url)
        mysql_db.sql(statement)
        run(mysql_db.dsn, url, tables=("t",))
        assert _reads_since(url, before) == everyone, statement
        assert_equal_to_table(mysql_db, url)
    before = _version(url)
    mysql_db.sql("ALTER TABLE t DROP COLUMN c", "UPDATE t SET b = 'x' WHERE id = 1")
    run(mysql_db.dsn, url, tables=("t",))
    assert _reads_since(url, before) == []  # a column dropped rewrote nothing downstream
    assert_equal_to_table(mysql_db, url)
    assert json.loads(events(url)[-1]["data"]) == {"id": 1, "a2": 1, "b": "x"}


def test_a_table_dropped_and_created_again_replaces_its_rows(mysql_db: Db, tmp_path: Path) -> None:
    """Between runs and inside one: the old table's rows are truncated in the log where
    the new table is created (its rows came after), then the new table is snapshotted."""
    url = str(tmp_path / "log")
    mysql_db.sql("CREATE TABLE t (id int PRIMARY KEY, v varchar(5))",
                 "INSERT INTO t VALUES (1, 'old'), (2, 'old')")  # fmt: skip
    run(mysql_db.dsn, url, tables=("t",))
    mysql_db.sql(
        "DROP TABLE t",
        "CREATE TABLE t (id int PRIMARY KEY, v varchar(5), w int)",
        "INSERT INTO t VALUES (2, 'new', 1), (3, 'new', 1)",
    )
    run(mysql_db.dsn, url, tables=("t",))
    ops = [e["op"] for e in events(url) if e["shard"] == 0 or e["op"] != "t"]
    assert ops.count("t") == 1
    truncate = next(e for e in events(url) if e["op"] == "t")
    assert truncate["source"]["table_recreated"] is True
    assert_equal_to_table(mysql_db, url)
    # again, the DROP in one run, the CREATE in the next (its truncate is still owed)
    mysql_db.sql("DROP TABLE t")
    run(mysql_db.dsn, url, tables=("t",))
    mysql_db.sql("CREATE TABLE t (id int PRIMARY KEY, v varchar(5), w int)",
                 "INSERT INTO t VALUES (9, 'again', 2)")  # fmt: skip
    run(mysql_db.dsn, url, tables=("t",))
    assert_equal_to_table(mysql_db, url)
    # CREATE TABLE IF NOT EXISTS of the table that exists: the binlog has it, nothing changes
    mysql_db.sql("CREATE TABLE IF NOT EXISTS t (id int PRIMARY KEY)")
    before = _version(url)
    run(mysql_db.dsn, url, tables=("t",))
    assert [e for e in events(url) if e["version"] > before] == []


def test_a_table_renamed_away_keeps_its_rows_and_one_renamed_in_replaces_them(
    mysql_db: Db, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "INSERT INTO t VALUES (1, 1)",
        "CREATE TABLE other (id int PRIMARY KEY, v int)",
        "INSERT INTO other VALUES (5, 5)",
    )
    run(mysql_db.dsn, url, tables=("t",))
    mysql_db.sql("RENAME TABLE t TO t_old", "INSERT INTO t_old VALUES (2, 2)")
    mysql_db.sql("ALTER TABLE other RENAME TO t", "INSERT INTO t VALUES (6, 6)")
    run(mysql_db.dsn, url, tables=("t",))
    assert "renamed to" in caplog.text
    assert_equal_to_table(mysql_db, url)  # other's rows, as t: t_old's went with the truncate
    assert all(e["key"] != '{"id":2}' for e in events(url))  # t_old is not captured


def test_ddl_inside_a_snapshot_window_reads_the_chunk_again(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column added between a chunk's low watermark and its read, and one added between
    its read and its high watermark: the chunk is read again (its rows must have the
    columns of the schema they are written with), and a column added with a value for
    every row starts the snapshot again."""
    url = str(tmp_path / "log")
    mysql_db.sql("CREATE TABLE t (id int PRIMARY KEY, v int)")
    mysql_db.sql("INSERT INTO t SELECT seq, seq FROM seq_1_to_100")
    racing_chunks(
        monkeypatch,
        # the second chunk: DDL after its low watermark
        before={2: lambda: mysql_db.sql("ALTER TABLE t ADD COLUMN x int NULL")},
        # the fourth: DDL after its read, before its high watermark
        after={4: lambda: mysql_db.sql("ALTER TABLE t ADD COLUMN y int NOT NULL DEFAULT 3")},
    )
    run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=30)
    monkeypatch.undo()
    assert_equal_to_table(mysql_db, url)
    reads = [json.loads(e["data"]) for e in events(url) if e["op"] == "r"]
    assert {r["y"] for r in reads if "y" in r} == {3}
    assert all(set(r) == {"id", "v", "x", "y"} for r in reads[-100:])
