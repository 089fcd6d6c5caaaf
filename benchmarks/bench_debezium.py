"""replog capture against Debezium's PostgreSQL connector, on the same database in one run.

    nice .venv/bin/python benchmarks/bench_debezium.py [--scales 10,100] [--transactions 20000]

Debezium 3.6.1 runs in its embedded engine (jvm/debezium, ``make jars``), each record
serialized by Kafka Connect's JsonConverter (schemas on, as Connect's default) and written
to a local file: what a Connect worker does before its producer sends. replog runs as
``replog capture postgres`` (the CLI) into a local log. Both reach the embedded server
(Unix socket only) the same way, by its socket: Debezium's JDBC driver through junixsocket's
socket factory (tests/support/debezium_peer.py).

* snapshot: pgbench's ``pgbench_accounts`` at scale 10 and 100 (1M and 10M rows): rows/s
  from start to the last row read, and the process's peak RSS (Debezium: the JVM with its
  default heap, a quarter of the machine's memory). Debezium's records are serialized
  as Connect's JsonConverter does but only counted (its ``count`` mode: 10M records with
  their schemas are ~23 GB); replog's log is written, as a capture writes it;
* streaming: pgbench's TPC-B-like transactions (3 updates, 1 insert) run with nothing
  capturing, then each reads the backlog: row changes/s (replog: the capture's run;
  Debezium: first to last change record, the JVM's start left out);
* latency: both follow while pgbench commits at a fixed rate (``-R``) on two clients: per
  change, source commit (``source.ts_ms``) to the event being visible (replog: a reader
  polling the log every 10 ms; Debezium: the engine handing the record over), p50/p95.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the Debezium peer
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import accounts, capture_command, measured, pgbench, running_server
from support.debezium_peer import DebeziumPeer, change_value

from replog.capture.options import CaptureOptions
from replog.capture.postgres import PostgresCapture, capture
from replog.log import ReplicationLog
from replog.timeutil import now_ms

TABLES = ("public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers",
          "public.pgbench_history")  # fmt: skip


def peak_rss_mb(pid: int) -> float:
    """A live process's peak resident memory (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def snapshot(scale: int) -> dict[str, Any]:
    with running_server() as server, server.database() as dsn:
        rows = accounts(dsn, scale)
        root = Path(tempfile.mkdtemp(prefix="bench-debezium-"))
        code, seconds, rss = measured(
            capture_command(dsn, str(root / "log"), "replog", "--drop-slot")
        )
        assert code == 0, code
        replog = {"seconds": round(seconds, 1), "rows_per_s": round(rows / seconds),
                  "peak_rss_mb": round(rss)}  # fmt: skip
        started = time.perf_counter()
        with DebeziumPeer(
            dsn, root / "debezium", tables=("public.pgbench_accounts",), variants="count",
            snapshot="initial", extra={"provide.transaction.metadata": "false"},
        ) as peer:  # fmt: skip
            peer.wait_for_text(rb"\"snapshot\":\"last\"")
            seconds = time.perf_counter() - started
            rss = peak_rss_mb(peer.process.pid)
        read = sum(json.loads(line).get("count", 0) for line in peer.output.open("rb"))
        assert read == rows, (read, rows)
        debezium = {"seconds": round(seconds, 1), "rows_per_s": round(rows / seconds),
                    "peak_rss_mb": round(rss)}  # fmt: skip
        return {"rows": rows, "replog": replog, "debezium": debezium}


