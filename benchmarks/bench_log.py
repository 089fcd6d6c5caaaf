"""Foundation benchmark: append throughput, shard read vs plain pyarrow, head finding.

Run: .venv/bin/python benchmarks/bench_log.py [--events 1000000] [--dir bench-data]
Prints a Markdown table; figures are copied into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import pyarrow as pa
from pyarrow import ipc
from workload import timed, workload

from replog.log import ReplicationLog


def bench_append(root: Path, events: int) -> tuple[ReplicationLog, float, float]:
    table = workload(events)
    payload = sum(len(v) for v in table.column("data").to_pylist()[:1000]) / 1000
    url = str(root / "append")
    log = ReplicationLog.create(url, 8)
    start = time.perf_counter()
    log.append(table)
    seconds = time.perf_counter() - start
    return log, events / seconds, payload


def bench_read(log: ReplicationLog) -> tuple[float, float]:
    segments = [s for lane in log.refresh().segments for s in lane]
    events = sum(s.events for s in segments)

    def replog_read() -> None:
        for shard in range(log.shards):
            for _ in log.read(shard):
                pass

    def plain_pyarrow() -> None:
        for segment in segments:
            data = log.storage.read(segment.path)
            ipc.open_file(pa.BufferReader(data)).read_all()

    return events / timed(replog_read), events / timed(plain_pyarrow)


def bench_head(root: Path, commits: int) -> float:
    url = str(root / f"head-{commits}")
    writer = ReplicationLog.create(url, 8)
    for i in range(commits):
        writer.append([{"key": f"k{i}", "data": "x"}])
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        ReplicationLog.open(url).head()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--dir", default="bench-data")
    parser.add_argument("--commits", default="10,1000,10000")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    log, append_rate, payload = bench_append(root, args.events)
    print(
        f"| append {args.events:,} events (~{payload:.0f}-byte payloads), local disk, "
        f"one commit | {append_rate:,.0f} events/s |"
    )
    replog_rate, plain_rate = bench_read(log)
    print(
        f"| read all shards through replog (checksums, shard/sequence columns) | "
        f"{replog_rate:,.0f} events/s |"
    )
    print(f"| read the same segment files with plain pyarrow | {plain_rate:,.0f} events/s |")
    print(f"| ratio replog / plain pyarrow | {replog_rate / plain_rate:.2f} |")
    for commits in (int(c) for c in args.commits.split(",")):
        print(
            f"| open + find head after {commits:,} commits (median of 5) | "
            f"{bench_head(root, commits):.1f} ms |"
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
