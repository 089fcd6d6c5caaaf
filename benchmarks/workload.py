"""Shared by the benchmarks: a CDC-like workload, a best-of timer, the SparkSession, and
one timed AvailableNow query."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

PAYLOAD_FILL = "x" * 120


def workload(events: int, offset: int = 0) -> pa.Table:
    """CDC-like input rows with ~200-byte JSON payloads (the sink's input columns)."""
    ids = range(offset, offset + events)
    data = [
        json.dumps(
            {
                "id": i,
                "customer": f"c{i % 50_000}",
                "total": i * 1.25,
                "status": "paid",
                "note": PAYLOAD_FILL,
            }
        ).encode()
        for i in ids
    ]
    return pa.table(
        {
            "event_id": [str(uuid.uuid4()) for _ in ids],
            "key": [f"order-{i % 200_000}" for i in ids],
            "collection": ["orders"] * events,
            "operation": ["update"] * events,
            "data": pa.array(data, pa.binary()),
        }
    )


@dataclass(frozen=True)
class Run:
    """One AvailableNow query into ``noop``."""

    seconds: float  # start() to termination
    rows: int
    batch_seconds: float  # triggerExecution of the micro-batches that read rows
    to_first_batch: float  # start() to the first micro-batch's start


def stream_run(reader: Any, checkpoint: Path) -> Run:
    """Run ``reader`` (a streaming DataFrame) into ``noop`` with AvailableNow, once."""
    shutil.rmtree(checkpoint, ignore_errors=True)
    started = time.time()
    clock = time.perf_counter()
    query = (
        reader.writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    seconds = time.perf_counter() - clock
    progress = query.recentProgress
    first = datetime.datetime.strptime(progress[0]["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ")
    first_start = first.replace(tzinfo=datetime.timezone.utc).timestamp()
    return Run(
        seconds=seconds,
        rows=sum(p["numInputRows"] for p in progress),
        batch_seconds=sum(
            p["durationMs"]["triggerExecution"] for p in progress if p["numInputRows"]
        )
        / 1000,
        to_first_batch=first_start - started,
    )


def timed(function: Callable[[], object], repeat: int = 3) -> float:
    """Best wall time of ``repeat`` runs, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def compile_bytecode() -> None:
    """Compile replog's and the benchmarks' modules to bytecode, as pip does when it
    installs a wheel. This environment sets PYTHONDONTWRITEBYTECODE and replog is an
    editable install here: without this, every Python process Spark starts (one per
    streaming query, and each worker) compiles replog from source (~50 ms)."""
    import compileall

    here = Path(__file__).resolve().parent
    for directory in (here.parent / "src", here):
        compileall.compile_dir(str(directory), quiet=1)


def bench_session() -> Any:
    """A ``local[2]`` SparkSession whose Python workers import modules from benchmarks/
    by reference (the comparison sources and sinks), as they import replog."""
    from pyspark.sql import SparkSession

    compile_bytecode()
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark
