"""Source benchmark: replog vs readStream.parquet vs a pre-built-batch Python source.

All three stream the same events into Spark's ``noop`` sink with Trigger.AvailableNow,
in one SparkSession (``local[2]``), interleaved, each run with a fresh checkpoint. Per
source it reports the median over the runs of: events/s over the whole query (start()
to termination), events/s within its micro-batch (Spark's own ``processedRowsPerSecond``:
the batch's ``triggerExecution``), and the time from start() to the first batch (for a
Python source, Spark starts a Python process per query there). Then it times the
driver's planning (``latestOffset`` + ``partitions``) for one new commit on logs of 100
and 10,000 commits.

Run: PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/python benchmarks/bench_source.py
[--events 1000000] [--runs 5]. Prints Markdown rows for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from ceiling import SCHEMA_DDL, CeilingSource
from proc_cpu import load_average, tree_cpu_seconds
from pyspark.sql.streaming.datasource import ReadAllAvailable
from workload import Run, bench_session, stream_run, workload

from replog.format.events import EVENT_SCHEMA
from replog.log import ReplicationLog
from replog.spark.options import SourceOptions
from replog.spark.schema import SPARK_SCHEMA_DDL
from replog.spark.source import ReplogStreamReader

SHARDS = 8
COMMIT_EVENTS = 250_000
CEILING_BATCH_ROWS = 100_000


# -- inputs ---------------------------------------------------------------------------------


def build_inputs(root: Path, events: int) -> tuple[str, str, str, int]:
    """The log, the same events as Parquet files (one per segment), a ceiling template."""
    log = ReplicationLog.create(str(root / "log"), SHARDS)
    for offset in range(0, events, COMMIT_EVENTS):
        log.append(workload(min(COMMIT_EVENTS, events - offset), offset))
    parquet_dir = root / "parquet"
    parquet_dir.mkdir()
    files = 0
    for shard in range(SHARDS):
        for segment in log.state().segments[shard]:
            table = log.read_table(shard, segment.first_sequence, segment.last_sequence)
            pq.write_table(table, parquet_dir / f"{shard:02d}-{segment.first_sequence:09d}.parquet")
            files += 1
    template = log.read_table(0).slice(0, 1024).cast(EVENT_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, template.schema) as writer:
        writer.write_table(template)
    template_path = root / "template.arrow"
    template_path.write_bytes(sink.getvalue().to_pybytes())
    # The ceiling gets as many tasks as replog plans: per-task cost is part of the API.
    reader = ReplogStreamReader(SourceOptions(path=str(root / "log"), starting_offsets="earliest"))
    start = reader.initialOffset()
    tasks = len(reader.partitions(start, reader.latestOffset(start, ReadAllAvailable())))
    print(f"{events:,} events: {files} segments = Parquet files; replog plans {tasks} tasks")
    return str(root / "log"), str(parquet_dir), str(template_path), tasks


# -- planning cost ----------------------------------------------------------------------


def planning_ms(root: Path, commits: int, samples: int = 20) -> tuple[float, float]:
    """(cold, steady) ms of latestOffset+partitions when one commit is new."""
    url = str(root / f"plan-{commits}")
    writer = ReplicationLog.create(url, SHARDS)
    for i in range(commits - samples):
        writer.append([{"key": f"k{i}", "data": "x"}])
    options = SourceOptions(path=url, starting_offsets="latest")
    start_offset = ReplogStreamReader(options).initialOffset()
    cold_start = time.perf_counter()  # a restarted query: a new reader, the log unread
    reader = ReplogStreamReader(options)
    end = reader.latestOffset(start_offset, ReadAllAvailable())
    reader.partitions(start_offset, end)
    cold = (time.perf_counter() - cold_start) * 1000
    steady = []
    for i in range(samples):
        writer.append([{"key": f"new{i}", "data": "x"}])
        begin = time.perf_counter()
        new_end = reader.latestOffset(end, ReadAllAvailable())
        tasks = reader.partitions(end, new_end)
        steady.append((time.perf_counter() - begin) * 1000)
        assert sum(t.events for p in tasks for t in p.tasks) == 1, tasks
        end = new_end
    return cold, statistics.median(steady)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--commits", default="100,10000")
    args = parser.parse_args()
    if SCHEMA_DDL != SPARK_SCHEMA_DDL:
        raise SystemExit("benchmarks/ceiling.py's SCHEMA_DDL no longer matches replog's schema")
    root = Path(tempfile.mkdtemp(prefix="replog-bench-source-"))
    try:
        log_url, parquet_dir, template, tasks = build_inputs(root, args.events)
        spark = bench_session()
        spark.dataSource.register(CeilingSource)
        schema = spark.read.parquet(parquet_dir).schema
        readers = {
            "replog": lambda: (
                spark.readStream.format("replog")
                .option("startingOffsets", "earliest")
                .load(log_url)
            ),
            "readStream.parquet": lambda: spark.readStream.schema(schema).parquet(parquet_dir),
            "pre-built-batch Python source": lambda: (
                spark.readStream.format("ceiling")
                .option("rows", str(args.events))
                .option("tasks", str(tasks))
                .option("template", template)
                .load()
            ),
        }
        results: dict[str, list[Run]] = {name: [] for name in readers}
        cpu: dict[str, list[float]] = {name: [] for name in readers}
        loads = [load_average()]
        names = list(readers)
        for run in range(args.runs + 1):  # run 0 warms up the JVM and the workers
            # rotated, so that no source always runs right after the same other one
            for name in names[run % len(names) :] + names[: run % len(names)]:
                before = tree_cpu_seconds()
                result = stream_run(readers[name](), root / "checkpoint")
                used = tree_cpu_seconds() - before
                if result.rows != args.events:
                    raise SystemExit(f"{name} read {result.rows} rows, expected {args.events}")
                if run:
                    results[name].append(result)
                    cpu[name].append(used)
            loads.append(load_average())
        spark.stop()
        print(f"load average (1 min) before and after each round: {', '.join(loads)}")
        print_results(results, args.events, tasks, cpu)
        print()
        print(
            "| planning: latestOffset + partitions, one new commit | cold (first call) "
            "| steady (median of 20) |"
        )
        print("|---|---|---|")
        for commits in (int(c) for c in args.commits.split(",") if c):
            cold, steady = planning_ms(root, commits)
            print(f"| log of {commits:,} commits | {cold:.1f} ms | {steady:.2f} ms |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def print_results(
    results: dict[str, list[Run]], events: int, tasks: int, cpu: dict[str, list[float]]
) -> None:
    """Medians per source, then replog's ratios to the other two, and each round's."""
    runs = len(next(iter(results.values())))
    whole = {n: statistics.median(events / r.seconds for r in rs) for n, rs in results.items()}
    batch = {
        n: statistics.median(events / r.batch_seconds for r in rs) for n, rs in results.items()
    }
    start = {n: statistics.median(r.to_first_batch for r in rs) for n, rs in results.items()}
    spent = {n: statistics.median(values) for n, values in cpu.items()}
    print(
        f"| source ({events:,} events, {tasks} tasks, noop, AvailableNow, median of {runs}) "
        f"| events/s, whole query | events/s in the micro-batch | start() to first batch "
        f"| CPU s (Spark and its Python processes) | whole-query runs |"
    )
    print("|---|---|---|---|---|---|")
    for name, rs in results.items():
        each = ", ".join(f"{events / r.seconds:,.0f}" for r in rs)
        print(
            f"| {name} | {whole[name]:,.0f} | {batch[name]:,.0f} | {start[name]:.2f} s "
            f"| {spent[name]:.2f} | {each} |"
        )
    for other in ("readStream.parquet", "pre-built-batch Python source"):
        print(
            f"| replog / {other} | {whole['replog'] / whole[other]:.2f} "
            f"| {batch['replog'] / batch[other]:.2f} | | {spent['replog'] / spent[other]:.2f} | |"
        )
    rounds = zip(results["replog"], results["pre-built-batch Python source"], strict=True)
    print(
        "per-round replog/ceiling, whole query: "
        + ", ".join(f"{ceiling.seconds / mine.seconds:.2f}" for mine, ceiling in rounds)
    )


if __name__ == "__main__":
    main()
