"""A production-shaped job for spark-submit: log A -> mask e-mails -> log B, exactly once.

Recipe (a), the wheel installed in the cluster's Python (formats found by name):

    spark-submit examples/replicate_masked.py SOURCE TARGET CHECKPOINT

Recipe (b), the wheel shipped with the job (Spark 4.3 does not make ``--py-files``
visible to Python streaming data sources, so the app registers them by value):

    make dist   # builds dist/pyspark_replog-<version>-py3-none-any.whl (replog.__version__)
    spark-submit --py-files dist/pyspark_replog-*-py3-none-any.whl \\
        examples/replicate_masked.py SOURCE TARGET CHECKPOINT --register

The job reads SOURCE as consumer ``--consumer`` (default: one per TARGET,
``replicate-masked-<digest of TARGET>``). A consumer's offsets say what has been read: two
jobs that share a consumer split the source between them, and a second one started
after the first has finished writes nothing. Give each replica its own consumer (the
default does), and keep the name when you replace the checkpoint of the same replica.

Storage options for S3 and the like: ``--fs endpoint_url=http://... --fs key=...``.
It runs with Trigger.AvailableNow (a catch-up job for a scheduler); drop ``--once`` to
keep it running. Prints one JSON line ``RESULT {...}`` at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("source")
parser.add_argument("target")
parser.add_argument("checkpoint")
parser.add_argument("--register", action="store_true", help="call replog.register(spark)")
parser.add_argument("--fs", action="append", default=[], metavar="NAME=VALUE")
parser.add_argument("--max-events", default="100000", help="maxEventsPerTrigger")
parser.add_argument("--once", action=argparse.BooleanOptionalAction, default=True)
parser.add_argument(
    "--consumer", help="the source consumer (default: replicate-masked-<digest of TARGET>)"
)
args = parser.parse_args()
consumer = (
    args.consumer
    or f"replicate-masked-{hashlib.sha256(args.target.encode()).hexdigest()[:12]}"
)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

spark = SparkSession.builder.appName("replog-replicate-masked").getOrCreate()
if args.register:
    import replog

    replog.register(spark)

fs_options = {f"fs.{pair.partition('=')[0]}": pair.partition("=")[2] for pair in args.fs}
events = (
    spark.readStream.format("replog")
    .options(**fs_options)
    .option("consumer", consumer)
    .option("maxEventsPerTrigger", args.max_events)
    .load(args.source)
)
# Mask the e-mail address in JSON payloads; every other column passes through.
masked = events.withColumn(
    "data",
    F.regexp_replace(F.col("data").cast("string"), r'"email"\s*:\s*"[^"]*"', '"email": "***"').cast(
        "binary"
    ),
).drop("shard", "sequence")
writer = (
    masked.writeStream.format("replog-sink")
    .options(**fs_options)
    .option("checkpointLocation", args.checkpoint)
)
writer = (
    writer.trigger(availableNow=True) if args.once else writer.trigger(processingTime="5 seconds")
)
query = writer.start(args.target)
query.awaitTermination()

import replog  # noqa: E402 - after Spark has registered or auto-loaded it

print(
    "RESULT",
    json.dumps(
        {
            "replog_module": replog.__file__,
            "batches": [p["numInputRows"] for p in query.recentProgress],
            "registered_explicitly": args.register,
            "consumer": consumer,
        }
    ),
    flush=True,
)
spark.stop()