def streaming(transactions: int) -> dict[str, Any]:
    with running_server() as server, server.database() as dsn:
        pgbench(dsn, "-i", "-s", "1", "-q")
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute("ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY")
        root = Path(tempfile.mkdtemp(prefix="bench-debezium-"))
        log = ReplicationLog.create(str(root / "log"), 8)
        options = CaptureOptions(dsn, "replog", tables=TABLES, snapshot="never")
        capture(options, log)  # the slot, at the start of the backlog
        settings = {"snapshot": "no_data", "extra": {"provide.transaction.metadata": "false"}}
        with DebeziumPeer(dsn, root / "debezium-0", tables=TABLES, variants="kafka",
                          **settings) as first:  # fmt: skip
            time.sleep(5)  # its slot made and streaming: then stopped
        del first
        pgbench(dsn, "-n", "-c", "2", "-t", str(transactions // 2))
        started = time.perf_counter()
        progress = capture(options, log)
        replog_s = time.perf_counter() - started
        changes = progress.rows
        directory = root / "debezium-0"  # the same offsets: it resumes at its slot
        (directory / "records.jsonl").unlink()
        with DebeziumPeer(dsn, directory, tables=TABLES, variants="kafka", **settings) as peer:
            peer.wait_for_text(rb"\"op\":", changes)
        records = [r for r in peer.records() if change_value(r) is not None]
        count = len(records)
        stamps = [r["at_ms"] for r in records]
        debezium_s = (max(stamps) - min(stamps)) / 1000
        return {
            "transactions": transactions,
            "row_changes": changes,
            "replog_changes_per_s": round(changes / replog_s),
            "debezium_changes_per_s": round(changes / debezium_s) if debezium_s else None,
            "debezium_records": count,
        }


def latency(seconds: int, rate: int) -> dict[str, Any]:
    with running_server() as server, server.database() as dsn:
        pgbench(dsn, "-i", "-s", "1", "-q")
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute("ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY")
        root = Path(tempfile.mkdtemp(prefix="bench-debezium-"))
        url = str(root / "log")
        stop = threading.Event()
        options = CaptureOptions(dsn, "replog", tables=TABLES, snapshot="never", follow=True)
        running = PostgresCapture(options, ReplicationLog.create(url, 8), stop=stop)
        follower = threading.Thread(target=running.run, daemon=True)
        follower.start()
        reader = ReplicationLog.open(url)
        seen = dict.fromkeys(range(reader.shards), 0)
        replog_delays: list[int] = []

        def read_new() -> None:
            for shard, head in enumerate(reader.refresh().heads):
                if head > seen[shard]:
                    table = reader.read_table(shard, seen[shard] + 1, head)
                    now = now_ms()
                    for metadata in table.column("metadata").to_pylist():
                        replog_delays.append(now - json.loads(metadata)["source"]["ts_ms"])
                    seen[shard] = head

        settings = {"snapshot": "no_data", "extra": {"provide.transaction.metadata": "false"}}
        with DebeziumPeer(dsn, root / "debezium", tables=TABLES, variants="kafka",
                          **settings) as peer:  # fmt: skip
            time.sleep(5)  # streaming
            load = threading.Thread(
                target=pgbench, args=(dsn, "-n", "-c", "2", "-T", str(seconds), "-R", str(rate))
            )
            load.start()
            while load.is_alive():
                read_new()
                time.sleep(0.01)
            time.sleep(3)
            read_new()
        stop.set()
        follower.join()
        running.close()
        debezium_delays = [
            r["at_ms"] - envelope["source"]["ts_ms"]
            for r in peer.records()
            if (envelope := change_value(r)) is not None
        ]

        def summary(delays: list[int]) -> dict[str, Any]:
            delays = sorted(delays)
            return {"changes": len(delays), "p50_ms": statistics.median(delays),
                    "p95_ms": delays[int(len(delays) * 0.95) - 1]}  # fmt: skip

        return {"seconds": seconds, "rate_tps": rate,
                "replog": summary(replog_delays), "debezium": summary(debezium_delays)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scales", default="10,100", help="pgbench scales: 10 = 1M rows")
    parser.add_argument("--transactions", type=int, default=20_000)
    parser.add_argument("--latency-seconds", type=int, default=60)
    parser.add_argument("--rate", type=int, default=100, help="pgbench transactions/s")
    args = parser.parse_args()
    for scale in (int(s) for s in args.scales.split(",") if s):
        print("snapshot:", json.dumps(snapshot(scale)), flush=True)
    print("streaming:", json.dumps(streaming(args.transactions)), flush=True)
    print("latency:", json.dumps(latency(args.latency_seconds, args.rate)), flush=True)


if __name__ == "__main__":
    main()
