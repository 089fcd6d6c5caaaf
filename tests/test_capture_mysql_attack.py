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

import pytest
from support.mysql import Db, assert_equal_to_table, events, racing_chunks, run

pytestmark = pytest.mark.slow  # a MariaDB server for the session


TABLE_OF_90 = (
    "CREATE TABLE t (id int PRIMARY KEY, v int)",
    "INSERT INTO t SELECT seq, seq FROM seq_1_to_90",
)


def _snapshot_racing(
    db: Db,
    url: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    tables: tuple[str, ...] = ("t",),
    before: dict[int, Callable[[], None]] | None = None,
    after: dict[int, Callable[[], None]] | None = None,
) -> None:
    """A capture of ``tables`` in chunks of 30 rows, with ``before`` and ``after`` run
    inside the chunk reads (:func:`racing_chunks`); more than two chunks were read."""
    calls = racing_chunks(monkeypatch, before, after)
    run(db.dsn, url, tables=tables, snapshot_chunk_rows=30)
    monkeypatch.undo()
    assert len(calls) > 2


def test_a_table_swapped_for_a_copy_between_chunks_and_while_streaming(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The online schema change cut-over: a copy with a new column, filled without the
    capture seeing its rows as changes of ``t``, renamed in under ``t``'s name in one
    statement with the old table renamed away. The log ends with the copy's rows (the old
    ones truncated), read again by a new snapshot, and changes made to the copy after."""
    url = str(tmp_path / "log")
    mysql_db.sql(*TABLE_OF_90)

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

    _snapshot_racing(mysql_db, url, monkeypatch, before={2: lambda: cut_over("w", 500)})
    assert_equal_to_table(mysql_db, url)
    cut_over("z", 501)  # again, while the capture streams
    mysql_db.sql("UPDATE t SET v = -1 WHERE id = 500")
    run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=30)
    assert_equal_to_table(mysql_db, url)
    assert {e["collection"] for e in events(url)} == {f"{mysql_db.name}.t"}


def test_a_table_dropped_inside_a_chunks_window_then_created_again(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(
        *TABLE_OF_90,
        "CREATE TABLE u (id int PRIMARY KEY, v int)",
        "INSERT INTO u SELECT seq, seq FROM seq_1_to_10",
    )
    _snapshot_racing(mysql_db, url, monkeypatch, tables=("t", "u"),
                     before={2: lambda: mysql_db.sql("DROP TABLE t")})  # fmt: skip
    assert_equal_to_table(mysql_db, url, "u")  # the other table's snapshot went on
    mysql_db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "INSERT INTO t SELECT seq, -seq FROM seq_50_to_60",
    )
    run(mysql_db.dsn, url, tables=("t", "u"), snapshot_chunk_rows=30)
    assert_equal_to_table(mysql_db, url)
    assert_equal_to_table(mysql_db, url, "u")


def test_a_truncate_between_a_chunks_read_and_its_high_watermark(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(*TABLE_OF_90)

    def truncate() -> None:
        mysql_db.sql("TRUNCATE TABLE t", "INSERT INTO t VALUES (45, -45), (88, -88)")

    _snapshot_racing(mysql_db, url, monkeypatch, after={2: truncate})
    assert_equal_to_table(mysql_db, url)


def test_keys_moved_across_the_chunk_boundary_inside_a_window(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    mysql_db.sql(*TABLE_OF_90)

    def move(pairs: tuple[tuple[int, int], ...]) -> Callable[[], None]:
        return lambda: mysql_db.sql(
            *(f"UPDATE t SET id = {new}, v = v + 1000 WHERE id = {old}" for old, new in pairs)
        )

    # chunk 2 reads 31..60: before its read, 80 (unread) moves behind it and 10 (read)
    # ahead; after its read, 40 (in the chunk) moves ahead and 70 behind
    _snapshot_racing(
        mysql_db,
        url,
        monkeypatch,
        before={2: move(((80, 0), (10, 95)))},
        after={2: move(((40, 99), (70, -1)))},
    )
    assert_equal_to_table(mysql_db, url)
