"""An adversarial review of issue 38's snapshots (a real PostgreSQL): DDL, kills, partitions
and publications the issue's twelve did not try. Each test compares the table the log
builds with the source, row by row (tests/support/replay.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from support.capture import query, run, sql
from support.cli import REPLOG
from support.logcheck import check_log
from support.replay import differences, log_table, source_table
from test_capture_motion import Moved, _rows, assert_equal, capture_moved

from replog.capture import watch
from replog.capture.batch import Batch
from replog.capture.options import CaptureOptions
from replog.capture.postgres import PostgresCapture
from replog.capture.snapshot import request_snapshot
from replog.errors import InjectedFaultError
from replog.log import ReplicationLog

HANG_S = 300
"""How long a wait may take before it is a hang (never a speed limit)."""


class Follower:
    """A following capture in a thread; :meth:`sync` waits until it has read everything
    the source committed so far, and owes no snapshot or deletes."""

    def __init__(self, dsn: str, url: str, *, tables: tuple[str, ...] = ("t",), **options: Any):
        self.dsn = dsn
        log = ReplicationLog.open_or_create(url, 4)
        opts = CaptureOptions(
            dsn=dsn, slot="cap", tables=tables, follow=True, poll_s=0.01, **options
        )
        self.stop = threading.Event()
        self.found: dict[str, Any] = {}

        def body() -> None:
            try:
                with PostgresCapture(opts, log, stop=self.stop) as capture:
                    self.found["capture"] = capture
                    capture.run()
            except BaseException as exc:  # handed to the test in sync() and close()
                self.found["error"] = exc

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def _wait(self, done: Callable[[PostgresCapture], bool], what: str) -> None:
        deadline = time.monotonic() + HANG_S  # a hang, not a speed
        while True:
            if "error" in self.found:
                raise self.found["error"]
            capture = self.found.get("capture")
            if capture is not None and capture.plan is not None and done(capture):
                return
            assert time.monotonic() < deadline, f"capture never {what}"
            time.sleep(0.05)

    def sync(self) -> None:
        """Until the capture looked at the catalog and read past a message written now,
        with nothing owed."""
        since = time.monotonic()
        (lsn,) = query(self.dsn, "SELECT pg_logical_emit_message(true, 'test.sync', '')::text")[0]
        high, low = (int(part, 16) for part in lsn.split("/"))
        position = (high << 32) | low

        def done(capture: PostgresCapture) -> bool:
            plan = capture.plan
            assert plan is not None
            return (
                capture.watch._checked > since
                and capture.progress.position > position
                and not plan.queue
                and capture.chunk is None
                and not plan.removals
                and not plan.resets
                and capture.removals.end_before is None
            )

        self._wait(done, "caught up")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        if "error" in self.found:
            raise self.found["error"]

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _toasted(dsn: str, count: int = 300) -> None:
    sql(dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(count, big_every=1))


# -- DDL inside a window, with a key change of a TOASTed row -------------------------------


@pytest.mark.parametrize(
    "ddl",
    [
        "ALTER TABLE t RENAME TO t2",
        "ALTER TABLE t RENAME COLUMN body TO text",
        "ALTER TABLE t DROP COLUMN body",
    ],
)
def test_a_toasted_row_whose_key_changed_before_a_ddl_is_captured(
    pg_dsn: str, tmp_path: Path, ddl: str
) -> None:
    """A key change of a row whose TOASTed body is unchanged: its create takes the body
    from the row as the table holds it now. A DDL after it, before capture reads it,
    must not stop capture (each restart would meet it again)."""
    url = str(tmp_path / "log")
    _toasted(pg_dsn)
    moved = Moved(pg_dsn, inside={2: ["UPDATE t SET id = id + 10000 WHERE id = 150", ddl]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert_equal(url, pg_dsn, table="t2" if "RENAME TO" in ddl else "t")


# -- two DDLs between two looks at the catalog (or while no capture runs) ------------------


def _partitioned(dsn: str) -> None:
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int, body text) PARTITION BY RANGE (id)",
        "CREATE TABLE t_1 PARTITION OF t FOR VALUES FROM (1) TO (1001)",
        "CREATE TABLE t_2 PARTITION OF t FOR VALUES FROM (1001) TO (2001)",
        "INSERT INTO t SELECT g, 0, 'b' FROM generate_series(1, 2000) g",
    )


def test_a_partition_detached_changed_and_attached_again_while_capture_is_down(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The usual way to load or prune a partition: DETACH, change it, ATTACH. The
    partition keeps its id and its bounds, but its rows are not the log's any more (no
    change of a detached partition is published)."""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "ALTER TABLE t DETACH PARTITION t_2",
        "UPDATE t_2 SET v = 7 WHERE id <= 1500",
        "DELETE FROM t_2 WHERE id > 1900",
        "INSERT INTO t_2 VALUES (2000, 8, 'new')",
        "ALTER TABLE t ATTACH PARTITION t_2 FOR VALUES FROM (1001) TO (2001)",
    )
    run(pg_dsn, url, tables=("t",))
    assert_equal(url, pg_dsn)


