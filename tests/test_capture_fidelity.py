"""Capture keeps the table equal to the source whatever the schema does (a real
PostgreSQL): partitioned tables, replica identities, relations capture cannot map.
Nothing is skipped silently, and capture never makes the source refuse writes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from support.capture import captured, query, run, sql

from replog.capture.options import CaptureOptions
from replog.capture.postgres import PostgresCapture, capture
from replog.capture.progress import CaptureProgress
from replog.errors import CaptureError, SourceConfigError
from replog.log import ReplicationLog

PARTITIONED = (
    "CREATE TABLE orders (id int, region text, amount int, PRIMARY KEY (region, id))"
    " PARTITION BY LIST (region)",
    "CREATE TABLE orders_eu PARTITION OF orders FOR VALUES IN ('eu')",
    "CREATE TABLE orders_us PARTITION OF orders FOR VALUES IN ('us')",
)


def _changes(url: str) -> list[tuple[str, str, str]]:
    return [
        (e["collection"], e["op"], e["data"])
        for e in captured(ReplicationLog.open(url))
        if e["op"] != "r"
    ]


# -- partitioned tables -------------------------------------------------------------------


def test_a_partitioned_table_is_captured_under_its_own_name(pg_dsn: str, tmp_path: Path) -> None:
    """pgoutput names a partitioned table's changes after its partitions unless the
    publication publishes via the root: those changes were dropped while the slot moved
    past them, and a restart failed (DuplicateObject). A partition attached later and a
    column added on the parent are captured too."""
    url = str(tmp_path / "log")
    sql(pg_dsn, *PARTITIONED, "INSERT INTO orders VALUES (1, 'eu', 10)")
    run(pg_dsn, url, tables=("orders",))  # the snapshot
    sql(
        pg_dsn,
        "INSERT INTO orders VALUES (2, 'us', 20)",
        "UPDATE orders SET amount = 11 WHERE id = 1",
    )
    run(pg_dsn, url, tables=("orders",))
    sql(
        pg_dsn,
        "CREATE TABLE orders_asia PARTITION OF orders FOR VALUES IN ('asia')",
        "INSERT INTO orders VALUES (3, 'asia', 30)",
        "ALTER TABLE orders ADD COLUMN note text",
        "INSERT INTO orders VALUES (4, 'eu', 40, 'late')",
        "DELETE FROM orders WHERE id = 2",
    )
    run(pg_dsn, url, tables=("orders",))  # the same arguments again: no DuplicateObject
    events = captured(ReplicationLog.open(url))
    assert [(e["op"], e["collection"], e["data"]) for e in events] == [
        ("r", "public.orders", '{"id":1,"region":"eu","amount":10}'),
        ("c", "public.orders", '{"id":2,"region":"us","amount":20}'),
        ("u", "public.orders", '{"id":1,"region":"eu","amount":11}'),
        ("c", "public.orders", '{"id":3,"region":"asia","amount":30}'),
        ("c", "public.orders", '{"id":4,"region":"eu","amount":40,"note":"late"}'),
        ("d", "public.orders", '{"id":2,"region":"us"}'),
    ]
    assert {e["key"] for e in events if e["op"] == "d"} == {'{"region":"us","id":2}'}


def test_partitions_published_under_their_own_names_are_captured_as_their_root(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A publication of the user's without publish_via_partition_root sends partitions'
    names (also a publication of replog's made before it set the option): their changes
    belong to the partitioned table, in its column order, and are captured as such."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        *PARTITIONED,
        # a partition whose columns are in another order than its parent's
        "CREATE TABLE orders_asia (amount int, region text NOT NULL, id int NOT NULL)",
        "ALTER TABLE orders ATTACH PARTITION orders_asia FOR VALUES IN ('asia')",
        "CREATE PUBLICATION leaves FOR TABLE orders",
    )
    run(pg_dsn, url, publication="leaves", tables=("orders",))
    sql(
        pg_dsn,
        "INSERT INTO orders VALUES (1, 'eu', 10)",
        "INSERT INTO orders VALUES (2, 'asia', 20)",
        "UPDATE orders SET amount = 21 WHERE id = 2",
    )
    run(pg_dsn, url, publication="leaves", tables=("orders",))
    assert _changes(url) == [
        ("public.orders", "c", '{"id":1,"region":"eu","amount":10}'),
        ("public.orders", "c", '{"id":2,"region":"asia","amount":20}'),
        ("public.orders", "u", '{"id":2,"region":"asia","amount":21}'),
    ]


# -- nothing skipped silently --------------------------------------------------------------


def test_a_change_capture_cannot_map_stops_it_before_the_slot_moves_past(
    pg_dsn: str, tmp_path: Path
) -> None:
    """With capture's own publication every published relation is a captured one. A
    change of one capture cannot map (here: published behind its back) must stop
    capture with a clear error, committing nothing, and leave the slot where it was."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "CREATE TABLE stray (id int PRIMARY KEY)")
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "ALTER PUBLICATION cap ADD TABLE stray",
        "INSERT INTO t VALUES (1)",
        "INSERT INTO stray VALUES (1)",
    )
    version = ReplicationLog.open(url).refresh().version
    [(slot_before,)] = query(pg_dsn, "SELECT confirmed_flush_lsn FROM pg_replication_slots")
    with pytest.raises(CaptureError, match=r"public\.stray.*not a captured table"):
        run(pg_dsn, url, tables=("t",))
    assert ReplicationLog.open(url).refresh().version == version
    assert query(pg_dsn, "SELECT confirmed_flush_lsn FROM pg_replication_slots") == [
        (slot_before,)
    ]


