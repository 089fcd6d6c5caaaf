"""Crash-test driver: Debezium topics in Kafka -> Spark's Kafka source -> from_debezium ->
replog-sink, AvailableNow (docs/CDC.md "Kafka -> replog in Spark").

Usage: kafka_to_replog.py BOOTSTRAP TOPICS TARGET CHECKPOINT [--max-offsets N] [--jars J]
Run it in its own session: the fault hook (REPLOG_FAULT) kills its whole process group.
:func:`start_query` is the pipeline alone, for a test that finishes a killed run in its
own session.
"""

import argparse
import os

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from replog.spark.functions import from_debezium


def start_query(
    spark: SparkSession,
    bootstrap: str,
    topics: str,
    target: str,
    checkpoint: str,
    *,
    max_offsets: str,
) -> StreamingQuery:
    """The pipeline, started: what the topics hold now, ``max_offsets`` per micro-batch."""
    changes = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topics)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", max_offsets)
        .load()
    )
    return (
        from_debezium(changes, key_fields=["id"], redeliveries_within="1 hour")
        .writeStream.format("replog-sink")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start(target)
    )


def main() -> None:
    from spark_app import finish, session

    parser = argparse.ArgumentParser()
    parser.add_argument("bootstrap")
    parser.add_argument("topics")
    parser.add_argument("target")
    parser.add_argument("checkpoint")
    parser.add_argument("--max-offsets", default="25")
    parser.add_argument("--jars", required=True, help="Spark's Kafka connector, comma-separated")
    args = parser.parse_args()
    # As spark-submit --jars, with spark_app.session's quick JVM options.
    quick = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    os.environ["PYSPARK_SUBMIT_ARGS"] = (
        f'--driver-java-options "{quick}" --jars {args.jars} pyspark-shell'
    )
    spark = session("replog-kafka-crash-test", "local[2,3]")
    query = start_query(
        spark,
        args.bootstrap,
        args.topics,
        args.target,
        args.checkpoint,
        max_offsets=args.max_offsets,
    )
    finish(spark, query)


if __name__ == "__main__":
    main()
