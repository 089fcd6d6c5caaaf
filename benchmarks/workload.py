"""Shared by the benchmarks: a CDC-like workload, a best-of timer, the SparkSession."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
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
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark
