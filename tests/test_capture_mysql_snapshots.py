"""MySQL snapshots in chunks between watermark rows (a real MariaDB server): no lock, no
long transaction; exact while the table is written to, also when a write races a
watermark; resumable chunk by chunk; asked for while the capture streams."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pymysql
import pytest
from support.cli import replog
from support.mysql import Db, events, log_rows, run, source_rows
from test_capture_mysql_adversity import following
from test_cli_output import validate

from replog.capture import chunk_sizes
from replog.capture.mysql import rows as chunk_rows
from replog.capture.mysql.chunks import MySqlChunks
from replog.capture.mysql.options import Dsn
from replog.capture.mysql.server import MySqlServer
from replog.capture.snapshot import SnapshotPlan
from replog.errors import InjectedFaultError, SourceConnectionError
from replog.log import ReplicationLog

pytestmark = pytest.mark.slow  # a MariaDB server for the session

ROWS = 2_000


def _table(db: Db, rows: int = ROWS) -> None:
    db.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int, note varchar(20))",
        f"INSERT INTO t SELECT seq, 0, CONCAT('n', seq) FROM seq_1_to_{rows}",
    )


def _equal(db: Db, url: str) -> None:
    assert log_rows(url, f"{db.name}.t") == source_rows(db, "t")


class Writes(threading.Thread):
    """Updates, inserts and deletes of random rows, one small transaction each, until
    stopped; an error is kept for the test to raise."""

    def __init__(self, db: Db, seed: int) -> None:
        super().__init__(daemon=True)
        self.db, self.random = db, random.Random(seed)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.count = 0

    def run(self) -> None:
        try:
            with self.db.server.admin(self.db.name) as connection, connection.cursor() as cursor:
                while not self.stop.is_set():
                    key = self.random.randrange(1, ROWS + 200)
                    choice = self.random.random()
                    if choice < 0.6:
                        cursor.execute("UPDATE t SET v = v + 1 WHERE id = %s", (key,))
                    elif choice < 0.8:
                        cursor.execute(
                            "INSERT INTO t VALUES (%s, 0, 'new') ON DUPLICATE KEY UPDATE v = v + 1",
                            (key,),
                        )
                    else:
                        cursor.execute("DELETE FROM t WHERE id = %s", (key,))
                    self.count += 1
                    time.sleep(0.001)
        except BaseException as exc:  # raised by the test
            self.error = exc

    def finish(self) -> None:
        self.stop.set()
        self.join()
        if self.error is not None:
            raise self.error


def test_a_snapshot_while_the_table_is_written_to_is_exact(mysql_db: Db, tmp_path: Path) -> None:
    """Small chunks while writes race them: every row the snapshot read is the row's state
    at its chunk, or a change of the window stands for it; no key is read twice by one
    snapshot; the log applied row by row equals the table."""
    url = str(tmp_path / "log")
    _table(mysql_db)
    writes = Writes(mysql_db, seed=random.randrange(1 << 30))
    writes.start()
    try:
        progress = run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=97)
    finally:
        writes.finish()
    run(mysql_db.dsn, url, tables=("t",))  # the changes after the snapshot's end
    assert writes.count > 0 and progress.snapshot_completed
    reads = Counter(e["key"] for e in events(url) if e["op"] == "r")
    assert max(reads.values()) == 1
    plan = SnapshotPlan.load(ReplicationLog.open(url).storage, "mysql.mysql",
                             ReplicationLog.open(url).log_id)  # fmt: skip
    assert plan is not None and plan.queue == [] and plan.finished[-1]["chunks"] > 10
    _equal(mysql_db, url)


def test_writes_racing_each_watermark_are_taken_as_the_newer_state(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write committed right after the low watermark (the chunk's read sees it), one
    right after the read (it does not): both are in the window, so the chunk drops those
    rows and their change events carry them; a row deleted in the window is not read back."""
    url = str(tmp_path / "log")
    _table(mysql_db, rows=50)
    watermark = MySqlServer.watermark
    select = MySqlChunks._select

    def after_low(self: MySqlServer, capture: str, chunk: str, side: str) -> None:
        watermark(self, capture, chunk, side)
        if side == "low":
            mysql_db.sql("UPDATE t SET v = 100 WHERE id = 5", "DELETE FROM t WHERE id = 6")

    def after_read(self: MySqlChunks, table: Any, after: Any, limit: int) -> Any:
        rows = select(self, table, after, limit)
        mysql_db.sql("UPDATE t SET v = 200 WHERE id = 7", "INSERT INTO t VALUES (51, 1, 'x')")
        return rows

    monkeypatch.setattr(MySqlServer, "watermark", after_low)
    monkeypatch.setattr(MySqlChunks, "_select", after_read)
    run(mysql_db.dsn, url, tables=("t",))
    monkeypatch.undo()
    found = events(url)
    read = {e["key"] for e in found if e["op"] == "r"}
    assert not read & {'{"id":5}', '{"id":6}', '{"id":7}'}  # stood for by their changes
    assert len(read) == 47
    _equal(mysql_db, url)
    # the same snapshot without the window's reconciliation would be stale: prove the
    # changes are in the window (between the chunk's watermarks), not before it
    window = [e for e in found if e["op"] in ("u", "d", "c")]
    assert {e["key"] for e in window} == {'{"id":5}', '{"id":6}', '{"id":7}', '{"id":51}'}


