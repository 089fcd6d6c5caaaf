"""apply_changes at scale (issue 31, goal 5): what a batch costs as the table grows.

Each figure is printed beside its goal, at each table size (default 1M and 10M rows):

- **load**: a snapshot into an empty table, in chunks of ``--chunk`` rows: the first chunk
  creates the table, the next ones hold new keys only and are appended, not merged.
  Goal: at least 200,000 rows/s into Delta.
- **locality**: batches of 10,000 updates of the newest 100,000 keys (an order system's
  updates). Goal: the time per batch at 10M rows within 1.5x of the time at 1M rows.
- **random**: batches of 10,000 updates of uniformly random keys. Goal: the time is
  proportional to the bytes of the files a batch rewrites (a merge is copy-on-write:
  delta-rs writes no deletion vectors), reported as MB rewritten and MB/s.
- **memory**: the driver's peak RSS during the batches (Linux ``VmHWM``, reset before
  them). Goal: it does not grow with the table.

``--layout`` adds the layout table at the largest size: target file sizes, and a
random-key workload with inserts (which widens the files' key ranges) before and after
``optimize.z_order(["id"])``. ``--spark`` adds the same through ``apply_changes`` in
Spark (micro-batch DataFrames, JSON payloads) and the baselines: Spark writing the same
rows to Parquet, and Spark rewriting the whole Parquet table for a batch (what a merge
costs without a table format).

Run: .venv/bin/python benchmarks/bench_apply_scale.py [--rows 1000000,10000000]
[--batches 5] [--chunk 1000000] [--layout] [--spark]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from replog.tables import changes as rows
from replog.tables.delta import TARGET_FILE_SIZE, apply_batch, open_table

NOW = datetime(2024, 1, 1, tzinfo=timezone.utc)
BATCH = 10_000
RECENT = 100_000
SCHEMA = "id long, name string, price double"


def changes(ids: np.ndarray, operation: str | list[str], first_sequence: int) -> pa.Table:
    """A batch of changes for the core (what Spark's reduction hands the driver)."""
    count = len(ids)
    ops = [operation] * count if isinstance(operation, str) else operation
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"name-{i}-{first_sequence}" for i in ids]),
            "price": pa.array(np.random.default_rng(first_sequence).random(count)),
            rows.SHARD: pa.array(np.zeros(count, np.int32)),
            rows.SEQUENCE: pa.array(np.arange(first_sequence, first_sequence + count)),
            rows.OPERATION: pa.array(ops),
            rows.TIMESTAMP: pa.array([NOW] * count, pa.timestamp("us", tz="UTC")),
        }
    )


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux 4.0+)


