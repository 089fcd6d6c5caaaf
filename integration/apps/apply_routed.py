"""Chaos driver: stream a replog log into one Delta table per collection with one
``apply_changes`` query (a ``{collection}`` template; keys, types and defaults from the
schema registry of ``--registry``), AvailableNow.

Usage: apply_routed.py LOG TARGET_TEMPLATE CHECKPOINT --app-id ID [--registry URL]
       [--fs-json JSON] [--delta-json JSON] [--max-events N] [--master M] [--consumer C]

``--fs-json`` are the logs' fsspec options, ``--delta-json`` delta-rs's storage options.
Run it in its own session: the fault hook (REPLOG_FAULT=apply_before_delta, ...) kills its
whole process group.
"""

import argparse
import json

from spark_app import events, finish, session

from replog.spark.functions import apply_changes

parser = argparse.ArgumentParser()
parser.add_argument("log")
parser.add_argument("target")
parser.add_argument("checkpoint")
parser.add_argument("--app-id", required=True)
parser.add_argument("--registry", default=None, help="the log whose schemas type the rows")
parser.add_argument("--fs-json", default="{}")
parser.add_argument("--delta-json", default="{}")
parser.add_argument("--max-events", default="2000")
parser.add_argument("--master", default="local[1]")
parser.add_argument("--consumer", default=None)
args = parser.parse_args()
spark = session("replog-apply-chaos", args.master)
fs = json.loads(args.fs_json)
query = (
    events(spark, args.log, max_events=args.max_events, fs=fs, consumer=args.consumer)
    .writeStream.foreachBatch(
        apply_changes(
            args.target,
            app_id=args.app_id,
            log=args.registry or args.log,
            log_options=fs,
            storage_options=json.loads(args.delta_json),
        )
    )
    .option("checkpointLocation", args.checkpoint)
    .trigger(availableNow=True)
    .start()
)
finish(spark, query)