def test_a_snapshot_killed_between_chunks_goes_on_from_the_last_committed_one(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    _table(mysql_db, rows=300)
    monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    afters = []
    for n in range(4):
        with pytest.raises(InjectedFaultError):
            run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=50)
        log = ReplicationLog.open(url)
        plan = SnapshotPlan.load(log.storage, "mysql.mysql", log.log_id)
        assert plan is not None and plan.pending is not None
        afters.append(plan.pending.after)
        mysql_db.sql(f"UPDATE t SET v = v + 1 WHERE id = {n * 50 + 10}")  # a read row changes
    monkeypatch.delenv("REPLOG_FAULT")
    assert afters == [[str(n * 50)] for n in range(1, 5)]  # one new chunk per run
    run(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=50)
    reads = Counter(e["key"] for e in events(url) if e["op"] == "r")
    assert len(reads) == 300 and max(reads.values()) == 1
    _equal(mysql_db, url)


def test_a_snapshot_asked_for_while_the_capture_streams(mysql_db: Db, tmp_path: Path) -> None:
    """``replog snapshot mysql`` writes a row in replog.signals; the following capture
    meets it in binlog order and reads the table again (source.snapshot incremental)."""
    url = str(tmp_path / "log")
    _table(mysql_db, rows=20)
    with following(mysql_db.dsn, url, tables=("t",), snapshot_chunk_rows=7) as capture:
        deadline = time.monotonic() + 300
        while not capture.progress.snapshot_completed:
            assert time.monotonic() < deadline, "the initial snapshot did not end"
            time.sleep(0.05)
        asked = replog("snapshot", "mysql", mysql_db.dsn, "--name", "mysql", "--tables", "t",
                       "--json")  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        validate(json.loads(asked.stdout), "snapshot-mysql")
        while sum(1 for e in events(url) if e["source"]["snapshot"] == "incremental") < 20:
            assert time.monotonic() < deadline, "the requested snapshot did not end"
            time.sleep(0.1)
    kinds = Counter(e["source"]["snapshot"] for e in events(url) if e["op"] == "r")
    assert kinds == {"true": 20, "incremental": 20}
    unknown = replog("snapshot", "mysql", mysql_db.dsn, "--slot", "s", "--tables", "t")
    assert (
        unknown.returncode == 2 and "--slot: an option of the PostgreSQL capture" in unknown.stderr
    )


