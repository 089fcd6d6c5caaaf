"""End-to-end replication latency: append to log A → replog → replog-sink → visible in B.

A producer appends ``--batch`` events every ``--interval`` seconds to A; a query
replicates A into B with ``processingTime=0``; an observer polls B's head and reads new
events as they become visible. Latency of an event = the time it became visible in B
minus the time its append to A returned. Reports p50, p90, p99 and max, and the mean
per-stage durations Spark reports for the micro-batches (planning: latestOffset and
queryPlanning; read + stage + commit: addBatch; Spark's own WAL and commit log).

Run: .venv/bin/python benchmarks/bench_latency.py [--seconds 30] [--batch 500] [--interval 0.5]
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from workload import bench_session

from replog.log import ReplicationLog

SHARDS = 8


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _stamp(progress: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(progress["timestamp"].replace("Z", "+00:00")).timestamp() * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--poll", type=float, default=0.01)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="replog-bench-latency-"))
    source = ReplicationLog.create(str(root / "A"), SHARDS)
    target_url = str(root / "B")
    ReplicationLog.create(target_url, SHARDS)
    spark = bench_session()
    appended_at: dict[str, float] = {}
    visible_at: dict[str, float] = {}
    stop = threading.Event()
    try:
        query = (
            spark.readStream.format("replog")
            .load(source.url)
            .writeStream.format("replog-sink")
            .option("checkpointLocation", str(root / "chk"))
            .trigger(processingTime="0 seconds")
            .start(target_url)
        )
        # Warm up: the first micro-batch with data spawns the Python workers (seconds).
        source.append([{"event_id": f"warm-{i}", "key": f"w{i}", "data": i} for i in range(100)])
        warm = ReplicationLog.open(target_url)
        while sum(warm.refresh().heads) < 100:
            time.sleep(0.1)
        time.sleep(1)
        warmup_batches = len(query.recentProgress)

        def produce() -> None:
            writer = ReplicationLog.open(source.url)
            n = 0
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                started = time.monotonic()
                ids = [f"e{n + i}" for i in range(args.batch)]
                writer.append(
                    [{"event_id": i, "key": f"k{hash(i) % 997}", "data": {"v": i}} for i in ids]
                )
                done = time.monotonic()
                for event_id in ids:
                    appended_at[event_id] = done
                n += args.batch
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))

        def observe() -> None:
            target = ReplicationLog.open(target_url)
            seen = [0] * SHARDS
            while not stop.is_set():
                heads = target.refresh().heads
                now = time.monotonic()
                for shard, head in enumerate(heads):
                    if head > seen[shard]:
                        table = target.read_table(shard, seen[shard] + 1, head)
                        for event_id in table.column("event_id").to_pylist():
                            visible_at.setdefault(event_id, now)
                        seen[shard] = head
                time.sleep(args.poll)

        observer = threading.Thread(target=observe, daemon=True)
        observer.start()
        produce()
        deadline = time.monotonic() + 30
        while len(visible_at) < len(appended_at) and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        observer.join()
        progress = [p for p in query.recentProgress[warmup_batches:] if p["numInputRows"] > 0]
        query.stop()
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)

    latencies = [visible_at[e] - appended_at[e] for e in appended_at if e in visible_at]
    missing = len(appended_at) - len(latencies)
    print(
        f"{len(appended_at):,} events in {args.seconds:.0f}s "
        f"({args.batch} every {args.interval}s), {missing} not visible after 30 s"
    )
    print("| p50 | p90 | p99 | max |")
    print("|---|---|---|---|")
    print(
        "| "
        + " | ".join(
            f"{value:.3f} s"
            for value in (
                percentile(latencies, 0.5),
                percentile(latencies, 0.9),
                percentile(latencies, 0.99),
                max(latencies),
            )
        )
        + " |"
    )
    stages: dict[str, list[float]] = defaultdict(list)
    for report in progress:
        for stage, millis in report["durationMs"].items():
            stages[stage].append(millis)
    print(f"\nper micro-batch with data ({len(progress)} batches), ms:")
    starts = [_stamp(report) for report in progress]
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    if gaps:
        print(f"time between batch starts: mean {statistics.mean(gaps):.0f}, max {max(gaps):.0f}")
    print("| | " + " | ".join(sorted(stages)) + " |")
    print("|---|" + "---|" * len(stages))
    print(
        "| mean | " + " | ".join(f"{statistics.mean(stages[s]):.0f}" for s in sorted(stages)) + " |"
    )
    print("| max | " + " | ".join(f"{max(stages[s]):.0f}" for s in sorted(stages)) + " |")


if __name__ == "__main__":
    main()
