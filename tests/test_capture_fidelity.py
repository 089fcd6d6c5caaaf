"""Capture keeps the table equal to the source whatever the schema does (a real
PostgreSQL): partitioned tables, replica identities, relations capture cannot map.
Nothing is skipped silently, and capture never makes the source refuse writes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import psycopg
import pytest
from support.capture import captured, query, run, sql
from support.logcheck import check_log

from replog.capture.options import CaptureOptions
from replog.capture.postgres import UNAVAILABLE, PostgresCapture, capture
from replog.capture.progress import CaptureProgress
from replog.errors import CaptureError, SourceConfigError
from replog.format import jsontext
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
        # the attached partition's rows are snapshotted (an ATTACH of a full table is not
        # in the WAL), here the one inserted after it too
        ("r", "public.orders", '{"id":3,"region":"asia","amount":30,"note":null}'),
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
    assert query(pg_dsn, "SELECT confirmed_flush_lsn FROM pg_replication_slots") == [(slot_before,)]


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


# -- one text per value, whichever path read it ---------------------------------------------

TYPES = {  # column type -> a literal (several per family; edge values where paths differ)
    "boolean": "true",
    "smallint": "-32768",
    "integer": "2147483647",
    "bigint": "-9223372036854775808",
    "numeric(12, 4)": "1.5000",
    "numeric": "0.000000000000000000000000001",
    "real": "1.17549e-38",
    "double precision": "1e308",
    "money": "12.34",
    "character(6)": "'ab'",
    "character varying(8)": "'ab  '",
    "text": "E'zo\\u00eb \"q\"\\n'",
    "name": "'a name'",
    '"char"': "'x'",
    "bytea": "'\\x00ff10'",
    "date": "'2024-02-29'",
    "time": "'23:59:59.999999'",
    "time with time zone": "'10:30:45.123456+05:30'",
    "timestamp": "'2024-05-01 12:00:00.5'",
    "timestamp with time zone": "'2024-05-01 12:00:00.123456+05:30'",
    "interval": "'1 year 2 mons 3 days 04:05:06.5'",
    "uuid": "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'",
    "json": '\'{"b": 1.0,  "a": [1,2]}\'',
    "jsonb": '\'{"b": 1.0, "a": 2}\'',
    "inet": "'10.0.0.1/32'",
    "cidr": "'10.0.0.0/8'",
    "macaddr": "'08:00:2b:01:02:03'",
    "macaddr8": "'08:00:2b:01:02:03:04:05'",
    "bit(4)": "B'1010'",
    "bit varying(8)": "B'101'",
    "point": "'(1.5,2)'",
    "line": "'{1,2,3}'",
    "lseg": "'[(0,0),(1,1)]'",
    "box": "'((0,0),(1,1))'",
    "path": "'[(0,0),(1,1),(2,0)]'",
    "polygon": "'((0,0),(1,1),(2,0))'",
    "circle": "'<(0,0),1>'",
    "tsvector": "'a fat cat'",
    "tsquery": "'fat & rat'",
    "int4range": "'[1,5)'",
    "numrange": "'(1.50,2.50]'",
    "tstzrange": "'[2024-01-01 00:00+00,2024-02-01 00:00+00)'",
    "daterange": "'[2024-01-01,2024-02-01)'",
    "int4multirange": "'{[1,3),[5,7)}'",
    "pg_lsn": "'16/B374D848'",
    "oid": "4294967295",
    "integer[]": "'{1,NULL,3}'",
    "text[]": '\'{"a b",NULL,"NULL"}\'',
    "numeric[]": "'{1.50,NaN,-0.000}'",
    "character(3)[]": "'{a,bc}'",
    "boolean[]": "'{t,f}'",
    "timestamp with time zone[]": "'{\"2024-05-01 12:00:00+02\"}'",
    "mood": "'happy'",
    "short_text": "'ab '",
    "pair": "ROW(1, 'x y')",
}
TYPES_SETUP = (
    "CREATE TYPE mood AS ENUM ('sad', 'happy')",
    "CREATE DOMAIN short_text AS character(4)",
    "CREATE TYPE pair AS (a int, b text)",
)


def _all_types_table(dsn: str) -> list[str]:
    columns = [f"c{i}" for i in range(len(TYPES))]
    definitions = ", ".join(f"{c} {t}" for c, t in zip(columns, TYPES, strict=True))
    sql(dsn, *TYPES_SETUP, f"CREATE TABLE every_type (id int PRIMARY KEY, {definitions})")
    return columns


def test_snapshot_and_stream_write_each_value_as_the_server_outputs_it(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A row captured by the stream and the same row read by a snapshot are the same JSON,
    column by column, and each value is what the type's output function writes (a cast to
    text is not: ``character(n)`` lost its trailing blanks, ``inet`` gained ``/32``)."""
    from replog.capture.source import connect, text_rows
    from replog.capture.values import ValueReader

    columns = _all_types_table(pg_dsn)
    streamed, snapshotted = str(tmp_path / "streamed"), str(tmp_path / "snapshotted")
    run(pg_dsn, streamed, tables=("every_type",), slot="s1")
    literals = ", ".join(TYPES.values())
    sql(pg_dsn, f"INSERT INTO every_type VALUES (1, {literals})")
    run(pg_dsn, streamed, tables=("every_type",), slot="s1")
    run(pg_dsn, snapshotted, tables=("every_type",), slot="s2")

    [change] = [e for e in captured(ReplicationLog.open(streamed)) if e["op"] == "c"]
    [read] = [e for e in captured(ReplicationLog.open(snapshotted)) if e["op"] == "r"]
    from_stream, from_snapshot = json.loads(change["data"]), json.loads(read["data"])
    assert from_stream == from_snapshot
    assert change["data"] == read["data"]  # byte for byte: number text, key order

    reader = ValueReader()
    with connect(pg_dsn) as connection:
        [output] = text_rows(connection, f"SELECT {', '.join(columns)} FROM every_type")
        types = dict(
            connection.execute(
                "SELECT attname, atttypid FROM pg_attribute WHERE attrelid = 'every_type'::regclass"
            ).fetchall()
        )
    for column, text in zip(columns, output, strict=True):
        expected = json.loads(jsontext.encode(reader.read(types[column], text)))
        assert from_stream[column] == expected, (column, text)
    by_type = dict(zip(TYPES, columns, strict=True))
    assert from_stream[by_type["character(6)"]] == "ab    "
    assert from_stream[by_type["short_text"]] == "ab  "
    assert from_stream[by_type["inet"]] == "10.0.0.1"
    assert from_stream[by_type["boolean"]] is True
    assert from_stream[by_type["character(3)[]"]] == ["a  ", "bc "]