def test_a_partition_detached_changed_and_attached_again_between_two_looks(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    with Follower(pg_dsn, url) as follower:
        follower.sync()
        sql(  # one transaction: no look at the catalog falls between
            pg_dsn,
            "ALTER TABLE t DETACH PARTITION t_2; DELETE FROM t_2 WHERE id > 1900;"
            " ALTER TABLE t ATTACH PARTITION t_2 FOR VALUES FROM (1001) TO (2001)",
        )
        follower.sync()
    assert_equal(url, pg_dsn)


def test_a_column_dropped_and_added_again_under_its_name_while_capture_is_down(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Every row now holds the new column's value (NULL, or its default); no row change
    says so."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "ALTER TABLE t DROP COLUMN v", "ALTER TABLE t ADD COLUMN v int")
    run(pg_dsn, url, tables=("t",))
    assert_equal(url, pg_dsn)


def test_a_column_dropped_and_added_again_under_its_name_between_chunks(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    moved = Moved(
        pg_dsn,
        before={3: ["ALTER TABLE t DROP COLUMN v", "ALTER TABLE t ADD COLUMN v int DEFAULT 5"]},
    )
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert_equal(url, pg_dsn)


@pytest.mark.xfail(
    strict=True,
    reason="a column renamed and renamed back leaves the catalog as it was (same attnum, "
    "name and type; only its pg_attribute xmin moved, as SET DEFAULT moves it): rows "
    "changed meanwhile keep the transient name downstream; only the stream's Relation "
    "messages witness it (see the review's report)",
)
def test_a_column_renamed_and_back_while_capture_is_down_keeps_its_name(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Rows changed while the column had its other name carry that name; the table is as
    it was before, and no look at the catalog sees a difference."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "ALTER TABLE t RENAME COLUMN v TO w",
        "UPDATE t SET w = 5 WHERE id <= 10",
        "ALTER TABLE t RENAME COLUMN w TO v",
    )
    run(pg_dsn, url, tables=("t",))
    assert_equal(url, pg_dsn)


# -- rewrites that change values, and no row change says so --------------------------------


@pytest.mark.parametrize(
    "ddl",
    [
        "ALTER TABLE t ALTER COLUMN v TYPE int USING v + 100",
        "ALTER TABLE t ADD COLUMN r float8 DEFAULT random()",
        "ALTER TABLE t ADD COLUMN n bigserial",
    ],
)
def test_a_rewrite_that_changes_values_is_snapshotted_again(
    pg_dsn: str, tmp_path: Path, ddl: str
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, ddl)
    run(pg_dsn, url, tables=("t",))
    assert_equal(url, pg_dsn)


# -- physical order: rows that move without a change ---------------------------------------


def test_a_physical_order_snapshot_survives_vacuum_full_between_chunks(
    pg_dsn: str, tmp_path: Path
) -> None:
    """VACUUM FULL (or CLUSTER, pg_repack) moves every row to other blocks and writes no
    change: the next block is not where the snapshot left off."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int NOT NULL, v int, body text)",
        "ALTER TABLE t REPLICA IDENTITY FULL",
        "INSERT INTO t SELECT g, 0, repeat('x', 100) FROM generate_series(1, 3000) g",
    )
    moved = Moved(pg_dsn, before={3: ["DELETE FROM t WHERE id <= 1500", "VACUUM FULL t"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=300, keys={"public.t": ("id",)})
    assert_equal(url, pg_dsn)


# -- partitions of other kinds removed -------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "removal"),
    [
        (  # a sub-partitioned partition (hash inside range), dropped whole
            [
                "CREATE TABLE t (id int PRIMARY KEY, v int, body text) PARTITION BY RANGE (id)",
                "CREATE TABLE t_1 PARTITION OF t FOR VALUES FROM (1) TO (1001)",
                "CREATE TABLE t_2 PARTITION OF t FOR VALUES FROM (1001) TO (2001)"
                " PARTITION BY HASH (id)",
                "CREATE TABLE t_2_0 PARTITION OF t_2 FOR VALUES WITH (MODULUS 2, REMAINDER 0)",
                "CREATE TABLE t_2_1 PARTITION OF t_2 FOR VALUES WITH (MODULUS 2, REMAINDER 1)",
            ],
            ["DROP TABLE t_2"],
        ),
        (  # one hash leaf of a sub-partitioned partition, detached
            [
                "CREATE TABLE t (id int PRIMARY KEY, v int, body text) PARTITION BY RANGE (id)",
                "CREATE TABLE t_1 PARTITION OF t FOR VALUES FROM (1) TO (1001)",
                "CREATE TABLE t_2 PARTITION OF t FOR VALUES FROM (1001) TO (2001)"
                " PARTITION BY HASH (id)",
                "CREATE TABLE t_2_0 PARTITION OF t_2 FOR VALUES WITH (MODULUS 2, REMAINDER 0)",
                "CREATE TABLE t_2_1 PARTITION OF t_2 FOR VALUES WITH (MODULUS 2, REMAINDER 1)",
            ],
            ["ALTER TABLE t_2 DETACH PARTITION t_2_1"],
        ),
        (  # a list partition and the default one, detached
            [
                "CREATE TABLE t (id int, v int, body text, PRIMARY KEY (id, v))"
                " PARTITION BY LIST (v)",
                "CREATE TABLE t_a PARTITION OF t FOR VALUES IN (0, 1)",
                "CREATE TABLE t_b PARTITION OF t FOR VALUES IN (2)",
                "CREATE TABLE t_d PARTITION OF t DEFAULT",
            ],
            ["ALTER TABLE t DETACH PARTITION t_b", "ALTER TABLE t DETACH PARTITION t_d"],
        ),
    ],
    ids=["hash-sub-partitioned-dropped", "hash-leaf-detached", "list-and-default-detached"],
)
def test_partitions_of_every_kind_removed_take_their_rows_out_of_the_log(
    pg_dsn: str, tmp_path: Path, layout: list[str], removal: list[str]
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, *layout, "INSERT INTO t SELECT g, g % 5, 'b' FROM generate_series(1, 2000) g")
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, *removal)
    with Follower(pg_dsn, url) as follower:
        follower.sync()
    key = ("id", "v") if "LIST" in layout[0] else ("id",)
    found = differences(log_table(url, "public.t"), source_table(pg_dsn, "t", key))
    assert not found, found


# -- a user's publication ----------------------------------------------------------------------


def test_a_detached_partition_written_afterwards_under_a_publication_for_all_tables(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A publication of the user's without publish_via_partition_root sends a partition's
    changes under the partition's id; once detached (a table of its own, still published
    FOR ALL TABLES), its changes are not the partitioned table's."""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    sql(pg_dsn, "CREATE PUBLICATION everything FOR ALL TABLES")
    with Follower(pg_dsn, url, publication="everything") as follower:
        follower.sync()
        sql(pg_dsn, "UPDATE t SET v = 1 WHERE id = 1500")  # capture meets t_2 in the stream
        follower.sync()
        sql(pg_dsn, "ALTER TABLE t DETACH PARTITION t_2")
        follower.sync()
        sql(pg_dsn, "UPDATE t_2 SET v = 2 WHERE id = 1600", "INSERT INTO t_2 VALUES (9000, 1, 'x')")
        follower.sync()
    assert_equal(url, pg_dsn)


# -- a table renamed, and another created under its name -----------------------------------------


def test_a_table_renamed_and_another_created_under_its_name_mid_snapshot(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(300))
    moved = Moved(
        pg_dsn,
        before={
            2: [
                "ALTER TABLE t RENAME TO t_old",
                "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
                "INSERT INTO t SELECT g, 9, 'new' FROM generate_series(1, 50) g",
            ]
        },
    )
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    # restarted as it was started (--tables t): public.t is the table called t now
    sql(pg_dsn, "UPDATE t_old SET v = 3 WHERE id <= 20", "UPDATE t SET v = 4 WHERE id <= 10")
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "UPDATE t_old SET v = 5 WHERE id <= 20", "UPDATE t SET v = 6 WHERE id <= 10")
    run(pg_dsn, url, tables=("t",))
    assert_equal(url, pg_dsn)


# -- workers under DDL ---------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_key_retyped_to_another_kind_between_chunks_stops_no_capture(
    pg_dsn: str, tmp_path: Path, workers: int
) -> None:
    """The chunk was described with the key as an integer; it is text when read: the
    bound ``$1::integer`` compares with nothing (``text > integer``). The chunk is read
    again with the key described anew. (The keys change form: ``{"id":"5"}``, not
    ``{"id":5}``; rows logged before under the old form stay, as for a primary key
    redefined: CDC.md.)"""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(600))
    moved = Moved(pg_dsn, before={3: ["ALTER TABLE t ALTER COLUMN id TYPE text"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100, snapshot_workers=workers)
    found = differences(log_table(url, "public.t"), source_table(pg_dsn, "t"))
    assert set(found) <= {"extra"}, found


# -- snapshots on demand -------------------------------------------------------------------------


def test_a_snapshot_asked_for_under_a_tables_new_name_is_taken(pg_dsn: str, tmp_path: Path) -> None:
    """A captured table renamed while capture runs: ``replog snapshot`` checks the name
    against the publication (the new name); the capture must take it, not warn and
    drop it."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(100))
    with Follower(pg_dsn, url) as follower:
        follower.sync()
        sql(pg_dsn, "ALTER TABLE t RENAME TO t2")
        follower.sync()
        request_snapshot(pg_dsn, ["public.t2"], slot="cap")
        follower.sync()
    reads = [r for r in check_log(ReplicationLog.open(url)) if '"incremental"' in r["metadata"]]
    assert len(reads) == 100


# -- kills at the new steps ------------------------------------------------------------------------


def _killed_at_every_commit(
    dsn: str,
    url: str,
    moved: Moved,
    monkeypatch: pytest.MonkeyPatch,
    when: str,
    **options: Any,
) -> int:
    """Captures killed (an injected fault) at each commit until one ends with nothing
    left to commit; how many were killed. ``when``: ``after`` each commit landed (before
    the slot moves), or ``before`` every other one lands, and the first of each batch
    that carries deletes (the plan that names it is written: a restart finds it did not
    land)."""
    if when == "after":
        monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
        monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    else:
        commit = Batch.commit
        calls = [0]
        deleting: set[tuple[str, ...]] = set()

        def dies(self: Batch, transaction: Any) -> Any:
            calls[0] += 1
            first_deletes = self.removed and tuple(self.removed) not in deleting
            deleting.add(tuple(self.removed))
            if calls[0] % 2 or first_deletes:  # the commit of each delete batch, once
                raise InjectedFaultError("killed before the commit landed")
            return commit(self, transaction)

        monkeypatch.setattr(Batch, "commit", dies)
    for kills in range(500):
        try:
            capture_moved(dsn, url, moved, **options)
        except InjectedFaultError:
            continue
        return kills
    raise AssertionError("capture never ended")


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_partition_detached_mid_snapshot_under_a_kill_at_every_commit(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    sql(
        pg_dsn,
        "CREATE TABLE t_3 PARTITION OF t FOR VALUES FROM (2001) TO (3001)",
        "INSERT INTO t SELECT g, 0, 'c' FROM generate_series(2001, 3000) g",
    )
    moved = Moved(  # chunks count reads, also those read again: at 14, t_2 was read
        pg_dsn,
        before={
            14: ["ALTER TABLE t DETACH PARTITION t_2", "UPDATE t SET v = 3 WHERE id < 300"],
            18: [
                "CREATE TABLE t_2b PARTITION OF t FOR VALUES FROM (1001) TO (2001)",
                "INSERT INTO t SELECT g, 4, 'again' FROM generate_series(1500, 1600) g",
                "DELETE FROM t WHERE id BETWEEN 100 AND 120",
            ],
        },
    )
    kills = _killed_at_every_commit(pg_dsn, url, moved, monkeypatch, when, snapshot_chunk_rows=200)
    assert kills > 5
    assert_equal(url, pg_dsn)


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_table_dropped_and_created_again_mid_snapshot_under_a_kill_at_every_commit(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(600))
    moved = Moved(
        pg_dsn,
        before={
            3: [
                "DROP TABLE t",
                "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
                "INSERT INTO t SELECT g, 9, 'again' FROM generate_series(300, 700) g",
            ],
            5: ["UPDATE t SET v = 10 WHERE id < 400", "DELETE FROM t WHERE id > 650"],
        },
    )
    kills = _killed_at_every_commit(pg_dsn, url, moved, monkeypatch, when, snapshot_chunk_rows=100)
    assert kills > 5
    assert_equal(url, pg_dsn)


def test_a_kill_after_a_removals_marker_before_the_plan_is_saved(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker is in the WAL, the plan that owes its deletes is not stored: a restart
    must still delete the partition's rows."""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "ALTER TABLE t DETACH PARTITION t_2")
    from replog.capture.snapshot import SnapshotPlan

    save = SnapshotPlan.save

    def dies(self: SnapshotPlan, storage: Any) -> None:
        if any(removal["done_at"] is None for removal in self.removals):
            raise InjectedFaultError("killed before the plan with the removal was saved")
        save(self, storage)

    monkeypatch.setattr(SnapshotPlan, "save", dies)
    with pytest.raises(InjectedFaultError):
        run(pg_dsn, url, tables=("t",))
    monkeypatch.setattr(SnapshotPlan, "save", save)
    sql(pg_dsn, "INSERT INTO t_2 VALUES (1500, 5, 'x') ON CONFLICT (id) DO UPDATE SET v = 5")
    run(pg_dsn, url, tables=("t",))
    assert_equal(url, pg_dsn)


def test_a_partition_attached_then_dropped_before_its_snapshot_is_read(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot owed for an attached partition reads that partition alone: once it is
    dropped (or detached), that snapshot is given up, not retried until capture stops."""
    monkeypatch.setattr(watch, "CHECK_S", 3600.0)  # looks: at the start and at the end
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    sql(
        pg_dsn,
        "CREATE TABLE t_4 (LIKE t INCLUDING ALL)",
        "INSERT INTO t_4 SELECT g, 4, 'late' FROM generate_series(3001, 3500) g",
    )
    moved = Moved(
        pg_dsn,
        before={
            2: ["ALTER TABLE t ATTACH PARTITION t_4 FOR VALUES FROM (3001) TO (4001)"],
            7: ["DROP TABLE t_4"],  # the first chunk of t_4's own snapshot
        },
    )
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=500)
    assert moved.chunks >= 7
    assert_equal(url, pg_dsn)


def test_a_partition_removed_at_the_last_look_is_deleted_before_capture_ends(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture that is not following looks at the catalog once more before it ends: a
    partition it then finds gone has its marker written; the capture must read on to it,
    or the rows stay in the log until some later run (if there is one)."""
    monkeypatch.setattr(watch, "CHECK_S", 3600.0)  # looks: at the start and at the end
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    moved = Moved(pg_dsn, before={4: ["ALTER TABLE t DETACH PARTITION t_2"]})
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=500)
    assert_equal(url, pg_dsn)


def test_a_capture_killed_while_it_reads_a_chunk_again(pg_dsn: str, tmp_path: Path) -> None:
    """A column added after a chunk's columns were described: the chunk is read again
    between new watermarks, and the capture dies there (the statement run at that
    watermark fails, as a kill would stop it). The restart reads on from the plan."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int, body text)", _rows(500))
    moved = Moved(
        pg_dsn,
        before={
            3: ["ALTER TABLE t ADD COLUMN c int DEFAULT 7", "UPDATE t SET c = id WHERE id > 250"],
            4: ["SELECT 1 / 0"],  # the chunk read again: the capture dies here
            6: ["UPDATE t SET c = -1 WHERE id < 20"],
        },
    )
    with pytest.raises(psycopg.errors.DivisionByZero):
        capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert moved.chunks == 4
    capture_moved(pg_dsn, url, moved, snapshot_chunk_rows=100)
    assert_equal(url, pg_dsn)


@pytest.mark.slow
def test_sigkills_at_every_commit_through_ddl_and_partitions(pg_dsn: str, tmp_path: Path) -> None:
    """``replog capture postgres`` SIGKILLed (its process group, as a machine failure)
    just after each commit, DDL between the runs: a partition detached, one attached, a
    column dropped and added again, a table rewritten, a partition detached and attached
    again. Every row equal at the end, no event twice."""
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    sql(
        pg_dsn,
        "CREATE TABLE t_3 PARTITION OF t FOR VALUES FROM (2001) TO (3001)",
        "INSERT INTO t SELECT g, 0, 'c' FROM generate_series(2001, 3000) g",
        "CREATE TABLE t_4 (LIKE t INCLUDING ALL)",
        "INSERT INTO t_4 SELECT g, 4, 'late' FROM generate_series(3001, 3300) g",
    )
    ddl = {
        2: ["ALTER TABLE t DETACH PARTITION t_1", "UPDATE t SET v = 2 WHERE id % 7 = 0"],
        4: ["ALTER TABLE t ATTACH PARTITION t_4 FOR VALUES FROM (3001) TO (4001)"],
        6: ["ALTER TABLE t DROP COLUMN v", "ALTER TABLE t ADD COLUMN v int"],
        8: ["ALTER TABLE t ALTER COLUMN v TYPE int USING 8"],
        10: [
            "ALTER TABLE t DETACH PARTITION t_3; DELETE FROM t_3 WHERE id > 2900;"
            " ALTER TABLE t ATTACH PARTITION t_3 FOR VALUES FROM (2001) TO (3001)"
        ],
    }
    env = {**os.environ, "REPLOG_FAULT": "capture_committed"}
    command = [REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "cap", "--tables", "t",
               "--snapshot-chunk-rows", "300"]  # fmt: skip
    kills = 0
    for attempt in range(300):
        sql(pg_dsn, *ddl.get(attempt, ()))
        done = subprocess.run(
            command, env=env, capture_output=True, start_new_session=True, check=False
        )
        if done.returncode == 0:
            break
        assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
        kills += 1
    else:
        raise AssertionError("capture never ended")
    assert kills > max(ddl)
    check_log(ReplicationLog.open(url))  # gapless, no event id twice
    assert_equal(url, pg_dsn)


def test_a_sub_partitioned_partition_attached_and_one_detached_concurrently(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    _partitioned(pg_dsn)
    sql(
        pg_dsn,
        "CREATE TABLE t_3 (id int NOT NULL, v int, body text) PARTITION BY HASH (id)",
        "CREATE TABLE t_3_0 PARTITION OF t_3 FOR VALUES WITH (MODULUS 2, REMAINDER 0)",
        "CREATE TABLE t_3_1 PARTITION OF t_3 FOR VALUES WITH (MODULUS 2, REMAINDER 1)",
        "ALTER TABLE t_3 ADD PRIMARY KEY (id)",
        "INSERT INTO t_3 SELECT g, 3, 'three' FROM generate_series(2001, 2600) g",
    )
    with Follower(pg_dsn, url) as follower:
        follower.sync()
        sql(pg_dsn, "ALTER TABLE t ATTACH PARTITION t_3 FOR VALUES FROM (2001) TO (3001)")
        follower.sync()
        sql(pg_dsn, "ALTER TABLE t DETACH PARTITION t_1 CONCURRENTLY")
        follower.sync()
        sql(pg_dsn, "UPDATE t SET v = 9 WHERE id % 10 = 0", "UPDATE t_1 SET v = 9")
        follower.sync()
    assert_equal(url, pg_dsn)


def test_a_table_renamed_away_and_replaced_while_capture_is_down_under_a_user_publication(
    pg_dsn: str, tmp_path: Path
) -> None:
    """FOR ALL TABLES publishes both: the new table's first change comes before changes of
    the old one, renamed; once the old rows are deleted (at that first change), the old
    table's changes are not the collection's."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
        _rows(200),
        "CREATE PUBLICATION everything FOR ALL TABLES",
    )
    run(pg_dsn, url, tables=("t",), publication="everything")
    sql(
        pg_dsn,
        "ALTER TABLE t RENAME TO t_old",
        "CREATE TABLE t (id int PRIMARY KEY, v int, body text)",
        "INSERT INTO t SELECT g, 9, 'new' FROM generate_series(1, 50) g",
        "UPDATE t_old SET v = 3 WHERE id <= 100",
        "INSERT INTO t_old VALUES (500, 5, 'old')",
    )
    run(pg_dsn, url, tables=("t",), publication="everything")
    sql(pg_dsn, "UPDATE t_old SET v = 4 WHERE id <= 100", "UPDATE t SET v = 10 WHERE id <= 5")
    run(pg_dsn, url, tables=("t",), publication="everything")
    assert_equal(url, pg_dsn)


