"""Snapshots while the schema and the rows move (a real PostgreSQL): DDL, TOASTed rows and
partitions changed between two chunks or inside a chunk's window, kills, workers. Each
test plays its statements at an exact point of the snapshot (before a chunk's low
watermark, or after its rows were read and before its high one), then compares the table
the log builds with the source, row by row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from support.capture import query, run, sql
from support.cli import REPLOG, replog
from support.logcheck import check_log
from support.replay import differences, log_table, source_table

from replog.capture import watch
from replog.capture.options import CaptureOptions
from replog.capture.postgres import PostgresCapture
from replog.capture.source import WATERMARK_PREFIX
from replog.capture.workers import RangeReaders
from replog.errors import InjectedFaultError, SourceConfigError
from replog.log import ReplicationLog

BIG = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 400) g)"
"""A text value PostgreSQL keeps out of line (TOASTed): an update that leaves it alone
does not send it."""

Statements = dict[int, Sequence[str]]


class Moved:
    """A capture whose snapshot meets statements at given chunks: ``before[n]`` run just
    before chunk n's low watermark, ``inside[n]`` after chunk n's rows were read and before
    its high watermark (inside its window). Chunks count from 1 over the run."""

    def __init__(
        self, dsn: str, before: Statements | None = None, inside: Statements | None = None
    ):
        self.dsn = dsn
        self.before = before or {}
        self.inside = inside or {}
        self.chunks = 0

    def attach(self, capture: PostgresCapture) -> None:
        emit = capture.source.emit_message

        def emitted(prefix: str, content: str) -> int:
            if prefix == WATERMARK_PREFIX:
                side = json.loads(content)["side"]
                if side == "low":
                    self.chunks += 1
                    sql(self.dsn, *self.before.get(self.chunks, ()))
                else:
                    sql(self.dsn, *self.inside.get(self.chunks, ()))
            return emit(prefix, content)

        capture.source.emit_message = emitted  # type: ignore[method-assign]


def capture_moved(
    dsn: str,
    url: str,
    moved: Moved | None = None,
    *,
    tables: tuple[str, ...] = ("t",),
    hang_s: float = 300,
    **options: Any,
) -> PostgresCapture:
    """One capture run (until caught up with nothing owed), in a thread watched for a
    hang; its errors are raised here."""
    log = ReplicationLog.open_or_create(url, 4)
    opts = CaptureOptions(dsn=dsn, slot="cap", tables=tables, poll_s=0.01, **options)
    found: dict[str, Any] = {}
    stop = threading.Event()

    def body() -> None:
        try:
            with PostgresCapture(opts, log, stop=stop) as capture:
                found["capture"] = capture
                if moved is not None:
                    moved.attach(capture)
                capture.run()
        except BaseException as exc:  # handed to the test below
            found["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(hang_s)
    if thread.is_alive():
        stop.set()
        thread.join(60)
        raise AssertionError(f"capture did not end within {hang_s} s (wedged)")
    if "error" in found:
        raise found["error"]
    return found["capture"]


def assert_equal(url: str, dsn: str, table: str = "t", collection: str = "public.t") -> None:
    found = differences(log_table(url, collection), source_table(dsn, table))
    assert not found, found


def _rows(count: int, *, big_every: int = 0) -> str:
    body = (
        f"CASE WHEN g % {big_every} = 0 THEN {BIG} ELSE 'b' || g END" if big_every else "'b' || g"
    )
    return f"INSERT INTO t SELECT g, 0, {body} FROM generate_series(1, {count}) g"


# -- 1. TOAST inside a window ------------------------------------------------------------


def test_a_row_updated_inside_its_chunks_window_keeps_its_unsent_toasted_value(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The update stands for the row the chunk read, but it does not carry the TOASTed
    body (unchanged): the body must come from the chunk, never as the placeholder."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300, big_every=1))
    moved = Moved(pg_dsn, inside={2: ["UPDATE t SET v = v + 1 WHERE id BETWEEN 101 AND 150"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    logged = log_table(url, "public.t")
    assert not [k for k, row in logged.items() if "__debezium" in json.dumps(row)]
    assert_equal(url, pg_dsn)


def test_a_row_updated_twice_in_a_window_takes_the_body_its_first_update_left(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Two updates inside one window, the second setting the body: each image holds the
    body the row had then (the first the chunk's, the second its own)."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(200, big_every=1))
    moved = Moved(
        pg_dsn,
        inside={
            1: [
                "UPDATE t SET v = 1 WHERE id = 5",
                "UPDATE t SET body = 'short' WHERE id = 5",
                "UPDATE t SET v = 2 WHERE id = 5",
            ]
        },
    )
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    images = [
        json.loads(row["data"])
        for row in sorted(check_log(ReplicationLog.open(url)), key=lambda r: r["sequence"])
        if row["key"] == '{"id":5}'
    ]
    assert [image["v"] for image in images] == [1, 1, 2]
    assert [image["body"] == "short" for image in images] == [False, True, True]
    assert "__debezium" not in json.dumps(images)
    assert_equal(url, pg_dsn)


# -- 2. workers and the table's end -------------------------------------------------------


def test_workers_read_every_old_row_of_the_last_range_whatever_is_inserted_in_the_window(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
        "INSERT INTO t SELECT g * 100, 0, 'old' FROM generate_series(1, 550) g",
    )
    read = RangeReaders.read
    calls: list[int] = []

    def crowded(self: RangeReaders, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # after the second chunk's cuts, before its ranges are read
            sql(pg_dsn, "INSERT INTO t SELECT 50000 + g, 1, 'new' FROM generate_series(1, 99) g")
        return read(self, *args, **kwargs)

    monkeypatch.setattr(RangeReaders, "read", crowded)
    capture_moved(pg_dsn, url, snapshot_chunk_rows=100, snapshot_workers=3)
    assert len(calls) >= 2
    assert_equal(url, pg_dsn)


# -- 3-5. columns retyped, added and set, dropped between chunks ----------------------------


def test_a_column_retyped_between_chunks_is_read_with_its_new_type(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, a int, body text)",
        "INSERT INTO t SELECT g, g, 'b' FROM generate_series(1, 300) g",
    )
    moved = Moved(pg_dsn, before={2: ["ALTER TABLE t ALTER COLUMN a TYPE text USING 'abc' || a"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    for row in check_log(ReplicationLog.open(url)):
        json.loads(row["data"])  # every image is JSON
    assert_equal(url, pg_dsn)


def test_a_column_retyped_after_many_chunks_is_read_on(pg_dsn: str, tmp_path: Path) -> None:
    """Ten chunks: a driver that prepares a statement run five times would have the
    chunk's SELECT prepared, and the server refuses it once a column is retyped ("cached
    plan must not change result type"): capture stopped."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
        "INSERT INTO t SELECT g, g, 'b' FROM generate_series(1, 1200) g",
    )
    moved = Moved(pg_dsn, before={10: ["ALTER TABLE t ALTER COLUMN v TYPE bigint"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert_equal(url, pg_dsn)


def test_a_key_retyped_between_chunks_keeps_the_shortest_key_form(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
        "INSERT INTO t SELECT g, g, 'b' FROM generate_series(1, 300) g",
    )
    moved = Moved(pg_dsn, before={2: ["ALTER TABLE t ALTER COLUMN id TYPE numeric(20,2)"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    keys = {row["key"] for row in check_log(ReplicationLog.open(url))}
    assert keys == {f'{{"id":{i}}}' for i in range(1, 301)}


def test_a_column_added_and_set_between_chunks_is_read_by_the_next_chunk(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    moved = Moved(
        pg_dsn,
        before={
            2: ["ALTER TABLE t ADD COLUMN c int DEFAULT 7", "UPDATE t SET c = id WHERE id > 100"]
        },
    )
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    logged = log_table(url, "public.t")
    assert logged['{"id":150}']["c"] == 150 and logged['{"id":50}']["c"] == 7
    assert_equal(url, pg_dsn)


@pytest.mark.parametrize("follow", [False, True])
def test_a_column_dropped_between_chunks_ends_no_capture(
    pg_dsn: str, tmp_path: Path, follow: bool
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    moved = Moved(pg_dsn, before={2: ["ALTER TABLE t DROP COLUMN body"]})
    if follow:
        _follow_until_snapshotted(pg_dsn, url, moved, snapshot_chunk_rows=100)
    else:
        capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert_equal(url, pg_dsn)


def test_a_column_added_inside_a_window_makes_the_chunk_read_again(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The rows were read without the column, the stream then meets its ADD: the chunk's
    rows are not the table's any more (read again), or the value set is lost."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    moved = Moved(
        pg_dsn,
        inside={
            2: ["ALTER TABLE t ADD COLUMN c int DEFAULT 7", "UPDATE t SET c = 1000 WHERE id = 300"]
        },
    )
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert log_table(url, "public.t")['{"id":150}']["c"] == 7
    assert_equal(url, pg_dsn)


def _follow_until_snapshotted(
    dsn: str,
    url: str,
    moved: Moved,
    *,
    settle_s: float = 0,
    then: tuple[str, ...] | None = ("t",),
    following: tuple[str, ...] = (),
    **options: Any,
) -> None:
    """A following capture until its plan owes nothing, then ``following`` run on the
    source (and ``settle_s`` more), stopped; then a capture of what the follower had not
    read yet, of tables ``then`` (None: none: a table renamed cannot be named as it
    was)."""
    log = ReplicationLog.open_or_create(url, 4)
    opts = CaptureOptions(dsn=dsn, slot="cap", tables=("t",), follow=True, poll_s=0.01, **options)
    stop = threading.Event()
    found: dict[str, Any] = {}

    def body() -> None:
        try:
            with PostgresCapture(opts, log, stop=stop) as capture:
                found["capture"] = capture
                moved.attach(capture)
                capture.run()
        except BaseException as exc:  # handed to the test below
            found["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300  # a hang, not a speed
    try:
        while True:
            assert "error" not in found, found.get("error")
            capture = found.get("capture")
            plan = capture.plan if capture is not None else None
            if plan is not None and plan.finished and not plan.queue and capture.chunk is None:
                break
            assert time.monotonic() < deadline, "the snapshot never ended"
            time.sleep(0.05)
        sql(dsn, *following)
        time.sleep(settle_s)
    finally:
        stop.set()
        thread.join(60)
    assert "error" not in found, found.get("error")
    if then is not None:
        run(dsn, url, tables=then)


# -- 6-7. the table renamed, dropped and created again --------------------------------------


def test_a_table_renamed_mid_snapshot_is_snapshotted_to_its_end(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    moved = Moved(pg_dsn, before={2: ["ALTER TABLE t RENAME TO t2"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100, hang_s=120)
    assert_equal(url, pg_dsn, table="t2")


def test_a_following_capture_snapshots_a_table_renamed_mid_snapshot_to_its_end(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    moved = Moved(pg_dsn, before={2: ["ALTER TABLE t RENAME TO t2"], 3: ["UPDATE t2 SET v = 5"]})
    _follow_until_snapshotted(pg_dsn, url, moved, snapshot_chunk_rows=100, settle_s=0.5, then=None)
    assert_equal(url, pg_dsn, table="t2")


def test_a_table_dropped_and_created_again_mid_snapshot_is_snapshotted_whole(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    moved = Moved(
        pg_dsn,
        before={
            2: [
                "DROP TABLE t",
                "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
                "INSERT INTO t SELECT g, 9, 'again' FROM generate_series(1, 500) g",
            ]
        },
    )
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert_equal(url, pg_dsn)


# -- 8-9. partitions attached and detached ---------------------------------------------------


def _partitioned(dsn: str, *, keyed: bool = True) -> None:
    key = "PRIMARY KEY (id)" if keyed else "CHECK (id > 0)"
    sql(
        dsn,
        f"CREATE TABLE t (id int NOT NULL, v int, body text, {key}) PARTITION BY RANGE (id)",
        "CREATE TABLE t_2 PARTITION OF t FOR VALUES FROM (1001) TO (2001)",
        "CREATE TABLE t_3 PARTITION OF t FOR VALUES FROM (2001) TO (3001)",
        "INSERT INTO t SELECT g, 0, 'b' FROM generate_series(1001, 3000) g",
        "CREATE TABLE t_1 (LIKE t INCLUDING ALL)",
        "INSERT INTO t_1 SELECT g, 1, 'early' FROM generate_series(1, 1000) g",
        "CREATE TABLE t_4 (LIKE t INCLUDING ALL)",
        "INSERT INTO t_4 SELECT g, 4, 'late' FROM generate_series(3001, 3500) g",
    )
    if not keyed:
        sql(
            dsn,
            *(f"ALTER TABLE {p} REPLICA IDENTITY FULL" for p in ("t", "t_1", "t_2", "t_3", "t_4")),
        )


def test_a_partition_attached_mid_snapshot_is_read_whatever_its_keys(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    moved = Moved(
        pg_dsn, before={6: ["ALTER TABLE t ATTACH PARTITION t_1 FOR VALUES FROM (1) TO (1001)"]}
    )
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert_equal(url, pg_dsn)


def test_a_partition_attached_after_the_snapshot_brings_its_rows(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    _follow_until_snapshotted(pg_dsn, url, Moved(pg_dsn), snapshot_chunk_rows=500)
    sql(pg_dsn, "ALTER TABLE t ATTACH PARTITION t_4 FOR VALUES FROM (3001) TO (4001)")
    _follow_until_snapshotted(pg_dsn, url, Moved(pg_dsn), snapshot_chunk_rows=500)
    assert_equal(url, pg_dsn)


def test_a_column_added_to_a_partitioned_table_while_following_is_captured(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition's changes after ``ADD COLUMN`` on its root carry the new column, also
    before capture's catalog watch looks again (here: never, after its first look): the
    root's old columns chose which of a partition's values were kept, so the column, and
    every value set in it, was left out of the log (pgbench_to_delta, one run in four)."""
    monkeypatch.setattr(watch, "CHECK_S", 3600.0)
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    added = (
        "ALTER TABLE t ADD COLUMN region text DEFAULT 'eu'",
        "UPDATE t SET region = 'us', v = 7 WHERE id IN (1500, 2500)",
        "INSERT INTO t (id, v, body, region) VALUES (1000, 8, 'new', NULL)",
    )
    sql(pg_dsn, "ALTER TABLE t ATTACH PARTITION t_1 FOR VALUES FROM (1) TO (1001)",
        "DELETE FROM t WHERE id = 1000")  # fmt: skip
    _follow_until_snapshotted(pg_dsn, url, Moved(pg_dsn), following=added, settle_s=3, then=None)
    log = ReplicationLog.open(url)
    rows = {
        json.loads(e["key"])["id"]: json.loads(e["data"])
        for e in log.read_all().to_pylist()
        if json.loads(e["key"])["id"] in (1000, 1500, 2500)
    }
    assert {k: (r["v"], r.get("region", "<not captured>")) for k, r in rows.items()} == {
        1000: (8, None),
        1500: (7, "us"),
        2500: (7, "us"),
    }


def test_a_partition_detached_takes_its_rows_out_of_the_log(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "ALTER TABLE t DETACH PARTITION t_2",
        "CREATE TABLE t_2b PARTITION OF t FOR VALUES FROM (1001) TO (2001)",
        "INSERT INTO t VALUES (1500, 1, 'again')",  # a key of t_2's range, held again
    )
    _follow_until_snapshotted(pg_dsn, url, Moved(pg_dsn))
    assert_equal(url, pg_dsn)


def test_a_partition_detached_after_a_kill_skips_no_partition_still_attached(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table read in physical order, partition by partition: the plan names the one it
    was reading by identity, so a DETACH of one read before the kill moves nothing."""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn, keyed=False)
    sql(pg_dsn, "ALTER TABLE t ATTACH PARTITION t_1 FOR VALUES FROM (1) TO (1001)")
    monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    keys = {"public.t": ("id",)}
    for _ in range(3):  # into the second partition
        with pytest.raises(InjectedFaultError):
            run(pg_dsn, url, tables=("t",), keys=keys, snapshot_chunk_rows=400)
    monkeypatch.delenv("REPLOG_FAULT")
    (first,) = query(  # the partition read first, before the kills
        pg_dsn,
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 't'::regclass ORDER BY c.oid LIMIT 1",
    )[0]
    sql(pg_dsn, f"ALTER TABLE t DETACH PARTITION {first}")
    run(pg_dsn, url, tables=("t",), keys=keys, snapshot_chunk_rows=400)
    assert_equal(url, pg_dsn)


# -- 10. workers die with the capture --------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def test_snapshot_workers_die_with_a_killed_capture_and_close_their_sessions(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
        "INSERT INTO t SELECT g, 0, repeat('x', 200) FROM generate_series(1, 200000) g",
    )
    process = subprocess.Popen(
        [REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "cap",
         "--tables", "t", "--snapshot-workers", "3", "--snapshot-chunk-rows", "2000", "--follow"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(_children(process.pid)) < 3:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        workers = _children(process.pid)
        database = query(pg_dsn, "SELECT current_database()")[0][0]
        process.send_signal(signal.SIGKILL)  # the capture alone, as the OOM killer does
        process.wait()
        deadline = time.monotonic() + 60  # a hang, not a speed
        while True:
            alive = [pid for pid in workers if _state(pid) != "Z"]
            (sessions,) = query(
                pg_dsn,
                "SELECT count(*) FROM pg_stat_activity"
                f" WHERE datname = '{database}' AND pid <> pg_backend_pid()",
            )[0]
            if not alive and sessions == 0:
                break
            assert time.monotonic() < deadline, f"workers {alive} and {sessions} sessions live on"
            time.sleep(0.5)
    finally:
        if process.poll() is None:
            process.kill()
        for pid in _children(process.pid):
            os.kill(pid, signal.SIGKILL)
        sql(pg_dsn, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


# -- 11. keys that allow NULL -----------------------------------------------------------------


def test_keys_naming_a_column_that_allows_null_are_refused_by_name(
    pg_dsn: str, tmp_path: Path
) -> None:
    sql(
        pg_dsn,
        "CREATE TABLE t (a int NOT NULL, b int, v text)",
        "CREATE UNIQUE INDEX t_ab ON t (a, b)",
        "ALTER TABLE t REPLICA IDENTITY FULL",
        "INSERT INTO t VALUES (1, NULL, 'x'), (1, NULL, 'y')",
    )
    with pytest.raises(SourceConfigError, match=r"column b .*allows NULL.*SET NOT NULL"):
        run(pg_dsn, str(tmp_path / "log"), tables=("t",), keys={"public.t": ("a", "b")})


# -- 12. snapshot requests -------------------------------------------------------------------


def test_the_same_sql_snapshot_request_sent_twice_runs_twice(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(100))
    run(pg_dsn, url, tables=("t",))
    request = (
        "SELECT pg_logical_emit_message(true, 'replog.signal',"
        ' \'{"snapshot": ["public.t"], "slot": "cap"}\')'
    )
    sql(pg_dsn, request, request)
    run(pg_dsn, url, tables=("t",))
    reads = [r for r in check_log(ReplicationLog.open(url)) if '"incremental"' in r["metadata"]]
    assert len(reads) == 200


def test_a_request_for_a_table_not_captured_is_refused_where_it_is_made(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
        "CREATE TABLE other (id int PRIMARY KEY)",
    )
    run(pg_dsn, url, tables=("t",))
    result = replog("snapshot", "postgres", pg_dsn, "--slot", "cap", "--tables", "other")
    assert result.returncode != 0
    assert "public.other" in result.stderr and "public.t" in result.stderr
    found = query(
        pg_dsn,
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('cap', NULL, NULL,"
        " 'proto_version', '1', 'publication_names', 'cap', 'messages', 'true')",
    )
    assert found == [(0,)]  # no signal was written