def test_the_pure_python_driver_reads_the_snapshot_the_same(pg_dsn: str, tmp_path: Path) -> None:
    """Under psycopg's pure-Python implementation every snapshot ``true`` was false."""
    import os
    import subprocess

    from support.cli import REPLOG

    sql(
        pg_dsn,
        "CREATE TABLE flags (id int PRIMARY KEY, on_ boolean, c character(3))",
        "INSERT INTO flags VALUES (1, true, 'a'), (2, false, NULL)",
    )
    url = str(tmp_path / "log")
    result = subprocess.run(
        [REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "pure", "--tables", "flags"],
        env={**os.environ, "PSYCOPG_IMPL": "python"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = sorted(
        (json.loads(e["data"]) for e in captured(ReplicationLog.open(url))), key=lambda r: r["id"]
    )
    assert rows == [{"id": 1, "on_": True, "c": "a  "}, {"id": 2, "on_": False, "c": None}]


# -- generated columns, defaults ------------------------------------------------------------


def test_stored_generated_columns_are_in_the_stream_as_in_the_snapshot(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE g (id int PRIMARY KEY, v int, twice int GENERATED ALWAYS AS (v * 2) STORED)",
        "INSERT INTO g (id, v) VALUES (1, 1)",
    )
    run(pg_dsn, url, tables=("g",))
    sql(pg_dsn, "INSERT INTO g (id, v) VALUES (2, 2)", "UPDATE g SET v = 10 WHERE id = 1")
    run(pg_dsn, url, tables=("g",))
    assert [e["data"] for e in captured(ReplicationLog.open(url))] == [
        '{"id":1,"v":1,"twice":2}',
        '{"id":2,"v":2,"twice":4}',
        '{"id":1,"v":10,"twice":20}',
    ]

    # A user's publication that does not publish them: absent from both paths, and said so.
    other = str(tmp_path / "other")
    sql(pg_dsn, "CREATE PUBLICATION plain FOR TABLE g")
    with caplog.at_level("WARNING", logger="replog.capture"):
        run(pg_dsn, other, publication="plain", slot="plain")
    sql(pg_dsn, "UPDATE g SET v = 3 WHERE id = 2")
    run(pg_dsn, other, publication="plain", slot="plain")
    assert {e["data"] for e in captured(ReplicationLog.open(other))} == {
        '{"id":1,"v":10}',
        '{"id":2,"v":2}',
        '{"id":2,"v":3}',
    }
    assert any("generated column twice" in r.getMessage() for r in caplog.records)


def test_a_column_added_with_a_default_registers_the_value_older_rows_hold(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Rows untouched since ``ADD COLUMN ... DEFAULT`` hold the default in PostgreSQL (its
    ``attmissingval``) but had no event saying so: the schema version carries it."""
    from replog.schemas import registry

    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE d (id int PRIMARY KEY)", "INSERT INTO d VALUES (1)")
    run(pg_dsn, url, tables=("d",))
    sql(
        pg_dsn,
        "ALTER TABLE d ADD COLUMN n int DEFAULT 5",
        "ALTER TABLE d ADD COLUMN amount numeric(6, 2) DEFAULT 1.50",
        "ALTER TABLE d ADD COLUMN c character(4) DEFAULT 'ab'",
        "ALTER TABLE d ADD COLUMN later text",
        "INSERT INTO d (id, later) VALUES (2, 'x')",
    )
    run(pg_dsn, url, tables=("d",))
    events = captured(ReplicationLog.open(url))
    assert events[-1]["data"] == '{"id":2,"n":5,"amount":1.50,"c":"ab  ","later":"x"}'
    version = next(
        v
        for v in registry.versions(ReplicationLog.open(url).storage, "public.d")
        if v.digest == events[-1]["metadata"]["schema"]
    )
    fields = {f["field"]: f for f in version.schema["fields"][1]["fields"]}
    assert fields["n"]["default"] == 5
    assert fields["amount"]["default"] == "1.50"
    assert fields["c"]["default"] == "ab  "
    assert "default" not in fields["later"] and "default" not in fields["id"]

    fresh = str(tmp_path / "fresh")  # a snapshot (of another slot) registers the same fields
    run(pg_dsn, fresh, tables=("d",), slot="fresh")
    [snapshotted] = registry.versions(ReplicationLog.open(fresh).storage, "public.d")
    assert snapshotted.schema["fields"][1]["fields"] == version.schema["fields"][1]["fields"]


def test_a_column_added_to_a_partitioned_table_registers_its_partitions_value(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A partitioned table holds no rows and no ``attmissingval``: its partitions do. The
    default was read from the parent alone, so Delta held NULL for every row of a
    partitioned table written before the column (found on a real-shaped table, not by
    the tests). Partitions whose rows hold different values register none, with a
    warning."""
    from replog.schemas import registry

    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE p (id int, r text, PRIMARY KEY (r, id)) PARTITION BY LIST (r)",
        "CREATE TABLE p_a PARTITION OF p FOR VALUES IN ('a')",
        "CREATE TABLE p_b PARTITION OF p FOR VALUES IN ('b')",
        "INSERT INTO p VALUES (1, 'a'), (2, 'b')",
    )
    run(pg_dsn, url, tables=("p",))
    sql(
        pg_dsn,
        "ALTER TABLE p ADD COLUMN due date DEFAULT DATE '2030-12-31'",
        "ALTER TABLE p ADD COLUMN n int",
        "ALTER TABLE p_a ALTER COLUMN n SET DEFAULT 1",  # no missing value: n stays NULL
        "ALTER TABLE p DETACH PARTITION p_a",
        "ALTER TABLE p DETACH PARTITION p_b",
        "ALTER TABLE p_a ADD COLUMN odd int DEFAULT 3",  # p_a's rows hold 3 ...
        "ALTER TABLE p_b ADD COLUMN odd int DEFAULT 2",  # ... and p_b's 2
        "ALTER TABLE p ADD COLUMN odd int",
        "ALTER TABLE p ATTACH PARTITION p_a FOR VALUES IN ('a')",
        "ALTER TABLE p ATTACH PARTITION p_b FOR VALUES IN ('b')",
        "INSERT INTO p (id, r) VALUES (3, 'a')",
    )
    with caplog.at_level("WARNING", logger="replog.capture.source"):
        run(pg_dsn, url, tables=("p",))
    events = captured(ReplicationLog.open(url))
    version = next(
        v
        for v in registry.versions(ReplicationLog.open(url).storage, "public.p")
        if v.digest == events[-1]["metadata"]["schema"]
    )
    fields = {f["field"]: f for f in version.schema["fields"][1]["fields"]}
    assert fields["due"]["default"] == "2030-12-31"  # io.debezium.time.IsoDate
    assert "default" not in fields["n"]
    assert "default" not in fields["odd"]
    assert any("different values" in r.getMessage() for r in caplog.records)


# -- key changes ----------------------------------------------------------------------------


def _latest(url: str) -> dict[str, str]:
    """The table a log builds: key -> row of its newest event (in the order of its shard)
    unless that is a delete."""
    latest: dict[str, tuple[str, str]] = {}
    rows = sorted(check_log(ReplicationLog.open(url)), key=lambda r: (r["shard"], r["sequence"]))
    for row in rows:
        latest[row["key"]] = (row["operation"], row["data"].decode())
    return {key: data for key, (op, data) in latest.items() if op != "delete"}


def test_a_deferrable_key_shifted_in_one_statement_ends_as_in_the_source(
    pg_dsn: str, tmp_path: Path
) -> None:
    """``UPDATE seats SET id = id + 1`` under a DEFERRABLE key is decoded row by row as
    d1 c2 d2 c3 d3 c4: taken one by one, keys 2 and 3 ended deleted."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE seats (id int PRIMARY KEY DEFERRABLE, label text)",
        "ALTER TABLE seats REPLICA IDENTITY FULL",
        "INSERT INTO seats VALUES (1, 'a'), (2, 'b'), (3, 'c')",
    )
    run(pg_dsn, url, tables=("seats",))
    sql(pg_dsn, "UPDATE seats SET id = id + 1")
    run(pg_dsn, url, tables=("seats",))
    source = dict(query(pg_dsn, "SELECT id, label FROM seats"))
    assert _latest(url) == {
        f'{{"id":{i}}}': json.dumps({"id": i, "label": label}, separators=(",", ":"))
        for i, label in source.items()
    }
    # The same row moved twice in one transaction is deleted from its middle key.
    with psycopg.connect(pg_dsn) as connection:  # one transaction, two statements
        connection.execute("UPDATE seats SET id = 10 WHERE id = 4")
        connection.execute("UPDATE seats SET id = 11 WHERE id = 10")
    run(pg_dsn, url, tables=("seats",))
    assert sorted(_latest(url)) == ['{"id":11}', '{"id":2}', '{"id":3}']


def test_a_key_update_with_an_unchanged_toasted_column_carries_its_value(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A primary-key UPDATE whose TOASTed column did not change: the server sends neither
    that value nor (default identity) the old row. The create of the new key reads it
    from the row as the table holds it (``fetched``) and names the old key; a row gone by
    then keeps Debezium's placeholder (listed ``unavailable``), and its delete follows."""
    url = str(tmp_path / "log")
    big = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 400) g)"
    sql(
        pg_dsn,
        "CREATE TABLE docs (id int PRIMARY KEY, body text)",
        f"INSERT INTO docs VALUES (1, {big}), (5, {big})",
    )
    run(pg_dsn, url, tables=("docs",))
    [(body,)] = query(pg_dsn, "SELECT body FROM docs WHERE id = 1")
    sql(
        pg_dsn,
        "UPDATE docs SET id = 2 WHERE id = 1",
        "UPDATE docs SET id = 6 WHERE id = 5",
        "DELETE FROM docs WHERE id = 6",
    )
    run(pg_dsn, url, tables=("docs",))
    d1, c2, d5, c6, d6 = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert [e["op"] for e in (d1, c2, d5, c6, d6)] == ["d", "c", "d", "c", "d"]
    assert c2["metadata"]["old_key"] == '{"id":1}' and d1["metadata"]["new_key"] == '{"id":2}'
    assert json.loads(c2["data"])["body"] == body and c2["metadata"]["fetched"] == ["body"]
    assert "unavailable" not in c2["metadata"]
    assert json.loads(c6["data"])["body"] == UNAVAILABLE  # the row was gone
    assert c6["metadata"]["unavailable"] == ["body"] and "fetched" not in c6["metadata"]