@pytest.mark.parametrize("keyed", [True, False], ids=["primary-key", "physical-order"])
def test_a_partition_detached_and_its_partition_column_renamed_between_two_looks(
    pg_dsn: str, tmp_path: Path, keyed: bool
) -> None:
    """The removal's partition constraint names the partition column as it was called
    (``v >= 10``): renamed since, the constraint must still judge the log's rows (it
    failed on every restart: column "v" does not exist)."""
    url = str(tmp_path / "log")
    key = "PRIMARY KEY (id, v)" if keyed else "CHECK (id > 0)"
    sql(
        pg_dsn,
        f"CREATE TABLE t (id int NOT NULL, v int NOT NULL, body text, {key})"
        " PARTITION BY RANGE (v)",
        "CREATE TABLE t_1 PARTITION OF t FOR VALUES FROM (0) TO (10)",
        "CREATE TABLE t_2 PARTITION OF t FOR VALUES FROM (10) TO (20)",
        "INSERT INTO t SELECT g, g % 20, 'b' FROM generate_series(1, 1000) g",
    )
    if not keyed:
        sql(pg_dsn, *(f"ALTER TABLE {p} REPLICA IDENTITY FULL" for p in ("t", "t_1", "t_2")))
    keys = {} if keyed else {"public.t": ("id",)}
    run(pg_dsn, url, tables=("t",), keys=keys)
    sql(pg_dsn, "ALTER TABLE t DETACH PARTITION t_2", "ALTER TABLE t RENAME COLUMN v TO w")
    run(pg_dsn, url, tables=("t",), keys=keys)
    columns = ("id", "w") if keyed else ("id",)
    logged = log_table(url, "public.t")
    if keyed:  # the key's columns are renamed: rows logged under the old key stay (CDC.md)
        left = [k for k in logged if '"v"' in k and json.loads(k)["v"] >= 10]
        assert not left, left[:5]  # but none of the partition that left
        logged = {k: row for k, row in logged.items() if '"w"' in k}
    found = differences(logged, source_table(pg_dsn, "t", columns))
    assert not found, found
