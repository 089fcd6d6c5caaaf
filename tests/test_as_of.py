"""Tables as the source had them at any past transaction (``table_as_of``,
``tables_as_of``): a real PostgreSQL workload over three related tables (a TRUNCATE among
its transactions) records, after each transaction, its position, its time and every
table's rows; the log is applied to Delta (scd1 and scd2) in micro-batches of a few events
whose boundaries fall between and inside the transactions, with the apply query failing
between its commits; each table as of each point equals what the source held then, row
by row."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from support.capture import run
from support.cli import replog
from test_cli_json import run_json

from replog.cli.output import COMMAND_SCHEMAS
from replog.errors import AsOfError, InvalidOptionError
from replog.log import ReplicationLog
from replog.spark.as_of import ARROW_BATCH, frame_of, read_rows, view_names
from replog.spark.functions import apply_changes, table_as_of, tables_as_of
from replog.tables import as_of
from replog.tables import coverage as covered
from replog.tables.delta import open_table, read_table

pytestmark = pytest.mark.spark

TABLES = ("public.customers", "public.orders", "public.items")
KEYS = {"public.customers": ("id",), "public.orders": ("id",), "public.items": ("order_id", "line")}
BIG = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 300) g)"

SCHEMA = (
    "CREATE TABLE customers (id int PRIMARY KEY, name text, notes text)",
    "CREATE TABLE orders (id int PRIMARY KEY, customer_id int REFERENCES customers(id)"
    " ON UPDATE CASCADE ON DELETE CASCADE, amount int, status text)",
    "CREATE TABLE items (order_id int REFERENCES orders(id) ON UPDATE CASCADE"
    " ON DELETE CASCADE, line int, qty int, PRIMARY KEY (order_id, line))",
)

WORKLOAD: tuple[tuple[str, ...], ...] = (
    (f"INSERT INTO customers VALUES (1, 'ann', {BIG}), (2, 'bob', 'short'), (3, 'cy', NULL)",),
    (
        "INSERT INTO orders VALUES (10, 1, 100, 'new'), (11, 2, 50, 'new')",
        "INSERT INTO items VALUES (10, 1, 2), (10, 2, 1), (11, 1, 5)",
    ),
    ("UPDATE orders SET status = 'paid', amount = 110 WHERE id = 10",),
    ("UPDATE customers SET name = 'ann b' WHERE id = 1",),  # the TOASTed notes unchanged
    ("DELETE FROM items WHERE order_id = 10 AND line = 2", "UPDATE items SET qty = 3"),
    ("UPDATE customers SET id = 100 WHERE id = 1",),  # a changed key, cascaded to orders
    (
        "INSERT INTO customers VALUES (4, 'dee', 'x')",
        "INSERT INTO orders VALUES (12, 4, 7, 'new')",
        "INSERT INTO items SELECT 12, g, g FROM generate_series(1, 6) g",
    ),
    ("DELETE FROM customers WHERE id = 2",),  # cascades to its order and items
    ("UPDATE customers SET name = 'ann c' WHERE id = 100",),  # TOAST again, after the key
    ("UPDATE orders SET id = 13 WHERE id = 12",),  # a changed key, cascaded to items
    ("INSERT INTO customers VALUES (2, 'bob again', 'back')",),  # a deleted key comes back
    ("UPDATE items SET qty = qty + 10 WHERE order_id = 13 AND line <= 3",),
    ("TRUNCATE items",),  # a truncate event on each shard of the log
    ("INSERT INTO items VALUES (10, 3, 9), (13, 1, 1)",),
    ("DELETE FROM orders WHERE id = 13", "UPDATE customers SET notes = 'n' WHERE id = 3"),
    tuple(f"UPDATE orders SET amount = {n} WHERE id = 10" for n in range(120, 124)),
    ("UPDATE orders SET status = 'sent' WHERE id = 10",),  # a key changed by two transactions
    ("UPDATE orders SET status = 'done' WHERE id = 10",),  # in a row: in one micro-batch
)


def contents(connection: psycopg.Connection[Any]) -> dict[str, dict[tuple[Any, ...], dict]]:
    """Every table's rows, by key."""
    found = {}
    for name in TABLES:
        cursor = connection.execute(f"SELECT * FROM {name}")
        columns = [c.name for c in cursor.description or ()]
        rows = [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]
        found[name] = {tuple(r[k] for k in KEYS[name]): r for r in rows}
    return found


