"""The MySQL snapshot's reader process (replog.capture.mysql.rows), attacked: sessions cut
and the server restarted between chunks, descriptors over reads and kills, the capture
SIGKILLed, a BIT key, a moved table, a table exactly one chunk long."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pymysql
import pytest
from support.mysql import Db, events, run

from replog.capture.mysql import rows as chunk_rows
from replog.capture.mysql.options import Dsn
from replog.capture.mysql.server import lost
from replog.errors import SourceConnectionError

pytestmark = pytest.mark.slow


def _fds() -> int:
    """The process's open descriptors, once garbage no longer holds any (an unclosed
    socket of a fixture's set-up, collected at a moment that depends on allocations)."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("fast", [True, False])
def test_killed_session_is_a_lost_connection(
    mysql_db: Db, monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    """The server ends the reader's session (KILL, as a restart does): the next read is a
    lost session (capture's retry), and the one after it reads on a new session."""
    monkeypatch.setattr(chunk_rows, "CHILD_READER", fast)
    mysql_db.sql("CREATE TABLE k (id int PRIMARY KEY)", "INSERT INTO k VALUES (1)")
    reader = chunk_rows.RowReader(Dsn.parse(mysql_db.dsn))
    try:
        statement = f"SELECT id FROM {mysql_db.name}.k"
        reader.columns(statement, None)
        (session,) = reader.columns("SELECT CONNECTION_ID()", None)
        mysql_db.sql(f"KILL CONNECTION {int(session[0].as_py())}")
        time.sleep(0.5)
        with pytest.raises(pymysql.err.MySQLError) as failed:
            reader.columns(statement, None)
        assert lost(failed.value), failed.value  # else capture stops (MySqlCapture._run)
        reader.close()  # as capture's _waiting does
        assert reader.columns(statement, None)[0].to_pylist() == [b"1"]
    finally:
        reader.close()


@pytest.mark.parametrize("fast", [True, False])
def test_server_restart_between_chunks_is_a_lost_connection(
    mysql_db: Db, monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    """The server restarts between two chunk reads: the read that meets it is a lost
    session (capture waits and reads again), not an error that stops capture."""
    monkeypatch.setattr(chunk_rows, "CHILD_READER", fast)
    mysql_db.sql("CREATE TABLE s (id int PRIMARY KEY)", "INSERT INTO s VALUES (1)")
    reader = chunk_rows.RowReader(Dsn.parse(mysql_db.dsn))
    statement = f"SELECT id FROM {mysql_db.name}.s"
    try:
        reader.columns(statement, None)
        mysql_db.server.stop()
        time.sleep(0.5)
        mysql_db.server.start()
        with pytest.raises(Exception) as failed:
            reader.columns(statement, None)
        assert lost(failed.value), repr(failed.value)
        reader.close()
        assert reader.columns(statement, None)[0].to_pylist() == [b"1"]
    finally:
        reader.close()


def test_no_descriptor_leak_over_reads_and_kills(mysql_db: Db) -> None:
    mysql_db.sql("CREATE TABLE f (id int PRIMARY KEY)", "INSERT INTO f VALUES (1)")
    reader = chunk_rows.RowReader(Dsn.parse(mysql_db.dsn))
    statement = f"SELECT id FROM {mysql_db.name}.f"
    try:
        reader.columns(statement, None)
        before = _fds()
        for _ in range(5):
            for _ in range(50):
                reader.columns(statement, None)
            assert reader._child is not None
            reader._child.kill()
            with pytest.raises(SourceConnectionError):
                reader.columns(statement, None)
        reader.columns(statement, None)
        assert _fds() == before
    finally:
        reader.close()
    assert reader._child is None


def test_child_ends_when_capture_is_sigkilled(mysql_db: Db, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        from replog.capture.mysql import rows
        from replog.capture.mysql.options import Dsn
        reader = rows.RowReader(Dsn.parse({mysql_db.dsn!r}))
        reader.columns("SELECT 1", None)
        print(reader._child.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
    assert Dsn.parse(mysql_db.dsn).password is None or (
        str(Dsn.parse(mysql_db.dsn).password).encode() not in cmdline
    )
    parent.kill()
    parent.wait()
    for _ in range(100):
        if not Path(f"/proc/{child}").exists():
            break
        status = Path(f"/proc/{child}/stat").read_text().split()[2]
        if status == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the reader process outlived its capture")


def _chunked(db: Db, tmp_path: Path, table: str, *statements: str) -> list[dict[str, Any]]:
    """``table`` made by ``statements``, captured in snapshot chunks of 10 rows: its
    events."""
    db.sql(*statements)
    url = str(tmp_path / "log")
    run(db.dsn, url, tables=(table,), snapshot_chunk_rows=10)
    return [e for e in events(url) if e["collection"].endswith(f".{table}")]


@pytest.mark.parametrize("fast", [True, False])
def test_bit_key_chunks(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    """A BIT(8) primary key, snapshot in chunks of 10: every row once."""
    monkeypatch.setattr(chunk_rows, "CHILD_READER", fast)
    read = _chunked(
        mysql_db,
        tmp_path,
        "b",
        "CREATE TABLE b (id bit(8) PRIMARY KEY, v int)",
        "INSERT INTO b SELECT seq, seq FROM seq_0_to_255",
    )
    found = sorted(int(e["data"].split('"v":')[1].split("}")[0].split(",")[0]) for e in read)
    assert found == list(range(256))


def test_reads_go_on_after_a_moved_table_error(mysql_db: Db) -> None:
    """1146/1054 (a table or column that moved) leave the reader usable: the chunk is read
    again on it."""
    mysql_db.sql("CREATE TABLE m (id int PRIMARY KEY)", "INSERT INTO m VALUES (1)")
    reader = chunk_rows.RowReader(Dsn.parse(mysql_db.dsn))
    statement = f"SELECT id FROM {mysql_db.name}.m"
    try:
        for bad, number in (
            (f"SELECT nope FROM {mysql_db.name}.m", 1054),
            (f"SELECT id FROM {mysql_db.name}.gone", 1146),
        ):
            with pytest.raises(pymysql.err.MySQLError) as failed:
                reader.columns(bad, None)
            assert failed.value.args[0] == number
            assert reader.columns(statement, None)[0].to_pylist() == [b"1"]
    finally:
        reader.close()


@pytest.mark.parametrize("fast", [True, False])
def test_a_table_exactly_one_chunk_long(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    monkeypatch.setattr(chunk_rows, "CHILD_READER", fast)
    found = _chunked(
        mysql_db,
        tmp_path,
        "x",
        "CREATE TABLE x (id varbinary(4) PRIMARY KEY, note varchar(8) CHARACTER SET latin1)",
        "INSERT INTO x SELECT UNHEX(LPAD(HEX(seq * 7), 8, '0')), 'é' FROM seq_1_to_20",
    )
    assert len(found) == 20 and len({e["key"] for e in found}) == 20
    assert all('"é"' in e["data"] for e in found)


@pytest.mark.parametrize("fast", [True, False])
def test_a_snapshot_whose_sessions_are_cut_mid_way_is_read_again(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    """Every session of the capture's user is cut between two chunk reads (as a server
    restart cuts them): capture waits it out and reads on; every row once."""
    monkeypatch.setattr(chunk_rows, "CHILD_READER", fast)
    mysql_db.sql(
        "CREATE TABLE c (id int PRIMARY KEY, v int)",
        "INSERT INTO c SELECT seq, seq FROM seq_1_to_50",
    )
    user = Dsn.parse(mysql_db.dsn).user
    calls = []
    original = chunk_rows.RowReader.columns

    def columns(self: chunk_rows.RowReader, statement: str, args: object) -> object:
        calls.append(statement)
        if len(calls) == 2:
            for (session,) in mysql_db.server.query(
                f"SELECT id FROM information_schema.processlist WHERE user = '{user}'"
            ):
                mysql_db.sql(f"KILL CONNECTION {int(session)}")
            time.sleep(0.3)
        return original(self, statement, args)  # type: ignore[arg-type]

    monkeypatch.setattr(chunk_rows.RowReader, "columns", columns)
    url = str(tmp_path / "log")
    run(mysql_db.dsn, url, tables=("c",), snapshot_chunk_rows=10)
    found = [e for e in events(url) if e["collection"].endswith(".c")]
    assert len(calls) > 2
    assert sorted(int(e["key"].split(":")[1].rstrip("}")) for e in found) == list(range(1, 51))
