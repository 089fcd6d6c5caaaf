"""Capture as a guest a DBA can leave running on a production database (a real
PostgreSQL): it never takes another log's slot, holds WAL within a few heartbeats of the
server while its tables are idle, checks the privileges it needs before it writes
anything, remembers the tables it captures, and shows its progress truthfully."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.capture import captured, query, run, sql
from support.cli import replog

from replog.capture.options import CaptureOptions
from replog.capture.postgres import PostgresCapture
from replog.errors import InvalidOptionError, SlotOwnershipError, SourcePrivilegeError
from replog.log import ReplicationLog


def _table(dsn: str, rows: int = 10) -> None:
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        f"INSERT INTO t SELECT g, 0 FROM generate_series(1, {rows}) g",
    )


def _confirmed(dsn: str, slot: str) -> str:
    return str(query(dsn, f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots"
                          f" WHERE slot_name = '{slot}'")[0][0])  # fmt: skip


# -- 1. a slot belongs to the log that created it -----------------------------------------


def test_a_mistyped_log_url_never_takes_another_logs_slot(pg_dsn: str, tmp_path: Path) -> None:
    shop, typo = str(tmp_path / "shop"), str(tmp_path / "shopp")
    _table(pg_dsn)
    run(pg_dsn, shop, tables=("t",), slot="shop")
    before = _confirmed(pg_dsn, "shop")
    with pytest.raises(SlotOwnershipError, match=rf"slot 'shop' exists.*belongs to log {shop}.*"
                       r"--slot.*--reset-slot"):  # fmt: skip
        run(pg_dsn, typo, tables=("t",), slot="shop")
    assert _confirmed(pg_dsn, "shop") == before  # neither dropped nor moved
    sql(pg_dsn, "UPDATE t SET v = 1 WHERE id = 1")
    run(pg_dsn, shop, tables=("t",), slot="shop")  # the owner resumes
    assert [e["op"] for e in captured(ReplicationLog.open(shop))].count("u") == 1


def test_reset_slot_takes_a_slot_over_explicitly(pg_dsn: str, tmp_path: Path) -> None:
    shop, other = str(tmp_path / "shop"), str(tmp_path / "other")
    _table(pg_dsn)
    run(pg_dsn, shop, tables=("t",), slot="shop")
    run(pg_dsn, other, tables=("t",), slot="shop", reset_slot=True)
    assert len([e for e in captured(ReplicationLog.open(other)) if e["op"] == "r"]) == 10
    with pytest.raises(SlotOwnershipError, match=rf"belongs to log {other}"):
        run(pg_dsn, shop, tables=("t",), slot="shop")  # the old owner may not advance it


# -- 3. heartbeats: an idle slot keeps WAL within a few heartbeats -------------------------


def _retained(dsn: str, slot: str) -> int:
    (found,) = query(
        dsn,
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint"
        f" FROM pg_replication_slots WHERE slot_name = '{slot}'",
    )[0]
    return int(found)


def _follow_while_others_write(dsn: str, url: str, heartbeat_s: float) -> int:
    """A following capture of idle ``t`` while ``u`` gets 20 bursts of writes; the WAL
    its slot retains at the end."""
    options = CaptureOptions(dsn=dsn, slot="idle", tables=("t",), follow=True, poll_s=0.02,
                             heartbeat_s=heartbeat_s)  # fmt: skip
    stop = threading.Event()
    errors: list[BaseException] = []
    with PostgresCapture(options, ReplicationLog.open_or_create(url, 2), stop=stop) as capture:

        def body() -> None:
            try:
                capture.run()
            except BaseException as exc:  # handed to the test below
                errors.append(exc)

        follower = threading.Thread(target=body, daemon=True)
        follower.start()
        for burst in range(20):
            sql(dsn, f"INSERT INTO u SELECT g, repeat('x', 200) FROM generate_series("
                     f"{burst * 5000 + 1}, {(burst + 1) * 5000}) g")  # fmt: skip
            time.sleep(0.3)
        # A slot's restart point moves only to where the server logged its running
        # transactions (every 15 s while it writes, and at checkpoints): log them now.
        sql(dsn, "SELECT pg_log_standby_snapshot()")
        time.sleep(max(heartbeat_s, 0.1) * 4)  # a few heartbeats after it
        stop.set()
        follower.join(120)
    assert not errors, errors
    return _retained(dsn, "idle")


def test_heartbeats_keep_an_idle_slots_wal_within_a_few_heartbeats(
    pg_dsn: str, tmp_path: Path
) -> None:
    """100,000 rows written to a table capture does not capture: without heartbeats the
    slot keeps all their WAL (its position never moves: pgoutput sends nothing); with
    them it keeps what a few heartbeats' worth of writes is."""
    _table(pg_dsn)
    sql(pg_dsn, "CREATE TABLE u (id int PRIMARY KEY, filler text)")
    without = _follow_while_others_write(pg_dsn, str(tmp_path / "a"), heartbeat_s=0)
    sql(pg_dsn, "SELECT pg_drop_replication_slot('idle')", "TRUNCATE u")
    with_beats = _follow_while_others_write(pg_dsn, str(tmp_path / "b"), heartbeat_s=0.5)
    assert without > 20_000_000, without  # 100,000 rows of ~250 bytes, and their indexes
    assert with_beats < without / 10, (with_beats, without)


