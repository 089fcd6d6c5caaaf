"""Throughput of the main job's streaming half (``make demo-throughput``): a synthetic
shop CDC stream of 1M events, masked and replicated exactly once.

1. Produce: customers, orders and payments change (inserts, updates, deletes) into
   log ``demo-data/shop`` (8 shards), in commits of 50,000 events.
2. Stream: ``replog`` -> mask the customers' e-mail in the JSON payload ->
   ``replog-sink`` into ``demo-data/shop-masked``, with progress (events/s, lag).
3. Summarise: events in and out per collection and operation, and a check that every
   event arrived exactly once and no e-mail address left the pipeline.

Usage: python examples/demo_throughput.py [--events 1000000] [--dir demo-data]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from tqdm import tqdm

from replog.log import ReplicationLog

COMMIT_EVENTS = 50_000


def produce(url: str, total: int) -> ReplicationLog:
    """A realistic shop workload: entity keys are updated many times, some deleted."""
    log = ReplicationLog.create(url, 8)
    rng = random.Random(42)
    made = 0
    with tqdm(total=total, unit="ev", desc="producing CDC events") as bar:
        while made < total:
            size = min(COMMIT_EVENTS, total - made)
            rows: dict[str, list] = {
                k: [] for k in ("event_id", "key", "collection", "operation", "data")
            }
            for _ in range(size):
                collection = rng.choices(("customers", "orders", "payments"), (2, 5, 3))[0]
                entity = rng.randrange(20_000 if collection == "customers" else 200_000)
                operation = rng.choices(("insert", "update", "delete"), (3, 6, 1))[0]
                if collection == "customers":
                    record = {
                        "id": entity,
                        "name": f"Customer {entity}",
                        "email": f"customer{entity}@example.com",
                        "tier": rng.choice(("bronze", "silver", "gold")),
                    }
                elif collection == "orders":
                    record = {
                        "id": entity,
                        "customer": rng.randrange(20_000),
                        "total": round(rng.uniform(5, 500), 2),
                        "status": rng.choice(("new", "paid", "shipped")),
                    }
                else:
                    record = {
                        "id": entity,
                        "order": rng.randrange(200_000),
                        "amount": round(rng.uniform(5, 500), 2),
                        "method": "card",
                    }
                rows["event_id"].append(str(uuid.uuid4()))
                rows["key"].append(f"{collection}/{entity}")
                rows["collection"].append(collection)
                rows["operation"].append(operation)
                rows["data"].append(json.dumps(record).encode())
            log.append(pa.table(rows))
            made += size
            bar.update(size)
    return log


def _events_at(offset: object) -> int:
    """Events up to a replog offset as Spark reports it (JSON text or dict)."""
    document = json.loads(offset) if isinstance(offset, str) else (offset or {})
    return sum(int(v) for k, v in document.items() if k.isdigit())


def report(query, printed: set[int]) -> None:
    """Print each finished micro-batch once: size, speed and lag behind the log's head."""
    for progress in query.recentProgress:
        if progress["batchId"] in printed or not progress["numInputRows"]:
            continue
        printed.add(progress["batchId"])
        source = progress["sources"][0]
        lag = _events_at(source.get("latestOffset")) - _events_at(source.get("endOffset"))
        rate = progress.get("processedRowsPerSecond") or 0
        print(
            f"  batch {progress['batchId']:>3}: {progress['numInputRows']:>8,} events "
            f"at {rate:>10,.0f} events/s | lag {max(lag, 0):>9,} events",
            flush=True,
        )


def watch(query, stop: threading.Event) -> None:
    """Report progress while the query runs, then whatever finished since the last look."""
    printed: set[int] = set()
    while not stop.wait(1.0):
        report(query, printed)
    report(query, printed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--dir", default="demo-data")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = Path(args.dir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    source_url, target_url = str(root / "shop"), str(root / "shop-masked")

    started = time.perf_counter()
    produce(source_url, args.events)
    print(
        f"produced {args.events:,} events into {source_url} in {time.perf_counter() - started:.1f}s"
    )

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("replog-demo")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # our own progress lines instead
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    events = (
        spark.readStream.format("replog").option("maxEventsPerTrigger", "250000").load(source_url)
    )
    masked = events.withColumn(
        "data",
        F.when(
            F.col("collection") == "customers",
            F.regexp_replace(
                F.col("data").cast("string"), r'"email": "[^"]*"', '"email": "***"'
            ).cast("binary"),
        ).otherwise(F.col("data")),
    )
    print("streaming replog -> mask e-mails -> replog-sink (exactly once):")
    started = time.perf_counter()
    query = (
        masked.writeStream.format("replog-sink")
        .option("checkpointLocation", str(root / "checkpoint"))
        .trigger(availableNow=True)
        .start(target_url)
    )
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(query, stop), daemon=True)
    watcher.start()
    query.awaitTermination()
    stop.set()
    watcher.join()
    seconds = time.perf_counter() - started
    print(
        f"streamed {args.events:,} events in {seconds:.1f}s "
        f"({args.events / seconds:,.0f} events/s end to end)"
    )

    # Whole logs: a batch read starts at the earliest event and commits nothing.
    before = spark.read.format("replog").load(source_url)
    after = spark.read.format("replog").load(target_url)
    counts_in = {
        (r["collection"], r["operation"]): r["count"]
        for r in before.groupBy("collection", "operation").count().collect()
    }
    counts_out = {
        (r["collection"], r["operation"]): r["count"]
        for r in after.groupBy("collection", "operation").count().collect()
    }
    print("\n  collection  operation        in       out")
    for collection, operation in sorted(counts_in):
        key = (collection, operation)
        print(
            f"  {collection:<10}  {operation:<9} {counts_in[key]:>9,} {counts_out.get(key, 0):>9,}"
        )
    missing = before.select("event_id").subtract(after.select("event_id")).count()
    duplicated = after.groupBy("event_id").count().where("count > 1").count()
    leaked = after.where(F.col("data").cast("string").contains("@example.com")).count()
    total_out = after.count()
    print(
        f"\n  events in {args.events:,}, out {total_out:,}; missing {missing}, "
        f"duplicated {duplicated}, e-mails leaked {leaked}"
    )
    total_in = before.count()
    ok = missing == 0 and duplicated == 0 and leaked == 0 and total_in == total_out == args.events
    print("  exactly once: " + ("YES - every event arrived once, masked" if ok else "NO"))
    spark.stop()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
