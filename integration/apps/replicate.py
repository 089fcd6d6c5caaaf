"""Crash-test driver: replicate log A into log B with replog -> replog-sink, AvailableNow.

Usage: replicate.py SOURCE TARGET CHECKPOINT [--max-events N] [--fs-json JSON] [--master M]
Run it in its own session: the fault hook (REPLOG_FAULT) kills its whole process group.
"""

import argparse
import json

from spark_app import events, finish, fs_options, session

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
spark = session("replog-crash-test", args.master)
fs = json.loads(args.fs_json)
writer = (
    events(spark, args.source, max_events=args.max_events, fs=fs, consumer=args.consumer)
    .writeStream.format("replog-sink")
    .options(**fs_options(fs))
    .option("checkpointLocation", args.checkpoint)
    .trigger(availableNow=True)
)
if args.sink_id:
    writer = writer.option("sinkId", args.sink_id)
finish(spark, writer.start(args.target))
