"""What a MySQL server does to a capture that reads it, done to a real MariaDB: binlog
files rotated and purged under it, the server restarted while it follows, GTIDs with
gaps, other domains and out of order, positions by binlog file and offset. Each change is
in the log once, or capture stops and says what to do."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support.mysql import Db, changes, events, rows_of, run

from replog.capture.mysql.capture import MySqlCapture
from replog.capture.mysql.options import MySqlOptions, capture_app_id
from replog.capture.mysql.positions import PositionRecord
from replog.errors import CaptureError, InjectedFaultError, SourcePositionError
from replog.log import ReplicationLog

pytestmark = pytest.mark.slow  # a MariaDB server for the session


def _table(db: Db) -> None:
    db.sql("CREATE TABLE t (id int PRIMARY KEY, v int)", "INSERT INTO t VALUES (1, 0)")


def _inserts(db: Db, first: int, count: int) -> list[tuple[str, str, str]]:
    """Inserts, one transaction each; the changes they must become."""
    db.sql(*[f"INSERT INTO t VALUES ({n}, {n})" for n in range(first, first + count)])
    return [("c", f'{{"id":{n}}}', f'{{"id":{n},"v":{n}}}') for n in range(first, first + count)]


@contextmanager
def following(dsn: str, url: str, **options: Any) -> Iterator[MySqlCapture]:
    """A capture with --follow in a thread, stopped (and its error raised) on exit."""
    stop = threading.Event()
    log = ReplicationLog.open_or_create(url, 4)
    running = MySqlCapture(MySqlOptions(dsn=dsn, follow=True, **options), log, stop=stop)
    failed: list[BaseException] = []

    def work() -> None:
        try:
            running.run()
        except BaseException as exc:  # raised in the test below
            failed.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield running
    finally:
        stop.set()
        thread.join(300)
        running.close()
    assert not thread.is_alive(), "the capture did not stop"
    if failed:
        raise failed[0]


def _purge(db: Db) -> None:
    """Purge every binlog file but the newest. MariaDB keeps a file until its binlog
    checkpoint passed it (PURGE then keeps it without a word): flushed again until it
    goes (a wait for a hang)."""
    [(first, *_)] = db.query("SHOW MASTER STATUS")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        db.sql("FLUSH BINARY LOGS")
        [(current, *_)] = db.query("SHOW MASTER STATUS")
        db.sql(f"PURGE BINARY LOGS TO '{current}'")
        if [name for name, *_ in db.query("SHOW BINARY LOGS")] == [current]:
            return
        time.sleep(0.2)
    raise AssertionError(f"the server kept binlog files older than {first}")


def _caught_up(db: Db, capture: MySqlCapture) -> None:
    """Wait until the capture's position is the server's (a wait for a hang). The
    server's is read again each time: the capture's own watermark rows move it."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        [(file, pos, *_)] = db.query("SHOW MASTER STATUS")
        position = capture.position
        if position is not None and (position.file, position.pos) == (file, pos):
            return
        time.sleep(0.05)
    raise AssertionError(f"the capture did not reach {file}:{pos}: {capture.position}")


