"""An adversarial review of issue 39 (capture as a good guest; a real PostgreSQL): slot
ownership and its races, starting over, publications changed under capture, heartbeats
and TRUNCATE beyond the issue's own tests. Each test compares the table the log builds
with the source, row by row (tests/support/replay.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from support.capture import query, run, sql
from support.cli import REPLOG, replog
from support.logcheck import check_log
from support.replay import differences, log_table, source_table
from test_capture_motion_attack import Follower

from replog.capture.batch import Batch
from replog.capture.options import CaptureOptions, capture_app_id
from replog.capture.postgres import PostgresCapture
from replog.capture.source import CAPTURE_LOCK_CLASS
from replog.errors import (
    CaptureError,
    CaptureRunningError,
    InjectedFaultError,
    SlotOwnershipError,
    SourcePositionError,
)
from replog.log import ReplicationLog
from replog.tables import changes

HANG_S = 300
"""How long a wait may take before it is a hang (never a speed limit)."""


def _equal(url: str, dsn: str, table: str = "t", key: tuple[str, ...] = ("id",)) -> None:
    found = differences(log_table(url, f"public.{table}"), source_table(dsn, table, key))
    assert not found, found


def _table(dsn: str, rows: int = 20) -> None:
    sql(dsn, "CREATE TABLE t (id int PRIMARY KEY, v text)",
        f"INSERT INTO t SELECT g, 'a' FROM generate_series(1, {rows}) g")  # fmt: skip


def _partitioned(dsn: str, *, default: bool = False) -> None:
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)",
        "CREATE TABLE t_1 PARTITION OF t FOR VALUES FROM (1) TO (101)",
        "CREATE TABLE t_2 PARTITION OF t FOR VALUES FROM (101) TO (201)",
        "CREATE TABLE t_d PARTITION OF t DEFAULT"
        if default
        else "CREATE TABLE t_3 PARTITION OF t FOR VALUES FROM (201) TO (301)",
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 300) g",
    )


def _gap(dsn: str) -> None:
    """Changes of every kind a capture must not lose: a delete, an update, an insert."""
    sql(dsn, "DELETE FROM t WHERE id = 1", "UPDATE t SET v = 'changed' WHERE id = 2",
        "INSERT INTO t VALUES (1000, 'new')")  # fmt: skip


# -- --reset-slot: the way on every refusal names must work --------------------------------


def test_reset_slot_starts_over_a_log_whose_slot_was_dropped(pg_dsn: str, tmp_path: Path) -> None:
    """The refusal says '--reset-slot starts over with a new slot and a snapshot into this
    log'; it did not: the same refusal again (reset was only read for a log holding no
    position). Starting over must also delete what the log holds and the source lost in
    the gap (row 1), not only read every row again."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "SELECT pg_drop_replication_slot('cap')")
    _gap(pg_dsn)
    with pytest.raises(SourcePositionError, match=r"slot does not exist.*--reset-slot"):
        run(pg_dsn, url, tables=("t",))
    run(pg_dsn, url, tables=("t",), reset_slot=True)
    _equal(url, pg_dsn)
    sql(pg_dsn, "UPDATE t SET v = 'after' WHERE id = 3", "DELETE FROM t WHERE id = 4")
    run(pg_dsn, url, tables=("t",))  # resumes the new slot, no flag
    _equal(url, pg_dsn)
    check_log(ReplicationLog.open(url))