def test_a_numeric_key_retyped_keeps_its_key(pg_dsn: str, tmp_path: Path) -> None:
    """``numeric`` -> ``numeric(10, 2)`` writes 1 as 1.00: the key must stay one key
    (one shard, one order), whatever scale the type now writes it with."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE n (id numeric PRIMARY KEY, v int)", "INSERT INTO n VALUES (1, 1)")
    run(pg_dsn, url, tables=("n",))
    sql(
        pg_dsn,
        "ALTER TABLE n ALTER COLUMN id TYPE numeric(10, 2)",
        "UPDATE n SET v = 2",
        "INSERT INTO n VALUES (2.5, 1)",
    )
    run(pg_dsn, url, tables=("n",))
    events = captured(ReplicationLog.open(url))
    assert [(e["key"], e["data"]) for e in events if e["op"] != "r"] == [
        ('{"id":1}', '{"id":1.00,"v":2}'),  # the value keeps the server's text
        ('{"id":2.5}', '{"id":2.50,"v":1}'),
    ]
    # the retype rewrote every row (no row change says so): the table is read again
    assert [(e["key"], e["data"]) for e in events if e["op"] == "r"] == [
        ('{"id":1}', '{"id":1,"v":1}'),
        ('{"id":1}', '{"id":1.00,"v":2}'),
        ('{"id":2.5}', '{"id":2.50,"v":1}'),
    ]


# -- tables joining the capture ------------------------------------------------------------


def test_a_table_added_to_tables_on_a_restart_gets_its_rows_snapshotted(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Its changes stream from the restart on; its rows from before were never captured:
    an incremental snapshot reads them while the stream runs."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY)",
        "CREATE TABLE late (id int PRIMARY KEY, v int)",
        "INSERT INTO late SELECT g, g FROM generate_series(1, 50) g",
    )
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "INSERT INTO t VALUES (1)", "UPDATE late SET v = -1 WHERE id = 1")
    run(pg_dsn, url, tables=("t", "late"), snapshot_chunk_rows=7)
    sql(pg_dsn, "UPDATE late SET v = -2 WHERE id = 2")
    run(pg_dsn, url, tables=("t", "late"))
    events = captured(ReplicationLog.open(url))
    reads = [e for e in events if e["collection"] == "public.late" and e["op"] == "r"]
    assert len(reads) == 50 and {e["metadata"]["source"]["snapshot"] for e in reads} == {
        "incremental"
    }
    assert json.loads(next(e for e in reads if e["key"] == '{"id":1}')["data"])["v"] == -1
    assert _latest(url)['{"id":2}'] == '{"id":2,"v":-2}'
    assert len({e["version"] for e in reads}) == 8  # ceil(50 / 7) chunks, a commit each


# -- a large transaction: bounded memory, one commit, nothing left by a kill ---------------


def test_a_large_transaction_is_staged_in_pieces_and_committed_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Its events are staged as they are decoded (a piece of STAGE_EVENTS at a time), yet
    it lands as one commit. Killed (SIGKILL) while staging: nothing is visible, and the
    next run gives back the dead run's staging lease, so ``recover`` collects every file
    it staged."""
    import os
    import subprocess

    from support.cli import REPLOG, replog

    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, v int)",
        "INSERT INTO big SELECT g, 0 FROM generate_series(1, 1000) g",
    )
    run(pg_dsn, url, tables=("big",))
    sql(pg_dsn, "UPDATE big SET v = v + 1")
    version = ReplicationLog.open(url).refresh().version
    STAGE = ["--stage-events", "128"]  # noqa: N806
    killed = subprocess.run(
        [REPLOG, "capture", "postgres", pg_dsn, url, "--slot", "cap", "--tables", "big", *STAGE],
        env={**os.environ, "REPLOG_FAULT": "capture_staged"},
        capture_output=True,
        text=True,
        check=False,
        start_new_session=True,
    )
    assert killed.returncode == -9, killed.stderr
    assert ReplicationLog.open(url).refresh().version == version  # nothing visible
    assert list((tmp_path / "log" / "_replog" / "leases").glob("*"))  # the dead run's

    run(pg_dsn, url, tables=("big",), stage_events=128)
    log = ReplicationLog.open(url)
    updates = [e for e in captured(log) if e["op"] == "u"]
    assert len(updates) == 1000 and len({e["version"] for e in updates}) == 1
    assert len({e["event_id"] for e in updates}) == 1000
    # The dead run's lease was wound down to expire within the clock skew (10 minutes: a
    # run that froze may be between its lease check and its put), not released at once.
    assert replog("recover", url, "--grace", "0s", "--json").returncode == 0
    assert list((tmp_path / "log" / "_replog" / "leases").glob("*"))
    from replog.ops.recovery import recover
    from replog.timeutil import use_clock

    with use_clock(lambda: time.time() + 11 * 60):  # 11 minutes later
        report = recover(ReplicationLog.open(url), grace_ms=0)
    assert report.garbage  # the files the killed run staged
    assert not list((tmp_path / "log" / "_replog" / "leases").glob("*"))
    assert replog("verify", url).returncode == 0


