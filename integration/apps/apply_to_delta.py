"""Crash-test driver: stream a replog log into a Delta table with apply_changes (scd1),
AvailableNow. Usage: apply_to_delta.py LOG TARGET CHECKPOINT [--max-events N]
Run it in its own session: the fault hook (REPLOG_FAULT) kills its whole process group.
"""

import argparse
import json
import logging
import os

from pyspark.sql import SparkSession

from replog.spark.functions import apply_changes

parser = argparse.ArgumentParser()
parser.add_argument("log")
parser.add_argument("target")
parser.add_argument("checkpoint")
parser.add_argument("--max-events", default="100")
parser.add_argument("--app-id", default="crash-test")
args = parser.parse_args()
# The fault hook kills this whole process group (driver, JVM, Python workers).
os.environ["REPLOG_FAULT_PGID"] = str(os.getpgrp())
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

spark = (
    SparkSession.builder.master("local[2]")
    .appName("replog-apply-crash-test")
    .config("spark.ui.enabled", "false")
    .config("spark.sql.shuffle.partitions", "2")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("WARN")
query = (
    spark.readStream.format("replog")
    .option("maxEventsPerTrigger", args.max_events)
    .load(args.log)
    .writeStream.foreachBatch(
        apply_changes(
            args.target, ["id"], app_id=args.app_id, schema="id long, name string, n long"
        )
    )
    .option("checkpointLocation", args.checkpoint)
    .trigger(availableNow=True)
    .start()
)
query.awaitTermination()
print("BATCHES", json.dumps([p["numInputRows"] for p in query.recentProgress]))
spark.stop()
