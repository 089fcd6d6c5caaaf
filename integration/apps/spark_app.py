"""What the crash-test drivers share: a Spark session the fault hook can kill whole, the
replog stream they read, and the line that reports their micro-batches."""

import json
import logging
import os
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery


def session(name: str, master: str) -> SparkSession:
    """A quiet local session. The fault hook (``REPLOG_FAULT=...``) kills this whole
    process group (driver, JVM, Python workers): run the driver in its own session."""
    os.environ["REPLOG_FAULT_PGID"] = str(os.getpgrp())
    # The driver's JVM tuned to start fast on a busy machine (the JIT's first tier only,
    # one GC thread): a driver run of one or two micro-batches took 57-65 s this way
    # against 98-122 s with the defaults, on two cores loaded ~9. A driver that sets its
    # own submit arguments (kafka_to_replog.py: --jars) keeps them.
    os.environ.setdefault(
        "PYSPARK_SUBMIT_ARGS",
        '--driver-java-options "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC" pyspark-shell',
    )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spark = (
        SparkSession.builder.master(master)
        .appName(name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark


def fs_options(fs: dict[str, Any]) -> dict[str, str]:
    """fsspec options as replog's ``fs.``-prefixed source and sink options."""
    return {f"fs.{k}": str(v) for k, v in fs.items()}


def events(
    spark: SparkSession,
    url: str,
    *,
    max_events: str,
    fs: dict[str, Any] | None = None,
    consumer: str | None = None,
) -> DataFrame:
    """The log at ``url`` as a stream, ``max_events`` per micro-batch."""
    reader = spark.readStream.format("replog").options(**fs_options(fs or {}))
    if consumer:
        reader = reader.option("consumer", consumer)
    return reader.option("maxEventsPerTrigger", max_events).load(url)


def finish(spark: SparkSession, query: StreamingQuery) -> None:
    """Wait for an AvailableNow query, print its micro-batches' sizes, stop."""
    query.awaitTermination()
    print("BATCHES", json.dumps([p["numInputRows"] for p in query.recentProgress]))
    spark.stop()
