"""Sink benchmark: replog-sink vs Spark's Parquet file sink, and S3 requests per commit.

A third sink, a Python Arrow writer that discards everything, shows what the Python
Data Source API itself costs (the floor any Python sink starts from).

Part 1, in one SparkSession (``local[2]``), interleaved, fresh checkpoint and target per
run: the same input (Parquet files of CDC events, read by ``readStream.parquet`` with
``maxFilesPerTrigger``) streamed with Trigger.AvailableNow into ``replog-sink`` and into
the built-in exactly-once ``parquet`` file sink.

Part 2, against a moto S3 server over HTTP: the requests one micro-batch commit of the
sink protocol sends (driver side), counted by operation through botocore's event hooks,
after 10 and after 1,000 previous commits.

Run: PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/python benchmarks/bench_sink.py
[--events 1000000] [--runs 5] [--commits 10,19,...] [--requests-only]
"""

from __future__ import annotations

import argparse
import collections
import logging
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from null_sink import NullSink
from proc_cpu import load_average, tree_cpu_seconds
from pyspark.sql import SparkSession
from workload import bench_session, workload

from replog.format.events import events_from_table
from replog.log import ReplicationLog
from replog.storage import Storage

SHARDS = 8
INPUT_FILES = 16
FILES_PER_TRIGGER = 2


def build_input(root: Path, events: int) -> str:
    directory = root / "input"
    directory.mkdir()
    per_file = events // INPUT_FILES
    for index in range(INPUT_FILES):
        table = workload(per_file, index * per_file)
        pq.write_table(table, directory / f"part-{index:03d}.parquet")
    return str(directory)


def run_sink(
    spark: SparkSession,
    input_dir: str,
    target: Path,
    checkpoint: Path,
    fmt: str,
    *,
    files_per_trigger: int = FILES_PER_TRIGGER,
) -> float:
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(checkpoint, ignore_errors=True)
    schema = spark.read.parquet(input_dir).schema
    frame = (
        spark.readStream.schema(schema)
        .option("maxFilesPerTrigger", files_per_trigger)
        .parquet(input_dir)
    )
    writer = frame.writeStream.format(fmt).option("checkpointLocation", str(checkpoint))
    if fmt == "replog-sink":
        writer = writer.option("shards", SHARDS)
    start = time.perf_counter()
    query = writer.trigger(availableNow=True).start(str(target))
    query.awaitTermination()
    return time.perf_counter() - start


def written(spark: SparkSession, target: Path, fmt: str, events: int) -> int:
    if fmt == "replog-sink":
        return sum(ReplicationLog.open(str(target)).head().values())
    if fmt == "parquet":
        return spark.read.parquet(str(target)).count()
    return events  # the null sink keeps nothing to count


# -- S3 requests per commit -------------------------------------------------------------


class RequestCounter:
    """Counts S3 API calls made by one s3fs filesystem, by operation name."""

    def __init__(self, fs: Any) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._events = fs.s3.meta.events
        self._events.register("before-call.s3", self._count)

    def _count(self, model: Any, params: Any = None, **_: Any) -> None:
        self.calls[model.name] += 1
        key = params.get("url_path", "") if isinstance(params, dict) else ""
        logging.getLogger("bench.requests").debug("%s %s", model.name, key)

    def stop(self) -> None:
        self._events.unregister("before-call.s3", self._count)


def s3_requests_per_commit(
    previous: tuple[int, ...],
) -> list[tuple[int, str, str, dict[str, int], float]]:
    """(previous commits, cold|warm, process, requests by operation, ms) of one micro-batch.

    The sink is driven as PySpark 4.3 drives it: the driver plans the micro-batch with
    ``streamWriter()`` (``write_into_data_source.py``; that writer is pickled into the
    tasks), the tasks stage segments (one PUT each, not counted), and Spark's commit
    process unpickles the data source, calls ``streamWriter()`` again and then
    ``commit()`` (``python_streaming_sink_runner.py``). "warm" is the steady state: both
    processes live for the whole query and keep the target log's state. "cold" is the
    first micro-batch after a restart.
    """
    import pickle

    import boto3
    from moto.server import ThreadedMotoServer
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType

    from replog.spark import sink as spark_sink

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    fs_options = {"fs.endpoint_url": endpoint, "fs.key": "testing", "fs.secret": "testing"}
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket="bench")
    schema = StructType([StructField("key", StringType()), StructField("data", BinaryType())])
    results = []

    def fresh_process() -> None:  # a restarted driver: nothing cached
        spark_sink.PROCESS.clear()

    def counted(url: str, action: Any) -> tuple[dict[str, int], float]:
        # fsspec shares one s3fs instance per set of options: this is the sink's client.
        counter = RequestCounter(
            Storage(url, {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}).fs
        )
        start = time.perf_counter()
        action()
        milliseconds = (time.perf_counter() - start) * 1000
        counter.stop()
        return dict(sorted(counter.calls.items())), milliseconds

    def micro_batch(
        source: Any, url: str, epoch: int, rows: int, *, cold: bool = False
    ) -> list[tuple[str, dict, float]]:
        planned: list[Any] = []

        def plan_and_ship() -> None:  # write_into_data_source.py: build, pickle for the tasks
            planned.append(pickle.loads(pickle.dumps(source.streamWriter(schema, False))))

        plan = counted(url, plan_and_ship)
        staged = ReplicationLog.open(url, storage_options=source_storage).stage(
            events_from_table(workload(rows))
        )  # the tasks' work
        message = spark_sink.ReplogCommitMessage(
            query, "run-1", epoch, 0, tuple(staged), since=planned[0].since
        )

        if cold:  # the commit process restarted too: it has its own (empty) caches
            fresh_process()

        def commit() -> None:
            writer = pickle.loads(pickle.dumps(source)).streamWriter(schema, False)
            writer.commit([message], epoch)

        return [("planning", *plan), ("commit", *counted(url, commit))]

    source_storage = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    query = str(uuid.uuid4())
    try:
        for count in previous:
            url = f"s3://bench/requests-{count}"
            source = spark_sink.ReplogSinkDataSource(
                {"path": url, "sinkId": "bench-sink", "shards": str(SHARDS), **fs_options}
            )
            for epoch in range(count):
                micro_batch(source, url, epoch, 16)
            fresh_process()
            for epoch, kind in ((count, "cold"), (count + 1, "warm")):
                batch = micro_batch(source, url, epoch, 1_000, cold=kind == "cold")
                for process, calls, milliseconds in batch:
                    results.append((count, kind, process, calls, milliseconds))
    finally:
        server.stop()
    return results


