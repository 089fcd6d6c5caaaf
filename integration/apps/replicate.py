"""Crash-test driver: replicate log A into log B with replog -> replog-sink, AvailableNow.

Usage: replicate.py SOURCE TARGET CHECKPOINT [--max-events N] [--fs-json JSON] [--master M]
Run it in its own session: the fault hook (REPLOG_FAULT) kills its whole process group.
"""

import argparse
import json
import logging
import os

from pyspark.sql import SparkSession

parser = argparse.ArgumentParser()
parser.add_argument("source")
parser.add_argument("target")
parser.add_argument("checkpoint")
parser.add_argument("--max-events", default="150")
parser.add_argument("--fs-json", default="{}")
parser.add_argument("--master", default="local[2,3]")
parser.add_argument("--sink-id", default=None)
parser.add_argument("--consumer", default=None)
args = parser.parse_args()
# The fault hook kills this whole process group (driver, JVM, Python workers).
os.environ["REPLOG_FAULT_PGID"] = str(os.getpgrp())
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

spark = (
    SparkSession.builder.master(args.master)
    .appName("replog-crash-test")
    .config("spark.ui.enabled", "false")
    .config("spark.sql.shuffle.partitions", "2")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("WARN")
fs_options = {f"fs.{k}": str(v) for k, v in json.loads(args.fs_json).items()}
events = (
    spark.readStream.format("replog")
    .options(**fs_options)
    .option("maxEventsPerTrigger", args.max_events)
    .options(**({"consumer": args.consumer} if args.consumer else {}))
    .load(args.source)
)
writer = (
    events.writeStream.format("replog-sink")
    .options(**fs_options)
    .option("checkpointLocation", args.checkpoint)
    .trigger(availableNow=True)
)
if args.sink_id:
    writer = writer.option("sinkId", args.sink_id)
query = writer.start(args.target)
query.awaitTermination()
print("BATCHES", json.dumps([p["numInputRows"] for p in query.recentProgress]))
spark.stop()
