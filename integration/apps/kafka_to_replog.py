"""Crash-test driver: Debezium topics in Kafka -> Spark's Kafka source -> from_debezium ->
replog-sink, AvailableNow (docs/CDC.md "Kafka -> replog in Spark").

Usage: kafka_to_replog.py BOOTSTRAP TOPICS TARGET CHECKPOINT [--max-offsets N] [--jars J]
Run it in its own session: the fault hook (REPLOG_FAULT) kills its whole process group.
"""

import argparse
import os

from spark_app import finish, session

from replog.spark.functions import from_debezium

parser = argparse.ArgumentParser()
parser.add_argument("bootstrap")
parser.add_argument("topics")
parser.add_argument("target")
parser.add_argument("checkpoint")
parser.add_argument("--max-offsets", default="25")
parser.add_argument("--jars", required=True, help="Spark's Kafka connector jars, comma-separated")
args = parser.parse_args()
os.environ["PYSPARK_SUBMIT_ARGS"] = f"--jars {args.jars} pyspark-shell"  # as spark-submit --jars
spark = session("replog-kafka-crash-test", "local[2,3]")
changes = (
    spark.readStream.format("kafka")
    .option("kafka.bootstrap.servers", args.bootstrap)
    .option("subscribe", args.topics)
    .option("startingOffsets", "earliest")
    .option("maxOffsetsPerTrigger", args.max_offsets)
    .load()
)
query = (
    from_debezium(changes, key_fields=["id"], redeliveries_within="1 hour")
    .writeStream.format("replog-sink")
    .option("checkpointLocation", args.checkpoint)
    .trigger(availableNow=True)
    .start(args.target)
)
finish(spark, query)