# -- a table dropped and created again under its name --------------------------------------


def _source_rows(dsn: str, table: str) -> dict[str, str]:
    rows = query(dsn, f"SELECT to_jsonb(r)::text, id FROM {table} r")
    return {
        f'{{"id":{i}}}': json.dumps(json.loads(text), separators=(",", ":")) for text, i in rows
    }


def test_a_table_dropped_and_created_again_between_runs_replaces_the_old_rows(
    pg_dsn: str, tmp_path: Path
) -> None:
    """With capture's own publication the drop took the table out of it: the new table's
    changes were never sent (lost) and the old rows stayed in every table built from the
    log. Now the new table is published, snapshotted, and the old rows are deleted."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int)", "INSERT INTO t VALUES (1, 1), (2, 2)")
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "DROP TABLE t",
        "CREATE TABLE t (id int PRIMARY KEY, label text)",
        "INSERT INTO t VALUES (2, 'two'), (3, 'three')",
    )
    run(pg_dsn, url, tables=("t",))
    sql(pg_dsn, "INSERT INTO t VALUES (4, 'four')", "UPDATE t SET label = 'TWO' WHERE id = 2")
    run(pg_dsn, url, tables=("t",))
    assert _latest(url) == _source_rows(pg_dsn, "t")
    drops = [
        e
        for e in captured(ReplicationLog.open(url))
        if "table_dropped" in json.dumps(e["metadata"])
    ]
    assert sorted(e["key"] for e in drops) == ['{"id":1}', '{"id":2}']


def test_a_table_dropped_and_created_again_while_capturing_replaces_the_old_rows(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v int)", "INSERT INTO t VALUES (1, 1), (2, 2)")
    run(pg_dsn, url, tables=("t",))
    done = threading.Event()
    state = {"round": 0}

    def ddl_while_running(progress: CaptureProgress) -> None:
        state["round"] += 1
        if state["round"] == 1:
            sql(
                pg_dsn,
                "UPDATE t SET v = 10 WHERE id = 1",
                "DROP TABLE t",
                "CREATE TABLE t (id int PRIMARY KEY, label text)",
                "INSERT INTO t VALUES (2, 'two')",
            )
        elif state["round"] == 30:
            sql(pg_dsn, "INSERT INTO t VALUES (3, 'three')")
        elif state["round"] > 60 and progress.snapshot_tables_left == 0:
            done.set()

    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t",), follow=True, poll_s=0.02)
    capture(options, ReplicationLog.open(url), stop=done, progress=ddl_while_running)
    run(pg_dsn, url, tables=("t",))
    assert (
        _latest(url)
        == _source_rows(pg_dsn, "t")
        == {
            '{"id":2}': '{"id":2,"label":"two"}',
            '{"id":3}': '{"id":3,"label":"three"}',
        }
    )
