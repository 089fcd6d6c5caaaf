"""A replog log streamed into a Delta table exactly once, through a driver kill.

    PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/python examples/replica_to_delta.py [WORKDIR]

It writes a log of inserts, updates and deletes, starts the streaming query (one Delta
commit per micro-batch, by ``apply_changes``) in a child process, SIGKILLs that driver
once the table has a few commits, restarts it from its checkpoint, and then compares
the table (read with ``deltalake``, no Spark) with the latest state computed from the
log. Prints ``RESULT {...}``; exits 1 if they differ.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deltalake import DeltaTable
from pyspark.sql import SparkSession

from replog.log import ReplicationLog
from replog.spark.functions import apply_changes
from replog.tables.delta import read_table

SCHEMA = "id long, name string, qty long"


def stream(log_url: str, table: str, checkpoint: str) -> None:
    """The job: the replog source into foreachBatch(apply_changes(...))."""
    spark = SparkSession.builder.master("local[2]").appName("replica-to-delta").getOrCreate()
    query = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", "200")  # also bounds the driver's memory per batch
        .load(log_url)
        .writeStream.foreachBatch(
            apply_changes(table, ["id"], app_id="replica-to-delta", schema=SCHEMA)
        )
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()


def write_log(log_url: str) -> None:
    log = ReplicationLog.create(log_url, 3)
    rng, alive = random.Random(0), set()
    for commit in range(10):
        events = []
        for n in range(200):
            k = rng.randrange(300)
            op = "insert" if k not in alive else rng.choice(["update"] * 4 + ["delete"])
            (alive.add if op != "delete" else alive.discard)(k)
            qty = commit * 1000 + n
            events.append(
                {
                    "key": json.dumps({"id": k}),
                    "operation": op,
                    "data": json.dumps({"id": k, "name": f"item {k}", "qty": qty}),
                }
            )
        log.append(events)


def expected(log_url: str) -> dict[int, dict[str, object]]:
    """The latest row per key, computed from the log's events."""
    log = ReplicationLog.open(log_url)
    last: dict[str, dict[str, object]] = {}
    for shard in range(log.shards):
        for event in log.read_table(shard, 0).to_pylist():  # in sequence order
            last[event["key"]] = event
    rows = (json.loads(e["data"]) for e in last.values() if e["operation"] != "delete")
    return {row["id"]: row for row in rows}


def table_rows(table: str) -> dict[int, dict[str, object]]:
    found = read_table(DeltaTable(table), ["id", "name", "qty"]).to_pylist()
    return {row["id"]: row for row in found}


def table_version(table: str) -> int:
    return DeltaTable(table).version() if DeltaTable.is_deltatable(table) else -1


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        stream(*sys.argv[2:5])
        return 0
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="replica-"))
    log_url, table, checkpoint = str(work / "log"), str(work / "table"), str(work / "chk")
    write_log(log_url)
    child = [sys.executable, __file__, "--child", log_url, table, checkpoint]
    driver = subprocess.Popen(child, start_new_session=True)
    while table_version(table) < 2 and driver.poll() is None:
        time.sleep(0.2)
    killed = driver.poll() is None
    if killed:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its Python workers
    driver.wait()
    at_kill = table_version(table)
    subprocess.run(child, check=True)  # restarted from the checkpoint
    same = table_rows(table) == expected(log_url)
    print(
        "RESULT "
        + json.dumps(
            {
                "killed": killed,
                "table_version_at_kill": at_kill,
                "final_version": table_version(table),
                "rows": len(table_rows(table)),
                "equal_to_log": same,
            }
        )
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