def test_tables_of_a_publication_left_out_by_tables_are_counted_and_warned(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--publication with --tables captures a subset: skipping the rest is the documented
    choice, so each skipped change is counted and every skip is warned about."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY)",
        "CREATE TABLE other (id int PRIMARY KEY)",
        "CREATE PUBLICATION both_tables FOR TABLE t, other",
    )
    run(pg_dsn, url, publication="both_tables", tables=("t",))
    sql(
        pg_dsn,
        "INSERT INTO t VALUES (1)",
        "INSERT INTO other VALUES (1), (2)",
        "INSERT INTO other VALUES (3)",
    )
    with caplog.at_level("WARNING", logger="replog.capture"):
        progress = run(pg_dsn, url, publication="both_tables", tables=("t",))
    assert progress.skipped_changes == 3
    assert progress.to_json()["skipped_changes"] == 3
    warnings = [r.getMessage() for r in caplog.records if "public.other" in r.getMessage()]
    assert len(warnings) == 2  # one per transaction that had skipped changes
    assert "not captured" in warnings[0] and "--tables" in warnings[0]
    assert _changes(url) == [("public.t", "c", '{"id":1}')]


# -- replica identity: never make the source refuse writes ---------------------------------


def _writes_work(dsn: str, table: str) -> None:
    sql(dsn, f"UPDATE {table} SET id = id", f"DELETE FROM {table} WHERE false")


@pytest.mark.parametrize(
    ("ddl", "message"),
    [
        (
            "CREATE TABLE t (id int PRIMARY KEY DEFERRABLE, v int)",
            r"primary key of table 'public\.t' is DEFERRABLE.*every UPDATE and DELETE.*"
            r"REPLICA IDENTITY FULL",
        ),
        (
            "CREATE TABLE t (id int PRIMARY KEY, v int); ALTER TABLE t REPLICA IDENTITY NOTHING",
            r"'public\.t' has REPLICA IDENTITY NOTHING.*every UPDATE and DELETE",
        ),
    ],
    ids=["deferrable-primary-key", "identity-nothing"],
)
def test_a_table_without_a_usable_replica_identity_is_refused_before_it_is_published(
    pg_dsn: str, tmp_path: Path, ddl: str, message: str
) -> None:
    """Published without a replica identity, a table's every UPDATE and DELETE fails on
    the source. Capture checks the identity first and refuses, naming the fix; the source
    keeps taking writes."""
    url = str(tmp_path / "log")
    sql(pg_dsn, *ddl.split("; "), "INSERT INTO t VALUES (1, 1)")
    with pytest.raises(SourceConfigError, match=message):
        run(pg_dsn, url, tables=("t",))
    _writes_work(pg_dsn, "t")
    assert query(pg_dsn, "SELECT count(*) FROM pg_publication_rel") == [(0,)]

    sql(pg_dsn, "ALTER TABLE t REPLICA IDENTITY FULL")  # the fix the message names
    run(pg_dsn, url, tables=("t",))
    _writes_work(pg_dsn, "t")