def keyed(rows: list[dict[str, Any]], name: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Rows (replog's bookkeeping columns dropped) by key; a key appears once."""
    found = {}
    for row in rows:
        key = tuple(row[k] for k in KEYS[name])
        assert key not in found, f"{name}: key {key} twice"
        found[key] = {k: v for k, v in row.items() if not k.startswith("__")}
    return found


def workload(dsn: str, url: str) -> list[dict[str, Any]]:
    """Run :data:`WORKLOAD`, capturing every few transactions; after each transaction its
    position (the WAL insert position after its commit), time and the tables' rows."""
    points = []
    with psycopg.connect(dsn, autocommit=True) as connection:
        for number, statements in enumerate(WORKLOAD):
            with connection.transaction():
                for statement in statements:
                    connection.execute(statement)
            lsn, moment = connection.execute(
                "SELECT pg_current_wal_insert_lsn()::text, clock_timestamp()"
            ).fetchone()  # type: ignore[misc]
            points.append({"lsn": lsn, "at": moment, "rows": contents(connection)})
            time.sleep(0.01)  # the next commit in a later millisecond than this point's time
            if number % 4 == 3:
                run(dsn, url, tables=TABLES)
    run(dsn, url, tables=TABLES)
    return points


def applied(spark: Any, log: ReplicationLog, tmp_path: Path, mode: str, monkeypatch: Any) -> str:
    """The log applied in micro-batches of 3 events, the query failing once just after a
    batch's first table committed and once just before a commit, then restarted."""
    targets = str(tmp_path / mode / "{collection}")
    apply = apply_changes(targets, app_id=f"as-of-{mode}", log=log.url, mode=mode)
    for fault in ("apply_after_delta@3", "apply_before_delta@6", None):
        if fault is None:
            monkeypatch.delenv("REPLOG_FAULT", raising=False)
        else:
            monkeypatch.setenv("REPLOG_FAULT", fault)
            monkeypatch.setenv("REPLOG_FAULT_ACTION", "raise")
        query = (
            spark.readStream.format("replog")
            .option("maxEventsPerTrigger", "3")
            .load(log.url)
            .writeStream.foreachBatch(apply)
            .option("checkpointLocation", str(tmp_path / f"chk-{mode}"))
            .trigger(availableNow=True)
            .start()
        )
        try:
            query.awaitTermination()
        except Exception as exc:  # the injected failure: the query stops mid-batch
            assert fault is not None and "injected fault" in str(exc), exc
        else:
            assert fault is None, f"{fault} did not fail the query"
    return str(tmp_path / mode)


@pytest.fixture(scope="module")
def history(
    spark: Any, postgres_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("as-of")
    monkeypatch = pytest.MonkeyPatch()
    with postgres_server.database() as dsn:
        with psycopg.connect(dsn, autocommit=True) as connection:
            for statement in SCHEMA:
                connection.execute(statement)
            before = connection.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
            assert before is not None
        url = str(tmp_path / "log")
        run(dsn, url, tables=TABLES)  # the slot, from before the first transaction
        points = workload(dsn, url)
        log = ReplicationLog.open(url)
        try:
            roots = {
                mode: applied(spark, log, tmp_path, mode, monkeypatch) for mode in ("scd1", "scd2")
            }
        finally:
            monkeypatch.undo()
    empty: dict[str, dict[Any, Any]] = {name: {} for name in TABLES}
    first = {"lsn": before[0], "at": None, "rows": empty}
    return {"log": log, "points": [first, *points], "roots": roots}


def paths(root: str) -> dict[str, str]:
    return {name: f"{root}/{name}" for name in TABLES}


def current(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["__current"]]


@pytest.mark.parametrize("mode", ["scd1", "scd2"])
def test_every_table_as_of_every_transaction_equals_the_source(
    spark: Any, history: dict[str, Any], mode: str
) -> None:
    """At each recorded position (before the first transaction, after each one), each
    table as of it holds exactly the source's rows then; some points need the log's
    events after their version (inside a micro-batch), some end a version exactly. An
    scd2 table is also read from a later version's history cut at the point (its rows'
    validity positions): the same history, row by row, as the version before it and the
    log's events after it give."""
    log, root = history["log"], history["roots"][mode]
    needing_tail = exact = cut = 0
    for number, point in enumerate(history["points"]):
        at = as_of.Point(position=covered.lsn_to_int(point["lsn"]))
        for name, path in paths(root).items():
            table = open_table(path, None)
            assert table is not None
            versions = covered.table_history(table.history())
            planned = as_of.plan(versions, log, at, cut=False)
            if planned.events.num_rows:
                needing_tail += 1
            else:
                exact += 1
            rows = read_rows(spark, path, log, at, cut=False).to_pylist()
            if mode == "scd2":
                cut += as_of.plan(versions, log, at).cut
                from_history = read_rows(spark, path, log, at).to_pylist()
                assert ordered(from_history) == ordered(rows), f"point {number}, {name}"
                rows = current(rows)
                if 0 < number < len(history["points"]) - 1:  # as of its time, too
                    moment = as_of.point(at=point["at"])
                    by_time = current(read_rows(spark, path, log, moment).to_pylist())
                    assert keyed(by_time, name) == point["rows"][name], f"{number} at, {name}"
            assert keyed(rows, name) == point["rows"][name], f"point {number}, {name}"
    assert needing_tail and exact, (needing_tail, exact)
    assert mode == "scd1" or cut > len(history["points"]), cut


def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History rows in one order (by position in the log)."""
    return sorted(rows, key=lambda r: (r["__shard"], r["__sequence"]))


def test_scd2_rows_carry_the_positions_of_the_transactions_that_opened_and_closed_them(
    history: dict[str, Any],
) -> None:
    """Each version of an scd2 target names the commit LSNs of the transactions that
    opened and closed it: the newest table alone, cut at any recorded position by them,
    holds exactly the source's rows then (no log needed)."""
    log, root = history["log"], history["roots"]["scd2"]
    metadata = log.read_all().column("metadata").to_pylist()
    commits = {int(json.loads(m)["transaction"]["id"].split(":")[1]) for m in metadata}
    for name, path in paths(root).items():
        table = open_table(path, None)
        assert table is not None
        versions = read_table(table).to_pylist()
        for row in versions:
            assert row["__valid_from_position"] in commits, row
            assert row["__valid_to_position"] is None or row["__valid_to_position"] in commits
            assert (row["__valid_to_position"] is None) == row["__current"], row
            if row["__valid_to_position"] is not None:  # equal: a version inside its txn
                assert row["__valid_from_position"] <= row["__valid_to_position"], row
        for number, point in enumerate(history["points"]):
            lsn = covered.lsn_to_int(point["lsn"])
            live = [
                r
                for r in versions
                if r["__valid_from_position"] <= lsn
                and (r["__valid_to_position"] is None or r["__valid_to_position"] > lsn)
            ]
            assert keyed(live, name) == point["rows"][name], f"point {number}, {name}"


def test_a_transaction_is_in_from_its_commit_position_on(
    spark: Any, history: dict[str, Any]
) -> None:
    """As of exactly a transaction's commit LSN (the position its events carry) the
    transaction is in, whole; as of one byte before, it is not."""
    log, root, points = history["log"], history["roots"]["scd1"], history["points"]
    metadata = log.read_all().column("metadata").to_pylist()
    commits = sorted({int(json.loads(m)["transaction"]["id"].split(":")[1]) for m in metadata})
    assert len(commits) == len(WORKLOAD)
    for number, commit in enumerate(commits):
        for lsn, expected in ((commit, points[number + 1]), (commit - 1, points[number])):
            for name, path in paths(root).items():
                rows = read_rows(spark, path, log, as_of.Point(position=lsn)).to_pylist()
                assert keyed(rows, name) == expected["rows"][name], f"{number}, {lsn}, {name}"


def test_tables_as_of_a_time_are_consistent_and_registered_as_views(
    spark: Any, history: dict[str, Any]
) -> None:
    """As of each recorded time, every table at once (DataFrames and temporary views):
    equal to the source's rows, and no item or order without its order or customer."""
    log, root = history["log"], history["roots"]["scd1"]
    last = len(history["points"]) - 1  # its time is past the log's newest event
    for number, point in enumerate(history["points"][1:last], start=1):
        frames = tables_as_of(spark, paths(root), log=log.url, at=point["at"])
        for name, frame in frames.items():
            rows = [r.asDict() for r in frame.collect()]
            assert keyed(rows, name) == point["rows"][name], f"point {number}, {name}"
        orphans = spark.sql(
            "SELECT count(*) AS n FROM items i LEFT JOIN orders o ON i.order_id = o.id"
            " WHERE o.id IS NULL"
        ).first()
        lost = spark.sql(
            "SELECT count(*) AS n FROM orders o LEFT JOIN customers c ON o.customer_id = c.id"
            " WHERE c.id IS NULL"
        ).first()
        assert orphans is not None and lost is not None
        assert (orphans["n"], lost["n"]) == (0, 0), f"point {number}"


def test_an_iso_time_and_a_naive_datetime_are_utc(spark: Any, history: dict[str, Any]) -> None:
    log, root = history["log"], history["roots"]["scd1"]
    point = history["points"][6]
    moment: dt.datetime = point["at"].astimezone(dt.timezone.utc)
    path = paths(root)["public.orders"]
    for at in (moment.isoformat(), moment.replace(tzinfo=None)):
        frame = table_as_of(spark, path, log=log, at=at)
        rows = [r.asDict() for r in frame.collect()]
        assert keyed(rows, "public.orders") == point["rows"]["public.orders"]


def test_points_outside_the_log_are_refused_with_the_reachable_range(
    spark: Any, history: dict[str, Any]
) -> None:
    log, root = history["log"], history["roots"]["scd1"]
    path = paths(root)["public.customers"]
    with pytest.raises(AsOfError, match=r"newer than the log.s newest event.*Reachable"):
        table_as_of(spark, path, log=log, lsn="FFFF/0")
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
    with pytest.raises(AsOfError, match="newer than the log's newest event"):
        table_as_of(spark, path, log=log, at=later)
    with pytest.raises(InvalidOptionError, match=r"exactly one of at= .* and lsn="):
        table_as_of(spark, path, log=log)
    with pytest.raises(InvalidOptionError, match="exactly one of"):
        table_as_of(spark, path, log=log, lsn="0/1", at="2024-01-01")
    with pytest.raises(InvalidOptionError, match="not a PostgreSQL LSN"):
        table_as_of(spark, path, log=log, lsn="3A5F1C8")
    with pytest.raises(InvalidOptionError, match="not an ISO 8601 time"):
        table_as_of(spark, path, log=log, at="yesterday")


def test_each_commit_records_what_it_covers(history: dict[str, Any]) -> None:
    """Any reader of the Delta log maps a version to the log and the source: the
    offsets grow, and each commit's span of positions and times lies within the log's."""
    log, root = history["log"], history["roots"]["scd1"]
    table = open_table(paths(root)["public.orders"], None)
    assert table is not None
    infos = [
        c["replog"] for c in sorted(table.history(), key=lambda c: c["version"]) if "replog" in c
    ]
    assert len(infos) > 3
    previous: dict[str, int] = {}
    for info in infos:
        assert info["log_id"] == log.log_id and info["collection"] == "public.orders"
        assert info["keys"] == ["id"] and info["mode"] == "scd1"
        assert all(info["offsets"].get(s, 0) >= q for s, q in previous.items())
        previous = info["offsets"]
        batch = info["batch"]
        assert batch["first_position"] <= batch["last_position"]
        assert covered.lsn_to_int(batch["last_lsn"]) == batch["last_position"]
        assert batch["first_ms"] <= batch["last_ms"]
    heads = log.head()
    assert all(0 < q <= heads[int(s)] for s, q in previous.items())


def test_view_names() -> None:
    assert view_names(["public.orders", "items"]) == {"public.orders": "orders", "items": "items"}
    assert view_names(["a.t", "b.t"]) == {"a.t": "a_t", "b.t": "b_t"}


def test_the_latest_view_of_the_log_alone_as_of_a_point(
    spark: Any, history: dict[str, Any]
) -> None:
    """``view=latest`` with ``asOfLsn``/``asOfTimestamp``: one row per key as the source
    had it at the point, from the log alone (no Delta replica)."""
    log = history["log"]
    *points, last = history["points"]
    for number, point in enumerate(points[1:], start=1):
        for option, value in (
            ("asOfLsn", point["lsn"]),
            ("asOfTimestamp", point["at"].isoformat()),
        ):
            rows = (
                spark.read.format("replog").option("view", "latest").option(option, value)
                .load(log.url).collect()
            )  # fmt: skip
            for name in TABLES:
                found = {
                    tuple(json.loads(r["key"])[k] for k in KEYS[name]): json.loads(r["data"])
                    for r in rows
                    if r["collection"] == name
                }
                expected = point["rows"][name]
                assert found.keys() == expected.keys(), f"{option} {number} {name}"
                if name != "public.customers":  # its TOASTed notes may be unsent in an event
                    assert found == expected, f"{option} {number} {name}"
    reader = spark.read.format("replog").option("view", "latest")
    newest = as_of.newest_in_log(log, as_of.point(lsn="0/0"))
    assert newest is not None and newest >= covered.lsn_to_int(last["lsn"])
    too_new = covered.lsn_to_text(newest + 1)
    with pytest.raises(Exception, match="newer than what the log"):
        reader.option("asOfLsn", too_new).load(log.url).collect()
    with pytest.raises(Exception, match="set option 'view' to 'latest'"):
        spark.read.format("replog").option("asOfLsn", "0/1").load(log.url).collect()
    with pytest.raises(Exception, match="give one of them"):
        reader.option("asOfLsn", "0/1").option("asOfTimestamp", "0").load(log.url).collect()


def test_the_cli_shows_the_points_each_replica_and_the_log_can_be_read_as_of(
    spark: Any, history: dict[str, Any]
) -> None:
    """``replog history``/``status`` ``--table``: the oldest and newest position and time;
    the newest shown is readable, the position after it is not."""
    log, root = history["log"], history["roots"]["scd1"]
    path = paths(root)["public.orders"]
    newest_ms = max(covered.event_times(log.read_all().column("timestamp")).to_pylist())
    for command in ("history", "status"):
        document = run_json(command, log.url, "--table", path, schema=COMMAND_SCHEMAS[command])
        found = document["as_of"]
        assert found["log"]["from_beginning"] and found["log"]["newest_lsn"] is not None
        (replica,) = found["replicas"]
        assert (replica["path"], replica["collection"]) == (path, "public.orders")
        assert replica["from_beginning"] and replica["newest_lsn"] == found["log"]["newest_lsn"]
        assert replica["newest_ms"] == found["log"]["newest_ms"] == newest_ms
    newest = covered.lsn_to_int(replica["newest_lsn"])
    assert table_as_of(spark, path, log=log, lsn=replica["newest_lsn"]).count() >= 0
    with pytest.raises(AsOfError, match="newer than the log's newest event"):
        table_as_of(spark, path, log=log, lsn=covered.lsn_to_text(newest + 1))
    text = replog("status", log.url, "--table", path).stdout
    assert "readable as of (LSN / time):" in text and f"{path} (version" in text


def source_event(key: int, ms: int, source: dict[str, Any], txn: str) -> dict[str, Any]:
    """An upsert of ``key`` in transaction ``txn`` of ``source`` (a Debezium source block)."""
    return {
        "collection": "t",
        "key": json.dumps({"id": key}),
        "operation": "update",
        "data": json.dumps({"id": key, "v": f"{source['name']}-{ms}"}),
        "timestamp": ms,
        "metadata": json.dumps({"op": "u", "source": source, "transaction": {"id": txn}}),
    }


def test_each_commit_records_the_span_of_each_source_in_its_batch(
    spark: Any, tmp_path: Path
) -> None:
    """A log fed by a PostgreSQL server and a MySQL server (positions that do not
    compare): each commit records, per source in its micro-batch, its first and last
    transaction position and commit time; the batch's span is their union."""
    t0 = 1_735_689_600_000
    pg = {"connector": "postgresql", "name": "pg-a", "lsn": 0}
    shop = {"connector": "mysql", "name": "shop", "server_id": 1, "file": "binlog.000001"}
    log = ReplicationLog.create(str(tmp_path / "log"), 2)
    log.append(
        [
            source_event(1, t0 + 1000, pg, "700:8192"),  # LSN 0/2000
            source_event(101, t0 + 2000, shop, "3e11fa47-71ca:5"),
            source_event(2, t0 + 3000, pg, "701:8448"),  # LSN 0/2100
            source_event(102, t0 + 4000, shop, "3e11fa47-71ca:7"),
            source_event(103, t0 + 4000, shop, "3e11fa47-71ca:7"),
        ]
    )
    target = str(tmp_path / "t")

    def apply() -> None:
        query = (
            spark.readStream.format("replog")
            .load(log.url)
            .writeStream.foreachBatch(
                apply_changes(target, ["id"], app_id="two", schema="id long, v string")
            )
            .option("checkpointLocation", str(tmp_path / "chk"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    apply()
    log.append([source_event(104, t0 + 9000, shop, "3e11fa47-71ca:9")])
    apply()
    table = open_table(target, None)
    assert table is not None
    infos = [c["replog"] for c in sorted(table.history(), key=lambda c: c["version"])]
    assert [sorted(i["sources"]) for i in infos] == [
        ["mysql:shop", "postgresql:pg-a"],
        ["mysql:shop"],
    ]
    first, second = infos
    assert first["sources"]["postgresql:pg-a"] == {
        "first_lsn": "0/2000", "last_lsn": "0/2100", "first_position": 0x2000,
        "last_position": 0x2100, "first_ms": t0 + 1000, "last_ms": t0 + 3000,
    }  # fmt: skip
    assert first["sources"]["mysql:shop"] == {
        "first_lsn": "0/5", "last_lsn": "0/7", "first_position": 5, "last_position": 7,
        "first_ms": t0 + 2000, "last_ms": t0 + 4000,
    }  # fmt: skip
    assert (first["batch"]["first_position"], first["batch"]["last_position"]) == (5, 0x2100)
    assert (first["batch"]["first_ms"], first["batch"]["last_ms"]) == (t0 + 1000, t0 + 4000)
    assert second["sources"]["mysql:shop"]["first_position"] == 9
    assert second["sources"]["mysql:shop"]["last_ms"] == t0 + 9000
    recorded = covered.Coverage.from_json(first)
    assert recorded.sources["postgresql:pg-a"] == covered.Span(0x2000, 0x2100, t0 + 1000, t0 + 3000)


def test_a_frame_of_the_drivers_rows_leaves_the_sessions_arrow_batches_as_they_were(
    spark: Any,
) -> None:
    """The as-of result (the driver's Arrow rows) becomes a DataFrame handed over in
    large Arrow batches (the speed is measured in bench_as_of.py); every row arrives, and
    the session's ``maxRecordsPerBatch`` is what it was, set or not."""
    table = pa.table({"id": pa.array(range(200_000), pa.int64()), "v": ["x"] * 200_000})
    total = sum(range(200_000))
    for given in (None, "777"):
        if given is None:
            spark.conf.unset(ARROW_BATCH)
        else:
            spark.conf.set(ARROW_BATCH, given)
        try:
            frame = frame_of(spark, table)
            assert spark.conf.get(ARROW_BATCH, None) == given
            assert frame.count() == 200_000
            assert frame.selectExpr("sum(id) AS s").first()["s"] == total  # type: ignore[index]
        finally:
            spark.conf.unset(ARROW_BATCH)