def test_reset_slot_starts_over_a_log_whose_slot_was_consumed_elsewhere(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    _gap(pg_dsn)
    sql(pg_dsn, "SELECT count(*) FROM pg_logical_slot_get_binary_changes('cap', NULL, NULL,"
                " 'proto_version', '1', 'publication_names', 'cap')")  # fmt: skip
    with pytest.raises(SourcePositionError, match=r"advanced to .* past the log's position"):
        run(pg_dsn, url, tables=("t",))
    run(pg_dsn, url, tables=("t",), reset_slot=True)
    _equal(url, pg_dsn)


def test_a_start_over_killed_before_its_first_commit_is_resumed_without_the_flag(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--reset-slot made the new slot and was killed before its first commit: the next
    run (no flag) finds a slot this log made and never advanced, ahead of the log's
    position, and starts over again (not 'advanced past the log's position')."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "SELECT pg_drop_replication_slot('cap')")
    _gap(pg_dsn)

    def killed(self: Batch, transaction: Any) -> Any:
        raise InjectedFaultError("killed before the first commit landed")

    with monkeypatch.context() as patched:
        patched.setattr(Batch, "commit", killed)
        with pytest.raises(InjectedFaultError):
            run(pg_dsn, url, tables=("t",), reset_slot=True)
    run(pg_dsn, url, tables=("t",))
    _equal(url, pg_dsn)


def test_a_publication_capture_killed_before_its_first_commit_starts_again(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --publication capture writes no owner into a publication of its own; a run
    killed before its first commit left a slot the restart refused as another log's
    (SlotOwnershipError), though this log's plan names the slot it made."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    sql(pg_dsn, "CREATE PUBLICATION mine FOR TABLE t")

    def killed(self: Batch, transaction: Any) -> Any:
        raise InjectedFaultError("killed before the first commit landed")

    with monkeypatch.context() as patched:
        patched.setattr(Batch, "commit", killed)
        with pytest.raises(InjectedFaultError):
            run(pg_dsn, url, tables=("t",), publication="mine")
    _gap(pg_dsn)
    run(pg_dsn, url, tables=("t",), publication="mine")
    _equal(url, pg_dsn)
    # another log is still refused the slot it never made
    with pytest.raises(SlotOwnershipError):
        run(pg_dsn, str(tmp_path / "typo"), tables=("t",), publication="mine")


def test_a_mistyped_log_refused_by_the_cli_leaves_nothing_behind(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Issue item 1 through the command: the refusal came after the command had created
    the mistyped log (and written a run record into it)."""
    _table(pg_dsn)
    run(pg_dsn, str(tmp_path / "shop"), tables=("t",), slot="shop")
    typo = tmp_path / "shopp"
    result = replog("capture", "postgres", pg_dsn, str(typo), "--slot", "shop", "--tables", "t")
    assert result.returncode != 0 and "belongs to log" in result.stderr, result.stderr
    assert not typo.exists(), sorted(str(p) for p in typo.rglob("*"))


def test_the_owner_resumes_after_its_publication_comment_was_removed(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "COMMENT ON PUBLICATION cap IS NULL")
    _gap(pg_dsn)
    with pytest.raises(SlotOwnershipError):  # a log holding nothing of it: refused
        run(pg_dsn, str(tmp_path / "typo"), tables=("t",))
    run(pg_dsn, url, tables=("t",))  # the log holding its position resumes it
    _equal(url, pg_dsn)
    (comment,) = query(pg_dsn, "SELECT obj_description(oid, 'pg_publication')"
                               " FROM pg_publication WHERE pubname = 'cap'")[0]  # fmt: skip
    assert json.loads(comment)["replog"]["log_id"] == ReplicationLog.open(url).log_id


# -- races of two captures -----------------------------------------------------------------


def test_two_captures_into_two_logs_started_at_once_one_wins(pg_dsn: str, tmp_path: Path) -> None:
    _table(pg_dsn, rows=3000)
    urls = [str(tmp_path / "a"), str(tmp_path / "b")]
    barrier = threading.Barrier(2)
    ended: dict[int, Any] = {}

    def body(index: int) -> None:
        barrier.wait()
        try:
            ended[index] = run(pg_dsn, urls[index], tables=("t",), snapshot_chunk_rows=300)
        except BaseException as exc:  # handed to the test below
            ended[index] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_S)
    refused = [i for i, end in ended.items() if isinstance(end, BaseException)]
    assert len(refused) == 1, ended
    assert isinstance(ended[refused[0]], (CaptureRunningError, SlotOwnershipError))
    winner = urls[1 - refused[0]]
    (comment,) = query(pg_dsn, "SELECT obj_description(oid, 'pg_publication')"
                               " FROM pg_publication WHERE pubname = 'cap'")[0]  # fmt: skip
    assert json.loads(comment)["replog"]["log_id"] == ReplicationLog.open(winner).log_id
    _equal(winner, pg_dsn)


def test_a_capture_started_while_its_predecessor_s_session_ends_is_let_in(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A capture that just stopped holds the slot's lock until its server process has
    exited; one started at that moment (a supervisor's restart) was refused at once as a
    second capture. Here the holder lets go as soon as the newcomer asks."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    holder = psycopg.connect(pg_dsn, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s, hashtext('cap'))", (CAPTURE_LOCK_CLASS,))
    done = threading.Event()

    def lets_go_when_asked() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as watcher:
            while not done.wait(0.01):
                (waiting,) = watcher.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone() or (0,)
                if waiting:
                    holder.close()
                    return

    thread = threading.Thread(target=lets_go_when_asked, daemon=True)
    thread.start()
    try:
        _gap(pg_dsn)
        run(pg_dsn, url, tables=("t",))
    finally:
        done.set()
        thread.join(HANG_S)
        holder.close()
    _equal(url, pg_dsn)


def test_a_terminated_capture_that_still_commits_never_doubles_a_transaction(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pg_terminate_backend ends a capture's session (its lock with it) while it is
    between reading a transaction and committing it; a second capture of the log is let
    in and commits that transaction; the first then commits too. The log holds it once."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    paused, go = threading.Event(), threading.Event()
    commit = Batch.commit

    def frozen(self: Batch, transaction: Any) -> Any:
        if threading.current_thread().name == "first" and not paused.is_set():
            paused.set()
            assert go.wait(HANG_S)
        return commit(self, transaction)

    ended: dict[str, Any] = {}
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t",), follow=True, poll_s=0.01)
    stop = threading.Event()

    def body() -> None:
        try:
            with PostgresCapture(options, ReplicationLog.open(url), stop=stop) as capture:
                ended["pid"] = capture.source.connection.info.backend_pid
                capture.run()
        except BaseException as exc:  # handed to the test below
            ended["error"] = exc

    monkeypatch.setattr(Batch, "commit", frozen)
    first = threading.Thread(target=body, name="first", daemon=True)
    first.start()
    try:
        sql(pg_dsn, "INSERT INTO t VALUES (500, 'once')")
        assert paused.wait(HANG_S)
        sql(pg_dsn, f"SELECT pg_terminate_backend({ended['pid']})")
        run(pg_dsn, url, tables=("t",))  # let in: the lock went with the session
    finally:
        go.set()
        stop.set()
        first.join(HANG_S)
    monkeypatch.setattr(Batch, "commit", commit)
    assert isinstance(ended.get("error"), (CaptureError, psycopg.Error)), ended
    run(pg_dsn, url, tables=("t",))
    rows = check_log(ReplicationLog.open(url))  # no event id twice, gapless
    created = [r["key"] for r in rows if json.loads(r["metadata"])["op"] == "c"]
    assert created == ['{"id":500}']
    _equal(url, pg_dsn)


# -- the captured set: --tables-changed ------------------------------------------------------


@pytest.mark.parametrize("ddl", ["ALTER TABLE o RENAME TO o2", "DROP TABLE o"])
def test_tables_changed_stopped_before_it_read_past_the_removal(
    pg_dsn: str, tmp_path: Path, ddl: str
) -> None:
    """--tables-changed takes a table out of capture's publication and out of the plan at
    start. Stopped before it read the changes of that table still in the slot, each
    restart then stopped on them ('not a captured table, yet capture's own publication
    published it ... remove it from the publication'), which it no longer is."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    sql(pg_dsn, "CREATE TABLE o (id int PRIMARY KEY)")
    run(pg_dsn, url, tables=("t", "o"))
    sql(pg_dsn, "INSERT INTO o VALUES (1)", "INSERT INTO t VALUES (500, 'x')")
    stop = threading.Event()
    stop.set()  # stopped after its start (a Ctrl-C before the first batch)
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t",), tables_changed=True,
                             follow=True)  # fmt: skip
    with PostgresCapture(options, ReplicationLog.open(url), stop=stop) as capture:
        capture.run()
    sql(pg_dsn, ddl)  # the released table renamed or dropped, its change still unread
    progress = run(pg_dsn, url)
    assert progress.skipped_changes >= 1
    _equal(url, pg_dsn)


# -- publications changed under capture -----------------------------------------------------


def test_capture_s_publication_dropped_while_it_was_down_is_made_good(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A DBA drops capture's publication (cleaning up); capture is restarted and creates it
    again. The changes between were never published: they were lost without a word
    (row 1 stayed, row 1000 never came)."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "DROP PUBLICATION cap")
    _gap(pg_dsn)
    with caplog.at_level("WARNING", logger="replog.capture"):
        run(pg_dsn, url, tables=("t",))
    assert any("publication cap" in r.getMessage() and "public.t" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")  # fmt: skip
    _equal(url, pg_dsn)


def test_a_table_taken_out_of_capture_s_publication_while_down_is_made_good(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "ALTER PUBLICATION cap DROP TABLE t")
    _gap(pg_dsn)
    run(pg_dsn, url, tables=("t",))  # published again, and snapshotted: row 1 stayed
    _equal(url, pg_dsn)


@pytest.mark.parametrize(
    "ddl", ["DROP PUBLICATION cap", "ALTER PUBLICATION cap DROP TABLE t"]
)
def test_capture_s_publication_changed_while_following_stops_it(
    pg_dsn: str, tmp_path: Path, ddl: str
) -> None:
    """While a capture follows, its publication is dropped or its table taken out: every
    change from then on is missing from the stream, and capture went on without a word."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    follower = Follower(pg_dsn, url)
    follower.sync()
    sql(pg_dsn, ddl)
    _gap(pg_dsn)
    follower.thread.join(HANG_S)  # it stops on its own
    assert not follower.thread.is_alive(), "capture went on without its publication"
    assert isinstance(follower.found.get("error"), CaptureError), follower.found
    assert "publication cap" in str(follower.found["error"])
    run(pg_dsn, url, tables=("t",))  # the restart makes it good
    _equal(url, pg_dsn)


def test_a_user_publication_that_would_hide_changes_is_warned_about(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A publication of the user's through partition roots sends no TRUNCATE of one
    partition; one without 'delete' or 'truncate' sends none of those: each must be
    said at start, never silent."""
    _partitioned(pg_dsn)
    sql(pg_dsn, "CREATE PUBLICATION viaroot FOR TABLE t WITH (publish_via_partition_root)",
        "CREATE PUBLICATION inserts FOR TABLE t WITH (publish = 'insert, update')")  # fmt: skip
    with caplog.at_level("WARNING", logger="replog.capture"):
        run(pg_dsn, str(tmp_path / "a"), tables=("t",), publication="viaroot", slot="a")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("publish_via_partition_root" in w and "TRUNCATE" in w for w in warned), warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="replog.capture"):
        run(pg_dsn, str(tmp_path / "b"), tables=("t",), publication="inserts", slot="b")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("delete" in w and "truncate" in w and "inserts" in w for w in warned), warned


def test_the_move_from_publishing_through_the_root_loses_no_partition_truncate(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A log captured by replog before 0.6 has a publication through partition roots:
    a TRUNCATE of one partition made before the upgrade, still unread in the slot, was
    never sent. The first run of this replog must make the table good."""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "ALTER PUBLICATION cap SET (publish_via_partition_root = true)")  # as before
    sql(pg_dsn, "UPDATE t SET v = 'x' WHERE id IN (1, 150)", "DELETE FROM t WHERE id = 2",
        "TRUNCATE t_2", "INSERT INTO t VALUES (120, 'again')")  # fmt: skip
    run(pg_dsn, url, tables=("t",))
    _equal(url, pg_dsn)


# -- TRUNCATE -------------------------------------------------------------------------------


def _partition_deletes(url: str) -> list[str]:
    return [
        r["key"]
        for r in check_log(ReplicationLog.open(url))
        if r["operation"] == "delete" and "partition_truncated" in
        json.loads(r["metadata"])["source"]
    ]  # fmt: skip


def test_a_default_partition_truncated_after_a_table_truncate_deletes_only_its_rows(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The log's live rows were read without its truncate events: every row truncated
    before was deleted again, and the truncate events' own keys ({"__truncate":n}, whose
    columns read as NULL, which only the DEFAULT partition's constraint selects) were
    deleted as rows: deletes apply_changes and Kafka consumers see for keys no table has."""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn, default=True)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t", "INSERT INTO t VALUES (5, 'b'), (150, 'b'), (250, 'b')")
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t_d")
    run(pg_dsn, url, tables=("t",))
    assert sorted(_partition_deletes(url)) == ['{"id":250}']
    _equal(url, pg_dsn)


def test_a_partition_truncated_after_a_table_truncate_in_one_transaction(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn, default=True)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "DO $$ BEGIN TRUNCATE t; INSERT INTO t VALUES (5, 'b'), (250, 'b'), (260, 'b');"
                " DELETE FROM t WHERE id = 260; TRUNCATE t_d; INSERT INTO t VALUES (270, 'c');"
                " END $$")  # fmt: skip
    run(pg_dsn, url, tables=("t",))
    assert sorted(_partition_deletes(url)) == ['{"id":250}']
    _equal(url, pg_dsn)


def test_a_table_dropped_after_a_truncate_deletes_only_its_live_rows(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t", "INSERT INTO t VALUES (5, 'b')")
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "DROP TABLE t", "CREATE TABLE t (id int PRIMARY KEY, v text)",
        "INSERT INTO t VALUES (7, 'c')")  # fmt: skip
    run(pg_dsn, url, tables=("t",))
    rows = check_log(ReplicationLog.open(url))
    dropped = [r["key"] for r in rows if r["operation"] == "delete"
               and "table_dropped" in json.loads(r["metadata"])["source"]]  # fmt: skip
    assert dropped == ['{"id":5}']
    _equal(url, pg_dsn)


def test_truncate_cascade_across_two_captured_tables(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE a (id int PRIMARY KEY, v text)",
        "CREATE TABLE b (id int PRIMARY KEY, a_id int REFERENCES a)",
        "INSERT INTO a SELECT g, 'a' FROM generate_series(1, 20) g",
        "INSERT INTO b SELECT g, g FROM generate_series(1, 20) g")  # fmt: skip
    run(pg_dsn, url, tables=("a", "b"))
    sql(pg_dsn, "DO $$ BEGIN UPDATE b SET a_id = 2 WHERE id = 1; TRUNCATE a CASCADE;"
                " INSERT INTO a VALUES (1, 'n'); INSERT INTO b VALUES (3, 1); END $$")  # fmt: skip
    assert run(pg_dsn, url, tables=("a", "b")).truncations == 2
    _equal(url, pg_dsn, "a")
    _equal(url, pg_dsn, "b")


def test_a_sub_partitioned_partition_truncated_with_its_keys_around_it(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int, r text, v text, PRIMARY KEY (id, r)) PARTITION BY LIST (r)",
        "CREATE TABLE t_eu PARTITION OF t FOR VALUES IN ('eu') PARTITION BY RANGE (id)",
        "CREATE TABLE t_eu_1 PARTITION OF t_eu FOR VALUES FROM (1) TO (51)",
        "CREATE TABLE t_eu_2 PARTITION OF t_eu FOR VALUES FROM (51) TO (101)",
        "CREATE TABLE t_us PARTITION OF t FOR VALUES IN ('us')",
        "INSERT INTO t SELECT g, r, 'a' FROM generate_series(1, 100) g,"
        " unnest('{eu,us}'::text[]) r",
    )
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "DO $$ BEGIN UPDATE t SET v = 'x' WHERE id = 3; UPDATE t SET r = 'us' WHERE id = 60"
        " AND r = 'eu' AND false; DELETE FROM t WHERE id = 4 AND r = 'eu'; TRUNCATE t_eu;"
        " INSERT INTO t VALUES (3, 'eu', 'again'), (4, 'eu', 'again');"
        " UPDATE t SET v = 'y' WHERE id = 3; END $$",
        "INSERT INTO t VALUES (70, 'eu', 'b')",
        "TRUNCATE t_us",
        "INSERT INTO t VALUES (80, 'us', 'c')",
    )
    run(pg_dsn, url, tables=("t",))
    _equal(url, pg_dsn, key=("id", "r"))


def test_a_truncate_among_updates_deletes_and_key_changes_of_the_same_keys(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    sql(pg_dsn, "CREATE TABLE p (id int PRIMARY KEY, v text)",
        "INSERT INTO p SELECT g, 'a' FROM generate_series(1, 20) g")  # fmt: skip
    run(pg_dsn, url, tables=("t", "p"))
    sql(
        pg_dsn,
        "DELETE FROM t WHERE id = 190",  # 190 is moved into t_2 only inside the transaction
        "DO $$ BEGIN UPDATE t SET v = 'u' WHERE id IN (5, 150); DELETE FROM t WHERE id IN (6, 299);"
        " UPDATE t SET id = 190 WHERE id = 9;"
        " UPDATE t SET id = 299 WHERE id = 7; DELETE FROM t WHERE id = 160;"
        " UPDATE t SET id = 160 WHERE id = 300;"
        " TRUNCATE t_2; INSERT INTO t VALUES (150, 'n'), (6, 'n');"
        " UPDATE t SET v = 'u2' WHERE id = 150; UPDATE t SET id = 120 WHERE id = 8; END $$",
        "DO $$ BEGIN UPDATE p SET v = 'u' WHERE id = 5; DELETE FROM p WHERE id = 6; TRUNCATE p;"
        " INSERT INTO p VALUES (5, 'n'), (6, 'n'); UPDATE p SET v = 'u2' WHERE id = 5;"
        " DELETE FROM p WHERE id = 6; UPDATE p SET id = 7 WHERE id = 5; END $$",
    )
    run(pg_dsn, url, tables=("t", "p"))
    _equal(url, pg_dsn)
    _equal(url, pg_dsn, "p")


@pytest.mark.parametrize("ddl", ["ALTER TABLE t DETACH PARTITION t_3", "DROP TABLE t_3"])
def test_a_partition_written_then_detached_while_capture_was_down(
    pg_dsn: str, tmp_path: Path, ddl: str
) -> None:
    """Capture's publication now names partitions as themselves: a change of t_3 made
    before it was detached (or dropped), unread when capture starts, was 'not a captured
    table' (the catalog no longer places t_3 under t), and every restart stopped on it.
    (Through the root, as before 0.6, the stream named t.)"""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t_2", "INSERT INTO t VALUES (110, 'x')",
        "UPDATE t SET v = 'y' WHERE id = 210", ddl,
        "INSERT INTO t_2 VALUES (111, 'z')")  # fmt: skip
    run(pg_dsn, url, tables=("t",))
    _equal(url, pg_dsn)


def test_the_live_rows_of_many_keys_are_reduced_once_per_batch_of_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partition's TRUNCATE (and a partition detached, a table dropped) reads the
    collection's live rows from the log (latest_events). Past REDUCE_EVERY distinct keys
    it reduced everything held again for every batch read: quadratic (a 1M-row log: 40 s
    of the 44 s such a TRUNCATE took). Counted, not timed."""
    monkeypatch.setattr(changes, "REDUCE_EVERY", 100)
    reductions = [0]
    latest = changes.latest_per_key

    def counted(*args: Any, **kwargs: Any) -> Any:
        reductions[0] += 1
        return latest(*args, **kwargs)

    monkeypatch.setattr(changes, "latest_per_key", counted)
    batches = [
        pa.table({
            "collection": ["c"] * 10, "key": [f"k{b * 10 + i}" for i in range(10)],
            "operation": ["insert"] * 10, "shard": [0] * 10,
            "sequence": list(range(b * 10, b * 10 + 10)),
        })
        for b in range(200)
    ]  # fmt: skip
    found = changes.latest_events(batches)
    assert found is not None and found.num_rows == 2000
    assert reductions[0] <= 2000 // 100 + 1, reductions[0]  # was 191


# -- heartbeats and TRUNCATE under SIGKILL ---------------------------------------------------


def _killed_runs(dsn: str, url: str, runs: int, before: list[str], *extra: str) -> int:
    """``replog capture postgres`` SIGKILLed (its process group) just after its first
    commit, ``runs`` times, ``before`` run before each; how many were killed."""
    env = {**os.environ, "REPLOG_FAULT": "capture_committed"}
    command = [REPLOG, "capture", "postgres", dsn, url, "--slot", "cap", "--tables", "t", *extra]
    kills = 0
    for _ in range(runs):
        sql(dsn, *before)
        done = subprocess.run(
            command, env=env, capture_output=True, start_new_session=True, check=False,
            timeout=HANG_S,
        )  # fmt: skip
        if done.returncode == 0:
            continue
        assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
        kills += 1
    return kills


def test_a_capture_killed_after_each_heartbeat_commit_keeps_slot_and_log_in_step(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A following capture of an idle table while another table writes: its first commit
    is a heartbeat's, and it is SIGKILLed just after it (before the slot moves), five
    times. Each restart moves the slot to the log's position; nothing is doubled."""
    url = str(tmp_path / "log")
    _table(pg_dsn)
    sql(pg_dsn, "CREATE TABLE u (id int PRIMARY KEY, filler text)")
    run(pg_dsn, url, tables=("t",))
    app = capture_app_id("cap")
    versions = [ReplicationLog.open(url).transaction_version(app)]
    for burst in range(5):
        rows = f"generate_series({burst * 2000 + 1}, {(burst + 1) * 2000})"
        kills = _killed_runs(pg_dsn, url, 1, [f"INSERT INTO u SELECT g, 'x' FROM {rows} g"],
                             "--follow", "--heartbeat", "0.2")  # fmt: skip
        assert kills == 1
        versions.append(ReplicationLog.open(url).transaction_version(app))
    assert versions == sorted(versions) and len(set(versions)) == len(versions), versions
    _gap(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    log = ReplicationLog.open(url)
    check_log(log)
    (confirmed,) = query(pg_dsn, "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM"
                                 " pg_replication_slots WHERE slot_name = 'cap'")[0]  # fmt: skip
    assert int(confirmed) == log.transaction_version(app)
    _equal(url, pg_dsn)


def test_an_idle_server_is_not_kept_writing_wal_by_heartbeats(pg_dsn: str, tmp_path: Path) -> None:
    """A heartbeat is WAL, after which the server writes its own bookkeeping (a
    running-transactions record every 15 s, a checkpoint): taken as 'the server writes WAL',
    that called for the next heartbeat, and so on forever: on an idle database a heartbeat
    every ~15 s, each waking the checkpointer, and with archive_timeout a WAL segment
    switched and archived each time. Counted in idle polls, not timed."""
    _table(pg_dsn)
    # autovacuum off: its ANALYZE of u after the inserts is WAL of the server's own too,
    # written at a moment of its choosing (it once came during the idle polls below)
    sql(pg_dsn, "CREATE TABLE u (id int, filler text) WITH (autovacuum_enabled = false)")
    seen: list[Any] = []
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t",), follow=True, poll_s=0.02,
                             heartbeat_s=0.05)  # fmt: skip
    stop = threading.Event()
    ended: dict[str, BaseException] = {}

    def body() -> None:
        try:
            log = ReplicationLog.open_or_create(str(tmp_path / "l"), 2)
            counted = lambda p: seen.append(p.heartbeats)  # noqa: E731
            with PostgresCapture(options, log, stop=stop, progress=counted) as c:
                c.run()
        except BaseException as exc:  # handed to the test below
            ended["error"] = exc

    def polls_until(done: Any) -> None:
        start = len(seen)
        while not done(start):
            assert "error" not in ended, ended
            assert len(seen) < start + 20_000, "never"  # a hang (minutes), not a speed
            time.sleep(0.01)

    follower = threading.Thread(target=body, daemon=True)
    follower.start()
    try:
        # the slot made first: WAL written before it would never call for a heartbeat
        polls_until(lambda start: len(seen) > start)
        sql(pg_dsn, "INSERT INTO u SELECT g, repeat('x', 500) FROM generate_series(1, 2000) g")
        polls_until(lambda start: seen and seen[-1] >= 1)  # other tables write: a heartbeat
        beats = seen[-1]
        sql(pg_dsn, "SELECT pg_log_standby_snapshot()", "CHECKPOINT")  # the server's own
        polls_until(lambda start: len(seen) > start + 60)  # 60 idle polls: over 20 heartbeats due
        assert seen[-1] == beats, (beats, seen[-1])
        sql(pg_dsn, "INSERT INTO u SELECT g, repeat('x', 500) FROM generate_series(1, 2000) g")
        polls_until(lambda start: seen[-1] > beats)  # writes elsewhere: heartbeats again
    finally:
        stop.set()
        follower.join(HANG_S)


def test_a_capture_killed_before_a_heartbeat_commit_lands_commits_it_once(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    commit = Batch.commit

    def dies_on_heartbeats(self: Batch, transaction: Any) -> Any:
        if self.heartbeats:
            raise InjectedFaultError("killed before the heartbeat's commit landed")
        return commit(self, transaction)

    monkeypatch.setattr(Batch, "commit", dies_on_heartbeats)
    sql(pg_dsn, "CREATE TABLE u (id int)", "INSERT INTO u SELECT generate_series(1, 1000)")
    with pytest.raises(InjectedFaultError):
        run(pg_dsn, url, tables=("t",), follow=True, heartbeat_s=0.05, poll_s=0.01)
    monkeypatch.setattr(Batch, "commit", commit)
    _gap(pg_dsn)
    progress = run(pg_dsn, url, tables=("t",))
    assert progress.transactions == 3  # the gap's; the heartbeat moved the position only
    check_log(ReplicationLog.open(url))
    _equal(url, pg_dsn)


@pytest.mark.slow
def test_truncates_of_tables_and_partitions_under_sigkill_at_every_commit(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A TRUNCATE of the table, of a partition (its deletes), and one refilled, each
    between runs SIGKILLed just after their first commit: equal at the end, no event
    twice."""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    statements = [
        ["TRUNCATE t_2", "INSERT INTO t VALUES (150, 'x')"],
        ["BEGIN; TRUNCATE t_3; INSERT INTO t SELECT g, 'r' FROM generate_series(201, 250) g;"
         " COMMIT"],
        ["UPDATE t SET v = 'u' WHERE id < 50"],
        ["TRUNCATE t", "INSERT INTO t VALUES (1, 'n'), (299, 'n')"],
        ["TRUNCATE t_1"],
    ]  # fmt: skip
    kills = 0
    for before in statements:
        kills += _killed_runs(pg_dsn, url, 3, before)
    done = subprocess.run([REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "cap",
                           "--tables", "t"], capture_output=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert kills >= len(statements)
    check_log(ReplicationLog.open(url))
    _equal(url, pg_dsn)


# -- TRUNCATE downstream ----------------------------------------------------------------------


@pytest.mark.spark
def test_a_captured_truncate_lands_in_delta(spark: Any, pg_dsn: str, tmp_path: Path) -> None:
    from test_apply_routing import run as stream
    from test_capture_to_delta import delta_rows, source_rows

    from replog.spark.functions import apply_changes

    url = str(tmp_path / "log")
    _table(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "TRUNCATE t", "INSERT INTO t VALUES (1, 'new'), (2, 'new')")
    run(pg_dsn, url, tables=("t",))
    log = ReplicationLog.open(url)
    target = str(tmp_path / "delta" / "{collection}")
    stream(spark, log, tmp_path / "chk", apply_changes(target, app_id="tr", log=log.url))
    assert delta_rows(str(tmp_path / "delta" / "public.t")) == source_rows(pg_dsn, "t")