def test_binlog_files_rotated_between_and_inside_batches(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    _table(mysql_db)
    run(mysql_db.dsn, url, tables=("t",))
    expected = []
    for round_ in range(3):
        expected += _inserts(mysql_db, 10 * round_ + 10, 3)
        mysql_db.sql("FLUSH BINARY LOGS")
    run(mysql_db.dsn, url, tables=("t",), max_changes=2)  # batches end across the files
    # killed after a commit whose position is in an older file than the server's now
    monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    expected += _inserts(mysql_db, 100, 1)
    mysql_db.sql("FLUSH BINARY LOGS")
    expected += _inserts(mysql_db, 101, 1)
    with pytest.raises(InjectedFaultError):
        run(mysql_db.dsn, url, tables=("t",), max_changes=1)
    monkeypatch.delenv("REPLOG_FAULT")
    run(mysql_db.dsn, url, tables=("t",))
    assert changes(url) == expected
    files = {e["source"]["file"] for e in events(url) if e["op"] == "c"}
    assert len(files) >= 4


def test_a_purged_binlog_is_refused_with_the_way_on(mysql_db: Db, tmp_path: Path) -> None:
    """The binlog after the log's position gone (PURGE, expire_logs_days): capture says so
    and names --reset-position, which takes a new snapshot from the server's position now
    and leaves the log's table equal to the source's."""
    url = str(tmp_path / "log")
    _table(mysql_db)
    mysql_db.sql("INSERT INTO t VALUES (4, 4)")
    run(mysql_db.dsn, url, tables=("t",))
    version = ReplicationLog.open(url).refresh().version
    mysql_db.sql(
        "UPDATE t SET v = 5 WHERE id = 1",
        "INSERT INTO t VALUES (2, 2)",
        "DELETE FROM t WHERE id = 4",
    )
    _purge(mysql_db)
    with pytest.raises(SourcePositionError, match=r"purged.*--reset-position"):
        run(mysql_db.dsn, url, tables=("t",))
    assert ReplicationLog.open(url).refresh().version == version  # nothing written
    mysql_db.sql("DELETE FROM t WHERE id = 2", "INSERT INTO t VALUES (3, 3)")
    progress = run(mysql_db.dsn, url, tables=("t",), reset_position=True)
    assert progress.snapshot_rows == 2
    # row 4, captured, then deleted in the binlog that is gone: the truncate that comes
    # first takes it away
    assert rows_of(url, f"{mysql_db.name}.t") == {
        '{"id":1}': '{"id":1,"v":5}',
        '{"id":3}': '{"id":3,"v":3}',
    }
    [truncate] = [e for e in events(url) if e["op"] == "t" and e["shard"] == 0]
    assert truncate["source"]["position_reset"] is True


def test_a_purge_while_following_stops_the_capture_with_the_way_on(
    mysql_db: Db, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _table(mysql_db)
    run(mysql_db.dsn, url, tables=("t",))
    log = ReplicationLog.open(url)
    capture = MySqlCapture(MySqlOptions(dsn=mysql_db.dsn, tables=("t",)), log)
    try:
        mysql_db.sql("INSERT INTO t VALUES (5, 5)")
        _purge(mysql_db)  # after the capture started
        with pytest.raises(SourcePositionError, match="--reset-position"):
            capture.run()
    finally:
        capture.close()


def test_a_server_restart_while_following_loses_and_doubles_nothing(
    mysql_db: Db, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _table(mysql_db)
    expected: list[tuple[str, str, str]] = []
    with following(mysql_db.dsn, url, tables=("t",)) as capture:
        expected += _inserts(mysql_db, 10, 5)
        _caught_up(mysql_db, capture)
        mysql_db.server.stop()  # its binlog connection and sessions are cut
        time.sleep(0.5)  # the capture meets the server down
        mysql_db.server.start()
        expected += _inserts(mysql_db, 20, 5)
        _caught_up(mysql_db, capture)
        assert capture.progress.errors >= 1  # it met the restart
    assert changes(url) == expected


def test_gtid_gaps_other_domains_and_a_resume_by_gtid(mysql_db: Db, tmp_path: Path) -> None:
    """Sequence numbers that jump, a second replication domain: each version rises (the
    GTID count), and a capture moved to "another server" (its position record names
    another server_id) resumes by GTID state, with nothing read twice."""
    url = str(tmp_path / "log")
    _table(mysql_db)
    run(mysql_db.dsn, url, tables=("t",))
    [(seq,)] = mysql_db.query("SELECT @@gtid_seq_no")
    [(state,)] = mysql_db.query("SELECT @@gtid_binlog_pos")
    top = max(int(part.split("-")[2]) for part in state.split(","))
    mysql_db.server.sql(  # a gap in domain 0, then a transaction in domain 9
        f"SET SESSION gtid_seq_no = {top + 1000}",
        f"INSERT INTO {mysql_db.name}.t VALUES (2, 2)",
        "SET SESSION gtid_domain_id = 9",
        f"INSERT INTO {mysql_db.name}.t VALUES (3, 3)",
    )
    run(mysql_db.dsn, url, tables=("t",))
    log = ReplicationLog.open(url)
    logged = log.transaction_version(capture_app_id("mysql"))
    record = PositionRecord.load(log.storage, "mysql", log.log_id)
    assert record is not None and logged is not None
    position = record.at(logged)
    assert position is not None and "9-1-1" in position.gtids
    # the record as another server's: the capture must find its place by GTID state
    record.positions = [replace(position, server_id=77, file="elsewhere.000001", pos=4)]
    record.write(log.storage, record.positions[0], logged=logged)
    expected = _inserts(mysql_db, 40, 2)
    run(mysql_db.dsn, url, tables=("t",))
    assert changes(url)[-2:] == expected
    assert [key for _, key, _ in changes(url)] == ['{"id":2}', '{"id":3}', '{"id":40}', '{"id":41}']
    del seq


def test_gtids_out_of_order_stop_the_capture(mysql_db: Db, tmp_path: Path) -> None:
    """Without gtid_strict_mode a transaction can carry a lower sequence number than one
    before it in its domain: its version would not be past the log's (taken for a
    transaction the log holds). Capture stops, naming the setting."""
    url = str(tmp_path / "log")
    _table(mysql_db)
    run(mysql_db.dsn, url, tables=("t",))
    [(state,)] = mysql_db.query("SELECT @@gtid_binlog_pos")
    top = max(int(p.split("-")[2]) for p in state.split(",") if p.startswith("0-"))
    server = mysql_db.server
    server.sql("SET GLOBAL gtid_strict_mode = OFF")
    try:
        server.sql(
            "SET SESSION gtid_domain_id = 0",
            f"SET SESSION gtid_seq_no = {top + 5}",
            f"INSERT INTO {mysql_db.name}.t VALUES (2, 2)",
            f"SET SESSION gtid_seq_no = {top + 3}",
            f"INSERT INTO {mysql_db.name}.t VALUES (3, 3)",
        )
    finally:
        server.sql("SET GLOBAL gtid_strict_mode = ON")
    with pytest.raises(CaptureError, match="GTIDs out of order \\(set gtid_strict_mode=ON"):
        run(mysql_db.dsn, url, tables=("t",))
    assert [key for _, key, _ in changes(url)] == []  # the batch with them committed nothing


def test_positions_by_binlog_file_and_offset(
    mysql_db: Db, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--position file (MySQL without GTIDs): the version is binlog number << 32 | offset,
    and a restart after a failure at each commit reads on from it."""
    url = str(tmp_path / "log")
    _table(mysql_db)
    run(mysql_db.dsn, url, tables=("t",), position="file")
    monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    expected = []
    for n in range(3):
        expected += _inserts(mysql_db, 10 + n, 1)
        with pytest.raises(InjectedFaultError):
            run(mysql_db.dsn, url, tables=("t",), position="file", max_changes=1)
    monkeypatch.delenv("REPLOG_FAULT")
    run(mysql_db.dsn, url, tables=("t",))  # auto: the log's mode is kept
    assert changes(url) == expected
    log = ReplicationLog.open(url)
    logged = log.transaction_version(capture_app_id("mysql"))
    [(file, pos, *_)] = mysql_db.query("SHOW MASTER STATUS")
    assert logged == (int(file.rsplit(".", 1)[1]) << 32) | pos
    with pytest.raises(Exception, match="records file positions"):
        run(mysql_db.dsn, url, tables=("t",), position="gtid")