def test_a_partition_without_a_replica_identity_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    """Writes go to partitions, so each partition's identity counts, not the parent's."""
    sql(
        pg_dsn,
        *PARTITIONED,
        "ALTER TABLE orders_us REPLICA IDENTITY NOTHING",
    )
    with pytest.raises(SourceConfigError, match=r"'public\.orders_us' \(a partition of"):
        run(pg_dsn, str(tmp_path / "log"), tables=("orders",))
    sql(pg_dsn, "UPDATE orders SET amount = 1")


def test_an_identity_index_other_than_the_key_is_refused_unless_the_key_is_its_columns(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Under REPLICA IDENTITY USING INDEX a delete carries the index's columns only: keyed
    by the primary key, every delete's key was {"id": null} and apply_changes failed on
    every restart. Capture refuses, unless --keys names the index's columns."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, code text NOT NULL, v int)",
        "CREATE UNIQUE INDEX t_code ON t (code)",
        "ALTER TABLE t REPLICA IDENTITY USING INDEX t_code",
        "INSERT INTO t VALUES (1, 'a', 1)",
    )
    with pytest.raises(SourceConfigError, match=r"USING INDEX t_code \(code\).*--keys public\.t"):
        run(pg_dsn, url, tables=("t",))
    run(pg_dsn, url, tables=("t",), keys={"public.t": ("code",)})
    sql(pg_dsn, "UPDATE t SET v = 2", "DELETE FROM t")
    run(pg_dsn, url, tables=("t",), keys={"public.t": ("code",)})
    changes = [(e["op"], e["key"]) for e in captured(ReplicationLog.open(url))]
    assert changes == [("r", '{"code":"a"}'), ("u", '{"code":"a"}'), ("d", '{"code":"a"}')]


def test_an_identity_changed_while_capturing_never_gives_a_key_of_nulls(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The identity switched to another index with changes unread: a delete then carries
    columns that are not the key. Capture stops with the reason instead of keying the
    event by NULLs."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, code text NOT NULL)",
        "CREATE UNIQUE INDEX t_code ON t (code)",
        "INSERT INTO t VALUES (1, 'a')",
    )
    run(pg_dsn, url, tables=("t",))
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t",))
    with PostgresCapture(options, ReplicationLog.open(url)) as running:  # checked: fine
        sql(pg_dsn, "ALTER TABLE t REPLICA IDENTITY USING INDEX t_code", "DELETE FROM t")
        version = running.log.refresh().version
        with pytest.raises(CaptureError, match=r"public\.t.*identity \(code\).*key \(id\)"):
            running.run()
    assert ReplicationLog.open(url).refresh().version == version


def test_a_capture_never_publishes_a_table_whose_writes_would_then_fail(
    pg_dsn: str, tmp_path: Path
) -> None:
    """With capture's own publication, a table joining --tables on a restart is checked
    before it is added to the publication, as at the first start."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY)",
        "CREATE TABLE d (id int PRIMARY KEY DEFERRABLE)",
        "INSERT INTO d VALUES (1)",
    )
    run(pg_dsn, url, tables=("t",))
    with pytest.raises(SourceConfigError, match="DEFERRABLE"):
        run(pg_dsn, url, tables=("t", "d"))
    _writes_work(pg_dsn, "d")


def test_a_following_capture_is_stopped_not_wedged_by_an_unmappable_change(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "CREATE TABLE stray (id int PRIMARY KEY)")
    run(pg_dsn, url, tables=("t",))
    stop = threading.Event()

    def publish_stray(_: CaptureProgress) -> None:
        if not stop.is_set():
            stop.set()  # once: the capture runs on until the change stops it
            sql(pg_dsn, "ALTER PUBLICATION cap ADD TABLE stray", "INSERT INTO stray VALUES (1)")

    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t",), follow=True, poll_s=0.01)
    with pytest.raises(CaptureError, match="stray"):
        capture(options, ReplicationLog.open(url), stop=threading.Event(), progress=publish_stray)
