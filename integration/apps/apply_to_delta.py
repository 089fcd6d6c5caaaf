"""Crash-test driver: stream a replog log into a Delta table with apply_changes (scd1),
AvailableNow. Usage: apply_to_delta.py LOG TARGET CHECKPOINT [--max-events N]
[--write-ahead-rows N] [--master M]
Run it in its own session: the fault hook (REPLOG_FAULT) kills its whole process group.
"""

import argparse

from spark_app import events, finish, session

from replog.spark.functions import apply_changes

parser = argparse.ArgumentParser()
parser.add_argument("log")
parser.add_argument("target")
parser.add_argument("checkpoint")
parser.add_argument("--max-events", default="100")
parser.add_argument("--app-id", default="crash-test")
parser.add_argument("--write-ahead-rows", type=int, default=None)
parser.add_argument("--master", default="local[2]")
args = parser.parse_args()
spark = session("replog-apply-crash-test", args.master)
query = (
    events(spark, args.log, max_events=args.max_events)
    .writeStream.foreachBatch(
        apply_changes(
            args.target,
            ["id"],
            app_id=args.app_id,
            schema="id long, name string, n long",
            write_ahead_rows=args.write_ahead_rows,
        )
    )
    .option("checkpointLocation", args.checkpoint)
    .trigger(availableNow=True)
    .start()
)
finish(spark, query)
