"""Attacks on the MySQL capture's snapshot (a real MariaDB server): what online schema
change tools and busy applications do to a table while its chunks are read. Each ends with
the log, applied row by row, equal to the table the server has.

* the table swapped for a copy between two chunks (``RENAME TABLE t TO t_old, t_new TO
  t``: pt-online-schema-change's and gh-ost's cut-over), and while streaming;
* the table dropped inside a chunk's window (nothing left to read), then created again;
* a TRUNCATE between a chunk's read and its high watermark;
* keys moved across the chunk boundary inside a window (a row not yet read moved behind
  the chunk, a row already read moved ahead of it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.mysql import Db, events, log_rows, run, source_rows

from replog.capture.mysql.chunks import MySqlChunks

pytestmark = pytest.mark.slow  # a MariaDB server for the session


def _equal(db: Db, url: str, table: str = "t") -> None:
    columns = [
        name
        for (name,) in db.query(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
            f"AND TABLE_NAME = '{table}' ORDER BY ORDINAL_POSITION"
        )
    ]
    assert log_rows(url, f"{db.name}.{table}", columns) == source_rows(db, table)


def _racing(
    monkeypatch: pytest.MonkeyPatch,
    before: dict[int, Callable[[], None]] | None = None,
    after: dict[int, Callable[[], None]] | None = None,
) -> list[int]:
    """Chunk reads that run ``before[n]`` after the n-th chunk's low watermark (before its
    SELECT) and ``after[n]`` after its SELECT (before its high watermark)."""
    select = MySqlChunks._select
    calls: list[int] = []

    def racing(self: MySqlChunks, table: Any, last: Any) -> Any:
        calls.append(1)
        if before and len(calls) in before:
            before[len(calls)]()
        rows = select(self, table, last)
        if after and len(calls) in after:
            after[len(calls)]()
        return rows

    monkeypatch.setattr(MySqlChunks, "_select", racing)
    return calls


def test_a_table_swapped_for_a_copy_between_chunks_and_while_streaming(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The online schema change cut-over: a copy with a new column, filled without the
    capture seeing its rows as changes of ``t``, renamed in under ``t``'s name in one
    statement with the old table renamed away. The log ends with the copy's rows (the old
    ones truncated), read again by a new snapshot, and changes made to the copy after."""
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "INSERT INTO t SELECT seq, seq FROM seq_1_to_90",
    )

    def cut_over(column: str, new: int) -> None:
        mysql_db.sql(
            "DROP TABLE IF EXISTS t_new",
            "CREATE TABLE t_new LIKE t",
            f"ALTER TABLE t_new ADD COLUMN {column} int NOT NULL DEFAULT 7",
            "INSERT INTO t_new SELECT t.*, 7 FROM t WHERE id % 3 <> 0",  # the copy differs
            "RENAME TABLE t TO t_old, t_new TO t",
            "DROP TABLE t_old",
            f"INSERT INTO t (id, v) VALUES ({new}, 5)",
        )

    calls = _racing(monkeypatch, before={2: lambda: cut_over("w", 500)})
    run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=30)
    monkeypatch.undo()
    assert len(calls) > 2
    _equal(mysql_db, url)
    cut_over("z", 501)  # again, while the capture streams
    mysql_db.sql("UPDATE t SET v = -1 WHERE id = 500")
    run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=30)
    _equal(mysql_db, url)
    assert {e["collection"] for e in events(url)} == {f"{mysql_db.name}.t"}


def test_a_table_dropped_inside_a_chunks_window_then_created_again(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "INSERT INTO t SELECT seq, seq FROM seq_1_to_90",
        "CREATE TABLE u (id int PRIMARY KEY, v int)",
        "INSERT INTO u SELECT seq, seq FROM seq_1_to_10",
    )
    calls = _racing(monkeypatch, before={2: lambda: mysql_db.sql("DROP TABLE t")})
    run(mysql_db.dsn, url, tables=("t", "u"), snapshot_chunk_rows=30)
    monkeypatch.undo()
    assert len(calls) > 2
    _equal(mysql_db, url, "u")  # the other table's snapshot went on
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "INSERT INTO t SELECT seq, -seq FROM seq_50_to_60",
    )
    run(mysql_db.dsn, url, tables=("t", "u"), snapshot_chunk_rows=30)
    _equal(mysql_db, url)
    _equal(mysql_db, url, "u")


def test_a_truncate_between_a_chunks_read_and_its_high_watermark(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "INSERT INTO t SELECT seq, seq FROM seq_1_to_90",
    )

    def truncate() -> None:
        mysql_db.sql("TRUNCATE TABLE t", "INSERT INTO t VALUES (45, -45), (88, -88)")

    calls = _racing(monkeypatch, after={2: truncate})
    run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=30)
    monkeypatch.undo()
    assert len(calls) > 2
    _equal(mysql_db, url)


def test_keys_moved_across_the_chunk_boundary_inside_a_window(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "INSERT INTO t SELECT seq, seq FROM seq_1_to_90",
    )

    def move(pairs: tuple[tuple[int, int], ...]) -> Callable[[], None]:
        return lambda: mysql_db.sql(
            *(f"UPDATE t SET id = {new}, v = v + 1000 WHERE id = {old}" for old, new in pairs)
        )

    # chunk 2 reads 31..60: before its read, 80 (unread) moves behind it and 10 (read)
    # ahead; after its read, 40 (in the chunk) moves ahead and 70 behind
    calls = _racing(
        monkeypatch,
        before={2: move(((80, 0), (10, 95)))},
        after={2: move(((40, 99), (70, -1)))},
    )
    run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=30)
    monkeypatch.undo()
    assert len(calls) > 2
    _equal(mysql_db, url)