def test_a_table_added_on_a_restart_is_snapshotted(mysql_db: Db, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _table(mysql_db, rows=5)
    mysql_db.sql("CREATE TABLE u (id int PRIMARY KEY)", "INSERT INTO u VALUES (1), (2)")
    run(mysql_db.dsn, url, tables=("t",))
    with pytest.raises(Exception, match="--tables leaves out"):
        run(mysql_db.dsn, url, tables=("u",))
    run(mysql_db.dsn, url, tables=("t", "u"))
    added = [e for e in events(url) if e["collection"] == f"{mysql_db.name}.u"]
    assert [(e["op"], e["source"]["snapshot"]) for e in added] == [("r", "incremental")] * 2


def test_the_snapshot_reader_process_killed_is_a_lost_connection_then_a_new_one(
    mysql_db: Db,
) -> None:
    """The C extension's reader runs in a child process: killed, the read that meets it
    fails as a lost source connection (capture's retry), never hangs, and the next read
    starts a new one. A server error comes back as PyMySQL's (a table that moved)."""
    mysql_db.sql("CREATE TABLE r (id int PRIMARY KEY, v varbinary(8))",
                 "INSERT INTO r VALUES (1, 0x00ff), (2, NULL)")  # fmt: skip
    reader = chunk_rows.RowReader(Dsn.parse(mysql_db.dsn))
    try:
        statement = f"SELECT id, v FROM {mysql_db.name}.r ORDER BY id"
        first = reader.columns(statement, None)
        assert reader.fast, "the C extension loads in its child process here"
        assert [c.to_pylist() for c in first] == [[b"1", b"2"], [b"\x00\xff", None]]
        assert reader._child is not None
        reader._child.kill()
        reader._child.wait()
        with pytest.raises(SourceConnectionError, match="reader process ended"):
            reader.columns(statement, None)
        again = reader.columns(f"{statement} LIMIT %s", (1,))
        assert [c.to_pylist() for c in again] == [[b"1"], [b"\x00\xff"]]
        with pytest.raises(pymysql.err.ProgrammingError) as moved:
            reader.columns(f"SELECT * FROM {mysql_db.name}.gone", None)
        assert moved.value.args[0] == 1146
    finally:
        reader.close()
    assert reader._child is None


@pytest.mark.parametrize("reader", ["c-extension", "pymysql"])
def test_chunks_of_a_binary_and_text_key_go_on_from_the_last_key_read(
    mysql_db: Db, tmp_path: Path, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of two rows of a (varbinary, utf8mb4 varchar) key: each chunk's last key
    is the next one's lower bound, as its reader returned it (bytes from the C
    extension) and as the statement's parameter (binary); every row is read once."""
    monkeypatch.setattr(chunk_rows, "CHILD_READER", reader == "c-extension")
    mysql_db.sql(
        "CREATE TABLE k (b varbinary(8), s varchar(8), v int, PRIMARY KEY (b, s))",
        "INSERT INTO k VALUES (0x00, 'a', 1), (0x00, 'ü', 2), (0x00ff, 'a', 3), "
        "(0x01, '', 4), (0xff, 'z', 5), (0xff00, 'a', 6), (0x7f, '😀', 7), (0x27, '''', 8)",
    )
    url = str(tmp_path / "log")
    run(mysql_db.dsn, url, tables=("k",), snapshot_chunk_rows=2)
    reads = [e for e in events(url) if e["op"] == "r"]
    assert sorted(json.loads(e["data"])["v"] for e in reads) == list(range(1, 9))
    assert {json.loads(e["data"])["s"] for e in reads} == {"a", "ü", "", "z", "😀", "'"}


def test_chunks_of_float_and_double_keys_go_on_from_the_value_stored(
    mysql_db: Db, tmp_path: Path
) -> None:
    """A chunk's lower bound is its last key as stored: a FLOAT's six-digit text output
    (0.3 for 0.30000001192092896) bounded below it and read rows again; the double it
    widens to, as the snapshot selects it, is exact. Every row read once."""
    mysql_db.sql(
        "CREATE TABLE f (k float PRIMARY KEY, v int)",
        "CREATE TABLE d (k double PRIMARY KEY, v int)",
        f"INSERT INTO f VALUES {', '.join(f'({n / 10}, {n})' for n in range(1, 12))}",
        f"INSERT INTO d VALUES {', '.join(f'({n / 10 + 1e-9}, {n})' for n in range(1, 12))}",
    )
    url = str(tmp_path / "log")
    run(mysql_db.dsn, url, tables=("f", "d"), snapshot_chunk_rows=3)
    for table in ("f", "d"):
        reads = [
            json.loads(e["data"])
            for e in events(url)
            if e["op"] == "r" and e["collection"].endswith(f".{table}")
        ]
        assert sorted(r["v"] for r in reads) == list(range(1, 12)), table


def test_wide_rows_are_read_in_short_chunks_narrow_rows_in_long_ones(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for PostgreSQL: a chunk holds about CHUNK_BYTES of row text (a table's first
    chunk FIRST_CHUNK_ROWS rows), at most --snapshot-chunk-rows; every row once."""
    monkeypatch.setattr(chunk_sizes, "CHUNK_BYTES", 256 << 10)
    monkeypatch.setattr(chunk_sizes, "FIRST_CHUNK_ROWS", 20)
    mysql_db.sql(
        "CREATE TABLE wide (id int PRIMARY KEY, body longtext)",
        "INSERT INTO wide SELECT seq, REPEAT(MD5(seq), 640) FROM seq_1_to_200",
        "CREATE TABLE narrow (id int PRIMARY KEY, v int)",
        "INSERT INTO narrow SELECT seq, seq FROM seq_1_to_1000",
    )
    url = str(tmp_path / "log")
    run(mysql_db.dsn, url, tables=("wide", "narrow"), snapshot_chunk_rows=300)
    found = events(url)
    per_commit: Counter[tuple[str, int]] = Counter(
        (e["collection"].split(".")[-1], e["version"]) for e in found if e["op"] == "r"
    )
    wide = [n for (name, _), n in sorted(per_commit.items()) if name == "wide"]
    narrow = [n for (name, _), n in sorted(per_commit.items()) if name == "narrow"]
    assert sum(wide) == 200 and sum(narrow) == 1000
    assert len({(e["collection"], e["key"]) for e in found}) == 1200  # every row once
    # 20,480-byte rows, 256 KiB a chunk: 12 rows (13 at most with the key's bytes)
    assert wide[0] == 20 and all(n <= 13 for n in wide[1:-1]) and len(wide) > 10, wide
    assert narrow[0] == 20 and narrow[1:4] == [300, 300, 300], narrow
