"""The MySQL job, end to end: MariaDB -> replog capture mysql -> Spark -> apply_changes -> Delta.

1. Start MariaDB (Debian's ``mariadb-server`` in a temporary directory, ROW binlog with
   GTIDs; ``examples/embedded_mariadb.py``) and create ``shop.orders`` with a first batch
   of orders.
2. Capture it (``replog capture mysql`` from Python): a snapshot in chunks between
   watermark rows, then, while an order workload runs (inserts, updates, deletes, key
   changes, ``decimal(12,2)`` amounts, an ENUM, a ``datetime(6)``, 4-byte UTF-8 names,
   NULLs, and ``ALTER TABLE ... ADD COLUMN discount`` half-way), a following capture turns
   each source transaction into part of exactly one log commit. A last capture after the
   workload catches up (a restart: it resumes at the log's binlog position).
3. Spark streams the log -> ``apply_changes(..., log=)`` (keys and types from the schemas
   capture registered) -> Delta table ``orders-delta``.
4. Compares the Delta table (read with ``deltalake``, no Spark) with the MariaDB table row
   by row: exact decimals, wall-clock DATETIMEs, NULLs. Exits 1 if they differ.

Usage: python examples/demo_mysql.py [--orders 4000] [--transactions 4000] [--dir demo-data]
(``--dsn mysql://user:password@host:port/database`` captures from a server you run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pymysql
from demo import (
    Comparison,
    compare,
    delta_rows,
    demo_main,
    follow_while,
    run_query,
    show_differences,
    spark_session,
)
from embedded_mariadb import USER, running_server
from pyspark.sql import SparkSession

from replog.capture.mysql.capture import capture
from replog.capture.mysql.options import Dsn, MySqlOptions
from replog.log import ReplicationLog
from replog.spark.functions import apply_changes

COLUMNS = ("id", "customer", "email", "total", "status", "note", "placed_at", "discount")
CREATE = """
CREATE TABLE orders (
    id bigint PRIMARY KEY,
    customer varchar(40) NOT NULL,
    email varchar(80),
    total decimal(12, 2),
    status enum('new', 'paid', 'shipped', 'cancelled') NOT NULL,
    note text,
    placed_at datetime(6) NOT NULL
) DEFAULT CHARSET utf8mb4
"""
STATUSES = ("new", "paid", "shipped", "cancelled")
NAMES = ("Zoë", "Åsa", "李雷", "Ana 😀", "Bob")


def connect(dsn: str) -> pymysql.Connection[Any]:
    """A session of the demo's own (autocommit off: each transaction is committed); the
    DSN's user needs to write ``orders`` too (the throwaway server's is granted that)."""
    parsed = Dsn.parse(dsn)
    return pymysql.connect(
        host=parsed.host, port=parsed.port, user=parsed.user, password=parsed.password,
        database=parsed.database, charset="utf8mb4", autocommit=False,
    )  # fmt: skip


class Workload:
    """Orders placed, changed, re-keyed and deleted in small transactions; ``discount``
    is added half-way (``ALTER TABLE``, a schema change in the binlog)."""

    def __init__(self, dsn: str, seed: int = 7) -> None:
        self.dsn = dsn
        self.random = random.Random(seed)
        self.changes: Counter[str] = Counter()
        self.next_id = 1

    def create(self, orders: int) -> None:
        with closing(connect(self.dsn)) as connection, connection.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS orders")
            cursor.execute(CREATE)
            cursor.executemany(
                "INSERT INTO orders VALUES (%s, %s, %s, %s, %s, %s, %s)",
                [self._order() for _ in range(orders)],
            )
            connection.commit()

    def _order(self) -> tuple[Any, ...]:
        key, self.next_id = self.next_id, self.next_id + 1
        pick = self.random
        return (
            key,
            f"{pick.choice(NAMES)} {key}",
            None if key % 7 == 0 else f"customer{key}@example.com",
            Decimal(pick.randrange(0, 1_000_000)) / 100,
            pick.choice(STATUSES),
            None if key % 3 else f"note {key}",
            dt.datetime(2024, 1, 1) + dt.timedelta(microseconds=pick.randrange(10**13)),
        )

    def run(self, transactions: int) -> None:
        with closing(connect(self.dsn)) as connection, connection.cursor() as cursor:
            for number in range(transactions):
                if number == transactions // 2:
                    cursor.execute("ALTER TABLE orders ADD COLUMN discount decimal(12,2) NULL")
                    self.changes["alter"] += 1
                for _ in range(self.random.randint(1, 3)):
                    self._change(cursor, number >= transactions // 2)
                connection.commit()

    def _change(self, cursor: Any, discounted: bool) -> None:
        pick = self.random
        choice = pick.random()
        if choice < 0.4 or self.next_id < 10:
            row = self._order()
            columns = "id, customer, email, total, status, note, placed_at"
            cursor.execute(f"INSERT INTO orders ({columns}) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                           row)  # fmt: skip
            self.changes["insert"] += 1
            return
        key = pick.randrange(1, self.next_id)
        if choice < 0.75:
            discount = Decimal(pick.randrange(0, 5000)) / 100 if discounted else None
            assignments = "status = %s, total = total + 0.01"
            values: list[Any] = [pick.choice(STATUSES)]
            if discounted:
                assignments += ", discount = %s"
                values.append(discount)
            cursor.execute(f"UPDATE orders SET {assignments} WHERE id = %s", (*values, key))
            self.changes["update"] += cursor.rowcount
        elif choice < 0.85:
            cursor.execute("UPDATE orders SET id = %s WHERE id = %s", (self.next_id, key))
            self.next_id += 1
            self.changes["key change"] += cursor.rowcount
        else:
            cursor.execute("DELETE FROM orders WHERE id = %s", (key,))
            self.changes["delete"] += cursor.rowcount


def capture_while(dsn: str, log_url: str, workload: Workload, transactions: int) -> None:
    """Snapshot, then capture (following) while the workload runs, then catch up."""
    log = ReplicationLog.create(log_url, 4)
    options = MySqlOptions(dsn=dsn, tables=("orders",), follow=True)
    follow_while(
        lambda stop, progress: capture(options, log, stop=stop, progress=progress),
        lambda report: report.snapshot_completed,  # the workload's changes follow it
        lambda: workload.run(transactions),
    )
    last = capture(MySqlOptions(dsn=dsn, tables=("orders",)), log)
    where = last.to_json()
    print(f"  capture: caught up ({last.rows:,} rows in the final catch-up, "
          f"{where['commits']} commits)")  # fmt: skip


def spark_pipeline(spark: SparkSession, root: Path, log_url: str, collection: str) -> None:
    started = time.perf_counter()
    count = run_query(
        spark.readStream.format("replog")
        .option("consumer", "to-delta")
        .option("maxEventsPerTrigger", "10000")
        .load(log_url)
        .writeStream.foreachBatch(
            apply_changes(
                str(root / "orders-delta"), app_id="demo-mysql", log=log_url, collection=collection
            )
        )
        .option("checkpointLocation", str(root / "checkpoints" / "delta"))
        .trigger(availableNow=True)
        .start()
    )
    print(f"  apply: {count:,} events -> {root / 'orders-delta'} "
          f"in {time.perf_counter() - started:.1f}s")  # fmt: skip


def source_rows(dsn: str) -> dict[int, tuple[Any, ...]]:
    """MariaDB's rows by id (DATETIME as the wall-clock time it is)."""
    with closing(connect(dsn)) as connection, connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(COLUMNS)} FROM orders")
        return {row[0]: tuple(row) for row in cursor.fetchall()}