def peak_mb() -> float:
    """The process's peak RSS since :func:`reset_peak`, MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def files(target: str) -> dict[str, int]:
    table = open_table(target, None)
    assert table is not None
    actions = pa.table(table.get_add_actions(flatten=True))
    return dict(
        zip(
            actions.column("path").to_pylist(),
            actions.column("size_bytes").to_pylist(),
            strict=True,
        )
    )


@dataclass
class Table:
    """A benchmark table and the state its batches go on from."""

    target: str
    rows: int
    sequence: int
    batch_id: int = 1
    next_id: int = 0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(1))

    def apply(self, batch: pa.Table) -> tuple[float, int]:
        """One batch: seconds, and bytes of the files it removed (rewrote)."""
        before = files(self.target)
        start = time.perf_counter()
        apply_batch(self.target, batch, ["id"], app_id="bench", batch_id=self.batch_id)
        seconds = time.perf_counter() - start
        self.batch_id += 1
        self.sequence += batch.num_rows
        after = files(self.target)
        return seconds, sum(size for path, size in before.items() if path not in after)


def load(
    where: str, count: int, chunk: int, file_size: int | None, name: str = "t"
) -> tuple[Table, float]:
    """A table of ``count`` rows loaded in chunks; rows/s of the load."""
    target = f"{where}/{name}{count}-{file_size}"
    start = time.perf_counter()
    for number, first in enumerate(range(0, count, chunk)):
        ids = np.arange(first, min(first + chunk, count))
        apply_batch(
            target,
            changes(ids, "insert", first),
            ["id"],
            app_id="bench",
            batch_id=number,
            target_file_size=file_size,
        )
    rate = count / (time.perf_counter() - start)
    table = Table(target, count, count, batch_id=number + 1, next_id=count)
    return table, rate


def locality(table: Table) -> pa.Table:
    ids = table.rng.choice(np.arange(table.next_id - RECENT, table.next_id), BATCH, replace=False)
    return changes(ids, "update", table.sequence)


def uniform(table: Table) -> pa.Table:
    return changes(table.rng.choice(table.next_id, BATCH, replace=False), "update", table.sequence)


def with_inserts(table: Table) -> pa.Table:
    """80% random updates, 20% inserts of new keys: rewritten files take the new keys."""
    updates = table.rng.choice(table.next_id, BATCH * 8 // 10, replace=False)
    fresh = np.arange(table.next_id, table.next_id + BATCH - len(updates))
    table.next_id += len(fresh)
    ops = ["update"] * len(updates) + ["insert"] * len(fresh)
    return changes(np.concatenate([updates, fresh]), ops, table.sequence)


def run(table: Table, make: Callable[[Table], pa.Table], count: int) -> tuple[float, float]:
    """Median seconds per batch and median bytes rewritten per batch."""
    measured = [table.apply(make(table)) for _ in range(count)]
    return statistics.median(m[0] for m in measured), statistics.median(m[1] for m in measured)


def one_size(count: int, batches: int, chunk: int) -> dict[str, float]:
    """The core's figures at one table size. The table is loaded by a process of its own,
    so that this one's peak memory is the batches' (and the table's log's) only."""
    with tempfile.TemporaryDirectory() as where:
        command = [sys.executable, __file__, "--load", str(count), "--chunk", str(chunk)]
        loaded = subprocess.run([*command, "--where", where], capture_output=True, check=True)
        rate = float(loaded.stdout.decode().strip().splitlines()[-1])
        table = Table(f"{where}/t{count}-{TARGET_FILE_SIZE}", count, count,
                      batch_id=-(-count // chunk), next_id=count)  # fmt: skip
        reset_peak()
        near, near_bytes = run(table, locality, batches)
        near_peak = peak_mb()
        reset_peak()
        far, far_bytes = run(table, uniform, batches)
        return {
            "load": rate,
            "locality": near,
            "locality_mb": near_bytes / 1e6,
            "locality_peak_mb": near_peak,
            "random": far,
            "random_mb": far_bytes / 1e6,
            "random_peak_mb": peak_mb(),
            "files": len(files(table.target)),
        }


def core(sizes: list[int], batches: int, chunk: int) -> dict[int, dict[str, float]]:
    results = {}
    for count in sizes:
        command = [sys.executable, __file__, "--one", str(count), "--batches", str(batches)]
        done = subprocess.run([*command, "--chunk", str(chunk)], capture_output=True, check=True)
        results[count] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return results


def print_core(results: dict[int, dict[str, float]]) -> None:
    sizes = sorted(results)
    small, large = results[sizes[0]], results[sizes[-1]]
    print(f"\n## Core (apply_batch), target file size {TARGET_FILE_SIZE >> 20} MiB\n")
    print(
        "| table rows | files | load rows/s | locality s/batch (MB rewritten) | "
        "random s/batch (MB rewritten, MB/s) | peak RSS MB (locality, random) |"
    )
    print("|---|---|---|---|---|---|")
    for count in sizes:
        r = results[count]
        print(
            f"| {count:,} | {r['files']:.0f} | {r['load']:,.0f} | {r['locality']:.2f} "
            f"({r['locality_mb']:.0f}) | {r['random']:.2f} ({r['random_mb']:.0f}, "
            f"{r['random_mb'] / r['random']:.0f}) | {r['locality_peak_mb']:.0f}, "
            f"{r['random_peak_mb']:.0f} |"
        )
    print("\n| goal | figure | met |\n|---|---|---|")
    worst_load = min(r["load"] for r in results.values())
    print(f"| load >= 200,000 rows/s | {worst_load:,.0f} rows/s | {worst_load >= 200_000} |")
    ratio = large["locality"] / small["locality"]
    print(
        f"| locality: {sizes[-1]:,} within 1.5x of {sizes[0]:,} | {large['locality']:.2f} / "
        f"{small['locality']:.2f} s = {ratio:.2f}x | {ratio <= 1.5} |"
    )
    rates = [r["random_mb"] / r["random"] for r in results.values()]
    print(
        f"| random: time proportional to bytes rewritten | "
        f"{' vs '.join(f'{rate:.0f}' for rate in rates)} MB/s | {max(rates) / min(rates) <= 1.5} |"
    )
    growth = large["locality_peak_mb"] / small["locality_peak_mb"]
    print(
        f"| driver memory does not grow with the table (locality batches) | "
        f"{small['locality_peak_mb']:.0f} vs {large['locality_peak_mb']:.0f} MB peak RSS "
        f"({growth:.2f}x) | {growth <= 1.5} |"
    )


def layout(count: int, batches: int, chunk: int) -> None:
    print(f"\n## Layout at {count:,} rows (core, {BATCH:,}-change batches)\n")
    print("| layout | files | locality s/batch (MB rewritten) | random s/batch (MB rewritten) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as where:
        for size in (8 << 20, 32 << 20, 128 << 20):
            table, _ = load(where, count, chunk, size)
            near, near_bytes = run(table, locality, batches)
            far, far_bytes = run(table, uniform, batches)
            print(
                f"| target file size {size >> 20} MiB | {len(files(table.target))} | "
                f"{near:.2f} ({near_bytes / 1e6:.0f}) | {far:.2f} ({far_bytes / 1e6:.0f}) |"
            )
        table, _ = load(where, count, chunk, TARGET_FILE_SIZE, name="mixed")
        run(table, uniform, 1)
        near, near_bytes = run(table, locality, batches)
        print(
            f"| {TARGET_FILE_SIZE >> 20} MiB after one random batch (every file rewritten, "
            f"the merge's output files mix key ranges) | {len(files(table.target))} | "
            f"{near:.2f} ({near_bytes / 1e6:.0f}) | - |"
        )
        run(table, with_inserts, 10)
        near, near_bytes = run(table, locality, batches)
        print(
            f"| {TARGET_FILE_SIZE >> 20} MiB after 10 more batches with inserts | "
            f"{len(files(table.target))} | {near:.2f} ({near_bytes / 1e6:.0f}) | - |"
        )
        delta = open_table(table.target, None)
        assert delta is not None
        start = time.perf_counter()
        delta.optimize.z_order(["id"], target_size=TARGET_FILE_SIZE)
        took = time.perf_counter() - start
        near, near_bytes = run(table, locality, batches)
        print(
            f'| then `optimize.z_order(["id"])` ({took:.0f} s) | {len(files(table.target))} | '
            f"{near:.2f} ({near_bytes / 1e6:.0f}) | - |"
        )


def spark_side(sizes: list[int], batches: int, chunk: int) -> None:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql import functions as F

    from replog.spark.functions import apply_changes

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")

    def events(ids: Any, operation: str, sequence: int) -> DataFrame:
        frame = ids if isinstance(ids, DataFrame) else spark.range(*ids)
        return frame.select(
            F.lit(0).alias("shard"),
            (F.col("id") + F.lit(sequence)).alias("sequence"),
            F.concat(F.lit("e"), F.col("id").cast("string")).alias("event_id"),
            F.lit(NOW).alias("timestamp"),
            F.lit(operation).alias("operation"),
            F.lit("shop.orders").alias("collection"),
            F.to_json(F.struct("id")).alias("key"),
            F.to_json(
                F.struct(
                    "id",
                    F.concat(F.lit("name-"), F.col("id").cast("string")).alias("name"),
                    F.rand(sequence).alias("price"),
                )
            )
            .cast("binary")
            .alias("data"),
            F.lit(None).cast("binary").alias("before"),
            F.lit(None).cast("string").alias("metadata"),
        )

    def timed(frame: DataFrame, action: Callable[[DataFrame], None]) -> float:
        frame = frame.cache()
        frame.count()  # the log's read is the source's cost, not apply_changes'
        start = time.perf_counter()
        action(frame)
        seconds = time.perf_counter() - start
        frame.unpersist()
        return seconds

    print("\n## Through apply_changes in Spark, beside plain Spark Parquet\n")
    print(
        "| table rows | load rows/s | Spark Parquet write rows/s | locality s/batch | "
        "random s/batch | Spark Parquet full rewrite s/batch |"
    )
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(2)
    figures = {}
    with tempfile.TemporaryDirectory() as where:
        warm = apply_changes(f"{where}/warm", ["id"], app_id="bench", schema=SCHEMA)
        timed(events((0, chunk), "insert", 0), lambda f: warm(f, 0))  # JVM, Python workers
        state: dict[int, dict[str, Any]] = {}
        for count in sizes:  # load every size first: the batches then alternate sizes,
            apply = apply_changes(f"{where}/s{count}", ["id"], app_id="bench", schema=SCHEMA)
            loading = []
            for number, first in enumerate(range(0, count, chunk)):
                span = (first, min(first + chunk, count))
                seconds = timed(events(span, "insert", 0), lambda f, n=number, a=apply: a(f, n))
                loading.append((span[1] - span[0]) / seconds)
            parquet = f"{where}/p{count}"
            start = time.perf_counter()
            events((0, count), "insert", 0).selectExpr(
                "from_json(cast(data as string), '" + SCHEMA + "') as r"
            ).select("r.*").write.parquet(parquet)
            state[count] = {
                "apply": apply, "batch_id": number + 1, "sequence": count, "near": [],
                "far": [], "load": statistics.median(loading), "parquet": parquet,
                "parquet_rate": count / (time.perf_counter() - start),
            }  # fmt: skip
        # the batches alternate sizes, so that a busy minute of the machine hits every size
        # alike; the locality batches first (a random batch rewrites every file, and the
        # merge's output files mix key ranges: see the layout table)
        for into in ("near", "far"):
            for _ in range(batches):
                for count in sizes:
                    one = state[count]
                    keys = (
                        rng.choice(np.arange(count - RECENT, count), BATCH)
                        if into == "near"
                        else rng.choice(count, BATCH)
                    )
                    ids = spark.createDataFrame([(int(k),) for k in np.unique(keys)], "id long")
                    frame = events(ids, "update", one["sequence"])
                    one[into].append(
                        timed(frame, lambda f, b=one["batch_id"], a=one["apply"]: a(f, b))
                    )
                    one["batch_id"] += 1
                    one["sequence"] += BATCH
        for count in sizes:
            one = state[count]
            ids = spark.createDataFrame([(int(k),) for k in rng.choice(count, BATCH)], "id long")
            update = (
                events(ids, "update", one["sequence"])
                .selectExpr("from_json(cast(data as string), '" + SCHEMA + "') as r")
                .select("r.*")
            )

            def rewrite(frame: DataFrame, source: str = one["parquet"]) -> None:
                table = spark.read.parquet(source)
                kept = table.join(frame, "id", "left_anti")
                kept.unionByName(frame).write.mode("overwrite").parquet(source + "-next")

            full = timed(update, rewrite)
            figures[count] = statistics.median(one["near"])
            print(
                f"| {count:,} | {one['load']:,.0f} | {one['parquet_rate']:,.0f} | "
                f"{statistics.median(one['near']):.2f} | {statistics.median(one['far']):.2f} | "
                f"{full:.2f} |"
            )
    sizes = sorted(figures)
    ratio = figures[sizes[-1]] / figures[sizes[0]]
    print(
        f"\nlocality through Spark: {sizes[-1]:,} rows / {sizes[0]:,} rows = {ratio:.2f}x"
        " (goal <= 1.5x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1000000,10000000")
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=1_000_000)
    parser.add_argument("--layout", action="store_true")
    parser.add_argument("--spark", action="store_true")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--load", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(load(args.where, args.load, args.chunk, TARGET_FILE_SIZE)[1])
        return
    if args.one:
        print(json.dumps(one_size(args.one, args.batches, args.chunk)))
        return
    sizes = sorted(int(s) for s in args.rows.split(","))
    print_core(core(sizes, args.batches, args.chunk))
    if args.layout:
        layout(sizes[-1], args.batches, args.chunk)
    if args.spark:
        spark_side(sizes, args.batches, args.chunk)


if __name__ == "__main__":
    main()