def print_requests(commits: str) -> None:
    print(
        "| one micro-batch on S3 (moto), driver side | commit process: requests "
        "| by operation | latency | planning process: requests |"
    )
    print("|---|---|---|---|---|")
    counts = tuple(int(c) for c in commits.split(",") if c)
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for count, kind, process, calls, milliseconds in s3_requests_per_commit(counts):
        rows.setdefault((count, kind), {})[process] = (calls, milliseconds)
    for (count, kind), measured in rows.items():
        calls, milliseconds = measured["commit"]
        planning, _ = measured["planning"]
        print(
            f"| {kind}, after {count:,} previous commits | {sum(calls.values())} | {calls} "
            f"| {milliseconds:.0f} ms | {sum(planning.values())} {planning} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--batch-events", type=int, default=250_000, help="events per micro-batch (input files)"
    )
    parser.add_argument("--commits", default="10,19,99,137,199,1000")
    parser.add_argument("--requests-only", action="store_true", help="only part 2 (S3 requests)")
    parser.add_argument("--no-requests", action="store_true", help="skip part 2 (S3 requests)")
    args = parser.parse_args()
    if args.requests_only:
        print_requests(args.commits)
        return
    root = Path(tempfile.mkdtemp(prefix="replog-bench-sink-"))
    try:
        input_dir = build_input(root, args.events)
        files_per_trigger = max(1, args.batch_events * INPUT_FILES // args.events)
        spark = bench_session()
        spark.dataSource.register(NullSink)
        sinks = {
            "replog-sink": "replog-sink",
            "parquet file sink": "parquet",
            "discarding Python Arrow sink (the API's floor)": "python-null",
        }
        rates: dict[str, list[float]] = {name: [] for name in sinks}
        cpu: dict[str, list[float]] = {name: [] for name in sinks}
        loads = [load_average()]
        names = list(sinks)
        for run in range(args.runs + 1):  # run 0 warms up the JVM and the workers
            # rotated, so that no sink always runs right after the same other one
            for name in names[run % len(names) :] + names[: run % len(names)]:
                fmt = sinks[name]
                target = root / f"out-{fmt}"
                before = tree_cpu_seconds()
                seconds = run_sink(
                    spark,
                    input_dir,
                    target,
                    root / "checkpoint",
                    fmt,
                    files_per_trigger=files_per_trigger,
                )
                used = tree_cpu_seconds() - before
                rows = written(spark, target, fmt, args.events)
                if rows != args.events:
                    raise SystemExit(f"{name} wrote {rows} rows, expected {args.events}")
                if run:
                    rates[name].append(args.events / seconds)
                    cpu[name].append(used)
            loads.append(load_average())
        spark.stop()
        batches = INPUT_FILES // files_per_trigger
        print(f"load average (1 min) before and after each round: {', '.join(loads)}")
        print(
            f"| sink ({args.events:,} events in {batches} micro-batches, AvailableNow, "
            f"{args.runs} runs) | events/s, median | best | all runs | CPU s (Spark and its "
            f"Python processes), median |"
        )
        print("|---|---|---|---|---|")
        for name, values in rates.items():
            each = ", ".join(f"{v:,.0f}" for v in values)
            print(
                f"| {name} | {statistics.median(values):,.0f} | {max(values):,.0f} | {each} "
                f"| {statistics.median(cpu[name]):.2f} |"
            )
        for other in ("parquet file sink", "discarding Python Arrow sink (the API's floor)"):
            median = statistics.median(rates["replog-sink"]) / statistics.median(rates[other])
            best = max(rates["replog-sink"]) / max(rates[other])
            spent = statistics.median(cpu["replog-sink"]) / statistics.median(cpu[other])
            print(f"| ratio replog-sink / {other} | {median:.2f} | {best:.2f} | | {spent:.2f} |")
        # Each run's ratio, replog against Parquet in the same round (the spread).
        each_run = [
            r / p for r, p in zip(rates["replog-sink"], rates["parquet file sink"], strict=True)
        ]
        print(f"per-round replog/parquet: {', '.join(f'{v:.2f}' for v in each_run)}")
        if not args.no_requests:
            print()
            print_requests(args.commits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