# -- 5. the captured tables are remembered -------------------------------------------------


def test_a_restart_without_tables_captures_the_logs_tables(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _table(pg_dsn)
    sql(pg_dsn, "CREATE TABLE other (id int PRIMARY KEY)")
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "UPDATE t SET v = 2 WHERE id = 2", "INSERT INTO other VALUES (1)")
    result = replog("capture", "postgres", pg_dsn, url, "--slot", "cap")
    assert result.returncode == 0, result.stderr
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert [(e["collection"], e["op"]) for e in changes] == [("public.t", "u")]


def test_a_restart_naming_fewer_tables_is_refused_unless_said(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    _table(pg_dsn)
    sql(pg_dsn, "CREATE TABLE other (id int PRIMARY KEY)")
    run(pg_dsn, url, tables=("t", "other"))
    sql(pg_dsn, "INSERT INTO other VALUES (1)", "UPDATE t SET v = 3 WHERE id = 3")
    with pytest.raises(InvalidOptionError, match=r"leaves out public\.other.*--tables-changed"):
        run(pg_dsn, url, tables=("t",))
    # said: other's changes still in the slot are skipped (counted), not a stop
    progress = run(pg_dsn, url, tables=("t",), tables_changed=True)
    assert progress.skipped_changes == 1
    sql(pg_dsn, "INSERT INTO other VALUES (2)", "UPDATE t SET v = 4 WHERE id = 4")
    run(pg_dsn, url, tables=("t",))  # the set is now t alone
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert [(e["collection"], e["key"]) for e in changes] == [
        ("public.t", '{"id":3}'),
        ("public.t", '{"id":4}'),
    ]


# -- 6. privileges, checked before anything is written --------------------------------------


@pytest.fixture
def capture_role(pg_dsn: str) -> Any:
    """A role with REPLICATION and SELECT on the tables, and no CREATE on the database."""
    sql(
        pg_dsn,
        "DROP ROLE IF EXISTS capturer",
        "CREATE ROLE capturer LOGIN REPLICATION",
        "GRANT SELECT ON ALL TABLES IN SCHEMA public TO capturer",
    )
    database = query(pg_dsn, "SELECT current_database()")[0][0]
    sql(pg_dsn, f"REVOKE CREATE ON DATABASE {database} FROM PUBLIC")
    yield pg_dsn.replace("user=postgres", "user=capturer")
    sql(pg_dsn, "DROP OWNED BY capturer", "DROP ROLE capturer")


def test_a_role_without_create_is_told_the_grant_and_nothing_is_written(
    pg_dsn: str, tmp_path: Path, capture_role: str
) -> None:
    _table(pg_dsn)
    sql(pg_dsn, "GRANT SELECT ON t TO capturer")
    url = str(tmp_path / "log")
    result = replog("capture", "postgres", capture_role, url, "--slot", "cap", "--tables", "t")
    assert result.returncode != 0
    assert "creates publication 'cap'" in result.stderr and "GRANT CREATE ON DATABASE" in (
        result.stderr
    )
    assert "--publication" in result.stderr
    assert not os.path.exists(url)  # no empty log left behind
    assert query(pg_dsn, "SELECT count(*) FROM pg_replication_slots") == [(0,)]
    # the way on it names: a publication of the owner's, given with --publication
    sql(pg_dsn, "CREATE PUBLICATION mine FOR TABLE t")
    done = replog("capture", "postgres", capture_role, url, "--slot", "cap", "--tables", "t",
                  "--publication", "mine")  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_role_without_replication_or_select_is_told_which(
    pg_dsn: str, tmp_path: Path, capture_role: str
) -> None:
    _table(pg_dsn)
    sql(pg_dsn, "REVOKE SELECT ON t FROM capturer", "CREATE PUBLICATION mine FOR TABLE t")
    with pytest.raises(SourcePrivilegeError, match=r"lacks SELECT on it\. GRANT SELECT ON "
                       r"public\.t TO capturer"):  # fmt: skip
        run(capture_role, str(tmp_path / "log"), tables=("t",), publication="mine")
    sql(pg_dsn, "ALTER ROLE capturer NOREPLICATION")
    with pytest.raises(SourcePrivilegeError, match="ALTER ROLE capturer REPLICATION"):
        run(capture_role, str(tmp_path / "log"), tables=("t",), publication="mine")


# -- 9. progress ---------------------------------------------------------------------------


def test_snapshot_progress_starts_low_for_a_table_that_is_not_partitioned(
    pg_dsn: str, tmp_path: Path
) -> None:
    _table(pg_dsn, rows=50_000)
    sql(pg_dsn, "ANALYZE t")
    fractions: list[float] = []
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t",), snapshot_chunk_rows=5_000)

    def seen(progress: Any) -> None:
        if progress.snapshot_running and progress.snapshot_fraction is not None:
            fractions.append(progress.snapshot_fraction)

    with PostgresCapture(options, ReplicationLog.open_or_create(str(tmp_path / "l"), 2),
                         progress=seen) as capture:  # fmt: skip
        capture.run()
    assert fractions and fractions[0] <= 0.2, fractions[:3]  # was 100% from the first line
    assert max(fractions) < 1.0 or fractions.count(1.0) <= 1
