"""apply_changes for many tables (issue 31, goal 6): one query routing each collection to
its table, beside one query per table (each of which reads the whole log).

A log of ``--tables`` collections (schemas registered as ``replog capture postgres``
registers them: the key non-optional), ``--events`` events each, is applied into Delta
tables twice, from a fresh checkpoint each time: by one ``apply_changes`` query with a
``{collection}`` path template and ``log=``, and by one query per collection
(``collection=``). Both end with the same tables; the time of each is printed.

Run: .venv/bin/python benchmarks/bench_apply_routing.py [--tables 15] [--events 20000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

from pyspark.sql import SparkSession

from replog.log import ReplicationLog
from replog.schemas import registry
from replog.spark.functions import apply_changes
from replog.tables.delta import open_table, read_table


def envelope() -> dict[str, Any]:
    row = {
        "type": "struct",
        "name": "bench.Value",
        "fields": [
            {"field": "id", "type": "int64", "optional": False},
            {"field": "name", "type": "string", "optional": True},
            {"field": "n", "type": "int64", "optional": True},
        ],
    }
    return {
        "type": "struct",
        "name": "bench.Envelope",
        "fields": [
            {**row, "field": "before", "optional": True},
            {**row, "field": "after", "optional": True},
            {"field": "op", "type": "string", "optional": False},
        ],
    }


def build(where: str, tables: int, events: int) -> ReplicationLog:
    log = ReplicationLog.create(f"{where}/log", 4)
    digests = {f"shop.t{t}": registry.register(log.storage, f"shop.t{t}", envelope())
               for t in range(tables)}  # fmt: skip
    batch = []
    for n in range(events):
        for name, digest in digests.items():
            k = n % (events // 2)  # every key changed twice
            batch.append({
                "collection": name, "key": json.dumps({"id": k}),
                "operation": "insert" if n < events // 2 else "update",
                "data": json.dumps({"id": k, "name": f"{name}-{n}", "n": n}),
                "metadata": json.dumps({"schema": digest}),
            })  # fmt: skip
        if len(batch) >= 50_000:
            log.append(batch)
            batch = []
    if batch:
        log.append(batch)
    return log


def run(spark: SparkSession, log: ReplicationLog, apply: Any, checkpoint: str) -> None:
    (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "100000")
        .load(log.url)
        .writeStream.foreachBatch(apply)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", type=int, default=15)
    parser.add_argument("--events", type=int, default=20_000)
    args = parser.parse_args()
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    with tempfile.TemporaryDirectory() as where:
        log = build(where, args.tables, args.events)
        names = [f"shop.t{t}" for t in range(args.tables)]
        warm = apply_changes(f"{where}/warm", app_id="warm", log=log.url, collection=names[0])
        run(spark, log, warm, f"{where}/chk-warm")  # the JVM's and Python workers' start
        start = time.perf_counter()
        apply = apply_changes(f"{where}/one/{{collection}}", app_id="one", log=log.url)
        run(spark, log, apply, f"{where}/chk-one")
        one = time.perf_counter() - start
        start = time.perf_counter()
        for name in names:
            each = apply_changes(
                f"{where}/many/{name}", app_id="many", log=log.url, collection=name
            )
            run(spark, log, each, f"{where}/chk-{name}")
        many = time.perf_counter() - start
        for name in names:
            a, b = (open_table(f"{where}/{kind}/{name}", None) for kind in ("one", "many"))
            assert a is not None and b is not None
            assert read_table(a).sort_by("id").equals(read_table(b).sort_by("id"))
    total = args.tables * args.events
    print("| tables | events | one routed query s | one query per table s | ratio |")
    print("|---|---|---|---|---|")
    print(f"| {args.tables} | {total:,} | {one:.1f} | {many:.1f} | {many / one:.1f}x |")


if __name__ == "__main__":
    main()
