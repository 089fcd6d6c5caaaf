"""The initial load alone, in warm sessions, beside Spark's own Parquet source and sink.

    PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/python benchmarks/load_only.py \
        [--scale 30] [--times 2] [--max-events 1000000] [--log DIR]

``pgbench -i -s SCALE`` is captured once (``replog capture postgres``, as in
``pgbench_follow.py``); then one SparkSession (``local[2]``) loads that log into Delta
``--times`` times, each from a fresh copy of the log into fresh tables
(``foreachBatch(apply_changes(..., log=...))``, ``maxEventsPerTrigger``): the first load
pays the session's warm-up (the JIT, the Python workers' imports), the later ones show a
warm session's pace. Beside them, in the same session, Spark's own Parquet source and
sink move the same accounts (their rows from PostgreSQL's ``COPY`` as one Parquet file:
``spark.read.parquet(...).write.parquet(...)``), the floor for moving those rows through
Spark at all. Each figure is wall time and the CPU of the whole process tree (Spark's JVM
and its Python workers; steadier than wall time on a shared machine), and the JVM's part
of it. The first load also records when each Python process Spark starts first appears
(``timeline``: the planning of a Python data source's read is a chain of them). ``--log``
loads a log captured before (by an earlier run's ``--keep``) instead of capturing one:
runs of two builds can then alternate on the same log. Prints ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pgbench_follow import capture, copy_out, pgbench, running_server, spark_session, sql
from proc_cpu import descendants, jvm_cpu_seconds, tree_cpu_seconds


def timed(run: Any) -> dict[str, float]:
    """Wall seconds, the process tree's CPU seconds and the JVM's of ``run()``."""
    wall, cpu, jvm = time.perf_counter(), tree_cpu_seconds(), jvm_cpu_seconds()
    run()
    return {
        "s": round(time.perf_counter() - wall, 1),
        "cpu_s": round(tree_cpu_seconds() - cpu, 1),
        "jvm_cpu_s": round(jvm_cpu_seconds() - jvm, 1),
    }


class Timeline:
    """When each Python process under this one first appears (polled every 100 ms)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seen = set(descendants())
        self.found: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.1):
            for pid, (_, command) in descendants().items():
                if pid not in self.seen:
                    self.seen.add(pid)
                    if "python" in command.split(" ")[0]:
                        at = round(time.perf_counter() - self.started, 1)
                        self.found.append({"at_s": at, "process": command.split(" ", 1)[-1]})

    def end(self) -> list[dict[str, Any]]:
        self.stop.set()
        self.thread.join()
        return self.found


def accounts_parquet(dsn: str, path: Path) -> int:
    """pgbench_accounts as one Parquet file (its rows through ``COPY ... CSV``)."""
    data = copy_out(dsn, "COPY pgbench_accounts TO STDOUT (FORMAT csv, HEADER)")
    table = pacsv.read_csv(pa.py_buffer(data))
    pq.write_table(table, path)
    return table.num_rows


def load(spark: Any, log: str, root: Path, max_events: int) -> list[dict[str, Any]]:
    """One load of a fresh copy of ``log`` into fresh Delta tables; its batches."""
    from replog.spark.functions import apply_changes

    url = str(root / "log")
    shutil.copytree(log, url)
    query = (
        spark.readStream.format("replog")
        .option("maxEventsPerTrigger", str(max_events))
        .load(url)
        .writeStream.foreachBatch(
            apply_changes(str(root / "delta" / "{collection}"), app_id="load", log=url)
        )
        .option("checkpointLocation", str(root / "chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return [
        {"rows": p["numInputRows"], "add_batch_ms": p["durationMs"].get("addBatch")}
        for p in query.recentProgress
    ]


def capture_once(scale: int, log: str, accounts: Path) -> int:
    """pgbench's database at ``scale`` captured into ``log``, and its accounts as one
    Parquet file (for Spark's own copy beside the load); the accounts' count."""
    with running_server() as server, server.database() as dsn:
        pgbench(dsn, "-i", "-s", str(scale), "-q")
        sql(dsn, "CREATE TABLE markers (id bigint PRIMARY KEY, at timestamptz)",
            "ALTER TABLE pgbench_history ADD COLUMN hid bigint GENERATED ALWAYS AS "
            "IDENTITY", "ALTER TABLE pgbench_history ADD PRIMARY KEY (hid)")  # fmt: skip
        snapshot = capture(dsn, log, follow=False)
        _, errors = snapshot.communicate(timeout=7200)
        assert snapshot.returncode == 0, errors.decode()[-2000:]
        return accounts_parquet(dsn, accounts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=30)
    parser.add_argument("--times", type=int, default=2)
    parser.add_argument("--max-events", type=int, default=1_000_000)
    parser.add_argument("--log", help="a log captured before (--keep): load it, capture none")
    parser.add_argument("--keep", help="keep a copy of the captured log in this folder")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-load-"))
    log = args.log or str(root / "log")
    rows = args.scale * 100_000 + args.scale * 11
    result: dict[str, Any] = {"scale": args.scale, "rows": rows, "loads": []}
    accounts = root / "accounts.parquet"
    try:
        if not args.log:
            result["accounts"] = capture_once(args.scale, log, accounts)
            if args.keep:
                shutil.copytree(log, args.keep)
        spark = None

        def start() -> None:
            nonlocal spark
            spark = spark_session()

        result["session"] = timed(start)
        for run in range(args.times):
            batches: list[dict[str, Any]] = []
            timeline = Timeline() if run == 0 else None
            figures: dict[str, Any] = timed(
                lambda run=run, batches=batches: batches.extend(
                    load(spark, log, root / f"load{run}", args.max_events)
                )
            )
            figures["rows_per_s"] = round(rows / figures["s"])
            figures["batches"] = batches
            if timeline is not None:
                figures["timeline"] = timeline.end()
            result["loads"].append(figures)
            print("LOAD", run, json.dumps(figures), flush=True)
        for run in range(args.times if accounts.exists() else 0):
            out = str(root / f"parquet{run}")
            figures = timed(lambda out=out: spark.read.parquet(str(accounts)).write.parquet(out))
            figures["rows_per_s"] = round(result["accounts"] / figures["s"])
            result.setdefault("spark_parquet", []).append(figures)
        spark.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