@contextmanager
def source_database(dsn: str | None) -> Iterator[str]:
    """``dsn``, or a database ``shop`` on a fresh MariaDB server."""
    if dsn is not None:
        yield dsn
        return
    started = time.perf_counter()
    with running_server() as server, server.database("shop") as shop:
        server.sql(f"GRANT ALL ON shop.* TO '{USER}'@'%'")  # the workload writes as it too
        print(f"1. MariaDB started (ROW binlog, GTIDs) in {time.perf_counter() - started:.1f}s")
        yield shop


def pipeline(
    dsn: str, root: Path, orders: int, transactions: int, spark: SparkSession | None = None
) -> Comparison:
    """Steps 2-4 against the database at ``dsn``, in ``root`` (emptied first). A given
    ``spark`` session is used and left running; else one is made and stopped."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log_url = str(root / "orders")
    workload = Workload(dsn)
    workload.create(orders)
    print(f"2. workload: {orders:,} orders, then {transactions:,} transactions "
          f"(ALTER TABLE orders ADD COLUMN discount half-way) while capture follows")  # fmt: skip
    started = time.perf_counter()
    capture_while(dsn, log_url, workload, transactions)
    changes = ", ".join(f"{n:,} {op}" for op, n in workload.changes.items())
    print(f"3. captured into {log_url} in {time.perf_counter() - started:.1f}s ({changes})")
    session = spark or spark_session()
    try:
        print("4. Spark: replog -> apply_changes (keys and types from the log's schemas)")
        spark_pipeline(session, root, log_url, f"{Dsn.parse(dsn).database}.orders")
    finally:
        if spark is None:
            session.stop()
    result = compare(source_rows(dsn), delta_rows(root / "orders-delta", COLUMNS), COLUMNS)
    print(f"5. Delta table vs MariaDB: {result.rows:,} rows, {len(result.missing)} missing, "
          f"{len(result.extra)} extra, {len(result.changed)} values differ")  # fmt: skip
    show_differences(result, "MariaDB")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    def run(args: argparse.Namespace) -> bool:
        with source_database(args.dsn) as dsn:
            root = Path(args.dir).resolve() / "mysql"
            return pipeline(dsn, root, args.orders, args.transactions).equal

    return demo_main(argv, __doc__, "MariaDB", 4_000, run)


if __name__ == "__main__":
    raise SystemExit(main())
